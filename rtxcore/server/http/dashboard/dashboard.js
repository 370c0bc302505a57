// The rtx-serve dashboard: polls /metrics (Prometheus text) and /dashboard/fleet.json (the peers' autoscaling
// signals, rtxcore/server/fleet.py) and fills the page. No build step, no library, nothing
// fetched from elsewhere, so that it works on an air-gapped cluster. Every shown figure is also in a data-value
// attribute (the raw number), which the browser test compares with /metrics.
"use strict";

const POLL_MS = Number(new URLSearchParams(location.search).get("interval_ms") || 2000);
// Percentiles and rates are over this window when it saw observations, otherwise over the server's lifetime.
const WINDOW_S = 60;
const snapshots = []; // [{t, series}], oldest first

// --- Prometheus text format -----------------------------------------------------------------------------------
const LINE = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)/;
const LABEL = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;

function parseMetrics(text) {
  const series = new Map();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = LINE.exec(line);
    if (!m) continue;
    const labels = {};
    for (const l of (m[3] || "").matchAll(LABEL)) labels[l[1]] = l[2].replace(/\\(.)/g, "$1");
    if (!series.has(m[1])) series.set(m[1], []);
    series.get(m[1]).push({ labels, value: Number(m[4]) });
  }
  return series;
}

function matches(labels, filter) {
  return Object.entries(filter).every(([k, v]) => labels[k] === v);
}

function total(series, name, filter = {}) {
  const rows = (series.get(name) || []).filter((s) => matches(s.labels, filter));
  return rows.length ? rows.reduce((a, s) => a + s.value, 0) : null;
}

// Cumulative bucket counts by upper bound, summed over the series that match (and minus `base`'s, for a window).
function buckets(series, name, filter, base) {
  const counts = new Map();
  for (const [snap, sign] of [[series, 1], [base, -1]]) {
    if (!snap) continue;
    for (const s of snap.get(name + "_bucket") || []) {
      if (!matches(s.labels, filter)) continue;
      const le = s.labels.le === "+Inf" ? Infinity : Number(s.labels.le);
      counts.set(le, (counts.get(le) || 0) + sign * s.value);
    }
  }
  return [...counts.entries()].sort((a, b) => a[0] - b[0]);
}

// Prometheus's histogram_quantile: linear within the bucket that holds the q-th observation.
function quantile(q, bucketList) {
  if (!bucketList.length) return null;
  const count = bucketList[bucketList.length - 1][1];
  if (!(count > 0)) return null;
  const rank = q * count;
  let lower = 0, below = 0;
  for (const [le, cum] of bucketList) {
    if (cum >= rank) {
      if (le === Infinity) return lower;
      return lower + (le - lower) * ((rank - below) / Math.max(cum - below, 1e-12));
    }
    lower = le; below = cum;
  }
  return lower;
}

// --- the window -------------------------------------------------------------------------------------------------
// The snapshot the window starts at, or null (lifetime figures) until there is one or while the engine was idle
// through the window (its percentiles would be empty).
function windowBase(now) {
  while (snapshots.length > 1 && now.t - snapshots[0].t > WINDOW_S * 1000) snapshots.shift();
  const base = snapshots.length > 1 ? snapshots[0] : null;
  const steps = (snap) => total(snap.series, "rtx_engine_steps_total") || 0;
  return base && steps(now) > steps(base) ? base : null;
}

function histogramFigures(series, base, name, filter) {
  const list = buckets(series, name, filter, base ? base.series : null);
  const delta = (n) => (total(series, n, filter) || 0) - (base ? total(base.series, n, filter) || 0 : 0);
  const n = delta(name + "_count");
  return { p50: quantile(0.5, list), p95: quantile(0.95, list), mean: n > 0 ? delta(name + "_sum") / n : null };
}

// --- formatting -----------------------------------------------------------------------------------------------
const fmt = {
  count: (v) => (v === null ? "—" : Math.round(v).toLocaleString("en")),
  num: (v) => (v === null ? "—" : v.toFixed(2)),
  seconds: (v) => (v === null ? "—" : v < 1 ? (v * 1000).toFixed(1) + " ms" : v.toFixed(2) + " s"),
  ratio: (v) => (v === null ? "—" : (v * 100).toFixed(1) + "%"),
  bytes: (v) => (v === null ? "—" : (v / 2 ** 20).toFixed(1) + " MiB"),
};

function set(el, value, format, miss = false) {
  el.dataset.value = value === null || value === undefined || Number.isNaN(value) ? "" : String(value);
  el.textContent = format(value ?? null);
  el.classList.toggle("miss", miss);
}

function setKey(key, value, format) {
  for (const el of document.querySelectorAll(`[data-key="${key}"]`)) set(el, value, format);
}

function cell(row, key, value, format, miss = false) {
  const td = document.createElement("td");
  td.dataset.key = key;
  set(td, value, format, miss);
  row.appendChild(td);
}

function fillRows(tbodyId, names, fillRow) {
  const body = document.getElementById(tbodyId);
  body.replaceChildren();
  for (const name of names) {
    const tr = document.createElement("tr");
    const th = document.createElement("th");
    th.textContent = name;
    tr.appendChild(th);
    fillRow(tr, name);
    body.appendChild(tr);
  }
}

function labelValues(series, name, label) {
  return [...new Set((series.get(name) || []).map((s) => s.labels[label]).filter((v) => v !== undefined))].sort();
}

// --- the page -------------------------------------------------------------------------------------------------
function render(now) {
  const base = windowBase(now);
  const s = now.series;
  const model = labelValues(s, "rtx_engine_steps_total", "model")[0] || "?";
  setKey("model", model, String);
  setKey("window", base ? `last ${Math.round((now.t - base.t) / 1000)} s` : "since start (idle in the window)",
         String);
  setKey("running", total(s, "rtx_num_requests_running"), fmt.count);
  setKey("waiting", total(s, "rtx_num_requests_waiting"), fmt.count);
  setKey("batch-mean", histogramFigures(s, base, "rtx_batch_size", {}).mean, fmt.num);
  setKey("step-mean", histogramFigures(s, base, "rtx_engine_step_duration_seconds", {}).mean, fmt.seconds);
  setKey("steps", total(s, "rtx_engine_steps_total"), fmt.count);
  const generated = total(s, "rtx_generation_tokens_total");
  setKey("generated", generated, fmt.count);
  const rate = base ? (generated - total(base.series, "rtx_generation_tokens_total")) / ((now.t - base.t) / 1000) : null;
  setKey("tokens-per-s", rate, fmt.num);
  setKey("merge-wait-p95", histogramFigures(s, base, "rtx_merge_wait_seconds", {}).p95, fmt.seconds);
  setKey("rejected", total(s, "rtx_requests_rejected_total") ?? 0, fmt.count);
  setKey("failures", total(s, "rtx_request_failures_total") ?? 0, fmt.count);
  setKey("oom", total(s, "rtx_oom_total"), fmt.count);
  setKey("preemptions", total(s, "rtx_request_preemptions_total"), fmt.count);

  setKey("brownout-level", total(s, "rtx_brownout_level"), fmt.count);
  setKey("brownout-pressure", total(s, "rtx_brownout_pressure"), fmt.num);
  const lanes = labelValues(s, "rtx_lane_target_seconds", "lane");
  fillRows("lane-rows", lanes, (tr, lane) => {
    const ttft = histogramFigures(s, base, "rtx_lane_time_to_first_token_seconds", { lane });
    const itl = histogramFigures(s, base, "rtx_lane_inter_token_latency_seconds", { lane });
    const ttftTarget = total(s, "rtx_lane_target_seconds", { lane, latency: "ttft" });
    const itlTarget = total(s, "rtx_lane_target_seconds", { lane, latency: "itl" });
    cell(tr, `lane-queued:${lane}`, total(s, "rtx_lane_requests_queued", { lane }), fmt.count);
    cell(tr, `lane-running:${lane}`, total(s, "rtx_lane_requests_running", { lane }), fmt.count);
    const predicted = total(s, "rtx_lane_predicted_ttft_seconds", { lane });
    cell(tr, `lane-ttft-predicted:${lane}`, predicted, fmt.seconds, predicted !== null && predicted > ttftTarget);
    cell(tr, `lane-ttft-p50:${lane}`, ttft.p50, fmt.seconds);
    cell(tr, `lane-ttft-p95:${lane}`, ttft.p95, fmt.seconds, ttft.p95 !== null && ttft.p95 > ttftTarget);
    cell(tr, `lane-ttft-target:${lane}`, ttftTarget, fmt.seconds);
    cell(tr, `lane-itl-p50:${lane}`, itl.p50, fmt.seconds);
    cell(tr, `lane-itl-p95:${lane}`, itl.p95, fmt.seconds, itl.p95 !== null && itl.p95 > itlTarget);
    cell(tr, `lane-itl-target:${lane}`, itlTarget, fmt.seconds);
  });

  setKey("kv-usage", total(s, "rtx_kv_cache_usage_ratio"), fmt.ratio);
  const queries = total(s, "rtx_prefix_cache_queries_total");
  setKey("hit-rate", queries ? total(s, "rtx_prefix_cache_hits_total") / queries : null, fmt.ratio);
  setKey("kv-evictions", total(s, "rtx_kv_cache_evictions_total"), fmt.count);
  setKey("kv-fragmentation", total(s, "rtx_kv_cache_fragmentation_ratio"), fmt.ratio);
  fillRows("tier-rows", labelValues(s, "rtx_kv_tier_capacity_bytes", "tier"), (tr, tier) => {
    cell(tr, `tier-used:${tier}`, total(s, "rtx_kv_tier_used_bytes", { tier }), fmt.bytes);
    cell(tr, `tier-capacity:${tier}`, total(s, "rtx_kv_tier_capacity_bytes", { tier }), fmt.bytes);
    cell(tr, `tier-usage:${tier}`, total(s, "rtx_kv_tier_usage_ratio", { tier }), fmt.ratio);
    cell(tr, `tier-pressure:${tier}`, total(s, "rtx_kv_tier_pressure_ratio", { tier }), fmt.ratio);
    cell(tr, `tier-offloaded:${tier}`, total(s, "rtx_kv_offload_bytes_total", { tier }), fmt.bytes);
    cell(tr, `tier-reloaded:${tier}`, total(s, "rtx_kv_reload_bytes_total", { tier }), fmt.bytes);
  });

  const gpus = labelValues(s, "rtx_gpu_memory_total_bytes", "gpu");
  setKey("gpu-note", gpus.length ? "" : "not measured: no GPU (or no NVML) on this server", String);
  fillRows("gpu-rows", gpus, (tr, gpu) => {
    cell(tr, `gpu-util:${gpu}`, total(s, "rtx_gpu_utilization_ratio", { gpu }), fmt.ratio);
    cell(tr, `gpu-memory-used:${gpu}`, total(s, "rtx_gpu_memory_used_bytes", { gpu }), fmt.bytes);
    cell(tr, `gpu-memory-total:${gpu}`, total(s, "rtx_gpu_memory_total_bytes", { gpu }), fmt.bytes);
  });
}

// The replicas panel: what the server's fleet watcher read from its peers (their own /metrics), as it gave it.
function renderFleet(view) {
  const configured = Boolean(view && view.configured);
  setKey("fleet-note", !configured ? "not configured: rtx serve --fleet-peers (the Helm chart sets it)"
    : view.updated_at === null ? "reading the peers..."
    : `read ${new Date(view.updated_at * 1000).toLocaleTimeString()}, every ${view.interval_s} s; TTFT p95 over ` +
      `${view.window_s} s${view.latency_lane ? " of lane " + view.latency_lane : ""}; the count is the ` +
      "autoscaler's rule before its stabilization windows", String);
  const ok = configured && view.updated_at !== null;
  setKey("fleet-replicas", ok ? view.replicas : null, fmt.count);
  setKey("fleet-unreachable", ok ? view.unreachable : null, fmt.count);
  setKey("fleet-desired", ok ? view.desired_replicas : null, fmt.count);
  setKey("fleet-bounds", ok ? `${view.min_replicas}..${view.max_replicas ?? "no limit"}` : null, (v) => v ?? "—");
  const signals = ok ? view.signals : [];
  const pods = ok ? view.pods : [];
  fillRows("signal-rows", signals.map((sig) => sig.name), (tr, name) => {
    const sig = signals.find((x) => x.name === name);
    const format = name === "queue depth" ? fmt.num : fmt.seconds;
    cell(tr, `fleet-average:${name}`, sig.average, format, sig.ratio !== null && sig.ratio > 1);
    cell(tr, `fleet-target:${name}`, sig.target, format);
    cell(tr, `fleet-ratio:${name}`, sig.ratio, fmt.num);
    cell(tr, `fleet-proposal:${name}`, sig.proposal, fmt.count);
  });
  fillRows("pod-rows", pods.map((pod) => pod.address), (tr, address) => {
    const pod = pods.find((x) => x.address === address);
    cell(tr, `pod-up:${address}`, pod.up ? 1 : 0, (v) => (v ? "yes" : "no: " + pod.error), !pod.up);
    cell(tr, `pod-waiting:${address}`, pod.queue_depth, fmt.count);
    cell(tr, `pod-ttft-p95:${address}`, pod.ttft_p95_s, fmt.seconds);
  });
}

// Its own failure says so in its panel: the rest of the page still comes from /metrics.
async function pollFleet() {
  try {
    const response = await fetch("/dashboard/fleet.json", { cache: "no-store" });
    if (!response.ok) throw new Error(`/dashboard/fleet.json answered ${response.status}`);
    renderFleet(await response.json());
  } catch (err) {
    renderFleet(null);
    setKey("fleet-note", "no fleet view: " + err.message, String);
  }
}

async function poll() {
  const status = document.querySelector('[data-key="status"]');
  try {
    const response = await fetch("/metrics", { cache: "no-store" });
    if (!response.ok) throw new Error(`/metrics answered ${response.status}`);
    const now = { t: Date.now(), series: parseMetrics(await response.text()) };
    snapshots.push(now);
    render(now);
    await pollFleet();
    status.textContent = "live, updated " + new Date(now.t).toLocaleTimeString();
    status.dataset.value = "live";
    status.classList.remove("down");
  } catch (err) {
    status.textContent = "no answer from the server: " + err.message;
    status.dataset.value = "down";
    status.classList.add("down");
  }
  setTimeout(poll, POLL_MS);
}

poll();
