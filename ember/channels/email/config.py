"""`[email]` in ember.toml: the mailbox Ember reads (IMAP), how it answers (SMTP), and whose mail it takes."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

PASSWORD_ENV = "EMBER_EMAIL_PASSWORD"
Security = Literal["tls", "starttls", "none"]
ImapSecurity = Literal["tls", "none"]


class EmailSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # The agent's address: answers come from it, and it is the IMAP and SMTP login unless `username` says otherwise.
    address: str = Field(pattern=r"^[^@\s]+@[^@\s]+$")
    # The login, where it is not the address.
    username: str | None = None
    # The login's password (an app password); or EMBER_EMAIL_PASSWORD.
    password: SecretStr | None = None
    # Where the mailbox is read (IMAP).
    imap_host: str
    imap_port: int = Field(default=993, ge=1, le=65_535)
    # "tls" from the first byte (port 993); "none" only on a trusted network.
    imap_security: ImapSecurity = "tls"
    # The folder whose unread mail Ember takes.
    mailbox: str = "INBOX"
    # Where answers are sent from (SMTP).
    smtp_host: str
    smtp_port: int = Field(default=587, ge=1, le=65_535)
    # "starttls" after connecting (port 587), "tls" from the first byte (465); "none" only on a trusted network.
    smtp_security: Security = "starttls"
    # Who may write to the agent: addresses, or "@example.com" for a whole domain. Empty: nobody
    # (an inbox is public); a stranger is told so once a run.
    allowed_senders: list[str] = Field(default_factory=list)
    # Addresses that may answer anyone's approval requests (besides the person whose turn asks).
    approvers: list[str] = Field(default_factory=list)
    # How often the mailbox is looked at when its server cannot push new mail (IMAP IDLE).
    poll_interval_s: float = Field(default=60.0, ge=1, le=3_600)
    # Unused: mail goes over IMAP and SMTP. Taken, so that every platform's table has the same key.
    api_base_url: str | None = None

    def key(self) -> str | None:
        return self.password.get_secret_value() if self.password else os.environ.get(PASSWORD_ENV) or None

    @property
    def login(self) -> str:
        return self.username or self.address
