"""The gateway's wire shapes (pydantic at the edge) and the OpenAPI document built from them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

from ember.core.memory import MAX_CONTENT_CHARS, MemoryKind, MemoryStatus
from ember.memory.service import MAX_LIMIT as MAX_SEARCH_LIMIT

SESSION_KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}$"
# A person's name as a chat shows it: letters of any script, digits, spaces and a little punctuation.
NAME_PATTERN = r"^[\p{L}\p{N}][\p{L}\p{N}_ .'-]{0,63}$"


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


class MessageRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str = Field(min_length=1, description="The user's message.")
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


# Patterns that mean the same to Python and to JSON Schema's regex dialect (whose `\w` and `\s`
# differ from Python's): a query needs a letter or a digit (the route checks the same, 400), and
# content needs a character that is not one of those `str.strip` removes (the core's check, 422).
MEMORY_QUERY_PATTERN = r"[\p{L}\p{N}]"
NOT_BLANK_PATTERN = r"[^\t-\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
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


_SCHEMAS: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest, MessageRequest, ApprovalAnswer, ErrorBody, ChatCompletion, ModelList, SessionList,
    History, TurnStopping, Health, PendingApprovals, ApprovalAnswered, MemoryWrite, MemoryCorrection, MemoryItem,
    MemoryList, MemoryHits,
)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type[BaseModel], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(model)}}}


# One Server-Sent Event: its `event` type (absent on the OpenAI stream) and its JSON `data`.
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}
_SSE = {"description": "Server-Sent Events: delta, tool_call, tool_result, approval_request, final, error",
        "content": {"text/event-stream": {"schema": _SSE_EVENT}}}
_APPROVAL_PARAM = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
_SESSION_PARAM = {
    "name": "key", "in": "path", "required": True,
    "schema": {"type": "string", "pattern": SESSION_KEY_PATTERN},
}
_MEMORY_PARAM = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
_MEMORY_FILTERS = [
    {"name": "kind", "in": "query", "required": False, "style": "form", "explode": True,
     "description": "Only these tiers (repeat it for several); every tier by default",
     "schema": {"type": "array", "items": {"type": "string", "enum": [kind.value for kind in MemoryKind]}}},
    {"name": "all", "in": "query", "required": False, "schema": {"type": "boolean", "default": False},
     "description": "Include superseded, archived and pending memories"},
]
_QUERY_PARAM = {"name": "q", "in": "query", "required": True, "description": "What to look for",
                "schema": {"type": "string", "minLength": 1, "maxLength": MAX_QUERY_CHARS,
                           "pattern": MEMORY_QUERY_PATTERN}}


_EVALUATION_HEADER = {"name": "X-Ember-Evaluation", "in": "header", "required": False,
                      "schema": {"type": "string", "enum": ["true", "false"], "default": "false"},
                      "description": "true: the session this message starts is an evaluation run and leaves "
                                     "no memory (on a session that exists already it changes nothing)"}


def _limit_param(default: int, most: int) -> dict[str, Any]:
    return {"name": "limit", "in": "query", "required": False,
            "schema": {"type": "integer", "minimum": 1, "maximum": most, "default": default}}


def _errors(*codes: int) -> dict[str, Any]:
    meaning = {400: "Bad request", 401: "Missing or wrong API key", 404: "Not found", 405: "Wrong method",
               409: "Already answered, or being answered",
               410: "Expired: nobody answered in time, or its turn ended without it",
               413: "Body too large", 415: "Body is not JSON", 422: "Invalid body", 429: "Too many requests",
               502: "The turn failed"}
    return {str(code): _json(ErrorBody, meaning[code]) for code in codes}


def _operation(summary: str, responses: dict[str, Any], *, body: type[BaseModel] | None = None,
               params: list[dict[str, Any]] | None = None, public: bool = False) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": responses}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(body)}}}
    if params:
        op["parameters"] = params
    if public:
        op["security"] = []
    else:
        op["responses"] = {**responses, **_errors(401, 429)}
    return op


def openapi_document(title: str, version: str) -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    for model in _SCHEMAS:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    session_header = [{"name": "X-Ember-Session", "in": "header", "required": False,
                       "schema": {"type": "string", "pattern": SESSION_KEY_PATTERN},
                       "description": "The session. Without it or the user field, the messages before the new "
                                      "one continue the caller's session holding them, or start one seeded "
                                      "with them; the response's X-Ember-Session names it"},
                      {"name": "Idempotency-Key", "in": "header", "required": False,
                       "schema": {"type": "string", "pattern": CLIENT_ID_PATTERN}},
                      _EVALUATION_HEADER]
    body_errors = _errors(400, 413, 415, 422)
    paths = {
        "/v1/chat/completions": {"post": _operation(
            "OpenAI-compatible chat completion (stream or not); the server keeps the history",
            {"200": {"description": "A completion, or its stream of chunks",
                     "content": {"application/json": {"schema": _ref(ChatCompletion)},
                                 "text/event-stream": {"schema": _SSE_EVENT}}},
             **body_errors, **_errors(409, 502)},
            body=ChatCompletionRequest, params=session_header)},
        "/v1/models": {"get": _operation("The agents this gateway serves", {"200": _json(ModelList, "Agents")})},
        "/api/sessions": {"get": _operation("The caller's sessions", {"200": _json(SessionList, "Sessions")})},
        "/api/sessions/{key}/messages": {
            "get": _operation("A session's committed history",
                              {"200": _json(History, "Messages"), **_errors(400, 404)}, params=[_SESSION_PARAM]),
            "post": _operation("Send a message; the answer streams back as Server-Sent Events",
                               {"200": _SSE, **body_errors, **_errors(409)}, body=MessageRequest,
                               params=[_SESSION_PARAM, _EVALUATION_HEADER]),
        },
        "/api/sessions/{key}/stop": {"post": _operation(
            "Stop the turn running in a session; what it committed stays, and its history says it was stopped",
            {"202": _json(TurnStopping, "Stopping"), **_errors(400, 404, 409)}, params=[_SESSION_PARAM])},
        "/api/approvals": {"get": _operation("The caller's approval requests waiting for an answer",
                                             {"200": _json(PendingApprovals, "Pending requests")})},
        "/api/approvals/{id}": {"post": _operation(
            "Answer an approval request", {"200": _json(ApprovalAnswered, "Answered"), **body_errors,
                                           **_errors(404, 409, 410)},
            body=ApprovalAnswer, params=[_APPROVAL_PARAM])},
        "/api/memory": {
            "get": _operation("The caller's memories, newest first (active ones unless all=true)",
                              {"200": _json(MemoryList, "Memories"), **_errors(400)},
                              params=[*_MEMORY_FILTERS, _limit_param(100, MAX_LIST_LIMIT)]),
            "post": _operation("Remember a fact the caller states",
                               {"201": _json(MemoryItem, "Remembered"),
                                "200": _json(MemoryItem, "Already remembered: the existing memory"), **body_errors},
                               body=MemoryWrite),
        },
        "/api/memory/search": {"get": _operation(
            "The caller's memories best matching q, by words and by meaning",
            {"200": _json(MemoryHits, "Hits, best first"), **_errors(400)},
            params=[_QUERY_PARAM, *_MEMORY_FILTERS, _limit_param(10, MAX_SEARCH_LIMIT)])},
        "/api/memory/{id}": {
            "patch": _operation(
                "Correct an active fact: a fact the caller states, of the same subject and key, supersedes it",
                {"200": _json(MemoryItem, "The fact as it reads now"), **body_errors, **_errors(404),
                 "405": _json(ErrorBody, "The id 'search': that path is the search route's")},
                body=MemoryCorrection, params=[_MEMORY_PARAM]),
            "delete": _operation(
                "Forget a memory: archived, never recalled again, still listed with all=true",
                {"200": _json(MemoryItem, "The archived memory"), **_errors(404),
                 "405": _json(ErrorBody, "The id 'search': that path is the search route's")},
                params=[_MEMORY_PARAM])},
        "/healthz": {"get": _operation("Liveness", {"200": _json(Health, "Alive")}, public=True)},
        "/metrics": {"get": _operation("Prometheus metrics", {"200": {
            "description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}})},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
