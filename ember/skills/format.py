"""The Agent Skills format: a folder with a SKILL.md (YAML front matter, then a
Markdown body) and optional scripts/, references/ and assets/.

Parsing is strict, so a skill that would mean something else than its author
thought is refused with the reason, never half-read: unknown or duplicate
front-matter keys, a name that is not the folder's, a missing description.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ember.core.errors import SkillError

SKILL_FILE = "SKILL.md"
NAME_PATTERN = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
MAX_NAME_CHARS = 64
MAX_DESCRIPTION_CHARS = 1_024
MAX_SKILL_CHARS = 50_000  # a SKILL.md from any source
SUBFOLDERS = ("scripts", "references", "assets")
MAX_FILES = 50
MAX_FILE_BYTES = 256 * 1024
MAX_FILES_BYTES = 1024 * 1024
FIELDS = ("name", "description", "license", "compatibility", "allowed-tools", "metadata")
_FRONT_MATTER = re.compile(r"\A---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(?:\r?\n|\Z)", re.DOTALL)


class SkillFormatError(SkillError):
    """A skill that cannot be admitted as written; the message says what to change."""


@dataclass(frozen=True, slots=True)
class SkillDoc:
    name: str
    description: str
    body: str
    text: str  # the whole SKILL.md, as written
    allowed_tools: tuple[str, ...] = ()
    license: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)


def check_name(name: str) -> str:
    if not isinstance(name, str) or not name:
        raise SkillFormatError("a skill needs a name")
    if len(name) > MAX_NAME_CHARS:
        raise SkillFormatError(f"a skill name is at most {MAX_NAME_CHARS} characters; {name[:80]!r} has {len(name)}")
    if not NAME_PATTERN.fullmatch(name):
        raise SkillFormatError(f"invalid skill name {name[:80]!r}: use lowercase letters, digits and single "
                               "hyphens, like 'weekly-report' (no paths, dots or spaces)")
    return name


class _StrictLoader(yaml.SafeLoader):
    """Safe YAML that refuses a key given twice (PyYAML keeps the last one silently)."""


def _mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise SkillFormatError(f"front matter gives {key!r} twice")
        seen.add(key)
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def _front_matter(text: str) -> tuple[dict[str, Any], str]:
    match = _FRONT_MATTER.match(text)
    if match is None:
        raise SkillFormatError(f"{SKILL_FILE} must start with YAML front matter between '---' lines")
    try:
        data = yaml.load(match[1], Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        problem = str(exc).splitlines()[0]
        raise SkillFormatError(f"front matter is not valid YAML: {problem}") from None
    if not isinstance(data, dict):
        raise SkillFormatError("front matter must be a mapping of keys to values")
    return data, text[match.end():]


def _text_field(data: dict[str, Any], key: str, limit: int) -> str | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise SkillFormatError(f"front matter {key!r} must be non-empty text")
    if len(value) > limit:
        raise SkillFormatError(f"front matter {key!r} is at most {limit} characters; it has {len(value)}")
    return value.strip()


def parse_skill_md(text: str, *, expected_name: str | None = None) -> SkillDoc:
    if len(text) > MAX_SKILL_CHARS:
        raise SkillFormatError(f"{SKILL_FILE} is at most {MAX_SKILL_CHARS} characters; this one has {len(text)}")
    data, body = _front_matter(text)
    unknown = sorted(str(key) for key in data if key not in FIELDS)
    if unknown:
        raise SkillFormatError(f"unknown front-matter key {', '.join(map(repr, unknown))}; "
                               f"a skill's keys are {', '.join(FIELDS)}")
    name = check_name(data.get("name"))  # type: ignore[arg-type]
    if expected_name is not None and name != expected_name:
        raise SkillFormatError(f"front matter names the skill {name!r}, but its folder is {expected_name!r}")
    description = _text_field(data, "description", MAX_DESCRIPTION_CHARS)
    if description is None:
        raise SkillFormatError("front matter needs a 'description': what the skill does and when to use it")
    license_ = _text_field(data, "license", 500)
    _text_field(data, "compatibility", 500)
    tools = data.get("allowed-tools", ())
    if isinstance(tools, str):
        tools = tools.split()
    if not isinstance(tools, list | tuple) or not all(isinstance(tool, str) for tool in tools):
        raise SkillFormatError("front matter 'allowed-tools' must be tool names, space-separated or a list")
    metadata = data.get("metadata", {})
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str | int | float | bool)
                                                 for k, v in metadata.items()):
        raise SkillFormatError("front matter 'metadata' must map names to plain values")
    if not body.strip():
        raise SkillFormatError(f"{SKILL_FILE} has no instructions after its front matter")
    return SkillDoc(name=name, description=description, body=body.strip(), text=text, allowed_tools=tuple(tools),
                    license=license_, metadata={k: str(v) for k, v in metadata.items()})


def render_skill_md(name: str, description: str, body: str, *, allowed_tools: tuple[str, ...] = ()) -> str:
    front: dict[str, Any] = {"name": name, "description": " ".join(description.split())}
    if allowed_tools:
        front["allowed-tools"] = " ".join(allowed_tools)
    return f"---\n{yaml.safe_dump(front, allow_unicode=True, sort_keys=False, width=10_000)}---\n\n{body.strip()}\n"


def read_folder(folder: Path) -> tuple[SkillDoc, dict[str, str]]:
    """A skill folder's SKILL.md, parsed, and the text files of its subfolders, by relative path."""
    check_name(folder.name)
    skill_md = folder / SKILL_FILE
    if not skill_md.is_file():
        raise SkillFormatError(f"{folder} has no {SKILL_FILE}")
    try:
        text = skill_md.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SkillFormatError(f"{skill_md} is not UTF-8 text") from None
    doc = parse_skill_md(text, expected_name=folder.name)
    files: dict[str, str] = {}
    total = 0
    root = folder.resolve()
    for sub in SUBFOLDERS:
        for path in sorted((folder / sub).rglob("*")) if (folder / sub).is_dir() else ():
            relative = path.relative_to(folder).as_posix()
            if path.is_symlink() and not path.resolve().is_relative_to(root):
                raise SkillFormatError(f"{relative} links outside the skill's folder")
            if not path.is_file() or any(part.startswith(".") for part in path.relative_to(folder).parts):
                continue
            size = path.stat().st_size
            if size > MAX_FILE_BYTES:
                raise SkillFormatError(f"{relative} is {size} bytes; a skill's file is at most {MAX_FILE_BYTES}")
            total += size
            if total > MAX_FILES_BYTES or len(files) >= MAX_FILES:
                raise SkillFormatError(f"a skill's files are at most {MAX_FILES} and {MAX_FILES_BYTES} bytes")
            try:
                files[relative] = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise SkillFormatError(f"{relative} is not UTF-8 text; Ember keeps a skill's text files only") \
                    from None
    return doc, files


def digest(text: str, files: dict[str, str]) -> str:
    """What a version's content is, to tell an edit from the same text read again."""
    return hashlib.sha256(json.dumps([text, sorted(files.items())]).encode()).hexdigest()[:32]
