"""Helpers the benchmark scripts share: the header (machine, versions, the exact rerun
command), quantiles, number formats, the busy-machine warning at the end, and the
set-up of the environment and of the signals.

The scripts run as `.venv/bin/python bench/X.py`, so this folder is `sys.path[0]`
and they import this module as `common`. Only the standard library is imported
here at load time: the gateway bench starts itself again as its child processes,
which should stay light.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import signal
import sys
from collections.abc import Iterable, MutableMapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent  # the checkout: where the scripts are run from

USER_CONFIG_PREFIXES = ("EMBER_", "OPENAI_")

# --- the header ------------------------------------------------------------------------------


def machine() -> str:
    """The machine: its CPUs, its platform and the 1, 5 and 15 minute load averages now."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{os.cpu_count()} CPUs, {platform.platform()}, load average {load}"


def store_versions() -> str:
    """The versions of the store's stack: SQLite (the library Python links), SQLAlchemy, aiosqlite."""
    import sqlite3

    import aiosqlite
    import sqlalchemy

    return f"sqlite {sqlite3.sqlite_version}, sqlalchemy {sqlalchemy.__version__}, aiosqlite {aiosqlite.__version__}"


def rerun_command(script: str, args: Iterable[str] | None = None) -> str:
    """The exact command that runs `script` again with `args` (default: this run's own
    arguments): from the checkout, with the checkout first on PYTHONPATH (so its own
    `ember` is imported, not the one another checkout's editable install points to),
    and this interpreter."""
    argv = [os.path.relpath(sys.executable, ROOT), os.path.relpath(Path(script).resolve(), ROOT),
            *(sys.argv[1:] if args is None else args)]
    return f"cd {ROOT} && PYTHONPATH={ROOT} {shlex.join(argv)}"


def print_header(title: str, versions: str, rows: Iterable[tuple[str, str]], rerun: str) -> None:
    """Prints the title, the machine, the Python version followed by `versions` (the
    libraries that matter), the script's own `rows` (label, text) and the rerun command."""
    print(title)
    print(f"  machine : {machine()}")
    print(f"  python  : {platform.python_version()}, {versions}")
    for label, text in rows:
        print(f"  {label:<8}: {text}")
    print(f"  rerun   : {rerun}", flush=True)


# --- what Ember sends and shows ---------------------------------------------------------------

_OUTSTANDING_JOBS = re.compile(r'^ember_background_jobs\{status="(?:pending|running)"\} ([0-9.e+]+)$', re.M)


def text_of(content: Any) -> str:
    """A chat message's text: its content, or the text of its parts."""
    if isinstance(content, list):
        return "\n".join(str(part.get("text") or "") for part in content if isinstance(part, dict))
    return str(content or "")


def asks_for_summary(messages: list[dict[str, Any]]) -> bool:
    """Whether a chat request is Ember's consolidation, which wants a JSON summary back."""
    system = " ".join(text_of(m.get("content")) for m in messages if m.get("role") in ("system", "developer"))
    return '"summary"' in system and "JSON" in system


def outstanding_jobs(metrics: str) -> int | None:
    """Ember's pending + running background jobs in a /metrics text; None when it shows none."""
    found = _OUTSTANDING_JOBS.findall(metrics)
    return int(sum(float(n) for n in found)) if found else None


# --- figures -----------------------------------------------------------------------------------


def quantile(samples: Iterable[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) of `samples` by nearest rank: the sorted sample at
    index int(q * n), the last one at most; NaN if there is no sample. p90 is q=0.9,
    p99 q=0.99."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def us(seconds: float, width: int = 9) -> str:
    """Seconds as whole microseconds, right-aligned in `width` characters."""
    return f"{seconds * 1e6:{width}.0f}"


def ms(seconds: float, width: int = 8) -> str:
    """Seconds as milliseconds with one decimal, right-aligned in `width` characters."""
    return f"{seconds * 1e3:{width}.1f}"


def verdict(ok: bool) -> str:
    """A target's verdict: PASS if met, MISS if not."""
    return "PASS" if ok else "MISS"


# --- the end ------------------------------------------------------------------------------------


def busy_warning(load_before: float, consequence: str, own_cores: float = 0.0) -> None:
    """Prints the 1-minute load average at the start (`load_before`) and now, and a
    warning ending in `consequence` if either exceeded the cores plus `own_cores` (what
    the bench itself keeps busy): other work on the machine then moved the figures."""
    load_after, cores = os.getloadavg()[0], os.cpu_count() or 1
    print(f"  load average (1 min) at the start {load_before:.2f}, at the end {load_after:.2f}, on {cores} cores")
    if max(load_before, load_after) > cores + own_cores:
        print(f"  WARNING: the machine was busy with other work: {consequence}")


# --- set-up ---------------------------------------------------------------------------------------


def without_user_config(env: MutableMapping[str, str], home: Path) -> MutableMapping[str, str]:
    """`env` (changed in place, and returned) without any EMBER_* or OPENAI_* variable and
    with EMBER_HOME=`home`, so that no user configuration leaks into Ember's settings."""
    for name in [n for n in env if n.startswith(USER_CONFIG_PREFIXES)]:
        del env[name]
    env["EMBER_HOME"] = str(home)
    return env


def checkout_on_path(env: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """`env` (changed in place, and returned) with the checkout first on PYTHONPATH: a bench's model
    server child imports `tests.modelserver` from it, which no install provides."""
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _interrupted(*_: object) -> None:
    raise KeyboardInterrupt


def unwind_on_signals() -> None:
    """Makes Ctrl-C and SIGTERM raise KeyboardInterrupt, so the `finally` blocks stop the
    children (also when this process was started with SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupted)
