"""Who is calling: API keys as identities, kept only as hashes, and a rate per identity."""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

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


@dataclass(slots=True)
class _Bucket:
    tokens: float
    stamp: float


@dataclass(slots=True)
class RateLimiter:
    """A token bucket per identity: `per_minute` steady, `burst` at once."""

    per_minute: float
    burst: int
    max_buckets: int = 10_000
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    def retry_after(self, identity: str) -> float:
        """0 when the request may go ahead (and is counted), else seconds to wait."""
        now = time.monotonic()
        if len(self._buckets) >= self.max_buckets:
            self._forget_idle(now)
        bucket = self._buckets.setdefault(identity, _Bucket(float(self.burst), now))
        rate = self.per_minute / 60
        bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.stamp) * rate)
        bucket.stamp = now
        if bucket.tokens >= 1:
            bucket.tokens -= 1
            return 0.0
        return (1 - bucket.tokens) / rate

    def _forget_idle(self, now: float) -> None:
        """Drop buckets that have refilled: they hold nothing a new bucket would not."""
        full_after = self.burst / (self.per_minute / 60)
        self._buckets = {k: b for k, b in self._buckets.items() if now - b.stamp < full_after}
