"""Who a memory belongs to: channel principals bound to identities (people).

A principal is `channel:sender` (`http:alice`, `telegram:123456`, `cli:local-user`).
By default an HTTP key's name is its identity, every terminal session is
`local`, and any other principal is its own identity. `[identities]` binds
several principals to one person:

    [identities]
    alice = ["http:alice", "telegram:123456"]
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from ember.core.errors import ConfigError
from ember.core.memory import KEYED_CHANNELS, default_identity

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")


class Identities:
    def __init__(self, bindings: Mapping[str, Sequence[str]] | None = None) -> None:
        self._by_principal: dict[str, str] = {}
        for identity, principals in (bindings or {}).items():
            if not _NAME.match(identity):
                raise ConfigError(f"identities: {identity!r} is not a valid identity name "
                                  "(letters, digits, '_', '.', ':', '-')")
            for principal in principals:
                if ":" not in principal:
                    raise ConfigError(f"identities.{identity}: {principal!r} must be channel:sender, "
                                      "such as http:alice or telegram:123456")
                bound = self._by_principal.setdefault(principal, identity)
                if bound != identity:
                    raise ConfigError(f"identities: {principal!r} is bound to both {bound!r} and {identity!r}")

    def resolve(self, channel: str, sender_id: str) -> str:
        principal = f"{channel}:{sender_id}"
        bound = self._by_principal.get(principal)
        if bound is None and channel in KEYED_CHANNELS:
            # A gateway key is one principal over HTTP and A2A alike; bindings name it http:<key>.
            bound = self._by_principal.get(f"http:{sender_id}")
        return bound or default_identity(principal)

