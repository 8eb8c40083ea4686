"""ContextStage: load the session, commit the user message, build the prompt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ember.core.events import InboundEvent
from ember.core.messages import Message
from ember.core.turn import PipelineContext, StreamSink
from ember.memory.service import MemoryService
from ember.store.sessions import SessionStore

StreamFactory = Callable[[str], StreamSink]


@dataclass(frozen=True, slots=True)
class Persona:
    agent_name: str
    system_prompt: str
    intro_template: str = ""


def merge_intro(intro: str, text: str) -> str:
    """The system's introduction goes first, separated by a blank line."""
    return f"{intro}\n\n{text}" if intro else text


class ContextStage:
    def __init__(self, sessions: SessionStore, memory: MemoryService, persona: Persona) -> None:
        self._sessions = sessions
        self._memory = memory
        self._persona = persona

    async def prepare(self, event: InboundEvent, turn_id: str,
                      open_stream: StreamFactory | None = None) -> PipelineContext:
        """The user message is committed here, before any inference (I1)."""
        session = await self._sessions.load(event.session_key)
        is_new = session.next_seq == 0
        await self._sessions.append(session, [Message.user(event.text, turn_id=turn_id)])
        intro = self._intro(event) if is_new else ""
        prompt = [Message.system(await self._system_text(event.session_key))]
        prompt += [message.without_reasoning() for message in session.messages]
        return PipelineContext(
            event=event,
            turn_id=turn_id,
            session=session,
            prompt=prompt,
            intro_text=intro,
            stream=open_stream(merge_intro(intro, "")) if open_stream is not None else None,
        )

    def _intro(self, event: InboundEvent) -> str:
        if not self._persona.intro_template:
            return ""
        return self._persona.intro_template.format(agent_name=self._persona.agent_name, channel=event.channel)

    async def _system_text(self, session_key: str) -> str:
        parts = [self._persona.system_prompt.format(agent_name=self._persona.agent_name)]
        snapshot = await self._memory.snapshot(session_key)
        if snapshot:
            parts.append(snapshot)
        return "\n\n".join(parts)
