"""`ember channels`: the entrances `ember serve` runs with this configuration."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ember.cli.common import out, print_json, settings_or_exit

if TYPE_CHECKING:
    from ember.config.settings import Settings


def channels(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """The entrances `ember serve` runs with this configuration, and how each is set up."""
    settings = settings_or_exit()
    rows = [("http", "the gateway", f"http://{settings.gateway_host}:{settings.gateway_port}/ and /v1, "
                                    f"{len(settings.api_keys) or 'no'} API keys")]
    rows += [("webhook", name, f"POST /webhooks/{name}" + (f", answers to {spec.reply_to}" if spec.reply_to else ""))
             for name, spec in settings.webhooks.items()]
    rows += [("outbound", name, "answers POSTed, signed") for name in settings.outbound]
    rows.append(("cron", "scheduled tasks", "ember cron list"))
    if settings.a2a_enabled:
        rows.append(("a2a", "agent to agent", "/.well-known/agent-card.json and POST /a2a"))
    rows += _chat_rows(settings)
    if as_json:
        print_json([{"channel": c, "name": n, "state": d} for c, n, d in rows])
        return
    table = Table()
    for column in ("channel", "name", "set up"):
        table.add_column(column)
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))
    out.print(table)
    out.print("`ember doctor` checks each one's credentials without sending anything.")


def _chat_rows(settings: Settings) -> list[tuple[str, str, str]]:
    """The chat platforms' rows: each one's name and how it is set up."""
    rows: list[tuple[str, str, str]] = []
    telegram = settings.telegram_bot
    if telegram is not None:
        token = "token set" if telegram.key() else "NO TOKEN"
        rows.append(("telegram", telegram.mode, f"{token}, {len(telegram.allowed_users)} allowed users, edits every "
                                                f"{telegram.edit_interval_ms} ms"))
    if (slack := settings.slack) is not None:
        token = "token set" if slack.token() else "NO TOKEN"
        allowed = len(slack.allowed_users) or "all"
        if slack.mode == "socket":
            where = "Socket Mode" + ("" if slack.socket_token() else ", NO APP TOKEN")
        else:
            where = "POST /channels/slack/events" + ("" if slack.secret() else ", NO SIGNING SECRET")
        rows.append(("slack", f"{slack.mode}, {slack.channel_replies} in channels",
                     f"{where}, {token}, {allowed} allowed users"))
    if (dingtalk := settings.dingtalk) is not None:
        secret = "" if dingtalk.key() else ", NO SECRET"
        rows.append(("dingtalk", f"app {dingtalk.app_key}",
                     ("Stream mode" if dingtalk.mode == "stream" else "POST /channels/dingtalk/events")
                     + f"{secret}, {len(dingtalk.allowed_users) or 'all'} allowed users"))
    if (discord := settings.discord) is not None:
        token = "token set" if discord.key() else "NO TOKEN"
        rows.append(("discord", "the Gateway", f"{token}, {len(discord.allowed_users) or 'all'} allowed users"))
    if (feishu := settings.feishu) is not None:
        secret = "" if feishu.secret() else ", NO SECRET"
        rows.append(("feishu", f"app {feishu.app_id}",
                     ("long connection" if feishu.mode == "websocket" else "POST /channels/feishu/events")
                     + f"{secret}, {len(feishu.allowed_users) or 'all'} allowed users"))
    if (email := settings.email) is not None:
        secret = "" if email.key() else ", NO PASSWORD"
        rows.append(("email", email.address, f"IMAP {email.imap_host}:{email.imap_port}, SMTP {email.smtp_host}:"
                     f"{email.smtp_port}{secret}, {len(email.allowed_senders)} allowed senders"))
    if settings.wecom is not None:
        rows.append(("wecom", f"corp {settings.wecom.corp_id}, app {settings.wecom.agent_id}",
                     "POST /channels/wecom" + ("" if settings.wecom.key() else ", NO SECRET")))
    if settings.wechat is not None:
        rows.append(("wechat", f"app {settings.wechat.app_id}",
                     "POST /channels/wechat" + ("" if settings.wechat.key() else ", NO SECRET")))
    if settings.wecom_bot is not None:
        rows.append(("wecom_bot", "smart bot", "POST /channels/wecom-bot"))
    if settings.qq is not None:
        rows.append(("qq", f"app {settings.qq.app_id}",
                     "POST /channels/qq" + ("" if settings.qq.key() else ", NO SECRET")))
    return rows
