"""An MCP server's configuration, and how a listing or an error message shows it without its secrets."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, StringConstraints, model_validator

from ember.core.redact import REDACTED, redact_text
from ember.core.tools import Risk

# Server names become tool-name prefixes; tool names are at most 64 characters.
McpServerName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,32}$")]


class McpServerConfig(BaseModel):
    """One MCP server: a command to run over stdio, or a streamable HTTP URL."""

    model_config = ConfigDict(extra="forbid")
    # A stdio server: the program to run...
    command: str | None = None
    # ...its arguments...
    args: list[str] = Field(default_factory=list)
    # ...its environment (it gets nothing else of Ember's)...
    env: dict[str, SecretStr] = Field(default_factory=dict)
    # ...and its working folder.
    cwd: Path | None = None
    # Or a streamable HTTP server's URL...
    url: str | None = None
    # ...with the headers it needs (an Authorization, say).
    headers: dict[str, SecretStr] = Field(default_factory=dict)
    # The risk class of every tool of the server, for the approval policy.
    risk: Risk = Risk.EXECUTE
    # Per call; a call without an answer by then fails and the server is restarted.
    timeout_s: float = Field(default=30.0, gt=0)
    # Per request while connecting (initialize, the tool listing): a server may be slow to start.
    startup_timeout_s: float = Field(default=30.0, gt=0)
    # false: configured, not started.
    enabled: bool = True

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerConfig:
        if (self.command is None) == (self.url is None):
            raise ValueError("set exactly one of `command` (a stdio server) or `url` (a streamable HTTP server)")
        if self.url is not None:
            if urlsplit(self.url).scheme not in ("http", "https"):
                raise ValueError(f"`url` must be an http:// or https:// URL, not {self.url!r}")
            if self.args or self.env or self.cwd is not None:
                raise ValueError("`args`, `env` and `cwd` apply to a `command`, not to a `url`")
        if self.command is not None and self.headers:
            raise ValueError("`headers` apply to a `url`, not to a `command`")
        return self

    @property
    def transport(self) -> str:
        return "stdio" if self.command is not None else "streamable-http"

    def target(self) -> str:
        """The command line or URL as a listing may show it: secret values hidden, names kept."""
        if self.url is not None:
            shown = _safe_url(self.url)
            names = [f"{name}: {REDACTED}" for name in self.headers]
        else:
            shown = self.scrub(" ".join([self.command or "", *self.args]))
            names = [f"{name}={REDACTED}" for name in self.env]
        return f"{shown} ({', '.join(names)})" if names else shown

    def scrub(self, text: str) -> str:
        """`text` without the values of this server's env variables and headers."""
        for secret in (*self.env.values(), *self.headers.values()):
            value = secret.get_secret_value()
            if len(value) >= 4:
                text = text.replace(value, REDACTED)
        return redact_text(text)


McpServers = dict[McpServerName, McpServerConfig]


def _safe_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return redact_text(url)
    host = parts.netloc.rsplit("@", 1)[1]
    return redact_text(urlunsplit(parts._replace(netloc=f"{parts.username}:{REDACTED}@{host}")))
