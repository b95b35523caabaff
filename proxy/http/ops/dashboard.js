// The dashboard's script: reads /admin/events with fetch and draws the page (charts in
// inline SVG, tables), sending the admin key the page asked for. Served inline by
// dashboard.py.
"use strict";
const KEY = "triage-proxy.admin-key";
const SVGNS = "http://www.w3.org/2000/svg";
const PALETTE = ["#d1495b", "#edae49", "#00798c", "#30638e", "#7a5195", "#66a182", "#8d96a3"];
const STATUS_COLORS = {"2xx": "#2e9e4f", "3xx": "#30638e", "4xx": "#edae49", "5xx": "#d1495b"};
const STATES = {closed: 0, half_open: 1, open: 2};
const SHOWN_REJECTIONS = 12;
let points = [];
let ticks = 0;
const $ = (id) => document.getElementById(id);

function setConn(state, text) {
  const conn = $("conn");
  conn.dataset.state = state;
  conn.textContent = text;
}

function seconds(v) {
  if (v === null || v === undefined) return "-";
  if (v < 1) return (v * 1000).toFixed(v < 0.01 ? 1 : 0) + " ms";
  if (v < 120) return v.toFixed(v < 10 ? 2 : 1) + " s";
  return (v / 60).toFixed(1) + " min";
}
const count = (v) => Math.round(v).toLocaleString("en-US");
const dollars = (v) => "$" + (v < 1 ? v.toFixed(6) : v.toFixed(2));

function niceTop(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function ago(t) {
  if (t === 0) return "now";
  return -t % 60 === 0 ? t / 60 + "m" : t + "s";
}

function chart(name, series, fmt, span) {
  const W = 480, H = 170, L = 52, R = 10, T = 8, B = 20;
  let top = 0;
  for (const s of series) for (const [, v] of s.values) if (v !== null && v > top) top = v;
  top = niceTop(top);
  const x = (t) => L + (W - L - R) * (1 + t / span);
  const y = (v) => T + (H - T - B) * (1 - v / top);
  const parts = [];
  for (const f of [0, 0.5, 1]) {
    parts.push(svg("line", {x1: L, x2: W - R, y1: y(top * f), y2: y(top * f), class: "grid"}));
    const v = top * f;
    const label = fmt === count && !Number.isInteger(v) ? v.toFixed(1) : fmt(v);
    parts.push(svg("text", {x: L - 5, y: y(v) + 3, class: "ylabel"}, label));
  }
  const step = [10, 15, 30, 60, 120, 300].find((s) => span / s <= 6) || 600;
  for (let t = 0; t >= -span; t -= step) {
    parts.push(svg("text", {x: x(t), y: H - 5, class: "xlabel"}, ago(t)));
  }
  const legend = [];
  for (const s of series) {
    let d = "", gap = true, last = null;
    for (const [t, v] of s.values) {
      if (v === null) { gap = true; continue; }
      const at = x(t).toFixed(1) + "," + y(v).toFixed(1);
      d += gap ? "M" + at + "l0,0" : "L" + at;
      gap = false;
      last = v;
    }
    parts.push(svg("path", {d: d || "M0,0", class: "line", stroke: s.color,
                            "data-series": s.name, "data-last": last === null ? "" : last}));
    const item = document.createElement("span");
    item.dataset.series = s.name;
    const swatch = document.createElement("i");
    swatch.style.background = s.color;
    const value = document.createElement("b");
    value.textContent = s.now === undefined ? "" : fmt(s.now);
    item.append(swatch, s.name + " ", value);
    legend.push(item);
  }
  const node = $("chart-" + name);
  node.setAttribute("viewBox", `0 0 ${W} ${H}`);
  node.dataset.points = points.length;
  node.replaceChildren(...parts);
  $("legend-" + name).replaceChildren(...legend);
}

function cell(text, field, value, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (field) td.dataset.field = field;
  if (value !== undefined && value !== null) td.dataset.value = value;
  if (cls) td.className = cls;
  return td;
}

function table(id, head, rows, empty) {
  const tr = document.createElement("tr");
  for (const h of head) {
    const th = document.createElement("th");
    th.textContent = h;
    tr.append(th);
  }
  if (rows.length) {
    [...rows[0].children].forEach((td, i) => {
      if (td.classList.contains("text")) tr.children[i].className = "text";
    });
  } else {
    const none = document.createElement("tr");
    const td = cell(empty, null, null, "empty");
    td.colSpan = head.length;
    none.append(td);
    rows = [none];
  }
  $(id).replaceChildren(tr, ...rows);
}

function row(attr, name, cells) {
  const tr = document.createElement("tr");
  tr.setAttribute(attr, name);
  tr.append(...cells);
  return tr;
}

function breakerOf(status, provider) {
  const pool = (status.scheduler.providers || {})[provider] || {};
  const deployments = Object.keys(pool.deployments || {});
  let worst = "closed", open = 0;
  for (const d of deployments) {
    const state = (status.breakers[d] || {}).state || "closed";
    if (state !== "closed") open += 1;
    if (STATES[state] > STATES[worst]) worst = state;
  }
  const text = open && deployments.length > 1 ? `${worst} (${open}/${deployments.length})` : worst;
  return [worst, text];
}

function sharedText(state) {
  if (state.backend !== "redis") return "";
  const entered = state.entered || {};
  const away = (entered.local || 0) + (entered.reject || 0);
  const now = state.mode === "shared"
    ? "shared with " + state.replicas_alive + " replicas"
    : "Redis away: " + state.mode + " for " + seconds(state.mode_for_s);
  const past = away ? "fell back " + away + "\u00d7, " + seconds(state.fallback_s) : "";
  const rebuilt = (state.rebuilt || {}).times ? "rebuilt " + state.rebuilt.times + "\u00d7" : "";
  return [now, past, rebuilt].filter(Boolean).join(", ");
}

function render(snap, first) {
  const status = snap.status;
  const now = snap.t;
  points = first ? snap.points : points.concat(snap.points);
  points = points.filter((p) => p.t > now - snap.window_s);
  const span = Math.min(Math.max(points.length ? now - points[0].t : 0, 60), snap.window_s);
  const shown = points.filter((p) => p.t >= now - span);
  const tiers = status.scheduler.tiers.map((t) => t.name);
  const providers = Object.keys(status.providers);
  const color = (i) => PALETTE[i % PALETTE.length];

  chart("depth", tiers.map((tier, i) => ({
    name: tier, color: color(i), now: status.scheduler.tiers[i].depth,
    values: shown.map((p) => [p.t - now, p.depth ? p.depth[tier] ?? 0 : null]),
  })), count, span);
  for (const q of ["p50", "p99"]) {
    chart(q, tiers.map((tier, i) => {
      const values = shown.map((p) => [p.t - now, p[q] && tier in p[q] ? p[q][tier] : null]);
      const seen = values.filter(([, v]) => v !== null);
      return {name: tier, color: color(i), values,
              now: seen.length ? seen[seen.length - 1][1] : undefined};
    }), seconds, span);
  }
  const groups = new Set(["2xx", "4xx", "5xx"]);
  for (const p of shown) for (const g of Object.keys(p.calls || {})) groups.add(g);
  const latest = points.length ? points[points.length - 1] : {};
  chart("calls", [...groups].sort().map((g) => ({
    name: g, color: STATUS_COLORS[g] || "#8d96a3", now: (latest.calls || {})[g] || 0,
    values: shown.map((p) => [p.t - now, (p.calls || {})[g] || 0]),
  })), count, span);
  chart("inflight", providers.map((name, i) => ({
    name: name, color: PALETTE[(i + 2) % PALETTE.length], now: status.providers[name].inflight,
    values: shown.map((p) => [p.t - now, p.inflight ? p.inflight[name] ?? 0 : null]),
  })), count, span);

  const runningIn = (name, i) =>
    ((status.scheduler.providers[name] || {}).running_by_tier || [])[i] || 0;
  const running = tiers.map((_, i) =>
    providers.reduce((sum, name) => sum + runningIn(name, i), 0));
  table("tiers", ["tier", "weight", "queued", "by level", "oldest wait", "running"],
    status.scheduler.tiers.map((t, i) => row("data-tier", t.name, [
      cell(t.name, "name"), cell(String(t.weight), "weight", t.weight),
      cell(count(t.depth), "depth", t.depth),
      cell((t.by_level || []).join(" / "), "by_level"),
      cell(seconds(t.oldest_wait_s), "oldest_wait_s", t.oldest_wait_s),
      cell(count(running[i]), "running", running[i]),
    ])), "no tiers");

  const keyRows = [];
  status.scheduler.tiers.forEach((t) => {
    Object.entries(t.keys || {}).forEach(([key, k]) => keyRows.push(
      row("data-key-share", t.name + "/" + key, [
        cell(key, "key"), cell(t.name, "tier", null, "text"),
        cell(count(k.queued), "queued", k.queued),
        cell(Math.round(k.share * 100) + " %", "share", k.share),
        cell(seconds(k.mean_wait_s), "mean_wait_s", k.mean_wait_s),
      ])));
  });
  table("keys", ["key", "tier", "queued", "share of its tier", "mean wait"], keyRows,
    "no calls yet");

  table("providers", ["provider", "kind", "in flight", "limit", "max", "breaker", "429s",
                      "paused", "retry budget"],
    providers.map((name) => {
      const p = status.providers[name];
      const [state, text] = breakerOf(status, name);
      const throttled = snap.throttles[name] || 0;
      return row("data-provider", name, [
        cell(name, "name"), cell(p.kind, "kind", null, "text"),
        cell(count(p.inflight), "inflight", p.inflight), cell(count(p.limit), "limit", p.limit),
        cell(count(p.max_concurrency), "max_concurrency", p.max_concurrency),
        cell(text, "breaker", state, state), cell(count(throttled), "throttles", throttled),
        cell(p.paused_for_s ? seconds(p.paused_for_s) : "-", "paused_for_s", p.paused_for_s),
        cell(String(p.retry_budget), "retry_budget", p.retry_budget),
      ]);
    }), "no providers");

  table("usage", ["key", "tier", "calls", "prompt tokens", "completion tokens", "cost"],
    snap.usage.map((u) => {
      const tr = row("data-key", u.key, [
        cell(u.key, "key"), cell(u.tier, "tier", null, "text"),
        cell(count(u.calls), "calls", u.calls),
        cell(count(u.prompt_tokens), "prompt_tokens", u.prompt_tokens),
        cell(count(u.completion_tokens), "completion_tokens", u.completion_tokens),
        cell(dollars(u.cost_usd), "cost_usd", u.cost_usd),
      ]);
      tr.dataset.tier = u.tier;
      return tr;
    }), "no calls yet");

  table("rejections", ["time", "status", "code", "tier", "key"],
    snap.rejections.slice(0, SHOWN_REJECTIONS).map((r) => row("data-code", r.code, [
      cell(new Date(r.at * 1000).toLocaleTimeString(), "at", r.at),
      cell(String(r.status), "status", r.status, "s" + Math.floor(r.status / 100) + "xx"),
      cell(r.code, "code", null, "text"), cell(r.tier || "-", "tier", null, "text"),
      cell(r.key || "-", "key", null, "text"),
    ])), "none");

  table("batches", ["batch", "key", "status", "done", "failed", "total", "window ends"],
    (snap.batches || []).map((b) => row("data-batch", b.id, [
      cell(b.id, "id", null, "text"), cell(b.owner, "owner", null, "text"),
      cell(b.status, "status", null, "text"), cell(count(b.completed), "completed", b.completed),
      cell(count(b.failed), "failed", b.failed), cell(count(b.total), "total", b.total),
      cell(new Date(b.expires_at * 1000).toLocaleString(), "expires_at", b.expires_at),
    ])), "none");

  const inflight = providers.reduce((s, n) => s + status.providers[n].inflight, 0);
  const limit = providers.reduce((s, n) => s + status.providers[n].limit, 0);
  const throttled = Object.values(snap.throttles).reduce((s, v) => s + v, 0);
  const rate = Object.values(latest.calls || {}).reduce((s, v) => s + v, 0);
  const spend = snap.usage.reduce((s, u) => s + u.cost_usd, 0);
  $("queued").textContent = count(status.scheduler.queued);
  $("queued").dataset.value = status.scheduler.queued;
  $("slots").textContent = count(inflight) + " / " + count(limit);
  $("slots").dataset.value = inflight;
  $("rate").textContent = count(rate);
  $("rate").dataset.value = rate;
  $("throttled").textContent = count(throttled);
  $("throttled").dataset.value = throttled;
  const errors = shown.reduce((sum, p) => sum + Object.entries(p.calls || {}).reduce(
    (n, [g, v]) => n + (g >= "4xx" ? v : 0), 0), 0);
  $("refused").textContent = count(errors);
  $("refused").dataset.value = errors;
  $("spend").textContent = dollars(spend);
  $("spend").dataset.value = spend;
  const config = status.config || {};
  $("meta").textContent = [
    sharedText(status.state || {}),
    status.schedule ? "schedule " + status.schedule : "",
    config.version ? "config " + config.version : "",
    "updated " + new Date().toLocaleTimeString(),
  ].filter(Boolean).join(" \u00b7 ");
  ticks += 1;
  document.body.dataset.ticks = ticks;
  document.body.dataset.t = now;
}

function askForKey(message) {
  setConn("error", "admin key needed");
  $("keyerror").textContent = message;
  $("keyform").hidden = false;
  $("adminkey").focus();
}

$("keyform").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("adminkey").value);
  $("adminkey").value = "";
  $("keyform").hidden = true;
  connect();
});

function dispatch(block, first) {
  let type = "message";
  const data = [];
  for (const line of block.split(/\r\n|\r|\n/)) {
    if (line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "event") type = value;
    else if (field === "data") data.push(value);
  }
  if (type !== "snapshot" || !data.length) return false;
  render(JSON.parse(data.join("\n")), first);
  return true;
}

function retry(message) {
  setConn("error", message + "; retrying");
  setTimeout(connect, 2000);
}

async function connect() {
  const key = sessionStorage.getItem(KEY);
  const headers = key ? {"X-Admin-Key": key} : {};
  let response;
  try {
    response = await fetch("/admin/events", {headers, cache: "no-store"});
  } catch (error) {
    return retry("unreachable");
  }
  if (response.status === 401) {
    sessionStorage.removeItem(KEY);
    return askForKey(key ? "That key was refused." : "");
  }
  if (response.status === 403) {
    return setConn("error", "admin endpoints answer loopback clients only (configure admin.key)");
  }
  if (!response.ok || !response.body) return retry("HTTP " + response.status);
  setConn("live", "live");
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "", first = true;
  try {
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let end;
      while ((end = /\r\n\r\n|\n\n|\r\r/.exec(buffer))) {
        const block = buffer.slice(0, end.index);
        buffer = buffer.slice(end.index + end[0].length);
        if (dispatch(block, first)) first = false;
      }
    }
  } catch (error) {
    return retry("disconnected");
  }
  retry("stream ended");
}

connect();
