"""What every turn sends a model before the conversation itself: the system prompt of a first
turn and the tools offered, with every built-in tool on (the browser included), as the OpenAI
format puts them on the wire. Measured by bench/prompt_size.py, held to a budget by
tests/test_prompt_budget.py."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ember.app.runtime import build_runtime, running
from ember.config.settings import Settings
from ember.core.messages import Message, Role
from ember.core.tools import ToolSpec
from ember.models.base import ModelReply
from ember.models.openai_compat import to_openai_tool
from ember.models.scripted import FunctionModel
from ember.tools.browser_config import BrowserSpec
from tests.conftest import Harness

# Characters a token stands for, the low end of what OpenAI's tokenizers give English prose and
# JSON schemas: an estimate that errs towards more tokens (no tokenizer ships without a download).
CHARS_PER_TOKEN = 3.5


@dataclass(frozen=True, slots=True)
class FixedPrompt:
    system_chars: int
    tool_chars: dict[str, int]  # by tool, as sent

    @property
    def chars(self) -> int:
        return self.system_chars + sum(self.tool_chars.values())

    @property
    def tokens(self) -> int:
        """An estimate, rounded up."""
        return -int(-self.chars // CHARS_PER_TOKEN)


async def fixed_prompt(home: Path | None = None) -> FixedPrompt:
    seen: dict[str, list] = {}

    def answer(messages: list[Message], tools: list[ToolSpec]) -> ModelReply:
        seen["messages"], seen["tools"] = messages, tools
        return ModelReply(text="ok")

    # The browser is offered but never started (no call uses it): any executable passes its check.
    settings = Settings(home=home or Path(tempfile.mkdtemp(prefix="ember-prompt-")), embedding_model="none",
                        browser=BrowserSpec(enabled=True, executable=Path("/bin/sh")))
    runtime = await build_runtime(settings, FunctionModel(answer))
    async with running(runtime):
        harness = Harness(runtime)
        try:
            await harness.turn("hello")
        finally:
            await harness.close()
    system = "\n".join(m.content for m in seen["messages"] if m.role is Role.SYSTEM)
    return FixedPrompt(len(system), {spec.name: len(json.dumps(to_openai_tool(spec))) for spec in seen["tools"]})
