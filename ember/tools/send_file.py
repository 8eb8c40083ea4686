"""send_file: a file of the workspace goes to the person with the answer, on whatever channel they
asked on. It is checked as a person's upload is (its bytes decide its type), kept in the session
and named by the answer (core/attachments.py); the channel sends it after the answer's text."""

from __future__ import annotations

import asyncio
import mimetypes
from collections.abc import Sequence
from typing import Protocol

from pydantic import BaseModel, Field

from ember.core.attachments import AttachmentContent, AttachmentRefused, checked, with_text
from ember.core.tools import Risk, ToolRun
from ember.tools.base import ToolFailure, TurnTool
from ember.tools.workspace import Workspaces

MAX_FILES_PER_ANSWER = 10


class FileKeeper(Protocol):
    async def keep_attachments(self, key: str, files: Sequence[AttachmentContent]) -> None: ...


class SendFileArgs(BaseModel):
    path: str = Field(description="File path relative to the workspace")
    name: str | None = Field(default=None, max_length=200,
                             description="The file's name as the person sees it; default: its own")


def send_file_tool(workspaces: Workspaces, keeper: FileKeeper, max_bytes: int) -> TurnTool[SendFileArgs]:
    async def send_file(args: SendFileArgs, run: ToolRun) -> str:
        if len(run.files) >= MAX_FILES_PER_ANSWER:
            raise ToolFailure(f"an answer sends at most {MAX_FILES_PER_ANSWER} files")
        workspace = await workspaces.for_run(run)
        path = workspace.resolve(args.path)
        data = await asyncio.to_thread(workspace.read_bytes, path, max_bytes)
        try:
            # What its name says it is must be what its bytes are: a person opens it by its name.
            declared = mimetypes.guess_type(path.name)[0]
            file = checked(data, declared=declared, name=args.name or path.name, max_bytes=max_bytes)
        except AttachmentRefused as exc:
            raise ToolFailure(f"{workspace.display(path)} cannot be sent: {exc}") from exc
        if not file.is_image and not file.is_audio:
            file = await asyncio.to_thread(with_text, file)  # memory keeps the start of a document's text
        await keeper.keep_attachments(run.session_key, [file])
        if file.digest not in {sent.digest for sent in run.files}:
            run.files.append(file.reference())
        return f"{file.label} will be sent with your answer."

    kinds = "images, PDF, Word, Excel, PowerPoint, text, Markdown, CSV, JSON and audio"
    return TurnTool("send_file", f"Send a file of the workspace to the person with your answer ({kinds}; "
                    f"at most {max_bytes / 1024 / 1024:g} MiB).", SendFileArgs, send_file, risk=Risk.READ,
                    subject=lambda a: a.path, verb="send the file")

