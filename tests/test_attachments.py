"""Files sent with a message: through the official `openai` SDK and Ember's native API to a running
`ember serve`, stored once in the session, shown to a model that sees images as images and to one
that does not as a note (and the person told), refused with a clear error when too large or not
what they claim, with nothing stored."""

from __future__ import annotations

import base64
import hashlib
import io
import sqlite3
import struct
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from ember.core.attachments import AttachmentContent, AttachmentRefused, checked, from_data_url, with_text
from ember.core.messages import Message, encode_attachments
from ember.models.anthropic_messages import AnthropicModel, TokenLimits
from ember.models.base import complete
from ember.store.attachments import with_documents
from ember.store.engine import Database
from tests.anthropicserver import AnthropicServer, Turn
from tests.gatewayproc import GatewayProcess, LaunchGateway
from tests.loopback import LoopbackServer, started, wait_until
from tests.modelserver import ModelServer, Reply, serving
from tests.pgserver import ENGINES, engine_database
from tests.sse import sse_events

KEY, OTHER_KEY = "test-secret-key-0123456789", "other-secret-key-0123456789"
SMALL_LIMIT = 4096


def png(width: int = 2, height: int = 2) -> bytes:
    """A real PNG: grey pixels."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = b"".join(b"\x00" + b"\x80" * width for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def pdf(text: str) -> bytes:
    """A one-page PDF whose page says `text`, with a correct cross-reference table."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
               b"/Resources << /Font << /F1 5 0 R >> >> >>",
               b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream),
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def model() -> Iterator[ModelServer]:
    with serving() as server:
        yield server


@pytest.fixture(scope="module")
def seeing(model: ModelServer, launch_module_gateway: LaunchGateway) -> GatewayProcess:
    """A gateway whose model reads images."""
    return launch_module_gateway(model, keys={"tester": KEY, "other": OTHER_KEY}, EMBER_MODEL_VISION="true",
                                 EMBER_WEB_FETCH_ALLOWED_HOSTS='["127.0.0.1"]')  # the tests' own images


@pytest.fixture(scope="module")
def blind(model: ModelServer, launch_module_gateway: LaunchGateway) -> GatewayProcess:
    """A gateway whose model reads text only, and takes files of at most SMALL_LIMIT bytes."""
    return launch_module_gateway(model, keys={"tester": KEY}, EMBER_ATTACHMENT_MAX_BYTES=str(SMALL_LIMIT))


def home_with_ears(home: Path, model: ModelServer, *, vision: bool = False) -> Path:
    """A gateway home whose ember.toml names `model` for chat and a transcription model beside it."""
    home.mkdir(parents=True)
    (home / "ember.toml").write_text(f"""
[models.chat]
base_url = "{model.base_url}"
model = "{model.model}"
vision = {str(vision).lower()}
[models.ears]
base_url = "{model.base_url}"
model = "whisper-test"
[model_roles]
main = ["chat"]
transcribe = ["ears"]
""")
    return home


@pytest.fixture(scope="module")
def hearing(model: ModelServer, launch_module_gateway: LaunchGateway,
            tmp_path_factory: pytest.TempPathFactory) -> GatewayProcess:
    """A gateway with a transcription model for voice notes ([model_roles] transcribe)."""
    home = home_with_ears(tmp_path_factory.mktemp("hearing") / "home", model)
    return launch_module_gateway(model, keys={"tester": KEY}, home=home)


@pytest.fixture
def fresh(model: ModelServer) -> Iterator[ModelServer]:
    model.responder = None
    model.requests.clear()
    model.transcribed.clear()
    model.transcript = "(transcribed)"
    yield model
    assert not model._script, "a test left scripted replies unused"


VOICE = b"OggS\x00\x02" + bytes(200)  # an Ogg page's start: what a voice note is
WAVE = b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(100)


def sdk(gateway: GatewayProcess, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url("/v1"), api_key=key, max_retries=0, timeout=30)


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def history(gateway: GatewayProcess, session: str) -> list[dict]:
    response = httpx.get(gateway.url(f"/api/sessions/{session}/messages"), headers=auth())
    assert response.status_code == 200, response.text
    return response.json()["messages"]


def stored_files(gateway: GatewayProcess) -> list[tuple[str, str]]:
    with sqlite3.connect(gateway.home / "ember.db") as db:
        return db.execute("SELECT session_key, digest FROM attachments ORDER BY created_at").fetchall()


def send_native(gateway: GatewayProcess, session: str, body: dict) -> httpx.Response:
    return httpx.post(gateway.url(f"/api/sessions/{session}/messages"), json=body, headers=auth(), timeout=30)


def test_an_image_sent_through_the_openai_sdk_reaches_a_seeing_model_as_an_image(
        seeing: GatewayProcess, fresh: ModelServer) -> None:
    image = png()
    fresh.push(Reply(text="A grey square."))
    with sdk(seeing) as client:
        raw = client.chat.completions.with_raw_response.create(model="ember", messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": data_url(image, "image/png")}}]}])
    assert raw.parse().choices[0].message.content == "A grey square."
    asked = fresh.requests[-1]["messages"][-1]
    assert asked["content"] == [{"type": "text", "text": "What is in this picture?"},
                                {"type": "image_url", "image_url": {"url": data_url(image, "image/png")}}]
    session = raw.headers["X-Ember-Session"]
    question = history(seeing, session)[0]
    digest = hashlib.sha256(image).hexdigest()
    assert question["content"] == "What is in this picture?"
    assert question["attachments"] == [{"digest": digest, "media_type": "image/png", "size": len(image), "name": None}]
    shown = httpx.get(seeing.url(f"/api/sessions/{session}/attachments/{digest}"), headers=auth())
    assert shown.status_code == 200 and shown.content == image
    assert shown.headers["content-type"] == "image/png" and shown.headers["x-content-type-options"] == "nosniff"
    # Another person asking for the same session's file, or its digest in a session of their own: nothing.
    for path in (f"/api/sessions/{session}/attachments/{digest}", f"/api/sessions/mine/attachments/{digest}"):
        assert httpx.get(seeing.url(path), headers=auth(OTHER_KEY)).status_code == 404


def test_an_image_linked_by_url_is_fetched_and_a_page_is_not_an_image(
        seeing: GatewayProcess, fresh: ModelServer) -> None:
    image = png(9, 9)
    pages = Starlette(routes=[Route("/cat.png", lambda _: Response(image, media_type="image/png")),
                              Route("/page", lambda _: Response(b"<html>hello</html>", media_type="text/html"))])
    fresh.push(Reply(text="A grey cat."))
    with started(LoopbackServer(pages, "images")) as served, sdk(seeing) as client:
        answer = client.chat.completions.create(model="ember", messages=[{"role": "user", "content": [
            {"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": f"{served.origin}/cat.png"}}]}])
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(model="ember", messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"{served.origin}/page"}}]}])
    assert answer.choices[0].message.content == "A grey cat."
    assert fresh.requests[-1]["messages"][-1]["content"][1] == {
        "type": "image_url", "image_url": {"url": data_url(image, "image/png")}}
    assert refused.value.status_code == 415 and refused.value.body["code"] == "attachment_type"


def test_a_model_that_cannot_see_reads_a_note_and_the_person_is_told_once(
        blind: GatewayProcess, fresh: ModelServer) -> None:
    fresh.push(Reply(text="Nice receipt."))
    with sdk(blind) as client:
        stream = client.chat.completions.create(model="ember", stream=True, messages=[{"role": "user", "content": [
            {"type": "text", "text": "Here is my receipt"},
            {"type": "image_url", "image_url": {"url": data_url(png(), "image/png")}}]}])
        said = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    parts = fresh.requests[-1]["messages"][-1]["content"]
    assert [part["type"] for part in parts] == ["text", "text"]
    assert "an image this model cannot see" in parts[1]["text"] and "image/png" in parts[1]["text"]
    assert said.startswith("(The model ") and "cannot see images" in said and said.endswith("Nice receipt.")
    assert said.count("cannot see images") == 1
    sessions = httpx.get(blind.url("/api/sessions"), headers=auth()).json()["sessions"]
    answer = history(blind, sessions[0]["key"])[-1]
    assert answer["role"] == "assistant" and answer["content"] == said  # what was shown is what was kept


def test_the_native_api_keeps_a_file_once_per_session_and_a_document_is_read_to_the_model(
        seeing: GatewayProcess, fresh: ModelServer) -> None:
    notes = b"# Groceries\n- oat milk\n- 2 lemons\n"
    upload = {"name": "list.md", "media_type": "text/markdown", "data": base64.b64encode(notes).decode()}
    before = len(stored_files(seeing))
    for text in ("Read my list", "And again"):
        fresh.push(Reply(text="Got it."))
        response = send_native(seeing, "shopping", {"text": text, "attachments": [upload]})
        assert response.status_code == 200 and sse_events(response.text)[-1].name == "final"
        document = fresh.requests[-1]["messages"][-1]["content"][1]["text"]
        assert "list.md (text/markdown" in document and "- 2 lemons" in document
    assert len(stored_files(seeing)) == before + 1
    assert [m["attachments"][0]["name"] for m in history(seeing, "shopping") if m["role"] == "user"] == ["list.md"] * 2


def test_a_pdfs_text_reaches_the_model_and_a_message_of_files_alone_is_answered(
        seeing: GatewayProcess, fresh: ModelServer) -> None:
    fresh.push(Reply(text="The total is 42 euros."))
    upload = {"name": "invoice.pdf", "data": base64.b64encode(pdf("Invoice total 42 EUR")).decode()}
    response = send_native(seeing, "invoices", {"attachments": [upload]})
    assert sse_events(response.text)[-1].json()["text"] == "The total is 42 euros."
    parts = fresh.requests[-1]["messages"][-1]["content"]
    assert len(parts) == 1 and "invoice.pdf (application/pdf" in parts[0]["text"]
    assert "Invoice total 42 EUR" in parts[0]["text"]


@pytest.mark.parametrize(("upload", "status", "code"), [
    ({"name": "big.png", "data": base64.b64encode(png(60, 60) + b"\x00" * SMALL_LIMIT).decode()}, 413,
     "attachment_too_large"),
    ({"name": "cat.png", "media_type": "image/png", "data": base64.b64encode(b"plain text, no cat").decode()}, 415,
     "attachment_disguised"),
    ({"name": "setup.exe", "data": base64.b64encode(b"MZ\x90\x00\x03\x00\x00\x00\x04").decode()}, 415,
     "attachment_type"),
    ({"name": "x.png", "data": "not base64!"}, 400, "attachment_invalid"),
])
def test_a_refused_file_gets_a_clear_error_and_nothing_is_kept(blind: GatewayProcess, fresh: ModelServer,
                                                               upload: dict, status: int, code: str) -> None:
    before = stored_files(blind)
    response = send_native(blind, f"refused-{code}", {"text": "look", "attachments": [upload]})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["param"] == "attachments[0]" and upload["name"] in error["message"]
    assert stored_files(blind) == before and fresh.requests == []
    assert httpx.get(blind.url(f"/api/sessions/refused-{code}/messages"), headers=auth()).status_code == 404


def test_the_openai_route_refuses_links_and_disguised_images_by_name(blind: GatewayProcess,
                                                                      fresh: ModelServer) -> None:
    with sdk(blind) as client:
        for url, code in (("ftp://example.com/cat.png", "attachment_url"),
                          ("http://127.0.0.1:9/cat.png", "attachment_fetch_failed"),  # a private address
                          (data_url(b"%PDF-1.4 not an image", "image/jpeg"), "attachment_disguised")):
            with pytest.raises(openai.APIStatusError) as refused:
                client.chat.completions.create(model="ember", messages=[{"role": "user", "content": [
                    {"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": url}}]}])
            assert refused.value.body["code"] == code and refused.value.body["param"] == "messages[0].content[1]"
    assert fresh.requests == []


def test_a_voice_note_is_transcribed_into_the_turns_text_and_kept_as_a_recording(
        hearing: GatewayProcess, fresh: ModelServer) -> None:
    fresh.transcript = "Remind me to call Ada at five."
    fresh.push(Reply(text="I will."), Reply(text="Heard."))
    voice = {"name": "note.ogg", "data": base64.b64encode(VOICE).decode()}
    response = send_native(hearing, "voice", {"attachments": [voice]})
    assert sse_events(response.text)[-1].json()["text"] == "I will."
    parts = fresh.requests[-1]["messages"][-1]["content"]
    assert parts[0] == {"type": "text", "text": "Remind me to call Ada at five."}
    assert "note.ogg (audio/ogg" in parts[1]["text"] and "transcript" in parts[1]["text"]
    question = history(hearing, "voice")[0]
    assert question["content"] == "Remind me to call Ada at five." and question["attachments"][0]["name"] == "note.ogg"
    # The OpenAI route's input_audio part, beside text the person typed.
    with sdk(hearing) as client:
        client.chat.completions.create(model="ember", extra_headers={"X-Ember-Session": "voice"}, messages=[
            {"role": "user", "content": [{"type": "text", "text": "And this:"},
                                         {"type": "input_audio", "input_audio": {
                                             "data": base64.b64encode(WAVE).decode(), "format": "wav"}}]}])
    assert fresh.requests[-1]["messages"][-1]["content"][0]["text"] == "And this:\n\nRemind me to call Ada at five."
    assert fresh.transcribed == [("note.ogg", "audio/ogg", len(VOICE), "whisper-test"),
                                 ("voice.wav", "audio/wav", len(WAVE), "whisper-test")]


def test_a_voice_note_nobody_can_hear_is_refused_and_nothing_is_kept(
        hearing: GatewayProcess, blind: GatewayProcess, fresh: ModelServer) -> None:
    voice = {"name": "note.ogg", "data": base64.b64encode(VOICE).decode()}
    fresh.transcript = None  # the transcription endpoint cannot decode it
    failed = send_native(hearing, "unheard", {"attachments": [voice]})
    assert failed.status_code == 502 and failed.json()["error"]["code"] == "transcription_failed"
    assert "could not be transcribed" in failed.json()["error"]["message"]
    unconfigured = send_native(blind, "unheard", {"attachments": [voice]})
    assert unconfigured.status_code == 400 and unconfigured.json()["error"]["code"] == "transcription_unavailable"
    assert "[model_roles] transcribe" in unconfigured.json()["error"]["message"]
    assert fresh.requests == [] and stored_files(blind) == [f for f in stored_files(blind) if "unheard" not in f[0]]
    for gateway in (hearing, blind):
        assert httpx.get(gateway.url("/api/sessions/unheard/messages"), headers=auth()).status_code == 404


def office(parts: dict[str, str]) -> bytes:
    """An Office Open XML file made of `parts` (name -> XML)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("[Content_Types].xml", "<Types/>")
        for name, xml in parts.items():
            archive.writestr(name, xml)
    return buffer.getvalue()


W = 'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"'
A = 'xmlns:a="http://schemas.openxmlformats.org/drawingml/2006/main"'


def test_word_excel_and_powerpoint_files_are_read_to_text_and_other_zips_refused() -> None:
    word = office({"word/document.xml": f'<w:document {W}><w:body><w:p><w:r><w:t>Quarterly </w:t></w:r><w:r>'
                                        '<w:t>plan</w:t></w:r></w:p><w:p><w:r><w:t>Ship it</w:t></w:r></w:p>'
                                        '</w:body></w:document>'})
    sheet = office({"xl/workbook.xml": "<workbook/>", "xl/sharedStrings.xml":
                    '<sst><si><t>Revenue</t></si><si><t>42 EUR</t></si></sst>'})
    deck = office({"ppt/presentation.xml": "<p/>",
                   "ppt/slides/slide10.xml": f'<p:sld {A} xmlns:p="p"><a:p><a:r><a:t>Last</a:t></a:r></a:p></p:sld>',
                   "ppt/slides/slide2.xml": f'<p:sld {A} xmlns:p="p"><a:p><a:r><a:t>First</a:t></a:r></a:p></p:sld>'})
    read = {name: with_text(checked(data, declared="application/zip", name=name, max_bytes=100_000))
            for name, data in (("plan.docx", word), ("sums.xlsx", sheet), ("deck.pptx", deck))}
    assert read["plan.docx"].media_type.endswith("wordprocessingml.document")
    assert read["plan.docx"].text == "Quarterly plan\nShip it"
    assert read["sums.xlsx"].text == "Revenue\n42 EUR" and read["deck.pptx"].text == "First\n\nLast"
    with pytest.raises(AttachmentRefused) as plain_zip:
        checked(office({"notes/readme.txt": "hello"}), declared="application/zip", name="bundle.zip", max_bytes=10_000)
    assert plain_zip.value.code == "attachment_type"


def test_a_file_is_judged_by_its_bytes() -> None:
    assert checked(png(), declared=None, name="../../etc/photo.PNG", max_bytes=10_000).name == "photo.PNG"
    assert checked(b"a,b\n1,2\n", declared="text/csv", name=None, max_bytes=100).media_type == "text/csv"
    assert checked(b"{}", declared="application/octet-stream", name="x.json", max_bytes=100).media_type == \
        "application/json"
    with pytest.raises(AttachmentRefused, match="not valid base64"):
        from_data_url("data:image/png;base64,@@@", name=None, max_bytes=100)
    scanned = with_text(checked(b"%PDF-1.4\n%garbage", declared=None, name="scan.pdf", max_bytes=100))
    assert scanned.text is None  # a PDF whose text cannot be read is kept; the model is told so


async def test_an_anthropic_model_sees_images_and_pdfs_as_blocks_or_reads_notes(
        anthropic_server: AnthropicServer) -> None:
    image = checked(png(), declared=None, name="photo.png", max_bytes=10_000)
    document = with_text(checked(pdf("Rent 900"), declared=None, name="rent.pdf", max_bytes=10_000))
    question = Message.user("What do these say?", attachments=(image, document))
    for vision in (True, False):
        anthropic_server.push(Turn(text="Read."))
        model = AnthropicModel(model="anthropic:claude-test", api_key="sk-ant-test", base_url=anthropic_server.base_url,
                               timeout_s=10, max_attempts=1, limits=TokenLimits(), vision=vision)
        reply = await complete(model, [question])
        blocks = anthropic_server.requests[-1]["messages"][0]["content"]
        if vision:
            assert [b["type"] for b in blocks] == ["text", "image", "document"] and reply.text == "Read."
            assert blocks[1]["source"] == {"type": "base64", "media_type": "image/png",
                                           "data": base64.b64encode(png()).decode()}
        else:
            assert [b["type"] for b in blocks] == ["text", "text", "text"] and "Rent 900" in blocks[2]["text"]
            assert reply.text.startswith("(The model claude-test cannot see images") and reply.text.endswith("Read.")


@pytest.fixture(params=ENGINES)
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    database = await engine_database(request.param, request, tmp_path)
    yield database
    await database.close()


async def test_a_sessions_files_are_its_own_on_either_engine(db: Database) -> None:
    from ember.store.sessions import SqlSessionStore

    sessions = SqlSessionStore(db)
    image = checked(png(), declared=None, name="a.png", max_bytes=10_000)
    document = with_text(checked(b"hello", declared=None, name="a.txt", max_bytes=100))
    await sessions.keep_attachments("http:ann:one", [image, document, image])
    await sessions.keep_attachments("http:ann:one", [image])  # kept already: left as it is
    found = await sessions.attachments("http:ann:one", [image.digest, document.digest, "0" * 64])
    assert {digest: (f.data, f.media_type, f.text) for digest, f in found.items()} == {
        image.digest: (png(), "image/png", None), document.digest: (b"hello", "text/plain", "hello")}
    assert await sessions.attachments("http:bob:one", [image.digest]) == {}
    assert isinstance(image, AttachmentContent) and image.reference().to_dict()["name"] == "a.png"
    # What memory keeps of a message: a document's text; of an answer, not its own words spoken again.
    spoken = checked(VOICE, declared="audio/ogg", name="reply.ogg", max_bytes=10_000)
    await sessions.keep_attachments("http:ann:one", [spoken])
    files = encode_attachments((document.reference(), spoken.reference()))
    kept = await db.run_read(lambda tx: [with_documents(tx, "http:ann:one", "Here.", files, answer=answer)
                                         for answer in (False, True)])
    assert kept == ["Here.\n[sent a.txt (text/plain, 5 bytes): hello]\n[sent reply.ogg (audio/ogg, 206 bytes)]",
                    "Here.\n[sent a.txt (text/plain, 5 bytes): hello]"]


def test_a_document_sent_is_remembered_by_its_text(seeing: GatewayProcess, fresh: ModelServer) -> None:
    fresh.push(Reply(text="Noted."))
    upload = {"name": "lease.pdf", "data": base64.b64encode(pdf("Rent is 900 EUR due on the 3rd")).decode()}
    assert send_native(seeing, "lease", {"text": "my new lease", "attachments": [upload]}).status_code == 200

    def recalled() -> list[dict]:
        found = httpx.get(seeing.url("/api/memory/search"), params={"q": "when is the rent due"}, headers=auth())
        assert found.status_code == 200, found.text
        return [m for m in found.json() if "lease.pdf" in m["content"]]

    wait_until(lambda: bool(recalled()), timeout_s=30, what="the archived message")
    [memory] = recalled()
    assert memory["content"].startswith("my new lease\n[sent lease.pdf (application/pdf")
    assert "Rent is 900 EUR due on the 3rd" in memory["content"]


def test_a_file_the_model_sends_comes_with_the_final_and_only_its_person_can_fetch_it(
        seeing: GatewayProcess, fresh: ModelServer) -> None:
    report = pdf("Q3 revenue rose")
    folder = seeing.home / "workspaces" / "tester"  # the key's person's own workspace
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.pdf").write_bytes(report)
    fresh.push(Reply(tool_calls=(("send_file", '{"path": "report.pdf"}'),)), Reply(text="Your report."))
    response = send_native(seeing, "reports", {"text": "send me the report"})
    final = sse_events(response.text)[-1]
    assert final.name == "final" and final.json()["text"] == "Your report."
    [sent] = final.json()["attachments"]
    assert (sent["name"], sent["media_type"], sent["size"]) == ("report.pdf", "application/pdf", len(report))
    assert sent["digest"] == hashlib.sha256(report).hexdigest()
    where = seeing.url(f"/api/sessions/reports/attachments/{sent['digest']}")
    assert httpx.get(where, headers=auth()).content == report
    assert httpx.get(where, headers=auth(OTHER_KEY)).status_code == 404
    [answer] = [m for m in history(seeing, "reports") if m["role"] == "assistant" and not m["tool_calls"]]
    assert answer["attachments"] == [sent]
    # An OpenAI client has the file named in the content, with its address, whole or streamed.
    named = f"\n\n[report.pdf (application/pdf, {len(report)} bytes): GET {where.removeprefix(seeing.url(''))}]"
    for stream in (False, True):
        fresh.push(Reply(tool_calls=(("send_file", '{"path": "report.pdf"}'),)), Reply(text="Again."))
        asked = {"model": "ember", "messages": [{"role": "user", "content": "the report again"}], "stream": stream,
                 "extra_headers": {"X-Ember-Session": "reports"}}
        if stream:
            content = "".join(chunk.choices[0].delta.content or "" for chunk in sdk(seeing).chat.completions.create(
                **asked) if chunk.choices)
        else:
            reply = sdk(seeing).chat.completions.create(**asked).choices[0].message
            content = reply.content
            assert reply.model_extra["attachments"] == [{**sent, "url": where.removeprefix(seeing.url(""))}]
        assert content == "Again." + named

    def recalled() -> list[str]:  # the answer is remembered with the start of the document it sent
        found = httpx.get(seeing.url("/api/memory/search"), params={"q": "Q3 revenue"}, headers=auth())
        return [m["content"] for m in found.json() if m["content"].startswith("Your report.")]

    wait_until(lambda: bool(recalled()), timeout_s=30, what="the archived answer")
    assert "[sent report.pdf (application/pdf" in recalled()[0] and "Q3 revenue rose" in recalled()[0]
