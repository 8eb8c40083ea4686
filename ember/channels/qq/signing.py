"""QQ official bot webhook signatures: Ed25519 with a key pair derived from the bot secret.

The 32-byte Ed25519 seed is the bot secret's UTF-8 bytes repeated until there are at least
32, then cut to 32. QQ signs each callback's `X-Signature-Timestamp` followed by the raw body
and sends the hex signature in `X-Signature-Ed25519`. When a callback URL is configured, QQ
posts `{"op": 13, "d": {"plain_token": …, "event_ts": …}}`; the bot answers
`{"plain_token": …, "signature": <hex signature of event_ts + plain_token>}`. The docs set no
window for the timestamp: a caller that wants one checks it itself.

Source: tencent-connect/bot-docs, docs/develop/api-v2/dev-prepare/interface-framework/sign.md
and event-emit.md; the reference implementation is tencent-connect/botgo,
interaction/signature/interaction.go.
"""

from __future__ import annotations

import binascii
from collections.abc import Mapping
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ember.core.errors import ConfigError

HEADER_SIGNATURE = "X-Signature-Ed25519"
HEADER_TIMESTAMP = "X-Signature-Timestamp"
VALIDATION_OP = 13
SEED_SIZE = 32
SIGNATURE_SIZE = 64


class ValidationPayloadError(Exception):
    """The body is not an `op: 13` callback-URL validation request; the message says what is wrong."""


def seed_from_secret(secret: str) -> bytes:
    """The Ed25519 seed QQ derives from a bot secret; a ConfigError for an empty secret."""
    if not secret:
        raise ConfigError("the QQ bot secret is empty; copy the AppSecret from the QQ bot admin console")
    # The reference repeats a Go string, whose length counts UTF-8 bytes, so the repeat is over bytes;
    # its doubling loop yields the same first 32 bytes as repeating the secret end to end.
    raw = secret.encode()
    return (raw * -(-SEED_SIZE // len(raw)))[:SEED_SIZE]


class QQSigner:
    """Signs as QQ does and checks QQ's signatures, with the key pair of one bot secret."""

    def __init__(self, secret: str) -> None:
        self._private_key = Ed25519PrivateKey.from_private_bytes(seed_from_secret(secret))
        self._public_key = self._private_key.public_key()

    def sign(self, timestamp: str, body: bytes) -> str:
        """The hex Ed25519 signature of `timestamp` followed by `body`."""
        return self._private_key.sign(timestamp.encode() + body).hex()

    def verify(self, signature_hex: str, timestamp: str, body: bytes) -> bool:
        """Whether `signature_hex` signs `timestamp + body`; False, never an exception, for any bad input."""
        if not timestamp:
            return False
        try:
            # unhexlify, unlike bytes.fromhex, refuses embedded whitespace.
            signature = binascii.unhexlify(signature_hex)
        except ValueError:
            return False
        # The docs refuse a signature whose top three bits are set (its S cannot be reduced) before checking.
        if len(signature) != SIGNATURE_SIZE or signature[-1] & 0xE0:
            return False
        try:
            self._public_key.verify(signature, timestamp.encode() + body)
        except InvalidSignature:
            return False
        return True

    def validation_response(self, payload: Mapping[str, Any]) -> dict[str, str]:
        """The answer to an `op: 13` callback-URL validation request (the parsed JSON body)."""
        plain_token, event_ts = _validation_fields(payload)
        return {"plain_token": plain_token, "signature": self.sign(event_ts, plain_token.encode())}


def _validation_fields(payload: Mapping[str, Any]) -> tuple[str, str]:
    """`plain_token` and `event_ts` of a validation request; a ValidationPayloadError for anything else."""
    if not isinstance(payload, Mapping):
        raise ValidationPayloadError("the validation request must be a JSON object")
    op = payload.get("op")
    # bool is an int in Python, and 13.0 equals 13: neither is the integer opcode QQ sends.
    if type(op) is not int or op != VALIDATION_OP:
        raise ValidationPayloadError(f"op is {op!r}; a callback-URL validation request has op {VALIDATION_OP}")
    data = payload.get("d")
    if not isinstance(data, Mapping):
        raise ValidationPayloadError("d must be an object holding plain_token and event_ts")
    fields = []
    for name in ("plain_token", "event_ts"):
        value = data.get(name)
        if not isinstance(value, str) or not value:
            raise ValidationPayloadError(f"d.{name} must be a non-empty string, not {value!r}")
        fields.append(value)
    return fields[0], fields[1]
