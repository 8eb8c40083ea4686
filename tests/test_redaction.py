"""The one redaction pass (core/redact.py): what it recognises, what prose it keeps, and that
it is idempotent; its log filter on every handler Ember configures. What it guards through
whole turns, on SQLite and PostgreSQL: memory rows, traces, spans, log lines."""

from __future__ import annotations

import json
import logging
import string
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import select, text

from ember.cli.common import setup_logging
from ember.config.settings import Settings
from ember.core.errors import ModelError
from ember.core.events import OutboundKind
from ember.core.memory import MemoryKind
from ember.core.messages import Message, Role, ToolCall
from ember.core.redact import REDACTED, RedactingFilter, redact, redact_handlers, redact_text
from ember.memory.consolidation import SUMMARY_INSTRUCTION
from ember.memory.review import REVIEW_INSTRUCTION as MEMORY_REVIEW
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from ember.runtime.titles import clean_title
from ember.skills.review import REVIEW_INSTRUCTION as SKILL_REVIEW
from ember.store import schema
from ember.store.engine import Database
from tests.conftest import CHANNEL, SENDER, session_key
from tests.otelcollector import collecting
from tests.pgserver import ENGINES, engine_settings

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


# -- through whole turns ------------------------------------------------------------------

CHAT_KEY = "sk-proj-Qw3rTy7uIoP0aSdF9gHjK2lZxC5vBnM"
TOOL_KEY = "ghp_Mn8bV4cX2zL6kJ0hG9fD3sA7pO1iU5yTrE"
# The part of each key no redaction leaves and no tokenizer splits (the text index keeps words).
TAILS = ("Qw3rTy7uIoP0aSdF9gHjK2lZxC5vBnM", "Mn8bV4cX2zL6kJ0hG9fD3sA7pO1iU5yTrE")
# The session's own record of what was said: it keeps it as said.
HISTORY_TABLES = {"messages"}  # what the web page's history shows


def secret_model(messages: list[Message], tools: object) -> ModelReply:
    """Says every key back wherever a model's words become something kept: a remember call, the
    memory review's facts, the consolidation's summary and facts, a proposed skill, an error."""
    system = messages[0].content if messages[0].role is Role.SYSTEM else ""
    if SUMMARY_INSTRUCTION in system:
        return ModelReply(text=json.dumps({"summary": f"They shared their key {CHAT_KEY}.", "facts": [
            {"subject": "user", "key": "openai_key", "content": f"The user's OpenAI key is {CHAT_KEY}."}]}))
    if MEMORY_REVIEW in system:
        return ModelReply(text=f"- The user's GitHub token is {TOOL_KEY}")
    if SKILL_REVIEW in system:
        return ModelReply(text=json.dumps({
            "action": "create", "name": "use-the-key", "description": f"Call the API with {CHAT_KEY}",
            "body": f"Send `Authorization: Bearer {CHAT_KEY}`.", "reason": f"they gave {TOOL_KEY}"}))
    last = messages[-1]
    if last.role is Role.USER and "again" in last.content:
        raise ModelError(f"the provider refused the key {CHAT_KEY}")
    if last.role is Role.USER and "key is" in last.content:
        call = ToolCall(id="call-1", name="remember", arguments=json.dumps({
            "content": f"The user's GitHub token is {TOOL_KEY}", "subject": "user", "key": "github_token"}))
        return ModelReply(tool_calls=(call,))
    if last.role is Role.USER:
        return ModelReply(text="You are welcome.")
    return ModelReply(text="Noted, though I will not keep the key itself.")


@pytest.fixture(params=ENGINES)
def config(settings: Settings, request: pytest.FixtureRequest) -> Settings:
    return engine_settings(settings, request.param, request).model_copy(update={
        "review_tool_call_threshold": 1, "consolidation_threshold": 6, "consolidation_keep_recent": 0})


async def stored_rows(db: Database) -> dict[str, str]:
    """Every table but the session's own history, and the full-text index, each as one text."""
    async with db.read() as conn:
        found = {table.name: repr((await conn.execute(select(table))).all())
                 for table in schema.metadata.sorted_tables if table.name not in HISTORY_TABLES}
        found["memory_fts"] = repr((await conn.execute(text(
            "SELECT owner, body, before, after, far FROM memory_fts"))).all())
    return found


async def test_a_key_said_in_chat_and_one_passed_to_remember_stay_in_the_history_only(
        start, config: Settings, root_logging: logging.Logger) -> None:  # type: ignore[no-untyped-def]
    setup_logging(config, verbose=False)
    root_logging.setLevel(logging.DEBUG)
    lines: list[str] = []
    capture = logging.Handler(logging.DEBUG)
    capture.emit = lambda record: lines.append(logging.Formatter().format(record))  # type: ignore[method-assign]
    redact_handlers([capture])  # as every handler Ember configures (checked above)
    root_logging.addHandler(capture)
    with collecting() as collector:
        async with start(FunctionModel(secret_model, name="secretive"),
                         config=config.model_copy(update={"otel_endpoint": collector.endpoint})) as h:
            answer = await h.turn(f"my OpenAI key is {CHAT_KEY}, and the key is to stay calm")
            await h.runtime.runner.wait_idle()  # the reviews, before the consolidation the next turn queues
            await h.turn("thanks")
            await h.runtime.runner.wait_idle()
            failed = await h.turn("try again")
            await h.runtime.runner.wait_idle()
            rows = await stored_rows(h.runtime.db)
            history = await h.runtime.sessions.history(session_key())
            memories = await h.runtime.memory.store.list(f"{CHANNEL}:{SENDER}", include_inactive=True)
            traces = await h.runtime.traces.for_session(session_key())
    root_logging.removeHandler(capture)
    for handler in root_logging.handlers:
        handler.flush()

    assert answer.text.startswith("Noted") and failed.kind is OutboundKind.ERROR
    assert failed.text == f"Sorry, I could not answer: the provider refused the key {REDACTED}"
    said = [m.content for m in history if m.role is Role.USER]
    assert said[0] == f"my OpenAI key is {CHAT_KEY}, and the key is to stay calm"
    assert any(TOOL_KEY in call.arguments for m in history for call in m.tool_calls)
    # Every path wrote what it derived, redacted: the archived message, remember, the review, the episode.
    contents = [record.content for record in memories]
    assert f"my OpenAI key is {REDACTED}, and the key is to stay calm" in contents
    assert f"The user's GitHub token is {REDACTED}" in contents
    assert {MemoryKind.ARCHIVAL, MemoryKind.FACT, MemoryKind.EPISODIC} <= {record.kind for record in memories}
    assert [t.status for t in traces] == ["ok", "ok", "failed"] and REDACTED in (traces[-1].error or "")
    assert rows["skill_proposals"].count("refused") and "memory_fts" in rows
    for tail in TAILS:
        for table, dump in rows.items():
            assert tail.lower() not in dump.lower(), table
        assert not [line for line in lines if tail in line]
        assert tail not in (config.home_dir / "ember.log").read_text()
        for span in collector.spans:
            assert tail not in json.dumps([span.name, span.attributes, span.events], default=str), span.name
    assert any("turn" in line and "failed" in line for line in lines)
    assert any(event[0] == "exception" for span in collector.spans for event in span.events)
