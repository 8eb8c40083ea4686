"""InferenceStage: the model and tool loop of one turn.

Each model step ends in one of two decisions: a final text, or tool calls.
Tool calls run (concurrently, results kept in call order), and the assistant
message is committed together with all its results in one transaction, so
the stored history never holds a call without its results (I3).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from dataclasses import dataclass, replace

from ember.core.errors import ModelError
from ember.core.journal import ModelCalled, Routed, ToolCalled
from ember.core.messages import Message, Role, ToolCall
from ember.core.thinking import ThinkFilter
from ember.core.tools import ToolRun, ToolSpec
from ember.core.turn import InferenceResult, PipelineContext
from ember.core.usage import Budget, TurnTally, UsageScope, current_scope
from ember.models.base import ModelClient, ModelReply, TextDelta
from ember.pipeline.agents import AgentTools
from ember.pipeline.context import shown_to_model
from ember.pipeline.voice import SpokenReplies, voice_command
from ember.store.protocols import SessionStore
from ember.tools.base import Toolset


@dataclass(frozen=True, slots=True)
class InferenceLimits:
    max_iterations: int = 12
    # A turn with at least this many tool calls asks for skill and memory reviews.
    review_tool_call_threshold: int = 3


TRUNCATED_NOTE = "(The answer was cut off at the model's output limit: ask me to go on.)"


def iteration_cap_text(limit: int) -> str:
    return (
        f"I stopped after {limit} rounds of tool calls without reaching an answer. "
        "Tell me to continue, or narrow the request."
    )


# A turn is simple, and `[model_roles] simple` answers it, when its message is short, its prompt
# small and it has made no model call yet; the simple chain's reply stands only if it calls no tool.
SIMPLE_MAX_MESSAGE_CHARS = 400
SIMPLE_MAX_PROMPT_CHARS = 24_000  # about 6,000 tokens


def token_budget_text(used: int, budget: int) -> str:
    return (f"I stopped after using {used:,} tokens, over this task's budget of {budget:,}, "
            "before reaching an answer.")


def simple_turn(ctx: PipelineContext, prompt: list[Message]) -> tuple[bool, str]:
    """Whether the turn may go to the simple chain, and why (the trace keeps it)."""
    size = sum(len(message.content) for message in prompt)
    if len(ctx.event.text) > SIMPLE_MAX_MESSAGE_CHARS:
        return False, f"a message of {len(ctx.event.text)} characters (simple: at most {SIMPLE_MAX_MESSAGE_CHARS})"
    if size > SIMPLE_MAX_PROMPT_CHARS:
        return False, f"a prompt of {size} characters (simple: at most {SIMPLE_MAX_PROMPT_CHARS})"
    if any(m.turn_id == ctx.turn_id and m.role is not Role.USER for m in ctx.session.messages):
        return False, "a resumed turn that had made calls"
    return True, f"a message of {len(ctx.event.text)} characters and a prompt of {size}"


class InferenceStage:
    """`simple`: the chain of `[model_roles] simple`, tried first on a simple turn (None: off).
    `voice` answers `/voice on|off` itself (pipeline/voice.py)."""

    def __init__(self, model: ModelClient, tools: Toolset, sessions: SessionStore, limits: InferenceLimits,
                 budget: Budget | None = None, simple: ModelClient | None = None,
                 voice: SpokenReplies | None = None) -> None:
        self._model = model
        self._tools = tools
        self._sessions = sessions
        self._limits = limits
        self._budget = budget
        self._simple = simple
        self._voice = voice

    def narrowed(self, names: Collection[str], why: str) -> InferenceStage:
        """The same stage, offering only the tools in `names` (`why`: whom for, as a refusal names them)."""
        return InferenceStage(self._model, AgentTools(self._tools, sorted(names), why), self._sessions,
                              self._limits, self._budget, self._simple, self._voice)

    async def run(self, ctx: PipelineContext, tools: ToolRun, *, token_budget: int | None = None) -> InferenceResult:
        """`tools` carries the turn's approver and observer to the tool calls, and tallies its use;
        past `token_budget` tokens (its delegated turns' included), no further step is taken."""
        if self._voice is not None and (on := voice_command(ctx.event.text)) is not None:
            return InferenceResult(response_text=self._voice.switch(ctx.session, on))
        if self._budget is not None and (refusal := await self._budget.refusal(ctx.identity, ctx.agent)):
            return InferenceResult(response_text=refusal)
        scope = current_scope.set(UsageScope(session_key=tools.conversation, identity=ctx.identity,
                                             turn_id=ctx.turn_id, agent=ctx.agent))
        specs = self._tools.specs()  # once a turn: every step offers the same
        tools = replace(tools, offered=frozenset(spec.name for spec in specs))
        try:
            return await self._loop(ctx, tools, specs, token_budget)
        finally:
            current_scope.reset(scope)

    async def _loop(self, ctx: PipelineContext, tools: ToolRun, specs: list[ToolSpec],
                    token_budget: int | None) -> InferenceResult:
        messages = list(ctx.prompt)
        # A resumed turn counts the calls it made before the crash too: they ask for the reviews alike;
        # and its answer sends the files they sent.
        earlier = [m for m in ctx.session.messages if m.turn_id == ctx.turn_id]
        tool_names = [call.name for m in earlier for call in m.tool_calls]
        tools.files.extend(file for m in earlier if m.role is Role.TOOL for file in m.attachments)
        usage = tools.spent
        model, trying_simple = self._model, False
        if self._simple is not None:
            trying_simple, why = simple_turn(ctx, messages)
            model = self._simple if trying_simple else model
            tools.observer.event(Routed("simple" if trying_simple else "main", why))
        for _ in range(self._limits.max_iterations):
            started = time.perf_counter()
            # The simple chain's answer is held back until it is known to call no tool.
            reply = await self._model_step(ctx, messages, specs, model, live=not trying_simple)
            tools.observer.event(ModelCalled(reply.model or model.name, started, reply.input_tokens,
                                             reply.output_tokens, len(reply.tool_calls), reply.passed_over))
            usage.add(TurnTally(1, reply.input_tokens, reply.output_tokens,
                                reply.cache_read_tokens + reply.cache_write_tokens))
            if trying_simple:
                model, trying_simple = self._model, False
                if reply.tool_calls:
                    tools.observer.event(Routed("main", "the simple chain asked for a tool"))
                    continue
                await self._show(ctx, reply.text)
            if not reply.tool_calls:
                text = f"{reply.text}\n\n{TRUNCATED_NOTE}" if reply.truncated else reply.text
                return self._result(text, tool_names, tools)
            assistant = Message.assistant(reply.text, tool_calls=reply.tool_calls, reasoning=reply.reasoning,
                                          reasoning_blocks=reply.reasoning_blocks, turn_id=ctx.turn_id)
            step = [assistant, *await self._run_tools(ctx, tools, reply.tool_calls)]
            await self._sessions.append(ctx.session, step)
            # The stored copies: the store strips reasoning tags from assistant text (I4).
            messages += [shown_to_model(m) for m in ctx.session.messages[-len(step):]]
            tool_names += [call.name for call in reply.tool_calls]
            if token_budget is not None and usage.tokens > token_budget:
                return self._result(token_budget_text(usage.tokens, token_budget), tool_names, tools)
        return self._result(iteration_cap_text(self._limits.max_iterations), tool_names, tools)

    async def _model_step(self, ctx: PipelineContext, messages: list[Message], specs: list[ToolSpec],
                          model: ModelClient, *, live: bool = True) -> ModelReply:
        visible = ThinkFilter()
        async for event in model.stream(messages, specs, sampling=ctx.event.sampling):
            if isinstance(event, ModelReply):
                if live:
                    await ctx.stream.delta(visible.flush())
                return event
            if live and isinstance(event, TextDelta):
                await ctx.stream.delta(visible.feed(event.text))
        raise ModelError(f"model {model.name} ended its stream without a reply")

    @staticmethod
    async def _show(ctx: PipelineContext, text: str) -> None:
        """A reply held back, streamed whole: what a live step would have shown of it."""
        visible = ThinkFilter()
        await ctx.stream.delta(visible.feed(text))
        await ctx.stream.delta(visible.flush())

    async def _run_tools(self, ctx: PipelineContext, tools: ToolRun, calls: tuple[ToolCall, ...]) -> list[Message]:
        for call in calls:
            await ctx.stream.tool_call(call)
        before = len(tools.files)
        outputs = await asyncio.gather(*(self._call(call, tools) for call in calls))
        for call, output in zip(calls, outputs):
            await ctx.stream.tool_result(call, output)
        # The files these calls had the answer send are kept with the first result: a resumed turn's
        # answer sends them too.
        sent = [tuple(tools.files[before:])] + [()] * (len(calls) - 1)
        return [Message.tool_result(call.id, output, turn_id=ctx.turn_id, attachments=files)
                for call, output, files in zip(calls, outputs, sent)]

    async def _call(self, call: ToolCall, tools: ToolRun) -> str:
        started = time.perf_counter()
        output = await self._tools.call(call, tools)
        tools.observer.event(ToolCalled(call.id, call.name, call.arguments, started, output))
        return output

    def _result(self, text: str, tool_names: list[str], tools: ToolRun) -> InferenceResult:
        review, usage = len(tool_names) >= self._limits.review_tool_call_threshold, tools.spent
        return InferenceResult(
            response_text=text,
            total_tool_calls=len(tool_names),
            tool_names=tuple(tool_names),
            should_review_skills=review,
            should_review_memory=review,
            model_calls=usage.model_calls,
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            cached_tokens=usage.cached_tokens,
            files=tuple(tools.files),
        )
