"""Archiving a session: its messages copied into the archival tier, each indexed with its neighbours.

One transaction per run (SqlMemoryStore.archive_session): the lines not yet archived, read with
the archived ones before them, whose neighbours the new ones may change.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import bindparam, func, null, select, update

from ember.core.memory import (
    MAX_CONTENT_CHARS,
    MemoryKind,
    NewMemory,
    SourceRank,
    memory_identity,
    says_something,
    session_identity,
)
from ember.core.redact import derived_text
from ember.store import schema
from ember.store.attachments import with_documents
from ember.store.memory_rows import DELETE_TEXT, NEIGHBOUR_CHARS, Context, insert_memory, write_text_row
from ember.store.session_rows import read_head
from ember.store.tx import Statement, Tx

_mi, _m, _marks = schema.memory_items, schema.messages, schema.memory_archive_marks

_ARCHIVE_MARK = Statement(select(_marks.c.next_seq).where(_marks.c.session_key == bindparam("key")))
# A session's messages worth archiving, with the channel and sender of their turn.
_ARCHIVABLE = (
    "SELECT m.seq, m.role, m.content, m.created_at, i.channel, i.sender_id, m.name, m.attachments FROM messages m "
    "LEFT JOIN inbox i ON i.turn_id = m.turn_id AND i.session_key = m.session_key "
    "WHERE m.session_key = :key AND m.role IN ('user', 'assistant') "
    "AND (TRIM(m.content) != '' OR m.attachments IS NOT NULL)"
)
# Archived lines read before the new ones: enough, with a nod after each, for the two that say
# something before the new lines to be read with the two that say something before them; four
# times as many where nods are thicker than that.
EARLIER_LINES = 8
_ARCHIVED_BEFORE = Statement(f"{_ARCHIVABLE} AND m.seq < :start ORDER BY m.seq DESC LIMIT :limit")
# Up to the last seq read first: at READ COMMITTED a message committed meanwhile waits for the next run.
_NOT_ARCHIVED = Statement(f"{_ARCHIVABLE} AND m.seq >= :start AND m.seq <= :high ORDER BY m.seq")
_LAST_SEQ = Statement(select(func.coalesce(func.max(_m.c.seq), -1)).where(_m.c.session_key == bindparam("key")))
_archived = (_mi.c.session_key == bindparam("key"), _mi.c.seq_start == bindparam("seq"), _mi.c.kind == "archival")
_ARCHIVED = Statement(select(_mi.c.num).where(*_archived))
_ARCHIVED_ROW = Statement(select(_mi.c.num, _mi.c.identity, _mi.c.content, _mi.c.context_json).where(*_archived))
_SET_CONTEXT_UNEMBEDDED = Statement(update(_mi).where(_mi.c.num == bindparam("memory_num"))
                                    .values(context_json=bindparam("context"), embedding_model=null()))
_MOVE_ARCHIVE_MARK = Statement(
    "INSERT INTO memory_archive_marks (session_key, next_seq) VALUES (:key, :next_seq) "
    "ON CONFLICT (session_key) DO UPDATE SET next_seq = excluded.next_seq")


def _neighbours(texts: Sequence[str], index: int, informative: Sequence[int]) -> Context:
    """The lines around `index` that say something (`informative`, in order): a bare "noted."
    between two of a person's lines is passed over, so each is read beside the other."""
    first_at, after_at = bisect.bisect_left(informative, index), bisect.bisect_right(informative, index)
    before, after = informative[max(0, first_at - 2):first_at], informative[after_at:after_at + 2]

    def text(positions: Sequence[int], which: int) -> str:
        return texts[positions[which]] if -len(positions) <= which < len(positions) else ""

    return Context(before=text(before, -1), after=text(after, 0),
                   far=tuple(line for line in (text(before, -2), text(after, 1)) if line))


def _earlier_lines(tx: Tx, session_key: str, start: int) -> tuple[list[Any], bool]:
    """The archived lines before `start`, oldest first, back to the fourth that says something,
    and whether they are all the session's."""
    for limit in (EARLIER_LINES, 4 * EARLIER_LINES):
        rows = tx.execute(_ARCHIVED_BEFORE, {"key": session_key, "start": start, "limit": limit}).fetchall()
        whole = len(rows) < limit
        if whole or sum(says_something(row[2]) or row[7] is not None for row in rows) >= 4:
            break
    return rows[::-1], whole


def _refresh_context(tx: Tx, session_key: str, seq: int, created_at: float, context: Context) -> None:
    row = tx.execute(_ARCHIVED_ROW, {"key": session_key, "seq": seq}).fetchone()
    if row is None or Context.from_json(row[3]) == context:
        return
    num, identity, content, _ = row
    tx.execute(DELETE_TEXT, {"num": num})
    write_text_row(tx, num, identity, content, created_at, context)
    # Its window vector is made with its neighbours: it is made again (of vectors mostly made already).
    tx.execute(_SET_CONTEXT_UNEMBEDDED, {"memory_num": num, "context": context.to_json()})


def archive_messages(tx: Tx, session_key: str, resolve: Callable[[str, str], str], now: float, *,
                     embed: bool = True) -> int:
    """Copy the session's messages not yet archived into the archival tier (SqlMemoryStore.archive_session)."""
    head = read_head(tx, session_key)
    metadata = json.loads(head.metadata_json) if head is not None else {}
    if head is None or metadata.get("evaluation"):  # nothing said, or nothing of it may become a memory
        return 0
    fallback = memory_identity(session_identity(session_key, metadata), metadata)  # a message without a receipt
    mark = tx.execute(_ARCHIVE_MARK, {"key": session_key}).fetchone()
    start = mark[0] if mark else 0
    high = tx.execute(_LAST_SEQ, {"key": session_key}).fetchone()[0]
    earlier, whole = _earlier_lines(tx, session_key, start)
    new = tx.execute(_NOT_ARCHIVED, {"key": session_key, "start": start, "high": high}).fetchall()
    line = [*earlier, *new]
    # A named author is part of what was said: "Caroline: I went to the support group".
    # Kept as derived text before they become its content and its neighbours' context.
    said = [with_documents(tx, session_key, row[2], row[7], answer=row[1] == "assistant") for row in line]
    texts = [derived_text(f"{row[6].strip()}: {text.strip()}" if row[6] else text.strip())
             for row, text in zip(line, said, strict=True)]
    heads = [text[:NEIGHBOUR_CHARS] for text in texts]
    informative = [i for i, text in enumerate(said) if says_something(text)]
    saying = set(informative)
    # The new lines reach back to the two that say something before them: from there on, an earlier
    # line's neighbours may change; those before only give theirs (their own reach further back).
    # A line is read again only with all it needs before it: the whole session, or two that say something.
    reach = ([i for i in informative if i < len(earlier)][-2:] or [0])[0]
    for index, (seq, role, _, created_at, channel, sender, name, _files) in enumerate(line):
        # A nod gets no neighbours: found by theirs, it would only stand in for them.
        context = _neighbours(heads, index, informative) if index in saying else Context()
        if index < len(earlier):
            if index >= reach and (whole or bisect.bisect_left(informative, index) >= 2):
                _refresh_context(tx, session_key, seq, created_at, context)
            continue
        if tx.execute(_ARCHIVED, {"key": session_key, "seq": seq}).fetchone():
            continue
        insert_memory(tx, NewMemory(
            identity=memory_identity(resolve(channel, sender), metadata) if channel is not None else fallback,
            content=texts[index][:MAX_CONTENT_CHARS], kind=MemoryKind.ARCHIVAL, subject=name or role,
            source=f"session {session_key}",
            source_rank=SourceRank.USER_STATED if role == "user" else SourceRank.INFERRED,
            session_key=session_key, seq_start=seq, seq_end=seq + 1, created_at=created_at),
            now, context=context, embed=embed)
    tx.execute(_MOVE_ARCHIVE_MARK, {"key": session_key, "next_seq": high + 1})
    return len(new)
