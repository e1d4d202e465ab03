// slotctl dashboard: a slot's footprint explained (issue 36), from
// GET /api/models/ID/footprint (what `slotctl model footprint ID` prints): each part of
// the estimate read from the model file (weights, the KV cache at the slot's context,
// compute buffers, host memory), the declared, estimated and observed figures, and the one
// admission counts. Opened from a slot's Memory cell; re-read while open.
// Loaded before app.js, whose helpers (h, api, bytes) it uses when called.
"use strict";

const FOOTPRINT_EVERY_MS = 5000;

const footprint = { slot: null, model: null, timer: 0 };

function footprintUi() {
  return {
    panel: document.getElementById("fp-panel"),
    title: document.getElementById("fp-title"),
    state: document.getElementById("fp-state"),
    body: document.getElementById("fp-body"),
    close: document.getElementById("fp-close"),
  };
}

const BASIS_WORDS = {
  declared: "the declared memory_gb",
  estimated: "the estimate from the model file",
  observed: "the most its server was seen holding",
  none: "nothing (not counted)",
};

// One row: a part's name, its bytes (data-bytes: the figure as the API gave it), a detail.
function footprintRow(part, name, value, detail, extra = {}) {
  return h(
    "tr",
    { "data-part": part, "data-bytes": value === null || value === undefined ? "" : String(value), ...extra },
    h("th", { scope: "row", text: name }),
    h("td", { class: "c-num fp-bytes", text: value === null || value === undefined ? "–" : bytes(value) }),
    h("td", { class: "fp-detail", text: detail || "" }),
  );
}

function footprintParts(fp) {
  if (!fp.source) {
    return [h("p", { class: "muted fp-none", "data-part": "no-estimate", text: `no estimate: ${fp.why_not || "not estimated yet"}` })];
  }
  const byType = Object.entries(fp.weights_by_type || {})
    .map(([type, size]) => `${type} ${bytes(size)}`)
    .join(", ");
  const rows = [
    footprintRow(
      "weights",
      "weights",
      fp.weights_bytes,
      `${byType}; ${fp.layers_on_device}/${fp.layers} layers on the device (${bytes(fp.weights_device_bytes)}), ${bytes(fp.weights_host_bytes)} in host memory`,
    ),
    footprintRow(
      "kv",
      "KV cache",
      fp.kv_bytes,
      `at context ${fp.context}, parallel ${fp.parallel}, cache ${fp.cache_type}; ${bytes(fp.kv_host_bytes)} in host memory`,
      { "data-context": String(fp.context) },
    ),
    footprintRow("buffers", "compute buffers", fp.buffers_bytes, ""),
    footprintRow(
      "host",
      "host memory",
      fp.host_bytes,
      `besides the device's: prompt cache ${bytes(fp.prompt_cache_bytes)}, engine ${bytes(fp.engine_bytes)}`,
    ),
  ];
  return [
    h("h3", { class: "fp-head", text: `estimated from its ${fp.source} file` }),
    h("table", { class: "fp-table fp-parts" }, h("tbody", {}, ...rows)),
  ];
}

function footprintFigures(fp) {
  const used = (basis) => (fp.basis === basis ? { class: "fp-used", title: "admission counts this one" } : {});
  const observedDetail =
    fp.observed_bytes === null || fp.observed_bytes === undefined
      ? "not seen yet: learnt once its server has run"
      : `${fp.observed_source}, ${bytes(fp.observed_host_bytes)} in host memory, peak at ${fp.observed_at || "?"}`;
  const rows = [
    footprintRow("declared", "declared", fp.declared_bytes, fp.declared_bytes === null ? "no memory_gb" : "memory_gb", used("declared")),
    footprintRow("estimated", "estimated", fp.estimated_bytes, fp.estimated_bytes === null ? fp.why_not || "" : `on ${fp.device}`, used("estimated")),
    footprintRow("observed", "observed", fp.observed_bytes, observedDetail, used("observed")),
    footprintRow("admitted", "admission counts", fp.admitted_bytes, BASIS_WORDS[fp.basis] || fp.basis, { class: "fp-admitted", "data-basis": fp.basis }),
  ];
  const out = [h("h3", { class: "fp-head", text: "what admission counts" }), h("table", { class: "fp-table fp-figures" }, h("tbody", {}, ...rows))];
  for (const note of fp.notes || []) out.push(h("p", { class: "muted fp-note", text: note }));
  if (fp.warning) out.push(h("p", { class: "fp-warning err", text: fp.warning }));
  return out;
}

function renderFootprint(fp) {
  const ui = footprintUi();
  ui.panel.dataset.basis = fp.basis;
  ui.body.replaceChildren(
    h("p", { class: "fp-lead", text: `${fp.model} on ${fp.slot} (${fp.provider}, device ${fp.device})` }),
    ...footprintParts(fp),
    ...footprintFigures(fp),
  );
}

async function pollFootprint() {
  clearTimeout(footprint.timer);
  const { slot, model } = footprint;
  if (!slot) return;
  const ui = footprintUi();
  try {
    const { body } = await api(`/api/models/${encodeURIComponent(model)}/footprint`);
    if (footprint.slot !== slot) return; // another slot opened meanwhile
    const fp = (body.slots || []).find((s) => s.slot === slot);
    if (fp) {
      renderFootprint(fp);
      ui.state.textContent = "";
    } else {
      ui.body.replaceChildren(h("p", { class: "muted", text: `${slot} no longer binds ${model}` }));
    }
  } catch (err) {
    if (footprint.slot !== slot) return;
    ui.state.textContent = `cannot read: ${err.message}`;
  }
  footprint.timer = setTimeout(pollFootprint, FOOTPRINT_EVERY_MS);
}

function openFootprint(slot) {
  const ui = footprintUi();
  if (!slot.model_id) {
    toast(`${slot.name}: no model bound, no footprint`, "err");
    return;
  }
  footprint.slot = slot.name;
  footprint.model = slot.model_id;
  ui.title.textContent = `Footprint · ${slot.name}`;
  ui.panel.dataset.slot = slot.name;
  ui.body.replaceChildren();
  ui.state.textContent = "reading…";
  ui.panel.hidden = false;
  pollFootprint();
  ui.panel.scrollIntoView({ block: "nearest" });
}

function closeFootprint() {
  clearTimeout(footprint.timer);
  footprint.slot = null;
  footprintUi().panel.hidden = true;
}

function setupFootprint() {
  footprintUi().close.addEventListener("click", closeFootprint);
}
