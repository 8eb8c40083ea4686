"""Mail as the email channel reads and writes it, with the standard library's `email` package.

A thread is one session: its id is the first Message-ID of a mail's References (the thread's first
mail), else the mail it replies to, else its own. Of a mail's text, the new part is what counts:
the quoted mail below "On … wrote:" is cut. A reply goes to the sender in the same thread: "Re:"
its subject, In-Reply-To its Message-ID, References the thread's ids and its own.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from email import policy
from email.headerregistry import Address
from email.message import EmailMessage
from email.parser import BytesParser
from email.utils import getaddresses
from html.parser import HTMLParser

from ember.core.attachments import AttachmentContent

_ID = re.compile(r"<([^<>\s]+)>")
_WROTE = re.compile(r"(wrote|写道|schrieb|a écrit|escribió)\s*[:：]\s*$", re.IGNORECASE)
_ORIGINAL = re.compile(r"^-{2,}\s*(Original Message|Forwarded message)", re.IGNORECASE)
MAX_REFERENCES = 20  # a reply's References: the thread's first ids and its last ones


@dataclass(frozen=True, slots=True)
class Replied:
    """What a reply needs of the mail it answers, when the mail itself is not at hand."""

    sender: str
    subject: str
    references: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Incoming:
    message_id: str  # without its angle brackets
    thread: str
    sender: str  # the address, lower-cased
    sender_name: str | None
    subject: str
    references: tuple[str, ...]  # what a reply to it refers to: the thread's ids, then its own
    text: str  # what is new in it: its text part (else its HTML's text), the quoted mail cut
    files: tuple[tuple[str, str, bytes], ...]  # (name, declared type, bytes) of its attachments

    @property
    def replied(self) -> Replied:
        return Replied(self.sender, self.subject, self.references)


def message_ids(header: str | None) -> list[str]:
    return _ID.findall(header or "")


def parsed(raw: bytes, fallback_id: str) -> Incoming:
    """A mail as received; `fallback_id` names one without a Message-ID (the mailbox's own id for it)."""
    mail = BytesParser(policy=policy.default).parsebytes(raw)
    assert isinstance(mail, EmailMessage)
    own = (message_ids(str(mail.get("Message-ID", ""))) or [fallback_id])[0]
    references = message_ids(str(mail.get("References", "")))
    replied = message_ids(str(mail.get("In-Reply-To", "")))
    if replied and replied[-1] not in references:
        references.append(replied[-1])
    [(name, address)] = getaddresses([str(mail.get("Reply-To") or mail.get("From", ""))])[:1] or [("", "")]
    body = mail.get_body(preferencelist=("plain", "html"))
    text = ""
    if body is not None:
        content = body.get_content()
        text = _html_text(content) if body.get_content_type() == "text/html" else str(content)
    files = tuple((part.get_filename() or f"attachment-{n}", part.get_content_type(),
                   part.get_payload(decode=True) or b"")
                  for n, part in enumerate(mail.iter_attachments(), 1) if isinstance(part, EmailMessage))
    return Incoming(message_id=own, thread=(references or [own])[0], sender=address.strip().lower(),
                    sender_name=name or None, subject=str(mail.get("Subject", "")).strip(),
                    references=(*references, own), text=new_text(text), files=files)


def new_text(body: str) -> str:
    """The text above the quoted mail a reply carries ("On … wrote:" and its "> " lines, or an
    "Original Message" block); all of it when nothing is quoted."""
    lines = body.replace("\r\n", "\n").split("\n")
    for n, line in enumerate(lines):
        if _ORIGINAL.match(line.strip()):
            return "\n".join(lines[:n]).strip() or body.strip()
        if line.startswith(">"):
            above = n
            while above > 0 and not lines[above - 1].strip():
                above -= 1
            if above > 0 and _WROTE.search(lines[above - 1]):
                above -= 1
            return "\n".join(lines[:above]).strip() or body.strip()
    return body.strip()


def reply(to: Replied, *, sender: str, text: str, message_id: str,
          files: Sequence[AttachmentContent] = ()) -> EmailMessage:
    """The answer to `to`, from `sender`, in its thread; `message_id` the same for a re-sent answer."""
    mail = EmailMessage()
    mail["From"] = Address(addr_spec=sender)
    mail["To"] = to.sender
    mail["Subject"] = to.subject if to.subject.lower().startswith("re:") else f"Re: {to.subject}".rstrip()
    mail["Message-ID"] = f"<{message_id}>"
    mail["In-Reply-To"] = f"<{to.references[-1]}>"
    kept = to.references if len(to.references) <= MAX_REFERENCES else (
        to.references[:1] + to.references[-(MAX_REFERENCES - 1):])
    mail["References"] = " ".join(f"<{ref}>" for ref in kept)
    mail.set_content(text)
    for file in files:
        kind, _, subtype = file.media_type.partition("/")
        mail.add_attachment(file.data, maintype=kind, subtype=subtype, filename=file.name or "file")
    return mail


class _Text(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("script", "style"):
            self._skip += 1
        elif tag in ("br", "p", "div", "li", "tr", "h1", "h2", "h3"):
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style") and self._skip:
            self._skip -= 1

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.parts.append(data)


def _html_text(html: str) -> str:
    reader = _Text()
    reader.feed(html)
    reader.close()
    return re.sub(r"\n{3,}", "\n\n", "".join(reader.parts)).strip()
