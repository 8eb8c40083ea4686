"""Every schema migration Ember has shipped, oldest first: what `migrations.migrate` applies.

Never edit one that has shipped: add a new one at the end. Where PostgreSQL
differs: numbers SQLite gives out (`INTEGER PRIMARY KEY`) are identity
columns; the memory's full-text index is a table with a `tsvector` column and a
GIN index instead of FTS5 (its key is named `rowid`, as FTS5's, so the
statements that join on it read alike); its vectors are also kept as
pgvector's; triggers call a PL/pgSQL function.
"""

from __future__ import annotations

from ember.store.migration_gateway import (
    A2A_TASKS,
    ANSWER_FILES,
    ATTACHMENTS,
    CONVERSATION_DIGESTS,
    USAGE_BY_AGENT,
)
from ember.store.migration_memory import MEMORY_TIERS, VECTORS_IN_DATABASE
from ember.store.migration_step import ByDialect, Step

MIGRATIONS: list[tuple[Step, ...]] = [
    (
        """CREATE TABLE sessions (
            key TEXT PRIMARY KEY,
            next_seq BIGINT NOT NULL,
            last_consolidated BIGINT NOT NULL DEFAULT 0,
            metadata_json TEXT NOT NULL DEFAULT '{}',
            created_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL)""",
        """CREATE TABLE messages (
            session_key TEXT NOT NULL,
            seq BIGINT NOT NULL,
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            tool_calls TEXT,
            tool_call_id TEXT,
            reasoning TEXT,
            turn_id TEXT,
            created_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (session_key, seq))""",
        """CREATE TABLE quarantine (
            id TEXT PRIMARY KEY,
            session_key TEXT NOT NULL,
            seq BIGINT NOT NULL,
            raw TEXT NOT NULL,
            reason TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL)""",
        """CREATE TABLE jobs (
            id TEXT PRIMARY KEY,
            kind TEXT NOT NULL,
            dedupe_key TEXT NOT NULL,
            session_key TEXT,
            status TEXT NOT NULL,
            attempts INTEGER NOT NULL DEFAULT 0,
            next_run_at DOUBLE PRECISION NOT NULL,
            last_error TEXT,
            created_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL)""",
        "CREATE UNIQUE INDEX jobs_one_pending ON jobs (kind, dedupe_key) WHERE status = 'pending'",
        "CREATE INDEX jobs_due ON jobs (status, next_run_at)",
        """CREATE TABLE memories (
            id TEXT PRIMARY KEY,
            session_key TEXT,
            kind TEXT NOT NULL,
            content TEXT NOT NULL,
            source_start BIGINT,
            source_end BIGINT,
            embedding TEXT,
            created_at DOUBLE PRECISION NOT NULL)""",
        "CREATE INDEX memories_by_session ON memories (session_key, kind, created_at)",
        """CREATE TABLE traces (
            turn_id TEXT PRIMARY KEY,
            session_key TEXT NOT NULL,
            status TEXT NOT NULL,
            error TEXT,
            detail TEXT NOT NULL,
            started_at DOUBLE PRECISION NOT NULL,
            finished_at DOUBLE PRECISION NOT NULL)""",
    ),
    (
        # Every accepted message, once per (channel, chat_id, message_id): a redelivery finds it here.
        """CREATE TABLE inbox (
            channel TEXT NOT NULL,
            message_id TEXT NOT NULL,
            session_key TEXT NOT NULL,
            chat_id TEXT NOT NULL,
            sender_id TEXT NOT NULL,
            turn_id TEXT NOT NULL,
            received_at DOUBLE PRECISION NOT NULL,
            answered_at DOUBLE PRECISION,
            PRIMARY KEY (channel, chat_id, message_id))""",
        "CREATE INDEX inbox_unanswered ON inbox (received_at) WHERE answered_at IS NULL",
        # Every committed answer, written with it; delivered_at is set once a channel has it.
        """CREATE TABLE outbox (
            delivery_id TEXT PRIMARY KEY,
            turn_id TEXT NOT NULL,
            session_key TEXT NOT NULL,
            channel TEXT NOT NULL,
            chat_id TEXT NOT NULL,
            reply_to TEXT,
            kind TEXT NOT NULL,
            text TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            delivered_at DOUBLE PRECISION,
            attempts INTEGER NOT NULL DEFAULT 0)""",
        "CREATE INDEX outbox_by_turn ON outbox (turn_id)",
        "CREATE INDEX outbox_undelivered ON outbox (created_at) WHERE delivered_at IS NULL",
    ),
    MEMORY_TIERS,
    (
        # Who wrote a message, where a session has several participants (a group chat).
        "ALTER TABLE messages ADD COLUMN name TEXT",
    ),
    (
        # How many vectors each identity has, and their highest revision, kept by the database itself:
        # what a cached matrix checks before every search, one row read instead of a count.
        """CREATE TABLE memory_vector_heads (
            identity TEXT NOT NULL,
            model TEXT NOT NULL,
            rows BIGINT NOT NULL,
            rev BIGINT NOT NULL,
            PRIMARY KEY (identity, model))""",
        "INSERT INTO memory_vector_heads (identity, model, rows, rev) "
        "SELECT identity, model, COUNT(*), MAX(rev) FROM memory_vectors GROUP BY identity, model",
        ByDialect(
            ("""CREATE TRIGGER memory_vector_added AFTER INSERT ON memory_vectors BEGIN
            INSERT INTO memory_vector_heads (identity, model, rows, rev) VALUES (new.identity, new.model, 1, new.rev)
            ON CONFLICT (identity, model) DO UPDATE SET rows = rows + 1, rev = MAX(rev, excluded.rev);
        END""",
             """CREATE TRIGGER memory_vector_removed AFTER DELETE ON memory_vectors BEGIN
            UPDATE memory_vector_heads SET rows = rows - 1 WHERE identity = old.identity AND model = old.model;
        END""",
             """CREATE TRIGGER memory_vector_replaced AFTER UPDATE ON memory_vectors BEGIN
            UPDATE memory_vector_heads SET rows = rows - 1 WHERE identity = old.identity AND model = old.model;
            INSERT INTO memory_vector_heads (identity, model, rows, rev) VALUES (new.identity, new.model, 1, new.rev)
            ON CONFLICT (identity, model) DO UPDATE SET rows = rows + 1, rev = MAX(rev, excluded.rev);
        END"""),
            # The same three, as one function.
            ("""CREATE FUNCTION memory_vector_heads_follow() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF TG_OP <> 'INSERT' THEN
                    UPDATE memory_vector_heads SET rows = rows - 1 WHERE identity = OLD.identity AND model = OLD.model;
                END IF;
                IF TG_OP <> 'DELETE' THEN
                    INSERT INTO memory_vector_heads AS head (identity, model, rows, rev)
                    VALUES (NEW.identity, NEW.model, 1, NEW.rev)
                    ON CONFLICT (identity, model) DO UPDATE SET rows = head.rows + 1, rev = GREATEST(head.rev, NEW.rev);
                END IF;
                RETURN NULL;
            END $$""",
             "CREATE TRIGGER memory_vector_heads_follow AFTER INSERT OR UPDATE OR DELETE ON memory_vectors "
             "FOR EACH ROW EXECUTE FUNCTION memory_vector_heads_follow()"),
        ),
    ),
    (
        # How many rows hold each term: a search leaves out terms far more common than its rarest.
        # (PostgreSQL counts a term's rows through memory_fts's GIN index.)
        ByDialect("CREATE VIRTUAL TABLE memory_fts_terms USING fts5vocab(memory_fts, 'row')", ()),
    ),
    (
        # Grows with every write of a memory's text row, per identity: a derived index
        # (memory/text_index.py) reads the rows written since the revision it holds.
        "ALTER TABLE memory_items ADD COLUMN text_rev BIGINT NOT NULL DEFAULT 0",
        "UPDATE memory_items SET text_rev = ranked.rev FROM (SELECT num, ROW_NUMBER() OVER "
        "(PARTITION BY identity ORDER BY num) AS rev FROM memory_items) AS ranked WHERE ranked.num = memory_items.num",
        "CREATE INDEX memory_by_text_rev ON memory_items (identity, text_rev)",
    ),
    (
        # One row per model call: tokens, cost (NULL: a price is missing) and whom it is charged to.
        ByDialect.edited("""CREATE TABLE model_usage (
            id INTEGER PRIMARY KEY,
            at DOUBLE PRECISION NOT NULL,
            model TEXT NOT NULL,
            session_key TEXT,
            identity TEXT,
            turn_id TEXT,
            job_kind TEXT,
            input_tokens BIGINT NOT NULL,
            output_tokens BIGINT NOT NULL,
            cache_read_tokens BIGINT NOT NULL,
            cache_write_tokens BIGINT NOT NULL,
            cost_usd DOUBLE PRECISION)""",
            "id INTEGER PRIMARY KEY", "id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY"),
        "CREATE INDEX model_usage_by_time ON model_usage (at)",
        "CREATE INDEX model_usage_by_identity ON model_usage (identity, at)",
    ),
    (
        # The turn whose commit queued a job: its trace links to that turn's.
        "ALTER TABLE jobs ADD COLUMN turn_id TEXT",
    ),
    (
        # Approval requests outlive the process that asked: after a restart one is clearly expired.
        """CREATE TABLE approvals (
            id TEXT PRIMARY KEY,
            session_key TEXT NOT NULL,
            turn_id TEXT NOT NULL,
            identity TEXT NOT NULL,
            tool TEXT NOT NULL,
            summary TEXT NOT NULL,
            status TEXT NOT NULL,
            decided_by TEXT,
            created_at DOUBLE PRECISION NOT NULL,
            decided_at DOUBLE PRECISION)""",
        "CREATE INDEX approvals_pending ON approvals (status) WHERE status = 'pending'",
    ),
    (
        # An answer a channel refused for good (a 4xx from a webhook target): kept, never re-sent.
        "ALTER TABLE outbox ADD COLUMN failure TEXT",
        # Messages a channel accepted before their turn could start (a webhook answered 202): each is
        # published again at start until its turn has a receipt.
        """CREATE TABLE accepted_inbound (
            channel TEXT NOT NULL,
            chat_id TEXT NOT NULL,
            message_id TEXT NOT NULL,
            sender_id TEXT NOT NULL,
            text TEXT NOT NULL,
            reply_channel TEXT,
            reply_chat_id TEXT,
            metadata_json TEXT NOT NULL,
            accepted_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (channel, chat_id, message_id))""",
    ),
    (
        # Scheduled tasks: the next run is advanced in the transaction that claims a run.
        """CREATE TABLE tasks (
            id TEXT PRIMARY KEY,
            identity TEXT NOT NULL,
            prompt TEXT NOT NULL,
            kind TEXT NOT NULL,
            spec TEXT NOT NULL,
            tz TEXT NOT NULL,
            anchor DOUBLE PRECISION NOT NULL,
            reply_channel TEXT,
            reply_chat_id TEXT,
            missed TEXT NOT NULL,
            grant_approvals INTEGER NOT NULL,
            state TEXT NOT NULL,
            next_run_at DOUBLE PRECISION,
            runs INTEGER NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL)""",
        "CREATE INDEX tasks_due ON tasks (next_run_at) WHERE state = 'active'",
        "CREATE INDEX tasks_owner ON tasks (identity, created_at)",
        # Every run claimed, and every run missed while Ember was down.
        """CREATE TABLE task_runs (
            task_id TEXT NOT NULL,
            scheduled_for DOUBLE PRECISION NOT NULL,
            outcome TEXT NOT NULL,
            message_id TEXT,
            recorded_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (task_id, scheduled_for, outcome))""",
    ),
    (
        # What a person calls a session, and the sessions they put away (their history is kept).
        """CREATE TABLE session_labels (
            session_key TEXT PRIMARY KEY,
            title TEXT,
            archived_at DOUBLE PRECISION)""",
    ),
    (
        # Skills, shared (identity '') or one identity's. A change is a new version, never an edit.
        """CREATE TABLE skills (
            identity TEXT NOT NULL,
            name TEXT NOT NULL,
            description TEXT NOT NULL,
            version INTEGER NOT NULL,
            status TEXT NOT NULL,
            origin TEXT NOT NULL,
            disk_digest TEXT,
            use_count INTEGER NOT NULL DEFAULT 0,
            last_used_at DOUBLE PRECISION,
            created_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (identity, name))""",
        """CREATE TABLE skill_versions (
            identity TEXT NOT NULL,
            name TEXT NOT NULL,
            version INTEGER NOT NULL,
            text TEXT NOT NULL,
            files_json TEXT NOT NULL,
            source TEXT NOT NULL,
            admitted_by TEXT NOT NULL,
            turn_id TEXT,
            job_id TEXT,
            created_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (identity, name, version))""",
        """CREATE TABLE skill_proposals (
            id TEXT PRIMARY KEY,
            identity TEXT NOT NULL,
            name TEXT NOT NULL,
            action TEXT NOT NULL,
            base_version INTEGER,
            text TEXT NOT NULL,
            risk TEXT NOT NULL,
            risk_reasons TEXT NOT NULL,
            status TEXT NOT NULL,
            reason TEXT NOT NULL,
            session_key TEXT,
            turn_id TEXT,
            job_id TEXT,
            input_tokens INTEGER NOT NULL DEFAULT 0,
            output_tokens INTEGER NOT NULL DEFAULT 0,
            cost_usd DOUBLE PRECISION,
            created_at DOUBLE PRECISION NOT NULL,
            decided_at DOUBLE PRECISION,
            decided_by TEXT,
            version INTEGER)""",
        # A review job retried after a crash finds its proposal already written.
        "CREATE UNIQUE INDEX skill_proposals_by_job ON skill_proposals (job_id)",
        "CREATE INDEX skill_proposals_by_status ON skill_proposals (identity, status, created_at)",
        # How far each session's turns have been reviewed for skills; advanced only by a review that succeeded.
        """CREATE TABLE skill_reviews (
            session_key TEXT PRIMARY KEY,
            reviewed_seq BIGINT NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL)""",
    ),
    (
        # The messages a chat platform shows of each answer (a draft, then its parts), so that a
        # final re-sent after a crash edits them rather than sending a second copy.
        """CREATE TABLE channel_messages (
            channel TEXT NOT NULL,
            turn_id TEXT NOT NULL,
            part INTEGER NOT NULL,
            chat_id TEXT NOT NULL,
            message_id TEXT NOT NULL,
            digest TEXT,
            created_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (channel, turn_id, part))""",
        # Which delivery each answer's messages show in full.
        """CREATE TABLE channel_finals (
            channel TEXT NOT NULL,
            turn_id TEXT NOT NULL,
            delivery_id TEXT,
            finished_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (channel, turn_id))""",
        # Per-chat counters a platform needs to survive a restart (QQ's msg_seq).
        """CREATE TABLE channel_counters (
            channel TEXT NOT NULL,
            name TEXT NOT NULL,
            value BIGINT NOT NULL,
            PRIMARY KEY (channel, name))""",
    ),
    (
        # A session's history shows the error each unanswered turn ended with.
        "CREATE INDEX outbox_by_session ON outbox (session_key, kind)",
        # The activity page lists the newest turns first.
        "CREATE INDEX traces_by_start ON traces (started_at)",
    ),
    (
        # Leases that several processes on one database contend for (a session's turns, the
        # scheduler): `token` grows with every new holder, and fences off the ones before.
        """CREATE TABLE leases (
            name TEXT PRIMARY KEY,
            holder TEXT NOT NULL,
            token BIGINT NOT NULL,
            expires_at DOUBLE PRECISION NOT NULL)""",
        # A running job is its claimer's until claimed_until, which the claimer keeps moving;
        # past it, the claimer is presumed dead and another process takes the job.
        "ALTER TABLE jobs ADD COLUMN claimed_by TEXT",
        "ALTER TABLE jobs ADD COLUMN claimed_until DOUBLE PRECISION",
        # "Allow for this session": kept with the session, so every process running its turns honours it.
        """CREATE TABLE session_grants (
            session_key TEXT NOT NULL,
            tool TEXT NOT NULL,
            granted_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (session_key, tool))""",
        # The whole request, for a process other than the one whose turn waits on it to list.
        "ALTER TABLE approvals ADD COLUMN request_json TEXT",
    ),
    CONVERSATION_DIGESTS,
    A2A_TASKS,
    USAGE_BY_AGENT,
    VECTORS_IN_DATABASE,
    ATTACHMENTS,
    ANSWER_FILES,
]
