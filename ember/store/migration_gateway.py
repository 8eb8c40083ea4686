"""The gateway's migration steps: the conversations of clients that name no session, and A2A
tasks kept in the main store (they were in a file of each gateway's
own, so a task created through one gateway was unknown to the next).

`a2a_tasks`: one row per task, the task itself as the protocol's JSON, its `version` counting the
writes (a write names the version it read: two writers never overwrite each other unseen).
`a2a_task_events`: the events those writes applied, in order, for a stream followed through
another gateway than the one running the task.
"""

from __future__ import annotations

from ember.store.migration_step import ByDialect, Step

_EVENTS = """CREATE TABLE a2a_task_events (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            task_id TEXT NOT NULL,
            version BIGINT NOT NULL,
            event_json TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL)"""

A2A_TASKS: tuple[Step, ...] = (
    """CREATE TABLE a2a_tasks (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        context_id TEXT NOT NULL,
        state TEXT NOT NULL,
        updated_ns BIGINT,
        version BIGINT NOT NULL,
        task_json TEXT NOT NULL)""",
    # ListTasks: a caller's own, newest first.
    "CREATE INDEX a2a_tasks_by_owner ON a2a_tasks (owner, updated_ns)",
    ByDialect.edited(_EVENTS, "seq INTEGER PRIMARY KEY AUTOINCREMENT",
                     "seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY"),
    "CREATE INDEX a2a_task_events_by_task ON a2a_task_events (task_id, seq)",
    # Old events are pruned by age.
    "CREATE INDEX a2a_task_events_by_age ON a2a_task_events (created_at)",
)


# The conversation each gateway session holds, as a client that names no session sends it back:
# a digest of its messages so far, by its owner (the caller's identity).
CONVERSATION_DIGESTS: tuple[Step, ...] = (
    """CREATE TABLE conversation_digests (
            session_key TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            digest TEXT NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL)""",
    "CREATE INDEX conversation_digests_by_digest ON conversation_digests (owner, digest)",
)


# Each model call names the named agent whose turn made it: a day's budget per agent ([agents.NAME]
# budget_usd_per_day) is summed from these.
USAGE_BY_AGENT: tuple[Step, ...] = (
    "ALTER TABLE model_usage ADD COLUMN agent TEXT",
    "CREATE INDEX model_usage_by_agent ON model_usage (agent, at)",
)


# Messages keep the files they came with by reference; each file's bytes are stored once in its
# session (core/attachments.py), with a document's text.
ATTACHMENTS: tuple[Step, ...] = (
    "ALTER TABLE messages ADD COLUMN attachments TEXT",
    ByDialect.edited("""CREATE TABLE attachments (
            session_key TEXT NOT NULL,
            digest TEXT NOT NULL,
            media_type TEXT NOT NULL,
            size BIGINT NOT NULL,
            data BLOB NOT NULL,
            text TEXT,
            created_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (session_key, digest))""", "data BLOB", "data BYTEA"),
)


# An answer can send files (a tool's, a spoken reply): its outbox record names them, for a re-send.
ANSWER_FILES: tuple[Step, ...] = (
    "ALTER TABLE outbox ADD COLUMN attachments TEXT",
)
