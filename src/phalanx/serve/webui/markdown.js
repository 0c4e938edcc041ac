// A small markdown renderer for model answers (issue 47; why hand-written: docs/design.md).
//
// It builds DOM nodes and puts text in them with createTextNode only: model text never
// reaches innerHTML, so no answer can inject markup, whatever it holds. Blocks: fenced
// code (``` or ~~~, an unclosed fence while streaming is code so far), headings, lists,
// block quotes, rules, paragraphs (line breaks kept). Inline: `code`, **bold**, *italic*,
// _italic_, and [links](https://...) whose address is http or https (others stay text).
"use strict";

(function () {
  const FENCE = /^\s{0,3}(`{3,}|~{3,})\s*([\w+#.-]{0,32})\s*$/;
  const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;
  const ITEM = /^\s{0,3}([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const QUOTE = /^\s{0,3}>\s?(.*)$/;
  const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|__(?=\S)([\s\S]*?\S)__|\*(?=\S)([^*]*?\S)\*|\b_(?=\S)([^_]*?\S)_\b|\[([^\]\n]+)\]\(([^)\s]+)\)/g;
  const MAX_DEPTH = 8;

  function el(doc, tag, parent) {
    const node = doc.createElement(tag);
    parent.appendChild(node);
    return node;
  }

  function text(doc, parent, s) {
    parent.appendChild(doc.createTextNode(s));
  }

  // Inline spans of one block's text into parent; line breaks become <br>.
  function inline(doc, parent, s, depth) {
    if (depth > MAX_DEPTH) {
      text(doc, parent, s);
      return;
    }
    let last = 0;
    INLINE.lastIndex = 0;
    const found = [];
    let m;
    while ((m = INLINE.exec(s)) !== null) found.push(m);
    for (const m of found) {
      plain(doc, parent, s.slice(last, m.index));
      last = m.index + m[0].length;
      if (m[1] !== undefined) {
        text(doc, el(doc, "code", parent), m[2]);
      } else if (m[3] !== undefined || m[4] !== undefined) {
        inline(doc, el(doc, "strong", parent), m[3] ?? m[4], depth + 1);
      } else if (m[5] !== undefined || m[6] !== undefined) {
        inline(doc, el(doc, "em", parent), m[5] ?? m[6], depth + 1);
      } else if (/^https?:\/\//i.test(m[8])) {
        const a = el(doc, "a", parent);
        a.href = m[8];
        a.rel = "noopener noreferrer nofollow";
        a.target = "_blank";
        inline(doc, a, m[7], depth + 1);
      } else {
        text(doc, parent, m[0]);
      }
    }
    plain(doc, parent, s.slice(last));
  }

  function plain(doc, parent, s) {
    const lines = s.split("\n");
    lines.forEach((line, i) => {
      if (i > 0) el(doc, "br", parent);
      if (line) text(doc, parent, line);
    });
  }

  function isBlockStart(line) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || ITEM.test(line)
      || QUOTE.test(line);
  }

  function blocks(doc, parent, lines, depth) {
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (!line.trim()) {
        i++;
      } else if ((m = FENCE.exec(line))) {
        const close = m[1];
        const body = [];
        i++;
        while (i < lines.length && !(lines[i].trim().startsWith(close[0].repeat(close.length))
                                     && lines[i].trim().replace(/[`~]/g, "") === "")) {
          body.push(lines[i]);
          i++;
        }
        i++;  // the closing fence (or the end)
        const pre = el(doc, "pre", parent);
        const code = el(doc, "code", pre);
        if (m[2]) code.className = "language-" + m[2];
        text(doc, code, body.join("\n"));
      } else if ((m = HEADING.exec(line))) {
        inline(doc, el(doc, "h" + m[1].length, parent), m[2], depth);
        i++;
      } else if (RULE.test(line)) {
        el(doc, "hr", parent);
        i++;
      } else if (QUOTE.test(line)) {
        const inner = [];
        while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
          inner.push(m[1]);
          i++;
        }
        const quote = el(doc, "blockquote", parent);
        if (depth < MAX_DEPTH) blocks(doc, quote, inner, depth + 1);
        else text(doc, quote, inner.join("\n"));
      } else if ((m = ITEM.exec(line))) {
        const ordered = /\d/.test(m[1]);
        const list = el(doc, ordered ? "ol" : "ul", parent);
        if (ordered && parseInt(m[1], 10) !== 1) list.start = parseInt(m[1], 10);
        let item = null;
        let itemText = [];
        const flush = () => {
          if (item) inline(doc, item, itemText.join("\n"), depth);
        };
        while (i < lines.length) {
          const cur = lines[i];
          const im = ITEM.exec(cur);
          if (im && /\d/.test(im[1]) === ordered) {
            flush();
            item = el(doc, "li", list);
            itemText = [im[2]];
          } else if (cur.trim() && /^\s/.test(cur) && !FENCE.test(cur)) {
            itemText.push(cur.trim());  // a continuation line, indented
          } else {
            break;
          }
          i++;
        }
        flush();
      } else {
        const para = [];
        while (i < lines.length && lines[i].trim() && (para.length === 0 || !isBlockStart(lines[i]))) {
          para.push(lines[i]);
          i++;
        }
        inline(doc, el(doc, "p", parent), para.join("\n"), depth);
      }
    }
  }

  // Render markdown source into a new DocumentFragment of doc.
  function render(source, doc) {
    doc = doc || document;
    const frag = doc.createDocumentFragment();
    blocks(doc, frag, String(source).replace(/\r\n?/g, "\n").split("\n"), 0);
    return frag;
  }

  window.phalanxMarkdown = Object.freeze({ render: render });
})();
