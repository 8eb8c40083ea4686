"""The approval model explains a call that needs approval: in plain words, with a risk rating.

It reads the call's whole arguments (what a person would have to decode from
raw JSON) and answers in a validated structure. It only informs: the person
still decides, and a model that fails, answers badly or is slower than
`timeout_s` leaves the request to go out without an explanation, never later.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from ember.core.messages import Message
from ember.core.redact import redact_text
from ember.core.tools import Explanation, ToolAction
from ember.models.base import ModelClient, complete

log = logging.getLogger(__name__)

EXPLAIN_INSTRUCTION = (
    "An AI agent wants to run a tool call that needs its user's approval. Explain to the user, in one or two "
    "short plain sentences, what the call will do and what it could change or reveal, reading its full "
    "arguments; then rate its risk: low (reads only, easy to undo), medium (changes files or settings in the "
    "workspace, or reaches the network), high (deletes, overwrites, runs arbitrary code, sends data away, or "
    "touches secrets). Answer with JSON only: "
    '{"explanation": "...", "risk": "low|medium|high", "reason": "..."} (reason: a few words).'
)


class _Answer(BaseModel):
    explanation: str = Field(min_length=1, max_length=600)
    risk: Literal["low", "medium", "high"]
    reason: str = Field(min_length=1, max_length=200)


class ApprovalExplainer:
    def __init__(self, model: ModelClient, timeout_s: float) -> None:
        self.model = model
        self._timeout_s = timeout_s

    async def explain(self, action: ToolAction) -> Explanation | None:
        call = {"tool": action.tool, "what Ember says it does": action.summary, "risk class": action.risk.value,
                "arguments": action.arguments or action.subject}
        messages = [Message.system(EXPLAIN_INSTRUCTION), Message.user(json.dumps(call, ensure_ascii=False))]
        try:
            async with asyncio.timeout(self._timeout_s):
                reply = await complete(self.model, messages)
            answer = _Answer.model_validate_json(_json_part(reply.text))
        except TimeoutError:
            log.warning("the approval model did not explain %s within %g s; asking without", action.tool,
                        self._timeout_s)
            return None
        except Exception as exc:  # whatever went wrong, the request must still go out
            log.warning("the approval model could not explain %s (%s); asking without", action.tool,
                        type(exc).__name__ if isinstance(exc, ValidationError | ValueError) else exc)
            return None
        # Shown on screens and kept in traces: whatever the arguments held, no secret passes.
        return Explanation(redact_text(answer.explanation.strip()), answer.risk, redact_text(answer.reason.strip()))


def _json_part(text: str) -> str:
    """The JSON object of a reply, without the prose or code fence a model may put around it."""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        raise ValueError("no JSON object in the reply")
    return text[start:end + 1]
