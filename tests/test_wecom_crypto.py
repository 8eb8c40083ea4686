"""WeCom / Official Account message crypto against the platforms' published vectors, and its refusals.

Vectors, copied from:
- WeCom sample: sbzhu/weworkapi_php callback/Sample.php (the same values are in the comments of
  sbzhu/weworkapi_python callback/Sample.py and in Tencent's C# sample): corp id wx5823bf96d3bd56c7.
- WeCom sample code proper: sbzhu/weworkapi_python callback/Sample.py (corp id ww1436e0e65a779aee).
- Official Account sample: Tencent's Python `Sample.py` (jonyqin, 2014), as kept in
  Abdurihim/weixin_encodingAES Sample.py (appid wx2c2769f8efd9abc2).
- WeChat message-push docs, safe mode, https://developers.weixin.qq.com/miniprogram/dev/framework/
  server-ability/message-push.html (Token "AAAAA"): the only vector with a published random prefix, so
  the only one that pins encryption byte for byte.
"""

from __future__ import annotations

import base64

import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.channels.wecom.crypto import (
    MAX_XML_CHARS,
    MessageCrypto,
    WeComCryptoError,
    cdata,
    parse_message,
    signature,
    text_reply,
    url_signature,
)
from ember.core.errors import ConfigError

# --- WeCom sample (Sample.php) ---
TOKEN = "QDG6eK"
AES_KEY = "jWmYm7qr5nMoAUwZRjGtBxmz3KA1tkAj3ykkR6q2B2C"
CORP_ID = "wx5823bf96d3bd56c7"

URL_SIG = "5c45ff5e21c57e6ad56bac8758b79b1d9ac89fd3"
URL_TIMESTAMP = "1409659589"
URL_NONCE = "263014780"
ECHOSTR = "P9nAzCzyDtyTWESHep1vC5X9xho/qYX3Zpb4yKa9SKld1DsH3Iyt3tP3zNdtp+4RPcs8TgAE7OaBO+FZXvnaqQ=="
# The sample does not print this plaintext; it is what the ciphertext holds (other suites assert the same).
ECHO_PLAIN = "1616140317555161061"

MSG_SIG = "477715d11cdb4164915debcba66cb864d751f3e6"
MSG_TIMESTAMP = "1409659813"
MSG_NONCE = "1372623149"
MSG_ENCRYPT = (
    "RypEvHKD8QQKFhvQ6QleEB4J58tiPdvo+rtK1I9qca6aM/wvqnLSV5zEPeusUiX5L5X/0lWfrf0QADHHhGd3QczcdCUpj911L3vg3W/"
    "sYYvuJTs3TUUkSUXxaccAS0qhxchrRYt66wiSpGLYL42aM6A8dTT+6k4aSknmPj48kzJs8qLjvd4Xgpue06DOdnLxAUHzM6+kDZ+HMZf"
    "JYuR+LtwGc2hgf5gsijff0ekUNXZiqATP7PF5mZxZ3Izoun1s4zG4LUMnvw2r+KqCKIw+3IQH03v+BCA9nMELNqbSf6tiWSrXJB3LAVG"
    "Ucallcrw8V2t9EL4EhzJWrQUax5wLVMNS0+rUPA3k22Ncx4XXZS9o0MBH27Bo6BpNelZpS+/uh9KsNlY6bHCmJU9p8g7m3fVKn28H3KD"
    "YA5Pl/T8Z1ptDAVe0lXdQ2YoyyH2uyPIGHBZZIs2pDBS8R07+qN+E7Q=="
)
MSG_BODY = (f"<xml><ToUserName><![CDATA[wx5823bf96d3bd56c7]]></ToUserName><Encrypt><![CDATA[{MSG_ENCRYPT}]]>"
            "</Encrypt><AgentID><![CDATA[218]]></AgentID></xml>")
# Printed in Sample.php's comment after DecryptMsg, newlines and all.
MSG_PLAIN = ("<xml><ToUserName><![CDATA[wx5823bf96d3bd56c7]]></ToUserName>\n"
             "<FromUserName><![CDATA[mycreate]]></FromUserName>\n"
             "<CreateTime>1409659813</CreateTime>\n"
             "<MsgType><![CDATA[text]]></MsgType>\n"
             "<Content><![CDATA[hello]]></Content>\n"
             "<MsgId>4561255354251345929</MsgId>\n"
             "<AgentID>218</AgentID>\n"
             "</xml>")

# --- WeCom sample code proper (weworkapi_python callback/Sample.py) ---
WW_TOKEN = "hJqcu3uJ9Tn2gXPmxx2w9kkCkCE2EPYo"
WW_AES_KEY = "6qkdMrq68nTKduznJYO1A37W2oEgpkMUvkttRToqhUt"
WW_CORP_ID = "ww1436e0e65a779aee"
WW_URL = ("012bc692d0a58dd4b10f8dfe5c4ac00ae211ebeb", "1476416373", "47744683",
          "fsi1xnbH4yQh0+PJxcOdhhK6TDXkjMyhEPA7xB2TGz6b+g7xyAbEkRxN/3cNXW9qdqjnoVzEtpbhnFyq6SVHyA==")
WW_MSG_SIG, WW_MSG_TIMESTAMP, WW_MSG_NONCE = "0c3914025cb4b4d68103f6bfc8db550f79dcf48e", "1476422779", "1597212914"
WW_MSG_BODY = (
    "<xml><ToUserName><![CDATA[ww1436e0e65a779aee]]></ToUserName>\n<Encrypt><![CDATA["
    "Kl7kjoSf6DMD1zh7rtrHjFaDapSCkaOnwu3bqLc5tAybhhMl9pFeK8NslNPVdMwmBQTNoW4mY7AIjeLvEl3NyeTkAgGzBhzTtRLNshw2AE"
    "ew+kkYcD+Fq72Kt00fT0WnN87hGrW8SqGc+NcT3mu87Ha3dz1pSDi6GaUA6A0sqfde0VJPQbZ9U+3JWcoD4Z5jaU0y9GSh010wsHF8KZD2"
    "4YhmZH4ch4Ka7ilEbjbfvhKkNL65HHL0J6EYJIZUC2pFrdkJ7MhmEbU2qARR4iQHE7wy24qy0cRX3Mfp6iELcDNfSsPGjUQVDGxQDCWjay"
    "JOpcwocugux082f49HKYg84EpHSGXAyh+/oxwaWbvL6aSDPOYuPDGOCI8jmnKiypE+"
    "]]></Encrypt>\n<AgentID><![CDATA[1000002]]></AgentID>\n</xml>"
)
# The same sample's reply text (sRespData): the message it received, byte for byte.
WW_MSG_PLAIN = ("<xml><ToUserName>ww1436e0e65a779aee</ToUserName><FromUserName>ChenJiaShun</FromUserName>"
                "<CreateTime>1476422779</CreateTime><MsgType>text</MsgType><Content>你好</Content>"
                "<MsgId>1456453720</MsgId><AgentID>1000002</AgentID></xml>")

# --- Official Account sample (Sample.py) ---
OA_TOKEN = "spamtest"
OA_AES_KEY = "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFG"
OA_APPID = "wx2c2769f8efd9abc2"
OA_SIG, OA_TIMESTAMP, OA_NONCE = "5d197aaffba7e9b25a30732f161a50dee96bd5fa", "1409735669", "1320562132"
# Compatibility mode: the message in clear and, in <Encrypt>, the same message encrypted.
OA_CLEAR = {"ToUserName": "gh_10f6c3c3ac5a", "FromUserName": "oyORnuP8q7ou2gfYjqLzSIWZf0rs",
            "CreateTime": "1409735668", "MsgType": "text", "Content": "abcdteT", "MsgId": "6054768590064713728"}
OA_BODY = (
    "<xml><ToUserName><![CDATA[gh_10f6c3c3ac5a]]></ToUserName><FromUserName><![CDATA[oyORnuP8q7ou2gfYjqLzSIWZf0"
    "rs]]></FromUserName><CreateTime>1409735668</CreateTime><MsgType><![CDATA[text]]></MsgType><Content><![CDATA"
    "[abcdteT]]></Content><MsgId>6054768590064713728</MsgId><Encrypt><![CDATA[hyzAe4OzmOMbd6TvGdIOO6uBmdJoD0Fk5"
    "3REIHvxYtJlE2B655HuD0m8KUePWB3+LrPXo87wzQ1QLvbeUgmBM4x6F8PGHQHFVAFmOD2LdJF9FrXpbUAh0B5GIItb52sn896wVsMSHGu"
    "PE328HnRGBcrS7C41IzDWyWNlZkyyXwon8T332jisa+h6tEDYsVticbSnyU8dKOIbgU6ux5VTjg3yt+WGzjlpKn6NPhRjpA912xMezR4kw"
    "6KWwMrCVKSVCZciVGCgavjIQ6X8tCOp3yZbGpy0VxpAe+77TszTfRd5RJSVO/HTnifJpXgCSUdUue1v6h0EIBYYI1BD1DlD+C0CR8e6Oew"
    "pusjZ4uBl9FyJvnhvQl+q5rv1ixrcpCumEPo5MJSgM9ehVsNPfUM669WuMyVWQLCzpu9GhglF2PE=]]></Encrypt></xml>"
)

# --- WeChat message-push docs (safe mode, JSON data format; the crypto is the same) ---
DOC_TOKEN = "AAAAA"
DOC_AES_KEY = "A" * 43
DOC_APPID = "wxba5fad812f8e6fb9"
DOC_ENCRYPT = (
    "+qdx1OKCy+5JPCBFWw70tm0fJGb2Jmeia4FCB7kao+/Q5c/ohsOzQHi8khUOb05JCpj0JB4RvQMkUyus8TPxLKJGQqcvZqzDpVzazhZv6J"
    "sXUnnR8XGT740XgXZUXQ7vJVnAG+tE8NUd4yFyjPy7GgiaviNrlCTj+l5kdfMuFUPpRSrfMZuMcp3Fn2Pede2IuQrKEYwKSqFIZoNqJ4M8"
    "EajAsjLY2km32IIjdf8YL/P50F7mStwntrA2cPDrM1kb6mOcfBgRtWygb3VIYnSeOBrebufAlr7F9mFUPAJGj04="
)
DOC_PLAIN = ('{"ToUserName":"gh_97417a04a28d","FromUserName":"o9AgO5Kd5ggOC-bXrbNODIiE3bGY",'
             '"CreateTime":1714112445,"MsgType":"event","Event":"debug_demo","debug_str":"hello world"}')


def wecom() -> MessageCrypto:
    return MessageCrypto(TOKEN, AES_KEY, CORP_ID)


def raw_ciphertext(encoding_aes_key: str, plain: bytes) -> str:
    """`plain` (already a whole number of blocks) encrypted with no padding added: for malformed plaintexts."""
    key = base64.b64decode(encoding_aes_key + "=")
    encryptor = Cipher(algorithms.AES(key), modes.CBC(key[:16])).encryptor()
    return base64.b64encode(encryptor.update(plain) + encryptor.finalize()).decode()


# --- published vectors ---

@pytest.mark.parametrize(("token", "timestamp", "nonce", "encrypted", "expected"), [
    (TOKEN, URL_TIMESTAMP, URL_NONCE, ECHOSTR, URL_SIG),
    (TOKEN, MSG_TIMESTAMP, MSG_NONCE, MSG_ENCRYPT, MSG_SIG),
    (OA_TOKEN, OA_TIMESTAMP, OA_NONCE, parse_message(OA_BODY)["Encrypt"], OA_SIG),
    (DOC_TOKEN, "1714112445", "415670741", DOC_ENCRYPT, "046e02f8204d34f8ba5fa3b1db94908f3df2e9b3"),
])
def test_msg_signature_matches_the_published_vectors(token, timestamp, nonce, encrypted, expected):
    assert signature(token, timestamp, nonce, encrypted) == expected


@pytest.mark.parametrize(("timestamp", "nonce", "expected"), [
    ("1714036504", "1514711492", "f464b24fc39322e44b38aa78f5edd27bd1441696"),  # URL check
    ("1714037059", "486452656", "899cf89e464efb63f54ddac96b0a0a235f53aa78"),  # plain-mode push
    ("1714112445", "415670741", "6c5c811b55cc85e0e1b54100749188c20beb3f5d"),  # safe-mode push's `signature`
])
def test_url_signature_matches_the_published_vectors(timestamp, nonce, expected):
    assert url_signature(DOC_TOKEN, timestamp, nonce) == expected


def test_wecom_url_verification_vector():
    assert wecom().verify_url(URL_SIG, URL_TIMESTAMP, URL_NONCE, ECHOSTR) == ECHO_PLAIN


def test_wecom_message_vector():
    plain = wecom().decrypt_message(MSG_SIG, MSG_TIMESTAMP, MSG_NONCE, MSG_BODY)
    assert plain == MSG_PLAIN
    assert parse_message(plain) == {"ToUserName": CORP_ID, "FromUserName": "mycreate", "CreateTime": "1409659813",
                                    "MsgType": "text", "Content": "hello", "MsgId": "4561255354251345929",
                                    "AgentID": "218"}


def test_wecom_sample_code_vectors():
    crypto = MessageCrypto(WW_TOKEN, WW_AES_KEY, WW_CORP_ID)
    assert crypto.verify_url(*WW_URL).isdigit()  # the sample prints no expected echo plaintext
    plain = crypto.decrypt_message(WW_MSG_SIG, WW_MSG_TIMESTAMP, WW_MSG_NONCE, WW_MSG_BODY.encode())
    assert plain == WW_MSG_PLAIN
    assert parse_message(plain)["Content"] == "你好"


def test_official_account_vector_decrypts_to_its_clear_copy():
    crypto = MessageCrypto(OA_TOKEN, OA_AES_KEY, OA_APPID)
    plain = crypto.decrypt_message(OA_SIG, OA_TIMESTAMP, OA_NONCE, OA_BODY)
    assert parse_message(plain) == OA_CLEAR


def test_official_account_plain_url_check_returns_echostr_as_sent():
    crypto = MessageCrypto(DOC_TOKEN, DOC_AES_KEY, DOC_APPID)
    echostr = "4375120948345356249"
    assert crypto.verify_plain_url("f464b24fc39322e44b38aa78f5edd27bd1441696", "1714036504", "1514711492",
                                   echostr) == echostr
    with pytest.raises(WeComCryptoError, match="signature"):
        crypto.verify_plain_url("899cf89e464efb63f54ddac96b0a0a235f53aa78", "1714036504", "1514711492", echostr)


def test_docs_safe_mode_vector_decrypts():
    assert MessageCrypto(DOC_TOKEN, DOC_AES_KEY, DOC_APPID).decrypt(DOC_ENCRYPT) == DOC_PLAIN


def test_docs_reply_vector_encrypts_byte_for_byte():
    # The docs publish the reply's random prefix, so encryption has one right answer.
    crypto = MessageCrypto(DOC_TOKEN, DOC_AES_KEY, DOC_APPID, entropy=lambda n: b"707722b803182950")
    sealed = crypto.encrypt('{"demo_resp":"good luck"}', nonce="415670741", timestamp=1713424427)
    assert sealed.encrypted == ("ELGduP2YcVatjqIS+eZbp80MNLoAUWvzzyJxgGzxZO/5sAvd070Bs6qrLARC9nVHm48Y4hyRbtzve1L32tm"
                                "xSQ==")
    assert sealed.signature == "1b9339964ed2e271e7c7b6ff2b0ef902fc94dea1"
    assert (sealed.timestamp, sealed.nonce) == ("1713424427", "415670741")


# --- round trips ---

@settings(max_examples=150, deadline=None)
@given(st.text(max_size=300))
def test_encrypt_then_decrypt_gives_the_message_back(message):
    crypto = wecom()
    sealed = crypto.encrypt(message, nonce="n", timestamp="1")
    assert len(base64.b64decode(sealed.encrypted)) % 32 == 0
    assert crypto.verify_url(sealed.signature, sealed.timestamp, sealed.nonce, sealed.encrypted) == message


def test_an_aligned_plaintext_gets_a_whole_block_of_padding():
    # 16 random + 4 length + 26 + 18 (corp id) = 64: PKCS#7 adds 32 bytes of 32, not nothing.
    sealed = wecom().encrypt("x" * 26, nonce="n", timestamp="1")
    assert len(base64.b64decode(sealed.encrypted)) == 96
    assert wecom().decrypt(sealed.encrypted) == "x" * 26


def test_encrypt_reply_is_an_envelope_the_receiver_can_open():
    crypto = wecom()
    reply = text_reply("mycreate", CORP_ID, "你好 <b>&</b>", create_time=1348831860)
    envelope = crypto.encrypt_reply(reply, MSG_NONCE, MSG_TIMESTAMP)
    fields = parse_message(envelope)
    assert set(fields) == {"Encrypt", "MsgSignature", "TimeStamp", "Nonce"}
    assert (fields["TimeStamp"], fields["Nonce"]) == (MSG_TIMESTAMP, MSG_NONCE)
    assert fields["MsgSignature"] == signature(TOKEN, MSG_TIMESTAMP, MSG_NONCE, fields["Encrypt"])
    opened = crypto.decrypt_message(fields["MsgSignature"], MSG_TIMESTAMP, MSG_NONCE, envelope)
    assert parse_message(opened) == {"ToUserName": "mycreate", "FromUserName": CORP_ID, "CreateTime": "1348831860",
                                     "MsgType": "text", "Content": "你好 <b>&</b>"}


def test_the_random_prefix_differs_between_encryptions():
    first, second = (wecom().encrypt("same", nonce="n", timestamp="1").encrypted for _ in range(2))
    assert first != second


# --- refusals ---

def test_a_tampered_signature_is_refused():
    forged = ("0" if URL_SIG[0] != "0" else "1") + URL_SIG[1:]
    with pytest.raises(WeComCryptoError, match="msg_signature"):
        wecom().verify_url(forged, URL_TIMESTAMP, URL_NONCE, ECHOSTR)
    with pytest.raises(WeComCryptoError, match="msg_signature"):
        wecom().decrypt_message(MSG_SIG, MSG_TIMESTAMP, "1372623150", MSG_BODY)  # another nonce
    with pytest.raises(WeComCryptoError, match="msg_signature"):
        wecom().decrypt_message("Ω" * 40, MSG_TIMESTAMP, MSG_NONCE, MSG_BODY)  # non-ASCII: no TypeError


def test_a_tampered_ciphertext_is_refused_by_its_signature():
    tampered = MSG_BODY.replace("RypEvHKD8QQ", "RypEvHKD8QR")
    with pytest.raises(WeComCryptoError, match="msg_signature"):
        wecom().decrypt_message(MSG_SIG, MSG_TIMESTAMP, MSG_NONCE, tampered)


def test_a_wrong_receive_id_is_refused():
    with pytest.raises(WeComCryptoError, match="wx5823bf96d3bd56c7"):
        MessageCrypto(TOKEN, AES_KEY, "ww0000000000000000").verify_url(URL_SIG, URL_TIMESTAMP, URL_NONCE, ECHOSTR)
    with pytest.raises(WeComCryptoError, match="receive id"):
        MessageCrypto(TOKEN, AES_KEY, CORP_ID + "x").decrypt_message(MSG_SIG, MSG_TIMESTAMP, MSG_NONCE, MSG_BODY)


def test_a_truncated_ciphertext_is_refused():
    raw = base64.b64decode(MSG_ENCRYPT)
    for cut in (raw[:-32], raw[:-16], raw[:32], raw[:5], b""):
        with pytest.raises(WeComCryptoError):
            wecom().decrypt(base64.b64encode(cut).decode())
    with pytest.raises(WeComCryptoError, match="base64"):
        wecom().decrypt(MSG_ENCRYPT[:-3])  # cut inside the base64 itself


def test_bad_base64_is_refused():
    for text in ("not base64!", "QUJD\n", "QUJD"[:-1]):
        with pytest.raises(WeComCryptoError, match="base64"):
            wecom().decrypt(text)


@pytest.mark.parametrize("tail", [b"\x00" * 32, b"\x21" * 32, b"\x05" * 28 + b"\x04\x04\x04\x03"])
def test_bad_padding_is_refused(tail):
    plain = b"r" * 16 + (2).to_bytes(4, "big") + b"hi" + CORP_ID.encode() + b"z" * 24 + tail  # 96 bytes
    with pytest.raises(WeComCryptoError, match="padding"):
        wecom().decrypt(raw_ciphertext(AES_KEY, plain))


def test_a_length_field_past_the_plaintext_is_refused():
    plain = b"r" * 16 + (500).to_bytes(4, "big") + b"hi" + CORP_ID.encode() + b"\x18" * 24  # 64 bytes
    with pytest.raises(WeComCryptoError, match="length field"):
        wecom().decrypt(raw_ciphertext(AES_KEY, plain))


def test_a_ciphertext_under_another_key_is_refused():
    sealed = MessageCrypto(TOKEN, OA_AES_KEY, CORP_ID).encrypt("hello", nonce="n", timestamp="1")
    with pytest.raises(WeComCryptoError):
        wecom().verify_url(sealed.signature, "1", "n", sealed.encrypted)


@pytest.mark.parametrize("body", [
    '<!DOCTYPE xml [<!ENTITY e SYSTEM "file:///etc/passwd">]><xml><Encrypt>&e;</Encrypt></xml>',
    '<!DOCTYPE xml [<!ENTITY a "aaaa"><!ENTITY b "&a;&a;&a;&a;">]><xml><Encrypt>&b;</Encrypt></xml>',
    "<?xml version='1.0'?>\n<!doctype xml><xml><Encrypt>x</Encrypt></xml>",
])
def test_a_doctype_or_entity_is_refused(body):
    with pytest.raises(WeComCryptoError, match="DOCTYPE"):
        wecom().decrypt_message(MSG_SIG, MSG_TIMESTAMP, MSG_NONCE, body)
    with pytest.raises(WeComCryptoError, match="DOCTYPE"):
        parse_message(body.encode())


def test_a_doctype_hidden_in_utf16_is_refused():
    body = '<?xml version="1.0" encoding="UTF-16"?><!DOCTYPE x [<!ENTITY e "e">]><xml><Encrypt>&e;</Encrypt></xml>'
    with pytest.raises(WeComCryptoError, match="UTF-8"):
        parse_message(body.encode("utf-16"))


@pytest.mark.parametrize(("body", "match"), [
    ("<xml><Encrypt>abc</Encrypt>", "malformed"),
    ("<xml><Encrypt>&nbsp;</Encrypt></xml>", "malformed"),  # an undeclared entity
    (f"<xml><Encrypt>{'A' * MAX_XML_CHARS}</Encrypt></xml>", "longer than"),
    ("<root><Encrypt>abc</Encrypt></root>", "root element"),
    ("<xml><ToUserName>x</ToUserName></xml>", "Encrypt"),
    ("<xml><Encrypt></Encrypt></xml>", "Encrypt"),
    (f"<xml><Encrypt>{MSG_ENCRYPT}</Encrypt><Encrypt>{MSG_ENCRYPT}</Encrypt></xml>", "Encrypt"),
])
def test_a_malformed_or_oversize_body_is_refused(body, match):
    with pytest.raises(WeComCryptoError, match=match):
        wecom().decrypt_message(MSG_SIG, MSG_TIMESTAMP, MSG_NONCE, body)


def test_an_oversize_ciphertext_is_refused_before_decoding():
    with pytest.raises(WeComCryptoError, match="longer than"):
        wecom().decrypt("A" * (MAX_XML_CHARS + 4))


def test_a_repeated_field_is_refused():
    with pytest.raises(WeComCryptoError, match="twice"):
        parse_message("<xml><Content>a</Content><Content>b</Content></xml>")


@pytest.mark.parametrize("key", ["A" * 42, "A" * 44, "!" * 43, "é" * 43])
def test_a_bad_encoding_aes_key_is_a_config_error(key):
    with pytest.raises(ConfigError, match="EncodingAESKey"):
        MessageCrypto(TOKEN, key, CORP_ID)


def test_an_empty_token_is_a_config_error():
    with pytest.raises(ConfigError, match="token"):
        MessageCrypto("", AES_KEY, CORP_ID)


def test_a_timestamp_that_is_not_whole_seconds_is_refused():
    with pytest.raises(WeComCryptoError, match="timestamp"):
        wecom().encrypt_reply("<xml/>", "n", "1409659813</TimeStamp><x>")


# --- CDATA ---

def test_cdata_cannot_be_closed_from_inside():
    content = "before ]]></Content><MsgType>news</MsgType><Content><![CDATA[ after ]]]]>>"
    reply = text_reply("user", "app", content, create_time=1)
    assert parse_message(reply) == {"ToUserName": "user", "FromUserName": "app", "CreateTime": "1",
                                    "MsgType": "text", "Content": content}


def test_a_hostile_nonce_stays_inside_its_cdata():
    nonce = "1]]></Nonce><Encrypt>forged</Encrypt><Nonce><![CDATA[2"
    fields = parse_message(wecom().encrypt_reply("<xml/>", nonce, 1))
    assert fields["Nonce"] == nonce
    assert fields["MsgSignature"] == signature(TOKEN, "1", nonce, fields["Encrypt"])


def test_text_reply_drops_what_xml_cannot_carry():
    reply = text_reply("user", "app", "red \x1b[31mtext\x00 ok\n", create_time=1)
    assert parse_message(reply)["Content"] == "red [31mtext ok\n"
    with pytest.raises(WeComCryptoError, match="cannot carry"):
        cdata("\x00")
