"""`[webhooks.NAME]` and `[outbound.NAME]` in ember.toml (a contract: keep the names)."""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from ember.channels.webhooks.signing import standard_key
from ember.channels.webhooks.template import TemplateError, fields
from ember.core.errors import ConfigError

NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")


def check_name(kind: str, name: str) -> None:
    if not NAME.match(name):
        raise ValueError(f"{kind}.{name}: a name is lowercase letters, digits, '-' and '_' (at most 64)")


def _key(secret: SecretStr) -> bytes:
    try:
        return standard_key(secret.get_secret_value(), "secret")
    except ConfigError as exc:  # as a ValueError, pydantic names the field it is about
        raise ValueError(str(exc).removeprefix("secret: ")) from None


def _template(value: str) -> str:
    try:
        fields(value)
    except TemplateError as exc:
        raise ValueError(str(exc)) from None
    return value


class WebhookSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # "standard": Standard Webhooks signatures; "github": X-Hub-Signature-256.
    scheme: Literal["standard", "github"] = "standard"
    # Required: a webhook without a secret would run anyone's message, so it is refused at start.
    secret: SecretStr | None = None
    message: str = Field(description="the agent's message: payload fields by name, {repo.name} for nested ones")
    session: str | None = Field(default=None, description="the session's name; default: the webhook's name")
    reply_to: str | None = Field(default=None, description="an [outbound.NAME] target for the answer")

    @field_validator("message", "session")
    @classmethod
    def _templates(cls, value: str | None) -> str | None:
        return None if value is None else _template(value)

    @model_validator(mode="after")
    def _signed(self) -> WebhookSpec:
        if self.secret is None or not self.secret.get_secret_value():
            raise ValueError("a secret is required: a webhook without one would be open to anyone")
        if self.scheme == "standard":
            _key(self.secret)
        return self

    def key(self) -> bytes:
        assert self.secret is not None
        secret = self.secret.get_secret_value()
        return standard_key(secret, "secret") if self.scheme == "standard" else secret.encode()


class OutboundSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Where answers are POSTed as JSON.
    url: str
    secret: SecretStr | None = Field(default=None, description="whsec_…: each answer is signed with it")
    # Per attempt.
    timeout_s: float = Field(default=10.0, gt=0)
    # Attempts per send on 5xx, 408, 429 or no connection; then the answer stays owed and is sent again later.
    max_attempts: int = Field(default=5, ge=1, le=20)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{value!r} is not an http(s) URL")
        return value

    @field_validator("secret")
    @classmethod
    def _whsec(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            _key(value)
        return value

    def key(self) -> bytes | None:
        return None if self.secret is None else standard_key(self.secret.get_secret_value(), "secret")
