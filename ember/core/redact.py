"""Secrets out of what Ember derives: by the name they are stored under, by their look, and
by how a person says them ("my password is ...").

`redact_text` is the one pass. Everything derived from what people and models said goes
through it before it is kept: memory rows and their indexes, learned skills, traces, spans
and log lines. The session's own history is not derived: it keeps what was said.
The pass is idempotent: `redact_text(redact_text(t)) == redact_text(t)`. Memory rows and
learned skills take `derived_text`, the same pass after the model's thinking is left out.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from ember.core.thinking import strip_thinking

REDACTED = "[redacted]"
_SECRET_NAME = re.compile(r"(pass(word|wd)?|secret|token|api[_-]?key|auth|credential|private[_-]?key|cookie)",
                          re.IGNORECASE)
# Credentials recognisable by their shape alone. A prefix may not be glued to a word before it
# ("task-..." is not an "sk-" key).
_EDGE = r"(?<![A-Za-z0-9_-])"
_SECRET_VALUE = re.compile("|".join((
    _EDGE + r"sk-[A-Za-z0-9_-]{16,}",  # OpenAI (sk-proj-, sk-svcacct-), Anthropic (sk-ant-), DeepSeek, ...
    _EDGE + r"(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,})",
    _EDGE + r"xox[abeoprs]-[A-Za-z0-9-]{10,}",  # Slack
    r"(?<![A-Z0-9])(?:AKIA|ASIA)[0-9A-Z]{16}(?![A-Z0-9])",  # AWS access key ids
    _EDGE + r"AIza[0-9A-Za-z_-]{30,}",  # Google API keys
    _EDGE + r"eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}",  # JWTs: header.payload.signature
    # A private key block, or its beginning when it was cut off.
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----(?:[\s\S]*?-----END [A-Z ]*PRIVATE KEY-----|[A-Za-z0-9+/=\s]*)",
)))
_BEARER = re.compile(r"(\bBearer\s+)[A-Za-z0-9._~+/-]{12,}=*", re.IGNORECASE)
# "my password is hunter2-xyz", "api key: abc123def456", "the token for staging = t0k3n-value".
# Only the value goes; whether it is one is decided by its look (_credential).
_SAID = re.compile(
    r"(?P<head>\b(?:(?P<kind>[A-Za-z]+)[ _-])?(?P<name>pass(?:word|wd|phrase|code)|pwd|secret|token|api ?key|key)"
    r"(?:\s+(?:for|of|to)\s+[^\s:=]+(?:\s+[^\s:=]+)?)?"  # "password for the router is ..."
    r"[\"']?(?:\s*[:=]\s*|\s+(?:is|was|=)\s+|\s+is:\s*)[\"'`]?)"
    r"(?P<value>[^\s\"'`<>]+)",
    re.IGNORECASE)
# Keys that name a thing, not a credential: "session key: http:alice".
_PLAIN_KEYS = frozenset({"session", "idempotency", "public", "primary", "foreign", "sort", "cache", "partition",
                         "routing", "fact", "dedupe", "lookup", "shard", "message", "turn", "object", "row", "map"})
# Punctuation that ends the sentence, not the secret.
_TRAILING = ".,;:!?)]}"
# NAME=value in a command line or an environment listing.
_ASSIGNMENT = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)=(\S+)")


def secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def secret_env_name(name: str) -> bool:
    """Environment variables a tool never gets: Ember's own settings and anything named like a credential."""
    upper = name.upper()
    return upper.startswith("EMBER_") or upper.endswith("KEY") or secret_name(name)


def _credential(value: str) -> bool:
    """Whether a word said after "password is" looks like one: no prose word does. It has a digit
    and is 8 characters long or also has letters ("hunter2"), or it is long and mixes cases and
    symbols ("Tr0ub4dor&3", "aB-cD_eF-gH")."""
    if len(value) < 6 or value == REDACTED:
        return False
    digits = any(c.isdigit() for c in value)
    letters = any(c.isalpha() for c in value)
    if digits and (letters or len(value) >= 8):
        return True
    mixed = any(c.isupper() for c in value) and any(c.islower() for c in value)
    return len(value) >= 10 and mixed and any(not c.isalnum() for c in value)


def _said(match: re.Match[str]) -> str:
    value = match["value"]
    core = value.rstrip(_TRAILING)
    plain = match["name"].lower() == "key" and (match["kind"] or "").lower() in _PLAIN_KEYS
    if plain or not _credential(core):
        return match[0]
    return f"{match['head']}{REDACTED}{value[len(core):]}"


# A secret right after another ("...-----END PRIVATE KEY-----ghp_...") is found once the first is
# gone (the patterns look at the character before): passes run until nothing changes.
_MAX_PASSES = 8


def _pass(text: str) -> str:
    text = _SECRET_VALUE.sub(REDACTED, text)
    text = _BEARER.sub(lambda m: f"{m[1]}{REDACTED}", text)
    text = _SAID.sub(_said, text)
    return _ASSIGNMENT.sub(lambda m: f"{m[1]}={REDACTED}" if secret_name(m[1]) else m[0], text)


def redact_text(text: str) -> str:
    for _ in range(_MAX_PASSES):
        redacted = _pass(text)
        if redacted == text:
            break
        text = redacted
    return text


def derived_text(text: str) -> str:
    """What Ember keeps of a text derived from what was said: no thinking (I4), then no secret.
    Thinking goes first: a redaction could eat a tag ("token=<think>...") and leave its block."""
    return redact_text(strip_thinking(text))


def redact(value: Any, *, by_name: bool = True) -> Any:
    """A copy of `value` (JSON-like) with secret-looking strings hidden, and with `by_name` the
    values of secret-named fields too (not for records whose field names are counts: "input_tokens")."""
    if isinstance(value, dict):
        return {k: REDACTED if by_name and secret_name(str(k)) and v not in (None, "") else redact(v, by_name=by_name)
                for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(item, by_name=by_name) for item in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


class RedactingFilter(logging.Filter):
    """On a handler: every record it writes is rendered, then redacted, its traceback included."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            rendered = record.getMessage()
        except (TypeError, ValueError):  # arguments that do not fit the format: both are kept, redacted
            rendered = f"{record.msg} {record.args!r}"
        record.msg, record.args = redact_text(rendered), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        if record.stack_info:
            record.stack_info = redact_text(record.stack_info)
        return True


def redact_handlers(handlers: list[logging.Handler]) -> None:
    for handler in handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
