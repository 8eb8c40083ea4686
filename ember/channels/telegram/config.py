"""`[telegram]` in ember.toml: the bot, who may talk to it, and how it is reached."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

TOKEN_ENV = "EMBER_TELEGRAM_TOKEN"
DEFAULT_API_BASE_URL = "https://api.telegram.org/bot"


class TelegramSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # The bot's token from @BotFather; or EMBER_TELEGRAM_TOKEN, which keeps it out of the file.
    token: SecretStr | None = None
    # Where the Bot API is (a local Bot API server, or the tests' own); the token is appended.
    api_base_url: str = DEFAULT_API_BASE_URL
    # Telegram user ids that may talk to the agent; anyone else gets one polite refusal.
    allowed_users: list[int] = Field(default_factory=list)
    # User ids that may answer anyone's approval requests (besides the person whose turn asks).
    approvers: list[int] = Field(default_factory=list)
    # "polling" (getUpdates) or "webhook" (Telegram calls gateway_public_url/channels/telegram).
    mode: Literal["polling", "webhook"] = "polling"
    # Checked on every webhook call (X-Telegram-Bot-Api-Secret-Token); required in webhook mode.
    webhook_secret: SecretStr | None = None
    # A streamed answer's draft is edited at most this often per chat (Telegram allows about 1/s).
    edit_interval_ms: int = Field(default=1_000, ge=100, le=60_000)
    # In a group: answer only messages that mention the bot or reply to it, or every message.
    group_replies: Literal["mention", "all"] = "mention"
    # Long polling: how long one getUpdates waits for news.
    poll_timeout_s: int = Field(default=25, ge=0, le=50)

    @model_validator(mode="after")
    def _webhook_needs_a_secret(self) -> TelegramSpec:
        if self.mode == "webhook" and self.webhook_secret is None:
            raise ValueError("telegram.mode = \"webhook\" needs webhook_secret (1-256 of A-Z a-z 0-9 _ -)")
        return self

    def key(self) -> str | None:
        if self.token is not None:
            return self.token.get_secret_value()
        return os.environ.get(TOKEN_ENV) or None
