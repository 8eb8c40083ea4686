"""Webhook signatures: the Standard Webhooks scheme, and GitHub's `X-Hub-Signature-256`.

Standard Webhooks (https://www.standardwebhooks.com): the secret is `whsec_` and
base64 key bytes; `webhook-signature` holds one or more space-separated
`v1,<base64 HMAC-SHA256 of "{webhook-id}.{webhook-timestamp}.{body}">`, and
the timestamp must be within five minutes of now. GitHub signs the body alone
with the plain secret (`sha256=<hex>`) and sends no timestamp; its delivery id
(`X-GitHub-Delivery`) names the message.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Mapping

from ember.core.errors import ConfigError

SECRET_PREFIX = "whsec_"
TOLERANCE_S = 300
MAX_ID_CHARS = 256


class SignatureError(Exception):
    """The request is not signed by the secret configured for it; the message says what is wrong."""


def standard_key(secret: str, where: str) -> bytes:
    """The key bytes of a `whsec_…` secret; a ConfigError naming `where` for anything else."""
    if not secret.startswith(SECRET_PREFIX):
        raise ConfigError(f"{where}: a standard webhook secret starts with {SECRET_PREFIX} and then base64")
    try:
        key = base64.b64decode(secret.removeprefix(SECRET_PREFIX) + "==", validate=False)
    except (binascii.Error, ValueError):
        raise ConfigError(f"{where}: the part after {SECRET_PREFIX} is not base64") from None
    if len(key) < 16:
        raise ConfigError(f"{where}: the secret's key is {len(key)} bytes; use at least 16 (24 to 64 is usual)")
    return key


def sign_standard(key: bytes, message_id: str, timestamp: int, body: bytes) -> str:
    digest = hmac.new(key, f"{message_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return f"v1,{base64.b64encode(digest).decode('ascii')}"


def verify_standard(key: bytes, headers: Mapping[str, str], body: bytes, *, now: float) -> str:
    """The message's `webhook-id` when the request is signed by `key` within the window."""
    message_id, stamp, signatures = (headers.get(name, "") for name in
                                     ("webhook-id", "webhook-timestamp", "webhook-signature"))
    missing = [name for name, value in (("webhook-id", message_id), ("webhook-timestamp", stamp),
                                        ("webhook-signature", signatures)) if not value]
    if missing:
        raise SignatureError(f"missing header{'s' if len(missing) > 1 else ''}: {', '.join(missing)}")
    if len(message_id) > MAX_ID_CHARS:
        raise SignatureError(f"webhook-id is longer than {MAX_ID_CHARS} characters")
    if not stamp.isascii() or not stamp.isdigit():
        raise SignatureError("webhook-timestamp must be whole seconds since 1970 (UTC)")
    timestamp = int(stamp)
    if abs(now - timestamp) > TOLERANCE_S:
        raise SignatureError(f"webhook-timestamp is {abs(now - timestamp):.0f} s from now; "
                             f"at most {TOLERANCE_S} s is accepted")
    expected = sign_standard(key, message_id, timestamp, body).encode()
    # Every candidate is compared, in constant time each, whatever came before it.
    matched = False
    for candidate in signatures.split():
        matched |= hmac.compare_digest(candidate.encode(), expected)
    if not matched:
        raise SignatureError("the signature does not match this webhook's secret")
    return message_id


def sign_github(secret: bytes, body: bytes) -> str:
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


def verify_github(secret: bytes, headers: Mapping[str, str], body: bytes) -> str:
    """The message's id (`X-GitHub-Delivery`, else the body's hash) when GitHub's signature matches."""
    signature = headers.get("x-hub-signature-256", "")
    if not signature:
        raise SignatureError("missing header: X-Hub-Signature-256")
    if not hmac.compare_digest(signature.encode(), sign_github(secret, body).encode()):
        raise SignatureError("the signature does not match this webhook's secret")
    delivery = headers.get("x-github-delivery", "")[:MAX_ID_CHARS]
    return delivery or hashlib.sha256(body).hexdigest()
