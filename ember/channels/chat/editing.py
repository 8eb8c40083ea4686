"""Streaming by edits, for every chat platform that can edit a message it sent.

The first text of an answer is sent as a draft; later text edits it, at most
once per `interval_s` in a chat (the platform's flood limit), and a 429's
`retry_after` pushes the next write back. Text over the platform's limit goes
on in follow-up messages, which are parts of the same answer. The final answer
*replaces* the draft: each part is edited to its final text, and only parts the
draft never had are sent. Each part's message id is stored as it is sent, so a
final re-sent after a crash, or a resumed turn streaming again, edits the same
messages: one visible copy per answer, whatever happened in between. An answer's files follow
its text, each a part of its own, sent once; a platform that cannot send files is told their names.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol, runtime_checkable

from ember.channels.attachments import FileShelf, files_named
from ember.channels.chat.split import split_message
from ember.core.attachments import AttachmentContent
from ember.core.events import OutboundEvent
from ember.store.protocols import ChannelMessages

log = logging.getLogger(__name__)

MAX_RETRY_AFTER_S = 300.0
# An answer's files are its parts from this one on: its text never has as many.
FILE_PARTS = 1_000


class RateLimited(Exception):
    """The platform said to wait (a 429 with retry_after) before writing in this chat again."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"rate limited for {retry_after_s:g} s")
        self.retry_after_s = min(max(retry_after_s, 0.0), MAX_RETRY_AFTER_S)


class MessageGone(Exception):
    """The message to edit no longer exists (the person deleted it): the part is sent anew."""


class EditablePlatform(Protocol):
    """One platform's send and edit, of Markdown text (the platform renders or falls back to plain)."""

    async def send(self, chat_id: str, text: str, *, reply_to: str | None = None) -> str:
        """The new message's id."""
        ...

    async def edit(self, chat_id: str, message_id: str, text: str) -> None:
        """An edit to the same text is not an error."""
        ...

    async def delete(self, chat_id: str, message_id: str) -> None:
        """A message that is gone already is not an error."""
        ...


@runtime_checkable
class SendsFiles(Protocol):
    async def send_file(self, chat_id: str, file: AttachmentContent, *, reply_to: str | None = None) -> str:
        """The new message's id: a picture shown as one, a voice note played as one, else a document."""
        ...


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(slots=True)
class _Chat:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    next_write_at: float = 0.0  # monotonic: the flood limit and any retry_after


@dataclass(slots=True)
class _Answer:
    chat_id: str
    reply_to: str | None
    text: str = ""
    parts: dict[int, str] | None = None  # part -> message id, once loaded from the store
    shown: dict[int, str] = field(default_factory=dict)  # part -> digest of the text it shows
    flush: asyncio.Task[None] | None = None
    # Set when the final takes over: the draft stops after its write in flight. A write is never
    # cancelled halfway, since a message sent whose id was not kept would be a second copy.
    closing: bool = False


class EditStream:
    def __init__(self, platform: EditablePlatform, messages: ChannelMessages, channel: str, *,
                 interval_s: float, limit: int, files: FileShelf | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._platform = platform
        # Where an answer's files are read from, on a platform that can send them.
        self._files = files if isinstance(platform, SendsFiles) else None
        self._messages = messages
        self._channel = channel
        self._interval_s = interval_s
        self._limit = limit
        self._clock = clock
        self._chats: dict[str, _Chat] = {}
        self._answers: dict[str, _Answer] = {}  # by turn id

    def started(self, chat_id: str) -> bool:
        """Whether an answer is being drafted in the chat (the typing indicator can stop)."""
        return any(answer.chat_id == chat_id for answer in self._answers.values())

    async def delta(self, event: OutboundEvent) -> None:
        """More of a turn's answer: the draft catches up at the chat's next free moment."""
        answer = self._answers.setdefault(event.turn_id, _Answer(event.chat_id, event.reply_to))
        answer.text += event.text
        if answer.flush is None or answer.flush.done():
            answer.flush = asyncio.create_task(self._write_draft(event.turn_id, answer),
                                               name=f"ember-{self._channel}-draft")

    def tool_step(self, event: OutboundEvent) -> None:
        """The model called a tool: what it streams next is a new text for the same draft."""
        answer = self._answers.get(event.turn_id)
        if answer is not None:
            answer.text = ""

    async def final(self, event: OutboundEvent) -> None:
        """The committed answer, in place of the draft; returns once every part shows it."""
        answer = self._answers.pop(event.turn_id, None) or _Answer(event.chat_id, event.reply_to)
        answer.closing = True
        if answer.flush is not None:
            await asyncio.gather(answer.flush, return_exceptions=True)
        if event.delivery_id is not None and await self._messages.finished(self._channel, event.turn_id) \
                == event.delivery_id:
            return  # shown already (a re-send after a restart, a replayed message)
        pieces = split_message(files_named(event.text, event.attachments) if self._files is None else event.text,
                               self._limit)
        await self._write(event.turn_id, answer, pieces)
        assert answer.parts is not None
        # A draft longer than the answer:
        extra = [part for part in answer.parts if len(pieces) <= part < FILE_PARTS]
        for part in extra:
            await self._platform.delete(answer.chat_id, answer.parts.pop(part))
        if extra:
            await self._messages.drop(self._channel, event.turn_id, extra)
        shown = {part: digest(text) for part, text in enumerate(pieces)}
        if event.attachments and self._files is not None and event.session_key is not None:
            shown |= await self._send_files(event.turn_id, answer,
                                            await self._files.read(event.session_key, event.attachments))
        await self._messages.finish(self._channel, event.turn_id, event.delivery_id, shown)

    async def close(self, grace_s: float = 5.0) -> None:
        """Let the drafts' writes in flight end (briefly); the finals they wait for are owed and re-sent."""
        flushes = [a.flush for a in self._answers.values() if a.flush is not None and not a.flush.done()]
        for answer in self._answers.values():
            answer.closing = True
        if flushes:
            _, late = await asyncio.wait(flushes, timeout=grace_s)
            for task in late:
                task.cancel()
        self._answers = {}

    async def _write_draft(self, turn_id: str, answer: _Answer) -> None:
        try:
            while not answer.closing:
                pieces = split_message(answer.text, self._limit)
                if all(answer.shown.get(part) == digest(text) for part, text in enumerate(pieces)):
                    return  # the draft shows everything streamed so far
                await self._write(turn_id, answer, pieces, draft=True)
        except Exception:  # a draft is best effort: the final replaces it, and is retried until shown
            log.warning("%s could not update the draft of turn %s", self._channel, turn_id, exc_info=True)

    async def _write(self, turn_id: str, answer: _Answer, pieces: list[str], *, draft: bool = False) -> None:
        """Bring every part to `pieces`, each write at the chat's pace; RateLimited waits and tries again.
        A draft's writes stop as soon as the final takes over."""
        if answer.parts is None:
            answer.parts = await self._messages.parts(self._channel, turn_id)
            answer.shown = await self._messages.digests(self._channel, turn_id)
        for part, text in enumerate(pieces):
            if not text.strip() or answer.shown.get(part) == digest(text):
                continue
            if not await self._paced(answer, partial(self._write_part, turn_id, answer, part, text), draft=draft):
                return
            answer.shown[part] = digest(text)

    async def _send_files(self, turn_id: str, answer: _Answer, files: list[AttachmentContent]) -> dict[int, str]:
        """Each file its own message after the text, once: a part recorded as sent (a file is never
        edited) is not sent again."""
        assert answer.parts is not None and isinstance(self._platform, SendsFiles)
        for part, file in enumerate(files, start=FILE_PARTS):
            if part not in answer.parts:
                await self._paced(answer, partial(self._send_file, self._platform, turn_id, answer, part, file))
        return {part: file.digest[:16] for part, file in enumerate(files, start=FILE_PARTS)}

    async def _send_file(self, platform: SendsFiles, turn_id: str, answer: _Answer, part: int,
                         file: AttachmentContent) -> None:
        assert answer.parts is not None
        answer.parts[part] = await platform.send_file(answer.chat_id, file, reply_to=answer.reply_to)
        await self._messages.record(self._channel, answer.chat_id, turn_id, part, answer.parts[part])

    async def _paced(self, answer: _Answer, write: Callable[[], Awaitable[None]], *, draft: bool = False) -> bool:
        """`write` at the chat's pace; RateLimited waits and tries again. False: a draft's write that
        did not happen, as the final took over."""
        chat = self._chats.setdefault(answer.chat_id, _Chat())
        while True:
            async with chat.lock:
                wait = chat.next_write_at - self._clock()
                if wait > 0:
                    await asyncio.sleep(wait)
                if draft and answer.closing:
                    return False
                try:
                    await write()
                except RateLimited as limited:
                    chat.next_write_at = self._clock() + limited.retry_after_s
                    log.info("%s chat %s: %s", self._channel, answer.chat_id, limited)
                    continue
                finally:
                    chat.next_write_at = max(chat.next_write_at, self._clock() + self._interval_s)
            return True

    async def _write_part(self, turn_id: str, answer: _Answer, part: int, text: str) -> None:
        assert answer.parts is not None
        message_id = answer.parts.get(part)
        if message_id is not None:
            try:
                await self._platform.edit(answer.chat_id, message_id, text)
                return
            except MessageGone:
                log.info("%s: message %s of turn %s is gone; sending the part again", self._channel, message_id,
                         turn_id)
        message_id = await self._platform.send(answer.chat_id, text, reply_to=answer.reply_to if part == 0 else None)
        answer.parts[part] = message_id
        await self._messages.record(self._channel, answer.chat_id, turn_id, part, message_id)
