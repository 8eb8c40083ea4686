"""Text as the full-text index sees it, Chinese, Japanese and Korean included.

SQLite's `unicode61` tokenizer keeps a run of CJK characters as one token, and
`trigram` finds nothing for a two-character word such as 花生. So CJK runs are
segmented here, before indexing: every character and every pair of adjacent
characters becomes a token ("我爱花生" -> 我 爱 花 生 我爱 爱花 花生). A query's
CJK run is looked up by its pairs (a one-character run by itself), which
matches any text containing that run. Other text passes through to the
`porter unicode61` tokenizer unchanged.

A term found in many rows costs a BM25 score for each of them and weighs
little in any ranking (its idf is low), so a query leaves out the terms far
more common than its most distinctive one (`distinctive`).
"""

from __future__ import annotations

import hashlib
import math
import re
import threading
import unicodedata
from collections.abc import Mapping, Sequence

import Stemmer

# Han (with extensions and compatibility), kana, Hangul.
_CJK = (
    "\u3040-\u30ff\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
    "\uac00-\ud7af\u1100-\u11ff\u3130-\u318f\U00020000-\U0002ebef"
)
_CJK_RUN = re.compile(f"[{_CJK}]+")
_WORD = re.compile(f"[^\\W_{_CJK}]+|[{_CJK}]+")

# Words too common to say anything about what a question is looking for.
_STOP_WORDS_TEXT = (
    "a an the and or but if of at by for with about against between into through during before after above "
    "below to from up down in out on off over under again further then once here there when where why how all "
    "any both each few more most other some such no nor not only own same so than too very s t can will just "
    "don should now i me my myself we our ours ourselves you your yours yourself yourselves he him his himself "
    "she her hers herself it its itself they them their theirs themselves what which who whom this that these "
    "those am is are was were be been being have has had having do does did doing would could might must shall "
    "may also yet ever even d ll m o re ve y"
)
STOP_WORDS = frozenset(_STOP_WORDS_TEXT.split())


# A term in fewer rows than this is always searched for: it costs little. (A query whose terms
# match 1,600 rows, each ranked, takes 4 ms of a turn's 8; its distinctive terms alone, 0.9 ms.)
COMMON_ROWS = 200
# ... and a term in more is left out when its idf is under this share of the query's highest.
# On 100k synthetic memories: the FTS5 query's p95 falls by 60%, 94% of its top 16 unchanged.
IDF_SHARE = 0.25

_stemmers = threading.local()  # a PyStemmer stemmer is not thread-safe


def cjk_tokens(run: str) -> list[str]:
    """Characters and adjacent pairs of one CJK run."""
    return [*run, *(run[i:i + 2] for i in range(len(run) - 1))]


def index_text(text: str) -> str:
    """The text to store in the full-text index in place of `text`."""
    return " ".join(_CJK_RUN.sub(lambda m: " " + " ".join(cjk_tokens(m.group())) + " ", _fold(text)).split())


def query_terms(text: str) -> list[str]:
    """The distinct terms of a query, stop words dropped (all of them kept if
    nothing else is left); CJK runs become their pairs."""
    words = _WORD.findall(_fold(text))
    terms: list[str] = []
    for word in words:
        if _CJK_RUN.fullmatch(word):
            terms += [word] if len(word) == 1 else [word[i:i + 2] for i in range(len(word) - 1)]
        else:
            terms.append(word)
    kept = [t for t in terms if t not in STOP_WORDS] or terms
    return list(dict.fromkeys(kept))


def match_expression(text: str) -> str | None:
    """An FTS5 MATCH expression: any of the query's terms, each quoted. None when
    the query has no searchable term (only punctuation, say)."""
    terms = query_terms(text)
    return expression(terms) if terms else None


def indexed_form(term: str) -> str:
    """The token the index holds for a query term (as `unicode61 remove_diacritics` and
    `porter` make it), to look up how many rows have it. A word that is no more than a suffix
    ("eed", "ies", "sses") FTS5 stems otherwise: looked up under another token, it is never
    found common, so it is always searched for, which is harmless."""
    bare = "".join(c for c in unicodedata.normalize("NFKD", term) if not unicodedata.combining(c))
    if not (bare.isascii() and bare.isalpha()):
        return term
    if not 3 <= len(bare) <= 64:  # FTS5's porter leaves these as they are
        return bare
    stemmer = getattr(_stemmers, "porter", None) or Stemmer.Stemmer("porter")
    _stemmers.porter = stemmer
    return str(stemmer.stemWord(bare))


def distinctive(terms: Sequence[str], rows_with: Mapping[str, int], total_rows: int) -> list[str]:
    """The terms worth searching for, in their order: those in fewer than COMMON_ROWS rows,
    and those whose idf (as FTS5's BM25 computes it) is at least IDF_SHARE of the best."""
    def idf(rows: int) -> float:
        return max(1e-6, math.log((total_rows - rows + 0.5) / (rows + 0.5)))

    best = max((idf(rows_with.get(term, 0)) for term in terms), default=0.0)
    return [term for term in terms
            if rows_with.get(term, 0) < COMMON_ROWS or idf(rows_with[term]) >= IDF_SHARE * best]


def expression(terms: Sequence[str]) -> str:
    """An FTS5 MATCH expression: any of the terms, each quoted."""
    return " OR ".join('"' + term.replace('"', '""') + '"' for term in terms)


def ts_lexeme(term: str) -> str:
    """A term as PostgreSQL's to_tsquery reads it: quoted, so its characters are the term's own."""
    return "'" + term.replace("\\", "\\\\").replace("'", "''") + "'"


def _fold(text: str) -> str:
    return unicodedata.normalize("NFKC", text).casefold()


def owner_token(identity: str) -> str:
    """One index token per identity, whatever characters its name has: a search
    is always `owner:<token> AND (...)`, so it sees one person's memories only."""
    return "o" + hashlib.sha256(identity.encode()).hexdigest()[:24]
