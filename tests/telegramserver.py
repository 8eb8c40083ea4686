"""A Telegram Bot API server of the tests' own, on 127.0.0.1: the methods Ember's channel
calls (getMe, getUpdates long polling, sendMessage, editMessageText, deleteMessage,
sendChatAction, answerCallbackQuery, setWebhook, deleteWebhook, getFile and the file
download beside them; sendPhoto, sendVoice, sendAudio and sendDocument as multipart uploads), with Telegram's
JSON envelopes and errors: 400 "message is not modified", "message to edit not
found", "can't parse entities" for HTML it would refuse, and 429 with
`parameters.retry_after` when a test asks for one.

Messages are kept as a chat shows them: HTML is rendered to its text (tags gone,
entities unescaped), so a test compares what a person would read.
"""

from __future__ import annotations

import asyncio
import html
import json
import re
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from html.parser import HTMLParser
from typing import Any
from urllib.parse import parse_qs

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.loopback import LoopbackServer

TOKEN = "123456:TEST-token-for-the-fake-bot-api"
BOT_ID = 123456
BOT_USERNAME = "ember_test_bot"
_ALLOWED_TAGS = {"b", "strong", "i", "em", "u", "ins", "s", "strike", "del", "code", "pre", "a", "blockquote",
                 "tg-spoiler", "span"}


class _Render(HTMLParser):
    """Telegram's HTML parse mode: its tags only, balanced; the text as shown."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.text: list[str] = []
        self.open: list[str] = []
        self.error: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag not in _ALLOWED_TAGS:
            self.error = f"Unsupported start tag \"{tag}\""
        self.open.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if not self.open or self.open.pop() != tag:
            self.error = f"Unexpected end tag \"{tag}\""

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def render(text: str, parse_mode: str | None) -> str:
    if parse_mode != "HTML":
        return text
    parser = _Render()
    parser.feed(text)
    parser.close()
    if parser.error or parser.open:
        raise ValueError(f"Bad Request: can't parse entities: {parser.error or 'unclosed tag'}")
    return "".join(parser.text)


@dataclass
class Shown:
    """A message of the bot's, as the chat shows it."""

    message_id: int
    chat_id: int
    text: str
    buttons: list[list[dict[str, Any]]] | None = None
    edits: int = 0
    deleted: bool = False
    file: SentFile | None = None  # a photo, voice note, audio or document the bot sent


@dataclass(frozen=True)
class SentFile:
    method: str  # sendPhoto, sendVoice, sendAudio, sendDocument
    name: str
    data: bytes


@dataclass
class Write:
    at: float
    method: str
    chat_id: int
    ok: bool


@dataclass
class FakeTelegram:
    token: str = TOKEN
    updates: list[dict[str, Any]] = field(default_factory=list)
    shown: dict[int, Shown] = field(default_factory=dict)  # by message id
    writes: list[Write] = field(default_factory=list)
    actions: list[tuple[int, str]] = field(default_factory=list)
    callback_answers: list[dict[str, Any]] = field(default_factory=list)
    webhook: dict[str, Any] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)  # by file_id
    fetched: list[str] = field(default_factory=list)  # the file_ids whose bytes were downloaded
    # method -> retry_after seconds of the 429s to answer its next calls with
    rate_limits: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    _next_update: int = 1000
    _next_message: int = 1
    _user_messages: dict[int, int] = field(default_factory=lambda: defaultdict(lambda: 5000))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # The test's side

    def message(self, chat_id: int, user_id: int, text: str, *, chat_type: str = "private",
                reply_to_bot: int | None = None, first_name: str = "Ana") -> dict[str, Any]:
        """A person's message, queued as an update; the update itself is returned (to replay it)."""
        with self._lock:
            self._user_messages[chat_id] += 1
            message: dict[str, Any] = {
                "message_id": self._user_messages[chat_id], "date": int(time.time()), "text": text,
                "chat": {"id": chat_id, "type": chat_type, **({"title": "Team"} if chat_type != "private" else {})},
                "from": {"id": user_id, "is_bot": False, "first_name": first_name}}
            if reply_to_bot is not None:
                shown = self.shown[reply_to_bot]
                message["reply_to_message"] = {"message_id": shown.message_id, "date": int(time.time()),
                                               "chat": message["chat"], "text": shown.text, "from": self._bot()}
            if text.startswith("@") or f"@{BOT_USERNAME}" in text:
                at = text.find(f"@{BOT_USERNAME}")
                message["entities"] = [{"type": "mention", "offset": at, "length": len(BOT_USERNAME) + 1}]
            return self._queue({"message": message})

    def file_message(self, chat_id: int, user_id: int, data: bytes, *, photo: bool = False, voice: bool = False,
                     caption: str = "", file_name: str = "file", mime_type: str | None = None,
                     file_size: int | None = None) -> dict[str, Any]:
        """A person's photo (offered in two sizes, as Telegram does), voice note or document, its
        bytes served by getFile and the file route."""
        with self._lock:
            self._user_messages[chat_id] += 1
            file_id = f"f{len(self.files) + 1}"
            self.files[file_id] = data
            described = {"file_id": file_id, "file_unique_id": f"u{file_id}",
                         "file_size": len(data) if file_size is None else file_size}
            message: dict[str, Any] = {
                "message_id": self._user_messages[chat_id], "date": int(time.time()),
                "chat": {"id": chat_id, "type": "private"},
                "from": {"id": user_id, "is_bot": False, "first_name": "Ana"}}
            if caption:
                message["caption"] = caption
            if photo:
                self.files[f"{file_id}s"] = data[:64]  # the thumbnail: never the one to fetch
                message["photo"] = [{"file_id": f"{file_id}s", "file_unique_id": f"u{file_id}s", "width": 8,
                                     "height": 8, "file_size": 64}, {**described, "width": 40, "height": 30}]
            elif voice:
                message["voice"] = {**described, "duration": 2, "mime_type": "audio/ogg"}
            else:
                message["document"] = {**described, "file_name": file_name,
                                       **({"mime_type": mime_type} if mime_type else {})}
            return self._queue({"message": message})

    def tap(self, user_id: int, shown: Shown, data: str, *, first_name: str = "Ana") -> dict[str, Any]:
        with self._lock:
            return self._queue({"callback_query": {
                "id": f"cb{self._next_update}", "chat_instance": "ci", "data": data,
                "from": {"id": user_id, "is_bot": False, "first_name": first_name},
                "message": {"message_id": shown.message_id, "date": int(time.time()), "text": shown.text,
                            "chat": {"id": shown.chat_id, "type": "private"}, "from": self._bot()}}})

    def replay(self, update: dict[str, Any]) -> None:
        """Deliver an update again (Telegram does, when it is not sure it was received)."""
        with self._lock:
            self.updates.append(update)

    def unconfirmed(self) -> list[int]:
        """The ids of the updates queued that no getUpdates offset has confirmed yet: the bot's
        poller confirms an update once it has handled it."""
        with self._lock:
            return [u["update_id"] for u in self.updates]

    def visible(self, chat_id: int) -> list[Shown]:
        with self._lock:
            return [m for m in self.shown.values() if m.chat_id == chat_id and not m.deleted]

    def texts(self, chat_id: int) -> list[str]:
        return [m.text for m in self.visible(chat_id)]

    def writes_in(self, chat_id: int) -> list[Write]:
        with self._lock:
            return [w for w in self.writes if w.chat_id == chat_id]

    # The Bot API

    def _bot(self) -> dict[str, Any]:
        return {"id": BOT_ID, "is_bot": True, "first_name": "Ember", "username": BOT_USERNAME}

    def _queue(self, update: dict[str, Any]) -> dict[str, Any]:
        self._next_update += 1
        update = {"update_id": self._next_update, **update}
        self.updates.append(update)
        return update

    async def _api(self, request: Request) -> Response:
        token, method = request.path_params["token"], request.path_params["method"]
        if token != self.token:
            return _error(401, "Unauthorized")
        if request.headers.get("content-type", "").startswith("multipart/form-data"):
            return await self._upload(method, request)
        raw = await request.body()
        if request.headers.get("content-type", "").startswith("application/json"):
            params = json.loads(raw or b"{}")
        else:
            params = {k: v[0] for k, v in parse_qs(raw.decode()).items()}
            params = {k: _maybe_json(v) for k, v in params.items()}
        if method == "getUpdates":
            return await self._get_updates(params)
        with self._lock:
            return self._call(method, params)

    async def _get_updates(self, params: dict[str, Any]) -> Response:
        offset = int(params.get("offset") or 0)
        deadline = time.monotonic() + min(float(params.get("timeout") or 0), 2.0)
        while True:
            with self._lock:
                self.updates = [u for u in self.updates if u["update_id"] >= offset]  # confirmed ones go
                ready = list(self.updates)
            if ready or time.monotonic() >= deadline:
                return _ok(ready)
            await asyncio.sleep(0.02)

    def _call(self, method: str, params: dict[str, Any]) -> Response:
        chat_id = int(params.get("chat_id") or 0)
        if method in ("sendMessage", "editMessageText") and self.rate_limits[method]:
            retry_after = self.rate_limits[method].pop(0)
            self.writes.append(Write(time.monotonic(), method, chat_id, False))
            return _error(429, f"Too Many Requests: retry after {retry_after}", retry_after=retry_after)
        if method == "getFile":
            file_id = str(params.get("file_id"))
            if file_id not in self.files:
                return _error(400, "Bad Request: invalid file_id")
            return _ok({"file_id": file_id, "file_unique_id": f"u{file_id}", "file_size": len(self.files[file_id]),
                        "file_path": f"documents/{file_id}"})
        if method == "getMe":
            return _ok({**self._bot(), "can_join_groups": True, "can_read_all_group_messages": False,
                        "supports_inline_queries": False})
        if method in ("setWebhook", "deleteWebhook"):
            self.webhook = params if method == "setWebhook" else {}
            return _ok(True)
        if method == "sendChatAction":
            self.actions.append((chat_id, params.get("action", "")))
            return _ok(True)
        if method == "answerCallbackQuery":
            self.callback_answers.append(params)
            return _ok(True)
        if method == "sendMessage":
            try:
                text = render(params["text"], params.get("parse_mode"))
            except ValueError as exc:
                return _error(400, str(exc))
            if len(text) > 4096:
                return _error(400, "Bad Request: message is too long")
            self._next_message += 1
            markup = params.get("reply_markup") or {}
            shown = Shown(self._next_message, chat_id, text, markup.get("inline_keyboard"))
            self.shown[shown.message_id] = shown
            self.writes.append(Write(time.monotonic(), method, chat_id, True))
            return _ok(self._message(shown))
        if method == "editMessageText":
            shown = self.shown.get(int(params.get("message_id") or 0))
            if shown is None or shown.deleted or shown.chat_id != chat_id:
                return _error(400, "Bad Request: message to edit not found")
            try:
                text = render(params["text"], params.get("parse_mode"))
            except ValueError as exc:
                return _error(400, str(exc))
            markup = (params.get("reply_markup") or {}).get("inline_keyboard")
            if text == shown.text and markup == shown.buttons:
                return _error(400, "Bad Request: message is not modified: specified new message content and reply "
                                   "markup are exactly the same as a current content and reply markup of the message")
            if len(text) > 4096:
                return _error(400, "Bad Request: MESSAGE_TOO_LONG")
            shown.text, shown.buttons, shown.edits = text, markup, shown.edits + 1
            self.writes.append(Write(time.monotonic(), method, chat_id, True))
            return _ok(self._message(shown))
        if method == "deleteMessage":
            shown = self.shown.get(int(params.get("message_id") or 0))
            if shown is None or shown.deleted:
                return _error(400, "Bad Request: message to delete not found")
            shown.deleted = True
            return _ok(True)
        return _error(404, "Not Found: method not found")

    async def _upload(self, method: str, request: Request) -> Response:
        field_name = _UPLOADS.get(method)
        if field_name is None:
            return _error(404, "Not Found: method not found")
        async with request.form() as form:
            upload = form.get(field_name)
            if upload is None or isinstance(upload, str):
                return _error(400, f"Bad Request: there is no {field_name} in the request")
            sent = SentFile(method, upload.filename or "", await upload.read())
            chat_id = int(str(form.get("chat_id") or 0))
        with self._lock:
            if self.rate_limits[method]:
                retry_after = self.rate_limits[method].pop(0)
                self.writes.append(Write(time.monotonic(), method, chat_id, False))
                return _error(429, f"Too Many Requests: retry after {retry_after}", retry_after=retry_after)
            self._next_message += 1
            shown = Shown(self._next_message, chat_id, "", file=sent)
            self.shown[shown.message_id] = shown
            self.writes.append(Write(time.monotonic(), method, chat_id, True))
            return _ok(self._message(shown))

    def _message(self, shown: Shown) -> dict[str, Any]:
        message: dict[str, Any] = {"message_id": shown.message_id, "date": int(time.time()), "text": shown.text,
                                   "chat": {"id": shown.chat_id, "type": "private"}, "from": self._bot()}
        if shown.buttons:
            message["reply_markup"] = {"inline_keyboard": shown.buttons}
        return message

    async def _file(self, request: Request) -> Response:
        file_id = request.path_params["path"].rsplit("/", 1)[-1]
        if request.path_params["token"] != self.token or file_id not in self.files:
            return _error(404, "Not Found")
        self.fetched.append(file_id)
        return Response(self.files[file_id], media_type="application/octet-stream")

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/bot{token}/{method}", self._api, methods=["GET", "POST"]),
                                 Route("/file/bot{token}/{path:path}", self._file, methods=["GET"])])


_UPLOADS = {"sendPhoto": "photo", "sendVoice": "voice", "sendAudio": "audio", "sendDocument": "document"}


def _maybe_json(value: str) -> Any:
    if value[:1] in "{[" or re.fullmatch(r"-?\d+", value):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _ok(result: Any) -> JSONResponse:
    return JSONResponse({"ok": True, "result": result})


def _error(status: int, description: str, *, retry_after: int | None = None) -> JSONResponse:
    body: dict[str, Any] = {"ok": False, "error_code": status, "description": description}
    if retry_after is not None:
        body["parameters"] = {"retry_after": retry_after}
    return JSONResponse(body, status_code=status)


@contextmanager
def serving_telegram() -> Iterator[tuple[FakeTelegram, str]]:
    """The fake Bot API, and the api_base_url that points a bot at it."""
    fake = FakeTelegram()
    server = LoopbackServer(fake.app(), "fake-telegram")
    server.start()
    try:
        yield fake, f"{server.origin}/bot"
    finally:
        server.stop()


def plain(text: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", text))
