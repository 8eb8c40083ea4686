"""`[slack]` in ember.toml: the app's bot token and signing secret, who may talk to it, how it answers."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

TOKEN_ENV = "EMBER_SLACK_BOT_TOKEN"
SIGNING_SECRET_ENV = "EMBER_SLACK_SIGNING_SECRET"
APP_TOKEN_ENV = "EMBER_SLACK_APP_TOKEN"


class SlackSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # The app's bot token (xoxb-…); or EMBER_SLACK_BOT_TOKEN, which keeps it out of the file.
    bot_token: SecretStr | None = None
    # "events": Slack POSTs to gateway_public_url/channels/slack/events and /interactions; "socket":
    # Socket Mode, a WebSocket Ember opens to Slack (no public address needed).
    mode: Literal["events", "socket"] = "events"
    # Events mode: checks that an event or a button press came from Slack; or EMBER_SLACK_SIGNING_SECRET.
    signing_secret: SecretStr | None = None
    # Socket mode: the app-level token (xapp-…, scope connections:write); or EMBER_SLACK_APP_TOKEN.
    app_token: SecretStr | None = None
    # Where the Web API is (the tests' own, or a proxy); ends with a slash.
    api_base_url: str = "https://slack.com/api/"
    # Slack user ids (U…) that may talk to the agent; empty: every member of the workspace.
    allowed_users: list[str] = Field(default_factory=list)
    # User ids that may answer anyone's approval requests (besides the person whose turn asks).
    approvers: list[str] = Field(default_factory=list)
    # A streamed answer's message is edited at most this often per conversation (Slack allows about 1/s).
    edit_interval_ms: int = Field(default=1_000, ge=100, le=60_000)
    # In channels: answer only messages that mention the app, or every message.
    channel_replies: Literal["mention", "all"] = "mention"

    def token(self) -> str | None:
        return self.bot_token.get_secret_value() if self.bot_token else os.environ.get(TOKEN_ENV) or None

    def socket_token(self) -> str | None:
        return self.app_token.get_secret_value() if self.app_token else os.environ.get(APP_TOKEN_ENV) or None

    def secret(self) -> str | None:
        return self.signing_secret.get_secret_value() if self.signing_secret else \
            os.environ.get(SIGNING_SECRET_ENV) or None
