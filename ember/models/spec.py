"""Named models in config (`[models.NAME]`) and the chains each role tries (`[model_roles]`)."""

from __future__ import annotations

import os
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from ember.core.usage import Price

ROLES = ("main", "background", "approval")
# Roles that exist only when configured: "simple", the cheap chain for simple turns (pipeline/inference.py);
# "transcribe", the speech-to-text model voice notes go to (models/transcription.py); "speech", the
# text-to-speech model that speaks answers to whoever turned spoken replies on (models/speech.py).
OPTIONAL_ROLES = ("simple", "transcribe", "speech")
ModelRole = Literal["main", "background", "approval", "simple", "transcribe", "speech"]
ToolCallFormat = Literal["native", "text", "auto"]


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # "openai": any OpenAI-compatible endpoint; "anthropic": Claude's Messages API.
    provider: Literal["openai", "anthropic"] = "openai"
    base_url: str | None = Field(default=None, description="required for openai; anthropic's default is its API")
    # The key itself, or...
    api_key: SecretStr | None = None
    api_key_env: str | None = Field(default=None, description="the environment variable holding the key")
    # The model's name at the endpoint.
    model: str
    # Its context in tokens: a prompt too long for one model goes to a larger one in the chain.
    context_window: int | None = Field(default=None, gt=0)
    # USD per million input tokens (not read from a cache); no price: tokens counted, no cost.
    price_input_per_mtok: float | None = Field(default=None, ge=0)
    # USD per million output tokens.
    price_output_per_mtok: float | None = Field(default=None, ge=0)
    # USD per million prompt tokens read from the provider's cache.
    price_cache_read_per_mtok: float | None = Field(default=None, ge=0)
    # USD per million prompt tokens written to it.
    price_cache_write_per_mtok: float | None = Field(default=None, ge=0)
    # Anthropic's: the answer's token limit (the API requires one), and extended thinking's budget.
    max_tokens: int | None = Field(default=None, gt=0)
    # Anthropic's extended thinking budget in tokens (off when unset).
    thinking_budget: int | None = Field(default=None, ge=1024)
    # How the model calls tools (openai): "native", the endpoint's tool calls only; "text", the tools
    # told in the system prompt and the calls read from the answer, for a server that takes no tools
    # (llama.cpp without --jinja); "auto", native, with calls a local model writes as text
    # (`<tool_call>…</tool_call>`, a fenced JSON call) read too, and text once the server refuses tools.
    tool_call_format: ToolCallFormat = "auto"
    # It reads images (and, on Anthropic, PDFs as they look): sent as images, not as a note saying
    # one was attached.
    vision: bool = False
    # A speech model's voice ([model_roles] speech), as its endpoint names them.
    voice: str = "alloy"

    @field_validator("base_url")
    @classmethod
    def _a_url(cls, value: str | None) -> str | None:
        return check_base_url(value) if value is not None else None

    @model_validator(mode="after")
    def _complete(self) -> ModelSpec:
        if self.provider == "openai" and not self.base_url:
            raise ValueError("an openai model needs base_url (e.g. https://api.openai.com/v1)")
        check_thinking(self.max_tokens, self.thinking_budget)
        return self

    def price(self) -> Price:
        return Price(self.price_input_per_mtok, self.price_output_per_mtok, self.price_cache_read_per_mtok,
                     self.price_cache_write_per_mtok)

    def key(self) -> str | None:
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        return os.environ.get(self.api_key_env) if self.api_key_env else None


DEFAULT_MAX_TOKENS = 4096
# `model = "anthropic:claude-…"`: the single-model shorthand for Anthropic's API.
ANTHROPIC_PREFIX = "anthropic:"
ANTHROPIC_BASE_URL = "https://api.anthropic.com"


def check_base_url(value: str) -> str:
    """A model endpoint's base URL: http(s), with a host."""
    parsed = urlsplit(value.strip())
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"{value!r} is not a base URL: give http(s)://host[:port][/path], "
                         "e.g. https://api.openai.com/v1")
    return value.strip()


def check_thinking(max_tokens: int | None, thinking_budget: int | None) -> None:
    if thinking_budget is not None and thinking_budget >= (max_tokens or DEFAULT_MAX_TOKENS):
        raise ValueError(f"thinking_budget ({thinking_budget}) must be below max_tokens "
                         f"({max_tokens or DEFAULT_MAX_TOKENS}): the answer comes out of the same limit")


def role_chains(models: dict[str, ModelSpec], roles: dict[str, list[str]]) -> dict[str, list[str]]:
    """Every role's chain: as configured, else main's, and main is every model in the order given.
    ValueError names a chain that is empty or names a model not configured."""
    chains = {"main": roles.get("main") or list(models)}
    for role in ROLES[1:]:
        chains[role] = roles.get(role) or chains["main"]
    chains |= {role: roles[role] for role in OPTIONAL_ROLES if role in roles}
    for role, chain in chains.items():
        unknown = [name for name in chain if name not in models]
        if unknown:
            raise ValueError(f"model_roles.{role} names {', '.join(map(repr, unknown))}, not under [models]")
        if not chain:
            raise ValueError(f"model_roles.{role} is empty")
    return chains
