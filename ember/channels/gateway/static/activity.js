// The "Activity" panel: the caller's recent turns, newest first, and on a click one turn's trace —
// its stages, model calls, tool calls and approvals, and the tasks it delegated (each with its own
// turn's detail inside), as `ember trace show` prints them.
//
// app.js starts it with its API call (`startActivity`); it shows its header button while the page
// is signed in (#app-view shown).
// Trace text (tool arguments, errors) reaches the DOM through textContent only.

import { $, el, hashKey, headerPanel, listEntry, relativeTime } from "./dom.js";

const LIMIT = 50;
const STATUS_TEXT = { ok: "Done", failed: "Failed", stopped: "Stopped", cancelled: "Interrupted", running: "Running",
  "answered before": "Answered before" };

let view = 0; // bumped by every load, so a slow answer never replaces a newer one
let opener = null; // the list entry whose turn is shown, focused again on Back

let getJson = null; // the page's API call, given by startActivity
let sessionName = (key) => key; // a session's title where the page knows it, given by startActivity

// ---- formatting ----

function duration(ms) {
  if (ms === null || ms === undefined) return "–";
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(1)} s`;
}

const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;
const tokens = (summary) => `${summary.input_tokens} in / ${summary.output_tokens} out tokens`;

function statusBadge(status) {
  return el("span", `activity-status activity-status-${status}`, STATUS_TEXT[status] ?? status);
}

// ---- the list ----

async function refreshList() {
  const mine = ++view;
  const params = new URLSearchParams({ limit: String(LIMIT) });
  const session = hashKey();
  if ($("activity-this-session").checked && session) params.set("session", session);
  $("activity-list").setAttribute("aria-busy", "true");
  setStatus("Loading…");
  try {
    const { turns } = await getJson(`/api/activity?${params}`);
    if (mine !== view) return;
    $("activity-list").replaceChildren(...turns.map(listItem));
    setStatus(turns.length ? "" : "No turns yet: what Ember does for you shows up here.");
  } catch (err) {
    if (mine !== view) return;
    $("activity-list").replaceChildren();
    setStatus(`Could not load the activity: ${err.message}`, true);
  } finally {
    if (mine === view) $("activity-list").removeAttribute("aria-busy");
  }
}

function listItem(turn) {
  const { summary } = turn;
  const meta = [duration(turn.duration_ms), tokens(summary), plural(summary.tool_calls, "tool"),
    ...(summary.tool_errors ? [`${summary.tool_errors} failed`] : [])].join(" · ");
  const item = listEntry({
    className: "activity-item", badge: statusBadge(turn.status), title: sessionName(turn.session),
    aside: [relativeTime(turn.started_at)], meta, onClick: (button) => openTurn(turn.turn_id, button),
  });
  item.dataset.turn = turn.turn_id;
  return item;
}

// ---- one turn ----

async function openTurn(turnId, from) {
  opener = from;
  const mine = ++view;
  showTurnView(true);
  $("activity-turn-title").textContent = "Loading…";
  $("activity-turn-body").replaceChildren();
  $("activity-turn-title").focus();
  try {
    const turn = await getJson(`/api/activity/${encodeURIComponent(turnId)}`);
    if (mine !== view) return;
    $("activity-turn-title").textContent = `Turn in ${sessionName(turn.session)}`;
    $("activity-turn-body").replaceChildren(...turnDetail(turn));
  } catch (err) {
    if (mine !== view) return;
    $("activity-turn-title").textContent = "Could not load this turn";
    $("activity-turn-body").replaceChildren(el("p", "error", err.message));
  }
}

function turnDetail(turn) {
  const { summary } = turn;
  const head = el("p", "activity-line");
  const started = new Date(turn.started_at * 1000).toLocaleString();
  head.append(statusBadge(turn.status), " ",
    el("span", "", `${started} · took ${duration(turn.duration_ms)} · ${tokens(summary)}`));
  const parts = [head];
  if (turn.error) parts.push(el("p", "error activity-error", turn.error));
  parts.push(...section("Stages", turn.stages, (s) => el("li", "", `${s.stage} · ${duration(s.duration_ms)}`)));
  parts.push(...section("Model calls", turn.model_calls, modelCall));
  // Each decision is shown with its call; one whose call never ran (the turn was stopped) on its own.
  const ran = new Set(turn.tool_calls.map((call) => call.call_id));
  const approvals = new Map(turn.approvals.map((a) => [a.call_id, a]));
  parts.push(...section("Tools", turn.tool_calls, (call) => toolCall(call, approvals.get(call.call_id))));
  parts.push(...section("Approvals of calls that never ran", turn.approvals.filter((a) => !ran.has(a.call_id)),
    (a) => el("li", "activity-approval", approvalText(a))));
  parts.push(...section("Progress", turn.progress, (p) => el("li", "", `${p.tool} at ${duration(p.at_ms)}: ${p.note}`)));
  parts.push(...section("Delegated tasks", turn.delegations, delegation));
  return parts;
}

/** A task the turn delegated: how it ended and what it cost, and inside, its own turn's detail. */
function delegation(task) {
  const item = el("li", "activity-delegation");
  const details = el("details");
  const cost = `${task.input_tokens} in / ${task.output_tokens} out tokens`;
  details.append(el("summary", "", `${task.agent ?? "An agent"} · ${STATUS_TEXT[task.status] ?? task.status} · ${cost}`));
  details.append(...(task.turn ? turnDetail(task.turn) : [el("p", "activity-result", "Its trace was not kept.")]));
  item.append(details);
  return item;
}

/** A heading and its list, or nothing when the turn has none of these. */
function section(title, entries, item) {
  if (!entries.length) return [];
  const list = el("ol", "activity-entries");
  list.append(...entries.map(item));
  return [el("h4", "", title), list];
}

function modelCall(call) {
  const item = el("li", "activity-model-call");
  const asked = call.tool_calls ? ` · asked for ${plural(call.tool_calls, "tool call")}` : "";
  item.append(el("strong", "", call.model),
    el("span", "", ` · ${duration(call.duration_ms)} · ${call.input_tokens} in / ${call.output_tokens} out${asked}`));
  for (const reason of call.passed_over) item.append(el("div", "activity-passed-over", `passed over ${reason}`));
  return item;
}

/** A tool call, collapsed: its arguments and its result's size inside. */
function toolCall(call, approval) {
  const item = el("li", `activity-tool activity-tool-${call.status}`);
  const details = el("details");
  const failed = call.status === "error" ? " · failed" : "";
  details.append(el("summary", "", `${call.name} · ${duration(call.duration_ms)}${failed}`),
    el("div", "label", "Arguments"), el("pre", "activity-args", JSON.stringify(call.arguments, null, 2)),
    el("div", "activity-result", `Result: ${plural(call.result_chars, "character")}${failed ? ", an error" : ""}`
      + " (the text itself is in the chat)"));
  if (approval) details.append(el("div", "activity-result", `Approval: ${approvalText(approval)}`));
  item.append(details);
  return item;
}

const DECISION_TEXT = { approve_once: "allowed once", approve_session: "allowed for the session", deny: "denied" };
const DECIDER_TEXT = { policy: "the tool policy", "session-grant": "an earlier “always in this session”" };

/** "write_file: allowed once by alice at 10:02:03": who decided about a call, and when. */
function approvalText(approval) {
  const when = new Date(approval.decided_at * 1000).toLocaleTimeString();
  const by = DECIDER_TEXT[approval.decided_by] ?? approval.decided_by.replace(/^user:/, "");
  const reason = approval.reason ? ` (${approval.reason})` : "";
  return `${approval.tool}: ${DECISION_TEXT[approval.decision] ?? approval.decision} by ${by} at ${when}${reason}`;
}

// ---- the panel ----

function showTurnView(shown) {
  $("activity-turn").hidden = !shown;
  $("activity-list-view").hidden = shown;
}

function back() {
  view++;
  showTurnView(false);
  if (opener?.isConnected) opener.focus();
  else $("activity-refresh").focus();
}

function setStatus(text, isError = false) {
  $("activity-status").textContent = text;
  $("activity-status").classList.toggle("error", isError);
}

function opened() {
  showTurnView(false);
  $("activity-this-session").disabled = !hashKey();
  refreshList();
}

/** Signed out: nothing of the caller's activity stays on the page. */
function clear() {
  view++;
  $("activity-list").replaceChildren();
  $("activity-turn-body").replaceChildren();
  setStatus("");
}

/** Wire the panel to the page; `api(path)` resolves to the JSON of a GET, or throws with `status`;
 * `nameOf(key)` is a session's title, or its key. */
export function startActivity(api, nameOf) {
  getJson = api;
  sessionName = nameOf;
  $("activity-refresh").addEventListener("click", refreshList);
  $("activity-this-session").addEventListener("change", refreshList);
  $("activity-back").addEventListener("click", back);
  // A click on the backdrop (outside the panel's box) closes it, as the drawers' scrim does.
  $("activity-panel").addEventListener("click", (event) => {
    if (event.target === $("activity-panel")) {
      const box = $("activity-panel").getBoundingClientRect();
      const inside = event.clientX >= box.left && event.clientX <= box.right
        && event.clientY >= box.top && event.clientY <= box.bottom;
      if (!inside) $("activity-panel").close();
    }
  });
  headerPanel("activity", { onOpen: opened, onSignOut: clear });
}
