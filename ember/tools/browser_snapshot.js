// The page as text for the browser tool's snapshot: its visible text, then every visible element
// one can click or type into, numbered (data-ember-ref) so that click and type can find it again.
() => {
  for (const old of document.querySelectorAll("[data-ember-ref]")) old.removeAttribute("data-ember-ref");
  const visible = (e) => {
    const box = e.getBoundingClientRect();
    const style = getComputedStyle(e);
    return box.width > 0 && box.height > 0 && style.visibility !== "hidden" && style.display !== "none";
  };
  const squeeze = (text) => (text || "").replace(/\s+/g, " ").trim().slice(0, 100);
  const labelOf = (e) => squeeze(e.getAttribute("aria-label") || (e.labels && e.labels[0] && e.labels[0].innerText)
    || e.innerText || e.value || e.getAttribute("placeholder") || e.getAttribute("name")
    || e.getAttribute("alt") || e.getAttribute("title"));
  const kindOf = (e) => {
    const tag = e.tagName.toLowerCase();
    if (tag === "a") return "link";
    if (tag === "input") return `input ${e.type}`;
    return e.getAttribute("role") || tag;
  };
  const lines = [];
  let n = 0;
  const selector = "a[href], button, input:not([type=hidden]), select, textarea, [role=button], [role=link], "
    + "[contenteditable=true]";
  for (const e of document.querySelectorAll(selector)) {
    if (!visible(e) || e.disabled) continue;
    n += 1;
    e.setAttribute("data-ember-ref", String(n));
    let line = `[${n}] ${kindOf(e)} "${labelOf(e)}"`;
    if (e.tagName === "A") line += ` -> ${e.href}`;
    if (e.form && (e.type === "submit" || e.type === "image")) line += " (submits a form)";
    else if (e.form && e.tagName !== "BUTTON") line += " (in a form)";
    lines.push(line);
  }
  const text = (document.body ? document.body.innerText : "").replace(/\n{3,}/g, "\n\n").trim();
  return `${text}\n\nElements (click or type by number):\n${lines.join("\n") || "(none)"}`;
}
