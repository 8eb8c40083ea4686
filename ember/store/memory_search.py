"""The full-text half of a memory search, as one read: the identity's memories that match a
query's distinctive terms, best first, and the records of the best of them (SqlMemoryStore.lexical).

The owner token keeps the search within the identity's rows; their states are filtered with
the records (a join in the search cost a third of the query).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Select, bindparam, func, literal_column, select

from ember.core.memory import LexicalHits
from ember.store import schema
from ember.store.memory_rows import LEXICAL, MEMORY, TERM_ROWS, record_of
from ember.store.segment import COMMON_ROWS, distinctive, expression, indexed_form, owner_token, ts_lexeme
from ember.store.tx import Statement, Tx, in_json_array, per_dialect

_mi = schema.memory_items


def _by_nums(dialect: str) -> Select[Any]:
    # `+identity`: look the rows up by number; SQLite would otherwise walk the identity's index.
    owner = literal_column("+memory_items.identity") if dialect == "sqlite" else _mi.c.identity
    return MEMORY.where(in_json_array(_mi.c.num, "nums", dialect), owner == bindparam("identity"))


BY_NUMS = per_dialect(_by_nums)
_HIGHEST_NUM = Statement(select(func.coalesce(func.max(_mi.c.num), 0)))


def lexical_hits(tx: Tx, identity: str, terms: Sequence[str], limit: int, records: int) -> LexicalHits:
    """(num, BM25 score; higher is better) of the identity's memories, in any state, matching any
    of `terms` that is distinctive (segment.distinctive), and the records of the first `records`."""
    scores = [(num, score) for num, score in _matching(tx, identity, terms, limit)]
    if not records or not scores:
        return LexicalHits(scores)
    best = {"nums": json.dumps([num for num, _ in scores[:records]]), "identity": identity}
    return LexicalHits(scores, dict(map(record_of, tx.execute(BY_NUMS, best).fetchall())))


def _matching(tx: Tx, identity: str, terms: Sequence[str], limit: int) -> Sequence[Sequence[Any]]:
    owner = owner_token(identity)
    total = tx.execute(_HIGHEST_NUM).fetchone()[0]
    if tx.dialect == "postgresql":  # every term, each weighed by its idf (memory_rows.LEXICAL)
        lexemes = [ts_lexeme(term) for term in terms]
        return tx.execute(LEXICAL, {"owner": owner, "terms": json.dumps(lexemes), "any_of": " | ".join(lexemes),
                                    "total": total, "limit": limit}).fetchall()
    kept = list(terms)
    if total > COMMON_ROWS:
        forms = {term: indexed_form(term) for term in terms}
        rows = dict(tx.execute(TERM_ROWS, {"terms": json.dumps(list(forms.values()))}).fetchall())
        kept = distinctive(terms, {term: rows.get(form, 0) for term, form in forms.items()}, total)
    return tx.execute(LEXICAL, {"match": f"owner:{owner} AND {{body before after far day}}:({expression(kept)})",
                                "limit": limit}).fetchall()
