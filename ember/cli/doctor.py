"""`ember doctor`: checks a user runs when something looks wrong."""

from __future__ import annotations

import asyncio
import os
import time
import tomllib
from collections.abc import Coroutine
from typing import Any

from pydantic import ValidationError
from pydantic_settings import EnvSettingsSource
from redis.asyncio import Redis
from rich.console import Console
from rich.markup import escape
from sqlalchemy import bindparam, distinct, func, select, text

from ember.app.database import Stores, open_database
from ember.app.model_probe import MODEL_CHECK_TIMEOUT_S, probe_model
from ember.app.models import model_endpoints
from ember.app.services import embedding_endpoint
from ember.app.tools import shell_sandbox
from ember.bus.redis import WORKERS
from ember.bus.redis_support import redacted_url
from ember.config.settings import CONFIGURE_MODEL_HINT, Settings, isolated_settings, load_settings
from ember.config.sources import ProviderFallback, config_file
from ember.core.errors import ConfigError, EmberError
from ember.memory.embeddings import e5_state
from ember.store import schema
from ember.store.migrations import SCHEMA_VERSION
from ember.tools.sandboxes import SandboxUnavailable
from ember.tools.workspace import Workspaces

_l = schema.leases
_HELD_LEASES = select(func.count(), func.count(distinct(_l.c.holder))).where(_l.c.expires_at > bindparam("now"))


class Report:
    def __init__(self, console: Console) -> None:
        self._console = console
        self.failures = 0

    def ok(self, what: str) -> None:
        self._console.print(f"[green]ok[/green]    {what}", highlight=False)

    def warn(self, what: str) -> None:
        self._console.print(f"[yellow]warn[/yellow]  {what}", highlight=False)

    def fail(self, what: str) -> None:
        self.failures += 1
        self._console.print(f"[red]FAIL[/red]  {what}", highlight=False)


async def run_doctor(console: Console) -> int:
    """Every check, 1 when one fails. A configuration that does not load is a failure, and the
    other checks run on what of it does (the failing keys left at their defaults)."""
    report = Report(console)
    try:
        settings = load_settings()
    except ConfigError as exc:
        report.fail(escape(f"config: {exc}"))
        settings, left_out = _salvaged_settings()
        without = ", ".join(left_out) or "the configuration"
        report.warn(escape(f"the checks below ran without {without}, left at the defaults"))
    return await run_checks(settings, console, report)


def _salvaged_settings() -> tuple[Settings, list[str]]:
    """The settings the environment and ember.toml give, without the top-level keys that fail
    to validate, and those keys (all of them, when the file does not parse or the rest fails as a whole)."""
    try:
        from_file = tomllib.loads(config_file().read_text(encoding="utf-8")) if config_file().is_file() else {}
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        from_file = {}
    try:
        from_env = EnvSettingsSource(Settings)()
    except ValueError:  # a nested table's variable that is not JSON
        from_env = {}
    given = {**ProviderFallback(Settings)(), **from_file, **from_env}
    left_out: set[str] = set()
    while True:
        try:
            return isolated_settings(**{k: v for k, v in given.items() if k not in left_out}), sorted(left_out)
        except ValidationError as exc:
            failing = {str(error["loc"][0]) for error in exc.errors() if error["loc"]}
            if not failing - left_out:  # an error of the whole (two settings that disagree): defaults
                home = given.get("home")
                return isolated_settings(**({"home": home} if home else {})), sorted(given)
            left_out |= failing


async def run_checks(settings: Settings, console: Console, report: Report | None = None) -> int:
    report = report or Report(console)
    _check_config(settings, report)
    await asyncio.to_thread(_check_sandbox, settings, report)
    await _check_store(settings, report)
    await _check_bus(settings, report)
    await _check_model(settings, report)
    await asyncio.to_thread(_check_embeddings, settings, report)
    await _check_channels(settings, report)
    return 1 if report.failures else 0


def _check_config(settings: Settings, report: Report) -> None:
    report.ok(f"config: home {settings.home_dir}")
    workspace = settings.workspace_dir
    if not workspace.exists():
        report.warn(f"workspace {workspace} does not exist yet (created on first run)")
    elif not os.access(workspace, os.R_OK | os.X_OK):
        report.fail(f"workspace {workspace} is not readable")
    else:
        report.ok(f"workspace {workspace}")
    if settings.workspace_scope == "identity":
        try:
            Workspaces(workspace, settings.workspaces_dir)
            report.ok(f"every other identity's workspace under {settings.workspaces_dir}")
        except ConfigError as exc:
            report.fail(str(exc))


def _check_sandbox(settings: Settings, report: Report) -> None:
    """Which sandbox the shell tool runs its commands in (it tries them, as the first command would)."""
    try:
        sandbox = shell_sandbox(settings).sandbox()
    except SandboxUnavailable as exc:  # configured explicitly, it is a failure; by default, the shell is only off
        (report.warn if settings.shell_sandbox == "auto" else report.fail)(f"shell tool refused: {exc}")
        return
    if sandbox.name == "none":
        report.warn('shell: commands run unsandboxed, as Ember\'s user (shell_sandbox = "none")')
        return
    network = "with" if settings.shell_network else "without"
    report.ok(f"shell: commands run in the {sandbox.name} sandbox, {network} network")


async def _check_store(settings: Settings, report: Report) -> None:
    where = "on PostgreSQL (database_url)" if settings.database_url is not None else str(settings.database_path)
    try:
        async with open_database(settings) as db:
            async with db.read() as conn:
                # PostgreSQL checks its own pages (checksums, WAL); SQLite's file is checked here.
                integrity = ((await conn.execute(text("PRAGMA integrity_check"))).scalar_one()
                             if conn.dialect.name == "sqlite" else "ok")
            stores = Stores(db)
            store = stores.sessions
            sessions = await store.list_sessions()
            quarantined = await store.quarantined()
            unreadable = await store.unreadable()  # read-only: a running Ember may be using the store
            jobs = await stores.jobs.counts()
            memory = await stores.memory.consistency()
            async with db.read() as conn:
                leases, holders = (await conn.execute(_HELD_LEASES, {"now": time.time()})).one()
    except Exception as exc:  # doctor reports every failure instead of crashing
        report.fail(f"store {where}: {type(exc).__name__}: {exc}")
        return
    if integrity != "ok":
        report.fail(f"store integrity check: {integrity}")
    report.ok(f"store {where}: schema v{SCHEMA_VERSION}, {len(sessions)} session(s)")
    if quarantined:
        report.warn(f"{len(quarantined)} stored message(s) could not be read and were set aside:")
        for row in quarantined:
            report.warn(f"  session {row.session_key} seq {row.seq}: {row.reason}")
    if unreadable:
        report.warn(f"{len(unreadable)} stored message(s) cannot be read; they are left out of the history:")
        for row in unreadable:
            report.warn(f"  session {row.session_key} seq {row.seq}: {row.reason}")
    if jobs.get("failed"):
        report.warn(f"{jobs['failed']} background job(s) failed for good (see ember.log)")
    report.ok(f"background jobs: {jobs.get('pending', 0)} pending, {jobs.get('running', 0)} running")
    if settings.database_url is not None:
        report.ok(f"leases: {leases} held now, by {holders} process(es)")
    _check_memory(memory, report)


async def _check_bus(settings: Settings, report: Report) -> None:
    """The Redis bus, read only: reachable, and how its inbound messages stand."""
    if settings.redis_url is None:
        return
    url = settings.redis_url.get_secret_value()
    where, ns = redacted_url(url), settings.redis_namespace
    client = Redis.from_url(url, decode_responses=True, socket_connect_timeout=2.0, socket_timeout=5.0)
    try:
        await client.ping()
        shards = await client.get(f"{ns}:inbound:shards")
        waiting = pending = 0
        consumers: set[str] = set()
        for shard in range(int(shards or 0)):
            stream = f"{ns}:inbound:{shard}"
            if not await client.exists(stream):
                continue
            for group in await client.xinfo_groups(stream):
                if group["name"] == WORKERS:
                    pending += group["pending"]
                    waiting += group.get("lag") or 0
                    consumers.update(c["name"] for c in await client.xinfo_consumers(stream, WORKERS))
    except Exception as exc:  # doctor reports every failure instead of crashing
        report.fail(f"Redis bus {where}: {type(exc).__name__}: {exc}")
        return
    finally:
        await client.aclose()
    if shards is None:
        report.warn(f"Redis bus {where} (namespace {ns}): no Ember process has used it yet")
        return
    report.ok(f"Redis bus {where} (namespace {ns}): {shards} inbound shard(s), {waiting} message(s) waiting, "
              f"{pending} being answered, {len(consumers)} worker(s) seen")


def _check_memory(counts: dict[str, int], report: Report) -> None:
    if counts["rows"] != counts["text_rows"] or counts["rows_without_text"]:
        report.fail(f"memory text index: {counts['text_rows']} entries for {counts['rows']} memories "
                    f"({counts['rows_without_text']} missing); `ember memory reindex` rebuilds it")
    elif counts["orphan_vectors"]:
        report.fail(f"memory vectors: {counts['orphan_vectors']} without a memory; `ember memory reindex` fixes it")
    elif counts["miscounted_vectors"]:
        report.fail(f"memory vectors: the counts of {counts['miscounted_vectors']} identities are off; "
                    "`ember memory reindex` fixes them")
    else:
        report.ok(f"memory: {counts['rows']} memories, text index complete, "
                  f"{counts['unembedded']} waiting for a vector")


async def _check_model(settings: Settings, report: Report) -> None:
    try:
        endpoints = model_endpoints(settings)
    except EmberError:
        report.warn(f"no model configured; `ember run` uses the scripted demo model. Configure: {CONFIGURE_MODEL_HINT}")
        return
    for label, model in endpoints.items():
        named = f"model {label!r} at" if settings.models else "model endpoint"
        state, said = await probe_model(model)
        if state == "down":
            report.fail(f"{named} {model.base_url}: {said}")
        elif state == "unlisted":
            report.warn(f"{named} {model.base_url} {said}")
        else:
            report.ok(f"{named} {model.base_url} {said}")


def _check_embeddings(settings: Settings, report: Report) -> None:
    name = settings.embedding_model
    if name == "e5-small":
        full_speed, said = e5_state()
        (report.ok if full_speed else report.warn)(f"embeddings: e5-small {said}")
    elif name == "none":
        report.ok("embeddings: none; memory is searched by its words alone")
    elif name == "hashing":
        report.warn("embeddings: hashing, which matches shared words only; e5-small also matches meaning")
    elif (base_url := embedding_endpoint(settings)[0]) is None:
        report.fail(f"embeddings: {name} has no endpoint; set embedding_base_url")
    else:
        report.ok(f"embeddings: {name} through {base_url}")


async def _check_channels(settings: Settings, report: Report) -> None:
    """Each chat platform's credentials, asked without sending anything."""
    if (spec := settings.telegram_bot) is not None:
        from ember.channels.telegram.channel import probe as telegram_probe

        if (name := await _probe("telegram", telegram_probe(spec), report)) is not None:
            allowed = len(spec.allowed_users)
            report.ok(f"telegram: the token is {name}'s; {spec.mode}; {allowed} allowed user{'s' * (allowed != 1)}")
            if not allowed:
                report.warn("telegram: allowed_users is empty, so the bot refuses everyone")
    if settings.slack is not None:
        from ember.channels.slack.channel import probe as slack_probe

        slack = settings.slack
        if (said := await _probe("slack", slack_probe(slack), report)) is not None:
            report.ok(f"slack: the token is {said}'s; {slack.mode} mode")
            if slack.mode == "events" and not slack.secret():
                report.fail("slack: no signing_secret (or EMBER_SLACK_SIGNING_SECRET): every event would be refused")
            if slack.mode == "socket" and not slack.socket_token():
                report.fail("slack: socket mode needs app_token (xapp-…, or EMBER_SLACK_APP_TOKEN)")
    await _check_more_channels(settings, report)


async def _check_more_channels(settings: Settings, report: Report) -> None:
    if settings.email is not None:
        from ember.channels.email.channel import probe as email_probe

        if (said := await _probe("email", email_probe(settings.email), report)) is not None:
            report.ok(f"email: {said}")
            if not settings.email.allowed_senders:
                report.warn("email: allowed_senders is empty, so every sender is refused")
    if settings.discord is not None:
        from ember.channels.discord.channel import probe as discord_probe

        if (said := await _probe("discord", discord_probe(settings.discord), report)) is not None:
            report.ok(f"discord: the token is {said}'s")
    if settings.feishu is not None:
        from ember.channels.feishu.channel import probe as feishu_probe

        if (said := await _probe("feishu", feishu_probe(settings.feishu), report)) is not None:
            report.ok(f"feishu: {said}")
            if settings.feishu.mode == "http" and not settings.feishu.encryption():
                report.warn("feishu: no encrypt_key: events come unsigned, checked by the verification token alone")
    if settings.dingtalk is not None:
        from ember.channels.dingtalk.channel import probe as dingtalk_probe

        if (said := await _probe("dingtalk", dingtalk_probe(settings.dingtalk), report)) is not None:
            report.ok(f"dingtalk: {said}")
    for label, weixin in (("wecom", settings.wecom), ("wechat", settings.wechat)):
        if weixin is not None:
            from ember.channels.wecom.channel import probe as weixin_probe

            if (said := await _probe(label, weixin_probe(weixin), report)) is not None:
                report.ok(f"{label}: {said}")
    if settings.qq is not None:
        from ember.channels.qq.channel import probe as qq_probe

        if (said := await _probe("qq", qq_probe(settings.qq), report)) is not None:
            report.ok(f"qq: {said}")


async def _probe(label: str, check: Coroutine[Any, Any, str], report: Report) -> str | None:
    try:
        return await asyncio.wait_for(check, MODEL_CHECK_TIMEOUT_S)
    except Exception as exc:  # the SDK's errors, a timeout, a missing secret: all say what is wrong
        report.fail(f"{label}: {exc or type(exc).__name__}")
        return None
