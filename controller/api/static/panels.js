// slotctl dashboard: traffic (request rate, latency, queue per slot, as small hand-drawn
// SVG sparklines from GET /api/traffic: the router's own counters, sampled by the
// controller), the per-slot log view (GET /api/slots/NAME/logs, its last lines, then
// followed) and the lease flips folded into one "requests" item a slot and burst.
// The keys panel (GET /api/keys: each key's scope, class, requests in flight and last
// use, and the requests waiting now by priority class).
// Loaded before app.js, whose helpers (h, api, state, clock) it uses when called.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const LOG_TAIL = 200;
const LOG_EVERY_MS = 1000;

const traffic = {
  interval: 2, // seconds a sample covers (the answer says)
  slots: new Map(), // slot name -> {requests_total, max_queue, series}
};

// ------------------------------------------------------------------ sparklines

// A line over `values` (null: a gap), scaled to its own maximum (at least `floor`), with
// the area under it shaded; the last point is marked.
function sparkline(values, { width = 48, height = 20, floor = 1, cls = "", title = "" } = {}) {
  const svg = document.createElementNS(SVG_NS, "svg");
  svg.setAttribute("class", `spark ${cls}`);
  svg.setAttribute("width", String(width));
  svg.setAttribute("height", String(height));
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("role", "img");
  if (title) {
    const t = document.createElementNS(SVG_NS, "title");
    t.textContent = title;
    svg.append(t);
  }
  const numbers = values.filter((v) => v !== null && v !== undefined);
  const top = Math.max(floor, ...numbers);
  const step = values.length > 1 ? width / (values.length - 1) : width;
  const y = (v) => (height - 2 - (v / top) * (height - 4)).toFixed(1);
  let runs = [];
  let run = [];
  values.forEach((v, i) => {
    if (v === null || v === undefined) {
      if (run.length) runs.push(run);
      run = [];
    } else {
      run.push([(i * step).toFixed(1), y(v)]);
    }
  });
  if (run.length) runs.push(run);
  for (const points of runs) {
    const line = points.map(([px, py]) => `${px},${py}`).join(" ");
    const area = document.createElementNS(SVG_NS, "polygon");
    area.setAttribute("class", "area");
    area.setAttribute("points", `${points[0][0]},${height} ${line} ${points[points.length - 1][0]},${height}`);
    const poly = document.createElementNS(SVG_NS, "polyline");
    poly.setAttribute("class", "line");
    poly.setAttribute("points", line);
    svg.append(area, poly);
  }
  const lastRun = runs[runs.length - 1];
  if (lastRun && values[values.length - 1] !== null && values[values.length - 1] !== undefined) {
    const [px, py] = lastRun[lastRun.length - 1];
    const dot = document.createElementNS(SVG_NS, "circle");
    dot.setAttribute("class", "dot");
    dot.setAttribute("cx", px);
    dot.setAttribute("cy", py);
    dot.setAttribute("r", "2");
    svg.append(dot);
  }
  return svg;
}

function ms(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
  return `${seconds.toFixed(seconds < 10 ? 2 : 1)} s`;
}

function rate(n) {
  if (n >= 100) return n.toFixed(0);
  if (n >= 10) return n.toFixed(1);
  return n.toFixed(2).replace(/\.?0+$/, "") || "0";
}

// ------------------------------------------------------------------ traffic

async function refreshTraffic() {
  const { body } = await api("/api/traffic");
  traffic.interval = body.interval_s || 2;
  traffic.slots = new Map(body.slots.map((s) => [s.slot, s]));
  queueRender("slots");
}

// The cells of one slot row: requests (rate sparkline), latency (p50 sparkline), and
// what is in flight and queued.
function trafficCells(slot) {
  const t = traffic.slots.get(slot.name);
  const series = t ? t.series : null;
  const perSecond = series ? series.requests.map((n) => n / traffic.interval) : [];
  const recent = perSecond.slice(-5);
  const now = recent.length ? recent.reduce((a, b) => a + b, 0) / recent.length : 0;
  const total = t ? t.requests_total : slot.requests || 0;
  const req = h(
    "td",
    { class: "c-spark c-req", "data-rate": now.toFixed(3), title: `${total} requests through the router; per second, last ${Math.round((perSecond.length * traffic.interval) / 60)} min` },
    series && series.requests.some((n) => n > 0) ? sparkline(perSecond, { cls: "s-req", floor: 0.5, title: "requests per second" }) : h("span", { class: "spark-none" }),
    h("span", { class: "spark-val" }, h("b", { text: `${rate(now)}/s` }), h("span", { class: "muted", text: String(total) })),
  );
  const p50 = series ? series.p50_s : [];
  const p95 = series ? series.p95_s : [];
  const lastOf = (values) => {
    for (let i = values.length - 1; i >= 0; i -= 1) if (values[i] !== null) return values[i];
    return null;
  };
  const lat = h(
    "td",
    { class: "c-spark c-lat", title: "latency until the last byte: p50 (line), p95 (last)" },
    p50.some((v) => v !== null) ? sparkline(p50, { cls: "s-lat", floor: 0.01, title: "p50 latency (s)" }) : h("span", { class: "spark-none" }),
    h("span", { class: "spark-val" }, h("b", { text: ms(lastOf(p50)) }), h("span", { class: "muted", text: `p95 ${ms(lastOf(p95))}` })),
  );
  const inFlight = Math.max(0, (slot.leases || 0) - (slot.holds || 0));
  const queued = slot.waiters || 0;
  const queueHistory = series ? series.queued : [];
  const cap = t && t.max_queue !== null ? t.max_queue : null;
  const flight = h(
    "td",
    { class: "c-num c-flight", title: `requests in flight / waiting for a cold load${cap !== null ? ` (at most ${cap}, then 429)` : ""}` },
    queueHistory.some((n) => n > 0) ? sparkline(queueHistory, { cls: "s-queue", width: 36, title: "queued" }) : null,
    h("span", { text: String(inFlight) }),
    queued ? h("span", { class: "queued", text: `${queued} queued` }) : null,
  );
  return [flight, req, lat];
}

function queuedTotal(slots) {
  return slots.reduce((n, s) => n + (s.waiters || 0), 0);
}

// ------------------------------------------------------------------ logs

const logs = { slot: null, lines: [], follow: true, timer: 0 };

function logUi() {
  return {
    panel: document.getElementById("logs-panel"),
    title: document.getElementById("logs-title"),
    pre: document.getElementById("log-lines"),
    follow: document.getElementById("logs-follow"),
    close: document.getElementById("logs-close"),
    state: document.getElementById("logs-state"),
  };
}

function openLogs(name) {
  const ui = logUi();
  logs.slot = name;
  logs.lines = [];
  logs.follow = true;
  ui.title.textContent = `Logs · ${name}`;
  ui.pre.textContent = "";
  ui.panel.hidden = false;
  ui.panel.dataset.slot = name;
  ui.follow.setAttribute("aria-pressed", "true");
  pollLogs();
  ui.panel.scrollIntoView({ block: "nearest" });
}

function closeLogs() {
  clearTimeout(logs.timer);
  logs.slot = null;
  logUi().panel.hidden = true;
}

function newLines(seen, fresh) {
  // The lines of `fresh` after the last one already shown (as `slotctl slot logs -f`).
  if (!seen.length) return fresh;
  const last = seen[seen.length - 1];
  const at = fresh.lastIndexOf(last);
  return at < 0 ? fresh : fresh.slice(at + 1);
}

async function pollLogs() {
  clearTimeout(logs.timer);
  const name = logs.slot;
  if (!name) return;
  const ui = logUi();
  try {
    const { body } = await api(`/api/slots/${encodeURIComponent(name)}/logs?tail=${LOG_TAIL}`);
    if (logs.slot !== name) return;
    const add = newLines(logs.lines, body.lines || []);
    if (add.length) {
      const atBottom = ui.pre.scrollTop + ui.pre.clientHeight >= ui.pre.scrollHeight - 8;
      logs.lines = logs.lines.concat(add).slice(-2000);
      ui.pre.append(document.createTextNode(add.join("\n") + "\n"));
      if (atBottom) ui.pre.scrollTop = ui.pre.scrollHeight;
    }
    ui.state.textContent = logs.follow ? "following" : "paused";
    ui.panel.dataset.lines = String(logs.lines.length);
  } catch (err) {
    ui.state.textContent = err.message;
  }
  if (logs.follow && logs.slot === name) logs.timer = setTimeout(pollLogs, LOG_EVERY_MS);
}

function setupLogs() {
  const ui = logUi();
  ui.close.addEventListener("click", closeLogs);
  ui.follow.addEventListener("click", () => {
    logs.follow = !logs.follow;
    ui.follow.setAttribute("aria-pressed", String(logs.follow));
    if (logs.follow) pollLogs();
    else {
      clearTimeout(logs.timer);
      ui.state.textContent = "paused";
    }
  });
}

// ------------------------------------------------------------------ lease flips

function isFlip(event) {
  return event.kind === "transition" && event.op === "lease" && FLIP_STATES.has(event.from) && FLIP_STATES.has(event.to);
}

// The events to show, newest first: with the lease flips each one, else each slot's run
// of flips folded into one "requests" item (counted from the flips' request counts).
function shownEvents() {
  const merged = [...state.events, ...state.flips].sort((a, b) => b.id - a.id);
  if (state.showFlips) return merged.slice(0, MAX_EVENTS);
  const items = [];
  const open = new Map(); // slot -> its burst, while no other event of the slot came
  for (const event of merged.reverse()) {
    if (!isFlip(event)) {
      open.delete(event.slot);
      items.push(event);
      continue;
    }
    const total = (event.details && event.details.requests) || 0;
    let burst = open.get(event.slot);
    if (!burst) {
      const base = event.to === "serving" ? total : Math.max(0, total - 1);
      burst = { kind: "requests", slot: event.slot, base, total, first: event.time, time: event.time, id: event.id, serving: false };
      open.set(event.slot, burst);
      items.push(burst);
    }
    burst.total = Math.max(burst.total, total);
    burst.time = event.time;
    burst.id = event.id;
    burst.serving = event.to === "serving";
  }
  return items.sort((a, b) => b.id - a.id).slice(0, MAX_EVENTS);
}

function burstItem(burst, fresh) {
  const served = burst.total - burst.base;
  const text = `since ${clock(burst.first)} · ${burst.total} in all${burst.serving ? " · serving" : ""}`;
  return h(
    "li",
    { class: fresh ? "new" : "", "data-kind": "requests", "data-slot": burst.slot, "data-requests": String(served) },
    h("span", { class: "ev-time", text: clock(burst.time) }),
    h("div", { class: "ev-main" }, h("span", { class: "ev-kind k-requests", text: "requests" }), h("span", { class: "ev-slot", text: burst.slot }), h("span", { class: "ev-count", text: `${served} request${served === 1 ? "" : "s"}` })),
    h("div", { class: "ev-msg", text }),
  );
}


// ------------------------------------------------------------------ keys

function lastUsed(wall) {
  if (!wall) return "never";
  const s = Math.max(0, Date.now() / 1000 - wall);
  if (s < 60) return `${Math.round(s)}s ago`;
  if (s < 3600) return `${Math.round(s / 60)}m ago`;
  return `${Math.round(s / 3600)}h ago`;
}

async function refreshAliases() {
  // [[alias]]: hidden while none is declared; "serves now" is where a request would go
  const { body } = await api("/api/models");
  const aliases = body.aliases || [];
  document.querySelector(".aliases-panel").hidden = aliases.length === 0;
  document.getElementById("alias-rows").replaceChildren(
    ...aliases.map((a) =>
      h(
        "tr",
        { "data-alias": a.id },
        h("td", { class: "mono" }, a.id),
        h("td", {}, a.prefer),
        h("td", { class: "mono" }, (a.models || []).join(", ")),
        h("td", { class: "mono" }, a.serves || "—"),
      ),
    ),
  );
}

async function refreshAdapters() {
  // [[adapter]]: hidden while none is declared; where each is resident now (a slot's
  // loading or draining adapters say so), pinned ones marked
  const { body } = await api("/api/adapters");
  const declared = body.declared || [];
  const where = {};
  for (const slot of body.adapters || []) {
    for (const held of slot.resident || []) {
      const state = held.state === "loaded" || held.state === "started" ? "" : ` (${held.state})`;
      (where[held.id] = where[held.id] || []).push(slot.slot + state);
    }
  }
  document.querySelector(".adapters-panel").hidden = declared.length === 0;
  document.getElementById("adapter-rows").replaceChildren(
    ...declared.map((a) =>
      h(
        "tr",
        { "data-adapter": a.id },
        h("td", { class: "mono" }, a.id + (a.pinned ? " (pinned)" : "")),
        h("td", { class: "mono" }, a.base),
        h("td", {}, String(a.priority)),
        h("td", { class: "mono" }, (where[a.id] || []).join(", ") || "—"),
      ),
    ),
  );
}

async function refreshKeys() {
  const panel = document.querySelector(".keys-panel");
  let body;
  try {
    ({ body } = await api("/api/keys"));
  } catch (err) {
    if (err.status !== 403) throw err;
    panel.hidden = true; // a key below admin: its keys are not this page's to show
    return;
  }
  panel.hidden = false;
  const rows = document.getElementById("key-rows");
  const keys = body.keys || [];
  rows.replaceChildren(
    ...keys.map((k) =>
      h(
        "tr",
        { "data-key": k.name, class: k.expired ? "expired" : "" },
        h("td", { class: "mono" }, k.name),
        h("td", {}, k.scope),
        h("td", {}, k.priority || "default"),
        h("td", { class: "num" }, String(k.in_flight || 0)),
        h("td", { class: "muted" }, k.expired ? "expired" : lastUsed(k.last_used)),
      ),
    ),
  );
  document.getElementById("keys-empty").hidden = keys.length > 0;
  const waiting = Object.entries(body.waiting || {}).filter(([cls]) => cls);
  document.getElementById("queue-by-class").textContent = waiting.length
    ? "waiting: " + waiting.map(([cls, n]) => `${cls} ${n}`).join(" · ")
    : "";
}
