/* mfpipe explorer: the page of one model (mfpipe.explorer). Data arrive as scripts that call MFX.model / MFX.card
   (a page opened from file:// may not fetch files). Every string from the run (type strings, corpus text, decodes)
   is put into the page as text (textContent) or, for plotly's labels, HTML-escaped: never as markup. */
(function () {
  "use strict";
  const MFX = (window.MFX = { data: null, cards: {}, pending: {}, state: { score: null, revision: null, head: null } });

  // ------------------------------------------------------------------------------------------------ helpers
  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function esc(s) { // for plotly's labels, which read a few HTML tags and entities
    return String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  }
  function vis(s) { // a token on its own: whitespace made visible
    s = String(s);
    s = s.replace(/\r\n|\n|\r/g, "⏎").replace(/\t/g, "⇥");
    return s.startsWith(" ") ? "␣" + s.slice(1) : (s === "" ? "∅" : s);
  }
  function fmt(v) {
    if (v === null || v === undefined) return "–";
    if (typeof v === "number") return Number.isInteger(v) ? String(v) : (Math.abs(v) >= 1e4 || (v !== 0 && Math.abs(v) < 1e-3) ? v.toExponential(3) : v.toFixed(4));
    return String(v);
  }
  function status(text) { const s = document.getElementById("status"); if (s) s.textContent = text; }
  const PLOT_CONFIG = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["sendDataToCloud"] };

  // ------------------------------------------------------------------------------------------- data loading
  MFX.model = function (d) {
    MFX.data = d;
    if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
    else init();
  };
  MFX.card = function (c) {
    const key = c.revision + "/" + c.head;
    MFX.cards[key] = c;
    const cb = MFX.pending[key];
    delete MFX.pending[key];
    if (cb) cb(c);
  };
  function loadCard(rev, head, cb) {
    const key = rev + "/" + head;
    if (MFX.cards[key]) { cb(MFX.cards[key]); return; }
    MFX.pending[key] = cb;
    const s = el("script", { src: "data/cards/" + encodeURIComponent(rev) + "/" + encodeURIComponent(head) + ".js" });
    s.onerror = function () { delete MFX.pending[key]; status("The card of " + head + " at " + rev + " could not be loaded."); };
    document.head.appendChild(s);
  }

  // -------------------------------------------------------------------------------------------------- tabs
  const TABS = [["heads", "Heads"], ["rollout", "Rollout"], ["training", "Training"], ["fv", "Function vectors"],
    ["divergence", "Divergence"], ["tables", "Tables"]];
  function init() {
    const nav = document.getElementById("tabs"), main = document.getElementById("main");
    main.textContent = "";
    main.appendChild(el("p", { id: "status" }, ""));
    for (const [id, label] of TABS) {
      const b = el("button", { id: "tab-" + id, type: "button" }, label);
      b.addEventListener("click", () => show(id));
      nav.appendChild(b);
      main.appendChild(el("section", { id: "page-" + id, class: "page" }));
    }
    buildHeads();
    show("heads");
  }
  const built = {};
  function show(id) {
    for (const [t] of TABS) {
      document.getElementById("page-" + t).style.display = t === id ? "" : "none";
      document.getElementById("tab-" + t).classList.toggle("active", t === id);
    }
    if (!built[id]) {
      built[id] = true;
      ({ rollout: buildRollout, training: buildTraining, fv: buildFV, divergence: buildDivergence, tables: buildTables }[id] || (() => {}))();
    }
    document.querySelectorAll("#page-" + id + " .js-plotly-plot").forEach((g) => Plotly.Plots.resize(g));
  }
  MFX.show = show;

  // ------------------------------------------------------------------------------------------- head grid
  function scoreOf(key) { return MFX.data.scores.find((s) => s.key === key); }
  function buildHeads() {
    const d = MFX.data, page = document.getElementById("page-heads");
    const bar = el("div", { class: "controls" });
    const sel = el("select", { id: "score" });
    for (const s of d.scores) sel.appendChild(el("option", { value: s.key, title: s.description }, s.label));
    bar.appendChild(el("label", { for: "score" }, "colour by "));
    bar.appendChild(sel);
    const slider = el("input", { id: "revision", type: "range", min: "0", max: String(d.revisions.length - 1), step: "1" });
    const last = d.revisions.length - 1;
    slider.value = String(last);
    bar.appendChild(el("label", { for: "revision" }, " revision "));
    bar.appendChild(slider);
    bar.appendChild(el("span", { id: "revision-label" }));
    if (d.revisions.length < 2) slider.disabled = true;
    page.appendChild(bar);
    page.appendChild(el("p", { id: "score-note", class: "note" }));
    page.appendChild(el("div", { id: "grid" }));
    page.appendChild(el("div", { id: "card" }));
    MFX.state.score = d.scores.length ? d.scores[0].key : null;
    MFX.state.revision = d.revisions[last].name;
    sel.addEventListener("change", () => { MFX.state.score = sel.value; drawGrid(); });
    slider.addEventListener("input", () => {
      MFX.state.revision = d.revisions[Number(slider.value)].name;
      drawGrid();
      if (MFX.state.head) openCard(MFX.state.revision, MFX.state.head);
    });
    drawGrid();
  }
  function drawGrid() {
    const d = MFX.data, st = MFX.state, s = scoreOf(st.score);
    const r = d.revisions.find((x) => x.name === st.revision);
    document.getElementById("revision-label").textContent = r.name + (r.step !== null ? " (step " + r.step + ")" : "");
    const z = s && s.values[st.revision] ? s.values[st.revision] : null;
    const note = document.getElementById("score-note");
    note.textContent = !s ? "No head scores in this run." : (z ? s.description + " — from " + s.sources[st.revision] :
      s.label + " is not computed at " + st.revision + "; it exists at: " + Object.keys(s.values).join(", "));
    const L = d.n_layers, H = d.n_heads;
    const zz = z || Array.from({ length: L }, () => Array(H).fill(null));
    const text = zz.map((row, l) => row.map((v, h) => "L" + l + "H" + h + ": " + esc(fmt(v))));
    const trace = { type: "heatmap", z: zz, x: [...Array(H).keys()], y: [...Array(L).keys()], text: text,
      hovertemplate: "%{text}<extra></extra>", colorscale: "Viridis", xgap: 1, ygap: 1 };
    const layout = { title: { text: esc(s ? s.label : "") }, xaxis: { title: { text: "head" }, dtick: 1 },
      yaxis: { title: { text: "layer" }, dtick: 1, autorange: true }, margin: { t: 40, l: 60, r: 20, b: 50 },
      height: Math.min(640, 160 + 28 * L) };
    const g = document.getElementById("grid");
    Plotly.react(g, [trace], layout, PLOT_CONFIG).then(() => {
      if (!g._mfxClick) {
        g._mfxClick = true;
        g.on("plotly_click", (ev) => {
          const p = ev.points[0];
          openCard(MFX.state.revision, "L" + p.y + "H" + p.x);
        });
      }
    });
  }

  // ------------------------------------------------------------------------------------------- head card
  function openCard(rev, head) {
    MFX.state.head = head;
    loadCard(rev, head, (c) => { if (MFX.state.head === head && MFX.state.revision === rev) drawCard(c); });
  }
  MFX.openCard = openCard;
  function drawCard(c) {
    const d = MFX.data, box = document.getElementById("card");
    box.textContent = "";
    box.setAttribute("data-head", c.head);
    box.setAttribute("data-revision", c.revision);
    box.appendChild(el("h2", {}, c.head + " at " + c.revision));
    if (c.roles.length) {
      const ul = el("ul", { class: "roles" });
      for (const r of c.roles) ul.appendChild(el("li", {}, r));
      box.appendChild(ul);
    }
    const t = el("table", { class: "scores" });
    t.appendChild(trow(["score", "value", "rank (of " + d.n_layers * d.n_heads + ")"], "th"));
    for (const s of d.scores) {
      const v = c.scores[s.key];
      if (v) t.appendChild(trow([s.label, fmt(v.value), v.rank ? String(v.rank) : "–"], "td"));
    }
    box.appendChild(t);
    const rows = el("div", { class: "rows" });
    rows.appendChild(el("h3", {}, "In the tables"));
    for (const r of c.rows) {
      const p = el("p", { class: "row" });
      const a = el("a", { href: r.link, target: "_blank" }, r.table);
      p.appendChild(a);
      p.appendChild(document.createTextNode(": " + Object.entries(r.values).map(([k, v]) => k + " = " + fmt(v)).join(", ")));
      rows.appendChild(p);
    }
    box.appendChild(rows);
    drawKernel(box, c);
    drawContexts(box, c);
    drawEvolution(box, c);
  }
  function trow(cells, tag) {
    const tr = el("tr");
    for (const x of cells) tr.appendChild(el(tag, {}, x));
    return tr;
  }
  function drawKernel(box, c) {
    const k = c.kernel;
    box.appendChild(el("h3", {}, "Kernel W = P / n̄ (top " + k.query.length + " query × " + k.key.length + " key types; C ≥ " + k.min_count + ")"));
    const div = el("div", { id: "kernel" });
    box.appendChild(div);
    if (!k.query.length) { div.textContent = "No tracked query type of this head has a row."; return; }
    const text = k.W.map((row, i) => row.map((w, j) => "query " + esc(vis(k.query[i])) + " → key " + esc(vis(k.key[j])) +
      "<br>W " + esc(fmt(w)) + "<br>P " + esc(fmt(k.P[i][j])) + "<br>n̄ " + esc(fmt(k.nbar[i][j])) + "<br>C " + esc(fmt(k.C[i][j]))));
    const trace = { type: "heatmap", z: k.W, x: [...k.key.keys()], y: [...k.query.keys()], text: text,
      hovertemplate: "%{text}<extra></extra>", colorscale: "Viridis" };
    const layout = { xaxis: { tickvals: [...k.key.keys()], ticktext: k.key.map((s) => esc(vis(s))), title: { text: "key type" } },
      yaxis: { tickvals: [...k.query.keys()], ticktext: k.query.map((s) => esc(vis(s))), autorange: "reversed", title: { text: "query type" } },
      margin: { t: 10, l: 110, r: 20, b: 110 }, height: 460 };
    Plotly.newPlot(div, [trace], layout, PLOT_CONFIG);
  }
  function drawContexts(box, c) {
    box.appendChild(el("h3", {}, "Top-deviation contexts"));
    const wrap = el("div", { id: "contexts" });
    box.appendChild(wrap);
    if (!c.contexts_mined) {
      const at = MFX.data.revisions.filter((r) => r.contexts).map((r) => r.name).join(", ") || "no revision";
      wrap.appendChild(el("p", { class: "note" }, "Contexts are mined by the lenses at the rollout revisions (" + at + ")."));
      return;
    }
    if (!c.contexts.length) {
      wrap.appendChild(el("p", { class: "note" }, "The lenses did not read this head (prompts.lenses.n_lens_heads / heads choose them)."));
      return;
    }
    for (const x of c.contexts) {
      const div = el("div", { class: "context" });
      div.appendChild(el("p", { class: "meters" }, "D = " + fmt(x.D) + " (recomputed " + fmt(x.D_recomputed) + "), M_cov = " +
        fmt(x.M_cov) + ", M_ctx = " + fmt(x.M_ctx) + ", attention on BOS " + fmt(x.bos_share)));
      const p = el("p", { class: "tokens" });
      const top = Math.max(1e-9, ...x.attention.filter((a) => a !== null));
      x.tokens.forEach((tok, i) => {
        const a = x.attention[i] || 0;
        const span = el("span", { class: "tok" + (i === x.query_index ? " query" : ""), title: "attention " + fmt(a) }, tok.replace(/\n/g, "⏎"));
        span.style.backgroundColor = "rgba(255,120,0," + (0.85 * a / top).toFixed(3) + ")";
        p.appendChild(span);
      });
      div.appendChild(p);
      div.appendChild(el("p", { class: "next" }, "next token: " + vis(x.next_token)));
      div.appendChild(el("p", { class: "decode" }, "logit lens: " + x.decode.map(([t, q]) => vis(t) + " (" + fmt(q) + ")").join(", ")));
      if (x.jlens) div.appendChild(el("p", { class: "decode jlens" }, "J-lens: " + x.jlens.map(([t, q]) => vis(t) + " (" + fmt(q) + ")").join(", ")));
      wrap.appendChild(div);
    }
  }
  function drawEvolution(box, c) {
    const d = MFX.data;
    if (d.revisions.length < 2) return;
    box.appendChild(el("h3", {}, "Across training"));
    const div = el("div", { id: "evolution" });
    box.appendChild(div);
    const steps = d.revisions.map((r) => r.step);
    const traces = [];
    for (const key of ["spread", "S_bar", "substitution_D"]) {
      const s = scoreOf(key);
      if (!s) continue;
      traces.push({ type: "scatter", mode: "lines+markers", name: esc(s.label), x: steps,
        y: d.revisions.map((r) => (s.values[r.name] ? s.values[r.name][c.layer][c.index] : null)) });
    }
    Plotly.newPlot(div, traces, { xaxis: { title: { text: "training step" } }, margin: { t: 10, l: 50, r: 20, b: 50 }, height: 300,
      shapes: windowShapes() }, PLOT_CONFIG);
  }
  function windowShapes() {
    const w = MFX.data.pages.induction_window;
    return w ? [{ type: "rect", xref: "x", yref: "paper", x0: w[0], x1: w[1], y0: 0, y1: 1, fillcolor: "#f2c14e", opacity: 0.25, line: { width: 0 } }] : [];
  }

  // ------------------------------------------------------------------------------------------- run pages
  function plotIn(page, id, title, traces, layout) {
    page.appendChild(el("h3", {}, title));
    const div = el("div", { id: id, class: "chart" });
    page.appendChild(div);
    Plotly.newPlot(div, traces, Object.assign({ margin: { t: 10, l: 60, r: 20, b: 50 }, height: 360 }, layout), PLOT_CONFIG);
  }
  function empty(page, text) { page.appendChild(el("p", { class: "note" }, text)); }
  function buildRollout() {
    const page = document.getElementById("page-rollout"), R = MFX.data.pages.rollout;
    if (!Object.keys(R).length) return empty(page, "No rollout in this run.");
    for (const [rev, rows] of Object.entries(R)) {
      const cos = rows.filter((r) => r.metric === "cosine" && (r.pinned === false || String(r.pinned) === "False"));
      const kernels = [...new Set(cos.map((r) => r.kernel))];
      const traces = kernels.map((k) => {
        const rs = cos.filter((r) => r.kernel === k).sort((a, b) => a.depth - b.depth);
        return { type: "scatter", mode: "lines+markers", name: esc(k), x: rs.map((r) => r.depth), y: rs.map((r) => r.value) };
      });
      plotIn(page, "rollout-" + rev, "Centroid cosine by depth, every kernel — " + rev, traces,
        { xaxis: { title: { text: "depth" }, dtick: 1 }, yaxis: { title: { text: "cosine to the true centroids" } } });
    }
  }
  function buildTraining() {
    const page = document.getElementById("page-training"), P = MFX.data.pages;
    if (!P.substitution.length) return empty(page, "No substitution sweep in this run.");
    const rs = P.substitution.slice().sort((a, b) => a.step - b.step);
    for (const [key, label] of [["delta_L", "ΔL = L_MF − L_model"], ["D_MF", "D_MF"]]) {
      plotIn(page, "training-" + key, label + " across training", [{ type: "scatter", mode: "lines+markers", name: esc(label),
        x: rs.map((r) => r.step), y: rs.map((r) => r[key]) }], { xaxis: { title: { text: "training step" } }, shapes: windowShapes() });
    }
    if (P.cka.length) {
      plotIn(page, "training-cka", "Kernel CKA between adjacent checkpoints", [{ type: "scatter", mode: "lines+markers",
        x: P.cka.map((r) => r.step_b), y: P.cka.map((r) => r.cka) }], { xaxis: { title: { text: "training step" } }, shapes: windowShapes() });
    }
  }
  function buildFV() {
    const page = document.getElementById("page-fv"), F = MFX.data.pages.fv;
    if (!Object.keys(F).length) return empty(page, "No function vectors in this run.");
    for (const [rev, rows] of Object.entries(F)) {
      const inj = rows.filter((r) => r.selection !== "none" || r.protocol !== "sum");
      const label = (r) => [r.protocol, r.selection, r.construction].filter((x) => x && x !== "none").join(" · ");
      const tasks = [...new Set(inj.map((r) => r.task))], cols = [...new Set(inj.map(label))];
      const z = tasks.map((t) => cols.map((cname) => { const r = inj.find((x) => x.task === t && label(x) === cname); return r ? r.accuracy : null; }));
      plotIn(page, "fv-" + rev, "Function-vector accuracy (task × pipeline) — " + rev, [{ type: "heatmap", z: z,
        x: cols.map(esc), y: tasks.map(esc), colorscale: "Greens", hovertemplate: "%{y} · %{x}: %{z:.3f}<extra></extra>" }],
        { margin: { t: 10, l: 100, r: 20, b: 160 }, height: 200 + 30 * tasks.length });
    }
  }
  function buildDivergence() {
    const page = document.getElementById("page-divergence"), D = MFX.data.pages.divergence;
    if (!Object.keys(D).length) return empty(page, "No divergence diagnostics in this run.");
    for (const [rev, rows] of Object.entries(D)) {
      // a column plotted where any block has a number (a ratio is NaN, null here, at block 0 of a rotary model)
      const keys = Object.keys(rows[0] || {}).filter((k) => k !== "layer" && k !== "frac_depth"
        && rows.some((r) => typeof r[k] === "number"));
      plotIn(page, "divergence-" + rev, "Rollout divergence by layer — " + rev, keys.map((k) => ({ type: "scatter",
        mode: "lines+markers", name: esc(k), x: rows.map((r) => r.layer), y: rows.map((r) => r[k]) })),
        { xaxis: { title: { text: "layer" }, dtick: 1 } });
    }
  }
  function buildTables() {
    const page = document.getElementById("page-tables"), ul = el("ul");
    for (const t of MFX.data.tables) {
      const li = el("li");
      li.appendChild(el("a", { href: t, target: "_blank" }, t.split("/").pop()));
      ul.appendChild(li);
    }
    page.appendChild(el("p", {}, "The head-level tables the cards link to (one anchor per head row):"));
    page.appendChild(ul);
  }
})();
