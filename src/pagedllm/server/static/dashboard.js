// The pagedllm KV-block dashboard. Polls dashboard/state (read on the engine thread at one step)
// and redraws: the block grid (one canvas cell per block, drawn through ImageData so 65,536
// blocks stay fast), per-state counts, usage and hit rate over time (a hand-drawn canvas chart),
// tokens/s and the running / waiting queues. The history behind the chart lives only here.
// A cluster's ingress (pagedllm serve --replicas N) answers with every replica's state; the page
// then shows a selector (each replica with its usage) and draws the chosen replica's pool.
"use strict";
(() => {
  // The one definition of the state colours; the legend swatches are painted from it.
  const NAMES = ["free", "cached", "used", "shared"];
  const COLORS = { free: "#e5e7eb", cached: "#93c5fd", used: "#1d4ed8", shared: "#ea580c" };
  const BACKGROUND = "#ffffff";
  const params = new URLSearchParams(location.search);
  const INTERVAL_MS = Math.max(50, Number(params.get("interval")) || 500);
  const HISTORY_S = 120;   // chart span
  const HIT_WINDOW_S = 5;  // hit rate over the last 5 s
  const RATE_WINDOW_S = 3; // tokens/s over the last 3 s
  const MAX_ROWS = 40;     // queue rows shown

  const $ = (id) => document.getElementById(id);
  const grid = $("grid"), gridCtx = grid.getContext("2d");
  const chart = $("chart"), tooltip = $("tooltip");
  const littleEndian = new Uint8Array(new Uint32Array([1]).buffer)[0] === 1;
  const pack = (hex) => {
    const [r, g, b] = [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
    return littleEndian ? ((255 << 24) | (b << 16) | (g << 8) | r) >>> 0 : ((r << 24) | (g << 16) | (b << 8) | 255) >>> 0;
  };
  const PACKED = NAMES.map((name) => pack(COLORS[name]));
  const PACKED_BACKGROUND = pack(BACKGROUND);

  let state = null;       // the latest dashboard/state (of the replica shown, in a cluster)
  let replica = params.get("replica");  // the replica shown, in a cluster
  let layout = null;      // grid geometry (CSS pixels) for state.num_blocks
  let image = null;       // ImageData the grid is drawn into
  let owner = null;       // block id -> index into ownerIds, -1 none, -2 several
  let ownerIds = [];
  let hovered = null;     // {index, x, y} under the mouse
  const history = [];     // {t, usage, hits, queries, gen, hitRate}

  document.querySelectorAll(".swatch").forEach((el) => { el.style.background = COLORS[el.dataset.state]; });

  function gridLayout(n) {
    const width = 640, area = 640 * 480;
    const cell = Math.max(2, Math.min(24, Math.floor(Math.sqrt(area / n))));
    const cols = Math.floor(width / cell);
    const rows = Math.ceil(n / cols);
    const scale = Math.max(1, Math.round(window.devicePixelRatio || 1));
    return { n, cell, cols, rows, gap: cell >= 6 ? 1 : 0, scale, width: cols * cell, height: rows * cell };
  }

  function drawGrid() {
    const L = layout, s = L.scale, W = L.width * s, H = L.height * s;
    if (grid.width !== W || grid.height !== H || !image) {
      grid.width = W; grid.height = H;
      grid.style.width = `${L.width}px`; grid.style.height = `${L.height}px`;
      Object.assign(grid.dataset, { cols: L.cols, cell: L.cell, gap: L.gap, scale: s });
      image = gridCtx.createImageData(W, H);
    }
    const px = new Uint32Array(image.data.buffer);
    px.fill(PACKED_BACKGROUND);
    const c = L.cell * s, inner = c - L.gap * s, states = state.states;
    for (let i = 0; i < L.n; i++) {
      const color = PACKED[states.charCodeAt(i) - 48];
      const x0 = (i % L.cols) * c, y0 = Math.floor(i / L.cols) * c;
      for (let y = y0; y < y0 + inner; y++) px.fill(color, y * W + x0, y * W + x0 + inner);
    }
    gridCtx.putImageData(image, 0, 0);
  }

  function buildOwners() {
    owner = new Int32Array(state.num_blocks).fill(-1);
    ownerIds = Object.keys(state.tables);
    ownerIds.forEach((rid, k) => {
      for (const b of state.tables[rid]) owner[b] = owner[b] === -1 ? k : -2;
    });
  }

  function describe(i) {
    const name = NAMES[state.states.charCodeAt(i) - 48];
    if (name === "used") return `block ${i}: used by ${ownerIds[owner[i]]} (ref 1)`;
    if (name === "shared") {
      const holders = ownerIds.filter((rid) => state.tables[rid].includes(i));
      const shown = holders.slice(0, 4).join(", ") + (holders.length > 4 ? ", …" : "");
      return `block ${i}: shared by ${holders.length} requests (ref ${holders.length}): ${shown}`;
    }
    if (name === "cached") return `block ${i}: cached (ref 0, holds a prefix-cache entry, evictable)`;
    return `block ${i}: free`;
  }

  function showTooltip() {
    if (!hovered || !state) { tooltip.hidden = true; return; }
    tooltip.textContent = describe(hovered.index);
    tooltip.style.left = `${grid.offsetLeft + hovered.x + 14}px`;
    tooltip.style.top = `${grid.offsetTop + hovered.y + 14}px`;
    tooltip.hidden = false;
  }

  grid.addEventListener("mousemove", (e) => {
    if (!layout) return;
    const r = grid.getBoundingClientRect(), x = e.clientX - r.left, y = e.clientY - r.top;
    const col = Math.floor(x / layout.cell), row = Math.floor(y / layout.cell), index = row * layout.cols + col;
    hovered = col >= 0 && col < layout.cols && row >= 0 && index < layout.n ? { index, x, y } : null;
    showTooltip();
  });
  grid.addEventListener("mouseleave", () => { hovered = null; showTooltip(); });

  function windowStart(seconds) {  // the oldest history entry within `seconds` of the newest
    const now = history[history.length - 1].t;
    let k = history.length - 1;
    while (k > 0 && history[k - 1].t >= now - seconds) k--;
    return history[k];
  }

  function record(s) {
    if (history.length && (s.time < history[history.length - 1].t || s.step < history[history.length - 1].step)) {
      history.length = 0;  // the server restarted
    }
    const entry = { t: s.time, step: s.step, usage: s.usage, hits: s.prefix_cache_hits,
                    queries: s.prefix_cache_queries, gen: s.generation_tokens, hitRate: null };
    history.push(entry);
    const first = windowStart(HIT_WINDOW_S);
    const dq = entry.queries - first.queries;
    entry.hitRate = dq > 0 ? (entry.hits - first.hits) / dq : null;
    while (history.length > 2 && history[0].t < s.time - HISTORY_S) history.shift();
  }

  function tokensPerSecond() {
    const last = history[history.length - 1], first = windowStart(RATE_WINDOW_S);
    return last.t > first.t ? (last.gen - first.gen) / (last.t - first.t) : null;
  }

  function drawChart() {
    const g = chart.getContext("2d"), W = chart.width, H = chart.height;
    const left = 36, right = 8, top = 8, bottom = 18, pw = W - left - right, ph = H - top - bottom;
    g.clearRect(0, 0, W, H);
    g.font = "11px system-ui, sans-serif";
    g.fillStyle = "#6e7781";
    g.strokeStyle = "#d0d7de";
    g.lineWidth = 1;
    for (const f of [0, 0.5, 1]) {
      const y = Math.round(top + ph * (1 - f)) + 0.5;
      g.beginPath(); g.moveTo(left, y); g.lineTo(W - right, y); g.stroke();
      g.fillText(`${f * 100}%`, 2, y + 4);
    }
    const now = history[history.length - 1].t, span = Math.max(1, Math.min(HISTORY_S, now - history[0].t));
    g.fillText(`-${Math.round(span)} s`, left, H - 4);
    g.fillText("now", W - right - 22, H - 4);
    $("chart-span").textContent = `${Math.round(span)} s`;
    const x = (t) => left + pw * (1 - (now - t) / span);
    const y = (v) => top + ph * (1 - v);
    const line = (key, color) => {
      g.strokeStyle = color; g.lineWidth = 2; g.beginPath();
      let pen = false;
      for (const h of history) {
        const v = h[key];
        if (v === null) { pen = false; continue; }
        if (pen) g.lineTo(x(h.t), y(v)); else g.moveTo(x(h.t), y(v));
        pen = true;
      }
      g.stroke();
    };
    line("usage", "#1d4ed8");
    line("hitRate", "#16a34a");
  }

  function fillQueue(id, rows) {
    const body = $(id).tBodies[0];
    const trs = rows.slice(0, MAX_ROWS).map((r) => {
      const tr = document.createElement("tr");
      const pct = r.total ? Math.min(100, (100 * r.computed) / r.total) : 0;
      tr.innerHTML = "<td class=id></td><td></td><td class=bar><div><span></span></div></td>";
      tr.cells[0].textContent = r.id;
      tr.cells[0].title = `${r.id} (${r.status})`;
      tr.cells[1].textContent = `${r.computed} / ${r.tokens} / ${r.total}`;
      tr.querySelector(".bar span").style.width = `${pct}%`;
      return tr;
    });
    if (rows.length > MAX_ROWS) {
      const tr = document.createElement("tr");
      tr.className = "more";
      tr.innerHTML = "<td colspan=3></td>";
      tr.cells[0].textContent = `… and ${rows.length - MAX_ROWS} more`;
      trs.push(tr);
    }
    body.replaceChildren(...trs);
  }

  function setCount(id, value) {
    const el = $(id);
    el.dataset.value = value;
    el.textContent = value.toLocaleString("en-US");
  }

  function percent(v) {
    if (v === null || Number.isNaN(v)) return "–";
    return v > 0 && v < 0.001 ? "<0.1%" : `${(100 * v).toFixed(1)}%`;
  }

  function update(s) {
    state = s;
    if (!layout || layout.n !== s.num_blocks) { layout = gridLayout(s.num_blocks); image = null; }
    buildOwners();
    drawGrid();
    for (const name of NAMES) setCount(`count-${name}`, s.counts[name]);
    setCount("count-hashed", s.counts.hashed);
    $("pool-info").textContent = `${s.num_blocks.toLocaleString("en-US")} blocks × ${s.block_size} tokens, ${s.layout}`;
    record(s);
    $("usage").textContent = percent(s.usage);
    $("hit-rate").textContent = s.prefix_cache_queries ? percent(s.prefix_cache_hits / s.prefix_cache_queries) : "–";
    const rate = tokensPerSecond();
    $("tokens-per-s").textContent = rate === null ? "–" : rate.toFixed(1);
    $("generation-tokens").textContent = Math.round(s.generation_tokens).toLocaleString("en-US");
    drawChart();
    setCount("num-running", s.running.length);
    setCount("num-waiting", s.waiting.length);
    fillQueue("running", s.running);
    fillQueue("waiting", s.waiting);
    showTooltip();
    const step = $("step");
    step.dataset.step = s.step;
    step.textContent = `step ${s.step.toLocaleString("en-US")}`;
  }

  function setStatus(text, error) {
    const el = $("status");
    el.textContent = text;
    el.classList.toggle("error", error);
  }

  // With --api-key the state needs the key: the page reads it from its URL's fragment
  // (/dashboard#key=KEY), which the browser never sends to the server or puts in its logs.
  function authHeaders() {
    const key = new URLSearchParams(location.hash.slice(1)).get("key");
    return key ? { Authorization: `Bearer ${key}` } : {};
  }

  // A cluster's answer ({replicas: [...]}) -> the state of the replica shown, the selector kept current.
  function pick(data) {
    if (!data.replicas) return data;
    const select = $("replica");
    $("replicas").hidden = false;
    if (!data.replicas.length) throw new Error("no replica has reported yet");
    if (!data.replicas.some((r) => r.replica === replica)) replica = data.replicas[0].replica;
    select.replaceChildren(...data.replicas.map((r) => {
      const option = document.createElement("option");
      option.value = r.replica;
      option.textContent = `${r.replica} · ${percent(r.usage)} used · ${r.running.length} running`;
      option.selected = r.replica === replica;
      return option;
    }));
    $("replica-count").textContent = `${data.replicas.length} replicas, ${data.routing} routing`;
    return data.replicas.find((r) => r.replica === replica);
  }

  $("replica").addEventListener("change", (e) => {
    replica = e.target.value;
    history.length = 0;  // another replica's history
    state = null;        // until its first poll
    layout = null;
  });

  async function poll() {
    try {
      const r = await fetch("dashboard/state", { cache: "no-store", headers: authHeaders() });
      if (r.status === 401) throw new Error("this server needs its API key: open /dashboard#key=KEY");
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      update(pick(await r.json()));
      setStatus(`live, every ${INTERVAL_MS} ms`, false);
    } catch (e) {
      setStatus(`disconnected (${e.message}); retrying`, true);
    } finally {
      setTimeout(poll, INTERVAL_MS);
    }
  }

  window.pagedllmDashboard = { colors: COLORS, get state() { return state; }, get layout() { return layout; } };
  poll();
})();
