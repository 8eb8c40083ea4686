"""kill -9 at the worst moments, restart at once, clients resend: nothing lost, nothing doubled.

A bounded run of the crash harness (tests/crash/harness.py): 30 kills of a
real `ember serve` under 12 concurrent conversations, aimed mid-stream, between
a tool call and its result, around the commit of a final, during
consolidation, at random, right after a restart, during a graceful stop and
during the start itself. Every invariant of DESIGN.md §3 is counted on the
store and on what the clients received, and must have no violation. The
scenarios the harness once found broken are pinned below, each by its
smallest form.

The seed is printed; rerun one with EMBER_CRASH_SEED=<seed>. The same harness
with 500 kills: bench/crash.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
from pathlib import Path

import httpx

from tests.crash.harness import (
    INVARIANTS,
    CrashConfig,
    Trigger,
    gateway_with_model,
    message_plan,
    plain_message_id,
    read_store,
    run_crash,
)

SEED = int(os.environ.get("EMBER_CRASH_SEED", "20240607"))
KILLS = int(os.environ.get("EMBER_CRASH_KILLS", "30"))


def test_kill_9_at_any_moment_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    print(f"\ncrash test seed {SEED} (rerun with EMBER_CRASH_SEED={SEED})")
    report = run_crash(CrashConfig(workdir=tmp_path, kills=KILLS, sessions=12, seed=SEED))
    print(report.render())
    counts = report.counts
    # The run did what it claims: it killed, clients resent, turns were cut off and finished later.
    assert counts["kills"] == KILLS
    assert counts["resends (attempts after the first)"] > 0
    assert counts["cut-off turns resumed at a restart (per restart)"] > 0
    assert counts["consolidations (episodic summaries)"] > 0
    assert counts["exit code of the final SIGTERM stop"] == 0
    assert counts.get("gateway exits nobody asked for", 0) == 0
    # Every message got its final, and no invariant was violated even once.
    assert counts["turns answered (a final reached the client)"] == counts["turns sent (distinct message ids)"]
    assert report.violation_counts() == dict.fromkeys(INVARIANTS, 0), report.render(examples=20)


async def _abandon_then_resend(tmp_path: Path) -> tuple[str, str]:
    """An OpenAI client reads the first piece of a slow streamed answer, gives up, and resends
    the message at once with the same Idempotency-Key (as a client with a short timeout would)."""
    async with gateway_with_model(tmp_path, delay_s=(0.08, 0.1)) as supervisor:
        mid = plain_message_id("rejoin")
        headers = {"Idempotency-Key": mid, "X-Ember-Session": "rejoin"}
        body = {"model": "ember", "stream": True, "messages": [{"role": "user", "content": f"[{mid}] hello"}]}
        async with httpx.AsyncClient(base_url=supervisor.base_url, timeout=30) as http:
            async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and _content(line):
                        break  # the first visible piece: the client gives up here
            for _ in range(100):  # 409 until the gateway has noticed the first request is gone
                async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
                    if response.status_code == 409:
                        await response.aread()
                        await asyncio.sleep(0.01)
                        continue
                    assert response.status_code == 200
                    return mid, "".join([_content(line) async for line in response.aiter_lines()
                                         if line.startswith("data: {")])
    raise AssertionError("the resend was refused with 409 for a whole second")


def _content(line: str) -> str:
    choices = json.loads(line.removeprefix("data: "))["choices"]
    return (choices[0]["delta"].get("content") or "") if choices else ""


def test_an_openai_stream_resent_mid_turn_shows_the_answer_once(tmp_path: Path) -> None:
    mid, content = asyncio.run(_abandon_then_resend(tmp_path))
    assert content == message_plan(mid).answer


async def _cut_off_after_the_first_tool_step(tmp_path: Path) -> list[dict[str, object]]:
    """A turn with two tool steps (three calls, enough to ask for the reviews) is killed once its
    first step is committed; the restarted server resumes it; its client resends and gets the answer."""
    async with gateway_with_model(tmp_path, delay_s=(0.02, 0.03)) as supervisor:
        mid = next(f"heavy.m{n:03d}" for n in itertools.count(1) if len(message_plan(f"heavy.m{n:03d}").steps) == 2)
        gateway = supervisor.current
        assert gateway is not None
        # The second tool step's model call comes after the first step (call and results) is committed.
        trigger = Trigger("after the first tool step", "tool", "request", gateway, skip=1)
        supervisor.model.switch.arm(trigger)
        body = {"text": f"[{mid}] read the notes twice", "message_id": mid}
        async with httpx.AsyncClient(base_url=supervisor.base_url, timeout=30) as http:
            with contextlib.suppress(httpx.HTTPError):
                async with http.stream("POST", "/api/sessions/heavy/messages", json=body) as response:
                    async for _ in response.aiter_lines():
                        pass
            assert await asyncio.to_thread(trigger.fired.wait, 10)
            await asyncio.to_thread(gateway.process.wait, 10)
            await supervisor.ready(supervisor.spawn())
            for _ in range(50):  # resent until the final arrives (the resumed turn may still hold the session)
                async with http.stream("POST", "/api/sessions/heavy/messages", json=body) as response:
                    lines = [line async for line in response.aiter_lines()]
                if "event: final" in lines:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError(f"no final for the resent message: {lines}")
            for _ in range(400):  # the background jobs settle
                view = read_store(supervisor.db_path)
                assert view is not None
                if not view.job_counts()["pending"] and not view.job_counts()["running"]:
                    break
                await asyncio.sleep(0.05)
            history = [m for rows in view.rows.values() for m in rows]
            assert sum(len(m.call_ids) for m in history) == 3  # the turn did make its three calls
            return view.jobs


def test_a_resumed_tool_heavy_turn_still_gets_its_reviews(tmp_path: Path) -> None:
    jobs = asyncio.run(_cut_off_after_the_first_tool_step(tmp_path))
    assert {job["kind"] for job in jobs if job["status"] == "done"} >= {"review_memory", "review_skills"}
