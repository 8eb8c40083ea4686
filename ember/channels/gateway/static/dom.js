// DOM helpers shared by the page's modules. Text goes in through textContent only.

export const $ = (id) => document.getElementById(id);

export function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

const UNITS = [["year", 31536000], ["month", 2592000], ["week", 604800], ["day", 86400], ["hour", 3600],
  ["minute", 60]];

/** "5 minutes ago", "yesterday": how long since `seconds` (Unix time). */
export function relativeTime(seconds) {
  const ago = Date.now() / 1000 - seconds;
  const format = new Intl.RelativeTimeFormat(undefined, { numeric: "auto" });
  for (const [unit, size] of UNITS) {
    if (ago >= size) return format.format(-Math.floor(ago / size), unit);
  }
  return "just now";
}

// A session key, as the gateway accepts it (http.py).
const SESSION_KEY = /^[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}$/;

/** The session named in the page's URL hash, or null. */
export function hashKey() {
  try {
    const key = decodeURIComponent(location.hash.slice(1));
    return SESSION_KEY.test(key) ? key : null;
  } catch {
    return null;
  }
}

/** A panel the header opens: `open-NAME` shows the dialog `NAME-panel` and calls `onOpen()`, `NAME-close`
 * closes it; the button shows while the page is signed in (#app-view shown), and on signing out the
 * panel closes and `onSignOut()` clears what it showed of the caller. */
export function headerPanel(name, { onOpen, onSignOut }) {
  const panel = $(`${name}-panel`);
  $(`open-${name}`).addEventListener("click", () => {
    panel.showModal();
    onOpen();
  });
  $(`${name}-close`).addEventListener("click", () => panel.close());
  const follow = () => {
    const signedIn = !$("app-view").hidden;
    $(`open-${name}`).hidden = !signedIn;
    if (signedIn) return;
    if (panel.open) panel.close();
    onSignOut();
  };
  new MutationObserver(follow).observe($("app-view"), { attributes: true, attributeFilter: ["hidden"] });
  follow();
}

/** A panel's list entry: a button with a badge, a title, words `aside` it and a line of details,
 * read out as one sentence (the spans are laid apart by CSS only); `onClick(button)` opens it. */
export function listEntry({ className, badge, title, aside = [], meta, onClick }) {
  const item = el("li", className);
  const button = el("button", "activity-open");
  button.type = "button";
  const head = el("span", "activity-line");
  head.append(badge, el("span", "activity-session", title), ...aside.map((words) => el("span", "activity-when", words)));
  button.append(head, el("span", "activity-meta", meta));
  button.setAttribute("aria-label", [badge.textContent, title, ...aside, meta].join(", "));
  button.addEventListener("click", () => onClick(button));
  item.append(button);
  return item;
}
