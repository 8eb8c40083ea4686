"""`[qq]` in ember.toml: the QQ official bot, who may talk to it, and where its APIs are."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field, SecretStr

SECRET_ENV = "EMBER_QQ_SECRET"
DEFAULT_API_BASE_URL = "https://api.sgroup.qq.com"
DEFAULT_TOKEN_URL = "https://bots.qq.com/app/getAppAccessToken"


class QQSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # The bot's AppID, from the QQ bot admin console (q.qq.com, 开发设置).
    app_id: str = Field(min_length=1)
    # The bot's AppSecret; or EMBER_QQ_SECRET, which keeps it out of the file. It also signs the callbacks.
    secret: SecretStr | None = None
    # Where the OpenAPI is (https://sandbox.api.sgroup.qq.com for the sandbox, or the tests' own).
    api_base_url: str = DEFAULT_API_BASE_URL
    # Where the app access token is fetched from (POST appId + clientSecret).
    token_url: str = DEFAULT_TOKEN_URL
    # Openids that may talk to the agent (user_openid; in a group, that group's member_openid); empty: anyone.
    allowed_users: list[str] = Field(default_factory=list)
    # Openids that may answer anyone's approval requests (besides the person whose turn asks).
    approvers: list[str] = Field(default_factory=list)

    def key(self) -> str | None:
        if self.secret is not None:
            return self.secret.get_secret_value()
        return os.environ.get(SECRET_ENV) or None
