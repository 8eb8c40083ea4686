"""A configuration that does not validate, said so a person can fix it: each problem with the
place that said it (ember.toml and its line, or the environment variable) and, for a key Ember
does not know, the keys it may have meant."""

from __future__ import annotations

import difflib
import os
import re
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from ember.config.sources import PROVIDER_VARIABLES

Loc = tuple[str | int, ...]

# A table header ([a.b] or [[a.b]]) or a key line (a.b = …) of a TOML file, keys bare or quoted.
_HEADER = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY_LINE = re.compile(r"^\s*((?:[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*'))*)"
                       r"\s*=")


def _dotted(text: str) -> list[str]:
    return [part.strip().strip("\"'") for part in re.findall(r"\"[^\"]*\"|'[^']*'|[^.]+", text)]


def toml_lines(text: str) -> dict[Loc, int]:
    """Every key path of a TOML document -> the line (from 1) that sets it; an array of tables
    counts its entries, as pydantic's locations do (tool_policy.rules.0.match)."""
    found: dict[Loc, int] = {}
    table: Loc = ()
    arrays: dict[Loc, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if header := _HEADER.match(line):
            path = tuple(_dotted(header[2]))
            if header[1] == "[[":
                arrays[path] = arrays.get(path, -1) + 1
                table = (*path, arrays[path])
            else:
                table = path
            found.setdefault(table, number)
        elif key := _KEY_LINE.match(line):
            found.setdefault((*table, *_dotted(key[1])), number)
    return found


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The settings table an annotation holds (through Optional and Annotated), if it is one."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, types.UnionType) or hasattr(annotation, "__metadata__"):
        for arg in get_args(annotation):
            if (found := _model_of(arg)) is not None:
                return found
    return None


def _table_at(root: type[BaseModel], loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The model whose keys sit at `loc` (a dict's or a list's entries are walked through)."""
    current: Any = root
    for part in loc:
        model = _model_of(current)
        if model is not None and isinstance(part, str) and part in model.model_fields:
            current = model.model_fields[part].annotation
            continue
        args = get_args(current)
        if get_origin(current) in (dict, Mapping) and len(args) == 2:
            current = args[1]
        elif get_origin(current) in (list, Sequence) and args:
            current = args[0]
        else:
            return None
    return _model_of(current)


def _source(loc: Loc, env_prefix: str, environ: Mapping[str, str], file: Path, lines: Mapping[Loc, int]) -> str:
    env_names = {name.upper(): name for name in environ}
    for depth in range(len(loc), 0, -1):  # EMBER_TELEGRAM__TOKEN, then EMBER_TELEGRAM (a JSON value)
        variable = (env_prefix + "__".join(str(part) for part in loc[:depth])).upper()
        if variable in env_names:
            return f"environment variable {env_names[variable]}"
    for depth in range(len(loc), 0, -1):
        if loc[:depth] in lines:
            return f"{file}, line {lines[loc[:depth]]}"
    if len(loc) == 1 and (fallback := PROVIDER_VARIABLES.get(str(loc[0]))) in environ:
        return f"environment variable {fallback}"
    return f"{file} or EMBER_* variables"


def _suggestion(root: type[BaseModel], loc: Loc) -> str:
    table = _table_at(root, loc[:-1])
    if table is None or not isinstance(loc[-1], str):
        return ""
    close = difflib.get_close_matches(loc[-1], list(table.model_fields), n=2, cutoff=0.6)
    return f"; did you mean {' or '.join(f'`{name}`' for name in close)}?" if close else ""


def explain(exc: ValidationError, root: type[BaseModel], file: Path, environ: Mapping[str, str] | None = None) -> str:
    """One line per problem of settings `root` read from `file` and `environ` (default: this
    process's): 'key: what is wrong (where it was said)', unknown keys with suggestions."""
    environ = os.environ if environ is None else environ
    env_prefix = str(root.model_config.get("env_prefix") or "")
    try:
        lines = toml_lines(file.read_text(encoding="utf-8")) if file.is_file() else {}
    except (OSError, UnicodeDecodeError):
        lines = {}
    said = []
    for error in exc.errors():
        loc: Loc = tuple(error["loc"])
        key = ".".join(str(part) for part in loc) or "(the whole configuration)"
        where = _source(loc, env_prefix, environ, file, lines) if loc else f"{file} or EMBER_* variables"
        if error["type"] == "extra_forbidden":
            said.append(f"{key}: not a setting Ember knows{_suggestion(root, loc)} ({where})")
        else:
            said.append(f"{key}: {error['msg']} ({where})")
    return "\n".join(said)
