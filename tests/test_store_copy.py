"""`ember store copy`: a SQLite home's store moved into PostgreSQL (store/copy.py), against a real
throwaway server (tests/pgserver.py) and a home the runtime itself filled."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import shutil
import socket
import sqlite3
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from typer.testing import CliRunner, Result

from ember.app.runtime import build_runtime
from ember.cli import store as store_cli
from ember.cli.main import app
from ember.config.settings import Settings
from ember.core.events import ReplyRoute
from ember.core.memory import NewMemory
from ember.core.messages import Role
from ember.core.schedule import Schedule
from ember.core.skills import NewVersion, SkillOrigin
from ember.core.tasks import Task, new_task_id
from ember.core.usage import UsageRow, UsageScope
from ember.memory.embeddings import HashingEmbedder
from ember.memory.service import MemoryService
from ember.memory.vectors import DatabaseVectors
from ember.models.demo import demo_model
from ember.skills.format import render_skill_md
from ember.store import copy as store_copy
from ember.store import schema
from ember.store.channel_messages import SqlChannelMessages
from ember.store.copy import CopyError, CopyMismatch, TablePlan, copy_store, target_name, verify
from ember.store.memories import SqlMemoryStore
from ember.store.postgres import PostgresDatabase
from ember.store.sessions import SqlSessionStore
from ember.store.skills import SqlSkillStore
from ember.store.sqlite.database import SqliteDatabase
from ember.store.tasks import SqlTaskStore
from ember.store.usage import SqlUsageStore
from tests.conftest import IDENTITY, running_harness, session_key
from tests.gatewayproc import EMBER

PEANUTS = "我喜欢吃花生，尤其是烤的。"
PASSWORD = "pw-Zq81-never-shown"
# What every copy must hold rows of: the runtime's and the stores' writes reached all of them.
FILLED = {"sessions", "messages", "inbox", "outbox", "traces", "jobs", "model_usage", "memory_items", "memory_fts",
          "memory_vectors", "memory_vector_heads", "memory_vector_rev", "tasks", "skills", "skill_versions",
          "session_labels", "channel_messages", "channel_counters"}


async def _fill(home: Path) -> None:
    """A home as a person leaves it: turns through the runtime (one with a tool call), then
    memories, a purged one among them, tasks, skills, labels, a channel's messages and usage."""
    settings = Settings(home=home, embedding_model="hashing")
    runtime = await build_runtime(settings, demo_model(), embedder=HashingEmbedder())
    async with running_harness(runtime) as harness:
        await harness.turn("你好！我的猫叫小米 🐱, tabs\tand\r\nnew lines")
        await harness.turn("which files are in the workspace?")
        await harness.turn("Ünïcödé, 'quotes' and \"more\"", chat="c2")
    db = SqliteDatabase(settings.database_path)
    await db.open()
    try:
        memory = MemoryService(SqlMemoryStore(db), HashingEmbedder())
        for fact in (PEANUTS, "My sister lives in Lisbon.", "A memory to purge."):
            await memory.remember(IDENTITY, fact)
        purged = (await memory.remember(IDENTITY, "Purged last, so its number is the highest.")).record
        await memory.flush_embeddings()
        await memory.store.purge(IDENTITY, purged.id)
        await SqlSessionStore(db).label(session_key(), title="关于小米的对话")
        await SqlTaskStore(db).add(Task(id=new_task_id(), identity=IDENTITY, prompt="每天早上提醒我喝水",
                                        schedule=Schedule.every("1h", time.time()), reply=ReplyRoute("test", "c1")))
        await SqlSkillStore(db).add_version(NewVersion(
            IDENTITY, "tidy", "整理文件", render_skill_md("tidy", "整理文件", "先看，再动。"), "test", IDENTITY,
            origin=SkillOrigin.LEARNED, files={"notes/说明.txt": "第一行\n第二行"}))
        channel = SqlChannelMessages(db)
        await channel.record("qq", "chat-1", "turn-1", 0, "msg-1")
        await channel.next_counter("qq", "chat-1")
        await SqlUsageStore(db).record([UsageRow(at=time.time(), model="m", scope=UsageScope(session_key(), IDENTITY),
                                                 input_tokens=12, output_tokens=3, cost_usd=0.25)])
    finally:
        await db.close()


@pytest.fixture(scope="module")
def filled_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("filled") / "home"
    # Made before any test's hermetic environment: none of the person's settings may reach it.
    with pytest.MonkeyPatch.context() as env, concurrent.futures.ThreadPoolExecutor(1) as thread:
        for name in list(os.environ):
            if name.startswith(("EMBER_", "OPENAI_")):
                env.delenv(name)
        # On a thread of its own: a test's event loop may be running already.
        thread.submit(asyncio.run, _fill(home)).result()
    return home


@pytest.fixture
def home(filled_home: Path, tmp_path: Path) -> Path:
    """A copy of the filled home of this test's own, which it may change."""
    return Path(shutil.copytree(filled_home, tmp_path / "copied-home"))


@asynccontextmanager
async def stores(home: Path, url: str) -> AsyncIterator[tuple[SqliteDatabase, PostgresDatabase]]:
    source, target = SqliteDatabase(home / "ember.db"), PostgresDatabase(url)
    await source.open()
    await target.open()
    try:
        yield source, target
    finally:
        await target.close()
        await source.close()


async def _count(db: SqliteDatabase | PostgresDatabase, table: str) -> int:
    async with db.read() as conn:
        return (await conn.execute(text(f"SELECT COUNT(*) FROM {table}"))).scalar_one()


async def _rows(db: SqliteDatabase | PostgresDatabase, sql: str) -> list[tuple[object, ...]]:
    async with db.read() as conn:
        return [tuple(row) for row in (await conn.execute(text(sql))).all()]


async def test_every_table_is_copied_in_batches_and_checked(home: Path, pg_store_database: str) -> None:
    steps: list[tuple[int, int]] = []
    async with stores(home, pg_store_database) as (source, target):
        report = await copy_store(source, target, batch=3, progress=lambda done, total: steps.append((done, total)))
        checks = {check.table: check for check in report.tables}
        assert all(check.ok for check in report.tables)
        # schema.py's tables and those only SQL names; neither the migrator's nor SQLite's FTS5 machinery.
        assert {table.name for table in schema.metadata.sorted_tables} | FILLED <= set(checks)
        assert not {"schema_version", "memory_fts_terms", "memory_fts_data"} & set(checks)
        for name, check in checks.items():
            assert check.rows == check.target_rows == await _count(source, name) == await _count(target, name), name
        assert all(checks[name].rows for name in FILLED), {n: checks[n].rows for n in FILLED}
        assert steps[0][0] == 0 and steps[-1][0] == steps[-1][1] == 3 * report.rows
        assert [done for done, _ in steps] == sorted(done for done, _ in steps)
        vectors = "SELECT num, identity, model, rev, vector, \"window\" FROM memory_vectors ORDER BY num"
        assert await _rows(target, vectors) == await _rows(source, vectors)  # the blobs, byte for byte
        jsons = "SELECT version, files_json, text FROM skill_versions ORDER BY version"
        assert await _rows(target, jsons) == await _rows(source, jsons)
        again = await verify(source, target)
        assert [(c.table, c.rows, c.checksum, c.ok) for c in again] == [
            (c.table, c.rows, c.checksum, True) for c in report.tables]


async def test_the_copied_home_runs_on_postgresql(home: Path, pg_store_database: str) -> None:
    async with stores(home, pg_store_database) as (source, target):
        await copy_store(source, target)
        for key in (session_key(), session_key("c2")):
            history = await SqlSessionStore(target).history(key)
            assert history == await SqlSessionStore(source).history(key)
            assert [m.seq for m in history] == list(range(len(history))) and len(history) >= 2
        first = await SqlSessionStore(target).history(session_key())
        assert first[0].content == "你好！我的猫叫小米 🐱, tabs\tand\r\nnew lines"
        assert any(m.role is Role.TOOL for m in first) and any(m.tool_calls for m in first)
        assert [s.key for s in await SqlSessionStore(target).list_sessions()] == [
            s.key for s in await SqlSessionStore(source).list_sessions()]
        # Lexically through the copied memory_fts (its tsvector made by PostgreSQL), and by vectors too.
        for embedder in (None, HashingEmbedder()):
            found = await MemoryService(SqlMemoryStore(target), embedder).search(IDENTITY, "花生")
            assert found[0].record.content == PEANUTS
        assert await MemoryService(SqlMemoryStore(target), None).search("someone-else", "花生") == []
        # Its vectors made pgvector's, which PostgreSQL scores: every one the source holds.
        query = HashingEmbedder().embed_queries(["花生"])[0]
        embedder = HashingEmbedder()
        scored = await DatabaseVectors(SqlMemoryStore(target), embedder.name, embedder.dimensions,
                                       ann_min_rows=1000).scores(IDENTITY, query)
        held = await _rows(source, f"SELECT count(*) FROM memory_vectors WHERE identity = '{IDENTITY}'")
        assert scored is not None and len(scored.nums) == held[0][0] > 0
        assert await SqlTaskStore(target).list() == await SqlTaskStore(source).list()
        skill = await SqlSkillStore(target).get(IDENTITY, "tidy")
        assert skill is not None and "先看，再动。" in (await SqlSkillStore(target).version(skill)).text
        # New numbers pass every one SQLite gave out, the purged memory's included.
        highest = (await _rows(source, "SELECT seq FROM sqlite_sequence WHERE name = 'memory_items'"))[0][0]
        new = await SqlMemoryStore(target).write(NewMemory(identity=IDENTITY, content="Written on PostgreSQL."))
        assert (await _rows(target, f"SELECT num FROM memory_items WHERE id = '{new.record.id}'"))[0][0] > highest
        before = await _count(target, "model_usage")
        await SqlUsageStore(target).record([UsageRow(at=time.time(), model="m", scope=UsageScope(),
                                                     input_tokens=1)])
        assert await _count(target, "model_usage") == before + 1


async def test_a_second_copy_to_the_same_target_is_refused(home: Path, pg_store_database: str) -> None:
    async with stores(home, pg_store_database) as (source, target):
        first = await copy_store(source, target)
        with pytest.raises(CopyError, match=r"already holds Ember's rows .*sessions"):
            await copy_store(source, target)
        assert await _count(target, "messages") == {c.table: c.rows for c in first.tables}["messages"]


async def test_a_row_changed_on_the_target_is_named_by_the_check(home: Path, pg_store_database: str) -> None:
    async with stores(home, pg_store_database) as (source, target):
        await copy_store(source, target)
        async with target.write() as conn:
            await conn.execute(text("UPDATE messages SET content = content || ' ' WHERE seq = 0 "
                                    "AND session_key = :key"), {"key": session_key()})
            await conn.execute(text("UPDATE memory_vectors SET vector = vector || '\\x00'::bytea "
                                    "WHERE num = (SELECT MIN(num) FROM memory_vectors)"))
            await conn.execute(text("DELETE FROM tasks"))
        checks = {check.table: check for check in await verify(source, target)}
    assert {name for name, check in checks.items() if not check.ok} == {"messages", "memory_vectors", "tasks"}
    assert checks["messages"].rows == checks["messages"].target_rows  # the same count, another checksum
    assert checks["tasks"].target_rows == 0 < checks["tasks"].rows


async def test_a_copy_that_fails_its_check_or_a_row_keeps_nothing(home: Path, pg_store_database: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    async with stores(home, pg_store_database) as (source, target):
        copy_table = store_copy._copy_table

        async def all_but_skills(src: Any, dst: Any, table: TablePlan, *args: Any) -> None:
            if table.name != "skills":
                await copy_table(src, dst, table, *args)

        with monkeypatch.context() as patched:
            patched.setattr(store_copy, "_copy_table", all_but_skills)
            with pytest.raises(CopyMismatch, match="differs from the source in skills; nothing was kept") as raised:
                await copy_store(source, target)
        assert [c.table for c in raised.value.checks if not c.ok] == ["skills"]
        assert await _count(target, "sessions") == 0
    with sqlite3.connect(home / "ember.db") as conn:
        conn.execute("UPDATE messages SET content = ? WHERE seq = 1", ("a NUL \x00 here",))
    async with stores(home, pg_store_database) as (source, target):
        with pytest.raises(CopyError, match=r"a row of messages .* holds a NUL character"):
            await copy_store(source, target)
        assert await _count(target, "sessions") == 0
        assert await _count(target, "memory_items") == 0


def test_the_target_is_named_without_its_password() -> None:
    assert target_name(f"postgresql://ann:{PASSWORD}@db.example:6543/ember") == "ann@db.example:6543/ember"
    assert target_name("postgres://db.example/ember") == "db.example:5432/ember"
    for url, says in ((f"mysql://ann:{PASSWORD}@db/ember", "postgresql:// URL"),
                      (f"postgresql://ann:{PASSWORD}@db:port/ember", "malformed"),
                      ("postgresql://ann@db:5432", "names no database")):
        with pytest.raises(CopyError, match=says) as raised:
            target_name(url)
        assert PASSWORD not in str(raised.value)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ember(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "EMBER_HOME": str(home)}
    done = subprocess.run([EMBER, "store", "copy", *args], env=env, capture_output=True, text=True, timeout=120)
    assert PASSWORD not in done.stdout + done.stderr and "Traceback" not in done.stderr, done.stdout + done.stderr
    return done


def test_the_command_copies_once_then_refuses(home: Path, pg_database: str) -> None:
    with_password = pg_database.replace("postgres@", f"postgres:{PASSWORD}@")  # the test server trusts anyone
    name = target_name(pg_database)
    done = ember(home, "--to", with_password, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["target"], report["ok"], report["kept"]) == (name, True, True)
    assert {t["table"]: t["rows"] for t in report["tables"]}["messages"] > 0
    assert all(t["ok"] and t["rows"] == t["target_rows"] for t in report["tables"])

    again = ember(home, "--to", with_password)
    assert again.returncode == 1 and again.stdout == ""
    assert f"cannot copy to {name}: the target already holds Ember's rows" in again.stderr


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Result]:
    """`ember store copy ARGS` in this process, its home `home`; logging left as the tests have it."""
    monkeypatch.setattr(store_cli, "setup_logging", lambda *_, **__: None)

    def invoke(home: Path, *args: str) -> Result:
        result = CliRunner().invoke(app, ["store", "copy", *args], env={"EMBER_HOME": str(home)})
        assert PASSWORD not in result.stdout + result.stderr, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit), result.output  # no traceback
        return result

    return invoke


def test_the_summary_names_every_table_and_whether_it_matched(home: Path, pg_database: str,
                                                              in_process: Callable[..., Result]) -> None:
    done = in_process(home, "--to", pg_database)
    assert done.exit_code == 0, done.output
    lines = done.stdout.splitlines()
    for table in ("messages", "memory_fts", "memory_vector_heads"):
        assert any(table in line and "ok" in line for line in lines), table
    assert f"to {target_name(pg_database)}" in done.stdout and "every checksum matches" in done.stdout


def test_the_command_says_why_it_cannot_copy(home: Path, tmp_path: Path, in_process: Callable[..., Result]) -> None:
    not_postgresql = in_process(home, "--to", f"mysql://ann:{PASSWORD}@db/ember")
    assert not_postgresql.exit_code == 2 and "postgresql:// URL" in not_postgresql.stderr
    down = in_process(home, "--to", f"postgresql://ann:{PASSWORD}@127.0.0.1:{_free_port()}/ember")
    assert down.exit_code == 1 and "cannot connect to the PostgreSQL store" in down.stderr, down.output
    assert "ann@127.0.0.1" in down.stderr
    nothing = in_process(tmp_path / "empty-home", "--to", "postgresql://ann@db/ember")
    assert nothing.exit_code == 1 and "no SQLite store" in nothing.stderr
    assert not (tmp_path / "empty-home" / "ember.db").exists()
