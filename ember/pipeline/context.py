"""ContextStage: load the session, commit the user message, build the prompt."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ember.core.delivery import Receipt
from ember.core.events import InboundEvent
from ember.core.messages import Message, Role, Session
from ember.core.turn import PipelineContext, StreamSink
from ember.memory.service import MemoryService
from ember.store.sessions import SessionStore

StreamFactory = Callable[[str], StreamSink]

# A tool result is stored whole; the model is shown its first characters only.
MODEL_RESULT_CHARS = 16_000


@dataclass(frozen=True, slots=True)
class Persona:
    agent_name: str
    system_prompt: str
    intro_template: str = ""


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
    return [m if m.reasoning is None and m.role is not Role.TOOL else shown_to_model(m.without_reasoning())
            for m in messages]


class ContextStage:
    def __init__(self, sessions: SessionStore, memory: MemoryService, persona: Persona) -> None:
        self._sessions = sessions
        self._memory = memory
        self._persona = persona

    async def prepare(self, event: InboundEvent, turn_id: str, open_stream: StreamFactory | None = None, *,
                      resume: bool = False) -> PipelineContext:
        """The user message is committed here, with its receipt, before any inference (I1).

        `resume` picks up a turn whose message was committed before: nothing new is written.
        """
        session = await self._sessions.load(event.session_key)
        # New until it has an answer: a first turn that failed still gets the intro next time.
        is_new = session.last_consolidated == 0 and not any(m.role is Role.ASSISTANT for m in session.messages)
        if session.next_seq == 0:
            session.metadata = {"channel": event.channel, "chat_id": event.chat_id, "sender_id": event.sender_id}
        if not resume:
            assert event.message_id is not None
            receipt = Receipt(channel=event.channel, message_id=event.message_id, chat_id=event.chat_id,
                              sender_id=event.sender_id, turn_id=turn_id)
            await self._sessions.append(session, [Message.user(event.text, turn_id=turn_id)], receipt=receipt)
        intro = self._intro(event) if is_new else ""
        prompt = [Message.system(await self._system_text(session))]
        prompt += history_for_model(session.messages)
        return PipelineContext(
            event=event,
            turn_id=turn_id,
            session=session,
            prompt=prompt,
            intro_text=intro,
            stream=open_stream(merge_intro(intro, "")) if open_stream is not None else None,
        )

    def _intro(self, event: InboundEvent) -> str:
        return fill(self._persona.intro_template, agent_name=self._persona.agent_name, channel=event.channel)

    async def _system_text(self, session: Session) -> str:
        parts = [fill(self._persona.system_prompt, agent_name=self._persona.agent_name)]
        snapshot = await self._memory.snapshot(session)
        if snapshot:
            parts.append(snapshot)
        return "\n\n".join(parts)
