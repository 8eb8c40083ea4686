"""Messages to rows and back, and the statements a turn runs on sessions.

Rows are read by position, whether they come from SQLAlchemy or from a `Tx`:
every query here selects the table's columns in their declared order.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import bindparam, func, insert, select, update

from ember.core.messages import (
    Message,
    Role,
    decode_attachments,
    decode_tool_calls,
    encode_attachments,
    encode_tool_calls,
)
from ember.core.thinking import strip_thinking
from ember.store import schema
from ember.store.tx import Statement, Tx, upsert

StoredRow = Sequence[Any]

_s, _m = schema.sessions, schema.messages
HEAD = Statement(select(_s.c.next_seq, _s.c.last_consolidated, _s.c.updated_at, _s.c.metadata_json)
                 .where(_s.c.key == bindparam("key")))
WINDOW = Statement(select(_m).where(_m.c.session_key == bindparam("key"), _m.c.seq >= bindparam("start"))
                   .order_by(_m.c.seq))
HISTORY = Statement(select(_m).where(_m.c.session_key == bindparam("key")).order_by(_m.c.seq))
LAST_QUESTION = Statement(select(_m.c.turn_id).where(_m.c.session_key == bindparam("key"), _m.c.role == Role.USER.value)
                          .order_by(_m.c.seq.desc()).limit(1))
CLAIM = Statement(update(_s).where(_s.c.key == bindparam("session"), _s.c.next_seq == bindparam("expected"))
                  .values(next_seq=bindparam("claimed"), updated_at=bindparam("now"),
                          metadata_json=bindparam("metadata")))
CREATE = upsert(lambda ins: ins(_s).on_conflict_do_nothing(index_elements=["key"]))
INSERT_MESSAGE = Statement(insert(_m))
FIRST_ROLE_FROM = Statement(select(_m.c.role).where(_m.c.session_key == bindparam("key"), _m.c.seq >= bindparam("seq"))
                            .order_by(_m.c.seq).limit(1))
ADVANCE = Statement(update(_s).where(_s.c.key == bindparam("session"), _s.c.last_consolidated == bindparam("expected"),
                                     _s.c.next_seq >= bindparam("new"))
                    .values(last_consolidated=bindparam("new"), updated_at=bindparam("now")))
SPAN = Statement(select(func.min(_m.c.created_at), func.max(_m.c.created_at))
                 .where(_m.c.session_key == bindparam("key"), _m.c.seq >= bindparam("start"),
                        _m.c.seq < bindparam("end")))

_ROLES = {role.value: role for role in Role}


@dataclass(frozen=True, slots=True)
class Head:
    """A session's row, which every write of its messages moves (next_seq, and always updated_at)."""

    next_seq: int
    last_consolidated: int
    updated_at: float
    metadata_json: str


def read_head(tx: Tx, key: str) -> Head | None:
    row = tx.execute(HEAD, {"key": key}).fetchone()
    return None if row is None else Head(*row)


def row_to_message(row: StoredRow) -> Message:
    """Parse one stored row; ValueError when it cannot be trusted (it is then quarantined).

    Called for every message of a window that is read, so it unpacks the row
    by position rather than looking fields up by name.
    """
    _key, seq, role_name, content, raw_calls, tool_call_id, reasoning, turn_id, _created, name, files = row
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
    attachments = decode_attachments(files)
    if attachments and role is Role.SYSTEM:
        raise ValueError(f"a {role.value} message cannot carry attachments")
    return Message(role=role, content=content, tool_calls=calls, tool_call_id=tool_call_id,
                   reasoning=reasoning, turn_id=turn_id, seq=seq, name=name, attachments=attachments)


def parse(row: StoredRow) -> Message | str:
    """The message, or why the row cannot be read."""
    try:
        return row_to_message(row)
    except (ValueError, KeyError, TypeError) as exc:
        return f"unreadable row: {exc}"


def stored(message: Message, seq: int) -> Message:
    """The message as it is stored at `seq`."""
    content = message.content
    if message.role is Role.ASSISTANT:
        # Storage boundary of I4: no reasoning text inside content, whoever wrote it.
        content = strip_thinking(content)
    return replace(message, content=content, seq=seq)


def message_row(key: str, message: Message, now: float) -> dict[str, Any]:
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
        "name": message.name,
        "attachments": encode_attachments(message.attachments),
    }


def raw(item: Message | StoredRow) -> str:
    """What is kept of a row set aside: enough to read it back by hand."""
    if isinstance(item, Message):
        return json.dumps({**item.to_json_dict(), "reasoning": item.reasoning, "turn_id": item.turn_id})
    return json.dumps(dict(zip(_m.c.keys(), item)), default=str)
