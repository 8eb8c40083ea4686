"""Files that come with a message: images, PDFs and text documents.

A message keeps its attachments by reference (`Attachment`: the bytes' SHA-256 digest, their type,
size and name); the bytes are stored once per session, under that digest, by whoever accepts the
message (store/attachments.py). Only a model call reads them back (`AttachmentContent`).

What is accepted is decided by the bytes, not by what the sender says they are (`checked`): a
file whose first bytes are not those of an accepted type is refused, and so is one that claims to
be an image or a PDF and is not. A text document must be UTF-8.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import zipfile
from dataclasses import dataclass, replace
from xml.etree import ElementTree

from ember.core.errors import EmberError

DEFAULT_MAX_BYTES = 10 * 1024 * 1024
# A document's text beyond this is cut (about 50,000 tokens: most of a model's context).
MAX_DOCUMENT_CHARS = 200_000
IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")
PDF_TYPE = "application/pdf"
TEXT_TYPES = ("text/plain", "text/markdown", "text/csv", "application/json")
# Voice notes and recordings: transcribed into their message's text where a model for it is configured.
AUDIO_TYPES = ("audio/ogg", "audio/mpeg", "audio/wav", "audio/webm", "audio/mp4")
# Office documents, by the part that holds their text: a Word document's body, an Excel workbook's
# shared strings and sheets, a PowerPoint deck's slides.
OFFICE_TYPES = {
    "application/vnd.openxmlformats-officedocument.wordprocessingml.document": "word/document.xml",
    "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet": "xl/workbook.xml",
    "application/vnd.openxmlformats-officedocument.presentationml.presentation": "ppt/presentation.xml",
}
ACCEPTED_TYPES = (*IMAGE_TYPES, PDF_TYPE, *TEXT_TYPES, *AUDIO_TYPES, *OFFICE_TYPES)
_OFFICE_TEXT_PARTS = re.compile(r"word/document\.xml|xl/sharedStrings\.xml|ppt/slides/slide\d+\.xml")
_SAYS_NOTHING = ("application/octet-stream", "binary/octet-stream", "application/zip", "application/x-zip-compressed")
_MAX_UNZIPPED = 50 * 1024 * 1024  # a document's text parts, unpacked: more is a zip bomb, not a document
_TEXT_BY_EXTENSION = {".md": "text/markdown", ".markdown": "text/markdown", ".csv": "text/csv",
                      ".json": "application/json"}
_NAME = re.compile(r"[^\w .()+-]")
_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(?:;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
                       re.ASCII)


class AttachmentRefused(EmberError):
    """A file Ember does not take: too large, of a type it does not read, or not what it claims."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.code = code  # attachment_too_large, attachment_type, attachment_disguised, attachment_invalid


@dataclass(frozen=True, slots=True, kw_only=True)
class Attachment:
    """A file a message carries, by reference: what its history keeps and the bus passes on."""

    digest: str  # SHA-256 of the bytes, hex
    media_type: str
    size: int
    name: str | None = None

    @property
    def is_image(self) -> bool:
        return self.media_type in IMAGE_TYPES

    @property
    def is_audio(self) -> bool:
        return self.media_type in AUDIO_TYPES

    @property
    def label(self) -> str:
        """How a person or a model that cannot open it is told of it: "receipt.jpg (image/jpeg, 41 KB)"."""
        return f"{self.name or 'a file'} ({self.media_type}, {_size(self.size)})"

    def to_dict(self) -> dict[str, object]:
        return {"digest": self.digest, "media_type": self.media_type, "size": self.size, "name": self.name}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Attachment:
        digest, media_type, size, name = data["digest"], data["media_type"], data["size"], data.get("name")
        if not (isinstance(digest, str) and isinstance(media_type, str) and type(size) is int
                and (name is None or isinstance(name, str))):
            raise ValueError("malformed attachment")
        return cls(digest=digest, media_type=media_type, size=size, name=name)


@dataclass(frozen=True, slots=True, kw_only=True)
class AttachmentContent(Attachment):
    """An attachment with its bytes, and a document's text (`with_text`), for the store and the model."""

    data: bytes
    text: str | None = None

    def data_url(self) -> str:
        return f"data:{self.media_type};base64,{base64.b64encode(self.data).decode()}"

    def reference(self) -> Attachment:
        return Attachment(digest=self.digest, media_type=self.media_type, size=self.size, name=self.name)


@dataclass(frozen=True, slots=True)
class StoredFile:
    """What the store keeps of an attachment: its bytes, their type, and a document's text."""

    data: bytes
    media_type: str
    text: str | None


def with_content(attachment: Attachment, stored: StoredFile | None) -> Attachment:
    """The attachment with its bytes; as it is when they could not be read (the model is told so)."""
    if stored is None:
        return attachment
    return AttachmentContent(digest=attachment.digest, media_type=attachment.media_type, size=attachment.size,
                             name=attachment.name, data=stored.data, text=stored.text)


def with_text(content: AttachmentContent) -> AttachmentContent:
    """A document with its text, to show any model and to remember (blocking: PDFs take a while)."""
    if content.media_type in TEXT_TYPES:
        text: str | None = content.data.decode("utf-8")
    elif content.media_type == PDF_TYPE:
        text = _pdf_text(content.data)
    elif content.media_type in OFFICE_TYPES:
        text = _office_text(content.data)
    else:
        return content
    if text is not None and len(text) > MAX_DOCUMENT_CHARS:
        text = text[:MAX_DOCUMENT_CHARS] + f"\n[cut here: the first {MAX_DOCUMENT_CHARS} of {len(text)} characters]"
    return replace(content, text=text)


def _office_text(data: bytes) -> str | None:
    """The text of a Word, Excel or PowerPoint file: its paragraphs, cells and slides' text runs."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            parts = sorted((i for i in archive.infolist() if _OFFICE_TEXT_PARTS.fullmatch(i.filename)),
                           key=lambda i: [int(n) if n.isdigit() else n for n in re.split(r"(\d+)", i.filename)])
            if sum(i.file_size for i in parts) > _MAX_UNZIPPED:
                return None
            lines = [_xml_text(archive.read(part)) for part in parts]
    except (zipfile.BadZipFile, ElementTree.ParseError, OSError, ValueError):
        return None
    text = "\n\n".join(line for line in lines if line)
    return text or None


def _xml_text(xml: bytes) -> str:
    """The text runs of an Office XML part (w:t, a:t, t), a line per paragraph, row or shared string."""
    lines: list[str] = []
    for block in ElementTree.fromstring(xml).iter():
        tag = block.tag.rsplit("}", 1)[-1]
        if tag in ("p", "si"):
            line = "".join(t.text or "" for t in block.iter() if t.tag.rsplit("}", 1)[-1] == "t").strip()
            if line:
                lines.append(line)
    return "\n".join(lines)


def _pdf_text(data: bytes) -> str | None:
    """The text of a PDF's pages, up to MAX_DOCUMENT_CHARS; None when it has none to read (a scan)."""
    import pypdf

    try:
        reader = pypdf.PdfReader(io.BytesIO(data))
        pages: list[str] = []
        for page in reader.pages:
            pages.append(page.extract_text() or "")
            if sum(map(len, pages)) > MAX_DOCUMENT_CHARS:
                break
    except (pypdf.errors.PyPdfError, ValueError, KeyError, TypeError, RecursionError):
        return None
    text = "\n\n".join(page.strip() for page in pages if page.strip())
    return text or None


def checked(data: bytes, *, declared: str | None, name: str | None, max_bytes: int) -> AttachmentContent:
    """`data` as an attachment, its type read from its bytes; AttachmentRefused says what is wrong."""
    if not data:
        raise AttachmentRefused(f"{name or 'the file'} is empty", code="attachment_invalid")
    if len(data) > max_bytes:
        raise AttachmentRefused(f"{name or 'the file'} is {_size(len(data))}; the limit is {_size(max_bytes)} "
                                "(attachment_max_bytes)", code="attachment_too_large")
    sniffed = _sniffed(data)
    claimed = (declared or "").split(";")[0].strip().lower() or None
    if sniffed is None:
        raise AttachmentRefused(f"{name or 'the file'} is not a type Ember reads (images: PNG, JPEG, GIF, WebP; "
                                "PDF; Word, Excel or PowerPoint; UTF-8 text, Markdown, CSV or JSON; audio: Ogg, "
                                "MP3, WAV, WebM, M4A)",
                                code="attachment_type")
    if claimed is not None and _kind(claimed) not in (None, _kind(sniffed)):
        raise AttachmentRefused(f"{name or 'the file'} says it is {claimed}, but its content is not",
                                code="attachment_disguised")
    if sniffed == "text/plain":
        sniffed = _text_type(claimed, name)
    return AttachmentContent(digest=hashlib.sha256(data).hexdigest(), media_type=sniffed, size=len(data),
                             name=clean_name(name), data=data)


def from_data_url(url: str, *, name: str | None, max_bytes: int) -> AttachmentContent:
    """A `data:` URL's bytes as an attachment (the OpenAI route's image_url and file parts)."""
    match = _DATA_URL.match(url)
    if match is None or not match.group("b64"):
        raise AttachmentRefused("an attachment's URL must be a base64 data URL (data:<type>;base64,...)",
                                code="attachment_invalid")
    encoded = url[match.end():]
    if len(encoded) > (max_bytes + 2) // 3 * 4 + 4:
        raise AttachmentRefused(f"{name or 'the file'} is over the limit of {_size(max_bytes)} "
                                "(attachment_max_bytes)", code="attachment_too_large")
    return checked(decoded(encoded, name), declared=match.group("type"), name=name, max_bytes=max_bytes)


def decoded(encoded: str, name: str | None) -> bytes:
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise AttachmentRefused(f"{name or 'the file'} is not valid base64", code="attachment_invalid") from None


def clean_name(name: str | None) -> str | None:
    """A file name safe to show and to send on: its last path part, at most 120 characters."""
    if not name:
        return None
    base = _NAME.sub("_", name.replace("\\", "/").rsplit("/", 1)[-1]).strip(" .")
    return base[:120] or None


def _sniffed(data: bytes) -> str | None:
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data.startswith(b"%PDF-"):
        return PDF_TYPE
    if data.startswith(b"PK\x03\x04"):
        return _office_type(data)
    if audio := _sniffed_audio(data):
        return audio
    if b"\x00" in data:
        return None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return "text/plain"


def _office_type(data: bytes) -> str | None:
    """Which Office document a zip file is, by the part only that kind has; None for any other zip."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = set(archive.namelist())
    except (zipfile.BadZipFile, OSError, ValueError):
        return None
    return next((media_type for media_type, part in OFFICE_TYPES.items() if part in names), None)


def _sniffed_audio(data: bytes) -> str | None:
    if data.startswith(b"OggS"):
        return "audio/ogg"
    if data.startswith(b"ID3") or data[:2] in (b"\xff\xfb", b"\xff\xf3", b"\xff\xf2"):
        return "audio/mpeg"
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "audio/wav"
    if data.startswith(b"\x1a\x45\xdf\xa3"):  # Matroska/WebM: what a browser records
        return "audio/webm"
    if data[4:8] == b"ftyp" and data[8:12] in (b"M4A ", b"mp42", b"isom", b"iso5", b"dash"):
        return "audio/mp4"
    return None


def _kind(media_type: str) -> str | None:
    """image, pdf, text, audio or office; None for a type that says nothing (application/octet-stream)."""
    if media_type.startswith("image/"):
        return "image"
    if media_type.startswith("audio/") or media_type == "video/webm":  # a browser's recording may say video
        return "audio"
    if media_type == PDF_TYPE:
        return "pdf"
    if media_type.startswith("text/") or media_type in TEXT_TYPES:
        return "text"
    if media_type in OFFICE_TYPES:
        return "office"
    return None if media_type in _SAYS_NOTHING else media_type


def _text_type(claimed: str | None, name: str | None) -> str:
    if claimed in TEXT_TYPES:
        return claimed
    extension = "." + name.rsplit(".", 1)[-1].lower() if name and "." in name else ""
    return _TEXT_BY_EXTENSION.get(extension, "text/plain")


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} bytes"
    if n < 1024 * 1024:
        return f"{n / 1024:.0f} KB"
    return f"{n / 1024 / 1024:.1f} MB"
