// The Conveyor dashboard: polls dashboard/data once a second and draws it (uPlot charts, a canvas KV map).
"use strict";

const POLL_MS = 1000;
const WIDTH = 500;
const HEIGHT = 180;
const COLORS = { prefill: "#e8833a", decode: "#3a78e8", p50: "#2a9d8f", p99: "#d62828", ttft: "#8338ec",
                 free: "#e6e6e6", shared: "#111" };

// what the verdict panel lists when nothing limits the server (the doctor's window)
const WINDOW_SHOWN = ["steps_per_second", "busy_fraction", "running_mean", "waiting_mean", "kv_usage_max", "mfu",
                      "mbu", "itl_p50_s", "itl_p99_s", "host_fraction"];

const state = { polls: 0, key: "", charts: {}, last: null };
window.conveyor = state;  // read by tests and by curious users in the console

const hashKey = new URLSearchParams(location.hash.slice(1)).get("key");
state.key = hashKey || sessionStorage.getItem("conveyor-key") || "";
if (hashKey) history.replaceState(null, "", location.pathname);  // the key leaves the address bar

function chart(id, series, opts = {}) {
  const options = {
    width: WIDTH, height: HEIGHT, legend: { live: false },
    scales: { x: { time: opts.time !== false }, y: opts.y || {} },
    axes: [{}, { size: 56 }, ...(opts.axes || [])],
    series: [{}, ...series],
  };
  const plot = new uPlot(options, [[], ...series.map(() => [])], document.getElementById(id));
  state.charts[id.replace("chart-", "")] = plot;
  return plot;
}

const bars = uPlot.paths.bars({ size: [0.9, 8] });
chart("chart-batch", [
  { label: "prompt tokens (on top)", stroke: COLORS.prefill, fill: COLORS.prefill, paths: bars },
  { label: "decode tokens", stroke: COLORS.decode, fill: COLORS.decode, paths: bars },
], { time: false, y: { range: (u, min, max) => [0, Math.max(1, max)] } });
chart("chart-queue", [
  { label: "running", stroke: COLORS.decode, width: 2 },
  { label: "waiting", stroke: COLORS.prefill, width: 2 },
]);
chart("chart-latency", [
  { label: "TTFT p50", stroke: COLORS.ttft, dash: [4, 4] },
  { label: "TTFT p99", stroke: COLORS.ttft },
  { label: "ITL p50", stroke: COLORS.p50 },
  { label: "ITL p99", stroke: COLORS.p99 },
], { y: { distr: 3 } });
chart("chart-utilization", [
  { label: "MFU", stroke: COLORS.prefill, width: 2 },
  { label: "MBU", stroke: COLORS.decode, width: 2 },
  { label: "KV usage", stroke: "#555", dash: [4, 4] },
], { y: { range: [0, 1] } });
chart("chart-throughput", [
  { label: "output tok/s", stroke: COLORS.p50, width: 2, fill: "#2a9d8f22" },
  { label: "requests/s within the latency targets", stroke: COLORS.ttft, width: 2, scale: "requests" },
], { axes: [{ scale: "requests", side: 1, size: 40, grid: { show: false } }] });

function drawSteps(steps) {
  const total = steps.prefill_tokens.map((p, i) => p + steps.decode_tokens[i]);
  state.charts.batch.setData([steps.step, total, steps.decode_tokens]);
  const n = steps.step.length;
  document.getElementById("batch-note").textContent = n === 0 ? "no step yet" :
    `step ${steps.step[n - 1]}: ${steps.prefill_seqs[n - 1]} prompt chunks (${steps.prefill_tokens[n - 1]} tokens), ` +
    `${steps.decode_seqs[n - 1]} decodes, ${steps.step_ms[n - 1].toFixed(1)} ms`;
}

function drawSeries(s) {
  state.charts.queue.setData([s.t, s.running, s.waiting]);
  state.charts.latency.setData([s.t, s.ttft_p50_ms, s.ttft_p99_ms, s.itl_p50_ms, s.itl_p99_ms]);
  state.charts.utilization.setData([s.t, s.mfu, s.mbu, s.kv_usage]);
  state.charts.throughput.setData([s.t, s.output_tokens_per_s, s.requests_within_slo_per_s]);
}

function drawQueue(queue) {
  document.getElementById("queue-note").textContent = queue.count === 0 ? "every request has its first token" :
    `${queue.count} without a first token yet (waiting or in prefill); the oldest:`;
  document.getElementById("queue").replaceChildren(...queue.oldest.map(([id, age, tokens]) => {
    const row = document.createElement("tr");
    row.innerHTML = "<td></td><td></td><td></td>";
    row.cells[0].textContent = id;
    row.cells[1].textContent = `${age.toFixed(1)} s`;
    row.cells[2].textContent = `${tokens} prompt tokens`;
    return row;
  }));
}

function hue(text) {
  let h = 0;
  for (const c of text) h = (h * 31 + c.charCodeAt(0)) >>> 0;
  return (h * 137.508) % 360;
}

// One replica's blocks: a cell per block, coloured by the request holding it; a block that several requests
// hold (a shared prefix) is black with a white dot; free blocks grey.
function drawKV(panel, replica, index) {
  const n = replica.num_blocks;
  const owners = new Array(n).fill(null);
  const holders = new Uint16Array(n);
  for (const owner of replica.owners) {
    for (const [first, count] of owner.blocks) {
      for (let b = first; b < first + count; b++) { owners[b] = owner.request_id; holders[b]++; }
    }
  }
  const width = 1040;
  const cell = Math.max(2, Math.min(12, Math.floor(Math.sqrt((width * 220) / Math.max(n, 1)))));
  const cols = Math.floor(width / cell);
  const canvas = panel.querySelector("canvas");
  canvas.width = cols * cell;
  canvas.height = Math.ceil(n / cols) * cell;
  const ctx = canvas.getContext("2d");
  let used = 0, shared = 0;
  for (let b = 0; b < n; b++) {
    const x = (b % cols) * cell, y = Math.floor(b / cols) * cell;
    if (holders[b] > 1) { ctx.fillStyle = COLORS.shared; shared++; used++; }
    else if (owners[b] !== null) { ctx.fillStyle = `hsl(${hue(owners[b])}, 65%, 55%)`; used++; }
    else ctx.fillStyle = COLORS.free;
    ctx.fillRect(x, y, cell - (cell > 3 ? 1 : 0), cell - (cell > 3 ? 1 : 0));
    if (holders[b] > 1 && cell >= 6) {
      ctx.fillStyle = "#fff";
      ctx.fillRect(x + cell / 2 - 1, y + cell / 2 - 1, 2, 2);
    }
  }
  panel.querySelector("h2").textContent = `KV cache${index === null ? "" : ` (replica ${index})`}: ` +
    `${n} blocks of ${replica.block_size} tokens`;
  panel.querySelector(".note").textContent =
    `${replica.owners.length} running requests hold ${used} blocks (${shared} shared prefix blocks, in black); ` +
    `${replica.num_free_blocks} free or cached; ${replica.waiting} waiting; ` +
    `${replica.preemptions} preemptions so far`;
  state.kvUsedBlocks = used;
  state.kvSharedBlocks = shared;
}

function drawReplicas(replicas) {
  const root = document.getElementById("kv");
  replicas.forEach((replica, i) => {
    if (replica === null) return;
    let panel = document.getElementById(`kv-${i}`);
    if (panel === null) {
      panel = document.createElement("div");
      panel.className = "panel kv";
      panel.id = `kv-${i}`;
      panel.style.marginTop = "12px";
      panel.innerHTML = "<h2></h2><canvas></canvas><div class='note'></div>";
      root.appendChild(panel);
    }
    drawKV(panel, replica, replicas.length > 1 ? i : null);
  });
}

function drawVerdict(verdict) {
  const name = document.getElementById("verdict-name");
  const table = document.getElementById("verdict-evidence");
  if (verdict === null) { name.textContent = "collecting /metrics..."; return; }
  const top = verdict.findings[0];
  name.textContent = verdict.verdict.replaceAll("_", " ");
  document.getElementById("verdict-summary").textContent = top ? top.summary :
    `nothing in the checklist holds over the last ${verdict.seconds.toFixed(0)} s`;
  document.getElementById("verdict-change").textContent = top ? `change first: ${top.change} (${top.advice})` : "";
  const evidence = top ? top.evidence : Object.fromEntries(WINDOW_SHOWN.map((k) => [k, verdict.window[k]]));
  table.replaceChildren(...Object.entries(evidence).map(([k, v]) => {
    const row = document.createElement("tr");
    row.innerHTML = "<td></td><td></td>";
    row.cells[0].textContent = k;
    row.cells[1].textContent = Number.isInteger(v) ? v : Number(v).toPrecision(4);
    return row;
  }));
}

async function poll() {
  const headers = state.key ? { Authorization: `Bearer ${state.key}` } : {};
  let response;
  try {
    response = await fetch("dashboard/data", { headers });
  } catch (e) {
    document.getElementById("status").textContent = `cannot reach the server: ${e}`;
    return;
  }
  if (response.status === 401) {
    document.getElementById("key-form").style.display = "block";
    document.getElementById("status").textContent = "waiting for the API key";
    return;
  }
  let data;
  try {
    data = await response.json();
  } catch (e) {
    data = { error: { message: `not JSON (${e})` } };
  }
  if (!response.ok) {
    document.getElementById("status").textContent = `error ${response.status}: ${data.error?.message}`;
    return;
  }
  document.getElementById("key-form").style.display = "none";
  document.getElementById("model").textContent = data.model;
  document.getElementById("status").textContent =
    `${data.in_flight} requests in flight; updated ${new Date(data.time * 1000).toLocaleTimeString()}`;
  drawSteps(data.steps);
  drawSeries(data.series);
  drawReplicas(data.replicas);
  drawQueue(data.queue);
  drawVerdict(data.verdict);
  state.last = data;
  state.polls++;
}

document.getElementById("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  state.key = document.getElementById("key").value;
  sessionStorage.setItem("conveyor-key", state.key);
  poll();
});
poll();
setInterval(poll, POLL_MS);
