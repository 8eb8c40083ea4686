"""kill -9 `ember serve` hundreds of times under concurrent clients and count what broke.

    .venv/bin/python bench/crash.py [--kills 500] [--sessions 12] [--seed N] [--quick]

The crash harness of tests/crash (see tests/crash/harness.py for the whole
story): a real `ember serve` child on a slow, tool-calling, sometimes-thinking
model server of its own, 12 conversations sending numbered messages with
client message ids (native API and OpenAI-compatible with Idempotency-Key),
and a killer that SIGKILLs the server mid-stream, between a tool call and its
result, around the commit of a final, during consolidation, at random, right
after a restart and during the start, then restarts it at once on the same
port while the clients resend what they did not get, with the same ids.

At the end (clients done, jobs settled, SIGTERM stop) the store is read
directly and every invariant of DESIGN.md §3 is counted against it and
against everything the clients received. It prints the outcomes (kills by
moment, attempts by outcome, cut-off turns resumed or noticed, consolidations,
jobs), the violations per invariant with examples, kills per minute, the wall
time, and the command to rerun the same seed. Exit status 1 if any invariant
was violated.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, print_header, rerun_command, unwind_on_signals

sys.path.insert(0, str(ROOT))  # tests.crash is not installed: run from the checkout

from tests.crash.harness import INVARIANTS, CrashConfig, CrashRun


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, help="kill -9s in all (default 500, quick 20)")
    parser.add_argument("--sessions", type=int, help="concurrent conversations (default 12, quick 8)")
    parser.add_argument("--seed", type=int, help="random seed of the kills and the clients (default: a new one)")
    parser.add_argument("--quick", action="store_true", help="20 kills, 8 sessions (about 2 minutes)")
    parser.add_argument("--notice-every", type=int, default=6,
                        help="every n-th restart answers cut-off turns with a notice (0: always resume)")
    parser.add_argument("--examples", type=int, default=10, help="examples printed per violated invariant")
    parser.add_argument("--dir", type=Path, help="where to create the temporary home (default: system temp)")
    parser.add_argument("--keep", action="store_true", help="keep the home (store, logs) after the run")
    parser.add_argument("--verbose", action="store_true", help="a line per restart and per kill")
    args = parser.parse_args()
    args.kills = args.kills or (20 if args.quick else 500)
    args.sessions = args.sessions or (8 if args.quick else 12)
    args.seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**9)
    return args


def rerun(args: argparse.Namespace) -> str:
    """The command that runs the same kills again: the same seed, every setting explicit."""
    return rerun_command(__file__, ["--kills", str(args.kills), "--sessions", str(args.sessions),
                                    "--seed", str(args.seed), "--notice-every", str(args.notice_every)])


def header(args: argparse.Namespace, directory: Path) -> None:
    import uvicorn

    print_header("Ember crash benchmark: kill -9 under load, restart, resend, check the invariants",
                 f"uvicorn {uvicorn.__version__}", [
                     ("run", f"{args.kills} kills, {args.sessions} sessions, seed {args.seed}, "
                             f"a notice restart every {args.notice_every or 'never'}, home {directory / 'home'}"),
                 ], rerun(args))


def main() -> int:
    args = parse_args()
    unwind_on_signals()
    directory = Path(tempfile.mkdtemp(prefix="ember-crash-bench-", dir=args.dir))
    header(args, directory)
    config = CrashConfig(workdir=directory, kills=args.kills, sessions=args.sessions, seed=args.seed,
                         notice_every=args.notice_every, verbose=args.verbose,
                         log=lambda line: print(f"  {line}", flush=True))
    run = CrashRun(config)
    started = time.perf_counter()
    try:
        report = asyncio.run(run.run())
    except KeyboardInterrupt:
        print("\n  interrupted", file=sys.stderr)
        return 130
    finally:
        run.cleanup()  # every `ember serve` it started, by pid, and the model server
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    print()
    print(report.render(examples=args.examples))
    violated = {name: n for name, n in report.violation_counts().items() if n}
    print()
    print(f"  kills per minute : {report.counts['kills per minute']}")
    print(f"  wall time        : {time.perf_counter() - started:.1f} s "
          f"({report.wall_s / max(1, args.kills):.2f} s per kill)")
    print(f"  verdict          : {'FAIL ' + str(violated) if violated else 'PASS: no invariant violated'}"
          f" ({', '.join(INVARIANTS)})")
    print(f"  rerun            : {rerun(args)}")
    if args.keep:
        print(f"  kept             : {directory}")
    return 1 if violated else 0


if __name__ == "__main__":
    sys.exit(main())
