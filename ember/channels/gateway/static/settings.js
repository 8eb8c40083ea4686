// The "Settings" panel: what this Ember runs with (GET /api/settings), read-only. The server
// leaves every secret out; text reaches the page through textContent only.

import { $, el, headerPanel } from "./dom.js";

let getJson = null; // the page's API call, given by startSettings

function list(pairs) {
  const dl = el("dl");
  for (const [term, value] of pairs) dl.append(el("dt", "", term), el("dd", "", value));
  return dl;
}

function section(title, ...content) {
  const node = el("section");
  node.append(el("h3", "", title), ...content);
  return node;
}

function render(view) {
  const models = view.models.map((m) => section(`Model: ${m.name}`, list([
    ["Roles", m.roles.join(", ")],
    ["Model", m.model],
    ["Provider", m.provider],
    ["Endpoint", m.endpoint ?? "the provider's default"],
    ...(m.context_window ? [["Context", `${m.context_window.toLocaleString()} tokens`]] : []),
    ["Priced", m.priced ? "yes: costs show in Usage" : "no: tokens counted, no cost"],
  ])));
  const agents = view.agents.map((a) => section(`Agent: ${a.name}`, list([
    ["Models", a.models.join(", ") || "the main chain"],
    ["Tools", a.tools === null ? "every tool" : a.tools.join(", ") || "none"],
    ["Skills", a.skills === null ? "every skill" : a.skills.join(", ") || "none"],
    ["Memory", a.memory === "own" ? "its own with each person" : "the person's"],
    ["System prompt", a.own_prompt ? "its own" : "the default"],
    ...Object.entries(view.channel_agents).filter(([, agent]) => agent === a.name)
      .map(([where]) => ["Answers", where]),
  ])));
  const policy = view.tool_policy;
  const overrides = Object.entries(policy.tools).map(([tool, choice]) => `${tool}: ${choice}`);
  const rules = policy.rules.map((r) => `${r.tool} on ${r.subject}: ${r.decision}`);
  $("settings-body").replaceChildren(
    section("Agent", list([["Name", view.agent_name], ["Time zone", view.timezone],
      ["Memory embeddings", view.embedding_model], ["Store", view.store], ["Bus", view.bus]])),
    ...models,
    ...agents,
    section("Channels", list([["On", view.channels.join(", ")]])),
    section("Tools", list([["Available", view.tools.join(", ") || "none"]])),
    section("Tool policy", list([
      ["Reading", policy.read], ["Writing", policy.write], ["Running commands", policy.execute],
      ["Network", policy.network], ["Per tool", overrides.join("; ") || "none"],
      ["Rules, in order", rules.join("; ") || "none"], ["Approval waits", `${policy.timeout_s} s`],
    ])),
  );
}

async function load() {
  $("settings-status").textContent = "Loading…";
  try {
    render(await getJson("/api/settings"));
    $("settings-status").textContent = "";
  } catch (err) {
    $("settings-status").textContent = `Could not load the settings: ${err.message}`;
  }
}

/** Wire the panel to the page; `api(path)` resolves to the JSON of a GET, or throws. */
export function startSettings(api) {
  getJson = api;
  headerPanel("settings", { onOpen: load, onSignOut: () => $("settings-body").replaceChildren() });
}
