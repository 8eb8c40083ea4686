// The "Usage" panel: what the caller's model calls took and cost, by day and by session
// (GET /api/usage, in the browser's time zone). Costs are of the priced calls only; the
// calls whose model has no price are counted apart, never guessed.

import { $, el, headerPanel } from "./dom.js";

let view = 0; // bumped by every load, so a slow answer never replaces a newer one
let getJson = null; // the page's API call, given by startUsage

const number = new Intl.NumberFormat();
const money = (usd) => `$${usd.toFixed(usd && usd < 0.01 ? 4 : 2)}`;

function cost(row) {
  if (row.calls && row.unpriced_calls === row.calls) return "no price";
  const text = money(row.cost_usd);
  return row.unpriced_calls ? `${text} + ${row.unpriced_calls} unpriced` : text;
}

function table(node, first, rows, label) {
  const head = el("tr");
  for (const title of [first, "Calls", "Tokens in", "Tokens out", "Cost"]) head.append(el("th", "", title));
  const body = rows.map((row) => {
    const line = el("tr");
    for (const cell of [label(row), number.format(row.calls), number.format(row.input_tokens + row.cache_read_tokens),
      number.format(row.output_tokens), cost(row)]) line.append(el("td", "", cell));
    return line;
  });
  node.replaceChildren(head, ...body);
}

async function refresh() {
  const mine = ++view;
  const params = new URLSearchParams({ days: $("usage-days").value, tz_offset: String(new Date().getTimezoneOffset()) });
  setStatus("Loading…");
  try {
    const usage = await getJson(`/api/usage?${params}`);
    if (mine !== view) return;
    const { total } = usage;
    $("usage-total").textContent = total.calls
      ? `${number.format(total.calls)} model calls, ${number.format(total.input_tokens + total.output_tokens)} tokens, ${cost(total)}`
      : "";
    table($("usage-by-day"), "Day", usage.by_day, (row) => row.day);
    table($("usage-by-session"), "Session", usage.by_session,
      (row) => row.session === null ? "Background work" : (row.title || row.session));
    setStatus(total.calls ? "" : "No model calls in these days.");
  } catch (err) {
    if (mine !== view) return;
    setStatus(`Could not load the usage: ${err.message}`, true);
  }
}

function setStatus(text, isError = false) {
  $("usage-status").textContent = text;
  $("usage-status").classList.toggle("error", isError);
}

/** Signed out: nothing of the caller's usage stays on the page. */
function clear() {
  view++;
  for (const id of ["usage-by-day", "usage-by-session"]) $(id).replaceChildren();
  $("usage-total").textContent = "";
  setStatus("");
}

/** Wire the panel to the page; `api(path)` resolves to the JSON of a GET, or throws. */
export function startUsage(api) {
  getJson = api;
  $("usage-days").addEventListener("change", refresh);
  headerPanel("usage", { onOpen: refresh, onSignOut: clear });
}
