"""Webhook templates: `"CI says: {text}"`, payload fields by name, dotted for nesting (`{repo.name}`).

`{{` and `}}` are literal braces. A field the payload lacks is an error naming
it; objects and lists are filled in as compact JSON.
"""

from __future__ import annotations

import json
import re
from typing import Any

_FIELD = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
_PATH = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")


class TemplateError(ValueError):
    pass


def fields(template: str) -> list[str]:
    """The fields `template` names; TemplateError for a malformed one."""
    names = []
    for match in _FIELD.finditer(template):
        token = match.group(0)
        if token in ("{{", "}}"):
            continue
        name = match.group(1)
        if name is None or not _PATH.match(name):
            raise TemplateError(f"{token!r} at position {match.start()} is not a field: write {{name}} or "
                                "{a.b} for a payload field, {{ and }} for literal braces")
        names.append(name)
    return names


def _lookup(payload: Any, path: str) -> Any:
    value = payload
    for part in path.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise TemplateError(f"the payload has no field {path}")
    return value


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def render(template: str, payload: Any) -> str:
    def fill(match: re.Match[str]) -> str:
        token = match.group(0)
        if token in ("{{", "}}"):
            return token[0]
        return _text(_lookup(payload, match.group(1)))

    fields(template)  # malformed templates are refused at start; this keeps render honest on its own
    return _FIELD.sub(fill, template)
