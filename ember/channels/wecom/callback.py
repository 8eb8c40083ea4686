"""Reading the platforms' callbacks: the URL check (GET), and a message push (POST), verified and opened.

WeCom always encrypts: `?msg_signature&timestamp&nonce`, and an `<Encrypt>` body (the URL check's `echostr`
is a ciphertext too). An Official Account signs every request with a plain `?signature` over the token,
the timestamp and the nonce; in safe (or compatible) mode a push also has `encrypt_type=aes` and a
`msg_signature` over its `<Encrypt>`. A bad signature is a 401, a request that cannot be read a 400, and
a push in the wrong mode for the configuration a 403. A passive reply goes back sealed as the push came.

A WeCom smart bot (智能机器人) signs and encrypts the same way, for the receive id "" (its docs: "企业内部智能
机器人场景中，ReceiveId为\"\""), but its bodies are JSON: `{"encrypt": …}` in, and a passive reply
`{"encrypt", "msgsignature", "timestamp", "nonce"}` out (`BotCallbacks`).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from ember.channels.gateway.http import ApiError
from ember.channels.wecom.crypto import MessageCrypto, WeComCryptoError, parse_message, signature, url_signature

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Callback:
    """A verified push: the message's fields, and how a passive reply to it is sealed."""

    fields: Mapping[str, str]
    nonce: str
    sealed: bool  # the reply is encrypted (WeCom always; an Official Account in safe mode)


class Callbacks(Protocol):
    """One app's callback checks."""

    def verify_url(self, query: Mapping[str, str]) -> str:
        """The URL check's answer body."""
        ...

    def open(self, query: Mapping[str, str], body: bytes) -> Callback: ...

    def seal(self, callback: Callback, reply_xml: str) -> str:
        """A passive reply's body."""
        ...


class UrlCheck(Protocol):
    def verify_url(self, query: Mapping[str, str]) -> str: ...


class CallbackEndpoint:
    """A channel the platform calls back at `path`: the URL check (GET) answered from its callbacks,
    and its pushes (POST) read by `receive`."""

    path: str
    _callbacks: UrlCheck

    def routes(self) -> list[Route]:
        return [Route(self.path, self.verify, methods=["GET"]), Route(self.path, self.receive, methods=["POST"])]

    async def verify(self, request: Request) -> Response:
        """The platform's check of the callback URL, when it is saved in the console."""
        return PlainTextResponse(self._callbacks.verify_url(request.query_params))

    async def receive(self, request: Request) -> Response:
        raise NotImplementedError


class WeComCallbacks:
    def __init__(self, token: str, encoding_aes_key: str, corp_id: str) -> None:
        self._token = token
        self._crypto = MessageCrypto(token, encoding_aes_key, corp_id)

    def verify_url(self, query: Mapping[str, str]) -> str:
        return _echo(self._crypto, self._token, query)

    def open(self, query: Mapping[str, str], body: bytes) -> Callback:
        msg_signature, timestamp, nonce = _required(query, "msg_signature", "timestamp", "nonce")
        return Callback(_decrypted(self._crypto, self._token, msg_signature, timestamp, nonce, body), nonce, True)

    def seal(self, callback: Callback, reply_xml: str) -> str:
        return self._crypto.encrypt_reply(reply_xml, callback.nonce)


class OfficialCallbacks:
    """Safe mode when an EncodingAESKey is configured (then a push in clear text is refused), else plain mode."""

    def __init__(self, token: str, encoding_aes_key: str | None, app_id: str) -> None:
        self._token = token
        self._crypto = MessageCrypto(token, encoding_aes_key, app_id) if encoding_aes_key else None

    def verify_url(self, query: Mapping[str, str]) -> str:
        given, timestamp, nonce, echostr = _required(query, "signature", "timestamp", "nonce", "echostr")
        _signed(given, url_signature(self._token, timestamp, nonce))
        return echostr

    def open(self, query: Mapping[str, str], body: bytes) -> Callback:
        encrypted = query.get("encrypt_type", "raw") == "aes"
        if self._crypto is None:
            given, timestamp, nonce = _required(query, "signature", "timestamp", "nonce")
            _signed(given, url_signature(self._token, timestamp, nonce))
            if encrypted:
                raise ApiError(403, "the account pushes in safe mode: set [wechat] encoding_aes_key",
                               code="wrong_message_mode")
            return Callback(_readable(parse_message, body), nonce, False)
        if not encrypted:
            raise ApiError(403, "a push in clear text, but [wechat] has an encoding_aes_key: set the account to "
                                "safe mode, or remove the key", code="wrong_message_mode")
        msg_signature, timestamp, nonce = _required(query, "msg_signature", "timestamp", "nonce")
        return Callback(_decrypted(self._crypto, self._token, msg_signature, timestamp, nonce, body), nonce, True)

    def seal(self, callback: Callback, reply_xml: str) -> str:
        if not callback.sealed or self._crypto is None:
            return reply_xml
        return self._crypto.encrypt_reply(reply_xml, callback.nonce)


class BotCallbacks:
    """A smart bot's callbacks: `open` gives a push's plaintext (a JSON message) and the nonce its reply reuses."""

    def __init__(self, token: str, encoding_aes_key: str) -> None:
        self._token = token
        self._crypto = MessageCrypto(token, encoding_aes_key, "")

    def verify_url(self, query: Mapping[str, str]) -> str:
        return _echo(self._crypto, self._token, query)

    def open(self, query: Mapping[str, str], body: bytes) -> tuple[str, str]:
        msg_signature, timestamp, nonce = _required(query, "msg_signature", "timestamp", "nonce")
        try:
            envelope = json.loads(body)
        except ValueError:
            raise ApiError(400, "the body is not JSON", code="invalid_callback") from None
        encrypted = envelope.get("encrypt") if isinstance(envelope, dict) else None
        if not isinstance(encrypted, str) or not encrypted:
            raise ApiError(400, "the body has no \"encrypt\"", code="invalid_callback")
        _signed(msg_signature, signature(self._token, timestamp, nonce, encrypted))
        return _readable(self._crypto.decrypt, encrypted), nonce

    def seal(self, nonce: str, reply_json: str) -> str:
        """A passive reply's body. The timestamp goes as a string, as Tencent's JSON sample library writes it."""
        sealed = self._crypto.encrypt(reply_json, nonce=nonce)
        return json.dumps({"encrypt": sealed.encrypted, "msgsignature": sealed.signature,
                           "timestamp": sealed.timestamp, "nonce": sealed.nonce})


def _echo(crypto: MessageCrypto, token: str, query: Mapping[str, str]) -> str:
    """WeCom's URL check: the plaintext of `echostr`, once its signature checks out."""
    msg_signature, timestamp, nonce, echostr = _required(query, "msg_signature", "timestamp", "nonce", "echostr")
    echostr = echostr.replace(" ", "+")  # base64 has no spaces: a "+" sent unescaped reads as one
    _signed(msg_signature, signature(token, timestamp, nonce, echostr))
    return _readable(crypto.decrypt, echostr)


def _required(query: Mapping[str, str], *names: str) -> list[str]:
    missing = [name for name in names if not query.get(name)]
    if missing:
        raise ApiError(401, f"not a platform callback: no {', '.join(missing)} in the query", code="invalid_signature")
    return [query[name] for name in names]


def _signed(given: str, expected: str) -> None:
    # As bytes: compare_digest refuses a non-ASCII str, and a query can hold anything.
    if not hmac.compare_digest(given.encode("utf-8", "replace"), expected.encode()):
        raise ApiError(401, "the signature does not match this app's token", code="invalid_signature")


def _decrypted(crypto: MessageCrypto, token: str, msg_signature: str, timestamp: str, nonce: str,
               body: bytes) -> Mapping[str, str]:
    """A push's message fields, once the signature over its `<Encrypt>` checks out."""
    encrypted = _readable(parse_message, body).get("Encrypt", "")
    if not encrypted:
        raise ApiError(400, "the body has no <Encrypt>", code="invalid_callback")
    _signed(msg_signature, signature(token, timestamp, nonce, encrypted))
    return _readable(parse_message, _readable(crypto.decrypt, encrypted))


def _readable(read: Callable[[T], R], value: T) -> R:
    """`read(value)`; a failed check of the crypto is a 400 (the signature was checked before)."""
    try:
        return read(value)
    except WeComCryptoError as exc:
        raise ApiError(400, f"the callback cannot be read: {exc}", code="invalid_callback") from None
