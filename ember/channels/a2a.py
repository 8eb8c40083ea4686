"""The A2A server (protocol 1.0, on the official `a2a-sdk`): other agents hand Ember work.

An A2A task is an Ember turn: its context id names the session
(`a2a:<key>:<context id>`), its message id is the message's idempotency key,
and the turn's output is relayed as the task's events: deltas as chunks of the
`answer` artifact, tool calls as `working` status messages, an approval request
as `input-required` (the next message in the task answers it: yes, always or
no), the committed answer as the whole artifact (it replaces the chunks) and
`completed`; an error as `failed`. Callers authenticate with the gateway's
bearer keys, and see only their own tasks (the SDK's task store is partitioned
by the key's name). The task records are in Ember's store (store/a2a_tasks.py), with the turns:
a restart keeps them, and every gateway on one database reads, cancels and streams the same tasks.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

from a2a.auth.user import UnauthenticatedUser, User
from a2a.helpers import new_task_from_user_message, new_text_part
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.cluster import TaskEventStream, VersionedTaskStore
from a2a.server.context import ServerCallContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import DefaultServerCallContextBuilder, create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import TaskUpdater
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
from starlette.requests import Request
from starlette.routing import BaseRoute

from ember import __version__
from ember.channels.gateway.turns import TurnRequest, TurnRouter, chat_id
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


def task_owner(context: ServerCallContext) -> str:
    """Whose task a call reads and writes: the caller's key name."""
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
    watch: asyncio.Task[None] | None = None  # while parked: whether another gateway cancels the task


# How often a turn waiting for an approval answer looks whether its task was cancelled through
# another gateway (which writes the store only).
CANCEL_POLL_S = 1.0


class EmberExecutor(AgentExecutor):
    def __init__(self, router: TurnRouter, approvals: ApprovalBroker, tasks: VersionedTaskStore,
                 poll_s: float = CANCEL_POLL_S) -> None:
        self._router = router
        self._approvals = approvals
        self._tasks = tasks
        self._poll_s = poll_s
        self._turns: dict[str, _Turn] = {}

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        caller = context.call_context.user.user_name if context.call_context else ""
        if context.current_task is None:
            await event_queue.enqueue_event(new_task_from_user_message(context.message))
        task = TaskUpdater(event_queue, context.task_id, context.context_id)
        text = context.get_user_input()
        turn = self._unpark(context.task_id)
        if turn is not None:  # the answer to the approval the task is waiting on
            await self._answer(turn, caller, text)
        else:
            turn = await self._start(caller, context, text)
        parked = False
        try:
            parked = await self._relay(turn, task)
        finally:
            if parked and context.call_context is not None:
                self._turns[context.task_id] = turn
                turn.watch = asyncio.create_task(self._watch(context.task_id, context.call_context))
            else:
                await turn.exit.aclose()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        """The task is cancelled; a turn waiting on an approval is answered "no" so that it ends.
        A running turn finishes on its own, and its answer stays in the session."""
        turn = self._unpark(context.task_id or "")
        if turn is not None:
            await self._deny(turn)

    async def aclose(self) -> None:
        for task_id in list(self._turns):
            turn = self._unpark(task_id)
            assert turn is not None
            await turn.exit.aclose()

    def _unpark(self, task_id: str) -> _Turn | None:
        turn = self._turns.pop(task_id, None)
        if turn is not None and turn.watch is not None and turn.watch is not asyncio.current_task():
            turn.watch.cancel()
        return turn

    async def _deny(self, turn: _Turn) -> None:
        if turn.approval_id is not None:
            await self._approvals.resolve(turn.approval_id, Decision.DENY, by="a2a cancel", scope=turn.session_key)
        await turn.exit.aclose()

    async def _watch(self, task_id: str, call: ServerCallContext) -> None:
        """A parked turn's task cancelled through another gateway: its approval is answered "no" here."""
        while task_id in self._turns:
            await asyncio.sleep(self._poll_s)
            try:
                stored = await self._tasks.get(task_id, call)
            except Exception:  # the store is down for now: the next look may find it
                logging.getLogger(__name__).warning("could not read A2A task %s", task_id, exc_info=True)
                continue
            if stored is None or stored.task.status.state == TaskState.TASK_STATE_CANCELED:
                turn = self._unpark(task_id)
                if turn is not None:
                    await self._deny(turn)
                return

    async def _start(self, caller: str, context: RequestContext, text: str) -> _Turn:
        stack = AsyncExitStack()
        message_id = context.message.message_id if context.message else None
        events = await stack.enter_async_context(self._router.turn(TurnRequest(
            caller, context.context_id or "", text, stream=True, can_approve=True, client_id=message_id or None)))
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
    executor: EmberExecutor
    routes: list[BaseRoute]

    async def aclose(self) -> None:
        await self.handler.aclose()
        await self.executor.aclose()


def a2a_server(router: TurnRouter, approvals: ApprovalBroker, card: AgentCard, tasks: VersionedTaskStore,
               events: TaskEventStream) -> A2AServer:
    """`tasks` keeps the task records (by `task_owner`); `events` carries a task's events to a
    stream resubscribed through another gateway than the one running it."""
    executor = EmberExecutor(router, approvals, tasks)
    handler = DefaultRequestHandler(agent_executor=executor, task_store=tasks, agent_card=card, event_stream=events)
    routes: list[BaseRoute] = [
        *create_agent_card_routes(card, card_url=CARD_PATH),
        *create_jsonrpc_routes(handler, RPC_PATH, context_builder=_GatewayIdentity(), enable_v0_3_compat=True),
    ]
    return A2AServer(router, handler, executor, routes)
