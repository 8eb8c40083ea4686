from __future__ import annotations

from typing import Protocol

from ember.core.events import InboundEvent, OutboundEvent


class Bus(Protocol):
    """Carries accepted messages to the agent loop and what it sends back to the channels.
    At least once: the inbox and the outbox, not the bus, make each message one turn and
    each answer one delivery."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def publish_inbound(self, event: InboundEvent) -> None: ...

    async def next_inbound(self) -> InboundEvent: ...

    async def ack_inbound(self, event: InboundEvent) -> None:
        """`event` (as next_inbound gave it) was handled: its turn's outcome is committed. One
        never acknowledged is delivered again, to this process or another."""
        ...

    async def earlier_in_session(self, event: InboundEvent) -> bool:
        """Whether another message of `event`'s session sent before it (as next_inbound gave it) is
        not handled yet, maybe by another process: `event` waits for it, so that a session's
        messages are answered in the order they were sent."""
        ...

    async def release_inbound(self, event: InboundEvent) -> None:
        """This process gives `event` up unfinished, unacknowledged: another process took its
        session over and acknowledges it, or, should that one die too, it is delivered again."""
        ...

    async def publish_outbound(self, event: OutboundEvent) -> None: ...

    async def next_outbound(self, channel: str) -> OutboundEvent: ...

    async def publish_stop(self, session_key: str) -> bool:
        """Ask whichever process runs `session_key`'s turn to stop it; False when this bus reaches
        no other process (the turn, if any, runs in this one)."""
        ...

    async def next_stop(self) -> str:
        """The next session whose turn some process asked to stop: every process hears every one."""
        ...
