"""`[discord]` in ember.toml: the Discord bot, who may talk to it, and where Discord's API and Gateway are."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field, SecretStr

TOKEN_ENV = "EMBER_DISCORD_TOKEN"


class DiscordSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # The bot's token, from the Developer Portal (Bot, Reset Token); or EMBER_DISCORD_TOKEN.
    token: SecretStr | None = None
    # Where the HTTP API and the Gateway are (the tests' own, or a proxy). One Discord bot per process.
    api_base_url: str = "https://discord.com/api/v10"
    gateway_url: str = "wss://gateway.discord.gg/"
    # User ids that may talk to the agent; empty: everyone who can reach the bot (a DM, a server it is in).
    allowed_users: list[str] = Field(default_factory=list)
    # User ids that may answer anyone's approval requests (besides the person whose turn asks).
    approvers: list[str] = Field(default_factory=list)
    # The least time between two edits of an answer (Discord allows 5 edits in 5 s in a channel).
    edit_interval_ms: int = Field(default=1_000, ge=200, le=10_000)

    def key(self) -> str | None:
        return self.token.get_secret_value() if self.token else os.environ.get(TOKEN_ENV) or None
