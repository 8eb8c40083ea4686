"""The gateway's chat page in a real browser (Debian's headless Chromium) against a
real `ember serve` and the scripted model server: what a user sees.

One gateway (and model server) serves the module's keyed tests, to keep the
runtime short; each test is still isolated, as every browser context starts a
session of its own.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from playwright.sync_api import Page, expect

from ember.core.skills import Proposal, ProposalStatus, SkillRisk, new_proposal_id
from ember.skills.format import render_skill_md
from ember.store.skills import SqlSkillStore
from ember.store.sqlite.database import SqliteDatabase
from tests.browser import answer, box, needs_chromium, offer_key, send, sign_in
from tests.gatewayproc import GatewayProcess, LaunchGateway
from tests.loopback import wait_until
from tests.modelserver import CANNED_EXPLANATION, ModelServer, Reply, serving, tool_call

ALICE_KEY = "alice-secret-0123456789"

pytestmark = needs_chromium


@pytest.fixture(scope="module")
def model() -> Iterator[ModelServer]:
    with serving() as server:
        yield server


@pytest.fixture(scope="module")
def gateway(model: ModelServer, launch_module_gateway: LaunchGateway) -> GatewayProcess:
    """`ember serve` with one key, alice's, not rate-limited: the module's pages and polls add up."""
    return launch_module_gateway(model, keys={"alice": ALICE_KEY}, EMBER_GATEWAY_RATE_PER_MINUTE="100000",
                                 EMBER_GATEWAY_RATE_BURST="10000")


def test_sign_in_streams_the_answer_and_a_reload_shows_the_history(
        page: Page, model: ModelServer, gateway: GatewayProcess) -> None:
    words = " ".join(f"word{i:02d}" for i in range(40))
    model.push(Reply(text=f"Counting: {words} done.", chunk_delay_s=0.04))

    sign_in(page, gateway, ALICE_KEY)
    expect(page.locator("#app-view")).to_be_visible()
    expect(page.locator("#sign-in-view")).to_be_hidden()
    send(page, "count for me")

    draft = page.locator(".message.assistant .draft")
    expect(draft).to_contain_text("word03")
    assert "done." not in draft.inner_text(), "the whole answer arrived at once: nothing was streamed"
    expect(page.locator("#send")).to_be_disabled()

    expect(answer(page)).to_have_text(f"Counting: {words} done.")
    expect(draft).to_have_count(0)  # the final replaced the draft
    expect(page.locator("#send")).to_be_enabled()
    session = page.url.split("#", 1)[1]
    assert session.startswith("web-")
    listed = page.locator(f'#sessions li[data-key="{session}"]')
    expect(listed).to_contain_text("2 messages")
    expect(listed.locator("a")).to_have_text("count for me")  # titled by its first message

    page.reload()
    expect(page.locator(".message.user")).to_have_text(["count for me"])
    expect(page.locator(".message.assistant")).to_have_count(1)
    expect(answer(page)).to_have_text(f"Counting: {words} done.")
    expect(page.locator("#sign-in-view")).to_be_hidden()

    page.locator("#sign-out").click()
    expect(page.locator("#sign-in-view")).to_be_visible()
    page.reload()
    expect(page.locator("#key-input")).to_be_visible()
    expect(page.locator(".message")).to_have_count(0)


def test_a_wrong_key_shows_an_error_and_no_sessions(
        page: Page, model: ModelServer, gateway: GatewayProcess) -> None:
    model.push(Reply(text="noted"))
    with httpx.stream("POST", gateway.url("/api/sessions/diary/messages"), json={"text": "remember this"},
                      headers={"Authorization": f"Bearer {ALICE_KEY}"}, timeout=20) as response:
        assert "event: final" in response.read().decode()

    offer_key(page, gateway, "not-alices-key-at-all")
    expect(page.locator("#sign-in-error")).to_contain_text("not accepted")
    expect(page.locator("#app-view")).to_be_hidden()
    expect(page.locator("#sessions li")).to_have_count(0)
    assert page.evaluate("localStorage.length") == 0

    page.locator("#key-input").fill(ALICE_KEY)  # the same page, with the right key, lists it
    page.locator("#sign-in").click()
    expect(page.locator('#sessions li[data-key="diary"]')).to_contain_text("remember this")
    expect(page.locator("#sign-in-error")).to_be_hidden()


def test_a_tool_call_is_shown_collapsed_with_its_result(
        page: Page, model: ModelServer, gateway: GatewayProcess) -> None:
    workspace = gateway.home / "workspaces" / "alice"  # the workspace of the key whose turns run here
    workspace.mkdir(parents=True, exist_ok=True)
    (workspace / "shopping-list.txt").write_text("eggs\n")
    model.push(Reply(text="Let me look.", tool_calls=(tool_call("list_dir", path="."),)),
                      Reply(text="There is one file: shopping-list.txt"))

    sign_in(page, gateway, ALICE_KEY)
    send(page, "what files do I have?")
    expect(answer(page).last).to_have_text("There is one file: shopping-list.txt")

    for attempt in ("live", "reloaded"):
        tool = page.locator(".message.assistant details.tool")
        expect(tool, attempt).to_have_count(1)
        assert tool.get_attribute("open") is None, attempt
        expect(tool.locator("summary"), attempt).to_contain_text("list_dir")
        result = tool.locator(".tool-result")
        expect(result, attempt).to_be_hidden()
        tool.locator("summary").click()
        expect(result, attempt).to_be_visible()
        expect(result, attempt).to_contain_text("shopping-list.txt")
        expect(tool.locator(".tool-args"), attempt).to_contain_text('"path": "."')
        expect(page.locator(".message.assistant .text"), attempt).to_have_text(
            ["Let me look.", "There is one file: shopping-list.txt"])
        page.reload()


def test_a_risky_call_waits_for_the_users_click(page: Page, model: ModelServer, gateway: GatewayProcess) -> None:
    model.push(Reply(tool_calls=(tool_call("write_file", path="from-the-page.txt", content="hello"),)),
               Reply(text="Written."),
               Reply(tool_calls=(tool_call("write_file", path="refused.txt", content="no"),)),
               Reply(text="Not written."))
    sign_in(page, gateway, ALICE_KEY)

    send(page, "write a file")
    request = page.locator(".approval").last
    expect(request.locator(".approval-question")).to_have_text(
        "Allow Ember to write the file from-the-page.txt?")
    # The approval model's reading of the call (the test model server's canned one).
    expect(request.locator(".approval-explanation")).to_have_text(json.loads(CANNED_EXPLANATION)["explanation"])
    expect(request.locator(".approval-rating")).to_have_text("Risk: medium (changes a file)")
    request.locator(".approval-approve_once").click()
    expect(answer(page).last).to_have_text("Written.")
    assert (gateway.home / "workspaces" / "alice" / "from-the-page.txt").read_text() == "hello"

    send(page, "write another")
    expect(page.locator(".approval")).to_have_count(2)
    page.locator(".approval").last.locator(".approval-deny").click()
    expect(answer(page).last).to_have_text("Not written.")
    expect(page.locator(".approval").last.locator(".approval-outcome")).to_have_text("Denied.")
    assert not (gateway.home / "workspaces" / "alice" / "refused.txt").exists()


def test_model_output_cannot_run_script(
        page: Page, model: ModelServer, gateway: GatewayProcess) -> None:
    attacks = ['<script>window.__pwned=1</script>', '<img src=x onerror="window.__pwned=1">',
               '[x](javascript:window.__pwned=1)']
    model.push(Reply(text="Try these:\n\n" + "\n\n".join(attacks)))

    sign_in(page, gateway, ALICE_KEY)
    send(page, "say something nasty")
    for attempt in ("live", "reloaded"):
        reply = page.locator(".message.assistant")
        for attack in attacks:
            expect(reply, attempt).to_contain_text(attack)  # shown literally, as text
        assert reply.locator("script, img, a, [onerror]").count() == 0, attempt
        page.get_by_text(attacks[2]).click()
        page.wait_for_timeout(200)
        assert page.evaluate("typeof window.__pwned") == "undefined", attempt
        page.reload()


def test_markdown_renders_and_an_open_gateway_needs_no_key(
        page: Page, model: ModelServer, launch_gateway: LaunchGateway) -> None:
    gateway = launch_gateway(model)  # no keys: the page skips the sign-in form
    model.push(Reply(text=(
        "Here is **bold** and *italic*.\n\n"
        "```\nif a < b:\n    print('<b>x</b>')\n```\n\n"
        "Steps:\n- one\n- two\n\n"
        "See [the docs](https://example.com/a_b?x=1&y=2)."
    )))

    page.goto(gateway.url("/"))
    expect(page.locator("#app-view")).to_be_visible()
    expect(page.locator("#sign-out")).to_be_hidden()
    send(page, "format something")

    reply = page.locator(".message.assistant")
    expect(reply.locator("strong")).to_have_text("bold")
    expect(reply.locator("em")).to_have_text("italic")
    expect(reply.locator("pre > code")).to_have_text("if a < b:\n    print('<b>x</b>')")
    expect(reply.locator("ul > li")).to_have_text(["one", "two"])
    link = reply.locator("a")
    expect(link).to_have_text("the docs")
    expect(link).to_have_attribute("href", "https://example.com/a_b?x=1&y=2")
    expect(link).to_have_attribute("rel", "noopener noreferrer")
    expect(link).to_have_attribute("target", "_blank")
    expect(reply.locator("b")).to_have_count(0)


def test_the_memory_panel_lists_searches_forgets_and_escapes(
        page: Page, launch_gateway: LaunchGateway) -> None:
    # Lexical search only: the dense half ranks every memory that has a vector (it has no similarity
    # floor), so with an embedder a search lists all of them, best first, and narrows nothing.
    gateway = launch_gateway(None, keys={"alice": ALICE_KEY}, EMBER_EMBEDDING_MODEL="none")
    tea, cello, attack = ("Alice drinks green tea every morning", "Alice plays the cello on Sundays",
                          "<img src=x onerror=alert(1)>")
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    with httpx.Client(base_url=gateway.base_url, headers={"Authorization": f"Bearer {ALICE_KEY}"},
                      timeout=20) as api:
        made = {}
        for content in (tea, cello, attack):
            response = api.post("/api/memory", json={"content": content})
            assert response.status_code == 201, response.text
            made[content] = response.json()["id"]

        sign_in(page, gateway, ALICE_KEY)
        panel = page.locator("#memory-panel")
        expect(panel.locator("h2")).to_have_text("What Ember remembers about you")
        contents = panel.locator(".memory .memory-content")
        expect(contents).to_have_text([attack, cello, tea])  # newest first
        expect(panel.get_by_text(attack, exact=True)).to_be_visible()  # shown as text, not as markup
        assert panel.locator("img, [onerror]").count() == 0

        page.locator("#memory-query").fill("tea")
        page.locator("#memory-query").press("Enter")
        expect(contents).to_have_text([tea])

        panel.locator(".memory", has_text=tea).locator(".memory-forget").click()
        expect(contents).to_have_count(0)
        expect(page.locator("#memory-status")).to_have_text("Nothing remembered now.")
        assert made[tea] not in [record["id"] for record in api.get("/api/memory").json()]
        archived = [r for r in api.get("/api/memory", params={"all": "true"}).json() if r["id"] == made[tea]]
        assert [r["status"] for r in archived] == ["archived"]

        page.locator("#memory-query").fill("")  # an emptied search box lists everything again
        expect(contents).to_have_text([attack, cello])
        page.reload()
        expect(contents).to_have_text([attack, cello])

        # Stated in the panel: a fact of the person's, listed at once, newest first.
        stated = "Alice is allergic to peanuts"
        page.locator("#memory-new").fill(stated)
        page.locator("#memory-new").press("Enter")
        expect(contents).to_have_text([stated, attack, cello])
        expect(page.locator("#memory-new")).to_have_value("")
        [record] = [r for r in api.get("/api/memory").json() if r["content"] == stated]
        assert (record["kind"], record["source_rank"]) == ("fact", "user_stated")
        page.locator("#memory-new").fill(stated)
        page.locator("#memory-add-button").click()
        expect(page.locator("#memory-status")).to_have_text("Already remembered.")
        expect(contents).to_have_text([stated, attack, cello])

        # Corrected in place: the new text replaces the fact, whose history keeps the old one.
        fact = panel.locator(".memory").first  # newest first; while edited, its text is in a box, not the item
        fact.locator(".memory-edit").click()
        box = fact.locator(".memory-edit-box")
        expect(box).to_be_focused()
        box.press("Escape")  # left as it was
        expect(contents).to_have_text([stated, attack, cello])
        fact.locator(".memory-edit").click()
        corrected = "Alice is allergic to peanuts and cashews"
        fact.locator(".memory-edit-box").fill(corrected)
        fact.locator(".memory-edit-box").press("Enter")
        expect(contents).to_have_text([corrected, attack, cello])
        old = [r for r in api.get("/api/memory", params={"all": "true"}).json() if r["id"] == record["id"]]
        assert [r["status"] for r in old] == ["superseded"]
    page.wait_for_timeout(200)
    assert dialogs == []


def propose_skill(gateway: GatewayProcess, identity: str, name: str, description: str, body: str, *,
                  reason: str, risk: SkillRisk = SkillRisk.LOW, risk_reasons: tuple[str, ...] = ()) -> str:
    """A pending proposal for `identity`, written into the running gateway's database as a review would."""
    proposal = Proposal(id=new_proposal_id(), identity=identity, name=name, action="create",
                        text=render_skill_md(name, description, body), risk=risk, risk_reasons=risk_reasons,
                        status=ProposalStatus.PENDING, reason=reason, created_at=time.time(), job_id=None)

    async def write() -> None:
        db = SqliteDatabase(gateway.home / "ember.db")
        await db.open()
        try:
            await SqlSkillStore(db).finish_review(f"http:{identity}:review-{name}", 0, proposal)
        finally:
            await db.close()

    # Sync Playwright keeps an event loop running in this thread: the store's loop gets a thread of its own.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, write()).result()
    return proposal.id


def test_the_skills_panel_lists_skills_and_approves_or_rejects_proposals(
        page: Page, model: ModelServer, gateway: GatewayProcess) -> None:
    attack = "<script>window.__pwned = 1</script> <img src=x onerror=\"window.__pwned = 2\">"
    weekly = propose_skill(gateway, "alice", "weekly-report", "Write the weekly report.",
                           f"1. Gather the week's notes.\n2. {attack}", reason="asked every Friday")
    risky = propose_skill(gateway, "alice", "purge-downloads", "Delete old downloads.", "1. Run rm -rf.",
                          reason="tidied up twice", risk=SkillRisk.HIGH, risk_reasons=("runs commands",))
    page.set_viewport_size({"width": 390, "height": 800})  # a phone: the panel is in the memory drawer
    page.emulate_media(reduced_motion="reduce")
    sign_in(page, gateway, ALICE_KEY)
    page.locator("#open-memory").click()
    panel = page.locator("#skills-section")
    expect(panel.get_by_role("heading", name="Skills", exact=True)).to_be_visible()

    bundled = panel.locator('#skills .skill[data-name="web-research"]')
    expect(bundled.locator(".skill-meta")).to_contain_text("shared · version ")
    expect(bundled.locator(".skill-description")).not_to_be_empty()

    proposals = panel.locator("#skill-proposals .skill-proposal")
    expect(proposals).to_have_count(2)
    report = proposals.and_(page.locator(f'[data-id="{weekly}"]'))
    expect(report.locator(".skill-name")).to_have_text("weekly-report")
    expect(report.locator(".skill-proposal-risk")).to_have_text("Risk: low")
    expect(report.locator(".skill-proposal-reason")).to_have_text("Why: asked every Friday")
    diff = report.locator("pre.skill-diff")
    expect(diff).to_contain_text("+description: Write the weekly report.")
    expect(diff).to_contain_text(f"+2. {attack}")  # shown literally, as text
    expect(diff.locator(".diff-add").first).to_be_visible()
    assert panel.locator("script, img, [onerror]").count() == 0
    assert page.evaluate("typeof window.__pwned") == "undefined"
    purge = proposals.and_(page.locator(f'[data-id="{risky}"]'))
    expect(purge.locator(".skill-proposal-risk")).to_have_text("Risk: high (runs commands)")
    card = box(page, f'.skill-proposal[data-id="{weekly}"]')
    assert card["x"] >= 0 and card["x"] + card["width"] <= 390, card  # fits the phone's width

    page.get_by_role("button", name="Approve skill weekly-report").click()
    expect(report).to_have_count(0)
    learned = panel.locator('#skills .skill[data-name="weekly-report"]')
    expect(learned.locator(".skill-meta")).to_have_text("learned · version 1")
    expect(learned.locator(".skill-description")).to_have_text("Write the weekly report.")
    learned.locator("summary").click()  # a card opens on the skill's instructions, the attack as text
    expect(learned.locator(".skill-text")).to_contain_text("Gather the week's notes.")
    expect(learned.locator(".skill-text")).to_contain_text(attack)
    assert panel.locator("script, img, [onerror]").count() == 0
    assert page.evaluate("typeof window.__pwned") == "undefined"

    page.get_by_role("button", name="Reject skill purge-downloads").click()
    expect(proposals).to_have_count(0)
    expect(panel.locator("#skill-proposals-section")).to_be_hidden()
    expect(panel.locator("#skills-error")).to_be_hidden()
    headers = {"Authorization": f"Bearer {ALICE_KEY}"}
    names = [skill["name"] for skill in httpx.get(gateway.url("/api/skills"), headers=headers).json()]
    assert "weekly-report" in names and "purge-downloads" not in names
    expect(panel.locator('#skills .skill[data-name="purge-downloads"]')).to_have_count(0)

    # A proposal a review makes meanwhile shows up when the next turn ends; one decided elsewhere
    # while the page still offers it gets an error line, and the lists show what it became.
    late = propose_skill(gateway, "alice", "water-plants", "Remind about the plants.", "1. Remind.",
                         reason="asked twice")
    page.keyboard.press("Escape")
    model.push(Reply(text="Noted."))
    send(page, "thanks")
    expect(answer(page)).to_have_text("Noted.")
    page.locator("#open-memory").click()
    expect(proposals).to_have_count(1)
    decided = httpx.post(gateway.url(f"/api/skills/pending/{late}"), json={"decision": "reject"}, headers=headers)
    assert decided.status_code == 200, decided.text
    page.get_by_role("button", name="Approve skill water-plants").click()
    expect(panel.locator("#skills-error")).to_contain_text("Could not approve skill water-plants")
    expect(proposals).to_have_count(0)
    expect(panel.locator('#skills .skill[data-name="water-plants"]')).to_have_count(0)

    page.keyboard.press("Escape")
    page.locator("#sign-out").click()
    expect(page.locator("#skills li, #skill-proposals li")).to_have_count(0)
    expect(page.locator("#skills-error")).to_be_hidden()


@pytest.mark.parametrize(("width", "sessions_inline", "memory_inline"), [
    (390, False, False),  # a phone: both are drawers
    (768, True, False),   # a tablet: the session list beside the chat, the memory a drawer
    (1280, True, True),   # a desk: three columns
])
def test_the_layout_fits_phones_tablets_and_desks(page: Page, model: ModelServer, gateway: GatewayProcess,
                                                  width: int, sessions_inline: bool, memory_inline: bool) -> None:
    page.set_viewport_size({"width": width, "height": 800})
    page.emulate_media(reduced_motion="reduce")  # drawers open at once: their boxes are final
    sign_in(page, gateway, ALICE_KEY)
    expect(page.locator("#app-view")).to_be_visible()
    composer = box(page, "#message-input")
    chat = box(page, "main")
    # The composer spans the chat column, and the chat column most of what the panels leave.
    assert composer["width"] >= chat["width"] - 120, (composer, chat)
    assert chat["width"] >= (width * 0.9 if not sessions_inline else width * 0.45)
    expect(page.locator("#sidebar")).to_be_visible() if sessions_inline else expect(
        page.locator("#sidebar")).to_be_hidden()
    expect(page.locator("#memory-panel")).to_be_visible() if memory_inline else expect(
        page.locator("#memory-panel")).to_be_hidden()
    expect(page.locator("#open-sessions")).to_be_hidden() if sessions_inline else expect(
        page.locator("#open-sessions")).to_be_visible()

    if not sessions_inline:  # the drawer opens over the chat, and picking a session closes it
        page.locator("#open-sessions").click()
        expect(page.locator("#sidebar")).to_be_visible()
        expect(page.locator("#open-sessions")).to_have_attribute("aria-expanded", "true")
        drawer = box(page, "#sidebar")
        assert drawer["x"] >= 0 and drawer["width"] <= width * 0.9
        page.locator("#new-session").click()
        expect(page.locator("#sidebar")).to_be_hidden()
        expect(page.locator("#open-sessions")).to_have_attribute("aria-expanded", "false")
    if not memory_inline:  # and Escape closes the memory drawer
        page.locator("#open-memory").click()
        expect(page.locator("#memory-panel")).to_be_visible()
        page.keyboard.press("Escape")
        expect(page.locator("#memory-panel")).to_be_hidden()
    page.screenshot(path=str(gateway.home.parent / f"layout-{width}.png"))  # for a person to look at


def test_the_page_says_who_and_which_model_offers_first_prompts_copies_code_and_retries(
        page: Page, model: ModelServer, gateway: GatewayProcess) -> None:
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=gateway.base_url)
    sign_in(page, gateway, ALICE_KEY)
    expect(page.locator("#whoami")).to_have_text(f"Signed in as alice · model: {model.model}")

    empty = page.locator(".empty-state")
    expect(empty).to_contain_text("Ember works for you across days")
    model.push(Reply(text="Here is how:\n\n```\nprint('hi')\n```"))
    page.locator(".first-prompt", has_text="What can you do for me?").click()
    expect(empty).to_have_count(0)
    expect(page.locator(".message.user")).to_have_text(["What can you do for me?"])
    copy = answer(page).locator("button.copy")
    expect(copy).to_have_count(1)
    copy.click()
    expect(copy).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == "print('hi')"

    model.push(Reply(status=400, error_message="scripted: the request was refused"))
    send(page, "try this")
    retry = page.locator(".message.assistant .error button.retry")
    expect(retry).to_be_visible()
    model.push(Reply(text="Second time lucky."))
    retry.click()
    expect(answer(page)).to_have_text("Second time lucky.")
    expect(page.locator(".message.user")).to_have_text(["What can you do for me?", "try this"])
    session = page.url.split("#", 1)[1]
    stored = httpx.get(gateway.url(f"/api/sessions/{session}/messages"),
                       headers={"Authorization": f"Bearer {ALICE_KEY}"}).json()["messages"]
    assert [m["content"] for m in stored if m["role"] == "user"] == ["What can you do for me?", "try this"]
    expect(page.locator(f'#sessions li[data-key="{session}"]')).to_contain_text("just now")


@pytest.mark.parametrize(("scheme", "background"), [("light", "rgb(246, 246, 244)"), ("dark", "rgb(23, 21, 19)")])
def test_the_page_follows_the_systems_light_or_dark_theme(page: Page, gateway: GatewayProcess, scheme: str,
                                                          background: str) -> None:
    page.emulate_media(color_scheme=scheme)  # type: ignore[arg-type]
    sign_in(page, gateway, ALICE_KEY)
    expect(page.locator("#app-view")).to_be_visible()
    assert page.evaluate("getComputedStyle(document.body).backgroundColor") == background
    text = page.evaluate("getComputedStyle(document.body).color")
    assert text != background


def test_a_session_can_be_found_renamed_and_put_away(page: Page, model: ModelServer, gateway: GatewayProcess) -> None:
    sign_in(page, gateway, ALICE_KEY)
    expect(page.locator("#session-actions")).to_be_hidden()  # nothing to rename before the first message
    model.push(Reply(text="Noted."))
    send(page, "plans for the garden")
    expect(answer(page)).to_have_text("Noted.")
    session = page.url.split("#", 1)[1]
    item = page.locator(f'#sessions li[data-key="{session}"]')
    expect(item.locator("a")).to_have_text("plans for the garden")
    expect(page.locator("#session-title")).to_have_text("plans for the garden")

    browser_dialogs: list[str] = []
    page.on("dialog", lambda dialog: (browser_dialogs.append(dialog.message), dialog.dismiss()))
    page.locator("#rename-session").click()  # the page's own dialog, its text chosen to be replaced
    expect(page.locator("#rename-dialog")).to_be_visible()
    expect(page.locator("#rename-input")).to_be_focused()
    page.keyboard.press("Escape")  # Escape cancels: nothing changes
    expect(page.locator("#rename-dialog")).to_be_hidden()
    expect(item.locator("a")).to_have_text("plans for the garden")
    page.locator("#rename-session").click()
    page.screenshot(path=str(gateway.home.parent / "rename-dialog.png"))  # for a person to look at
    page.keyboard.type("Garden 2027")  # replaces the selected name
    page.keyboard.press("Enter")
    expect(item.locator("a")).to_have_text("Garden 2027")
    expect(page.locator("#session-title")).to_have_text("Garden 2027")

    page.locator("#session-filter").fill("garden")
    expect(item).to_be_visible()
    page.locator("#session-filter").fill("no such words")
    expect(item).to_be_hidden()
    page.locator("#session-filter").fill("")

    page.locator("#archive-session").click()
    expect(page.locator("#delete-dialog")).to_be_visible()
    page.get_by_role("button", name="Cancel").click()
    expect(item).to_be_visible()
    page.locator("#archive-session").click()
    page.locator("#delete-confirm").click()
    expect(page.locator(f'#sessions li[data-key="{session}"]')).to_have_count(0)
    assert browser_dialogs == []  # the browser's own prompt and confirm never showed
    assert page.url.split("#", 1)[1] != session  # a new session is open
    headers = {"Authorization": f"Bearer {ALICE_KEY}"}
    listed = httpx.get(gateway.url("/api/sessions"), params={"archived": "true"}, headers=headers).json()
    [kept] = [s for s in listed["sessions"] if s["key"] == session]
    assert kept["archived"] is True and kept["title"] == "Garden 2027"
    history = httpx.get(gateway.url(f"/api/sessions/{session}/messages"), headers=headers).json()["messages"]
    assert [m["content"] for m in history] == ["plans for the garden", "Noted."]  # put away, not erased
    assert httpx.delete(gateway.url("/api/sessions/never-was"), headers=headers).status_code == 404


def test_a_request_of_a_turn_the_page_is_not_showing_can_be_answered_there(
        page: Page, model: ModelServer, gateway: GatewayProcess) -> None:
    model.push(Reply(tool_calls=(tool_call("write_file", path="from-elsewhere.txt", content="hi"),)),
               Reply(text="Written from elsewhere."))
    headers = {"Authorization": f"Bearer {ALICE_KEY}"}
    # Another client starts the turn and goes away while it waits for the approval.
    with httpx.stream("POST", gateway.url("/api/sessions/elsewhere/messages"), json={"text": "write it"},
                      headers=headers, timeout=20) as response:
        for line in response.iter_lines():
            if line == "event: approval_request":
                break
    sign_in(page, gateway, ALICE_KEY)
    pending = page.locator("#pending-approvals .approval")
    expect(pending).to_have_count(1)
    expect(pending.locator(".approval-session")).to_have_text("In session elsewhere")
    expect(pending.locator(".approval-question")).to_have_text("Allow Ember to write the file from-elsewhere.txt?")
    pending.locator(".approval-approve_once").click()
    expect(pending.locator(".approval-outcome")).to_have_text("Allowed.")
    for _ in range(100):
        if (gateway.home / "workspaces" / "alice" / "from-elsewhere.txt").exists():
            break
        page.wait_for_timeout(100)
    assert (gateway.home / "workspaces" / "alice" / "from-elsewhere.txt").read_text() == "hi"
    expect(page.locator("#pending-approvals")).to_be_hidden(timeout=10_000)  # the next look finds none
    page.goto(gateway.url("/#elsewhere"))
    expect(answer(page).last).to_have_text("Written from elsewhere.")


def test_stop_ends_the_turn_keeps_what_it_showed_and_a_reload_offers_it_again(
        page: Page, model: ModelServer, gateway: GatewayProcess) -> None:
    sign_in(page, gateway, ALICE_KEY)
    words = " ".join(f"word{i:02d}" for i in range(200))
    model.push(Reply(text=words, chunk_delay_s=0.05))
    send(page, "write a lot")
    draft = page.locator(".message.assistant .draft")
    expect(draft).to_contain_text("word03")
    expect(page.locator("#send")).to_be_disabled()
    page.locator("#stop").click()
    card = page.locator(".message.assistant .error")
    expect(card).to_contain_text("Stopped")
    expect(draft).to_contain_text("word03")  # what had streamed stays on the page
    expect(page.locator("#stop")).to_be_hidden()
    expect(page.locator("#send")).to_be_enabled()

    page.reload()  # the history says the turn was stopped, and offers it again
    expect(page.locator(".message.user")).to_have_text(["write a lot"])
    expect(card).to_contain_text("Stopped")
    model.push(Reply(text="A short answer this time."))
    card.locator("button.retry").click()
    expect(answer(page)).to_have_text("A short answer this time.")
    expect(page.locator(".message.user")).to_have_text(["write a lot"])
    expect(card).to_have_count(0)


def test_the_key_is_kept_for_the_tab_unless_the_person_asks_to_be_remembered(
        page: Page, gateway: GatewayProcess) -> None:
    sign_in(page, gateway, ALICE_KEY)
    expect(page.locator("#sign-out")).to_be_visible()
    assert page.evaluate("localStorage.length") == 0
    page.reload()
    expect(page.locator("#sign-out")).to_be_visible()  # the tab's session still holds it
    other_tab = page.context.new_page()
    other_tab.goto(gateway.url("/"))
    expect(other_tab.locator("#key-input")).to_be_visible()  # but nowhere else
    other_tab.close()

    page.locator("#sign-out").click()
    page.locator("#key-input").fill(ALICE_KEY)
    page.locator("#remember-key").check()
    page.locator("#sign-in").click()
    expect(page.locator("#sign-out")).to_be_visible()
    remembered = page.context.new_page()
    remembered.goto(gateway.url("/"))
    expect(remembered.locator("#sign-out")).to_be_visible()
    remembered.locator("#sign-out").click()
    assert remembered.evaluate("localStorage.length") == 0


def test_an_answer_with_a_table_renders_its_header_aligned_cells_and_body(
        page: Page, model: ModelServer, gateway: GatewayProcess) -> None:
    model.push(Reply(text=(
        "Prices:\n\n"
        "| Fruit | Colour | Price |\n"
        "|:------|:------:|------:|\n"
        "| apple | **red** | `1\\|2` |\n"  # an escaped pipe stays in its cell
        "| [kiwi](https://example.com/kiwi) | green |\n"  # too few cells: padded
        "| plum | purple | 3 | extra |\n\n"  # too many: cut
        "a | b, but no delimiter row"
    )))
    sign_in(page, gateway, ALICE_KEY)
    send(page, "a table please")

    table = answer(page).locator(".table-wrap > table")
    expect(table).to_have_count(1)
    headers = table.locator("thead th")
    expect(headers).to_have_text(["Fruit", "Colour", "Price"])
    assert [th.get_attribute("class") for th in headers.all()] == ["align-left", "align-center", "align-right"]
    rows = table.locator("tbody tr")
    expect(rows).to_have_count(3)
    expect(rows.nth(0).locator("td")).to_have_text(["apple", "red", "1|2"])
    expect(rows.nth(0).locator("td strong")).to_have_text("red")
    expect(rows.nth(0).locator("td code")).to_have_text("1|2")
    expect(rows.nth(1).locator("td")).to_have_text(["kiwi", "green", ""])
    expect(rows.nth(1).locator("td a")).to_have_attribute("href", "https://example.com/kiwi")
    expect(rows.nth(2).locator("td")).to_have_text(["plum", "purple", "3"])
    aligned = [td.evaluate("td => getComputedStyle(td).textAlign") for td in rows.nth(2).locator("td").all()]
    assert aligned == ["left", "center", "right"]
    expect(answer(page).locator("p")).to_have_text(["Prices:", "a | b, but no delimiter row"])


def test_code_in_a_named_language_is_highlighted_and_copies_exactly_as_written(
        page: Page, model: ModelServer, gateway: GatewayProcess) -> None:
    code = ("def greet(name):\n"
            "    # say hi & <wave>\n"
            "    return f\"<b>hi</b> {name}\" if name else 'nobody'")
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=gateway.base_url)
    model.push(Reply(text=f"Like this:\n\n```python\n{code}\n```\n\nDone."))
    sign_in(page, gateway, ALICE_KEY)
    send(page, "some python")

    block = answer(page).locator("pre > code.language-python")
    expect(block).to_have_count(1)
    keywords = block.locator(".tok-keyword").all_inner_texts()
    assert {"def", "return", "if", "else"} <= set(keywords), keywords
    expect(block.locator(".tok-string")).to_have_text(['"<b>hi</b> {name}"', "'nobody'"])
    expect(block.locator(".tok-comment")).to_have_text("# say hi & <wave>")
    assert block.evaluate("code => code.textContent") == code
    keyword_colour = block.locator(".tok-keyword").first.evaluate("span => getComputedStyle(span).color")
    assert keyword_colour != block.evaluate("code => getComputedStyle(code).color")  # the stylesheet colours it

    copy = answer(page).locator("button.copy")
    expect(copy).to_have_count(1)
    copy.click()
    expect(copy).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == code


def test_hostile_text_in_tables_and_highlighted_code_is_shown_not_run(
        page: Page, model: ModelServer, gateway: GatewayProcess) -> None:
    img = "<img src=x onerror=window.__pwned=1>"
    script = "</span><script>window.__pwned=2</script>"
    model.push(Reply(text=(
        f"| name | note |\n|---|:---:|\n| {img} | `{img}` |\n\n"
        f"```html\n{img}\n<script>window.__pwned=3</script>\n```\n\n"
        f"```python\nx = \"{script}\"  # {img}\n```\n\n"
        f"```js\nlet s = '{script}'; /* {img} */\n```"
    )))
    sign_in(page, gateway, ALICE_KEY)
    send(page, "be nasty")
    expect(answer(page).locator("pre")).to_have_count(3)

    for attempt in ("live", "reloaded"):
        messages = page.locator("#messages")
        expect(messages.locator("td"), attempt).to_have_text([img, img])
        codes = messages.locator("pre > code")
        expect(codes, attempt).to_have_text([f"{img}\n<script>window.__pwned=3</script>",
                                             f'x = "{script}"  # {img}', f"let s = '{script}'; /* {img} */"])
        expect(codes.nth(0).locator(".tok-tag").first, attempt).to_have_text("<img")
        expect(codes.nth(1).locator(".tok-string"), attempt).to_have_text(f'"{script}"')
        assert messages.locator("img, script, [onerror], [src]").count() == 0, attempt
        classes = messages.locator("pre span").evaluate_all("spans => spans.map((s) => s.className)")
        assert classes and all(c.startswith("tok-") for c in classes), (attempt, classes)
        page.wait_for_timeout(200)
        assert page.evaluate("typeof window.__pwned") == "undefined", attempt
        page.reload()


@pytest.mark.parametrize("width", [390, 768])
def test_a_wide_table_scrolls_in_its_wrapper_instead_of_widening_the_page(
        page: Page, model: ModelServer, gateway: GatewayProcess, width: int) -> None:
    columns = range(10)
    model.push(Reply(text="\n".join([
        "| " + " | ".join(f"column_{n}_heading" for n in columns) + " |",
        "|" + "---|" * len(columns),
        "| " + " | ".join(f"value_{n}_is_rather_long" for n in columns) + " |",
    ])))
    page.set_viewport_size({"width": width, "height": 800})
    sign_in(page, gateway, ALICE_KEY)
    send(page, "a wide table")

    wrap = answer(page).locator(".table-wrap")
    expect(wrap.locator("th")).to_have_count(len(columns))
    assert page.evaluate("document.documentElement.scrollWidth") <= width
    assert page.evaluate("(m => m.scrollWidth <= m.clientWidth)(document.getElementById('messages'))")
    chat, table = box(page, "#messages"), box(page, ".table-wrap")
    assert table["x"] >= chat["x"] and table["x"] + table["width"] <= chat["x"] + chat["width"], (chat, table)
    assert wrap.evaluate("w => w.scrollWidth > w.clientWidth")
    assert wrap.evaluate("w => { w.scrollLeft = 200; return w.scrollLeft; }") > 0


RENDER = """async (markdown) => (await import("/static/markdown.js")).renderMarkdown(markdown)"""

# Renders fenced code in each language, and tables, from fixed and from (seeded) random pieces of
# hostile text; returns what went wrong: an element or attribute not of ours, or code not kept as written.
RENDERER_FUZZ = """async (tags) => {
  const { renderMarkdown } = await import("/static/markdown.js");
  const pieces = ["<", ">", "&", "&lt;", "&amp;", '"', "'", "`", "\\\\", "\\n", " ", "\\t", "#", "//", "/*", "*/",
    "--", "<!--", "-->", "=", ":", ";", "|", "\\\\|", "{", "}", "[", "]", "$", "@", "!", "0x1F", "1.5e3", "def",
    "return", "if", "<img src=x onerror=window.__pwned=1>", "</span>", "<script>", "'''", '\"\"\"', "**", "_",
    "[a](https://a.example/x)", "---", ":-:", "é", "🙂"];
  let seed = 7;
  const random = (n) => Math.floor((seed = (seed * 16807) % 2147483647) / 2147483647 * n);
  const sample = () => Array.from({ length: 1 + random(30) }, () => pieces[random(pieces.length)]).join("");
  const tokens = /^tok-(keyword|string|comment|number|property|tag|attr)$/;
  const tableTags = new Set(["DIV", "TABLE", "THEAD", "TBODY", "TR", "TH", "TD", "P", "BR", "CODE", "STRONG", "EM",
    "A", "UL", "OL", "LI", "H4"]);
  const problems = [];
  const render = (markdown) => {
    const box = document.createElement("div");
    box.innerHTML = renderMarkdown(markdown);
    return box;
  };
  for (const tag of tags) {
    for (let n = 0; n < 150; n++) {
      const code = sample().replace(/`{3,}/g, "``");  // a line of ``` would end the block
      for (const markdown of ["```" + tag + "\\n" + code + "\\n```", "```" + tag + "\\n" + code]) {
        const box = render(markdown);
        const block = box.querySelector("pre > code");
        const kept = block?.textContent === code && block.className === `language-${tag}`;
        if (!kept) problems.push([markdown, box.innerHTML]);
        for (const el of box.querySelectorAll("*")) {
          const ours = el.tagName === "SPAN" ? tokens.test(el.className) && !el.children.length
            : ["PRE", "CODE"].includes(el.tagName);
          if (!ours || el.attributes.length > (el.tagName === "PRE" ? 0 : 1)) problems.push([markdown, el.outerHTML]);
        }
      }
    }
  }
  for (let n = 0; n < 300; n++) {
    const markdown = `| ${sample()} | b |\\n|:--|--:|\\n| ${sample()} | ${sample()} |`.replace(/`{3,}/g, "``");
    for (const el of render(markdown).querySelectorAll("*")) {
      const allowed = [...el.attributes].every((a) => (el.tagName === "A" && ["href", "target", "rel"].includes(a.name))
        || (a.name === "class" && /^(table-wrap|align-(left|right))$/.test(a.value)));
      if (!tableTags.has(el.tagName) || !allowed) problems.push([markdown, el.outerHTML]);
    }
  }
  await new Promise((resolve) => setTimeout(resolve, 200));  // any image of the model's would have failed by now
  if (window.__pwned !== undefined) problems.push(["window.__pwned", String(window.__pwned)]);
  return problems.slice(0, 5);
}"""

LANGUAGE_TAGS = ["python", "py", "js", "javascript", "jsx", "ts", "typescript", "tsx", "bash", "sh", "shell", "zsh",
                 "json", "sql", "go", "rust", "rs", "java", "c", "cpp", "c++", "yaml", "yml", "toml", "html", "xml",
                 "css"]


def test_the_renderer_keeps_every_languages_code_as_written_and_adds_only_its_own_markup(
        page: Page, gateway: GatewayProcess) -> None:
    page.goto(gateway.url("/"))
    expect(page.locator("#key-input")).to_be_visible()
    assert page.evaluate(RENDERER_FUZZ, LANGUAGE_TAGS) == []

    def render(markdown: str) -> str:
        return str(page.evaluate(RENDER, markdown))

    assert render("```\n<b>&</b>\n```") == "<pre><code>&lt;b&gt;&amp;&lt;/b&gt;</code></pre>"  # no tag: plain
    assert render("```constructor\nx\n```") == "<pre><code>x</code></pre>"  # unknown: plain
    assert render('```python\nx = "still streaming') == (  # an unclosed fence and string: a draft
        '<pre><code class="language-python">x = <span class="tok-string">&quot;still streaming</span></code></pre>')
    assert render("```SQL\nselect 1 -- one\n```") == (
        '<pre><code class="language-sql"><span class="tok-keyword">select</span> <span class="tok-number">1</span>'
        ' <span class="tok-comment">-- one</span></code></pre>')
    assert render("| a | b |\n|---|--:|\n| 1 |") == (
        '<div class="table-wrap"><table><thead><tr><th>a</th><th class="align-right">b</th></tr></thead>'
        '<tbody><tr><td>1</td><td class="align-right"></td></tr></tbody></table></div>')
    assert render("| a | b |\n|---|\n| 1 | 2 |") == "<p>| a | b |<br>|---|<br>| 1 | 2 |</p>"  # cells ≠ delimiters


def contrast(foreground: str, background: str) -> float:
    """The WCAG contrast ratio of two computed `rgb(r, g, b)` colours."""
    def luminance(rgb: str) -> float:
        channels = [int(part) / 255 for part in rgb[rgb.index("(") + 1:rgb.index(")")].split(",")[:3]]
        linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
        return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]
    light, dark = sorted((luminance(foreground), luminance(background)), reverse=True)
    return (light + 0.05) / (dark + 0.05)


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_highlighted_code_is_legible_in_both_themes(page: Page, gateway: GatewayProcess, scheme: str) -> None:
    page.emulate_media(color_scheme=scheme)  # type: ignore[arg-type]
    page.goto(gateway.url("/"))
    expect(page.locator("#key-input")).to_be_visible()
    colours = page.evaluate("""async () => {
      const { renderMarkdown } = await import("/static/markdown.js");
      const box = document.createElement("div");
      box.className = "message assistant";
      box.innerHTML = renderMarkdown('```python\\n# c\\ndef f(): return "s", 1\\n```\\n```html\\n<a href="x">\\n```'
        + "\\n```json\\n{\\"k\\": true}\\n```");
      document.body.append(box);
      const spans = [...box.querySelectorAll("span")];
      return { background: getComputedStyle(box.querySelector("pre")).backgroundColor,
               tokens: Object.fromEntries(spans.map((s) => [s.className, getComputedStyle(s).color])) };
    }""")
    assert set(colours["tokens"]) == {f"tok-{kind}" for kind in
                                      ("comment", "keyword", "string", "number", "tag", "attr", "property")}
    for kind, colour in colours["tokens"].items():
        assert contrast(colour, colours["background"]) >= 4.5, (scheme, kind, colour, colours["background"])


@pytest.mark.parametrize("width", [390, 1280])
def test_an_answer_can_be_copied_its_question_edited_and_asked_again(
        page: Page, model: ModelServer, gateway: GatewayProcess, width: int) -> None:
    page.set_viewport_size({"width": width, "height": 800})
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=gateway.base_url)
    sign_in(page, gateway, ALICE_KEY)
    model.push(Reply(text="Tea: **green** or black."))
    send(page, "Which tea?")
    expect(answer(page)).to_have_text("Tea: green or black.")

    actions = page.locator(".message-actions")
    expect(actions).to_have_count(1)
    copy = actions.get_by_role("button", name="Copy the answer")
    copy.click()
    expect(copy).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == "Tea: **green** or black."  # as written

    # Edit brings the question back into the composer, by keyboard too; nothing is sent yet.
    actions.get_by_role("button", name="Edit the question and send it again").focus()
    page.keyboard.press("Enter")
    expect(page.locator("#message-input")).to_have_value("Which tea?")
    expect(page.locator("#message-input")).to_be_focused()
    expect(page.locator(".message.user")).to_have_count(1)
    page.locator("#message-input").fill("")

    # Ask again sends the same question as a new message; only the latest answer offers it.
    model.push(Reply(text="Oolong, today."))
    actions.get_by_role("button", name="Send the same question again for another answer").click()
    expect(answer(page)).to_have_text("Oolong, today.")
    expect(page.locator(".message.user")).to_have_text(["Which tea?", "Which tea?"])
    expect(actions).to_have_count(2)
    expect(page.locator(".ask-again")).to_have_count(1)
    latest = page.locator(".message.assistant").last.locator("xpath=following-sibling::*[1]")
    expect(latest.locator(".ask-again")).to_have_count(1)
    session = page.url.split("#", 1)[1]
    stored = httpx.get(gateway.url(f"/api/sessions/{session}/messages"),
                       headers={"Authorization": f"Bearer {ALICE_KEY}"}).json()["messages"]
    assert [m["content"] for m in stored if m["role"] == "assistant"] == ["Tea: **green** or black.", "Oolong, today."]
    row = box(page, ".message-actions >> nth=-1")
    assert row["x"] >= 0 and row["x"] + row["width"] <= width, row  # on screen, at a phone's width too

    page.reload()  # the history offers the same, from the stored answers
    expect(page.locator(".message.user")).to_have_text(["Which tea?", "Which tea?"])
    expect(page.locator(".message-actions")).to_have_count(2)
    expect(page.locator(".ask-again")).to_have_count(1)
    page.locator(".message-actions").first.get_by_role("button", name="Copy the answer").click()
    assert page.evaluate("navigator.clipboard.readText()") == "Tea: **green** or black."


def test_a_desks_session_list_can_be_put_away_and_brought_back_by_keyboard(
        page: Page, gateway: GatewayProcess) -> None:
    page.set_viewport_size({"width": 1280, "height": 800})
    sign_in(page, gateway, ALICE_KEY)
    expect(page.locator("#sidebar")).to_be_visible()
    expect(page.locator("#open-sessions")).to_be_hidden()
    narrow = box(page, "main")["width"]
    page.locator("#collapse-sessions").focus()
    page.keyboard.press("Enter")
    expect(page.locator("#sidebar")).to_be_hidden()
    expect(page.locator("#open-sessions")).to_be_focused()  # the way back is where the keyboard is
    assert box(page, "main")["width"] > narrow + 100  # the chat takes the room
    page.reload()  # remembered on this device
    expect(page.locator("#app-view")).to_be_visible()
    expect(page.locator("#sidebar")).to_be_hidden()
    page.locator("#open-sessions").click()
    expect(page.locator("#sidebar")).to_be_visible()
    expect(page.locator("#scrim")).not_to_have_class("shown")  # beside the chat, not a drawer over it
    expect(page.locator("#collapse-sessions")).to_be_focused()


@pytest.mark.parametrize("width", [390, 1280])
def test_the_tasks_panel_shows_each_runs_answer_and_removes_a_task_on_a_second_click(
        page: Page, model: ModelServer, gateway: GatewayProcess, width: int) -> None:
    page.set_viewport_size({"width": width, "height": 800})
    headers = {"Authorization": f"Bearer {ALICE_KEY}"}
    model.push(Reply(text="The build is **green**."))
    once = httpx.post(gateway.url("/api/tasks"), headers=headers, json={"prompt": f"check the build {width}",
                                                                         "at": "+1s"}).json()
    daily = httpx.post(gateway.url("/api/tasks"), headers=headers, json={"prompt": f"water the plants {width}",
                                                                          "cron": "0 8 * * *"}).json()

    def answered() -> bool:
        runs = httpx.get(gateway.url(f"/api/tasks/{once['id']}"), headers=headers).json()["recent_runs"]
        return any(run["answer"] for run in runs)

    wait_until(answered, timeout_s=20, what="the one-off task's answer")

    sign_in(page, gateway, ALICE_KEY)
    page.locator("#open-tasks").click()
    panel = page.locator("#tasks-panel")
    entry = panel.locator(f'.task-item[data-task="{once["id"]}"]')
    expect(entry).to_contain_text(f"check the build {width}")
    expect(panel.locator(f'.task-item[data-task="{daily["id"]}"]')).to_contain_text("08:00")
    entry.get_by_role("button").focus()  # by keyboard: the entry is a button
    page.keyboard.press("Enter")
    expect(page.locator("#task-title")).to_have_text(f"check the build {width}")
    expect(panel.locator(".task-answer strong")).to_have_text("green")  # the answer, its Markdown rendered
    found = box(page, ".task-answer")
    assert found["x"] >= 0 and found["x"] + found["width"] <= width
    page.screenshot(path=str(gateway.home.parent / f"tasks-{width}.png"))  # for a person to look at
    panel.get_by_role("button", name="Back to the list").click()
    expect(entry.get_by_role("button")).to_be_focused()

    panel.locator(f'.task-item[data-task="{daily["id"]}"] button').click()
    remove = panel.locator(".task-remove")
    expect(remove).to_have_text("Remove this task")
    remove.click()  # the first click only asks
    expect(remove).to_have_text("Click again to remove it")
    assert httpx.get(gateway.url(f"/api/tasks/{daily['id']}"), headers=headers).json()["state"] == "active"
    remove.click()
    expect(panel.locator(f'.task-item[data-task="{daily["id"]}"]')).to_have_count(0)
    assert daily["id"] not in [t["id"] for t in httpx.get(gateway.url("/api/tasks"), headers=headers).json()]
    page.keyboard.press("Escape")
    page.locator("#sign-out").click()
    expect(page.locator("#open-tasks")).to_be_hidden()
    expect(panel.locator(".task-item")).to_have_count(0)  # nothing of alice's stays on the page
