"""The A2A server (protocol 1.0, on the official `a2a-sdk`): other agents hand Ember work.

An A2A task is an Ember turn: its context id names the session
(`a2a:<key>:<context id>`), its message id is the message's idempotency key,
and the turn's output is relayed as the task's events: deltas as chunks of the
`answer` artifact, tool calls as `working` status messages, an approval request
as `input-required` (the next message in the task answers it: yes, always or
no), the committed answer as the whole artifact (it replaces the chunks) and
`completed`; an error as `failed`. Callers authenticate with the gateway's
bearer keys, and see only their own tasks (the SDK's task store is partitioned
by the key's name). The task records are kept in `EMBER_HOME/a2a.db`, so a
restart keeps them; the turns, as every turn, are in the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path

from a2a.auth.user import UnauthenticatedUser, User
from a2a.helpers import new_task_from_user_message, new_text_part
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.context import ServerCallContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import DefaultServerCallContextBuilder, create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import DatabaseTaskStore, InMemoryTaskStore, TaskUpdater
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    HTTPAuthSecurityScheme,
    SecurityRequirement,
    SecurityScheme,
    StringList,
    TaskState,
)
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from starlette.requests import Request
from starlette.routing import BaseRoute

from ember import __version__
from ember.channels.gateway.turns import TurnRouter, chat_id
from ember.core.events import OutboundEvent, OutboundKind
from ember.core.tools import Decision, ToolSpec, decision_from_reply
from ember.runtime.approvals import ApprovalBroker, Resolution

CHANNEL = "a2a"
RPC_PATH = "/a2a"
CARD_PATH = "/.well-known/agent-card.json"
ANSWER_ARTIFACT = "answer"
APPROVAL_HINT = 'Reply "yes" to allow it once, "always" for the rest of this context, or "no" to deny it.'

# Every JSON-RPC error the SDK answers is a warning in its own logger; the caller gets the error.
logging.getLogger("a2a").setLevel(logging.ERROR)


def agent_card(*, name: str, description: str, url: str, tools: list[ToolSpec]) -> AgentCard:
    """What another agent learns before it calls: the endpoint, streaming, the bearer scheme, and
    the skills (a conversation, and what Ember's tools let it do)."""
    skills = [AgentSkill(id="conversation", name="Conversation",
                         description="Answers requests and carries them out over several turns, "
                                     "remembering what it was told.", tags=["chat", "memory"])]
    skills += [AgentSkill(id=f"tool-{spec.name}", name=spec.name, description=spec.description, tags=["tool"])
               for spec in tools]
    return AgentCard(
        name=name, description=description, version=__version__,
        supported_interfaces=[AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version="1.0")],
        capabilities=AgentCapabilities(streaming=True), default_input_modes=["text/plain"],
        default_output_modes=["text/plain"], skills=skills,
        security_schemes={"bearer": SecurityScheme(http_auth_security_scheme=HTTPAuthSecurityScheme(
            scheme="bearer", description="an Ember gateway key"))},
        security_requirements=[SecurityRequirement(schemes={"bearer": StringList(list=[])})])


class _Caller(User):
    def __init__(self, name: str) -> None:
        self._name = name

    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def user_name(self) -> str:
        return self._name


class _GatewayIdentity(DefaultServerCallContextBuilder):
    """The caller is the gateway key the identity gate already checked (request.state.identity)."""

    def build_user(self, request: Request) -> User:
        identity = getattr(request.state, "identity", None)
        return _Caller(identity) if identity else UnauthenticatedUser()


def _owner(context: ServerCallContext) -> str:
    if not context.user.is_authenticated:  # the identity gate lets no such call through
        raise PermissionError("an A2A call without a caller reached the task store")
    return context.user.user_name


@dataclass
class _Turn:
    """An Ember turn relayed into an A2A task; kept while the task waits for an approval answer."""

    events: asyncio.Queue[OutboundEvent]  # open while `exit` is
    exit: AsyncExitStack
    session_key: str
    approval_id: str | None = None
    chunks: int = 0
    draft: list[str] = field(default_factory=list)


class EmberExecutor(AgentExecutor):
    def __init__(self, router: TurnRouter, approvals: ApprovalBroker) -> None:
        self._router = router
        self._approvals = approvals
        self._turns: dict[str, _Turn] = {}

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        caller = context.call_context.user.user_name if context.call_context else ""
        if context.current_task is None:
            await event_queue.enqueue_event(new_task_from_user_message(context.message))
        task = TaskUpdater(event_queue, context.task_id, context.context_id)
        text = context.get_user_input()
        turn = self._turns.pop(context.task_id, None)
        if turn is not None:  # the answer to the approval the task is waiting on
            await self._answer(turn, caller, text)
        else:
            turn = await self._start(caller, context, text)
        parked = False
        try:
            parked = await self._relay(turn, task)
        finally:
            if parked:
                self._turns[context.task_id] = turn
            else:
                await turn.exit.aclose()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        """The task is cancelled; a turn waiting on an approval is answered "no" so that it ends.
        A running turn finishes on its own, and its answer stays in the session."""
        turn = self._turns.pop(context.task_id or "", None)
        if turn is not None:
            if turn.approval_id is not None:
                await self._approvals.resolve(turn.approval_id, Decision.DENY, by="a2a cancel",
                                              scope=turn.session_key)
            await turn.exit.aclose()

    async def _start(self, caller: str, context: RequestContext, text: str) -> _Turn:
        stack = AsyncExitStack()
        message_id = context.message.message_id if context.message else None
        events = await stack.enter_async_context(self._router.turn(
            caller, context.context_id or "", text, stream=True, can_approve=True, client_id=message_id or None))
        return _Turn(events, stack, f"{CHANNEL}:{chat_id(caller, context.context_id or '')}")

    async def _answer(self, turn: _Turn, caller: str, text: str) -> None:
        decision = decision_from_reply(text)
        if turn.approval_id is not None:
            outcome = await self._approvals.resolve(turn.approval_id, decision, by=caller, scope=turn.session_key)
            if outcome is not Resolution.RESOLVED:
                logging.getLogger(__name__).info("approval %s was %s", turn.approval_id, outcome.value)
        turn.approval_id = None

    async def _relay(self, turn: _Turn, task: TaskUpdater) -> bool:
        """Relay the turn's events until it ends (False) or waits for an approval answer (True)."""
        await task.start_work()
        while True:
            event: OutboundEvent = await turn.events.get()
            if event.kind is OutboundKind.DELTA:
                await task.add_artifact([new_text_part(event.text)], artifact_id=ANSWER_ARTIFACT, name="answer",
                                        append=turn.chunks > 0, last_chunk=False)
                turn.chunks += 1
            elif event.kind is OutboundKind.TOOL_CALL:
                await task.update_status(TaskState.TASK_STATE_WORKING,
                                         message=task.new_agent_message([new_text_part(f"→ {event.text}")]))
            elif event.kind is OutboundKind.APPROVAL_REQUEST:
                assert event.approval is not None
                turn.approval_id = event.approval.id
                await task.requires_input(task.new_agent_message([new_text_part(f"{event.text}\n{APPROVAL_HINT}")]))
                return True
            elif event.kind is OutboundKind.FINAL:
                # The committed answer replaces the streamed chunks: one copy, whatever the draft was.
                await task.add_artifact([new_text_part(event.text)], artifact_id=ANSWER_ARTIFACT, name="answer",
                                        append=False, last_chunk=True,
                                        metadata={"delivery_id": event.delivery_id} if event.delivery_id else None)
                await task.complete()
                return False
            elif event.kind is OutboundKind.ERROR:
                await task.failed(task.new_agent_message([new_text_part(event.text)]))
                return False


@dataclass
class A2AServer:
    """The A2A channel's routes on the gateway port, and what must be closed at the end."""

    router: TurnRouter
    handler: DefaultRequestHandler
    routes: list[BaseRoute]
    engine: AsyncEngine | None = None

    async def aclose(self) -> None:
        await self.handler.aclose()
        if self.engine is not None:
            await self.engine.dispose()


def _adopt_named_table(path: Path) -> None:
    """The task records of a home whose file keeps them as `a2a_tasks`, renamed to the SDK's `tasks`.
    Run once at start, before the gateway serves (a file of its own: nothing else waits on it)."""
    if not path.exists():
        return
    with contextlib.closing(sqlite3.connect(path)) as raw, raw:
        names = {row[0] for row in raw.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "a2a_tasks" in names and "tasks" not in names:
            raw.execute("ALTER TABLE a2a_tasks RENAME TO tasks")


def a2a_server(router: TurnRouter, approvals: ApprovalBroker, card: AgentCard,
               tasks_path: Path | None = None) -> A2AServer:
    """`tasks_path`: the SQLite file the task records are kept in (a file of their own, so the SDK's
    writes never wait on Ember's); None keeps them in memory."""
    if tasks_path is not None:
        _adopt_named_table(tasks_path)
    engine = create_async_engine(f"sqlite+aiosqlite:///{tasks_path}") if tasks_path is not None else None
    # The SDK's own table name: any other makes it declare a second TaskModel class on its shared
    # declarative base, which SQLAlchemy warns about at every start.
    store = (DatabaseTaskStore(engine, owner_resolver=_owner) if engine is not None
             else InMemoryTaskStore(owner_resolver=_owner))
    handler = DefaultRequestHandler(agent_executor=EmberExecutor(router, approvals), task_store=store,
                                    agent_card=card)
    routes: list[BaseRoute] = [
        *create_agent_card_routes(card, card_url=CARD_PATH),
        *create_jsonrpc_routes(handler, RPC_PATH, context_builder=_GatewayIdentity(), enable_v0_3_compat=True),
    ]
    return A2AServer(router, handler, routes, engine)
