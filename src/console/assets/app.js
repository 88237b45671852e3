// ax console: a small page over the same APIs as the CLI (POST /api/<api>/<op>).
"use strict";

const view = document.getElementById("view");
let role = null;

const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) =>
  ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
const ago = (ms) => {
  if (!ms) return "-";
  const d = Date.now() - ms, a = Math.abs(d) / 1000;
  const t = a < 60 ? `${Math.round(a)}s` : a < 3600 ? `${Math.round(a / 60)}m` : a < 86400 ? `${Math.round(a / 3600)}h` : `${Math.round(a / 86400)}d`;
  return d >= 0 ? `${t} ago` : `in ${t}`;
};
const badge = (s) => `<span class="badge s-${esc(s)}" data-state="${esc(s)}">${esc(s)}</span>`;
const toast = (text) => {
  const t = document.getElementById("toast");
  t.textContent = text; t.style.display = "block";
  clearTimeout(toast.timer); toast.timer = setTimeout(() => (t.style.display = "none"), 3000);
};

async function call(api, op, body = {}) {
  const r = await fetch(`/api/${api}/${op}`, {
    method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body),
  });
  if (r.status === 401) { showLogin(); throw new Error("log in"); }
  const j = await r.json();
  if (j.error) throw new Error(j.error.message || j.error.code || JSON.stringify(j.error));
  return j.ok;
}

async function act(what, api, op, body) {
  try { await call(api, op, body); toast(`${what}: done`); render(); }
  catch (e) { toast(`${what}: ${e.message}`); }
}

function showLogin() {
  view.innerHTML = `<h1>Log in</h1><form id="login"><input type="password" id="token" placeholder="console token" autofocus>
    <button class="primary">Log in</button> <span id="login-error" class="error"></span></form>`;
  document.getElementById("login").onsubmit = async (ev) => {
    ev.preventDefault();
    const r = await fetch("/api/login", { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify({ token: document.getElementById("token").value }) });
    if (r.ok) { await whoami(); render(); }
    else document.getElementById("login-error").textContent = r.status === 429 ? "too many wrong tokens: wait a minute" : "wrong token";
  };
}

async function whoami() {
  const r = await fetch("/api/whoami");
  if (r.status === 401) { role = null; showLogin(); return false; }
  role = (await r.json()).role;
  live();
  document.getElementById("who").textContent = role === "admin" ? "" : role;
  return true;
}
const admin = () => role === "admin";
const btn = (label, onclick, cls = "") => admin() ? `<button class="${cls}" data-act="${esc(onclick)}">${esc(label)}</button>` : "";

// ---- pages ----

async function overview() {
  const q = await call("task", "queues");
  const total = (s) => q.queues.reduce((n, x) => n + x.tasks[s], 0);
  const rate = (s) => q.last_minute?.[s] ?? "-";
  const cards = ["pending", "running", "retrying", "scheduled", "dead"].map((s) =>
    `<div class="card"><span class="muted">${s}</span><b>${total(s)}</b></div>`).join("") +
    `<div class="card" id="rates"><span class="muted">last minute</span><b>${rate("succeeded")}</b>
     succeeded · ${rate("retrying")} retried · ${rate("dead")} dead</div>`;
  const rows = q.queues.map((x) => `<tr>
    <td><a href="#/tasks?queue=${esc(x.queue)}">${esc(x.queue)}</a></td>
    <td>${x.paused ? `<span class="badge s-retrying">paused</span>` : "active"}</td>
    <td class="mono">${x.ready.high} / ${x.ready.normal} / ${x.ready.low}</td>
    ${["scheduled", "pending", "running", "retrying", "succeeded"].map((s) => `<td>${x.tasks[s]}</td>`).join("")}
    <td><a href="#/tasks?queue=${esc(x.queue)}&state=dead">${x.tasks.dead}</a></td><td>${x.tasks.cancelled}</td>
    <td>${x.paused ? btn("Resume", `task/resume/${JSON.stringify({ queue: x.queue })}`) : btn("Pause", `task/pause/${JSON.stringify({ queue: x.queue, by: "console" })}`)}</td>
  </tr>`).join("");
  view.innerHTML = `<h1>Overview</h1><div class="cards">${cards}</div>
    <table><tr><th>queue</th><th>status</th><th>ready high / normal / low</th><th>scheduled</th><th>pending</th>
    <th>running</th><th>retrying</th><th>succeeded</th><th>dead</th><th>cancelled</th><th></th></tr>${rows}</table>
    ${q.complete ? "" : `<p class="muted">The index is still loading.</p>`}
    <p class="muted">Headline metrics (<code>ax_pending_dispatch</code>, <code>ax_worker_busy_rate</code>, <code>ax_task_timeout_rate</code>) are on each process's <code>/metrics</code>.</p>`;
}

const FILTERS = ["state", "queue", "name", "error_class", "trigger", "flow_run", "idempotency_key"];

async function tasks(params) {
  const query = {};
  for (const f of FILTERS) if (params.get(f)) query[f] = params.get(f);
  if (params.get("since")) query.from_ms = Date.now() - Number(params.get("since")) * 60000;
  const body = { ...query, limit: 50 };
  if (params.get("after")) { const [ms, ...id] = params.get("after").split(":"); body.after = { updated_at_ms: Number(ms), id: id.join(":") }; }
  const r = await call("task", "list", body);
  const states = ["", "scheduled", "pending", "running", "retrying", "succeeded", "dead", "cancelled"];
  const input = (f, label) => `<label>${label}<input name="${f}" value="${esc(params.get(f) || "")}"></label>`;
  const rows = r.tasks.map((t) => `<tr>
    <td class="mono"><a href="#/task/${encodeURIComponent(t.id)}">${esc(t.id)}</a></td><td>${esc(t.name)}</td>
    <td>${badge(t.state)}</td><td>${t.attempt}</td><td>${esc(t.error_class || "")}</td><td>${ago(t.updated_at_ms)}</td></tr>`).join("");
  const next = r.next ? `<a id="next" href="#/tasks?${new URLSearchParams({ ...Object.fromEntries(params), after: `${r.next.updated_at_ms}:${r.next.id}` })}">next page →</a>` : "";
  view.innerHTML = `<h1>Tasks</h1>
    <form class="filters" id="filters">
      <label>state<select name="state">${states.map((s) => `<option ${params.get("state") === s ? "selected" : ""}>${s}</option>`).join("")}</select></label>
      ${input("queue", "queue")}${input("name", "name")}${input("error_class", "error class")}${input("trigger", "trigger")}
      ${input("flow_run", "flow run")}${input("idempotency_key", "idempotency key")}
      <label>changed within (min)<input name="since" size="6" value="${esc(params.get("since") || "")}"></label>
      <button class="primary" id="search">Search</button>
    </form>
    <p id="count">${r.tasks.length} of ${r.total ?? "over 100,000"} task(s)${r.complete ? "" : " (index loading)"}</p>
    <div class="actions">
      ${query.state === "dead" || !query.state ? btn("Replay the dead tasks matching this filter", "replay", "danger") : ""}
      ${!["succeeded", "dead", "cancelled"].includes(query.state) ? btn("Cancel the unfinished tasks matching this filter", "cancel-many", "danger") : ""}
    </div>
    <table id="results"><tr><th>id</th><th>name</th><th>state</th><th>attempt</th><th>error class</th><th>changed</th></tr>${rows}</table>
    <p>${next}</p>`;
  const form = document.getElementById("filters");
  form.oninput = form.onchange = () => (dirty = true);
  form.onsubmit = (ev) => {
    ev.preventDefault();
    const p = new URLSearchParams();
    for (const [k, v] of new FormData(ev.target)) if (v) p.set(k, v);
    location.hash = `#/tasks?${p}`;
  };
  const cancelMany = view.querySelector('[data-act="cancel-many"]');
  if (cancelMany) cancelMany.onclick = async () => {
    const dry = await call("task", "cancel_many", { ...query, dry_run: true });
    if (!confirm(`Cancel ${dry.would_cancel} task(s)?`)) return;
    const done = await call("task", "cancel_many", { ...query, by: "console" });
    toast(`cancelled ${done.cancelled}`); render();
  };
  const replay = view.querySelector('[data-act="replay"]');
  if (replay) replay.onclick = async () => {
    const dry = await call("task", "replay", { ...query, state: "dead", dry_run: true });
    if (!confirm(`Retry ${dry.would_retry} dead task(s)?`)) return;
    const done = await call("task", "replay", { ...query, state: "dead", by: "console" });
    toast(`retried ${done.retried}`); render();
  };
}

async function task(id) {
  const [g, ev] = await Promise.all([call("task", "get", { id }), call("task", "events", { id })]);
  const rec = g.record;
  const flowRun = id.split(".")[1] === "fl" ? id.split(".")[2] : null;
  const kv = (k, v) => v === undefined || v === null || v === "" ? "" : `<tr><td>${k}</td><td>${v}</td></tr>`;
  // Attempts from the stored history: a `running` record (its revision is the fencing
  // token) and the record after it (the outcome).
  const hist = g.history;
  const attempts = [];
  hist.forEach((h, i) => {
    if (h.record.state !== "running") return;
    const end = hist.slice(i + 1).find((x) => x.record.state !== "running");
    attempts.push(`<tr><td>${h.record.attempt}</td><td class="mono">${esc(h.record.worker || "")}</td><td>${h.revision}</td>
      <td>${end ? badge(end.record.state) : badge("running")}</td>
      <td>${end ? `${end.record.updated_at_ms - (h.record.started_at_ms || h.record.updated_at_ms)} ms` : "-"}</td>
      <td>${end && end.record.state !== "succeeded" && end.record.last_error ? esc(`${end.record.last_error.class}: ${end.record.last_error.message}`) : ""}</td></tr>`);
  });
  const why = rec.trigger ? `trigger <b>${esc(rec.trigger)}</b> (${esc(rec.trigger_source)}, for ${ago(rec.scheduled_at_ms)})`
    : flowRun ? `flow run <a href="#/run/${esc(flowRun)}">${esc(flowRun)}</a>` : "submitted by a producer";
  const events = ev.events.map((e) => `<tr><td>${ago(e.at_ms)}</td><td>${esc(e.event)}</td><td>${e.attempt}</td><td class="mono">${esc(e.actor)}</td><td>${esc(e.reason || "")}</td></tr>`).join("");
  const s = rec.state;
  view.innerHTML = `<h1 class="mono">${esc(id)}</h1>
    <p>${badge(s)} <span id="state">${esc(s)}</span></p>
    <div class="actions">
      ${["scheduled", "pending", "retrying", "running"].includes(s) ? btn("Cancel", "cancel", "danger") : ""}
      ${s === "dead" ? btn("Retry", "retry", "primary") + btn("Retry with attempts reset", "retry-reset") : ""}
      ${["scheduled", "retrying"].includes(s) ? btn("Run now", "run-now", "primary") : ""}
    </div>
    <table class="kv">
      ${kv("queue / name", `${esc(rec.queue)} / ${esc(rec.name)}`)}
      ${kv("attempt", `${rec.attempt} of ${rec.max_attempts}`)}
      ${kv("next retry", rec.next_retry_at_ms ? ago(rec.next_retry_at_ms) : "")}
      ${kv("run at", rec.run_at_ms ? ago(rec.run_at_ms) : "")}
      ${kv("last error", rec.last_error ? `<span class="error">${esc(rec.last_error.class)}</span>: ${esc(rec.last_error.message)}` : "")}
      ${kv("worker", esc(rec.worker || ""))}
      ${kv("idempotency key", esc(rec.idempotency_key || ""))}
      ${kv("why it ran", why)}
      ${kv("waiting", rec.waiting ? esc(`${rec.waiting.reason} ${rec.waiting.limit}`) : "")}
      ${kv("operator", rec.op ? esc(`${rec.op.op} by ${rec.op.by}`) + " " + ago(rec.op.at_ms) : "")}
      ${kv("traceparent", esc(rec.traceparent || ""))}
      ${kv("created / changed", `${ago(rec.created_at_ms)} / ${ago(rec.updated_at_ms)} (revision ${g.revision})`)}
    </table>
    <h2>Attempts</h2>
    <table id="attempts"><tr><th>attempt</th><th>worker</th><th>fencing token</th><th>outcome</th><th>duration</th><th>error</th></tr>${attempts.join("")}</table>
    <h2>Events</h2>${ev.complete ? "" : `<p class="muted">The record's last 16 changes (keep all with --task-events).</p>`}
    <table id="events"><tr><th>when</th><th>event</th><th>attempt</th><th>actor</th><th>reason</th></tr>${events}</table>`;
  const on = (name, f) => { const b = view.querySelector(`[data-act="${name}"]`); if (b) b.onclick = f; };
  on("cancel", () => act("cancel", "task", "cancel", { id, by: "console" }));
  on("retry", () => act("retry", "task", "retry", { id, by: "console" }));
  on("retry-reset", () => act("retry", "task", "retry", { id, reset_attempts: true, by: "console" }));
  on("run-now", () => act("run now", "task", "run_now", { id, by: "console" }));
}

async function runs() {
  const list = await call("flow", "list", {});
  view.innerHTML = `<h1>Flow runs</h1><table><tr><th>run</th><th>flow</th><th>state</th><th>started</th><th>reason</th></tr>
    ${list.map((r) => `<tr><td class="mono"><a href="#/run/${esc(r.run)}">${esc(r.run)}</a></td><td>${esc(r.flow)}</td>
    <td>${badge(r.state)}</td><td>${ago(r.created_at_ms)}</td><td>${esc(r.reason || "")}</td></tr>`).join("")}</table>`;
}

function dag(steps) {
  const by = Object.fromEntries(steps.map((s) => [s.name, s]));
  const level = {};
  const depth = (n, seen = 0) => level[n] ?? (level[n] = Math.max(0, ...by[n].needs.map((p) => depth(p) + 1)));
  steps.forEach((s) => depth(s.name));
  const cols = {};
  steps.forEach((s) => (cols[level[s.name]] = cols[level[s.name]] || []).push(s.name));
  const W = 150, H = 44, GX = 70, GY = 24, pos = {};
  Object.entries(cols).forEach(([l, names]) => names.forEach((n, i) => (pos[n] = { x: 20 + l * (W + GX), y: 20 + i * (H + GY) })));
  const width = 40 + (Math.max(...Object.keys(cols).map(Number)) + 1) * (W + GX);
  const height = 40 + Math.max(...Object.values(cols).map((c) => c.length)) * (H + GY);
  const fill = { succeeded: "#d1fadf", failed: "#fda29b", running: "#b2ddff", waiting: "#f2f4f7", upstream_failed: "#fedf89", skipped: "#f9fafb", cancelled: "#eaecf0" };
  const edges = steps.flatMap((s) => s.needs.map((p) => `<line x1="${pos[p].x + W}" y1="${pos[p].y + H / 2}" x2="${pos[s.name].x}" y2="${pos[s.name].y + H / 2}" stroke="#98a2b3" marker-end="url(#arrow)"/>`));
  const nodes = steps.map((s) => `<g class="step" data-step="${esc(s.name)}" data-state="${esc(s.state)}">
    <rect x="${pos[s.name].x}" y="${pos[s.name].y}" width="${W}" height="${H}" fill="${fill[s.state] || "#fff"}"/>
    <text x="${pos[s.name].x + 10}" y="${pos[s.name].y + 18}" font-weight="600">${esc(s.name)}</text>
    <text x="${pos[s.name].x + 10}" y="${pos[s.name].y + 34}" fill="#475467">${esc(s.state)}${s.epoch ? ` · epoch ${s.epoch}` : ""}</text></g>`);
  return `<svg class="dag" width="${width}" height="${height}"><defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" markerHeight="6" orient="auto"><path d="M0,0L10,5L0,10z" fill="#98a2b3"/></marker></defs>${edges.join("")}${nodes.join("")}</svg>`;
}

async function run(id) {
  const r = await call("flow", "get", { run: id });
  const rows = r.steps.map((s) => `<tr><td>${esc(s.name)}</td><td>${badge(s.state)}</td><td>${s.epoch ?? 0}</td>
    <td>${s.task_id ? `<a class="mono" href="#/task/${encodeURIComponent(s.task_id)}">${esc(s.task_id)}</a>` : ""}</td>
    <td>${s.error ? esc(`${s.error.class}: ${s.error.message}`) : ""}</td></tr>`).join("");
  view.innerHTML = `<h1>Run <span class="mono">${esc(id)}</span> of ${esc(r.flow)}</h1>
    <p>${badge(r.state)} <span id="run-state">${esc(r.state)}</span> ${esc(r.reason || "")}</p>
    <div class="actions">${r.state === "running" ? btn("Cancel run", "cancel", "danger") : ""}${r.state !== "running" ? btn("Re-run…", "rerun", "primary") : ""}</div>
    ${dag(r.steps)}
    <h2>Steps</h2><table><tr><th>step</th><th>state</th><th>epoch</th><th>first task</th><th>error</th></tr>${rows}</table>
    <dialog id="rerun-dialog"><form method="dialog"><h2>Re-run</h2>
      <label><input type="radio" name="mode" value="failed" checked> failed steps only</label><br>
      <label><input type="radio" name="mode" value="failed_and_downstream"> failed steps and everything downstream</label><br>
      <label><input type="radio" name="mode" value="whole"> the whole run (a new run)</label>
      <div class="actions"><button value="cancel">Cancel</button><button class="primary" id="rerun-go" value="go">Re-run</button></div></form></dialog>`;
  const c = view.querySelector('[data-act="cancel"]');
  if (c) c.onclick = () => act("cancel", "flow", "cancel", { run: id });
  const b = view.querySelector('[data-act="rerun"]');
  if (b) b.onclick = () => {
    const d = document.getElementById("rerun-dialog");
    d.onclose = async () => {
      if (d.returnValue !== "go") return;
      const mode = d.querySelector('input[name="mode"]:checked').value;
      try {
        const out = await call("flow", "rerun", { run: id, mode });
        toast("re-run started");
        if (out && out.run && out.run !== id) location.hash = `#/run/${out.run}`; else render();
      } catch (e) { toast(`re-run: ${e.message}`); }
    };
    d.showModal();
  };
}

async function triggers() {
  const [list, lead] = await Promise.all([call("trigger", "list", {}), call("trigger", "leader", {})]);
  view.innerHTML = `<h1>Triggers</h1><p>Leader (fires the scheduled triggers): <span class="mono" id="leader">${esc(lead.leader || "none")}</span></p>
    <table><tr><th>name</th><th>kind</th><th>enabled</th><th>next fire</th><th>fires</th><th>last fire</th><th>last result</th><th></th></tr>
    ${list.map((t) => `<tr><td>${esc(t.name)}</td><td>${esc(t.kind)}</td><td>${t.enabled ? "yes" : "paused"}</td>
    <td>${esc(t.next ?? "-")}</td><td>${t.fires ?? 0}</td><td>${ago(t.last_fired_at_ms)}</td><td>${esc((t.last_result || []).join(", "))}</td>
    <td>${btn(t.enabled ? "Pause" : "Resume", `trigger/${t.enabled ? "pause" : "resume"}/${JSON.stringify({ name: t.name })}`)}
        ${btn("Run now", `trigger/run/${JSON.stringify({ name: t.name })}`)}</td></tr>`).join("")}</table>`;
}

async function limits() {
  const list = await call("limit", "status", {});
  view.innerHTML = `<h1>Limits</h1><table id="limits"><tr><th>queue</th><th>name</th><th>task</th><th>per key</th><th>rate/s</th><th>burst</th>
    <th>tokens left</th><th>concurrency</th><th>slots held</th></tr>
    ${list.map(({ limit: l, tokens, slots_held }) => `<tr><td>${esc(l.queue)}</td><td>${esc(l.name)}</td><td>${esc(l.task || "all")}</td>
    <td>${l.per_key ? "yes" : ""}</td><td>${l.rate ?? ""}</td><td>${l.burst ?? ""}</td>
    <td>${tokens === null ? (l.rate ? "per key" : "") : tokens.toFixed(1)}</td><td>${l.concurrency ?? ""}</td>
    <td>${slots_held.length}${slots_held.length ? `: <span class="mono">${slots_held.map((s) => esc(s.holder)).join(", ")}</span>` : ""}</td></tr>`).join("")}</table>
    <p class="muted">Tasks waiting for a limit carry <code>waiting</code> in their record (shown on the task page).</p>`;
}

// ---- routing, actions, live updates ----

async function render() {
  dirty = false;
  if (!role && !(await whoami())) return;
  const [path, qs] = location.hash.slice(1).split("?");
  const params = new URLSearchParams(qs || "");
  try {
    if (!path || path === "/") await overview();
    else if (path === "/tasks") await tasks(params);
    else if (path.startsWith("/task/")) await task(decodeURIComponent(path.slice(6)));
    else if (path === "/runs") await runs();
    else if (path.startsWith("/run/")) await run(decodeURIComponent(path.slice(5)));
    else if (path === "/triggers") await triggers();
    else if (path === "/limits") await limits();
    else view.innerHTML = "<h1>Not found</h1>";
  } catch (e) {
    if (e.message !== "log in") view.innerHTML = `<h1>Error</h1><p class="error">${esc(e.message)}</p>`;
  }
  // Generic buttons: data-act="<api>/<op>/<json body>".
  view.querySelectorAll("[data-act]").forEach((b) => {
    const parts = b.dataset.act.split("/");
    if (parts.length >= 3 && !b.onclick) {
      const body = JSON.parse(parts.slice(2).join("/"));
      b.onclick = () => act(b.textContent, parts[0], parts[1], body);
    }
  });
}

window.addEventListener("hashchange", render);
let pending = null;
let source = null;
// Someone is typing in a filter or has a dialog open: a live refresh would throw that away.
let dirty = false;
const busy = () => dirty || !!document.querySelector("dialog[open]") ||
  (document.activeElement && ["INPUT", "SELECT"].includes(document.activeElement.tagName));
// Live updates: the server says when the task index moved; the page shows it again. A
// stream refused (logged out) is opened again after the next login.
function live() {
  if (source && source.readyState !== EventSource.CLOSED) return;
  const es = (source = new EventSource("/api/live"));
  const dot = document.getElementById("live");
  es.onopen = () => dot.classList.add("on");
  es.onerror = () => dot.classList.remove("on");
  es.addEventListener("change", () => {
    clearTimeout(pending);
    pending = setTimeout(() => { if (!busy()) render(); }, 250);
  });
}
render();
