// lmc viz: the page. Plain JavaScript, no build step; every datum comes from
// the JSON API (runtime/tools/viz/app.py documents it) and is put on the page
// as text (textContent), never as HTML, except the SVG pictures this server drew.
"use strict";

const state = {
  info: null,        // /api/info
  passes: [],        // /api/passes
  step: 0,           // index of the step shown
  stepData: null,    // /api/step/STEP
  view: "overview",
  layer: 0,
  selected: null,    // name of the node in the panel
  profile: null,     // /api/profile, when lmc viz ran with --profile
  panZoom: null,
  graphKey: null,    // view and layer of the picture shown (zoom is kept while it stays)
  loadToken: 0,      // the latest picture request (older answers are dropped)
};

// --- small helpers -------------------------------------------------------------------------
function $(id) { return document.getElementById(id); }

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    e.append(c instanceof Node ? c : String(c));
  }
  return e;
}

// Paths are relative to the page, so it works at / (lmc viz) and at /viz/ (lmc serve).
// Under lmc serve --api-key, the key is the one the chat page stored in its settings.
function apiKey() {
  try { return (JSON.parse(localStorage.getItem("lmc.settings") || "{}") || {}).api_key || ""; }
  catch (e) { return ""; }
}

async function api(path) {
  const key = apiKey();
  const r = await fetch(path, key ? { headers: { Authorization: `Bearer ${key}` } } : {});
  const isJson = (r.headers.get("content-type") || "").includes("json");
  const body = isJson ? await r.json() : await r.text();
  if (r.status === 401) {
    throw new Error(key ? "The API key stored by the chat page was refused (HTTP 401): correct it in the chat page's Settings, then reload."
                        : "This server needs an API key (HTTP 401): enter it in the chat page's Settings, then reload.");
  }
  if (!r.ok) {
    const msg = isJson && body.error ? (typeof body.error === "string" ? body.error : body.error.message) : null;
    throw new Error(msg || `${r.status} ${r.statusText}`);
  }
  return body;
}

function fmtBytes(n) {
  if (n === undefined || n === null) return "";
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return i ? `${n.toFixed(1)} ${units[i]}` : `${n} B`;
}

function fmtUs(us) { return us >= 1000 ? `${(us / 1000).toFixed(2)} ms` : `${us.toFixed(1)} µs`; }

function showError(where, err) {
  where.replaceChildren(el("p", { class: "error" }, String(err.message || err)));
}

// --- tabs ----------------------------------------------------------------------------------
function setupTabs() {
  for (const b of document.querySelectorAll("#tabs button")) {
    b.addEventListener("click", () => showTab(b.dataset.tab));
  }
}

function showTab(name) {
  for (const b of document.querySelectorAll("#tabs button")) b.classList.toggle("active", b.dataset.tab === name);
  for (const m of document.querySelectorAll("main.tab")) m.classList.toggle("hidden", m.id !== `tab-${name}`);
  if (name === "plan") loadPlan();
  if (name === "profile") renderProfileTab();
}

// --- passes --------------------------------------------------------------------------------
function renderPasses() {
  const list = $("passes");
  list.replaceChildren();
  for (const p of state.passes) {
    const meta = p.index === 0 ? `${p.nodes} nodes` : `${p.nodes} nodes · ${p.ms.toFixed(1)} ms`;
    const li = el("li", { "data-step": p.index, title: p.doc || p.name, onclick: () => selectStep(p.index) },
      el("div", { class: "pass-name" }, `${p.index}. ${p.name}`),
      el("div", { class: "pass-meta" }, meta));
    list.append(li);
  }
}

function markActivePass() {
  for (const li of document.querySelectorAll("#passes li")) {
    li.classList.toggle("active", Number(li.dataset.step) === state.step);
  }
}

async function selectStep(index) {
  state.step = index;
  markActivePass();
  try {
    state.stepData = await api(`api/step/${index}`);
  } catch (e) {
    showError($("diff-summary"), e);
    return;
  }
  renderDiff();
  await loadGraph();
  if (state.selected && nodeSummary(state.selected)) selectNode(state.selected, false);
  else clearNode();
}

function nodeSummary(name) {
  return state.stepData ? state.stepData.nodes.find(n => n.name === name) : null;
}

// --- the diff ------------------------------------------------------------------------------
function nodeLink(name, text) {
  return el("span", { class: "link mono", onclick: () => selectNode(name, true) }, text || `%${name}`);
}

function renderDiff() {
  const d = state.stepData.diff;
  const chips = [];
  if (state.step > 0) {
    chips.push(el("span", { class: "legend-chip", style: "background:#1a9c3c" }), "added",
               el("span", { class: "legend-chip", style: "background:#e07b00" }), "fused",
               el("span", { class: "legend-chip", style: "background:#2f6fd6" }), "changed");
  }
  $("diff-summary").replaceChildren(el("span", {}, d.summary), ...chips);

  const body = $("changes-body");
  body.replaceChildren();
  const section = (title, items, render) => {
    if (!items.length) return;
    body.append(el("div", {}, el("b", {}, `${title} (${items.length})`)),
                el("ul", {}, items.map(render)));
  };
  section("Removed", d.removed, r => el("li", { class: "mono" }, r.text));
  section("Added", d.added, a => el("li", {}, nodeLink(a.name), " ", el("span", { class: "mono" }, a.text)));
  section("Fused", d.fused, f => el("li", {}, nodeLink(f.name), ` ${f.what}: absorbed `,
    f.absorbed.map(a => `%${a}`).join(", "), el("div", { class: "muted small mono" }, f.changes.join("; "))));
  section("Changed", d.changed, c => el("li", {}, nodeLink(c.name), ` ${c.op}: `,
    el("span", { class: "mono small" }, c.changes.join("; "))));
  section("Moved (reordered)", d.moved, m => el("li", {}, nodeLink(m)));
  if (!body.children.length) body.append(el("p", { class: "muted" }, state.step ? "This pass changed nothing here." :
    "The first step: the graph as the frontend built it."));
}

// --- the picture ---------------------------------------------------------------------------
function setupToolbar() {
  $("view").addEventListener("change", () => { state.view = $("view").value; syncToolbar(); loadGraph(); });
  $("layer").addEventListener("change", () => { state.layer = Number($("layer").value); loadGraph(); });
  $("times").addEventListener("change", () => decorateGraph());
}

function syncToolbar() {
  $("view").value = state.view;
  $("layer").value = String(state.layer);
  $("layer-label").classList.toggle("hidden", state.view !== "layer");
  $("times-label").classList.toggle("hidden", !state.profile);
}

async function loadGraph() {
  const token = ++state.loadToken;
  const q = state.view === "layer" ? `view=layer&layer=${state.layer}` : `view=${state.view}`;
  $("graph-status").textContent = "drawing…";
  let text;
  try {
    text = await api(`api/graph/${state.step}.svg?${q}`);
  } catch (e) {
    if (token === state.loadToken) showError($("graph"), e);
    return;
  }
  if (token !== state.loadToken) return;   // a newer request is on its way
  const doc = new DOMParser().parseFromString(text, "image/svg+xml");
  const svg = document.importNode(doc.documentElement, true);
  svg.removeAttribute("width");
  svg.removeAttribute("height");
  const key = q;
  const keep = state.panZoom && state.graphKey === key ? { zoom: state.panZoom.getZoom(), pan: state.panZoom.getPan() } : null;
  if (state.panZoom) { state.panZoom.destroy(); state.panZoom = null; }
  $("graph").replaceChildren(svg);
  state.graphKey = key;
  if (window.svgPanZoom) {
    state.panZoom = window.svgPanZoom(svg, { controlIconsEnabled: true, fit: true, center: true, minZoom: 0.05,
                                              maxZoom: 40, dblClickZoomEnabled: false, zoomScaleSensitivity: 0.3 });
    if (keep) { state.panZoom.zoom(keep.zoom); state.panZoom.pan(keep.pan); }
  }
  setupNodeClicks(svg);
  decorateGraph();
  $("graph-status").textContent = "";
}

// A node's DOT id is its SVG <title>: "node %12" for an op, "@w" (or "@w#%12") for a
// weight, "from %3" / "to %5" for stubs that stand for nodes of other layers.
function titleTarget(g) {
  const t = g.querySelector(":scope > title");
  if (!t) return null;
  const s = t.textContent;
  let m = s.match(/^node %(.+)$/);
  if (m) return { node: m[1], own: true };
  m = s.match(/^(?:from|to) %(.+)$/) || s.match(/^@[^#]*#%(.+)$/);
  if (m) return { node: m[1], own: false };
  return null;
}

function setupNodeClicks(svg) {
  let down = null;   // a drag pans the picture: only a click without movement selects
  svg.addEventListener("mousedown", e => { down = [e.clientX, e.clientY]; });
  for (const g of svg.querySelectorAll("g.node")) {
    const target = titleTarget(g);
    if (!target) continue;
    if (target.own) g.dataset.node = target.node;
    g.addEventListener("click", e => {
      if (down && Math.hypot(e.clientX - down[0], e.clientY - down[1]) > 4) return;
      selectNode(target.node, !target.own);
    });
  }
}

function decorateGraph() {
  const svg = $("graph").querySelector("svg");
  if (!svg || !state.stepData) return;
  const d = state.stepData.diff;
  const kinds = new Map();
  for (const a of d.added) kinds.set(a.name, "viz-added");
  for (const f of d.fused) kinds.set(f.name, "viz-fused");
  for (const c of d.changed) kinds.set(c.name, "viz-changed");
  for (const t of svg.querySelectorAll("text.viz-time, rect.viz-time")) t.remove();
  for (const g of svg.querySelectorAll("g.node[data-node]")) {
    const name = g.dataset.node;
    g.classList.remove("viz-added", "viz-fused", "viz-changed");
    if (kinds.has(name)) g.classList.add(kinds.get(name));
    g.classList.toggle("viz-selected", name === state.selected);
  }
  drawTimes(svg);
}

// lmc profile's times, on the last step only (the graph that was compiled and timed); in the
// overview, a node of the block drawn carries the sum over every layer's copy of it.
function drawTimes(svg) {
  const p = state.profile;
  const status = $("graph-status");
  if (!p || !$("times").checked) return;
  if (!state.stepData.last) { status.textContent = "times: on the last step's graph"; return; }
  const peers = state.view === "overview" ? state.stepData.overview_peers : {};
  const ns = "http://www.w3.org/2000/svg";
  const maxShare = Math.max(...Object.values(p.nodes).map(n => n.share), 1e-9);
  for (const g of svg.querySelectorAll("g.node[data-node]")) {
    const names = peers[g.dataset.node] || [g.dataset.node];
    const hits = names.map(n => p.nodes[n]).filter(Boolean);
    if (!hits.length) continue;
    const us = hits.reduce((a, h) => a + h.us, 0);
    const share = hits.reduce((a, h) => a + h.share, 0);
    const box = g.getBBox();
    const label = `${fmtUs(us)} · ${(100 * share).toFixed(1)}%` + (hits.length > 1 ? ` (${hits.length} layers)` : "");
    const heat = Math.min(1, hits[0].share / maxShare);
    const bg = document.createElementNS(ns, "rect");
    bg.setAttribute("class", "viz-time");
    bg.setAttribute("x", box.x + box.width / 2 - 3.2 * label.length / 1.3);
    bg.setAttribute("y", box.y + box.height + 1);
    bg.setAttribute("width", 6.4 * label.length / 1.3);
    bg.setAttribute("height", 11);
    bg.setAttribute("rx", 2);
    bg.setAttribute("fill", `rgba(225, 87, 89, ${0.15 + 0.7 * heat})`);
    const t = document.createElementNS(ns, "text");
    t.setAttribute("class", "viz-time");
    t.setAttribute("x", box.x + box.width / 2);
    t.setAttribute("y", box.y + box.height + 9);
    t.setAttribute("text-anchor", "middle");
    t.textContent = label;
    g.append(bg, t);
  }
}

// --- a node --------------------------------------------------------------------------------
function clearNode() {
  state.selected = null;
  $("node").replaceChildren();
  $("node-hint").classList.remove("hidden");
  decorateGraph();
}

// Show the picture where a node is drawn: its layer, unless the overview draws it.
async function reveal(name) {
  const n = nodeSummary(name);
  if (!n) return;
  const drawn = state.view === "overview" ? (typeof n.layer !== "number" || n.layer === 0)
    : state.view === "layer" ? n.layer === state.layer : true;
  if (drawn) return;
  if (typeof n.layer === "number") { state.view = "layer"; state.layer = n.layer; }
  else state.view = "overview";
  syncToolbar();
  await loadGraph();
}

// Pan the picture so that a node is in the middle of it.
function centerOn(name) {
  const g = $("graph").querySelector(`g.node[data-node="${CSS.escape(name)}"]`);
  if (!g || !state.panZoom) return;
  const r = g.getBoundingClientRect(), c = $("graph").getBoundingClientRect();
  state.panZoom.panBy({ x: c.left + c.width / 2 - (r.left + r.width / 2), y: c.top + c.height / 2 - (r.top + r.height / 2) });
}

async function selectNode(name, reveal_it) {
  if (!nodeSummary(name)) {
    $("node").replaceChildren(el("p", { class: "error" }, `%${name} is not in step ${state.step}`));
    return;
  }
  state.selected = name;
  if (reveal_it) {
    await reveal(name);
    centerOn(name);
  }
  decorateGraph();
  $("node-hint").classList.add("hidden");
  let n;
  try {
    n = await api(`api/node/${state.step}/${encodeURIComponent(name)}`);
  } catch (e) {
    showError($("node"), e);
    return;
  }
  if (state.selected !== name) return;
  renderNode(n);
}

function valueRow(v, result) {
  const from = result ? "" : v.producer ? nodeLink(v.producer.name, `%${v.producer.name} (${v.producer.op})`) : v.kind;
  const size = v.bytes !== undefined ? fmtBytes(v.bytes) : `${fmtBytes(v.bytes_per_token)} per token`;
  return el("tr", {}, el("td", { class: "mono" }, v.ref), el("td", { class: "mono" }, v.type),
    el("td", {}, v.stored || v.dtype), el("td", { class: "num" }, size), el("td", {}, from));
}

function kvTable(obj) {
  const keys = Object.keys(obj);
  if (!keys.length) return el("p", { class: "muted" }, "none");
  return el("table", {}, keys.map(k => el("tr", {}, el("th", {}, k), el("td", { class: "mono" }, String(obj[k])))));
}

function renderNode(n) {
  const parts = [
    el("h2", {}, `%${n.name} = ${n.label}`),
    el("pre", {}, n.text),
    el("table", {},
      el("tr", {}, el("th", {}, "op"), el("td", {}, n.op)),
      el("tr", {}, el("th", {}, "layer"), el("td", {}, String(n.layer))),
      el("tr", {}, el("th", {}, "position"), el("td", {}, `${n.index} of ${state.stepData.nodes.length}`)),
      el("tr", {}, el("th", {}, "graph output"), el("td", {}, n.is_output ? "yes" : "no"))),
  ];
  if (n.in_diff) {
    const d = n.in_diff;
    const what = d.kind === "added" ? "added by this pass" :
      d.kind === "fused" ? `fused by this pass: ${d.what} (absorbed ${d.absorbed.map(a => "%" + a).join(", ")})` :
      `changed by this pass: ${d.changes.join("; ")}`;
    parts.push(el("p", { class: "note" }, what));
  }
  if (state.profile && state.stepData.last && state.profile.nodes[n.name]) {
    const t = state.profile.nodes[n.name];
    parts.push(el("p", { class: "note" }, `measured: ${fmtUs(t.us)} per ${state.profile.entry} step, ` +
      `${(100 * t.share).toFixed(1)}% of it, ${t.gb_s.toFixed(1)} GB/s`));
  }
  if (n.stream_segments && n.stream_segments.length) {
    parts.push(el("p", {}, `weights streamed in segment ${n.stream_segments.join(", ")}`));
  }
  parts.push(el("h3", {}, "Operands"),
    el("table", {}, el("tr", {}, ["value", "type", "layout", "size", "from"].map(h => el("th", {}, h))),
      n.inputs.map(v => valueRow(v, false))),
    el("h3", {}, "Result"),
    el("table", {}, valueRow(n.output, true)),
    el("h3", {}, "Attributes"), kvTable(n.attrs));
  if (Object.keys(n.kernel_choices).length) parts.push(el("h3", {}, "Kernel choices"), kvTable(n.kernel_choices));
  parts.push(el("h3", {}, "Read by"),
    n.readers.length ? el("p", {}, n.readers.map((r, i) => [i ? ", " : "", nodeLink(r.name, `%${r.name} (${r.op})`)]))
      : el("p", { class: "muted" }, "nothing (a graph output or a state update)"));
  const s = n.signature;
  parts.push(el("h3", {}, "Kernel"),
    el("table", {},
      el("tr", {}, el("th", {}, "symbol"), el("td", { class: "mono" }, s.name)),
      el("tr", {}, el("th", {}, "operands"), el("td", { class: "mono" }, s.in_types.join(", "))),
      el("tr", {}, el("th", {}, "result"), el("td", { class: "mono" }, s.out_type)),
      el("tr", {}, el("th", {}, "specialised on"), el("td", { class: "mono" },
        Object.entries(s.attrs).map(([k, v]) => `${k}=${v}`).join(", ") || "types only"))),
    el("button", { class: "action", id: "show-kernel", onclick: () => loadKernel(n.name) },
      "Show its LLVM IR, assembly and llvm-mca"),
    el("div", { id: "kernel" }));
  $("node").replaceChildren(...parts);
}

async function loadKernel(name) {
  const box = $("kernel");
  box.replaceChildren(el("p", { class: "muted" }, "compiling the kernel…"));
  let k;
  try {
    k = await api(`api/kernel/${state.step}/${encodeURIComponent(name)}`);
  } catch (e) {
    showError(box, e);
    return;
  }
  if (state.selected !== name || !$("kernel")) return;
  if (!k.available) {
    box.replaceChildren(el("p", { class: "note" }, `No native kernel: ${k.reason}. ` +
      "A later pass removes or rewrites this node; pick a later step to see the code it becomes."));
    return;
  }
  const mca = k.mca;
  const mcaText = mca.available ? mca.text : `llvm-mca: ${mca.reason}` + (mca.stderr ? `\n\n${mca.stderr}` : "");
  const views = [
    ["asm", `Assembly (${k.cpu})`, k.asm],
    ["ir", "LLVM IR (as emitted)", k.ir],
    ["ir_optimized", "LLVM IR (optimised, O3)", k.ir_optimized],
    ["mca", "llvm-mca", mcaText],
  ];
  const pre = el("pre", { id: "kernel-code" });
  const tabs = el("div", { class: "code-tabs" });
  const show = key => {
    const v = views.find(x => x[0] === key);
    pre.textContent = v[2];
    pre.dataset.view = key;
    for (const b of tabs.children) b.classList.toggle("active", b.dataset.view === key);
    // the assembly opens at the kernel's first instruction, past its constant pools
    const lines = v[2].split("\n");
    const at = key === "asm" ? lines.findIndex(l => l === `${k.name}:`) : 0;
    pre.scrollTop = at > 0 ? at * (pre.scrollHeight / lines.length) : 0;
  };
  for (const [key, title] of views) tabs.append(el("button", { "data-view": key, onclick: () => show(key) }, title));
  const tuning = Object.entries(k.tuning).map(([a, b]) => `${a}=${b}`).join(", ");
  const facts = [`${k.name}: vector width ${k.vector_width}`, tuning ? `, tuning ${tuning}` : "",
                 `, ${k.asm.split("\n").filter(l => /^\s+[a-z]/.test(l)).length} assembly lines`];
  const notes = [];
  if (mca.note) notes.push(el("p", { class: "note" }, mca.note));
  if (!mca.available) notes.push(el("p", { class: "note" }, `llvm-mca: ${mca.reason}`));
  box.replaceChildren(el("p", { class: "muted" }, facts.join("")), ...notes, tabs, pre);
  show("asm");
}

// --- memory plan ---------------------------------------------------------------------------
let planLoaded = false;

async function loadPlan() {
  if (planLoaded) return;
  let p;
  try {
    p = await api("api/plan");
  } catch (e) {
    showError($("plan-text"), e);
    return;
  }
  planLoaded = true;
  $("plan-text").textContent = p.text;
  const doc = new DOMParser().parseFromString(p.arena_svg, "image/svg+xml");
  $("plan-arena").replaceChildren(document.importNode(doc.documentElement, true));
  const s = p.stream;
  if (!s) {
    $("plan-stream").replaceChildren(el("p", { class: "muted" },
      "Nothing streams: every weight stays resident. Give lmc viz --mem-budget SIZE or --stream layers to see a schedule."));
    return;
  }
  $("plan-stream").replaceChildren(
    el("p", {}, `${s.segments.length} segments read with ${s.io} into two buffers of ${s.buffer}, ` +
      `${fmtBytes(s.read_bytes_per_step)} read per token; segment i goes to buffer i % 2 while the other computes.`),
    el("table", {},
      el("tr", {}, ["#", "segment", "buffer", "size", "reads", "weights", "nodes reading them"].map(h => el("th", {}, h))),
      s.segments.map(g => el("tr", {},
        el("td", { class: "num" }, g.index), el("td", { class: "mono" }, g.name), el("td", { class: "num" }, g.buffer),
        el("td", { class: "num" }, g.size), el("td", { class: "num" }, g.reads),
        el("td", { class: "mono small" }, g.weights.join(", ")),
        el("td", {}, g.nodes.map((x, i) => [i ? ", " : "", el("span", { class: "link mono", onclick: () => {
          showTab("graph"); goToNode(state.passes.length - 1, x); } }, `%${x}`)]))))));
}

// --- profile -------------------------------------------------------------------------------
async function goToNode(step, name) {
  if (state.step !== step) { state.selected = name; await selectStep(step); }
  await selectNode(name, true);
}

function renderProfileTab() {
  const p = state.profile;
  const body = $("profile-body");
  if (!p) {
    body.replaceChildren(el("p", { class: "muted" }, "No profile: start lmc viz with --profile to time every node."));
    return;
  }
  const max = Math.max(...p.top.map(n => n.us), 1e-9);
  body.replaceChildren(el("div", {},
    el("p", {}, `${p.model}, ${p.entry} step on ${p.threads} thread(s), CPU ${p.cpu}: ${fmtUs(p.measured_us)} measured ` +
      `(mean of ${p.steps}), kernels ${fmtUs(p.kernels_us)}, overhead ${fmtUs(p.overhead_us)}. ` +
      "The times are also drawn on the last step's graph."),
    p.note ? el("p", { class: "note" }, p.note) : null,
    el("h3", {}, "Slowest nodes"),
    el("table", { id: "profile-top" },
      el("tr", {}, ["#", "node", "op", "layer", "time", "share", "", "GB/s", "GFLOP/s"].map(h => el("th", {}, h))),
      p.top.map(n => el("tr", { class: "clickable", "data-node": n.name,
                               onclick: () => { showTab("graph"); goToNode(p.step, n.name); } },
        el("td", { class: "num" }, n.index), el("td", { class: "mono" }, `%${n.name}`), el("td", { class: "mono" }, n.op),
        el("td", {}, String(n.layer)), el("td", { class: "num" }, fmtUs(n.us)),
        el("td", { class: "num" }, `${(100 * n.share).toFixed(1)}%`),
        el("td", {}, el("span", { class: "bar", style: `width:${Math.round(120 * n.us / max)}px` })),
        el("td", { class: "num" }, n.gb_s.toFixed(1)), el("td", { class: "num" }, n.gflop_s.toFixed(2))))),
    el("h3", {}, "By op kind"),
    el("table", {},
      el("tr", {}, ["op", "nodes", "time", "share"].map(h => el("th", {}, h))),
      p.kinds.map(k => el("tr", {}, el("td", { class: "mono" }, k.kind), el("td", { class: "num" }, k.nodes),
        el("td", { class: "num" }, fmtUs(k.us)), el("td", { class: "num" }, `${(100 * k.share).toFixed(1)}%`))))));
}

// --- start ---------------------------------------------------------------------------------
function setupKeys() {
  document.addEventListener("keydown", e => {
    if (e.target.closest("input, select, textarea") || $("tab-graph").classList.contains("hidden")) return;
    if (e.key === "ArrowDown" && state.step < state.passes.length - 1) { e.preventDefault(); selectStep(state.step + 1); }
    if (e.key === "ArrowUp" && state.step > 0) { e.preventDefault(); selectStep(state.step - 1); }
  });
}

async function start() {
  setupTabs();
  setupToolbar();
  setupKeys();
  try {
    [state.info, state.passes] = await Promise.all([api("api/info"), api("api/passes")]);
  } catch (e) {
    showError($("graph"), e);
    return;
  }
  const i = state.info;
  $("model-info").textContent = `${i.model} · ${i.graph} · ${i.n_layers} layers · context ${i.ctx} · ` +
    `KV ${i.kv_type} · CPU ${i.cpu} (vector width ${i.vector_width})` + (i.llvm_mca ? "" : " · no llvm-mca on PATH");
  document.title = `lmc viz: ${i.model}`;
  for (let l = 0; l < i.n_layers; l++) $("layer").append(el("option", { value: l }, `layer ${l}`));
  if (i.profile) {
    try { state.profile = await api("api/profile"); } catch (e) { state.profile = null; }
  }
  $("profile-tab").disabled = !state.profile;
  $("profile-tab").title = state.profile ? "" : "start lmc viz with --profile";
  syncToolbar();
  renderPasses();
  await selectStep(state.passes.length - 1);
}

document.addEventListener("DOMContentLoaded", start);
