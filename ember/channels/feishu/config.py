"""`[feishu]` in ember.toml: the Feishu (飞书) or Lark app, who may talk to it, and where its APIs are."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

SECRET_ENV = "EMBER_FEISHU_APP_SECRET"
ENCRYPT_KEY_ENV = "EMBER_FEISHU_ENCRYPT_KEY"


class FeishuSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # The app's App ID (cli_…) and App Secret (or EMBER_FEISHU_APP_SECRET), from the developer console.
    app_id: str = Field(min_length=1)
    app_secret: SecretStr | None = None
    # "http": Feishu posts events to gateway_public_url/channels/feishu/events; "websocket": Ember opens
    # Feishu's long connection (长连接: no public URL needed, nothing to verify or decrypt).
    mode: Literal["http", "websocket"] = "http"
    # Event subscription's Verification Token, which every posted event must carry (needed for "http").
    verification_token: SecretStr | None = None
    # Its Encrypt Key (or EMBER_FEISHU_ENCRYPT_KEY): events come encrypted and signed with it. Strongly advised.
    encrypt_key: SecretStr | None = None
    # Where the Open API is: Feishu's, Lark's (https://open.larksuite.com), the tests' own, or a proxy.
    api_base_url: str = "https://open.feishu.cn"
    # open_ids that may talk to the agent; empty: everyone in the tenant who can reach the bot.
    allowed_users: list[str] = Field(default_factory=list)
    # open_ids that may answer anyone's approval requests (besides the person whose turn asks).
    approvers: list[str] = Field(default_factory=list)
    # In groups, answer only messages that @-mention the bot ("mention"), or every message ("all").
    group_replies: Literal["mention", "all"] = "mention"
    # The least time between two updates of an answer's card (Feishu allows 5 a second per message).
    edit_interval_ms: int = Field(default=500, ge=200, le=10_000)

    @model_validator(mode="after")
    def _http_needs_a_token(self) -> FeishuSpec:
        if self.mode == "http" and self.verification_token is None:
            raise ValueError('mode = "http" needs verification_token (or mode = "websocket": no public URL)')
        return self

    def secret(self) -> str | None:
        return self.app_secret.get_secret_value() if self.app_secret else os.environ.get(SECRET_ENV) or None

    def encryption(self) -> str | None:
        return self.encrypt_key.get_secret_value() if self.encrypt_key else os.environ.get(ENCRYPT_KEY_ENV) or None
