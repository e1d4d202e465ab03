// slotctl dashboard: slots, memory and events, live from the API. No build step.
//
// The bearer token is asked once (or taken from a one-time login link) and kept in
// localStorage. The event stream is read with
// fetch() and a small SSE parser (EventSource cannot send an Authorization header); on a
// reconnect it resumes with Last-Event-ID, and an `event: gap` makes it re-read the state.
"use strict";

const TOKEN_KEY = "slotctl.token";
const FLIPS_KEY = "slotctl.show-flips";
const MAX_EVENTS = 80; // shown
const KEEP_EVENTS = 300; // kept (the lease flips apart, up to KEEP_FLIPS)
const KEEP_FLIPS = 400;
const FLIP_STATES = new Set(["ready", "serving", "idle"]);
const LOADED = new Set(["pulling", "starting", "warming", "ready", "serving", "idle", "unloading"]);
const STATE_ORDER = ["serving", "ready", "idle", "warming", "starting", "pulling", "unloading", "error", "offline"];

const ui = {
  rows: document.getElementById("slot-rows"),
  slotsEmpty: document.getElementById("slots-empty"),
  slotsCount: document.getElementById("slots-count"),
  summary: document.getElementById("summary"),
  devices: document.getElementById("devices"),
  events: document.getElementById("events"),
  eventsEmpty: document.getElementById("events-empty"),
  eventsCount: document.getElementById("events-count"),
  flipsToggle: document.getElementById("flips-toggle"),
  conn: document.getElementById("conn"),
  connText: document.getElementById("conn-text"),
  host: document.getElementById("host"),
  dialog: document.getElementById("token-dialog"),
  form: document.getElementById("token-form"),
  tokenInput: document.getElementById("token-input"),
  tokenError: document.getElementById("token-error"),
  tokenChange: document.getElementById("token-change"),
  toasts: document.getElementById("toasts"),
};

const state = {
  token: localStorage.getItem(TOKEN_KEY) || "",
  slots: new Map(), // name -> slot object (GET /api/slots shape)
  devices: [],
  events: [], // newest first, the lease flips apart:
  flips: [], // each request's ready -> serving -> ready, folded unless showFlips
  showFlips: localStorage.getItem(FLIPS_KEY) === "1",
  lastEventId: null,
  stream: null, // AbortController of the running stream
  refreshTimer: null,
  busy: new Map(), // slot name -> the button action in flight
  // slot name -> which way its change rolls out, then the surge's phase (from the plan
  // and rollout events; kept apart from the slot objects, which a refresh replaces)
  rollouts: new Map(),
  rolloutsRead: new Set(), // the slots whose line came from GET /api/slots (its `rollout`)
};

// ------------------------------------------------------------------ small helpers

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "text") el.textContent = value;
    else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else if (key.startsWith("data-")) el.setAttribute(key, value);
    else if (key in el) el[key] = value;
    else el.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

// What admission counts for a slot and why (issue 36); its Memory cell opens the footprint
// view (footprint.js), each part as `slotctl model footprint ID` shows it.
function memoryTitle(slot) {
  const basis = {
    declared: "declared memory_gb",
    estimated: "estimated from the model file",
    observed: "the most its server was seen holding",
    none: "not counted",
  }[slot.memory_basis] || slot.memory_basis;
  return `admission counts ${bytes(slot.memory_bytes)}: ${basis}`;
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = n;
  let unit = 0;
  while (Math.abs(value) >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  const digits = value >= 100 || unit === 0 ? 0 : value >= 10 ? 1 : 2;
  return `${value.toFixed(digits)} ${units[unit]}`;
}

function ago(iso) {
  if (!iso) return "";
  const t = Date.parse(iso);
  if (Number.isNaN(t)) return "";
  const s = Math.max(0, Math.round((Date.now() - t) / 1000));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d`;
}

function clock(seconds) {
  return new Date(seconds * 1000).toLocaleTimeString([], { hour12: false });
}

function toast(message, kind = "") {
  const el = h("div", { class: `toast ${kind}`, role: "status", text: message });
  ui.toasts.append(el);
  setTimeout(() => el.remove(), kind === "err" ? 8000 : 3000);
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// ------------------------------------------------------------------ API

class ApiError extends Error {
  constructor(status, body) {
    const error = (body && body.error) || {};
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.code = error.code || "";
  }
}

async function api(path, options = {}) {
  const headers = { Accept: "application/json", Authorization: `Bearer ${state.token}` };
  const response = await fetch(path, { cache: "no-store", ...options, headers });
  let body = null;
  const text = await response.text();
  if (text) {
    try {
      body = JSON.parse(text);
    } catch {
      body = null;
    }
  }
  if (response.status === 401) {
    askToken("The token was refused. Enter the current one.");
    throw new ApiError(401, body);
  }
  if (!response.ok) throw new ApiError(response.status, body);
  return { status: response.status, body };
}

async function refreshSlots() {
  const { body } = await api("/api/slots");
  const fresh = new Map();
  for (const slot of body.slots) fresh.set(slot.name, slot);
  state.slots = fresh;
  // A rollout in flight is in the slot itself (a page opened mid-rollout shows it); a
  // line read so is dropped once the slot has none (a plan's line waits for its events).
  for (const slot of body.slots) {
    if (slot.rollout) {
      state.rollouts.set(slot.name, rolloutText(slot.rollout));
      state.rolloutsRead.add(slot.name);
    } else if (state.rolloutsRead.delete(slot.name)) {
      state.rollouts.delete(slot.name);
    }
  }
  renderSlots();
}

async function refreshDevices() {
  const { body } = await api("/api/devices");
  state.devices = body.devices;
  renderDevices();
}

function refreshSoon(delay = 300) {
  clearTimeout(state.refreshTimer);
  state.refreshTimer = setTimeout(() => {
    Promise.all([refreshSlots(), refreshDevices(), refreshTraffic()]).catch(() => {});
  }, delay);
}

// ------------------------------------------------------------------ event stream

function parseBlock(block) {
  const event = { id: null, type: "message", data: [] };
  let fields = 0;
  for (const line of block.split("\n")) {
    if (!line || line.startsWith(":")) continue; // comment (keep-alive)
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    fields += 1;
    if (field === "id") event.id = value;
    else if (field === "event") event.type = value;
    else if (field === "data") event.data.push(value);
  }
  if (!fields) return null;
  event.data = event.data.join("\n");
  return event;
}

async function streamEvents(signal) {
  let backoff = 500;
  let first = true;
  while (!signal.aborted) {
    try {
      const headers = { Accept: "text/event-stream", Authorization: `Bearer ${state.token}` };
      if (state.lastEventId !== null) headers["Last-Event-ID"] = state.lastEventId;
      const response = await fetch("/api/events", { headers, signal, cache: "no-store" });
      if (response.status === 401) {
        setConn("unauthorized", "token refused");
        askToken("The token was refused. Enter the current one.");
        return;
      }
      if (!response.ok || !response.body) throw new Error(`HTTP ${response.status}`);
      setConn("live", "live");
      backoff = 500;
      // Subscribed now: (re)read the full state so nothing falls between the two.
      if (first) refreshSoon(0);
      first = false;
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          const event = parseBlock(block);
          if (event) dispatch(event);
        }
      }
      throw new Error("stream ended");
    } catch (err) {
      if (signal.aborted) return;
      setConn("reconnecting", "reconnecting…");
      await sleep(backoff);
      backoff = Math.min(backoff * 2, 15000);
    }
  }
}

function dispatch(message) {
  if (message.id !== null && message.id !== "") state.lastEventId = message.id;
  if (message.type === "gap") {
    refreshSoon(0); // some events are gone: re-read everything
    return;
  }
  let event;
  try {
    event = JSON.parse(message.data);
  } catch {
    return;
  }
  applyEvent(event);
}

function applyEvent(event) {
  if (event.kind === "transition" && event.slot) {
    const slot = state.slots.get(event.slot);
    // A replayed (older) transition never overrides the state read since.
    const newer = slot && event.time * 1000 >= (Date.parse(slot.since) || 0) - 1;
    if (slot && newer) {
      slot.state = event.to;
      slot.since = new Date(event.time * 1000).toISOString();
      slot.message = event.message || "";
      slot.idle_reason = (event.details && event.details.idle_reason) || null;
      slot.residency = (event.details && event.details.residency) || "awake";
      slot.sleep_level = (event.details && event.details.level) || 0;
      if (event.to !== "pulling") slot.pull = null; // its pull is over (or never began)
      // A recreate is over once its new server is up (a surge says "done" itself).
      const way = state.rollouts.get(event.slot) || "";
      if (event.from === "warming" && way.startsWith("recreate")) state.rollouts.delete(event.slot);
      queueRender("slots", isFlip(event) ? null : event.slot);
    }
  }
  if (event.kind === "residency" && event.slot && event.details && event.details.residency) {
    const slot = state.slots.get(event.slot);
    if (slot) {
      slot.residency = event.details.residency; // asleep, waking, awake (the tier of idle)
      queueRender("slots", event.slot);
    }
  }
  if ((event.kind === "plan" || event.kind === "rollout") && event.slot) {
    // Which way a change rolls out (the plan: surge or recreate, and why), then its phases.
    const details = event.details || {};
    if (details.rollout || event.kind === "rollout") state.rolloutsRead.delete(event.slot);
    if (event.kind === "plan" && details.rollout) {
      state.rollouts.set(event.slot, `${details.rollout}: ${details.rollout_reason || ""}`);
      queueRender("slots", event.slot);
    } else if (event.kind === "rollout") {
      const phase = details.phase;
      if (phase === "done") state.rollouts.delete(event.slot);
      else state.rollouts.set(event.slot, phase === "failed" ? event.message : `surge ${phase}: ${event.message}`);
      queueRender("slots", event.slot);
    }
  }
  if (event.kind === "progress" && event.slot && event.details && event.details.phase) {
    // A pulling slot's model files: bytes done of total, rate, ETA (PullProgress.details).
    const slot = state.slots.get(event.slot);
    if (slot && slot.state === "pulling") {
      slot.pull = event.details;
      queueRender("slots");
    }
  }
  if (isFlip(event)) {
    // The slot's request count rides on its flips: the counter moves with no refresh.
    const slot = state.slots.get(event.slot);
    const count = event.details && event.details.requests;
    if (slot && typeof count === "number") slot.requests = Math.max(slot.requests || 0, count);
    state.flips.unshift(event);
    state.flips.length = Math.min(state.flips.length, KEEP_FLIPS);
    queueRender("events");
    return;
  }
  if (event.kind !== "progress" || state.events.length === 0 || state.events[0].kind !== "progress") {
    state.events.unshift(event);
  } else {
    state.events[0] = event; // pull progress replaces itself
  }
  state.events.length = Math.min(state.events.length, KEEP_EVENTS);
  queueRender("events");
  if (event.slot && event.kind !== "progress") refreshSoon(); // a pull's progress: above
}

// A burst of events (a replay, a swap) renders once per animation frame.
const pending = { slots: false, events: false, flash: null, frame: 0 };

function queueRender(what, flash) {
  pending[what] = true;
  if (flash) pending.flash = flash;
  if (pending.frame) return;
  pending.frame = requestAnimationFrame(() => {
    pending.frame = 0;
    if (pending.slots) renderSlots(pending.flash);
    if (pending.events) renderEvents(true);
    pending.slots = pending.events = false;
    pending.flash = null;
  });
}

function setConn(kind, text) {
  ui.conn.dataset.conn = kind;
  ui.connText.textContent = text;
}

// ------------------------------------------------------------------ rendering

function badge(stateName, idleReason, residency, level) {
  let label = stateName;
  if (stateName === "idle" && idleReason === "no_model") label = "idle · no model";
  if (stateName === "idle" && residency === "waking") label = "idle · waking";
  else if (stateName === "idle" && idleReason === "asleep") label = `idle · asleep${level ? " L" + level : ""}`;
  return h("span", { class: "badge" }, h("span", { class: "dot" }), label);
}

function rolloutText(rollout) {
  if (rollout.phase === "failed") return rollout.message;
  return `${rollout.way} ${rollout.phase}: ${rollout.message}`;
}

function duration(seconds) {
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
}

// A pulling slot's model files: a bar, bytes done of total, rate and ETA.
function pullLine(slot) {
  const pull = slot.pull;
  if (slot.state !== "pulling" || !pull) return null;
  const known = typeof pull.percent === "number";
  const words = [known ? `${pull.percent.toFixed(1)}%` : pull.phase || "pulling"];
  words.push(pull.bytes_total ? `${bytes(pull.bytes_done)} / ${bytes(pull.bytes_total)}` : bytes(pull.bytes_done));
  if (pull.rate_bps > 0) words.push(`${bytes(pull.rate_bps)}/s`);
  if (typeof pull.eta_s === "number") words.push(`ETA ${duration(pull.eta_s)}`);
  if (pull.phase && pull.phase !== "downloading") words.push(pull.phase);
  const text = words.join(" · ");
  const fill = h("div", { class: "pull-fill" });
  fill.style.width = `${known ? Math.min(100, Math.max(0, pull.percent)) : 0}%`;
  return h(
    "div",
    { class: "slot-pull", title: `pulling ${pull.source || ""}: ${text}`, "data-percent": known ? String(pull.percent) : "" },
    h("div", { class: "pull-bar", role: "progressbar", "aria-valuemin": "0", "aria-valuemax": "100", "aria-valuenow": known ? String(Math.round(pull.percent)) : null }, fill),
    h("span", { class: "pull-text", text }),
  );
}

function rolloutLine(text) {
  return text ? h("div", { class: "slot-sub slot-rollout", title: text, text }) : null;
}

function slotRow(slot, flash) {
  const pending = state.busy.get(slot.name);
  const busy = pending !== undefined;
  const asleep = slot.idle_reason === "asleep"; // the residency tier: a load wakes it
  const canLoad = !busy && (!LOADED.has(slot.state) || asleep) && Boolean(slot.model_id);
  const canUnload = !busy && slot.state !== "offline" && slot.state !== "unloading";
  const isError = slot.state === "error";
  const sub = slot.message
    ? h("div", { class: `slot-sub${isError ? " err" : ""}`, title: slot.message, text: slot.message })
    : h("div", { class: "slot-sub", text: slot.stack ? `stack ${slot.stack}` : "" });
  const row = h(
    "tr",
    { "data-slot": slot.name, "data-state": slot.state, "data-residency": slot.residency || "awake", class: flash ? "flash" : "" },
    h("td", { class: "c-state" }, badge(slot.state, slot.idle_reason, slot.residency, slot.sleep_level), h("div", { class: "c-since", title: "in this state since", "data-since": slot.since, text: ago(slot.since) })),
    h(
      "td",
      {},
      h("div", { class: "slot-name" }, slot.name, slot.pinned ? h("span", { class: "pin", title: "pinned: never evicted", text: "pinned" }) : null, slot.unit ? h("span", { class: "pin unit", title: `unit ${slot.unit}: loads, evicts and sleeps with its members`, text: `unit ${slot.unit}` }) : null, slot.replica_of ? h("span", { class: "pin replica", title: `replica ${slot.replica_index} of ${slot.replica_of}: the same model, its own server`, text: `replica ${slot.replica_index} of ${slot.replica_of}` }) : null),
      sub,
      pullLine(slot),
      rolloutLine(state.rollouts.get(slot.name)),
    ),
    h("td", {}, h("span", { class: "model", text: slot.model_id || "—" })),
    h("td", { class: "c-device" }, h("span", { class: "device", title: slot.device, text: placedOn(slot) })),
    h("td", { class: "c-num", text: String(slot.priority) }),
    ...trafficCells(slot),
    h("td", { class: "c-num c-mem" }, h("button", { type: "button", class: "ghost mem", "data-action": "footprint", title: `${memoryTitle(slot)} (click: each part)`, onclick: () => openFootprint(slot) }, bytes(slot.memory_bytes))),
    h(
      "td",
      { class: "c-actions" },
      h("button", { type: "button", class: `load${pending === "load" ? " busy" : ""}`, "data-action": "load", disabled: !canLoad, title: `load ${slot.name}`, onclick: () => act(slot.name, "load") }, "Load"),
      h("button", { type: "button", class: `unload${pending === "unload" ? " busy" : ""}`, "data-action": "unload", disabled: !canUnload, title: `unload ${slot.name}`, onclick: () => act(slot.name, "unload") }, "Unload"),
      h("button", { type: "button", class: "ghost logs", "data-action": "logs", title: `the last lines of ${slot.name}'s server, followed`, onclick: () => openLogs(slot.name) }, "Log"),
    ),
  );
  return row;
}

function renderSlots(changed) {
  const slots = [...state.slots.values()];
  // a slot's replicas right after it, in index order
  const at = new Map(slots.map((s, i) => [s.name, i]));
  const group = (s) => at.get(s.replica_of || s.name) ?? at.get(s.name);
  slots.sort((a, b) => group(a) - group(b) || (a.replica_index || 0) - (b.replica_index || 0));
  ui.rows.replaceChildren(...slots.map((s) => slotRow(s, s.name === changed)));
  ui.slotsEmpty.hidden = slots.length > 0;
  ui.slotsCount.textContent = slots.length ? `${slots.length} slot${slots.length === 1 ? "" : "s"}` : "";
  const counts = new Map();
  let leases = 0;
  for (const s of slots) {
    counts.set(s.state, (counts.get(s.state) || 0) + 1);
    leases += s.leases;
  }
  const chips = STATE_ORDER.filter((name) => counts.has(name)).map((name) =>
    h("span", { class: "chip", "data-state": name }, h("span", { class: "dot" }), h("span", { class: "n", text: String(counts.get(name)) }), name),
  );
  if (slots.length) chips.push(h("span", { class: "chip" }, h("span", { class: "n", text: String(leases) }), leases === 1 ? "lease" : "leases"));
  const queued = queuedTotal(slots);
  if (queued) chips.push(h("span", { class: "chip queued", title: "requests waiting for a cold load" }, h("span", { class: "n", text: String(queued) }), "queued"));
  ui.summary.replaceChildren(...chips);
}

function seg(cls, from, width) {
  const el = h("div", { class: `seg ${cls}` });
  el.style.left = `${from}%`;
  el.style.width = `${Math.max(0, width)}%`;
  return el;
}

// Where a slot runs: its GPUs once placed ("gpu:0,1"), else what it declares ("gpu").
function placedOn(slot) {
  if (slot.gpus && slot.gpus.length) return `gpu:${slot.gpus.join(",")}`;
  return slot.device;
}

function deviceCard(dev) {
  const admitted = dev.admitted_bytes || 0;
  const budget = dev.budget_bytes;
  const total = dev.total_bytes;
  const free = dev.free_bytes;
  const card = h("div", { class: "device-card", "data-device": dev.device });
  const title = dev.name ? `${dev.device} · ${dev.name}` : dev.device;
  const names = dev.slots.length ? `: ${dev.slots.join(", ")}` : "";
  card.append(
    h(
      "div",
      { class: "dev-head" },
      h("span", { class: "dev-name", title: dev.uuid || "", text: title }),
      h("span", { class: "dev-src", text: `${dev.slots.length} slot${dev.slots.length === 1 ? "" : "s"}${names} · ${dev.source ? `probe: ${dev.source}` : "no probe"}` }),
    ),
  );
  if (dev.error) {
    const held = dev.slots.length ? `recorded here: ${dev.slots.join(", ")}` : "nothing new is placed here";
    card.append(h("p", { class: "muted", text: `cannot be read: ${dev.error} (${held})` }));
    return card;
  }
  // slotctl's promise: admitted against the budget (or the device when no budget is set).
  const cap = budget ?? total;
  if (cap) {
    const pct = (admitted / cap) * 100;
    const reserved = dev.reserved_bytes || 0;
    const bar = h("div", { class: "bar", title: `admitted ${bytes(admitted)} of ${bytes(cap)} (resident ${bytes(dev.resident_bytes || 0)}, loading ${bytes(reserved)})` });
    const up = Math.min(100, ((admitted - reserved) / cap) * 100);
    bar.append(seg(pct > 100 ? "over" : "admitted", 0, up), seg("loading", up, Math.max(0, Math.min(100, pct) - up)));
    card.append(
      h("div", { class: "bar-label" }, h("span", {}, "admitted ", h("b", { text: bytes(admitted) })), h("span", {}, budget !== null && budget !== undefined ? "budget " : "device ", h("b", { text: bytes(cap) }))),
      bar,
    );
  }
  // The device as probed: in use by us (admitted) and others, free.
  if (total) {
    const used = Math.max(0, total - (free ?? total));
    const ours = Math.min(admitted, used);
    const bar = h("div", { class: "bar", title: `${bytes(free)} free of ${bytes(total)}` });
    bar.append(seg("admitted", 0, (ours / total) * 100), seg("other", (ours / total) * 100, ((used - ours) / total) * 100));
    if (budget) {
      const marker = h("div", { class: "marker", title: `budget ${bytes(budget)}` });
      marker.style.left = `${Math.min(100, (budget / total) * 100)}%`;
      bar.append(marker);
    }
    card.append(h("div", { class: "bar-label" }, h("span", {}, "free ", h("b", { text: bytes(free) })), h("span", {}, "of ", h("b", { text: bytes(total) }))), bar);
  } else if (!cap) {
    card.append(h("p", { class: "muted", text: "no probe and no memory_budget_gb: loads here are refused" }));
  }
  return card;
}

function renderDevices() {
  if (!state.devices.length) {
    ui.devices.replaceChildren(h("p", { class: "muted", text: "No devices in use." }));
    return;
  }
  ui.devices.replaceChildren(...state.devices.map(deviceCard));
}

function eventItem(event, fresh) {
  if (event.kind === "requests") return burstItem(event, fresh);
  const main = h("div", { class: "ev-main" });
  if (event.kind !== "transition") main.append(h("span", { class: `ev-kind k-${event.kind}`, text: event.kind }));
  if (event.slot) main.append(h("span", { class: "ev-slot", text: event.slot }));
  if (event.kind === "transition") {
    main.append(h("span", { class: "ev-from", text: `${event.from} →` }), h("span", { class: "ev-to", "data-state": event.to, text: event.to }));
  } else if (event.op && event.op !== event.kind) {
    main.append(h("span", { class: "muted", text: event.op }));
  }
  const failed = Boolean(event.error) || event.kind === "refusal" || event.kind === "error";
  const message = (event.message || "").replace(/\b(\d{6,}) bytes\b/g, (_, n) => bytes(Number(n)));
  const text = event.error && !message.includes(event.error) ? `[${event.error}] ${message}` : message;
  return h(
    "li",
    { class: fresh ? "new" : "", "data-kind": event.kind, "data-id": String(event.id) },
    h("span", { class: "ev-time", text: clock(event.time) }),
    main,
    text ? h("div", { class: `ev-msg${failed ? " err" : ""}`, title: text, text }) : null,
  );
}

function renderEvents(fresh) {
  const shown = shownEvents();
  ui.events.replaceChildren(...shown.map((e, i) => eventItem(e, fresh && i === 0)));
  ui.eventsEmpty.hidden = shown.length > 0;
  ui.eventsCount.textContent = shown.length ? `last ${shown.length}` : "";
}

ui.flipsToggle.checked = state.showFlips;
ui.flipsToggle.addEventListener("change", () => {
  state.showFlips = ui.flipsToggle.checked;
  localStorage.setItem(FLIPS_KEY, state.showFlips ? "1" : "0");
  renderEvents(false);
});

function tick() {
  for (const cell of ui.rows.querySelectorAll("[data-since]")) cell.textContent = ago(cell.dataset.since);
}

// ------------------------------------------------------------------ actions

async function act(name, action) {
  state.busy.set(name, action);
  renderSlots();
  try {
    let result;
    try {
      result = await api(`/api/slots/${encodeURIComponent(name)}/${action}`, { method: "POST" });
    } catch (err) {
      if (action === "unload" && err.code === "slot.pinned" && confirm(`${name} is pinned. Unload it anyway?`)) {
        result = await api(`/api/slots/${encodeURIComponent(name)}/unload?force=true`, { method: "POST" });
      } else {
        throw err;
      }
    }
    const status = result.body && result.body.status;
    toast(`${name}: ${status || action}`, "ok");
  } catch (err) {
    if (err.status !== 401) toast(`${name}: ${err.message}`, "err");
  } finally {
    state.busy.delete(name);
    renderSlots();
    refreshSoon(0);
  }
}

// ------------------------------------------------------------------ token and start

function askToken(message) {
  ui.tokenError.hidden = !message;
  ui.tokenError.textContent = message || "";
  ui.tokenInput.value = "";
  if (!ui.dialog.open) ui.dialog.showModal();
  ui.tokenInput.focus();
}

ui.form.addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const token = ui.tokenInput.value.trim();
  if (!token) return;
  state.token = token;
  try {
    await api("/api/slots");
  } catch (err) {
    if (err.status !== 401) {
      ui.tokenError.hidden = false;
      ui.tokenError.textContent = `Cannot reach the API: ${err.message}`;
    }
    return;
  }
  localStorage.setItem(TOKEN_KEY, token);
  ui.dialog.close();
  start();
});

ui.dialog.addEventListener("cancel", (ev) => {
  if (!state.token) ev.preventDefault(); // nothing to show without a token
});

ui.tokenChange.addEventListener("click", () => askToken(""));

function start() {
  if (state.stream) state.stream.abort();
  state.stream = new AbortController();
  state.lastEventId = "0"; // first connect: replay the buffered history for the list
  state.events = [];
  state.flips = [];
  setConn("connecting", "connecting");
  Promise.all([
    refreshSlots(),
    refreshDevices(),
    refreshTraffic(),
    refreshKeys(),
    refreshAliases(),
    refreshAdapters(),
  ]).catch((err) => {
    if (err.status !== 401) toast(`Cannot read the state: ${err.message}`, "err");
  });
  streamEvents(state.stream.signal);
}

ui.host.textContent = location.host;
setInterval(tick, 1000);
setInterval(() => {
  if (state.token && ui.conn.dataset.conn === "live") refreshDevices().catch(() => {});
}, 5000);
setInterval(() => {
  // the traffic samples (every 2 s) and the slots' counters with them
  if (state.token && ui.conn.dataset.conn === "live") {
    Promise.all([
      refreshSlots(),
      refreshTraffic(),
      refreshKeys(),
      refreshAliases(),
      refreshAdapters(),
    ]).catch(() => {});
  }
}, 2000);
setupLogs();
setupFootprint();
// ------------------------------------------------------------------ one-time login link

// `slotctl up` / `slotctl dashboard` print http://HOST/#login=CODE: the fragment is never
// sent to a server; the code is exchanged once for the token, then leaves the address bar
// and the history entry.
async function loginWithCode(code) {
  history.replaceState(null, "", location.pathname + location.search);
  let body = null;
  let status = 0;
  try {
    const response = await fetch("/api/login", {
      method: "POST",
      cache: "no-store",
      headers: { Accept: "application/json", "Content-Type": "application/json" },
      body: JSON.stringify({ code }),
    });
    status = response.status;
    body = await response.json().catch(() => null);
  } catch (err) {
    askToken(`Cannot reach the API: ${err.message}`);
    return;
  }
  if (status !== 200 || !body || !body.token) {
    const error = (body && body.error) || {};
    if (state.token) {
      toast(error.message || `login link refused (HTTP ${status})`, "err");
      start();
    } else {
      askToken(error.message || `The login link was refused (HTTP ${status}).`);
    }
    return;
  }
  state.token = body.token;
  localStorage.setItem(TOKEN_KEY, body.token);
  if (ui.dialog.open) ui.dialog.close();
  start();
}

const loginCode = new URLSearchParams(location.hash.slice(1)).get("login");
if (loginCode) loginWithCode(loginCode);
else if (state.token) start();
else askToken("");
