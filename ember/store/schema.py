"""The current tables, for building queries. migrations.py creates them."""

from sqlalchemy import BigInteger, Column, Float, Integer, LargeBinary, MetaData, Table, Text

metadata = MetaData()

sessions = Table(
    "sessions",
    metadata,
    Column("key", Text, primary_key=True),
    Column("next_seq", BigInteger, nullable=False),
    Column("last_consolidated", BigInteger, nullable=False),
    Column("metadata_json", Text, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
)

messages = Table(
    "messages",
    metadata,
    Column("session_key", Text, primary_key=True),
    Column("seq", BigInteger, primary_key=True),
    Column("role", Text, nullable=False),
    Column("content", Text, nullable=False),
    Column("tool_calls", Text),
    Column("tool_call_id", Text),
    Column("reasoning", Text),
    Column("turn_id", Text),
    Column("created_at", Float, nullable=False),
    Column("name", Text),
    Column("attachments", Text),
)

# The files messages came with, each stored once in its session under its digest (core/attachments.py).
attachments = Table(
    "attachments",
    metadata,
    Column("session_key", Text, primary_key=True),
    Column("digest", Text, primary_key=True),
    Column("media_type", Text, nullable=False),
    Column("size", BigInteger, nullable=False),
    Column("data", LargeBinary, nullable=False),
    Column("text", Text),  # a document's text, read once when it arrived
    Column("created_at", Float, nullable=False),
)

quarantine = Table(
    "quarantine",
    metadata,
    Column("id", Text, primary_key=True),
    Column("session_key", Text, nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("raw", Text, nullable=False),
    Column("reason", Text, nullable=False),
    Column("created_at", Float, nullable=False),
)

jobs = Table(
    "jobs",
    metadata,
    Column("id", Text, primary_key=True),
    Column("kind", Text, nullable=False),
    Column("dedupe_key", Text, nullable=False),
    Column("session_key", Text),
    Column("status", Text, nullable=False),
    Column("attempts", Integer, nullable=False),
    Column("next_run_at", Float, nullable=False),
    Column("last_error", Text),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("turn_id", Text),
    Column("claimed_by", Text),
    Column("claimed_until", Float),
)

conversation_digests = Table(
    "conversation_digests",
    metadata,
    Column("session_key", Text, primary_key=True),
    Column("owner", Text, nullable=False),
    Column("digest", Text, nullable=False),
    Column("updated_at", Float, nullable=False),
)

session_grants = Table(
    "session_grants",
    metadata,
    Column("session_key", Text, primary_key=True),
    Column("tool", Text, primary_key=True),
    Column("granted_at", Float, nullable=False),
)

leases = Table(
    "leases",
    metadata,
    Column("name", Text, primary_key=True),
    Column("holder", Text, nullable=False),
    Column("token", BigInteger, nullable=False),
    Column("expires_at", Float, nullable=False),
)

traces = Table(
    "traces",
    metadata,
    Column("turn_id", Text, primary_key=True),
    Column("session_key", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("error", Text),
    Column("detail", Text, nullable=False),
    Column("started_at", Float, nullable=False),
    Column("finished_at", Float, nullable=False),
)

inbox = Table(
    "inbox",
    metadata,
    Column("channel", Text, primary_key=True),
    Column("message_id", Text, primary_key=True),
    Column("session_key", Text, nullable=False),
    Column("chat_id", Text, primary_key=True),
    Column("sender_id", Text, nullable=False),
    Column("turn_id", Text, nullable=False),
    Column("received_at", Float, nullable=False),
    Column("answered_at", Float),
)

outbox = Table(
    "outbox",
    metadata,
    Column("delivery_id", Text, primary_key=True),
    Column("turn_id", Text, nullable=False),
    Column("session_key", Text, nullable=False),
    Column("channel", Text, nullable=False),
    Column("chat_id", Text, nullable=False),
    Column("reply_to", Text),
    Column("kind", Text, nullable=False),
    Column("text", Text, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("delivered_at", Float),
    Column("attempts", Integer, nullable=False),
    Column("failure", Text),
    Column("attachments", Text),  # the answer's files, by reference (core/attachments.py)
)

session_labels = Table(
    "session_labels",
    metadata,
    Column("session_key", Text, primary_key=True),
    Column("title", Text),
    Column("archived_at", Float),
)

accepted_inbound = Table(
    "accepted_inbound",
    metadata,
    Column("channel", Text, primary_key=True),
    Column("chat_id", Text, primary_key=True),
    Column("message_id", Text, primary_key=True),
    Column("sender_id", Text, nullable=False),
    Column("text", Text, nullable=False),
    Column("reply_channel", Text),
    Column("reply_chat_id", Text),
    Column("metadata_json", Text, nullable=False),
    Column("accepted_at", Float, nullable=False),
)

memory_items = Table(
    "memory_items",
    metadata,
    Column("num", Integer, primary_key=True),  # the rowid the text index and vectors refer to
    Column("id", Text, nullable=False, unique=True),
    Column("identity", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("content", Text, nullable=False),
    Column("content_hash", Text, nullable=False),
    Column("subject", Text),
    Column("fact_key", Text),
    Column("source", Text),
    Column("source_rank", Integer, nullable=False),
    Column("session_key", Text),
    Column("seq_start", BigInteger),
    Column("seq_end", BigInteger),
    Column("valid_from", Float, nullable=False),
    Column("invalid_at", Float),
    Column("superseded_by", Text),
    Column("recall_count", Integer, nullable=False),
    Column("last_recalled_at", Float),
    Column("strength", Float, nullable=False),
    Column("embedding_model", Text),
    Column("context_json", Text),  # an archived message's neighbours, for its text index and window vector
    Column("checked_at", Float),  # a keyless fact compared with older ones for contradictions
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("text_rev", BigInteger, nullable=False, server_default="0"),  # per identity; derived indexes follow it
)

memory_vectors = Table(
    "memory_vectors",
    metadata,
    Column("num", Integer, primary_key=True),
    Column("identity", Text, nullable=False),
    Column("model", Text, nullable=False),
    Column("rev", Integer, nullable=False),
    Column("vector", LargeBinary, nullable=False),
    Column("window", LargeBinary),
)

memory_archive_marks = Table(
    "memory_archive_marks",
    metadata,
    Column("session_key", Text, primary_key=True),
    Column("next_seq", BigInteger, nullable=False),
)

model_usage = Table(
    "model_usage",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("at", Float, nullable=False),
    Column("model", Text, nullable=False),
    Column("session_key", Text),
    Column("identity", Text),
    Column("turn_id", Text),
    Column("job_kind", Text),
    Column("input_tokens", BigInteger, nullable=False),
    Column("output_tokens", BigInteger, nullable=False),
    Column("cache_read_tokens", BigInteger, nullable=False),
    Column("cache_write_tokens", BigInteger, nullable=False),
    Column("cost_usd", Float),
    Column("agent", Text),  # the named agent whose turn made the call (None: the default agent, or background)
)

approvals = Table(
    "approvals",
    metadata,
    Column("id", Text, primary_key=True),
    Column("session_key", Text, nullable=False),
    Column("turn_id", Text, nullable=False),
    Column("identity", Text, nullable=False),
    Column("tool", Text, nullable=False),
    Column("summary", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("decided_by", Text),
    Column("created_at", Float, nullable=False),
    Column("decided_at", Float),
    Column("request_json", Text),
)

tasks = Table(
    "tasks",
    metadata,
    Column("id", Text, primary_key=True),
    Column("identity", Text, nullable=False),
    Column("prompt", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("spec", Text, nullable=False),
    Column("tz", Text, nullable=False),
    Column("anchor", Float, nullable=False),
    Column("reply_channel", Text),
    Column("reply_chat_id", Text),
    Column("missed", Text, nullable=False),
    Column("grant_approvals", Integer, nullable=False),
    Column("state", Text, nullable=False),
    Column("next_run_at", Float),
    Column("runs", Integer, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
)

task_runs = Table(
    "task_runs",
    metadata,
    Column("task_id", Text, primary_key=True),
    Column("scheduled_for", Float, primary_key=True),
    Column("outcome", Text, primary_key=True),
    Column("message_id", Text),
    Column("recorded_at", Float, nullable=False),
)

skills = Table(
    "skills",
    metadata,
    Column("identity", Text, primary_key=True),
    Column("name", Text, primary_key=True),
    Column("description", Text, nullable=False),
    Column("version", Integer, nullable=False),
    Column("status", Text, nullable=False),
    Column("origin", Text, nullable=False),
    Column("disk_digest", Text),
    Column("use_count", Integer, nullable=False, server_default="0"),
    Column("last_used_at", Float),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
)

skill_versions = Table(
    "skill_versions",
    metadata,
    Column("identity", Text, primary_key=True),
    Column("name", Text, primary_key=True),
    Column("version", Integer, primary_key=True),
    Column("text", Text, nullable=False),
    Column("files_json", Text, nullable=False),
    Column("source", Text, nullable=False),
    Column("admitted_by", Text, nullable=False),
    Column("turn_id", Text),
    Column("job_id", Text),
    Column("created_at", Float, nullable=False),
)

skill_proposals = Table(
    "skill_proposals",
    metadata,
    Column("id", Text, primary_key=True),
    Column("identity", Text, nullable=False),
    Column("name", Text, nullable=False),
    Column("action", Text, nullable=False),
    Column("base_version", Integer),
    Column("text", Text, nullable=False),
    Column("risk", Text, nullable=False),
    Column("risk_reasons", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("reason", Text, nullable=False),
    Column("session_key", Text),
    Column("turn_id", Text),
    Column("job_id", Text),
    Column("input_tokens", Integer, nullable=False, server_default="0"),
    Column("output_tokens", Integer, nullable=False, server_default="0"),
    Column("cost_usd", Float),
    Column("created_at", Float, nullable=False),
    Column("decided_at", Float),
    Column("decided_by", Text),
    Column("version", Integer),
)

skill_reviews = Table(
    "skill_reviews",
    metadata,
    Column("session_key", Text, primary_key=True),
    Column("reviewed_seq", BigInteger, nullable=False),
    Column("updated_at", Float, nullable=False),
)

a2a_tasks = Table(
    "a2a_tasks",
    metadata,
    Column("id", Text, primary_key=True),
    Column("owner", Text, nullable=False),
    Column("context_id", Text, nullable=False),
    Column("state", Text, nullable=False),
    Column("updated_ns", BigInteger),
    Column("version", BigInteger, nullable=False),
    Column("task_json", Text, nullable=False),
)

a2a_task_events = Table(
    "a2a_task_events",
    metadata,
    Column("seq", Integer, primary_key=True),
    Column("task_id", Text, nullable=False),
    Column("version", BigInteger, nullable=False),
    Column("event_json", Text, nullable=False),
    Column("created_at", Float, nullable=False),
)
