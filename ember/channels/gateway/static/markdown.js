// A small, safe Markdown renderer for model output.
//
// Contract: the source is HTML-escaped FIRST (& < > " '), so no tag or attribute
// of the model's can survive; only then are the few supported forms turned into
// tags written here: paragraphs, line breaks, fenced code, inline code, headings,
// **bold**, *italic*, `-`/`1.` lists, GFM tables, and [links](https://...) for http(s) only.
// Fenced code in a known language is highlighted: highlight() tokenizes the block's
// original text (unescapeHtml is escapeHtml's exact inverse) and escapes each token
// again before wrapping it in a <span class="tok-…"> of ours, so the spans hold
// exactly the escaped code.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const UNESCAPES = Object.fromEntries(Object.entries(ESCAPES).map(([c, entity]) => [entity, c]));
const FENCE = /^\s*```\s*([\w+-]*)/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*\d+[.)]\s+(.*)$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const KEPT = /\0(\d+)\0/g;
const PIPE = /(?<!\\)\|/; // a cell boundary; `\|` is a pipe inside a cell
const DELIMITER_CELL = /^(:?)-+(:?)$/;

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

function unescapeHtml(html) {
  return html.replace(/&(?:amp|lt|gt|quot|#39);/g, (entity) => UNESCAPES[entity]);
}

export function renderMarkdown(source) {
  // \0 marks placeholders below; the model's own \0 is dropped.
  const lines = escapeHtml(source.replace(/\0/g, "").replace(/\r\n?/g, "\n")).split("\n");
  const html = [];
  let block = [];
  let fence = null; // the open fenced block: its language tag and lines
  const flush = () => {
    if (block.length) html.push(renderBlock(block));
    block = [];
  };
  for (const line of lines) {
    if (fence !== null) {
      if (/^\s*```\s*$/.test(line)) {
        html.push(renderCode(fence));
        fence = null;
      } else {
        fence.lines.push(line);
      }
    } else if (FENCE.test(line)) {
      flush();
      fence = { tag: FENCE.exec(line)[1].toLowerCase(), lines: [] };
    } else if (!line.trim()) {
      flush();
    } else {
      block.push(line);
    }
  }
  flush();
  if (fence !== null) html.push(renderCode(fence)); // unclosed: a draft
  return html.join("");
}

// Consecutive lines of one kind (paragraph, bullet, numbered, heading, table) make one element.
function renderBlock(lines) {
  const out = [];
  let kind = null;
  let run = [];
  const close = () => {
    if (kind === "p") out.push(`<p>${run.map(inline).join("<br>")}</p>`);
    if (kind === "ul" || kind === "ol") out.push(`<${kind}>${run.map((i) => `<li>${inline(i)}</li>`).join("")}</${kind}>`);
    run = [];
    kind = null;
  };
  for (let i = 0; i < lines.length; i++) {
    const rows = tableRows(lines, i);
    if (rows) {
      close();
      out.push(renderTable(lines.slice(i, i + rows)));
      i += rows - 1;
      continue;
    }
    const line = lines[i];
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

// ---- tables (GFM) ----

// How many lines the table starting at lines[i] spans, or 0: a header row with pipes, a
// delimiter row of as many cells, then body rows up to a heading or a list item.
function tableRows(lines, i) {
  if (i + 1 >= lines.length || !PIPE.test(lines[i]) || !PIPE.test(lines[i + 1])) return 0;
  const delimiters = cells(lines[i + 1]);
  if (delimiters.length !== cells(lines[i]).length || !delimiters.every((d) => DELIMITER_CELL.test(d))) return 0;
  let end = i + 2;
  const startsBlock = (line) => HEADING.test(line) || BULLET.test(line) || NUMBERED.test(line);
  while (end < lines.length && !startsBlock(lines[end])) end++;
  return end - i;
}

// A row's cells, trimmed: split at its unescaped pipes, leaving out a leading and a trailing one.
function cells(row) {
  let text = row.trim();
  if (text.startsWith("|")) text = text.slice(1);
  if (/(?:^|[^\\])\|$/.test(text)) text = text.slice(0, -1);
  return text.split(PIPE).map((cell) => cell.trim().replace(/\\\|/g, "|"));
}

// Body rows get the header's number of cells, padded or cut as GitHub does.
function renderTable([header, delimiter, ...body]) {
  const aligns = cells(delimiter).map((cell) => {
    const [, left, right] = DELIMITER_CELL.exec(cell);
    return left && right ? "center" : right ? "right" : left ? "left" : "";
  });
  const row = (line, tag) => {
    const texts = cells(line);
    return `<tr>${aligns.map((align, n) =>
      `<${tag}${align && ` class="align-${align}"`}>${inline(texts[n] ?? "")}</${tag}>`).join("")}</tr>`;
  };
  const rows = body.length ? `<tbody>${body.map((line) => row(line, "td")).join("")}</tbody>` : "";
  return `<div class="table-wrap"><table><thead>${row(header, "th")}</thead>${rows}</table></div>`;
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

// ---- fenced code and its highlighting ----

function renderCode({ tag, lines }) {
  const code = lines.join("\n"); // escaped
  const family = LANGUAGES.get(tag);
  if (!family) return `<pre><code>${code}</code></pre>`;
  return `<pre><code class="language-${tag}">${highlight(unescapeHtml(code), family)}</code></pre>`;
}

// `code` is the original text. Every character of it is written once, escaped: plain
// runs as they are, tokens inside a span whose class is one of ours.
function highlight(code, family) {
  let html = "";
  let plain = 0; // where the text not yet written starts
  for (let i = 0; i < code.length;) {
    const [kind, length] = tokenAt(code, i, family);
    if (kind) {
      const token = escapeHtml(code.slice(i, i + length));
      html += `${escapeHtml(code.slice(plain, i))}<span class="tok-${kind}">${token}</span>`;
      plain = i + length;
    }
    i += length;
  }
  return html + escapeHtml(code.slice(plain));
}

// The token at code[i]: the first rule of the family that matches there, [kind, length];
// a word is a keyword or plain; [null, 1] when nothing matches.
function tokenAt(code, i, { rules, keywords, caseless }) {
  for (const [kind, rule] of rules) {
    rule.lastIndex = i;
    const text = rule.exec(code)?.[0];
    if (!text) continue;
    if (kind !== "word") return [kind, text.length];
    return [keywords.has(caseless ? text.toLowerCase() : text) ? "keyword" : null, text.length];
  }
  return [null, 1];
}

// A family: ordered sticky rules (the first that matches wins), then words. Not grammars:
// keywords, strings, comments and numbers, enough to read by. Strings end at their line
// and an unclosed one runs to it, so a streaming draft highlights without breaking.
const WORD = /[A-Za-z_$][\w$]*/y;
const DQ = /"(?:\\.|[^"\\\n])*"?/y;
const SQ = /'(?:\\.|[^'\\\n])*'?/y;
const NUMBER = /(?:0x[\da-f_]+|\d[\d_]*(?:\.\d[\d_]*)?(?:e[+-]?\d+)?)[a-z\d_]*/iy;
const SLASH_COMMENT = /\/\/.*|\/\*[\s\S]*?(?:\*\/|$)/y;
const HASH_COMMENT = /(?<!\S)#.*/y; // at a line's start or after a space: not `$#` nor `a#b`
const CONFIG_KEY = /(?<=(?:^|\n)[ \t-]*)[\w.-]+(?=[ \t]*[:=])/y;

const family = (rules, keywords = "", caseless = false) =>
  ({ rules: [...rules, ["word", WORD]], keywords: new Set(keywords.split(" ")), caseless });

const PYTHON = family([["comment", /#.*/y], ["string", /("""|''')[\s\S]*?(?:\1|$)/y], ["string", DQ],
  ["string", SQ], ["number", NUMBER]],
"and as assert async await break class continue def del elif else except finally for from global if import in is " +
  "lambda match case nonlocal not or pass raise return try while with yield None True False");
const JS = family([["comment", SLASH_COMMENT], ["string", DQ], ["string", SQ],
  ["string", /`(?:\\[\s\S]|[^`\\])*`?/y], ["number", NUMBER]],
"async await break case catch class const continue debugger default delete do else export extends finally for " +
  "from function if import in instanceof let new of return static super switch this throw try typeof var void " +
  "while yield true false null undefined as enum implements interface keyof private protected public readonly type");
const SHELL = family([["comment", HASH_COMMENT], ["string", DQ], ["string", /'[^'\n]*'?/y], ["number", NUMBER]],
  "if then else elif fi for while until do done case esac function in select return exit export local readonly " +
  "unset shift source");
const JSON_ = family([["property", /"(?:\\.|[^"\\\n])*"(?=\s*:)/y], ["string", DQ], ["number", NUMBER]],
  "true false null");
const SQL = family([["comment", /--.*|\/\*[\s\S]*?(?:\*\/|$)/y], ["string", /'(?:''|[^'])*'?/y], ["number", NUMBER]],
  "select from where and or not insert into values update set delete create table drop alter add index primary " +
  "key foreign references join left right inner outer full cross on as group by order having limit offset union " +
  "all distinct case when then else end is null like in between exists with returning default unique check " +
  "constraint view begin commit rollback if asc desc true false", true);
const GO = family([["comment", SLASH_COMMENT], ["string", DQ], ["string", /`[^`]*`?/y], ["string", SQ],
  ["number", NUMBER]],
"break case chan const continue default defer else fallthrough for func go goto if import interface map package " +
  "range return select struct switch type var true false nil");
const RUST = family([["comment", SLASH_COMMENT], ["string", DQ], ["string", /'(?:\\.|[^'\\\n])'/y],
  ["number", NUMBER]],
"as async await break const continue crate dyn else enum extern false fn for if impl in let loop match mod move " +
  "mut pub ref return self Self static struct super trait true type unsafe use where while");
const C_LIKE = family([["comment", SLASH_COMMENT], ["keyword", /(?<=(?:^|\n)[ \t]*)#[ \t]*[a-z]+/y],
  ["string", DQ], ["string", SQ], ["number", NUMBER]],
"abstract auto bool boolean break byte case catch char class const constexpr continue default delete do double " +
  "else enum explicit extends extern final finally float for friend goto if implements import inline instanceof " +
  "int interface long namespace new noexcept nullptr null NULL operator override package private protected " +
  "public register return short signed sizeof static struct super switch synchronized template this throw " +
  "throws try typedef typename union unsigned using virtual void volatile while true false");
const CONFIG = family([["comment", HASH_COMMENT], ["property", CONFIG_KEY], ["keyword", /(?<=(?:^|\n)[ \t]*)\[.*/y],
  ["string", DQ], ["string", /(?<!\w)'(?:''|[^'\n])*'?/y], ["number", NUMBER]], "true false null yes no");
const MARKUP = family([["comment", /<!--[\s\S]*?(?:-->|$)/y], ["tag", /<[!?/]?[\w:.-]+|\/?>/y],
  ["attr", /[\w:.-]+(?==)/y], ["string", /(?<==)(?:"[^"]*"?|'[^']*'?)/y]]);
const CSS = family([["comment", /\/\*[\s\S]*?(?:\*\/|$)/y], ["string", DQ], ["string", SQ],
  ["keyword", /@[\w-]+|!important/y], ["property", /[\w-]+(?=\s*:[^{};]*(?:[;}]|$))/y],
  ["number", /(?:\d+\.?\d*|\.\d+)(?:%|[a-z]+)?/iy]]);

// A Map, so that a tag like `constructor` finds nothing.
const LANGUAGES = new Map(Object.entries({
  python: PYTHON, py: PYTHON, js: JS, javascript: JS, jsx: JS, ts: JS, typescript: JS, tsx: JS,
  bash: SHELL, sh: SHELL, shell: SHELL, zsh: SHELL, json: JSON_, sql: SQL, go: GO, rust: RUST, rs: RUST,
  java: C_LIKE, c: C_LIKE, cpp: C_LIKE, "c++": C_LIKE, yaml: CONFIG, yml: CONFIG, toml: CONFIG,
  html: MARKUP, xml: MARKUP, css: CSS,
}));
