// Markdown for the chat page's answers, built as DOM nodes. Text enters the page only through text nodes (never
// innerHTML), so HTML in the model's output shows as text; links are made only for http(s) URLs, images are not loaded.
// It covers what chat models write: fenced code, headings, lists (nested by indentation), quotes, rules, pipe tables,
// paragraphs (a single newline is a line break), inline code, bold, italics, strikethrough, links and bare URLs.
"use strict";

const Markdown = (() => {
  const FENCE = /^( {0,3})(`{3,}|~{3,})[ \t]*([^`\s]*)[^`]*$/;
  const HEADING = /^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$/;
  const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
  const QUOTE = /^ {0,3}> ?(.*)$/;
  const ITEM = /^( *)([-*+]|\d{1,9}[.)])(?:( +)(.*))?$/;
  const TABLE_RULE = /^ *\|? *:?-+:? *(?:\| *:?-+:? *)*\|? *$/;
  const LANG = /^[\w+#.-]{1,32}$/;

  function el(tag, cls) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    return node;
  }

  const blank = (line) => /^\s*$/.test(line);
  const indentOf = (line) => line.length - line.replace(/^ +/, "").length;

  /** The URL if it is an absolute http(s) URL, else null. */
  function safeUrl(url) {
    if (!/^https?:\/\/[^\s]+$/i.test(url)) return null;
    try {
      const u = new URL(url);
      return u.protocol === "http:" || u.protocol === "https:" ? u.href : null;
    } catch (e) {
      return null;
    }
  }

  function link(url, parent, label) {
    const a = el("a");
    a.href = url;
    a.target = "_blank";
    a.rel = "noopener noreferrer nofollow";
    if (label === undefined) a.textContent = url;
    else inline(label, a);
    parent.appendChild(a);
  }

  function item(line) {
    const m = ITEM.exec(line);
    if (!m || (m[3] === undefined && m[4] === undefined && line.trim() !== m[2])) return null;
    const spaces = m[3] ? m[3].length : 1;
    return { indent: m[1].length, ordered: /\d/.test(m[2]), start: parseInt(m[2], 10),
             content: m[1].length + m[2].length + (spaces > 4 ? 1 : spaces), rest: m[4] || "" };
  }

  function startsBlock(line) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || item(line) !== null;
  }

  function codeBlock(code, lang, parent) {
    const wrap = el("div", "code-block");
    const bar = el("div", "code-bar");
    const name = el("span");
    name.textContent = LANG.test(lang) ? lang : "";
    const copy = el("button", "copy");
    copy.type = "button";
    copy.textContent = "Copy";
    copy.onclick = () => {
      if (navigator.clipboard) navigator.clipboard.writeText(code).then(() => { copy.textContent = "Copied"; }, () => {});
    };
    bar.append(name, copy);
    const pre = el("pre");
    const c = el("code");
    if (LANG.test(lang)) c.className = "language-" + lang;
    c.textContent = code;
    pre.appendChild(c);
    wrap.append(bar, pre);
    parent.appendChild(wrap);
  }

  function splitRow(line) {
    let s = line.trim();
    if (s.startsWith("|")) s = s.slice(1);
    if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
    const cells = [];
    let cur = "";
    for (let i = 0; i < s.length; i++) {
      if (s[i] === "\\" && s[i + 1] === "|") { cur += "|"; i++; } else if (s[i] === "|") { cells.push(cur.trim()); cur = ""; } else cur += s[i];
    }
    cells.push(cur.trim());
    return cells;
  }

  function table(lines, i, parent) {
    const head = splitRow(lines[i]);
    const align = splitRow(lines[i + 1]).map((c) => (c.endsWith(":") ? (c.startsWith(":") ? "center" : "right") : c.startsWith(":") ? "left" : ""));
    const t = el("table");
    const row = (cells, tag) => {
      const tr = el("tr");
      head.forEach((_, k) => {
        const td = el(tag);
        if (align[k]) td.style.textAlign = align[k];
        inline(cells[k] || "", td);
        tr.appendChild(td);
      });
      return tr;
    };
    const thead = el("thead");
    thead.appendChild(row(head, "th"));
    const tbody = el("tbody");
    i += 2;
    while (i < lines.length && !blank(lines[i]) && lines[i].includes("|")) tbody.appendChild(row(splitRow(lines[i++]), "td"));
    t.append(thead, tbody);
    const wrap = el("div", "table");
    wrap.appendChild(t);
    parent.appendChild(wrap);
    return i;
  }

  function list(lines, i, parent) {
    const first = item(lines[i]);
    const ol = el(first.ordered ? "ol" : "ul");
    if (first.ordered && first.start !== 1) ol.start = first.start;
    while (i < lines.length) {
      const it = item(lines[i]);
      if (!it || it.indent !== first.indent || it.ordered !== first.ordered || RULE.test(lines[i])) break;
      const body = [it.rest];
      i++;
      while (i < lines.length) {
        const line = lines[i];
        if (blank(line)) {
          let j = i;
          while (j < lines.length && blank(lines[j])) j++;
          if (j < lines.length && indentOf(lines[j]) >= it.content) { for (; i < j; i++) body.push(""); continue; }
          break;
        }
        const sub = item(line);
        if (indentOf(line) >= it.content || (sub && sub.indent > it.indent)) body.push(line.slice(Math.min(indentOf(line), it.content)));
        else if (sub || startsBlock(line)) break;
        else body.push(line.trim());  // a lazy continuation of the item's paragraph
        i++;
      }
      const li = el("li");
      blocks(body, li);
      if (li.childNodes.length === 1 && li.firstChild.nodeName === "P") li.replaceChildren(...li.firstChild.childNodes);
      ol.appendChild(li);
      let j = i;  // blank lines between items of the same list
      while (j < lines.length && blank(lines[j])) j++;
      const next = j < lines.length ? item(lines[j]) : null;
      if (j > i && next && next.indent === first.indent && next.ordered === first.ordered) i = j;
    }
    parent.appendChild(ol);
    return i;
  }

  /** Renders the lines as block elements appended to parent. */
  function blocks(lines, parent) {
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (blank(line)) {
        i++;
      } else if ((m = FENCE.exec(line))) {
        const fence = m[2];
        const close = new RegExp("^ {0,3}" + fence[0] + "{" + fence.length + ",}[ \\t]*$");
        const code = [];
        for (i++; i < lines.length && !close.test(lines[i]); i++) code.push(lines[i].slice(Math.min(indentOf(lines[i]), m[1].length)));
        i++;  // the closing fence; an unclosed block (still streaming) runs to the end
        codeBlock(code.join("\n"), m[3], parent);
      } else if ((m = HEADING.exec(line))) {
        const h = el("h" + m[1].length);
        inline(m[2] || "", h);
        parent.appendChild(h);
        i++;
      } else if (RULE.test(line)) {
        parent.appendChild(el("hr"));
        i++;
      } else if (QUOTE.test(line)) {
        const body = [];
        for (; i < lines.length && (m = QUOTE.exec(lines[i])); i++) body.push(m[1]);
        const q = el("blockquote");
        blocks(body, q);
        parent.appendChild(q);
      } else if (item(line)) {
        i = list(lines, i, parent);
      } else if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1]) && lines[i + 1].includes("-")) {
        i = table(lines, i, parent);
      } else {
        const text = [line.trim()];
        for (i++; i < lines.length && !blank(lines[i]) && !startsBlock(lines[i]); i++) text.push(lines[i].trim());
        const p = el("p");
        inline(text.join("\n"), p);
        parent.appendChild(p);
      }
    }
  }

  const ESCAPABLE = /[\\`*_{}[\]()#+\-.!~|<>]/;
  const AUTOLINK = /<(https?:\/\/[^\s<>]+)>/y;
  const BARE_URL = /https?:\/\/[^\s<>"'`]+/y;
  const LINK_TAIL = /\(\s*<?([^\s()<>]*(?:\([^\s()]*\)[^\s()<>]*)*)>?(?:\s+"[^"]*")?\s*\)/y;

  function sticky(re, text, i) {
    re.lastIndex = i;
    return re.exec(text);
  }

  /** The index of the "]" closing the "[" at i, or -1 (a backslash escapes the character after it). */
  function scanBracket(text, i) {
    let depth = 0;
    for (let k = i; k < text.length; k++) {
      if (text[k] === "\\") k++;
      else if (text[k] === "[") depth++;
      else if (text[k] === "]" && --depth === 0) return k;
    }
    return -1;
  }

  /** scanBracket for every "[" of text from one pass with a stack, built on first use: a scan to the end per
   * unclosed "[" is quadratic. A "[" that this pass reads as escaped is scanned alone, since a scan from it pairs
   * the backslashes after it differently (rare: the inline parser takes "\\[" as an escape before it gets there). */
  function bracketCloser(text) {
    let match = null;
    let escaped = null;
    return (i) => {
      if (match === null) {
        match = new Int32Array(text.length).fill(-1);
        escaped = new Uint8Array(text.length + 1);
        const open = [];
        for (let k = 0; k < text.length; k++) {
          if (text[k] === "\\") escaped[++k] = 1;
          else if (text[k] === "[") open.push(k);
          else if (text[k] === "]" && open.length) match[open.pop()] = k;
        }
      }
      return escaped[i] ? scanBracket(text, i) : match[i];
    };
  }

  /** For every p, where a search for a closing `delim` that starts at p ends (-1: none), in one pass from the end.
   * The closing run follows a non-space character; a single delimiter followed by another is part of a longer run
   * (** inside *...*) and the search goes on after it; "_" is not closing before a letter or digit. Built once per
   * text and delimiter, so that each opener's lookup is O(1): scanning from every opener to the end of a text with
   * many unclosed openers is quadratic, and a streaming answer is rendered again every frame. */
  function closers(text, delim) {
    const n = text.length;
    const to = new Int32Array(n + 3).fill(-1);
    for (let k = n - 1; k >= 0; k--) {
      if (!text.startsWith(delim, k)) to[k] = to[k + 1];
      else if (/\s/.test(text[k - 1])) to[k] = to[k + 1];
      else if (delim.length === 1 && text[k + 1] === delim) to[k] = to[k + 2];
      else if (delim[0] === "_" && /[\p{L}\p{N}]/u.test(text[k + delim.length] || "")) to[k] = to[k + 1];
      else to[k] = k;
    }
    return to;
  }

  /** A function giving where the emphasis opened by `delim` at i closes in text, or -1 (tables built on first use). */
  function emphasisCloser(text) {
    const tables = new Map();
    return (i, delim) => {
      if (!tables.has(delim)) tables.set(delim, closers(text, delim));
      const to = tables.get(delim);
      const from = i + delim.length + 1;
      return from < to.length ? to[from] : -1;
    };
  }

  const EMPHASIS = [["***", ["strong", "em"]], ["___", ["strong", "em"]], ["**", ["strong"]], ["__", ["strong"]],
                    ["~~", ["del"]], ["*", ["em"]], ["_", ["em"]]];

  /** Renders one block's text (inline code, emphasis, links, line breaks) appended to parent as nodes. */
  function inline(text, parent) {
    const closeEmphasis = emphasisCloser(text);
    const closeBracket = bracketCloser(text);
    let buf = "";
    const flush = () => {
      if (buf) parent.appendChild(document.createTextNode(buf));
      buf = "";
    };
    let i = 0;
    outer: while (i < text.length) {
      const c = text[i];
      if (c === "\\" && ESCAPABLE.test(text[i + 1] || "")) {
        buf += text[i + 1];
        i += 2;
        continue;
      }
      if (c === "\n") {
        flush();
        parent.appendChild(el("br"));
        i++;
        continue;
      }
      if (c === "`") {
        let n = 1;
        while (text[i + n] === "`") n++;
        const run = "`".repeat(n);
        let k = text.indexOf(run, i + n);
        while (k >= 0 && text[k + n] === "`") k = text.indexOf(run, k + n + 1);
        if (k < 0) {
          buf += run;
          i += n;
          continue;
        }
        let code = text.slice(i + n, k).replace(/\n/g, " ");
        if (code.length > 2 && code[0] === " " && code[code.length - 1] === " ") code = code.slice(1, -1);
        flush();
        const node = el("code");
        node.textContent = code;
        parent.appendChild(node);
        i = k + n;
        continue;
      }
      if (c === "[") {
        const end = closeBracket(i);
        const m = end > 0 ? sticky(LINK_TAIL, text, end + 1) : null;
        if (m) {
          const url = safeUrl(m[1]);
          flush();
          if (url) link(url, parent, text.slice(i + 1, end));
          else inline(text.slice(i + 1, end), parent);  // not http(s): the label alone, as text
          i = end + 1 + m[0].length;
          continue;
        }
      }
      if (c === "<") {
        const m = sticky(AUTOLINK, text, i);
        const url = m && safeUrl(m[1]);
        if (url) {
          flush();
          link(url, parent);
          i += m[0].length;
          continue;
        }
      }
      if ((c === "h" || c === "H") && !/[\p{L}\p{N}]/u.test(text[i - 1] || "")) {
        const m = sticky(BARE_URL, text, i);
        if (m) {
          let s = m[0].replace(/[.,;:!?]+$/, "");
          const opens = s.split("(").length;
          let closes = s.split(")").length;
          while (s.endsWith(")") && opens < closes) {  // an unbalanced ")" at the end is not part of the URL
            s = s.slice(0, -1);
            closes--;
          }
          const url = safeUrl(s);
          if (url) {
            flush();
            link(url, parent);
            parent.lastChild.textContent = s;
            i += s.length;
            continue;
          }
        }
      }
      if (c === "*" || c === "_" || c === "~") {
        for (const [delim, tags] of EMPHASIS) {
          if (!text.startsWith(delim, i) || /\s/.test(text[i + delim.length] || " ")) continue;
          if (delim[0] === "_" && /[\p{L}\p{N}]/u.test(text[i - 1] || "")) continue;
          const k = closeEmphasis(i, delim);
          if (k < 0) continue;
          flush();
          const outerNode = el(tags[0]);
          let inner = outerNode;
          for (const t of tags.slice(1)) inner = inner.appendChild(el(t));
          inline(text.slice(i + delim.length, k), inner);
          parent.appendChild(outerNode);
          i = k + delim.length;
          continue outer;
        }
      }
      buf += c;
      i++;
    }
    flush();
  }

  /** The markdown text as a fragment of DOM nodes. */
  function render(text) {
    const frag = document.createDocumentFragment();
    blocks(String(text).replace(/\r\n?/g, "\n").split("\n"), frag);
    return frag;
  }

  return { render, inline, safeUrl };
})();
