"""The settings source below every Ember setting: the providers' usual variables."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import PydanticBaseSettingsSource

# Setting -> the provider's variable that sets it when nothing of Ember's does.
PROVIDER_VARIABLES = {"model_base_url": "OPENAI_BASE_URL", "model_api_key": "OPENAI_API_KEY",
                      "anthropic_api_key": "ANTHROPIC_API_KEY"}


class ProviderFallback(PydanticBaseSettingsSource):
    """The usual OPENAI_* and ANTHROPIC_API_KEY variables, below every Ember setting."""

    def __call__(self) -> dict[str, Any]:
        found = {name: os.environ.get(variable) for name, variable in PROVIDER_VARIABLES.items()}
        return {name: value for name, value in found.items() if value}

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False


def config_file() -> Path:
    return Path(os.environ.get("EMBER_HOME", "~/.ember")).expanduser() / "ember.toml"
