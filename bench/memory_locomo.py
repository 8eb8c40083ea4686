"""Recall on LoCoMo through Ember's own memory, beside plain FTS5 BM25 measured in the same run.

Each conversation is one person's history: its sessions are appended as
Ember sessions (SqlSessionStore.append, the turn path), copied into the
archival tier by the same job a live turn queues, embedded by the default
embedder, and every question is asked as a query to MemoryService.search (no
model at query time). Prints session-level R@1/5/10 (every question with
evidence) and turn-level R@1/5/10 (categories 1–4), per category, query
median/p95 and ingest time per conversation.

    .venv/bin/python bench/memory_locomo.py [--data PATH] [--conversations N] [--index-min-rows N]
        [--engines sqlite postgresql] [--embedding e5-small|hashing|none]

`--engines postgresql` runs Ember's side on a throwaway PostgreSQL (tests/pgserver.py) as
well, reported beside SQLite's; `--embedding none` measures the words alone.

The data is LoCoMo (CC BY-NC 4.0, evaluation only): it is read from outside
the repository and never shipped with Ember.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import re
import sqlite3
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ember.core.memory import MemoryKind
from ember.core.messages import Message, Session
from ember.memory.embeddings import load_embedder
from ember.memory.service import MemoryService
from ember.memory.text_index import INDEX_MIN_ROWS
from ember.store.engine import Database
from ember.store.memories import SqlMemoryStore
from ember.store.postgres import PostgresDatabase
from ember.store.sessions import SqlSessionStore
from ember.store.sqlite.database import SqliteDatabase
from ember.store.tx import Statement

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "locomo" / "locomo10.json"
KS = (1, 5, 10)
DEPTH = 50  # turns retrieved per question; sessions are ranked by their best turn among them
CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}


@dataclass(frozen=True, slots=True)
class Turn:
    dia_id: str
    session: str  # "D3"
    speaker: str
    said: str  # the message, with the image it shares
    when: float

    @property
    def text(self) -> str:
        """The turn as the transcript line the baseline indexes."""
        return f"{self.speaker}: {self.said}"


@dataclass(frozen=True, slots=True)
class Question:
    text: str
    evidence: tuple[str, ...]
    category: int


@dataclass(slots=True)
class Conversation:
    name: str
    turns: list[Turn]
    questions: list[Question]


def parse_when(text: str) -> float:
    """LoCoMo's "1:56 pm on 8 May, 2023"."""
    return dt.datetime.strptime(text.strip(), "%I:%M %p on %d %B, %Y").replace(tzinfo=dt.UTC).timestamp()


def said(turn: dict[str, str]) -> str:
    caption = turn.get("blip_caption")
    return turn["text"] + (f" [shares an image: {caption}]" if caption else "")


def load(path: Path) -> list[Conversation]:
    conversations = []
    for sample in json.loads(path.read_text()):
        conv = sample["conversation"]
        turns: list[Turn] = []
        number = 1
        while f"session_{number}" in conv:
            when = parse_when(conv[f"session_{number}_date_time"])
            for offset, turn in enumerate(conv[f"session_{number}"] or []):
                turns.append(Turn(turn["dia_id"], f"D{number}", turn["speaker"], said(turn), when + offset))
            number += 1
        questions = [Question(q["question"], tuple(q.get("evidence") or ()), q["category"]) for q in sample["qa"]]
        conversations.append(Conversation(sample["sample_id"], turns, questions))
    return conversations


# A ranker answers a question with dia_ids, best first.
Ranker = Callable[[str], Sequence[str]]


@dataclass(slots=True)
class Scores:
    session: dict[int, list[bool]] = field(default_factory=lambda: {k: [] for k in KS})
    turn: dict[int, list[bool]] = field(default_factory=lambda: {k: [] for k in KS})
    session_by_cat: dict[int, dict[int, list[bool]]] = field(default_factory=lambda: defaultdict(
        lambda: {k: [] for k in KS}))
    turn_by_cat: dict[int, dict[int, list[bool]]] = field(default_factory=lambda: defaultdict(
        lambda: {k: [] for k in KS}))
    latency_ms: list[float] = field(default_factory=list)

    def add(self, question: Question, ranked: Sequence[str], elapsed_ms: float) -> None:
        self.latency_ms.append(elapsed_ms)
        sessions = list(dict.fromkeys(dia.split(":")[0] for dia in ranked))
        wanted_sessions = {e.split(":")[0] for e in question.evidence}
        for k in KS:
            hit = bool(wanted_sessions & set(sessions[:k]))
            self.session[k].append(hit)
            self.session_by_cat[question.category][k].append(hit)
        if question.category in (1, 2, 3, 4):
            for k in KS:
                hit = bool(set(question.evidence) & set(ranked[:k]))
                self.turn[k].append(hit)
                self.turn_by_cat[question.category][k].append(hit)


def rate(hits: list[bool]) -> str:
    return f"{sum(hits) / len(hits):.3f}" if hits else "-"


def measure(conversations: list[Conversation], rankers: list[Ranker], scores: Scores) -> None:
    for conversation, rank in zip(conversations, rankers):
        for question in conversation.questions:
            if not question.evidence:
                continue
            started = time.perf_counter()
            ranked = rank(question.text)
            scores.add(question, ranked, (time.perf_counter() - started) * 1000)


# -- the baseline: plain FTS5 BM25 over the same turns --------------------------------

_WORD = re.compile(r"\w+")


def bm25_ranker(conversation: Conversation) -> Ranker:
    db = sqlite3.connect(":memory:")
    db.execute("CREATE VIRTUAL TABLE turns USING fts5(text, tokenize='porter unicode61')")
    db.executemany("INSERT INTO turns (rowid, text) VALUES (?, ?)",
                   [(i, turn.text) for i, turn in enumerate(conversation.turns)])

    def rank(question: str) -> list[str]:
        words = " OR ".join(f'"{w}"' for w in dict.fromkeys(_WORD.findall(question.lower())))
        if not words:
            return []
        rows = db.execute("SELECT rowid FROM turns WHERE turns MATCH ? ORDER BY rank LIMIT ?", (words, DEPTH))
        return [conversation.turns[i].dia_id for (i,) in rows]

    return rank


# -- Ember ------------------------------------------------------------------------

async def ingest(conversation: Conversation, db: Database, memory: MemoryService) -> dict[tuple[str, int], str]:
    """The conversation as sessions of one person; returns (session key, seq) -> dia_id."""
    sessions = SqlSessionStore(db)
    identity = f"locomo-{conversation.name}"
    where: dict[tuple[str, int], str] = {}
    by_session: dict[str, list[Turn]] = defaultdict(list)
    for turn in conversation.turns:
        by_session[turn.session].append(turn)
    for name, turns in by_session.items():
        key = f"bench:{conversation.name}:{name}"
        session = Session(key=key, metadata={"identity": identity})
        # Both speakers are people: each message carries its author's name, as in a group chat.
        first = turns[0].speaker
        messages = [Message.user(t.said, name=t.speaker) if t.speaker == first
                    else Message.assistant(t.said, name=t.speaker) for t in turns]
        await sessions.append(session, messages)
        # The conversation happened on its own dates, not today.
        await db.run_write(lambda tx, key=key, turns=turns: tx.executemany(
            Statement("UPDATE messages SET created_at = :at WHERE session_key = :key AND seq = :seq"),
            [{"at": t.when, "key": key, "seq": seq} for seq, t in enumerate(turns)]))
        await memory.archive_session(key)
        where.update({(key, seq): t.dia_id for seq, t in enumerate(turns)})
    await memory.flush_embeddings()
    return where


async def ember_rankers(conversations: list[Conversation], db: Database, index_min_rows: int,
                        embedding: str) -> tuple[list[Ranker], list[float]]:
    memory = MemoryService(SqlMemoryStore(db), load_embedder(embedding), index_min_rows=index_min_rows)
    await memory.open()
    loop = asyncio.get_running_loop()
    rankers, ingest_s = [], []
    for conversation in conversations:
        started = time.perf_counter()
        where = await ingest(conversation, db, memory)
        ingest_s.append(time.perf_counter() - started)
        identity = f"locomo-{conversation.name}"
        await memory.prepare(identity)  # the derived indexes, when it has index_min_rows memories
        print(f"  ingested {conversation.name}: {len(conversation.turns)} turns in {ingest_s[-1]:.1f} s",
              flush=True)

        def rank(question: str, identity: str = identity, where: dict = where) -> list[str]:
            future = asyncio.run_coroutine_threadsafe(
                memory.search(identity, question, limit=DEPTH, kinds=(MemoryKind.ARCHIVAL,), relevant_only=False),
                loop)
            hits = future.result()
            return [where[(h.record.session_key, h.record.seq_start)] for h in hits
                    if (h.record.session_key, h.record.seq_start) in where]

        rankers.append(rank)
    return rankers, ingest_s


def report(label: str, scores: Scores) -> None:
    latency = sorted(scores.latency_ms)
    p95 = latency[int(0.95 * (len(latency) - 1))]
    print(f"\n{label}")
    print(f"  session R@1/5/10 ({len(scores.session[1])} questions): "
          + " / ".join(rate(scores.session[k]) for k in KS))
    print(f"  turn    R@1/5/10 ({len(scores.turn[1])} questions):   "
          + " / ".join(rate(scores.turn[k]) for k in KS))
    for category in sorted(scores.session_by_cat):
        turn = scores.turn_by_cat.get(category)
        print(f"    category {category} {CATEGORIES[category]:<11}: session R@5 "
              f"{rate(scores.session_by_cat[category][5])}"
              + (f", turn R@5 {rate(turn[5])} R@10 {rate(turn[10])}" if turn else ""))
    print(f"  query median {statistics.median(latency):.1f} ms, p95 {p95:.1f} ms")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--conversations", type=int, default=10)
    parser.add_argument("--index-min-rows", type=int, default=INDEX_MIN_ROWS,
                        help="from how many memories search goes through the derived indexes (tantivy, faiss);"
                             " each conversation has a few hundred, so 1 measures them here")
    parser.add_argument("--engines", nargs="+", choices=("sqlite", "postgresql"), default=["sqlite"])
    parser.add_argument("--embedding", default="e5-small", help="e5-small (default), hashing or none")
    args = parser.parse_args()
    if not args.data.exists():
        sys.exit(f"no LoCoMo data at {args.data}; pass --data PATH to locomo10.json")
    conversations = load(args.data)[: args.conversations]
    print(f"LoCoMo: {len(conversations)} conversations, {sum(len(c.turns) for c in conversations)} turns")

    baseline = Scores()
    measure(conversations, [bm25_ranker(c) for c in conversations], baseline)
    report("plain FTS5 BM25 (porter unicode61, question words OR-ed)", baseline)

    for engine in args.engines:
        with tempfile.TemporaryDirectory(prefix="ember-locomo-") as home, opened(engine, Path(home)) as open_db:
            db = await open_db
            try:
                rankers, ingest_s = await ember_rankers(conversations, db, args.index_min_rows, args.embedding)
                ember = Scores()
                await asyncio.to_thread(measure, conversations, rankers, ember)
            finally:
                await db.close()
        through = ("the derived indexes" if args.index_min_rows <= min(len(c.turns) for c in conversations)
                   else "the store's full-text search and every vector")
        report(f"Ember memory on {engine} (MemoryService.search: CJK-aware BM25 + {args.embedding} vectors, "
               f"fused; through {through})", ember)
        print(f"  ingest per conversation: median {statistics.median(ingest_s):.1f} s, "
              f"max {max(ingest_s):.1f} s (append, archive, embed)")
    print("\ntargets: session R@5 >= 0.96, turn R@10 >= 0.85 (with e5-small)")


@contextmanager
def opened(engine: str, home: Path) -> Iterator[Awaitable[Database]]:
    """A store on `engine`, to be awaited open: the SQLite file in `home`, or a database on a
    throwaway PostgreSQL server, stopped when the block ends."""
    async def open_(db: Database) -> Database:
        await db.open()
        return db

    if engine == "sqlite":
        yield open_(SqliteDatabase(home / "ember.db", synchronous="NORMAL"))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ is not installed
    from tests.pgserver import throwaway_postgres

    with throwaway_postgres() as server:
        yield open_(PostgresDatabase(server.fresh_database()))


if __name__ == "__main__":
    asyncio.run(main())
