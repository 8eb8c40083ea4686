"""The gateway's wire shapes (pydantic at the edge); gateway/openapi.py documents them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

from ember.core.memory import MAX_CONTENT_CHARS, MemoryKind, MemoryStatus

SESSION_KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}$"
# A person's name as a chat shows it: letters of any script, digits, spaces and a little punctuation.
NAME_PATTERN = r"^[\p{L}\p{N}][\p{L}\p{N}_ .'-]{0,63}$"
# Text that is not blank: a character that is not one of those `str.strip` removes.
NOT_BLANK_PATTERN = r"[^\t-\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    # Who wrote a user message, when the client relays a chat of several people: their memories
    # of what each one said carry the name.
    name: str | None = Field(default=None, pattern=NAME_PATTERN)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content if part.type == "text" and part.text)
        return self.content or ""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = Field(default=False, description="A last chunk, before [DONE], with the turn's usage")


class ChatCompletionRequest(BaseModel):
    """The OpenAI request. Ember keeps the history itself: only the last user message is new
    (the earlier ones find or seed the session when none is named). max_tokens (or
    max_completion_tokens), temperature and top_p reach each model call of the turn, within the
    gateway's caps; every other field (n, stop, seed, tools, response_format, penalties, ...) is
    accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[ChatMessage] = Field(
        min_length=1,
        # Documents what the route checks: a user message with text (the last one is the new message).
        json_schema_extra={"contains": {"type": "object", "required": ["role", "content"],
                                        "properties": {"role": {"const": "user"},
                                                       "content": {"anyOf": [{"type": "string", "pattern": r"\S"},
                                                                             {"type": "array", "minItems": 1}]}}}},
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Ranges are documented, not enforced here: the route says what is out of range (400). Strict: true
    # or "7" is not a number.
    max_tokens: int | None = Field(default=None, strict=True, json_schema_extra={"minimum": 1})
    max_completion_tokens: int | None = Field(default=None, strict=True, json_schema_extra={"minimum": 1},
                                              description="The same as max_tokens; either may be sent")
    temperature: float | None = Field(default=None, strict=True, json_schema_extra={"minimum": 0, "maximum": 2})
    top_p: float | None = Field(default=None, strict=True, json_schema_extra={"minimum": 0, "maximum": 1})
    # The pattern is documented, not enforced here: the route says what is wrong with the key (400).
    user: str | None = Field(default=None, json_schema_extra={"pattern": SESSION_KEY_PATTERN},
                             description="The session, when no X-Ember-Session header names one")


CLIENT_ID_PATTERN = r"^[A-Za-z0-9._:@+-]{1,128}$"


class SessionChange(BaseModel):
    model_config = ConfigDict(extra="forbid")
    title: str | None = Field(default=None, max_length=120, description='A name for the session; "" clears it')
    archived: bool | None = Field(default=None, description="Put the session away (true) or back (false)")


class AttachmentUpload(BaseModel):
    model_config = ConfigDict(extra="forbid")
    data: str = Field(description="The file's bytes, base64")
    name: str | None = Field(default=None, max_length=255, description="Its file name, shown with it")
    media_type: str | None = Field(default=None, max_length=127, description="What it says it is (image/png, "
                                   "application/pdf, text/markdown, ...); its bytes decide, and a file that is not "
                                   "what it says is refused")


class MessageRequest(BaseModel):
    # Documents what the route checks (422 empty_message): text that is not blank, or files.
    model_config = ConfigDict(extra="forbid", json_schema_extra={"anyOf": [
        {"required": ["text"], "properties": {"text": {"pattern": NOT_BLANK_PATTERN}}},
        {"required": ["attachments"], "properties": {"attachments": {"minItems": 1}}}]})
    text: str = Field(default="", description="The user's message; it may be empty when files come with it.")
    attachments: list[AttachmentUpload] = Field(
        default_factory=list, max_length=16,
        description="Files sent with the message: images (PNG, JPEG, GIF, WebP), PDFs and UTF-8 text documents, "
                    "at most attachment_max_bytes together")
    agent: str | None = Field(default=None, description="The named agent ([agents.NAME]) to answer; unset: the "
                                                        "session's, else the default agent")
    # The pattern is documented, not enforced here: the route says what is wrong with the id (400).
    message_id: str | None = Field(
        default=None, json_schema_extra={"pattern": CLIENT_ID_PATTERN},
        description="Your id for this message: sent again (after a timeout, say), it gets the recorded "
                    "answer instead of a second turn")


class ApprovalAnswer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    decision: Literal["approve_once", "approve_session", "deny"] = Field(
        description="approve_once; approve_session: this tool unasked for the rest of the session; deny")


class ApprovalExplanation(BaseModel):
    text: str
    risk: str = Field(description="low, medium or high: the approval model's rating")
    reason: str


class PendingApproval(BaseModel):
    id: str
    session: str
    tool: str
    risk: str
    subject: str
    summary: str
    timeout_s: float
    explanation: ApprovalExplanation | None = Field(
        default=None, description="the approval model's reading of the full call; absent when it failed or was slow")


class PendingApprovals(BaseModel):
    approvals: list[PendingApproval]


class ApprovalAnswered(BaseModel):
    id: str
    decision: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None = None
    param: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop"] = "stop"


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int = Field(description="Every model call's prompt, the cached part included")
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = Field(default=None, description="The turn's tokens, over all its model calls")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ember"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class SessionInfo(BaseModel):
    key: str
    messages: int
    updated_at: float


class SessionList(BaseModel):
    sessions: list[SessionInfo]


class StoredToolCall(BaseModel):
    id: str
    name: str
    arguments: str


class StoredMessage(BaseModel):
    seq: int | None  # None for an error record, which is not a message the model reads
    role: str
    content: str
    tool_calls: list[StoredToolCall]
    tool_call_id: str | None
    turn_id: str | None
    name: str | None = None
    # "error": how a turn that never answered ended (it failed, or was stopped); `message_id` is the
    # client's id of its question, which a retry sends again.
    kind: Literal["message", "error"] = "message"
    message_id: str | None = None


class TurnStopping(BaseModel):
    key: str
    turn_id: str
    status: Literal["stopping"]


class History(BaseModel):
    key: str
    messages: list[StoredMessage]


class Health(BaseModel):
    status: Literal["ok"]


# A pattern that means the same to Python and to JSON Schema's regex dialect (whose `\w` and `\s`
# differ from Python's), as NOT_BLANK_PATTERN does: a query needs a letter or a digit (the route
# checks the same, 400).
MEMORY_QUERY_PATTERN = r"[\p{L}\p{N}]"
MAX_QUERY_CHARS = 1_000
MAX_LABEL_CHARS = 200
MAX_LIST_LIMIT = 1_000


class MemoryWrite(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # The pattern is documented, not enforced here: the core's own check says the content is blank (422).
    content: str = Field(max_length=MAX_CONTENT_CHARS, json_schema_extra={"pattern": NOT_BLANK_PATTERN},
                         description="What to remember: a fact or a summary")
    subject: str | None = Field(default=None, max_length=MAX_LABEL_CHARS, description="Whom or what it is about")
    key: str | None = Field(default=None, max_length=MAX_LABEL_CHARS,
                            description="The attribute: a new fact with the same subject and key replaces the old one")


class MemoryCorrection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    content: str = Field(max_length=MAX_CONTENT_CHARS, json_schema_extra={"pattern": NOT_BLANK_PATTERN},
                         description="The fact as it should read now")


class MemoryItem(BaseModel):
    """A memory as `ember memory list --json` prints it."""

    id: str
    content: str
    kind: MemoryKind
    subject: str | None
    key: str | None
    status: MemoryStatus
    created_at: float
    source: str | None
    source_rank: str
    session_key: str | None
    seq_start: int | None
    seq_end: int | None
    valid_from: float
    invalid_at: float | None
    superseded_by: str | None
    recall_count: int
    last_recalled_at: float | None
    strength: float


class MemoryHit(MemoryItem):
    score: float = Field(description="Fused relevance; higher is better")


class MemoryList(RootModel[list[MemoryItem]]):
    """Newest first."""


class MemoryHits(RootModel[list[MemoryHit]]):
    """Best first, as `ember memory search --json` prints them."""
