// Shoal dashboard: plain JavaScript, no build step, no framework.
// Polls the router every 2 s with the admin key; server text only ever reaches the page
// through textContent / text nodes (see el()), never through innerHTML.
import { drawChart } from "./chart.js";

const POLL_MS = 2000;
const WINDOW_S = 300;                 // the chart shows the last five minutes
const ABSENT_RETRY_MS = 30000;        // ask again this late for an endpoint that answered 404
const KEY_STORE = "shoal.adminKey";
const INFERENCE_ROUTE = /completions|embeddings|chat/;
const WORKER_COLORS = ["#0f766e", "#7c3aed", "#ea580c", "#2563eb", "#db2777", "#65a30d",
  "#0891b2", "#a16207"];

const state = {
  key: null,            // the admin key; "" on an open router (no keys: none is sent)
  timer: null,
  loop: 0,              // which sign-in the polling loop belongs to
  history: [],          // {t, rps, tps}: one point per poll
  prev: null,           // the previous poll's counters
  modelRates: {},       // model name -> generated tokens/s
  keyQueue: {},         // API key id -> its requests waiting in this router's queues
  metrics: "pending",   // "ok" | "missing" | an error message
  skipUntil: {},        // optional endpoint path -> Date.now() before which it is not asked
  colors: new Map(),    // worker id -> layer map colour
  chat: { messages: [], controller: null },
};

// ------------------------------------------------------------------ small helpers

const $ = (selector) => document.querySelector(selector);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined) continue;
    if (name === "text") node.textContent = value;
    else if (name === "class") node.className = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) if (child !== null && child !== undefined) node.append(child);
  return node;
}

function formatBytes(n) {
  if (!Number.isFinite(n)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i && n < 10 ? 1 : 0)} ${units[i]}`;
}

function formatRate(n) {
  if (!Number.isFinite(n)) return "–";
  return n >= 100 ? n.toFixed(0) : n >= 10 ? n.toFixed(1) : n.toFixed(2);
}

// Replace a panel's content, or say why it is empty.
function show(box, nodes, emptyText) {
  box.replaceChildren(...(nodes.length ? nodes : [el("p", { class: "empty", text: emptyText })]));
}

function statePill(value) {
  return el("span", { class: `pill state-${value}`, text: value });
}

// ------------------------------------------------------------------ the router's API

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, options = {}) {
  const auth = state.key ? { Authorization: `Bearer ${state.key}` } : {};
  const headers = { ...auth, ...(options.headers || {}) };
  const response = await fetch(path, { ...options, headers }).catch((error) => {
    if (error.name === "AbortError") throw error;
    throw new ApiError(0, `Cannot reach the router (${error.message}). Is it running?`);
  });
  if (!response.ok) throw new ApiError(response.status, await errorMessage(response));
  return response;
}

async function errorMessage(response) {
  const body = await response.json().catch(() => null);
  return body?.error?.message || `HTTP ${response.status} ${response.statusText}`;
}

// An endpoint this router may not have yet (/metrics, deployments status): 404 means "absent".
async function optional(path, read) {
  if (Date.now() < (state.skipUntil[path] || 0)) return { missing: true };
  try {
    return { value: await read(await api(path)) };
  } catch (error) {
    if (error.status !== 404) throw error;
    state.skipUntil[path] = Date.now() + ABSENT_RETRY_MS;
    return { missing: true };
  }
}

// ------------------------------------------------------------------ sign in and out

// The key must open both what the dashboard reads: the control plane and the models.
async function login(key) {
  state.key = key;
  $("#login-button").disabled = true;
  try {
    await api("/api/v1/workers");
    await api("/v1/models");
  } catch (error) {
    state.key = null;
    return showLogin(error.message);
  } finally {
    $("#login-button").disabled = false;
  }
  sessionStorage.setItem(KEY_STORE, key);
  showApp(false);
}

// A router with no admin and no inference key (loopback only) takes any key, so asking for
// one would be a sham: say it is open instead.
async function openRouter() {
  const health = await fetch("/health").then((r) => r.json()).catch(() => null);
  const open = health?.open_scopes || [];
  return open.includes("admin") && open.includes("inference");
}

function showApp(open) {
  $("#login").hidden = true;
  $("#app").hidden = false;
  $("#logout").hidden = open;
  $("#open-router").hidden = !open;
  state.loop += 1;
  poll(state.loop);
}

function showLogin(message) {
  clearTimeout(state.timer);
  state.timer = null;
  $("#app").hidden = true;
  $("#login").hidden = false;
  const error = $("#login-error");
  error.textContent = message || "";
  error.hidden = !message;
  $("#key").focus();
}

function logout(message) {
  state.chat.controller?.abort();
  sessionStorage.removeItem(KEY_STORE);
  state.key = null;
  showLogin(message);
}

// ------------------------------------------------------------------ polling

// One polling loop per sign-in: a loop from an earlier sign-in stops at its next turn.
async function poll(loop) {
  try {
    await refresh();
  } finally {
    if (state.key !== null && loop === state.loop) state.timer = setTimeout(poll, POLL_MS, loop);
  }
}

async function refresh() {
  const [workers, models, health, metrics, deployments] = await Promise.allSettled([
    api("/api/v1/workers").then((r) => r.json()),
    api("/v1/models").then((r) => r.json()),
    fetch("/health").then((r) => r.json()),
    optional("/metrics", (r) => r.text()),
    optional("/api/v1/pipeline/status", (r) => r.json()),
  ]);
  if (state.key === null) return;  // signed out while the calls were in flight
  const failures = [workers, models, health, metrics, deployments]
    .filter((r) => r.status === "rejected").map((r) => r.reason);
  const denied = failures.find((e) => e.status === 401 || e.status === 403);
  if (denied) {
    const why = state.key ? "The router refused the key" : "The router now asks for a key";
    return logout(`${why}: ${denied.message}`);
  }

  if (metrics.status === "fulfilled") recordMetrics(metrics.value);
  else state.metrics = metrics.reason.message;
  renderKeyQueue();
  const modelList = models.status === "fulfilled" ? models.value.data : null;
  if (modelList) { renderModels(modelList); renderPicker(modelList); }
  if (workers.status === "fulfilled") {
    renderWorkers(workers.value.data, modelList || []);
    renderQueue(modelList || [], workers.value.data);
  }
  if (health.status === "fulfilled") renderSummary(health.value);
  if (deployments.status === "fulfilled") renderDeployments(deployments.value);
  renderChart();

  const problem = $("#poll-error");
  problem.hidden = failures.length === 0;
  problem.textContent = failures.length ? `Update failed: ${failures[0].message}` : "";
  $("#updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
}

// ------------------------------------------------------------------ metrics -> rates

const METRIC_LINE = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/;
const LABEL = /(\w+)="((?:[^"\\]|\\.)*)"/g;

// The counters the chart needs, summed over their labels, from Prometheus' text format.
function readCounters(text) {
  const totals = { requests: 0, tokens: 0, byModel: {}, keyQueue: {} };
  for (const line of text.split("\n")) {
    const [, name, rawLabels, rawValue] = METRIC_LINE.exec(line) || [];
    const labels = {};
    for (const [, key, value] of (rawLabels || "").matchAll(LABEL)) {
      labels[key] = value.replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
    }
    const value = Number(rawValue);
    if (name === "shoal_requests_total" && INFERENCE_ROUTE.test(labels.route || "")) {
      totals.requests += value;
    } else if (name === "shoal_tokens_total" && labels.direction === "out") {
      totals.tokens += value;
      totals.byModel[labels.model] = (totals.byModel[labels.model] || 0) + value;
    } else if (name === "shoal_key_queue_depth" && value > 0) {
      totals.keyQueue[labels.key] = value;
    }
  }
  return totals;
}

// A counter that went down belongs to a restarted router: count from zero.
const rate = (now, before, seconds) => (now >= before ? now - before : now) / seconds;

function recordMetrics(result) {
  if (result.missing) { state.metrics = "missing"; state.prev = null; state.keyQueue = {}; return; }
  state.metrics = "ok";
  const t = Date.now() / 1000;
  const now = { t, ...readCounters(result.value) };
  state.keyQueue = now.keyQueue;
  const before = state.prev;
  state.prev = now;
  if (!before || t <= before.t) return;
  const seconds = t - before.t;
  state.history.push({
    t, rps: rate(now.requests, before.requests, seconds), tps: rate(now.tokens, before.tokens, seconds),
  });
  state.history = state.history.filter((p) => p.t >= t - WINDOW_S);
  state.modelRates = {};
  for (const [model, total] of Object.entries(now.byModel)) {
    state.modelRates[model] = rate(total, before.byModel[model] || 0, seconds);
  }
}

// ------------------------------------------------------------------ panels

function renderSummary(health) {
  $("#version").textContent = health.version ? `v${health.version}` : "";
  $("#summary-workers").textContent = `${health.ready_workers} / ${health.workers} workers ready`;
  $("#summary-models").textContent = `${health.models.length} model${health.models.length === 1 ? "" : "s"}`;
}

// A labelled bar, full at share 1; `what` ends its accessible label ("used", "busy").
function bar(label, share, detail, what, cls = "") {
  share = Number.isFinite(share) ? Math.min(1, Math.max(0, share)) : 0;
  const fill = el("div", { class: `fill${share > 0.9 ? " hot" : share > 0.75 ? " warm" : ""}` });
  fill.style.width = `${(share * 100).toFixed(1)}%`;
  return el("div", { class: `meter ${cls}`.trim() },
    el("div", { class: "meter-label" }, el("span", { text: label }), el("span", { class: "muted", text: detail })),
    el("div", { class: "bar", role: "img", "aria-label": `${label} ${Math.round(share * 100)}% ${what}` }, fill));
}

function meter(label, used, total, cls = "") {
  return bar(label, total > 0 ? used / total : 0,
    `${formatBytes(used)} used · ${formatBytes(total - used)} free`, "used", cls);
}

// One GPU as its worker's last heartbeat read it: utilization and memory as bars, temperature
// and power as text. A reading its tool cannot give (null) is left out.
function gpuTelemetry(g, s) {
  const readout = [];
  if (Number.isFinite(s.temperature_celsius)) readout.push(`${Math.round(s.temperature_celsius)} °C`);
  if (Number.isFinite(s.power_watts)) {
    const cap = Number.isFinite(s.power_limit_watts) ? ` / ${Math.round(s.power_limit_watts)}` : "";
    readout.push(`${Math.round(s.power_watts)}${cap} W`);
  }
  const box = el("div", { class: "gpu", "data-gpu": String(s.index) },
    el("div", { class: "gpu-head" },
      el("span", { class: "gpu-name", text: `GPU ${s.index} · ${s.name || g.name}` }),
      el("span", { class: "muted gpu-readout", text: readout.join(" · ") })));
  if (Number.isFinite(s.utilization_percent)) {
    const percent = s.utilization_percent;
    box.append(bar("Utilization", percent / 100, `${Math.round(percent)}%`, "busy", "gpu-util"));
  }
  const total = s.memory_total_bytes ?? g.memory_total_bytes;
  if (Number.isFinite(s.memory_used_bytes) && total > 0) {
    box.append(meter("Memory", s.memory_used_bytes, total, "gpu-memory"));
  }
  return box;
}

// A worker serving several text models: each resident one as a bar of the memory its models
// may hold together (its model budget), and the total; loadable ones are listed as text.
function residency(w) {
  const budget = w.model_budget_bytes;
  if (!(budget > 0)) return null;
  const own = w.models.filter((m) => m.state && m.resident_bytes !== null && m.resident_bytes !== undefined);
  const held = own.filter((m) => ["ready", "loading", "restarting"].includes(m.state));
  const used = held.reduce((sum, m) => sum + m.resident_bytes, 0);
  const box = el("div", { class: "residency" }, meter("Models", used, budget, "residency-total"));
  for (const m of held) {
    const notes = [formatBytes(m.resident_bytes)];
    if (m.state !== "ready") notes.push(m.state);
    if (m.pinned) notes.push("pinned");
    const row = bar(m.name, m.resident_bytes / budget, notes.join(" · "), "of the model budget", "resident");
    row.dataset.model = m.name;
    box.append(row);
  }
  const loadable = own.filter((m) => !held.includes(m)).map((m) => m.name);
  if (loadable.length) box.append(el("p", { class: "loadable muted", text: `loadable: ${loadable.join(", ")}` }));
  return box;
}

function slotDots(used, total) {
  const dots = el("span", { class: "slots", title: `${used} of ${total} slots busy` });
  for (let i = 0; i < Math.min(total, 16); i += 1) {
    dots.append(el("span", { class: i < used ? "slot busy" : "slot" }));
  }
  return el("span", {}, dots, ` ${used} / ${total} busy`);
}

function fact(name, value) {
  return [el("dt", { text: name }), el("dd", {}, value)];
}

function workerCard(w, soleServer) {
  const hw = w.hardware || {};
  const gpus = hw.gpus || [];
  const names = w.models.map((m) => m.name);
  const facts = [
    ...fact("Host", `${hw.hostname || "?"} · ${hw.os || "?"}`),
    ...fact("CPU", `${hw.cpu_model || "CPU"} · ${hw.cpu_count} threads`),
    ...fact(gpus.length > 1 ? "GPUs" : "GPU",
      gpus.length ? gpus.map((g) => g.name).join(", ") : `none (${hw.accelerator || "cpu"})`),
    ...fact(names.length > 1 ? "Models" : "Model", names.join(", ") || "none"),
    ...fact("Slots", slotDots(w.running_jobs, w.slots)),
  ];
  // tokens/s are counted per model: they are this worker's only when no other worker serves it.
  const rates = names.filter((n) => soleServer.has(n) && n in state.modelRates);
  if (rates.length) {
    const total = rates.reduce((sum, n) => sum + state.modelRates[n], 0);
    facts.push(...fact("Tokens/s", formatRate(total)));
  }
  const ramTotal = hw.ram_total_bytes;
  const meters = el("div", { class: "meters" }, meter("RAM", ramTotal - w.ram_available_bytes, ramTotal));
  const telemetry = new Map((w.gpu_telemetry || []).map((s) => [s.index, s]));
  gpus.forEach((g, i) => {
    if (telemetry.has(g.index)) {
      meters.append(gpuTelemetry(g, telemetry.get(g.index)));
      return;
    }
    const free = w.gpu_free_bytes?.[i] ?? g.memory_free_bytes;
    if (free !== null && free !== undefined) {
      meters.append(meter(`GPU ${g.index} memory`, g.memory_total_bytes - free, g.memory_total_bytes));
    }
  });
  const resident = residency(w);
  if (resident) meters.append(resident);
  meters.append(el("p", { class: "seen muted", text: `seen ${w.last_seen_s_ago.toFixed(1)} s ago` }));
  // A GPU machine whose llama.cpp build drives none of its GPUs: the badge, and the fix.
  const unused = w.gpus_unused
    ? el("span", { class: "badge gpus-unused", title: w.gpus_unused, text: "GPUs unused" })
    : null;
  return el("article", { class: "card worker", "data-worker-id": w.id },
    el("header", { class: "card-head" }, el("h3", { text: w.name }), unused, statePill(w.state)),
    w.detail ? el("p", { class: `detail state-text-${w.state}`, text: w.detail }) : null,
    w.gpus_unused ? el("p", { class: "detail gpus-unused-why", text: w.gpus_unused }) : null,
    el("div", { class: "worker-body" }, el("dl", { class: "facts" }, ...facts), meters));
}

function renderWorkers(workers, models) {
  const soleServer = new Set(models.filter((m) => m.workers === 1).map((m) => m.id));
  show($("#workers"), workers.map((w) => workerCard(w, soleServer)),
    "No worker is connected. Start one with: shoal worker --router-url <this router>");
}

function renderModels(models) {
  if (!models.length) return show($("#models"), [], "No models: no worker serves one yet.");
  const head = el("tr", {}, ...["Model", "State", "Ready", "Tokens/s"].map((h) => el("th", { text: h })));
  const rows = models.map((m) => el("tr", { "data-model": m.id },
    el("td", { class: "name", title: m.context_length ? `context ${m.context_length} tokens` : null, text: m.id }),
    el("td", {}, statePill(m.state)),
    el("td", { text: `${m.ready_workers} / ${m.workers}` }),
    el("td", { text: m.id in state.modelRates ? formatRate(state.modelRates[m.id]) : "–" })));
  show($("#models"), [el("table", { class: "table" }, el("thead", {}, head), el("tbody", {}, ...rows))]);
}

function renderQueue(models, workers) {
  const deepest = Math.max(1, ...models.map((m) => m.queued));
  show($("#queue"), models.map((m) => {
    const serving = workers.filter((w) => w.models.some((x) => x.name === m.id));
    const running = serving.reduce((sum, w) => sum + w.running_jobs, 0);
    const fill = el("div", { class: "fill" });
    fill.style.width = `${(100 * m.queued) / deepest}%`;
    return el("div", { class: "queue-row", "data-model": m.id },
      el("div", { class: "meter-label" }, el("span", { class: "name", text: m.id }),
        el("span", { class: "muted", text: `${m.queued} queued · ${running} running` })),
      el("div", { class: "bar" }, fill));
  }), "Nothing queued.");
}

// Fair scheduling's tenants: the requests each API key has waiting (from /metrics).
function renderKeyQueue() {
  const waiting = Object.entries(state.keyQueue).sort((a, b) => b[1] - a[1] || (a[0] < b[0] ? -1 : 1));
  const deepest = Math.max(1, ...waiting.map(([, n]) => n));
  show($("#key-queue"), waiting.map(([key, n]) => {
    const fill = el("div", { class: "fill" });
    fill.style.width = `${(100 * n) / deepest}%`;
    return el("div", { class: "queue-row", "data-key": key },
      el("div", { class: "meter-label" }, el("span", { class: "name", text: key }),
        el("span", { class: "muted", text: `${n} waiting` })),
      el("div", { class: "bar" }, fill));
  }), state.metrics === "ok" ? "No key is waiting." : "Per-key queues need /metrics.");
}

function workerColor(id) {
  if (!state.colors.has(id)) state.colors.set(id, WORKER_COLORS[state.colors.size % WORKER_COLORS.length]);
  return state.colors.get(id);
}

// A deployment's layers coloured by the worker holding them (GET /api/v1/pipeline/status).
function layerMap(d) {
  const owner = new Array(d.n_layers).fill(null);
  for (const shard of d.shards) {
    for (let i = shard.layers[0]; i <= shard.layers[1] && i < d.n_layers; i += 1) owner[i] = shard;
  }
  const cells = owner.map((shard, i) => {
    const cell = el("span", {
      class: shard ? "cell" : "cell unassigned",
      "data-worker": shard ? shard.worker : null,
      title: `layer ${i}: ${shard ? shard.worker_name : "unassigned"}`,
    });
    if (shard) cell.style.backgroundColor = workerColor(shard.worker);
    return cell;
  });
  return el("div", { class: d.n_layers > 48 ? "layer-map dense" : "layer-map", role: "img",
    "aria-label": `${d.n_layers} layers` }, ...cells);
}

// Which device of a shard's worker holds which layers ("CUDA0 layers 0–26, …").
function shardDevices(s) {
  const held = (s.devices || []).filter((d) => d.layers)
    .map((d) => `${d.device} layers ${d.layers[0]}–${d.layers[1]}`);
  return held.length ? held.join(", ") : `layers ${s.layers[0]}–${s.layers[1]}`;
}

// A stage's link to the head: its RPC round trip as the head timed it, and the bytes its
// tunnel carried ("RPC 1.20 ms (p90 2.00) · 3.4 MiB to stage · 1.1 MiB back").
function shardLink(s) {
  const link = s.link;
  if (!link) return null;
  if (!link.measured) return el("span", { class: "link muted", title: link.why, text: "RPC not measured" });
  const rtt = link.rtt_ms ? `RPC ${link.rtt_ms.median.toFixed(2)} ms (p90 ${link.rtt_ms.p90.toFixed(2)})` : "RPC –";
  const hub = link.router_rtt_ms ? ` (router to stage alone: ${link.router_rtt_ms.median.toFixed(2)} ms)` : "";
  return el("span", { class: "link", title: `round trip measured at ${link.rtt_measures}${hub}`,
    text: `${rtt} · ${formatBytes(link.bytes_to_stage)} to stage · ${formatBytes(link.bytes_to_head)} back` });
}

function deploymentCard(d) {
  const legend = d.shards.map((s) => {
    const swatch = el("span", { class: "swatch" });
    swatch.style.backgroundColor = workerColor(s.worker);
    return el("li", { "data-worker": s.worker }, swatch, el("span", { class: "name", text: s.worker_name || s.worker }),
      el("span", { class: "muted", text: `${s.role} · ${shardDevices(s)} · ${formatBytes(s.planned_bytes)}` }),
      shardLink(s), statePill(s.state));
  });
  const head = el("header", { class: "card-head" }, el("h3", { class: "wrap", text: d.name }), statePill(d.state));
  const about = el("p", { class: "muted small", text: d.n_layers
    ? `${d.model} · ${d.n_layers} layers on ${d.shards.length} workers · ${d.mode}`
    : `${d.model} · ${d.detail}` });
  if (!d.n_layers || !d.shards.length) return el("article", { class: "deployment", "data-deployment": d.name }, head, about);
  return el("article", { class: "deployment", "data-deployment": d.name }, head, about,
    layerMap(d),
    el("div", { class: "layer-scale muted" }, el("span", { text: "0" }), el("span", { text: String(d.n_layers - 1) })),
    el("ul", { class: "shard-legend" }, ...legend));
}

function renderDeployments(result) {
  const deployments = result.missing ? [] : result.value.data || [];
  show($("#deployments"), deployments.map(deploymentCard),
    "No deployments: no model is split across workers.");
}

// ------------------------------------------------------------------ the live chart

function renderChart() {
  const points = state.history;
  drawChart($("#chart"), points, WINDOW_S);
  const last = points[points.length - 1];
  $("#now-tokens").textContent = last ? formatRate(last.tps) : "–";
  $("#now-requests").textContent = last ? formatRate(last.rps) : "–";
  const note = $("#chart-note");
  note.textContent = state.metrics === "missing" ? "Metrics unavailable: this router has no /metrics endpoint."
    : state.metrics === "ok" ? (points.length ? "" : "Collecting…")
      : state.metrics === "pending" ? "" : `Metrics unavailable: ${state.metrics}`;
  note.hidden = !note.textContent;
  $(".chart-box").classList.toggle("off", state.metrics !== "ok");
}

// ------------------------------------------------------------------ the playground

function renderPicker(models) {
  const select = $("#model");
  const ids = models.map((m) => m.id);
  if (ids.join("\n") === [...select.options].map((o) => o.value).join("\n")) return;
  const chosen = select.value;
  select.replaceChildren(...ids.map((id) => el("option", { value: id, text: id })));
  if (ids.includes(chosen)) select.value = chosen;
}

function addMessage(role, text) {
  const transcript = $("#transcript");
  transcript.querySelector(".empty")?.remove();
  const body = el("div", { class: "body", text });
  const message = el("div", { class: `msg ${role}`, "data-state": role === "assistant" ? "streaming" : "done" },
    el("div", { class: "role", text: role === "user" ? "You" : $("#model").value }), body);
  transcript.append(message);
  transcript.scrollTop = transcript.scrollHeight;
  return message;
}

// The data of each server-sent event, parsed, until [DONE].
async function* serverEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      const lines = buffer.split("\n");
      buffer = lines.pop();
      for (const line of lines) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

function setBusy(busy) {
  $("#send").disabled = busy;
  $("#stop").disabled = !busy;
}

async function send() {
  const prompt = $("#prompt").value.trim();
  const model = $("#model").value;
  if (!prompt || !model || state.chat.controller) return;
  $("#prompt").value = "";
  const history = state.chat.messages;  // "Clear" during the reply starts a new one
  history.push({ role: "user", content: prompt });
  addMessage("user", prompt);
  const message = addMessage("assistant", "");
  const body = message.querySelector(".body");
  const controller = new AbortController();
  state.chat.controller = controller;
  setBusy(true);
  $("#chat-stats").textContent = "waiting for a slot…";
  const started = performance.now();
  let text = "", tokens = 0, first = null;
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({
        model, messages: history, stream: true,
        max_tokens: Number($("#max-tokens").value) || 256,
      }),
      signal: controller.signal,
    });
    for await (const event of serverEvents(response)) {
      if (event.error) throw new Error(event.error.message);
      const delta = event.choices?.[0]?.delta?.content;
      if (event.usage) tokens = event.usage.completion_tokens;
      if (!delta) continue;
      first ??= performance.now();
      text += delta;
      tokens += event.usage ? 0 : 1;  // llama-server sends one token per event
      body.textContent = text;
      $("#transcript").scrollTop = $("#transcript").scrollHeight;
    }
    message.dataset.state = "done";
  } catch (error) {
    const stopped = error.name === "AbortError";
    message.dataset.state = stopped ? "stopped" : "error";
    message.append(el("div", { class: "note", text: stopped ? "stopped" : error.message }));
  } finally {
    state.chat.controller = null;
    setBusy(false);
  }
  if (text) history.push({ role: "assistant", content: text });
  else history.pop();  // an unanswered prompt is not part of the conversation
  const end = performance.now();
  const speed = first && end > first ? ` · ${formatRate(tokens / ((end - first) / 1000))} tok/s` : "";
  $("#chat-stats").textContent = first
    ? `${tokens} tokens · TTFT ${Math.round(first - started)} ms${speed}` : "";
}

function clearChat() {
  state.chat.controller?.abort();
  state.chat.messages = [];
  $("#transcript").replaceChildren(el("p", { class: "empty", text: "Conversation cleared." }));
  $("#chat-stats").textContent = "";
}

// ------------------------------------------------------------------ wiring

function start() {
  $("#login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    login($("#key").value.trim());
  });
  $("#logout").addEventListener("click", () => logout(""));
  $("#chat-form").addEventListener("submit", (event) => { event.preventDefault(); send(); });
  $("#prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); send(); }
  });
  $("#stop").addEventListener("click", () => state.chat.controller?.abort());
  $("#clear").addEventListener("click", clearChat);
  window.addEventListener("resize", renderChart);
  openRouter().then((open) => {
    if (open) {
      state.key = "";
      return showApp(true);
    }
    const saved = sessionStorage.getItem(KEY_STORE);
    if (saved) login(saved); else showLogin("");
  });
}

start();
