// The page of `ckptrepo ui`: draws what the JSON endpoints answer (docs/ui.md). Plain browser JavaScript, no
// build step; uPlot (vendor/) draws the metric curves, a canvas the heatmap, the DOM the graph and the tables.
// Text from the repository (names, messages, refs) only ever goes into the page as text, never as HTML.
// Every drawn element carries an id and data attributes (rows, points, cells) that tests read from the DOM.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const ROW_H = 20;                // px per line of the graph: only the lines in view are in the DOM
  const HEAT_ROW = 12;             // px per heatmap row at least: room for its label, so every row has one
  const HEAT_BELOW = 130;          // px under the heatmap's rows: its axis, legend, and the version panel's heading
  const BIG = 1e300;               // the server sends an infinity as the largest float
  const LANES = ["#0969da", "#1a7f37", "#cf222e", "#8250df", "#bf8700", "#1b7c83", "#e16f24", "#6e7781"];
  const VIRIDIS = ["#440154", "#482878", "#3e4989", "#31688e", "#26828e", "#1f9e89", "#35b779", "#6ece58",
                   "#b5de2b", "#fde725"];
  const ABSENT = "#e6e8eb";
  const NO_FINITE = "#ff2d55";   // a tensor present with not one finite value: the server sends "nan"

  const state = {info: null, rev: "HEAD", stat: null, pattern: "*", scale: "log", nonfloat: false, selected: null,
                 graph: null, metrics: null, heatmap: null, charts: [], drawn: null, detailToken: 0};

  // ---- small helpers --------------------------------------------------------------------------------------
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined) continue;
      if (k === "class") e.className = v;
      else e.setAttribute(k, String(v));
    }
    for (const c of children) {
      if (c === null || c === undefined) continue;
      e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return e;
  }

  async function api(path) {
    const r = await fetch(path, {cache: "no-store"});
    let body = null;
    try { body = await r.json(); } catch (_) { /* not JSON: said below */ }
    if (!r.ok || body === null) throw new Error((body && body.error) || `${path}: HTTP ${r.status}`);
    return body;
  }

  function fmt(x) {
    if (x === null || x === undefined) return "-";
    if (typeof x !== "number") return String(x);
    if (Math.abs(x) >= BIG) return x > 0 ? "inf" : "-inf";
    if (Number.isInteger(x) && Math.abs(x) < 1e9) return String(x);
    return String(Number(x.toPrecision(4)));
  }

  function size(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return i === 0 ? `${n} B` : `${n.toFixed(1)} ${units[i]}`;
  }

  function when(t) {
    const d = new Date(t * 1000), p = (n) => String(n).padStart(2, "0");
    return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}`;
  }

  function shellQuote(s) {
    return /^[\w@%+=:,./-]+$/.test(s) ? s : `'${s.replace(/'/g, "'\\''")}'`;
  }

  function status(text, bad) {
    const s = $("status");
    s.textContent = text;
    s.className = bad ? "error" : "";
  }

  function toast(text) {
    const t = $("toast");
    t.textContent = text;
    t.classList.add("show");
    clearTimeout(toast.timer);
    toast.timer = setTimeout(() => t.classList.remove("show"), 1600);
  }

  async function copy(text, what) {
    try {
      await navigator.clipboard.writeText(text);
    } catch (_) {   // a browser without the async clipboard (or without focus): the older way
      const ta = el("textarea", {"aria-hidden": "true"});
      ta.value = text;
      document.body.append(ta);
      ta.select();
      document.execCommand("copy");
      ta.remove();
    }
    toast(`copied ${what}: ${text}`);
  }

  function failed(box, err) {
    box.textContent = "";
    box.append(el("div", {class: "error"}, err.message));
  }

  // ---- the URL's hash: #v=<version>&rev=&stat=&pattern=&scale=&nonfloat= ----------------------------------
  function hashParams() { return new URLSearchParams(location.hash.replace(/^#/, "")); }

  function writeHash(changes, addToHistory) {
    const p = hashParams();
    for (const [k, v] of Object.entries(changes)) {
      if (v === null || v === undefined || v === "") p.delete(k); else p.set(k, v);
    }
    const hash = "#" + p.toString();
    if (addToHistory) location.hash = hash;
    else history.replaceState(null, "", hash);
  }

  function versionUrl(id) {
    const p = hashParams();
    p.set("v", id);
    return location.href.replace(/#.*$/, "") + "#" + p.toString();
  }

  function select(id) {
    if (id) writeHash({v: id}, true);   // the hashchange shows it
  }

  // ---- the graph ------------------------------------------------------------------------------------------
  function renderGraph() {
    const g = state.graph, box = $("graph");
    box.textContent = "";
    box.dataset.rows = g.rows.length;
    box.dataset.versions = g.versions;
    box.dataset.truncated = g.truncated;
    $("graph-count").textContent = g.versions ? `${g.versions} versions${g.truncated ? ` (newest ${g.limit})` : ""}` : "";
    if (!g.rows.length) {
      box.append(el("div", {class: "muted", id: "graph-empty"}, "no versions yet"));
      return;
    }
    const spacer = el("div", {id: "graph-rows"});
    spacer.style.position = "relative";
    spacer.style.height = `${g.rows.length * ROW_H}px`;
    box.append(spacer);
    state.drawn = null;
    drawGraphRows();
  }

  function drawGraphRows(force) {
    const box = $("graph"), spacer = $("graph-rows"), rows = state.graph && state.graph.rows;
    if (!spacer || !rows) return;
    const view = Math.max(box.clientHeight, 600);
    const first = Math.max(0, Math.floor(box.scrollTop / ROW_H) - 30);
    const last = Math.min(rows.length, Math.ceil((box.scrollTop + view) / ROW_H) + 30);
    if (!force && state.drawn && state.drawn[0] === first && state.drawn[1] === last) return;
    state.drawn = [first, last];
    const frag = document.createDocumentFragment();
    for (let i = first; i < last; i++) frag.append(graphRow(rows[i], i));
    spacer.replaceChildren(frag);
  }

  function lanes(prefix) {
    const span = el("span", {class: "lanes"});
    for (let p = 0; p < prefix.length; p++) {
      const ch = prefix[p];
      if (ch === " ") { span.append(" "); continue; }
      const colour = LANES[Math.ceil(p / 2) % LANES.length];   // the column a character draws or joins
      const c = el(ch === "*" ? "b" : "span", {}, ch);
      c.style.color = colour;
      span.append(c);
    }
    return span;
  }

  function graphRow(r, i) {
    const v = r.version;
    const row = el("div", {class: v ? "graph-row version" : "graph-row"});
    row.style.top = `${i * ROW_H}px`;
    row.append(lanes(r.prefix));
    if (!v) return row;
    row.dataset.version = v.id;
    if (v.step !== null) row.dataset.step = v.step;
    if (v.id === state.selected) row.classList.add("selected");
    row.title = `${v.id}\n${when(v.time)}`;
    row.append(el("a", {class: "vid", href: `#v=${v.id}`}, v.short));
    for (const ref of v.refs) {
      const kind = ref.startsWith("tag: ") ? "tag" : ref.startsWith("HEAD") ? "head" : "branch";
      row.append(el("span", {class: `ref ${kind}`, "data-ref": ref}, kind === "tag" ? ref.slice(5) : ref));
    }
    row.append(el("span", {class: "step"}, v.step === null ? "step -" : `step ${v.step}`));
    const shown = Object.entries(v.metrics).filter(([, x]) => typeof x === "number").slice(0, 2);
    if (shown.length) row.append(el("span", {class: "step"}, shown.map(([k, x]) => `${k}=${fmt(x)}`).join(" ")));
    row.append(el("span", {class: v.pruned ? "msg pruned" : "msg"}, v.pruned ? `(pruned) ${v.message}` : v.message));
    row.addEventListener("click", (e) => { e.preventDefault(); select(v.id); });
    return row;
  }

  function graphVersions() {
    return state.graph ? state.graph.rows.filter((r) => r.version).map((r) => r.version.id) : [];
  }

  function scrollGraphTo(id) {
    if (!state.graph) return;
    const i = state.graph.rows.findIndex((r) => r.version && r.version.id === id);
    const box = $("graph");
    if (i < 0) return;
    const top = i * ROW_H;
    if (top < box.scrollTop || top + ROW_H > box.scrollTop + box.clientHeight) box.scrollTop = top - box.clientHeight / 3;
    drawGraphRows(true);
  }

  // ---- metric curves --------------------------------------------------------------------------------------
  function renderMetrics() {
    const m = state.metrics, box = $("metrics");
    for (const c of state.charts) c.destroy();
    state.charts = [];
    box.textContent = "";
    const names = Object.keys(m.series);
    box.dataset.metrics = names.length;
    box.dataset.versions = m.x.length;
    $("metrics-count").textContent = m.total ? `${m.x.length}${m.sampled ? ` sampled of ${m.total}` : ""} versions of ${m.rev}` : "";
    if (!names.length) {
      box.append(el("div", {class: "muted", id: "metrics-empty"}, m.total ? "no numeric metrics recorded" : "no versions yet"));
      return;
    }
    const full = box.clientWidth || 800;
    const width = names.length > 1 && full >= 700 ? Math.floor((full - 8) / 2) : full;
    names.forEach((name, k) => {
      const ys = m.series[name];
      const points = ys.filter((y) => y !== null).length;
      const div = el("div", {class: "metric-chart", id: `metric-${k}`, "data-metric": name, "data-points": points});
      box.append(div);
      const opts = {
        width, height: 180, title: name,
        cursor: {sync: {key: "ckptrepo-metrics"}, drag: {x: true, y: false}},
        scales: {x: {time: false}},
        axes: [{label: m.x_label, labelSize: 18, size: 34}, {size: 56}],
        series: [{label: m.x_label, value: (u, x) => fmt(x)},
                 {label: name, stroke: LANES[k % LANES.length], width: 1.5, spanGaps: true,
                  points: {show: points <= 80}, value: (u, y) => fmt(y)}],
        hooks: {draw: [(u) => markSelected(u, m)]},
      };
      const u = new uPlot(opts, [m.x, ys], div);
      let downX = null;
      u.over.addEventListener("mousedown", (e) => { downX = e.clientX; });
      u.over.addEventListener("click", (e) => {   // a click, not the end of a drag that zooms
        if (downX !== null && Math.abs(e.clientX - downX) < 4 && u.cursor.idx !== null && u.cursor.idx !== undefined) {
          select(m.versions[u.cursor.idx]);
        }
      });
      state.charts.push(u);
    });
  }

  function markSelected(u, m) {
    const i = m.versions.indexOf(state.selected);
    if (i < 0) return;
    const x = Math.round(u.valToPos(m.x[i], "x", true));
    const ctx = u.ctx;
    ctx.save();
    ctx.strokeStyle = "#cf222e";
    ctx.setLineDash([4, 3]);
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    ctx.moveTo(x, u.bbox.top);
    ctx.lineTo(x, u.bbox.top + u.bbox.height);
    ctx.stroke();
    ctx.restore();
  }

  // ---- heatmap --------------------------------------------------------------------------------------------
  function hex(c) { return [1, 3, 5].map((i) => parseInt(c.slice(i, i + 2), 16)); }
  const STOPS = VIRIDIS.map(hex);

  function colour(t) {   // t in [0, 1] -> viridis
    const x = Math.min(1, Math.max(0, t)) * (STOPS.length - 1), i = Math.min(STOPS.length - 2, Math.floor(x)), f = x - i;
    const a = STOPS[i], b = STOPS[i + 1];
    return `rgb(${Math.round(a[0] + (b[0] - a[0]) * f)},${Math.round(a[1] + (b[1] - a[1]) * f)},${Math.round(a[2] + (b[2] - a[2]) * f)})`;
  }

  // values -> [0, 1] (null: absent), by the chosen scale; an infinity is the top of the scale
  function normalised(values, scale) {
    const shown = (v) => (scale === "log" ? (v === 0 ? null : Math.log10(Math.abs(v))) : v);
    const range = (vals) => {
      let lo = Infinity, hi = -Infinity;
      for (const v of vals) {
        if (typeof v !== "number" || Math.abs(v) >= BIG) continue;
        const s = shown(v);
        if (s === null) continue;
        if (s < lo) lo = s;
        if (s > hi) hi = s;
      }
      return [lo, hi];
    };
    const map = (v, [lo, hi]) => {
      if (v === null || typeof v === "string") return v;
      if (Math.abs(v) >= BIG) return 1;
      const s = shown(v);
      if (s === null || !isFinite(lo)) return 0;
      return hi > lo ? (s - lo) / (hi - lo) : 0.5;
    };
    if (scale === "row") return {cells: values.map((row) => { const r = range(row); return row.map((v) => map(v, r)); }), range: null};
    const r = range(values.flat());
    return {cells: values.map((row) => row.map((v) => map(v, r))), range: r};
  }

  function renderHeatmap() {
    const h = state.heatmap, box = $("heatmap");
    box.textContent = "";
    const rows = h.rows.length, cols = h.versions.length;
    $("heatmap-count").textContent = rows
      ? `${h.stat} of ${h.tensors} tensors${h.aggregated ? ` in ${rows} groups (${h.aggregated} per group)` : ""} × ${cols} versions`
      : "";
    if (!rows || !cols) {
      box.append(el("div", {class: "muted", id: "heatmap-empty"}, "no tensors to show"));
      return;
    }
    const longest = Math.max(...h.rows.map((r) => r.name.length));
    const labelW = Math.min(260, Math.max(60, longest * 6.2 + 10));
    const W = Math.max(300, box.clientWidth || 800), cellW = (W - labelW) / cols;
    const cellH = Math.max(HEAT_ROW, Math.min(16, Math.floor(heatmapRoom() / rows))), top = 6, axisH = 24;
    const H = top + rows * cellH + axisH;
    const {cells, range} = normalised(h.values, state.scale);
    let finiteCells = 0;
    for (const row of h.values) for (const v of row) if (v !== null) finiteCells++;
    const canvas = el("canvas", {class: "cells", id: "heatmap-canvas", "data-rows": rows, "data-cols": cols,
                                 "data-cells": finiteCells, "data-stat": h.stat, "data-tensors": h.tensors,
                                 "data-aggregated": h.aggregated || "", "data-scale": state.scale});
    const dpr = window.devicePixelRatio || 1;
    canvas.width = Math.round(W * dpr);
    canvas.height = Math.round(H * dpr);
    canvas.style.width = `${W}px`;
    canvas.style.height = `${H}px`;
    const ctx = canvas.getContext("2d");
    ctx.scale(dpr, dpr);
    const x0 = (c) => Math.floor(labelW + c * cellW);
    for (let r = 0; r < rows; r++) {
      for (let c = 0; c < cols; c++) {
        const t = cells[r][c];
        ctx.fillStyle = t === null ? ABSENT : typeof t === "string" ? NO_FINITE : colour(t);
        ctx.fillRect(x0(c), top + r * cellH, Math.max(1, x0(c + 1) - x0(c)), cellH);
      }
    }
    // row labels, one per row (the server folds rows so that they fit: see loadHeatmap), as text in the DOM;
    // a long name keeps its end, which tells the tensors of a module apart
    const chars = Math.floor((labelW - 8) / 6.2);
    const labels = el("div", {class: "heat-labels", id: "heatmap-labels", "data-rows": rows});
    labels.style.width = `${labelW}px`;
    h.rows.forEach((row, r) => {
      const name = row.name;
      const label = el("div", {class: "heat-label", "data-row": r, title: name},
                       name.length > chars ? "…" + name.slice(name.length - chars + 1) : name);
      label.style.top = `${top + r * cellH}px`;
      label.style.height = label.style.lineHeight = `${cellH}px`;
      labels.append(label);
    });
    // x axis: steps, about every 90 px
    ctx.fillStyle = "#1d232a";
    ctx.font = "10px ui-monospace, DejaVu Sans Mono, monospace";
    ctx.textBaseline = "top";
    const stride = Math.max(1, Math.ceil(90 / cellW));
    for (let c = 0; c < cols; c += stride) {
      const s = h.steps[c];
      ctx.fillRect(x0(c), top + rows * cellH, 1, 4);
      ctx.fillText(s === null ? `#${c}` : `${s}`, x0(c) + 2, top + rows * cellH + 6);
    }
    const sel = h.versions.indexOf(state.selected);
    if (sel >= 0) {
      ctx.strokeStyle = "#cf222e";
      ctx.lineWidth = 2;
      ctx.strokeRect(x0(sel) - 1, top - 1, Math.max(3, x0(sel + 1) - x0(sel) + 2), rows * cellH + 2);
    }
    const tip = el("div", {id: "heatmap-tip"});
    const at = (e) => {
      const rect = canvas.getBoundingClientRect();
      const x = e.clientX - rect.left, y = e.clientY - rect.top;
      const c = Math.floor((x - labelW) / cellW), r = Math.floor((y - top) / cellH);
      return c >= 0 && c < cols && r >= 0 && r < rows ? [r, c, x, y] : null;
    };
    canvas.addEventListener("mousemove", (e) => {
      const p = at(e);
      if (!p) { tip.style.display = "none"; return; }
      const [r, c, x, y] = p, row = h.rows[r];
      tip.textContent = `${row.name}${row.tensors > 1 ? ` (${row.tensors} tensors)` : ""}\n` +
        `step ${h.steps[c] === null ? "-" : h.steps[c]}  ${h.versions[c].slice(0, 12)}\n${h.stat} ${h.values[r][c] === "nan" ? "no finite value" : h.values[r][c] === null ? "absent" : fmt(h.values[r][c])}`;
      tip.style.display = "block";
      tip.style.left = `${Math.min(x + 14, W - 260)}px`;
      tip.style.top = `${y + 14}px`;
    });
    canvas.addEventListener("mouseleave", () => { tip.style.display = "none"; });
    canvas.addEventListener("click", (e) => { const p = at(e); if (p) select(h.versions[p[1]]); });
    box.append(canvas, labels, tip, legend(range));
  }

  // px the heatmap's rows may take so that the version panel's heading stays in the window below them
  function heatmapRoom() {
    const top = $("heatmap").getBoundingClientRect().top + window.scrollY;
    return Math.max(12 * HEAT_ROW, window.innerHeight - top - HEAT_BELOW);
  }

  function legend(range) {
    const bar = el("canvas", {width: 160, height: 10});
    const ctx = bar.getContext("2d");
    for (let i = 0; i < 160; i++) { ctx.fillStyle = colour(i / 159); ctx.fillRect(i, 0, 1, 10); }
    const swatch = el("span", {class: "muted"}, "absent");
    swatch.style.borderLeft = `12px solid ${ABSENT}`;
    swatch.style.paddingLeft = "4px";
    const ends = (v) => (state.scale === "log" ? fmt(Number(Math.pow(10, v).toPrecision(3))) : fmt(v));
    const lo = range && isFinite(range[0]) ? ends(range[0]) : "row min", hi = range && isFinite(range[1]) ? ends(range[1]) : "row max";
    const broken = el("span", {class: "muted"}, "no finite value");
    broken.style.borderLeft = `12px solid ${NO_FINITE}`;
    broken.style.paddingLeft = "4px";
    return el("div", {class: "legend", id: "heatmap-legend"}, el("span", {}, lo), bar, el("span", {}, hi), swatch, broken);
  }

  // ---- one version ----------------------------------------------------------------------------------------
  // text that may wrap after each "." and "/" (a <wbr>, which a copy leaves out), so a tensor name breaks
  // between its parts before it breaks inside one
  function breakable(text) {
    if (typeof text !== "string") return [text];
    const out = [];
    for (const part of text.split(/(?<=[./])/)) out.push(part, el("wbr"));
    return out.slice(0, -1);
  }

  function table(id, columns, rows, rowClass) {
    // columns: [label, key, kind] with kind "num", "name" (text that wraps: the table fits its panel) or "tag"
    // (short text kept on one line); a click on a header sorts by it
    const t = el("table", {class: "data", id, "data-rows": rows.length});
    const body = el("tbody");
    let order = null;
    const fill = () => {
      body.replaceChildren(...rows.map((r) => {
        const tr = el("tr", {class: rowClass ? rowClass(r) : null, "data-name": r.name || r.prefix});
        for (const [, key, kind] of columns) {
          const v = r[key];
          tr.append(el("td", {class: kind}, ...(kind === "num" ? [fmt(v)] : Array.isArray(v) ? [v.join("x") || "()"]
                                                  : kind === "name" ? breakable(v) : [v])));
        }
        return tr;
      }));
    };
    const head = el("tr", {}, ...columns.map(([label, key, kind]) => {
      const th = el("th", {title: "sort"}, label);
      th.style.cursor = "pointer";
      th.addEventListener("click", () => {
        const dir = order === key ? -1 : 1;
        order = dir === 1 ? key : null;
        const val = (r) => (r[key] === null || r[key] === undefined ? -Infinity : r[key]);
        rows.sort((a, b) => (kind === "num" ? (val(a) - val(b)) * -dir
                                            : String(val(a)).localeCompare(String(val(b)), undefined, {numeric: true}) * dir));
        fill();
      });
      return th;
    }));
    t.append(el("thead", {}, head), body);
    fill();
    return el("div", {class: "scroll"}, t);
  }

  function headerTable(info) {
    const v = info.version;
    const rows = [["version", v.id]];
    if (v.refs.length) rows.push(["refs", v.refs.join(", ")]);
    const parents = el("span", {});
    v.parents.forEach((p, i) => {
      if (i) parents.append(" ");
      const a = el("a", {href: `#v=${p}`, class: "vid"}, p.slice(0, 12));
      a.addEventListener("click", (e) => { e.preventDefault(); select(p); });
      parents.append(a);
    });
    rows.push(["parents", v.parents.length ? parents : "-"]);
    rows.push(["step", v.step === null ? "-" : v.step], ["time", when(v.time)]);
    rows.push(["size", v.pruned ? "pruned: gc deleted its data" : size(v.size)]);
    const metrics = Object.entries(v.metrics);
    if (metrics.length) rows.push(["metrics", metrics.map(([k, x]) => `${k}=${fmt(x)}`).join("  ")]);
    for (const [k, x] of Object.entries(v.meta)) rows.push(["meta", `${k}=${x}`]);
    if (info.layout && info.layout.world_size > 1) rows.push(["layout", JSON.stringify(info.layout)]);
    if (v.message) rows.push(["message", v.message]);
    const c = info.capture || {};
    if (typeof c.blocking_s === "number") {   // the loop's cost of this snapshot, as log --stats shows it
      const ms = (x) => `${(x * 1e3).toFixed(1)} ms`;
      rows.push(["snapshot", (typeof c.lost_s === "number" ? `lost ${ms(c.lost_s)}  ` : "") + `blocking ${ms(c.blocking_s)}`]);
    }
    return el("table", {class: "head-table", id: "detail-header"},
              ...rows.map(([k, x]) => el("tr", {}, el("td", {}, k), el("td", {}, x))));
  }

  function diffSection(d) {
    if (d.root) return el("div", {id: "diff", class: "muted", "data-root": "true"}, "a root version: no parent to compare with");
    const changed = d.tensors.filter((t) => t.status !== "unchanged").length;
    const wrap = el("div", {id: "diff", "data-changed": changed, "data-tensors": d.tensors.length});
    const parent = el("a", {href: `#v=${d.a}`, class: "vid"}, d.a.slice(0, 12));
    parent.addEventListener("click", (e) => { e.preventDefault(); select(d.a); });
    wrap.append(el("h3", {}, `Diff against `, parent, ` — ${changed} of ${d.tensors.length} tensors changed`));
    wrap.append(table("diff-prefixes", [["prefix", "prefix", "name"], ["tensors", "tensors", "num"], ["changed", "changed", "num"],
                                        ["||B-A||", "l2", "num"], ["rel. change", "relative", "num"]], d.prefixes));
    const order = (t) => (t.relative === null ? -1 : t.relative);
    const rows = d.tensors.slice().sort((a, b) => order(b) - order(a));
    wrap.append(el("h3", {}, "Per tensor, largest relative change first"));
    wrap.append(table("diff-table", [["tensor", "name", "name"], ["status", "status", "tag"], ["||B-A||", "l2", "num"],
                                     ["rel. change", "relative", "num"], ["max |B-A|", "max_abs", "num"],
                                     ["cosine", "cosine", "num"]], rows,
                      (t) => (t.status !== "changed" && t.status !== "unchanged" ? "bad" : null)));
    if (d.objects.length) {
      wrap.append(el("h3", {}, "Objects"),
                  table("diff-objects", [["object", "path", "name"], ["status", "status", "tag"], ["before", "a", "name"],
                                         ["after", "b", "name"]], d.objects));
    }
    return wrap;
  }

  async function showDetail(id) {
    const token = ++state.detailToken;
    state.selected = id;
    document.body.dataset.detail = "loading";
    drawGraphRows(true);
    scrollGraphTo(id);
    for (const u of state.charts) u.redraw(false, false);
    if (state.heatmap) renderHeatmap();
    const box = $("detail");
    const [info, diff] = await Promise.allSettled([api(`api/version/${encodeURIComponent(id)}`),
                                                   api(`api/diff/${encodeURIComponent(id)}${nonfloatQuery("?")}`)]);
    if (token !== state.detailToken) return;   // another version was chosen meanwhile
    box.className = "";
    if (info.status === "rejected") {
      failed(box, info.reason);
      box.dataset.version = "";
      document.body.dataset.detail = "error";
      return;
    }
    const v = info.value.version;
    box.textContent = "";
    box.dataset.version = v.id;
    const command = `ckptrepo${state.info && state.info.url ? ` --repo ${shellQuote(state.info.url)}` : ""} checkout ${v.id}`;
    const copyCheckout = el("button", {id: "copy-checkout", type: "button", title: command}, "Copy checkout command");
    copyCheckout.addEventListener("click", () => copy(command, "command"));
    const copyLink = el("button", {id: "copy-link", type: "button", title: versionUrl(v.id)}, "Copy link");
    copyLink.addEventListener("click", () => copy(versionUrl(v.id), "link"));
    box.append(headerTable(info.value), el("div", {class: "actions"}, copyCheckout, copyLink,
                                           el("code", {id: "checkout-command", class: "muted"}, command)));
    const tensors = info.value.tensors;
    box.append(el("h3", {}, `${tensors.length} tensors${info.value.stats ? "" : " (no statistics: the data is gone)"}`));
    box.append(table("tensor-table", [["tensor", "name", "name"], ["dtype", "dtype", "tag"], ["shape", "shape", "tag"],
                                      ["norm", "norm", "num"], ["mean", "mean", "num"], ["std", "std", "num"],
                                      ["min", "min", "num"], ["max", "max", "num"], ["absmax", "absmax", "num"],
                                      ["NaN", "nan", "num"], ["Inf", "inf", "num"]], tensors,
                       (t) => (t.nan || t.inf ? "bad" : null)));
    if (diff.status === "rejected") {
      const d = el("div", {id: "diff"});
      failed(d, diff.reason);
      box.append(d);
    } else {
      box.append(diffSection(diff.value));
    }
    if (info.value.objects.length) {
      box.append(el("h3", {}, `${info.value.objects.length} objects`),
                 table("object-table", [["object", "path", "name"], ["value", "value", "name"]], info.value.objects));
    }
    document.body.dataset.detail = "ready";
  }

  // ---- loading --------------------------------------------------------------------------------------------
  async function loadGraph() {
    try {
      state.graph = await api("api/graph");
      renderGraph();
    } catch (e) { failed($("graph"), e); throw e; }
  }

  async function loadMetrics() {
    try {
      state.metrics = await api(`api/metrics?rev=${encodeURIComponent(state.rev)}`);
      renderMetrics();
    } catch (e) { failed($("metrics"), e); throw e; }
  }

  async function loadHeatmap() {
    const box = $("heatmap");
    const cols = Math.max(20, Math.min(400, Math.floor(((box.clientWidth || 800) - 120) / 2)));
    // as many rows as fit with a label each; more tensors fold into module prefixes on the server
    const rows = Math.min(2000, Math.floor(heatmapRoom() / HEAT_ROW));
    try {
      state.heatmap = await api(`api/heatmap?rev=${encodeURIComponent(state.rev)}&stat=${encodeURIComponent(state.stat)}` +
                                `&pattern=${encodeURIComponent(state.pattern)}&max_versions=${cols}&max_rows=${rows}` +
                                nonfloatQuery("&"));
      renderHeatmap();
    } catch (e) { state.heatmap = null; failed(box, e); throw e; }
  }

  function readHashSettings() {
    const p = hashParams();
    state.rev = p.get("rev") || (state.info ? state.info.rev : "HEAD");
    state.stat = p.get("stat") || state.stat || (state.info && state.info.stats.includes("absmax") ? "absmax" : "norm");
    state.pattern = p.get("pattern") || state.pattern;
    state.scale = p.get("scale") || state.scale;
    state.nonfloat = p.get("nonfloat") === "1";
    $("rev").value = state.rev;
    $("stat").value = state.stat;
    $("pattern").value = state.pattern;
    $("scale").value = state.scale;
    $("nonfloat").checked = state.nonfloat;
  }

  // non-float tensors and step counters are left out of the numbers unless asked for (docs/ui.md)
  function nonfloatQuery(sep) { return state.nonfloat ? `${sep}nonfloat=1` : ""; }

  async function loadAll() {
    document.body.dataset.state = "loading";
    status("loading…");
    const t0 = performance.now();
    try {
      state.info = await api("api/info");
    } catch (e) {
      status(e.message, true);
      document.body.dataset.state = "error";
      return;
    }
    $("repo-url").textContent = state.info.url;
    document.title = `ckptrepo: ${state.info.url}`;
    const stat = $("stat");
    stat.replaceChildren(...state.info.stats.map((s) => el("option", {value: s}, s)));
    readHashSettings();
    const metrics = loadMetrics();   // drawn first: the heatmap fits its rows in the height left below the curves
    const tasks = [loadGraph(), metrics, metrics.catch(() => {}).then(loadHeatmap)];
    const v = hashParams().get("v");
    if (v) tasks.push(showDetail(v));
    const results = await Promise.allSettled(tasks);
    const bad = results.filter((r) => r.status === "rejected");
    const ms = Math.round(performance.now() - t0);
    if (bad.length) status(`${bad.length} part${bad.length > 1 ? "s" : ""} failed: ${bad[0].reason.message}`, true);
    else status(`loaded in ${ms} ms`);
    document.body.dataset.state = bad.length ? "error" : "ready";
  }

  function onHashChange() {
    const p = hashParams();
    const before = [state.rev, state.stat, state.pattern, state.scale, state.nonfloat];
    readHashSettings();
    const after = [state.rev, state.stat, state.pattern, state.scale, state.nonfloat];
    if (before[0] !== after[0]) loadMetrics().catch(() => {});
    if (before[0] !== after[0] || before[1] !== after[1] || before[2] !== after[2] || before[4] !== after[4]) {
      loadHeatmap().catch(() => {});
    } else if (before[3] !== after[3] && state.heatmap) renderHeatmap();
    const v = p.get("v");
    if (v && (v !== state.selected || before[4] !== after[4])) showDetail(v);
  }

  function moveSelection(delta) {
    const ids = graphVersions();
    if (!ids.length) return;
    const i = ids.indexOf(state.selected);
    select(ids[Math.max(0, Math.min(ids.length - 1, i < 0 ? 0 : i + delta))]);
  }

  function wire() {
    $("graph").addEventListener("scroll", () => requestAnimationFrame(() => drawGraphRows(false)));
    $("graph").addEventListener("keydown", (e) => {
      if (e.key === "ArrowDown" || e.key === "j") { e.preventDefault(); moveSelection(1); }
      if (e.key === "ArrowUp" || e.key === "k") { e.preventDefault(); moveSelection(-1); }
    });
    $("reload").addEventListener("click", () => loadAll());
    $("rev").addEventListener("change", () => {
      writeHash({rev: $("rev").value.trim() || null}, false);
      onHashChange();
    });
    $("heatmap-controls").addEventListener("submit", (e) => {
      e.preventDefault();
      writeHash({stat: $("stat").value, pattern: $("pattern").value.trim() || "*"}, false);
      onHashChange();
    });
    $("stat").addEventListener("change", () => $("heatmap-controls").requestSubmit());
    $("scale").addEventListener("change", () => { writeHash({scale: $("scale").value}, false); onHashChange(); });
    $("nonfloat").addEventListener("change", () => { writeHash({nonfloat: $("nonfloat").checked ? "1" : null}, false); onHashChange(); });
    window.addEventListener("hashchange", onHashChange);
    let resize = null;
    window.addEventListener("resize", () => {
      clearTimeout(resize);
      resize = setTimeout(() => {
        if (state.metrics) renderMetrics();
        if (state.heatmap) loadHeatmap().catch(() => {});   // another height folds the rows otherwise
      }, 150);
    });
  }

  wire();
  loadAll();
})();
