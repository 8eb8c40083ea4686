"""A process that answers a called-back chat platform slowly, to be killed mid-answer:
`python -m tests.chat_child slack|dingtalk|feishu|discord HOME PLATFORM_URL ORIGIN_FILE`. It serves the channel's
routes on 127.0.0.1 and writes their origin to ORIGIN_FILE; its model streams a long draft slowly
and never finishes it."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from starlette.applications import Starlette

from ember.app.runtime import Runtime, build_runtime, running
from ember.app.serve import chat_services
from ember.config.settings import Settings
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from tests.chatplatform import CalledBack
from tests.loopback import served_here


def platform(name: str, runtime: Runtime, url: str) -> CalledBack:
    if name == "slack":
        from ember.channels.slack.channel import SlackChannel
        from tests.test_slack import spec as slack_spec

        return SlackChannel(slack_spec(url), chat_services(runtime))
    if name == "discord":  # on the Gateway: its routes are none
        from ember.channels.discord.channel import DiscordChannel
        from tests.discordserver import FakeDiscord
        from tests.test_discord import spec as discord_spec

        return DiscordChannel(discord_spec(FakeDiscord(origin=url)), chat_services(runtime))
    if name == "feishu":
        from ember.channels.feishu.channel import FeishuChannel
        from tests.feishuserver import FakeFeishu
        from tests.test_feishu import spec as feishu_spec

        return FeishuChannel(feishu_spec(FakeFeishu(origin=url)), chat_services(runtime))
    from ember.channels.dingtalk.channel import DingTalkChannel
    from tests.dingtalkserver import FakeDingTalk
    from tests.test_dingtalk import spec as dingtalk_spec

    return DingTalkChannel(dingtalk_spec(FakeDingTalk(origin=url)), chat_services(runtime))


async def main(name: str, home: Path, url: str, origin_file: Path) -> None:
    model = FunctionModel(lambda messages, tools: ModelReply(text="Let me think about this. " * 400), chunk_size=8,
                          delta_delay_s=0.05)
    runtime = await build_runtime(Settings(home=home), model)
    channel = platform(name, runtime, url)
    runtime.channels.register(channel)
    async with running(runtime, recover=True), served_here(Starlette(routes=channel.routes())) as origin:
        origin_file.write_text(origin)
        await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4])))
