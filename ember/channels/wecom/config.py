"""`[wecom]`, `[wecom_bot]` and `[wechat]` in ember.toml: a WeCom (企业微信) self-built app, a WeCom smart bot
(智能机器人) and a WeChat Official Account (微信公众号). The platforms call back at /channels/wecom,
/channels/wecom-bot and /channels/wechat; answers go back in that callback's response (the smart bot's as a
stream it keeps asking for), or later through the platform's send API (the smart bot's `response_url`)."""

from __future__ import annotations

import os
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from ember.channels.wecom.crypto import aes_key
from ember.core.errors import ConfigError

WECOM_SECRET_ENV = "EMBER_WECOM_SECRET"
WECHAT_SECRET_ENV = "EMBER_WECHAT_SECRET"
WECOM_API_BASE_URL = "https://qyapi.weixin.qq.com"
WECHAT_API_BASE_URL = "https://api.weixin.qq.com"
# The platforms drop the connection and retry after 5 s without an answer: a passive reply must come before.
MAX_PASSIVE_REPLY_S = 4.5
# A smart bot's stream is asked for at most 6 minutes after the person's message (the docs' "最多等待6min").
MAX_STREAM_WINDOW_S = 330.0


def _checked_key(value: SecretStr | None) -> SecretStr | None:
    if value is not None:
        try:
            aes_key(value.get_secret_value())
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
    return value


def _checked_token(value: SecretStr) -> SecretStr:
    token = value.get_secret_value()
    if not (token.isascii() and token.isalnum()) or len(token) > 32:
        raise ValueError("the Token is 1-32 letters and digits (the console's callback settings show it)")
    return value


class _Sealed(BaseModel):
    """A platform whose callbacks are signed with a token and sealed with an EncodingAESKey: both are
    checked as they are read, and their values never reach an error message."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("token", check_fields=False)
    @classmethod
    def _token_is_letters_and_digits(cls, value: SecretStr) -> SecretStr:
        return _checked_token(value)

    @field_validator("encoding_aes_key", check_fields=False)
    @classmethod
    def _key_is_43_base64_characters(cls, value: SecretStr | None) -> SecretStr | None:
        return _checked_key(value)


class _AppAccount(_Sealed):
    """An app that is called back and answers through a send API that takes its secret: a callback waits
    a while for its answer, to send it back as its response (the passive reply)."""

    secret_env: ClassVar[str]
    secret: SecretStr | None = None
    # How long a callback waits for its answer to send it back as the response (the passive reply);
    # a later answer goes through the send API. 0: every answer through the API.
    passive_reply_s: float = Field(default=4.0, ge=0, le=MAX_PASSIVE_REPLY_S)

    def key(self) -> str | None:
        if self.secret is not None:
            return self.secret.get_secret_value()
        return os.environ.get(self.secret_env) or None


class WeComSpec(_AppAccount):
    secret_env = WECOM_SECRET_ENV
    # The corp's ID (企业ID, "ww…"), under My Company in the admin console; every callback is sealed for it.
    corp_id: str = Field(min_length=1)
    # The self-built app's AgentId, on the app's page in the admin console.
    agent_id: int
    # The app's Secret; or EMBER_WECOM_SECRET, which keeps it out of the file.
    secret: SecretStr | None = None
    # The Token of the app's "receive messages" (接收消息) API settings: it signs every callback.
    token: SecretStr
    # The EncodingAESKey of those settings (43 characters): callbacks and passive replies are encrypted with it.
    encoding_aes_key: SecretStr
    # Where the API is (a proxy, or the tests' own); paths such as /cgi-bin/gettoken are appended.
    api_base_url: str = WECOM_API_BASE_URL
    # WeCom UserIDs that may talk to the agent; empty: every member of the corp who can see the app.
    allowed_users: list[str] = Field(default_factory=list)
    # UserIDs that may answer anyone's approval requests (besides the person whose turn asks).
    approvers: list[str] = Field(default_factory=list)


class WeComBotSpec(_Sealed):
    # The Token of the smart bot's API settings (API模式, in the bot's page of the admin console): it signs every
    # callback.
    token: SecretStr
    # The EncodingAESKey of those settings (43 characters): callbacks and passive replies are encrypted with it.
    encoding_aes_key: SecretStr
    # WeCom UserIDs that may talk to the agent; empty: everyone who can chat with the bot.
    allowed_users: list[str] = Field(default_factory=list)
    # UserIDs that may answer anyone's approval requests (besides the person whose turn asks).
    approvers: list[str] = Field(default_factory=list)
    # How long after a message its stream waits for the answer; then the stream ends with a note and the answer
    # follows through the message's response_url. Below the platform's 6 minutes, so the stream's end is ours.
    stream_window_s: float = Field(default=300.0, gt=0, le=MAX_STREAM_WINDOW_S)


class WeChatOfficialSpec(_AppAccount):
    secret_env = WECHAT_SECRET_ENV
    # The account's AppID ("wx…"), under Settings and Development > Basic Configuration.
    app_id: str = Field(min_length=1)
    # The account's AppSecret; or EMBER_WECHAT_SECRET, which keeps it out of the file.
    secret: SecretStr | None = None
    # The server configuration's Token: it signs every push, in every message mode.
    token: SecretStr
    # The EncodingAESKey, for safe (安全) or compatible mode; unset: plain mode, messages in clear text.
    encoding_aes_key: SecretStr | None = None
    # Where the API is (a proxy, or the tests' own); paths such as /cgi-bin/token are appended.
    api_base_url: str = WECHAT_API_BASE_URL
    # OpenIDs that may talk to the agent; empty: everyone who follows the account.
    allowed_users: list[str] = Field(default_factory=list)
    # OpenIDs that may answer anyone's approval requests (besides the person whose turn asks).
    approvers: list[str] = Field(default_factory=list)
