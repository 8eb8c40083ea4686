// A small, safe Markdown renderer for model output.
//
// Contract: the source is HTML-escaped FIRST (& < > " '), so no tag or attribute
// of the model's can survive; only then are the few supported forms turned into
// tags written here: paragraphs, line breaks, fenced code, inline code, headings,
// **bold**, *italic*, `-`/`1.` lists, and [links](https://...) for http(s) only.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const FENCE = /^\s*```/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*\d+[.)]\s+(.*)$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const KEPT = /\0(\d+)\0/g;

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

export function renderMarkdown(source) {
  // \0 marks placeholders below; the model's own \0 is dropped.
  const lines = escapeHtml(source.replace(/\0/g, "").replace(/\r\n?/g, "\n")).split("\n");
  const html = [];
  let block = [];
  let code = null; // the lines of an open fenced block
  const flush = () => {
    if (block.length) html.push(renderBlock(block));
    block = [];
  };
  for (const line of lines) {
    if (code !== null) {
      if (/^\s*```\s*$/.test(line)) {
        html.push(`<pre><code>${code.join("\n")}</code></pre>`);
        code = null;
      } else {
        code.push(line);
      }
    } else if (FENCE.test(line)) {
      flush();
      code = [];
    } else if (!line.trim()) {
      flush();
    } else {
      block.push(line);
    }
  }
  flush();
  if (code !== null) html.push(`<pre><code>${code.join("\n")}</code></pre>`); // unclosed: a draft
  return html.join("");
}

// Consecutive lines of one kind (paragraph, bullet, numbered, heading) make one element.
function renderBlock(lines) {
  const out = [];
  let kind = null;
  let run = [];
  const close = () => {
    if (kind === "p") out.push(`<p>${run.map(inline).join("<br>")}</p>`);
    if (kind === "ul" || kind === "ol") out.push(`<${kind}>${run.map((i) => `<li>${inline(i)}</li>`).join("")}</${kind}>`);
    run = [];
  };
  for (const line of lines) {
    const heading = HEADING.exec(line);
    const bullet = BULLET.exec(line);
    const numbered = NUMBERED.exec(line);
    const next = heading ? "h" : bullet ? "ul" : numbered ? "ol" : "p";
    if (next !== kind || next === "h") close();
    kind = next;
    if (heading) out.push(`<h4>${inline(heading[2])}</h4>`);
    else run.push(bullet ? bullet[1] : numbered ? numbered[1] : line);
  }
  close();
  return out.join("");
}

// Code spans and links are set aside as placeholders, so emphasis never reaches
// into them (nor into an href).
function inline(text) {
  const kept = [];
  const keep = (html) => `\0${kept.push(html) - 1}\0`;
  let html = text
    .replace(/`([^`]+)`/g, (_, code) => keep(`<code>${code}</code>`))
    .replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g,
      (_, label, url) => keep(`<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>`))
    .replace(/\*\*(?=\S)(.+?)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w*])\*([^\s*](?:[^*]*[^\s*])?)\*(?![\w*])/g, "$1<em>$2</em>")
    .replace(/(^|\W)_([^\s_](?:[^_]*[^\s_])?)_(?!\w)/g, "$1<em>$2</em>");
  // A link's label may hold a code span: restore until no placeholder is left.
  while (/\0\d+\0/.test(html)) html = html.replace(KEPT, (_, i) => kept[Number(i)]);
  return html;
}
