"""Who is calling: API keys as identities, kept only as hashes, and a rate per identity."""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass

from ember.core.errors import ConfigError

LOCAL_IDENTITY = "local"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_HASHED = re.compile(r"^sha256:([0-9a-f]{64})$")


def key_digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """The configured keys. Empty means an open gateway, which serves loopback only."""

    _digests: tuple[tuple[bytes, str], ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> ApiKeys:
        """Entries are "name=secret", "name=sha256:<hex>" or a bare secret (named by its hash)."""
        digests: list[tuple[bytes, str]] = []
        for entry in entries:
            name, sep, secret = entry.partition("=")
            if not sep:
                name, secret = f"key-{key_digest(entry).hex()[:8]}", entry
            if not _NAME.match(name):
                raise ConfigError(f"API key name {name!r}: use letters, digits, '_', '.', '-' (at most 64)")
            if len(secret) < 16 and not _HASHED.match(secret):
                raise ConfigError(f"API key {name!r} is shorter than 16 characters; use a long random secret")
            hashed = _HASHED.match(secret)
            digests.append((bytes.fromhex(hashed.group(1)) if hashed else key_digest(secret), name))
        names = [name for _, name in digests]
        if len(set(names)) != len(names):
            raise ConfigError("two API keys share one name; each key is one identity")
        return cls(tuple(digests))

    @property
    def open(self) -> bool:
        return not self._digests

    @property
    def count(self) -> int:
        return len(self._digests)

    def identify(self, authorization: str | None) -> str | None:
        """The identity a `Bearer` header proves, or None."""
        if self.open:
            return LOCAL_IDENTITY
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        digest = key_digest(token.strip())
        found = None
        for known, name in self._digests:  # every key compared: the time taken says nothing
            if hmac.compare_digest(known, digest):
                found = name
        return found
