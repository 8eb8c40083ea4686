"""How long the `ember` command takes to answer: help, version and the list commands.

    .venv/bin/python bench/cli_start.py                 # 9 runs of each command
    .venv/bin/python bench/cli_start.py --runs 21
    .venv/bin/python bench/cli_start.py --checkout /path/to/another/checkout   # compare a version

Each command runs as a new process (`python -m ember …`, the checkout first on
PYTHONPATH) in a throwaway home with no configuration: the demo model, an empty
store made by a first, unmeasured run. It prints the median and the fastest
wall time of each command, and the target: 0.3 s for the median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, busy_warning, ms, print_header, rerun_command, verdict, without_user_config

COMMANDS = [["--help"], ["-h"], ["--version"], ["sessions", "list"], ["trace", "list"], ["cron", "list"],
            ["memory", "list"], ["skills", "list"], ["models"], ["usage"]]
TARGET_S = 0.3


def _run(checkout: Path, env: dict[str, str], args: list[str]) -> float | None:
    """The wall time of one run; None when the command failed (an older checkout may lack it)."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ember", *args], cwd=checkout, env=env, capture_output=True,
                          text=True, timeout=120)
    elapsed = time.perf_counter() - started
    return elapsed if done.returncode == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9, help="runs of each command (default 9)")
    parser.add_argument("--checkout", type=Path, default=ROOT, help="the checkout whose ember runs (default: this)")
    options = parser.parse_args()
    checkout = options.checkout.resolve()
    print_header("ember CLI start-up: wall time of a whole process", f"checkout {checkout}",
                 [("runs", f"{options.runs} of each command, round-robin"), ("target", f"median <= {TARGET_S} s")],
                 rerun_command(__file__))
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="ember-cli-bench-") as home:
        env = dict(without_user_config(dict(os.environ), Path(home)))
        env["PYTHONPATH"] = str(checkout)
        _run(checkout, env, ["sessions", "list"])  # creates and migrates the store: not measured
        times: dict[str, list[float | None]] = {" ".join(args): [] for args in COMMANDS}
        for _ in range(options.runs):  # round-robin: a burst of other work hits every command alike
            for args in COMMANDS:
                times[" ".join(args)].append(_run(checkout, env, args))
    print(f"  {'command':<22} {'median ms':>9} {'min ms':>8}  target")
    for command, runs in times.items():
        samples = [t for t in runs if t is not None]
        if len(samples) < len(runs):
            print(f"  ember {command:<16} {'fails':>9} {'':>8}  (not a command of this checkout, or it failed)")
            continue
        median = statistics.median(samples)
        print(f"  ember {command:<16} {ms(median, 9)} {ms(min(samples))}  {verdict(median <= TARGET_S)}")
    busy_warning(load_before, "the times are longer than on an idle machine", own_cores=1.0)


if __name__ == "__main__":
    main()
