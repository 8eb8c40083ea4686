"""Files on the web page, in Chromium: picked with Attach or pasted into the message box, sent with
the message, shown with it, and shown again from the store after a reload; the files an answer
sends, shown under it and downloaded."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, Page, expect

from tests.browser import CHROMIUM, CHROMIUM_ARGS, answer, needs_chromium, sign_in
from tests.gatewayproc import GatewayProcess, LaunchGateway
from tests.modelserver import ModelServer, Reply, serving
from tests.test_attachments import KEY, data_url, home_with_ears, png

pytestmark = needs_chromium


@pytest.fixture(scope="module")
def model() -> Iterator[ModelServer]:
    with serving() as server:
        yield server


@pytest.fixture(scope="module")
def seeing(model: ModelServer, launch_module_gateway: LaunchGateway, tmp_path_factory: pytest.TempPathFactory
           ) -> GatewayProcess:
    """A gateway whose model sees images, with a transcription model for voice notes."""
    home = home_with_ears(tmp_path_factory.mktemp("page") / "home", model, vision=True)
    return launch_module_gateway(model, keys={"tester": KEY}, home=home)


@pytest.fixture(scope="module")
def listening(browser: Browser) -> Iterator[Browser]:
    """Chromium with a fake microphone it may use without asking (a tone, as its test device plays)."""
    other = browser.browser_type.launch(executable_path=CHROMIUM, args=[
        *CHROMIUM_ARGS, "--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream"])
    yield other
    other.close()


@pytest.fixture
def fresh(model: ModelServer) -> Iterator[ModelServer]:
    model.requests.clear()
    model.transcribed.clear()
    yield model
    assert not model._script, "a test left scripted replies unused"


def test_the_page_attaches_and_pastes_files_and_shows_them_again_after_a_reload(
        page: Page, seeing: GatewayProcess, fresh: ModelServer) -> None:
    fresh.push(Reply(text="Two files seen."))
    sign_in(page, seeing, KEY)
    page.goto(seeing.url("/#desk"))
    page.locator("#attach-input").set_input_files([
        {"name": "photo.png", "mimeType": "image/png", "buffer": png(40, 30)},
        {"name": "drop.txt", "mimeType": "text/plain", "buffer": b"throw away"}])
    page.get_by_role("button", name="Remove drop.txt").click()
    # A picture pasted into the message box joins the files, as a file, not as text.
    page.locator("#message-input").evaluate("""(box, bytes) => {
        const data = new DataTransfer();
        data.items.add(new File([new Uint8Array(bytes)], "notes.md", { type: "text/markdown" }));
        box.dispatchEvent(new ClipboardEvent("paste", { clipboardData: data, bubbles: true, cancelable: true }));
    }""", list(b"# pasted notes"))
    expect(page.locator("#attachments-tray .file-chip")).to_have_count(2)
    assert page.locator("#message-input").input_value() == ""
    page.locator("#message-input").fill("Look at these")
    page.locator("#send").click()
    expect(answer(page)).to_have_text("Two files seen.")
    expect(page.locator("#attachments-tray")).to_be_hidden()
    parts = fresh.requests[-1]["messages"][-1]["content"]
    assert [part["type"] for part in parts] == ["text", "image_url", "text"]
    assert parts[1]["image_url"]["url"] == data_url(png(40, 30), "image/png") and "# pasted notes" in parts[2]["text"]
    page.reload()
    shown = page.locator(".message.user").last.locator("img.file-image")
    expect(shown).to_have_attribute("alt", "photo.png")
    page.wait_for_function("image => image.complete && image.naturalWidth === 40", arg=shown.element_handle())
    expect(page.locator(".message.user").last.locator(".file-chip")).to_have_text("notes.md (text/markdown)")


def test_a_voice_note_recorded_on_the_page_is_transcribed_into_the_message(
        listening: Browser, seeing: GatewayProcess, fresh: ModelServer) -> None:
    fresh.transcript = "Remind me to water the plants."
    fresh.push(Reply(text="I will remind you."))
    page = listening.new_context().new_page()
    sign_in(page, seeing, KEY)
    page.goto(seeing.url("/#voice"))
    page.locator("#record").click()
    expect(page.locator("#record")).to_have_attribute("aria-pressed", "true")
    page.wait_for_timeout(800)
    page.locator("#record").click()
    expect(page.locator("#attachments-tray .file-chip")).to_have_count(1)
    page.locator("#send").click()
    expect(answer(page)).to_have_text("I will remind you.")
    [(name, media_type, size, model)] = fresh.transcribed
    assert name == "voice-note.webm" and media_type == "audio/webm" and size > 1000 and model == "whisper-test"
    heard = fresh.requests[-1]["messages"][-1]["content"][0]
    assert heard == {"type": "text", "text": "Remind me to water the plants."}
    page.reload()
    expect(page.locator(".message.user").last).to_contain_text("Remind me to water the plants.")
    expect(page.locator(".message.user").last.locator("audio.file-audio")).to_have_attribute(
        "title", "voice-note.webm (audio/webm)")
    page.context.close()


def test_the_files_an_answer_sends_show_under_it_and_download(
        page: Page, seeing: GatewayProcess, fresh: ModelServer) -> None:
    folder = seeing.home / "workspaces" / "tester"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "chart.png").write_bytes(png(24, 12))
    (folder / "notes.md").write_bytes(b"# June\n- shipped")
    fresh.push(Reply(tool_calls=(("send_file", '{"path": "chart.png"}'), ("send_file", '{"path": "notes.md"}'))),
               Reply(text="The chart and the notes."))
    sign_in(page, seeing, KEY)
    page.goto(seeing.url("/#sent"))
    page.locator("#message-input").fill("send me June")
    page.locator("#send").click()
    expect(answer(page)).to_have_text("The chart and the notes.")
    for from_the_store in (False, True):
        if from_the_store:
            page.reload()
        files = page.locator(".message.assistant").last.locator(".files")
        chart = files.locator("img.file-image")
        page.wait_for_function("image => image.complete && image.naturalWidth === 24", arg=chart.element_handle())
        with page.expect_download() as download:
            files.get_by_text("notes.md (text/markdown)").click()
        assert download.value.suggested_filename == "notes.md"
        assert download.value.path().read_bytes() == b"# June\n- shipped"
