"""Named models in config (`[models.NAME]`) and the chains each role tries (`[model_roles]`)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

ROLES = ("main", "background", "approval")
ModelRole = Literal["main", "background", "approval"]


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    provider: Literal["openai"] = "openai"
    base_url: str
    api_key: SecretStr | None = None
    api_key_env: str | None = Field(default=None, description="the environment variable holding the key")
    model: str
    context_window: int | None = Field(default=None, gt=0)
    price_input_per_mtok: float | None = Field(default=None, ge=0)
    price_output_per_mtok: float | None = Field(default=None, ge=0)

    def key(self) -> str | None:
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        return os.environ.get(self.api_key_env) if self.api_key_env else None


def role_chains(models: dict[str, ModelSpec], roles: dict[str, list[str]]) -> dict[str, list[str]]:
    """Every role's chain: as configured, else main's, and main is every model in the order given.
    ValueError names a chain that is empty or names a model not configured."""
    chains = {"main": roles.get("main") or list(models)}
    for role in ROLES[1:]:
        chains[role] = roles.get(role) or chains["main"]
    for role, chain in chains.items():
        unknown = [name for name in chain if name not in models]
        if unknown:
            raise ValueError(f"model_roles.{role} names {', '.join(map(repr, unknown))}, not under [models]")
        if not chain:
            raise ValueError(f"model_roles.{role} is empty")
    return chains
