"""Several processes on one PostgreSQL store (tests/pgserver.py): session leases and their fencing
tokens, shared job claims that expire, the scheduler's leader, and approvals answered in another
process. Each "process" here is a PostgresDatabase of its own, as a separate process would have."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest
from sqlalchemy import text

from ember.bus.memory import InProcessBus
from ember.channels.cron import Scheduler
from ember.core.errors import LeaseLost
from ember.core.events import InboundEvent
from ember.core.journal import TurnJournal
from ember.core.leases import Fence, current_fence
from ember.core.memory import NewMemory
from ember.core.messages import Message
from ember.core.schedule import Schedule
from ember.core.skills import NewVersion, SkillOrigin
from ember.core.tasks import Task, new_task_id
from ember.core.tools import Decision, Risk, ToolAction, ToolRun
from ember.runtime.approvals import Resolution, SharedApprovalBroker
from ember.store.approvals import SqlApprovalStore
from ember.store.deliveries import SqlDeliveryStore
from ember.store.jobs import SharedJobStore, SqlJobStore
from ember.store.leases import SESSION_PREFIX, LeaderLease, LeaseTable, SqlSessionLeases
from ember.store.memories import SqlMemoryStore
from ember.store.postgres import PostgresDatabase
from ember.store.sessions import SqlSessionStore
from ember.store.skills import SqlSkillStore
from ember.store.tasks import SqlTaskStore
from ember.store.tx import Statement, Tx
from ember.tools.approval import ApprovalGate, ToolPolicy
from tests.conftest import FixedApprover, tool_run
from tests.test_approval import note_call, notebook

_HOLD = Statement("SELECT pg_sleep(:s)")


class LeaseTime:
    """The clock lease tables read in a test, moved on by the test instead of waited for."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
async def processes(pg_store_database: str) -> AsyncIterator[Callable[[], PostgresDatabase]]:
    """Opens one more connection pool to the same database per call: one per process."""
    opened: list[PostgresDatabase] = []

    def another() -> PostgresDatabase:
        opened.append(PostgresDatabase(pg_store_database))
        return opened[-1]

    yield another
    for db in opened:
        await db.close()


async def _texts(db: PostgresDatabase, key: str) -> list[str]:
    return [m.content for m in await SqlSessionStore(db).history(key)]


async def test_a_second_process_waits_for_a_held_session_lease_and_takes_it_with_the_next_token(
        processes: Callable[[], PostgresDatabase]) -> None:
    a, b = LeaseTable(processes(), "a", ttl_s=30), LeaseTable(processes(), "b", ttl_s=30)
    seen: list[Fence | None] = []

    async def turn(leases: SqlSessionLeases, release: asyncio.Event) -> None:
        async with leases.hold("http:alice:s1"):
            seen.append(current_fence.get())
            await release.wait()

    first_done, second_done = asyncio.Event(), asyncio.Event()
    first = asyncio.create_task(turn(SqlSessionLeases(a), first_done))
    while not seen:
        await asyncio.sleep(0.01)
    refused = asyncio.Event()
    try_take = b.try_take

    async def counted(name: str) -> int | None:  # the second process's look at the lease, told to the test
        token = await try_take(name)
        if token is None:
            refused.set()
        return token

    b.try_take = counted  # type: ignore[method-assign]
    second = asyncio.create_task(turn(SqlSessionLeases(b), second_done))
    await asyncio.wait_for(refused.wait(), 10)
    assert len(seen) == 1 and not second.done(), "the second process must wait while the first holds the lease"
    first_done.set()
    await first
    second_done.set()
    await asyncio.wait_for(second, 10)
    assert [(f.holder, f.name) for f in seen if f] == [("a", SESSION_PREFIX + "http:alice:s1"),
                                                       ("b", SESSION_PREFIX + "http:alice:s1")]
    assert seen[1].token == seen[0].token + 1  # type: ignore[union-attr]
    assert current_fence.get() is None  # not left set once the lease is released


async def test_a_holder_paused_past_its_lease_has_its_late_commit_refused_and_nothing_kept(
        processes: Callable[[], PostgresDatabase]) -> None:
    paused_db, taker_db = processes(), processes()
    key = "http:alice:s1"
    clock = LeaseTime()
    paused = LeaseTable(paused_db, "paused", ttl_s=1, clock=clock)  # takes the lease, then never renews it: SIGSTOP
    token = await paused.take(SESSION_PREFIX + key)
    fence = Fence(SESSION_PREFIX + key, "paused", token)
    store = SqlSessionStore(paused_db)

    reset = current_fence.set(fence)
    try:
        session = await store.load(key)
        await store.append(session, [Message.user("before the pause")])  # still the holder: kept
    finally:
        current_fence.reset(reset)

    clock.advance(1.2)  # the lease expires unrenewed
    taker = SqlSessionLeases(LeaseTable(taker_db, "taker", ttl_s=30, clock=clock))
    async with taker.hold(key):
        taker_store = SqlSessionStore(taker_db)
        taken = await taker_store.load(key)

        reset = current_fence.set(fence)  # the paused process wakes up and commits what it had
        try:
            with pytest.raises(LeaseLost, match="lost the lease"):
                await store.append(session, [Message.assistant("the paused process's late answer")])
        finally:
            current_fence.reset(reset)
        await taker_store.append(taken, [Message.assistant("the new holder's answer")])

    assert await _texts(taker_db, key) == ["before the pause", "the new holder's answer"]


async def test_a_commit_under_the_lease_finishes_before_another_process_can_take_it(
        processes: Callable[[], PostgresDatabase]) -> None:
    slow_db, taker_db = processes(), processes()
    name = SESSION_PREFIX + "http:alice:s1"
    clock = LeaseTime()
    slow = LeaseTable(slow_db, "slow", ttl_s=0.2, clock=clock)
    fence = Fence(name, "slow", await slow.take(name))
    clock.advance(0.3)  # expired, not yet taken: the holder may still commit
    events: list[str] = []

    def long_commit(tx: Tx) -> None:
        events.append("inside")  # the fence was checked: its lease row is locked until the commit
        tx.execute(_HOLD, {"s": 0.5})
        events.append("slept")

    async def commit() -> None:
        reset = current_fence.set(fence)
        try:
            await slow_db.run_write(long_commit)
        finally:
            current_fence.reset(reset)

    committing = asyncio.create_task(commit())
    while not events:
        await asyncio.sleep(0.01)
    token = await LeaseTable(taker_db, "taker", ttl_s=30, clock=clock).take(name)
    events.append("taken")
    await committing
    assert events == ["inside", "slept", "taken"], "the takeover waited for the commit"
    assert token == fence.token + 1


async def test_shared_claimers_never_take_the_same_job(processes: Callable[[], PostgresDatabase]) -> None:
    first, second = (SharedJobStore(processes(), claimer=name, claim_ttl_s=30) for name in ("w1", "w2"))
    for n in range(40):
        await first.enqueue("embed", f"job-{n}")
    claimed: dict[str, list[str]] = {"w1": [], "w2": []}

    async def drain(store: SqlJobStore) -> None:
        while batch := (await store.claim_due(3)).jobs:
            claimed[store.claimer] += [job.dedupe_key for job in batch]

    await asyncio.gather(drain(first), drain(second), drain(first), drain(second))
    every = claimed["w1"] + claimed["w2"]
    assert sorted(every) == sorted(f"job-{n}" for n in range(40)), "each job claimed once, none left"
    assert claimed["w1"] and claimed["w2"]


async def test_a_dead_claimers_job_is_taken_over_and_a_renewed_claim_is_not(
        processes: Callable[[], PostgresDatabase]) -> None:
    db = processes()
    dead, survivor = SharedJobStore(db, claimer="dead", claim_ttl_s=60), SharedJobStore(processes(), claimer="live",
                                                                                  claim_ttl_s=60)
    await dead.enqueue("consolidate", "s1", session_key="s1")
    await dead.enqueue("consolidate", "s2", session_key="s2")
    jobs = {job.dedupe_key: job for job in (await dead.claim_due(10)).jobs}
    assert set(jobs) == {"s1", "s2"} and (await survivor.claim_due(10)).jobs == []
    # "dead" renews s1 and then stops; its claim on s2 runs out.
    assert await dead.extend([jobs["s1"]]) == 1
    async with db.write() as conn:
        await conn.execute(text("UPDATE jobs SET claimed_until = :past WHERE dedupe_key = 's2'"),
                           {"past": time.time() - 1})
    taken = (await survivor.claim_due(10)).jobs
    assert [job.dedupe_key for job in taken] == ["s2"]
    assert taken[0].attempts == 0, "a crash is not the job's failed attempt"
    assert await dead.extend(jobs.values()) == 1, "the dead claimer's claim on s2 is no longer its own"
    await survivor.complete(taken[0])
    assert (await survivor.counts()).get("done") == 1


async def test_one_scheduler_leads_and_another_takes_over_when_it_stops_renewing(
        processes: Callable[[], PostgresDatabase]) -> None:
    clock = LeaseTime()
    first = LeaderLease(LeaseTable(processes(), "w1", ttl_s=1, clock=clock), "scheduler")
    second = LeaderLease(LeaseTable(processes(), "w2", ttl_s=1, clock=clock), "scheduler")
    assert await first.held() and not await second.held()
    await first.release()
    assert await second.held() and not await first.held()
    clock.advance(1.2)  # second stops renewing (paused): its lease runs out
    assert await first.held(), "the other process took over"
    assert not await second.held(), "the paused leader finds it lost the lead"


def _event() -> InboundEvent:
    return InboundEvent(channel="http", chat_id="alice:s1", sender_id="alice", text="hi", message_id="m1",
                        can_approve=True)


async def test_an_approval_answered_in_another_process_reaches_the_waiting_turn(
        processes: Callable[[], PostgresDatabase]) -> None:
    worker_bus = InProcessBus()
    worker = SharedApprovalBroker(worker_bus, 30, None, SqlApprovalStore(processes()))
    gateway = SharedApprovalBroker(InProcessBus(), 30, None, SqlApprovalStore(processes()))
    action = ToolAction("write_file", Risk.WRITE, "notes.txt", "write notes.txt")
    asking = asyncio.create_task(worker.ask(_event(), "turn-1", "alice", action))
    request = await asyncio.wait_for(worker_bus.next_outbound("http"), 5)
    assert request.approval is not None
    approval_id = request.approval.id

    # A process starting meanwhile does not expire a request a live process still waits on.
    await SharedApprovalBroker(InProcessBus(), 30, None, SqlApprovalStore(processes())).recover()
    assert await gateway.pending("http:alice:") == [request.approval], "listed where the answer will come"
    assert await gateway.pending("http:bob:") == []

    assert await gateway.resolve(approval_id, Decision.APPROVE_ONCE, by="alice",
                                 scope="http:bob:") is Resolution.NOT_FOUND
    assert await gateway.resolve(approval_id, Decision.APPROVE_ONCE, by="alice",
                                 scope="http:alice:") is Resolution.RESOLVED
    verdict = await asyncio.wait_for(asking, 10)
    assert verdict.decision is Decision.APPROVE_ONCE and verdict.decided_by == "user:alice"
    assert await gateway.pending("http:alice:") == []
    assert await gateway.resolve(approval_id, Decision.DENY, by="alice",
                                 scope="http:alice:") is Resolution.ALREADY_DECIDED


async def test_a_request_outlives_its_process_and_the_resumed_turn_takes_it_up(
        processes: Callable[[], PostgresDatabase]) -> None:
    first_bus, second_bus = InProcessBus(), InProcessBus()
    first = SharedApprovalBroker(first_bus, 30, None, SqlApprovalStore(processes()))
    action = ToolAction("write_file", Risk.WRITE, "notes.txt", "write notes.txt")
    asking = asyncio.create_task(first.ask(_event(), "turn-1", "alice", action))
    asked = (await asyncio.wait_for(first_bus.next_outbound("http"), 5)).approval
    assert asked is not None
    asking.cancel()  # its process stopped while the turn waited
    await asyncio.gather(asking, return_exceptions=True)

    second = SharedApprovalBroker(second_bus, 30, None, SqlApprovalStore(processes()))
    await second.recover()
    assert [r.id for r in await second.pending("http:alice:")] == [asked.id], "still listed"
    taken: set[str] = set()
    resumed = asyncio.create_task(second.ask(_event(), "turn-1", "alice", action, taken))
    again = (await asyncio.wait_for(second_bus.next_outbound("http"), 5)).approval
    assert again is not None and again.id == asked.id, "the resumed turn asks under the same id"
    assert await second.resolve(asked.id, Decision.APPROVE_ONCE, by="alice",
                                scope="http:alice:") is Resolution.RESOLVED
    assert (await asyncio.wait_for(resumed, 10)).decision is Decision.APPROVE_ONCE

    # The same call made again in that turn is a new question, which ends with the turn.
    another = asyncio.create_task(second.ask(_event(), "turn-1", "alice", action, taken))
    fresh = (await asyncio.wait_for(second_bus.next_outbound("http"), 5)).approval
    assert fresh is not None and fresh.id != asked.id
    await second.turn_ended("turn-1", "stopped")
    assert (await asyncio.wait_for(another, 10)).decision is Decision.DENY
    assert await second.resolve(fresh.id, Decision.APPROVE_ONCE, by="alice",
                                scope="http:alice:") is Resolution.EXPIRED


async def test_an_approval_the_waiting_process_gave_up_on_is_expired_for_the_other(
        processes: Callable[[], PostgresDatabase]) -> None:
    worker_bus = InProcessBus()
    worker = SharedApprovalBroker(worker_bus, 0.3, None, SqlApprovalStore(processes()))
    gateway = SharedApprovalBroker(InProcessBus(), 0.3, None, SqlApprovalStore(processes()))
    verdict = await worker.ask(_event(), "turn-1", "alice", ToolAction("shell", Risk.EXECUTE, "ls", "run ls"))
    assert verdict.decision is Decision.DENY and verdict.decided_by == "timeout"
    request = await worker_bus.next_outbound("http")
    assert request.approval is not None
    assert await gateway.resolve(request.approval.id, Decision.APPROVE_ONCE, by="alice",
                                 scope="http:alice:") is Resolution.EXPIRED


async def test_jobs_dedupe_past_the_sixth_run_of_a_prepared_statement(
        processes: Callable[[], PostgresDatabase]) -> None:
    """PostgreSQL plans a prepared statement generically from its sixth run: the upsert must still
    find the partial index of pending jobs."""
    store = SqlJobStore(processes())
    assert [await store.enqueue("embed", "all") for _ in range(12)] == [True] + [False] * 11
    assert all([await store.enqueue("title_session", f"s{n}") for n in range(12)])
    assert (await store.counts()) == {"pending": 13}


async def test_memories_written_at_once_by_two_processes_get_distinct_text_revisions_in_commit_order(
        processes: Callable[[], PostgresDatabase]) -> None:
    """The text index catches up by revision: two rows with one revision, or a lower one committed
    later, would leave a memory out of it."""
    stores = [SqlMemoryStore(processes()) for _ in range(2)]

    async def remember(store: SqlMemoryStore, n: int) -> None:
        await store.write(NewMemory(identity="alice", content=f"alice likes colour number {n}"))

    await asyncio.gather(*(remember(stores[n % 2], n) for n in range(24)))
    revisions = [rev for _num, rev, _texts in await stores[0].texts_after("alice", 0, 100)]
    assert len(revisions) == 24
    assert sorted(revisions) == list(range(1, 25)), "one revision each, with no gap and none twice"


async def test_versions_of_one_skill_added_at_once_by_two_processes_are_numbered_one_after_another(
        processes: Callable[[], PostgresDatabase]) -> None:
    stores = [SqlSkillStore(processes()) for _ in range(2)]
    await stores[0].add_version(_skill_change(0))  # the skill exists: its row is what writers queue on

    added = await asyncio.gather(*(stores[n % 2].add_version(_skill_change(n)) for n in range(1, 13)))
    assert sorted(version.version for version in added) == list(range(2, 14))


def _skill_change(n: int) -> NewVersion:
    return NewVersion(identity="alice", name="tidy-notes", description="Tidy notes", text=f"Step {n}: tidy.",
                      source="test", admitted_by="alice", origin=SkillOrigin.LEARNED, files={})


async def test_allow_for_this_session_holds_in_every_process_and_only_in_that_session(
        processes: Callable[[], PostgresDatabase]) -> None:
    written: list[str] = []
    first = ApprovalGate(notebook(written), ToolPolicy(), SqlApprovalStore(processes()))
    second = ApprovalGate(notebook(written), ToolPolicy(), SqlApprovalStore(processes()))
    approver = FixedApprover(Decision.APPROVE_SESSION)
    await first.call(note_call("one"), tool_run(approver))
    approver.decision = Decision.DENY  # would refuse, were it asked again
    run = tool_run(approver)
    await second.call(note_call("two"), run)  # the session's next turn, run by another process
    assert written == ["one", "two"] and len(approver.asked) == 1
    assert run.observer.approvals[-1]["decided_by"] == "session-grant"  # type: ignore[attr-defined]
    other_session = ToolRun("test:other", "turn-2", approver, TurnJournal(), "local")
    assert (await second.call(note_call("three"), other_session)).startswith("Error: not permitted")


async def test_a_new_scheduler_leader_publishes_the_runs_the_last_one_claimed_but_never_sent(
        processes: Callable[[], PostgresDatabase]) -> None:
    dead_db, live_db = processes(), processes()
    tasks, now = SqlTaskStore(dead_db), time.time()
    task = await tasks.add(Task(id=new_task_id(), identity="alice", prompt="water the plants",
                                schedule=Schedule.every("1h", now), reply=None))
    await tasks.make_due(task.id, now=now)
    # The leader claims the due run and dies before publishing it.
    claimed = await tasks.claim_due(now, missed_after_s=60)
    assert [event.message_id for event in claimed] == [f"{task.id}@{now:.3f}"]

    bus = InProcessBus()
    scheduler = Scheduler(bus, SqlTaskStore(live_db), leader=LeaderLease(LeaseTable(live_db, "live", ttl_s=30),
                                                                          "scheduler"),
                          unstarted=lambda: SqlDeliveryStore(live_db).unstarted(["cron"]))
    await scheduler.start()
    try:
        event = await asyncio.wait_for(bus.next_inbound(), 10)
    finally:
        await scheduler.stop()
    assert (event.message_id, event.text) == (claimed[0].message_id, "water the plants")
