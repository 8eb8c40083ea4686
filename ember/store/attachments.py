"""The files messages came with: each stored once per session, under the SHA-256 of its bytes.

A session is the unit that may read them: its messages name them, its turns show them to the
model, and the page of the person whose session it is shows them. The same file sent twice in a
session is one row; sent in two sessions, two (no person can read another's by its digest).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from sqlalchemy import bindparam, select

from ember.core.attachments import AttachmentContent, StoredFile
from ember.core.messages import decode_attachments
from ember.store import schema
from ember.store.tx import Tx, in_json_array, per_dialect, upsert

_a = schema.attachments
_PUT = upsert(lambda insert: insert(_a).on_conflict_do_nothing(index_elements=["session_key", "digest"]))
_READ = per_dialect(lambda dialect: select(_a.c.digest, _a.c.data, _a.c.media_type, _a.c.text).where(
    _a.c.session_key == bindparam("key"), in_json_array(_a.c.digest, "digests", dialect)))


def put_files(tx: Tx, key: str, files: Sequence[AttachmentContent]) -> None:
    """Keep each file's bytes in the session, once: a file it holds already is left as it is."""
    now, distinct = time.time(), {f.digest: f for f in files}.values()
    tx.executemany(_PUT, [{"session_key": key, "digest": f.digest, "media_type": f.media_type, "size": f.size,
                           "data": f.data, "text": f.text, "created_at": now} for f in distinct])


def read_files(tx: Tx, key: str, digests: Sequence[str]) -> dict[str, StoredFile]:
    """The bytes, type and text of those of `digests` the session holds, by digest."""
    rows = tx.execute(_READ, {"key": key, "digests": json.dumps(sorted(set(digests)))}).fetchall()
    return {digest: StoredFile(bytes(data), media_type, text) for digest, data, media_type, text in rows}


# Of a document's text, what a message's memory keeps with it: enough to be recalled by.
DOCUMENT_CHARS = 2_000


def with_documents(tx: Tx, key: str, content: str, attachments_json: str | None, *, answer: bool = False) -> str:
    """A message's text as memory keeps it: with the start of each document it came with, and the
    name of each other file (a person asks later for "the invoice I sent"). An answer's recording
    is its own text spoken: nothing more to keep."""
    files = [f for f in decode_attachments(attachments_json) if not (answer and f.is_audio)]
    if not files:
        return content
    stored = read_files(tx, key, [f.digest for f in files])
    parts = [content.strip()] if content.strip() else []
    for attachment in files:
        text = (found := stored.get(attachment.digest)) and found.text
        shown = f": {text[:DOCUMENT_CHARS]}" if text and not attachment.is_audio else ""
        parts.append(f"[sent {attachment.label}{shown}]")
    return "\n".join(parts)
