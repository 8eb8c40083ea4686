"""A faster text index for the people with many memories, derived from the store's.

FTS5 scores every row that holds any of a query's terms, so its time grows
with the person's memories (about 21 ms median at 100,000, 46 ms p95:
bench/memory_scale.py). tantivy finds the best rows without scoring them all
(block-max WAND), in a few milliseconds. So, once a person has `min_rows`
memories, their text rows are copied into an in-memory tantivy index of
their own, and searches go there; below that, and until the copy has caught
up, FTS5 answers as before.

The store stays the source of truth: every write of a text row raises the
identity's text revision (`memory_items.text_rev`), and before each search
the index reads the rows written since the revision it holds (a few per turn,
inline; a backlog larger than `inline_rows`, such as an import, is read in the
background while FTS5 answers). A memory's state is checked with its record,
after the search, so an archived or superseded memory left in the index is
harmless; a purged one is no longer found by its number. The index is
rebuilt in each process that searches, never written to disk.

The same columns as FTS5, weighted alike; tantivy sums a BM25 per column where
FTS5 weighs the columns' frequencies inside one, and stems with Snowball where
FTS5 uses Porter, so the two rank alike but not identically (the scale bench
reports their agreement).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import tantivy

from ember.store.memory_rows import TEXT_WEIGHTS
from ember.store.protocols import TextRows

log = logging.getLogger(__name__)

INDEX_MIN_ROWS = 20_000
INLINE_ROWS = 500
# Rows read from the store and added per step of a build (one thread hop each).
BUILD_BATCH = 5_000
# A person below `min_rows` is counted again after this many seconds.
RECOUNT_S = 30.0
_COLUMNS = ("body", "before", "after", "far", "day")
_WEIGHTS = dict(zip(_COLUMNS, TEXT_WEIGHTS[1:], strict=True))
_TOKENIZER = "ember"
_WRITER_HEAP = 50_000_000


def _analyzer() -> tantivy.TextAnalyzer:
    # The store's text is already folded and its CJK runs segmented (store/segment.py).
    return (tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple()).filter(tantivy.Filter.lowercase())
            .filter(tantivy.Filter.ascii_fold()).filter(tantivy.Filter.stemmer("english")).build())


def _schema() -> tantivy.Schema:
    builder = tantivy.SchemaBuilder()
    builder.add_unsigned_field("num", indexed=True, fast=True)
    for column in _COLUMNS:
        builder.add_text_field(column, tokenizer_name=_TOKENIZER, index_option="freq")
    return builder.build()


@dataclass(slots=True)
class _Lexicon:
    """One person's tantivy index and the text revision it has caught up to."""

    index: tantivy.Index
    writer: tantivy.IndexWriter
    rev: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    catching_up: asyncio.Task[None] | None = None


class TextIndex:
    def __init__(self, store: TextRows, *, min_rows: int = INDEX_MIN_ROWS,
                 inline_rows: int = INLINE_ROWS) -> None:
        self._store = store
        self._min_rows = min_rows
        self._inline_rows = inline_rows
        self._schema = _schema()
        self._analyzer = _analyzer()
        self._lexicons: dict[str, _Lexicon] = {}
        self._small: dict[str, float] = {}  # identity -> when it was counted and had too few rows

    async def lexical(self, identity: str, terms: Sequence[str], limit: int) -> list[tuple[int, float]] | None:
        """(num, score) of the identity's best matches, as `SqlMemoryStore.lexical` gives them;
        None when this index does not hold the identity's current rows (FTS5 answers then)."""
        lexicon = await self._current(identity)
        if lexicon is None:
            return None
        query = self._query(terms)
        return await asyncio.to_thread(self._search, lexicon.index, query, limit)

    async def prepare(self, identity: str) -> None:
        """Catch the identity's index up now, rather than in the background."""
        await self._current(identity)
        lexicon = self._lexicons.get(identity)
        if lexicon is not None and lexicon.catching_up is not None:
            await asyncio.shield(lexicon.catching_up)

    async def close(self) -> None:
        tasks = [lexicon.catching_up for lexicon in self._lexicons.values() if lexicon.catching_up is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _current(self, identity: str) -> _Lexicon | None:
        lexicon = self._lexicons.get(identity)
        if lexicon is None:
            # Most people are small: their searches cost no query here, only a recount now and then.
            counted_at = self._small.get(identity)
            if counted_at is not None and time.monotonic() - counted_at < RECOUNT_S:
                return None
            if await self._store.count(identity) < self._min_rows:
                self._small[identity] = time.monotonic()
                return None
            self._small.pop(identity, None)
            index = tantivy.Index(self._schema)
            index.register_tokenizer(_TOKENIZER, self._analyzer)
            lexicon = self._lexicons[identity] = _Lexicon(index, index.writer(_WRITER_HEAP, 1))
            log.info("memory of %s: building its text index in the background", identity)
        if lexicon.catching_up is not None:
            return None
        rev = await self._store.text_rev(identity)
        if rev - lexicon.rev > self._inline_rows:
            lexicon.catching_up = asyncio.create_task(self._catch_up(identity, lexicon))
            return None
        if rev > lexicon.rev:
            async with lexicon.lock:
                await self._add(identity, lexicon, self._inline_rows)
        return lexicon

    async def _catch_up(self, identity: str, lexicon: _Lexicon) -> None:
        try:
            while await self._add(identity, lexicon, BUILD_BATCH) == BUILD_BATCH:
                pass
        except Exception:
            log.exception("memory of %s: its text index could not be built; full-text search goes on", identity)
            self._lexicons.pop(identity, None)
            self._small[identity] = time.monotonic()  # tried again after RECOUNT_S
        finally:
            lexicon.catching_up = None

    async def _add(self, identity: str, lexicon: _Lexicon, limit: int) -> int:
        rows = await self._store.texts_after(identity, lexicon.rev, limit)
        if rows:
            await asyncio.to_thread(self._write, lexicon, rows, replace=lexicon.rev > 0)
            lexicon.rev = rows[-1][1]
        return len(rows)

    def _write(self, lexicon: _Lexicon, rows: list[tuple[int, int, tuple[str, ...]]], *, replace: bool) -> None:
        for num, _, columns in rows:
            if replace:  # a text row written again (an archived message whose neighbours came)
                lexicon.writer.delete_documents_by_term("num", num)
            document = tantivy.Document()
            document.add_unsigned("num", num)
            for column, text in zip(_COLUMNS, columns, strict=True):
                if text:
                    document.add_text(column, text)
            lexicon.writer.add_document(document)
        lexicon.writer.commit()
        lexicon.index.reload()

    def _query(self, terms: Sequence[str]) -> tantivy.Query:
        tokens = dict.fromkeys(token for term in terms for token in self._analyzer.analyze(term))
        return tantivy.Query.boolean_query([
            (tantivy.Occur.Should, tantivy.Query.boost_query(
                tantivy.Query.term_query(self._schema, column, token), weight))
            for token in tokens for column, weight in _WEIGHTS.items()])

    @staticmethod
    def _search(index: tantivy.Index, query: tantivy.Query, limit: int) -> list[tuple[int, float]]:
        searcher = index.searcher()
        hits = searcher.search(query, limit, count=False).hits
        nums = searcher.fast_field_values("num", [address for _, address in hits])
        return [(num, score) for (score, _), num in zip(hits, nums, strict=True)]
