"""The `call_agent` tool: hand a message to another agent over A2A (`[a2a_agents.NAME]`) and
return its answer. Network risk; the address rules of `web_fetch` apply to the agent's URL
unless its host is allowed there. The answer's progress is recorded in the turn's trace."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from ember.core.journal import ToolProgress
from ember.core.tools import Risk, ToolRun
from ember.tools.base import Tool, ToolFailure, TurnTool

if TYPE_CHECKING:
    from a2a.types import StreamResponse

MAX_ANSWER_CHARS = 20_000


class A2AAgentSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="the agent's base URL; its card is at /.well-known/agent-card.json")
    # Its bearer key, or...
    api_key: SecretStr | None = None
    api_key_env: str | None = Field(default=None, description="the environment variable holding the key")
    # What it is good for, as the model reads it in the tool's description.
    description: str = ""
    # The longest one call may take.
    timeout_s: float = Field(default=300.0, gt=0)

    @field_validator("url")
    @classmethod
    def _http(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"{value!r} is not an http(s) URL")
        return value.rstrip("/")

    def key(self) -> str | None:
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        return os.environ.get(self.api_key_env) if self.api_key_env else None


class CallAgentArgs(BaseModel):
    agent: str = Field(description="The agent's name, as configured.")
    message: str = Field(description="What to ask it, complete in itself: it knows nothing of this conversation.",
                         min_length=1)


class _Reply:
    """What an agent says over a streamed call: its answer so far, its task's state, its last words
    of status. (The SDK is imported when agents are configured, never for reading the settings.)"""

    def __init__(self) -> None:
        from a2a.types import TaskState

        self.chunks: list[str] = []
        self.state, self.said = TaskState.TASK_STATE_UNSPECIFIED, ""

    def take(self, event: StreamResponse, name: str, run: ToolRun) -> None:
        from a2a.types import TaskState

        kind = event.WhichOneof("payload")
        if kind == "artifact_update":
            piece = "".join(part.text for part in event.artifact_update.artifact.parts)
            self.chunks = [*self.chunks, piece] if event.artifact_update.append else [piece]
            run.observer.event(ToolProgress("call_agent", f"{name}: {sum(map(len, self.chunks))} characters"))
        elif kind == "status_update":
            self.state = event.status_update.status.state
            self.said = "".join(part.text for part in event.status_update.status.message.parts) or self.said
            run.observer.event(ToolProgress("call_agent", f"{name}: {TaskState.Name(self.state)}"))
        elif kind == "task":
            self.state = event.task.status.state
            if event.task.artifacts:
                self.chunks = ["".join(p.text for a in event.task.artifacts for p in a.parts)]
        elif kind == "message":
            self.chunks = ["".join(p.text for p in event.message.parts)]
            self.state = TaskState.TASK_STATE_COMPLETED

    def result(self, name: str) -> str:
        from a2a.types import TaskState

        answer, state, said = "".join(self.chunks)[:MAX_ANSWER_CHARS], self.state, self.said
        if state == TaskState.TASK_STATE_INPUT_REQUIRED:
            return f"{name} needs more from you before it can go on: {said or answer}"
        if state in (TaskState.TASK_STATE_FAILED, TaskState.TASK_STATE_REJECTED, TaskState.TASK_STATE_CANCELED):
            raise ToolFailure(f"{name} did not finish ({TaskState.Name(state)}): {said or answer or 'no reason given'}")
        return f"{name} answered: {answer}" if answer else f"{name} finished without an answer"


def a2a_tools(agents: Mapping[str, A2AAgentSpec], *, allow_private: bool = False,
              allowed_hosts: frozenset[str] = frozenset()) -> list[Tool]:
    if not agents:
        return []
    import httpx  # with the SDK: only when agents are configured, never for reading the settings
    from a2a.client import A2AClientError, ClientConfig, create_client
    from a2a.types import Message, Part, Role, SendMessageRequest

    from ember.tools.web import AddressRefused, checked_target

    async def call(spec: A2AAgentSpec, name: str, text: str, run: ToolRun) -> str:
        headers = {"Authorization": f"Bearer {key}"} if (key := spec.key()) else {}
        async with httpx.AsyncClient(headers=headers, timeout=spec.timeout_s, trust_env=False) as http:
            client = await create_client(spec.url, ClientConfig(streaming=True, httpx_client=http))
            request = SendMessageRequest(message=Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex,
                                                         parts=[Part(text=text)]))
            reply = _Reply()
            try:
                async for event in client.send_message(request):
                    reply.take(event, name, run)
            finally:
                await client.close()
        return reply.result(name)

    async def call_agent(args: CallAgentArgs, run: ToolRun) -> str:
        spec = agents.get(args.agent)
        if spec is None:
            raise ToolFailure(f"there is no agent {args.agent!r}; configured: {', '.join(agents)}")
        try:
            await checked_target(spec.url, allow_private=allow_private, allowed_hosts=allowed_hosts)
            async with asyncio.timeout(spec.timeout_s):
                return await call(spec, args.agent, args.message, run)
        except AddressRefused as exc:
            raise ToolFailure(str(exc)) from None
        except TimeoutError:
            raise ToolFailure(f"{args.agent} did not answer within {spec.timeout_s:g} s") from None
        except (A2AClientError, httpx.HTTPError) as exc:
            raise ToolFailure(f"calling {args.agent} failed: {exc}") from None

    known = "; ".join(f"{name}: {spec.description}" if spec.description else name for name, spec in agents.items())
    return [TurnTool("call_agent", f"Hand a task to another agent and get its answer. Agents: {known}.",
                     CallAgentArgs, call_agent, risk=Risk.NETWORK, subject=lambda a: f"{a.agent}: {a.message}",
                     verb="ask the agent")]
