"""The skill folders on disk, Ember's bundled ones and the person's (HOME/skills), as they are now; and
which of them differ from what the store last read. No store here: the library (skills/library.py)
reads changes into the store, and `ember skills list` only looks whether there are any."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ember.core.skills import SkillOrigin
from ember.skills.format import SKILL_FILE, SkillDoc, SkillFormatError, digest, read_folder

BUNDLED_DIR = Path(__file__).parent / "bundled"


@dataclass(frozen=True, slots=True)
class SkillFolder:
    path: Path  # a folder of skill folders
    origin: SkillOrigin


@dataclass(frozen=True, slots=True)
class FolderSkill:
    path: Path
    doc: SkillDoc
    files: dict[str, str]
    origin: SkillOrigin

    @property
    def digest(self) -> str:
        return digest(self.doc.text, self.files)


def default_folders(home_skills: Path) -> list[SkillFolder]:
    """Bundled first: a skill of the person's with the same name overrides it."""
    return [SkillFolder(BUNDLED_DIR, SkillOrigin.BUNDLED), SkillFolder(home_skills, SkillOrigin.HOME)]


def skill_dirs(folders: Sequence[SkillFolder]) -> list[tuple[Path, SkillOrigin]]:
    dirs = []
    for folder in folders:
        if folder.path.is_dir():
            dirs += [(path, folder.origin) for path in sorted(folder.path.iterdir())
                     if path.is_dir() and not path.name.startswith((".", "_"))]
    return dirs


def signature(folders: Sequence[SkillFolder]) -> tuple[tuple[str, int], ...]:
    """Changes when a skill folder comes, goes or has its SKILL.md written."""
    marks = []
    for path, _ in skill_dirs(folders):
        try:
            marks.append((str(path), os.stat(path / SKILL_FILE).st_mtime_ns))
        except OSError:
            marks.append((str(path), 0))
    return tuple(marks)


def read_folders(folders: Sequence[SkillFolder]) -> tuple[dict[str, FolderSkill], dict[str, str]]:
    """The skills the folders hold, by name (a later folder's wins), and the folders that could not be
    read, with why."""
    found: dict[str, FolderSkill] = {}
    errors: dict[str, str] = {}
    for path, origin in skill_dirs(folders):
        try:
            doc, files = read_folder(path)
        except (SkillFormatError, OSError) as exc:
            errors[str(path)] = str(exc)
            continue
        found[doc.name] = FolderSkill(path, doc, files, origin)
    return found, errors


def edited(found: Mapping[str, FolderSkill], known: Mapping[str, tuple[str | None, str]]) -> list[str]:
    """The skills whose folder is not what the store last read (`known`: the store's disk digests)."""
    return [name for name, skill in found.items() if known.get(name, (None, ""))[0] != skill.digest]


def vanished(found: Mapping[str, FolderSkill], known: Mapping[str, tuple[str | None, str]]) -> list[str]:
    """The skills read from a folder once that is gone now."""
    return [name for name, (content, origin) in known.items()
            if content is not None and name not in found and origin in (SkillOrigin.BUNDLED, SkillOrigin.HOME)]
