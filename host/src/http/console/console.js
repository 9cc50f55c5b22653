// The idem console: plain JavaScript over the host's own endpoints (/admin/*, /metrics,
// /readyz). No library, no network beyond this host. Message data is only ever put in the
// page as text, never as markup.
"use strict";

const OUTCOMES = ["applied", "duplicate", "stale", "skipped", "rejected", "retried"];
const POLL_MS = 2000;
const WINDOW_MS = 5 * 60 * 1000; // the charts' span once the host has run that long
const MIN_SPAN_MS = 60 * 1000; // their narrowest span
const TOKEN_KEY = "idem-admin-token";

const $ = (selector) => document.querySelector(selector);

/** An element with attributes and children (strings become text nodes). */
function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (value !== false && value !== null && value !== undefined) node.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function notice(text, isError = false) {
  const box = $("#notice");
  box.textContent = text;
  box.className = isError ? "error" : "";
  box.hidden = !text;
}

function age(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  if (seconds < 60) return `${seconds}s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)}m`;
  if (seconds < 86400) return `${Math.floor(seconds / 3600)}h${String(Math.floor((seconds % 3600) / 60)).padStart(2, "0")}m`;
  return `${Math.floor(seconds / 86400)}d${String(Math.floor((seconds % 86400) / 3600)).padStart(2, "0")}h`;
}

// --- the admin API, with the token kept for this browser session ------------------------

let asking = null; // the token dialog's answer while it is open: every call waits for the one
let declined = false; // the dialog was cancelled: polls stop asking until the button is used

/** Asks for the admin token; resolves to whether one was given. */
function askToken(reason) {
  if (asking) return asking;
  const dialog = $("#token-dialog");
  $("#token-reason").textContent = reason;
  $("#token-input").value = "";
  asking = new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      const token = $("#token-input").value.trim();
      asking = null;
      if (dialog.returnValue === "ok" && token) {
        sessionStorage.setItem(TOKEN_KEY, token);
        declined = false;
        resolve(true);
      } else {
        declined = true;
        resolve(false);
      }
    }, { once: true });
    dialog.showModal();
  });
  return asking;
}

/** Calls the host; on 401 asks for the token once and tries again. Resolves to {status, body}. */
async function api(method, path, body) {
  for (let attempt = 0; attempt < 2; attempt++) {
    const headers = {};
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (token) headers.Authorization = `Bearer ${token}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    let response;
    try {
      response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
    } catch (error) {
      return { status: 0, body: { error: `the host does not answer: ${error.message}` } };
    }
    const text = await response.text();
    let parsed;
    try { parsed = JSON.parse(text); } catch { parsed = { error: text.trim() }; }
    if (response.status === 401 && attempt === 0) {
      // Another call may have been given a token while this one was out: try with it.
      const current = sessionStorage.getItem(TOKEN_KEY);
      if (current && current !== token) continue;
      sessionStorage.removeItem(TOKEN_KEY);
      const why = token ? "The admin token was refused; enter it again." : "This host requires its admin token.";
      if (!declined && await askToken(why)) continue;
    }
    return { status: response.status, body: parsed };
  }
  return { status: 401, body: { error: "admin token required" } };
}

// --- pipelines --------------------------------------------------------------------------

const history = new Map(); // pipeline -> [{at (ms), counts: {outcome: n}}], oldest first
let depths = {}; // pipeline -> the last depths the host read from the broker; OUTBOX -> its backlog
const OUTBOX = "(outbox)";
let pipelines = [];

/** Seeds the charts with the host's own last minutes (`/admin/history`), and the depths. */
async function readHistory(seed) {
  const { status, body } = await api("GET", "/admin/history");
  if (status !== 200) return;
  depths = body.depths;
  if (!seed) return;
  for (const sample of body.samples) {
    for (const [name, counts] of Object.entries(sample.pipelines)) {
      const samples = history.get(name) || [];
      samples.push({ at: sample.at * 1000, counts });
      history.set(name, samples);
    }
  }
}

/** Counters of the Prometheus text: {pipeline: {outcome: n}} and {pipeline: {sqlstate: n}}. */
function parseMetrics(text) {
  const outcomes = {}, retries = {};
  const label = (labels, name) => (labels.match(new RegExp(`${name}="([^"]*)"`)) || [])[1];
  for (const line of text.split("\n")) {
    const match = line.match(/^(idem_messages_total|idem_database_retries_total)\{([^}]*)\} (\S+)/);
    if (!match) continue;
    const pipeline = label(match[2], "pipeline");
    const value = Number(match[3]);
    if (match[1] === "idem_messages_total") {
      (outcomes[pipeline] ||= {})[label(match[2], "outcome")] = value;
    } else {
      (retries[pipeline] ||= {})[label(match[2], "sqlstate")] = value;
    }
  }
  return { outcomes, retries };
}

function drawChart(canvas, samples) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  canvas.width = width * ratio;
  canvas.height = height * ratio;
  const context = canvas.getContext("2d");
  context.scale(ratio, ratio);
  context.clearRect(0, 0, width, height);
  const rates = OUTCOMES.map(() => []);
  for (let i = 1; i < samples.length; i++) {
    const seconds = (samples[i].at - samples[i - 1].at) / 1000;
    OUTCOMES.forEach((outcome, index) => {
      const delta = (samples[i].counts[outcome] || 0) - (samples[i - 1].counts[outcome] || 0);
      rates[index].push(seconds > 0 ? Math.max(0, delta) / seconds : 0);
    });
  }
  const top = Math.max(1, ...rates.flat());
  const now = Date.now();
  const span = Math.min(WINDOW_MS, Math.max(MIN_SPAN_MS, now - (samples[0]?.at ?? now)));
  const x = (at) => width - ((now - at) / span) * width;
  const style = getComputedStyle(document.documentElement);
  OUTCOMES.forEach((outcome, index) => {
    const series = rates[index];
    if (!series.some((rate) => rate > 0)) return;
    context.strokeStyle = style.getPropertyValue(`--${outcome}`);
    context.lineWidth = 1.5;
    context.beginPath();
    series.forEach((rate, i) => {
      const y = height - 2 - (rate / top) * (height - 4);
      if (i === 0) context.moveTo(x(samples[i + 1].at), y); else context.lineTo(x(samples[i + 1].at), y);
    });
    context.stroke();
  });
  context.fillStyle = "#6b7280";
  context.font = "10px system-ui";
  context.fillText(`${top.toFixed(top < 10 ? 1 : 0)}/s`, 2, 10);
  canvas.dataset.peak = top.toFixed(2);
  canvas.dataset.samples = samples.length;
  canvas.dataset.applied = (rates[0].at(-1) || 0).toFixed(2);
}

function pipelineRow(pipeline, totals, retries) {
  const held = pipeline.operator_pause;
  const state = held ? "paused-by-operator" : pipeline.paused ? "paused" : pipeline.consuming ? "consuming" : "stopped";
  const why = held
    ? `paused by an operator${held.persistent ? " on every host" : " on this host"} since ${new Date(held.since * 1000).toLocaleString()}: ${held.reason}`
    : pipeline.paused
      ? `${pipeline.paused.reason}${pipeline.paused.sqlstate ? ` (SQLSTATE ${pipeline.paused.sqlstate})` : ""}`
      : "";
  const pauseButton = held
    ? el("button", { type: "button", class: "resume", onclick: () => resumePipeline(pipeline.name) }, "Resume")
    : el("button", { type: "button", class: "pause", onclick: () => pausePipeline(pipeline.name) }, "Pause");
  const plugin = pipeline.plugin;
  const loaded = new Date(plugin.loaded_at * 1000).toLocaleString();
  const reload = pipeline.last_reload_error
    ? el("div", { class: "error" }, `last reload refused: ${pipeline.last_reload_error}`)
    : pipeline.last_reload_at ? el("div", { class: "muted" }, `last reload ${new Date(pipeline.last_reload_at * 1000).toLocaleTimeString()}`) : null;
  const canvas = el("canvas", { class: "chart", "data-pipeline": pipeline.name });
  const retryText = Object.entries(retries || {}).map(([state, count]) => `${state}: ${count}`).join(", ") || "0";
  const depth = depths[pipeline.name];
  const depthText = !depth ? "-" : depth.error ? null : [
    `waiting ${depth.waiting}`,
    depth.unacknowledged === null ? null : `unacked ${depth.unacknowledged}`,
    `dead letters ${depth.dead_letters ?? 0}`,
  ].filter(Boolean).join(" · ");
  const row = el("tr", { "data-pipeline": pipeline.name, "data-state": state },
    el("td", {}, el("strong", {}, pipeline.name)),
    el("td", {}, `${pipeline.source} `, el("span", { class: "mono" }, pipeline.queue),
      el("div", { class: "muted" }, "dead letters: ", el("span", { class: "mono" }, pipeline.dead_letter_queue))),
    el("td", {}, el("span", { class: `state-${state}` }, state), why ? el("div", { class: "error" }, why) : null),
    el("td", { class: "num" }, pipeline.workers ?? "-"),
    el("td", { class: "depth" }, depthText ?? el("span", { class: "error" }, depth.error),
      depth ? el("div", { class: "muted" }, `read ${new Date(depth.at * 1000).toLocaleTimeString()}`) : null),
    el("td", {}, el("span", { class: "mono digest", title: plugin.path }, plugin.digest.slice(0, 19)),
      el("div", { class: plugin.contract_deprecated ? "error contract" : "muted contract" }, plugin.contract), el("div", { class: "muted" }, `loaded ${loaded}`), reload),
    el("td", {}, canvas),
    el("td", { class: "mono" }, OUTCOMES.filter((outcome) => totals[outcome]).map((outcome) => el("div", { class: outcome }, `${outcome} ${totals[outcome]}`))),
    el("td", { class: "mono" }, retryText),
    el("td", {}, el("button", { type: "button", class: "reload", onclick: () => reloadPlugin(pipeline.name) }, "Reload plugin"),
      " ", pauseButton),
  );
  return { row, canvas };
}

async function refreshPipelines() {
  const [status, , metricsResponse, ready] = await Promise.all([
    api("GET", "/admin/status"),
    readHistory(false),
    fetch("/metrics").then((response) => response.text()).catch(() => ""),
    fetch("/readyz").then((response) => response.json()).catch(() => ({ ready: false, problems: ["no answer"] })),
  ]);
  const outbox = depths[OUTBOX];
  const backlog = outbox && !outbox.error ? ` · outbox: ${outbox.pending} pending, ${outbox.parked} parked` : "";
  $("#health").textContent = (ready.ready ? "ready" : `not ready: ${(ready.problems || []).join("; ")}`) + backlog;
  $("#health").className = ready.ready ? "muted" : "error";
  if (status.status !== 200) {
    notice(`status: ${status.body.error || status.status}`, true);
    return;
  }
  pipelines = status.body.pipelines;
  const { outcomes, retries } = parseMetrics(metricsResponse);
  const now = Date.now();
  const body = $("#pipeline-table tbody");
  body.replaceChildren();
  for (const pipeline of pipelines) {
    const counts = outcomes[pipeline.name] || {};
    const samples = history.get(pipeline.name) || [];
    samples.push({ at: now, counts });
    while (samples.length && samples[0].at < now - WINDOW_MS) samples.shift();
    history.set(pipeline.name, samples);
    const { row, canvas } = pipelineRow(pipeline, counts, retries[pipeline.name]);
    body.append(row);
    drawChart(canvas, samples);
  }
  fillPipelineChoice();
}

async function reloadPlugin(name) {
  const { status, body } = await api("POST", `/admin/reload/${encodeURIComponent(name)}`);
  if (body.result === "swapped") notice(`${name}: plugin swapped, ${body.from.slice(0, 19)} → ${body.to.slice(0, 19)}`);
  else if (body.result === "unchanged") notice(`${name}: plugin unchanged (${body.digest.slice(0, 19)})`);
  else notice(`${name}: reload refused: ${body.error || status}`, true);
  refreshPipelines();
}

/** Asks the pause dialog; resolves to {reason, persist} or null when cancelled. */
function askPause(name) {
  const dialog = $("#pause-dialog");
  $("#pause-text").textContent = `Pause pipeline ${name}? It settles the messages it started, then consumes nothing (what it prefetched goes back to the queue) until resumed.`;
  $("#pause-reason").value = "";
  $("#pause-persist").checked = false;
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"
      ? { reason: $("#pause-reason").value, persist: $("#pause-persist").checked }
      : null), { once: true });
    dialog.showModal();
  });
}

async function pausePipeline(name) {
  const asked = await askPause(name);
  if (!asked) return;
  const { status, body } = await api("POST", `/admin/pipelines/${encodeURIComponent(name)}/pause`, asked);
  if (status === 200) notice(`${name}: paused${body.persistent ? " on every host, until resumed" : " on this host"}`);
  else notice(`${name}: not paused: ${body.error || status}`, true);
  refreshPipelines();
}

async function resumePipeline(name) {
  if (!await confirmed(`Resume pipeline ${name}? Every host it was paused on consumes again.`, "Resume")) return;
  const { status, body } = await api("POST", `/admin/pipelines/${encodeURIComponent(name)}/resume`);
  if (status === 200) notice(`${name}: resumed`);
  else notice(`${name}: not resumed: ${body.error || status}`, true);
  refreshPipelines();
}

// --- dead letters -----------------------------------------------------------------------

let letters = null; // the last list of the selected pipeline
let deadLetterReads = 0; // lists asked for; only the newest one is drawn

function fillPipelineChoice() {
  const select = $("#dl-pipeline");
  const names = pipelines.map((pipeline) => pipeline.name);
  if ([...select.options].map((option) => option.value).join() === names.join()) return;
  const chosen = select.value;
  select.replaceChildren(...names.map((name) => el("option", { value: name }, name)));
  if (names.includes(chosen)) select.value = chosen;
}

function selectedIds() {
  return [...document.querySelectorAll("#dl-letters input[data-id]:checked")].map((box) => box.dataset.id);
}

async function refreshDeadLetters() {
  const name = $("#dl-pipeline").value;
  if (!name) return;
  $("#dl-summary").textContent = "reading…";
  const read = ++deadLetterReads;
  const { status, body } = await api("POST", `/admin/dead-letters/${encodeURIComponent(name)}/list`, {});
  // A list asked for later (another pipeline chosen, refresh clicked) answers for the page.
  if (read !== deadLetterReads) return;
  if (status !== 200) {
    $("#dl-summary").textContent = "";
    notice(`dead letters of ${name}: ${body.error || status}`, true);
    return;
  }
  letters = body;
  $("#dl-summary").textContent = `${body.letters.length}${body.more ? "+" : ""} in ${body.dead_letter} (${body.source}); replays go to ${body.queue}`;
  $("#dl-groups tbody").replaceChildren(...body.groups.map((group) => el("tr", { "data-kind": group.kind ?? "" },
    el("td", { class: "num" }, group.count),
    el("td", {}, group.kind ?? "-"),
    el("td", {}, group.reason ?? "-"),
    el("td", {}, age(group.newest_age_seconds)),
    el("td", {}, ...DEAD_LETTER_ACTIONS.map((action) => el("button", { type: "button", class: `${action}-group`, onclick: () => act(action, group.ids, group.count, `${group.kind}: ${group.reason}`) }, `${ACTION_WORDS[action].button} ${group.count}`))),
  )));
  $("#dl-letters tbody").replaceChildren(...body.letters.map((letter) => el("tr", { class: "clickable", "data-id": letter.id, onclick: (event) => { if (event.target.tagName !== "INPUT") showLetter(letter.id); } },
    el("td", {}, el("input", { type: "checkbox", "data-id": letter.id, onchange: updateSelection })),
    el("td", { class: "num" }, letter.position),
    el("td", {}, age(letter.age_seconds)),
    el("td", {}, letter.kind ?? "-"),
    el("td", {}, letter.reason ?? "-"),
    el("td", { class: "mono" }, letter.body.preview ?? letter.body.text ?? `hex ${letter.body.hex.slice(0, 40)}…`),
  )));
  $("#dl-all").checked = false;
  updateSelection();
}

function updateSelection() {
  const count = selectedIds().length;
  for (const action of DEAD_LETTER_ACTIONS) {
    const button = $(`#dl-${action}-selected`);
    button.disabled = count === 0;
    button.textContent = count ? `${ACTION_WORDS[action].button} ${count} selected` : `${ACTION_WORDS[action].button} selected`;
  }
}

async function showLetter(id) {
  const name = $("#dl-pipeline").value;
  const { status, body } = await api("POST", `/admin/dead-letters/${encodeURIComponent(name)}/show`, { id });
  if (status !== 200) {
    notice(body.error || `status ${status}`, true);
    return;
  }
  $("#dl-detail-title").textContent = `#${body.position} (${body.kind ?? "-"})`;
  $("#dl-detail-headers tbody").replaceChildren(
    el("tr", {}, el("th", {}, "message-id"), el("td", { class: "mono" }, body.message_id ?? "-")),
    el("tr", {}, el("th", {}, "subject"), el("td", { class: "mono" }, body.subject)),
    ...body.headers.map(([header, value]) => el("tr", {}, el("th", { class: "mono" }, header), el("td", { class: "mono" }, value))),
  );
  $("#dl-detail-body").textContent = body.body.text ?? `(${body.body_bytes} bytes, not UTF-8, hex)\n${body.body.hex}`;
  $("#dl-detail").hidden = false;
  $("#dl-detail").scrollIntoView({ behavior: "smooth" });
}

function confirmed(text, action = "Replay") {
  const dialog = $("#confirm");
  $("#confirm-text").textContent = text;
  $("#confirm-ok").textContent = action;
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
    dialog.showModal();
  });
}

const DEAD_LETTER_ACTIONS = ["replay", "archive", "discard"];
const ACTION_WORDS = {
  replay: { button: "Replay", done: "Replayed", count: "replayed" },
  archive: { button: "Archive", done: "Archived", count: "archived" },
  discard: { button: "Discard", done: "Discarded", count: "discarded" },
};

/** The question a dead-letter action asks before it is done. */
function question(action, count, name, what) {
  const from = letters ? letters.dead_letter : "the dead letters";
  if (action === "replay") {
    const target = letters ? `from ${letters.dead_letter} to ${letters.queue}` : "";
    return `Replay ${count} message(s) of pipeline ${name} (${what}) ${target}? Messages applied before are recognised as duplicates.`;
  }
  if (action === "archive") {
    return `Archive ${count} message(s) of pipeline ${name} (${what})? They are written whole to the database's idem_dead_letters table, then removed from ${from}.`;
  }
  return `Discard ${count} message(s) of pipeline ${name} (${what}) from ${from}? They are removed for good and cannot be replayed.`;
}

async function act(action, ids, count, what) {
  const name = $("#dl-pipeline").value;
  const words = ACTION_WORDS[action];
  if (!await confirmed(question(action, count, name, what), words.button)) return;
  const { status, body } = await api("POST", `/admin/dead-letters/${encodeURIComponent(name)}/${action}`, { ids });
  if (status === 200) {
    const where = action === "replay" ? ` from ${body.from} to ${body.to}` : action === "archive" ? ` to ${body.to}` : ` from ${body.from}`;
    notice(`${words.done} ${body[words.count]} message(s)${where}.`);
  } else {
    notice(`${action} refused: ${body.error || status}`, true);
  }
  $("#dl-detail").hidden = true;
  refreshDeadLetters();
}

// --- outbox -------------------------------------------------------------------------------

async function refreshOutbox() {
  const { status, body } = await api("GET", "/admin/outbox");
  if (status !== 200) {
    notice(`outbox: ${body.error || status}`, true);
    return;
  }
  $("#outbox-summary").textContent = `${body.pending} pending, ${body.parked} parked`;
  $("#outbox-rows tbody").replaceChildren(...body.rows.map((row) => el("tr", { "data-state": row.state },
    el("td", { class: "num" }, row.id),
    el("td", { class: row.state === "parked" ? "error" : "" }, row.state),
    el("td", {}, row.database ? `${row.destination} (${row.database})` : row.destination),
    el("td", { class: "mono" }, row.key),
    el("td", { class: "num" }, row.attempts),
    el("td", {}, age(row.age_seconds)),
    el("td", {}, row.last_error ?? "-"),
    el("td", {}, row.state === "parked" ? el("button", { type: "button", onclick: () => retryOutbox(row.id, row.database) }, "Retry") : null),
  )));
}

async function retryOutbox(id, database) {
  const { status, body } = await api("POST", "/admin/outbox/retry", database ? { id, database } : { id });
  if (status === 200 && body.retried.length) notice(`Outbox row ${id} is pending again.`);
  else notice(`retry: ${body.error || "no parked row matched"}`, true);
  refreshOutbox();
}

// --- views --------------------------------------------------------------------------------

function show(view) {
  notice("");
  for (const section of document.querySelectorAll(".view")) section.hidden = section.id !== view;
  for (const link of document.querySelectorAll("nav a")) link.classList.toggle("current", link.dataset.view === view);
  if (view === "dead-letters") refreshDeadLetters();
  if (view === "outbox") refreshOutbox();
}

function route() {
  const view = location.hash.slice(1) || "pipelines";
  show(["pipelines", "dead-letters", "outbox"].includes(view) ? view : "pipelines");
}

window.addEventListener("hashchange", route);
document.addEventListener("DOMContentLoaded", async () => {
  $("#dl-refresh").addEventListener("click", refreshDeadLetters);
  $("#dl-pipeline").addEventListener("change", refreshDeadLetters);
  $("#dl-all").addEventListener("change", (event) => {
    for (const box of document.querySelectorAll("#dl-letters input[data-id]")) box.checked = event.target.checked;
    updateSelection();
  });
  for (const action of DEAD_LETTER_ACTIONS) {
    $(`#dl-${action}-selected`).addEventListener("click", () => {
      const ids = selectedIds();
      act(action, ids, ids.length, "selected");
    });
  }
  $("#dl-detail-close").addEventListener("click", () => { $("#dl-detail").hidden = true; });
  $("#outbox-refresh").addEventListener("click", refreshOutbox);
  $("#token-button").addEventListener("click", () => { declined = false; askToken("The admin token, kept for this browser session only."); });
  await readHistory(true);
  await refreshPipelines();
  route();
  setInterval(refreshPipelines, POLL_MS);
});
