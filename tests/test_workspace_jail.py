"""Escape attempts against every file tool: nothing outside the workspace is read, listed or written.

Each attempt runs against a fresh workspace next to an `outside` folder holding
a secret, with symlinks planted inside that point out. An attempt may be
refused or may resolve to a name inside the workspace; it must never reveal the
secret, list the outside folder, or change anything outside.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ember.core.messages import ToolCall
from ember.tools.base import ToolFailure, ToolRegistry
from ember.tools.files import file_tools
from ember.tools.workspace import Workspace, Workspaces
from tests.conftest import tool_run

SECRET = "SECRET-LAUNCH-CODE-0000"
MARKER = "outside-only-marker.txt"
WRITTEN = "PWNED-BY-THE-MODEL"

# Paths a model might try; {ws} and {out} are the absolute workspace and outside folders.
ATTEMPTS = [
    # traversal
    "../outside/secret.txt", "a/../../outside/secret.txt", "./../outside/secret.txt",
    "sub/../../outside/secret.txt", "../../../../../../../../etc/passwd", "..", "../", "sub/../..",
    "..\\outside\\secret.txt", "sub\\..\\..\\outside\\secret.txt", "./.././outside",
    # absolute
    "/etc/passwd", "{out}/secret.txt", "{out}", "//etc/passwd", "/", "{ws}/../outside/secret.txt",
    "{ws}/file-out", "{OUT}/secret.txt", "/proc/self/root/etc/passwd",
    # Windows-style
    "C:\\Windows\\win.ini", "C:/Windows/win.ini", "C:secret.txt", "\\\\server\\share\\secret.txt",
    "\\\\?\\C:\\secret.txt", "\\etc\\passwd", "//server/share/secret.txt",
    # home expansion
    "~", "~/secret.txt", "~root/.bashrc", "~/../outside/secret.txt",
    # symlinks out
    "file-out", "dir-out", "dir-out/secret.txt", "dir-out/new.txt", "sub/parent-out/secret.txt",
    "sub/parent-out/newdir/new.txt", "chain1", "hop/secret.txt", "root-link/etc/passwd", "root-link",
    "rel-out", "dangling-out", "loop", "loop/x",
    # encodings and look-alikes: literal names inside, or refused
    "..%2foutside%2fsecret.txt", "%2e%2e/outside/secret.txt", "．．/outside/secret.txt",
    "\u2024\u2024/outside/secret.txt", ".\u0307./outside/secret.txt", "..\u200b/outside/secret.txt",
    "...//outside/secret.txt", "\u2025/outside/secret.txt",
    # case variants
    "DIR-OUT/secret.txt", "File-Out", "{OUT}",
    # NUL, length, empty, whitespace
    "inside.txt\x00../../outside/secret.txt", "\x00", "a/" * 3000 + "x", "x" * 300, "../" * 1500 + "etc/passwd",
    "", " ", "\t\n", " ../outside/secret.txt", "../outside/secret.txt ",
]

TOOLS = ["read_file", "write_file", "edit_file", "list_dir", "glob", "grep", "grep_glob"]


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path]:
    """(workspace, outside): the outside folder holds the secret; links inside point at it."""
    ws, out = tmp_path / "ws", tmp_path / "outside"
    (ws / "sub").mkdir(parents=True)
    out.mkdir()
    (out / "secret.txt").write_text(f"the launch code is {SECRET}\n")
    (out / MARKER).write_text(f"{SECRET}\n")
    (ws / "inside.txt").write_text("inside ok\n")
    links = {
        "file-out": out / "secret.txt", "dir-out": out, "sub/parent-out": out, "chain2": out / "secret.txt",
        "chain1": ws / "chain2", "hop": ws / "dir-out", "root-link": Path("/"),
        "rel-out": Path("../outside/secret.txt"),
        "dangling-out": out / "created-through-a-dangling-link.txt", "loop": ws / "loop", "link-in": ws / "inside.txt",
    }
    for name, target in links.items():
        (ws / name).symlink_to(target)
    return ws, out


def snapshot(tmp_path: Path, ws: Path) -> dict[str, bytes | str]:
    """Every entry under tmp_path outside the workspace, with file contents and link targets."""
    seen: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(tmp_path):
        if Path(dirpath) == ws or ws in Path(dirpath).parents:
            dirnames[:] = []
            continue
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            if path == ws:
                continue
            seen[str(path)] = (os.readlink(path) if path.is_symlink()
                               else b"<dir>" if path.is_dir() else path.read_bytes())
    return seen


def arguments(tool: str, path: str) -> tuple[str, dict[str, object]]:
    return {
        "read_file": ("read_file", {"path": path}),
        "write_file": ("write_file", {"path": path, "content": WRITTEN}),
        "edit_file": ("edit_file", {"path": path, "old": "launch code", "new": WRITTEN}),
        "list_dir": ("list_dir", {"path": path}),
        "glob": ("glob", {"pattern": path}),
        "grep": ("grep", {"pattern": "launch|secret|root", "path": path}),
        "grep_glob": ("grep", {"pattern": "launch|secret|root", "glob": path}),
    }[tool]


def listed_paths(result: str) -> list[str]:
    """The paths a list_dir, glob or grep result names."""
    lines = result.splitlines()[1:]
    return [line.split(":")[0].split("-")[0] if ":" in line else line for line in lines
            if line and not line.startswith(("[", "--"))]


@pytest.mark.parametrize("attempt", ATTEMPTS, ids=lambda a: repr(a)[:40])
async def test_no_attempt_escapes(layout: tuple[Path, Path], tmp_path: Path, attempt: str) -> None:
    ws, out = layout
    path = attempt.format(ws=ws, out=out, OUT=str(out).upper())
    before = snapshot(tmp_path, ws)
    registry = ToolRegistry(file_tools(Workspaces(ws)))

    for tool in TOOLS:
        name, args = arguments(tool, path)
        result = await registry.call(ToolCall(id="c", name=name, arguments=json.dumps(args)), tool_run())

        assert SECRET not in result, tool
        assert MARKER not in result, tool
        assert "unexpectedly" not in result, (tool, result)  # a refusal is a plain ToolFailure, not a crash
        assert snapshot(tmp_path, ws) == before, f"{tool} changed something outside the workspace"
        if not result.startswith("Error:") and tool in ("list_dir", "glob"):
            for listed in listed_paths(result)[:50]:
                entry = listed.rstrip("/")
                target = ws / (entry if tool == "glob" else Path(path) / entry)
                assert target.resolve().is_relative_to(ws.resolve()) or target.is_symlink(), (tool, listed)
    for written in tmp_path.rglob("*"):
        if written.is_file() and not written.is_symlink() and WRITTEN in written.read_text(errors="replace"):
            assert written.resolve().is_relative_to(ws.resolve()), written


async def test_a_symlink_inside_that_points_inside_is_allowed(layout: tuple[Path, Path]) -> None:
    ws, _ = layout
    registry = ToolRegistry(file_tools(Workspaces(ws)))

    async def call(name: str, **args: object) -> str:
        return await registry.call(ToolCall(id="c", name=name, arguments=json.dumps(args)), tool_run())

    assert await call("read_file", path="link-in") == "inside ok\n"
    assert (await call("edit_file", path="link-in", old="ok", new="edited")).startswith("edited inside.txt")
    assert (ws / "inside.txt").read_text() == "inside edited\n" and (ws / "link-in").is_symlink()


async def test_walking_the_whole_workspace_leaves_links_out_behind(layout: tuple[Path, Path]) -> None:
    ws, _ = layout
    registry = ToolRegistry(file_tools(Workspaces(ws)))

    async def call(name: str, **args: object) -> str:
        return await registry.call(ToolCall(id="c", name=name, arguments=json.dumps(args)), tool_run())

    everything = await call("glob", pattern="**/*")
    assert "inside.txt" in everything and "link-in" in everything
    for gone in ("file-out", "dir-out", "chain1", "root-link", "rel-out", "dangling-out", "loop", "etc", MARKER):
        assert gone not in everything.splitlines()[1:-1], gone
    assert "symlinks to outside the workspace left out" in everything
    found = await call("grep", pattern="launch|inside|root:")
    assert SECRET not in found and "inside.txt:1: inside ok" in found
    listing = await call("list_dir", path=".")
    assert MARKER not in listing and "secret.txt" not in listing


def test_a_link_swapped_in_after_the_check_is_not_followed(layout: tuple[Path, Path]) -> None:
    """The race between resolve and open: open walks from the root refusing any symlink."""
    ws, out = layout
    workspace = Workspace(ws)
    (ws / "victim").mkdir()
    (ws / "victim" / "f.txt").write_text("fine\n")
    checked_file, checked_in_dir = workspace.resolve("inside.txt"), workspace.resolve("victim/f.txt")

    (ws / "inside.txt").unlink()
    (ws / "inside.txt").symlink_to(out / "secret.txt")
    (ws / "victim" / "f.txt").unlink()
    (ws / "victim").rmdir()
    (ws / "victim").symlink_to(out)
    (out / "f.txt").write_text(SECRET)

    for checked in (checked_file, checked_in_dir):
        with pytest.raises(ToolFailure):
            workspace.read_bytes(checked, 1000)
    with pytest.raises(ToolFailure):
        workspace.open(workspace.root / "victim" / "new.txt", os.O_WRONLY | os.O_CREAT)
    assert not (out / "new.txt").exists()
