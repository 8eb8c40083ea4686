"""Where the SQLite store is, read from the environment and ember.toml without the settings' validation:
for the CLI's list commands, which answer faster than loading the settings takes (store/sqlite/glance.py)."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path


def plain_sqlite_store(environ: Mapping[str, str] = os.environ) -> Path | None:
    """HOME/ember.db when nothing configures the store otherwise; None when something might (a
    database_url, a home in ember.toml or in an unusual spelling) or ember.toml cannot be read:
    the settings then decide, and explain any mistake."""
    spelled = {name.upper(): name for name in environ}
    if "EMBER_DATABASE_URL" in spelled or spelled.get("EMBER_HOME", "EMBER_HOME") != "EMBER_HOME":
        return None
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
    if "database_url" in configured or "home" in configured:
        return None
    return home_dir / "ember.db"
