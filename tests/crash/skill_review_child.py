"""A process that runs one tool-heavy turn and stops dead inside its skill review:
`python -m tests.crash.skill_review_child HOME MOMENT`, MOMENT one of

- `model`: while the review waits for its model;
- `recorded`: right after the review's outcome was committed, before the job is marked done.

It writes HOME/at-kill-point when it gets there and waits for the SIGKILL.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from pathlib import Path

from ember.app.runtime import build_runtime, running
from ember.config.settings import Settings
from ember.core.events import InboundEvent
from ember.models.base import ModelReply
from ember.models.scripted import FunctionModel
from ember.store.skills import SqlSkillStore
from tests.test_skills import WEEKLY, is_skill_review, searching_turns


def at_kill_point(home: Path) -> None:
    (home / "at-kill-point").write_text("here")
    time.sleep(3600)  # the thread stops here; the parent kills the process


async def main(home: Path, moment: str) -> None:
    settings = Settings(home=home, skills_auto_admit="low-risk")

    async def review(messages: list, tools: object) -> ModelReply:
        if is_skill_review(messages) and moment == "model":
            at_kill_point(home)
        return ModelReply(text=json.dumps(WEEKLY) if is_skill_review(messages) else "NONE")

    if moment == "recorded":
        finish = SqlSkillStore.finish_review

        async def finish_then_die(self: SqlSkillStore, *args: object, **kwargs: object) -> object:
            outcome = await finish(self, *args, **kwargs)  # type: ignore[arg-type]
            at_kill_point(home)
            return outcome

        SqlSkillStore.finish_review = finish_then_die  # type: ignore[method-assign]
    runtime = await build_runtime(settings, FunctionModel(searching_turns), background_model=FunctionModel(review))
    async with running(runtime):
        await runtime.bus.publish_inbound(InboundEvent(channel="test", chat_id="c1", sender_id="tester",
                                                       text="make my weekly report", message_id=uuid.uuid4().hex))
        await runtime.bus.next_outbound("test")
        await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2]))
