"""A model-based test of long-term memory: MemoryService over a real store, SQLite and PostgreSQL.

A hypothesis state machine remembers facts and episodes for two people
(subjects, keys and values from small sets, so contents repeat and facts
replace facts, at every source rank), supersedes, forgets, purges, recalls
for a prompt and writes the recalls (upkeep), lets ages pass so memories
fade, flushes embeddings, and runs batches of these at once with
asyncio.gather (as a serving process runs two background jobs beside its
turns). It keeps its own record of every memory. The store serialises
writes, so a batch's outcomes must be explained by some serial order of its
writes: no update is lost. After every step:

- the store's rows are the model's, field by field: nothing lost, nothing
  resurrected, no id reused;
- at most one active fact per (identity, subject, key), and one active or
  pending row per (identity, content hash, kind) of a fact;
- `superseded_by` names an existing row of the same identity;
- `consistency()` agrees: a text row per memory and none more, no vector
  without its memory; text rows and vectors carry their memory's owner, and
  a vector is the one of its memory's content;
- recall counts are within what was recalled (exact once none are pending).

Searches and prompts are checked where they are made: only the asking
person's memories, never a superseded or forgotten one unless asked for, and
ranked as a process with nothing cached would rank them. After an upkeep, a
memory is archived exactly when the forgetting policy says it faded.
Below the machine, each bug it led to, in its smallest form.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from ember.core.errors import MemoryNotFound
from ember.core.memory import (
    MemoryKind,
    MemoryRecord,
    MemoryStatus,
    SourceRank,
    WriteOutcome,
    check_content,
    content_hash,
    normalized_key,
)
from ember.core.messages import Message
from ember.memory.embeddings import HashingEmbedder
from ember.memory.encoder import window_vector
from ember.memory.forgetting import DAY_S, ForgettingPolicy
from ember.memory.prompt import PromptMemory, RecallBudget
from ember.memory.service import RECALLED_KINDS, MemoryService
from ember.store.memories import SqlMemoryStore
from ember.store.memory_rows import Context
from ember.store.postgres import PostgresDatabase
from ember.store.segment import owner_token
from ember.store.sessions import SqlSessionStore
from ember.store.sqlite.database import SqliteDatabase
from ember.store.tx import Statement, Tx
from tests.pgserver import ENGINES, PgServer, engine_database

T = TypeVar("T")
ACTIVE, PENDING, SUPERSEDED, ARCHIVED = (MemoryStatus.ACTIVE, MemoryStatus.PENDING, MemoryStatus.SUPERSEDED,
                                         MemoryStatus.ARCHIVED)
IDENTITIES = ("alice", "bob")
# Spelled several ways: subjects and keys compare case- and space-insensitively.
SUBJECTS = ("user", " User", "work", None)
KEYS = ("city", "City ", "pet", None)
VALUES = ("paris", "berlin", "mochi", "green tea", "花生")
# A century: a memory not recalled since fades unless recalls have doubled its half-life often enough.
AGES_S = 100 * 365 * DAY_S
WITH_PROFILE = RecallBudget(profile_facts=30, recalled_tokens=10_000, recalled_max=8)
WITHOUT_PROFILE = RecallBudget(profile_facts=0, recalled_tokens=10_000, recalled_max=8)


class PacedEmbedder(HashingEmbedder):
    """The hashing embedder taking the time a real model takes (a few ms a batch, in its worker
    thread), so that writes land while an embedding is under way, as they do in a serving process."""

    def embed_passages(self, texts: Sequence[str]) -> Any:
        time.sleep(0.004)
        return super().embed_passages(texts)


EMBEDDER = HashingEmbedder()  # what a memory's vector must be


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# --------------------------------------------------------------------------- operations


@dataclass(frozen=True, slots=True)
class Remember:
    identity: str
    content: str
    subject: str | None
    key: str | None
    rank: SourceRank
    kind: MemoryKind


@dataclass(frozen=True, slots=True)
class Forget:
    identity: str
    memory_id: str


@dataclass(frozen=True, slots=True)
class Purge:
    identity: str
    memory_id: str


@dataclass(frozen=True, slots=True)
class Recall:
    identity: str
    message: str
    profile: bool


@dataclass(frozen=True, slots=True)
class Upkeep:
    pass


@dataclass(frozen=True, slots=True)
class Flush:
    pass


Op = Remember | Forget | Purge | Recall | Upkeep | Flush
WRITES = (Remember, Forget, Purge)


@st.composite
def remembers(draw: st.DrawFn) -> Remember:
    kind = draw(st.sampled_from([MemoryKind.FACT, MemoryKind.FACT, MemoryKind.FACT, MemoryKind.EPISODIC]))
    subject, key = ((draw(st.sampled_from(SUBJECTS)), draw(st.sampled_from(KEYS))) if kind is MemoryKind.FACT
                    else (None, None))
    value = draw(st.sampled_from(VALUES))
    base = draw(st.sampled_from([value, f"{(subject or 'my').strip()} {(key or 'note').strip()} {value}"]))
    content = draw(st.sampled_from([base, base.upper(), f"  {base}!"]))  # one content, three spellings
    return Remember(draw(st.sampled_from(IDENTITIES)), content, subject, key, draw(st.sampled_from(SourceRank)),
                    kind)


recalls = st.builds(Recall, st.sampled_from(IDENTITIES), st.sampled_from(VALUES).map(lambda v: f"what about {v}?"),
                    st.booleans())


# --------------------------------------------------------------------------- the model


@dataclass(slots=True)
class Expected:
    identity: str
    kind: MemoryKind
    content: str
    subject: str | None
    key: str | None
    rank: SourceRank
    status: MemoryStatus = ACTIVE
    superseded_by: str | None = None
    recalls_low: int = 0  # recalls certainly counted
    recalls_high: int = 0  # recalls perhaps counted (a profile fact counts only if the message also hit it)


class Model:
    """Every memory the machine made, as the store must hold it."""

    def __init__(self) -> None:
        self.rows: dict[str, Expected] = {}
        self.unembedded: set[str] = set()
        self.purged: dict[str, str] = {}  # id -> content

    def apply(self, op: Op, outcome: object) -> str | None:
        """Apply a write with the outcome the store reported; what disagrees, if anything."""
        if isinstance(op, Remember):
            return self._remember(op, outcome)
        assert isinstance(op, Forget | Purge)
        row = self.rows.get(op.memory_id)
        if row is None or row.identity != op.identity:
            return None if isinstance(outcome, MemoryNotFound) else f"{op} found a memory: {outcome!r}"
        if isinstance(op, Forget):
            if not isinstance(outcome, MemoryRecord) or outcome.status is not ARCHIVED or outcome.id != op.memory_id:
                return f"{op} gave {outcome!r}"
            row.status = ARCHIVED
            return None
        if outcome is not None:
            return f"{op} gave {outcome!r}"
        del self.rows[op.memory_id]
        self.unembedded.discard(op.memory_id)
        self.purged[op.memory_id] = row.content
        for other in self.rows.values():
            if other.superseded_by == op.memory_id:
                other.superseded_by = None
        return None

    def _remember(self, op: Remember, outcome: object) -> str | None:
        if not isinstance(outcome, WriteOutcome):
            return f"{op} gave {outcome!r}"
        content = check_content(op.content)
        digest = content_hash(content)
        confirmed: set[str] = set()
        if op.kind is not MemoryKind.EPISODIC:
            # Known in any state but forgotten; a pending one said again by a better source takes effect.
            repeated = {id_ for id_, r in self.rows.items() if r.identity == op.identity and r.kind is op.kind
                        and content_hash(r.content) == digest and r.status is not ARCHIVED}
            settled = {id_ for id_ in repeated if self.rows[id_].status is not PENDING}
            waiting = repeated - settled
            if settled or any(self.rows[id_].rank >= op.rank for id_ in waiting):
                if outcome.created or outcome.record.id not in (settled or waiting) or outcome.superseded:
                    return f"{op} repeats {repeated}, yet the store wrote {outcome}"
                return None
            confirmed = waiting
        subject, key = normalized_key(op.subject), normalized_key(op.key)
        current = [id_ for id_, r in self.rows.items() if key is not None and r.identity == op.identity
                   and r.subject == subject and r.key == key and r.status is ACTIVE]
        outranked = any(self.rows[id_].rank > op.rank for id_ in current)
        status, superseded = (PENDING, set()) if outranked else (ACTIVE, set(current))
        record = outcome.record
        wrote = (record.identity, record.kind, record.content, record.subject, record.key, record.source_rank,
                 record.status)
        if (not outcome.created or record.id in self.rows or record.id in self.purged
                or wrote != (op.identity, op.kind, content, subject, key, op.rank, status)
                or set(outcome.superseded) != superseded):
            return f"{op}: expected a new {status} memory superseding {superseded}, the store wrote {outcome}"
        for id_ in superseded | confirmed:
            self.rows[id_].status, self.rows[id_].superseded_by = SUPERSEDED, record.id
        self.rows[record.id] = Expected(op.identity, op.kind, content, subject, key, op.rank, status)
        self.unembedded.add(record.id)
        return None


def serial_order(model: Model, writes: Sequence[tuple[Op, object]]) -> Model | None:
    """The model after the first serial order of `writes` that explains every outcome, if one does."""
    for order in itertools.permutations(writes):
        candidate = copy.deepcopy(model)
        if all(candidate.apply(op, outcome) is None for op, outcome in order):
            return candidate
    return None


# --------------------------------------------------------------------------- the machine


class MemoryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.dir = Path(tempfile.mkdtemp(prefix="ember-memory-model-"))
        self.db = self.database()
        self.run(self.db.open())
        self.clock = Clock(time.time())
        self.memory = MemoryService(SqlMemoryStore(self.db), PacedEmbedder(), clock=self.clock)
        self.run(self.memory.open())
        self.model = Model()
        self.fading_due = False  # ages passed since the last upkeep: it must archive what faded

    def database(self) -> SqliteDatabase:
        """The store this example runs on (not opened yet)."""
        return SqliteDatabase(self.dir / "ember.db")

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.run(self.db.close())
        self.loop.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # Doing things, one at a time or many at once.

    def ids(self, *, recent: bool = False) -> st.SearchStrategy[str]:
        """Any id the machine has seen (purged ones too), or one that never existed; with `recent`, one of
        the three newest. Drawn as an index: the ids and how many there are may differ between runs of
        one example (they are random, and a batch's serial order may differ)."""
        rows = list(self.model.rows)
        ids = (rows[-3:] or ["no-such-id"]) if recent else [*rows, *rows, *rows, *self.model.purged, "no-such-id"]
        return st.integers(0, 1_000).map(lambda i: ids[i % len(ids)])

    def ops(self) -> st.SearchStrategy[Op]:
        targets = st.tuples(st.sampled_from(IDENTITIES), self.ids())
        return st.one_of(remembers(), remembers(), recalls, st.just(Upkeep()), st.just(Flush()),
                         targets.map(lambda t: Forget(*t)), targets.map(lambda t: Purge(*t)))

    async def perform(self, op: Op) -> object:
        try:
            if isinstance(op, Remember):
                return await self.memory.remember(op.identity, op.content, subject=op.subject, key=op.key,
                                                  source_rank=op.rank, kind=op.kind, created_at=self.clock.now)
            if isinstance(op, Forget):
                return await self.memory.forget(op.identity, op.memory_id)
            if isinstance(op, Purge):
                return await self.memory.store.purge(op.identity, op.memory_id)
            if isinstance(op, Recall):
                return await self.memory.for_prompt(op.identity, op.message,
                                                    budget=WITH_PROFILE if op.profile else WITHOUT_PROFILE)
            if isinstance(op, Upkeep):
                return await self.memory.upkeep()
            return await self.memory.flush_embeddings()
        except MemoryNotFound as exc:
            return exc

    async def at_once(self, ops: Sequence[Op]) -> list[object]:
        return await asyncio.gather(*(self.perform(op) for op in ops))

    def do(self, ops: Sequence[Op]) -> None:
        """Run `ops` at once; their writes must be explained by a serial order, the rest checked as it ran."""
        unembedded_before = set(self.model.unembedded)
        outcomes = self.run(self.at_once(ops))
        writes = [(op, outcome) for op, outcome in zip(ops, outcomes) if isinstance(op, WRITES)]
        after = serial_order(self.model, writes)
        assert after is not None, f"no serial order of the writes explains their outcomes: {writes}"
        self.model = after
        for op, outcome in zip(ops, outcomes):
            if isinstance(op, Recall):
                assert isinstance(outcome, PromptMemory)
                self.check_prompt(op, outcome, alone=len(ops) == 1)
            elif isinstance(op, Flush) and len(ops) == 1:
                assert outcome == len(unembedded_before), "flush_embeddings embedded more or less than was new"
        if any(isinstance(op, Flush) for op in ops):
            left = set(self.run(self.unembedded_ids()))
            assert left <= self.model.unembedded, f"vectors went missing: {left - self.model.unembedded}"
            self.model.unembedded = left
        if any(isinstance(op, Upkeep) for op in ops):
            # A memory recalled while the upkeep ran may be spared by it, or archived just before.
            recalled_beside = {record.id for op, outcome in zip(ops, outcomes) if isinstance(op, Recall)
                               for record in (*outcome.profile, *outcome.recalled)}
            self.settle_upkeep(recalled_beside)

    @rule(ops=st.lists(remembers(), min_size=1, max_size=3))
    def remember(self, ops: list[Remember]) -> None:
        for op in ops:
            self.do([op])

    @precondition(lambda self: any(r.key is not None and r.status is ACTIVE for r in self.model.rows.values()))
    @rule(data=st.data(), value=st.sampled_from(VALUES), rank=st.sampled_from(SourceRank))
    def supersede(self, data: st.DataObject, value: str, rank: SourceRank) -> None:
        """A new value for an active fact's subject and key: it replaces the fact unless outranked."""
        facts = [id_ for id_, r in self.model.rows.items() if r.key is not None and r.status is ACTIVE]
        old_id = facts[data.draw(st.integers(0, 1_000)) % len(facts)]
        old = self.model.rows[old_id]
        self.do([Remember(old.identity, f"{old.subject or 'my'} {old.key} is now {value}", old.subject, old.key,
                          rank, MemoryKind.FACT)])
        if self.model.rows[old_id].status is SUPERSEDED:
            self.search_for(old_id, include_inactive=False)
            self.search_for(old_id, include_inactive=True)

    @rule(data=st.data(), identity=st.sampled_from(IDENTITIES))
    def forget(self, data: st.DataObject, identity: str) -> None:
        self.do([Forget(identity, data.draw(self.ids()))])

    @rule(data=st.data(), identity=st.sampled_from(IDENTITIES), recent=st.booleans())
    def purge(self, data: st.DataObject, identity: str, recent: bool) -> None:
        self.do([Purge(identity, data.draw(self.ids(recent=recent)))])

    @rule(op=recalls, then_upkeep=st.booleans())
    def recall(self, op: Recall, then_upkeep: bool) -> None:
        self.do([op])
        if then_upkeep:
            self.do([Upkeep()])

    @rule()
    def upkeep(self) -> None:
        self.do([Upkeep()])

    @rule()
    def flush(self) -> None:
        self.do([Flush()])

    @rule()
    def ages_pass(self) -> None:
        self.clock.now += AGES_S
        self.fading_due = True

    @rule(data=st.data())
    def concurrently(self, data: st.DataObject) -> None:
        self.together(data.draw(st.lists(self.ops(), min_size=2, max_size=5), label="batch"))

    @rule(data=st.data())
    def jobs_beside_a_turn(self, data: st.DataObject) -> None:
        """What a serving process does at once: two background jobs (the runner runs two at a time),
        while a turn recalls and someone remembers or purges."""
        jobs = data.draw(st.lists(st.sampled_from([Upkeep(), Flush()]), min_size=2, max_size=2), label="jobs")
        targets = st.tuples(st.sampled_from(IDENTITIES), self.ids(recent=True))
        turn = data.draw(st.lists(st.one_of(recalls, remembers(), targets.map(lambda t: Purge(*t))), max_size=2),
                         label="turn")
        self.together([*jobs, *turn])

    def together(self, ops: list[Op]) -> None:
        upkeeps = sum(isinstance(op, Upkeep) for op in ops)
        if upkeeps and self.fading_due:  # which facts a write finds active would depend on the fading
            ops = [op for op in ops if not isinstance(op, WRITES)]
        if upkeeps > 1:  # a recall counted between two upkeeps may land after its memory faded
            ops = [op for op in ops if not isinstance(op, Recall)]
        note(f"at once: {ops}")
        self.do(ops)

    @rule(data=st.data(), include_inactive=st.booleans())
    def search(self, data: st.DataObject, include_inactive: bool) -> None:
        self.search_for(data.draw(self.ids()), include_inactive=include_inactive)

    # Checks of what searches and prompts return, where they are made.

    def search_for(self, memory_id: str, *, include_inactive: bool) -> None:
        """Each person searches for a memory's words: only its owner finds it, and only while it is
        active unless `include_inactive`; a purged memory is found by nobody."""
        target = self.model.rows.get(memory_id)
        content = target.content if target else self.model.purged.get(memory_id, "paris mochi")
        fresh = MemoryService(self.memory.store, EMBEDDER, clock=self.clock)  # with no vectors cached
        for identity in IDENTITIES:
            running, again = (self.run(service.search(identity, content, limit=100, include_inactive=include_inactive))
                              for service in (self.memory, fresh))
            assert {(h.record.id, round(h.score, 5)) for h in running} == {
                (h.record.id, round(h.score, 5)) for h in again}, "this process ranks otherwise than a fresh one"
            hits = [h.record for h in running]
            self.check_owned(identity, hits, include_inactive=include_inactive)
            found = memory_id in {r.id for r in hits}
            visible = target is not None and target.identity == identity and (
                include_inactive or target.status is ACTIVE)
            assert found <= visible, f"{identity} found {memory_id} ({target}) with include_inactive={include_inactive}"
            owned = sum(r.identity == identity for r in self.model.rows.values())
            assert found or not visible or owned > 100, f"{identity} did not find their own {target}"

    def check_owned(self, identity: str, records: Sequence[MemoryRecord], *, include_inactive: bool) -> None:
        for record in records:
            row = self.model.rows.get(record.id)
            assert record.identity == identity and row is not None and row.identity == identity, \
                f"{identity} was shown {record}"
            assert include_inactive or (record.status is ACTIVE and row.status is ACTIVE), \
                f"{identity} was shown an inactive memory: {record}"

    def check_prompt(self, op: Recall, prompt: PromptMemory, *, alone: bool) -> None:
        """A prompt holds the person's active memories only: profile facts, then recalled ones not
        among them. Run alone, the profile is every active fact, keyed or not (within its budget)."""
        shown = [*prompt.profile, *prompt.recalled]
        assert all(r.identity == op.identity and r.status is ACTIVE for r in shown), f"{op} was given {shown}"
        assert all(r.kind is MemoryKind.FACT for r in prompt.profile)
        assert all(r.kind in RECALLED_KINDS for r in prompt.recalled)
        assert not {r.id for r in prompt.profile} & {r.id for r in prompt.recalled}
        if alone:
            self.check_owned(op.identity, shown, include_inactive=False)
            facts = {id_ for id_, r in self.model.rows.items() if r.identity == op.identity and r.status is ACTIVE
                     and r.kind is MemoryKind.FACT}
            if not op.profile:
                assert prompt.profile == ()
            elif len(facts) <= WITH_PROFILE.profile_facts:
                assert {r.id for r in prompt.profile} == facts
            else:
                assert len(prompt.profile) == WITH_PROFILE.profile_facts and {r.id for r in prompt.profile} <= facts
        for record in prompt.recalled:
            if (row := self.model.rows.get(record.id)) is not None:
                row.recalls_low += 1
                row.recalls_high += 1
        for record in prompt.profile:
            if (row := self.model.rows.get(record.id)) is not None:
                row.recalls_high += 1

    def settle_upkeep(self, recalled_beside: frozenset[str] | set[str] = frozenset()) -> None:
        """After an upkeep: a memory is archived exactly when it faded (ages passed and it was not
        recalled since), each active one has the strength the policy gives it, and the recalls
        counted so far are written (all of them, unless a recall came in after the upkeep took them)."""
        policy, now = ForgettingPolicy(), self.clock.now
        records = {r.id: r for identity in IDENTITIES
                   for r in self.run(self.memory.store.list(identity, include_inactive=True, limit=10_000))}
        for id_, row in self.model.rows.items():
            record = records[id_]
            if row.status is ACTIVE:
                faded = self.fading_due and policy.fades_out(record, now)
                if faded and id_ in recalled_beside and record.status is ACTIVE:
                    continue
                assert (record.status is ARCHIVED) == faded, f"faded {faded}, yet the store has {record}"
                if faded:
                    row.status = ARCHIVED
                else:
                    assert record.strength == round(policy.strength(record, now), 4), f"a stale strength: {record}"
            if not self.memory.recalls_pending:
                assert row.recalls_low <= record.recall_count <= row.recalls_high, f"recalls lost: {record}"
                row.recalls_low = row.recalls_high = record.recall_count
        self.fading_due = False

    async def unembedded_ids(self) -> list[str]:
        return await self.db.run_read(lambda tx: [id_ for (id_,) in tx.execute(Statement(
            "SELECT id FROM memory_items WHERE embedding_model IS NULL")).fetchall()])

    # The store against the model, after every step.

    @invariant()
    def store_matches_model(self) -> None:
        stored = {row.id: row for row in self.run(self.db.run_read(read_rows))}
        lost, unknown = set(self.model.rows) - set(stored), set(stored) - set(self.model.rows)
        assert not lost and not unknown, f"lost {lost}, resurrected or unknown {unknown}"
        for id_, row in self.model.rows.items():
            s = stored[id_]
            assert (s.identity, s.kind, s.status, s.content, s.subject, s.key, s.rank, s.superseded_by) == (
                row.identity, row.kind, row.status, row.content, row.subject, row.key, row.rank, row.superseded_by)
            assert s.recall_count <= row.recalls_high, f"more recalls than were made: {s}"
        assert {id_ for id_, s in stored.items() if s.embedding_model is None} == self.model.unembedded
        self.check_shape(list(stored.values()))

    def check_shape(self, stored: list[Stored]) -> None:
        """What holds of any store, whatever was done to it."""
        by_id = {s.id: s for s in stored}
        facts = [(s.identity, s.subject, s.key) for s in stored if s.status is ACTIVE and s.key is not None]
        assert len(facts) == len(set(facts)), f"two active facts for one subject and key: {facts}"
        repeats = [(s.identity, s.digest, s.kind) for s in stored
                   if s.kind is not MemoryKind.EPISODIC and s.status in (ACTIVE, PENDING)]
        assert len(repeats) == len(set(repeats)), "one content twice among the active and pending memories"
        for s in stored:
            successor = by_id.get(s.superseded_by or "")
            assert s.superseded_by is None or (successor is not None and successor.identity == s.identity), s
        counts = self.run(self.memory.store.consistency())
        assert counts == {"rows": len(stored), "text_rows": len(stored), "rows_without_text": 0,
                          "orphan_vectors": 0, "unembedded": sum(s.embedding_model is None for s in stored),
                          "miscounted_vectors": 0}, counts
        owners, vectors = self.run(self.db.run_read(read_index))
        assert owners == {s.num: owner_token(s.identity) for s in stored}, "a text row under another owner"
        assert {num: (identity, model) for num, (identity, model, _) in vectors.items()} == {
            s.num: (s.identity, s.embedding_model) for s in stored if s.embedding_model}, \
            "a vector missing, under another owner or of another model"
        for s in stored:
            if s.embedding_model is not None:
                made = np.frombuffer(vectors[s.num][2], dtype=np.float32)
                assert np.allclose(made, EMBEDDER.embed_passages([s.content])[0]), f"the vector of another text: {s}"


@dataclass(frozen=True, slots=True)
class Stored:
    num: int
    id: str
    identity: str
    kind: MemoryKind
    status: MemoryStatus
    content: str
    digest: str
    subject: str | None
    key: str | None
    rank: SourceRank
    superseded_by: str | None
    recall_count: int
    embedding_model: str | None


_ROWS = Statement("SELECT num, id, identity, kind, status, content, content_hash, subject, fact_key, source_rank, "
                  "superseded_by, recall_count, embedding_model FROM memory_items")
_OWNERS = Statement("SELECT rowid, owner FROM memory_fts")
_VECTORS = Statement("SELECT num, identity, model, vector FROM memory_vectors")


def read_rows(tx: Tx) -> list[Stored]:
    rows = tx.execute(_ROWS).fetchall()
    return [Stored(num, id_, identity, MemoryKind(kind), MemoryStatus(status), content, digest, subject, key,
                   SourceRank(rank), superseded_by, recall_count, model)
            for num, id_, identity, kind, status, content, digest, subject, key, rank, superseded_by,
            recall_count, model in rows]


def read_index(tx: Tx) -> tuple[dict[int, str], dict[int, tuple[str, str, bytes]]]:
    owners = dict(tx.execute(_OWNERS).fetchall())
    vectors = {num: (identity, model, vector) for num, identity, model, vector in tx.execute(_VECTORS).fetchall()}
    return owners, vectors


def on_postgresql(server: PgServer, schema: str) -> type[MemoryMachine]:
    """The same machine with each example in a PostgreSQL database of its own."""

    class PostgresMemoryMachine(MemoryMachine):
        url: str | None = None

        def database(self) -> SqliteDatabase:
            if self.url is None:
                self.url = server.fresh_database(template=schema)
            return PostgresDatabase(self.url)  # type: ignore[return-value]

        def teardown(self) -> None:
            super().teardown()
            if self.url is not None:
                server.drop_database(self.url)

    return PostgresMemoryMachine


# PostgreSQL runs fewer examples: each costs a database of its own and a round trip per statement.
EXAMPLES = {"sqlite": 80, "postgresql": 10}


@pytest.mark.parametrize("engine", ENGINES)
def test_memory_matches_its_model(engine: str, request: pytest.FixtureRequest) -> None:
    machine = (MemoryMachine if engine == "sqlite"
               else on_postgresql(request.getfixturevalue("pg_server"), request.getfixturevalue("pg_schema")))
    # No shrinking: it would take minutes over these examples; the smallest forms are pinned below.
    run_state_machine_as_test(machine, settings=settings(
        max_examples=EXAMPLES[engine], stateful_step_count=40, deadline=None, derandomize=True, database=None,
        phases=(Phase.explicit, Phase.generate), suppress_health_check=[HealthCheck.too_slow]))


# --------------------------------------------------------------------------- what the machine found


class GatedEmbedder(HashingEmbedder):
    """The hashing embedder, held inside its next call until `release` (it runs in a worker thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.released, self.armed = threading.Event(), threading.Event(), False

    def embed_passages(self, texts: Sequence[str]) -> Any:
        if self.armed:
            self.armed = False
            self.entered.set()
            assert self.released.wait(10)
        return super().embed_passages(texts)

    async def hold(self) -> None:
        """Arm; return once an embedding call is held (it has read its batch)."""
        self.armed = True
        assert await asyncio.to_thread(self.entered.wait, 10)


@pytest.fixture(params=ENGINES)
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SqliteDatabase]:
    """The bugs the machine found stay fixed on both engines."""
    database = await engine_database(request.param, request, tmp_path)
    yield database  # type: ignore[misc]
    await database.close()


async def service_on(db: SqliteDatabase, embedder: HashingEmbedder, clock: Clock | None = None) -> MemoryService:
    service = MemoryService(SqlMemoryStore(db), embedder, clock=clock or Clock(time.time()))
    await service.open()
    return service


async def test_a_purge_while_the_embedding_runs_leaves_no_vector_behind(db: SqliteDatabase) -> None:
    embedder = GatedEmbedder()
    memory = await service_on(db, embedder)
    doomed = await memory.remember("bob", "Bob's old phone number is 555-0199.")
    flush = asyncio.create_task(memory.flush_embeddings())
    await embedder.hold()  # the embedding job has read the memory and is making its vector
    await memory.store.purge("bob", doomed.record.id)
    embedder.released.set()
    await flush
    counts = await memory.store.consistency()
    assert counts["rows"] == 0 and counts["orphan_vectors"] == 0, counts


async def test_a_memory_written_where_a_purged_one_was_gets_its_own_vector(db: SqliteDatabase) -> None:
    embedder = GatedEmbedder()
    memory = await service_on(db, embedder)
    doomed = await memory.remember("bob", "Bob's old phone number is 555-0199.")
    flush = asyncio.create_task(memory.flush_embeddings())
    await embedder.hold()  # the embedding job has read bob's memory and is making its vector
    await memory.store.purge("bob", doomed.record.id)
    fresh = await memory.remember("alice", "Alice drinks green tea.")
    embedder.released.set()
    await flush
    await memory.flush_embeddings()
    [(identity, vector)] = await db.run_read(lambda tx: tx.execute(Statement(
        "SELECT v.identity, v.vector FROM memory_vectors v JOIN memory_items m ON m.num = v.num "
        "WHERE m.id = :id"), {"id": fresh.record.id}).fetchall())
    assert identity == "alice", "alice's memory has a vector filed under bob"
    assert np.allclose(np.frombuffer(vector, dtype=np.float32), HashingEmbedder().embed_passages(
        ["Alice drinks green tea."])[0]), "alice's memory has the vector of bob's purged one"


async def test_a_purged_memory_no_longer_steers_search_in_a_running_process(db: SqliteDatabase) -> None:
    memory = await service_on(db, HashingEmbedder())
    await memory.remember("carol", "Carol plays the violin.")
    secret = await memory.remember("carol", "Carol's diary: the key is under the lighthouse mat.")
    await memory.flush_embeddings()
    await memory.search("carol", "violin")  # the process now holds carol's vectors
    await memory.store.purge("carol", secret.record.id)
    await memory.remember("carol", "Carol waters the garden on Sundays.")
    await memory.flush_embeddings()
    question = "where is the key of the diary? lighthouse"
    running = {(h.record.content, round(h.score, 6)) for h in await memory.search("carol", question)}
    fresh = await service_on(db, HashingEmbedder())
    assert running == {(h.record.content, round(h.score, 6)) for h in await fresh.search("carol", question)}


class SlowDiskStore(SqlMemoryStore):
    """The real store, whose recall counts reach the disk only once `written` is set (a slow fsync)."""

    def __init__(self, db: SqliteDatabase) -> None:
        super().__init__(db)
        self.written = asyncio.Event()

    async def note_recalls(self, recalls: dict[tuple[str, str], tuple[int, float]]) -> None:
        await self.written.wait()
        await super().note_recalls(recalls)


async def test_two_upkeeps_at_once_never_archive_a_memory_just_recalled(db: SqliteDatabase) -> None:
    clock = Clock(time.time())
    store = SlowDiskStore(db)
    memory = MemoryService(store, HashingEmbedder(), clock=clock)
    kept = await memory.remember("alice", "The user's cat is called Mochi.", source_rank=SourceRank.INFERRED,
                                 created_at=clock.now)
    clock.now += AGES_S  # long faded, unless recalled
    prompt = await memory.for_prompt("alice", "what is my cat called? Mochi", budget=WITHOUT_PROFILE)
    assert [r.id for r in prompt.recalled] == [kept.record.id]
    # The background runner runs two jobs at a time: one upkeep job may run while the next is claimed.
    first = asyncio.create_task(memory.upkeep())  # takes the recall and writes it
    await asyncio.sleep(0)
    second = asyncio.create_task(memory.upkeep())  # its sweep must wait for the recall the first one writes
    await asyncio.sleep(0.05)
    assert not second.done()
    store.written.set()
    await asyncio.gather(first, second)
    record = await memory.store.get("alice", kept.record.id)
    assert record.recall_count == 1 and record.status is MemoryStatus.ACTIVE, record


async def test_a_pending_fact_the_person_then_states_takes_effect(db: SqliteDatabase) -> None:
    memory = await service_on(db, HashingEmbedder())
    berlin = await memory.remember("alice", "I live in Berlin.", subject="user", key="city")
    guessed = await memory.remember("alice", "I live in Paris.", subject="user", key="city",
                                    source_rank=SourceRank.INFERRED)
    assert guessed.record.status is MemoryStatus.PENDING  # outranked by what she said: parked
    stated = await memory.remember("alice", "I live in Paris.", subject="user", key="city")
    assert stated.record.status is MemoryStatus.ACTIVE, stated
    assert (await memory.store.get("alice", berlin.record.id)).status is MemoryStatus.SUPERSEDED


async def test_a_pending_fact_said_again_by_a_source_still_outranked_waits_once(db: SqliteDatabase) -> None:
    memory = await service_on(db, HashingEmbedder())
    await memory.remember("alice", "I live in Berlin.", subject="user", key="city")
    guessed = await memory.remember("alice", "I live in Paris.", subject="user", key="city",
                                    source_rank=SourceRank.INFERRED)
    summed_up = await memory.remember("alice", "I live in Paris!", subject="user", key="city",
                                      source_rank=SourceRank.CONSOLIDATED)
    assert summed_up.created and summed_up.record.status is MemoryStatus.PENDING
    waiting = [r for r in await memory.store.list("alice", include_inactive=True) if r.status is MemoryStatus.PENDING]
    assert [r.id for r in waiting] == [summed_up.record.id]  # the better-sourced one, not both
    assert (await memory.store.get("alice", guessed.record.id)).superseded_by == summed_up.record.id


async def test_a_message_whose_neighbour_arrives_while_it_is_embedded_gets_its_new_window(db: SqliteDatabase) -> None:
    embedder = GatedEmbedder()
    memory = await service_on(db, embedder)
    sessions = SqlSessionStore(db)
    session = await sessions.load("test:c1")
    await sessions.append(session, [Message.user("I am planning a trip."), Message.assistant("Where to?")])
    archiving = asyncio.create_task(memory.archive_session("test:c1"))
    await embedder.hold()  # the archive wrote both messages, and embedding them has read them
    session = await sessions.load("test:c1")
    await sessions.append(session, [Message.user("To Lisbon, in May.")])
    # "Where to?" learns its next neighbour; this archive's own embedding waits for the first.
    next_archive = asyncio.create_task(memory.archive_session("test:c1"))
    lisbon = Statement("SELECT COUNT(*) FROM memory_items WHERE content = 'To Lisbon, in May.'")
    async with asyncio.timeout(10):
        while not await db.run_read(lambda tx: tx.execute(lisbon).fetchone()[0]):
            await asyncio.sleep(0.01)
    embedder.released.set()
    await asyncio.gather(archiving, next_archive)
    rows = await db.run_read(lambda tx: tx.execute(Statement(
        "SELECT m.content, m.context_json, v.window FROM memory_items m JOIN memory_vectors v ON v.num = m.num "
        "WHERE m.content = 'Where to?'")).fetchall())
    [(content, context, window)] = rows
    neighbours = Context.from_json(context)
    assert "Lisbon" in neighbours.after
    embedder = HashingEmbedder()
    expected = window_vector(embedder.embed_passages([content])[0], list(embedder.embed_passages(
        list(neighbours.adjacent))), list(embedder.embed_passages(list(neighbours.far))))
    assert np.allclose(np.frombuffer(window, dtype=np.float32), expected), \
        "the window vector is of the message's old neighbours"


async def test_one_fact_said_several_times_at_once_is_one_memory(db: SqliteDatabase) -> None:
    # PostgreSQL runs writes side by side: each found no such fact yet, and each added it.
    memory = await service_on(db, HashingEmbedder())
    outcomes = await asyncio.gather(*(memory.remember("alice", "I live in Paris.", subject="user", key="city")
                                      for _ in range(4)))
    assert sum(outcome.created for outcome in outcomes) == 1 and len({o.record.id for o in outcomes}) == 1
    assert [r.content for r in await memory.store.list("alice", include_inactive=True)] == ["I live in Paris."]


async def test_upkeeps_and_embeddings_at_once_never_deadlock(db: SqliteDatabase) -> None:
    # On PostgreSQL each locked the rows it updated, in an order of its own, and one of them failed.
    clock = Clock(time.time())
    memory = await service_on(db, HashingEmbedder(), clock)
    for round_ in range(3):
        for i in range(12):
            await memory.remember(IDENTITIES[i % 2], f"note {round_} {i} about {VALUES[i % len(VALUES)]}",
                                  created_at=clock.now)
        for value in VALUES:
            await memory.for_prompt("alice", f"what about {value}?", budget=WITHOUT_PROFILE)
        clock.now += AGES_S / 100
        await asyncio.gather(memory.upkeep(), memory.upkeep(), memory.flush_embeddings(), memory.upkeep())
    assert (await memory.store.consistency())["unembedded"] == 0
