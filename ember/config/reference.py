"""docs/configuration.md, written from the settings themselves: every key, its environment
variable, type, default, and the comment above it in the code.

    .venv/bin/python -m ember.config.reference > docs/configuration.md

A test checks that the file in the repository is what this prints, so the
reference cannot drift from the code.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel, SecretStr
from pydantic_core import PydanticUndefined

from ember.channels.dingtalk.config import DingTalkSpec
from ember.channels.discord.config import DiscordSpec
from ember.channels.email.config import EmailSpec
from ember.channels.feishu.config import FeishuSpec
from ember.channels.qq.config import QQSpec
from ember.channels.slack.config import SlackSpec
from ember.channels.telegram.config import TelegramSpec
from ember.channels.webhooks.config import OutboundSpec, WebhookSpec
from ember.channels.wecom.config import WeChatOfficialSpec, WeComBotSpec, WeComSpec
from ember.config.settings import Settings
from ember.models.spec import ModelSpec
from ember.pipeline.agent_spec import AgentSpec
from ember.tools.a2a import A2AAgentSpec
from ember.tools.approval import Rule, ToolPolicy
from ember.tools.browser_config import BrowserSpec
from ember.tools.delegate import DelegationSpec
from ember.tools.mcp.config import McpServerConfig

TABLES: list[tuple[str, type[BaseModel], str]] = [
    ("[models.NAME]", ModelSpec, "A named model; `[model_roles]` lists, per role (`main`, `background`, "
                                 "`approval`), the names tried in order."),
    ("[tool_policy]", ToolPolicy, "What each tool call may do without asking: `allow`, `ask` or `deny`."),
    ("[[tool_policy.rules]]", Rule, "Checked in order before everything else; the first match decides."),
    ("[mcp_servers.NAME]", McpServerConfig, "An MCP server whose tools the agent gets (stdio or streamable HTTP)."),
    ("[webhooks.NAME]", WebhookSpec, "A signed webhook: `POST /webhooks/NAME`."),
    ("[outbound.NAME]", OutboundSpec, "A URL that answers are POSTed to, signed."),
    ("[a2a_agents.NAME]", A2AAgentSpec, "Another agent the `call_agent` tool may hand work to."),
    ("[agents.NAME]", AgentSpec, "A named agent: its own prompt, models, tools, skills and memory scope."),
    ("[browser]", BrowserSpec, "The `browser` tool: a real Chromium, off unless enabled (docs/tools.md)."),
    ("[delegation]", DelegationSpec, "The `delegate` tool: tasks handed to child turns, and their bounds "
                                     "(docs/tools.md)."),
    ("[telegram]", TelegramSpec, "A Telegram bot `ember serve` runs (also on when only EMBER_TELEGRAM_TOKEN is set)."),
    ("[slack]", SlackSpec, "A Slack app: Events API at `/channels/slack/events`, or Socket Mode."),
    ("[dingtalk]", DingTalkSpec, "A DingTalk (钉钉) app robot, called back at `/channels/dingtalk/events`."),
    ("[discord]", DiscordSpec, "A Discord bot `ember serve` runs on the Gateway."),
    ("[feishu]", FeishuSpec, "A Feishu (飞书) / Lark bot: `/channels/feishu/events`, or its long connection."),
    ("[email]", EmailSpec, "A mailbox read over IMAP and answered from over SMTP, one session per thread."),
    ("[wecom]", WeComSpec, "A WeCom (企业微信) self-built app, called back at `/channels/wecom`."),
    ("[qq]", QQSpec, "A QQ official bot in webhook mode, called back at `/channels/qq`."),
    ("[wecom_bot]", WeComBotSpec, "A WeCom smart bot (企业微信智能机器人), called back at `/channels/wecom-bot`."),
    ("[wechat]", WeChatOfficialSpec, "A WeChat Official Account (微信公众号), called back at `/channels/wechat`."),
]
# Tables documented by the rows above, not as keys of their own.
NESTED = {"models", "tool_policy", "mcp_servers", "webhooks", "outbound", "a2a_agents", "telegram", "slack",
          "dingtalk", "discord", "feishu", "email", "wecom", "wechat", "wecom_bot", "qq"}


def comments(model: type[BaseModel]) -> dict[str, str]:
    """Field name -> the comment lines right above it in the class body that defines it last, joined."""
    found: dict[str, str] = {}
    for klass in reversed(model.__mro__):
        if issubclass(klass, BaseModel) and klass is not BaseModel:
            found.update((name, said) for name, said in _own_comments(klass).items() if said)
    return found


def _own_comments(model: type[BaseModel]) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(model))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    found: dict[str, str] = {}
    for node in ast.parse(source).body[0].body:  # type: ignore[attr-defined]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above, row = [], node.lineno - 2
            while row >= 0 and lines[row].strip().startswith("#"):
                above.insert(0, lines[row].strip().lstrip("#").strip())
                row -= 1
            found[node.target.id] = " ".join(above)
    return found


def _type(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if not get_args(annotation) else None
    text = text or str(annotation).replace("typing.", "").replace("pathlib.", "")
    for long, short in (("pydantic.types.SecretStr", "secret"), ("SecretStr", "secret"),
                        ("ember.models.spec.", ""), ("ember.channels.webhooks.config.", ""),
                        ("ember.tools.a2a.", ""), ("ember.tools.approval.", ""), ("ember.pipeline.agent_spec.", ""),
                        ("NoneType", "None")):
        text = text.replace(long, short)
    return text


def _default(field: Any) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, SecretStr):
        return "(set)"
    if isinstance(value, Path):
        return f'"{value}"'
    if value in ({}, [], None):
        return "—"
    if isinstance(value, BaseModel):
        return "see its table"
    shown = repr(value) if not isinstance(value, str) else f'"{value}"'
    return shown if len(shown) <= 60 else shown[:57] + "…"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _rows(model: type[BaseModel], *, env: bool) -> list[str]:
    said = comments(model)
    rows = []
    for name, field in model.model_fields.items():
        if env and name in NESTED:
            continue
        what = field.description or said.get(name, "")
        key = f"`{name}`" + (f"<br>`EMBER_{name.upper()}`" if env else "")
        rows.append(f"| {key} | {_cell(_type(field.annotation))} | {_cell(_default(field))} | {_cell(what)} |")
    return rows


def render() -> str:
    out = [
        "# Configuration reference",
        "",
        "Written by `python -m ember.config.reference` from the settings' own code; a test keeps it",
        "current. Ember reads `EMBER_HOME/ember.toml` (default `~/.ember/ember.toml`) and `EMBER_*`",
        "environment variables, which win over the file; values given in code win over both. Nested",
        "tables take `EMBER_TABLE__KEY` (`EMBER_TOOL_POLICY__EXECUTE=allow`). The model endpoint also",
        "honours `OPENAI_BASE_URL` / `OPENAI_API_KEY`, and Claude's key `ANTHROPIC_API_KEY`.",
        "A setting Ember does not know is an error, never ignored.",
        "",
        "## Settings",
        "",
        "| key and variable | type | default | what |",
        "|---|---|---|---|",
        *_rows(Settings, env=True),
    ]
    for title, model, intro in TABLES:
        out += ["", f"## `{title}`", "", intro, "", "| key | type | default | what |", "|---|---|---|---|",
                *_rows(model, env=False)]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
