"""Read-only file tools confined to the workspace."""

from __future__ import annotations

import asyncio
from pathlib import Path

from pydantic import BaseModel, Field

from ember.core.tools import Risk
from ember.tools.base import FunctionTool, ToolFailure
from ember.tools.workspace import Workspace

MAX_READ_BYTES = 2_000_000
MAX_LIST_ENTRIES = 500


class ReadFileArgs(BaseModel):
    path: str = Field(description="File path relative to the workspace")
    start_line: int = Field(default=1, ge=1, description="First line to return (1-based)")
    end_line: int | None = Field(default=None, ge=1, description="Last line to return (inclusive); omit for the end")


class ListDirArgs(BaseModel):
    path: str = Field(default=".", description="Directory path relative to the workspace")


def _read_lines(path: Path, start: int, end: int | None) -> str:
    if not path.is_file():
        raise ToolFailure(f"{path.name!r} is not a file" if path.exists() else "no such file")
    if path.stat().st_size > MAX_READ_BYTES:
        raise ToolFailure(f"the file is larger than {MAX_READ_BYTES} bytes")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
    if start > max(len(lines), 1):
        raise ToolFailure(f"start_line {start} is past the end of the file ({len(lines)} lines)")
    return "".join(lines[start - 1 : end])


def _list(path: Path, workspace: Workspace) -> str:
    if not path.is_dir():
        raise ToolFailure("no such directory" if not path.exists() else "not a directory")
    entries = sorted(path.iterdir(), key=lambda p: p.name)
    shown = [f"{entry.name}/" if entry.is_dir() else entry.name for entry in entries[:MAX_LIST_ENTRIES]]
    if len(entries) > MAX_LIST_ENTRIES:
        shown.append(f"[{len(entries) - MAX_LIST_ENTRIES} more entries not shown]")
    header = f"{workspace.display(path)}: {len(entries)} entries"
    return "\n".join([header, *shown])


def file_tools(workspace: Workspace) -> list[FunctionTool]:
    async def read_file(args: ReadFileArgs) -> str:
        if args.end_line is not None and args.end_line < args.start_line:
            raise ToolFailure("end_line is before start_line")
        path = workspace.resolve(args.path)
        return await asyncio.to_thread(_read_lines, path, args.start_line, args.end_line)

    async def list_dir(args: ListDirArgs) -> str:
        path = workspace.resolve(args.path)
        return await asyncio.to_thread(_list, path, workspace)

    return [
        FunctionTool("read_file", "Read a text file from the workspace, optionally a range of lines.",
                     ReadFileArgs, read_file, risk=Risk.READ, subject=lambda a: a.path, verb="read the file"),
        FunctionTool("list_dir", "List the entries of a directory in the workspace.", ListDirArgs, list_dir,
                     risk=Risk.READ, subject=lambda a: a.path, verb="list the directory"),
    ]
