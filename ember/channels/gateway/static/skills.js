// The "Skills" section of the memory panel: the skills Ember can use (shared and the caller's
// learned ones), and the proposals of the background review waiting for the person, each with
// its diff and Approve / Reject buttons.
// Skill text is written by the model: it reaches the DOM through textContent, or through the
// Markdown renderer, which escapes it first.

import { $, el } from "./dom.js";
import { renderMarkdown } from "./markdown.js";

const DECISIONS = [["approve", "Approve"], ["reject", "Reject"]];

export class SkillsPanel {
  /** `api(path, options)` sends a request with the caller's key; `onSignedOut()` runs on a 401. */
  constructor(api, onSignedOut) {
    this.api = api;
    this.onSignedOut = onSignedOut;
    this.view = 0; // bumped by every load, so a slow answer never replaces a newer one
  }

  /** Loads both lists; a decision's error line stays until the next decision. */
  async refresh() {
    const view = ++this.view;
    try {
      const [skills, proposals] = await Promise.all(
        ["/api/skills", "/api/skills/pending"].map(async (path) => (await this.api(path)).json()));
      if (view !== this.view) return;
      $("skill-proposals").replaceChildren(...proposals.map((proposal) => this.proposalItem(proposal)));
      $("skill-proposals-section").hidden = proposals.length === 0;
      $("skills").replaceChildren(...skills.map((skill) => this.skillItem(skill)));
      setStatus(skills.length ? "" : "No skills yet.");
    } catch (err) {
      if (view !== this.view) return;
      if (err.status === 401) return this.onSignedOut();
      setStatus(`Could not load the skills: ${err.message}`, true);
    }
  }

  clear() {
    this.view++;
    $("skills").replaceChildren();
    $("skill-proposals").replaceChildren();
    $("skill-proposals-section").hidden = true;
    setStatus("");
    setError("");
  }

  proposalItem(proposal) {
    const item = el("li", `skill-proposal skill-risk-${proposal.risk}`);
    item.dataset.id = proposal.id;
    const title = el("div", "skill-proposal-title");
    title.append(el("strong", "skill-name", proposal.name),
      el("span", "skill-proposal-action", proposal.action === "patch" ? " · a change" : " · new"));
    const reasons = proposal.risk_reasons?.length ? ` (${proposal.risk_reasons.join("; ")})` : "";
    item.append(title, el("div", "skill-proposal-risk", `Risk: ${proposal.risk}${reasons}`));
    if (proposal.reason) item.append(el("div", "skill-proposal-reason", `Why: ${proposal.reason}`));
    item.append(proposal.diff ? diffBlock(proposal.diff) : el("pre", "skill-diff", proposal.text ?? ""));
    const buttons = el("div", "skill-proposal-buttons");
    for (const [decision, label] of DECISIONS) {
      const button = el("button", `skill-${decision}`, label);
      button.type = "button";
      button.setAttribute("aria-label", `${label} skill ${proposal.name}`);
      button.addEventListener("click", () => this.decide(proposal, decision, buttons));
      buttons.append(button);
    }
    item.append(buttons);
    return item;
  }

  /** A skill's card; opened, it shows the skill's instructions (fetched once, as Markdown). */
  skillItem(skill) {
    const item = el("li", `skill skill-${skill.scope}`);
    item.dataset.name = skill.name;
    const uses = skill.use_count ? ` · used ${skill.use_count} time${skill.use_count === 1 ? "" : "s"}` : "";
    const card = el("details", "skill-card");
    const summary = el("summary");
    summary.append(el("div", "skill-name", skill.name),
      el("div", "skill-meta", `${skill.scope} · version ${skill.version}${uses}`),
      el("div", "skill-description", skill.description));
    const body = el("div", "skill-text markdown");
    card.append(summary, body);
    card.addEventListener("toggle", () => {
      if (card.open && !body.dataset.loaded) this.loadText(skill.name, body);
    });
    item.append(card);
    return item;
  }

  async loadText(name, body) {
    body.dataset.loaded = "1";
    body.textContent = "Loading…";
    try {
      const skill = await (await this.api(`/api/skills/${encodeURIComponent(name)}`)).json();
      body.innerHTML = renderMarkdown(skill.text); // escapes the model's text: no markup of its own gets through
      if (skill.files?.length) body.append(el("p", "skill-files", `Files: ${skill.files.join(", ")}`));
    } catch (err) {
      delete body.dataset.loaded; // opened again, it tries again
      if (err.status === 401) return this.onSignedOut();
      body.textContent = `Could not load the skill: ${err.message}`;
    }
  }

  async decide(proposal, decision, buttons) {
    for (const button of buttons.querySelectorAll("button")) button.disabled = true;
    try {
      await this.api(`/api/skills/pending/${encodeURIComponent(proposal.id)}`, {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ decision }),
      });
      setError("");
    } catch (err) {
      if (err.status === 401) return this.onSignedOut();
      setError(`Could not ${decision} skill ${proposal.name}: ${err.message}`);
    }
    await this.refresh(); // a 409 means it was decided elsewhere: the lists show what it became
  }
}


/** A unified diff, one span a line, so added and removed lines can be coloured. */
function diffBlock(diff) {
  const pre = el("pre", "skill-diff");
  let inHunk = false; // "--- " and "+++ " name the files only before the first hunk; after it, they are lines
  for (const line of diff.replace(/\n$/, "").split("\n")) {
    let kind = "";
    if (line.startsWith("@@")) {
      kind = "diff-hunk";
      inHunk = true;
    } else if (!inHunk) kind = "diff-file";
    else if (line.startsWith("+")) kind = "diff-add";
    else if (line.startsWith("-")) kind = "diff-del";
    pre.append(el("span", kind, `${line}\n`));
  }
  return pre;
}

function setStatus(text, isError = false) {
  const status = $("skills-status");
  status.textContent = text;
  status.hidden = !text;
  status.classList.toggle("error", isError);
}

function setError(text) {
  $("skills-error").textContent = text;
  $("skills-error").hidden = !text;
}
