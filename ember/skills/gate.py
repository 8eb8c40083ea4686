"""The admission gate: what every proposed skill passes before it can change
the agent's behaviour. It refuses what cannot be admitted (a secret, a bad
name, an oversize body, malformed front matter), classes the rest by risk, and
turns a near-copy of an existing skill into a new version of that one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from ember.core.redact import redact_text
from ember.core.skills import SkillRisk
from ember.skills.format import SkillDoc, SkillFormatError

# A reviewed proposal is shorter than a skill a person writes: the model's summary of one task.
MAX_PROPOSAL_CHARS = 12_000
# Above this trigram overlap a "new" skill is the same skill again.
DUPLICATE_SIMILARITY = 0.6

_TOOL_RISKS = {
    "runs commands": ("shell", "bash", "run_command", "exec"),
    "writes files": ("write_file", "edit_file", "write", "edit"),
    "reaches the network": ("web_fetch", "call_agent", "webfetch", "fetch"),
}
_BODY_RISKS = {
    "runs commands": re.compile(r"```(?:bash|sh|shell|zsh|console|powershell|cmd)\b|\bshell tool\b|\bsudo\b"
                                r"|\brm -|\bpip install\b|\bnpm install\b", re.IGNORECASE),
    "writes files": re.compile(r"\bwrite_file\b|\bedit_file\b|\b(?:write|save|overwrite|delete)s? (?:the |a |it )?"
                               r"(?:file|files)\b", re.IGNORECASE),
    "reaches the network": re.compile(r"\bhttps?://|\bcurl\b|\bwget\b|\bweb_fetch\b|\bcall_agent\b", re.IGNORECASE),
}


class AdmissionRefused(SkillFormatError):
    pass


@dataclass(frozen=True, slots=True)
class Assessment:
    risk: SkillRisk
    reasons: tuple[str, ...]


def check_secrets(text: str) -> str:
    """`text` if it carries no secret; a skill is read by every later turn, so one that does is refused."""
    if redact_text(text) != text:
        raise AdmissionRefused("the proposal contains what looks like a secret (an API key, a token or a "
                               "password); skills never carry credentials")
    return text


def check_size(text: str) -> None:
    if len(text) > MAX_PROPOSAL_CHARS:
        raise AdmissionRefused(f"the proposal is {len(text)} characters; a learned skill is at most "
                               f"{MAX_PROPOSAL_CHARS}")


def assess(doc: SkillDoc, files: Iterable[str] = ()) -> Assessment:
    """Higher risk for a skill that runs commands, writes files or reaches the network."""
    reasons: list[str] = []
    tools = {tool.lower().split("(")[0] for tool in doc.allowed_tools}
    for reason, names in _TOOL_RISKS.items():
        if tools & set(names):
            reasons.append(f"{reason} (allowed-tools)")
    for reason, pattern in _BODY_RISKS.items():
        if not any(reason in known for known in reasons) and pattern.search(doc.body):
            reasons.append(f"{reason} (its instructions)")
    if any(path.startswith("scripts/") for path in files) and not any("runs commands" in r for r in reasons):
        reasons.append("runs commands (scripts/)")
    return Assessment(SkillRisk.HIGH if reasons else SkillRisk.LOW, tuple(reasons))


def _trigrams(text: str) -> set[str]:
    # Character trigrams work for every script, Chinese included, with no tokenizer.
    flat = " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())
    return {flat[i:i + 3] for i in range(max(len(flat) - 2, 1))}


def similarity(a: str, b: str) -> float:
    first, second = _trigrams(a), _trigrams(b)
    return len(first & second) / len(first | second) if first and second else 0.0


def near_duplicate(doc: SkillDoc, existing: Iterable[tuple[str, str]]) -> tuple[str, float] | None:
    """The most similar existing skill (name, similarity) above the threshold, among (name, text) pairs."""
    mine = f"{doc.description}\n{doc.body}"
    best = max(((name, similarity(mine, text)) for name, text in existing if name != doc.name),
               key=lambda pair: pair[1], default=None)
    return best if best is not None and best[1] >= DUPLICATE_SIMILARITY else None
