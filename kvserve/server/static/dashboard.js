// kvserve's live dashboard: polls kvserve/stats once a second, turns successive snapshots into rates,
// and draws them; a recent request's trip comes from kvserve/stats/requests/{id}. No build step.
"use strict";

const POLL_MS = 1000;
const HISTORY = 300; // points kept per chart: five minutes at one a second
const $ = (id) => document.getElementById(id);

const fmt = (v, digits = 0) => (v === null || v === undefined || Number.isNaN(v)) ? "–"
  : Number(v).toLocaleString(undefined, { maximumFractionDigits: digits, minimumFractionDigits: digits });
const pct = (part, whole) => whole > 0 ? 100 * part / whole : null;

// --- charts -------------------------------------------------------------------------------------------
// series: [label, colour, scale?]; a second scale gets its own axis on the right.
function makeChart(id, series) {
  const el = $(id);
  const data = [[], ...series.map(() => [])];
  const scales = [...new Set(series.map(([, , scale]) => scale || "y"))];
  const opts = {
    width: Math.max(320, el.clientWidth || 430), height: 170,
    scales: { x: { time: true } },
    series: [{}, ...series.map(([label, stroke, scale]) => ({ label, stroke, scale: scale || "y", width: 1.5,
      spanGaps: true, points: { show: false } }))],
    cursor: { show: false },
    axes: [{}, ...scales.map((scale, i) => ({ scale, size: 50, side: i === 0 ? 3 : 1, grid: { show: i === 0 } }))],
    legend: { live: false },
  };
  return { plot: new uPlot(opts, data, el), data };
}

const charts = {
  batch: makeChart("chart-batch", [["prefill tokens", "#d8843b"], ["decode rows", "#3b6fd8"], ["draft tokens", "#8a4fd0"]]),
  latency: makeChart("chart-latency", [["TTFT p50", "#3b6fd8"], ["TTFT p99", "#9bb5ec"], ["TPOT p50", "#2c9a52"], ["ITL p99", "#d8843b"]]),
  tokens: makeChart("chart-tokens", [["prompt tok/s", "#d8843b"], ["output tok/s", "#3b6fd8"]]),
  compute: makeChart("chart-compute", [["GFLOP/s (left)", "#d8843b", "flops"], ["GB/s (right)", "#3b6fd8", "bytes"]]),
  hits: makeChart("chart-hits", [["prompt tokens cached %", "#2c9a52"], ["prefix blocks hit %", "#3b6fd8"], ["drafts accepted %", "#8a4fd0"]]),
};

function clearCharts() {
  snaps.length = 0;
  for (const chart of Object.values(charts)) {
    chart.data.forEach((column) => column.splice(0));
    chart.plot.setData(chart.data);
  }
}

function push(chart, t, values) {
  chart.data[0].push(t);
  values.forEach((v, i) => chart.data[i + 1].push(v === undefined ? null : v));
  if (chart.data[0].length > HISTORY) chart.data.forEach((column) => column.shift());
  chart.plot.setData(chart.data);
}

// --- one snapshot -------------------------------------------------------------------------------------

function rate(now, before, pick) {
  if (!before) return null;
  const dt = now.time - before.time;
  return dt > 0 ? (pick(now) - pick(before)) / dt : null;
}

function ratio(now, before, part, whole) {
  if (!before) return null;
  const dw = whole(now) - whole(before);
  return dw > 0 ? 100 * (part(now) - part(before)) / dw : null;
}

// The snapshots of the last WINDOW_S seconds of what is shown (the server, or the gateway's replica
// picked). Per-poll rates use the one before the newest; requests finish, and bring their FLOPs, in bursts,
// so those rates use the oldest.
const WINDOW_S = 10;
const snaps = [];
function remember(s) {
  snaps.push(s);
  while (snaps.length > 2 && s.time - snaps[1].time >= WINDOW_S) snaps.shift();
  const n = snaps.length;
  return { previous: n > 1 ? snaps[n - 2] : null, start: n > 1 ? snaps[0] : null };
}

function render(s) {
  const { previous, start } = remember(s);
  $("model").textContent = s.model;
  $("uptime").textContent = `up ${fmt(s.uptime_s / 60, 1)} min`;
  setStatus(s.alive ? "live" : "dead", s.alive ? "live" : "engine stopped");
  $("queue-waiting").textContent = fmt(s.queue.waiting);
  $("queue-prefilling").textContent = fmt(s.queue.prefilling);
  $("queue-decoding").textContent = fmt(s.queue.decoding);
  $("finished-total").textContent = fmt(s.requests.finished);

  const r = s.requests;
  const hitPct = pct(r.cached_prompt_tokens, r.prompt_tokens);
  $("hit-rate").textContent = hitPct === null ? "–" : `${fmt(hitPct, 1)}%`;
  $("hit-detail").textContent = `${fmt(r.cached_prompt_tokens)} of ${fmt(r.prompt_tokens)} prompt tokens from cache`;

  const kv = s.kv.device;
  const total = Math.max(kv.total, 1);
  const bar = $("kv-bar").children;
  bar[0].style.width = `${100 * kv.used / total}%`;
  bar[1].style.width = `${100 * kv.cached / total}%`;
  bar[2].style.width = `${100 * kv.free / total}%`;
  $("kv-used").textContent = `${fmt(kv.used)} / ${fmt(kv.total)}`;
  $("kv-cached").textContent = fmt(kv.cached);
  $("kv-free").textContent = fmt(kv.free);
  $("kv-evicted").textContent = fmt(kv.evicted);
  $("preemptions").textContent = fmt(s.engine.preemptions);
  renderTiers(s.kv);

  const t = s.time;
  const prefillRate = rate(s, previous, (x) => x.engine.prompt_tokens_computed);
  const outRate = rate(s, previous, (x) => x.engine.generated_tokens);
  $("prefill-rate").textContent = `${fmt(prefillRate)} prompt tok/s`;
  $("decode-rate").textContent = `${fmt(outRate)} output tok/s`;
  $("finished-rate").textContent = `${fmt(rate(s, start, (x) => x.requests.finished), 2)} req/s`;

  if (previous) {
    const steps = s.engine.steps - previous.engine.steps;
    const perStep = (pick) => steps > 0 ? (pick(s) - pick(previous)) / steps : null;
    push(charts.batch, t, [
      perStep((x) => x.engine.prompt_tokens_computed),
      // each decode row samples one token beyond the drafts it accepted
      perStep((x) => x.engine.generated_tokens - x.speculative.accepted_tokens),
      perStep((x) => x.speculative.draft_tokens),
    ]);
    push(charts.tokens, t, [prefillRate, outRate]);
    push(charts.hits, t, [
      ratio(s, previous, (x) => x.requests.cached_prompt_tokens, (x) => x.requests.prompt_tokens),
      ratio(s, previous, (x) => x.kv.prefix_cache.hits, (x) => x.kv.prefix_cache.queries),
      ratio(s, previous, (x) => x.speculative.accepted_tokens, (x) => x.speculative.draft_tokens),
    ]);
  }
  renderCompute(s, start);
  const l = s.latency;
  push(charts.latency, t, [l.ttft_ms.p50, l.ttft_ms.p99, l.tpot_ms.p50, l.itl_ms.p99]);
  renderRecent(s.recent);
}

// Tables are rebuilt only when what they show changed: an open page should cost its browser little.
const shown = {};
function changed(key, value) {
  const text = JSON.stringify(value);
  if (shown[key] === text) return false;
  shown[key] = text;
  return true;
}

// FLOPs and KV bytes come with each finished request (the cost model of `kvserve bench`); weights are read
// once a step. Rates are over the wall-clock window since ``before``.
function renderCompute(s, before) {
  const c = s.compute;
  if (!c || !before) return;
  const dt = s.time - before.time;
  if (dt <= 0) return;
  const flops = (s.requests.flops - before.requests.flops) / dt;
  const bytes = ((s.engine.steps - before.engine.steps) * c.weight_bytes_per_step
    + s.requests.kv_bytes - before.requests.kv_bytes) / dt;
  push(charts.compute, s.time, [flops / 1e9, bytes / 1e9]);
  if (c.peak_flops && c.peak_bandwidth) {
    $("mfu").textContent = `MFU ${fmt(100 * flops / c.peak_flops, 2)}%`;
    $("compute-detail").textContent = `MBU ${fmt(100 * bytes / c.peak_bandwidth, 2)}% of ${c.hardware}`;
  } else {
    $("mfu").textContent = `${fmt(flops / 1e9, 1)} GFLOP/s`;
    $("compute-detail").textContent = `${fmt(bytes / 1e9, 2)} GB/s; MFU and MBU with --hardware`;
  }
}

function renderTiers(kv) {
  if (!changed("tiers", [kv.tiers, kv.cached_tokens_by_tier])) return;
  const body = $("tiers").tBodies[0];
  const rows = [["device", null, null, null, kv.cached_tokens_by_tier.device || 0, "ok"]];
  for (const [name, tier] of Object.entries(kv.tiers)) {
    rows.push([name, tier.entries, tier.bytes_held === null ? null : tier.bytes_held / 2 ** 20,
      pct(tier.hits, tier.hits + tier.misses), kv.cached_tokens_by_tier[name] || 0,
      tier.healthy ? "ok" : "unreachable"]);
  }
  body.innerHTML = "";
  for (const [name, entries, mib, hit, served, state] of rows) {
    const tr = body.insertRow();
    tr.dataset.tier = name;
    for (const text of [name, fmt(entries), fmt(mib, 1), hit === null ? "–" : `${fmt(hit, 1)}%`, fmt(served), state]) {
      tr.insertCell().textContent = text;
    }
  }
}

let selected = null;

function renderRecent(recent) {
  if (!changed("recent", [recent, selected])) return;
  const body = $("recent").tBodies[0];
  body.innerHTML = "";
  for (const r of recent) {
    const tr = body.insertRow();
    tr.dataset.id = r.id;
    if (r.id === selected) tr.classList.add("selected");
    for (const text of [r.id, r.finish_reason, fmt(r.prompt_tokens), fmt(r.cached_tokens), fmt(r.output_tokens),
      fmt(r.ttft_ms, 1), fmt(r.e2e_ms, 1)]) {
      tr.insertCell().textContent = text;
    }
    tr.addEventListener("click", () => showTrip(r.id));
  }
}

// --- a gateway: its replicas and routing, then one replica's panels -----------------------------------
let selectedReplica = null;

function renderGateway(g) {
  $("gateway").hidden = false;
  $("policy").textContent = `policy: ${g.policy}`;
  const body = $("replicas").tBodies[0];
  body.innerHTML = "";
  const sum = { finished: 0, cached: 0, prompt: 0 };
  for (const r of g.replicas) {
    const s = r.stats;
    if (s) {
      sum.finished += s.requests.finished;
      sum.cached += s.requests.cached_prompt_tokens;
      sum.prompt += s.requests.prompt_tokens;
    }
    const hit = s ? pct(s.requests.cached_prompt_tokens, s.requests.prompt_tokens) : null;
    const tr = body.insertRow();
    tr.dataset.replica = r.url;
    if (r.url === selectedReplica) tr.classList.add("selected");
    for (const text of [r.url, r.healthy ? "healthy" : `out: ${r.last_error}`, fmt(r.in_flight),
      s ? fmt(s.requests.finished) : "–", hit === null ? "–" : `${fmt(hit, 1)}%`,
      s ? `${fmt(s.kv.device.used)} / ${fmt(s.kv.device.total)}` : "–", s ? fmt(s.latency.ttft_ms.p50, 1) : "–",
      fmt(g.routing.requests[r.url] || 0)]) {
      tr.insertCell().textContent = text;
    }
    tr.addEventListener("click", () => { selectedReplica = r.url; clearCharts(); });
  }
  const all = body.insertRow();
  all.dataset.replica = "all";
  const hit = pct(sum.cached, sum.prompt);
  for (const text of ["all replicas", "", "", fmt(sum.finished), hit === null ? "–" : `${fmt(hit, 1)}%`, "", "", ""]) {
    all.insertCell().textContent = text;
  }
  const decisions = $("decisions").tBodies[0];
  decisions.innerHTML = "";
  for (const [reason, count] of Object.entries(g.routing.decisions)) {
    const tr = decisions.insertRow();
    tr.insertCell().textContent = reason;
    tr.insertCell().textContent = fmt(count);
  }
  const chosen = g.replicas.find((r) => r.url === selectedReplica && r.stats) || g.replicas.find((r) => r.stats);
  if (!chosen) {
    setStatus("unreachable", "no replica answers");
    return;
  }
  if (chosen.url !== selectedReplica) clearCharts();
  selectedReplica = chosen.url;
  render(chosen.stats);
  $("model").textContent = `${chosen.stats.model} · gateway (${g.policy}) · ${chosen.url}`;
}

// --- one request's trip -------------------------------------------------------------------------------
function stagesOf(trip) {
  // The stages kvserve trace prints, on the server's clock from the moment the HTTP request arrived.
  const n = (v) => (v === null || v === undefined) ? 0 : Number(v);
  const tokenize = n(trip.received_to_queued_ms);
  const scheduled = tokenize + n(trip.queued_ms);
  const first = tokenize + n(trip.first_token_ms);
  const finished = tokenize + n(trip.finished_ms);
  const lastToken = first + n(trip.decode.ms);
  const lookup = trip.cache_lookup;
  const tiers = Object.entries(lookup.cached_tokens_by_tier || {}).map(([k, v]) => `${k}: ${v}`).join(", ");
  return [
    ["tokenize", 0, tokenize, "validate, template, tokenize"],
    ["queue", tokenize, n(trip.queued_ms), "waiting for a slot in the batch"],
    ["cache lookup", scheduled, 0, `${lookup.cached_tokens}/${lookup.prompt_tokens} prompt tokens found${tiers ? ` (${tiers})` : ""}`],
    ["prefill", scheduled, n(trip.prefill.ms), `${trip.prefill.tokens_computed} tokens in ${trip.prefill.chunks} chunk(s)`],
    ["first token", first, 0, `TTFT ${fmt(first, 1)} ms (server)`],
    ["decode", first, n(trip.decode.ms), `${trip.decode.tokens} tokens in ${trip.decode.steps} steps`],
    ["finish", lastToken, Math.max(finished - lastToken, 0), `finish: ${trip.finish_reason}` +
      (trip.preemptions ? `, preempted ${trip.preemptions}×` : "")],
  ];
}

const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs, text) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

function drawTrip(trip) {
  const stages = stagesOf(trip);
  const total = Math.max(...stages.map(([, start, length]) => start + length), 1);
  const width = 1000, left = 110, right = 400, row = 24;
  const x = (ms) => left + (width - left - right) * ms / total;
  const root = svg("svg", { viewBox: `0 0 ${width} ${row * (stages.length + 1) + 10}`, role: "img" });
  stages.forEach(([label, start, length, detail], i) => {
    const y = 8 + i * row;
    const g = svg("g", { class: "stage", "data-stage": label });
    g.appendChild(svg("text", { x: 0, y: y + 14, class: "label" }, label));
    if (length > 0) {
      g.appendChild(svg("rect", { x: x(start), y, width: Math.max(2, x(start + length) - x(start)), height: 18, fill: "#3b6fd8", rx: 2 }));
    } else {
      g.appendChild(svg("path", { d: `M${x(start)} ${y + 1} l7 8 l-7 8 l-7 -8 z`, fill: "#d8843b" }));
    }
    g.appendChild(svg("text", { x: width - right + 10, y: y + 14, class: "detail" }, `${fmt(length, 1)} ms · ${detail}`));
    root.appendChild(g);
    if (label === "prefill") {
      for (const chunk of trip.prefill_chunks || []) {
        root.appendChild(svg("line", { x1: x(chunk.end_ms), x2: x(chunk.end_ms), y1: y, y2: y + 18, stroke: "#fff", class: "chunk" }));
      }
    }
    if (label === "decode") {
      for (const t of trip.decode_steps_ms || []) {
        root.appendChild(svg("line", { x1: x(t), x2: x(t), y1: y + 18, y2: y + 22, stroke: "#1d2330", class: "step" }));
      }
    }
  });
  for (const t of trip.preemptions_ms || []) {
    root.appendChild(svg("line", { x1: x(t), x2: x(t), y1: 4, y2: row * stages.length + 6, stroke: "#c0392b", "stroke-dasharray": "3 3", class: "preemption" }));
  }
  const axisY = 8 + stages.length * row + 10;
  root.appendChild(svg("text", { x: left, y: axisY, class: "detail" }, "0"));
  root.appendChild(svg("text", { x: width - right, y: axisY, class: "detail", "text-anchor": "end" }, `${fmt(total, 1)} ms`));
  const box = $("timeline");
  box.innerHTML = "";
  const title = document.createElement("h2");
  title.textContent = `trip of ${trip.id}` + (trip.replica ? ` on ${trip.replica}` : "");
  box.append(title, root);
}

async function showTrip(id) {
  selected = id;
  const box = $("timeline");
  try {
    const response = await fetch(`kvserve/stats/requests/${encodeURIComponent(id)}`, { cache: "no-store" });
    if (!response.ok) {
      box.textContent = (await response.json()).error?.message || `HTTP ${response.status}`;
      return;
    }
    drawTrip(await response.json());
  } catch (error) {
    box.textContent = `could not load the trip: ${error}`;
  }
}

$("trip-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const id = $("trip-id").value.trim();
  if (id) showTrip(id);
});

// --- polling ------------------------------------------------------------------------------------------
function setStatus(cls, text) {
  const el = $("status");
  el.className = `status ${cls}`;
  el.textContent = text;
}

async function poll() {
  try {
    const response = await fetch("kvserve/stats", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const snapshot = await response.json();
    if (snapshot.gateway) renderGateway(snapshot); else render(snapshot);
  } catch (error) {
    setStatus("unreachable", "server unreachable: retrying");
    snaps.length = 0; // rates restart from the next snapshot (counters start again if the server restarted)
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

window.addEventListener("resize", () => {
  for (const chart of Object.values(charts)) {
    const el = chart.plot.root.parentElement;
    chart.plot.setSize({ width: Math.max(320, el.clientWidth), height: 170 });
  }
});
poll();
