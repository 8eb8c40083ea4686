"""Sessions as append-only message rows (one row per message, numbered by seq).

A turn's commit inserts only its new rows and bumps the session's `next_seq`
by compare-and-set, so it costs the same at message 10 and at message 100,000.
Loading returns the window since the consolidation boundary, made
protocol-valid (I3) by a repair that is written back once, not redone per load.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from sqlalchemy import Row, func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from ember.core.delivery import Delivery, Receipt
from ember.core.errors import StoreConflict
from ember.core.messages import Message, Role, Session, decode_tool_calls, encode_tool_calls
from ember.core.thinking import strip_thinking
from ember.store import schema
from ember.store.database import Database, complete_despite_cancel
from ember.store.deliveries import record_delivery, record_receipt
from ember.store.repair import RepairPlan, plan_repair

INTERRUPTED_RESULT = "[interrupted: this tool call's result was lost when the turn was cut off; it did not complete]"
REPAIR_ATTEMPTS = 3

StoredRow = Row[Any]


@dataclass(frozen=True, slots=True)
class SessionSummary:
    key: str
    message_count: int
    last_consolidated: int
    updated_at: float


@dataclass(frozen=True, slots=True)
class UnreadableRow:
    session_key: str
    seq: int
    reason: str
    raw: str


class SessionStore(Protocol):
    """What the pipeline and the memory workers need of session storage."""

    async def load(self, key: str) -> Session: ...

    async def append(self, session: Session, messages: Sequence[Message], *, receipt: Receipt | None = None,
                     delivery: Delivery | None = None) -> None: ...

    async def advance_boundary(self, key: str, *, expected: int, new: int, summary: str) -> bool: ...


_ROLES = {role.value: role for role in Role}


def _row_to_message(row: StoredRow) -> Message:
    """Parse one stored row; ValueError when it cannot be trusted (it is then quarantined).

    Called for every message of the window on every turn, so it unpacks the
    row by position rather than looking fields up by name.
    """
    _key, seq, role_name, content, raw_calls, tool_call_id, reasoning, turn_id, _created = row
    role = _ROLES.get(role_name)
    if role is None:
        raise ValueError(f"unknown role {role_name!r}")
    calls = decode_tool_calls(raw_calls)
    if calls and role is not Role.ASSISTANT:
        raise ValueError(f"a {role.value} message cannot carry tool_calls")
    if role is Role.TOOL and not tool_call_id:
        raise ValueError("a tool message without tool_call_id")
    if not isinstance(content, str):
        raise ValueError("content is not text")
    return Message(role=role, content=content, tool_calls=calls, tool_call_id=tool_call_id,
                   reasoning=reasoning, turn_id=turn_id, seq=seq)


def _parse(row: StoredRow) -> Message | str:
    """The message, or why the row cannot be read."""
    try:
        return _row_to_message(row)
    except (ValueError, KeyError, TypeError) as exc:
        return f"unreadable row: {exc}"


def _stored(message: Message, seq: int) -> Message:
    content = message.content
    if message.role is Role.ASSISTANT:
        # Storage boundary of I4: no reasoning text inside content, whoever wrote it.
        content = strip_thinking(content)
    return replace(message, content=content, seq=seq)


def _message_row(key: str, message: Message, now: float) -> dict[str, Any]:
    return {
        "session_key": key,
        "seq": message.seq,
        "role": message.role.value,
        "content": message.content,
        "tool_calls": encode_tool_calls(message.tool_calls),
        "tool_call_id": message.tool_call_id,
        "reasoning": message.reasoning,
        "turn_id": message.turn_id,
        "created_at": now,
    }


def _raw(item: Message | StoredRow) -> str:
    if isinstance(item, Message):
        return json.dumps({**item.to_json_dict(), "reasoning": item.reasoning, "turn_id": item.turn_id})
    return json.dumps(dict(item._mapping), default=str)


class SqlSessionStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def load(self, key: str) -> Session:
        """The session's window since its consolidation boundary, protocol-valid.

        A needed repair is written under a compare-and-set on the session head;
        if another writer got there first, the window is read and planned again.
        """
        for _ in range(REPAIR_ATTEMPTS):
            session, rows = await self._read_window(key)
            parsed = [(row, _parse(row)) for row in rows]
            messages = [item for _, item in parsed if isinstance(item, Message)]
            broken = [(row, item) for row, item in parsed if isinstance(item, str)]
            repair = plan_repair(messages, INTERRUPTED_RESULT)
            if not broken and not repair.needed:
                session.messages = messages
                return session
            try:
                _, cancelled = await complete_despite_cancel(self._write_repair(session, broken, repair))
            except (StoreConflict, IntegrityError):
                continue
            if cancelled:
                raise asyncio.CancelledError
        raise StoreConflict(f"session {key!r} kept changing while it was being repaired")

    async def append(self, session: Session, messages: Sequence[Message], *, receipt: Receipt | None = None,
                     delivery: Delivery | None = None) -> None:
        """Commit `messages` at the end of the session in one transaction, with
        the inbound `receipt` they answer to and the outbound `delivery` they owe.

        On success the stored copies (with their seq) are added to
        `session.messages`. Once started, the write finishes even if the turn
        is cancelled, and the cancellation is raised after it is recorded.
        DuplicateMessage (and nothing written) when the receipt's message was
        already accepted.
        """
        if not messages:
            return
        stored, cancelled = await complete_despite_cancel(self._append(session, messages, receipt, delivery))
        session.messages.extend(stored)
        session.next_seq += len(stored)
        if cancelled:
            raise asyncio.CancelledError

    async def history(self, key: str) -> list[Message]:
        """Every readable message of the session, consolidated ones included, as stored."""
        rows = await self._rows(key)
        return [item for item in map(_parse, rows) if isinstance(item, Message)]

    async def unreadable(self) -> list[UnreadableRow]:
        """Rows of any session, inside the window or before it, that cannot be parsed. Read-only."""
        return [
            UnreadableRow(row.session_key, row.seq, item, _raw(row))
            for row in await self._rows(None)
            if isinstance(item := _parse(row), str)
        ]

    async def quarantined(self) -> list[UnreadableRow]:
        """Rows set aside by earlier loads."""
        q = schema.quarantine
        async with self._db.read() as conn:
            rows = (await conn.execute(select(q).order_by(q.c.created_at))).all()
        return [UnreadableRow(r.session_key, r.seq, r.reason, r.raw) for r in rows]

    async def list_sessions(self, prefix: str = "") -> list[SessionSummary]:
        """Sessions whose key starts with `prefix`, most recently active first."""
        s = schema.sessions
        query = select(s).order_by(s.c.updated_at.desc())
        if prefix:
            # Not LIKE: SQLite's LIKE ignores case, and "Alice" must not list "alice"'s sessions.
            query = query.where(func.substr(s.c.key, 1, len(prefix)) == prefix)
        async with self._db.read() as conn:
            rows = (await conn.execute(query)).all()
        return [SessionSummary(r.key, r.next_seq, r.last_consolidated, r.updated_at) for r in rows]

    async def advance_boundary(self, key: str, *, expected: int, new: int, summary: str) -> bool:
        """Move `last_consolidated` from `expected` forward to `new` and record
        the summary of the messages in between, atomically (I5).

        False (and nothing written) when another consolidation moved it first;
        ValueError for a boundary inside a tool-call chain (I5).
        """
        if new <= expected:
            return False
        now = time.time()
        s, m = schema.sessions, schema.messages
        async with self._db.write() as conn:
            first_kept = (await conn.execute(
                select(m.c.role).where(m.c.session_key == key, m.c.seq >= new).order_by(m.c.seq).limit(1)
            )).scalar()
            if first_kept == Role.TOOL.value:
                # The next load would find a result without its call and set it aside: a lost row.
                raise ValueError(f"boundary {new} of {key!r} would split a tool call from its results")
            moved = await conn.execute(
                update(s)
                .where(s.c.key == key, s.c.last_consolidated == expected, s.c.next_seq >= new)
                .values(last_consolidated=new, updated_at=now)
            )
            if moved.rowcount != 1:
                return False
            await conn.execute(
                insert(schema.memories).values(
                    id=uuid.uuid4().hex, session_key=key, kind="episodic", content=summary,
                    source_start=expected, source_end=new, created_at=now,
                )
            )
        return True

    async def _rows(self, key: str | None) -> list[StoredRow]:
        m = schema.messages
        query = select(m).order_by(m.c.session_key, m.c.seq)
        if key is not None:
            query = query.where(m.c.session_key == key)
        async with self._db.read() as conn:
            return list((await conn.execute(query)).all())

    async def _read_window(self, key: str) -> tuple[Session, list[StoredRow]]:
        s, m = schema.sessions, schema.messages
        async with self._db.read() as conn:
            head = (await conn.execute(select(s).where(s.c.key == key))).first()
            if head is None:
                return Session(key=key), []
            rows = (
                await conn.execute(
                    select(m).where(m.c.session_key == key, m.c.seq >= head.last_consolidated).order_by(m.c.seq)
                )
            ).all()
        session = Session(key=key, last_consolidated=head.last_consolidated, next_seq=head.next_seq,
                          metadata=json.loads(head.metadata_json))
        return session, list(rows)

    async def _append(self, session: Session, messages: Sequence[Message], receipt: Receipt | None,
                      delivery: Delivery | None) -> list[Message]:
        now = time.time()
        stored = [_stored(msg, session.next_seq + i) for i, msg in enumerate(messages)]
        async with self._db.write() as conn:
            await self._claim_seqs(conn, session, len(stored), now)
            await conn.execute(insert(schema.messages), [_message_row(session.key, msg, now) for msg in stored])
            if receipt is not None:
                await record_receipt(conn, session.key, receipt, now)
            if delivery is not None:
                await record_delivery(conn, session.key, delivery, now)
        return stored

    async def _claim_seqs(self, conn: AsyncConnection, session: Session, count: int, now: float) -> None:
        """Reserve `count` seqs after `session.next_seq`, creating the session on its first write."""
        s = schema.sessions
        bumped = await conn.execute(
            update(s)
            .where(s.c.key == session.key, s.c.next_seq == session.next_seq)
            .values(next_seq=session.next_seq + count, updated_at=now)
        )
        if bumped.rowcount == 1:
            return
        if session.next_seq == 0:
            try:
                async with conn.begin_nested():
                    await conn.execute(insert(s).values(
                        key=session.key, next_seq=count, last_consolidated=0,
                        metadata_json=json.dumps(session.metadata), created_at=now, updated_at=now,
                    ))
                return
            except IntegrityError:
                pass
        raise StoreConflict(f"session {session.key!r} was written by someone else since it was loaded")

    async def _write_repair(self, session: Session, broken: list[tuple[StoredRow, str]], repair: RepairPlan) -> None:
        """Set aside what cannot be used and close interrupted tool calls, in one
        transaction, provided the session head is still the one planned from."""
        now = time.time()
        s, m = schema.sessions, schema.messages
        new_next = max([session.next_seq, *((msg.seq or 0) + 1 for msg in repair.synthetic)])
        async with self._db.write() as conn:
            unchanged = await conn.execute(
                update(s)
                .where(s.c.key == session.key, s.c.next_seq == session.next_seq,
                       s.c.last_consolidated == session.last_consolidated)
                .values(next_seq=new_next, updated_at=now)
            )
            if unchanged.rowcount != 1:
                raise StoreConflict(f"session {session.key!r} changed while it was being repaired")
            for item, reason in [*broken, *repair.quarantine]:
                await conn.execute(insert(schema.quarantine).values(
                    id=uuid.uuid4().hex, session_key=session.key, seq=item.seq, raw=_raw(item),
                    reason=reason, created_at=now,
                ))
                await conn.execute(m.delete().where(m.c.session_key == session.key, m.c.seq == item.seq))
            if repair.synthetic:
                await conn.execute(insert(m), [_message_row(session.key, msg, now) for msg in repair.synthetic])
