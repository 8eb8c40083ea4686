"""Ember scaled out, as real processes: gateways (`ember serve --workers 0`) and workers
(`ember worker`), each in its own home, on one PostgreSQL and one Redis (tests/cluster.py).

Turns sent to any gateway are answered once, a session's turns stay one history whichever
gateway took them, and what a dead or paused process held is taken over: a worker killed
mid-turn (its turn resumed by another), a worker paused past its lease (its late commit
refused by the fence, not even its draft shown, and its message left to the others should
the taker die too), the scheduler's leader killed (another fires the runs, none twice), a
gateway killed mid-stream (the resend, through the other gateway, answered once, its OpenAI
stream adding up to the answer), Redis restarted (the answers whose route it lost found in the
store); an approval asked in a worker is answered on a gateway, a delegated task's too.

The module's tests share one topology (2 gateways, 2 workers; a member a test kills is
restarted after it); the scheduler's test has one of its own (2 workers, no gateway).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import json
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster import (  # noqa: F401 (launch_cluster: a fixture)
    WORKER_TIMEOUT_S,
    Cluster,
    LaunchCluster,
    Member,
    launch_cluster,
    query,
    running_cluster,
)
from tests.gatewayproc import EMBER, free_port
from tests.loopback import wait_until
from tests.modelserver import ModelServer, Reply, serving, tool_call
from tests.pgserver import PgServer
from tests.redisserver import RedisServer
from tests.sse import chunks
from tests.sse import events as sse_events

KEY = "alice-secret-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
IDENTITY = "alice"
TIMEOUT = httpx.Timeout(60.0, connect=5.0)
# Long enough for the takeover of a dead worker's message (its entry idle past the worker
# timeout, its lease expired), short enough to fail fast.
TAKEOVER_S = WORKER_TIMEOUT_S * 6 + 10


# --------------------------------------------------------------------------- the model


@dataclass
class Script:
    """The model's answers, by the message a turn answers: "echo: <text>", unless a test planned
    that message's calls (the n-th call for it -> its Reply). Counts the calls per message."""

    plans: dict[str, Callable[[int], Reply]] = field(default_factory=dict)
    calls: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, body: dict[str, Any]) -> Reply:
        messages = body.get("messages") or []
        last = messages[-1] if messages else {}
        users = [m for m in messages if m.get("role") == "user"]
        text = str(users[-1].get("content") or "") if users else ""
        if last.get("role") == "tool":  # the answer after a tool step
            return Reply(text=f"done: {text}")
        with self.lock:
            self.calls[text] += 1
            number = self.calls[text]
        plan = self.plans.get(text)
        return plan(number) if plan is not None else Reply(text=f"echo: {text}")

    def wait_calls(self, text: str, count: int, timeout_s: float = TAKEOVER_S) -> None:
        wait_until(lambda: self.calls[text] >= count, timeout_s=timeout_s,
                   what=f"model call {count} for {text!r} (calls so far: {self.calls[text]})")


@pytest.fixture(scope="module")
def script() -> Script:
    return Script()


@pytest.fixture(scope="module")
def model(script: Script) -> Iterator[ModelServer]:
    with serving() as server:
        server.responder = script
        yield server


# --------------------------------------------------------------------------- the topology


@pytest.fixture(scope="module")
def database(pg_server: PgServer) -> Iterator[str]:
    url = pg_server.fresh_database()  # empty: the members race to migrate it, one does
    yield url
    pg_server.drop_database(url)


@pytest.fixture(scope="module")
def metrics_ports() -> dict[str, int]:
    """The workers' /metrics ports, by member name."""
    return {"w1": free_port(), "w2": free_port()}


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory, database: str, redis_server: RedisServer,
             model: ModelServer, metrics_ports: dict[str, int]) -> Iterator[Cluster]:
    """2 gateways and 2 workers, shared by the tests of this module that leave it whole."""
    def own(name: str) -> dict[str, str]:
        return {"EMBER_WORKER_METRICS_PORT": str(metrics_ports[name])} if name in metrics_ports else {}

    with running_cluster(tmp_path_factory.mktemp("cluster"), database_url=database, redis_url=redis_server.url,
                         model=model, keys={IDENTITY: KEY}, gateways=2, workers=2, member_env=own,
                         EMBER_TOOL_POLICY__TIMEOUT_S="30") as cluster:
        yield cluster


@pytest.fixture
def cluster(topology: Cluster) -> Iterator[Cluster]:
    """The module's topology, whole before and after the test: a member a test killed is restarted."""
    heal(topology)
    yield topology
    heal(topology)


def heal(cluster: Cluster) -> None:
    dead = [m for m in cluster.members if not m.alive]
    for member in cluster.members:
        member.resume()
    for member in dead:
        member.spawn()
    for member in dead:
        member.wait_ready()


# --------------------------------------------------------------------------- clients


@dataclass
class Event:
    name: str
    data: dict[str, Any]


class Abandoned(Exception):
    """A client gave up on a request that went on past its deadline; what it had received is `events`."""

    def __init__(self, what: str, events: list[Any]) -> None:
        super().__init__(f"{what}: no end within the deadline; received {events}")
        self.events = events


@contextlib.contextmanager
def deadline(response: httpx.Response, seconds: float) -> Iterator[threading.Event]:
    """Close `response` from a timer after `seconds` (a stream of keepalives never times out)."""
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        response.close()

    timer = threading.Timer(seconds, expire)
    timer.start()
    try:
        yield expired
    finally:
        timer.cancel()


def native(gateway: Member, session: str, text: str, message_id: str | None = None,
           on_event: Callable[[Event], None] | None = None, deadline_s: float = TAKEOVER_S) -> list[Event]:
    """One turn on the native API, read to its end; its events. Abandoned past `deadline_s`."""
    body: dict[str, Any] = {"text": text}
    if message_id is not None:
        body["message_id"] = message_id
    events: list[Event] = []
    with httpx.stream("POST", gateway.url(f"/api/sessions/{session}/messages"), json=body, headers=AUTH,
                      timeout=TIMEOUT) as response, deadline(response, deadline_s) as expired:
        assert response.status_code == 200, response.read()
        try:
            for sse in sse_events(response.iter_lines()):
                event = Event(sse.name or "", sse.json())
                events.append(event)
                if on_event is not None:
                    on_event(event)
        except (httpx.HTTPError, httpx.StreamError) as exc:
            if expired.is_set():
                raise Abandoned(f"{text!r} on {gateway.name}", events) from exc
            raise
        if expired.is_set():
            raise Abandoned(f"{text!r} on {gateway.name}", events)
    return events


def outcome(future: concurrent.futures.Future[list[Event]]) -> list[Event] | BaseException:
    """The events a client got, or what it failed with."""
    try:
        return future.result(timeout=TAKEOVER_S + 5)
    except Exception as exc:
        return exc


def finals(events: list[Event]) -> list[dict[str, Any]]:
    return [e.data for e in events if e.name == "final"]


def the_final(events: list[Event]) -> dict[str, Any]:
    found = finals(events)
    assert len(found) == 1, f"expected one final, got {events}"
    assert not [e for e in events if e.name == "error"], events
    return found[0]


def openai(gateway: Member, session: str, text: str, *, stream: bool, idempotency_key: str | None = None,
           deadline_s: float = TAKEOVER_S) -> str:
    """One turn on the OpenAI route; the answer's text (a stream's deltas joined)."""
    headers = {**AUTH, "X-Ember-Session": session}
    if idempotency_key is not None:
        headers["Idempotency-Key"] = idempotency_key
    body = {"model": "ember", "stream": stream, "messages": [{"role": "user", "content": text}]}
    if not stream:
        response = httpx.post(gateway.url("/v1/chat/completions"), json=body, headers=headers,
                              timeout=httpx.Timeout(deadline_s, connect=5.0))
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["message"]["content"])
    content, finished = [], False
    with httpx.stream("POST", gateway.url("/v1/chat/completions"), json=body, headers=headers,
                      timeout=TIMEOUT) as response, deadline(response, deadline_s) as expired:
        assert response.status_code == 200, response.read()
        try:
            for data in chunks(response.iter_lines()):
                assert "error" not in data, data
                for choice in data["choices"]:
                    content.append((choice.get("delta") or {}).get("content") or "")
                    finished = finished or choice.get("finish_reason") == "stop"
        except (httpx.HTTPError, httpx.StreamError) as exc:
            if expired.is_set():
                raise Abandoned(f"{text!r} on {gateway.name}", content) from exc
            raise
    assert finished, f"the stream ended without its finish: {content}"
    return "".join(content)


def history(gateway: Member, session: str) -> list[dict[str, Any]]:
    response = httpx.get(gateway.url(f"/api/sessions/{session}/messages"), headers=AUTH, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return list(response.json()["messages"])


def fresh(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


# --------------------------------------------------------------------------- the store


def full_key(session: str) -> str:
    return f"http:{IDENTITY}:{session}"


def stored(cluster: Cluster, session: str) -> list[dict[str, Any]]:
    return query(cluster.database_url, "SELECT seq, role, content, tool_calls, tool_call_id, turn_id "
                                       "FROM messages WHERE session_key = $1 ORDER BY seq", full_key(session))


def receipts(cluster: Cluster, session: str) -> list[dict[str, Any]]:
    return query(cluster.database_url, "SELECT message_id, turn_id, answered_at FROM inbox WHERE session_key = $1",
                 full_key(session))


def final_records(cluster: Cluster, session: str) -> list[dict[str, Any]]:
    return query(cluster.database_url, "SELECT delivery_id, turn_id, text FROM outbox "
                                       "WHERE session_key = $1 AND kind = 'final' ORDER BY created_at",
                 full_key(session))


def lease_holder(cluster: Cluster, name: str) -> tuple[Member | None, int]:
    rows = query(cluster.database_url, "SELECT holder, token FROM leases WHERE name = $1", name)
    if not rows:
        return None, 0
    return cluster.member_of(rows[0]["holder"]), int(rows[0]["token"])


def assert_whole(cluster: Cluster, session: str, exchanges: list[tuple[str, str]]) -> None:
    """The session's stored history is exactly these (question, answer) pairs in order, each turn
    with one receipt (answered) and one final record equal to its answer."""
    rows = stored(cluster, session)
    assert [(r["role"], r["content"]) for r in rows] == [
        pair for question, answer in exchanges for pair in (("user", question), ("assistant", answer))], rows
    assert [r["seq"] for r in rows] == list(range(rows[0]["seq"], rows[0]["seq"] + len(rows)))
    inbox = receipts(cluster, session)
    assert len(inbox) == len(exchanges) and all(r["answered_at"] is not None for r in inbox), inbox
    records = final_records(cluster, session)
    answers = [r for r in rows if r["role"] == "assistant"]
    assert sorted((r["turn_id"], r["text"]) for r in records) == sorted((a["turn_id"], a["content"])
                                                                        for a in answers), records
    assert {r["delivery_id"] for r in records} == {f"{a['turn_id']}:{a['seq']}" for a in answers}


# --------------------------------------------------------------------------- a. the turns


def test_turns_sent_to_any_gateway_are_answered_once_into_one_history(cluster: Cluster, model: ModelServer) -> None:
    routes = ("native", "openai", "openai-stream")
    jobs = [(gateway, route, fresh(f"a-{gateway.name}-{route}")) for gateway in cluster.gateways for route in routes]

    def conversation(gateway: Member, route: str, session: str) -> list[tuple[str, str]]:
        exchanges = []
        for number in range(3):
            text = f"{session} message {number}"
            if route == "native":
                answer = the_final(native(gateway, session, text, message_id=f"{session}.{number}"))["text"]
            else:
                answer = openai(gateway, session, text, stream=route == "openai-stream",
                                idempotency_key=f"{session}.{number}")
            assert answer == f"echo: {text}"
            exchanges.append((text, answer))
        return exchanges

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        done = {job: pool.submit(conversation, *job) for job in jobs}
        results = {job: future.result(timeout=120) for job, future in done.items()}
    for (gateway, _route, session), exchanges in results.items():
        assert_whole(cluster, session, exchanges)
        # Either gateway reads the same history.
        assert [m["content"] for m in history(gateway, session)] == [t for pair in exchanges for t in pair]

    # One session, its turns through both gateways and every route: one coherent history.
    session = fresh("a-shared")
    g1, g2 = cluster.gateways
    exchanges = []
    for number, (gateway, route) in enumerate([(g1, "native"), (g2, "openai"), (g1, "openai-stream"),
                                               (g2, "native"), (g1, "openai"), (g2, "openai-stream")]):
        text = f"{session} turn {number}"
        if route == "native":
            answer = the_final(native(gateway, session, text))["text"]
        else:
            answer = openai(gateway, session, text, stream=route == "openai-stream")
        exchanges.append((text, answer))
        # Whichever worker ran it, the model saw the whole history so far.
        seen = next(r for r in reversed(model.requests)
                    if r["messages"][-1].get("content") == text)["messages"]
        assert [m["content"] for m in seen if m["role"] in ("user", "assistant")] == \
            [t for pair in exchanges for t in pair][:-1]
    assert_whole(cluster, session, exchanges)
    assert history(g1, session) == history(g2, session)


def samples(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of one metric of the Prometheus text at `url`, by their labels."""
    text = httpx.get(url, headers=AUTH, timeout=10).raise_for_status().text
    return {tuple(sorted(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples if sample.name == name}


def test_the_workers_metrics_count_the_model_calls_that_the_gateways_do_not_see(
        cluster: Cluster, metrics_ports: dict[str, int]) -> None:
    workers = [f"http://127.0.0.1:{port}/metrics" for port in metrics_ports.values()]

    def total(name: str, urls: list[str]) -> float:
        return sum(value for url in urls for value in samples(url, name).values())

    calls, tokens = total("ember_model_calls_total", workers), total("ember_model_tokens_total", workers)
    session = fresh("metrics")
    g1 = cluster.gateways[0]
    for number in range(4):
        assert the_final(native(g1, session, f"{session} {number}"))["text"] == f"echo: {session} {number}"
    assert total("ember_model_calls_total", workers) >= calls + 4  # the turns' calls, and any job's
    assert total("ember_model_tokens_total", workers) > tokens
    # A gateway that runs no turns counts the turns as its clients saw them, and calls no model.
    gateway = g1.url("/metrics")
    assert samples(gateway, "ember_turns_total")[(("api", "native"), ("outcome", "final"))] >= 4
    assert total("ember_model_calls_total", [gateway]) == 0
    # Every process samples its event loop's lag (bench/soak.py reads its p99).
    assert all(total("ember_event_loop_lag_seconds_count", [url]) > 0 for url in [*workers, gateway])


# --------------------------------------------------------------------------- b. a worker killed mid-turn


def test_a_worker_killed_mid_turn_has_its_turn_resumed_by_another(cluster: Cluster, script: Script) -> None:
    session = fresh("b")
    text, mid = f"{session} the killed worker's turn", f"{session}.m1"
    held = threading.Event()
    script.plans[text] = lambda n: Reply(text=f"answer to {session}", hold=held if n == 1 else None)
    g1, g2 = cluster.gateways
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(native, g1, session, text, mid)
            script.wait_calls(text, 1)
            killed, token = lease_holder(cluster, f"session:{full_key(session)}")
            assert killed in cluster.workers, killed
            killed.kill()
            held.set()  # the dead worker's model call answers nobody now
            events = waiting.result(timeout=TAKEOVER_S)
    finally:
        held.set()
    # The client still waiting on its gateway got the one answer, from the other worker.
    final = the_final(events)
    assert final["text"] == f"answer to {session}"
    assert script.calls[text] == 2
    taker, taken_at = lease_holder(cluster, f"session:{full_key(session)}")
    assert taker is not None and taker is not killed and taken_at > token
    # Sent again with the same id through the other gateway: the recorded answer, not a second turn.
    again = the_final(native(g2, session, text, mid))
    assert (again["text"], again["delivery_id"], again["turn_id"]) == (final["text"], final["delivery_id"],
                                                                      final["turn_id"])
    assert script.calls[text] == 2
    assert_whole(cluster, session, [(text, final["text"])])


@pytest.mark.parametrize("sessions, per_session", [(4, 2), (2, 5)], ids=["two-in-flight", "bursts-of-five"])
def test_a_sessions_messages_are_answered_in_order_and_once_though_a_worker_dies(
        cluster: Cluster, script: Script, sessions: int, per_session: int) -> None:
    """Each session's messages sent one after another through either gateway while the first is
    still being answered; a worker holding some of them killed. Each message gets its own answer,
    once, on its own stream, and the history has them in the order sent: a message the survivor
    took before the dead worker's earlier one waits for that one to be taken over and answered."""
    held = threading.Event()
    names = [fresh(f"order{per_session}") for _ in range(sessions)]
    texts = {name: [f"{name} message {i}" for i in range(per_session)] for name in names}
    for name in names:
        first = texts[name][0]
        script.plans[first] = lambda n, first=first: Reply(text=f"echo: {first}", hold=held if n == 1 else None)
    gateways = itertools.cycle(cluster.gateways)
    try:
        with concurrent.futures.ThreadPoolExecutor(sessions * per_session) as pool:
            sent: dict[str, concurrent.futures.Future[list[Event]]] = {}
            for number in range(per_session):  # a burst: every session's next message, 0.15 s apart
                for name in names:
                    text = texts[name][number]
                    sent[text] = pool.submit(native, next(gateways), name, text, f"{name}.{number}")
                time.sleep(0.15)
            for name in names:
                script.wait_calls(texts[name][0], 1)
            killed, _ = lease_holder(cluster, f"session:{full_key(names[0])}")
            assert killed in cluster.workers, killed
            killed.kill()
            held.set()
            results = {text: outcome(future) for text, future in sent.items()}
    finally:
        held.set()
    wrong = {text: result for text, result in results.items()
             if isinstance(result, BaseException) or the_final(result)["text"] != f"echo: {text}"}
    assert not wrong, wrong
    for name in names:
        assert_whole(cluster, name, [(text, f"echo: {text}") for text in texts[name]])


# --------------------------------------------------------------------------- c. fencing


def test_a_worker_paused_past_its_lease_cannot_commit_over_the_one_that_took_over(
        cluster: Cluster, script: Script) -> None:
    session = fresh("c")
    text, mid = f"{session} the paused worker's turn", f"{session}.m1"
    first, second = threading.Event(), threading.Event()
    answers = {1: "the first worker's answer", 2: "the second worker's answer"}
    script.plans[text] = lambda n: Reply(text=answers.get(n, "a third answer"), hold=first if n == 1 else second)
    lease = f"session:{full_key(session)}"
    g1, g2 = cluster.gateways
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(native, g1, session, text, mid)
            script.wait_calls(text, 1)
            paused, token = lease_holder(cluster, lease)
            assert paused in cluster.workers, paused
            paused.pause()
            try:
                # Silent past the worker timeout: another worker takes its message and its session,
                # resumes the turn, and is held in its own model call.
                script.wait_calls(text, 2)
                taker, taken_at = lease_holder(cluster, lease)
                assert taker in cluster.workers and taker is not paused and taken_at > token
            finally:
                paused.resume()
            first.set()  # the paused worker wakes up, gets its answer, and tries to commit it
            wait_until(lambda: "was taken over by another process" in paused.ember_log(), timeout_s=30,
                       what="the fenced worker's log line")
            assert "lost the lease " + lease in paused.ember_log()
            assert answers[1] not in [r["content"] for r in stored(cluster, session)]  # refused: nothing kept
            second.set()
            events = waiting.result(timeout=TAKEOVER_S)
    finally:
        first.set()
        second.set()
    final = the_final(events)
    assert final["text"] == answers[2]
    # Not even a draft of the refused answer reached the client.
    assert "first" not in "".join(e.data["text"] for e in events if e.name == "delta"), events
    assert script.calls[text] == 2
    assert_whole(cluster, session, [(text, answers[2])])
    again = the_final(native(g2, session, text, mid))  # delivered once: a resend gets the same record
    assert (again["text"], again["delivery_id"]) == (final["text"], final["delivery_id"])
    assert "Traceback" not in paused.ember_log().split(lease)[-1]


def test_a_fenced_worker_leaves_the_message_to_the_others_if_the_taker_dies_too(
        cluster: Cluster, script: Script) -> None:
    """The worker that lost the session does not keep its message: when the one that took it over
    dies as well, the message is taken over again and answered. The client, on an OpenAI stream,
    is shown that answer once: never the fenced worker's draft."""
    session = fresh("c2")
    text, mid = f"{session} twice taken", f"{session}.m1"
    first, second = threading.Event(), threading.Event()
    script.plans[text] = lambda n: Reply(text=f"answer {n}", hold={1: first, 2: second}.get(n))
    lease = f"session:{full_key(session)}"
    g1, _g2 = cluster.gateways
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(openai, g1, session, text, stream=True, idempotency_key=mid)
            script.wait_calls(text, 1)
            paused, _token = lease_holder(cluster, lease)
            assert paused in cluster.workers, paused
            paused.pause()
            try:
                script.wait_calls(text, 2)
                taker, _ = lease_holder(cluster, lease)
                assert taker in cluster.workers and taker is not paused
            finally:
                paused.resume()
            first.set()
            wait_until(lambda: "was taken over by another process" in paused.ember_log(), timeout_s=30,
                       what="the fenced worker's log line")
            taker.kill()  # the taker dies mid-turn too: the fenced worker, the one left, must finish it
            second.set()
            content = waiting.result(timeout=TAKEOVER_S + 10)
    finally:
        first.set()
        second.set()
    assert content == "answer 3"
    assert_whole(cluster, session, [(text, "answer 3")])


# --------------------------------------------------------------------------- d. scheduled tasks


def task_runs(cluster: Cluster, task_id: str) -> list[dict[str, Any]]:
    return query(cluster.database_url, "SELECT scheduled_for, outcome, message_id, recorded_at FROM task_runs "
                                       "WHERE task_id = $1 ORDER BY scheduled_for", task_id)


@pytest.fixture
def own_database(pg_server: PgServer) -> Iterator[str]:
    """An empty database of the test's own, dropped once the test's clusters have stopped."""
    url = pg_server.fresh_database()
    yield url
    pg_server.drop_database(url)


def test_scheduled_runs_fire_once_and_the_leaders_death_moves_them_to_another_worker(
        own_database: str, redis_server: RedisServer, model: ModelServer,
        launch_cluster: LaunchCluster) -> None:  # noqa: F811 (the fixture imported above)
    url = own_database
    cluster = launch_cluster(database_url=url, redis_url=redis_server.url, model=model, keys=None,
                             gateways=0, workers=2)
    added = subprocess.run([EMBER, "cron", "add", "--every", "1s", "--prompt", "tick", "--json"],
                           env=cluster.workers[0].env, capture_output=True, text=True, timeout=60)
    assert added.returncode == 0, added.stdout + added.stderr
    task_id = json.loads(added.stdout)["id"]
    wait_until(lambda: len([r for r in task_runs(cluster, task_id) if r["outcome"] == "run"]) >= 3,
               timeout_s=30, what="three runs")
    leader, token = lease_holder(cluster, "scheduler")
    assert leader in cluster.workers, leader
    other = next(w for w in cluster.workers if w is not leader)
    leader.kill()
    killed_at = time.time()
    wait_until(lambda: lease_holder(cluster, "scheduler")[0] is other, timeout_s=TAKEOVER_S,
               what="the other worker leading")
    assert lease_holder(cluster, "scheduler")[1] > token
    wait_until(lambda: len([r for r in task_runs(cluster, task_id)
                            if r["outcome"] == "run" and r["scheduled_for"] > killed_at + 1]) >= 3,
               timeout_s=30, what="three runs fired by the new leader")
    runs = [r for r in task_runs(cluster, task_id) if r["outcome"] == "run"]

    def answered() -> list[dict[str, Any]]:
        return query(url, "SELECT message_id, turn_id, answered_at FROM inbox WHERE channel = 'cron' "
                          "AND message_id = ANY($1::text[])", [r["message_id"] for r in runs])

    wait_until(lambda: all(r["answered_at"] is not None for r in answered()) and len(answered()) == len(runs),
               timeout_s=TAKEOVER_S, what="every run answered")
    receipts_ = answered()
    times = [r["scheduled_for"] for r in runs]
    assert len(set(times)) == len(times) and all(b - a >= 0.99 for a, b in itertools.pairwise(times)), times
    assert len({r["message_id"] for r in receipts_}) == len(runs) == len(receipts_)
    # One turn per run: one question and one answer each, and one final record.
    turns = [r["turn_id"] for r in receipts_]
    rows = query(url, "SELECT turn_id, role, content FROM messages WHERE turn_id = ANY($1::text[])", turns)
    assert Counter((r["turn_id"], r["role"]) for r in rows) == Counter(
        {(turn, role): 1 for turn in turns for role in ("user", "assistant")}), rows
    # The run the kill cut off too: the new leader's next run waits for it to be taken over.
    assert [r for r in rows if r["content"] not in ("tick", "echo: tick")] == [], rows
    outbox = query(url, "SELECT turn_id FROM outbox WHERE kind = 'final' AND turn_id = ANY($1::text[])", turns)
    assert Counter(r["turn_id"] for r in outbox) == Counter(turns)


# --------------------------------------------------------------------------- e. Redis restarted


def test_a_redis_restart_mid_run_loses_no_message(cluster: Cluster, script: Script,
                                                   redis_server: RedisServer) -> None:
    for gateway in cluster.gateways:
        session = fresh(f"e-{gateway.name}")
        assert the_final(native(gateway, session, f"{session} before"))["text"] == f"echo: {session} before"
    held = threading.Event()
    flights = [(gateway, fresh(f"e-{gateway.name}-{i}")) for gateway in cluster.gateways for i in range(2)]
    for _gateway, session in flights:
        script.plans[f"{session} across"] = lambda n, session=session: Reply(text=f"answer to {session}",
                                                                              hold=held)
    try:
        with concurrent.futures.ThreadPoolExecutor(len(flights)) as pool:
            waiting = [pool.submit(native, gateway, session, f"{session} across", f"{session}.m1")
                       for gateway, session in flights]
            for _gateway, session in flights:  # accepted: each turn is in its model call
                script.wait_calls(f"{session} across", 1, timeout_s=30)
            redis_server.restart()  # empty, as a Redis without persistence comes back
            held.set()
            results = [outcome(future) for future in waiting]
    finally:
        held.set()
    got = {session: finals(events) if isinstance(events, list) else repr(events)
           for (_gateway, session), events in zip(flights, results)}
    assert all(isinstance(events, list) for events in results), got
    for (_gateway, session), events in zip(flights, results):
        assert the_final(events)["text"] == f"answer to {session}"
        assert_whole(cluster, session, [(f"{session} across", f"answer to {session}")])
    # And after: new messages through both gateways, both APIs.
    for gateway in cluster.gateways:
        session = fresh(f"e-{gateway.name}-after")
        assert the_final(native(gateway, session, f"{session} one"))["text"] == f"echo: {session} one"
        assert openai(gateway, session, f"{session} two", stream=True) == f"echo: {session} two"
        assert openai(gateway, session, f"{session} three", stream=False) == f"echo: {session} three"


# --------------------------------------------------------------------------- f. a gateway killed mid-stream


LONG = " ".join(f"word{i}" for i in range(60))


def test_a_gateway_killed_mid_stream_leaves_the_resend_to_the_other_gateway(cluster: Cluster,
                                                                            script: Script) -> None:
    g1, g2 = cluster.gateways
    native_session, openai_session = fresh("f-native"), fresh("f-openai")
    texts = {native_session: f"{native_session} slow", openai_session: f"{openai_session} slow"}
    for session, text in texts.items():
        script.plans[text] = lambda n, session=session: Reply(text=f"{session}: {LONG}", chunk_delay_s=0.04)
    streaming = {session: threading.Event() for session in texts}

    def native_until_cut() -> None:
        with contextlib.suppress(httpx.HTTPError):
            native(g1, native_session, texts[native_session], f"{native_session}.m1",
                   on_event=lambda e: streaming[native_session].set() if e.name == "delta" else None)

    def openai_until_cut() -> None:
        headers = {**AUTH, "X-Ember-Session": openai_session, "Idempotency-Key": f"{openai_session}.m1"}
        body = {"model": "ember", "stream": True, "messages": [{"role": "user", "content": texts[openai_session]}]}
        with contextlib.suppress(httpx.HTTPError), httpx.stream(
                "POST", g1.url("/v1/chat/completions"), json=body, headers=headers, timeout=TIMEOUT) as response:
            for line in response.iter_lines():
                if '"content": "' in line and '"content": ""' not in line:
                    streaming[openai_session].set()

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        cut = [pool.submit(native_until_cut), pool.submit(openai_until_cut)]
        for event in streaming.values():
            assert event.wait(30), "no delta before the kill"
        g1.kill()
        for future in cut:
            future.result(timeout=30)
    # Each client sends its message again at once, with the same id, to the other gateway, while
    # the turn still streams: its one answer, the OpenAI stream's deltas adding up to it.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        resent_native = pool.submit(native, g2, native_session, texts[native_session], f"{native_session}.m1")
        resent_openai = pool.submit(openai, g2, openai_session, texts[openai_session], stream=True,
                                    idempotency_key=f"{openai_session}.m1")
        final = the_final(resent_native.result(timeout=TAKEOVER_S + 5))
        content = resent_openai.result(timeout=TAKEOVER_S + 5)
    assert final["text"] == f"{native_session}: {LONG}"
    assert content == f"{openai_session}: {LONG}"
    for session, text in texts.items():
        assert script.calls[text] == 1  # no second turn
        assert_whole(cluster, session, [(text, f"{session}: {LONG}")])


# --------------------------------------------------------------------------- g. approvals across processes


def test_an_approval_asked_in_a_worker_is_answered_on_a_gateway(cluster: Cluster, script: Script) -> None:
    g1, g2 = cluster.gateways
    session = fresh("g")
    outcomes = {}
    for number, (answering, decision) in enumerate([(g1, "approve_once"), (g2, "deny")]):
        text, path = f"{session} write {number}", f"{session}-{number}.txt"
        script.plans[text] = lambda n, path=path: Reply(tool_calls=(tool_call("write_file", path=path,
                                                                               content="approved"),))
        answered: list[httpx.Response] = []

        def answer(event: Event, answering: Member = answering, decision: str = decision,
                   answered: list[httpx.Response] = answered) -> None:
            if event.name == "approval_request":
                answered.append(httpx.post(answering.url(f"/api/approvals/{event.data['id']}"),
                                           json={"decision": decision}, headers=AUTH, timeout=TIMEOUT))

        events = native(g1, session, text, on_event=answer)
        requests = [e.data for e in events if e.name == "approval_request"]
        assert len(requests) == 1 and requests[0]["tool"] == "write_file", events
        assert [r.status_code for r in answered] == [200], [r.text for r in answered]
        assert the_final(events)["text"] == f"done: {text}"
        results = [e.data["text"] for e in events if e.name == "tool_result"]
        written = [w for w in cluster.workers if (w.home / "workspaces" / IDENTITY / path).exists()]
        outcomes[decision] = (results, written)
        row = query(cluster.database_url, "SELECT status, decided_by FROM approvals WHERE id = $1", requests[0]["id"])
        assert row == [{"status": decision, "decided_by": f"user:{IDENTITY}"}]
        # Answered once: a second answer, on either gateway, is told it was decided.
        late = httpx.post(g2.url(f"/api/approvals/{requests[0]['id']}"), json={"decision": "approve_once"},
                          headers=AUTH, timeout=TIMEOUT)
        assert late.status_code == 409 and late.json()["error"]["code"] == "approval_decided"
    results, written = outcomes["approve_once"]
    assert len(written) == 1
    assert (written[0].home / "workspaces" / IDENTITY / f"{session}-0.txt").read_text() == "approved"
    results, written = outcomes["deny"]
    assert written == [] and "not permitted" in results[0]


def test_a_task_delegated_in_a_worker_asks_the_person_on_a_gateway(cluster: Cluster, script: Script) -> None:
    g1, g2 = cluster.gateways
    session = fresh("d")
    text, task, path = f"{session} hand it over", f"{session} write the file", f"{session}.txt"
    script.plans[text] = lambda n: Reply(tool_calls=(tool_call("delegate", task=task),))
    script.plans[task] = lambda n: Reply(tool_calls=(tool_call("write_file", path=path, content="by the child"),))
    answered: list[httpx.Response] = []

    def answer(event: Event) -> None:
        if event.name == "approval_request":
            answered.append(httpx.post(g2.url(f"/api/approvals/{event.data['id']}"),
                                       json={"decision": "approve_once"}, headers=AUTH, timeout=TIMEOUT))

    events = native(g1, session, text, on_event=answer)
    [asked] = [e.data for e in events if e.name == "approval_request"]
    assert asked["tool"] == "write_file" and "delegated task" in asked["summary"], asked
    assert [r.status_code for r in answered] == [200], [r.text for r in answered]
    assert the_final(events)["text"] == f"done: {text}"
    [result] = [e.data["text"] for e in events if e.name == "tool_result"]
    assert result == f"done: {task}"  # the child's answer, as the delegate call's result
    written = [w for w in cluster.workers if (w.home / "workspaces" / IDENTITY / path).exists()]
    assert len(written) == 1 and (written[0].home / "workspaces" / IDENTITY / path).read_text() == "by the child"

    def child_traces() -> list[dict[str, Any]]:
        return query(cluster.database_url, "SELECT status FROM traces WHERE session_key LIKE 'delegate:%' "
                     "AND detail LIKE $1", f"%{task}%")

    wait_until(lambda: bool(child_traces()), timeout_s=30, what="the child's trace")
    assert child_traces() == [{"status": "ok"}]
