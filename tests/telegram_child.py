"""A process that answers Telegram messages slowly, to be killed mid-answer:
`python -m tests.telegram_child HOME API_BASE_URL`. Its model streams a long draft and
never finishes it."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from ember.app.runtime import build_runtime, running
from ember.config.settings import Settings
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from tests.test_telegram import telegram_channel


async def main(home: Path, base_url: str) -> None:
    model = FunctionModel(lambda messages, tools: ModelReply(text="Let me think about this. " * 400), chunk_size=8,
                          delta_delay_s=0.05)
    runtime = await build_runtime(Settings(home=home), model)
    runtime.channels.register(telegram_channel(runtime, base_url))
    async with running(runtime, recover=True):
        await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2]))
