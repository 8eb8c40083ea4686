"""The file tools as the model uses them: read, write, edit, list, glob and grep in a real workspace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ember.core.messages import ToolCall
from ember.core.tools import Risk
from ember.tools.approval import Rule, ToolPolicy
from ember.tools.base import ToolRegistry
from ember.tools.files import MAX_GLOB_RESULTS, MAX_GREP_MATCHES, file_tools
from ember.tools.workspace import Workspaces
from tests.conftest import tool_run


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "app.py").write_text("import os\n\ndef main():\n    return helper()\n\ndef helper():\n"
                                         "    return 42\n")
    (root / "src" / "pkg" / "util.py").write_text("def util():\n    return 'Helper'\n")
    (root / "README.md").write_text("# Demo\nRun main.\n")
    return root


@pytest.fixture
def tools(ws: Path) -> ToolRegistry:
    return ToolRegistry(file_tools(Workspaces(ws)))


async def call(tools: ToolRegistry, name: str, **args: object) -> str:
    return await tools.call(ToolCall(id="c", name=name, arguments=json.dumps(args)), tool_run())


def test_the_six_tools_ask_with_their_risk_and_subject(tools: ToolRegistry) -> None:
    assert [spec.name for spec in tools.specs()] == ["read_file", "write_file", "edit_file", "list_dir", "glob",
                                                     "grep"]
    write = tools.describe(ToolCall(id="c", name="write_file", arguments='{"path": "notes/a.md", "content": "x"}'))
    assert (write.risk, write.subject, write.summary) == (Risk.WRITE, "notes/a.md", "write the file notes/a.md")
    edit = tools.describe(ToolCall(id="c", name="edit_file", arguments='{"path": "a.py", "old": "x", "new": "y"}'))
    assert edit.risk is Risk.WRITE and edit.subject == "a.py"
    glob = tools.describe(ToolCall(id="c", name="glob", arguments='{"pattern": "**/*.py"}'))
    assert (glob.risk, glob.subject) == (Risk.READ, "**/*.py")
    grep = tools.describe(ToolCall(id="c", name="grep", arguments='{"pattern": "x", "path": "src"}'))
    assert (grep.risk, grep.subject) == (Risk.READ, "src")
    policy = ToolPolicy(rules=[Rule(tool="write_file", subject="notes/*", decision="allow")])
    assert policy.decide(write) == "allow" and policy.decide(edit) == "ask"
    params = tools.specs()[2].parameters["properties"]
    assert all(params[name].get("description") for name in ("path", "old", "new", "replace_all"))


async def test_read_file_returns_the_asked_lines(tools: ToolRegistry) -> None:
    assert await call(tools, "read_file", path="src/app.py", start_line=3, end_line=4) == (
        "def main():\n    return helper()\n")
    assert await call(tools, "read_file", path="README.md") == "# Demo\nRun main.\n"
    assert await call(tools, "read_file", path="README.md", start_line=2) == "Run main.\n"


@pytest.mark.parametrize(("args", "reason"), [
    ({"path": "README.md", "start_line": 9}, "past the end of the file (2 lines)"),
    ({"path": "README.md", "start_line": 2, "end_line": 1}, "end_line is before start_line"),
    ({"path": "missing.md"}, "no such file"),
    ({"path": "src"}, "src is a directory"),
    ({"path": "blob.bin"}, "binary"),
])
async def test_read_file_says_why_it_cannot_read(tools: ToolRegistry, ws: Path, args: dict[str, object],
                                                 reason: str) -> None:
    (ws / "blob.bin").write_bytes(b"\x89PNG\x00\x00\x01")
    result = await call(tools, "read_file", **args)
    assert result.startswith("Error:") and reason in result


async def test_write_file_creates_parents_and_reports_what_it_did(tools: ToolRegistry, ws: Path) -> None:
    result = await call(tools, "write_file", path="notes/2024/todo.md", content="- milk\n- bread\n")
    assert result == "created notes/2024/todo.md (15 bytes, 2 lines)"
    assert (ws / "notes" / "2024" / "todo.md").read_text() == "- milk\n- bread\n"

    result = await call(tools, "write_file", path="notes/2024/todo.md", content="- tea")
    assert result == "overwrote notes/2024/todo.md (5 bytes, 1 line; it had 15 bytes)"
    assert (ws / "notes" / "2024" / "todo.md").read_text() == "- tea"  # nothing of the longer old content left


async def test_write_file_keeps_unicode_and_refuses_a_directory(tools: ToolRegistry, ws: Path) -> None:
    assert (await call(tools, "write_file", path="grüße.txt", content="naïve ☕\n")).startswith("created grüße.txt")
    assert (ws / "grüße.txt").read_text(encoding="utf-8") == "naïve ☕\n"
    assert (await call(tools, "write_file", path="src", content="x")).startswith("Error: src is a directory")
    assert (await call(tools, "write_file", path=".", content="x")).startswith("Error: the path names the workspace")
    assert (ws / "src" / "app.py").exists()


async def test_edit_file_replaces_a_unique_string_and_names_the_line(tools: ToolRegistry, ws: Path) -> None:
    result = await call(tools, "edit_file", path="src/app.py", old="    return 42\n", new="    return 43\n")
    assert result == "edited src/app.py: replaced 1 occurrence, now at line 7"
    assert (ws / "src" / "app.py").read_text().endswith("def helper():\n    return 43\n")

    result = await call(tools, "edit_file", path="src/app.py", old="def main():\n", new="def main():\n    '''Run.'''\n")
    assert result == "edited src/app.py: replaced 1 occurrence, now at lines 3-4"


async def test_edit_file_fails_clearly_when_the_text_is_absent(tools: ToolRegistry, ws: Path) -> None:
    before = (ws / "src" / "app.py").read_text()
    result = await call(tools, "edit_file", path="src/app.py", old="return 41", new="return 0")
    assert result.startswith("Error:") and "not found in src/app.py" in result
    assert (ws / "src" / "app.py").read_text() == before


async def test_edit_file_refuses_an_ambiguous_string_and_suggests_context(tools: ToolRegistry, ws: Path) -> None:
    before = (ws / "src" / "app.py").read_text()
    result = await call(tools, "edit_file", path="src/app.py", old="return", new="yield")
    assert result.startswith("Error:") and "occurs 2 times" in result
    assert "surrounding lines" in result and "replace_all" in result
    assert (ws / "src" / "app.py").read_text() == before


async def test_edit_file_replace_all_changes_every_occurrence(tools: ToolRegistry, ws: Path) -> None:
    result = await call(tools, "edit_file", path="src/app.py", old="return", new="yield", replace_all=True)
    assert result == "edited src/app.py: replaced 2 occurrences, now at lines 4, 7"
    text = (ws / "src" / "app.py").read_text()
    assert "return" not in text and text.count("yield") == 2


async def test_edit_file_matches_lines_of_a_crlf_file(tools: ToolRegistry, ws: Path) -> None:
    (ws / "win.txt").write_bytes(b"one\r\ntwo\r\nthree\r\n")
    result = await call(tools, "edit_file", path="win.txt", old="one\ntwo\n", new="1\n2\n")
    assert result == "edited win.txt: replaced 1 occurrence, now at lines 1-2"
    assert (ws / "win.txt").read_bytes() == b"1\r\n2\r\nthree\r\n"


@pytest.mark.parametrize(("args", "reason"), [
    ({"path": "src/app.py", "old": "", "new": "x"}, "old"),
    ({"path": "src/app.py", "old": "os", "new": "os"}, "the same"),
    ({"path": "nope.py", "old": "a", "new": "b"}, "no such file"),
    ({"path": "latin1.txt", "old": "caf", "new": "x"}, "not UTF-8"),
])
async def test_edit_file_refuses_edits_it_cannot_make(tools: ToolRegistry, ws: Path, args: dict[str, object],
                                                      reason: str) -> None:
    (ws / "latin1.txt").write_bytes("café".encode("latin-1"))
    result = await call(tools, "edit_file", **args)
    assert result.startswith("Error:") and reason in result
    assert (ws / "latin1.txt").read_bytes() == "café".encode("latin-1")


async def test_list_dir_marks_directories(tools: ToolRegistry) -> None:
    assert await call(tools, "list_dir") == ".: 2 entries\nREADME.md\nsrc/"
    assert await call(tools, "list_dir", path="src") == "src: 2 entries\napp.py\npkg/"
    assert (await call(tools, "list_dir", path="README.md")).startswith("Error:")


async def test_glob_finds_files_sorted_at_any_depth(tools: ToolRegistry, ws: Path) -> None:
    (ws / "setup.py").write_text("")
    (ws / ".git").mkdir()
    (ws / ".git" / "hook.py").write_text("")
    assert await call(tools, "glob", pattern="**/*.py") == (
        "3 matches for '**/*.py'\nsetup.py\nsrc/app.py\nsrc/pkg/util.py")
    assert await call(tools, "glob", pattern="*.py") == "1 match for '*.py'\nsetup.py"
    assert await call(tools, "glob", pattern="src/*") == "2 matches for 'src/*'\nsrc/app.py\nsrc/pkg/"
    assert await call(tools, "glob", pattern="src/**/util.?y") == "1 match for 'src/**/util.?y'\nsrc/pkg/util.py"
    assert await call(tools, "glob", pattern="README.md") == "1 match for 'README.md'\nREADME.md"
    assert await call(tools, "glob", pattern="**/*.rs") == "no matches for '**/*.rs'"


async def test_glob_caps_its_list_and_says_so(tools: ToolRegistry, ws: Path) -> None:
    many = ws / "many"
    many.mkdir()
    for i in range(MAX_GLOB_RESULTS + 7):
        (many / f"f{i:04d}.txt").write_text("")
    lines = (await call(tools, "glob", pattern="many/*.txt")).splitlines()
    assert lines[0] == f"{MAX_GLOB_RESULTS + 7} matches for 'many/*.txt'"
    assert lines[1:3] == ["many/f0000.txt", "many/f0001.txt"]
    assert len(lines) == MAX_GLOB_RESULTS + 2
    assert lines[-1] == "[7 more not shown; narrow the pattern]"


async def test_grep_prints_path_line_and_text(tools: ToolRegistry) -> None:
    assert await call(tools, "grep", pattern=r"def \w+\(") == (
        "3 matches in 2 files for 'def \\\\w+\\\\(' in .\n"
        "src/app.py:3: def main():\nsrc/app.py:6: def helper():\nsrc/pkg/util.py:1: def util():")


async def test_grep_shows_context_lines_marked_and_separated(tools: ToolRegistry, ws: Path) -> None:
    (ws / "log.txt").write_text("".join(f"line {i}\n" for i in range(1, 21)).replace("line 5\n", "ERROR five\n")
                                .replace("line 15\n", "ERROR fifteen\n"))
    result = await call(tools, "grep", pattern="ERROR", path="log.txt", context=2)
    assert result.splitlines() == [
        "2 matches in 1 file for 'ERROR' in log.txt",
        "log.txt-3- line 3", "log.txt-4- line 4", "log.txt:5: ERROR five", "log.txt-6- line 6", "log.txt-7- line 7",
        "--",
        "log.txt-13- line 13", "log.txt-14- line 14", "log.txt:15: ERROR fifteen", "log.txt-16- line 16",
        "log.txt-17- line 17",
    ]


async def test_grep_filters_by_case_path_and_glob(tools: ToolRegistry, ws: Path) -> None:
    (ws / "notes.txt").write_text("helper notes\n")
    assert "src/pkg/util.py:2:     return 'Helper'" in await call(tools, "grep", pattern="helper", ignore_case=True)
    assert "util.py" not in await call(tools, "grep", pattern="helper")
    only_py = await call(tools, "grep", pattern="helper", glob="*.py")
    assert "src/app.py:4:" in only_py and "notes.txt" not in only_py
    in_pkg = await call(tools, "grep", pattern="(?i)helper", path="src/pkg")
    assert in_pkg.splitlines()[1:] == ["src/pkg/util.py:2:     return 'Helper'"]
    deep = await call(tools, "grep", pattern="return", glob="pkg/**/*.py", path="src")
    assert deep.splitlines()[1:] == ["src/pkg/util.py:2:     return 'Helper'"]
    assert await call(tools, "grep", pattern="nothing like this") == "no matches for 'nothing like this' in ."


async def test_grep_rejects_an_invalid_regex(tools: ToolRegistry) -> None:
    result = await call(tools, "grep", pattern="def (main")
    assert result.startswith("Error: invalid regular expression 'def (main'") and "missing )" in result


async def test_grep_skips_binary_files_and_caps_matches(tools: ToolRegistry, ws: Path) -> None:
    (ws / "asset.bin").write_bytes(b"\x00\x01 helper \x00")  # walked before big.txt
    (ws / "big.txt").write_text("match\n" * (MAX_GREP_MATCHES + 50))
    result = await call(tools, "grep", pattern="helper|match")
    lines = result.splitlines()
    assert lines[0] == f"{MAX_GREP_MATCHES} matches in 1 file for 'helper|match' in ."
    assert "asset.bin" not in result
    assert lines[-2] == f"[stopped at {MAX_GREP_MATCHES} matches; narrow the pattern or the path]"
    assert lines[-1].startswith("[skipped 1 binary file and")
