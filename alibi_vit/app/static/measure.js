// alibi-vit app, the Measure panel: the prediction shown (a 2D image's, the volume slice's, or with
// "Measure volume" the whole volume's, predicted first) measured on the server by alibi_vit.measure, the
// computation of `alibi-vit segment measure` (API.md "Measure"): a table per class (fraction with its 95 %
// tile interval, specific surface, objects), the interfaces and percolation in words, S2(r) drawn on a
// canvas, and the table as a CSV download. The numbers and the CSV come from the server; this file only
// lays them out. Plain ES2020, loaded after app.js and volume.js.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const enc = encodeURIComponent;
  const POLL_MS = 250;          // the job, while it runs
  const CHECK_MS = 500;         // whether the page still shows what was measured (no request: the page's state)
  const AXIS_COLOUR = "#9aa1b1";   // the page's muted text colour (app.css --muted)

  const M = {
    job: null,        // the Measure job followed
    result: null,     // the last measurement shown
    key: null,        // what it measured: "image/m0/<model>", "volume/v/xz/12/<model>" or "volume/v/whole/<model>"
    csvUrl: null,     // object URL of its CSV
    classKey: "",     // the class names and colours the panel was drawn with
  };
  window.measureApp = {   // read-only peek for tests
    get result() { return M.result; },
    get running() { return M.job !== null; },
    get stale() { return $("measure-panel").dataset.stale === "true"; },
  };

  const status = (text, kind = "") => window.app.status(text, kind);
  async function api(method, path, json) {
    const res = await window.app.request(method, path, json);
    const text = await res.text();
    return text ? JSON.parse(text) : null;
  }
  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

  // What the page shows, as a request and a key: the 2D image (app.js), or of the volume shown (volume.js)
  // its slice, or with `whole` the whole volume.
  function shown(whole = false) {
    const state = window.app.state || {};
    const volume = window.volumeApp;
    if (volume && volume.current) {
      const model = state.volume_model ? state.volume_model.id : null;
      const path = `/api/volumes/${enc(volume.current)}/measure`;
      if (whole) return { path, body: { whole: true }, key: `volume/${volume.current}/whole/${model}` };
      return { path, body: { view: volume.view, index: volume.index },
        key: `volume/${volume.current}/${volume.view}/${volume.index}/${model}` };
    }
    const id = window.app.current;
    if (!id) return null;
    return { path: `/api/images/${enc(id)}/measure`, body: undefined, key: `image/${id}/${state.model ? state.model.id : null}` };
  }

  function keyOf(measured) {
    if (measured.kind !== "volume") return `image/${measured.id}/${measured.model}`;
    if (measured.whole) return `volume/${measured.id}/whole/${measured.model}`;
    return `volume/${measured.id}/${measured.view}/${measured.index}/${measured.model}`;
  }
  const volumeShown = () => Boolean(window.volumeApp && window.volumeApp.current);

  // ---------------------------------------------------------------- running a measurement
  function setBusy(busy, pressed = $("measure")) {
    pressed.classList.toggle("busy", busy);
    pressed.setAttribute("aria-busy", busy ? "true" : "false");
    $("measure").disabled = busy;
    $("measure-volume").disabled = busy;
    $("measure-cancel").hidden = !busy;
    $("measure-progress").hidden = !busy;
    $("measure-panel").dataset.state = busy ? "running" : "idle";
  }

  function message(text, kind = "") {
    const el = $("measure-message");
    el.textContent = text;
    el.className = `small ${kind || "muted"}`;
  }

  async function measure(whole = false) {
    if (M.job) return;
    const target = shown(whole);
    if (!target) { status("select an image or a volume first", "error"); return; }
    const t0 = performance.now();
    const pressed = whole ? $("measure-volume") : $("measure");
    setBusy(true, pressed);
    status(whole ? "predicting and measuring the whole volume…" : "measuring…", "busy");
    message("starting…");
    let j;
    try {
      const job = await api("POST", target.path, target.body);
      M.job = job.job;
      $("measure-progress").value = 0;
      for (;;) {
        j = await api("GET", `/api/jobs/${enc(M.job)}`);
        $("measure-progress").value = j.progress || 0;
        message(`${j.message || "measuring"}… ${Math.round(100 * (j.progress || 0))} %`);
        if (j.state !== "running") break;
        await sleep(POLL_MS);
      }
    } catch (err) {
      j = { state: "error", message: err.message };
    } finally {
      M.job = null;
      setBusy(false, pressed);
    }
    if (j.state === "done") {
      show(j.result);
      window.appTimings.push({ event: "measure", ms: Math.round(performance.now() - t0), image: j.result.measured.id });
      status(j.message, "ok");
    } else if (j.state === "cancelled") {
      status("measure cancelled");
      message(j.message || "cancelled");
    } else {
      status(`measure: ${j.message || "failed"}`, "error");
      message(j.message || "failed", "error");
    }
  }

  async function cancel() {
    if (!M.job) return;
    try {
      await api("DELETE", `/api/jobs/${enc(M.job)}`);
    } catch (err) {
      status(`measure: ${err.message}`, "error");
    }
  }

  // The words of a 2D measurement or a volume's: what a cell is, what its fraction and specific surface are of.
  function wordsOf(result) {
    return result.ndim === 3
      ? { cell: "voxel", cells: "voxels", fraction: "volume", of: "volume", surfaceOf: "unit volume", interface: "area" }
      : { cell: "pixel", cells: "pixels", fraction: "area", of: result.measured.kind === "volume" ? "slice" : "image",
        surfaceOf: "unit area", interface: "length" };
  }

  function describe(result) {
    const m = result.measured;
    const words = wordsOf(result);
    const across = [...result.shape].reverse().join("×");   // x × y (× z), as the page names sizes
    const size = `${across} ${result.unit === "px" && result.ndim !== 3 ? "px" : words.cells}`;
    const spacing = result.unit === "px" ? "" : `, ${words.cell} ${[...result.spacing].reverse().map((s) => fmt(s)).join(" × ")} ${result.unit}`;
    return `${m.name}, model #${m.model}${m.crf ? " with CRF" : ""}: ${size}${spacing}`;
  }

  // ---------------------------------------------------------------- the result
  function fmt(v, digits = 3) {   // significant digits (whole numbers from 1000), trailing zeros of the decimals dropped
    if (v === null || v === undefined) return "–";
    if (Math.abs(v) >= 10 ** digits) return String(Math.round(v));
    const text = Number(v).toPrecision(digits);
    return text.includes(".") ? text.replace(/\.?0+(?=e|$)/, "") : text;
  }
  const percent = (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(1));

  // The class's current name and colour (recoloured since: the panel follows), else those measured.
  function classOf(row) {
    const state = window.app.state;
    const cls = state && state.classes.find((c) => c.value === row.phase);
    return { name: cls ? cls.name : row.name, color: (cls && cls.color) || row.color || "#888888" };
  }

  function show(result) {
    M.result = result;
    M.key = keyOf(result.measured);
    $("measure-result").hidden = false;   // before drawing: a hidden canvas has no size
    render();
    if (M.csvUrl) URL.revokeObjectURL(M.csvUrl);
    M.csvUrl = URL.createObjectURL(new Blob([result.csv], { type: "text/csv" }));
    const link = $("measure-csv");
    const m = result.measured;
    link.href = M.csvUrl;
    link.download = m.kind !== "volume" ? `${m.id}_measure.csv`
      : m.whole ? `${m.id}_volume_measure.csv` : `${m.id}_${m.view}${m.index}_measure.csv`;
    link.hidden = false;
    checkShown(true);
  }

  function render() {
    const result = M.result;
    if (!result) return;
    const state = window.app.state;
    M.classKey = JSON.stringify(state ? state.classes : []);
    const unit = result.unit;
    const words = wordsOf(result);
    const fractionHead = $("measure-fraction-head");
    fractionHead.textContent = words.fraction;
    fractionHead.title = `${words.fraction} fraction; below it the 95 % interval from resampled tiles`;
    $("measure-surface-head").title = `specific surface (1/${unit}): interface with the other classes per ${words.surfaceOf} of the class (isotropic estimate)`;
    const body = $("measure-table").tBodies[0];
    body.replaceChildren(...result.classes.map((row) => {
      const cls = classOf(row);
      const tr = document.createElement("tr");
      tr.dataset.value = String(row.phase);
      tr.innerHTML = '<td><span class="swatch"></span></td><td class="cname"></td><td class="num fraction"></td>'
        + '<td class="num surface"></td><td class="num objects"></td>';
      tr.querySelector(".swatch").style.background = cls.color;
      tr.querySelector(".cname").textContent = cls.name;
      tr.querySelector(".cname").title = cls.name;
      const fraction = tr.querySelector(".fraction");
      fraction.innerHTML = '<span></span><small></small>';
      fraction.firstChild.textContent = `${percent(row.fraction)} %`;
      fraction.lastChild.textContent = `${percent(row.tile_ci95_low)}–${percent(row.tile_ci95_high)}`;
      fraction.title = `${percent(row.fraction)} % of the ${words.of}; 95 % interval `
        + `${percent(row.tile_ci95_low)}–${percent(row.tile_ci95_high)} % (tile standard error ${percent(row.tile_se)} %)`;
      const surface = tr.querySelector(".surface");
      surface.textContent = fmt(row.specific_surface_isotropic);
      surface.title = `${fmt(row.specific_surface_isotropic)} per ${unit} (isotropic); ${fmt(row.specific_surface_faces)} from ${words.cell} faces`;
      const objects = tr.querySelector(".objects");
      objects.innerHTML = '<span></span><small></small>';
      objects.firstChild.textContent = String(row.objects);
      objects.lastChild.textContent = `⌀ ${fmt(row.median_equivalent_diameter)}`;
      objects.title = `${row.objects} objects, ${row.border_objects} cut by the border; equivalent diameter of the `
        + `${row.diameters_of}: median ${fmt(row.median_equivalent_diameter)} ${unit}, mean ${fmt(row.mean_equivalent_diameter)} ${unit}`;
      return tr;
    }));
    renderNotes(result);
    drawS2(result);
  }

  function renderNotes(result) {
    const name = (value) => {
      const row = result.classes.find((r) => r.phase === value);
      return row ? classOf(row).name : `class ${value}`;
    };
    const interval = result.interval;
    const unit = result.unit;
    const words = wordsOf(result);
    const tile = result.ndim === 3 ? `${interval.tile_side}³ voxels` : `${interval.tile_side} px`;
    const lines = [
      `Under each ${words.fraction}: its ${Math.round(100 * interval.level)} % interval from ${interval.tiles} tiles of `
        + `${tile} resampled (${interval.name}). SV in 1/${unit}; ⌀: median equivalent diameter in ${unit}.`,
      `Interfaces (isotropic ${words.interface}, ${unit}${result.ndim === 3 ? "²" : ""}): ` + (result.interfaces.length
        ? result.interfaces.map((r) => `${name(r.phase_a)}–${name(r.phase_b)} ${fmt(r.isotropic_area)}`).join("; ") : "none"),
      "Percolates: " + (result.classes.some((r) => r.percolates_along)
        ? result.classes.filter((r) => r.percolates_along).map((r) => `${name(r.phase)} along ${r.percolates_along.split(" ").join(", ")}`).join("; ")
        : "no class spans the region"),
    ];
    $("measure-notes").replaceChildren(...lines.map((text) => {
      const span = document.createElement("span");
      span.textContent = text;
      return span;
    }));
  }

  // S2(r): one curve per class in its colour; the mean over the axes when their spacing is the same,
  // else each axis: the last (x) solid, the one before dashed, z of a volume dotted.
  const DASHES = [[], [4, 3], [1, 3]];
  const dashOf = (axes, axis) => DASHES[axes.length - 1 - axes.indexOf(axis)] || [];
  function drawS2(result) {
    const canvas = $("measure-s2");
    const ratio = window.devicePixelRatio || 1;
    const w = canvas.clientWidth, h = canvas.clientHeight;
    canvas.width = Math.round(w * ratio);
    canvas.height = Math.round(h * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const hasMean = result.s2.some((c) => c.axis === "mean");
    const curves = result.s2.filter((c) => (hasMean ? c.axis === "mean" : true));
    if (!curves.length) return;
    const pad = { left: 30, right: 8, top: 8, bottom: 24 };
    const plotW = w - pad.left - pad.right, plotH = h - pad.top - pad.bottom;
    const rMax = Math.max(...curves.map((c) => c.distance[c.distance.length - 1] || 0)) || 1;
    const top = Math.max(...curves.flatMap((c) => c.s2.filter((v) => v !== null)));
    const yMax = Math.min(1, Math.ceil(10 * top) / 10) || 1;
    const x = (r) => pad.left + (r / rMax) * plotW;
    const y = (v) => pad.top + (1 - v / yMax) * plotH;

    ctx.strokeStyle = AXIS_COLOUR;
    ctx.fillStyle = AXIS_COLOUR;
    ctx.lineWidth = 1;
    ctx.beginPath();
    ctx.moveTo(pad.left - 0.5, pad.top);
    ctx.lineTo(pad.left - 0.5, pad.top + plotH + 0.5);
    ctx.lineTo(pad.left + plotW, pad.top + plotH + 0.5);
    ctx.stroke();
    ctx.font = "10px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    ctx.fillText(fmt(yMax, 2), pad.left - 4, pad.top + 4);
    ctx.fillText("0", pad.left - 4, pad.top + plotH);
    ctx.textBaseline = "top";
    ctx.textAlign = "center";
    ctx.fillText("0", pad.left, pad.top + plotH + 4);
    ctx.fillText(fmt(rMax), pad.left + plotW - 6, pad.top + plotH + 4);
    ctx.fillText(`r (${result.unit})`, pad.left + plotW / 2, pad.top + plotH + 4);
    ctx.save();
    ctx.translate(8, pad.top + plotH / 2);
    ctx.rotate(-Math.PI / 2);
    ctx.textBaseline = "middle";
    ctx.fillText("S2", 0, 0);
    ctx.restore();

    ctx.lineWidth = 2;
    ctx.lineJoin = "round";
    for (const curve of curves) {
      const row = result.classes.find((r) => r.phase === curve.phase);
      ctx.strokeStyle = row ? classOf(row).color : AXIS_COLOUR;
      ctx.setLineDash(hasMean ? [] : dashOf(result.axes, curve.axis));
      ctx.beginPath();
      let drawing = false;
      curve.distance.forEach((r, i) => {
        const v = curve.s2[i];
        if (v === null) { drawing = false; return; }
        if (drawing) ctx.lineTo(x(r), y(v));
        else ctx.moveTo(x(r), y(v));
        drawing = true;
      });
      ctx.stroke();
    }
    ctx.setLineDash([]);
    const styles = ["solid", "dashed", "dotted"];
    const along = [...result.axes].reverse().map((axis, i) => `${styles[i]}: along ${axis}`).join(", ");
    $("measure-s2-note").textContent = hasMean
      ? `mean over ${result.axes.join(", ").replace(/, ([^,]*)$/, " and $1")}; S2(0) is the fraction, S2 settles at its square`
      : `${along}; S2(0) is the fraction, S2 settles at its square`;
  }

  // With a volume shown, Measure is "Measure slice" and "Measure volume" is offered beside it.
  function showButtons() {
    const volume = volumeShown();
    $("measure").textContent = volume ? "Measure slice" : "Measure";
    $("measure-volume").hidden = !volume;
    $("measure-volume-note").hidden = !volume;
  }

  // The panel says so when the page no longer shows what was measured (another image, slice, volume or
  // model; a whole volume's measurement stays current through its slices), and follows renamed or
  // recoloured classes.
  function checkShown(force = false) {
    showButtons();
    if (!M.result) return;
    const target = shown(Boolean(M.result.measured.whole));
    const stale = !target || target.key !== M.key;
    const panel = $("measure-panel");
    if (force || (panel.dataset.stale === "true") !== stale) {
      panel.dataset.stale = stale ? "true" : "false";
      if (!M.job) message(stale ? `${describe(M.result)}. The page shows something else now: press Measure for it.` : describe(M.result), stale ? "warning" : "");
    }
    const state = window.app.state;
    if (state && JSON.stringify(state.classes) !== M.classKey) render();
  }

  $("measure").addEventListener("click", () => measure(false));
  $("measure-volume").addEventListener("click", () => measure(true));
  $("measure-cancel").addEventListener("click", cancel);
  setInterval(() => checkShown(), CHECK_MS);
})();
