"""Skills at scale: 1,000 skills installed, what the prompt's index costs and
how big it gets, how fast skill_view answers, and what a review job costs.

1. Reading 1,000 skill folders into the store (the first start) and checking
   them again unchanged (every later start, and a turn every 2 s at most).
2. The index: its length against `skills_index_chars` (target: within it),
   how many skills it lists, its build time cold (the store changed) and warm
   (unchanged: one freshness query), against one bare read of the store in the
   same run (the floor).
3. skill_view of a random skill: median and p95 over the views.
4. One review job through a real runtime: a tool-heavy turn on a scripted
   model, the review on a scripted background model that reports tokens, with
   a price configured: the tokens and cost recorded on its proposal and in the
   usage table under the job's kind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import busy_warning, ms, print_header, quantile, rerun_command, store_versions, us, verdict

from ember.app.runtime import build_runtime, running
from ember.app.services import skill_library
from ember.config.settings import Settings
from ember.core.events import InboundEvent
from ember.core.messages import ToolCall
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from ember.models.spec import ModelSpec
from ember.skills.format import render_skill_md
from ember.store.sqlite.database import SqliteDatabase
from ember.store.tx import Statement

_ONE = Statement("SELECT 1")  # the floor: an empty read
WORDS = ["report", "invoice", "deploy", "backup", "review", "summary", "schedule", "research", "translate", "draft",
         "email", "budget", "meeting", "notes", "release", "test", "migrate", "archive", "calendar", "travel"]


def write_folders(folder: Path, count: int, rng: random.Random) -> None:
    for n in range(count):
        name = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}-{n:04d}"
        words = " ".join(rng.choice(WORDS) for _ in range(18))
        body = "\n".join(f"{step}. {' '.join(rng.choice(WORDS) for _ in range(12))}." for step in range(1, 9))
        (folder / name).mkdir(parents=True)
        (folder / name / "SKILL.md").write_text(render_skill_md(name, f"Use it to {words}.", body))


async def timed(work, runs: int) -> list[float]:  # type: ignore[no-untyped-def]
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        await work()
        samples.append(time.perf_counter() - started)
    return samples


async def store_figures(home: Path, count: int, views: int, runs: int, rng: random.Random) -> bool:
    settings = Settings(home=home)
    write_folders(settings.skills_path, count, rng)
    db = SqliteDatabase(settings.database_path)
    await db.open()
    try:
        library = skill_library(settings, db)
        started = time.perf_counter()
        await library.sync()
        first = time.perf_counter() - started
        recheck = statistics.median(await timed(lambda: library.sync(force=True), runs))
        unchanged = statistics.median(await timed(library.sync, runs))
        installed = len(await library.skills(None))
        print(f"\n1. folders: {installed} skills; first read {ms(first)} ms, re-read unchanged {ms(recheck)} ms, "
              f"change check {ms(unchanged)} ms")

        floor = statistics.median(await timed(lambda: db.run_read(lambda tx: tx.execute(_ONE).fetchone()), runs * 20))
        cold = []
        for run in range(runs):  # each person's first index is built from the store
            cold += await timed(lambda run=run: library.index(f"person-{run}"), 1)
        warm = await timed(lambda: library.index("person-0"), runs * 20)
        index = await library.index("person-0")
        listed = sum(line.startswith("- ") for line in index.splitlines())
        budget = settings.skills_index_chars
        print(f"2. index: {len(index)} of {budget} characters, {listed} of {installed} skills listed "
              f"[{verdict(len(index) <= budget)}]")
        print(f"   build cold {ms(statistics.median(cold))} ms, warm {us(statistics.median(warm))} µs; "
              f"floor (one store read) {us(floor)} µs, warm = {statistics.median(warm) / floor:.1f} x floor")

        names = [skill.name for skill in await library.skills(None)]
        samples = []
        for _ in range(views):
            name = rng.choice(names)
            started = time.perf_counter()
            await library.view("person-0", name)
            samples.append(time.perf_counter() - started)
        p95 = quantile(samples, 0.95)
        print(f"3. skill_view: median {us(statistics.median(samples))} µs, p95 {us(p95)} µs over {views} views")
        return len(index) <= budget
    finally:
        await db.close()


def turn(messages, tools):  # type: ignore[no-untyped-def]
    done = sum(m.role.value == "tool" for m in messages[-8:])
    if done < 3:
        return ModelReply(tool_calls=(ToolCall(f"c{done}", "skill_view", json.dumps({"name": "reminders"})),))
    return ModelReply(text="Done.")


def review(messages, tools):  # type: ignore[no-untyped-def]
    if "reusable procedure" not in messages[0].content:
        return ModelReply(text="NONE", input_tokens=900, output_tokens=2, model="bench-background")
    answer = {"action": "create", "name": "bench-skill", "description": "A skill the bench proposes.",
              "body": "1. Step one.\n2. Step two.", "reason": "bench"}
    prompt_chars = sum(len(m.content) for m in messages)
    return ModelReply(text=json.dumps(answer), input_tokens=prompt_chars // 4, output_tokens=60,
                      model="bench-background")


async def review_figures(home: Path) -> None:
    price = ModelSpec(model="bench-background", base_url="http://127.0.0.1:9/v1", price_input_per_mtok=0.15,
                      price_output_per_mtok=0.60)  # never called: the background model is scripted
    settings = Settings(home=home, models={"bench-background": price})
    runtime = await build_runtime(settings, FunctionModel(turn), background_model=FunctionModel(review))
    async with running(runtime):
        started = time.perf_counter()
        await runtime.bus.publish_inbound(InboundEvent(channel="bench", chat_id="c", sender_id="me",
                                                       text="remind me of things", message_id="m1"))
        await runtime.bus.next_outbound("bench")
        await runtime.runner.wait_idle()
        elapsed = time.perf_counter() - started
        [proposal] = await runtime.skills.proposals(None)
    db = SqliteDatabase(settings.database_path)  # read once the usage counts were written, at stop
    await db.open()
    rows = await db.run_read(lambda tx: tx.execute(Statement(
        "SELECT SUM(input_tokens), SUM(output_tokens), SUM(cost_usd) FROM model_usage "
        "WHERE job_kind = 'review_skills'")).fetchone())
    await db.close()
    print(f"4. review job: proposal {proposal.name} [{proposal.status.value}], on it: {proposal.input_tokens} in / "
          f"{proposal.output_tokens} out tokens, ${proposal.cost_usd:.6f}; usage table under review_skills: "
          f"{rows[0]} in / {rows[1]} out, ${rows[2]:.6f}; turn to idle {ms(elapsed)} ms")


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skills", type=int, default=1_000)
    parser.add_argument("--views", type=int, default=2_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print_header("Ember skills", store_versions(), [
        ("settings", f"{args.skills} skills, {args.views} views, {args.runs} runs per build figure")],
        rerun_command(__file__))
    load_before = os.getloadavg()[0]
    rng = random.Random(20261201)
    with tempfile.TemporaryDirectory() as tmp:
        ok = await store_figures(Path(tmp) / "store", args.skills, args.views, args.runs, rng)
        await review_figures(Path(tmp) / "review")
    busy_warning(load_before, "the timings are high")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
