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
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// runJob follows a long operation (a job of the ops API) in box: its
// steps, a progress bar when it counts units, and a Cancel button, until
// it ends. It resolves with the finished job and throws its error when it
// failed, so act() shows that at the top of the page too.
async function runJob(box, job) {
  box.hidden = false;
  box.onclick = (e) => {
    if (e.target.dataset.cancel) api("POST", `/jobs/${e.target.dataset.cancel}/cancel`).catch((err) => showError(err.message));
  };
  for (;;) {
    box.innerHTML = `<div class="job job-${esc(job.state)}" data-job="${esc(job.id)}" data-state="${esc(job.state)}">
      <b>${esc(job.kind)} ${esc(job.target)}</b> <span class="job-state">${esc(job.state)}</span>
      ${job.total ? `${bar(job.done, job.total)} <span class="muted">${esc(job.progress)}</span>` : ""}
      <span class="muted">${((new Date(job.ended || Date.now()) - new Date(job.started)) / 1000).toFixed(1)} s</span>
      ${job.state === "running" ? `<button type="button" data-cancel="${esc(job.id)}">Cancel</button>` : ""}
      <ol class="steps">${job.steps.map((s) => `<li class="lvl-${esc(s.level)}">${new Date(s.t).toLocaleTimeString()} ${esc(s.text)}</li>`).join("")}</ol>
      ${job.error ? `<p class="bad job-error">${esc(job.error)}</p>` : ""}</div>`;
    if (job.state !== "running" || !box.isConnected) break;
    await sleep(500);
    job = await api("GET", "/jobs/" + job.id);
  }
  if (job.state !== "done") throw new Error(job.error || job.state);
  return job;
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
  view.innerHTML = `<h1>Nodes</h1><div class="cards" id="nodes">loading…</div><div id="drain-job" class="jobbox" hidden></div>`;
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
        <button data-drain="1">Drain</button>
      </div>`).join("") : "<p>No node has registered.</p>";
    for (const b of view.querySelectorAll("button[data-act]")) {
      b.onclick = () => act(b, b.textContent, async () => {
        await api("POST", `/nodes/${b.closest(".node").dataset.id}/${b.dataset.act}`);
        await draw();
      });
    }
    for (const b of view.querySelectorAll("button[data-drain]")) {
      const node = b.closest(".node").dataset.id;
      b.onclick = () => act(b, "Draining", async () => {
        if (!confirm(`Drain ${node}? It is cordoned and its sandboxes move to other nodes.`)) return;
        const job = await api("POST", `/nodes/${node}/drain`, {});
        try {
          await runJob($("#drain-job"), job);
        } finally {
          await draw();
        }
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
    <table><thead id="sort"><tr><th data-key="id">ID</th><th data-key="state">State</th><th data-key="templateID">Template</th><th data-key="runtime">Runtime</th>
      <th data-key="nodeID">Node</th><th data-key="team">Team</th><th data-key="memoryMiB">Size</th><th data-key="startedAt">Started</th></tr></thead>
    <tbody id="rows"><tr><td colspan="8">loading…</td></tr></tbody></table>`;
  let last = [];
  // Sorted by a column (a click on its header; again: reversed), newest
  // first until then.
  let key = "", dir = 1;
  const draw = () => {
    const f = $("#filter").value;
    const rows = last.filter((s) => !f || JSON.stringify(s).includes(f));
    if (key) rows.sort((a, b) => (a[key] < b[key] ? -dir : a[key] > b[key] ? dir : 0));
    $("#rows").innerHTML = sandboxRows(rows) || '<tr><td colspan="8" class="muted">No sandboxes.</td></tr>';
    for (const th of view.querySelectorAll("#sort th")) th.dataset.dir = th.dataset.key === key ? (dir > 0 ? "asc" : "desc") : "";
  };
  $("#sort").onclick = (ev) => {
    const k = ev.target.closest("th")?.dataset.key;
    if (!k) return;
    dir = k === key ? -dir : 1;
    key = k;
    draw();
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
  view.innerHTML = `<h1>Sandbox ${esc(id)}</h1><p id="facts">loading…</p><p id="made" class="muted"></p>
    <div class="actions">
      <button id="pause">Pause</button><button id="resume">Resume</button>
      <button id="snapshot">Snapshot</button><button id="fork">Fork</button><button id="kill">Kill</button>
      <button id="open-term">Open terminal</button>
    </div>
    <div id="term-box" hidden><div id="terminal"></div></div>
    <div class="cards">
      <div class="card"><canvas class="chart" id="cpu"></canvas></div>
      <div class="card"><canvas class="chart" id="mem"></canvas></div>
    </div>
    <h2>Files</h2>
    <div class="files">
      <form id="file-nav" class="actions"><input name="path" value="/" size="40" aria-label="directory"><button type="submit">Open</button>
        <button type="button" id="file-up">Up</button></form>
      <table><thead><tr><th>Name</th><th>Size</th><th>Mode</th><th>Owner</th><th>Modified</th></tr></thead><tbody id="file-rows"></tbody></table>
      <form id="upload" class="actions"><input type="file" name="file"><button type="submit">Upload here</button>
        <progress id="upload-progress" max="1" value="0" hidden></progress> <span id="upload-status" class="muted"></span></form>
      <h3 id="file-name" hidden></h3><pre class="logs" id="file-view" hidden></pre>
    </div>
    <h2>Create trace</h2><div id="trace" class="muted">none</div>
    <h2>Log</h2><pre class="logs" id="logs"></pre>`;
  let sb = null;
  const showFacts = () => {
    $("#facts").innerHTML = `<span class="state-${esc(sb.state)}" id="state">${esc(sb.state)}</span> ·
      ${esc(sb.alias || sb.templateID)} on ${esc(sb.nodeID)} (${esc(sb.runtime)}) · team ${esc(sb.team)} · until ${ago(sb.endAt)}`;
  };
  const facts = async () => {
    sb = await api("GET", "/sandboxes/" + id);
    showFacts();
  };
  // Samples arrive over the page's live stream (the history first, then
  // each new one); the charts keep the last 900.
  let ms = [];
  const drawMetrics = () => {
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
        $("#made").insertAdjacentHTML("beforeend", ` snapshot <a class="snap" href="#/lineage">${esc(s.id)}</a>`);
        return;
      }
      if (name === "fork") {
        const f = await api("POST", `/sandboxes/${id}/fork`, { count: 1 });
        $("#made").insertAdjacentHTML("beforeend", f.sandboxes.map((c) => ` fork <a class="fork" href="#/sandbox/${esc(c.id)}">${esc(c.id)}</a>`).join(""));
        if (f.errors.length) throw new Error(f.errors.join("; "));
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
  verb("fork", "fork", "Forking");
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
  // Files: a directory listing through the sandbox's agent; a click on a
  // file shows its text, on a directory opens it; uploads go to the
  // directory shown, with their progress.
  let dir = "/";
  const openDir = async (p) => {
    const files = await api("GET", `/sandboxes/${id}/files?path=${encodeURIComponent(p)}`);
    dir = p;
    $("#file-nav input").value = p;
    $("#file-rows").innerHTML = files.map((f) => `<tr data-path="${esc(f.path)}" data-type="${esc(f.type)}">
      <td><button type="button" class="link file-${esc(f.type)}">${esc(f.name)}${f.type === "dir" ? "/" : ""}</button></td>
      <td>${f.type === "dir" ? "" : bytes(f.size)}</td><td><code>${esc(f.mode)}</code></td><td>${esc(f.owner)}</td><td>${ago(f.modified)}</td></tr>`).join("") ||
      '<tr><td colspan="5" class="muted">empty</td></tr>';
  };
  const showFile = async (p) => {
    const r = await fetch(`/ops/api/sandboxes/${id}/file?path=${encodeURIComponent(p)}`, { credentials: "same-origin" });
    if (!r.ok) throw new Error((await r.json().catch(() => ({}))).message || r.statusText);
    const text = await r.text();
    $("#file-name").hidden = $("#file-view").hidden = false;
    $("#file-name").textContent = p;
    $("#file-view").textContent = text.length > 200000 ? text.slice(0, 200000) + "\n[… cut]" : text;
  };
  $("#file-nav").onsubmit = (ev) => {
    ev.preventDefault();
    openDir(new FormData(ev.target).get("path")).catch((e) => showError(`Open failed: ${e.message}`));
  };
  $("#file-up").onclick = () => openDir(dir.replace(/\/[^/]*\/?$/, "") || "/").catch((e) => showError(`Open failed: ${e.message}`));
  $("#file-rows").onclick = (ev) => {
    const tr = ev.target.closest("tr[data-path]");
    if (!tr || ev.target.tagName !== "BUTTON") return;
    ev.preventDefault();
    showError("");
    const p = tr.dataset.path;
    (tr.dataset.type === "dir" ? openDir(p) : showFile(p)).catch((e) => showError(`Reading ${p} failed: ${e.message}`));
  };
  $("#upload").onsubmit = (ev) => {
    ev.preventDefault();
    const f = ev.target.file.files[0];
    if (!f) return showError("Choose a file to upload");
    const target = (dir.endsWith("/") ? dir : dir + "/") + f.name;
    const prog = $("#upload-progress"), st = $("#upload-status");
    act($("#upload button"), "Uploading", () => new Promise((resolve, reject) => {
      const x = new XMLHttpRequest();
      x.open("PUT", `/ops/api/sandboxes/${id}/file?path=${encodeURIComponent(target)}`);
      x.setRequestHeader("X-CSRF-Token", me.csrf);
      prog.hidden = false;
      x.upload.onprogress = (e) => {
        if (e.lengthComputable) { prog.value = e.loaded / e.total; st.textContent = `${bytes(e.loaded)} of ${bytes(e.total)}`; }
      };
      x.onload = () => {
        if (x.status >= 200 && x.status < 300) {
          st.textContent = `uploaded ${target} (${bytes(f.size)})`;
          resolve(openDir(dir));
        } else {
          let msg = x.statusText;
          try { msg = JSON.parse(x.responseText).message; } catch { /* not JSON */ }
          st.textContent = "";
          reject(new Error(msg));
        }
      };
      x.onerror = () => reject(new Error("network error"));
      x.send(f);
    }));
  };
  // Handlers first, then the data: a click never meets a button without
  // its handler. #state appears once the sandbox is read.
  await facts();
  await Promise.all([logs().catch(() => {}),
    sb.state === "running" ? openDir("/").catch((e) => { $("#file-rows").innerHTML = `<tr><td colspan="5" class="bad">${esc(e.message)}</td></tr>`; }) : null]);
  // Live: the sandbox's state and samples over server-sent events.
  const es = new EventSource(`/ops/api/sandboxes/${id}/live`);
  es.addEventListener("sandbox", (e) => { sb = JSON.parse(e.data); showFacts(); });
  es.addEventListener("metrics", (e) => { ms = ms.concat(JSON.parse(e.data)).slice(-900); drawMetrics(); });
  es.addEventListener("gone", () => { es.close(); showError(`Sandbox ${decodeURIComponent(id)} no longer exists.`); });
  const t = setInterval(() => logs().catch(() => {}), 2000);
  return () => { clearInterval(t); es.close(); ws?.close(); term?.dispose(); };
}

async function pageTemplates() {
  const admin = me.admin;
  view.innerHTML = `<h1>Templates</h1>
    ${admin ? `<form id="import" class="inline">
      <label>ID <input name="id" required pattern="[A-Za-z0-9][A-Za-z0-9._-]*" size="14"></label>
      <label>Source <input name="source" size="34" placeholder="path on the master, or registry image"></label>
      <label>or an archive <input name="archive" type="file" accept=".tar,application/x-tar"></label>
      <label>Node <select name="node"><option value="">every healthy node</option></select></label>
      <label><input type="checkbox" name="warm"> warm</label>
      <button class="primary" type="submit">Import</button></form>
    <div id="template-job" class="jobbox" hidden></div>` : ""}
    <table><thead><tr><th>ID</th><th>Aliases</th><th>Nodes</th><th>Warm on</th><th>Size</th><th>Created</th>${admin ? "<th></th>" : ""}</tr></thead>
    <tbody id="template-rows"><tr><td>loading…</td></tr></tbody></table>`;
  const draw = async () => {
    const ts = await api("GET", "/templates");
    $("#template-rows").innerHTML = ts.map((t) => `<tr data-id="${esc(t.id)}"><td>${esc(t.id)}</td><td>${esc(t.aliases.join(", "))}</td>
      <td>${esc(t.nodes.join(", "))}</td><td class="warm">${esc(t.warmNodes.join(", "))}</td><td>${bytes(t.sizeBytes)}</td><td>${ago(t.createdAt)}</td>
      ${admin ? `<td><button data-warm="1">Warm</button> <button data-delete="1">Delete</button></td>` : ""}</tr>`).join("") ||
      '<tr><td colspan="7" class="muted">No templates.</td></tr>';
  };
  await draw();
  if (!admin) return;
  const nodes = await api("GET", "/nodes").catch(() => []);
  $("#import select").insertAdjacentHTML("beforeend", nodes.map((n) => `<option value="${esc(n.id)}">${esc(n.id)}</option>`).join(""));
  $("#template-rows").onclick = (ev) => {
    const b = ev.target.closest("button");
    const tid = ev.target.closest("tr")?.dataset.id;
    if (!b || !tid) return;
    if (b.dataset.warm) {
      act(b, "Warming", async () => {
        const job = await api("POST", `/templates/${encodeURIComponent(tid)}/warm`, {});
        try { await runJob($("#template-job"), job); } finally { await draw(); }
      });
    } else if (b.dataset.delete) {
      act(b, "Deleting", async () => {
        if (!confirm(`Delete template ${tid} from every node?`)) return;
        await api("DELETE", `/templates/${encodeURIComponent(tid)}`);
        await draw();
      });
    }
  };
  $("#import").onsubmit = (ev) => {
    ev.preventDefault();
    const fd = new FormData(ev.target);
    const src = String(fd.get("source") || "");
    const body = { id: fd.get("id"), nodeID: fd.get("node"), warm: fd.get("warm") === "on" };
    if (src.startsWith("/")) body.source = src; else body.imageRef = src;
    const file = ev.target.archive.files[0];
    if (file) {
      act($("#import button"), "Importing", () => uploadTemplate(body, file).finally(draw));
      return;
    }
    act($("#import button"), "Importing", async () => {
      const job = await api("POST", "/templates", body);
      try { await runJob($("#template-job"), job); } finally { await draw(); }
    });
  };
}

// uploadTemplate sends an image archive with its progress, then waits
// for the import on the nodes (the same request answers when it is done).
function uploadTemplate(body, file) {
  const box = $("#template-job");
  box.hidden = false;
  box.innerHTML = `<div class="job job-running" data-state="running"><b>template upload ${esc(body.id)}</b>
    <progress id="template-progress" max="1" value="0"></progress> <span class="muted" id="template-upload-status">starting</span></div>`;
  const q = new URLSearchParams({ nodeID: body.nodeID || "", warm: body.warm ? "1" : "" });
  return new Promise((resolve, reject) => {
    const x = new XMLHttpRequest();
    x.open("PUT", `/ops/api/templates/${encodeURIComponent(body.id)}/upload?${q}`);
    x.setRequestHeader("X-CSRF-Token", me.csrf);
    const status = (text, state) => {
      $("#template-upload-status").textContent = text;
      if (state) { box.firstElementChild.dataset.state = state; box.firstElementChild.className = `job job-${state}`; }
    };
    x.upload.onprogress = (e) => {
      if (!e.lengthComputable) return;
      $("#template-progress").value = e.loaded / e.total;
      status(`uploading: ${bytes(e.loaded)} of ${bytes(e.total)}`);
    };
    x.upload.onload = () => status(`uploaded ${bytes(file.size)}; importing on the nodes…`);
    x.onload = () => {
      let data = null;
      try { data = JSON.parse(x.responseText); } catch { /* not JSON */ }
      if (x.status >= 200 && x.status < 300) {
        status(`imported ${data.id}: on ${data.nodes.join(", ") || "no node yet"}`, "done");
        resolve(data);
      } else {
        status(data?.message || x.statusText, "failed");
        reject(new Error(data?.message || x.statusText));
      }
    };
    x.onerror = () => { status("network error", "failed"); reject(new Error("network error")); };
    x.send(file);
  });
}

async function pageKeys() {
  view.innerHTML = `<h1>API keys</h1>
    <form id="new-key" class="inline"><label>Name <input name="name" required size="16"></label>
      <label>Team <select name="team"></select></label><label><input type="checkbox" name="admin"> admin key</label>
      <button class="primary" type="submit">Create key</button></form>
    <div id="secret" class="secret" hidden></div>
    <table><thead><tr><th>Name</th><th>ID</th><th>Prefix</th><th>Team</th><th>Admin</th><th>Created</th><th>Last used</th><th></th></tr></thead>
    <tbody id="key-rows"></tbody></table>`;
  const teams = await api("GET", "/teams");
  $("#new-key select").innerHTML = teams.map((t) => `<option>${esc(t.name)}</option>`).join("");
  const draw = async () => {
    const ks = await api("GET", "/keys");
    $("#key-rows").innerHTML = ks.map((k) => `<tr data-id="${esc(k.id)}" data-name="${esc(k.name)}"><td>${esc(k.name)}</td><td><code>${esc(k.id)}</code></td>
      <td><code>${esc(k.prefix)}…</code></td><td>${esc(k.team)}</td><td>${k.admin ? "yes" : ""}</td><td>${ago(k.createdAt)}</td>
      <td>${k.lastUsedAt ? ago(k.lastUsedAt) : '<span class="muted">never</span>'}</td><td><button>Revoke</button></td></tr>`).join("") ||
      '<tr><td colspan="8" class="muted">No keys.</td></tr>';
  };
  await draw();
  $("#key-rows").onclick = (ev) => {
    const b = ev.target.closest("button"), tr = ev.target.closest("tr");
    if (!b || !tr) return;
    act(b, "Revoking", async () => {
      if (!confirm(`Revoke key ${tr.dataset.name}? Its sessions end too.`)) return;
      await api("DELETE", `/keys/${encodeURIComponent(tr.dataset.id)}`);
      await draw();
    });
  };
  $("#new-key").onsubmit = (ev) => {
    ev.preventDefault();
    const fd = new FormData(ev.target);
    act($("#new-key button"), "Creating", async () => {
      const k = await api("POST", "/keys", { name: fd.get("name"), team: fd.get("team"), admin: fd.get("admin") === "on" });
      $("#secret").hidden = false;
      $("#secret").innerHTML = `Key <b>${esc(k.name)}</b> of team ${esc(k.team)}: <code id="new-secret">${esc(k.secret)}</code>
        <br><span class="muted">Copy it now: it is not stored and cannot be shown again.</span>`;
      await draw();
    });
  };
}

async function pageTeams() {
  view.innerHTML = `<h1>Teams</h1>
    <form id="new-team" class="inline"><label>Name <input name="name" required size="16"></label>
      <label>Max sandboxes <input name="max" type="number" min="0" value="0" style="width:6rem"></label>
      <button class="primary" type="submit">Create team</button> <span class="muted">0: no limit</span></form>
    <table><thead><tr><th>Team</th><th>Sandboxes</th><th>CPU</th><th>Memory</th><th>Quota (sandboxes · mCPU · MiB)</th><th>Keys</th><th>Created</th><th></th></tr></thead>
    <tbody id="team-rows"></tbody></table>`;
  const draw = async () => {
    const ts = await api("GET", "/teams");
    const q = (v) => (v ? v : "∞");
    $("#team-rows").innerHTML = ts.map((t) => `<tr data-name="${esc(t.name)}"><td>${esc(t.name)}</td><td>${t.sandboxes}</td>
      <td>${(t.milliCPU / 1000).toFixed(1)}</td><td>${t.memoryMiB} MiB</td>
      <td>${q(t.quota.maxSandboxes)} · ${q(t.quota.maxMilliCPU)} · ${q(t.quota.maxMemoryMiB)}</td><td>${t.keys}</td><td>${ago(t.createdAt)}</td>
      <td>${t.name === "default" ? "" : "<button>Delete</button>"}</td></tr>`).join("");
  };
  await draw();
  $("#team-rows").onclick = (ev) => {
    const b = ev.target.closest("button"), name = ev.target.closest("tr")?.dataset.name;
    if (!b || !name) return;
    act(b, "Deleting", async () => {
      if (!confirm(`Delete team ${name}, revoke its keys, kill its sandboxes and delete its snapshots?`)) return;
      await api("DELETE", `/teams/${encodeURIComponent(name)}?force=1`);
      await draw();
    });
  };
  $("#new-team").onsubmit = (ev) => {
    ev.preventDefault();
    const fd = new FormData(ev.target);
    act($("#new-team button"), "Creating", async () => {
      await api("POST", "/teams", { name: fd.get("name"), quota: { maxSandboxes: Number(fd.get("max")) } });
      await draw();
    });
  };
}

async function pageEvents() {
  view.innerHTML = `<h1>Events</h1><p class="muted">What was done through the console, newest first${me.admin ? "" : ` (team ${esc(me.team)})`}.</p>
    <table><thead><tr><th>Time</th><th>By</th><th>Team</th><th>Action</th><th>Target</th><th>Result</th></tr></thead><tbody id="event-rows"></tbody></table>
    <div class="actions"><button id="older">Older</button></div>`;
  let oldest = 0;
  const row = (e) => `<tr data-seq="${e.seq}"><td>${new Date(e.t).toLocaleString()}</td><td>${esc(e.by)}${e.admin ? " (admin)" : ""}</td>
    <td>${esc(e.team)}</td><td>${esc(e.action)}</td><td>${esc(e.target)}</td>
    <td class="${e.ok ? "result-ok" : "result-failed"}">${e.ok ? "ok" : "failed: " + esc(e.error)}</td></tr>`;
  const load = async (more) => {
    const es = await api("GET", `/events?limit=100${more && oldest ? "&before=" + oldest : ""}`);
    if (es.length) oldest = es[es.length - 1].seq;
    const html = es.map(row).join("");
    if (more) $("#event-rows").insertAdjacentHTML("beforeend", html);
    else $("#event-rows").innerHTML = html || '<tr><td colspan="6" class="muted">Nothing yet.</td></tr>';
    $("#older").disabled = es.length < 100;
  };
  await load(false);
  $("#older").onclick = () => load(true).catch((e) => showError(e.message));
  const t = setInterval(() => { if (!$("#event-rows").querySelector("tr[data-seq]") || window.scrollY === 0) load(false).catch(() => {}); }, 5000);
  return () => clearInterval(t);
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
  for (const a of document.querySelectorAll("[data-admin]")) a.hidden = !me.admin;
  const [, page, arg] = (location.hash || "").split("/");
  try {
    const stop = await ({
      // The ID from the URL goes into API paths: encoded, so a crafted
      // link cannot turn a button into a call of another route.
      nodes: pageNodes, sandboxes: pageSandboxes, sandbox: () => pageSandbox(encodeURIComponent(decodeURIComponent(arg || ""))), templates: pageTemplates, lineage: pageLineage,
      keys: pageKeys, teams: pageTeams, events: pageEvents,
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
