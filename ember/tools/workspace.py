"""The workspace jail: every path a tool touches resolves inside one folder."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from ember.tools.base import ToolFailure


class Workspace:
    def __init__(self, root: Path) -> None:
        self.root = root.expanduser().resolve()

    def resolve(self, relative: str) -> Path:
        """The real path of `relative` (symlinks followed), or ToolFailure if it
        would leave the workspace."""
        if "\x00" in relative:
            raise ToolFailure("the path contains a NUL character")
        candidate = PurePosixPath(relative.replace("\\", "/"))
        if candidate.is_absolute() or Path(relative).is_absolute():
            raise ToolFailure(f"{relative!r} is absolute; give a path relative to the workspace")
        if ".." in candidate.parts:
            raise ToolFailure(f"{relative!r} contains '..'; paths must stay inside the workspace")
        resolved = (self.root / candidate).resolve()
        if not resolved.is_relative_to(self.root):
            raise ToolFailure(f"{relative!r} leads outside the workspace")
        return resolved

    def display(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix() or "."
