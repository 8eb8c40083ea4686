"""Composition root: configuration in, a wired and running runtime out.

Every component receives, in its constructor, only the collaborators it calls;
this is the one place that knows them all.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ember.app.database import store_database
from ember.app.models import (
    Models,
    configured_approval_model,
    configured_background_model,
    configured_simple_model,
    configured_speaker,
    metered_models,
)
from ember.app.services import memory_service, skill_library
from ember.app.tools import browser, default_tools
from ember.bus.base import Bus
from ember.bus.memory import InProcessBus
from ember.bus.redis import RedisBus
from ember.bus.redis_support import READER_TTL_MS, RedisBusConfig
from ember.channels.cron import Scheduler
from ember.channels.gateway.turns import CHANNEL as GATEWAY_CHANNEL
from ember.config.settings import Settings
from ember.core.errors import ConfigError
from ember.core.jobs import Job, JobKind
from ember.core.leases import SessionLeases
from ember.core.tasks import CHANNEL as TASK_CHANNEL
from ember.memory.consolidation import ConsolidationWorker
from ember.memory.embeddings import Embedder
from ember.memory.identity import Identities
from ember.memory.prompt import RecallBudget
from ember.memory.reconcile import FactReconciler
from ember.memory.review import MemoryReviewer
from ember.memory.service import MemoryService
from ember.models.base import ModelClient
from ember.models.demo import DEMO_NAME
from ember.models.metered import MeteredModel
from ember.pipeline.agents import AgentTools
from ember.pipeline.context import ContextStage, Persona
from ember.pipeline.inference import InferenceLimits, InferenceStage
from ember.pipeline.response import DerivedWorkPolicy, ResponseStage
from ember.pipeline.voice import SpokenReplies
from ember.runtime.approvals import ApprovalBroker, SharedApprovalBroker
from ember.runtime.background import BackgroundRunner, HostRunner, JobHandler, RetryPolicy, RunnerRight, SharedClaims
from ember.runtime.channels import ChannelHub
from ember.runtime.delegation import Delegations
from ember.runtime.delivery import DeliveryWorker
from ember.runtime.leases import HostLock, LocalLeases, process_name
from ember.runtime.loop import AgentLoop, Pipeline, RecoveryPolicy
from ember.runtime.titles import SessionTitler
from ember.runtime.usage import UsageRecorder
from ember.skills.library import SkillLibrary
from ember.skills.review import SkillReviewer
from ember.store.approvals import SqlApprovalStore
from ember.store.deliveries import SqlDeliveryStore
from ember.store.engine import AdminDatabase, Database
from ember.store.jobs import SharedJobStore, SqlJobStore
from ember.store.leases import LeaderLease, LeaseTable, SqlSessionLeases
from ember.store.sessions import SqlSessionStore
from ember.store.tasks import SqlTaskStore
from ember.store.traces import SqlTraceStore
from ember.store.usage import SqlUsageStore
from ember.tools.approval import ApprovalGate
from ember.tools.base import ToolRegistry, Toolset, Toolsets
from ember.tools.browser import BrowserPool
from ember.tools.delegate import delegate_tool
from ember.tools.mcp import McpHub, start_mcp

if TYPE_CHECKING:
    from ember.runtime.telemetry import Telemetry

log = logging.getLogger(__name__)

# A session on the scripted demo model is an evaluation session (nothing of it is archived, summarised
# or reviewed into memory); what it kept with the remember tool leaves at the first start on a real model.
DEMO_MARKS = {"evaluation": True, "demo": True}
SCHEDULER_LEASE = "scheduler"  # the lease of the process that fires scheduled tasks


def telemetry(settings: Settings) -> Telemetry | None:
    if settings.otel_endpoint is None:
        return None
    from ember.runtime.telemetry import Telemetry  # the OpenTelemetry SDK is imported only when it is on

    return Telemetry(settings.otel_endpoint, service_name=settings.otel_service_name)




@dataclass(slots=True)
class Runtime:
    """The wired parts a command or a test drives."""

    db: AdminDatabase
    sessions: SqlSessionStore
    jobs: SqlJobStore
    traces: SqlTraceStore
    memory: MemoryService
    bus: Bus
    approvals: ApprovalBroker
    runner: BackgroundRunner
    loop: AgentLoop
    consolidation: ConsolidationWorker
    mcp: McpHub
    deliveries: DeliveryWorker
    identities: Identities
    usage: UsageRecorder
    channels: ChannelHub
    tasks: SqlTaskStore
    skills: SkillLibrary
    tools: Toolset  # what the model may call, behind the approval gate
    models: Models  # every model the runtime calls; closed with it
    telemetry: Telemetry | None = None  # OpenTelemetry, when otel_endpoint is set
    lease_table: LeaseTable | None = None  # on a store several processes share
    browser: BrowserPool | None = None  # the browser tool's Chromium, when [browser] is enabled; closed too

    def scheduler(self) -> Scheduler:
        """The channel that fires scheduled tasks; on a shared store, only in the process that leads."""
        if self.lease_table is None:
            return Scheduler(self.bus, self.tasks)
        return Scheduler(self.bus, self.tasks, leader=LeaderLease(self.lease_table, SCHEDULER_LEASE),
                         unstarted=lambda: self.deliveries.store.unstarted([TASK_CHANNEL]))


def _job_handlers(sessions: SqlSessionStore, leases: SessionLeases, background: MeteredModel,
                  memory: MemoryService, skills: SkillLibrary, consolidation: ConsolidationWorker,
                  ) -> dict[str, JobHandler]:
    memory_reviewer = MemoryReviewer(sessions, leases, background, memory)
    skill_reviewer = SkillReviewer(sessions, leases, background, memory, skills, cost=background.cost_of)
    reconciler, titler = FactReconciler(memory, background), SessionTitler(sessions, background)

    def whole(work: Callable[[], Awaitable[object]]) -> JobHandler:
        async def handle(job: Job) -> None:
            await work()
        return handle

    def of_session(work: Callable[[str], Awaitable[object]]) -> JobHandler:
        async def handle(job: Job) -> None:
            if job.session_key is None:
                raise ValueError(f"{job.kind} job {job.id} has no session key")
            await work(job.session_key)
        return handle

    async def review_skills(job: Job) -> None:
        await of_session(lambda key: skill_reviewer.review(key, job.id))(job)
        await skills.curate()

    return {
        JobKind.ARCHIVE: of_session(memory.archive_session),
        JobKind.MEMORY_UPKEEP: whole(memory.upkeep),
        JobKind.RECONCILE_FACTS: whole(reconciler.reconcile),
        JobKind.CONSOLIDATE: of_session(consolidation.consolidate),
        JobKind.EMBED: whole(memory.flush_embeddings),
        JobKind.REVIEW_MEMORY: of_session(memory_reviewer.review),
        JobKind.REVIEW_SKILLS: review_skills,
        JobKind.CURATE_SKILLS: whole(skills.curate),
        JobKind.TITLE_SESSION: of_session(titler.title),
    }


@dataclass(frozen=True, slots=True)
class _Sharing:
    """How this process shares sessions and jobs: with processes on other machines through a shared
    store (fencing lease rows, claimed jobs), or with those of its own home through file locks."""

    leases: SessionLeases
    jobs: SqlJobStore
    runner_right: RunnerRight
    lease_table: LeaseTable | None


def _sharing(settings: Settings, db: Database, process: str) -> _Sharing:
    if settings.database_url is None:
        jobs = SqlJobStore(db)
        return _Sharing(LocalLeases(settings.home_dir / "locks" / "sessions"), jobs,
                        HostRunner(HostLock(settings.home_dir / "locks" / "background-runner"), jobs), None)
    table = LeaseTable(db, process, settings.worker_timeout_s)
    shared = SharedJobStore(db, claimer=process, claim_ttl_s=settings.worker_timeout_s)
    return _Sharing(SqlSessionLeases(table), shared, SharedClaims(shared), table)


def _pipeline(settings: Settings, sessions: SqlSessionStore, memory: MemoryService, skills: SkillLibrary,
              tools: Toolset, models: Models, runner: BackgroundRunner) -> Pipeline:
    persona = Persona(settings.agent_name, settings.system_prompt, settings.intro_template, settings.intro_templates,
                      settings.agents, settings.channel_agents)
    recall = RecallBudget(settings.memory_profile_facts, settings.memory_recall_tokens)
    # The index tells the model to call skill_view: only where it can.
    index = skills if any(spec.name == "skill_view" for spec in tools.specs()) else None
    marks = DEMO_MARKS if models.turns.name == DEMO_NAME else None
    # The scripted demo model has no titles to give.
    titled = settings.session_titles and models.background.name != DEMO_NAME
    derived = DerivedWorkPolicy(settings.consolidation_threshold,
                                frozenset({GATEWAY_CHANNEL}) if titled else frozenset())
    limits = InferenceLimits(settings.max_tool_iterations, settings.review_tool_call_threshold)
    voice = SpokenReplies(configured_speaker(settings, demo=models.turns.name == DEMO_NAME), sessions)
    agents = {name: InferenceStage(models.agents.get(name, models.turns),
                                   AgentTools(tools, spec.tools, f"agent {name}") if spec.tools is not None else tools,
                                   sessions, limits, models.usage, voice=voice)
              for name, spec in settings.agents.items()}
    return Pipeline(context=ContextStage(sessions, memory, persona, Identities(settings.identities), recall,
                                         index, marks),
                    inference=InferenceStage(models.turns, tools, sessions, limits, models.usage, models.simple, voice),
                    response=ResponseStage(sessions, runner, memory, derived, voice), agents=agents)


def approval_broker(settings: Settings, bus: Bus, models: Models, rows: SqlApprovalStore, *,
                    shared: bool) -> ApprovalBroker:
    """The broker of approval requests; `shared`: the store is shared with other processes."""
    if settings.redis_url is not None or shared:  # turns and answers in other processes
        return SharedApprovalBroker(bus, settings.tool_policy.timeout_s, models.explainer, rows)
    return ApprovalBroker(bus, settings.tool_policy.timeout_s, models.explainer, rows)


def with_delegation(settings: Settings, tools: Toolset, delegations: Delegations) -> Toolset:
    """`tools` and, when `[delegation] enabled`, the `delegate` tool that hands tasks to `delegations`."""
    if not settings.delegation.enabled:
        return tools
    agents = {name: spec.description for name, spec in settings.agents.items()}
    return Toolsets(tools, ToolRegistry([delegate_tool(delegations, agents)]))


def usage_recorder(settings: Settings, db: Database) -> UsageRecorder:
    """What model calls cost, held to each person's and each named agent's daily budget."""
    agents = {name: spec.budget_usd_per_day for name, spec in settings.agents.items()
              if spec.budget_usd_per_day is not None}
    return UsageRecorder(SqlUsageStore(db), budgets_usd_per_day=settings.budget_usd_per_day,
                         agent_budgets_usd_per_day=agents)


async def build_runtime(settings: Settings, model: ModelClient, *, tools: Toolset | None = None,
                        embedder: Embedder | None = None, background_model: ModelClient | None = None,
                        approval_model: ModelClient | None = None, simple_model: ModelClient | None = None,
                        ) -> Runtime:
    """`tools` replaces the built-in tools (tests); `embedder` the configured one; `background_model`
    does the background work (default: `model`); `approval_model` explains approval requests (None:
    unexplained); `simple_model` tries simple turns first. Every model call is counted (and priced,
    from `[models]`) in `Runtime.usage`."""
    settings.home_dir.mkdir(parents=True, exist_ok=True)
    identities = Identities(settings.identities)  # checked before anything is opened
    db = store_database(settings)
    await db.open()
    spans = telemetry(settings)
    usage = usage_recorder(settings, db)
    models = metered_models(settings, usage, spans, model, {"background": background_model,
                                                            "approval": approval_model, "simple": simple_model})
    sessions = SqlSessionStore(db)
    memory = memory_service(settings, db, embedder)
    await memory.open()
    process = process_name()
    sharing = _sharing(settings, db, process)
    bus = message_bus(settings, process)
    approvals = approval_broker(settings, bus, models, approval_rows := SqlApprovalStore(db),
                                shared=sharing.lease_table is not None)
    # Servers that fail to start are logged and left out; given tools (tests) use no server.
    mcp = await start_mcp(settings.mcp_servers if tools is None else {})
    tasks, skills = SqlTaskStore(db), skill_library(settings, db)
    await skills.sync()
    browsing = browser(settings, memory) if tools is None else None
    deliveries, traces = DeliveryWorker(SqlDeliveryStore(db), bus), SqlTraceStore(db)
    delegations = Delegations(sharing.leases, deliveries, traces, settings.delegation)
    given = tools if tools is not None else default_tools(settings, mcp, memory, tasks, skills, sessions,
                                                          browsing[0] if browsing else None)
    gated = ApprovalGate(with_delegation(settings, given, delegations), settings.tool_policy, approval_rows)
    consolidation = ConsolidationWorker(sessions, sharing.leases, models.background, memory,
                                        keep_recent=settings.consolidation_keep_recent)
    handlers = _job_handlers(sessions, sharing.leases, models.background, memory, skills, consolidation)
    runner = BackgroundRunner(sharing.jobs, handlers, sharing.runner_right, spans=spans, retry=RetryPolicy(
        max_attempts=settings.job_max_attempts, backoff_base_s=settings.job_backoff_base_s))
    pipeline = _pipeline(settings, sessions, memory, skills, gated, models, runner)
    delegations.bind(pipeline)
    loop = AgentLoop(bus, sharing.leases, sessions, pipeline, traces, approvals, deliveries,
                     RecoveryPolicy(settings.interrupted_turns, settings.resume_window_s), spans,
                     max_turns=settings.max_concurrent_turns)
    return Runtime(
        db=db, sessions=sessions, jobs=sharing.jobs, traces=traces, memory=memory, bus=bus,
        approvals=approvals, runner=runner, loop=loop, consolidation=consolidation, mcp=mcp,
        deliveries=deliveries, identities=identities, usage=usage, channels=ChannelHub(bus, deliveries),
        tasks=tasks, skills=skills, tools=gated, telemetry=spans, models=models,
        lease_table=sharing.lease_table, browser=browsing[1] if browsing else None)


async def configured_runtime(settings: Settings, model: ModelClient, *, own_roles: bool = True) -> Runtime:
    """`build_runtime` as the commands run it: with a model configured (and `own_roles`), the
    background and approval work go to the models `[model_roles]` names for them; else `model`
    does it all."""
    roles = own_roles and settings.model_configured
    return await build_runtime(settings, model,
                               background_model=configured_background_model(settings) if roles else None,
                               approval_model=configured_approval_model(settings, model) if roles else None,
                               simple_model=configured_simple_model(settings) if roles else None)


def require_shared_bus(settings: Settings, command: str) -> None:
    """ConfigError unless the turns can cross processes: a gateway that runs none, and the workers
    that run them, meet on the Redis bus."""
    if settings.redis_url is None:
        raise ConfigError(f"{command} needs the Redis bus, where gateways and the workers that run their "
                          "turns meet: set EMBER_REDIS_URL (and EMBER_DATABASE_URL for processes on several "
                          "machines)")


def message_bus(settings: Settings, process: str | None = None) -> Bus:
    """Redis Streams when `redis_url` is set, else the in-process queues."""
    if settings.redis_url is None:
        return InProcessBus()
    claim_idle_ms = int(settings.worker_timeout_s * 1000)
    # A dead process's outbound stream ends before its messages are taken over: the answers of those
    # then go to the channel's live readers, not into the stream of a process that is gone.
    return RedisBus(settings.redis_url.get_secret_value(), process=process or process_name(),
                    config=RedisBusConfig(namespace=settings.redis_namespace, claim_idle_ms=claim_idle_ms,
                                          reader_ttl_ms=min(READER_TTL_MS, claim_idle_ms // 2)))


@asynccontextmanager
async def running(runtime: Runtime, *, channels: Iterable[str] = (), recover: bool = False,
                  turns: bool = True) -> AsyncIterator[Runtime]:
    """Start the background runner, the delivery worker, the loop and the registered channels;
    stop them in reverse, then the MCP servers (no turn can call them any more), then the store.

    `channels`: those this process serves besides the registered ones (which it serves too),
    whose unconfirmed answers are re-sent.
    `recover`: pick up the turns a crash cut off (resumed or answered with a notice).
    `turns`: run turns and background jobs here; False for a gateway whose workers (`ember worker`,
    on the same store and Redis bus) run them.
    """
    channels = list(dict.fromkeys([*runtime.channels.names, *channels]))
    async with AsyncExitStack() as stack:
        # Each part is stopped, in reverse, if a later one fails to start.
        stack.push_async_callback(runtime.db.close)
        if runtime.telemetry is not None:  # last but the store: the spans of everything that stopped
            stack.callback(runtime.telemetry.shutdown)
        stack.push_async_callback(runtime.memory.close)
        stack.push_async_callback(runtime.skills.close)
        for model in runtime.models.owned:
            stack.push_async_callback(model.aclose)
        stack.push_async_callback(runtime.mcp.close)
        if runtime.browser is not None:
            stack.push_async_callback(runtime.browser.close)
        await runtime.bus.start()
        stack.push_async_callback(runtime.bus.close)  # after the loop and the channels
        await runtime.approvals.recover()
        if runtime.models.turns.name != DEMO_NAME:
            await forget_demo_memories(runtime)
        await runtime.usage.start()
        stack.push_async_callback(runtime.usage.stop)  # after the turns and jobs: their last counts
        if turns:
            await runtime.runner.start()
            stack.push_async_callback(runtime.runner.stop)
        await runtime.runner.schedule(JobKind.CURATE_SKILLS, "all")
        await runtime.deliveries.start(channels, confirming=runtime.channels.confirming)
        stack.push_async_callback(runtime.deliveries.stop)
        if turns:
            await runtime.loop.start()
            stack.push_async_callback(runtime.loop.stop)
        await runtime.channels.start()
        stack.push_async_callback(runtime.channels.stop)  # first: no new messages while turns finish
        if recover:
            await runtime.loop.recover(channels, runtime.channels.capabilities)
        yield runtime


async def forget_demo_memories(runtime: Runtime) -> int:
    """The memories of the demo's sessions, deleted once a real model answers: canned chat must not
    come back as recalled noise. The sessions stay, for their history."""
    demo = await runtime.sessions.marked("demo")
    forgotten = await runtime.memory.store.purge_sessions(demo)
    if forgotten:
        log.info("a real model is configured: forgot %d memories of %d demo sessions", forgotten, len(demo))
    return forgotten
