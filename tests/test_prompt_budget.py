"""The fixed part of every turn's prompt (system prompt and tools, every built-in tool on) stays
under issue 31's budget of 4,000 tokens: counted in characters, never timed."""

from __future__ import annotations

from pathlib import Path

from tests.prompt_size import CHARS_PER_TOKEN, fixed_prompt

MAX_TOKENS = 4_000


async def test_the_fixed_prompt_with_every_tool_on_stays_under_4000_tokens(tmp_path: Path) -> None:
    prompt = await fixed_prompt(tmp_path)
    offered = {"read_file", "shell", "web_fetch", "browser", "remember", "schedule_task", "delegate"}
    assert offered <= set(prompt.tool_chars)
    assert prompt.chars <= MAX_TOKENS * CHARS_PER_TOKEN, (prompt.tokens, prompt.tool_chars)
