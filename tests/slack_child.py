"""A process that answers Slack messages slowly, to be killed mid-answer:
`python -m tests.slack_child HOME API_BASE_URL ORIGIN_FILE`. It serves the events route on
127.0.0.1 and writes its origin to ORIGIN_FILE; its model streams a long draft and never
finishes it."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from starlette.applications import Starlette

from ember.app.runtime import build_runtime, running
from ember.app.serve import chat_services
from ember.channels.slack.channel import SlackChannel
from ember.config.settings import Settings
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from tests.loopback import served_here
from tests.test_slack import spec


async def main(home: Path, base_url: str, origin_file: Path) -> None:
    model = FunctionModel(lambda messages, tools: ModelReply(text="Let me think about this. " * 400), chunk_size=8,
                          delta_delay_s=0.05)
    runtime = await build_runtime(Settings(home=home), model)
    channel = SlackChannel(spec(base_url), chat_services(runtime))
    runtime.channels.register(channel)
    async with running(runtime, recover=True), served_here(Starlette(routes=channel.routes())) as origin:
        origin_file.write_text(origin)
        await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])))
