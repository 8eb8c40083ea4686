"""Where the home is, read from the environment and ember.toml without the settings' validation: for the
CLI's list commands, which answer faster than loading the settings takes (store/sqlite/glance.py)."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path

# Settings that would put the store somewhere else than HOME/ember.db.
_STORE_ELSEWHERE = ("database_url", "home")


def plain_home(environ: Mapping[str, str] = os.environ, *, also_unset: tuple[str, ...] = ()) -> Path | None:
    """EMBER_HOME, when nothing configures the store (nor any setting of `also_unset`) otherwise; None when
    something might (a database_url, a home in ember.toml, EMBER_HOME in another case) or ember.toml
    cannot be read: the settings then decide, and explain any mistake."""
    unset = (*_STORE_ELSEWHERE, *also_unset)
    spelled = {name.upper(): name for name in environ}
    if any(f"EMBER_{setting.upper()}" in spelled for setting in unset if setting != "home"):
        return None
    if spelled.get("EMBER_HOME", "EMBER_HOME") != "EMBER_HOME":
        return None  # pydantic-settings reads any case; ember.toml's location is read from EMBER_HOME only
    home = environ.get("EMBER_HOME", "~/.ember")
    if not home:
        return None
    home_dir = Path(home).expanduser()
    try:
        configured = tomllib.loads((home_dir / "ember.toml").read_text(encoding="utf-8"))
    except FileNotFoundError:
        configured = {}
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    return None if any(setting in configured for setting in unset) else home_dir
