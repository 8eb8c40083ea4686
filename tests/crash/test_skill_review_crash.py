"""kill -9 during a skill review: after the restart the job runs again and ends,
with one proposal, and a skill admitted once or not at all — never twice, never half."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from ember.app.runtime import build_runtime
from ember.config.settings import Settings
from ember.models.scripted import FunctionModel
from tests.conftest import running_harness
from tests.gatewayproc import EMBER_SOURCE
from tests.loopback import wait_until
from tests.test_skills import WEEKLY, Reviews, searching_turns


def rows(db: Path, sql: str) -> list[tuple[object, ...]]:
    with sqlite3.connect(db) as conn:
        return conn.execute(sql).fetchall()


@pytest.mark.parametrize("moment", ["model", "recorded"])
async def test_a_review_killed_mid_way_resumes_once(tmp_path: Path, moment: str) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    env["PYTHONPATH"] = EMBER_SOURCE
    child = subprocess.Popen([sys.executable, "-m", "tests.crash.skill_review_child", str(home), moment],
                             cwd=EMBER_SOURCE, env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (home / "at-kill-point").exists() or child.poll() is not None, timeout_s=60,
                   what="the review to reach its kill point")
        assert child.poll() is None, child.stderr.read() if child.stderr else ""
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    db = home / "ember.db"
    assert rows(db, "SELECT status FROM jobs WHERE kind = 'review_skills'") == [("running",)]
    written = rows(db, "SELECT COUNT(*) FROM skill_proposals")[0][0]
    assert written == (1 if moment == "recorded" else 0)

    reviews = Reviews(WEEKLY)
    settings = Settings(home=home, skills_auto_admit="low-risk")
    runtime = await build_runtime(settings, FunctionModel(searching_turns), background_model=FunctionModel(reviews))
    async with running_harness(runtime) as h:
        await h.runtime.runner.wait_idle()
    assert rows(db, "SELECT status FROM jobs WHERE kind = 'review_skills'") == [("done",)]
    assert rows(db, "SELECT name, status, version FROM skill_proposals") == [("weekly-report", "admitted", 1)]
    assert rows(db, "SELECT name, version FROM skill_versions WHERE identity != ''") == [("weekly-report", 1)]
    assert rows(db, "SELECT name, version, status FROM skills WHERE identity != ''") == [
        ("weekly-report", 1, "active")]
    # The review after a recorded outcome found it and asked the model nothing again.
    assert len(reviews.skill_reviews) == (0 if moment == "recorded" else 1)
