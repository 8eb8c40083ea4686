"""What the page's read-only Settings view shows: the models and their roles, the named agents, the
channels that are on, the tools and the policy that judges their calls, and where the store and the bus are.

Written here, where the settings are read, as plain values: never a key, a token or a password. A
URL keeps its scheme, host, port and path; credentials in it, its query and fragment are left out.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from ember.app.models import model_specs
from ember.app.runtime import Runtime
from ember.config.settings import Settings
from ember.models.spec import ModelSpec, role_chains

DEMO_MODEL = "the scripted demo model (canned answers, not AI)"


def settings_view(settings: Settings, runtime: Runtime) -> dict[str, Any]:
    policy = settings.tool_policy
    return {
        "agent_name": settings.agent_name,
        "models": _models(settings),
        "embedding_model": settings.embedding_model,
        "channels": sorted(runtime.channels.names),
        "tools": sorted(spec.name for spec in runtime.tools.specs()),
        "tool_policy": {
            "read": policy.read, "write": policy.write, "execute": policy.execute, "network": policy.network,
            "tools": dict(policy.tools), "timeout_s": policy.timeout_s,
            "rules": [{"tool": rule.tool, "subject": rule.subject, "decision": rule.decision} for rule in policy.rules],
        },
        "agents": [{"name": name, "models": spec.models, "tools": spec.tools, "skills": spec.skills,
                    "memory": spec.memory, "own_prompt": spec.system_prompt is not None}
                   for name, spec in sorted(settings.agents.items())],
        "channel_agents": dict(settings.channel_agents),
        "store": "postgresql" if settings.database_url is not None else "sqlite",
        "bus": "redis" if settings.redis_url is not None else "in-process",
        "timezone": settings.timezone,
    }


def _models(settings: Settings) -> list[dict[str, Any]]:
    if not settings.model_configured:
        return [{"name": "demo", "roles": ["main", "background", "approval"], "provider": "scripted",
                 "model": DEMO_MODEL, "endpoint": None, "priced": False}]
    specs = model_specs(settings)
    chains = role_chains(specs, dict(settings.model_roles))
    return [{"name": name, "roles": [role for role, chain in chains.items() if name in chain],
             "provider": spec.provider, "model": spec.model, "endpoint": endpoint(spec.base_url),
             "context_window": spec.context_window, "priced": _priced(spec)}
            for name, spec in specs.items()]


def _priced(spec: ModelSpec) -> bool:
    return spec.price_input_per_mtok is not None or spec.price_output_per_mtok is not None


def endpoint(url: str | None) -> str | None:
    """`url` without what may be secret in it: user and password, query, fragment."""
    if not url:
        return None
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"  # an IPv6 address
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"
