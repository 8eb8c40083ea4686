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
from dataclasses import dataclass, replace
from typing import Any, Protocol, Sequence

from sqlalchemy import insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from ember.core.errors import StoreConflict
from ember.core.messages import Message, Role, Session, decode_tool_calls, encode_tool_calls
from ember.core.thinking import strip_thinking
from ember.store import schema
from ember.store.database import Database
from ember.store.repair import RepairPlan, plan_repair

INTERRUPTED_RESULT = "[interrupted: this tool call's result was lost when the turn was cut off; it did not complete]"


@dataclass(frozen=True, slots=True)
class SessionSummary:
    key: str
    message_count: int
    last_consolidated: int
    updated_at: float


@dataclass(frozen=True, slots=True)
class QuarantinedRow:
    session_key: str
    seq: int
    reason: str
    raw: str
    created_at: float


_ROLES = {role.value: role for role in Role}


def _row_to_message(row: Any) -> Message:
    """Parse one stored row; ValueError when it cannot be trusted (it is then quarantined).

    Called for every message of the window on every turn, so it avoids
    per-field lookups by name.
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


def _raw(item: Any) -> str:
    if isinstance(item, Message):
        return json.dumps({**item.to_json_dict(), "reasoning": item.reasoning, "turn_id": item.turn_id})
    return json.dumps(dict(item._mapping), default=str)


class SessionStore(Protocol):
    """What the pipeline and the memory workers need of session storage."""

    async def load(self, key: str) -> Session: ...

    async def append(self, session: Session, messages: Sequence[Message]) -> None: ...

    async def advance_boundary(self, key: str, *, expected: int, new: int, summary: str) -> bool: ...


class SqlSessionStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def load(self, key: str) -> Session:
        """The session's window since its consolidation boundary, protocol-valid."""
        return await self._load(key, repaired=False)

    async def _load(self, key: str, *, repaired: bool) -> Session:
        head, rows = await self._read_window(key)
        if head is None:
            return Session(key=key)
        session = Session(key=key, last_consolidated=head.last_consolidated, next_seq=head.next_seq)
        parsed: list[Message] = []
        broken: list[tuple[Any, str]] = []
        for row in rows:
            try:
                parsed.append(_row_to_message(row))
            except (ValueError, KeyError, TypeError) as exc:
                broken.append((row, f"unparseable row: {exc}"))
        repair = plan_repair(parsed, session.next_seq, INTERRUPTED_RESULT)
        if broken or repair.needed:
            if repaired:
                raise RuntimeError(f"session {key!r} still needs repair after being repaired")
            await asyncio.shield(self._write_repair(session, broken, repair))
            return await self._load(key, repaired=True)
        session.messages = parsed
        return session

    async def append(self, session: Session, messages: Sequence[Message]) -> None:
        """Commit `messages` at the end of the session in one transaction.

        On success the stored copies (with their seq) are added to
        `session.messages`. The write is shielded: once started, a cancelled
        turn does not abandon it half-way.
        """
        if messages:
            stored = await asyncio.shield(self._append(session.key, session.next_seq, messages))
            session.messages.extend(stored)
            session.next_seq += len(stored)

    async def history(self, key: str) -> list[Message]:
        """Every stored message of the session, consolidated ones included, as stored."""
        async with self._db.read() as conn:
            rows = (
                await conn.execute(
                    select(schema.messages).where(schema.messages.c.session_key == key).order_by(schema.messages.c.seq)
                )
            ).all()
        return [_row_to_message(row) for row in rows]

    async def exists(self, key: str) -> bool:
        async with self._db.read() as conn:
            found = await conn.execute(select(schema.sessions.c.key).where(schema.sessions.c.key == key))
            return found.first() is not None

    async def list_sessions(self) -> list[SessionSummary]:
        s = schema.sessions
        async with self._db.read() as conn:
            rows = (await conn.execute(select(s).order_by(s.c.updated_at.desc()))).all()
        return [SessionSummary(r.key, r.next_seq, r.last_consolidated, r.updated_at) for r in rows]

    async def advance_boundary(self, key: str, *, expected: int, new: int, summary: str) -> bool:
        """Move `last_consolidated` from `expected` forward to `new` and record
        the summary of the messages in between, atomically (I5).

        False (and nothing written) when another consolidation moved it first.
        """
        if new <= expected:
            return False
        now = time.time()
        s = schema.sessions
        async with self._db.write() as conn:
            moved = await conn.execute(
                update(s)
                .where(s.c.key == key, s.c.last_consolidated == expected, s.c.next_seq >= new)
                .values(last_consolidated=new, updated_at=now)
            )
            if moved.rowcount != 1:
                return False
            await conn.execute(
                insert(schema.memories).values(
                    id=uuid.uuid4().hex,
                    session_key=key,
                    kind="episodic",
                    content=summary,
                    source_start=expected,
                    source_end=new,
                    created_at=now,
                )
            )
        return True

    async def quarantined(self) -> list[QuarantinedRow]:
        q = schema.quarantine
        async with self._db.read() as conn:
            rows = (await conn.execute(select(q).order_by(q.c.created_at))).all()
        return [QuarantinedRow(r.session_key, r.seq, r.reason, r.raw, r.created_at) for r in rows]

    async def _read_window(self, key: str) -> tuple[Any, list[Any]]:
        s, m = schema.sessions, schema.messages
        async with self._db.read() as conn:
            head = (await conn.execute(select(s).where(s.c.key == key))).first()
            if head is None:
                return None, []
            rows = (
                await conn.execute(
                    select(m).where(m.c.session_key == key, m.c.seq >= head.last_consolidated).order_by(m.c.seq)
                )
            ).all()
        return head, list(rows)

    async def _append(self, key: str, expected_next: int, messages: Sequence[Message]) -> list[Message]:
        now = time.time()
        stored = [_stored(msg, expected_next + i) for i, msg in enumerate(messages)]
        async with self._db.write() as conn:
            await self._claim_seqs(conn, key, expected_next, len(stored), now)
            await conn.execute(insert(schema.messages), [_message_row(key, msg, now) for msg in stored])
        return stored

    async def _claim_seqs(self, conn: AsyncConnection, key: str, expected_next: int, count: int, now: float) -> None:
        s = schema.sessions
        bumped = await conn.execute(
            update(s)
            .where(s.c.key == key, s.c.next_seq == expected_next)
            .values(next_seq=expected_next + count, updated_at=now)
        )
        if bumped.rowcount == 1:
            return
        if expected_next == 0:
            try:
                async with conn.begin_nested():
                    await conn.execute(
                        insert(s).values(key=key, next_seq=count, last_consolidated=0, created_at=now, updated_at=now)
                    )
                return
            except IntegrityError:
                pass
        raise StoreConflict(f"session {key!r} was written by someone else since it was loaded")

    async def _write_repair(self, session: Session, broken: list[tuple[Any, str]], repair: RepairPlan) -> None:
        """Set aside what cannot be used and close interrupted tool calls, in one transaction."""
        now = time.time()
        m = schema.messages
        async with self._db.write() as conn:
            for row, reason in [*broken, *repair.quarantine]:
                await conn.execute(
                    insert(schema.quarantine).values(
                        id=uuid.uuid4().hex,
                        session_key=session.key,
                        seq=row.seq,
                        raw=_raw(row),
                        reason=reason,
                        created_at=now,
                    )
                )
                await conn.execute(m.delete().where(m.c.session_key == session.key, m.c.seq == row.seq))
            if repair.synthetic:
                await conn.execute(
                    insert(m), [_message_row(session.key, msg, now) for msg in repair.synthetic]
                )
                new_next = max(session.next_seq, max(msg.seq for msg in repair.synthetic) + 1)
                if new_next != session.next_seq:
                    await self._claim_seqs(conn, session.key, session.next_seq, new_next - session.next_seq, now)
