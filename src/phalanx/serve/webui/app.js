// phalanx serve's page (issue 47): a chat streamed through /v1/chat/completions and
// the server's state polled from /state (the figures of /metrics), with a plot of the
// last minutes kept here. Every server or model string reaches the page through
// textContent or the markdown renderer's text nodes, never innerHTML.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const params = new URLSearchParams(location.search);
  // ?poll=ms: how often /state is asked (the browser tests poll faster)
  const POLL_MS = Math.min(10000, Math.max(100, parseInt(params.get("poll") || "1000", 10) || 1000));
  const PLOT_S = 300;      // the plot's span: the last five minutes
  const SVG = "http://www.w3.org/2000/svg";

  let apiKey = null;       // kept in this page's memory only
  let model = null;
  let history = [];        // [{role, content}] of this chat
  let controller = null;   // the running stream's AbortController
  const samples = [];      // [{t, tps, hit}] for the plot

  // -- the API -------------------------------------------------------------------------

  function headers() {
    const h = { "Content-Type": "application/json" };
    if (apiKey) h.Authorization = "Bearer " + apiKey;
    return h;
  }

  async function errorText(resp) {
    try {
      const body = await resp.json();
      if (body && body.error && body.error.message) return resp.status + ": " + body.error.message;
    } catch (e) { /* not JSON: the status alone */ }
    return "HTTP " + resp.status;
  }

  function askForKey(message) {
    $("keyform").hidden = false;
    $("keyerror").textContent = message || "";
    $("apikey").focus();
  }

  async function checkKey() {
    const resp = await fetch("/v1/models", { headers: headers() });
    if (resp.status === 401) {
      askForKey(apiKey ? "wrong key" : "");
      return false;
    }
    $("keyform").hidden = true;
    $("keyerror").textContent = "";
    return true;
  }

  // -- the chat ------------------------------------------------------------------------

  function addMessage(role, content) {
    const box = document.createElement("div");
    box.className = "msg " + role;
    const body = document.createElement("div");
    body.className = "body";
    box.appendChild(body);
    const meta = document.createElement("div");
    meta.className = "meta";
    box.appendChild(meta);
    if (role === "user") body.textContent = content;
    $("messages").appendChild(box);
    box.scrollIntoView({ block: "end" });
    return { box, body, meta };
  }

  function renderAnswer(view, text) {
    view.body.replaceChildren(window.phalanxMarkdown.render(text));
  }

  function stopStrings() {
    const raw = $("stopstrings").value;
    if (!raw.trim()) return undefined;
    const stops = raw.split(",").map((s) => s.trim().replace(/\\n/g, "\n").replace(/\\t/g, "\t"))
      .filter((s) => s.length > 0);
    return stops.length ? stops.slice(0, 4) : undefined;
  }

  function requestBody() {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...history);
    const body = { messages, stream: true, stream_options: { include_usage: true } };
    if (model) body.model = model;
    const t = parseFloat($("temperature").value);
    if (!Number.isNaN(t)) body.temperature = t;
    const n = parseInt($("maxtokens").value, 10);
    if (!Number.isNaN(n)) body.max_tokens = n;
    const stop = stopStrings();
    if (stop) body.stop = stop;
    return body;
  }

  function cachedText(usage) {
    const d = usage.prompt_tokens_details || {};
    return "cached " + (d.cached_tokens || 0) + " of " + usage.prompt_tokens
      + " prompt tokens (memory " + (usage.cached_tokens_memory || 0)
      + ", disk " + (usage.cached_tokens_disk || 0) + ") · "
      + usage.completion_tokens + " generated";
  }

  function setStreaming(on) {
    $("send").disabled = on;
    $("stop").disabled = !on;
  }

  async function send() {
    const text = $("prompt").value;
    if (!text.trim() || controller) return;
    $("prompt").value = "";
    history.push({ role: "user", content: text });
    addMessage("user", text);
    const view = addMessage("assistant", "");
    view.box.dataset.state = "streaming";
    let answer = "";
    let pending = false;
    const draw = () => {
      pending = false;
      renderAnswer(view, answer);
    };
    controller = new AbortController();
    setStreaming(true);
    let outcome = "done";
    try {
      const resp = await fetch("/v1/chat/completions", {
        method: "POST", headers: headers(), body: JSON.stringify(requestBody()),
        signal: controller.signal,
      });
      if (!resp.ok) {
        if (resp.status === 401) askForKey(apiKey ? "wrong key" : "");
        throw new Error(await errorText(resp));
      }
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data: ")) continue;
            const data = line.slice(6);
            if (data === "[DONE]") continue;
            const obj = JSON.parse(data);
            if (obj.error) throw new Error(obj.error.message || "the stream failed");
            const choice = obj.choices && obj.choices[0];
            if (choice && choice.delta && choice.delta.content) {
              answer += choice.delta.content;
              if (!pending) {
                pending = true;
                requestAnimationFrame(draw);
              }
            }
            if (choice && choice.finish_reason) view.box.dataset.finish = choice.finish_reason;
            if (obj.usage) {
              view.meta.textContent = cachedText(obj.usage);
              view.meta.classList.add("cached");
              view.box.dataset.cached = String(obj.usage.prompt_tokens_details.cached_tokens);
            }
          }
        }
      }
    } catch (err) {
      if (err.name === "AbortError") {
        outcome = "stopped";
        view.meta.textContent = "stopped";
      } else {
        outcome = "error";
        const e = document.createElement("div");
        e.className = "error";
        e.textContent = String(err.message || err);
        view.box.appendChild(e);
      }
    } finally {
      renderAnswer(view, answer);
      view.box.dataset.state = outcome;
      controller = null;
      setStreaming(false);
      if (answer) history.push({ role: "assistant", content: answer });
    }
  }

  function stop() {
    if (controller) controller.abort();  // the server sees the disconnect and aborts
  }

  function newChat() {
    stop();
    history = [];
    $("messages").replaceChildren();
    $("prompt").focus();
  }

  // -- the state -----------------------------------------------------------------------

  function bytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) {
      n /= 1024;
      i++;
    }
    return (i ? n.toFixed(1) : String(n)) + " " + units[i];
  }

  function pct(x) {
    return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%";
  }

  function cell(row, value, cls) {
    const td = document.createElement("td");
    td.textContent = value;
    if (cls) td.className = cls;
    row.appendChild(td);
    return td;
  }

  function showRanks(s) {
    const rows = s.ranks.map((r) => {
      const tr = document.createElement("tr");
      tr.className = "rank";
      tr.dataset.rank = String(r.rank);
      tr.dataset.alive = String(r.alive);
      cell(tr, String(r.rank));
      cell(tr, String(r.host));
      cell(tr, r.alive ? "alive" : "dead", "status " + (r.alive ? "alive" : "dead"));
      cell(tr, bytes(r.weight_bytes));
      cell(tr, bytes(r.kv_cache_bytes));
      cell(tr, bytes(r.resident_bytes));
      cell(tr, r.disk_records === null ? "–" : r.disk_records + " rec, " + bytes(r.disk_bytes));
      return tr;
    });
    $("ranks").tBodies[0].replaceChildren(...rows);
  }

  function showTier(id, occupancy, rate, now, hits) {
    const row = $(id);
    row.querySelector(".occ").textContent = occupancy;
    row.querySelector(".rate").textContent = pct(rate);
    row.querySelector(".now").textContent = pct(now);
    row.querySelector(".hits").textContent = hits === null ? "–" : String(hits);
  }

  function showState(s) {
    model = s.model;
    $("model").textContent = s.model;
    $("shape").textContent = "TP " + s.tensor_parallel_size + " · " + s.hosts
      + (s.hosts === 1 ? " host" : " hosts");
    const h = $("health");
    h.textContent = s.health.ok ? "serving" : "down: " + s.health.reason;
    h.className = "pill " + (s.health.ok ? "ok" : "bad");
    showRanks(s);
    const m = s.memory_tier;
    const d = s.disk_tier;
    showTier("tier-memory", pct(m.usage) + " of KV pages", m.hit_rate, s.rates.hit_rate_memory,
      m.hit_tokens);
    showTier("tier-disk", d.enabled ? d.records_per_rank + (d.records_per_rank === 1 ? " record, " : " records, ") + bytes(d.bytes_per_rank)
      + " of " + bytes(d.capacity_bytes_per_rank) + " per rank" : "off", d.hit_rate,
      s.rates.hit_rate_disk, d.hit_tokens);
    $("running").textContent = String(s.requests.running);
    $("waiting").textContent = String(s.requests.waiting);
    $("finished").textContent = String(s.requests.finished);
    const tps = s.rates.tokens_per_s;
    $("tps").textContent = tps === null ? "–" : tps.toFixed(1);
    $("restarts").textContent = String(s.restarts);
    const hm = s.rates.hit_rate_memory;
    const hd = s.rates.hit_rate_disk;
    samples.push({ t: Date.now() / 1000, tps: tps, hit: hm === null ? null : hm + (hd || 0) });
    const oldest = Date.now() / 1000 - PLOT_S;
    while (samples.length && samples[0].t < oldest) samples.shift();
    plot();
  }

  function svgEl(tag, attrs, parent) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    if (parent) parent.appendChild(node);
    return node;
  }

  // Two series over the last PLOT_S seconds: tokens/s (scaled to its maximum) and the
  // prefix hit rate (0..1); a sample without a value breaks its line.
  function plot() {
    const W = 600, H = 160, L = 36, R = 36, T = 8, B = 18;
    const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, role: "img",
      "aria-label": "tokens per second and hit rate over the last minutes" });
    const now = Date.now() / 1000;
    const x = (t) => L + (W - L - R) * (1 - (now - t) / PLOT_S);
    const maxTps = Math.max(1, ...samples.map((s) => s.tps || 0));
    const yTps = (v) => T + (H - T - B) * (1 - v / maxTps);
    const yHit = (v) => T + (H - T - B) * (1 - v);
    svgEl("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }, svg);
    svgEl("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" }, svg);
    svgEl("line", { x1: W - R, y1: T, x2: W - R, y2: H - B, class: "axis" }, svg);
    const label = (x0, y0, s, anchor) => {
      const t = svgEl("text", { x: x0, y: y0, "text-anchor": anchor }, svg);
      t.textContent = s;
    };
    label(L - 3, T + 8, maxTps.toFixed(0), "end");
    label(L - 3, H - B, "0", "end");
    label(W - R + 3, T + 8, "100%", "start");
    label(W - R + 3, H - B, "0%", "start");
    label(L, H - 4, "-" + PLOT_S / 60 + " min", "start");
    label(W - R, H - 4, "now", "end");
    for (const [key, y, cls] of [["tps", yTps, "tps"], ["hit", yHit, "hit"]]) {
      let run = [];
      const flush = () => {
        if (run.length > 1) svgEl("polyline", { points: run.join(" "), class: cls }, svg);
        run = [];
      };
      for (const s of samples) {
        if (s[key] === null || s[key] === undefined) flush();
        else run.push(x(s.t).toFixed(1) + "," + y(s[key]).toFixed(1));
      }
      flush();
    }
    $("plotbox").replaceChildren(svg);
  }

  async function poll() {
    try {
      const resp = await fetch("/state", { cache: "no-store" });
      if (!resp.ok) throw new Error(await errorText(resp));
      showState(await resp.json());
      $("stateerror").textContent = "";
    } catch (err) {
      $("stateerror").textContent = "state unavailable: " + String(err.message || err);
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }

  // -- wiring --------------------------------------------------------------------------

  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (ev) => {
    if (ev.key === "Escape") stop();
  });
  $("send").addEventListener("click", send);
  $("stop").addEventListener("click", stop);
  $("newchat").addEventListener("click", newChat);
  $("keyform").addEventListener("submit", (ev) => {
    ev.preventDefault();
    apiKey = $("apikey").value.trim() || null;
    checkKey().then((ok) => { if (ok) $("prompt").focus(); });
  });
  checkKey();
  poll();
})();
