"""Sessions as append-only message rows (one row per message, numbered by seq).

A turn's commit inserts only its new rows and bumps the session's `next_seq`
by compare-and-set, so it costs the same at message 10 and at message 100,000.
Loading returns the window since the consolidation boundary, made
protocol-valid (I3) by a repair that is written back once, not redone per load.

A turn's load and commits each go to the database in one hop (run_read,
run_write), and a window read once is kept between turns while its session's
head does not move (store/windows.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Integer, bindparam, delete, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from ember.core.attachments import AttachmentContent, StoredFile
from ember.core.delivery import Delivery, Receipt
from ember.core.errors import StoreConflict
from ember.core.jobs import JobRequest
from ember.core.memory import MemoryKind, NewMemory, SourceRank, memory_identity, session_identity
from ember.core.messages import Message, Role, Session
from ember.store import schema
from ember.store.attachments import put_files, read_files
from ember.store.deliveries import record_delivery, record_receipt
from ember.store.engine import Database, complete_despite_cancel
from ember.store.jobs import record_job
from ember.store.memory_rows import hold_memory_writes, write_memory
from ember.store.records import SessionSummary, session_summary
from ember.store.repair import RepairPlan, plan_repair
from ember.store.session_rows import (
    ADVANCE,
    CLAIM,
    CREATE,
    FIRST_ROLE_FROM,
    HISTORY,
    INSERT_MESSAGE,
    LAST_QUESTION,
    SPAN,
    WINDOW,
    Head,
    StoredRow,
    message_row,
    parse,
    raw,
    read_head,
    stored,
)
from ember.store.tx import Statement, Tx, upsert
from ember.store.windows import Window, WindowCache

INTERRUPTED_RESULT = "[interrupted: this tool call's result was lost when the turn was cut off; it did not complete]"
REPAIR_ATTEMPTS = 3

Parsed = list[tuple[StoredRow, Message | str]]


TITLE_CHARS = 80  # of a first message, as a session's title when it has none of its own

_labels = schema.session_labels
_LABELLED = upsert(lambda ins: ins(_labels).values(session_key=bindparam("key"))
                   .on_conflict_do_nothing(index_elements=["session_key"]))
_RETITLE = Statement(update(_labels).where(_labels.c.session_key == bindparam("key"))
                     .values(title=bindparam("title")))
_ARCHIVE = Statement(update(_labels).where(_labels.c.session_key == bindparam("key"))
                     .values(archived_at=bindparam("archived_at")))
_TITLE_IF_UNTITLED = Statement(update(_labels).where(_labels.c.session_key == bindparam("key"),
                                                     _labels.c.title.is_(None))
                               .values(title=bindparam("title")))


_s, _m, _q = schema.sessions, schema.messages, schema.quarantine
_QUARANTINED = Statement(select(_q.c.session_key, _q.c.seq, _q.c.reason, _q.c.raw).order_by(_q.c.created_at))
_QUARANTINE = Statement(insert(_q))
_DROP_MESSAGE = Statement(delete(_m).where(_m.c.session_key == bindparam("key"), _m.c.seq == bindparam("seq")))
_REPAIRED_HEAD = Statement(update(_s).where(_s.c.key == bindparam("session"), _s.c.next_seq == bindparam("expected"),
                                            _s.c.last_consolidated == bindparam("boundary"))
                           .values(next_seq=bindparam("claimed"), updated_at=bindparam("now")))
_ALL_MESSAGES = Statement(select(_m).order_by(_m.c.session_key, _m.c.seq))
# A candidate: the flag's name is in the metadata's text; its JSON says whether it is set.
_MAYBE_MARKED = Statement(select(_s.c.key, _s.c.metadata_json).where(_s.c.metadata_json.contains(bindparam("flag"))))


def _listed(archived: bool) -> Statement:
    first_words = (select(func.substr(_m.c.content, 1, TITLE_CHARS))
                   .where(_m.c.session_key == _s.c.key, _m.c.role == Role.USER.value)
                   .order_by(_m.c.seq).limit(1).scalar_subquery())
    query = (select(_s.c.key, _s.c.next_seq, _s.c.last_consolidated, _s.c.updated_at,
                    func.coalesce(_labels.c.title, first_words), _labels.c.archived_at)
             .select_from(_s.outerjoin(_labels, _labels.c.session_key == _s.c.key))
             # Not LIKE: SQLite's LIKE ignores case, and "Alice" must not list "alice"'s sessions.
             .where(func.substr(_s.c.key, 1, bindparam("prefix_chars", type_=Integer)) == bindparam("prefix"))
             .order_by(_s.c.updated_at.desc()))
    return Statement(query if archived else query.where(_labels.c.archived_at.is_(None)))


_LISTED = {True: _listed(True), False: _listed(False)}


@dataclass(frozen=True, slots=True)
class UnreadableRow:
    session_key: str
    seq: int
    reason: str
    raw: str


class SqlSessionStore:
    def __init__(self, db: Database) -> None:
        self._db = db
        self._windows = WindowCache()

    async def load(self, key: str) -> Session:
        """The session's window since its consolidation boundary, protocol-valid.

        A needed repair is written under a compare-and-set on the session head;
        if another writer got there first, the window is read and planned again.
        """
        for _ in range(REPAIR_ATTEMPTS):
            epoch = self._db.write_epoch
            kept = self._windows.get(key, epoch)
            head, parsed = await self._db.run_read(functools.partial(_read_window, key=key, kept=kept))
            if head is None:
                return Session(key=key)
            session = Session(key=key, last_consolidated=head.last_consolidated, next_seq=head.next_seq,
                              metadata=json.loads(head.metadata_json))
            if parsed is None:
                assert kept is not None
                session.messages = kept.messages()
                return session
            messages = [item for _, item in parsed if isinstance(item, Message)]
            broken = [(row, item) for row, item in parsed if isinstance(item, str)]
            repair = plan_repair(messages, INTERRUPTED_RESULT)
            if not broken and not repair.needed:
                self._windows.put(key, Window.of(head, messages, epoch))
                session.messages = messages
                return session
            try:
                _, cancelled = await complete_despite_cancel(self._write_repair(session, broken, repair))
            except (StoreConflict, IntegrityError):
                continue
            if cancelled:
                raise asyncio.CancelledError
        raise StoreConflict(f"session {key!r} kept changing while it was being repaired")

    async def last_question(self, key: str) -> str | None:
        """The turn id of the session's newest user message, however far behind its boundary."""
        row = await self._db.run_read(lambda tx: tx.execute(LAST_QUESTION, {"key": key}).fetchone())
        return None if row is None else row[0]

    async def append(self, session: Session, messages: Sequence[Message], *, receipt: Receipt | None = None,
                     delivery: Delivery | None = None, jobs: Sequence[JobRequest] = ()) -> None:
        """Commit `messages` at the end of the session in one transaction, with
        the inbound `receipt` they answer to, the outbound `delivery` they owe
        and the background `jobs` they call for.

        On success the stored copies (with their seq) are added to
        `session.messages`. Once started, the write finishes even if the turn
        is cancelled, and the cancellation is raised after it is recorded.
        DuplicateMessage (and nothing written) when the receipt's message was
        already accepted.
        """
        if not messages:
            return
        new, cancelled = await complete_despite_cancel(self._append(session, messages, receipt, delivery, jobs))
        session.messages.extend(new)
        session.next_seq += len(new)
        if cancelled:
            raise asyncio.CancelledError

    async def history(self, key: str) -> list[Message]:
        """Every readable message of the session, consolidated ones included, as stored: read and
        parsed in one hop to the reader thread (a title job reads one after each first exchange)."""
        return await self._db.run_read(functools.partial(_read_history, key=key))

    async def unreadable(self) -> list[UnreadableRow]:
        """Rows of any session, inside the window or before it, that cannot be parsed. Read-only."""
        return [
            UnreadableRow(row[0], row[1], item, raw(row))
            for row in await self._all_rows()
            if isinstance(item := parse(row), str)
        ]

    async def quarantined(self) -> list[UnreadableRow]:
        """Rows set aside by earlier loads."""
        rows = await self._db.run_read(lambda tx: tx.execute(_QUARANTINED).fetchall())
        return [UnreadableRow(*row) for row in rows]

    async def list_sessions(self, prefix: str = "", *, archived: bool = True) -> list[SessionSummary]:
        """Sessions whose key starts with `prefix`, most recently active first; `archived`: those a
        person put away too."""
        params = {"prefix": prefix, "prefix_chars": len(prefix)}
        rows = await self._db.run_read(lambda tx: tx.execute(_LISTED[archived], params).fetchall())
        return [session_summary(row) for row in rows]

    async def marked(self, flag: str) -> list[str]:
        """The keys of the sessions whose metadata sets `flag` (ContextStage's marks on a new session)."""
        rows = await self._db.run_read(lambda tx: tx.execute(_MAYBE_MARKED, {"flag": json.dumps(flag)}).fetchall())
        return [key for key, metadata_json in rows if json.loads(metadata_json).get(flag) is True]

    async def label(self, key: str, *, title: str | None = None, archived: bool | None = None) -> bool:
        """Rename a session (`title`; "" clears it) or put it away / back (`archived`); False if there is
        no such session. Its messages are untouched either way."""
        now = time.time()

        def write(tx: Tx) -> bool:
            if read_head(tx, key) is None:
                return False
            tx.execute(_LABELLED, {"key": key})
            if title is not None:
                tx.execute(_RETITLE, {"key": key, "title": title or None})
            if archived is not None:
                tx.execute(_ARCHIVE, {"key": key, "archived_at": now if archived else None})
            return True

        return await self._db.run_write(write)

    async def keep_attachments(self, key: str, files: Sequence[AttachmentContent]) -> None:
        """Store files a message of the session will name, before it is committed (store/attachments.py)."""
        if files:
            await self._db.run_write(lambda tx: put_files(tx, key, files))

    async def attachments(self, key: str, digests: Sequence[str]) -> dict[str, StoredFile]:
        return await self._db.run_read(lambda tx: read_files(tx, key, digests)) if digests else {}

    async def name_if_untitled(self, key: str, title: str) -> bool:
        """Give the session `title` unless it has one (a person's name for it, or an earlier
        one); True when written."""
        def write(tx: Tx) -> bool:
            if read_head(tx, key) is None:
                return False
            tx.execute(_LABELLED, {"key": key})
            return tx.execute(_TITLE_IF_UNTITLED, {"key": key, "title": title}).rowcount == 1

        return bool(await self._db.run_write(write))

    async def advance_boundary(self, key: str, *, expected: int, new: int, summary: str,
                               facts: Sequence[NewMemory] = (), identity: str | None = None) -> bool:
        """Move `last_consolidated` from `expected` forward to `new` and record
        the summary of the messages in between, with the facts drawn from them,
        atomically (I5): a retried consolidation can add nothing twice. The
        summary joins `identity`'s memory (by default, the session owner's).

        False (and nothing written) when another consolidation moved it first;
        ValueError for a boundary inside a tool-call chain (I5).
        """
        if new <= expected:
            return False
        now = time.time()

        def commit(tx: Tx) -> bool:
            first_kept = tx.execute(FIRST_ROLE_FROM, {"key": key, "seq": new}).fetchone()
            if first_kept is not None and first_kept[0] == Role.TOOL.value:
                # The next load would find a result without its call and set it aside: a lost row.
                raise ValueError(f"boundary {new} of {key!r} would split a tool call from its results")
            head = read_head(tx, key)
            moved = tx.execute(ADVANCE, {"session": key, "expected": expected, "new": new, "now": now})
            if head is None or moved.rowcount != 1:
                return False
            hold_memory_writes(tx)
            first, _last = tx.execute(SPAN, {"key": key, "start": expected, "end": new}).fetchone()
            metadata = json.loads(head.metadata_json)
            owner = identity or memory_identity(session_identity(key, metadata), metadata)
            span = f"session {key}, messages {expected}–{new - 1}"
            write_memory(tx, NewMemory(identity=owner, content=summary, kind=MemoryKind.EPISODIC,
                                       source=span, source_rank=SourceRank.CONSOLIDATED, session_key=key,
                                       seq_start=expected, seq_end=new, created_at=first or now), now)
            for fact in facts:
                write_memory(tx, fact, now)
            return True

        return await self._db.run_write(commit)

    async def _all_rows(self) -> list[StoredRow]:
        return list(await self._db.run_read(lambda tx: tx.execute(_ALL_MESSAGES).fetchall()))

    async def _append(self, session: Session, messages: Sequence[Message], receipt: Receipt | None,
                      delivery: Delivery | None, jobs: Sequence[JobRequest]) -> list[Message]:
        key, expected, now = session.key, session.next_seq, time.time()
        new = [stored(msg, expected + i) for i, msg in enumerate(messages)]
        rows = [message_row(key, msg, now) for msg in new]
        metadata_json = json.dumps(session.metadata)

        def commit(tx: Tx) -> Head | None:
            # The head this write replaces tells whether a kept window is still the stored one.
            replaced = read_head(tx, key)
            _claim_seqs(tx, key, expected, len(new), now, metadata_json)
            tx.executemany(INSERT_MESSAGE, rows)
            if receipt is not None:
                record_receipt(tx, key, receipt, now)
            if delivery is not None:
                record_delivery(tx, key, delivery, now)
            for job in jobs:
                record_job(tx, job, now)
            return replaced

        epoch = self._db.write_epoch
        try:
            replaced = await self._db.run_write(commit)
        except BaseException:
            self._windows.drop(key)
            raise
        if replaced is None:
            head = Head(len(new), 0, now, metadata_json)
        else:
            head = Head(expected + len(new), replaced.last_consolidated, now, metadata_json)
        self._windows.appended(key, replaced, head, new, epoch)
        return new

    async def _write_repair(self, session: Session, broken: list[tuple[StoredRow, str]], repair: RepairPlan) -> None:
        """Set aside what cannot be used and close interrupted tool calls, in one
        transaction, provided the session head is still the one planned from."""
        now, key = time.time(), session.key
        new_next = max([session.next_seq, *((msg.seq or 0) + 1 for msg in repair.synthetic)])
        set_aside = [{"id": uuid.uuid4().hex, "session_key": key, "raw": raw(item), "reason": reason,
                      "seq": item.seq if isinstance(item, Message) else item[1], "created_at": now}
                     for item, reason in [*broken, *repair.quarantine]]

        def write(tx: Tx) -> None:
            unchanged = tx.execute(_REPAIRED_HEAD, {"session": key, "expected": session.next_seq,
                                                   "boundary": session.last_consolidated, "claimed": new_next,
                                                   "now": now})
            if unchanged.rowcount != 1:
                raise StoreConflict(f"session {key!r} changed while it was being repaired")
            for row in set_aside:
                tx.execute(_QUARANTINE, row)
                tx.execute(_DROP_MESSAGE, {"key": key, "seq": row["seq"]})
            if repair.synthetic:
                tx.executemany(INSERT_MESSAGE, [message_row(key, msg, now) for msg in repair.synthetic])

        await self._db.run_write(write)


def _read_window(tx: Tx, key: str, kept: Window | None) -> tuple[Head | None, Parsed | None]:
    """The session's head and its window, parsed; no window (None) when `kept` is still current.

    Runs on the reader thread, parsing included, so the event loop only waits.
    """
    head = read_head(tx, key)
    if head is None or (kept is not None and kept.head == head):
        return head, None
    rows = tx.execute(WINDOW, {"key": key, "start": head.last_consolidated}).fetchall()
    return head, [(row, parse(row)) for row in rows]


def _read_history(tx: Tx, key: str) -> list[Message]:
    return [item for item in map(parse, tx.execute(HISTORY, {"key": key}).fetchall()) if isinstance(item, Message)]


def _claim_seqs(tx: Tx, key: str, expected: int, count: int, now: float,
                metadata_json: str) -> None:
    """Reserve `count` seqs after `expected`, creating the session on its first write; the session's
    metadata as the writer has it (a turn may set a flag: `/voice on`)."""
    claimed = tx.execute(CLAIM, {"session": key, "expected": expected, "claimed": expected + count, "now": now,
                                 "metadata": metadata_json})
    if claimed.rowcount == 1:
        return
    if expected == 0:
        created = tx.execute(CREATE, {"key": key, "next_seq": count, "last_consolidated": 0,
                                      "metadata_json": metadata_json, "created_at": now, "updated_at": now})
        if created.rowcount == 1:
            return
    raise StoreConflict(f"session {key!r} was written by someone else since it was loaded")
