"""WeCom (企业微信) self-built app callbacks and WeChat Official Accounts in safe mode: the message crypto.

Both platforms use one scheme, Tencent's (its `WXBizMsgCrypt` samples):

- `msg_signature` is the SHA-1 hex of the token, the timestamp, the nonce and the ciphertext, sorted as
  strings and concatenated; the Official Account's plain `signature` is the same over the first three.
- AESKey = base64(EncodingAESKey + "="), 32 bytes; AES-256-CBC with IV = AESKey[:16].
- The plaintext is 16 random bytes, the message's length in 4 big-endian bytes, the message (UTF-8) and
  the receive id, PKCS#7-padded to a multiple of 32 bytes (the platforms' block, not AES's 16).
- The receive id is the corp id of a WeCom self-built app (a third-party app's suite id) and an Official
  Account's appid.

A callback comes as `?msg_signature=…&timestamp=…&nonce=…` with an XML body whose `<Encrypt>` holds the
ciphertext; WeCom's URL check (GET) sends a ciphertext as `echostr` and wants its plaintext as the answer.
A passive reply is the same envelope the other way (`encrypt_reply`). Every failed check raises
WeComCryptoError, and the signature is checked before anything is decrypted, so a caller without the token
learns nothing about padding.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
import secrets
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from ember.core.errors import ConfigError

KEY_CHARS = 43
BLOCK = 32
RANDOM_BYTES = 16
MAX_XML_CHARS = 256 * 1024
# Entities can only be declared in a document type; without one expat expands none (no XXE, no billion laughs).
_DECLARATION = re.compile(r"<!\s*(?:DOCTYPE|ENTITY)", re.IGNORECASE)
# XML 1.0 forbids these even inside CDATA: a document carrying one is refused by the platform's parser.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


class WeComCryptoError(ValueError):
    """A callback or ciphertext failed a check (signature, base64, padding, receive id, XML); the message says which."""


def signature(token: str, timestamp: str, nonce: str, encrypted: str) -> str:
    """The `msg_signature` of a ciphertext (WeCom, and Official Accounts in safe mode)."""
    return _sha1_sorted(token, timestamp, nonce, encrypted)


def url_signature(token: str, timestamp: str, nonce: str) -> str:
    """An Official Account's plain `signature`: its URL check, and every push in every mode."""
    return _sha1_sorted(token, timestamp, nonce)


def aes_key(encoding_aes_key: str) -> bytes:
    """The 32 key bytes of a 43-character EncodingAESKey; a ConfigError for anything else."""
    if len(encoding_aes_key) != KEY_CHARS:
        raise ConfigError(f"the EncodingAESKey has {len(encoding_aes_key)} characters; it has exactly {KEY_CHARS}")
    try:
        return base64.b64decode(encoding_aes_key + "=", validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError("the EncodingAESKey is not base64 (the console gives 43 letters and digits)") from None


@dataclass(frozen=True, slots=True)
class Sealed:
    """A ciphertext and what signs it: the four fields of a passive reply's envelope."""

    encrypted: str
    signature: str
    timestamp: str
    nonce: str


class MessageCrypto:
    """One app's callbacks: its token, its EncodingAESKey, and the receive id its messages must carry.

    `entropy` gives the 16 random bytes that open each plaintext (a fixed one reproduces a published vector).
    """

    def __init__(self, token: str, encoding_aes_key: str, receive_id: str, *,
                 entropy: Callable[[int], bytes] = os.urandom) -> None:
        if not token:
            raise ConfigError("the callback token is empty")
        self._token = token
        self._key = aes_key(encoding_aes_key)
        self._receive_id = receive_id.encode()
        self._entropy = entropy

    def encrypt(self, message: str, *, nonce: str | None = None, timestamp: str | int | None = None) -> Sealed:
        """`message` encrypted for this app and signed; the timestamp defaults to now, the nonce to a random one."""
        stamp = _timestamp(int(time.time()) if timestamp is None else timestamp)
        nonce = secrets.token_hex(8) if nonce is None else nonce
        prefix = self._entropy(RANDOM_BYTES)
        if len(prefix) != RANDOM_BYTES:
            raise ValueError(f"entropy gave {len(prefix)} bytes, not {RANDOM_BYTES}")
        body = message.encode()
        plain = prefix + len(body).to_bytes(4, "big") + body + self._receive_id
        pad = BLOCK - len(plain) % BLOCK  # a whole block of 32s when already aligned, as PKCS#7 says
        plain += bytes([pad]) * pad
        encryptor = self._cipher().encryptor()
        encrypted = base64.b64encode(encryptor.update(plain) + encryptor.finalize()).decode("ascii")
        return Sealed(encrypted, signature(self._token, stamp, nonce, encrypted), stamp, nonce)

    def decrypt(self, encrypted: str) -> str:
        """The message inside a ciphertext, once its padding, length field and receive id check out.

        This authenticates nothing: use it on a ciphertext whose signature was checked (as `verify_url` and
        `decrypt_message` do), or its distinct errors become a padding oracle.
        """
        if len(encrypted) > MAX_XML_CHARS:
            raise WeComCryptoError(f"the ciphertext is longer than {MAX_XML_CHARS} characters")
        try:
            raw = base64.b64decode(encrypted, validate=True)
        except (binascii.Error, ValueError):
            raise WeComCryptoError("the ciphertext is not base64") from None
        if not raw or len(raw) % BLOCK:
            raise WeComCryptoError(f"the ciphertext is {len(raw)} bytes, not whole {BLOCK}-byte blocks")
        decryptor = self._cipher().decryptor()
        plain = decryptor.update(raw) + decryptor.finalize()
        pad = plain[-1]
        if not 1 <= pad <= BLOCK or plain[-pad:] != bytes([pad]) * pad:
            raise WeComCryptoError("the ciphertext's padding is wrong: another key, or a damaged message")
        body = plain[RANDOM_BYTES:-pad]
        size = int.from_bytes(body[:4], "big")
        if len(body) < 4 or size > len(body) - 4:
            raise WeComCryptoError("the message's length field runs past the plaintext")
        receive_id = body[4 + size:]
        if not hmac.compare_digest(receive_id, self._receive_id):
            shown = receive_id.decode("utf-8", "replace")[:64]
            raise WeComCryptoError(f"the message is for receive id {shown!r}, not this app's")
        try:
            return body[4:4 + size].decode("utf-8")
        except UnicodeDecodeError:
            raise WeComCryptoError("the message is not UTF-8") from None

    def verify_url(self, msg_signature: str, timestamp: str, nonce: str, echostr: str) -> str:
        """WeCom's URL check (GET): the plaintext of `echostr`, which must be the whole response body."""
        self._check(msg_signature, timestamp, nonce, echostr)
        return self.decrypt(echostr)

    def verify_plain_url(self, signature: str, timestamp: str, nonce: str, echostr: str) -> str:
        """An Official Account's URL check (GET, in every mode): `echostr` as it came, once `signature` matches."""
        if not _same(signature, url_signature(self._token, timestamp, nonce)):
            raise WeComCryptoError("the signature does not match this app's token")
        return echostr

    def decrypt_message(self, msg_signature: str, timestamp: str, nonce: str, xml_body: str | bytes) -> str:
        """A callback POST's plaintext (its XML message): the body's `<Encrypt>`, once `msg_signature` signs it."""
        found = _parse(xml_body).findall("Encrypt")
        if len(found) != 1 or not found[0].text:
            raise WeComCryptoError("the body has no single, non-empty <Encrypt> element")
        encrypted = found[0].text
        self._check(msg_signature, timestamp, nonce, encrypted)
        return self.decrypt(encrypted)

    def encrypt_reply(self, xml_text: str, nonce: str, timestamp: str | int | None = None) -> str:
        """A passive reply's body: `xml_text` (such as `text_reply` builds) sealed in the signed envelope.

        The nonce is usually the request's own, so it goes in as escaped CDATA like any text from outside.
        """
        sealed = self.encrypt(xml_text, nonce=nonce, timestamp=timestamp)
        return ("<xml>"
                f"<Encrypt>{cdata(sealed.encrypted)}</Encrypt>"
                f"<MsgSignature>{cdata(sealed.signature)}</MsgSignature>"
                f"<TimeStamp>{sealed.timestamp}</TimeStamp>"
                f"<Nonce>{cdata(sealed.nonce)}</Nonce>"
                "</xml>")

    def _check(self, msg_signature: str, timestamp: str, nonce: str, encrypted: str) -> None:
        if not _same(msg_signature, signature(self._token, timestamp, nonce, encrypted)):
            raise WeComCryptoError("the msg_signature does not match this app's token")

    def _cipher(self) -> Cipher[modes.CBC]:
        return Cipher(algorithms.AES(self._key), modes.CBC(self._key[:16]))


def parse_message(xml_text: str | bytes) -> dict[str, str]:
    """A decrypted message's fields: each child of its `<xml>` by tag (ToUserName, MsgType, Content, AgentID…).

    CDATA is unwrapped; an empty element gives "". A container (an event's ScanCodeInfo, SendPicsInfo…) gives
    "" too: read nested fields from the XML itself.
    """
    fields: dict[str, str] = {}
    for child in _parse(xml_text):
        if child.tag in fields:
            raise WeComCryptoError(f"the message has <{child.tag}> twice")
        fields[child.tag] = "" if len(child) else child.text or ""
    return fields


def text_reply(to_user: str, from_user: str, content: str, *, create_time: int) -> str:
    """A passive text reply's XML (the plaintext `encrypt_reply` seals): to the sender, from the app.

    Characters XML 1.0 cannot carry (an escape code in a model's output) are dropped from the content.
    """
    return ("<xml>"
            f"<ToUserName>{cdata(to_user)}</ToUserName>"
            f"<FromUserName>{cdata(from_user)}</FromUserName>"
            f"<CreateTime>{int(create_time)}</CreateTime>"
            "<MsgType><![CDATA[text]]></MsgType>"
            f"<Content>{cdata(_NOT_XML.sub('', content))}</Content>"
            "</xml>")


def cdata(text: str) -> str:
    """`text` as CDATA that nothing inside can close early: each "]]>" is split across two sections."""
    if _NOT_XML.search(text):
        raise WeComCryptoError("the text has characters XML 1.0 cannot carry")
    return "<![CDATA[" + text.replace("]]>", "]]]]><![CDATA[>") + "]]>"


def _parse(document: str | bytes) -> ET.Element:
    """The root `<xml>` of a platform document; refused when oversize or when it declares a DTD or entities."""
    if len(document) > MAX_XML_CHARS:
        raise WeComCryptoError(f"the XML is longer than {MAX_XML_CHARS} characters")
    if isinstance(document, bytes):
        try:
            document = document.decode("utf-8-sig")
        except UnicodeDecodeError:
            raise WeComCryptoError("the XML is not UTF-8") from None
    # Expat reads a str as UTF-8 whatever its declaration says, so this search sees what expat will parse.
    if _DECLARATION.search(document):
        raise WeComCryptoError("the XML declares a DOCTYPE or an entity, which the platforms never send")
    try:
        root = ET.fromstring(document)
    except ET.ParseError as exc:
        raise WeComCryptoError(f"the XML is malformed: {exc}") from None
    if root.tag != "xml":
        raise WeComCryptoError(f"the root element is <{root.tag}>, not <xml>")
    return root


def _sha1_sorted(*parts: str) -> str:
    # Python orders str by code point, which is UTF-8 byte order: what the samples' sort gives.
    return hashlib.sha1("".join(sorted(parts)).encode()).hexdigest()


def _same(given: str, expected: str) -> bool:
    # As bytes: compare_digest raises TypeError on a non-ASCII str, and a query string can hold anything.
    return hmac.compare_digest(given.encode("utf-8", "replace"), expected.encode())


def _timestamp(value: str | int) -> str:
    stamp = str(value) if isinstance(value, int) else value
    if not (stamp.isascii() and stamp.isdigit()):
        raise WeComCryptoError("the timestamp must be whole seconds since 1970")
    return stamp
