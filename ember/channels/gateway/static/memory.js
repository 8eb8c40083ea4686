// The "What Ember remembers about you" panel: the caller's facts and conversation
// summaries, newest first, a search over them, Forget on each and Edit on a fact, and a
// box to state a fact (it joins what every prompt carries about the person).
// Memory text is the person's own words or the model's: it reaches the DOM through textContent only.

import { $, el } from "./dom.js";

// What Ember knows about the person. The archival tier (every message, word for word)
// is the chat history itself, which the page shows already.
const KINDS = ["fact", "episodic"];
const SEARCH_LIMIT = 50;

export class MemoryPanel {
  /** `api(path, options)` sends a request with the caller's key; `onSignedOut()` runs on a 401. */
  constructor(api, onSignedOut) {
    this.api = api;
    this.onSignedOut = onSignedOut;
    this.view = 0; // bumped by every load, so a slow answer never replaces a newer one
    $("memory-search").addEventListener("submit", (event) => {
      event.preventDefault();
      this.refresh();
    });
    $("memory-query").addEventListener("input", () => {
      if (!$("memory-query").value.trim()) this.refresh(); // an emptied search box lists everything again
    });
    $("memory-add").addEventListener("submit", (event) => {
      event.preventDefault();
      this.add();
    });
  }

  /** Remembers what the box says as a fact the person stated, then lists it with the rest. */
  async add() {
    const box = $("memory-new");
    const content = box.value.trim();
    if (!content) return;
    $("memory-add-button").disabled = true;
    try {
      const response = await this.api("/api/memory", {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ content }),
      });
      box.value = "";
      $("memory-query").value = "";
      await this.refresh();
      if (response.status === 200) setStatus("Already remembered.");
    } catch (err) {
      this.fail(err); // the text stays in the box, to try again
    } finally {
      $("memory-add-button").disabled = false;
    }
  }

  /** Shows the memories, or the hits of the query in the search box. */
  refresh() {
    const query = $("memory-query").value.trim();
    const params = new URLSearchParams(KINDS.map((kind) => ["kind", kind]));
    if (!query) return this.show(`/api/memory?${params}`, "Nothing remembered yet.");
    params.set("q", query);
    params.set("limit", String(SEARCH_LIMIT));
    return this.show(`/api/memory/search?${params}`, "Nothing found.");
  }

  clear() {
    this.view++;
    $("memory-query").value = "";
    $("memories").replaceChildren();
    setStatus("");
  }

  async show(path, emptyText) {
    const view = ++this.view;
    try {
      const records = await (await this.api(path)).json();
      if (view !== this.view) return;
      $("memories").replaceChildren(...records.map((record) => this.item(record)));
      setStatus(records.length ? "" : emptyText);
    } catch (err) {
      if (view !== this.view) return;
      $("memories").replaceChildren(); // what is listed must answer the query in the box
      this.fail(err);
    }
  }

  item(record) {
    const item = el("li", "memory");
    const about = record.key ? `${record.subject ?? ""}.${record.key}` : record.subject;
    const when = new Date(record.created_at * 1000).toLocaleDateString();
    const forget = el("button", "memory-forget", "Forget");
    forget.type = "button";
    forget.addEventListener("click", () => this.forget(record.id, item, forget));
    const content = el("div", "memory-content", record.content);
    item.append(content, el("div", "memory-meta", [record.kind, about, when].filter(Boolean).join(" · ")));
    if (record.kind === "fact") { // an episode is a summary of what was said: it is forgotten, not rewritten
      const edit = el("button", "memory-edit", "Edit");
      edit.type = "button";
      edit.addEventListener("click", () => this.edit(record, item, content));
      item.append(edit);
    }
    item.append(forget);
    return item;
  }

  /** The fact's text in a box in its place: Enter saves the correction, Escape leaves it as it was. */
  edit(record, item, content) {
    const form = el("form", "memory-edit-form");
    const box = el("input", "memory-edit-box");
    box.value = record.content;
    box.setAttribute("aria-label", "The fact as it should read");
    const save = el("button", "memory-save", "Save");
    save.type = "submit";
    form.append(box, save);
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const text = box.value.trim();
      if (!text || text === record.content) return form.replaceWith(content);
      save.disabled = true;
      try {
        await this.api(`/api/memory/${encodeURIComponent(record.id)}`, {
          method: "PATCH", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ content: text }),
        });
        await this.refresh();
      } catch (err) {
        save.disabled = false;
        this.fail(err);
      }
    });
    box.addEventListener("keydown", (event) => {
      if (event.key === "Escape") form.replaceWith(content);
    });
    content.replaceWith(form);
    box.focus();
  }

  async forget(id, item, button) {
    button.disabled = true;
    try {
      await this.api(`/api/memory/${encodeURIComponent(id)}`, { method: "DELETE" });
    } catch (err) {
      if (err.status !== 404) { // 404: it is gone already, which is what was asked
        button.disabled = false;
        return this.fail(err);
      }
    }
    item.remove();
    if (!$("memories").children.length) setStatus("Nothing remembered now.");
  }

  fail(err) {
    if (err.status === 401) return this.onSignedOut();
    setStatus(err.message, true);
  }
}

function setStatus(text, isError = false) {
  const status = $("memory-status");
  status.textContent = text;
  status.hidden = !text;
  status.classList.toggle("error", isError);
}
