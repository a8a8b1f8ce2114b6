// CubeOps console: plain JavaScript, no build step. Every call goes to
// /ops/api with the session cookie and the CSRF token of the login.
const $ = (sel, el = document) => el.querySelector(sel);
const view = $("#view");
let me = null; // {user, admin, team, csrf}
let stopPage = () => {}; // closes the current page's streams and timers

function esc(s) {
  return String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}
function showError(msg) {
  const e = $("#error");
  e.textContent = msg || "";
  e.hidden = !msg;
}
async function api(method, path, body) {
  const opt = { method, headers: {}, credentials: "same-origin" };
  if (me?.csrf && method !== "GET") opt.headers["X-CSRF-Token"] = me.csrf;
  if (body !== undefined) {
    opt.headers["Content-Type"] = "application/json";
    opt.body = JSON.stringify(body);
  }
  const r = await fetch("/ops/api" + path, opt);
  if (r.status === 401 && path !== "/login") {
    me = null;
    route();
    throw new Error("logged out");
  }
  const text = await r.text();
  const data = text ? JSON.parse(text) : null;
  if (!r.ok) throw new Error(data?.message || r.statusText);
  return data;
}
// act runs a long operation with its button disabled and a clear error.
async function act(btn, label, fn) {
  const old = btn.textContent;
  btn.disabled = true;
  btn.textContent = label + "…";
  showError("");
  try {
    return await fn();
  } catch (e) {
    showError(`${old} failed: ${e.message}`);
  } finally {
    btn.disabled = false;
    btn.textContent = old;
  }
}
const bytes = (n) => {
  if (!n) return "0";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return n.toFixed(i ? 1 : 0) + " " + u[i];
};
const bar = (used, total) => {
  const pct = total > 0 ? Math.min(100, (100 * used) / total) : 0;
  return `<span class="bar" title="${pct.toFixed(0)}%"><i style="width:${pct}%"></i></span> ${pct.toFixed(0)}%`;
};
const ago = (t) => (t ? new Date(t).toLocaleTimeString() : "");

// ---- pages ----

async function pageNodes() {
  view.innerHTML = `<h1>Nodes</h1><div class="cards" id="nodes">loading…</div>`;
  const draw = async () => {
    const nodes = await api("GET", "/nodes");
    $("#nodes").innerHTML = nodes.length ? nodes.map((n) => `
      <div class="card node" data-id="${esc(n.id)}">
        <h2>${esc(n.id)} <span class="${n.healthy ? "ok" : "bad"}">${n.healthy ? "healthy" : "unhealthy"}</span>
          ${n.schedulable ? "" : '<span class="muted">cordoned</span>'}</h2>
        ${n.reason ? `<p class="bad">${esc(n.reason)}</p>` : ""}
        <div>CPU ${bar(n.allocatedMilliCPU, n.maxMilliCPU || n.cpus * 1000)} <span class="muted">${(n.allocatedMilliCPU / 1000).toFixed(1)} of ${n.cpus} CPUs allocated</span></div>
        <div>Memory ${bar(n.allocatedMemoryMiB * 1048576, n.maxMemoryMiB * 1048576 || n.memoryBytes)} <span class="muted">${bytes(n.allocatedMemoryMiB * 1048576)}</span></div>
        <div>Disk ${bar(n.storageTotalBytes - n.storageFreeBytes, n.storageTotalBytes)} <span class="muted">${bytes(n.storageFreeBytes)} free</span></div>
        <p class="muted">${n.sandboxes} sandboxes · ${esc(n.version)} · heartbeat ${ago(n.lastHeartbeat)}</p>
        <button data-act="${n.schedulable ? "cordon" : "uncordon"}">${n.schedulable ? "Cordon" : "Uncordon"}</button>
      </div>`).join("") : "<p>No node has registered.</p>";
    for (const b of view.querySelectorAll("button[data-act]")) {
      b.onclick = () => act(b, b.textContent, async () => {
        await api("POST", `/nodes/${b.closest(".node").dataset.id}/${b.dataset.act}`);
        await draw();
      });
    }
  };
  await draw();
  const t = setInterval(() => draw().catch(() => {}), 5000);
  return () => clearInterval(t);
}

function sandboxRows(list) {
  return list.map((s) => `<tr data-id="${esc(s.id)}">
    <td><a href="#/sandbox/${esc(s.id)}">${esc(s.id)}</a></td>
    <td class="state-${esc(s.state)}">${esc(s.state)}</td><td>${esc(s.alias || s.templateID)}</td>
    <td>${esc(s.runtime)}</td><td>${esc(s.nodeID)}</td><td>${esc(s.team)}</td>
    <td>${(s.milliCPU / 1000).toFixed(1)} CPU · ${s.memoryMiB} MiB</td><td>${ago(s.startedAt)}</td></tr>`).join("");
}

async function pageSandboxes() {
  const tmpls = await api("GET", "/templates");
  view.innerHTML = `<h1>Sandboxes</h1>
    <form id="create" class="actions">
      <select name="template">${tmpls.map((t) => `<option value="${esc(t.id)}">${esc(t.id)}${t.aliases?.length ? " (" + esc(t.aliases.join(", ")) + ")" : ""}</option>`).join("")}</select>
      <input name="timeout" type="number" min="10" value="600" title="time to live, seconds">
      <button class="primary" type="submit">Create sandbox</button>
      <input id="filter" placeholder="filter">
    </form>
    <table><thead><tr><th>ID</th><th>State</th><th>Template</th><th>Runtime</th><th>Node</th><th>Team</th><th>Size</th><th>Started</th></tr></thead>
    <tbody id="rows"><tr><td colspan="8">loading…</td></tr></tbody></table>`;
  let last = [];
  const draw = () => {
    const f = $("#filter").value;
    $("#rows").innerHTML = sandboxRows(last.filter((s) => !f || JSON.stringify(s).includes(f))) ||
      '<tr><td colspan="8" class="muted">No sandboxes.</td></tr>';
  };
  $("#filter").oninput = draw;
  $("#create").onsubmit = (ev) => {
    ev.preventDefault();
    const fd = new FormData(ev.target);
    act($("#create button"), "Creating", async () => {
      const sb = await api("POST", "/sandboxes", { template: fd.get("template"), timeoutSeconds: Number(fd.get("timeout")) });
      location.hash = "#/sandbox/" + sb.id;
    });
  };
  // Live: server-sent events with the whole list on every change.
  const es = new EventSource("/ops/api/live");
  es.addEventListener("sandboxes", (e) => { last = JSON.parse(e.data); draw(); });
  es.onerror = () => showError("live updates interrupted; retrying…");
  es.onopen = () => showError("");
  return () => es.close();
}

// chart draws one series (values 0..max) on a canvas.
function chart(canvas, points, max, label, fmt) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  canvas.width = w * dpr;
  canvas.height = h * dpr;
  const g = canvas.getContext("2d");
  g.scale(dpr, dpr);
  g.clearRect(0, 0, w, h);
  g.fillStyle = "#667";
  g.font = "12px system-ui";
  const lastV = points.length ? points[points.length - 1].v : 0;
  g.fillText(`${label}: ${fmt(lastV)}`, 8, 16);
  if (points.length < 2) return;
  const t0 = points[0].t, t1 = points[points.length - 1].t;
  g.strokeStyle = "#2563eb";
  g.lineWidth = 1.5;
  g.beginPath();
  points.forEach((p, i) => {
    const x = 4 + ((w - 8) * (p.t - t0)) / Math.max(1, t1 - t0);
    const y = h - 4 - ((h - 28) * Math.min(p.v, max)) / max;
    i ? g.lineTo(x, y) : g.moveTo(x, y);
  });
  g.stroke();
}

function traceTable(fields) {
  const rows = Object.keys(fields).filter((k) => k.startsWith("trace.") && k !== "trace.flow").sort();
  const total = Number(fields["trace.total"]) || 1;
  return `<table class="trace"><tbody>${rows.map((k) => {
    const v = Number(fields[k]);
    return `<tr><td>${esc(k.slice(6))}</td><td>${v.toFixed(1)} ms</td><td>${bar(v, total)}</td></tr>`;
  }).join("")}</tbody></table>`;
}

async function pageSandbox(id) {
  view.innerHTML = `<h1>Sandbox ${esc(id)}</h1><p id="facts">loading…</p>
    <div class="actions">
      <button id="pause">Pause</button><button id="resume">Resume</button>
      <button id="snapshot">Snapshot</button><button id="kill">Kill</button>
      <button id="open-term">Open terminal</button>
    </div>
    <div id="term-box" hidden><div id="terminal"></div></div>
    <div class="cards">
      <div class="card"><canvas class="chart" id="cpu"></canvas></div>
      <div class="card"><canvas class="chart" id="mem"></canvas></div>
    </div>
    <h2>Create trace</h2><div id="trace" class="muted">none</div>
    <h2>Log</h2><pre class="logs" id="logs"></pre>`;
  let sb = null;
  const facts = async () => {
    sb = await api("GET", "/sandboxes/" + id);
    $("#facts").innerHTML = `<span class="state-${esc(sb.state)}" id="state">${esc(sb.state)}</span> ·
      ${esc(sb.alias || sb.templateID)} on ${esc(sb.nodeID)} (${esc(sb.runtime)}) · team ${esc(sb.team)} · until ${ago(sb.endAt)}`;
  };
  const metrics = async () => {
    const ms = await api("GET", `/sandboxes/${id}/metrics`);
    chart($("#cpu"), ms.map((m) => ({ t: m.t, v: m.cpuUsedPct })), 100, "CPU", (v) => v.toFixed(1) + "%");
    $("#cpu").dataset.last = ms.length ? ms[ms.length - 1].cpuUsedPct : 0;
    $("#cpu").dataset.max = Math.max(0, ...ms.map((m) => m.cpuUsedPct));
    const total = ms.length ? ms[ms.length - 1].memTotal : 1;
    chart($("#mem"), ms.map((m) => ({ t: m.t, v: m.memUsed })), total, "Memory", bytes);
  };
  const logs = async () => {
    const ls = await api("GET", `/sandboxes/${id}/logs`);
    const created = ls.find((l) => l.message === "sandbox created" && l.fields?.["trace.total"]);
    if (created) $("#trace").innerHTML = traceTable(created.fields);
    $("#logs").innerHTML = ls.slice().reverse().map((l) =>
      `<span class="lvl-${esc(l.level)}">${new Date(l.t).toLocaleTimeString()} ${esc(l.fields?.stream || l.level)} ${esc(l.message)}</span>`).join("\n");
  };
  const verb = (btnID, name, label) => {
    const b = $("#" + btnID);
    b.onclick = () => act(b, label, async () => {
      if (name === "kill" && !confirm(`Kill ${id}?`)) return;
      if (name === "snapshot") {
        const s = await api("POST", `/sandboxes/${id}/snapshot`, {});
        showError("");
        $("#facts").insertAdjacentHTML("beforeend", ` · snapshot <a href="#/lineage">${esc(s.id)}</a>`);
        return;
      }
      await api("POST", `/sandboxes/${id}/${name}`);
      if (name === "kill") { location.hash = "#/sandboxes"; return; }
      await facts();
    });
  };
  verb("pause", "pause", "Pausing");
  verb("resume", "resume", "Resuming");
  verb("kill", "kill", "Killing");
  verb("snapshot", "snapshot", "Snapshotting");
  let ws = null, term = null;
  $("#open-term").onclick = () => {
    if (ws) return;
    $("#term-box").hidden = false;
    term = new window.Terminal({ cols: 100, rows: 18, convertEol: false });
    term.open($("#terminal"));
    const proto = location.protocol === "https:" ? "wss:" : "ws:";
    ws = new WebSocket(`${proto}//${location.host}/ops/api/sandboxes/${id}/terminal`);
    ws.binaryType = "arraybuffer";
    ws.onmessage = (e) => term.write(typeof e.data === "string" ? e.data : new Uint8Array(e.data));
    ws.onopen = () => ws.send(JSON.stringify({ type: "resize", cols: term.cols, rows: term.rows }));
    ws.onclose = () => { term.write("\r\n[disconnected]\r\n"); ws = null; };
    term.onData((d) => ws?.readyState === 1 && ws.send(JSON.stringify({ type: "input", data: d })));
    window.cubeTerm = term; // for tests: the buffer is read through it
  };
  // Handlers first, then the data: a click never meets a button without
  // its handler. #state appears once the sandbox is read.
  await facts();
  await Promise.all([metrics().catch(() => {}), logs().catch(() => {})]);
  const t = setInterval(() => {
    metrics().catch(() => {});
    logs().catch(() => {});
    facts().catch(() => {});
  }, 2000);
  return () => { clearInterval(t); ws?.close(); term?.dispose(); };
}

async function pageTemplates() {
  const ts = await api("GET", "/templates");
  view.innerHTML = `<h1>Templates</h1><table><thead><tr><th>ID</th><th>Aliases</th><th>Nodes</th><th>Size</th><th>Created</th></tr></thead>
    <tbody>${ts.map((t) => `<tr><td>${esc(t.id)}</td><td>${esc((t.aliases || []).join(", "))}</td><td>${esc((t.nodes || []).join(", "))}</td>
    <td>${bytes(t.sizeBytes)}</td><td>${ago(t.createdAt)}</td></tr>`).join("")}</tbody></table>`;
}

async function pageLineage() {
  const roots = await api("GET", "/lineage");
  const li = (n) => `<li data-kind="${esc(n.kind)}" data-id="${esc(n.id)}"><span class="kind kind-${esc(n.kind)}">${esc(n.kind)}</span>${
    n.kind === "sandbox" ? `<a href="#/sandbox/${esc(n.id)}">${esc(n.label)}</a> <span class="state-${esc(n.state)}">${esc(n.state)}</span>` : esc(n.label)}
    ${n.children.length ? `<ul>${n.children.map(li).join("")}</ul>` : ""}</li>`;
  view.innerHTML = `<h1>Snapshot lineage</h1>${roots.length ? `<ul class="tree">${roots.map(li).join("")}</ul>` : "<p>Nothing yet.</p>"}`;
}

// ---- routing and login ----

// gen counts route() calls: a page whose route was overtaken while it
// loaded stops itself at once (browsers allow six connections per host
// over HTTP/1.1; a leaked live stream would hold one for good).
let gen = 0;
async function route() {
  const mine = ++gen;
  stopPage();
  stopPage = () => {};
  showError("");
  if (!me) {
    try {
      me = await (await fetch("/ops/api/session", { credentials: "same-origin" })).json();
      if (!me.user) me = null;
    } catch { me = null; }
  }
  $("#login").hidden = !!me;
  $("#nav").hidden = !me;
  view.hidden = !me;
  if (!me) return;
  $("#who").textContent = me.admin ? `${me.user} (admin)` : `${me.user} (team ${me.team})`;
  $("#nav-nodes").hidden = !me.admin;
  const [, page, arg] = (location.hash || "").split("/");
  try {
    const stop = await ({
      // The ID from the URL goes into API paths: encoded, so a crafted
      // link cannot turn a button into a call of another route.
      nodes: pageNodes, sandboxes: pageSandboxes, sandbox: () => pageSandbox(encodeURIComponent(decodeURIComponent(arg || ""))), templates: pageTemplates, lineage: pageLineage,
    }[page] || (me.admin ? pageNodes : pageSandboxes))();
    if (stop && mine !== gen) stop();
    else if (stop) stopPage = stop;
  } catch (e) {
    showError(e.message);
  }
}

async function login(body) {
  try {
    me = await api("POST", "/login", body);
    const want = me.admin ? "#/nodes" : "#/sandboxes";
    if (!location.hash || location.hash === "#") location.hash = want; // hashchange routes
    else route();
  } catch (e) {
    showError("Log in failed: " + e.message);
  }
}
$("#login-password").onsubmit = (ev) => {
  ev.preventDefault();
  const fd = new FormData(ev.target);
  login({ user: fd.get("user"), password: fd.get("password") });
};
$("#login-key").onsubmit = (ev) => {
  ev.preventDefault();
  login({ key: new FormData(ev.target).get("key") });
};
$("#logout").onclick = async () => {
  await api("POST", "/logout").catch(() => {});
  me = null;
  location.hash = "";
  route();
};
window.addEventListener("hashchange", route);
route();
