// The gateway's chat page: sign in, pick a session, stream turns over the native API.
// Model text reaches the DOM only through renderMarkdown (which escapes first) or textContent.

import { startActivity } from "./activity.js";
import { $, el, hashKey, relativeTime } from "./dom.js";
import { PendingFiles, showFiles } from "./files.js";
import { renderMarkdown } from "./markdown.js";
import { MemoryPanel } from "./memory.js";
import { SkillsPanel } from "./skills.js";
import { startSettings } from "./settings.js";
import { startTasks } from "./tasks.js";
import { startUsage } from "./usage.js";

const KEY_STORE = "ember.apiKey";

const state = { key: null, open: false, session: null, view: 0, busy: false, abort: null, titles: new Map() };
const APPROVALS_POLL_MS = 3000;
// Approval requests already on the page (in the turn that asked): not listed again as pending.
const shownApprovals = new Set();

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function api(path, options = {}) {
  const headers = { ...options.headers };
  if (state.key) headers.Authorization = `Bearer ${state.key}`;
  const response = await fetch(path, { ...options, headers });
  if (response.ok) return response;
  let message = `HTTP ${response.status}`;
  try {
    message = (await response.json()).error?.message || message;
  } catch {
    // not JSON: keep the status
  }
  throw new ApiError(response.status, message);
}

const sessionPath = (key, action = "messages") => `/api/sessions/${encodeURIComponent(key)}/${action}`;
const pendingFiles = new PendingFiles((text) => appendMessage("error", text));

/** A stored file of a session, fetched with the key (an <img> or a link cannot send it). */
async function storedFile(key, attachment) {
  const response = await api(sessionPath(key, `attachments/${attachment.digest}`));
  return URL.createObjectURL(await response.blob());
}
const storedFiles = (key, attachments) => (attachments || []).map((a) => ({ ...a, url: () => storedFile(key, a) }));
const signedOut = () => showSignIn("Your key is no longer accepted. Sign in again.");
const memoryPanel = new MemoryPanel(api, signedOut);
const skillsPanel = new SkillsPanel(api, signedOut);
startActivity(async (path) => (await api(path)).json(), (key) => state.titles.get(key) ?? key);
startUsage(async (path) => (await api(path)).json());
startSettings(async (path) => (await api(path)).json());
startTasks(api);

// ---- signing in ----

/** True when the current key (or none) is accepted; other failures throw. */
async function accepted() {
  try {
    await api("/api/sessions");
    return true;
  } catch (err) {
    if (err.status === 401) return false;
    throw err;
  }
}

async function start() {
  try {
    if (await accepted()) {
      state.open = true; // the gateway has no keys: nothing to sign in with
      return enter();
    }
    state.key = sessionStorage.getItem(KEY_STORE) ?? localStorage.getItem(KEY_STORE);
    if (state.key && await accepted()) return enter();
    showSignIn(state.key ? "The saved key is no longer accepted. Sign in again." : "");
  } catch (err) {
    showSignIn(`The gateway did not answer: ${err.message}`);
  }
}

function showSignIn(message) {
  state.key = null;
  state.view++; // a history still loading is for the signed-out view: drop it
  $("app-view").hidden = true;
  $("sign-out").hidden = true;
  $("whoami").hidden = true;
  for (const toggle of Object.keys(DRAWERS)) $(toggle).hidden = true;
  $("sessions").replaceChildren();
  $("messages").replaceChildren();
  $("pending-list").replaceChildren();
  $("pending-approvals").hidden = true;
  memoryPanel.clear();
  skillsPanel.clear();
  $("sign-in-view").hidden = false;
  $("sign-in-error").textContent = message;
  $("sign-in-error").hidden = !message;
  $("key-input").focus();
}

async function signIn(event) {
  event.preventDefault();
  const key = $("key-input").value.trim();
  if (!key) return;
  state.key = key;
  try {
    if (!(await accepted())) return showSignIn("That key was not accepted. Check it and try again.");
  } catch (err) {
    return showSignIn(`Could not sign in: ${err.message}`);
  }
  // Kept for this tab's session only, unless the person asks to be remembered on this device.
  ($("remember-key").checked ? localStorage : sessionStorage).setItem(KEY_STORE, key);
  $("key-input").value = "";
  enter();
}

function signOut() {
  state.abort?.abort();
  localStorage.removeItem(KEY_STORE);
  sessionStorage.removeItem(KEY_STORE);
  showSignIn("");
}

function enter() {
  $("sign-in-view").hidden = true;
  $("app-view").hidden = false;
  $("scrim").hidden = false;
  for (const toggle of Object.keys(DRAWERS)) $(toggle).hidden = false;
  $("sign-out").hidden = state.open;
  route();
  memoryPanel.refresh();
  skillsPanel.refresh();
  showWhoami().catch(() => {}); // the header line is a nicety; the page works without it
  refreshApprovals();
}

/** Requests of turns this page is not showing (another tab, a client that went away), answerable here. */
async function refreshApprovals() {
  if ($("app-view").hidden) return;
  try {
    const { approvals } = await (await api("/api/approvals")).json();
    const waiting = approvals.filter((request) => !shownApprovals.has(request.id));
    const listed = new Set(Array.from($("pending-list").children, (box) => box.dataset.id));
    for (const box of Array.from($("pending-list").children)) {
      if (waiting.some((r) => r.id === box.dataset.id)) continue;
      if (box.querySelector(".approval-outcome") && !box.dataset.kept) {
        box.dataset.kept = "1"; // answered here: the outcome stays for one more look
        continue;
      }
      box.remove();
    }
    for (const request of waiting.filter((r) => !listed.has(r.id))) {
      const box = approvalBox(request);
      box.dataset.id = request.id;
      box.prepend(el("div", "approval-session", `In session ${request.session}`));
      $("pending-list").append(box);
    }
    $("pending-approvals").hidden = $("pending-list").children.length === 0;
  } catch {
    // the next look tries again; a signed-out key is noticed by the other requests
  }
}
setInterval(refreshApprovals, APPROVALS_POLL_MS);

/** "alice · gpt-4o-mini": who is signed in, and which model answers. */
async function showWhoami() {
  const me = await (await api("/api/me")).json();
  const who = me.keys ? `Signed in as ${me.identity}` : "Open gateway (no keys)";
  $("whoami").textContent = `${who} · model: ${me.model}`;
  $("whoami").hidden = false;
  showAgents(me.agents ?? []);
  // What `ember serve` found when it asked the model at start: turns fail until it answers.
  $("model-banner").textContent = me.model_problem ? `The model did not answer when Ember started: ${me.model_problem}` : "";
  $("model-banner").hidden = !me.model_problem;
}

/** The named agents, when there are any: the message names the one picked ("" is the session's, else the default). */
function showAgents(agents) {
  const select = $("agent-select");
  const picked = select.value;
  select.replaceChildren(el("option", "", "Default agent"), ...agents.map((name) => el("option", "", name)));
  select.firstChild.value = "";
  select.value = agents.includes(picked) ? picked : "";
  select.hidden = agents.length === 0;
}

// ---- sessions ----

function randomId(prefix) {
  const bytes = crypto.getRandomValues(new Uint8Array(6));
  return `${prefix}-${Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("")}`;
}

const newSessionKey = () => randomId("web");

/** Opens the session named in the URL hash, or a new one. */
function route() {
  let key = hashKey();
  if (!key) {
    key = newSessionKey();
    history.replaceState(null, "", `#${encodeURIComponent(key)}`);
  }
  openSession(key);
}

async function refreshSessions() {
  const { sessions } = await (await api("/api/sessions")).json();
  state.titles = new Map(sessions.filter((s) => s.title).map((s) => [s.key, s.title]));
  const current = sessions.find((s) => s.key === state.session);
  const items = sessions.map((s) => sessionItem(
    s.key, s.title, `${s.messages} message${s.messages === 1 ? "" : "s"} · ${relativeTime(s.updated_at)}`));
  if (state.session && !current) items.unshift(sessionItem(state.session, null, "new"));
  $("sessions").replaceChildren(...items);
  filterSessions();
  $("session-title").textContent = current?.title || state.session;
  $("session-actions").hidden = !current; // nothing to rename or put away before the first message
}

/** Shows the sessions whose title or key holds the filter's words. */
function filterSessions() {
  const words = $("session-filter").value.toLowerCase().split(/\s+/).filter(Boolean);
  for (const item of $("sessions").children) {
    const link = item.querySelector("a");
    const text = `${link.textContent} ${link.title}`.toLowerCase();
    item.hidden = !words.every((word) => text.includes(word));
  }
}

/** Shows one of the page's own dialogs; resolves with the value of the button that closed it ("" for Escape). */
function ask(dialog) {
  dialog.returnValue = "";
  dialog.showModal();
  return new Promise((resolve) => dialog.addEventListener("close", () => resolve(dialog.returnValue), { once: true }));
}

async function renameSession() {
  const input = $("rename-input");
  input.value = $("session-title").textContent;
  const asked = ask($("rename-dialog"));
  input.select();
  if (await asked !== "save") return;
  await api(`/api/sessions/${encodeURIComponent(state.session)}`, {
    method: "PATCH", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ title: input.value }),
  });
  await refreshSessions();
}

async function archiveSession() {
  if (await ask($("delete-dialog")) !== "delete") return;
  await api(`/api/sessions/${encodeURIComponent(state.session)}`, { method: "DELETE" });
  location.hash = encodeURIComponent(newSessionKey());
}

function sessionItem(key, title, detail) {
  const link = el("a", "", title || key);
  link.title = key;
  link.href = `#${encodeURIComponent(key)}`;
  if (key === state.session) link.setAttribute("aria-current", "page");
  const item = el("li", "session");
  item.dataset.key = key;
  item.append(link, el("small", "", detail));
  return item;
}

async function openSession(key) {
  state.abort?.abort();
  state.session = key;
  const view = ++state.view;
  const focused = document.activeElement;
  $("session-title").textContent = key;
  $("session-actions").hidden = true;
  $("messages").replaceChildren();
  refreshSessions().catch(showFailure);
  try {
    const { messages } = await (await api(sessionPath(key))).json();
    if (view === state.view) renderHistory(messages);
  } catch (err) {
    if (view !== state.view) return;
    if (err.status === 404) showEmptyState(); // nothing said here yet
    else showFailure(err);
  }
  // To the message box, unless the person put the keyboard elsewhere while the history loaded.
  const moved = ![focused, document.body, null].includes(document.activeElement);
  if (view === state.view && !moved) $("message-input").focus();
}

const FIRST_PROMPTS = [
  "What can you do for me?",
  "Remember that I prefer short answers.",
  "Remind me every weekday at 9 to check my inbox.",
];

/** A new session: what Ember is, and a first message to send with one click. */
function showEmptyState() {
  const box = el("div", "empty-state");
  box.append(el("h3", "", "Ember works for you across days."),
    el("p", "", "It remembers what you tell it, in every session; uses its tools only as you allow; and "
      + "keeps every conversation, so nothing you said or it answered is lost."));
  const prompts = el("div", "first-prompts");
  for (const text of FIRST_PROMPTS) {
    const button = el("button", "first-prompt", text);
    button.type = "button";
    button.addEventListener("click", () => {
      $("message-input").value = text;
      $("composer").requestSubmit();
    });
    prompts.append(button);
  }
  box.append(prompts);
  $("messages").append(box);
}

function showFailure(err) {
  if (err.status === 401) return showSignIn("Your key is no longer accepted. Sign in again.");
  appendMessage("error", err.message);
}

// ---- messages ----

function appendMessage(className, text) {
  const node = el("div", `message ${className}`, text);
  $("messages").append(node);
  node.scrollIntoView({ block: "end" });
  return node;
}

function appendText(box, markdown, className = "text") {
  const node = el("div", className);
  node.innerHTML = renderMarkdown(markdown); // escaped before any tag is added
  if (!className.includes("draft")) addCopyButtons(node);
  box.append(node);
  return node;
}

/** A Copy button on each code block of a committed answer. */
function addCopyButtons(node) {
  for (const pre of node.querySelectorAll("pre")) {
    const button = el("button", "copy", "Copy");
    button.type = "button";
    button.setAttribute("aria-label", "Copy the code");
    button.addEventListener("click", async () => {
      try {
        await navigator.clipboard.writeText(pre.textContent);
        button.textContent = "Copied";
      } catch {
        button.textContent = "Copy failed";
      }
      setTimeout(() => { button.textContent = "Copy"; }, 1500);
    });
    pre.before(button);
  }
}

/** A tool call, collapsed; its result is filled in by call id. */
function appendTool(box, name, args) {
  const details = el("details", "tool");
  const summary = el("summary", "", `Tool: ${name}`);
  const result = el("pre", "tool-result", "(running…)");
  details.append(summary, el("div", "label", "Arguments"), el("pre", "tool-args", args || ""),
    el("div", "label", "Result"), result);
  box.append(details);
  return result;
}

function renderHistory(messages) {
  const results = new Map();
  const answered = new Map(); // box -> its question and the texts it shows
  let box = null;
  let turnId = null;
  let question = null;
  for (const m of messages) {
    if (m.role === "user") {
      showFiles(appendMessage("user", m.content), storedFiles(state.session, m.attachments));
      question = m.content;
      box = null;
    } else if (m.kind === "error") {
      // The turn never answered (it failed, or was stopped): its record says why, and offers it again.
      if (!box || m.turn_id !== turnId) box = appendMessage("assistant");
      const turn = new LiveTurn(box);
      const asked = question;
      if (m.message_id && asked !== null) turn.retry = () => turn.resend(asked, m.message_id);
      turn.fail(m.content);
      box = null;
    } else if (m.role === "assistant") {
      if (!box || (m.turn_id && turnId && m.turn_id !== turnId)) box = appendMessage("assistant");
      turnId = m.turn_id;
      if (m.content) {
        appendText(box, m.content);
        if (!answered.has(box)) answered.set(box, { question, texts: [] });
        answered.get(box).texts.push(m.content);
      }
      showFiles(box, storedFiles(state.session, m.attachments));
      for (const call of m.tool_calls) results.set(call.id, appendTool(box, call.name, call.arguments));
    } else if (m.role === "tool" && results.has(m.tool_call_id)) {
      results.get(m.tool_call_id).textContent = m.content;
    }
  }
  for (const [answeredBox, { question: asked, texts }] of answered) {
    if (answeredBox.isConnected) addAnswerActions(answeredBox, texts.join("\n\n"), asked);
  }
}

/** Under a finished answer: copy it, bring its question back to edit and send, or ask it again.
 * Only the latest answer offers "Ask again": it sends the same question as a new message. */
function addAnswerActions(box, answerText, question) {
  forgetAskAgain();
  const row = el("div", "message-actions");
  row.append(actionButton("Copy", "Copy the answer", async (button) => {
    try {
      await navigator.clipboard.writeText(answerText);
      button.textContent = "Copied";
    } catch {
      button.textContent = "Copy failed";
    }
    setTimeout(() => { button.textContent = "Copy"; }, 1500);
  }));
  if (question !== null) {
    row.append(actionButton("Edit", "Edit the question and send it again", () => {
      const input = $("message-input");
      input.value = question;
      input.focus();
      input.setSelectionRange(question.length, question.length);
    }));
    const again = actionButton("Ask again", "Send the same question again for another answer", () => {
      if (!state.busy) sendText(question);
    });
    again.classList.add("ask-again");
    row.append(again);
  }
  box.after(row);
}

function forgetAskAgain() {
  for (const older of $("messages").querySelectorAll(".ask-again")) older.remove();
}

function actionButton(label, description, onClick) {
  const button = el("button", "action", label);
  button.type = "button";
  button.title = description;
  button.setAttribute("aria-label", description);
  button.addEventListener("click", () => onClick(button));
  return button;
}

const DECISIONS = [["approve_once", "Allow once"], ["approve_session", "Always in this session"], ["deny", "Deny"]];

/** A request to allow a risky tool call, with its three answers. */
function approvalBox(request) {
  const box = el("div", "approval");
  box.setAttribute("role", "alert");
  box.append(el("div", "approval-question", `Allow Ember to ${request.summary}?`));
  if (request.explanation) {
    // The approval model's reading of the full call; the person still decides.
    const { text, risk, reason } = request.explanation;
    box.append(el("div", "approval-explanation", text),
      el("div", `approval-rating approval-rating-${risk}`, `Risk: ${risk} (${reason})`));
  }
  box.append(el("div", "approval-risk", `${request.risk} · denied if unanswered in ${request.timeout_s} s`));
  const buttons = el("div", "approval-buttons");
  for (const [decision, label] of DECISIONS) {
    const button = el("button", `approval-${decision}`, label);
    button.type = "button";
    button.addEventListener("click", async () => {
      for (const b of buttons.querySelectorAll("button")) b.disabled = true;
      try {
        await api(`/api/approvals/${encodeURIComponent(request.id)}`, {
          method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ decision }),
        });
        box.append(el("div", "approval-outcome", decision === "deny" ? "Denied." : "Allowed."));
      } catch (err) {
        box.append(el("div", "error", err.message));
      }
    });
    buttons.append(button);
  }
  box.append(buttons);
  return box;
}

/** One turn as it streams: deltas grow a draft that the `final` text replaces. */
class LiveTurn {
  constructor(box) {
    this.box = box;
    this.draft = null;
    this.draftText = "";
    this.results = new Map();
    this.closed = false;
    this.retry = null;
    this.question = null;
    this.session = state.session; // the answer's files are stored in it
  }

  on(name, data) {
    if (name === "delta") {
      if (!this.draft) {
        this.draft = appendText(this.box, "", "text draft");
        this.draftText = "";
      }
      this.draftText += data.text;
      this.draft.innerHTML = renderMarkdown(this.draftText);
    } else if (name === "tool_call") {
      this.draft = null; // text after the call is a new model step
      this.results.set(data.call_id, appendTool(this.box, data.name, data.arguments));
    } else if (name === "tool_result") {
      const result = this.results.get(data.call_id);
      if (result) result.textContent = data.text;
    } else if (name === "approval_request") {
      shownApprovals.add(data.id);
      this.box.append(approvalBox(data));
    } else if (name === "final") {
      if (this.draft) this.draft.remove();
      if (data.text) appendText(this.box, data.text);
      showFiles(this.box, storedFiles(this.session, data.attachments));
      this.close();
      if (data.text) addAnswerActions(this.box, data.text, this.question);
    } else if (name === "error") {
      this.fail(data.text);
    }
    this.box.scrollIntoView({ block: "end" });
  }

  fail(text) {
    const card = el("div", "error", text);
    if (this.retry) {
      const button = el("button", "retry", "Retry");
      button.type = "button";
      button.addEventListener("click", () => {
        button.disabled = true;
        this.retry();
      });
      card.append(" ", button);
    }
    this.box.append(card);
    this.box.setAttribute("role", "alert");
    this.close();
  }

  close() {
    this.closed = true;
    this.box.classList.remove("running");
  }

  /** Send the question again with its id: the gateway retries the turn it accepted. */
  resend(text, messageId, files = []) {
    if (state.busy) return;
    this.box.previousElementSibling?.remove(); // the question is shown again with its new attempt
    this.box.remove();
    sendText(text, messageId, files);
  }
}

/** Calls `onEvent(name, data)` for each Server-Sent Event of the response. */
async function readEvents(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer = (buffer + value).replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith(":")) continue; // keep-alive
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const fieldValue = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "event") name = fieldValue;
        else if (field === "data") data.push(fieldValue);
      }
      if (data.length) onEvent(name, JSON.parse(data.join("\n")));
    }
  }
}

function setBusy(busy) {
  state.busy = busy;
  $("send").disabled = busy;
  $("message-input").disabled = busy;
  $("stop").hidden = !busy;
  $("stop").disabled = false;
}

/** Ask the gateway to stop the running turn; its stream then ends with the record that says so,
 * and what the turn had shown stays on the page. */
async function stopTurn() {
  $("stop").disabled = true;
  try {
    await api(sessionPath(state.session, "stop"), { method: "POST" });
  } catch (err) {
    if (err.status !== 409) showFailure(err); // 409: it had just finished
  }
}

async function send(event) {
  event.preventDefault();
  const text = $("message-input").value;
  if (state.busy || (!text.trim() && !pendingFiles.count)) return;
  $("message-input").value = "";
  await sendText(text, randomId("msg"), await pendingFiles.take());
}

/** One turn of `text` (and `files`): shown, streamed, and on failure offered again with Retry. The
 * message keeps its id across retries, so the gateway retries the turn it accepted instead of
 * storing it twice. */
async function sendText(text, messageId = randomId("msg"), files = []) {
  setBusy(true);
  $("messages").querySelector(".empty-state")?.remove();
  forgetAskAgain();
  showFiles(appendMessage("user", text), files.map((f) => f.shown));
  const turn = new LiveTurn(appendMessage("assistant running"));
  turn.question = text;
  turn.retry = () => turn.resend(text, messageId, files);
  const abort = (state.abort = new AbortController());
  try {
    const response = await api(sessionPath(state.session), {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({
        text, message_id: messageId, ...($("agent-select").value ? { agent: $("agent-select").value } : {}),
        ...(files.length ? { attachments: files.map((f) => f.upload) } : {}),
      }),
      signal: abort.signal,
    });
    await readEvents(response, (name, data) => turn.on(name, data));
    if (!turn.closed) turn.fail("The connection closed before the answer was complete.");
  } catch (err) {
    if (err.name === "AbortError") return;
    if (err.status === 401) return showSignIn("Your key is no longer accepted. Sign in again.");
    turn.fail(err instanceof ApiError ? err.message : `The request failed: ${err.message}`);
  } finally {
    if (state.abort === abort) state.abort = null;
    setBusy(false);
  }
  refreshSessions().catch(showFailure);
  memoryPanel.refresh(); // the turn may have remembered something
  skillsPanel.refresh(); // use counts, and what reviews have proposed since
  $("message-input").focus();
}

$("sign-in-form").addEventListener("submit", signIn);
$("sign-out").addEventListener("click", signOut);
$("composer").addEventListener("submit", send);
$("stop").addEventListener("click", () => stopTurn());
$("message-input").addEventListener("keydown", (event) => {
  if (event.key !== "Enter" || event.shiftKey || event.isComposing) return;
  event.preventDefault();
  $("composer").requestSubmit();
});
$("session-filter").addEventListener("input", filterSessions);
// Not a submit button: Enter in a dialog's field submits with its first one, which must be the answer.
for (const cancel of document.querySelectorAll("dialog.ask [data-cancel]")) {
  cancel.addEventListener("click", () => cancel.closest("dialog").close("cancel"));
}
$("rename-session").addEventListener("click", () => renameSession().catch(showFailure));
$("archive-session").addEventListener("click", () => archiveSession().catch(showFailure));
$("new-session").addEventListener("click", () => {
  location.hash = encodeURIComponent(newSessionKey());
});
window.addEventListener("hashchange", () => {
  closeDrawers(); // a session was picked: the chat comes back
  if (!$("app-view").hidden) route();
});

// Drawers, at the widths where the session list and the memory panel do not fit beside the chat.
const DRAWERS = { "open-sessions": "sidebar", "open-memory": "memory-panel" };

function closeDrawers() {
  for (const [toggle, drawer] of Object.entries(DRAWERS)) {
    $(drawer).classList.remove("open");
    $(toggle).setAttribute("aria-expanded", "false");
  }
  $("scrim").classList.remove("shown");
}

// On a desk, the session list put away: the header's Sessions button brings it back, not as a drawer.
const COLLAPSED_KEY = "ember.sessionsCollapsed";
const desk = window.matchMedia("(min-width: 701px)");

function collapseSessions(collapsed) {
  document.body.classList.toggle("sessions-collapsed", collapsed);
  if (collapsed) localStorage.setItem(COLLAPSED_KEY, "1");
  else localStorage.removeItem(COLLAPSED_KEY); // nothing is stored but what the person chose
}

document.body.classList.toggle("sessions-collapsed", localStorage.getItem(COLLAPSED_KEY) === "1");
$("collapse-sessions").addEventListener("click", () => {
  collapseSessions(true);
  $("open-sessions").focus();
});
$("open-sessions").addEventListener("click", (event) => {
  if (!desk.matches || !document.body.classList.contains("sessions-collapsed")) return;
  event.stopImmediatePropagation(); // not the drawer: the list comes back beside the chat
  collapseSessions(false);
  $("collapse-sessions").focus();
});

for (const [toggle, drawer] of Object.entries(DRAWERS)) {
  $(toggle).addEventListener("click", () => {
    const opening = !$(drawer).classList.contains("open");
    closeDrawers();
    if (!opening) return;
    $(drawer).classList.add("open");
    $(toggle).setAttribute("aria-expanded", "true");
    $("scrim").classList.add("shown");
    $(drawer).querySelector("button, input, a")?.focus();
  });
}
$("scrim").addEventListener("click", closeDrawers);
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape") closeDrawers();
});
start();
