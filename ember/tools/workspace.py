"""The workspace jail: every path a tool touches resolves inside one folder,
and Workspaces, which says whose folder a turn's tools work in.

    resolve(relative)   checks the text of the path (no absolute or drive paths,
                        no '..', no '~', no NUL), then follows every symlink and
                        refuses a real path outside the root: a link out, a
                        linked parent directory, a dangling link whose target
                        would be outside, a loop.
    open(path, flags)   opens a resolved path by walking down from the root one
                        component at a time with O_NOFOLLOW, so a symlink
                        swapped in after resolve fails the open instead of
                        leading outside. Use it for every read and write.

Backslashes count as separators, so a Windows-style `..\\x` is refused like
`../x`. A hard link to a file outside cannot be told apart from a file inside;
only someone with other means (a shell) can create one.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import stat
import unicodedata
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import BinaryIO, Protocol

from ember.core.errors import ConfigError
from ember.core.memory import LOCAL_IDENTITY
from ember.core.tools import ToolRun
from ember.tools.base import ToolFailure

MAX_PATH_CHARS = 4096
SLUG_CHARS = 48
DIGEST_CHARS = 16
# A folder name that is the identity itself; "+" is outside it, so "<slug>+<digest>" never is one.
_PLAIN = re.compile(r"[a-z0-9_-][a-z0-9._-]{0,63}")
_UNSAFE = re.compile(r"[^a-z0-9._-]+")


class Workspace:
    def __init__(self, root: Path) -> None:
        self.root = root.expanduser().resolve()

    def parts(self, relative: str) -> tuple[str, ...]:
        """The components of `relative` once its text is checked; ToolFailure when
        it is empty, absolute, a drive or UNC path, starts with '~' or has '..'."""
        if not relative.strip():
            raise ToolFailure("the path is empty; use '.' for the workspace itself")
        if "\x00" in relative:
            raise ToolFailure("the path contains a NUL character")
        if len(relative) > MAX_PATH_CHARS:
            raise ToolFailure(f"the path is longer than {MAX_PATH_CHARS} characters")
        windows = PureWindowsPath(relative)
        posix = PurePosixPath(relative.replace("\\", "/"))
        if posix.is_absolute() or windows.drive or windows.root:
            raise ToolFailure(f"{relative!r} is absolute; give a path relative to the workspace")
        if ".." in posix.parts:
            raise ToolFailure(f"{relative!r} contains '..'; paths must stay inside the workspace")
        if posix.parts and posix.parts[0].startswith("~"):
            raise ToolFailure(f"{relative!r} starts with '~', which is not expanded; give a path relative "
                              "to the workspace")
        return posix.parts

    def resolve(self, relative: str) -> Path:
        """The real path of `relative` (symlinks followed), or ToolFailure if it
        would leave the workspace. The path need not exist yet."""
        candidate = self.root.joinpath(*self.parts(relative))
        try:
            resolved = candidate.resolve()
        except RuntimeError as exc:  # a symlink loop (Python 3.11 raises RuntimeError)
            raise ToolFailure(f"{relative!r} is a symlink loop") from exc
        except OSError as exc:
            raise ToolFailure(f"cannot resolve {relative!r}: {exc.strerror}") from exc
        if not self.contains(resolved):
            raise ToolFailure(f"{relative!r} leads outside the workspace")
        return resolved

    def contains(self, path: Path) -> bool:
        """Whether a real (already resolved) path lies inside the workspace."""
        return path.is_relative_to(self.root)

    def display(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix() or "."

    def open(self, path: Path, flags: int, *, make_parents: bool = False) -> int:
        """A file descriptor for `path` (a result of resolve), opened without
        following any symlink below the root; the caller closes it.

        With make_parents, missing directories are created on the way down.
        Errors come back as ToolFailure in plain words.
        """
        parts = path.relative_to(self.root).parts
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise ToolFailure(f"the workspace cannot be opened: {exc.strerror}") from exc
        if not parts:
            return fd
        try:
            for part in parts[:-1]:
                if make_parents:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, dir_fd=fd)
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                fd = child
            return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=fd)
        except OSError as exc:
            raise ToolFailure(_plain(exc, self.display(path))) from exc
        finally:
            os.close(fd)

    def open_file(self, path: Path, flags: int, *, make_parents: bool = False) -> tuple[BinaryIO, os.stat_result]:
        """The regular file at `path` (a result of resolve) opened through `open`,
        binary, for reading or writing as `flags` say, with its status before use."""
        # O_NONBLOCK: opening a FIFO must not hang; it is refused below like any non-file.
        fd = self.open(path, flags | os.O_NONBLOCK, make_parents=make_parents)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise ToolFailure(f"{self.display(path)} is {kind}")
        return os.fdopen(fd, "rb" if flags & os.O_ACCMODE == os.O_RDONLY else "wb"), info

    def read_bytes(self, path: Path, limit: int) -> bytes:
        """The content of the regular file at `path` (a result of resolve), at most `limit` bytes."""
        file, info = self.open_file(path, os.O_RDONLY)
        with file:
            if info.st_size > limit:
                raise ToolFailure(f"{self.display(path)} is larger than {limit} bytes")
            return file.read(limit)


def folder_name(identity: str) -> str:
    """The folder of `identity` under workspaces/: the identity itself when it is a plain
    lower-case name, else a readable slug of it and a digest of its exact text. Distinct
    identities get distinct names (a digest collision aside), also on a file system that
    ignores case, and every name is one safe path component of at most 65 bytes."""
    if _PLAIN.fullmatch(identity):
        return identity
    ascii_text = unicodedata.normalize("NFKD", identity).encode("ascii", "ignore").decode().lower()
    slug = _UNSAFE.sub("-", ascii_text).strip(".-")[:SLUG_CHARS]
    digest = hashlib.sha256(identity.encode("utf-8", "surrogatepass")).hexdigest()[:DIGEST_CHARS]
    return f"{slug}+{digest}"


class SessionOwners(Protocol):
    async def workspace_owner(self, session_key: str, identity: str) -> str:
        """Whose workspace a turn of `identity` in the session uses: theirs, or a group chat's."""
        ...


class Workspaces:
    """Whose folder a turn's file and shell tools work in.

    With `per_identity` (workspace_scope = "identity") each identity has its own
    folder, `per_identity/<folder_name(identity)>`, made on first use; `local`, the
    terminal's person, keeps `local`. Without it (scope "shared") everyone works in
    `local`. `owners` says when a group chat's turns use the group's folder.
    """

    def __init__(self, local: Path, per_identity: Path | None = None, owners: SessionOwners | None = None) -> None:
        self._local = local.expanduser().resolve()
        self._root = per_identity.expanduser().resolve() if per_identity is not None else None
        self._owners = owners
        if self._root is not None and (self._root.is_relative_to(self._local)
                                       or self._local.is_relative_to(self._root)):
            raise ConfigError(f"workspace {self._local} and the identities' workspaces {self._root} must not lie "
                              "one inside the other (set `workspace` to a folder of its own, or "
                              "workspace_scope = \"shared\")")

    def for_identity(self, identity: str) -> Workspace:
        if self._root is None or identity == LOCAL_IDENTITY:
            self._local.mkdir(parents=True, exist_ok=True)
            return Workspace(self._local)
        self._root.mkdir(parents=True, exist_ok=True)
        folder = self._root / folder_name(identity)
        with contextlib.suppress(FileExistsError):
            folder.mkdir()
        # A link planted in place of the folder (by a shell command) would lead into someone else's.
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            raise ToolFailure(f"the workspace {folder.name} is not a plain folder; ask the administrator")
        return Workspace(folder)

    async def for_run(self, run: ToolRun) -> Workspace:
        identity = run.identity
        if self._root is not None and self._owners is not None:
            identity = await self._owners.workspace_owner(run.conversation, identity)
        return self.for_identity(identity)


def _plain(exc: OSError, shown: str) -> str:
    reasons = {
        errno.ENOENT: f"no such file or directory: {shown}",
        errno.ENOTDIR: f"a part of {shown} is not a directory",
        errno.EISDIR: f"{shown} is a directory",
        errno.ELOOP: f"{shown} changed into a symlink while being opened; not following it",
        errno.EACCES: f"permission denied: {shown}",
        errno.ENAMETOOLONG: f"a name in {shown} is too long",
    }
    return reasons.get(exc.errno or 0, f"cannot open {shown}: {exc.strerror or exc}")
