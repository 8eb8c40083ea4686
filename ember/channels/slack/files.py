"""Files shared with a Slack message: fetched from their `url_private_download` with the bot token
(Slack serves them to apps that way only) and checked like any other file (channels/attachments.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx

from ember.channels.attachments import FileShelf
from ember.core.attachments import AttachmentContent, AttachmentRefused


def slacks_own(url: str, api_base_url: str) -> bool:
    """Whether `url` is Slack's (or the configured API's host): the bot token is sent nowhere else."""
    host, own = urlsplit(url).hostname or "", urlsplit(api_base_url).hostname or ""
    return urlsplit(url).scheme in ("https", "http") and (host == own or host.endswith(".slack.com"))


async def shared_files(files: Sequence[dict[str, Any]], token: str, shelf: FileShelf,
                       api_base_url: str) -> list[AttachmentContent]:
    """AttachmentRefused says why a file is not taken; httpx.HTTPError that it could not be fetched."""
    kept: list[AttachmentContent] = []
    if not files:
        return kept
    async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {token}"},
                                 follow_redirects=False) as http:
        for file in files:
            name, size = str(file.get("name") or file.get("id") or "file"), file.get("size")
            url = file.get("url_private_download") or file.get("url_private")
            if isinstance(size, int) and size > shelf.max_bytes:  # not fetched at all
                raise AttachmentRefused(f"{name} is {size} bytes; the limit is {shelf.max_bytes} "
                                        "(attachment_max_bytes)", code="attachment_too_large")
            if not isinstance(url, str) or not slacks_own(url, api_base_url):
                raise AttachmentRefused(f"{name} has no Slack address Ember can fetch it from",
                                        code="attachment_invalid")
            response = await http.get(url)
            response.raise_for_status()
            kept.append(shelf.checked(response.content, declared=file.get("mimetype"), name=name))
    return kept
