"""Stateless OpenAI clients (Open WebUI, LibreChat, `llm`, ...) keep their conversation: the
official `openai` SDK sends the whole history each time and names no session, against a running
`ember serve` with the tests' own model server behind it, on each runtime: SQLite, PostgreSQL,
and PostgreSQL with the Redis bus (the conversation a client brings crosses it)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.gatewayproc import GatewayProcess, LaunchGateway
from tests.modelserver import ModelServer, Reply, serving
from tests.pgserver import RUNTIMES

ALICE = "alice-secret-0123456789"
BOB = "bob-secret-0123456789ab"
AGENT = "ember"
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}  # a front-end's own; Ember has its own


@pytest.fixture(scope="module")
def model() -> Iterator[ModelServer]:
    with serving() as server:
        yield server


@pytest.fixture(scope="module", params=RUNTIMES)
def gateway(request: pytest.FixtureRequest, model: ModelServer, launch_module_gateway: LaunchGateway) -> GatewayProcess:
    # Caps below the defaults, to see that the settings set them.
    env = {"EMBER_GATEWAY_MAX_TOKENS": "1000", "EMBER_GATEWAY_MAX_TEMPERATURE": "1.2"}
    if request.param.startswith("postgresql"):
        env["EMBER_DATABASE_URL"] = request.getfixturevalue("pg_server").fresh_database()
    if request.param == "postgresql+redis":
        env |= {"EMBER_REDIS_URL": request.getfixturevalue("redis_server").url,
                "EMBER_REDIS_NAMESPACE": f"stateless-{uuid.uuid4().hex[:8]}"}
    gateway = launch_module_gateway(model, keys={"alice": ALICE, "bob": BOB}, **env)
    assert (gateway.home / "ember.db").exists() == (request.param == "sqlite")
    return gateway


@pytest.fixture
def alice(gateway: GatewayProcess, model: ModelServer) -> Iterator[openai.OpenAI]:
    model.responder = None
    with openai.OpenAI(base_url=gateway.url("/v1"), api_key=ALICE, max_retries=0, timeout=30) as sdk:
        yield sdk
    assert not model._script, "a test left scripted replies unused"


@pytest.fixture
def bob(gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.url("/v1"), api_key=BOB, max_retries=0, timeout=30) as sdk:
        yield sdk


def ask(client: openai.OpenAI, model: ModelServer, messages: list[dict[str, str]], answer: str, *,
        stream: bool = False) -> str:
    """Send the whole conversation, as a stateless client does, the model answering `answer`; the
    session Ember put it in. The answer comes back whole, streamed or not."""
    model.push(Reply(text=answer))
    raw = client.chat.completions.with_raw_response.create(model=AGENT, messages=messages, stream=stream)
    if stream:
        said = "".join(chunk.choices[0].delta.content or "" for chunk in raw.parse() if chunk.choices)
    else:
        said = raw.parse().choices[0].message.content or ""
    assert said == answer
    return raw.headers["X-Ember-Session"]


def seen(model: ModelServer) -> list[tuple[str, str]]:
    """The conversation the model was last shown: its user and assistant messages."""
    return [(m["role"], m["content"]) for m in model.requests[-1]["messages"] if m["role"] in ("user", "assistant")]


def stored(gateway: GatewayProcess, session: str, key: str = ALICE) -> list[dict[str, Any]]:
    response = httpx.get(gateway.url(f"/api/sessions/{session}/messages"), headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response.json()["messages"]


def said(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in messages]


def words() -> str:
    """Text no other test's conversation has."""
    return uuid.uuid4().hex[:8]


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_follow_up_continues_the_session_with_each_earlier_turn_once(
        alice: openai.OpenAI, model: ModelServer, gateway: GatewayProcess, stream: bool) -> None:
    tag = words()
    q1, a1 = f"My favourite colour is teal ({tag}).", "Teal is a fine colour."
    first = ask(alice, model, [SYSTEM, user(q1)], a1, stream=stream)
    q2, a2 = "What is my favourite colour?", f"Your favourite colour is teal ({tag})."
    second = ask(alice, model, [SYSTEM, user(q1), assistant(a1), user(q2)], a2, stream=stream)
    assert second == first
    assert seen(model) == [("user", q1), ("assistant", a1), ("user", q2)]
    q3, a3 = "And what did I just ask?", "You asked for your favourite colour."
    third = ask(alice, model, [SYSTEM, user(q1), assistant(a1), user(q2), assistant(a2), user(q3)], a3, stream=stream)
    assert third == first
    assert seen(model) == [("user", q1), ("assistant", a1), ("user", q2), ("assistant", a2), ("user", q3)]
    assert said(stored(gateway, first)) == [("user", q1), ("assistant", a1), ("user", q2), ("assistant", a2),
                                            ("user", q3), ("assistant", a3)]


def test_a_conversation_begun_elsewhere_is_seeded_once_as_the_client_supplied_it(
        alice: openai.OpenAI, model: ModelServer, gateway: GatewayProcess) -> None:
    tag = words()
    # A front-end that talked to another model first, then switched to Ember.
    earlier = [SYSTEM, user(f"Plan a trip to Porto ({tag})."), assistant("Day one: the Ribeira."),
               user("Shorter, please."), assistant("Ribeira, then port wine.")]
    session = ask(alice, model, [*earlier, user("And day two?")], "Day two: Foz do Douro.", stream=True)
    history = [(m["role"], m["content"]) for m in earlier[1:]]
    assert seen(model) == [*history, ("user", "And day two?")]
    kept = stored(gateway, session)
    assert said(kept) == [*history, ("user", "And day two?"), ("assistant", "Day two: Foz do Douro.")]
    # Recorded as supplied: no turn of Ember's wrote the seeded messages; the new question is the turn's.
    assert [m["turn_id"] for m in kept[:4]] == [None] * 4 and kept[4]["turn_id"] and kept[5]["turn_id"]
    again = ask(alice, model, [*earlier, user("And day two?"), assistant("Day two: Foz do Douro."),
                               user("Thanks!")], "Enjoy Porto.")
    assert again == session
    assert seen(model) == [*history, ("user", "And day two?"), ("assistant", "Day two: Foz do Douro."),
                           ("user", "Thanks!")]
    assert len(stored(gateway, session)) == 8  # nothing seeded twice


def test_an_edited_or_regenerated_history_branches_and_leaves_the_old_session_whole(
        alice: openai.OpenAI, model: ModelServer, gateway: GatewayProcess) -> None:
    tag = words()
    q1, a1, q2, a2 = f"I live in Oslo ({tag}).", "Oslo is lovely.", "Where do I live?", "In Oslo."
    session = ask(alice, model, [user(q1)], a1)
    assert ask(alice, model, [user(q1), assistant(a1), user(q2)], a2) == session
    before = said(stored(gateway, session))

    # The person edits their first message: the conversation is another one.
    edited = f"I live in Bergen ({tag})."
    branch = ask(alice, model, [user(edited), assistant(a1), user(q2)], "In Bergen.")
    assert branch != session
    assert seen(model) == [("user", edited), ("assistant", a1), ("user", q2)]
    # The person regenerates the last answer: the same question again, after the same history.
    regenerated = ask(alice, model, [user(q1), assistant(a1), user(q2)], "You live in Oslo.")
    assert regenerated not in (session, branch)
    assert seen(model) == [("user", q1), ("assistant", a1), ("user", q2)]  # not the first answer, nor q2 twice
    assert said(stored(gateway, session)) == before

    # Each branch goes on as its own conversation, and so does the original.
    assert ask(alice, model, [user(q1), assistant(a1), user(q2), assistant("You live in Oslo."), user("Sure?")],
               "Yes.") == regenerated
    assert ask(alice, model, [user(q1), assistant(a1), user(q2), assistant(a2), user("Sure?")], "Quite.") == session
    assert said(stored(gateway, session)) == [*before, ("user", "Sure?"), ("assistant", "Quite.")]


def test_two_identities_with_the_same_history_get_sessions_of_their_own(
        alice: openai.OpenAI, bob: openai.OpenAI, model: ModelServer, gateway: GatewayProcess) -> None:
    tag = words()
    q1, a1 = f"Remember the number {tag}.", "Noted."
    mine = ask(alice, model, [user(q1)], a1)
    assert ask(alice, model, [user(q1), assistant(a1), user("Which number?")], tag) == mine
    # Bob sends Alice's conversation word for word: it continues nothing of hers.
    theirs = ask(bob, model, [user(q1), assistant(a1), user("Which number?")], "I do not know it yet.")
    assert theirs != mine
    assert seen(model) == [("user", q1), ("assistant", a1), ("user", "Which number?")]  # his own copy, seeded
    assert len(stored(gateway, mine)) == 4
    assert httpx.get(gateway.url(f"/api/sessions/{mine}/messages"),
                     headers={"Authorization": f"Bearer {BOB}"}).status_code == 404
    # And Alice's next request, with her answer, still finds hers.
    assert ask(alice, model, [user(q1), assistant(a1), user("Which number?"), assistant(tag), user("Thanks.")],
               "You are welcome.") == mine


def test_answers_trimmed_by_the_client_still_match(alice: openai.OpenAI, model: ModelServer) -> None:
    q1 = f"Write two lines ({words()})."
    session = ask(alice, model, [user(q1)], "Line one.\n\nLine two.\n")
    # Clients trim answers and rewrite line ends; the conversation is the same.
    assert ask(alice, model, [user(q1), assistant("Line one.\r\n\r\nLine two."), user("More?")], "No.") == session


def test_a_named_session_takes_only_the_new_message(alice: openai.OpenAI, model: ModelServer,
                                                   gateway: GatewayProcess) -> None:
    key = f"named-{words()}"
    model.push(Reply(text="Hello."))
    alice.chat.completions.create(model=AGENT, messages=[user("Hi"), assistant("Earlier, elsewhere."), user("Hello?")],
                                  extra_headers={"X-Ember-Session": key})
    assert said(stored(gateway, key)) == [("user", "Hello?"), ("assistant", "Hello.")]


def test_a_failed_turn_sent_again_starts_over_seeded_with_the_conversation(
        alice: openai.OpenAI, model: ModelServer, gateway: GatewayProcess) -> None:
    q1, a1 = f"Count to two ({words()}).", "One, two."
    session = ask(alice, model, [user(q1)], a1)
    model.push(*[Reply(status=500)] * 4)  # every attempt of Ember's model client fails
    with pytest.raises(openai.APIStatusError):
        alice.chat.completions.create(model=AGENT, messages=[user(q1), assistant(a1), user("Now three.")])
    retry = ask(alice, model, [user(q1), assistant(a1), user("Now three.")], "One, two, three.")
    assert retry != session
    assert seen(model) == [("user", q1), ("assistant", a1), ("user", "Now three.")]  # the question once


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_sampling_options_reach_the_model_within_the_settings_caps(
        alice: openai.OpenAI, model: ModelServer, stream: bool) -> None:
    q1 = f"Be brief ({words()})."
    model.push(Reply(text="Yes."))
    done = alice.chat.completions.with_raw_response.create(
        model=AGENT, messages=[user(q1)], stream=stream, max_tokens=1000, temperature=1.2, top_p=0.5)
    list(done.parse()) if stream else done.parse()
    sent = model.requests[-1]
    assert (sent["max_tokens"], sent["temperature"], sent["top_p"]) == (1000, 1.2, 0.5)
    # The follow-up still continues the conversation, and sets options of its own.
    session = done.headers["X-Ember-Session"]
    model.push(Reply(text="Still yes."))
    again = alice.chat.completions.with_raw_response.create(
        model=AGENT, messages=[user(q1), assistant("Yes."), user("Sure?")], stream=stream, max_completion_tokens=7)
    list(again.parse()) if stream else again.parse()
    assert again.headers["X-Ember-Session"] == session
    assert model.requests[-1]["max_tokens"] == 7 and "temperature" not in model.requests[-1]
    for options, param, says in [({"max_tokens": 1001}, "max_tokens", "from 1 to 1000 (gateway_max_tokens caps it)"),
                                 ({"temperature": 1.3}, "temperature",
                                  "from 0 to 1.2 (gateway_max_temperature caps it); it was 1.3")]:
        with pytest.raises(openai.BadRequestError) as caught:
            alice.chat.completions.create(model=AGENT, messages=[user(q1)], stream=stream, **options)
        assert caught.value.body["param"] == param and says in caught.value.message
