"""Long-term memory as plain data: tiers, states, sources, records. No I/O.

A memory belongs to an identity (a person), never to a session. Facts carry
their history: an update supersedes the old fact instead of deleting it.
"""

from __future__ import annotations

import enum
import hashlib
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypedDict

from ember.core.errors import MemoryInputError
from ember.core.thinking import strip_thinking

LOCAL_IDENTITY = "local"  # the terminal's person

# Longer content is refused: a memory is a fact or a summary, not a document.
MAX_CONTENT_CHARS = 8_000
# An archived message's subject when its author has no name: a role, not a person.
ROLE_SUBJECTS = frozenset({"user", "assistant"})


class MemoryKind(enum.StrEnum):
    """The tiers. The working tier is the session window itself and has no rows."""

    EPISODIC = "episodic"  # consolidation summaries, with their source span
    FACT = "fact"  # semantic facts: subject, key, value
    ARCHIVAL = "archival"  # every committed user/assistant message
    PROCEDURAL = "procedural"  # skills


class MemoryStatus(enum.StrEnum):
    ACTIVE = "active"
    SUPERSEDED = "superseded"  # replaced by a newer fact; kept with its history
    ARCHIVED = "archived"  # forgotten: never injected, still found with --all
    PENDING = "pending"  # contradicts a better-sourced fact: needs confirmation


class SourceRank(enum.IntEnum):
    """Who vouches for a memory; a lower rank never overrides a higher one."""

    INFERRED = 1  # the model concluded it
    CONSOLIDATED = 2  # extracted from a conversation by consolidation
    USER_STATED = 3  # the person said it, or added it themselves


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryRecord:
    id: str
    identity: str
    kind: MemoryKind
    status: MemoryStatus
    content: str
    subject: str | None = None
    key: str | None = None
    source: str | None = None
    source_rank: SourceRank = SourceRank.USER_STATED
    session_key: str | None = None
    seq_start: int | None = None
    seq_end: int | None = None
    created_at: float
    valid_from: float
    invalid_at: float | None = None
    superseded_by: str | None = None
    recall_count: int = 0
    last_recalled_at: float | None = None
    strength: float = 1.0

    def to_json_dict(self) -> dict[str, object]:
        return {
            "id": self.id, "content": self.content, "kind": self.kind.value, "subject": self.subject,
            "key": self.key, "status": self.status.value, "created_at": self.created_at, "source": self.source,
            "source_rank": self.source_rank.name.lower(), "session_key": self.session_key,
            "seq_start": self.seq_start, "seq_end": self.seq_end, "valid_from": self.valid_from,
            "invalid_at": self.invalid_at, "superseded_by": self.superseded_by,
            "recall_count": self.recall_count, "last_recalled_at": self.last_recalled_at,
            "strength": round(self.strength, 4),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class NewMemory:
    """A memory to write. `created_at` None means now."""

    identity: str
    content: str
    kind: MemoryKind = MemoryKind.FACT
    subject: str | None = None
    key: str | None = None
    source: str | None = None
    source_rank: SourceRank = SourceRank.USER_STATED
    session_key: str | None = None
    seq_start: int | None = None
    seq_end: int | None = None
    created_at: float | None = None


class MemoryFields(TypedDict, total=False):
    """What `MemoryService.remember` may say of a memory besides its owner and text (NewMemory's fields)."""

    kind: MemoryKind
    subject: str | None
    key: str | None
    source: str | None
    source_rank: SourceRank
    session_key: str | None
    created_at: float | None


@dataclass(frozen=True, slots=True)
class Recalled:
    """A search hit: the record, its fused score (higher is better), whether the
    text index matched its words and how close in meaning it is (cosine, 0 without vectors)."""

    record: MemoryRecord
    score: float
    matched_words: bool = True
    similarity: float = 0.0

    def to_json_dict(self) -> dict[str, object]:
        """The record as search results show it (CLI and API alike): its fields and its score."""
        return {**self.record.to_json_dict(), "score": round(self.score, 6)}


@dataclass(frozen=True, slots=True)
class LexicalHits:
    """What a full-text search found: (num, BM25 score; higher is better), best first, and the
    records of the best of them where the search read those too, in the same transaction."""

    scores: list[tuple[int, float]]
    records: dict[int, MemoryRecord] = field(default_factory=dict)


# The system prompt's section of the person's profile facts, one "- fact" a line after it.
PROFILE_HEADING = "What you know about the person you are talking with:"

_SPACE = re.compile(r"\s+")
_EDGE_PUNCT = re.compile(r"^[\W_]+|[\W_]+$")


# A message of fewer words is a nod ("ok", "noted.", "thanks"): no neighbour to read another by,
# nothing to recall.
INFORMATIVE_WORDS = 2
_WORD = re.compile(r"[^\W_]+")


def says_something(text: str) -> bool:
    return len(_WORD.findall(text, 0, 200)) >= INFORMATIVE_WORDS


def remembered_in(session_key: str) -> str:
    """The source of a fact the model kept with the remember tool in a session."""
    return f"remember tool, session {session_key}"


def normalized(content: str) -> str:
    """The form duplicates are recognised by: NFKC, case-folded, spaces collapsed, edge punctuation off."""
    text = _SPACE.sub(" ", unicodedata.normalize("NFKC", content).casefold()).strip()
    return _EDGE_PUNCT.sub("", text)


def content_hash(content: str) -> str:
    return hashlib.sha256(normalized(content).encode()).hexdigest()[:32]


def normalized_key(value: str | None) -> str | None:
    """Subjects and keys compare case- and space-insensitively ("Favourite Color" = "favourite_color")."""
    if value is None:
        return None
    text = _SPACE.sub("_", unicodedata.normalize("NFKC", value).casefold().strip())
    return text or None


def check_content(content: str) -> str:
    """The content as a memory keeps it: without the model's thinking (I4), trimmed, not empty."""
    text = strip_thinking(content).strip()
    if not text:
        only_thinking = " but for thinking" if content.strip() else ""
        raise MemoryInputError(f"a memory needs some content; it was empty{only_thinking}")
    if len(text) > MAX_CONTENT_CHARS:
        raise MemoryInputError(f"a memory is at most {MAX_CONTENT_CHARS} characters; this one has {len(text)}")
    return text


# Channels whose senders are the gateway's key names, each its own identity by default.
KEYED_CHANNELS = frozenset({"http", "a2a"})
# Channels that act for a person (a scheduled task, a delegated task): their sender is the identity.
ACTING_CHANNELS = frozenset({"cron", "delegate"})


def default_identity(principal_or_session: str) -> str:
    """The identity of a principal, or of a session key (`http:alice:work` -> alice), with no bindings."""
    channel, _, rest = principal_or_session.partition(":")
    if channel == "cli" or not rest:
        return LOCAL_IDENTITY
    if channel in KEYED_CHANNELS:
        return rest.partition(":")[0]
    if channel in ACTING_CHANNELS:
        return rest
    return f"{channel}:{rest.partition(':')[0]}"


def session_identity(session_key: str, metadata: dict[str, object]) -> str:
    """The identity a session belongs to: recorded at its first message (with the
    configured bindings applied), else read off its channel and sender, else its key."""
    recorded = metadata.get("identity")
    if isinstance(recorded, str) and recorded:
        return recorded
    channel, sender = metadata.get("channel"), metadata.get("sender_id")
    if isinstance(channel, str) and isinstance(sender, str):
        return default_identity(f"{channel}:{sender}")
    return default_identity(session_key)


def memory_identity(identity: str, metadata: Mapping[str, object]) -> str:
    """Whose memory the words of a session go to: the person's, or, in a session of a named agent
    with a memory of its own (`[agents.NAME] memory = "own"`), that agent's with the person."""
    agent = metadata.get("agent")
    return f"{identity}@{agent}" if agent and metadata.get("memory") == "own" else identity


def shared_identity(session_key: str) -> str:
    """The identity of a session several people wrote in: the group's, nobody's own."""
    return f"shared:{session_key}"


@dataclass(frozen=True, slots=True)
class WriteOutcome:
    """What a write did: the record now standing for the content, whether it is
    new, and the facts it superseded."""

    record: MemoryRecord
    created: bool
    superseded: tuple[str, ...] = ()
