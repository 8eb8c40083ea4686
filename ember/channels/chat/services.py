"""What every chat platform's channel needs of the runtime, handed over as one value."""

from __future__ import annotations

from dataclasses import dataclass

from ember.bus.base import InboundPublisher
from ember.channels.attachments import FileShelf
from ember.memory.identity import Identities
from ember.runtime.approvals import ApprovalBroker
from ember.store.protocols import ApprovalLog, Inbox, PlatformMessages


@dataclass(frozen=True, slots=True)
class ChatServices:
    """The bus its messages go on; the inbox that keeps a message from being taken twice; the
    messages it showed of each answer (so a re-sent final edits them); the approvals it answers in
    the chat; who each chat user is; where the photos and documents people send go."""

    bus: InboundPublisher
    inbox: Inbox
    messages: PlatformMessages
    approvals: ApprovalBroker
    approval_rows: ApprovalLog
    identities: Identities
    files: FileShelf
