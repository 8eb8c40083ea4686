"""Long-term memory at scale: search latency, ingest, size and memory footprint at
10k, 100k (and optionally 1M) memories of one person; a turn's commit cost with
100k memories in the store against an empty one.

    .venv/bin/python bench/memory_scale.py [--sizes N ...] [--quick] [--runs R] [--queries Q]
                                           [--commits K] [--level-budget S] [--dir PATH]

The memories are synthetic but shaped like real ones: a vocabulary of common
English words followed by ~40,000 generated words, drawn with a Zipf
distribution (s = 1, so the top words make about half the tokens, as in
English); about one text in eight is Chinese (common characters, Zipf-drawn
words of one to three characters), a few English ones carry a Chinese word.
70% are archival: conversations of 50 messages, appended to sessions of their
own (`SqlSessionStore.append`) and archived by `SqlMemoryStore.archive_session`
as the archive job does, so each is indexed with its neighbours and has a
window; 20% are consolidation summaries and 10% facts (a few naming an
attribute, so supersession happens), written by `SqlMemoryStore.write_many`
(row + FTS5 row + embedding job, as an import does). Every memory then gets
synthetic normalised 384-d float32 vectors (its own, and a window vector when
it has neighbours) through `unembedded` + `set_vectors`, as the embedding job
does: the bench measures the index, not the embedder. The query embedder is a
stand-in that turns a text into a fixed random unit vector.

All the memories belong to one identity; a second identity holds 300 from the
same vocabulary, so every search goes through the identity filter (and the
bench checks that no hit ever crosses over). The sizes are filled
incrementally in one database file: each level adds to the previous one.

At each size it prints:

1. ingest: memories/s for the rows with their text index (archival and
   write_many apart), vectors/s; the database file's size (after a WAL
   checkpoint) and bytes per memory;
2. memory footprint: the RSS growth of this process when a VectorIndex loads
   the identity's two matrices (own and window vectors; and the peak during
   the load), against 2 x n x 384 x 4 bytes; how long that cold first search took;
3. search latency, median and p95 in ms (medians of per-run figures), with
   the limit a turn's recall asks for, of `lexical` (MemoryService without an
   embedder: FTS5 BM25 + fusion + records), `vector` (the query's embedding on
   a thread, as the service does, then `VectorIndex.scores` + `fuse` with no
   lexical matches + the records), `fused` (MemoryService.search with both,
   built by `ember.app.runtime.memory_service`), and `other` (the fused search of the
   second identity, in the same file). Queries are user-message-like sentences
   drawn from the same distribution (one in five Chinese); each run asks every
   query of its share in each mode in turn, so drift hits all modes alike.
   Target: fused p95 < 20 ms at 100,000 (PASS/MISS per size; above it,
   brute force is a known miss, printed as such, not hidden).

At 100,000 (or the largest size below it), and at every larger size, it
profiles where a fused search's time goes, each part timed on its own over
the same queries (at most 200, fewer when slow): the FTS5 query
(`store.lexical`), the vector-count check `VectorIndex` makes before every
search (`store.vectors_since`), the embedding's thread hop, the two
matrix-vector products of `VectorIndex.scores` (the same numpy operations on
the same matrices), the fusion (`fuse`, over every
vector), the record fetch (`by_nums`, with its statement's plan, and the same
fetch by `num` alone on a raw connection for comparison), and an empty read's
hop for scale; and the FTS5 time by the number of matches (thirds).

Last, the commit cost: a turn's two commits as the pipeline makes them
(`SqlSessionStore.append` of the user message with its receipt, as
ContextStage does, then of the answer with its outbox record and its jobs,
archive + memory upkeep, as ResponseStage does), on a fresh copy of the
100,000-memory file and of an empty one, in the same directory, round-robin in
blocks of 10 turns, with the sqlite3 floor of commit_cost.py. Target: median
turn commit with memories / empty <= 1.2 (commit cost unchanged).

Only Ember's public interfaces are used; the profile also reads the file with
the stdlib sqlite3 module (read-only) to count each query's FTS5 matches.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import hashlib
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from commit_cost import Floor
from common import (
    busy_warning,
    print_header,
    quantile,
    rerun_command,
    store_versions,
    verdict,
    without_user_config,
)

from ember.app.services import memory_service
from ember.config.settings import Settings
from ember.core.delivery import Delivery, Receipt, delivery_id
from ember.core.events import InboundEvent
from ember.core.jobs import JobKind, JobRequest
from ember.core.memory import MemoryKind, MemoryStatus, NewMemory, SourceRank
from ember.core.messages import Message
from ember.memory.prompt import RecallBudget
from ember.memory.retrieval import fuse
from ember.memory.service import CANDIDATES, LEXICAL_DEPTH, MemoryService
from ember.memory.text_index import INDEX_MIN_ROWS, TextIndex
from ember.memory.vectors import DenseScores, VectorIndex
from ember.store.memories import SqlMemoryStore
from ember.store.memory_rows import Unembedded
from ember.store.segment import match_expression, owner_token, query_terms
from ember.store.sessions import SqlSessionStore
from ember.store.sqlite.database import SqliteDatabase

DIM = 384
MODEL = "bench-random-384"  # stamped on the synthetic vectors; the query embedder has the same name
PERSON = "bench-person"
OTHER = "bench-other"
OTHER_COUNT = 300
NEEDLE_WORD = "zqxneedlequartz"  # one memory of PERSON holds it, with the query embedder's vector of it
OTHER_NEEDLE_WORD = "zqxneedleother"  # and one of OTHER
WRITE_BATCH = 2_000  # memories per ingest step: ~70% archived chats, the rest in one write_many
VECTOR_BATCH = 2_000
CHAT_LEN = 50  # messages per synthetic conversation
ARCHIVAL_SHARE = 0.7
SEARCH_LIMIT = RecallBudget().search_limit  # what a turn's recall asks for
DEPTH = 3 * SEARCH_LIMIT + CANDIDATES  # the candidates MemoryService.search fuses and fetches
TARGET_P95_S = 0.020  # fused search p95 at 100,000 memories
TARGET_SIZE = 100_000
TARGET_RATIO = 1.2  # a turn's commit with 100,000 memories / with none
WARMUP = 5
BLOCK = 10  # turns per target before the commit round-robin moves on
SEED = 20261201
DAY_S = 86_400.0
MODES = ("lexical", "vector", "fused", "exact", "other")
EXACT = 10**12  # an index_min_rows never reached: FTS5 and a scan of every vector

QUESTION = "Could you look into this for me and tell me what you find? " * 2
ANSWER = "Here is the final answer to your question, in a couple of plain sentences. " * 3

# The most common English words, most frequent first: the head of the Zipf vocabulary.
_COMMON_WORDS_TEXT = (
    "the of and to a in is you that it he was for on are as with his they i at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up other "
    "about out many then them these so some her would make like him into time has look two more write go see "
    "number no way could people my than first water been call who oil its now find long down day did get come "
    "made may part over new sound take only little work know place year live me back give most very after thing "
    "our just name good sentence man think say great where help through much before line right too mean old any "
    "same tell boy follow came want show also around form three small set put end does another well large must "
    "big even such because turn here why ask went men read need land different home us move try kind hand "
    "picture again change off play spell air away animal house point page letter mother answer found study "
    "still learn should world high every near add food between own below country plant last school father keep "
    "tree never start city earth eye light thought head under story saw left few while along might close "
    "something seem next hard open example begin life always those both paper together got group often run"
)
COMMON_WORDS = _COMMON_WORDS_TEXT.split()
SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
COMMON_HANZI = (
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么心多天而"
    "能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分将外但身些与高意"
    "进把法此实回二理美点月明其种声全工己话儿者向情部正名定女问力机给等几很业最间新什打便位因重被走电四第门相次东政海口"
    "使教西再平真听世气信北少关并内加化由却代军产入先山五太水万市眼体别处总才场师书比住员九笑性通目华报立马命张活难神数"
    "件安表原车白应路期叫死常提感金何更反合放做系计或司利受光王果亲界及今京务制解各任至清物台象记边共风战干接它许八特觉"
    "望直服毛林题建南度统色字请交爱让认算论百吃义科怎元社术结六功指思非流每青管夫连远资队跟带花快条院变联言权往展该领传"
    "近留红治决周保达办运武半候七必城父强步完革深区即求品士转量空甚众技轻程告江语英基派满式李息写呢识极令黄德收脸钱党倒"
    "未持取设始版双历越史商千片容研像找友孩站广改议形委早房音火际则首单据导影失拿网香似斯专石若兵弟谁校读志飞观争究包组"
)


# --- synthetic text, vectors and the query embedder ------------------------------------------------


class Zipf:
    """Draws indices 0..n-1 with probability proportional to 1 / (rank ** s)."""

    def __init__(self, n: int, s: float, rng: np.random.Generator) -> None:
        weights = np.arange(1, n + 1, dtype=np.float64) ** -s
        self._cdf = np.cumsum(weights) / weights.sum()
        self._rng = rng

    def draw(self, count: int) -> np.ndarray:
        return np.minimum(np.searchsorted(self._cdf, self._rng.random(count)), len(self._cdf) - 1)


class Corpus:
    """Memories and queries from a Zipf-distributed vocabulary, English and Chinese."""

    def __init__(self, seed: int = SEED, generated_words: int = 40_000, chinese_words: int = 8_000) -> None:
        self.rng = rng = np.random.default_rng(seed)
        words: dict[str, None] = dict.fromkeys(COMMON_WORDS)
        while len(words) < len(COMMON_WORDS) + generated_words:
            syllables = rng.integers(0, len(SYLLABLES), size=int(rng.integers(2, 5)))
            words.setdefault("".join(SYLLABLES[i] for i in syllables))
        self.words = list(words)
        self.english = Zipf(len(self.words), 1.0, rng)
        characters = Zipf(len(COMMON_HANZI), 0.8, rng)
        hanzi: dict[str, None] = {}
        while len(hanzi) < chinese_words:
            size = int(rng.choice([1, 2, 2, 2, 2, 2, 2, 3, 3]))
            hanzi.setdefault("".join(COMMON_HANZI[i] for i in characters.draw(size)))
        self.hanzi = list(hanzi)
        self.chinese = Zipf(len(self.hanzi), 1.0, rng)
        self.now = time.time()

    def english_sentence(self, low: int, high: int, *, chinese_word: bool = False) -> str:
        tokens = [self.words[i] for i in self.english.draw(int(self.rng.integers(low, high + 1)))]
        if chinese_word:
            tokens.insert(int(self.rng.integers(0, len(tokens) + 1)), self.hanzi[int(self.chinese.draw(1)[0])])
        tokens[0] = tokens[0].capitalize()
        return " ".join(tokens) + str(self.rng.choice([".", ".", ".", "?", "!"]))

    def chinese_sentence(self, low: int, high: int) -> str:
        count = int(self.rng.integers(low, high + 1))
        parts = [self.hanzi[i] for i in self.chinese.draw(count)]
        clauses = ["".join(parts[i:i + 6]) for i in range(0, len(parts), 6)]
        return "，".join(clauses) + str(self.rng.choice(["。", "。", "？", "！"]))

    def sentence(self, low: int, high: int) -> str:
        draw = self.rng.random()
        if draw < 0.12:
            return self.chinese_sentence(low, high)
        return self.english_sentence(low, high, chinese_word=draw > 0.97)

    def chat(self, count: int) -> list[str]:
        """The messages of one conversation, user and assistant in turn."""
        return [self.sentence(6, 40) for _ in range(count)]

    def memories(self, identity: str, start: int, count: int) -> list[NewMemory]:
        """`count` summaries (two in three) and facts, numbered from `start`."""
        out = []
        for i in range(start, start + count):
            draw = self.rng.random()
            created = self.now - float(self.rng.uniform(0, 730)) * DAY_S
            chat = f"bench:chat-{i // CHAT_LEN}"
            if draw < 2 / 3:  # a consolidation summary
                text = " ".join(self.sentence(8, 25) for _ in range(int(self.rng.integers(2, 6))))
                out.append(NewMemory(
                    identity=identity, content=text, kind=MemoryKind.EPISODIC, source=f"session {chat}",
                    source_rank=SourceRank.CONSOLIDATED, session_key=chat, seq_start=0, seq_end=CHAT_LEN,
                    created_at=created))
            else:  # a fact; one in ten names an attribute (supersession, pending)
                keyed = self.rng.random() < 0.1
                out.append(NewMemory(
                    identity=identity, content=self.sentence(5, 15), kind=MemoryKind.FACT,
                    subject="user" if keyed else None, key=f"attribute {int(self.rng.integers(0, 300))}" if keyed
                    else None, source_rank=SourceRank(int(self.rng.integers(1, 4))), created_at=created))
        return out

    def queries(self, count: int) -> list[str]:
        """User-message-like queries: one in five Chinese, the others sentences of 5-16 words."""
        out: list[str] = []
        while len(out) < count:
            text = (self.chinese_sentence(2, 5) if self.rng.random() < 0.2
                    else self.english_sentence(5, 16))
            if match_expression(text) is not None:
                out.append(text)
        return out

    def unit_vectors(self, count: int) -> np.ndarray:
        vectors = self.rng.standard_normal((count, DIM), dtype=np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        return vectors


class RandomEmbedder:
    """A stand-in query embedder: each text becomes a fixed random unit vector
    (seeded by its hash), at no cost worth measuring."""

    name = MODEL
    dimensions = DIM
    # Random unit vectors are unrelated to one another (cosines of about +-0.05): above this,
    # only a planted vector passes, as only related memories pass a real embedder's floor.
    relevance_floor = 0.2
    symmetric = True

    def _one(self, text: str) -> np.ndarray:
        seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
        vector = np.random.default_rng(seed).standard_normal(DIM, dtype=np.float32)
        return vector / np.linalg.norm(vector)

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        return np.vstack([self._one(t) for t in texts])

    def embed_passages(self, texts: Sequence[str]) -> np.ndarray:
        return self.embed_queries(texts)

    def prepare(self) -> None:
        pass


# --- figures --------------------------------------------------------------------------------------


@dataclass
class Samples:
    """Seconds, one list per run; figures are medians of the per-run figures."""

    runs: list[list[float]] = field(default_factory=list)

    def q(self, q: float) -> float:
        figures = [quantile(run, q) for run in self.runs if run]
        return statistics.median(figures) if figures else float("nan")

    @property
    def median(self) -> float:
        return self.q(0.5)

    @property
    def p95(self) -> float:
        return self.q(0.95)

    @property
    def flat(self) -> list[float]:
        return [s for run in self.runs for s in run]


def ms(seconds: float, width: int = 8, digits: int = 2) -> str:
    return f"{seconds * 1e3:{width}.{digits}f}"


def mib(size: float) -> str:
    return f"{size / 2**20:,.1f} MiB"


def rss_bytes(field_name: str = "VmRSS") -> int:
    """This process's resident set (or its peak, VmHWM), from /proc; 0 where there is no /proc."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so a later peak is the load's own."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def trim_heap() -> bool:
    """Hand freed heap back to the OS (glibc's malloc_trim), so RSS shows what is still held."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def checkpoint(path: Path) -> None:
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def file_size(path: Path) -> int:
    return sum(Path(f"{path}{suffix}").stat().st_size for suffix in ("", "-wal")
               if Path(f"{path}{suffix}").exists())


async def timed(work: Awaitable[Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    result = await work
    return result, time.perf_counter() - started


# --- the memory store, filled level by level -------------------------------------------------------


@dataclass
class Level:
    n: int
    archive_s: float = 0.0  # seconds in archive_session: archival rows, indexed with their neighbours
    archived: int = 0
    write_s: float = 0.0  # seconds in write_many: summaries and facts
    written: int = 0
    append_s: float = 0.0  # seconds appending the chats' messages to their sessions (not memories yet)
    appended: int = 0
    vectors_s: float = 0.0
    added: int = 0
    file_bytes: int = 0
    consistency: dict[str, int] = field(default_factory=dict)
    rss_growth: int = 0
    rss_trimmed: int | None = None  # the growth once freed heap is handed back
    rss_peak: int | None = None
    cold_s: float = 0.0  # the first vector search: loads the matrix
    build_s: tuple[float, float] = (0.0, 0.0)  # the derived text index's build, the nearest-vector index's
    agreement: list[float] = field(default_factory=list)  # per query: share of the exact top hits fused finds
    queries_per_run: int = 0
    timings: dict[str, Samples] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)  # process CPU seconds per query, all threads
    hits: dict[str, float] = field(default_factory=dict)  # mean hits per query, by mode
    violations: list[str] = field(default_factory=list)
    skipped: str = ""

    @property
    def rows_s(self) -> float:
        return self.archive_s + self.write_s


class MemoryBench:
    def __init__(self, directory: Path, corpus: Corpus) -> None:
        self.path = directory / "memories.db"
        self.db = SqliteDatabase(self.path)
        self.store = SqlMemoryStore(self.db)
        self.corpus = corpus
        self.count = 0  # PERSON's memories written (the needle included)
        self.written = 0  # summaries and facts generated, both identities: numbers them
        self.needles: dict[str, int] = {}  # identity -> the num of its needle
        self.chats = 0

    async def open(self) -> None:
        await self.db.open()
        embedder = RandomEmbedder()
        # The other identity: a conversation of 200 messages, summaries and facts, and its needle.
        await self._archive(OTHER, [self.corpus.chat(200)], Level(0))
        others = self.corpus.memories(OTHER, 0, OTHER_COUNT - 201)
        others.append(NewMemory(identity=OTHER, content=f"The {OTHER_NEEDLE_WORD} belongs to the other person.",
                                kind=MemoryKind.FACT))
        self.written = len(others)
        await self.store.write_many(others)
        await self.store.write_many([NewMemory(identity=PERSON, content=f"My {NEEDLE_WORD} is on the shelf.",
                                               kind=MemoryKind.FACT)])
        self.count = 1
        # The needles get the query embedder's vectors of their words: a vector search for the
        # word finds them first. Every other memory gets random unit vectors.
        needles = {}
        for item in await self.store.unembedded(OTHER_COUNT + 10):
            for word in (NEEDLE_WORD, OTHER_NEEDLE_WORD):
                if word in item.content:
                    self.needles[item.identity] = item.num
                    needles[item.num] = embedder.embed_queries([word])[0]
        await self._embed(Level(0), needles)

    async def _archive(self, identity: str, chats: list[list[str]], level: Level) -> None:
        """Each chat's messages appended to a session of its own, then archived (archive_session:
        each message indexed with its neighbours), as the archive job does after turns. The
        chats go concurrently, so their commits share fsyncs (group commit)."""
        sessions = SqlSessionStore(self.db)  # a fresh one: its cache of windows does not pile up
        keys = [f"bench:{identity}-chat-{self.chats + i}" for i in range(len(chats))]
        self.chats += len(chats)

        async def append(key: str, texts: list[str]) -> None:
            session = await sessions.load(key)
            session.metadata = {"identity": identity}  # whose memory its messages become
            turn = f"{key}-t"
            await sessions.append(session, [
                Message.user(text, turn_id=f"{turn}{i // 2}") if i % 2 == 0
                else Message.assistant(text, turn_id=f"{turn}{i // 2}") for i, text in enumerate(texts)])

        _, seconds = await timed(asyncio.gather(*(append(key, texts) for key, texts in zip(keys, chats))))
        level.append_s += seconds
        level.appended += sum(map(len, chats))
        archived, seconds = await timed(asyncio.gather(*(
            self.store.archive_session(key, lambda _channel, _sender: identity) for key in keys)))
        level.archive_s += seconds
        level.archived += sum(done.count for done in archived)
        if identity == PERSON:
            self.count += sum(archived)
            level.added += sum(archived)

    async def _embed(self, level: Level, fixed: dict[int, np.ndarray] | None = None) -> None:
        """Random unit vectors for every memory without one (own and, with neighbours, window),
        through unembedded + set_vectors, as the embedding job does; `fixed` num -> own vector."""
        fixed = fixed or {}
        while True:
            rows, seconds = await timed(self.store.unembedded(VECTOR_BATCH))
            level.vectors_s += seconds
            if not rows:
                return
            own = self.corpus.unit_vectors(len(rows))
            windows = iter(self.corpus.unit_vectors(sum(item.window is not None for item in rows)))
            payload: list[tuple[Unembedded, bytes, bytes | None]] = [
                (item, fixed.get(item.num, vector).tobytes(),
                 next(windows).tobytes() if item.window is not None else None) for item, vector in zip(rows, own)]
            stored, seconds = await timed(self.store.set_vectors(MODEL, payload))
            level.vectors_s += seconds
            if not stored:
                raise RuntimeError("set_vectors stored none of a batch of unembedded memories")

    async def close(self) -> None:
        await self.db.close()

    async def fill(self, level: Level) -> None:
        """Add PERSON's memories up to `level.n`, timing the store's writes only."""
        while self.count < level.n:
            want = min(WRITE_BATCH, level.n - self.count)
            archival = int(want * ARCHIVAL_SHARE) if want >= 20 else 0
            if archival:
                sizes = [CHAT_LEN] * (archival // CHAT_LEN) + ([archival % CHAT_LEN] if archival % CHAT_LEN else [])
                await self._archive(PERSON, [self.corpus.chat(size) for size in sizes], level)
            batch = self.corpus.memories(PERSON, self.written, want - archival)
            self.written += len(batch)
            outcomes, seconds = await timed(self.store.write_many(batch))
            level.write_s += seconds
            created = sum(outcome.created for outcome in outcomes)  # a repeated fact is one fact
            level.written += created
            self.count += created
            level.added += created
        await self._embed(level)
        checkpoint(self.path)
        level.file_bytes = file_size(self.path)
        level.consistency = await self.store.consistency()

    def backup(self, target: Path) -> None:
        """A consistent copy of the file as it is now (sqlite3's online backup)."""
        with closing(sqlite3.connect(self.path)) as source, closing(sqlite3.connect(target)) as copy:
            source.backup(copy)
        checkpoint(target)


# --- search latency ------------------------------------------------------------------------------------


class Searchers:
    """The three ways into search, fresh at each level (so the vector matrices load cold)."""

    def __init__(self, bench: MemoryBench, home: Path) -> None:
        store = bench.store
        self.store = store
        self.embedder = RandomEmbedder()
        self.lexical_service = MemoryService(store, None)
        self.fused_service = memory_service(Settings(home=home), bench.db, self.embedder)
        # Below the derived indexes' threshold (and until they are built): FTS5 and every vector scored.
        self.exact_service = MemoryService(store, self.embedder, index_min_rows=EXACT)
        self.text = TextIndex(store)
        self.index: VectorIndex | None = VectorIndex(store, MODEL, DIM, ann_min_rows=INDEX_MIN_ROWS)

    async def prepare(self) -> tuple[float, float]:
        """Build every derived index of PERSON; the seconds the text index and the vector index took."""
        assert self.index is not None
        _, text_s = await timed(self.text.prepare(PERSON))
        _, vectors_s = await timed(self.index.prepare(PERSON))
        await self.fused_service.prepare(PERSON)
        await self.lexical_service.prepare(PERSON)
        return text_s, vectors_s

    async def close(self) -> None:
        for service in (self.lexical_service, self.fused_service, self.exact_service):
            await service.close()
        await self.text.close()
        if self.index is not None:
            await self.index.close()

    async def lexical(self, identity: str, query: str) -> list[tuple[str, str]]:
        hits = await self.lexical_service.search(identity, query, limit=SEARCH_LIMIT)
        return [(hit.record.identity, hit.record.id) for hit in hits]

    async def vector(self, identity: str, query: str) -> list[tuple[str, str]]:
        """The dense half as the service runs it: embed on a thread, score every vector,
        fuse without lexical matches, then the records."""
        assert self.index is not None
        vector = (await asyncio.to_thread(self.embedder.embed_queries, [query]))[0]
        dense = await self.index.scores(identity, vector)
        candidates = fuse([], dense, DEPTH) if dense is not None else []
        records = await self.store.by_nums(identity, [c.num for c in candidates])
        active = [records[c.num] for c in candidates if c.num in records
                  and records[c.num].status is MemoryStatus.ACTIVE][:SEARCH_LIMIT]
        return [(record.identity, record.id) for record in active]

    async def fused(self, identity: str, query: str) -> list[tuple[str, str]]:
        hits = await self.fused_service.search(identity, query, limit=SEARCH_LIMIT)
        return [(hit.record.identity, hit.record.id) for hit in hits]

    async def exact(self, identity: str, query: str) -> list[tuple[str, str]]:
        hits = await self.exact_service.search(identity, query, limit=SEARCH_LIMIT)
        return [(hit.record.identity, hit.record.id) for hit in hits]

    def mode(self, name: str) -> Callable[[str], Awaitable[list[tuple[str, str]]]]:
        if name == "other":
            return lambda query: self.fused(OTHER, query)
        method = getattr(self, name)
        return lambda query: method(PERSON, query)


async def load_matrix(searchers: Searchers, level: Level) -> None:
    """The cold first vector search: loads PERSON's matrix; its RSS growth and peak."""
    gc.collect()
    trim_heap()
    before = rss_bytes()
    peak_reset = reset_peak_rss()
    _, level.cold_s = await timed(searchers.vector(PERSON, "the first search of this level"))
    peak = rss_bytes("VmHWM")
    gc.collect()
    level.rss_growth = rss_bytes() - before
    level.rss_peak = peak - before if peak_reset and peak else None
    if trim_heap():
        level.rss_trimmed = rss_bytes() - before


async def needle_checks(searchers: Searchers, bench: MemoryBench, level: Level) -> None:
    """Each needle is found by its own identity, first, and never by the other identity."""
    person_id = (await bench.store.by_nums(PERSON, [bench.needles[PERSON]]))[bench.needles[PERSON]].id
    other_id = (await bench.store.by_nums(OTHER, [bench.needles[OTHER]]))[bench.needles[OTHER]].id
    for mode in ("lexical", "vector", "fused"):
        hits = await getattr(searchers, mode)(PERSON, NEEDLE_WORD)
        if not hits or hits[0][1] != person_id:
            level.violations.append(f"{mode}: the person's needle is not the first hit of its word")
        crossing = await getattr(searchers, mode)(PERSON, OTHER_NEEDLE_WORD)
        if any(memory_id == other_id or identity != PERSON for identity, memory_id in crossing):
            level.violations.append(f"{mode}: the person's search returned the other identity's memory")
        hits = await getattr(searchers, mode)(OTHER, OTHER_NEEDLE_WORD)
        if not hits or hits[0][1] != other_id:
            level.violations.append(f"{mode}: the other identity's needle is not its first hit")


async def search_bench(searchers: Searchers, level: Level, queries: list[str], runs: int, wanted: int,
                       budget_s: float) -> None:
    for mode in MODES:  # warm: the matrices, the statement caches, the pages
        for query in queries[:WARMUP]:
            await searchers.mode(mode)(query)
    # Bounded in time: fewer queries per run when a level's searches are slow (1M).
    probe = queries[WARMUP:WARMUP + 5]
    started = time.perf_counter()
    for query in probe:
        for mode in MODES:
            await searchers.mode(mode)(query)
    per_query = (time.perf_counter() - started) / len(probe)
    level.queries_per_run = max(20, min(wanted, int(budget_s / (runs * per_query))))
    level.timings = {mode: Samples() for mode in MODES}
    level.cpu = {mode: [] for mode in MODES}
    hits = {mode: 0 for mode in MODES}
    found: dict[str, list[tuple[str, str]]] = {}
    owner = {mode: OTHER if mode == "other" else PERSON for mode in MODES}
    order = list(MODES)
    for run in range(runs):
        for timing in level.timings.values():
            timing.runs.append([])
        share = queries[run * level.queries_per_run:(run + 1) * level.queries_per_run]
        for i, query in enumerate(share):
            rotated = order[i % len(order):] + order[:i % len(order)]  # each mode first in turn
            for mode in rotated:
                cpu = time.process_time()
                found[mode], seconds = await timed(searchers.mode(mode)(query))
                level.cpu[mode].append(time.process_time() - cpu)
                level.timings[mode].runs[-1].append(seconds)
                hits[mode] += len(found[mode])
                if any(identity != owner[mode] for identity, _ in found[mode]):
                    level.violations.append(f"{mode}: a hit of another identity for {query!r}")
            if found["exact"]:
                level.agreement.append(len(set(found["fused"]) & set(found["exact"])) / len(found["exact"]))
    asked = runs * level.queries_per_run
    level.hits = {mode: hits[mode] / asked for mode in MODES}


# --- where a fused search's time goes -----------------------------------------------------------------


@dataclass
class Profile:
    n: int
    parts: dict[str, list[float]]
    matches: list[int]  # FTS5 matches of each query's expression (the person's)
    terms: list[int]
    total: list[float]
    text_agreement: list[float]  # per query: share of FTS5's top 50 the text index also has in its top 50
    near_recall: list[float]  # per random query: share of the exact 50 nearest own vectors proposed
    near_found: list[bool]  # per query near one memory's vector: was that memory proposed?
    references: dict[str, list[float]]
    fetch_plan: str


async def profile_search(bench: MemoryBench, searchers: Searchers, queries: list[str]) -> Profile:
    store, db = bench.store, bench.db
    derived_text, derived_vectors = searchers.text, searchers.index
    searchers.index = None
    gc.collect()
    # The person's two matrices as VectorIndex holds them (own vectors; window vectors, or own again).
    (_, latest), rows = await store.vectors_since(PERSON, MODEL, 0)
    own = np.vstack([np.frombuffer(blob, dtype=np.float32) for _, _, blob, _ in rows])
    window = np.vstack([np.frombuffer(w if w is not None else blob, dtype=np.float32) for _, _, blob, w in rows])
    nums = np.asarray([num for num, _, _, _ in rows], dtype=np.int64)  # VectorIndex keeps this array
    positions = {int(num): i for i, num in enumerate(nums)}
    del rows
    parts: dict[str, list[float]] = {name: [] for name in (
        "FTS5 query (store.lexical)", "vector catch-up check (store.vectors_since)", "embedding thread hop",
        "2 matvecs, own + window (numpy)", "fusion over all n (fuse)",
        "record fetch (store.by_nums)", "empty read hop (db.run_read)",
        "text index query (TextIndex.lexical)", "nearest rows, scored (VectorIndex.scores)",
        "fusion over those (fuse)")}
    names = list(parts)
    matches, terms, total, text_agreement = [], [], [], []
    near_recall: list[float] = []
    near_found: list[bool] = []
    rng = np.random.default_rng(SEED)
    references: dict[str, list[float]] = {}  # the record fetch's statement on a raw connection, two ways
    with closing(sqlite3.connect(f"file:{bench.path}?mode=ro", uri=True)) as raw:
        for query in queries:
            expression = match_expression(query)
            assert expression is not None
            terms.append(expression.count(" OR ") + 1)
            # Every text column (the owner column holds only owner tokens), as store.lexical searches.
            matches.append(raw.execute("SELECT count(*) FROM memory_fts WHERE memory_fts MATCH ?",
                                       (f"owner:{owner_token(PERSON)} AND ({expression})",)).fetchone()[0])
            hits, seconds = await timed(store.lexical(PERSON, query_terms(query), LEXICAL_DEPTH))
            lexical = hits.scores
            parts[names[0]].append(seconds)
            _, seconds = await timed(store.vectors_since(PERSON, MODEL, latest))
            parts[names[1]].append(seconds)
            vector, seconds = await timed(asyncio.to_thread(searchers.embedder.embed_queries, [query]))
            parts[names[2]].append(seconds)
            q = vector[0].astype(np.float32)  # VectorIndex.scores's own operations, timed apart
            started = time.perf_counter()
            own_scores, window_scores = own @ q, window @ q
            parts[names[3]].append(time.perf_counter() - started)
            dense = DenseScores(nums, own_scores, window_scores, positions)
            started = time.perf_counter()
            candidates = fuse(lexical, dense, DEPTH)
            parts[names[4]].append(time.perf_counter() - started)
            wanted = [c.num for c in candidates]
            _, seconds = await timed(store.by_nums(PERSON, wanted))
            parts[names[5]].append(seconds)
            marks = ",".join("?" * len(wanted))
            for label, sql, params in (
                    ("identity = ? AND num IN (...)", f"identity = ? AND num IN ({marks})", (PERSON, *wanted)),
                    ("num IN (...) alone", f"num IN ({marks})", tuple(wanted))):
                started = time.perf_counter()
                raw.execute(f"SELECT * FROM memory_items WHERE {sql}", params).fetchall()
                references.setdefault(label, []).append(time.perf_counter() - started)
            _, seconds = await timed(db.run_read(lambda conn: None))
            parts[names[6]].append(seconds)
            found, seconds = await timed(derived_text.lexical(PERSON, query_terms(query), LEXICAL_DEPTH))
            parts[names[7]].append(seconds)
            if derived_vectors is not None:
                near, seconds = await timed(derived_vectors.scores(PERSON, q, also=[n for n, _ in found or lexical]))
                parts[names[8]].append(seconds)
                started = time.perf_counter()
                fuse(found or lexical, near, DEPTH)
                parts[names[9]].append(time.perf_counter() - started)
                assert near is not None
                nearest = set(nums[np.argpartition(-own_scores, 50)[:50]].tolist())
                near_recall.append(len(nearest & set(near.nums.tolist())) / 50)
                # A question about something said sits near its memory: cosine about 0.8 here.
                target = int(rng.integers(len(own)))
                asked = own[target] + 0.75 * rng.standard_normal(DIM).astype(np.float32) / DIM ** 0.5
                proposed = await derived_vectors.scores(PERSON, (asked / np.linalg.norm(asked)).astype(np.float32))
                near_found.append(proposed is not None and int(nums[target]) in proposed.rows)
            if found is not None:
                top = {num for num, _ in lexical[:50]}
                text_agreement.append(len(top & {num for num, _ in found[:50]}) / max(1, len(top)))
            _, seconds = await timed(searchers.fused(PERSON, query))
            total.append(seconds)
        plan = raw.execute(f"EXPLAIN QUERY PLAN SELECT * FROM memory_items WHERE identity = ? AND num IN"
                           f" ({','.join('?' * DEPTH)})", (PERSON, *range(DEPTH))).fetchall()
    return Profile(bench.count, parts, matches, terms, total, text_agreement, near_recall, near_found, references,
                   "; ".join(row[-1] for row in plan))


# --- a turn's commit cost, with and without memories ---------------------------------------------------


class CommitTarget:
    """A fresh copy of a template file each run; a turn's two commits as the pipeline makes them."""

    def __init__(self, label: str, template: Path, directory: Path) -> None:
        self.label = label
        self.template = template
        self.path = directory / f"commit-{template.name}"
        self.db: SqliteDatabase | None = None
        self.store: SqlSessionStore | None = None
        self.user = Samples()
        self.answer = Samples()
        self.turn = Samples()
        self._run = 0
        self._turns = 0

    async def reset(self, run: int) -> None:
        await self.close()
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(f"{self.path}{suffix}").unlink(missing_ok=True)
        shutil.copyfile(self.template, self.path)
        self.db = SqliteDatabase(self.path)
        await self.db.open()
        self.store = SqlSessionStore(self.db)
        self._run, self._turns = run, 0
        for samples in (self.user, self.answer, self.turn):
            samples.runs.append([])

    async def close(self) -> None:
        if self.db is not None:
            await self.db.close()
            self.db = self.store = None

    async def turns(self, count: int, *, record: bool = True) -> None:
        assert self.store is not None
        event = InboundEvent(channel="bench", chat_id=f"commit-{self._run}", sender_id="bench", text=QUESTION)
        session = await self.store.load(event.session_key)  # the store's cached window: no read after the first
        if session.next_seq == 0:
            session.metadata = {"channel": event.channel, "chat_id": event.chat_id, "sender_id": event.sender_id,
                                "identity": PERSON}
        for _ in range(count):
            self._turns += 1
            turn_id = f"turn-{self._run}-{self._turns}"
            message_id = f"msg-{self._run}-{self._turns}"
            receipt = Receipt(channel=event.channel, message_id=message_id, chat_id=event.chat_id,
                              sender_id=event.sender_id, turn_id=turn_id)
            started = time.perf_counter()
            await self.store.append(session, [Message.user(QUESTION, turn_id=turn_id)], receipt=receipt)
            user_done = time.perf_counter()
            delivery = Delivery(delivery_id=delivery_id(turn_id, session.next_seq), turn_id=turn_id,
                                channel=event.channel, chat_id=event.chat_id, reply_to=message_id, kind="final",
                                text=ANSWER)
            jobs = [JobRequest(JobKind.ARCHIVE, session.key, session.key), JobRequest(JobKind.MEMORY_UPKEEP, "all")]
            await self.store.append(session, [Message.assistant(ANSWER, turn_id=turn_id)], delivery=delivery,
                                    jobs=jobs)
            done = time.perf_counter()
            if record:
                self.user.runs[-1].append(user_done - started)
                self.answer.runs[-1].append(done - user_done)
                self.turn.runs[-1].append(done - started)


class FloorTarget:
    def __init__(self, directory: Path) -> None:
        self.floor = Floor(directory, "memory-scale-floor.db")
        self.samples = Samples()

    async def reset(self, _run: int) -> None:
        await self.floor.reset()
        self.samples.runs.append([])

    async def turns(self, count: int, *, record: bool = True) -> None:
        samples = await self.floor.time_commits(count)
        if record:
            self.samples.runs[-1] += samples

    async def close(self) -> None:
        await self.floor.close()


async def commit_bench(directory: Path, empty: Path, full: Path, full_n: int, runs: int,
                       turns: int) -> tuple[FloorTarget, CommitTarget, CommitTarget]:
    floor = FloorTarget(directory)
    base = CommitTarget("empty store", empty, directory)
    loaded = CommitTarget(f"{full_n:,} memories", full, directory)
    targets: list[FloorTarget | CommitTarget] = [floor, base, loaded]
    try:
        for run in range(runs):
            for target in targets:
                await target.reset(run)
                await target.turns(WARMUP, record=False)
            for block in range(0, turns, BLOCK):  # round-robin, so drift hits both alike
                for target in targets:
                    await target.turns(min(BLOCK, turns - block))
    finally:
        for target in targets:
            await target.close()
    return floor, base, loaded


# --- report ------------------------------------------------------------------------------------------


def report_level(level: Level) -> None:
    n = level.n
    print(f"\n== {n:,} memories of one person (+ {OTHER_COUNT} of another) ==")
    if level.skipped:
        print(f"  skipped: {level.skipped}")
        return
    def rate(count: int, seconds: float) -> str:
        return f"{count / seconds:,.0f}/s" if seconds else "-"

    print(f"  ingest      : {level.added:,} added, rows + text index {rate(level.added, level.rows_s)}"
          f" ({level.rows_s:.1f} s): archival {level.archived:,} by archive_session (with neighbours)"
          f" {rate(level.archived, level.archive_s)}, summaries + facts {level.written:,} by write_many"
          f" {rate(level.written, level.write_s)}")
    print(f"                vectors (own, and window where there are neighbours) {rate(level.added, level.vectors_s)}"
          f" ({level.vectors_s:.1f} s, set_vectors x {VECTOR_BATCH:,}); before the archive, the chats' messages"
          f" appended to their sessions {rate(level.appended, level.append_s)} ({level.append_s:.1f} s)")
    c = level.consistency
    print(f"  database    : {mib(level.file_bytes)} = {level.file_bytes / (n + OTHER_COUNT):,.0f} bytes/memory"
          f" (the sessions' messages included); rows {c.get('rows', 0):,}, text rows"
          f" {c.get('text_rows', 0):,}, without text {c.get('rows_without_text', 0)},"
          f" unembedded {c.get('unembedded', 0)}")
    expected = 2 * n * DIM * 4
    peak = f", peak during the load +{mib(level.rss_peak)}" if level.rss_peak is not None else ""
    trimmed = f" (+{mib(level.rss_trimmed)} once freed heap is trimmed)" if level.rss_trimmed is not None else ""
    print(f"  vectors RAM : RSS +{mib(level.rss_growth)}{trimmed} for one VectorIndex's two matrices"
          f" (own + window: 2 x n x {DIM} x 4 = {mib(expected)}){peak}; the cold first search (loads them)"
          f" {level.cold_s * 1e3:,.0f} ms")
    derived = n >= INDEX_MIN_ROWS
    if derived:
        print(f"  indexes     : from {INDEX_MIN_ROWS:,} memories a person's text and vectors get derived indexes"
              f" (tantivy; faiss IVF), built in the background: the text index here in {level.build_s[0]:.1f} s,"
              f" the nearest-vector one {level.build_s[1]:.1f} s after it (its build starts with the first"
              " search); FTS5 and a scan of every vector answer meanwhile, as `exact` below")
    runs = len(level.timings["fused"].runs)
    scored = "the nearest vectors proposed by the index scored" if derived else "every vector scored"
    print(f"  search      : {runs} runs x {level.queries_per_run} queries per mode, limit {SEARCH_LIMIT} (a turn's"
          f" recall), {LEXICAL_DEPTH} text matches read, {scored}, {DEPTH} candidates fetched; ms")
    print(f"    {'mode':<8} {'median':>8} {'p95':>8} {'max':>8}  {'CPU med':>8} {'CPU p95':>8}  {'hits/q':>6}")
    for mode in MODES:
        timing, cpu = level.timings[mode], level.cpu[mode]
        print(f"    {mode:<8} {ms(timing.median)} {ms(timing.p95)} {ms(max(timing.flat))}"
              f"  {ms(statistics.median(cpu))} {ms(quantile(cpu, 0.95))}  {level.hits[mode]:6.1f}")
    if derived and level.agreement:
        print(f"    fused finds {statistics.mean(level.agreement):.1%} of exact's top {SEARCH_LIMIT} (mean over"
              f" {len(level.agreement)} queries; worst query {min(level.agreement):.0%}); with random query vectors the"
              " dense half's top is noise, which the IVF index samples: see the profile for each index's own recall")
    fused = level.timings["fused"].p95
    where = "target" if n == TARGET_SIZE else "target is at 100,000; shown for scale"
    print(f"    fused p95 {fused * 1e3:.1f} ms vs < {TARGET_P95_S * 1e3:.0f} ms ({where}):"
          f" {verdict(fused < TARGET_P95_S)}")
    if n > TARGET_SIZE and fused >= TARGET_P95_S:
        print(f"    ** at {n:,} the fused search MISSES the {TARGET_P95_S * 1e3:.0f} ms p95: {fused * 1e3:.1f} ms"
              f" (the vector half alone {level.timings['vector'].p95 * 1e3:.1f} ms, the lexical half alone"
              f" {level.timings['lexical'].p95 * 1e3:.1f} ms); which part, below **")
    if level.violations:
        print(f"  CHECK FAILED: {len(level.violations)} identity/needle violations, e.g. {level.violations[:3]}")
    else:
        print("  checks      : every hit belongs to the identity searched; each needle is its word's first hit"
              " (lexical, vector, fused) and never found by the other identity")


def report_profile(profile: Profile, level: Level) -> None:
    print(f"\n== Where a fused search's time goes at {profile.n:,} memories ({len(profile.total)} queries) ==")
    print("  each part timed on its own over the same queries, ms:")
    print(f"    {'part':<42} {'median':>8} {'p95':>8}  {'share of the sum of medians':>27}")
    medians = {name: statistics.median(values) for name, values in profile.parts.items()}
    summed = sum(v for name, v in medians.items() if not name.startswith("empty"))
    for name, values in profile.parts.items():
        share = "" if name.startswith("empty") else f"{medians[name] / summed:27.0%}"
        print(f"    {name:<42} {ms(medians[name])} {ms(quantile(values, 0.95))}  {share}")
    total = statistics.median(profile.total)
    print(f"    {'sum of the parts (medians)':<42} {ms(summed)}")
    print(f"    {'the fused search itself':<42} {ms(total)} {ms(quantile(profile.total, 0.95))}")
    dominant = max((name for name in medians if not name.startswith("empty")), key=medians.__getitem__)
    print(f"  dominant: {dominant}, {medians[dominant] / summed:.0%} of the median parts")
    fused = level.timings["fused"].p95
    if profile.n > TARGET_SIZE and fused >= TARGET_P95_S:
        grown = ", ".join(f"{name.split(' (')[0]} {medians[name] * 1e3:.1f}" for name in medians if "hop" not in name)
        print(f"  ** at {profile.n:,} memories the fused search misses the {TARGET_P95_S * 1e3:.0f} ms p95 target"
              f" ({fused * 1e3:.1f} ms): every part here is a pass over the identity's rows (brute force),"
              f" so each grows with n; medians, ms: {grown} **")
    if profile.text_agreement:
        print(f"  the text index's top 50 holds {statistics.mean(profile.text_agreement):.1%} of FTS5's top 50"
              " (mean over the queries): tantivy sums a BM25 per column and stems with Snowball")
    if profile.near_found:
        print(f"  nearest-vector index: for a query near one memory's vector (cosine 0.8), that memory is proposed"
              f" {statistics.mean(profile.near_found):.1%} of the time; for the random queries, the exact 50"
              f" nearest (noise: random vectors have no true neighbours) {statistics.mean(profile.near_recall):.1%}")
    print(f"  the record fetch's statement on a raw sqlite3 connection (no thread hop); its plan: {profile.fetch_plan}")
    for label, values in profile.references.items():
        print(f"    {label:<42} {ms(statistics.median(values))} {ms(quantile(values, 0.95))}")
    fts = profile.parts["FTS5 query (store.lexical)"]
    order = sorted(range(len(fts)), key=lambda i: profile.matches[i])
    thirds = [order[i * len(order) // 3:(i + 1) * len(order) // 3] for i in range(3)]
    print("  FTS5 cost follows the matches (the person's rows matching any term;"
          f" {statistics.median(profile.terms):.0f} terms per query, median):")
    for label, part in zip(("fewest", "middle", "most"), thirds):
        if part:
            print(f"    {label:>6} third: {statistics.median(profile.matches[i] for i in part):>9,.0f} matches,"
                  f" FTS5 {statistics.median(fts[i] for i in part) * 1e3:6.2f} ms median,"
                  f" {max(fts[i] for i in part) * 1e3:6.2f} max")


def report_commits(floor: FloorTarget, base: CommitTarget, loaded: CommitTarget) -> None:
    turns = len(base.turn.flat)
    print(f"\n== A turn's commit cost: {loaded.label} vs an empty store ({turns} turns each,"
          f" {len(base.turn.runs)} runs) ==")
    print("  SqlSessionStore.append of the user message + receipt (ContextStage), then of the answer + outbox"
          " record + jobs (ResponseStage); WAL, synchronous=FULL; µs")
    print(f"    {'store':<18} {'commit':<16} {'median':>8} {'p90':>8}  {'x floor':>7}")
    fl = floor.samples.median
    print(f"    {'sqlite3 floor':<18} {'one-row INSERT':<16} {fl * 1e6:8.0f} {floor.samples.q(0.9) * 1e6:8.0f}"
          f"  {1:7.2f}")
    for target in (base, loaded):
        for label, samples in (("user + receipt", target.user), ("answer + outbox", target.answer),
                               ("the turn (both)", target.turn)):
            print(f"    {target.label:<18} {label:<16} {samples.median * 1e6:8.0f} {samples.q(0.9) * 1e6:8.0f}"
                  f"  {samples.median / fl:7.2f}")
    for label, a, b in (("turn", base.turn, loaded.turn), ("answer commit", base.answer, loaded.answer)):
        ratio = b.median / a.median
        print(f"  {label} ratio median({loaded.label}) / median(empty) = {ratio:.2f}   target <= {TARGET_RATIO}"
              f"  {verdict(ratio <= TARGET_RATIO)}")


# --- main ---------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", help="memories of the person (default 10000 100000;"
                        " add 1000000 for the 1M level)")
    parser.add_argument("--quick", action="store_true", help="10,000 only, fewer samples (< 1 min)")
    parser.add_argument("--runs", type=int, help="runs of searches per size and of commits (default 5, quick 3)")
    parser.add_argument("--queries", type=int, help="queries per run per mode (default 100, quick 40)")
    parser.add_argument("--commits", type=int, help="timed turns (2 commits each) per run (default 100, quick 50)")
    parser.add_argument("--level-budget", type=float, default=120.0,
                        help="seconds of timed searches per size at most; fewer queries per run when slower"
                             " (default 120)")
    parser.add_argument("--dir", type=Path, help="where to create the temporary databases (default: system temp)")
    args = parser.parse_args()
    args.sizes = sorted(set(args.sizes or ([10_000] if args.quick else [10_000, 100_000])))
    if args.sizes[0] < 1_000:
        parser.error("sizes start at 1,000 memories")
    args.runs = args.runs or (3 if args.quick else 5)
    args.queries = args.queries or (40 if args.quick else 100)
    args.commits = args.commits or (50 if args.quick else 100)
    return args


def room_for(n: int, directory: Path, have: int) -> str:
    """Why the level of `n` memories cannot run here, or ''."""
    disk = shutil.disk_usage(directory).free
    need_disk = int((n - have) * 6_500 * 1.3)  # ~6.4 kB a memory, the sessions' messages included
    if disk < need_disk:
        return f"needs ~{mib(need_disk)} of disk, {mib(disk)} free in {directory}"
    ram = available_memory()
    # Three services' two matrices each, the load's peak, the profile's copy, the IVF codes, tantivy.
    need_ram = int(n * DIM * 4 * 13)
    if ram is not None and ram < need_ram:
        return f"needs ~{mib(need_ram)} of RAM, {mib(ram)} available"
    return ""


async def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="ember-bench-memory-", dir=args.dir) as tmp:
        directory = Path(tmp)
        without_user_config(os.environ, directory / "home")
        print_header("Ember long-term memory at scale", f"{store_versions()}, numpy {np.__version__}", [
            ("files", f"{directory} (WAL, synchronous=FULL)"),
            ("sizes", ", ".join(f"{n:,}" for n in args.sizes) + f" memories of one identity (+ {OTHER_COUNT}"
                      " of another), filled incrementally in one file"),
            ("settings", f"{args.runs} runs x {args.queries} queries per mode (at most {args.level_budget:g} s of"
                         f" searches per size); {args.runs} runs x {args.commits} turns of commits"),
            ("vectors", f"synthetic unit vectors, {DIM}-d float32; the query embedder is a random stand-in"),
        ], rerun_command(__file__))
        load_before, started = os.getloadavg()[0], time.perf_counter()
        corpus = Corpus()
        queries = corpus.queries(WARMUP + 5 + args.runs * args.queries)
        print(f"  corpus  : {len(corpus.words):,} English-like words (the first {len(COMMON_WORDS)} real),"
              f" {len(corpus.hanzi):,} Chinese words; e.g. {corpus.sentence(8, 14)!r}", flush=True)

        empty = directory / "template-empty.db"
        empty_db = SqliteDatabase(empty)
        await empty_db.open()
        await empty_db.close()
        checkpoint(empty)

        commit_n = max([n for n in args.sizes if n <= TARGET_SIZE], default=args.sizes[0])
        full = directory / f"template-{commit_n}.db"
        bench = MemoryBench(directory, corpus)
        await bench.open()
        levels: list[Level] = []
        failed = False
        try:
            for n in args.sizes:
                level = Level(n)
                levels.append(level)
                if reason := room_for(n, directory, bench.count):
                    level.skipped = reason
                    report_level(level)
                    continue
                if levels[:-1] and levels[-2].rows_s:
                    previous = levels[-2]
                    eta = (n - bench.count) * (previous.rows_s + previous.vectors_s + previous.append_s) / max(
                        1, previous.added)
                    print(f"\n  ingesting {n - bench.count:,} more memories: at least {eta:.0f} s at the last rate"
                          " (it falls as the file grows) ...", flush=True)
                await bench.fill(level)
                if n == commit_n:
                    bench.backup(full)
                searchers = Searchers(bench, directory / "home")
                await load_matrix(searchers, level)
                level.build_s = await searchers.prepare()
                await needle_checks(searchers, bench, level)
                await search_bench(searchers, level, queries[WARMUP:], args.runs, args.queries, args.level_budget)
                report_level(level)
                failed |= bool(level.violations)
                if n >= commit_n:  # at 100,000, and above it, where the misses are
                    # Each profiled query costs about 2.5 fused searches: bounded like the searches.
                    count = int(args.level_budget / (2.5 * level.timings["fused"].median))
                    count = max(20, min(200, count))
                    report_profile(await profile_search(bench, searchers, queries[WARMUP:WARMUP + count]), level)
                await searchers.close()
                del searchers
                gc.collect()
        finally:
            await bench.close()
        (directory / "memories.db").unlink(missing_ok=True)  # the 1M file can be large; not needed any more

        floor, base, loaded = await commit_bench(directory, empty, full, commit_n, args.runs, args.commits)
        report_commits(floor, base, loaded)

        print("\n== Targets ==")
        for level in levels:
            if level.timings:
                fused = level.timings["fused"]
                note = "  (target)" if level.n == TARGET_SIZE else ""
                print(f"  fused search at {level.n:>9,}: p95 {fused.p95 * 1e3:6.1f} ms, median"
                      f" {fused.median * 1e3:6.1f} ms  < {TARGET_P95_S * 1e3:.0f} ms p95:"
                      f" {verdict(fused.p95 < TARGET_P95_S)}{note}")
        if TARGET_SIZE not in args.sizes:
            print("  (100,000 memories not measured in this run: the search target is at 100,000)")
        ratio = loaded.turn.median / base.turn.median
        print(f"  turn commit with {commit_n:,} memories / empty: {ratio:.2f}  <= {TARGET_RATIO}:"
              f" {verdict(ratio <= TARGET_RATIO)}")
        print(f"\n  total {time.perf_counter() - started:.1f} s")
        busy_warning(load_before, "the latencies are inflated; rerun on a quiet machine", own_cores=1.0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
