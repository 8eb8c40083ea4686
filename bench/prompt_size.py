"""What every turn sends the model before the conversation: the system prompt and the tools, with
every built-in tool on (the browser included), per tool, in characters and estimated tokens.

    .venv/bin/python bench/prompt_size.py

The target (issue 31): at most 4,000 tokens for the default agent. Tokens are estimated at 3.5
characters each, which errs towards more tokens than OpenAI's tokenizers count for English and
JSON schemas (none ships without a download). tests/test_prompt_budget.py holds the same budget.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.prompt_size import CHARS_PER_TOKEN, fixed_prompt

TARGET_TOKENS = 4_000


async def main() -> None:
    prompt = await fixed_prompt()
    print(f"system prompt: {prompt.system_chars:6d} characters")
    print(f"tools ({len(prompt.tool_chars)}):   {sum(prompt.tool_chars.values()):6d} characters")
    for name, chars in sorted(prompt.tool_chars.items(), key=lambda item: -item[1]):
        print(f"  {name:22s} {chars:6d}")
    verdict = "PASS" if prompt.tokens <= TARGET_TOKENS else "MISS"
    print(f"total: {prompt.chars} characters, about {prompt.tokens} tokens at {CHARS_PER_TOKEN} characters a token"
          f"; target <= {TARGET_TOKENS}: {verdict}")


if __name__ == "__main__":
    asyncio.run(main())
