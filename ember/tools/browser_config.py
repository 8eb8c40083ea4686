"""`[browser]`: the browser tool's settings (the tool itself is tools/browser.py, which the settings
never import: it brings Playwright's and the proxy's modules with it)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class BrowserSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Offer the browser tool (needs Playwright, `pip install 'ember[browser]'`, and Chromium).
    enabled: bool = False
    # The Chromium to drive (Debian's package; never a downloaded one).
    executable: Path = Path("/usr/bin/chromium")
    # A person's browser context is closed after this long unused (its cookies go with it).
    idle_s: float = Field(default=300.0, gt=0)
    # Longest wait for one action (a page load, a click's navigation).
    timeout_s: float = Field(default=20.0, gt=0)
    # Most characters of page text a snapshot gives the model.
    snapshot_chars: int = Field(default=12_000, ge=500)
