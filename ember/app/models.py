"""The model clients the settings name: one per configured model, the chain each role (main,
background, approval, simple) and each named agent calls, the transcription model, under a router when `[models]` names
several; and those a runtime calls, each metered into its usage (`Models`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ember.config.settings import CONFIGURE_MODEL_HINT, Settings
from ember.core.errors import ConfigError, ModelNotConfigured
from ember.models.base import ModelClient, ModelEndpoint
from ember.models.metered import MeteredModel
from ember.models.router import ModelRouter, Route
from ember.models.spec import ANTHROPIC_PREFIX, ModelRole, ModelSpec, role_chains
from ember.runtime.usage import UsageRecorder
from ember.tools.explain import ApprovalExplainer

if TYPE_CHECKING:
    from ember.models.speech import Speaker
    from ember.models.transcription import Transcriber
    from ember.runtime.telemetry import Telemetry


def model_specs(settings: Settings) -> dict[str, ModelSpec]:
    """Every configured model by name: `[models]`, or the single-model settings as one."""
    if not settings.model_configured:
        missing = settings.missing_model_setting()
        raise ModelNotConfigured(f"{missing}." if missing else
                                 f"no model is configured. Configure one with:\n  {CONFIGURE_MODEL_HINT}\n"
                                 "or try Ember on the scripted demo model: --demo")
    if settings.models:
        return dict(settings.models)
    assert settings.model is not None
    anthropic = settings.model.startswith(ANTHROPIC_PREFIX)
    return {settings.model: ModelSpec(
        provider="anthropic" if anthropic else "openai", base_url=settings.model_base_url,
        model=settings.model.removeprefix(ANTHROPIC_PREFIX),
        api_key=settings.anthropic_api_key if anthropic else settings.model_api_key,
        max_tokens=settings.model_max_tokens if anthropic else None,
        thinking_budget=settings.model_thinking_budget if anthropic else None, vision=settings.model_vision)}


def model_endpoints(settings: Settings, *, names: Collection[str] | None = None,
                    tried_once: Collection[str] = ()) -> dict[str, ModelEndpoint]:
    """A client for every configured model (or those `names`), by name (the single-model settings:
    one, named by its model); those `tried_once` make one attempt per call, not model_max_attempts."""
    # Imported here: the SDKs take most of a second to import, which
    # commands that never call a model (sessions, doctor without a model) skip.
    from ember.models.anthropic_messages import AnthropicModel, TokenLimits
    from ember.models.openai_compat import OpenAICompatibleModel

    endpoints: dict[str, ModelEndpoint] = {}
    attempts = settings.model_max_attempts
    for name, spec in model_specs(settings).items():
        if names is not None and name not in names:
            continue
        if spec.provider == "anthropic":
            endpoints[name] = AnthropicModel(
                model=spec.model, api_key=spec.key() or settings.anthropic_api_key, base_url=spec.base_url,
                timeout_s=settings.model_timeout_s, max_attempts=1 if name in tried_once else attempts,
                limits=TokenLimits(spec.max_tokens or settings.model_max_tokens, spec.thinking_budget),
                vision=spec.vision)
        else:
            assert spec.base_url is not None
            endpoints[name] = OpenAICompatibleModel(
                model=spec.model, base_url=spec.base_url, api_key=spec.key(), timeout_s=settings.model_timeout_s,
                max_attempts=1 if name in tried_once else attempts, tool_call_format=spec.tool_call_format,
                vision=spec.vision)
    return endpoints


def configured_model(settings: Settings, role: ModelRole = "main") -> ModelClient:
    """The model a role calls: the chain `[model_roles]` gives it, under a router, or the one
    model of the single-model settings."""
    if not settings.models:
        return next(iter(model_endpoints(settings).values()))
    chain = role_chains(settings.models, dict(settings.model_roles))[role]
    endpoints = model_endpoints(settings, names=chain, tried_once=chain[:-1])
    return ModelRouter(role, [Route(name, endpoints[name], settings.models[name].context_window) for name in chain])


def configured_approval_model(settings: Settings, main: ModelClient) -> ModelClient:
    """The model that explains approval requests: the approval role's chain when `[models]` names
    one, else `main`."""
    return configured_model(settings, "approval") if settings.models else main


def configured_background_model(settings: Settings) -> ModelClient | None:
    """The background role's own model when `[models]` names a chain for it; None: the main model does it."""
    return configured_model(settings, "background") if settings.models else None


def configured_simple_model(settings: Settings) -> ModelClient | None:
    """The chain `[model_roles] simple` names for simple turns; None: every turn goes to main."""
    return configured_model(settings, "simple") if "simple" in settings.model_roles else None


def configured_transcriber(settings: Settings, *, demo: bool) -> Transcriber | None:
    """The model `[model_roles] transcribe` names (its first); on the demo, its scripted transcripts;
    else None (voice notes are then refused, saying why)."""
    from ember.models.transcription import DemoTranscriber, OpenAITranscriber

    spec = _audio_endpoint(settings, "transcribe", "/v1/audio/transcriptions")
    if spec is None or spec.base_url is None:
        return DemoTranscriber() if demo else None
    return OpenAITranscriber(model=spec.model, base_url=spec.base_url, api_key=spec.key(),
                             timeout_s=max(settings.model_timeout_s, 120.0))


def configured_speaker(settings: Settings, *, demo: bool) -> Speaker | None:
    """The model `[model_roles] speech` names (its first); on the demo, a tone named for what it is;
    else None (`/voice on` then says what is missing)."""
    from ember.models.speech import DemoSpeaker, OpenAISpeaker

    spec = _audio_endpoint(settings, "speech", "/v1/audio/speech")
    if spec is None or spec.base_url is None:
        return DemoSpeaker() if demo else None
    return OpenAISpeaker(model=spec.model, base_url=spec.base_url, api_key=spec.key(), voice=spec.voice,
                         timeout_s=max(settings.model_timeout_s, 120.0))


def _audio_endpoint(settings: Settings, role: ModelRole, route: str) -> ModelSpec | None:
    """The first model of an audio role's chain (None: the role is not configured); ConfigError
    unless it is an OpenAI-compatible endpoint, which is what serves `route`."""
    chain = settings.model_roles.get(role)
    if not chain:
        return None
    spec = model_specs(settings)[chain[0]]
    if spec.provider != "openai" or spec.base_url is None:
        raise ConfigError(f"model_roles.{role} names {chain[0]!r}, which is not an OpenAI-compatible endpoint "
                          f"(one with {route})")
    return spec


def configured_agent_models(settings: Settings) -> dict[str, ModelClient]:
    """Each named agent's chain, for those whose `models` name one (the others call the main chain)."""
    chains = {name: spec.models for name, spec in settings.agents.items() if spec.models}
    if not chains:
        return {}
    endpoints = model_endpoints(settings, names={model for chain in chains.values() for model in chain})
    return {name: ModelRouter(f"agent {name}", [Route(model, endpoints[model], settings.models[model].context_window)
                                                 for model in chain]) for name, chain in chains.items()}


@dataclass(frozen=True, slots=True)
class Models:
    """The models a runtime calls, each metered into `usage`: the turns', the background work's,
    the one that explains approval requests (None: they go out unexplained) and the simple chain
    (None: off). `owned`: the clients the runtime closes when it stops, each once."""

    turns: MeteredModel
    background: MeteredModel
    usage: UsageRecorder
    explainer: ApprovalExplainer | None = None
    simple: MeteredModel | None = None
    agents: Mapping[str, MeteredModel] = field(default_factory=dict)  # a named agent's chain, when it has one
    owned: tuple[ModelClient, ...] = ()


def metered_models(settings: Settings, usage: UsageRecorder, spans: Telemetry | None, model: ModelClient,
             roles: dict[str, ModelClient | None]) -> Models:
    """`roles`: the background, approval and simple models given, by role (None: the role has none);
    each named agent's chain is made from the settings."""
    from ember.models.metered import MeteredModel
    from ember.tools.explain import ApprovalExplainer

    prices = {name: spec.price() for name, spec in settings.models.items()}
    tracer = spans.tracer if spans is not None else None
    roles = {**roles, **{f"agent:{name}": chain for name, chain in configured_agent_models(settings).items()}}
    metered = {id(model): MeteredModel(model, prices, usage.record, tracer, usage)}
    for given in filter(None, roles.values()):
        metered.setdefault(id(given), MeteredModel(given, prices, usage.record, tracer, usage))

    def of(role: str) -> MeteredModel | None:
        given = roles.get(role)
        return metered[id(given)] if given is not None else None

    turns, approval = metered[id(model)], of("approval")
    explainer = ApprovalExplainer(approval, settings.approval_explain_timeout_s) if approval else None
    agents = {role.removeprefix("agent:"): chain for role in roles if role.startswith("agent:")
              if (chain := of(role)) is not None}
    return Models(turns, of("background") or turns, usage, explainer, of("simple"), agents, tuple(metered.values()))
