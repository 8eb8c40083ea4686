"""Where a home keeps things, from the settings `home`, `workspace` and `skills_dir`: a part of
Settings (config/settings.py) kept apart so that the settings read as the list of what can be set."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

DATABASE_FILE = "ember.db"  # in the home
SKILLS_FOLDER = "skills"  # in the home, unless skills_dir says otherwise


class HomePaths:
    if TYPE_CHECKING:  # Settings's own fields: declared here for the checker only, not as fields of their own
        home: Path
        workspace: Path | None
        skills_dir: Path | None

    @property
    def home_dir(self) -> Path:
        return self.home.expanduser()

    @property
    def workspace_dir(self) -> Path:
        """The terminal's person's workspace (and everyone's, with workspace_scope = "shared")."""
        return (self.workspace or self.home_dir / "workspace").expanduser()

    @property
    def workspaces_dir(self) -> Path:
        """Each identity's workspace, one folder each."""
        return self.home_dir / "workspaces"

    @property
    def skills_path(self) -> Path:
        return (self.skills_dir or self.home_dir / SKILLS_FOLDER).expanduser()

    @property
    def database_path(self) -> Path:
        """The SQLite store, unless database_url names a PostgreSQL one."""
        return self.home_dir / DATABASE_FILE
