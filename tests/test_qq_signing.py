"""QQ bot webhook signatures against the vectors Tencent publishes, and the ways a check must fail."""

from __future__ import annotations

import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from ember.channels.qq.signing import QQSigner, ValidationPayloadError, seed_from_secret
from ember.core.errors import ConfigError

# Callback-URL validation example, copied from tencent-connect/bot-docs,
# docs/develop/api-v2/dev-prepare/interface-framework/event-emit.md ("例如机器人账号").
DOC_SECRET = "DG5g3B4j9X2KOErG"
DOC_REQUEST = '{"d":{"plain_token":"Arq0D5A61EgUu4OxUvOp","event_ts":"1725442341"},"op":13}'
DOC_SIGNATURE = ("87befc99c42c651b3aac0278e71ada338433ae26fcb24307bdc5ad38c1adc2d0"
                 "1bcfcadc0842edac85e85205028a1132afe09280305f13aa6909ffc2d652c706")

# Seed and public-key demo, copied from tencent-connect/bot-docs,
# docs/develop/api-v2/dev-prepare/interface-framework/sign.md ("DEMO").
DEMO_SECRET = "naOC0ocQE3shWLAfffVLB1rhYPG7"
DEMO_SEED = b"naOC0ocQE3shWLAfffVLB1rhYPG7naOC"
DEMO_PUBLIC_KEY = bytes([215, 195, 98, 254, 120, 174, 248, 31, 242, 50, 135, 180, 147, 98, 139, 93,
                         176, 42, 60, 79, 227, 11, 33, 94, 77, 25, 96, 155, 93, 118, 103, 58])

# A signed event, copied from tencent-connect/botgo, interaction/signature/interaction_test.go.
BOTGO_SECRET = "123456abcdef"
BOTGO_TIMESTAMP = "1728981195"
BOTGO_SIGNATURE = ("e949b5b94ef4103df903fb031d1d16e358db3db83e79e117edd404c8508be3ce"
                   "8a76d7bad1bed353194c126a1a5915b4ad8b5288c1191cc53a12acffccd82004")
BOTGO_BODY = ('{"id":"ROBOT1.0_veoihSEXDc8Q.g-6eLpNIa11bH8MisOjn-m-'
              'LKxCPntMk6exUXgcWCGpVO7L2QKTNZzjZzFFDSbiOFcqAPWyVA!!",'
              '"content":"哦一下","timestamp":"2024-10-15T16:33:15+08:00",'
              '"author":{"id":"675860273","user_openid":"675860273"}}').encode()

BODY = b'{"op":0,"d":{"content":"hello"},"t":"C2C_MESSAGE_CREATE"}'
TIMESTAMP = "1725442341"


def test_the_published_validation_example_gives_the_published_answer() -> None:
    answer = QQSigner(DOC_SECRET).validation_response(json.loads(DOC_REQUEST))
    assert answer == {"plain_token": "Arq0D5A61EgUu4OxUvOp", "signature": DOC_SIGNATURE}


def test_the_validation_answer_verifies_as_event_ts_then_plain_token() -> None:
    signer = QQSigner(DOC_SECRET)
    assert signer.verify(DOC_SIGNATURE, "1725442341", b"Arq0D5A61EgUu4OxUvOp")


def test_the_seed_and_public_key_match_the_docs_demo() -> None:
    seed = seed_from_secret(DEMO_SECRET)
    assert seed == DEMO_SEED
    public = Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    assert public == DEMO_PUBLIC_KEY


def test_botgos_signed_event_verifies() -> None:
    signer = QQSigner(BOTGO_SECRET)
    assert signer.verify(BOTGO_SIGNATURE, BOTGO_TIMESTAMP, BOTGO_BODY)
    assert signer.sign(BOTGO_TIMESTAMP, BOTGO_BODY) == BOTGO_SIGNATURE


@pytest.mark.parametrize(("secret", "seed"), [
    ("abc", b"abcabcabcabcabcabcabcabcabcabcab"),
    ("0123456789abcdef0123456789ABCDEFtail-is-dropped", b"0123456789abcdef0123456789ABCDEF"),
    ("x" * 32, b"x" * 32),
    ("密钥", ("密钥" * 6).encode()[:32]),  # repeated by UTF-8 bytes, as Go counts them
])
def test_the_seed_repeats_a_short_secret_and_cuts_a_long_one(secret: str, seed: bytes) -> None:
    assert seed_from_secret(secret) == seed
    assert len(seed) == 32


def test_an_empty_secret_is_refused_clearly() -> None:
    with pytest.raises(ConfigError, match="secret is empty"):
        seed_from_secret("")
    with pytest.raises(ConfigError, match="secret is empty"):
        QQSigner("")


def test_sign_then_verify_round_trips() -> None:
    signer = QQSigner("a-bot-secret")
    signature = signer.sign(TIMESTAMP, BODY)
    assert len(signature) == 128
    assert signer.verify(signature, TIMESTAMP, BODY)
    assert signer.verify(signature.upper(), TIMESTAMP, BODY)


def test_a_tampered_request_does_not_verify() -> None:
    signer = QQSigner("a-bot-secret")
    signature = signer.sign(TIMESTAMP, BODY)
    flipped = bytearray.fromhex(signature)
    flipped[0] ^= 0x01
    assert not signer.verify(flipped.hex(), TIMESTAMP, BODY)
    assert not signer.verify(signature, TIMESTAMP, BODY + b" ")
    assert not signer.verify(signature, "1725442342", BODY)
    assert not signer.verify(signature, "", BODY)
    assert not QQSigner("another-secret").verify(signature, TIMESTAMP, BODY)


@pytest.mark.parametrize("bad", [
    "",
    "zz" * 64,
    "a" * 127,  # odd length
    "ab" * 63,  # 63 bytes
    "ab" * 65,  # 65 bytes
    " " + "ab" * 64,
    "ab " * 64,
    "é" * 128,  # not ASCII
])
def test_a_malformed_signature_is_false_not_an_exception(bad: str) -> None:
    assert not QQSigner("a-bot-secret").verify(bad, TIMESTAMP, BODY)


def test_a_signature_with_its_top_bits_set_is_refused_before_checking() -> None:
    signer = QQSigner("a-bot-secret")
    signature = bytearray.fromhex(signer.sign(TIMESTAMP, BODY))
    signature[63] |= 0xE0
    assert not signer.verify(signature.hex(), TIMESTAMP, BODY)


@pytest.mark.parametrize(("payload", "complaint"), [
    ([], "JSON object"),
    ({"d": {"plain_token": "t", "event_ts": "1"}}, "op is None"),
    ({"op": 0, "d": {"plain_token": "t", "event_ts": "1"}}, "op is 0"),
    ({"op": "13", "d": {"plain_token": "t", "event_ts": "1"}}, "op is '13'"),
    ({"op": True, "d": {"plain_token": "t", "event_ts": "1"}}, "op is True"),
    ({"op": 13.0, "d": {"plain_token": "t", "event_ts": "1"}}, "op is 13.0"),
    ({"op": 13}, "d must be an object"),
    ({"op": 13, "d": "token"}, "d must be an object"),
    ({"op": 13, "d": {"event_ts": "1"}}, "d.plain_token"),
    ({"op": 13, "d": {"plain_token": "", "event_ts": "1"}}, "d.plain_token"),
    ({"op": 13, "d": {"plain_token": "t"}}, "d.event_ts"),
    ({"op": 13, "d": {"plain_token": "t", "event_ts": 1725442341}}, "d.event_ts"),
])
def test_a_malformed_validation_request_says_what_is_wrong(payload: object, complaint: str) -> None:
    with pytest.raises(ValidationPayloadError, match=complaint):
        QQSigner(DOC_SECRET).validation_response(payload)  # type: ignore[arg-type]
