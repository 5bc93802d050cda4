/*
 * The chat page of `lmc serve`: plain JavaScript, no build step.
 *
 * It is a client of the server's own OpenAI-compatible API, like any other:
 * GET v1/models for the header, POST v1/chat/completions streamed as
 * server-sent events (read from fetch's ReadableStream, since EventSource
 * cannot POST or send a header). Conversations and settings live in this
 * browser's localStorage; nothing is kept on the server. Model output is
 * untrusted: its markdown is rendered with raw HTML escaped and the result
 * sanitized (DOMPurify) before it enters the page; the page's
 * Content-Security-Policy runs no script but these files.
 */
"use strict";

const STORE = { settings: "lmc.settings", conversations: "lmc.conversations", current: "lmc.current" };
const DEFAULT_SETTINGS = { system: "", temperature: 0.7, top_p: 0.95, max_tokens: null, api_key: "" };

const $ = (id) => document.getElementById(id);

let settings = loadSettings();
/** [{id, title, updated, messages: [{role, content, stats?, error?, stopped?}]}], newest first */
let conversations = loadConversations();
/** the conversation shown; null: a new chat, stored once its first message is sent */
let currentId = localStorage.getItem(STORE.current);
/** {id, n_ctx} from v1/models, or null while unknown */
let model = null;
/** the reply being streamed: {controller, conversation, reply}, or null */
let generation = null;

// ---------------------------------------------------------------- storage

function loadJSON(key, fallback) {
  try {
    const text = localStorage.getItem(key);
    return text === null ? fallback : JSON.parse(text);
  } catch (e) {
    return fallback;   // unreadable (hand-edited, or another version's): start afresh rather than break
  }
}

function loadSettings() {
  return { ...DEFAULT_SETTINGS, ...loadJSON(STORE.settings, {}) };
}

function loadConversations() {
  const list = loadJSON(STORE.conversations, []);
  if (!Array.isArray(list)) return [];
  for (const c of list) {
    for (const m of c.messages || []) {
      // a reply that was streaming when the page went away ends as stopped
      if (m.pending) { delete m.pending; m.stopped = true; }
    }
  }
  return list.filter((c) => c && c.id && Array.isArray(c.messages));
}

function store(key, value) {
  try {
    localStorage.setItem(key, typeof value === "string" ? value : JSON.stringify(value));
  } catch (e) {
    showBanner(`Could not save to this browser's storage (${e.message}): delete old conversations to make room.`);
  }
}

function saveConversations() {
  store(STORE.conversations, conversations);
  if (currentId) store(STORE.current, currentId); else localStorage.removeItem(STORE.current);
}

function current() {
  return conversations.find((c) => c.id === currentId) || null;
}

// ---------------------------------------------------------------- the API

function apiHeaders() {
  const h = { "Content-Type": "application/json" };
  if (settings.api_key) h.Authorization = `Bearer ${settings.api_key}`;
  return h;
}

/** The message of a refused request: the API's {"error": {"message"}} when it sent one. */
async function errorMessage(res) {
  let text = "";
  try {
    text = await res.text();
    const body = JSON.parse(text);
    if (body && body.error && body.error.message) text = body.error.message;
  } catch (e) { /* not JSON: the text as it came */ }
  if (res.status === 401) {
    return settings.api_key
      ? `The API key in Settings was refused (HTTP 401: ${text}).`
      : `This server needs an API key: enter it in Settings (HTTP 401: ${text}).`;
  }
  return `HTTP ${res.status}${text ? ": " + text : ""}`;
}

/** What fetch itself throws when the server cannot be reached. */
function networkMessage(e) {
  return `Cannot reach the server (${e.message}).`;
}

async function loadModel() {
  let res;
  try {
    res = await fetch("v1/models", { headers: apiHeaders() });
  } catch (e) {
    showBanner(networkMessage(e));
    return;
  }
  if (!res.ok) {
    model = null;
    renderHeader();
    showBanner(await errorMessage(res), res.status === 401);
    return;
  }
  const card = ((await res.json()).data || [])[0];
  model = card ? { id: card.id, n_ctx: card.meta && card.meta.n_ctx } : null;
  renderHeader();
  renderMessages();   // the statistics show the context's size now that it is known
  hideBanner();
}

/**
 * The data of each server-sent event in a response body, as it arrives.
 * Only `data:` lines matter to this API; comments (`:`) and other fields
 * are skipped, and a line may arrive split across reads.
 */
async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let data = [];
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let nl;
      while ((nl = buffer.indexOf("\n")) >= 0) {
        let line = buffer.slice(0, nl);
        buffer = buffer.slice(nl + 1);
        if (line.endsWith("\r")) line = line.slice(0, -1);
        if (line === "") {            // a blank line ends an event
          if (data.length) yield data.join("\n");
          data = [];
        } else if (line.startsWith("data:")) {
          data.push(line.slice(5).replace(/^ /, ""));
        }
      }
    }
    if (data.length) yield data.join("\n");
  } finally {
    reader.releaseLock();
  }
}

/** The request's messages: the system prompt, then the turns (failed replies left out). */
function requestMessages(conv) {
  const out = [];
  if (settings.system.trim()) out.push({ role: "system", content: settings.system });
  for (const m of conv.messages) {
    if (m.pending || (m.error && !m.content)) continue;
    out.push({ role: m.role, content: m.content });
  }
  return out;
}

/**
 * Stream a reply to the end of `conv` (which ends with a user message).
 * A request refused before any text (HTTP 4xx/5xx, no server) leaves no
 * reply: `onRefused(message)` decides what the user sees; an error after
 * some text (a stream's error event, a lost connection) is kept in the
 * reply, under its text.
 */
async function generate(conv, onRefused) {
  const reply = { role: "assistant", content: "", pending: true };
  const body = {
    messages: requestMessages(conv),
    stream: true,
    stream_options: { include_usage: true },
    temperature: settings.temperature,
    top_p: settings.top_p,
  };
  if (model) body.model = model.id;
  if (settings.max_tokens) body.max_tokens = settings.max_tokens;
  conv.messages.push(reply);
  conv.updated = Date.now();
  const controller = new AbortController();
  generation = { controller, conversation: conv, reply };
  renderBusy();
  renderMessages();

  const started = performance.now();
  let firstAt = null, pieces = 0, usage = null, finish = null, refused = null;
  try {
    const res = await fetch("v1/chat/completions", {
      method: "POST", headers: apiHeaders(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!res.ok) {
      refused = await errorMessage(res);
    } else {
      for await (const data of sseData(res.body)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
        if (chunk.usage) usage = chunk.usage;
        const choice = (chunk.choices || [])[0];
        if (!choice) continue;
        const text = choice.delta && choice.delta.content;
        if (text) {
          if (firstAt === null) firstAt = performance.now();
          reply.content += text;
          pieces += 1;
          scheduleRender(conv, reply);
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      if (finish === null && !controller.signal.aborted) throw new Error("the stream ended before the reply did");
    }
  } catch (e) {
    if (e.name === "AbortError") reply.stopped = true;
    else if (!reply.content) refused = e instanceof TypeError ? networkMessage(e) : e.message;
    else reply.error = e instanceof TypeError ? networkMessage(e) : e.message;
  }
  const ended = performance.now();
  delete reply.pending;
  generation = null;
  if (refused !== null && !reply.content) {
    conv.messages.splice(conv.messages.indexOf(reply), 1);
    onRefused(refused);
  } else {
    reply.stats = replyStats(started, firstAt, ended, usage, pieces, finish);
    // cut by the request's max_tokens, or (without one) by the end of the context
    if (finish === "length") reply.stats.limit = body.max_tokens ? "max_tokens" : "context";
    hideBanner();
  }
  conv.updated = Date.now();
  saveConversations();
  renderBusy();
  renderSidebar();
  renderMessages();
}

/**
 * Statistics of one reply. Tokens: the server's count (usage); a stopped
 * reply has none, so its streamed pieces stand in (about a token each).
 * tok/s: tokens after the first over the time after the first, the
 * generation speed without the prompt's processing, which TTFT shows.
 */
function replyStats(started, firstAt, ended, usage, pieces, finish) {
  const tokens = usage ? usage.completion_tokens : pieces;
  const stats = { tokens, exact: Boolean(usage), finish };
  if (firstAt !== null) {
    stats.ttft_ms = Math.round(firstAt - started);
    stats.tok_s = tokens > 1 && ended > firstAt ? (tokens - 1) / ((ended - firstAt) / 1000) : null;
  }
  if (usage) stats.context = usage.prompt_tokens + usage.completion_tokens;
  return stats;
}

function statsText(s) {
  const parts = [`${s.exact ? "" : "~"}${s.tokens} ${s.tokens === 1 ? "token" : "tokens"}`];
  if (s.tok_s != null) parts.push(`${s.tok_s.toFixed(1)} tok/s`);
  if (s.ttft_ms != null) parts.push(`TTFT ${s.ttft_ms} ms`);
  if (s.context != null) parts.push(`context ${s.context}${model && model.n_ctx ? " / " + model.n_ctx : ""}`);
  if (s.finish === "length") parts.push(s.limit === "context" ? "the context is full" : "max_tokens reached");
  return parts.join(" · ");
}

// ---------------------------------------------------------------- actions

function send() {
  const input = $("input");
  const text = input.value;
  if (!text.trim() || generation) return;
  let conv = current();
  if (!conv) {
    conv = { id: newId(), title: titleOf(text), updated: Date.now(), messages: [] };
    conversations.unshift(conv);
    currentId = conv.id;
  }
  conv.messages.push({ role: "user", content: text });
  input.value = "";
  fitInput();
  saveConversations();
  renderSidebar();
  generate(conv, (message) => {
    // refused before any text: the message goes back to the box, to send again (after fixing the key, say)
    const i = conv.messages.length - 1;
    if (i >= 0 && conv.messages[i].role === "user" && conv.messages[i].content === text) conv.messages.splice(i, 1);
    if (!conv.messages.length) {
      conversations = conversations.filter((c) => c !== conv);
      if (currentId === conv.id) currentId = null;
    }
    if (!$("input").value) { $("input").value = text; fitInput(); }
    showBanner(message, /^(This server needs|The API key)/.test(message));
  });
}

function regenerate() {
  const conv = current();
  if (!conv || generation) return;
  const last = conv.messages[conv.messages.length - 1];
  if (last && last.role === "assistant") conv.messages.pop();
  generate(conv, (message) => showBanner(message, /^(This server needs|The API key)/.test(message)));
}

/** Change a user message and answer it anew: the turns after it go. */
function editMessage(index, text) {
  const conv = current();
  if (!conv || generation || !text.trim()) return;
  conv.messages.splice(index);
  conv.messages.push({ role: "user", content: text });
  if (index === 0) conv.title = titleOf(text);
  generate(conv, (message) => showBanner(message, /^(This server needs|The API key)/.test(message)));
}

function stop() {
  if (generation) generation.controller.abort();   // the server sees the connection close and cancels
}

function newChat() {
  currentId = null;
  saveConversations();
  renderSidebar();
  renderMessages();
  $("input").focus();
}

function switchTo(id) {
  currentId = id;
  saveConversations();
  renderSidebar();
  renderMessages();
}

function deleteConversation(id) {
  const conv = conversations.find((c) => c.id === id);
  if (!conv || !confirm(`Delete the conversation "${conv.title}"?`)) return;
  if (generation && generation.conversation === conv) generation.controller.abort();
  conversations = conversations.filter((c) => c !== conv);
  if (currentId === id) currentId = null;
  saveConversations();
  renderSidebar();
  renderMessages();
}

function newId() {
  return (crypto.randomUUID ? crypto.randomUUID() : `${Date.now()}-${Math.random()}`);
}

function titleOf(text) {
  const line = text.trim().split("\n")[0];
  return line.length > 60 ? line.slice(0, 57) + "…" : line;
}

/** Copy to the clipboard; the Clipboard API needs a secure context (localhost, https), else the old way. */
async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch (e) {
    const area = document.createElement("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    const ok = document.execCommand("copy");
    area.remove();
    return ok;
  }
}

// ---------------------------------------------------------------- rendering

function renderHeader() {
  $("model-name").textContent = model ? model.id : "(model unknown)";
  $("model-ctx").textContent = model && model.n_ctx ? `context ${model.n_ctx}` : "";
  document.title = model ? `${model.id} · lmc chat` : "lmc chat";
}

function showBanner(text, needsKey = false) {
  const banner = $("banner");
  banner.replaceChildren(document.createTextNode(text));
  if (needsKey) {
    const open = document.createElement("button");
    open.type = "button";
    open.textContent = "Open settings";
    open.addEventListener("click", openSettings);
    banner.append(" ", open);
  }
  banner.hidden = false;
}

function hideBanner() {
  $("banner").hidden = true;
}

function renderBusy() {
  $("send").hidden = Boolean(generation);
  $("stop").hidden = !generation;
}

function renderSidebar() {
  const list = $("conversations");
  list.replaceChildren();
  conversations.sort((a, b) => b.updated - a.updated);
  for (const conv of conversations) {
    const item = document.createElement("li");
    item.className = conv.id === currentId ? "active" : "";
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = conv.title || "(untitled)";
    open.title = conv.title;
    open.addEventListener("click", () => switchTo(conv.id));
    const del = document.createElement("button");
    del.type = "button";
    del.className = "delete icon";
    del.textContent = "×";
    del.title = "Delete this conversation";
    del.setAttribute("aria-label", `Delete ${conv.title}`);
    del.addEventListener("click", () => deleteConversation(conv.id));
    item.append(open, del);
    list.append(item);
  }
}

function renderMessages() {
  const box = $("messages");
  const conv = current();
  const messages = conv ? conv.messages : [];
  box.replaceChildren();
  if (!messages.length) {
    const empty = document.createElement("div");
    empty.id = "empty";
    empty.className = "muted";
    empty.textContent = "Send a message to start a conversation.";
    box.append(empty);
  }
  messages.forEach((m, i) => box.append(messageElement(m, i, i === messages.length - 1)));
  box.scrollTop = box.scrollHeight;
}

function messageElement(m, index, isLast) {
  const el = document.createElement("article");
  el.className = `message ${m.role}`;
  const content = document.createElement("div");
  content.className = "content";
  if (m.role === "assistant") renderMarkdown(content, m.content);
  else content.textContent = m.content;     // the user's words as typed
  el.append(content);
  if (m.role === "assistant") {
    if (m.pending && !m.content) content.classList.add("waiting");
    if (m.error) {
      const err = document.createElement("div");
      err.className = "error";
      err.textContent = `Error: ${m.error}`;
      el.append(err);
    }
    const stats = document.createElement("div");
    stats.className = "stats";
    if (m.stats) stats.textContent = statsText(m.stats) + (m.stopped ? " · stopped" : "");
    else if (m.stopped) stats.textContent = "stopped";
    el.append(stats);
  }
  if (!m.pending) el.append(messageActions(m, index, isLast, content));
  return el;
}

function messageActions(m, index, isLast, content) {
  const bar = document.createElement("div");
  bar.className = "actions";
  bar.append(actionButton("Copy", async (b) => flash(b, (await copyText(m.content)) ? "Copied" : "Copy failed")));
  if (m.role === "assistant" && isLast) bar.append(actionButton("Regenerate", regenerate));
  if (m.role === "user") bar.append(actionButton("Edit", () => startEdit(content, index, m.content)));
  // a turn left unanswered (its reply was refused): ask again
  if (m.role === "user" && isLast) bar.append(actionButton("Retry", regenerate));
  return bar;
}

function actionButton(label, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = "link";
  b.textContent = label;
  b.addEventListener("click", () => onClick(b));
  return b;
}

function flash(button, text) {
  const was = button.textContent;
  button.textContent = text;
  setTimeout(() => { button.textContent = was; }, 1200);
}

function startEdit(content, index, text) {
  if (generation) return;
  const area = document.createElement("textarea");
  area.className = "edit";
  area.value = text;
  area.rows = Math.min(12, text.split("\n").length + 1);
  const bar = document.createElement("div");
  bar.className = "actions";
  bar.append(actionButton("Send", () => editMessage(index, area.value)), actionButton("Cancel", renderMessages));
  content.replaceChildren(area, bar);
  area.focus();
}

/**
 * Markdown to sanitized HTML, code blocks highlighted and given a copy
 * button. Raw HTML in the text is shown as text (a model writing about
 * <script> means the word), and DOMPurify removes whatever else could run
 * (javascript: links, event attributes).
 */
function renderMarkdown(el, text) {
  if (!window.marked || !window.DOMPurify) {   // the libraries did not load: plain text is still safe
    el.textContent = text;
    return;
  }
  el.innerHTML = DOMPurify.sanitize(marked.parse(text, { gfm: true, async: false }));
  for (const code of el.querySelectorAll("pre > code")) {
    if (window.hljs) {
      try { hljs.highlightElement(code); } catch (e) { /* an unknown language: left plain */ }
    }
    const pre = code.parentElement;
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "copy-code";
    copy.textContent = "Copy";
    copy.addEventListener("click", async () => flash(copy, (await copyText(code.textContent)) ? "Copied" : "Copy failed"));
    pre.prepend(copy);
  }
}

/**
 * Show a streaming reply's new text, at most once a frame: each render
 * parses the whole reply again (a code fence opened early changes what
 * follows). The view follows the text unless the user scrolled up.
 */
let renderQueued = false;
function scheduleRender(conv, reply) {
  if (renderQueued) return;
  renderQueued = true;
  requestAnimationFrame(() => {
    renderQueued = false;
    if (conv.id !== currentId) return;
    const box = $("messages");
    const last = box.querySelector("article.message.assistant:last-of-type .content");
    if (!last) return;
    const follow = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
    last.classList.remove("waiting");
    renderMarkdown(last, reply.content);
    if (follow) box.scrollTop = box.scrollHeight;
  });
}

function fitInput() {
  const input = $("input");
  input.style.height = "auto";
  const borders = input.offsetHeight - input.clientHeight;   // border-box: the height includes them
  input.style.height = `${Math.min(input.scrollHeight + borders, window.innerHeight * 0.4)}px`;
}

// ---------------------------------------------------------------- settings

function openSettings() {
  $("set-system").value = settings.system;
  $("set-temperature").value = settings.temperature;
  $("set-top-p").value = settings.top_p;
  $("set-max-tokens").value = settings.max_tokens ?? "";
  $("set-api-key").value = settings.api_key;
  $("settings-error").hidden = true;
  $("settings").showModal();
}

/** The form's values, or an error naming the field that is out of range. */
function readSettings() {
  const number = (id, name, lo, hi, integer) => {
    const raw = $(id).value.trim();
    if ($(id).validity.badInput) return { error: `${name} must be a number.` };   // typed text the field cannot read
    if (raw === "") return { value: null };
    const v = Number(raw);
    if (!Number.isFinite(v) || v < lo || v > hi || (integer && !Number.isInteger(v))) {
      return { error: `${name} must be ${integer ? "a whole number" : "a number"} from ${lo} to ${hi}, not "${raw}".` };
    }
    return { value: v };
  };
  const t = number("set-temperature", "Temperature", 0, 2, false);
  const p = number("set-top-p", "Top-p", 0.01, 1, false);
  const n = number("set-max-tokens", "Max tokens", 1, model && model.n_ctx ? model.n_ctx : 1e9, true);
  const error = t.error || p.error || n.error;
  if (error) return { error };
  return {
    value: {
      system: $("set-system").value,
      temperature: t.value ?? DEFAULT_SETTINGS.temperature,
      top_p: p.value ?? DEFAULT_SETTINGS.top_p,
      max_tokens: n.value,
      api_key: $("set-api-key").value.trim(),
    },
  };
}

function saveSettings(event) {
  const read = readSettings();
  if (read.error) {
    event.preventDefault();          // keep the dialog open on the bad field
    $("settings-error").textContent = read.error;
    $("settings-error").hidden = false;
    return;
  }
  const keyChanged = read.value.api_key !== settings.api_key;
  settings = read.value;
  store(STORE.settings, settings);
  if (keyChanged || !model) loadModel();
}

// ---------------------------------------------------------------- wiring

function init() {
  if (window.marked) {
    // raw HTML in a reply is shown as its text
    marked.use({ renderer: { html: (token) => escapeHtml(token.text) } });
  }
  if (window.DOMPurify) {
    // links from a reply open elsewhere, never in place of the chat
    DOMPurify.addHook("afterSanitizeAttributes", (node) => {
      if (node.tagName === "A") { node.setAttribute("target", "_blank"); node.setAttribute("rel", "noopener noreferrer"); }
    });
  }
  if (currentId && !current()) currentId = null;

  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
    else if (e.key === "Escape") stop();
  });
  $("input").addEventListener("input", fitInput);
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("open-settings").addEventListener("click", openSettings);
  $("settings-cancel").addEventListener("click", () => $("settings").close());
  $("settings-form").addEventListener("submit", saveSettings);
  // a wide window shows the sidebar until hidden, a narrow one hides it until shown
  $("toggle-sidebar").addEventListener("click", () => document.body.classList.toggle(
    window.matchMedia("(max-width: 700px)").matches ? "sidebar-shown" : "sidebar-hidden"));
  // another tab changed the conversations: show them, unless this one is streaming into its own copy
  window.addEventListener("storage", (e) => {
    if (e.key === STORE.conversations && !generation) { conversations = loadConversations(); renderSidebar(); renderMessages(); }
    if (e.key === STORE.settings) settings = loadSettings();
  });
  // a reply streaming when the page goes away is kept as far as it came
  window.addEventListener("pagehide", () => { if (generation) saveConversations(); });

  renderHeader();
  renderBusy();
  renderSidebar();
  renderMessages();
  loadModel();
  $("input").focus();
}

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

init();
