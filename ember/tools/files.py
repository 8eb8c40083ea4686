"""File tools confined to the workspace: read_file, list_dir, glob and grep here,
write_file and edit_file in ember.tools.edit; `file_tools` returns all six. Each
call works in the workspace of its turn (Workspaces.for_run).

Every path goes through Workspace.resolve and every file is opened through
Workspace.open. Walks (glob, grep) use os.fwalk, which never descends into a
symlinked directory; a symlink whose target is outside is never listed or read.
"""

from __future__ import annotations

import asyncio
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path

from pydantic import BaseModel, Field

from ember.core.tools import Risk, ToolRun
from ember.tools.base import ToolFailure, TurnTool
from ember.tools.edit import edit_tools
from ember.tools.workspace import Workspace, Workspaces

MAX_READ_BYTES = 2_000_000
MAX_LIST_ENTRIES = 500
MAX_GLOB_RESULTS = 200
MAX_GREP_MATCHES = 200
MAX_GREP_LINE_CHARS = 400
MAX_WALK_ENTRIES = 100_000
SKIPPED_DIRS = frozenset({".git"})
BINARY_SNIFF_BYTES = 8192
MAGIC = re.compile(r"[*?\[]")
TRUNCATED = f"[stopped after {MAX_WALK_ENTRIES} entries; narrow the pattern or the path]"


class ReadFileArgs(BaseModel):
    path: str = Field(description="File path relative to the workspace")
    start_line: int = Field(default=1, ge=1, description="First line to return (1-based)")
    end_line: int | None = Field(default=None, ge=1, description="Last line to return (inclusive); omit for the end")


class ListDirArgs(BaseModel):
    path: str = Field(default=".", description="Directory path relative to the workspace")


class GlobArgs(BaseModel):
    pattern: str = Field(description="Glob pattern relative to the workspace, e.g. '**/*.py' or 'docs/*.md'; "
                                     "'**' matches any number of directories")


class GrepArgs(BaseModel):
    pattern: str = Field(min_length=1, description="Python regular expression, matched against each line")
    path: str = Field(default=".", description="File or directory to search, relative to the workspace")
    glob: str | None = Field(default=None, description="Only search files matching this glob, e.g. '*.py' "
                                                       "(file name) or 'src/**/*.py' (path under `path`)")
    context: int = Field(default=0, ge=0, le=20, description="Lines of context before and after each match")
    ignore_case: bool = Field(default=False, description="Match regardless of case")


def counted(n: int, noun: str, plural: str | None = None) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {plural or noun + 's'}"


def _read_lines(workspace: Workspace, path: Path, start: int, end: int | None) -> str:
    data = workspace.read_bytes(path, MAX_READ_BYTES)
    if b"\x00" in data[:BINARY_SNIFF_BYTES]:
        raise ToolFailure(f"{workspace.display(path)} looks like a binary file")
    lines = data.decode("utf-8", errors="replace").splitlines(keepends=True)
    if start > max(len(lines), 1):
        raise ToolFailure(f"start_line {start} is past the end of the file ({counted(len(lines), 'line')})")
    return "".join(lines[start - 1 : end])


def _list(workspace: Workspace, path: Path) -> str:
    fd = workspace.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with os.scandir(fd) as listing:
            entries = sorted(listing, key=lambda e: e.name)
        shown = [_entry_name(workspace, path, entry) for entry in entries[:MAX_LIST_ENTRIES]]
    finally:
        os.close(fd)
    if len(entries) > MAX_LIST_ENTRIES:
        shown.append(f"[{len(entries) - MAX_LIST_ENTRIES} more entries not shown]")
    header = f"{workspace.display(path)}: {len(entries)} {'entry' if len(entries) == 1 else 'entries'}"
    return "\n".join([header, *shown])


def _entry_name(workspace: Workspace, parent: Path, entry: os.DirEntry[str]) -> str:
    """`name/` for a directory, or a symlink to one inside the workspace; else `name`."""
    if entry.is_symlink():
        try:
            target = (parent / entry.name).resolve()
        except RuntimeError:  # a symlink loop
            return entry.name
        return f"{entry.name}/" if workspace.contains(target) and os.path.isdir(target) else entry.name
    return f"{entry.name}/" if entry.is_dir(follow_symlinks=False) else entry.name


def glob_match(pattern: tuple[str, ...], parts: tuple[str, ...]) -> bool:
    """Whether path components match glob components; '**' matches zero or more."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(glob_match(pattern[1:], parts[i:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatchcase(parts[0], pattern[0]) and glob_match(pattern[1:], parts[1:])


def _compact(pattern: tuple[str, ...]) -> tuple[str, ...]:
    """Drops '.' and repeated '**' components, which mean nothing more."""
    kept: list[str] = []
    for part in pattern:
        if part != "." and not (part == "**" and kept and kept[-1] == "**"):
            kept.append(part)
    return tuple(kept)


@dataclass
class Walk:
    """The entries under a directory, as paths relative to it, without descending
    into symlinked directories; symlinks out of the workspace are set aside in
    `links_out` instead of being yielded."""

    workspace: Workspace
    base: Path
    visited: int = 0
    truncated: bool = False
    links_out: list[tuple[str, ...]] = field(default_factory=list)

    def entries(self) -> Iterator[tuple[tuple[str, ...], bool, int, str]]:
        """(relative parts, is_dir, the parent's dir fd, name) for every entry: at each
        level directories then files, each sorted; stops after MAX_WALK_ENTRIES."""
        fd = self.workspace.open(self.base, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for dirpath, dirnames, filenames, dirfd in os.fwalk(".", dir_fd=fd):
                dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
                filenames.sort()
                prefix = tuple(p for p in dirpath.split("/") if p != ".")
                for name, is_dir in [*((d, True) for d in dirnames), *((f, False) for f in filenames)]:
                    self.visited += 1
                    if self.visited > MAX_WALK_ENTRIES:
                        self.truncated = True
                        return
                    if self._leads_out(dirfd, prefix, name):
                        self.links_out.append((*prefix, name))
                        continue
                    yield (*prefix, name), is_dir, dirfd, name
        finally:
            os.close(fd)

    def _leads_out(self, dirfd: int, prefix: tuple[str, ...], name: str) -> bool:
        try:
            if not stat.S_ISLNK(os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode):
                return False
            return not self.workspace.contains(self.base.joinpath(*prefix, name).resolve())
        except (OSError, RuntimeError):  # gone since listed, a loop, or unreadable: nothing to follow
            return True


def _glob(workspace: Workspace, pattern: str) -> str:
    parts = _compact(workspace.parts(pattern))
    literal = 0
    while literal < len(parts) and not MAGIC.search(parts[literal]):
        literal += 1
    prefix, rest = parts[:literal], parts[literal:]
    base = workspace.resolve("/".join(prefix) or ".")
    if not rest:
        if not os.path.exists(base):
            return f"no matches for {pattern!r}"
        return f"1 match for {pattern!r}\n{'/'.join(prefix) or '.'}{'/' if os.path.isdir(base) else ''}"
    if not os.path.isdir(base):
        return f"no matches for {pattern!r}"
    walk = Walk(workspace, base)
    found = sorted("/".join((*prefix, *rel)) + ("/" if is_dir else "")
                   for rel, is_dir, _, _ in walk.entries() if glob_match(rest, rel))
    if not found:
        lines = [f"no matches for {pattern!r}"]
    else:
        lines = [f"{counted(len(found), 'match', 'matches')} for {pattern!r}", *found[:MAX_GLOB_RESULTS]]
    if len(found) > MAX_GLOB_RESULTS:
        lines.append(f"[{len(found) - MAX_GLOB_RESULTS} more not shown; narrow the pattern]")
    links_out = sum(glob_match(rest, rel) for rel in walk.links_out)
    if links_out:
        lines.append(f"[{counted(links_out, 'symlink')} to outside the workspace left out]")
    if walk.truncated:
        lines.append(TRUNCATED)
    return "\n".join(lines)


@dataclass
class Search:
    """One grep over files: the regex, the output so far and what was left out."""

    regex: re.Pattern[str]
    context: int
    out: list[str] = field(default_factory=list)
    matches: int = 0
    files: int = 0
    binary: int = 0
    large: int = 0

    @property
    def full(self) -> bool:
        return self.matches >= MAX_GREP_MATCHES

    def scan(self, shown: str, data: bytes) -> None:
        if b"\x00" in data[:BINARY_SNIFF_BYTES]:
            self.binary += 1
            return
        lines = data.decode("utf-8", errors="replace").split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        hits = [i for i, line in enumerate(lines) if self.regex.search(line)]
        hits = hits[: MAX_GREP_MATCHES - self.matches]
        if not hits:
            return
        self.files += 1
        self.matches += len(hits)
        around = range(-self.context, self.context + 1)
        wanted = sorted({i + d for i in hits for d in around if 0 <= i + d < len(lines)})
        hit_set = set(hits)
        previous = None
        for j in wanted:
            if self.out and (previous is None or j != previous + 1) and self.context:
                self.out.append("--")
            text = lines[j].rstrip("\r")
            if len(text) > MAX_GREP_LINE_CHARS:
                text = text[:MAX_GREP_LINE_CHARS] + " [line cut]"
            mark = ":" if j in hit_set else "-"
            self.out.append(f"{shown}{mark}{j + 1}{mark} {text}")
            previous = j

    def report(self, what: str, *, truncated: bool = False) -> str:
        if not self.matches:
            head = f"no matches for {self.regex.pattern!r} in {what}"
        else:
            found = f"{counted(self.matches, 'match', 'matches')} in {counted(self.files, 'file')}"
            head = f"{found} for {self.regex.pattern!r} in {what}"
        notes = []
        if self.full:
            notes.append(f"[stopped at {MAX_GREP_MATCHES} matches; narrow the pattern or the path]")
        if self.binary or self.large:
            notes.append(f"[skipped {counted(self.binary, 'binary file')} and {counted(self.large, 'file')} over "
                         f"{MAX_READ_BYTES} bytes]")
        if truncated:
            notes.append(TRUNCATED)
        return "\n".join([head, *self.out, *notes])


def _read_at(dirfd: int, name: str) -> bytes | None:
    """A regular file's content, opened relative to its directory without following a symlink."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dirfd)
    except OSError:  # a symlink (grep does not follow links while walking), gone, or unreadable
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    with os.fdopen(fd, "rb") as file:
        return file.read(MAX_READ_BYTES + 1)


def _grep(workspace: Workspace, args: GrepArgs) -> str:
    try:
        regex = re.compile(args.pattern, re.IGNORECASE if args.ignore_case else 0)
    except re.error as exc:
        raise ToolFailure(f"invalid regular expression {args.pattern!r}: {exc}") from exc
    filter_parts = _compact(workspace.parts(args.glob)) if args.glob is not None else None
    if filter_parts is not None and len(filter_parts) == 1:
        filter_parts = ("**", *filter_parts)
    path = workspace.resolve(args.path)
    search = Search(regex, args.context)
    if not os.path.isdir(path):
        search.scan(workspace.display(path), workspace.read_bytes(path, MAX_READ_BYTES))
        return search.report(workspace.display(path))
    # Each file is read while the walk stands in its directory: fwalk closes dirfd when it moves on.
    walk = Walk(workspace, path)
    for rel, is_dir, dirfd, name in walk.entries():
        if search.full:
            break
        if is_dir or (filter_parts is not None and not glob_match(filter_parts, rel)):
            continue
        data = _read_at(dirfd, name)
        if data is None:
            continue
        if len(data) > MAX_READ_BYTES:
            search.large += 1
            continue
        search.scan(workspace.display(path.joinpath(*rel)), data)
    return search.report(workspace.display(path), truncated=walk.truncated)


def file_tools(workspaces: Workspaces) -> list[TurnTool]:
    async def read_file(args: ReadFileArgs, run: ToolRun) -> str:
        if args.end_line is not None and args.end_line < args.start_line:
            raise ToolFailure("end_line is before start_line")
        workspace = await workspaces.for_run(run)
        path = workspace.resolve(args.path)
        return await asyncio.to_thread(_read_lines, workspace, path, args.start_line, args.end_line)

    async def list_dir(args: ListDirArgs, run: ToolRun) -> str:
        workspace = await workspaces.for_run(run)
        path = workspace.resolve(args.path)
        return await asyncio.to_thread(_list, workspace, path)

    async def glob(args: GlobArgs, run: ToolRun) -> str:
        return await asyncio.to_thread(_glob, await workspaces.for_run(run), args.pattern)

    async def grep(args: GrepArgs, run: ToolRun) -> str:
        return await asyncio.to_thread(_grep, await workspaces.for_run(run), args)

    return [
        TurnTool("read_file", "Read a text file from the workspace, optionally a range of lines.",
                 ReadFileArgs, read_file, risk=Risk.READ, subject=lambda a: a.path, verb="read the file"),
        *edit_tools(workspaces),
        TurnTool("list_dir", "List the entries of a directory in the workspace.", ListDirArgs, list_dir,
                 risk=Risk.READ, subject=lambda a: a.path, verb="list the directory"),
        TurnTool("glob", f"Find files and directories in the workspace by glob pattern, sorted; at most "
                 f"{MAX_GLOB_RESULTS} are shown.", GlobArgs, glob, risk=Risk.READ,
                 subject=lambda a: a.pattern, verb="list the files matching"),
        TurnTool("grep", "Search file contents in the workspace with a regular expression, line by line. "
                 "Prints `path:line: text` for matches and `path-line- text` for context lines; binary files "
                 f"and symlinks are skipped; at most {MAX_GREP_MATCHES} matches.", GrepArgs, grep,
                 risk=Risk.READ, subject=lambda a: a.path, verb="search the contents of"),
    ]
