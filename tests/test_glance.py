"""The list commands read a plain SQLite store through the glance (store/sqlite/glance.py): what they
show is what the store shows, and they load neither SQLAlchemy nor the settings to show it."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ember.app.database import Stores, open_database
from ember.app.services import skill_library
from ember.config.locate import plain_home
from ember.config.settings import isolated_settings
from ember.core.memory import LOCAL_IDENTITY, MemoryKind
from ember.store import memories, sessions, skills, tasks, traces, usage
from ember.store.migrations import SCHEMA_VERSION
from ember.store.sqlite import glance
from tests.modelserver import ModelServer, Reply
from tests.test_cli_e2e import EMBER_SOURCE, TIMEOUT_S, chat, ember, ember_env
from tests.test_cli_start import HEAVY

# pydantic too: typer from 0.29 on converts options through it, 60 ms of every command's start.
NOT_LOADED = {*HEAVY, "pydantic"}
LISTS = (["sessions", "list"], ["trace", "list"], ["cron", "list"], ["usage"], ["memory", "list"], ["skills", "list"])


def test_the_glance_runs_the_stores_own_sql() -> None:
    assert SCHEMA_VERSION == glance.SCHEMA_VERSION
    assert sessions._LISTED[True].sqlite_sql == glance.SESSIONS
    assert traces._RECENT.sqlite_sql == glance.TRACES
    assert traces._RECENT_OF_SESSION.sqlite_sql == glance.TRACES_OF_SESSION
    assert tasks._LIST.sqlite_sql == glance.TASKS
    assert {by: statement.sqlite_sql for by, statement in usage._TOTALS.items()} == glance.USAGE
    listings = {(inactive, of_kinds): statement.sqlite_sql
                for (inactive, of_session, of_kinds), statement in memories._LISTINGS.items() if not of_session}
    assert listings == glance.MEMORIES
    assert skills._VISIBLE.sqlite_sql == glance.SKILLS
    assert skills._DISK_DIGESTS.sqlite_sql == glance.SKILL_DIGESTS


@pytest.fixture
def home(tmp_path: Path, model_server: ModelServer) -> Path:
    """A home whose store holds two sessions, their turns and usage, a fact and a scheduled task."""
    env = ember_env(tmp_path, model_server, EMBER_EMBEDDING_MODEL="none")  # the listings show no vectors
    model_server.push(Reply(text="Hello."), Reply(text="Noted."))
    for message, session in (("hello", "work"), ("I moved to Lisbon", "home")):
        assert chat(env, message, session).returncode == 0
    for args in (["memory", "add", "I am allergic to peanuts"],
                 ["cron", "add", "--every", "1d", "--prompt", "What is new?"]):
        done = ember(env, *args)
        assert done.returncode == 0, done.stderr
    return tmp_path


async def test_each_listing_reads_as_the_store_reads_it_and_the_commands_load_none_of_its_machinery(
        home: Path) -> None:
    async with open_database(isolated_settings(home=home)) as db:
        stores = Stores(db)
        assert await stores.sessions.label("cli:home", title="Moving house")
        with glance.glance(home / "ember.db") as quick:
            assert quick is not None
            listed = await stores.sessions.list_sessions()
            assert len(listed) == 2 and "Moving house" in {row.title for row in listed}
            assert await quick.sessions.list_sessions() == listed
            turns = await stores.traces.recent(20)
            assert len(turns) == 2
            assert await quick.traces.recent(20) == turns
            assert await quick.traces.recent(1, listed[0].key) == await stores.traces.recent(1, listed[0].key)
            assert len(await stores.tasks.list()) == 1
            assert await quick.tasks.list() == await stores.tasks.list()
            for by in usage._TOTALS:
                totals = await stores.usage.totals(by)
                assert totals and await quick.usage.totals(by) == totals
            for kinds, everything in (((MemoryKind.FACT, MemoryKind.EPISODIC), False), ((), True)):
                shown = await stores.memory.list(LOCAL_IDENTITY, kinds=kinds, include_inactive=everything)
                assert shown and await quick.memory.list(LOCAL_IDENTITY, kinds=kinds,
                                                         include_inactive=everything) == shown
            library = skill_library(isolated_settings(home=home), db)
            for archived in (False, True):
                assert await quick.skills.visible(None, include_archived=archived) == await library.skills(
                    None, include_archived=archived)
            assert await quick.skills.disk_digests() == await library.store.disk_digests()

    for argv in LISTS:
        shown_json, modules = _modules_of(home, [*argv, "--json"])
        assert json.loads(shown_json), argv
        assert sorted(name for name in modules if name in NOT_LOADED or name.split(".")[0] in NOT_LOADED) == [], argv
    facts = json.loads(_modules_of(home, ["memory", "list", "--json"])[0])
    assert [fact["content"] for fact in facts] == ["I am allergic to peanuts"]


def _modules_of(home: Path, argv: list[str]) -> tuple[str, set[str]]:
    """What `ember ARGV` printed, and the modules it had loaded by its end."""
    probe = (f"import sys\nsys.argv = ['ember', *{argv!r}]\nimport ember.cli.main\n"
             "try:\n    ember.cli.main.app()\nexcept SystemExit:\n    pass\n"
             "print('--modules--', *sys.modules, sep='\\n')")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=TIMEOUT_S,
                          cwd=EMBER_SOURCE, env={**ember_env(home, None), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    shown, _, modules = done.stdout.rpartition("--modules--")
    return shown, set(modules.split())


def _skill_names(home: Path) -> tuple[list[str], bool]:
    """The skills `ember skills list` shows, and whether it needed the store's machinery to show them."""
    shown, modules = _modules_of(home, ["skills", "list", "--json"])
    return [skill["name"] for skill in json.loads(shown)], "sqlalchemy" in modules


def test_skills_list_reads_a_changed_skill_folder_in_first_and_then_glances(tmp_path: Path) -> None:
    assert ember(ember_env(tmp_path, None), "sessions", "list").returncode == 0  # a store, migrated
    assert _skill_names(tmp_path) == (["reminders", "web-research", "write-a-skill"], True)  # read in
    assert _skill_names(tmp_path) == (["reminders", "web-research", "write-a-skill"], False)
    folder = tmp_path / "skills" / "packing"
    folder.mkdir(parents=True)
    (folder / "SKILL.md").write_text("---\nname: packing\ndescription: Pack for a trip.\n---\n\nList first.\n")
    assert _skill_names(tmp_path) == (["packing", "reminders", "web-research", "write-a-skill"], True)
    assert _skill_names(tmp_path) == (["packing", "reminders", "web-research", "write-a-skill"], False)
    (folder / "SKILL.md").unlink()
    folder.rmdir()
    assert _skill_names(tmp_path) == (["reminders", "web-research", "write-a-skill"], True)  # archived
    assert _skill_names(tmp_path) == (["reminders", "web-research", "write-a-skill"], False)


def test_a_home_the_glance_cannot_read_plainly_is_left_to_the_settings(tmp_path: Path) -> None:
    env: dict[str, Any] = {"EMBER_HOME": str(tmp_path)}
    assert plain_home(env) == tmp_path
    assert plain_home({**env, "EMBER_DATABASE_URL": "postgresql://db/ember"}) is None
    assert plain_home({**env, "ember_home": str(tmp_path)}) is None  # the settings read any case
    assert plain_home({**env, "EMBER_SKILLS_DIR": "/skills"}) == tmp_path
    assert plain_home({**env, "EMBER_SKILLS_DIR": "/skills"}, also_unset=("skills_dir",)) is None
    for written in ('database_url = "postgresql://db/ember"', 'home = "/elsewhere"', "model = [unclosed"):
        (tmp_path / "ember.toml").write_text(written)
        assert plain_home(env) is None, written
    (tmp_path / "ember.toml").write_text('model = "gpt-4o-mini"')
    assert plain_home(env) == tmp_path

    with glance.glance(tmp_path / "ember.db") as missing:
        assert missing is None
    with sqlite3.connect(tmp_path / "ember.db") as old:
        old.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)")
        old.execute("INSERT INTO schema_version VALUES (?, 0)", (SCHEMA_VERSION - 1,))
    with glance.glance(tmp_path / "ember.db") as behind:  # the whole store migrates it first
        assert behind is None
