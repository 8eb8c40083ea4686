"""`ember memory` end to end: the commands as a person (or their scripts) runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ember.core.memory import MemoryKind, NewMemory
from ember.store.engine import Database
from ember.store.memories import REINDEX_BATCH, SqlMemoryStore

EMBER = str(Path(sys.executable).with_name("ember"))


def ember(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "EMBER_HOME": str(home)}
    return subprocess.run([EMBER, "memory", *args], env=env, capture_output=True, text=True, timeout=120)


def test_add_then_search_by_meaning_right_away(tmp_path: Path) -> None:
    added = ember(tmp_path, "add", "My cat is called Mochi.")
    assert added.returncode == 0, added.stderr
    memory_id = added.stdout.strip()
    found = ember(tmp_path, "search", "what's my pet called?", "--json")
    assert found.returncode == 0, found.stderr
    records = json.loads(found.stdout)
    assert records[0]["id"] == memory_id and records[0]["content"] == "My cat is called Mochi."
    assert {"id", "content", "kind", "subject", "key", "status", "created_at", "source", "score"} <= set(records[0])
    assert json.loads(ember(tmp_path, "search", "Mochi", "--json", "--identity", "bob").stdout) == []


def test_an_update_keeps_its_history_and_forget_archives(tmp_path: Path) -> None:
    first = ember(tmp_path, "add", "I live in Paris.", "--subject", "user", "--key", "city").stdout.strip()
    second = json.loads(ember(tmp_path, "add", "I live in Berlin.", "--subject", "user", "--key", "city",
                              "--json").stdout)
    assert second["superseded"] == [first]
    chain = json.loads(ember(tmp_path, "history", first, "--json").stdout)
    assert [(r["content"], r["status"]) for r in chain] == [("I live in Paris.", "superseded"),
                                                           ("I live in Berlin.", "active")]
    assert ember(tmp_path, "forget", second["id"]).returncode == 0
    assert json.loads(ember(tmp_path, "list", "--json").stdout) == []
    assert {r["status"] for r in json.loads(ember(tmp_path, "list", "--all", "--json").stdout)} == {
        "superseded", "archived"}


def test_import_reports_bad_lines_and_export_writes_the_same_format(tmp_path: Path) -> None:
    source = tmp_path / "memories.jsonl"
    source.write_text("\n".join([
        json.dumps({"content": "Bob is my brother.", "created_at": "2025-01-02", "source": "notes"}),
        "not json",
        json.dumps({"content": ""}),
        json.dumps({"content": "我喜欢吃花生。", "created_at": 1735689600}),
        json.dumps({"content": "x", "created_at": "yesterday"}),
    ]) + "\n", encoding="utf-8")
    done = ember(tmp_path, "import", str(source))
    assert done.returncode == 0, done.stderr
    assert "imported 2 new, 0 already known, 3 bad line(s) skipped" in done.stdout
    for number in (2, 3, 5):
        assert f"line {number}:" in done.stderr
    assert "imported 0 new, 2 already known" in ember(tmp_path, "import", str(source)).stdout
    exported = [json.loads(line) for line in ember(tmp_path, "export").stdout.splitlines()]
    assert exported == [  # oldest first
        {"content": "我喜欢吃花生。", "created_at": "2025-01-01T00:00:00+00:00", "source": "import"},
        {"content": "Bob is my brother.", "created_at": "2025-01-02T00:00:00+00:00", "source": "notes"},
    ]
    assert json.loads(ember(tmp_path, "search", "花生", "--json").stdout)[0]["content"] == "我喜欢吃花生。"


def test_bad_input_is_one_clear_line(tmp_path: Path) -> None:
    for args, says in ((("add", ""), "empty"), (("search", "?!"), "no words"), (("forget", "nope"), "no memory"),
                       (("add", "x" * 9000), "at most")):
        done = ember(tmp_path, *args)
        assert done.returncode == 1 and says in done.stderr and "Traceback" not in done.stderr, done.stderr


async def test_reindex_reports_its_progress_over_the_rows(db: Database) -> None:
    """What `ember memory reindex`'s bar follows: every REINDEX_BATCH rows, up to all of them."""
    store = SqlMemoryStore(db)
    total = 2 * REINDEX_BATCH + 7
    await store.write_many([NewMemory(identity="alice" if n % 2 else "bob", content=f"Note number {n}.")
                            for n in range(total)])
    reports: list[tuple[int, int]] = []
    assert await store.reindex_text(lambda done, of: reports.append((done, of))) == total
    assert reports == [(0, total), (REINDEX_BATCH, total), (2 * REINDEX_BATCH, total), (total, total)]
    counts = await store.consistency()
    assert counts["rows"] == counts["text_rows"] == total and counts["rows_without_text"] == 0


def test_json_stays_one_document_when_a_bar_is_drawn(tmp_path: Path) -> None:
    """On a terminal a new store's migrations draw a bar on standard error, once;
    standard output is the JSON alone, and off a terminal standard error stays empty."""
    plain = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}

    def listed(home: Path, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([EMBER, "memory", "list", "--json"], env=plain | {"EMBER_HOME": str(home)} | env,
                              capture_output=True, text=True, timeout=120)

    terminal = {"TTY_COMPATIBLE": "1", "TERM": "xterm-256color"}
    first = listed(tmp_path / "a", **terminal)
    assert first.returncode == 0 and json.loads(first.stdout) == []
    assert "upgrading the store" in first.stderr
    second = listed(tmp_path / "a", **terminal)
    assert json.loads(second.stdout) == [] and second.stderr == ""  # nothing pending: no bar
    piped = listed(tmp_path / "b")
    assert json.loads(piped.stdout) == [] and piped.stderr == ""


async def test_list_shows_facts_and_episodes_unless_asked_for_the_chat(db: Database, tmp_path: Path) -> None:
    store = SqlMemoryStore(db)
    fact = "I am allergic to peanuts and carry an epinephrine pen whenever we go out to eat anywhere new."
    await store.write_many([
        NewMemory(identity="local", content=fact),
        NewMemory(identity="local", content="We planned a trip to Lyon.", kind=MemoryKind.EPISODIC,
                  session_key="cli:trip"),
        *(NewMemory(identity="local", content=f"chat line {n}", kind=MemoryKind.ARCHIVAL, session_key="cli:trip",
                    seq_start=n, seq_end=n + 1) for n in range(3)),
    ])

    def kinds(*args: str) -> list[str]:
        listed = ember(tmp_path, "list", *args, "--json")
        assert listed.returncode == 0, listed.stderr
        return sorted(record["kind"] for record in json.loads(listed.stdout))

    assert kinds() == ["episodic", "fact"]
    assert kinds("--kind", "archival") == ["archival"] * 3
    assert kinds("--kind", "archival", "--kind", "fact") == ["archival"] * 3 + ["fact"]
    assert kinds("--all") == ["archival"] * 3 + ["episodic", "fact"]
    # On an 80-column terminal the content is whole (wrapped, not cut), and no column says "active" on every row.
    table = subprocess.run([EMBER, "memory", "list"], env={**os.environ, "EMBER_HOME": str(tmp_path),
                                                            "COLUMNS": "80"}, capture_output=True, text=True,
                           timeout=120).stdout
    content = " ".join(line.split("│")[3].strip() for line in table.splitlines() if line.startswith("│"))
    assert fact in content
    assert "…" not in table and "active" not in table and "chat line" not in table
    empty = ember(tmp_path, "list", "--identity", "bob")
    assert "--kind archival" in empty.stdout
