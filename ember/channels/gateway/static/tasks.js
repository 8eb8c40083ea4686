// The "Tasks" panel: the caller's scheduled tasks (GET /api/tasks), and on a click one task with
// its next runs and what its recent runs answered (GET /api/tasks/{id}); a task can be removed
// there (DELETE), after a second click that confirms it. The prompt and the answers are the
// person's and the model's text: through textContent, and the answers through the page's
// Markdown renderer, which escapes before it adds any tag.

import { $, el, headerPanel, listEntry, relativeTime } from "./dom.js";
import { renderMarkdown } from "./markdown.js";

let call = null; // the page's API call, given by startTasks
let view = 0; // bumped by every load, so a slow answer never replaces a newer one
let opener = null; // the list entry whose task is shown, focused again on Back

const STATE_TEXT = { active: "Active", paused: "Paused", done: "Done", removed: "Removed" };

function setStatus(text, isError = false) {
  $("tasks-status").textContent = text;
  $("tasks-status").classList.toggle("error", isError);
}

async function refreshList() {
  const mine = ++view;
  showTask(false);
  setStatus("Loading…");
  try {
    const tasks = await (await call("/api/tasks")).json();
    if (mine !== view) return;
    $("tasks-list").replaceChildren(...tasks.map(listItem));
    setStatus(tasks.length ? "" : "No tasks yet: ask Ember to remind you of something, or to do it every morning.");
  } catch (err) {
    if (mine === view) setStatus(`Could not load the tasks: ${err.message}`, true);
  }
}

function listItem(task) {
  const next = task.next_run ? `next ${task.next_run}` : "no next run";
  const item = listEntry({
    className: "task-item",
    badge: el("span", `activity-status task-state-${task.state}`, STATE_TEXT[task.state] ?? task.state),
    title: task.prompt, meta: [task.schedule, next, `${task.runs} run${task.runs === 1 ? "" : "s"}`].join(" · "),
    onClick: (button) => openTask(task.id, button),
  });
  item.dataset.task = task.id;
  return item;
}

async function openTask(id, from) {
  opener = from;
  const mine = ++view;
  showTask(true);
  $("task-title").textContent = "Loading…";
  $("task-body").replaceChildren();
  try {
    const task = await (await call(`/api/tasks/${encodeURIComponent(id)}`)).json();
    if (mine !== view) return;
    $("task-title").textContent = task.prompt;
    $("task-body").replaceChildren(...taskParts(task));
    $("task-title").focus();
  } catch (err) {
    if (mine === view) $("task-title").textContent = `Could not load the task: ${err.message}`;
  }
}

function taskParts(task) {
  const facts = el("p", "activity-meta",
    [task.schedule, task.upcoming.length ? `next: ${task.upcoming.join(", ")}` : "no next run",
      `created ${relativeTime(task.created_at)}`].join(" · "));
  const runs = el("ol", "activity-entries task-runs");
  for (const run of task.recent_runs) {
    const entry = el("li", "task-run");
    const when = new Date(run.scheduled_for * 1000).toLocaleString();
    entry.append(el("div", "activity-meta", `${when} · ${run.outcome === "missed" ? "missed" : "ran"}`));
    const answer = el("div", "task-answer");
    if (run.answer) answer.innerHTML = renderMarkdown(run.answer);
    else answer.textContent = run.outcome === "missed" ? "Not run: the server was down at the time." : "No answer yet.";
    entry.append(answer);
    runs.append(entry);
  }
  const parts = [facts, el("h4", "", "Recent runs"), task.recent_runs.length ? runs : el("p", "", "No run yet.")];
  if (task.state !== "removed") parts.push(removeButton(task));
  return parts;
}

function removeButton(task) {
  const button = el("button", "task-remove", "Remove this task");
  button.type = "button";
  button.addEventListener("click", async () => {
    if (!button.classList.contains("confirming")) { // a second click confirms: no task goes by accident
      button.classList.add("confirming");
      button.textContent = "Click again to remove it";
      return;
    }
    button.disabled = true;
    try {
      await call(`/api/tasks/${encodeURIComponent(task.id)}`, { method: "DELETE" });
      await refreshList();
      $("tasks-refresh").focus();
    } catch (err) {
      button.disabled = false;
      button.after(el("p", "error", `Could not remove it: ${err.message}`));
    }
  });
  return button;
}

function showTask(shown) {
  $("tasks-task").hidden = !shown;
  $("tasks-list-view").hidden = shown;
}

function back() {
  view++;
  showTask(false);
  if (opener?.isConnected) opener.focus();
  else $("tasks-refresh").focus();
}

function clear() {
  view++;
  $("tasks-list").replaceChildren();
  $("task-body").replaceChildren();
  setStatus("");
}

/** Wire the panel to the page; `api(path, options)` sends a request with the caller's key. */
export function startTasks(api) {
  call = api;
  $("tasks-refresh").addEventListener("click", refreshList);
  $("tasks-back").addEventListener("click", back);
  headerPanel("tasks", { onOpen: refreshList, onSignOut: clear });
}
