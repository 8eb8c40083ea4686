"""Telegram under load: many chats streaming at once against the tests' fake Bot API.

Each chat's person sends one message; the scripted model streams a long answer
in small pieces, so every chat's draft wants an edit far more often than the
flood limit allows. Printed, over the chats:

1. edits per chat per second: the highest rate any chat saw over a sliding
   second (target: never above 1000 / edit_interval_ms), and the shortest gap
   between two writes in one chat;
2. time to first visible text (the draft's sendMessage after the update was
   queued): median and p95;
3. time to the final text shown, median and p95;
4. duplicates: chats showing more than one message, or a text other than the
   committed answer (target 0).

The in-process run is the whole channel: polling, the inbox, turns, the
ChannelHub's per-chat lanes and the EditStream.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import busy_warning, ms, print_header, quantile, rerun_command, store_versions, verdict

# This script's own name would hide the `telegram` package: its folder gives way to the checkout
# (tests/ is not installed) once `common` is imported.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from ember.app.runtime import build_runtime, running  # noqa: E402
from ember.app.serve import chat_services  # noqa: E402
from ember.channels.telegram.channel import TelegramChannel  # noqa: E402
from ember.channels.telegram.config import TelegramSpec  # noqa: E402
from ember.channels.telegram.markup import telegram_html  # noqa: E402
from ember.config.settings import Settings  # noqa: E402
from ember.core.messages import Role  # noqa: E402
from ember.models.base import ModelReply  # noqa: E402
from ember.models.scripted import FunctionModel  # noqa: E402
from ember.tools.base import ToolRegistry  # noqa: E402
from tests.telegramserver import TOKEN, render, serving_telegram  # noqa: E402

ANSWER = " ".join(f"Sentence {n} of a long streamed answer." for n in range(60))


def max_rate(times: list[float]) -> int:
    """The most writes within any one second."""
    best, start = 0, 0
    for end in range(len(times)):
        while times[end] - times[start] >= 1.0:
            start += 1
        best = max(best, end - start + 1)
    return best


async def run(chats: int, interval_ms: int, delay_s: float) -> bool:
    with serving_telegram() as (fake, base_url), tempfile.TemporaryDirectory() as home:
        model = FunctionModel(lambda messages, tools: ModelReply(text=ANSWER), chunk_size=6, delta_delay_s=delay_s)
        settings = Settings(home=Path(home), embedding_model="hashing")
        runtime = await build_runtime(settings, model, tools=ToolRegistry())
        spec = TelegramSpec(token=TOKEN, api_base_url=base_url, allowed_users=list(range(1, chats + 1)),
                            poll_timeout_s=1, edit_interval_ms=interval_ms)
        runtime.channels.register(TelegramChannel(spec, chat_services(runtime)))
        shown_answer = render(telegram_html(ANSWER), "HTML")
        async with running(runtime):
            queued = {}
            for chat in range(1, chats + 1):
                fake.message(chat, chat, f"question {chat}")
                queued[chat] = time.monotonic()
            started = time.monotonic()
            done: dict[int, float] = {}
            while len(done) < chats and time.monotonic() - started < 600:
                for chat in range(1, chats + 1):
                    if chat not in done and shown_answer in fake.texts(chat):
                        done[chat] = time.monotonic()
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # a late second copy would show by now
            answers = [[m.content for m in await runtime.sessions.history(f"telegram:{chat}")
                        if m.role is Role.ASSISTANT] for chat in range(1, chats + 1)]
        writes = {chat: sorted(w.at for w in fake.writes_in(chat) if w.ok) for chat in range(1, chats + 1)}
        first = [writes[chat][0] - queued[chat] for chat in writes if writes[chat]]
        final = [done[chat] - queued[chat] for chat in done]
        rates = [max_rate(times) for times in writes.values()]
        gaps = [b - a for times in writes.values() for a, b in itertools.pairwise(times)]
        duplicates = sum(len(fake.visible(chat)) != 1 or fake.texts(chat) != [shown_answer] or answers[chat - 1]
                         != [ANSWER] for chat in range(1, chats + 1))
    limit = 1000 / interval_ms
    ok = max(rates) <= limit and duplicates == 0 and len(done) == chats
    print(f"\n1. edits per chat per second: max {max(rates)} (limit {limit:g}) [{verdict(max(rates) <= limit)}]; "
          f"shortest gap in a chat {ms(min(gaps))} ms; "
          f"writes per chat median {statistics.median(map(len, writes.values()))}")
    print(f"2. first visible text: median {ms(statistics.median(first))} ms, p95 {ms(quantile(first, 0.95))} ms")
    print(f"3. final shown: median {ms(statistics.median(final))} ms, p95 {ms(quantile(final, 0.95))} ms "
          f"({len(done)} of {chats} chats)")
    print(f"4. duplicates (a second message, or a text not the committed answer): {duplicates} "
          f"[{verdict(duplicates == 0)}]")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chats", type=int, default=200)
    parser.add_argument("--interval-ms", type=int, default=1000, help="edit_interval_ms")
    parser.add_argument("--delta-delay", type=float, default=0.02, help="seconds between the model's pieces")
    args = parser.parse_args()
    print_header("Ember on Telegram", store_versions(), [
        ("settings", f"{args.chats} chats at once, edit_interval_ms {args.interval_ms}, "
                     f"{len(ANSWER)}-character answers in 6-character pieces every {args.delta_delay:g} s")],
        rerun_command(__file__))
    load_before = os.getloadavg()[0]
    ok = asyncio.run(run(args.chats, args.interval_ms, args.delta_delay))
    busy_warning(load_before, "the latencies are high (the rate and duplicate checks stand)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
