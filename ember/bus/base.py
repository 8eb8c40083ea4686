from __future__ import annotations

from typing import Protocol

from ember.core.events import InboundEvent, OutboundEvent


class InboundPublisher(Protocol):
    """What an entrance needs of the bus: a place to put the messages it accepted."""

    async def publish_inbound(self, event: InboundEvent) -> None: ...


class InboundQueue(InboundPublisher, Protocol):
    """The accepted messages, as the agent loop takes them. At least once: the inbox and the outbox,
    not the bus, make each message one turn and each answer one delivery."""

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


class OutboundPublisher(Protocol):
    """What the turn's parts need of the bus: a way to what they send back to a channel."""

    async def publish_outbound(self, event: OutboundEvent) -> None: ...


class OutboundRouter(OutboundPublisher, Protocol):
    """What is sent back, handed to each channel in order."""

    async def next_outbound(self, channel: str) -> OutboundEvent: ...


class StopSignal(Protocol):
    """A person's Stop, heard by whichever process runs the turn."""

    async def publish_stop(self, session_key: str) -> bool:
        """Ask whichever process runs `session_key`'s turn to stop it; False when this bus reaches
        no other process (the turn, if any, runs in this one)."""
        ...

    async def next_stop(self) -> str:
        """The next session whose turn some process asked to stop: every process hears every one."""
        ...


class Bus(InboundQueue, OutboundRouter, StopSignal, Protocol):
    """Carries accepted messages to the agent loop, what it sends back to the channels, and stops:
    in-process queues (bus/memory.py), or Redis Streams shared by several processes (bus/redis.py)."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...
