"""ContextStage: load the session, commit the user message, build the prompt."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ember.core.attachments import with_content
from ember.core.delivery import Receipt
from ember.core.events import InboundEvent
from ember.core.language import language_of
from ember.core.memory import PROFILE_HEADING, MemoryKind, MemoryRecord
from ember.core.memory import memory_identity as scoped
from ember.core.messages import Message, Role, Session
from ember.core.turn import NO_STREAM, PipelineContext, StreamSink
from ember.memory.identity import Identities
from ember.memory.prompt import PromptMemory, RecallBudget, recalled_text
from ember.memory.protocols import PromptRecall
from ember.pipeline.agent_spec import AgentSpec
from ember.pipeline.agents import agent_of
from ember.skills.library import SkillLibrary
from ember.store.protocols import SessionStore

StreamFactory = Callable[[str], StreamSink]

# A tool result is stored whole; the model is shown its first characters only.
MODEL_RESULT_CHARS = 16_000


@dataclass(frozen=True, slots=True)
class Persona:
    agent_name: str
    system_prompt: str
    intro_template: str = ""
    # By "channel:language", "channel" or "language" (the first message's), the most specific first.
    intro_templates: Mapping[str, str] = field(default_factory=dict)
    # The named agents, each presenting itself its own way, and the channels and chats bound to one.
    agents: Mapping[str, AgentSpec] = field(default_factory=dict)
    bindings: Mapping[str, str] = field(default_factory=dict)

    def intro_for(self, channel: str, language: str) -> str:
        templates = self.intro_templates
        for key in (f"{channel}:{language}", channel, language):
            if key in templates:
                return templates[key]
        return self.intro_template


def fill(template: str, **values: str) -> str:
    """Replace {name} placeholders, leaving every other brace alone (prompts
    often contain JSON examples, which str.format would reject)."""
    for name, value in values.items():
        template = template.replace("{" + name + "}", value)
    return template


def merge_intro(intro: str, text: str) -> str:
    """The system's introduction goes first, separated by a blank line."""
    return f"{intro}\n\n{text}" if intro else text


def shown_to_model(message: Message) -> Message:
    """The message as the model sees it: long tool output cut, with a note saying so."""
    if message.role is not Role.TOOL or len(message.content) <= MODEL_RESULT_CHARS:
        return message
    note = (f"\n[output truncated: showing {MODEL_RESULT_CHARS} of {len(message.content)} characters; "
            "ask for a narrower range to see more]")
    return replace(message, content=message.content[:MODEL_RESULT_CHARS] + note)


def history_for_model(messages: Sequence[Message]) -> list[Message]:
    """The stored history as the model sees it: no stored reasoning, long tool output cut.

    It runs over the whole window on every turn, and most messages need
    neither change: those are passed on as they are, without a call.
    """
    return [m if m.reasoning is None and m.reasoning_blocks is None and m.role is not Role.TOOL
            else shown_to_model(m.without_reasoning())
            for m in messages]


EPISODES_IN_PROMPT = 5
RECALLED_HEADING = ("Memories from earlier conversations that may bear on the latest message (they may be outdated; "
                    "use them only where they help):")


def _in_window(session: Session) -> Callable[[MemoryRecord], bool]:
    """Memories the prompt carries anyway: this session's episodes and its messages since the boundary."""
    def carried(record: MemoryRecord) -> bool:
        if record.session_key != session.key:
            return False
        return record.kind is MemoryKind.EPISODIC or (
            record.kind is MemoryKind.ARCHIVAL and (record.seq_start or 0) >= session.last_consolidated)
    return carried


class ContextStage:
    """The prompt is built from sections, most stable first, so providers can
    cache its prefix: the system text, the skills index, the person's profile facts, this
    session's episodes, the history; then, just before the newest message,
    the memories it recalls (they change every turn)."""

    def __init__(self, sessions: SessionStore, memory: PromptRecall, persona: Persona, identities: Identities,
                 budget: RecallBudget, skills: SkillLibrary | None = None,
                 marks: Mapping[str, object] | None = None) -> None:
        self._sessions = sessions
        self._marks = dict(marks or {})  # set in every new session's metadata
        self._skills = skills
        self._memory = memory
        self._persona = persona
        self._identities = identities
        self._budget = budget

    async def prepare(self, event: InboundEvent, turn_id: str, open_stream: StreamFactory | None = None, *,
                      resume: bool = False) -> PipelineContext:
        """The user message is committed here, with its receipt, before any inference (I1).

        `resume` picks up a turn whose message was committed before: nothing new is written.
        """
        session = await self._sessions.load(event.session_key)
        # The conversation a client brought along begins a new session (which is then not new to the
        # person); a session that has messages already has it.
        seed = event.history if session.next_seq == 0 else ()
        # New until it has an answer: a first turn that failed still gets the intro next time.
        is_new = not seed and session.last_consolidated == 0 and not any(
            m.role is Role.ASSISTANT for m in session.messages)
        # The sender's memory, not the session's: in a group chat each member recalls only their own.
        identity = self._identities.resolve(event.channel, event.sender_id)
        agent = agent_of(event.agent, session.metadata, self._persona.bindings, event.channel, event.chat_id)
        spec = self._persona.agents.get(agent or "")
        if session.next_seq == 0:
            session.metadata = {"channel": event.channel, "chat_id": event.chat_id, "sender_id": event.sender_id,
                                "identity": identity, **self._marks}
            if event.metadata.get("evaluation") == "true":
                # An evaluation run: nothing of it may become anyone's memory.
                session.metadata["evaluation"] = True
            if spec is not None:  # the session keeps its agent, and that agent's memory scope, for good
                session.metadata |= {"agent": agent, "memory": spec.memory}
        memory_identity = scoped(identity, session.metadata)
        # The commit goes to the writer and the prompt's reads to the reader: they overlap. The
        # inference after this stage still starts only once the message is durable (I1).
        reads = self._sections(session, memory_identity, event.text, spec)
        if resume:
            memory, system = await reads
        else:
            _, (memory, system) = await _together(self._commit_question(session, event, turn_id, seed), reads)
        intro = self._intro(event) if is_new else ""
        return PipelineContext(
            event=event,
            turn_id=turn_id,
            identity=identity,
            session=session,
            prompt=await self._with_files(session.key, _assembled(system, session, memory)),
            intro_text=intro,
            stream=open_stream(merge_intro(intro, "")) if open_stream is not None else NO_STREAM,
            agent=agent if spec is not None else None,
            memory_identity=memory_identity,
        )

    async def _commit_question(self, session: Session, event: InboundEvent, turn_id: str,
                               seed: Sequence[Message]) -> None:
        """The question, after the `seed` a new session starts with, in one transaction."""
        assert event.message_id is not None
        receipt = Receipt(channel=event.channel, message_id=event.message_id, chat_id=event.chat_id,
                          sender_id=event.sender_id, turn_id=turn_id)
        message = Message.user(event.text, turn_id=turn_id, name=event.sender_name, attachments=event.attachments)
        await self._sessions.append(session, [*seed, message], receipt=receipt)

    async def _with_files(self, key: str, prompt: list[Message]) -> list[Message]:
        """The prompt with the content of the files its users' messages name (one read, only when they
        name any). An answer's files are the model's own: it is not shown them again."""
        digests = sorted({a.digest for m in prompt if m.role is Role.USER for a in m.attachments})
        if not digests:
            return prompt
        data = await self._sessions.attachments(key, digests)
        return [replace(m, attachments=tuple(with_content(a, data.get(a.digest)) for a in m.attachments))
                if m.attachments and m.role is Role.USER else m for m in prompt]

    def _intro(self, event: InboundEvent) -> str:
        language = language_of(event.text)
        return fill(self._persona.intro_for(event.channel, language), agent_name=self._persona.agent_name,
                    channel=event.channel, language=language)

    async def _sections(self, session: Session, identity: str, text: str,
                        agent: AgentSpec | None) -> tuple[PromptMemory, str]:
        """The memory the prompt carries and its system text, their reads at once."""
        skills = agent.skills if agent is not None else None
        memory, index = await _together(
            self._memory.for_prompt(identity, text, budget=self._budget, session_key=session.key,
                                    episodes=EPISODES_IN_PROMPT, exclude=_in_window(session)),
            self._skills.index(identity, skills) if self._skills is not None else _nothing())
        system = agent.system_prompt if agent is not None and agent.system_prompt else self._persona.system_prompt
        parts = [fill(system, agent_name=self._persona.agent_name)]
        if index:
            parts.append(index)
        if memory.profile:
            parts.append(PROFILE_HEADING + "\n" + "\n".join(f"- {r.content}" for r in memory.profile))
        if memory.episodes:
            parts.append("Earlier in this conversation:\n" + "\n".join(f"- {e.content}" for e in memory.episodes))
        return memory, "\n\n".join(parts)


def _assembled(system: str, session: Session, memory: PromptMemory) -> list[Message]:
    """The prompt: the system text, the history (the new message included), and the recalled
    memories just before the newest user message."""
    prompt = [Message.system(system), *history_for_model(session.messages)]
    if memory.recalled:
        recalled = Message.system(RECALLED_HEADING + "\n" + recalled_text(memory.recalled))
        last_user = max((i for i, m in enumerate(prompt) if m.role is Role.USER), default=len(prompt))
        prompt.insert(last_user, recalled)
    return prompt


async def _nothing() -> str:
    return ""


async def _together(*steps: Awaitable[Any]) -> list[Any]:
    """The steps run at once; their results in order. The first failure cancels the others (a
    commit among them still finishes: the store shields it) and is raised as it is, so the loop
    sees a LeaseLost or a StoreBusy, not a group of errors."""
    tasks = [asyncio.ensure_future(step) for step in steps]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
