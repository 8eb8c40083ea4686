"""The runtime's store protocols (ember/store/protocols.py) and their one implementation each:
every method a protocol names exists on its `Sql…` class with the same signature, so that a
consumer written against the protocol runs on the class unchanged, on either engine. The same for
the memory service and the protocols its consumers name (ember/memory/protocols.py)."""

from __future__ import annotations

import inspect

import pytest

from ember.memory import protocols as memory_protocols
from ember.memory.service import MemoryService
from ember.store import protocols
from ember.store.approvals import SqlApprovalStore
from ember.store.channel_messages import SqlChannelMessages
from ember.store.conversations import SqlConversationIndex
from ember.store.deliveries import SqlDeliveryStore
from ember.store.jobs import SharedJobStore, SqlJobStore
from ember.store.memories import SqlMemoryStore
from ember.store.sessions import SqlSessionStore
from ember.store.skills import SqlSkillStore
from ember.store.tasks import SqlTaskStore
from ember.store.traces import SqlTraceStore
from ember.store.usage import SqlUsageStore

IMPLEMENTATIONS = {
    protocols.SessionStore: SqlSessionStore,
    protocols.SessionBrowser: SqlSessionStore,
    protocols.SessionTitles: SqlSessionStore,
    protocols.Inbox: SqlDeliveryStore,
    protocols.Outbox: SqlDeliveryStore,
    protocols.DeliveryStore: SqlDeliveryStore,
    protocols.JobQueue: SqlJobStore,
    protocols.SharedJobQueue: SharedJobStore,
    protocols.TraceLog: SqlTraceStore,
    protocols.TraceReader: SqlTraceStore,
    protocols.JobCounts: SqlJobStore,
    protocols.TaskBook: SqlTaskStore,
    protocols.ChannelMessages: SqlChannelMessages,
    protocols.ChatCounters: SqlChannelMessages,
    protocols.PlatformMessages: SqlChannelMessages,
    protocols.ApprovalLog: SqlApprovalStore,
    protocols.ConversationIndex: SqlConversationIndex,
    protocols.DueTasks: SqlTaskStore,
    protocols.UsageLedger: SqlUsageStore,
    protocols.UsageReport: SqlUsageStore,
    protocols.MemoryStore: SqlMemoryStore,
    protocols.MemoryRecall: SqlMemoryStore,
    protocols.MemoryWrites: SqlMemoryStore,
    protocols.EmbeddingQueue: SqlMemoryStore,
    protocols.MemoryUpkeep: SqlMemoryStore,
    protocols.MemoryAdmin: SqlMemoryStore,
    protocols.TextRows: SqlMemoryStore,
    protocols.VectorRows: SqlMemoryStore,
    protocols.SkillStore: SqlSkillStore,
}


def methods(protocol: type, module: str = protocols.__name__) -> dict[str, object]:
    return {name: member for klass in protocol.__mro__ if klass.__module__ == module
            for name, member in vars(klass).items() if inspect.iscoroutinefunction(member)}


def test_every_protocol_of_the_module_has_an_implementation() -> None:
    declared = {value for value in vars(protocols).values()
                if inspect.isclass(value) and value.__module__ == protocols.__name__}
    assert declared == set(IMPLEMENTATIONS)


@pytest.mark.parametrize("protocol", list(IMPLEMENTATIONS), ids=lambda p: p.__name__)
def test_the_implementation_has_each_method_with_the_protocols_signature(protocol: type) -> None:
    implementation = IMPLEMENTATIONS[protocol]
    assert methods(protocol), f"{protocol.__name__} names no method"
    for name, declared in methods(protocol).items():
        actual = getattr(implementation, name, None)
        assert inspect.iscoroutinefunction(actual), f"{implementation.__name__}.{name} is missing or not async"
        assert inspect.signature(actual) == inspect.signature(declared), f"{implementation.__name__}.{name}"



@pytest.mark.parametrize("protocol", [memory_protocols.PromptRecall, memory_protocols.PersonalMemory,
                                      memory_protocols.ReviewedMemory], ids=lambda p: p.__name__)
def test_the_memory_service_is_each_of_its_consumers_protocols(protocol: type) -> None:
    def shape(method: object) -> list[tuple[str, object, object]]:
        return [(p.name, p.kind, p.annotation) for p in inspect.signature(method).parameters.values()]  # type: ignore[arg-type]

    for name, declared in methods(protocol, memory_protocols.__name__).items():
        actual = getattr(MemoryService, name, None)
        assert inspect.iscoroutinefunction(actual), f"MemoryService.{name} is missing or not async"
        assert shape(actual) == shape(declared), f"MemoryService.{name}"
