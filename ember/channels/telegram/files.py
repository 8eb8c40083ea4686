"""The photo, voice note, audio or document of a Telegram message, fetched through the Bot API (getFile, then the file
itself) and checked like any other file (channels/attachments.py)."""

from __future__ import annotations

from telegram import Bot, Message

from ember.channels.attachments import FileShelf
from ember.core.attachments import AttachmentContent, AttachmentRefused


def file_base_url(api_base_url: str) -> str:
    """Where the Bot API serves files, beside its methods: https://api.telegram.org/file/bot."""
    return api_base_url.removesuffix("/bot") + "/file/bot"


async def message_files(bot: Bot, message: Message, shelf: FileShelf) -> list[AttachmentContent]:
    """AttachmentRefused says why a file is not taken; TelegramError that it could not be fetched."""
    wanted: list[tuple[str, int | None, str | None, str]] = []
    if message.photo:  # the same photo in several sizes: the largest that fits
        fits = [size for size in message.photo if (size.file_size or 0) <= shelf.max_bytes] or message.photo[:1]
        best = max(fits, key=lambda size: size.width * size.height)
        wanted.append((best.file_id, best.file_size, "image/jpeg", f"photo-{message.message_id}.jpg"))
    if message.voice is not None:  # a voice note: Opus in Ogg
        voice = message.voice
        wanted.append((voice.file_id, voice.file_size, voice.mime_type or "audio/ogg",
                       f"voice-{message.message_id}.ogg"))
    if message.audio is not None:
        audio = message.audio
        wanted.append((audio.file_id, audio.file_size, audio.mime_type,
                       audio.file_name or f"audio-{message.message_id}"))
    if message.document is not None:
        document = message.document
        wanted.append((document.file_id, document.file_size, document.mime_type,
                       document.file_name or f"file-{message.message_id}"))
    files = []
    for file_id, size, declared, name in wanted:
        if size is not None and size > shelf.max_bytes:  # not fetched at all
            raise AttachmentRefused(f"{name} is {size} bytes; the limit is {shelf.max_bytes} (attachment_max_bytes)",
                                    code="attachment_too_large")
        data = bytes(await (await bot.get_file(file_id)).download_as_bytearray())
        files.append(shelf.checked(data, declared=declared, name=name))
    return files
