"""Files sent with a message through the gateway: checked, stored in the session, passed on by reference.

The native API takes them as `attachments` ({name, media_type, data: base64}); the OpenAI route as
the content parts clients send (`image_url` with a data URL or an http(s) URL, fetched under
web_fetch's address rules; `file` with `file_data`; `input_audio`).
A voice note's transcript joins its message's text (channels/attachments.py). Everything
is checked before anything is stored, so a refused file leaves nothing behind (core/attachments.py
says what is refused). `GET /api/sessions/{key}/attachments/{digest}` gives a file back to the
person whose session it is in.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ember.channels.attachments import FileShelf
from ember.channels.gateway.http import ApiError, FileAllowance, T, checked_key
from ember.channels.gateway.schemas import AttachmentUpload, ChatCompletionRequest, ContentPart, MessageRequest
from ember.channels.gateway.turns import session_key
from ember.core.attachments import (
    TEXT_TYPES,
    Attachment,
    AttachmentContent,
    AttachmentRefused,
    checked,
    clean_name,
    decoded,
    from_data_url,
)
from ember.core.errors import ModelError
from ember.store.protocols import SessionBrowser
from ember.tools.base import ToolFailure

FetchFile = Callable[[str], Awaitable[tuple[bytes, str]]]
_STATUS = {"attachment_too_large": 413, "attachment_type": 415, "attachment_disguised": 415}
# Parts of an OpenAI message that carry a file; others (refusal, ...) are refused by name.
_FILE_PARTS = ("image_url", "file", "input_audio")
_AUDIO_FORMATS = {"wav": "audio/wav", "mp3": "audio/mpeg", "ogg": "audio/ogg", "webm": "audio/webm", "m4a": "audio/mp4"}


def uploads_weight(body: MessageRequest) -> int:
    return sum(len(upload.data) for upload in body.attachments)


def parts_weight(body: ChatCompletionRequest) -> int:
    """The data URLs of every file part (a client that names no session sends earlier ones again)."""
    return sum(len(url) for message in body.messages if isinstance(message.content, list)
               for part in message.content if part.type in _FILE_PARTS and isinstance(url := _source(part)[0], str))


class Intake:
    """How the message routes take a body and the files it carries: checked, heard (a voice note's
    transcript), then kept on the shelf. A body may weigh `max_body_bytes`, its files aside."""

    def __init__(self, shelf: FileShelf, max_body_bytes: int, fetch: FetchFile | None = None) -> None:
        self._shelf = shelf
        self._max_bytes = shelf.max_bytes
        self.max_body_bytes = max_body_bytes
        self._fetch = fetch  # an image a part links to (None: links are refused)

    def allowance(self, weight: Callable[[T], int]) -> FileAllowance[T]:
        return FileAllowance(self._max_bytes * 4 // 3 + 4096, weight)  # base64 is 4/3 of the bytes

    def uploaded(self, items: Sequence[AttachmentUpload]) -> list[AttachmentContent]:
        """The native API's `attachments`, checked; ApiError says what is wrong with the first bad one."""
        files = []
        for i, item in enumerate(items):
            with _refusal_said(f"attachments[{i}]"):
                files.append(self._shelf.checked(decoded(item.data, item.name), declared=item.media_type,
                                                 name=item.name))
        return self._within(files)

    async def from_parts(self, parts: Sequence[ContentPart], where: str) -> list[AttachmentContent]:
        """The files among an OpenAI message's content parts, checked; an image linked by URL fetched."""
        files = []
        for i, part in enumerate(parts):
            if part.type in ("text", "input_text"):
                continue
            if part.type not in _FILE_PARTS:
                raise ApiError(400, f"{where}.content[{i}] is a {part.type!r} part; Ember takes text, image_url, "
                                    "file and input_audio parts", code="unsupported_content", param=f"{where}.content")
            url, name = _part_source(part, f"{where}.content[{i}]", linked=self._fetch is not None)
            with _refusal_said(f"{where}.content[{i}]"):
                files.append(await self._linked(url, f"{where}.content[{i}]") if not url.startswith("data:")
                             else from_data_url(url, name=name, max_bytes=self._max_bytes))
        return self._within(files)

    async def _linked(self, url: str, where: str) -> AttachmentContent:
        """An image an image_url part links to, fetched (web_fetch's address rules) and checked."""
        assert self._fetch is not None
        try:
            data, media_type = await self._fetch(url)
        except ToolFailure as exc:
            raise ApiError(400, f"{where}: the image could not be fetched: {exc}", code="attachment_fetch_failed",
                           param=where) from exc
        image = checked(data, declared=media_type or None, name=_url_name(url), max_bytes=self._max_bytes)
        if not image.is_image:
            raise AttachmentRefused(f"{url} is {image.media_type}, not an image", code="attachment_type")
        return image

    async def heard(self, text: str, files: Sequence[AttachmentContent]) -> str:
        """The message's text, with what its voice notes say after it."""
        try:
            return await self._shelf.heard(text, files)
        except AttachmentRefused as exc:
            raise ApiError(400, str(exc), code=exc.code, param="attachments") from exc
        except ModelError as exc:
            raise ApiError(502, f"the voice note could not be transcribed: {exc}", code="transcription_failed") \
                from exc

    async def keep(self, key: str, files: Sequence[AttachmentContent]) -> tuple[Attachment, ...]:
        return await self._shelf.keep(key, files)

    def _within(self, files: list[AttachmentContent]) -> list[AttachmentContent]:
        total = sum(f.size for f in files)
        if total > self._max_bytes:
            raise ApiError(413, f"the message's files weigh {total} bytes together; the limit is {self._max_bytes} "
                                "(attachment_max_bytes)", code="attachment_too_large")
        return files


@contextmanager
def _refusal_said(where: str) -> Iterator[None]:
    try:
        yield
    except AttachmentRefused as exc:
        raise ApiError(_STATUS.get(exc.code, 400), str(exc), code=exc.code, param=where) from exc


def _source(part: ContentPart) -> tuple[object, object]:
    """The URL (or OpenAI's bare base64 file_data) and file name an image_url, file or input_audio
    part gives."""
    extra: dict[str, Any] = part.model_extra or {}
    if part.type == "image_url":
        image = extra.get("image_url")
        return (image.get("url") if isinstance(image, dict) else image), None
    if part.type == "input_audio":
        audio = extra.get("input_audio") if isinstance(extra.get("input_audio"), dict) else {}
        media_type = _AUDIO_FORMATS.get(str(audio.get("format")), "application/octet-stream")
        data = audio.get("data")
        return (f"data:{media_type};base64,{data}" if isinstance(data, str) and data else None), \
            f"voice.{audio.get('format')}" if audio.get("format") in _AUDIO_FORMATS else None
    file = extra.get("file") if isinstance(extra.get("file"), dict) else {}
    return file.get("file_data"), file.get("filename")


def _part_source(part: ContentPart, where: str, *, linked: bool) -> tuple[str, str | None]:
    """The data URL and file name of an image_url or file part; with `linked`, an image_url's
    http(s) URL too."""
    url, name = _source(part)
    if not isinstance(url, str) or not url:
        raise ApiError(400, f"{where} has no data URL", code="attachment_invalid", param=where)
    if part.type == "file" and not url.startswith("data:"):
        url = f"data:application/octet-stream;base64,{url}"  # OpenAI's file_data may be bare base64
    if linked and part.type == "image_url" and url.startswith(("https://", "http://")):
        return url, None
    if not url.startswith("data:"):
        raise ApiError(400, f"{where}: Ember takes files as data URLs (data:<type>;base64,...), and images by their "
                            "http(s) URL", code="attachment_url", param=where)
    return url, name if isinstance(name, str) else None


def _url_name(url: str) -> str | None:
    return clean_name(urlsplit(url).path.rsplit("/", 1)[-1]) or None


class AttachmentsApi:
    def __init__(self, sessions: SessionBrowser) -> None:
        self._sessions = sessions

    def routes(self) -> list[Route]:
        return [Route("/api/sessions/{key}/attachments/{digest}", self.attachment, methods=["GET"])]

    async def attachment(self, request: Request) -> Response:
        """A file of one of the caller's sessions; 404 for any other (another person's included)."""
        key = checked_key(request.path_params["key"], "session")
        digest = request.path_params["digest"]
        full_key = session_key(request.state.identity, key)
        stored = (await self._sessions.attachments(full_key, [digest])).get(digest) if _is_digest(digest) else None
        if stored is None:
            raise ApiError(404, f"no file {digest[:64]!r} in session {key!r}", code="attachment_not_found")
        media_type = f"{stored.media_type}; charset=utf-8" if stored.media_type in TEXT_TYPES else stored.media_type
        return Response(stored.data, media_type=media_type, headers={
            "X-Content-Type-Options": "nosniff", "Content-Security-Policy": "sandbox",
            "Cache-Control": "private, max-age=31536000, immutable"})


def _is_digest(value: str) -> bool:
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value)
