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
const badge = (s, id = "") => `<span class="badge s-${esc(s)}" data-state="${esc(s)}"${id ? ` id="${id}"` : ""}>${esc(s)}</span>`;
// Numbers with separators; times as "3m ago" with the absolute time on hover.
const num = (n) => (n === null || n === undefined ? "-" : Number(n).toLocaleString("en-US"));
const when = (ms) => ms ? `<time datetime="${new Date(ms).toISOString()}" title="${new Date(ms).toISOString()}">${ago(ms)}</time>` : "-";
const dur = (ms) => ms === null || ms === undefined ? "-" : ms < 1000 ? `${Math.round(ms)} ms` : ms < 120000 ? `${(ms / 1000).toFixed(1)} s` : `${Math.round(ms / 60000)} min`;

// Shows a page by changing only what differs from what is shown: a live refresh keeps
// the elements (and the button under the pointer) that did not change.
function show(html) {
  const next = document.createElement("main");
  next.innerHTML = html;
  morph(view, next);
}
function morph(from, to) {
  const a = [...from.childNodes], b = [...to.childNodes];
  b.forEach((nb, i) => {
    const na = a[i];
    if (!na) { from.appendChild(nb); return; }
    if (na.nodeType !== nb.nodeType || na.nodeName !== nb.nodeName ||
        (na.nodeType === 1 && (na.id !== nb.id || na.nodeName === "svg"))) { from.replaceChild(nb, na); return; }
    if (na.nodeType === 3 || na.nodeType === 8) { if (na.nodeValue !== nb.nodeValue) na.nodeValue = nb.nodeValue; return; }
    // An open dialog is the user's: a refresh that started before it opened must not
    // close it (by dropping its `open` attribute) or change what it shows.
    if (na.nodeName === "DIALOG" && na.open) return;
    for (const { name } of [...na.attributes]) if (!nb.hasAttribute(name)) na.removeAttribute(name);
    for (const { name, value } of [...nb.attributes]) if (na.getAttribute(name) !== value) na.setAttribute(name, value);
    if (na === document.activeElement && ["INPUT", "SELECT", "TEXTAREA"].includes(na.nodeName)) return;
    if (na.nodeName === "INPUT" && na.type === "checkbox") na.checked = nb.hasAttribute("checked");
    morph(na, nb);
  });
  a.slice(b.length).forEach((n) => n.remove());
}
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
  const me = await r.json();
  role = me.role;
  const login = me.login;
  live();
  document.getElementById("who").textContent = role === "admin" ? "" : role;
  const out = document.getElementById("logout");
  out.hidden = !login;
  out.onclick = async () => {
    await fetch("/api/logout", { method: "POST", headers: { "content-type": "application/json" }, body: "{}" });
    role = null; if (source) source.close(); showLogin();
  };
  return true;
}
const admin = () => role === "admin";
const btn = (label, onclick, cls = "") => admin() ? `<button class="${cls}" data-act="${esc(onclick)}">${esc(label)}</button>` : "";

// ---- pages ----

// Per-minute series of the last hour: the server keeps them (ax.task.series).
const points = (rows, f) => rows.map((r) => [r.t, f(r)]);
function sumSeries(queues) {
  const rows = Object.values(queues);
  if (!rows.length) return [];
  return rows[0].map((r, i) => ({ t: r.t, succeeded: rows.reduce((n, q) => n + q[i].succeeded, 0),
    retried: rows.reduce((n, q) => n + q[i].retried, 0), dead: rows.reduce((n, q) => n + q[i].dead, 0) }));
}
const throughputChart = (id, rows, title) => chart({ id, title, series: [
  { name: "succeeded", points: points(rows, (r) => r.succeeded) },
  { name: "retried", points: points(rows, (r) => r.retried) },
  { name: "dead", points: points(rows, (r) => r.dead) }] });
const latencyChart = (id, rows) => chart({ id, title: "latency per minute (ms)", unit: " ms", series: [
  { name: "queue wait p50", points: points(rows, (r) => r.wait_p50_ms) },
  { name: "queue wait p95", points: points(rows, (r) => r.wait_p95_ms) },
  { name: "run time p50", points: points(rows, (r) => r.run_p50_ms) },
  { name: "run time p95", points: points(rows, (r) => r.run_p95_ms) }] });
const pausedBy = (x) => x.pause ? `paused by ${esc(x.pause.by || "?")} ${when(x.pause.paused_at_ms)}${x.pause.reason ? `: ${esc(x.pause.reason)}` : ""}` : "";
const pauseButton = (x) => x.paused ? btn("Resume", `task/resume/${JSON.stringify({ queue: x.queue })}`) : btn("Pause…", `pause:${x.queue}`);

// The server's services as its supervisor keeps them (GET /healthz): up or waiting to be
// started again, restarts, and why one last stopped.
async function services() {
  const r = await fetch("/healthz").catch(() => null);
  const h = r ? await r.json().catch(() => null) : null;
  if (!h || !h.services) return `<p class="muted" id="services">The services' health is not available.</p>`;
  const rows = Object.entries(h.services).map(([name, s]) => `<tr data-service="${esc(name)}">
    <td>${esc(name)}</td><td class="up">${badge(s.up ? "up" : "restarting")}</td>
    <td class="n restarts">${num(s.restarts)}</td><td class="muted last-stop">${esc(s.last_stop || "")}</td></tr>`).join("");
  return `<h2>Services ${h.ok ? "" : badge("restarting")}</h2><table id="services"><tr><th>service</th><th>state</th>
    <th>restarts</th><th>last stop</th></tr>${rows}</table>`;
}

async function overview() {
  const [q, series, health] = await Promise.all([call("task", "queues"),
    call("task", "series", {}).catch(() => ({ queues: {} })), services()]);
  const total = (s) => q.queues.reduce((n, x) => n + x.tasks[s], 0);
  const rate = (s) => num(q.last_minute?.[s]);
  const cards = ["pending", "running", "retrying", "scheduled", "dead"].map((s) =>
    `<div class="card"><span class="muted">${s}</span><b>${num(total(s))}</b></div>`).join("") +
    `<div class="card" id="rates"><span class="muted">last minute</span><b>${rate("succeeded")}</b>
     succeeded · ${rate("retrying")} retried · ${rate("dead")} dead</div>`;
  const rows = q.queues.map((x) => `<tr data-queue="${esc(x.queue)}">
    <td><a href="#/queue/${encodeURIComponent(x.queue)}">${esc(x.queue)}</a></td>
    <td class="status">${x.paused ? `<span class="badge s-retrying">paused</span> <span class="muted">${pausedBy(x)}</span>` : "active"}</td>
    <td class="mono">${num(x.ready.high)} / ${num(x.ready.normal)} / ${num(x.ready.low)}</td>
    ${["scheduled", "pending", "running", "retrying", "succeeded"].map((s) => `<td class="n">${num(x.tasks[s])}</td>`).join("")}
    <td class="n"><a href="#/tasks?queue=${encodeURIComponent(x.queue)}&state=dead">${num(x.tasks.dead)}</a></td><td class="n">${num(x.tasks.cancelled)}</td>
    <td>${pauseButton(x)}</td>
  </tr>`).join("");
  show(`<h1>Overview</h1><div class="cards">${cards}</div>
    <div class="charts">${throughputChart("chart-throughput", sumSeries(series.queues), "tasks per minute, all queues")}</div>
    <table id="queues"><tr><th>queue</th><th>status</th><th>ready high / normal / low</th><th>scheduled</th><th>pending</th>
    <th>running</th><th>retrying</th><th>succeeded</th><th>dead</th><th>cancelled</th><th></th></tr>${rows}</table>
    ${q.complete ? "" : `<p class="muted">The index is still loading.</p>`}
    ${health}
    <p class="muted">Headline metrics (<code>ax_pending_dispatch</code>, <code>ax_worker_busy_rate</code>, <code>ax_task_timeout_rate</code>) are on each process's <code>/metrics</code>.</p>`);
  bindPause();
}

// "Pause…" asks why; the reason and who paused show on the overview and in `ax queue list`.
function bindPause() {
  view.querySelectorAll('[data-act^="pause:"]').forEach((b) => {
    b.onclick = () => {
      const queue = b.dataset.act.slice(6);
      const reason = prompt(`Pause queue ${queue}: why? (shown to other operators)`, "");
      if (reason === null) return;
      act("pause", "task", "pause", { queue, by: "console", ...(reason ? { reason } : {}) });
    };
  });
}

async function queue(name) {
  const [q, series] = await Promise.all([call("task", "queues"), call("task", "series", { queue: name }).catch(() => ({ queues: {} }))]);
  const x = q.queues.find((y) => y.queue === name);
  if (!x) { show(`<h1>Not found</h1><p>No queue ${esc(name)}.</p>`); return; }
  const rows = series.queues[name] || [];
  const states = ["scheduled", "pending", "running", "retrying", "succeeded", "dead", "cancelled"];
  show(`<h1>Queue <span class="mono">${esc(name)}</span></h1>
    <p id="queue-status">${x.paused ? `<span class="badge s-retrying">paused</span> ${pausedBy(x)}` : "active"} ${pauseButton(x)}</p>
    <div class="cards">${states.map((s) => `<div class="card"><span class="muted">${s}</span><b><a href="#/tasks?queue=${encodeURIComponent(name)}&state=${s}">${num(x.tasks[s])}</a></b></div>`).join("")}</div>
    <div class="charts">${throughputChart("chart-queue-throughput", rows, "tasks per minute")}${latencyChart("chart-queue-latency", rows)}</div>
    <p class="muted">Series of the last hour, per minute, kept by the server from the task records (after a server restart, from each record's last state).</p>`);
  bindPause();
}

const FILTERS = ["state", "queue", "name", "error_class", "error_text", "trigger", "flow_run", "idempotency_key"];

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
    <td>${admin() ? `<input type="checkbox" class="pick" value="${esc(t.id)}" data-state="${esc(t.state)}" aria-label="select ${esc(t.id)}">` : ""}</td>
    <td class="mono"><a href="#/task/${encodeURIComponent(t.id)}">${esc(t.id)}</a></td><td>${esc(t.name)}</td>
    <td>${badge(t.state)}</td><td class="n">${num(t.attempt)}</td><td>${esc(t.error_class || "")}</td><td>${when(t.updated_at_ms)}</td></tr>`).join("");
  const next = r.next ? `<a id="next" href="#/tasks?${new URLSearchParams({ ...Object.fromEntries(params), after: `${r.next.updated_at_ms}:${r.next.id}` })}">next page →</a>` : "";
  const finished = !query.state || ["succeeded", "dead", "cancelled"].includes(query.state);
  show(`<h1>Tasks</h1>
    <form class="goto" id="goto"><label>task id<input name="id" size="40" placeholder="emails.sgivJrxqJsZEKRDBtDspTj"></label><button>Open</button></form>
    <form class="filters" id="filters">
      <label>state<select name="state">${states.map((s) => `<option ${params.get("state") === s ? "selected" : ""}>${s}</option>`).join("")}</select></label>
      ${input("queue", "queue")}${input("name", "name")}${input("error_class", "error class")}${input("error_text", "error text")}${input("trigger", "trigger")}
      ${input("flow_run", "flow run")}${input("idempotency_key", "idempotency key")}
      <label>changed within (min)<input name="since" size="6" value="${esc(params.get("since") || "")}"></label>
      <button class="primary" id="search">Search</button>
    </form>
    <p id="count">${num(r.tasks.length)} of ${r.total === null || r.total === undefined ? "over 100,000" : num(r.total)} task(s)${r.complete ? "" : " (index loading)"}</p>
    <div class="actions">
      ${admin() ? `<span id="picked" class="muted">0 selected</span>` : ""}
      ${btn("Cancel selected", "cancel-picked", "danger")}${btn("Retry selected", "retry-picked")}
      ${query.state === "dead" || !query.state ? btn("Replay the dead tasks matching this filter", "replay", "danger") : ""}
      ${!["succeeded", "dead", "cancelled"].includes(query.state) ? btn("Cancel the unfinished tasks matching this filter", "cancel-many", "danger") : ""}
      ${finished ? btn("Purge finished tasks matching this filter…", "purge", "danger") : ""}
    </div>
    <table id="results"><tr><th>${admin() ? `<input type="checkbox" id="pick-all" aria-label="select all">` : ""}</th><th>id</th><th>name</th><th>state</th><th>attempt</th><th>error class</th><th>changed</th></tr>${rows}</table>
    <p>${next}</p>`);
  const form = document.getElementById("filters");
  form.oninput = form.onchange = () => (dirty = true);
  form.onsubmit = (ev) => {
    ev.preventDefault();
    const p = new URLSearchParams();
    for (const [k, v] of new FormData(ev.target)) if (v) p.set(k, v);
    location.hash = `#/tasks?${p}`;
  };
  document.getElementById("goto").onsubmit = (ev) => {
    ev.preventDefault();
    const id = new FormData(ev.target).get("id").trim();
    if (id) location.hash = `#/task/${encodeURIComponent(id)}`;
  };
  // Row selection: a selection is a reason not to refresh under the user.
  const picked = () => [...view.querySelectorAll("input.pick:checked")];
  const count = () => { const c = document.getElementById("picked"); if (c) c.textContent = `${picked().length} selected`; dirty = picked().length > 0; };
  view.querySelectorAll("input.pick").forEach((c) => (c.onchange = count));
  const all = document.getElementById("pick-all");
  if (all) all.onchange = () => { view.querySelectorAll("input.pick").forEach((c) => (c.checked = all.checked)); count(); };
  const on = (name, f) => { const b = view.querySelector(`[data-act="${name}"]`); if (b) b.onclick = f; };
  const each = async (what, op, ids) => {
    if (!ids.length) { toast("select tasks first"); return; }
    if (!confirm(`${what} ${ids.length} task(s)?`)) return;
    let done = 0; const failed = [];
    for (const id of ids) {
      try { await call("task", op, { id, by: "console" }); done++; } catch (e) { failed.push(`${id}: ${e.message}`); }
    }
    toast(`${what}: ${done} done${failed.length ? `, ${failed.length} refused (${failed[0]})` : ""}`);
    dirty = false; render();
  };
  on("cancel-picked", () => each("Cancel", "cancel", picked().map((c) => c.value)));
  on("retry-picked", () => each("Retry", "retry", picked().filter((c) => c.dataset.state === "dead").map((c) => c.value)));
  on("cancel-many", async () => {
    const dry = await call("task", "cancel_many", { ...query, dry_run: true });
    if (!confirm(`Cancel ${num(dry.would_cancel)} task(s)?`)) return;
    const done = await call("task", "cancel_many", { ...query, by: "console" });
    toast(`cancelled ${num(done.cancelled)}`); render();
  });
  on("replay", async () => {
    const dry = await call("task", "replay", { ...query, state: "dead", dry_run: true });
    if (!confirm(`Retry ${num(dry.would_retry)} dead task(s)?`)) return;
    const done = await call("task", "replay", { ...query, state: "dead", by: "console" });
    toast(`retried ${num(done.retried)}`); render();
  });
  on("purge", async () => {
    const days = prompt("Purge finished tasks (succeeded, dead, cancelled) matching this filter, last changed more than how many days ago?", "7");
    if (days === null || !(Number(days) >= 0)) return;
    const older_than_ms = Math.round(Number(days) * 86400000);
    const states = query.state ? [query.state] : ["succeeded", "dead", "cancelled"];
    let would = 0;
    for (const state of states) would += (await call("task", "purge", { ...query, state, older_than_ms, dry_run: true })).would_purge;
    if (!confirm(`Delete the records of ${num(would)} finished task(s)? This cannot be undone.`)) return;
    let purged = 0;
    for (const state of states) purged += (await call("task", "purge", { ...query, state, older_than_ms, by: "console" })).purged;
    toast(`purged ${num(purged)}`); render();
  });
}

const pre = (v) => `<pre class="data">${esc(typeof v === "string" ? v : JSON.stringify(v, null, 2))}</pre>`;

async function task(id) {
  const [g, ev, body] = await Promise.all([call("task", "get", { id }), call("task", "events", { id }),
    call("task", "payload", { id }).catch((e) => ({ gone: e.message }))]);
  const rec = g.record;
  const flowRun = id.split(".")[1] === "fl" ? id.split(".")[2] : null;
  const kv = (k, v) => v === undefined || v === null || v === "" ? "" : `<tr><td>${k}</td><td>${v}</td></tr>`;
  // Attempts from the stored history: a `running` record (its revision is the fencing
  // token) and the record after it (the outcome).
  const hist = g.history;
  const attempts = [];
  hist.forEach((h, i) => {
    // An attempt that ended before its `running` write (a first attempt within its first
    // second, docs/PROTOCOL.md §3): its outcome record alone, no fencing token.
    const r = h.record, prev = i > 0 ? hist[i - 1].record : null;
    if (["succeeded", "retrying", "dead", "cancelled"].includes(r.state) && r.attempt > 0 &&
        r.started_at_ms && !(prev && prev.attempt === r.attempt)) {
      attempts.push(`<tr><td>${r.attempt}</td><td class="mono">${esc(r.worker || "")}</td><td>-</td>
        <td>${badge(r.state)}</td><td>${dur(r.updated_at_ms - r.started_at_ms)}</td>
        <td>${r.state !== "succeeded" && r.last_error ? esc(`${r.last_error.class}: ${r.last_error.message}`) : ""}</td></tr>`);
      return;
    }
    if (h.record.state !== "running") return;
    const end = hist.slice(i + 1).find((x) => x.record.state !== "running");
    attempts.push(`<tr><td>${h.record.attempt}</td><td class="mono">${esc(h.record.worker || "")}</td><td>${h.revision}</td>
      <td>${end ? badge(end.record.state) : badge("running")}</td>
      <td>${end ? dur(end.record.updated_at_ms - (h.record.started_at_ms || h.record.updated_at_ms)) : "-"}</td>
      <td>${end && end.record.state !== "succeeded" && end.record.last_error ? esc(`${end.record.last_error.class}: ${end.record.last_error.message}`) : ""}</td></tr>`);
  });
  const why = rec.trigger ? `trigger <b>${esc(rec.trigger)}</b> (${esc(rec.trigger_source)}, for ${when(rec.scheduled_at_ms)})`
    : flowRun ? `flow run <a href="#/run/${esc(flowRun)}">${esc(flowRun)}</a>` : "submitted by a producer";
  const events = ev.events.map((e) => `<tr><td>${when(e.at_ms)}</td><td>${esc(e.event)}</td><td>${e.attempt}</td><td class="mono">${esc(e.actor)}</td><td>${esc(e.reason || "")}</td></tr>`).join("");
  const o = body.options;
  const policy = o ? `${o.max_attempts} attempts; backoff ${dur(o.backoff.base_ms)} doubling to ${dur(o.backoff.max_ms)}, jitter ${Math.round(o.backoff.jitter * 100)} %` +
    (o.retry_on.length ? `; retried only on ${esc(o.retry_on.join(", "))}` : "") + (o.no_retry_on.length ? `; never retried on ${esc(o.no_retry_on.join(", "))}` : "") : "";
  const payload = body.payload ? (body.payload.json !== undefined ? pre(body.payload.json)
    : `${pre(body.payload.base64)}<p class="muted">${num(body.payload.bytes)} bytes, base64${body.payload.truncated ? ", first 64 KiB" : ""}</p>`)
    : `<p class="muted" id="payload-gone">${esc(body.gone || "")}</p>`;
  const out = rec.output;
  const output = !out ? "" : out.json !== undefined ? pre(out.json) : out.base64 !== undefined ? pre(out.base64)
    : `<p class="muted">${num(out.size)} bytes, stored in <code>AX_RESULTS</code> under <code>${esc(out.key)}</code> (<code>ax task get ${esc(id)} --result</code>)</p>`;
  const s = rec.state;
  const err = rec.last_error;
  show(`<h1 class="mono">${esc(id)}</h1>
    <p>${badge(s, "state")}${s === "running" && rec.started_at_ms ? ` <span class="muted">for ${ago(rec.started_at_ms).replace(" ago", "")}</span>` : ""}</p>
    <div class="actions">
      ${["scheduled", "pending", "retrying", "running"].includes(s) ? btn("Cancel", "cancel", "danger") : ""}
      ${s === "dead" ? btn("Retry", "retry", "primary") + btn("Retry with attempts reset", "retry-reset") : ""}
      ${["scheduled", "retrying"].includes(s) ? btn("Run now", "run-now", "primary") : ""}
    </div>
    <table class="kv" id="fields">
      ${kv("queue / name", `${esc(rec.queue)} / ${esc(rec.name)}`)}
      ${kv("priority", esc(rec.priority))}
      ${kv("attempt", `${rec.attempt} of ${rec.max_attempts}`)}
      ${kv("timeout", o ? dur(o.timeout_ms) : "")}
      ${kv("retry policy", policy)}
      ${kv("next retry", rec.next_retry_at_ms ? when(rec.next_retry_at_ms) : "")}
      ${kv("run at", rec.run_at_ms ? when(rec.run_at_ms) : "")}
      ${kv("last error", err ? `<span class="error">${esc(err.class)}</span>: ${esc(err.message)}` : "")}
      ${kv("worker", esc(rec.worker || ""))}
      ${kv("idempotency key", esc(rec.idempotency_key || ""))}
      ${kv("limit key", o ? esc(o.limit_key || "") : "")}
      ${kv("why it ran", why)}
      ${kv("waiting", rec.waiting ? esc(`${rec.waiting.reason} ${rec.waiting.limit}`) : "")}
      ${kv("operator", rec.op ? esc(`${rec.op.op} by ${rec.op.by}`) + " " + when(rec.op.at_ms) : "")}
      ${kv("traceparent", esc(rec.traceparent || ""))}
      ${kv("created / changed", `${when(rec.created_at_ms)} / ${when(rec.updated_at_ms)} (revision ${g.revision})`)}
    </table>
    ${err && err.detail ? `<h2>Error detail</h2><div id="error-detail">${pre(err.detail)}</div>` : ""}
    <h2>Payload${body.source ? ` <span class="muted">(from the ${esc(body.source)} message)</span>` : ""}</h2><div id="payload">${payload}</div>
    ${output ? `<h2>Output</h2><div id="output">${output}</div>` : ""}
    <h2>Attempts</h2>
    <table id="attempts"><tr><th>attempt</th><th>worker</th><th>fencing token</th><th>outcome</th><th>duration</th><th>error</th></tr>${attempts.join("")}</table>
    <h2>Events</h2>${ev.complete ? "" : `<p class="muted">The record's last 16 changes (keep all with --task-events).</p>`}
    <table id="events"><tr><th>when</th><th>event</th><th>attempt</th><th>actor</th><th>reason</th></tr>${events}</table>`);
  const on = (name, f) => { const b = view.querySelector(`[data-act="${name}"]`); if (b) b.onclick = f; };
  on("cancel", () => act("cancel", "task", "cancel", { id, by: "console" }));
  on("retry", () => act("retry", "task", "retry", { id, by: "console" }));
  on("retry-reset", () => act("retry", "task", "retry", { id, reset_attempts: true, by: "console" }));
  on("run-now", () => act("run now", "task", "run_now", { id, by: "console" }));
}

async function runs() {
  const [list, approvals] = await Promise.all([call("flow", "list", { limit: 1000 }), call("flow", "approvals", {})]);
  // Per flow, over the last hour: runs started per minute, and the p50 time of the runs
  // that ended in each minute; from the runs the flow store keeps.
  const now = Date.now(), start = Math.floor((now - 3600000) / 60000) * 60000;
  const minutes = Array.from({ length: 61 }, (_, i) => start + i * 60000);
  const flows = [...new Set(list.map((r) => r.flow))].slice(0, 6);
  const perFlow = (f, pick) => ({ name: f, points: minutes.map((m) => [m, pick(list.filter((r) => r.flow === f), m)]) });
  const started = (rs, m) => rs.filter((r) => r.created_at_ms >= m && r.created_at_ms < m + 60000).length;
  const p50 = (rs, m) => {
    const d = rs.filter((r) => r.finished_at_ms >= m && r.finished_at_ms < m + 60000).map((r) => r.finished_at_ms - r.created_at_ms).sort((a, b) => a - b);
    return d.length ? d[Math.floor((d.length - 1) / 2)] : null;
  };
  const charts = flows.length ? `<div class="charts">${chart({ id: "chart-flow-runs", title: "runs started per minute, by flow", series: flows.map((f) => perFlow(f, started)) })}
    ${chart({ id: "chart-flow-time", title: "run time p50 (ms), by flow", unit: " ms", series: flows.map((f) => perFlow(f, p50)) })}</div>` : "";
  // Approvals waiting: approve or reject by the wait task (an admin's session; the
  // token is for whoever the approval's announcement went to).
  const decide = (a, decision) => `flow/approve_task/${JSON.stringify({ task: a.task, decision })}`;
  const waiting = approvals.length ? `<h2>Approvals waiting</h2><table id="approvals">
    <tr><th>run</th><th>flow</th><th>step</th><th>message</th><th>since</th><th>times out</th><th></th></tr>
    ${approvals.map((a) => `<tr><td class="mono"><a href="#/run/${esc(a.run)}">${esc(a.run)}</a></td><td>${esc(a.flow)}</td><td>${esc(a.step)}</td>
    <td>${esc(a.message || "")}</td><td>${when(a.since_ms)}</td><td>${when(a.until_ms)}</td>
    <td>${btn("Approve", decide(a, "approve"), "primary")} ${btn("Reject", decide(a, "reject"), "danger")}</td></tr>`).join("")}</table>` : "";
  show(`<h1>Flow runs</h1>${waiting}${charts}<table id="runs"><tr><th>run</th><th>flow</th><th>state</th><th>started</th><th>took</th><th>reason</th></tr>
    ${list.slice(0, 100).map((r) => `<tr><td class="mono"><a href="#/run/${esc(r.run)}">${esc(r.run)}</a></td><td>${esc(r.flow)}</td>
    <td>${badge(r.state)}</td><td>${when(r.created_at_ms)}</td><td>${r.finished_at_ms ? dur(r.finished_at_ms - r.created_at_ms) : "-"}</td><td>${esc(r.reason || "")}</td></tr>`).join("")}</table>`);
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
    <text x="${pos[s.name].x + 10}" y="${pos[s.name].y + 34}" fill="#475467">${esc(stepState(s))}${s.epoch ? ` · epoch ${s.epoch}` : ""}</text></g>`);
  return `<svg class="dag" width="${width}" height="${height}"><defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" markerHeight="6" orient="auto"><path d="M0,0L10,5L0,10z" fill="#98a2b3"/></marker></defs>${edges.join("")}${nodes.join("")}</svg>`;
}

// A step's state as shown: a running step that waits says what for and until when.
function stepState(s) {
  const until = s.waiting ? new Date(s.waiting.until_ms).toISOString().replace(".000", "") : "";
  if (s.waiting && s.waiting.kind === "sleep") return `sleeping until ${until}`;
  if (s.waiting && s.waiting.kind === "event") return `waiting for event ${s.waiting.event} until ${until}`;
  if (s.waiting && s.waiting.kind === "approval") return `waiting for approval until ${until}`;
  if (s.waiting && s.waiting.kind === "flow") return `waiting for flow ${s.waiting.flow} (${s.waiting.runs.length} run${s.waiting.runs.length === 1 ? "" : "s"}) until ${until}`;
  return s.state;
}

// A waiting child flow step's runs, linked.
function childLinks(s) {
  if (!s.waiting || s.waiting.kind !== "flow") return "";
  return s.waiting.runs.map((c) => ` <a class="mono child-run" href="#/run/${encodeURIComponent(c)}">${esc(c)}</a>`).join("");
}

async function run(id) {
  const r = await call("flow", "get", { run: id });
  const rows = r.steps.map((s) => `<tr><td>${esc(s.name)}</td><td>${s.waiting ? esc(stepState(s)) : badge(s.state)}</td><td>${s.epoch ?? 0}</td>
    <td>${s.task_id ? `<a class="mono" href="#/task/${encodeURIComponent(s.task_id)}">${esc(s.task_id)}</a>` : ""}${childLinks(s)}</td>
    <td>${s.error ? esc(`${s.error.class}: ${s.error.message}`) : ""}</td></tr>`).join("");
  const parent = r.parent ? `<p>child of <a class="mono" href="#/run/${encodeURIComponent(r.parent.run)}">${esc(r.parent.run)}</a> (step ${esc(r.parent.step)})</p>` : "";
  show(`<h1>Run <span class="mono">${esc(id)}</span> of ${esc(r.flow)}</h1>
    <p>${badge(r.state, "run-state")} ${esc(r.reason || "")}</p>${parent}
    <div class="actions">${r.state === "running" ? btn("Cancel run", "cancel", "danger") : ""}${r.state !== "running" ? btn("Re-run…", "rerun", "primary") : ""}</div>
    ${dag(r.steps)}
    <h2>Steps</h2><table><tr><th>step</th><th>state</th><th>epoch</th><th>first task</th><th>error</th></tr>${rows}</table>
    <dialog id="rerun-dialog"><form method="dialog"><h2>Re-run</h2>
      <label><input type="radio" name="mode" value="failed" checked> failed steps only</label><br>
      <label><input type="radio" name="mode" value="failed_and_downstream"> failed steps and everything downstream</label><br>
      <label><input type="radio" name="mode" value="whole"> the whole run (a new run)</label>
      <div class="actions"><button value="cancel">Cancel</button><button class="primary" id="rerun-go" value="go">Re-run</button></div></form></dialog>`);
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
  show(`<h1>Triggers</h1><p>Leader (fires the scheduled triggers): <span class="mono" id="leader">${esc(lead.leader || "none")}</span></p>
    <table><tr><th>name</th><th>kind</th><th>enabled</th><th>next fire</th><th>fires</th><th>last fire</th><th>last result</th><th></th></tr>
    ${list.map((t) => `<tr><td>${esc(t.name)}</td><td>${esc(t.kind)}</td><td>${t.enabled ? "yes" : "paused"}</td>
    <td>${esc(t.next ?? "-")}</td><td>${t.fires ?? 0}</td><td>${when(t.last_fired_at_ms)}</td><td>${esc((t.last_result || []).join(", "))}</td>
    <td>${btn(t.enabled ? "Pause" : "Resume", `trigger/${t.enabled ? "pause" : "resume"}/${JSON.stringify({ name: t.name })}`)}
        ${btn("Run now", `trigger/run/${JSON.stringify({ name: t.name })}`)}</td></tr>`).join("")}</table>`);
}

async function limits() {
  const [list, waiting, fair] = await Promise.all([call("limit", "status", {}), call("limit", "windows", {}),
    call("limit", "fair_get", {})]);
  const tenants = Object.entries(fair.reports || {}).flatMap(([q, r]) => r.tenants.map((t) => ({ queue: q, ...t })));
  const shares = tenants.length ? `<h2>Fair shares: tenants</h2><table id="fair">
    <tr><th>queue</th><th>tenant</th><th>priority</th><th>weight</th><th>held</th><th>released in the last second</th></tr>
    ${tenants.map((t) => `<tr><td>${esc(t.queue)}</td><td class="mono">${esc(t.key)}</td><td>${esc(t.priority)}</td>
    <td>${t.weight}</td><td>${t.held}</td><td>${t.released}</td></tr>`).join("")}</table>` : "";
  const runs = (w) => w.closed ? "closed: due now" : w.due_ms > Date.now() ? `in ${((w.due_ms - Date.now()) / 1000).toFixed(1)} s` : "due now";
  const windows = waiting.windows.length ? `<h2>Debounce windows and batches waiting</h2><table id="windows">
    <tr><th>queue</th><th>waiting</th><th>key</th><th>items</th><th>runs</th><th>task</th></tr>
    ${waiting.windows.map((w) => `<tr><td>${esc(w.queue)}</td><td>${esc(w.kind)}</td><td class="mono">${esc(w.key ?? "")}</td>
    <td>${w.items ?? ""}</td><td>${runs(w)}</td><td><a class="mono" href="#/task/${encodeURIComponent(w.id)}">${esc(w.id)}</a></td></tr>`).join("")}</table>
    ${waiting.more ? `<p class="muted">and ${waiting.more} more not listed</p>` : ""}` : "";
  show(`<h1>Limits</h1><table id="limits"><tr><th>queue</th><th>name</th><th>task</th><th>per key</th><th>rate/s</th><th>burst</th>
    <th>tokens left</th><th>concurrency</th><th>slots held</th></tr>
    ${list.map(({ limit: l, tokens, slots_held, rate_now }) => `<tr><td>${esc(l.queue)}${l.queues ? ` <span class="muted">shared with ${l.queues.filter((q) => q !== l.queue).map(esc).join(", ")}</span>` : ""}</td><td>${esc(l.name)}</td><td>${esc(l.task || "all")}</td>
    <td>${l.per_key ? "yes" : ""}</td><td>${l.rate ?? ""}${l.adaptive ? ` <span class="muted">adaptive ${esc(l.adaptive.min)}–${esc(l.rate)}${rate_now != null ? `, now ${rate_now.toFixed(1)}` : ""}</span>` : ""}${l.excess === "drop" ? ` <span class="muted">excess dropped</span>` : ""}</td><td>${l.burst ?? ""}</td>
    <td>${tokens === null ? (l.rate ? "per key" : "") : tokens.toFixed(1)}</td><td>${l.concurrency ?? ""}</td>
    <td>${slots_held.length}${slots_held.length ? `: <span class="mono">${slots_held.map((s) => esc(s.holder)).join(", ")}</span>` : ""}</td></tr>`).join("")}</table>
    <p class="muted">Tasks waiting for a limit carry <code>waiting</code> in their record (shown on the task page).</p>${windows}${shares}`);
}

// ---- routing, actions, live updates ----

async function render() {
  dirty = false;
  window.axRenders = (window.axRenders || 0) + 1;
  if (!role && !(await whoami())) return;
  const [path, qs] = location.hash.slice(1).split("?");
  const params = new URLSearchParams(qs || "");
  try {
    if (!path || path === "/") await overview();
    else if (path === "/tasks") await tasks(params);
    else if (path.startsWith("/queue/")) await queue(decodeURIComponent(path.slice(7)));
    else if (path.startsWith("/task/")) await task(decodeURIComponent(path.slice(6)));
    else if (path === "/runs") await runs();
    else if (path.startsWith("/run/")) await run(decodeURIComponent(path.slice(5)));
    else if (path === "/triggers") await triggers();
    else if (path === "/limits") await limits();
    else show("<h1>Not found</h1>");
  } catch (e) {
    if (e.message !== "log in") show(`<h1>Error</h1><p class="error">${esc(e.message)}</p>`);
  }
  // Generic buttons: data-act="<api>/<op>/<json body>".
  // The body is read at click time: a kept button may carry a new data-act.
  view.querySelectorAll("[data-act]").forEach((b) => {
    if (b.dataset.act.split("/").length >= 3) b.onclick = () => {
      const parts = b.dataset.act.split("/");
      act(b.textContent, parts[0], parts[1], JSON.parse(parts.slice(2).join("/")));
    };
  });
}

window.addEventListener("hashchange", render);
let pending = null;
let source = null;
// Someone is typing in a filter or has a dialog open: a live refresh would throw that away.
let dirty = false;
const busy = () => dirty || !!document.querySelector("dialog[open]") ||
  (document.activeElement && ["INPUT", "SELECT"].includes(document.activeElement.tagName));
// Live updates: the server says when the task index, a flow run, a wait, a trigger or a limit moved; the page shows it again. A
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
