// alibi-vit app, volume mode: a volume shown one slice at a time in XY, XZ or YZ, with a slider and
// keys to step through slices, scribbles on the slice shown, and the overlay of the slice predicted
// from 3D features (API.md "Volumes"). It shares the page's classes, brush, Train and Save buttons:
// while a volume is shown, those act on it. Plain ES2020, loaded after app.js.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const VIEWS = ["xy", "xz", "yz"];
  const ACROSS = { xy: "z", xz: "y", yz: "x" };        // the axis a view's slices are taken across
  const LIST_POLL_MS = 400;

  const V = {
    id: null,                  // the volume shown (null: the 2D viewer is on)
    shape: null,               // [z, y, x]
    view: "xy",
    index: { xy: 0, xz: 0, yz: 0 },
    scale: 1,
    seq: 0,                    // bumps on every slice change: stale answers do not draw
    shown: null,               // "view/index" of the slice drawn
    overlayShown: null,        // "view/index/model" of the overlay drawn
    labelsVersion: null,
    drawing: null,
    pendingStrokes: 0,
    strokeQueue: Promise.resolve(),
    predictAbort: null,
    listKey: "",
  };
  window.volumeApp = {   // read-only peek for tests and benchmarks
    get current() { return V.id; },
    get view() { return V.view; },
    get index() { return V.index[V.view]; },
    get shown() { return V.shown; },
    get overlayShown() { return V.overlayShown; },
    get pendingStrokes() { return V.pendingStrokes + (V.drawing ? 1 : 0); },
    get scale() { return V.scale; },
  };

  const canvases = { image: $("volume-image"), overlay: $("volume-overlay"), labels: $("volume-labels") };
  const area = $("volume-area"), stage = $("volume-stage");
  const enc = encodeURIComponent;

  function timing(event, ms, extra = {}) {
    window.appTimings.push({ event, ms: Math.round(ms), ...extra });
  }

  // Requests and the status line are the image page's (app.js): one token header, one error form.
  const status = (text, kind = "") => window.app.status(text, kind);
  const send = (method, path, json, signal) => window.app.request(method, path, json, signal);

  async function bitmap(path, signal) {
    const res = await send("GET", path, undefined, signal);
    return { image: await createImageBitmap(await res.blob()), res };
  }

  const state = () => window.app && window.app.state;
  const volumeRecord = (id) => ((state() && state().volumes) || []).find((v) => v.id === id);
  const model = () => state() && state().volume_model;
  const sliceCount = (view) => V.shape[VIEWS.indexOf(view)];
  const sliceSize = (view) => (view === "xy" ? [V.shape[2], V.shape[1]] : view === "xz" ? [V.shape[2], V.shape[0]]
    : [V.shape[1], V.shape[0]]);   // [columns, rows]
  const slicePath = (layer, view = V.view, index = V.index[V.view]) =>
    `/api/volumes/${enc(V.id)}/${layer}/${view}/${index}.png`;

  // ---------------------------------------------------------------- the list of volumes
  function renderList() {
    const volumes = (state() && state().volumes) || [];
    const key = JSON.stringify([volumes, V.id]);
    if (key === V.listKey) return;
    V.listKey = key;
    const list = $("volume-list");
    list.replaceChildren(...volumes.map((v) => {
      const li = document.createElement("li");
      li.className = "image-row volume-row" + (v.id === V.id ? " selected" : "");
      li.dataset.id = v.id;
      li.dataset.testid = `volume-${v.id}`;
      li.dataset.features = "ready";
      const labelled = Object.values(v.labelled || {}).reduce((a, b) => a + b, 0);
      li.innerHTML = '<span class="name"><span class="file"></span><span class="page">[volume]</span></span><span class="meta"><span class="size"></span></span>';
      li.querySelector(".file").textContent = v.file;
      li.querySelector(".size").textContent = `${v.shape[2]}×${v.shape[1]}×${v.shape[0]}` + (labelled ? ` · ${labelled} voxels` : "");
      li.title = `${v.name} (${v.id}): x × y × z = ${v.shape[2]} × ${v.shape[1]} × ${v.shape[0]}`;
      li.addEventListener("click", () => selectVolume(v.id));
      return li;
    }));
    if (volumes.length) $("no-images").hidden = true;
  }

  // ---------------------------------------------------------------- showing a slice
  function fit() {
    if (!V.id) return;
    const [w, h] = sliceSize(V.view);
    const r = area.getBoundingClientRect();
    V.scale = Math.max(Math.min(r.width / w, r.height / h), 0.01);
    stage.style.width = `${w * V.scale}px`;
    stage.style.height = `${h * V.scale}px`;
    stage.style.left = `${Math.max((r.width - w * V.scale) / 2, 0)}px`;
    stage.style.top = `${Math.max((r.height - h * V.scale) / 2, 0)}px`;
  }

  function draw(canvas, image) {
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    if (image) ctx.drawImage(image, 0, 0);
  }

  function renderBar() {
    const n = sliceCount(V.view), index = V.index[V.view];
    const slider = $("volume-slider");
    slider.max = String(n - 1);
    slider.value = String(index);
    $("volume-index").textContent = `${ACROSS[V.view]} = ${index} / ${n - 1}`;
    document.querySelectorAll("#volume-bar [data-view]").forEach((b) =>
      b.setAttribute("aria-pressed", b.dataset.view === V.view ? "true" : "false"));
  }

  async function showSlice(t0 = performance.now(), event = "volume_slice") {
    const seq = ++V.seq, view = V.view, index = V.index[view];
    renderBar();
    if (V.predictAbort) V.predictAbort.abort();
    let slice, labels;
    try {
      [slice, labels] = await Promise.all([bitmap(slicePath("slice", view, index)), bitmap(slicePath("labels", view, index))]);
    } catch (err) {
      if (seq === V.seq) status(`slice not shown: ${err.message}`, "error");
      return;
    }
    if (seq !== V.seq) return;
    const [w, h] = sliceSize(view);
    for (const c of Object.values(canvases)) { c.width = w; c.height = h; }
    fit();
    draw(canvases.image, slice.image);
    draw(canvases.labels, labels.image);
    draw(canvases.overlay, null);
    V.shown = `${view}/${index}`;
    V.overlayShown = null;
    V.labelsVersion = Number(labels.res.headers.get("X-Labels-Version"));
    timing(event, performance.now() - t0, { image: V.id, view, index });
    if (model()) showOverlay(performance.now());
  }

  async function showOverlay(t0, event = "volume_overlay") {
    const seq = V.seq, view = V.view, index = V.index[view];
    if (V.predictAbort) V.predictAbort.abort();
    const abort = V.predictAbort = new AbortController();
    let answer;
    try {
      answer = await bitmap(slicePath("prediction", view, index), abort.signal);
    } catch (err) {
      if (!window.app.aborted(err) && seq === V.seq) status(`overlay not shown: ${err.message}`, "error");
      return;
    }
    if (seq !== V.seq) return;
    draw(canvases.overlay, answer.image);
    canvases.overlay.hidden = !$("show-overlay").checked;
    window.app.renderFractions({ fractions: JSON.parse(answer.res.headers.get("X-Fractions") || "{}"), predicted: 1 });
    $("fractions-note").hidden = false;
    $("fractions-note").textContent = `of the ${view.toUpperCase()} slice ${ACROSS[view]} = ${index}`;
    V.overlayShown = `${view}/${index}/${answer.res.headers.get("X-Model")}`;
    timing(event, performance.now() - t0, { image: V.id, view, index });
  }

  async function reloadLabels() {
    const seq = V.seq;
    try {
      const labels = await bitmap(slicePath("labels"));
      if (seq !== V.seq || V.drawing || V.pendingStrokes) return;
      draw(canvases.labels, labels.image);
      V.labelsVersion = Number(labels.res.headers.get("X-Labels-Version"));
    } catch (err) {
      status(`labels not shown: ${err.message}`, "error");
    }
  }

  function step(delta, t0) {
    const n = sliceCount(V.view);
    const index = Math.min(Math.max(V.index[V.view] + delta, 0), n - 1);
    if (index === V.index[V.view]) return;
    V.index[V.view] = index;
    showSlice(t0);
  }

  function setView(view, t0 = performance.now()) {
    if (!VIEWS.includes(view) || view === V.view) return;
    V.view = view;
    showSlice(t0, "volume_view");
  }

  function selectVolume(id) {
    const record = volumeRecord(id);
    if (!record) return;
    const t0 = performance.now();
    document.body.classList.add("volume-mode");
    window.app.renderModel();
    $("volume-view").hidden = false;
    $("empty-hint").hidden = true;
    if (V.id !== id) {
      V.id = id;
      V.shape = record.shape;
      V.view = "xy";
      V.index = { xy: record.shape[0] >> 1, xz: record.shape[1] >> 1, yz: record.shape[2] >> 1 };
    }
    document.querySelectorAll("#image-list .image-row.selected").forEach((li) => li.classList.remove("selected"));
    renderList();
    $("volume-view").focus({ preventScroll: true });
    showSlice(t0, "volume_open");
  }

  function leave() {
    if (!V.id) return;
    V.id = null;
    V.seq++;
    if (V.predictAbort) V.predictAbort.abort();
    document.body.classList.remove("volume-mode");
    window.app.renderModel();
    $("volume-view").hidden = true;
    renderList();
  }

  // ---------------------------------------------------------------- strokes
  function toSlice(clientX, clientY) {
    const r = stage.getBoundingClientRect();
    return { x: (clientX - r.left) / V.scale - 0.5, y: (clientY - r.top) / V.scale - 0.5 };
  }

  function classColour(value) {
    const c = (state() ? state().classes : []).find((k) => k.value === value);
    return c ? c.color : "#ffffff";
  }

  function paint(a, b, st) {
    const ctx = canvases.labels.getContext("2d");
    ctx.save();
    ctx.globalCompositeOperation = st.erase ? "destination-out" : "source-over";
    ctx.strokeStyle = ctx.fillStyle = st.colour;
    ctx.lineWidth = 2 * st.radius;
    ctx.lineCap = ctx.lineJoin = "round";
    ctx.beginPath();
    ctx.moveTo(a.x + 0.5, a.y + 0.5);
    ctx.lineTo(b.x + 0.5 + (a === b ? 0.01 : 0), b.y + 0.5);
    ctx.stroke();
    ctx.restore();
  }

  function startStroke(e) {
    const classes = state() ? state().classes : [];
    if (!classes.length) { status("add a class first (Classes panel on the left)", "error"); return false; }
    const erase = $("eraser").getAttribute("aria-pressed") === "true";
    const cls = window.app.classValue;
    if (!erase && !classes.some((c) => c.value === cls)) { status("pick a class first", "error"); return false; }
    const p = toSlice(e.clientX, e.clientY);
    V.drawing = { pointerId: e.pointerId, view: V.view, index: V.index[V.view], erase, radius: Number($("brush-size").value),
      cls: erase ? classes[0].value : cls, colour: classColour(cls), points: [p] };
    paint(p, p, V.drawing);
    return true;
  }

  function extendStroke(events) {
    const st = V.drawing, minStep = Math.max(0.5, st.radius / 4);
    for (const ev of events) {
      const p = toSlice(ev.clientX, ev.clientY), last = st.points[st.points.length - 1];
      if (Math.hypot(p.x - last.x, p.y - last.y) < minStep) continue;
      paint(last, p, st);
      st.points.push(p);
    }
  }

  function finishStroke(e) {
    const st = V.drawing, id = V.id;
    V.drawing = null;
    if (!st) return;
    if (e) { V.drawing = st; extendStroke([e]); V.drawing = null; }
    const round2 = (v) => Math.round(v * 100) / 100;
    const body = { view: st.view, index: st.index, class: st.cls, radius: st.radius, erase: st.erase,
      points: st.points.map((p) => [round2(p.x), round2(p.y)]) };
    V.pendingStrokes++;
    V.strokeQueue = V.strokeQueue.then(async () => {
      try {
        const r = await (await send("POST", `/api/volumes/${enc(id)}/strokes`, body)).json();
        const record = volumeRecord(id);
        if (record) { record.version = r.version; record.labelled = r.labelled; }
        renderList();
      } catch (err) {
        status(`stroke not saved: ${err.message}`, "error");
      } finally {
        V.pendingStrokes--;
      }
      if (!V.pendingStrokes && id === V.id) reloadLabels();
    });
  }

  async function undoRedo(which) {
    await V.strokeQueue;
    try {
      const r = await (await send("POST", `/api/volumes/${enc(V.id)}/${which}`, { version: (volumeRecord(V.id) || {}).version })).json();
      const record = volumeRecord(V.id);
      if (record) { record.version = r.version; record.labelled = r.labelled; }
      renderList();
      reloadLabels();
    } catch (err) {
      status(err.message, "error");
    }
  }

  // ---------------------------------------------------------------- train and save
  async function train() {
    const t0 = performance.now();
    await V.strokeQueue;
    status("training on the volumes' labels…");
    $("train").disabled = true;
    try {
      const answer = await (await send("POST", "/api/volumes/train")).json();
      if (state()) state().volume_model = answer.model;
      const voxels = Object.values(answer.model.voxels).reduce((a, b) => a + b, 0);
      status(`trained on ${voxels} labelled voxels in ${answer.model.seconds} s`);
      window.app.renderModel();   // the Train panel names the volume model (app.js keeps it so on every state poll)
      timing("volume_train", performance.now() - t0);
      if (V.id) await showOverlay(t0, "volume_train_overlay");
    } catch (err) {
      status(`not trained: ${err.message}`, "error");
    } finally {
      $("train").disabled = false;
    }
  }

  // A volume's Save is a background job (as a 2D Save): progress in the Save panel, Cancel stops it,
  // and slices and overlays are shown meanwhile.
  async function save() {
    const what = ["labels", "model", "masks"].filter((w) => $(`save-${w}`).checked);
    if (!what.length) { status("tick labels, model or masks to save a volume", "error"); return; }
    if (window.app.saving) { status("a Save is running: wait for it, or cancel it", "error"); return; }
    const id = V.id;
    let job;
    try {
      await V.strokeQueue;
      job = (await (await send("POST", `/api/volumes/${enc(id)}/save`, { what })).json()).job;
    } catch (err) {
      status(`not saved: ${err.message}`, "error");
      return;
    }
    status(`saving ${what.join(", ")} of ${id}…`, "busy");
    const j = await window.app.followSave(job, " steps");
    $("save-message").textContent = j.message || "";
    if (j.state === "done") status(`saved ${what.join(", ")} of ${id}`, "ok");
    else if (j.state === "cancelled") status("save cancelled");
    else status(`not saved: ${j.message || "unknown error"}`, "error");
  }

  // ---------------------------------------------------------------- events
  function bind() {
    area.addEventListener("pointerdown", (e) => {
      $("volume-view").focus({ preventScroll: true });
      if (e.button !== 0 || V.drawing) return;
      e.preventDefault();   // a press on the slice starts no text selection, stroke or not
      if (V.shown && startStroke(e)) area.setPointerCapture(e.pointerId);
    });
    document.addEventListener("selectstart", (e) => { if (V.drawing) e.preventDefault(); });
    area.addEventListener("pointermove", (e) => {
      if (V.drawing && e.pointerId === V.drawing.pointerId) extendStroke(e.getCoalescedEvents ? e.getCoalescedEvents() : [e]);
    });
    const end = (e) => {
      if (V.drawing && e.pointerId === V.drawing.pointerId) finishStroke(e.type === "pointerup" ? e : null);
      if (area.hasPointerCapture(e.pointerId)) area.releasePointerCapture(e.pointerId);
    };
    area.addEventListener("pointerup", end);
    area.addEventListener("pointercancel", end);
    area.addEventListener("contextmenu", (e) => e.preventDefault());
    new ResizeObserver(fit).observe(area);
    $("volume-slider").addEventListener("input", () => {
      V.index[V.view] = Number($("volume-slider").value);
      showSlice();
    });
    document.querySelectorAll("#volume-bar [data-view]").forEach((b) =>
      b.addEventListener("click", () => setView(b.dataset.view)));
    $("show-overlay").addEventListener("change", () => { canvases.overlay.hidden = !$("show-overlay").checked; });
    $("overlay-opacity").addEventListener("input", () => { canvases.overlay.style.opacity = $("overlay-opacity").value / 100; });
    $("label-opacity").addEventListener("input", () => { canvases.labels.style.opacity = $("label-opacity").value / 100; });
    $("show-labels").addEventListener("change", () => { canvases.labels.hidden = !$("show-labels").checked; });

    // While a volume is shown, the page's Train, Predict, Save, Undo and Redo act on it: caught
    // before app.js's handlers (capture phase on the document). A 2D image's row leaves the mode.
    const routes = { train: () => train(), predict: () => showOverlay(performance.now()), save: () => save(),
      undo: () => undoRedo("undo"), redo: () => undoRedo("redo"),
      "predict-all": () => status("Predict all is for 2D images; Save writes a volume's mask", "error") };
    document.addEventListener("click", (e) => {
      const row = e.target.closest && e.target.closest("#image-list .image-row");
      if (row) { leave(); return; }
      const button = e.target.closest && e.target.closest("button");
      if (!V.id) return;
      if (button && routes[button.id]) {
        e.preventDefault();
        e.stopImmediatePropagation();
        routes[button.id]();
      }
    }, true);

    const typing = (t) => t && (t.isContentEditable || t.tagName === "TEXTAREA" || t.tagName === "SELECT" ||
      (t.tagName === "INPUT" && !["checkbox", "radio", "range", "color", "button", "file"].includes(t.type)));
    document.addEventListener("keydown", (e) => {
      if (!V.id || typing(e.target) || e.altKey) return;
      const t0 = performance.now(), k = e.key;
      let handled = true;
      if (e.ctrlKey || e.metaKey) {
        if (k === "z" || k === "Z") undoRedo(e.shiftKey ? "redo" : "undo");
        else if (k === "y" || k === "Y") undoRedo("redo");
        else handled = false;
      } else {
        switch (k) {
          case "ArrowUp": case "ArrowRight": step(1, t0); break;
          case "ArrowDown": case "ArrowLeft": step(-1, t0); break;
          case "PageUp": step(10, t0); break;
          case "PageDown": step(-10, t0); break;
          case "Home": step(-Infinity, t0); break;
          case "End": step(Infinity, t0); break;
          case "v": case "V": setView(VIEWS[(VIEWS.indexOf(V.view) + 1) % 3], t0); break;
          case "t": case "T": train(); break;
          case "p": case "P": showOverlay(t0); break;
          case "0": case "+": case "=": case "-": case "_": case "u": case "U": case " ": break;  // 2D viewer keys
          default: handled = false;
        }
      }
      if (handled) { e.preventDefault(); e.stopImmediatePropagation(); }
    }, true);
    setInterval(renderList, LIST_POLL_MS);
  }

  bind();
})();
