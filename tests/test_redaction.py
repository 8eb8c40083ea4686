"""The one redaction pass (core/redact.py): what it recognises, what prose it keeps, and that
it is idempotent; its log filter on every handler Ember configures. What it guards through
whole turns, on SQLite and PostgreSQL: memory rows, traces, spans, log lines."""

from __future__ import annotations

import logging
import string
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.cli_common import setup_logging
from ember.config import Settings
from ember.core.redact import REDACTED, RedactingFilter, redact, redact_text
from ember.runtime.titles import clean_title

KEYS = [
    "sk-proj-Zq8RtY3vLmN0pKs7WxB2cD4eF6gHiJ",
    "sk-ant-api03-Zq8RtY3vLmN0pKs7WxB2cD4eF6gH-AbCd",
    "sk-Zq8RtY3vLmN0pKs7WxB2",
    "ghp_Zq8RtY3vLmN0pKs7WxB2cD4eF6gHiJkLmN",
    "github_pat_11ABCDEFG0Zq8RtY3vLmN0_pKs7WxB2cD4eF6gHiJkLmN",
    "xoxb-1234567890-Zq8RtY3vLmN0",
    "AKIAIOSFODNN7EXAMPLE",
    "AIzaSyZq8RtY3vLmN0pKs7WxB2cD4eF6gHiJkLm",
    "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    "-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEAZq8RtY3vLmN0\npKs7WxB2cD4eF6gH==\n-----END RSA PRIVATE KEY-----",
]


@pytest.mark.parametrize("key", KEYS)
def test_every_key_format_is_redacted_in_a_sentence(key: str) -> None:
    redacted = redact_text(f"Here it is: {key}, keep it safe.")
    assert key not in redacted and redacted == f"Here it is: {REDACTED}, keep it safe."


@pytest.mark.parametrize(("said", "kept"), [
    ("my password is hunter2-xyz", "my password is [redacted]"),
    ("My password is hunter2.", "My password is [redacted]."),
    ("api key: abc123def456", "api key: [redacted]"),
    ("the token = 9f8e7d6c5b4a", "the token = [redacted]"),
    ("API_KEY=abc123def456 ember serve", "API_KEY=[redacted] ember serve"),
    ('{"api_key": "abc123def456"}', '{"api_key": "[redacted]"}'),
    ("the wifi password for the office is Tr0ub4dor&3!", "the wifi password for the office is [redacted]!"),
    ("secret: CorrectHorse-Battery", "secret: [redacted]"),
    ("curl -H 'Authorization: Bearer abcdefghijklmnop123'", "curl -H 'Authorization: Bearer [redacted]'"),
])
def test_a_secret_said_in_words_loses_its_value_and_keeps_the_sentence(said: str, kept: str) -> None:
    assert redact_text(said) == kept


@pytest.mark.parametrize("prose", [
    "the key is to stay calm",
    "The secret is patience, and the password is on the sticky note.",
    "password: ********",
    "the token is valid for an hour",
    "the key to success is 3x effort",
    "session key: http:alice:chat-1",
    "a task-scheduler-for-everyone-here runs it",
    "input_tokens: 12345678 and output tokens: 20",
    "my pin is 1234",
    "The keyboard is 60% and the monkey is named Bob.",
    "Use a token: the one you got from the settings page.",
])
def test_prose_about_keys_and_passwords_is_kept(prose: str) -> None:
    assert redact_text(prose) == prose


def test_trace_records_are_redacted_by_look_and_keep_their_counts() -> None:
    detail = {"model_calls": [{"input_tokens": 12, "passed_over": ["refused sk-proj-Zq8RtY3vLmN0pKs7WxB2"]}]}
    assert redact(detail, by_name=False) == {"model_calls": [{"input_tokens": 12, "passed_over": [
        f"refused {REDACTED}"]}]}
    assert redact({"api_key": "abc", "n": 1}) == {"api_key": REDACTED, "n": 1}


def test_a_title_the_model_writes_never_repeats_a_key() -> None:
    assert clean_title("Title: Storing sk-proj-Zq8RtY3vLmN0pKs7WxB2") == f"Storing {REDACTED}"


# -- properties ---------------------------------------------------------------------------

_B64URL = string.ascii_letters + string.digits + "_-"
_ALNUM = string.ascii_letters + string.digits


def _chars(alphabet: str, low: int, high: int) -> st.SearchStrategy[str]:
    return st.text(st.sampled_from(alphabet), min_size=low, max_size=high)


_PROVIDER_KEYS = st.one_of(
    st.tuples(st.sampled_from(["sk-", "sk-proj-", "sk-ant-api03-", "sk-svcacct-"]), _chars(_B64URL, 16, 60)),
    st.tuples(st.sampled_from(["ghp_", "gho_", "ghu_", "ghs_", "ghr_"]), _chars(_ALNUM, 20, 40)),
    st.tuples(st.just("github_pat_"), _chars(_ALNUM + "_", 22, 82)),
    st.tuples(st.sampled_from(["xoxb-", "xoxp-", "xoxa-", "xoxe-"]), _chars(_ALNUM + "-", 10, 40)),
    st.tuples(st.sampled_from(["AKIA", "ASIA"]), _chars(string.ascii_uppercase + string.digits, 16, 16)),
    st.tuples(st.just("AIza"), _chars(_B64URL, 35, 35)),
).map("".join)
_JWTS = st.tuples(_chars(_B64URL, 8, 40), _chars(_B64URL, 8, 80), _chars(_B64URL, 8, 60)).map(
    lambda parts: f"eyJ{parts[0]}.{parts[1]}.{parts[2]}")
_PRIVATE_KEYS = st.tuples(st.sampled_from(["", "RSA ", "EC ", "OPENSSH "]),
                          st.lists(_chars(string.ascii_letters + string.digits + "+/", 8, 64), min_size=1,
                                   max_size=5)).map(
    lambda parts: f"-----BEGIN {parts[0]}PRIVATE KEY-----\n" + "\n".join(parts[1])
    + f"\n-----END {parts[0]}PRIVATE KEY-----")
_BEARERS = _chars(_ALNUM + "._~+/-", 12, 60).map(lambda token: f"Bearer {token}")
# A credential as people type one: letters and digits, maybe a symbol, 8 or more characters.
_SAID_VALUES = st.tuples(_chars(string.ascii_letters, 3, 12), _chars(string.digits, 1, 6),
                         _chars(_ALNUM + "-_!@#$%&*", 0, 12)).map("".join).filter(lambda v: len(v) >= 8)
_PHRASES = st.sampled_from(["my password is ", "password: ", "the api key is ", "token = ", "secret: ",
                            "my OpenAI key is ", "passwd=", "The Password Is "])
_SECRETS = st.one_of(_PROVIDER_KEYS, _JWTS, _PRIVATE_KEYS, _BEARERS,
                     st.tuples(_PHRASES, _SAID_VALUES).map(lambda p: ("".join(p), p[1])))
_PROSE = st.text(st.sampled_from(string.ascii_letters + string.digits + " .,!?'\n"), max_size=80)


@settings(max_examples=400, deadline=None)
@given(before=_PROSE, secret=_SECRETS, after=_PROSE)
def test_every_generated_secret_in_prose_is_removed(before: str, secret: str | tuple[str, str],
                                                    after: str) -> None:
    text, value = secret if isinstance(secret, tuple) else (secret, secret)
    redacted = redact_text(f"{before} {text} {after}")
    assert value not in redacted and REDACTED in redacted
    assert redact_text(redacted) == redacted


@settings(max_examples=600, deadline=None)
@given(st.text(max_size=200) | st.lists(st.one_of(_PROSE, _SECRETS.map(str), st.sampled_from(
    ["password is ", "key: ", REDACTED, "Bearer ", "sk-", "=", "\"", "API_KEY="])), max_size=8).map("".join))
def test_redaction_is_idempotent(text: str) -> None:
    once = redact_text(text)
    assert redact_text(once) == once


# -- log lines ----------------------------------------------------------------------------

KEY = KEYS[0]


def test_the_filter_renders_then_redacts_a_record_and_its_traceback() -> None:
    try:
        raise RuntimeError(f"refused {KEY}")
    except RuntimeError:
        record = logging.LogRecord("ember.x", logging.ERROR, __file__, 1, "calling with %s and %r", (KEY, {"k": KEY}),
                                   exc_info=__import__("sys").exc_info())
    assert RedactingFilter().filter(record)
    line = logging.Formatter().format(record)
    assert KEY not in line and "calling with [redacted]" in line and "RuntimeError: refused [redacted]" in line


def test_arguments_that_do_not_fit_the_format_are_kept_redacted_not_raised() -> None:
    record = logging.LogRecord("ember.x", logging.INFO, __file__, 1, "%d keys", (KEY,), None)
    assert RedactingFilter().filter(record) and KEY not in record.getMessage()


@pytest.fixture
def root_logging() -> Iterator[logging.Logger]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield root
    for handler in root.handlers:
        if handler not in handlers:
            handler.close()
    root.handlers[:], root.level = handlers, level


def test_every_handler_ember_configures_redacts_the_lines_of_every_logger(
        root_logging: logging.Logger, settings: Settings, capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(settings, verbose=True)
    assert root_logging.handlers and all(
        any(isinstance(f, RedactingFilter) for f in handler.filters) for handler in root_logging.handlers)
    for name in ("ember.runtime.loop", "uvicorn.error", "httpx", "a.library"):
        logging.getLogger(name).warning("a request with %s failed", f"Authorization: Bearer {KEY[3:]}")
    for handler in root_logging.handlers:
        handler.flush()
    written = (settings.home_dir / "ember.log").read_text()
    assert written.count("Bearer [redacted] failed") == 4 and KEY[3:] not in written
    assert KEY[3:] not in capsys.readouterr().err
