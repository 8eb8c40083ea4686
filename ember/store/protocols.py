"""What the runtime needs of each store: one narrow protocol per consumer, all in one place.

The pipeline, the loop, the workers, the channels and memory are written against these, never
against an engine (the admin commands read the `Sql…` classes directly). Each has one
implementation, the `Sql…` class beside its tables, written once over the `Tx` unit of work of
either engine (`engine.Database`). Errors are Ember's own (`ember.core.errors`), never a driver's.
tests/test_store_protocols.py checks that each implementation's signatures are these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ember.core.skills import ProposalStatus

if TYPE_CHECKING:
    from ember.core.approvals import ApprovalRow, AskedBefore
    from ember.core.attachments import AttachmentContent, StoredFile
    from ember.core.delivery import Delivery, Receipt
    from ember.core.events import InboundEvent
    from ember.core.jobs import Claimed, Job, JobRequest
    from ember.core.memory import LexicalHits, MemoryKind, MemoryRecord, MemoryStatus, NewMemory, WriteOutcome
    from ember.core.messages import Message, Session
    from ember.core.skills import NewVersion, Proposal, Skill, SkillStatus, SkillVersion
    from ember.core.tasks import Task, TaskRun, TaskState
    from ember.core.traces import TurnTrace
    from ember.core.usage import UsageCell, UsageRow
    from ember.store.memory_rows import Archived, Unembedded
    from ember.store.records import SessionSummary


class SessionStore(Protocol):
    """Sessions, for the pipeline and the memory workers: a window loaded (and the files its
    messages name), a turn's messages committed with what they answer and owe (the ResponseStage
    boundary), the consolidation boundary moved (I5)."""

    async def load(self, key: str) -> Session: ...

    async def last_question(self, key: str) -> str | None: ...

    async def append(self, session: Session, messages: Sequence[Message], *, receipt: Receipt | None = None,
                     delivery: Delivery | None = None, jobs: Sequence[JobRequest] = ()) -> None: ...

    async def advance_boundary(self, key: str, *, expected: int, new: int, summary: str,
                               facts: Sequence[NewMemory] = (), identity: str | None = None) -> bool: ...

    async def attachments(self, key: str, digests: Sequence[str]) -> dict[str, StoredFile]: ...


class SessionBrowser(Protocol):
    """What the HTTP API shows of a person's sessions and sets (names, archiving, files sent)."""

    async def list_sessions(self, prefix: str = "", *, archived: bool = True) -> list[SessionSummary]: ...

    async def history(self, key: str) -> list[Message]: ...

    async def label(self, key: str, *, title: str | None = None, archived: bool | None = None) -> bool: ...

    async def keep_attachments(self, key: str, files: Sequence[AttachmentContent]) -> None: ...

    async def attachments(self, key: str, digests: Sequence[str]) -> dict[str, StoredFile]: ...


class SessionTitles(Protocol):
    """The title job: a session's history, and its title set only if nobody named it first."""

    async def history(self, key: str) -> list[Message]: ...

    async def name_if_untitled(self, key: str, title: str) -> bool: ...


class Inbox(Protocol):
    """The accepted messages and what their turns answered, for the agent loop and the
    channels that accept messages and look up answers (I1, I2)."""

    async def accept(self, event: InboundEvent) -> bool: ...

    async def receipt(self, channel: str, chat_id: str, message_id: str) -> Receipt | None: ...

    async def unanswered_in(self, session_key: str) -> Receipt | None: ...

    async def unanswered(self) -> list[Receipt]: ...

    async def unstarted(self, channels: Iterable[str]) -> list[InboundEvent]: ...

    async def answer_of(self, turn_id: str) -> Delivery | None: ...

    async def failures(self, session_key: str) -> list[Delivery]: ...

    async def record(self, session_key: str, delivery: Delivery) -> None: ...


class Outbox(Protocol):
    """The answers owed to channels, for the delivery worker: sent again until confirmed."""

    async def undelivered(self, channels: Iterable[str], *, older_than_s: float = 0.0) -> list[Delivery]: ...

    async def mark_delivered(self, delivery_ids: Iterable[str]) -> None: ...

    async def mark_given_up(self, refused: Iterable[tuple[str, str]]) -> None: ...


class DeliveryStore(Inbox, Outbox, Protocol):
    """The inbox and the outbox, kept together: a turn's commit writes both."""


class JobQueue(Protocol):
    """Durable background jobs (I6), for the background runner."""

    async def enqueue(self, kind: str, dedupe_key: str, *, session_key: str | None = None) -> bool: ...

    async def claim_due(self, limit: int) -> Claimed: ...

    async def complete(self, job: Job) -> None: ...

    async def fail(self, job: Job, error: str, *, retry_in_s: float | None) -> None: ...

    async def release(self, job: Job) -> None: ...

    async def requeue_interrupted(self) -> int: ...

    async def counts(self) -> dict[str, int]: ...


class SharedJobQueue(JobQueue, Protocol):
    """A queue several processes run jobs from, each renewing its claims before `claim_ttl_s` runs out."""

    claim_ttl_s: float

    async def extend(self, jobs: Iterable[Job]) -> int: ...


class TraceLog(Protocol):
    """Where the agent loop records each turn's trace: kept by `record`, written by `flush`."""

    async def record(self, trace: TurnTrace) -> None: ...

    async def flush(self) -> None: ...


class TraceReader(Protocol):
    """The activity page: the latest turns' traces, and one turn's."""

    async def recent(self, limit: int, session_key: str | None = None, *, prefix: str = "") -> list[TurnTrace]: ...

    async def get(self, turn_id: str) -> TurnTrace | None: ...


class JobCounts(Protocol):
    """The background jobs by status, for the gateway's metrics."""

    async def counts(self) -> dict[str, int]: ...


class ApprovalLog(Protocol):
    """Approval requests as rows, for the approval broker: answered, listed and expired in
    whichever process the person reaches."""

    async def opened(self, approval_id: str, session_key: str, turn_id: str, identity: str, tool: str,
                     summary: str, request_json: str | None = None) -> None: ...

    async def closed(self, approval_id: str, status: str, decided_by: str) -> bool: ...

    async def pending_requests(self, since: float) -> list[str]: ...

    async def get(self, approval_id: str) -> ApprovalRow | None: ...

    async def asked_before(self, turn_id: str, tool: str, summary: str, *, since: float) -> list[AskedBefore]: ...

    async def expire_turn(self, turn_id: str, decided_by: str) -> int: ...

    async def expire_pending(self, *, older_than_s: float = 0.0) -> int: ...


class ConversationIndex(Protocol):
    """Which session holds a conversation, for the OpenAI route's clients that name no session."""

    async def take(self, owner: str, digest: str) -> str | None: ...

    async def put(self, owner: str, session_key: str, digest: str) -> None: ...


class DueTasks(Protocol):
    """Scheduled tasks, for the scheduler: each due run claimed once, with its message."""

    async def claim_due(self, now: float, *, missed_after_s: float, limit: int = 500) -> list[InboundEvent]: ...

    async def next_due_at(self) -> float | None: ...


class TaskBook(Protocol):
    """A person's scheduled tasks as the task tools and the HTTP API keep them; `clock` is what
    "now" is when a task is added or changed."""

    clock: Callable[[], float]

    async def add(self, task: Task) -> Task: ...

    async def get(self, task_id: str, identity: str | None = None) -> Task | None: ...

    async def list(self, identity: str | None = None) -> list[Task]: ...

    async def set_state(self, task_id: str, state: TaskState, identity: str | None = None,
                        now: float | None = None) -> Task | None: ...

    async def runs(self, task_id: str, limit: int = 20) -> list[TaskRun]: ...


class ChannelMessages(Protocol):
    """The messages a chat platform shows of each answer (a draft, then its parts) and which
    delivery they show in full: what lets a re-sent final edit them instead of sending twice."""

    async def parts(self, channel: str, turn_id: str) -> dict[int, str]: ...

    async def digests(self, channel: str, turn_id: str) -> dict[int, str]: ...

    async def record(self, channel: str, chat_id: str, turn_id: str, part: int, message_id: str) -> None: ...

    async def drop(self, channel: str, turn_id: str, parts: list[int]) -> None: ...

    async def finished(self, channel: str, turn_id: str) -> str | None: ...

    async def finish(self, channel: str, turn_id: str, delivery_id: str | None, digests: dict[int, str]) -> None: ...


class ChatCounters(Protocol):
    """Per-chat counters a platform needs across restarts (QQ's msg_seq)."""

    async def next_counter(self, channel: str, name: str) -> int: ...


class PlatformMessages(ChannelMessages, ChatCounters, Protocol):
    """Both, as one store keeps them."""


class UsageLedger(Protocol):
    """Model calls and their cost, for the usage recorder and its budgets."""

    async def record(self, rows: Sequence[UsageRow]) -> None: ...

    async def spent(self, identity: str, since: float) -> float: ...

    async def spent_by_agent(self, agent: str, since: float) -> float: ...


class UsageReport(Protocol):
    """A person's model usage, by day and session, for the page's Usage view."""

    async def by_day_and_session(self, identity: str, since: float, shift_s: int) -> list[UsageCell]: ...


class MemoryRecall(Protocol):
    """What recall reads (hits, records, a prompt's profile and episodes), and the recalls it notes."""

    async def lexical(self, identity: str, terms: Sequence[str], limit: int, *, records: int = 0) -> LexicalHits: ...

    async def by_nums(self, identity: str, nums: Sequence[int]) -> dict[int, MemoryRecord]: ...

    # The profile facts and the session's episodes of each owner, in one read.
    async def prompt_records(self, identity: str, profile_limit: int, episode_owners: Sequence[str],
                             session_key: str, episode_limit: int) -> tuple[list[MemoryRecord], list[MemoryRecord]]: ...

    async def note_recalls(self, recalls: dict[tuple[str, str], tuple[int, float]]) -> None: ...


class MemoryWrites(Protocol):
    """Memories written: stated, reviewed, corrected, archived from a session's messages."""

    async def write(self, memory: NewMemory) -> WriteOutcome: ...

    async def write_many(self, memories: Sequence[NewMemory]) -> list[WriteOutcome]: ...

    async def set_status(self, identity: str, memory_id: str, status: MemoryStatus) -> MemoryRecord: ...

    async def revise(self, identity: str, memory_id: str, content: str) -> WriteOutcome: ...

    async def archive_session(self, session_key: str, resolve: Callable[[str, str], str], *,
                              queue_embedding: bool = True, pending: int = 0) -> Archived: ...

    async def senders(self, session_key: str) -> dict[str, tuple[str, str]]: ...


class EmbeddingQueue(Protocol):
    """The memories waiting for their vectors, and the vectors written for them."""

    async def queue_embedding(self) -> None: ...

    async def unembedded(self, limit: int) -> list[Unembedded]: ...

    async def set_vectors(self, model: str, vectors: Iterable[tuple[Unembedded, bytes, bytes | None]]) -> int: ...

    async def forget_other_models(self, model: str) -> int: ...

    async def count_unembedded(self) -> int: ...


class MemoryUpkeep(Protocol):
    """The background's care of memory: strengths that fade, and new facts checked against old."""

    async def decay_candidates(self, kinds: Sequence[MemoryKind]) -> list[MemoryRecord]: ...

    async def set_strengths(self, strengths: dict[str, float], archive: Sequence[str]) -> None: ...

    async def unchecked_facts(self, limit: int) -> list[MemoryRecord]: ...

    async def mark_checked(self, identity: str, memory_id: str) -> None: ...

    async def supersede_by(self, identity: str, old_id: str, new_id: str) -> None: ...


class MemoryAdmin(Protocol):
    """What the commands and the API show, purge and rebuild."""

    async def list(self, identity: str, *, kinds: Sequence[MemoryKind] = (), include_inactive: bool = False,
                   limit: int = 100, session_key: str | None = None) -> list[MemoryRecord]: ...

    async def history(self, identity: str, memory_id: str) -> list[MemoryRecord]: ...

    async def purge(self, identity: str, memory_id: str) -> None: ...

    async def purge_sessions(self, keys: Sequence[str]) -> int: ...

    async def reindex_text(self, progress: Callable[[int, int], None] | None = None) -> int: ...


class MemoryStore(MemoryRecall, MemoryWrites, EmbeddingQueue, MemoryUpkeep, MemoryAdmin, Protocol):
    """Long-term memory's rows, all of them, as the memory service holds them."""


class TextRows(Protocol):
    """What the in-process text index catches up from: memories' texts by revision."""

    async def count(self, identity: str) -> int: ...

    async def text_rev(self, identity: str) -> int: ...

    async def texts_after(self, identity: str, rev: int, limit: int) -> list[tuple[int, int, tuple[str, ...]]]: ...


# (nums, own scores, window scores) of the vectors the database read, and the nums of those it could not.
ScoredVectors = tuple[list[int], list[float], list[float], list[int]]


class VectorRows(Protocol):
    """Memories' vectors: by revision, for the matrices a process holds (SQLite), or scored by the
    database itself (PostgreSQL)."""

    # (count, highest rev) of the identity's vectors, and those written after `rev`, in one read.
    async def vectors_since(self, identity: str, model: str,
                            rev: int) -> tuple[tuple[int, int], list[tuple[int, int, bytes, bytes | None]]]: ...

    @property
    def scores_vectors(self) -> bool:
        """Whether `vector_scores` is the database's (PostgreSQL), so no process need hold the vectors."""
        ...

    # Each of the identity's vectors scored against `query`; None when it has `most` or more.
    async def vector_scores(self, identity: str, model: str, query: Sequence[float], *,
                            most: int) -> ScoredVectors | None: ...

    async def quarantine_vector(self, num: int) -> None: ...


class SkillStore(Protocol):
    """Skills, their versions and the proposals to change them, for the skill library."""

    async def visible(self, identity: str | None, *, include_archived: bool = False) -> list[Skill]: ...

    async def freshness(self, identity: str) -> tuple[Any, ...]: ...

    async def get(self, identity: str | None, name: str) -> Skill | None: ...

    async def version(self, skill: Skill, version: int | None = None) -> SkillVersion | None: ...

    async def history(self, skill: Skill) -> list[SkillVersion]: ...

    async def disk_digests(self) -> dict[str, tuple[str | None, str]]: ...

    async def add_version(self, change: NewVersion) -> SkillVersion: ...

    async def set_status(self, identity: str, names: Sequence[str], status: SkillStatus) -> None: ...

    async def record_use(self, skill: Skill, at: float) -> None: ...

    async def unused_since(self, before: float) -> list[Skill]: ...

    async def proposal(self, proposal_id: str, identity: str | None = None) -> Proposal | None: ...

    async def proposals(self, identity: str | None, status: ProposalStatus | None = ProposalStatus.PENDING,
                        limit: int = 100) -> list[Proposal]: ...

    async def decide(self, proposal: Proposal, by: str, admit: NewVersion | None) -> Proposal | None: ...

    async def review_mark(self, session_key: str) -> int: ...

    async def finish_review(self, session_key: str, reviewed_seq: int, proposal: Proposal | None,
                            admit: NewVersion | None = None) -> Proposal | None: ...
