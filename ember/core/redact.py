"""Secrets out of traces and listings: by the name they are stored under, and by their look."""

from __future__ import annotations

import re
from typing import Any

REDACTED = "[redacted]"
_SECRET_NAME = re.compile(r"(pass(word|wd)?|secret|token|api[_-]?key|auth|credential|private[_-]?key|cookie)",
                          re.IGNORECASE)
_SECRET_VALUE = re.compile(
    r"(sk-[A-Za-z0-9_-]{16,}|gh[pousr]_[A-Za-z0-9]{20,}|xox[baprs]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16}"
    r"|(?<=Bearer )[A-Za-z0-9._~+/-]{12,}=*|-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?-----END [A-Z ]*PRIVATE KEY-----)"
)
# NAME=value in a command line or an environment listing.
_ASSIGNMENT = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)=(\S+)")


def secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def secret_env_name(name: str) -> bool:
    """Environment variables a tool never gets: Ember's own settings and anything named like a credential."""
    upper = name.upper()
    return upper.startswith("EMBER_") or upper.endswith("KEY") or secret_name(name)


def redact_text(text: str) -> str:
    text = _SECRET_VALUE.sub(REDACTED, text)
    return _ASSIGNMENT.sub(lambda m: f"{m[1]}={REDACTED}" if secret_name(m[1]) else m[0], text)


def redact(value: Any) -> Any:
    """A copy of `value` (JSON-like) with secret-named fields and secret-looking strings hidden."""
    if isinstance(value, dict):
        return {k: REDACTED if secret_name(str(k)) and v not in (None, "") else redact(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(item) for item in value]
    if isinstance(value, str):
        return redact_text(value)
    return value
