"""The file tools that change the workspace: write_file and edit_file.

Both open their file through Workspace.open (no symlink followed below the
workspace root) and rewrite it in place: a crash mid-write can leave it short.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from pydantic import BaseModel, Field

from ember.core.tools import Risk, ToolRun
from ember.tools.base import ToolFailure, TurnTool
from ember.tools.workspace import Workspace, Workspaces

MAX_EDIT_BYTES = 2_000_000
MAX_LINES_LISTED = 20


class WriteFileArgs(BaseModel):
    path: str = Field(description="File path relative to the workspace; missing parent directories are created")
    content: str = Field(description="The complete new content of the file")


class EditFileArgs(BaseModel):
    path: str = Field(description="File path relative to the workspace")
    old: str = Field(min_length=1, description="The exact text to replace, including whitespace and indentation; "
                                               "it must occur exactly once unless replace_all is set")
    new: str = Field(description="The text to put in its place")
    replace_all: bool = Field(default=False, description="Replace every occurrence of `old`, not just one")


def _count_lines(text: str) -> int:
    return text.count("\n") + (1 if text and not text.endswith("\n") else 0)


def _overwrite(workspace: Workspace, path: Path, data: bytes, *, create: bool) -> int:
    """Replaces the content of the regular file at `path`; returns its size before."""
    file, info = workspace.open_file(path, os.O_WRONLY | (os.O_CREAT if create else 0), make_parents=create)
    with file:
        os.ftruncate(file.fileno(), 0)
        file.write(data)
    return info.st_size


def _write(workspace: Workspace, path: Path, content: str) -> str:
    shown = workspace.display(path)
    if path == workspace.root:
        raise ToolFailure("the path names the workspace itself; give a file name")
    existed = os.path.lexists(path)  # only for the message; the open below is what is safe
    data = content.encode("utf-8")
    before = _overwrite(workspace, path, data, create=True)
    lines = _count_lines(content)
    size = f"{len(data)} bytes, {lines} {'line' if lines == 1 else 'lines'}"
    return f"overwrote {shown} ({size}; it had {before} bytes)" if existed else f"created {shown} ({size})"


def _line_spans(text: str, starts: list[int], length: int) -> str:
    """Where the replaced text now stands: "line 7", "lines 3-5", "lines 4, 9"."""
    spans = []
    for start in starts[:MAX_LINES_LISTED]:
        end = start + length - (1 if length and text[start + length - 1] == "\n" else 0)
        first = text.count("\n", 0, start) + 1
        last = first + text.count("\n", start, end)
        spans.append(str(first) if last == first else f"{first}-{last}")
    more = f" and {len(starts) - MAX_LINES_LISTED} more" if len(starts) > MAX_LINES_LISTED else ""
    return ("line " if spans == [spans[0]] and "-" not in spans[0] else "lines ") + ", ".join(spans) + more


def _occurrences(text: str, old: str) -> list[int]:
    starts, at = [], text.find(old)
    while at != -1:
        starts.append(at)
        at = text.find(old, at + len(old))
    return starts


def _edit(workspace: Workspace, path: Path, args: EditFileArgs) -> str:
    shown = workspace.display(path)
    if args.old == args.new:
        raise ToolFailure("old and new are the same; there is nothing to change")
    try:
        text = workspace.read_bytes(path, MAX_EDIT_BYTES).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ToolFailure(f"{shown} is not UTF-8 text; edit_file edits text files only") from exc
    old, new = args.old, args.new
    if old not in text and "\r\n" in text and "\r" not in old:  # the model writes \n, the file has \r\n
        old, new = old.replace("\n", "\r\n"), new.replace("\n", "\r\n")
    starts = _occurrences(text, old)
    if not starts:
        raise ToolFailure(f"the text to replace was not found in {shown}; read the file and copy the exact text, "
                          "including whitespace and indentation")
    if len(starts) > 1 and not args.replace_all:
        raise ToolFailure(f"the text to replace occurs {len(starts)} times in {shown}; add surrounding lines to "
                          "`old` so that it matches exactly once, or set replace_all to replace every occurrence")
    edited = text.replace(old, new)
    _overwrite(workspace, path, edited.encode("utf-8"), create=False)
    shift = len(new) - len(old)
    new_starts = [start + i * shift for i, start in enumerate(starts)]
    count = "1 occurrence" if len(starts) == 1 else f"{len(starts)} occurrences"
    return f"edited {shown}: replaced {count}, now at {_line_spans(edited, new_starts, len(new))}"


def edit_tools(workspaces: Workspaces) -> list[TurnTool]:
    async def write_file(args: WriteFileArgs, run: ToolRun) -> str:
        workspace = await workspaces.for_run(run)
        path = workspace.resolve(args.path)
        return await asyncio.to_thread(_write, workspace, path, args.content)

    async def edit_file(args: EditFileArgs, run: ToolRun) -> str:
        workspace = await workspaces.for_run(run)
        path = workspace.resolve(args.path)
        return await asyncio.to_thread(_edit, workspace, path, args)

    return [
        TurnTool("write_file", "Create a text file in the workspace, or replace all of its content.",
                 WriteFileArgs, write_file, risk=Risk.WRITE, subject=lambda a: a.path, verb="write the file"),
        TurnTool("edit_file", "Replace an exact piece of text in a file of the workspace. `old` must match "
                 "exactly once (give enough surrounding lines), unless replace_all is set.", EditFileArgs,
                 edit_file, risk=Risk.WRITE, subject=lambda a: a.path, verb="edit the file"),
    ]
