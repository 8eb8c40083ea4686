"""What a model is shown of the files a message came with.

A model configured with `vision = true` sees images as images (OpenAI `image_url` parts, Anthropic
`image` blocks) and, on Anthropic, PDFs as `document` blocks. Every model reads a document's text;
in place of an image it cannot see, or a file no longer stored, it reads a line that says so.
Before answering a message whose images it cannot see, the person is told (`blind_notice`), as
the first line of the answer.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

from ember.core.attachments import PDF_TYPE, Attachment, AttachmentContent
from ember.core.messages import Message, Role


def as_text(attachment: Attachment) -> str:
    """The file as a model that does not see it reads it."""
    if attachment.is_audio:
        return f"[Attached: {attachment.label}; a recording, whose transcript is the message's text]"
    if not isinstance(attachment, AttachmentContent):
        return f"[Attached: {attachment.label}; its content is no longer stored]"
    if attachment.text is not None:
        end = f"[end of {attachment.name or 'the file'}]"
        return f"[Attached: {attachment.label}; its text follows]\n{attachment.text}\n{end}"
    if attachment.is_image:
        return f"[Attached: {attachment.label}; an image this model cannot see]"
    return f"[Attached: {attachment.label}; it has no text that could be read]"


def openai_content(message: Message, vision: bool) -> str | list[dict[str, Any]]:
    """A user message's content in the Chat Completions format: text, or parts when it has files."""
    if not message.attachments:
        return message.content
    parts: list[dict[str, Any]] = [{"type": "text", "text": message.content}] if message.content else []
    for attachment in message.attachments:
        if vision and attachment.is_image and isinstance(attachment, AttachmentContent):
            parts.append({"type": "image_url", "image_url": {"url": attachment.data_url()}})
        else:
            parts.append({"type": "text", "text": as_text(attachment)})
    return parts


def anthropic_blocks(attachments: Sequence[Attachment], vision: bool) -> list[dict[str, Any]]:
    """The Messages API's blocks for a user message's files."""
    blocks: list[dict[str, Any]] = []
    for attachment in attachments:
        if vision and isinstance(attachment, AttachmentContent) and attachment.is_image:
            blocks.append({"type": "image", "source": _base64(attachment)})
        elif vision and isinstance(attachment, AttachmentContent) and attachment.media_type == PDF_TYPE:
            blocks.append({"type": "document", "source": _base64(attachment), "title": attachment.name or "document"})
        else:
            blocks.append({"type": "text", "text": as_text(attachment)})
    return blocks


def blind_notice(messages: Sequence[Message], vision: bool, model: str) -> str | None:
    """What the person is told when the message being answered has images the model cannot see:
    only on the turn's first call (the prompt ends with that message), so it is said once."""
    if vision or not messages or messages[-1].role is not Role.USER:
        return None
    unseen = [a.name or "an image" for a in messages[-1].attachments if a.is_image]
    if not unseen:
        return None
    return (f"(The model {model} cannot see images, so it was told only that you sent {', '.join(unseen)}; "
            "a model with `vision = true` can look at them.)\n\n")


def _base64(attachment: AttachmentContent) -> dict[str, str]:
    return {"type": "base64", "media_type": attachment.media_type, "data": base64.b64encode(attachment.data).decode()}
