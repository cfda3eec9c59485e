// alibi-vit app: the browser side of the interactive trainable segmentation (see API.md beside
// this folder). Plain ES2020, no framework, nothing fetched but the app's own server.
"use strict";

(() => {
  // ---------------------------------------------------------------- basics
  const $ = (id) => document.getElementById(id);
  const TOKEN = new URLSearchParams(location.search).get("token");
  const POLL_MS = 500;          // /api/state while features are computed somewhere
  const POLL_SHOWN_MS = 250;    // ... while the shown image's features are computed
  const POLL_IDLE_MS = 3000;    // ... otherwise: another tab's strokes show up without a click
  const MAX_SCALE = 64;

  // Timings read by the tests and benchmarks/bench_app.py: {event, ms, ...} measured with performance.now().
  window.appTimings = [];
  function timing(event, ms, extra = {}) {
    window.appTimings.push({ event, ms: Math.round(ms * 10) / 10, ...extra });
  }

  class ApiError extends Error {
    constructor(status, detail) {
      super(detail);
      this.status = status;
    }
  }

  async function errorDetail(res) {
    try {
      const body = await res.json();
      if (body && body.detail !== undefined) {
        return typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
      }
    } catch (_) { /* not JSON */ }
    return `${res.status} ${res.statusText || "error"}`;
  }

  // Every request carries the token (X-Token); JSON in, JSON out; a 4xx/5xx throws ApiError(detail),
  // an aborted one (``signal``: the user moved on) ApiError with status ABORTED.
  const ABORTED = -1;
  async function request(method, path, { json, raw, signal } = {}) {
    const headers = {};
    if (TOKEN) headers["X-Token"] = TOKEN;
    let body;
    if (raw !== undefined) {
      body = raw;
      headers["Content-Type"] = "application/octet-stream";
    } else if (json !== undefined) {
      body = JSON.stringify(json);
      headers["Content-Type"] = "application/json";
    }
    let res;
    try {
      res = await fetch(path, { method, headers, body, cache: "no-store", signal });
    } catch (err) {
      if (err && err.name === "AbortError") throw new ApiError(ABORTED, "aborted");
      throw new ApiError(0, "the server does not answer: is alibi-vit app still running?");
    }
    if (!res.ok) throw new ApiError(res.status, await errorDetail(res));
    return res;
  }

  async function api(method, path, json, signal) {
    const res = await request(method, path, { json, signal });
    const text = await res.text();
    return text ? JSON.parse(text) : null;
  }

  // PNGs come as blobs (so the token header goes with them) and are decoded off the main thread;
  // returns [bitmap, response headers] (the server says there which label version or model it shows).
  async function fetchBitmap(path, data = false, signal = undefined) {
    const res = await request("GET", path, { signal });
    const blob = await res.blob();
    // Label values are data: no colour management may touch them.
    const options = data ? { colorSpaceConversion: "none", premultiplyAlpha: "none" } : {};
    return [await createImageBitmap(blob, options), res.headers];
  }

  const nextFrame = () => new Promise((resolve) => requestAnimationFrame(() => resolve()));
  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
  const enc = encodeURIComponent;
  const clamp = (v, lo, hi) => Math.min(hi, Math.max(lo, v));

  function hexToRgb(hex) {
    const m = /^#?([0-9a-f]{6})$/i.exec(hex || "");
    const n = m ? parseInt(m[1], 16) : 0x888888;
    return [(n >> 16) & 255, (n >> 8) & 255, n & 255];
  }

  function formatCount(n) {
    if (n >= 1e6) return `${(n / 1e6).toFixed(1)}M`;
    if (n >= 1e4) return `${Math.round(n / 1e3)}k`;
    if (n >= 1e3) return `${(n / 1e3).toFixed(1)}k`;
    return String(n);
  }

  // ---------------------------------------------------------------- state
  const S = {
    state: null,              // the last GET /api/state
    current: null,            // id of the shown image
    classValue: null,         // selected class value
    erase: false,
    live: false,
    showOverlay: true,
    showUncertainty: false,
    showLabels: true,
    view: { scale: 1, tx: 0, ty: 0 },
    fitted: true,             // the view is "fit": refit when the window changes size
    imgW: 0,
    imgH: 0,
    levels: [],               // [width, height] of each display level of the shown image
    labelsLoading: false,     // label tiles are being fetched again
    overlayPredicted: null,   // the share of the image predicted when the overlay was last fetched
    trainedAt: null,          // performance.now() of the last Train click
    labelsVersion: null,
    overlayShown: false,      // a prediction/uncertainty of the shown image is on the overlay layer
    overlayModel: null,       // ... of this model id
    overlayCrf: null,         // ... with or without the CRF
    predictJob: null,         // the Predict-all job being followed
    loadSeq: 0,               // bumps on every image switch: stale loads do not draw
    leave: new AbortController(),  // aborts the shown image's prediction requests when another is shown
    drawing: null,            // the stroke under the pointer
    pendingStrokes: 0,        // strokes sent and not answered
    strokeQueue: Promise.resolve(),
    pan: null,
    spaceDown: false,
    training: false,
    trainAgain: false,
    liveStrokeT0: null,       // pointer-up time of the first stroke not yet shown in a prediction
    openedAt: new Map(),      // image id → performance.now() of its first open in this page
    clickedAt: new Map(),     // ... and of the click that led to it
    featuresReported: new Set(),
    pollTimer: null,
    saveJob: null,
    pointer: null,            // last pointer position over the canvas area (area px)
    stateSeq: 0,              // GET /api/state requests sent ...
    stateApplied: 0,          // ... and the latest one shown (older answers are dropped)
    settingsGen: 0,           // bumps when the page changes a setting
    settingsInFlight: 0,      // PUT /api/settings not answered yet
  };
  window.app = {   // read-only peek for tests and debugging
    get state() { return S.state; },
    get current() { return S.current; },
    get classValue() { return S.classValue; },
    get view() { return { ...S.view }; },
    get training() { return S.training; },
    // The label tiles in view are drawn, up to date, and no stroke is on its way.
    get labelsShown() { return layers.labels.settled() && !S.labelsLoading && S.labelsVersion !== null && !S.drawing && !S.pendingStrokes; },
    get imageWidth() { return S.imgW; },
    get imageHeight() { return S.imgH; },
    get level() { return layers.image.level; },
    // Image pixels [top, left, bottom, right] in view (what Train and Predict send as the region).
    get region() { return viewRegion(); },
    get pendingStrokes() { return S.pendingStrokes + (S.drawing ? 1 : 0); },
    get overlayShown() { return S.overlayShown; },
    get labelsVersion() { return S.labelsVersion; },
    get overlayStale() { return !$("overlay-stale").hidden; },
    renderFractions: (p) => renderFractions(p),   // the volume mode's slice fractions (volume.js)
    renderModel: () => { if (S.state) renderModel(); },   // the Train panel, on entering or leaving the volume mode
    // For the volume mode (volume.js): the same requests (token, errors as ApiError) and status line.
    request: (method, path, json, signal) => request(method, path, { json, signal }),
    aborted: (err) => err instanceof ApiError && err.status === ABORTED,
    status: (text, kind) => status(text, kind),
    followSave: (job, unit) => followSave(job, unit),   // a volume's Save job (volume.js)
    get saving() { return S.saveJob !== null; },
  };

  const imageById = (id) => (S.state ? S.state.images.find((im) => im.id === id) : undefined);
  const classByValue = (v) => (S.state ? S.state.classes.find((c) => c.value === v) : undefined);

  // ---------------------------------------------------------------- status line
  let statusTimer = null;
  function status(text, kind = "") {
    const el = $("status");
    el.textContent = text;
    el.className = kind;
    el.title = text;
    clearTimeout(statusTimer);
    if (kind === "ok") statusTimer = setTimeout(() => { if (el.textContent === text) { el.textContent = ""; el.className = ""; } }, 6000);
  }
  function showError(err, prefix = "") {
    if (err instanceof ApiError && err.status === ABORTED) return;   // the user moved on: not an error
    const msg = err instanceof Error ? err.message : String(err);
    status(prefix + msg, "error");
    console.warn(prefix + msg);
  }

  // ---------------------------------------------------------------- elements
  const area = $("canvas-area");
  const stage = $("stage");
  const imageLayer = $("image-layer");
  const labelLayer = $("label-layer");
  const overlayLayer = $("overlay-layer");
  const brushCursor = $("brush-cursor");

  // ---------------------------------------------------------------- tiled layers
  // The page never holds a whole image. Each layer (the image, the labels, the prediction overlay)
  // is a <div> in the stage holding tiles of the display level that matches the zoom: canvases of
  // TILE² px of their level, placed in image pixels (level 0), so the stage's transform zooms and
  // pans them all. Level L + 1 halves level L (sizes rounded up), as on the server. Tiles of
  // another level stay on screen under the new ones until those have all arrived.
  let TILE = 512;           // the server's (state.tile)
  const MAX_INFLIGHT = 6;   // tile requests in flight per layer
  const KEEP_TILES = 160;   // tiles a layer keeps off screen (panning back shows them at once)

  function levelShapes(w, h) {
    const shapes = [[w, h]];
    while (Math.max(...shapes[shapes.length - 1]) > TILE) {
      const [lw, lh] = shapes[shapes.length - 1];
      shapes.push([Math.ceil(lw / 2), Math.ceil(lh / 2)]);
    }
    return shapes;
  }

  // The display level for a zoom: the coarsest whose pixels are no larger than a screen pixel.
  function levelFor(scale) {
    return clamp(Math.floor(Math.log2(1 / scale) + 1e-9), 0, S.levels.length - 1);
  }

  // The part of the image in view, in image pixels, clipped to it: [x0, y0, x1, y1].
  function visibleRect() {
    const { scale, tx, ty } = S.view;
    return [clamp(-tx / scale, 0, S.imgW), clamp(-ty / scale, 0, S.imgH),
      clamp((area.clientWidth - tx) / scale, 0, S.imgW), clamp((area.clientHeight - ty) / scale, 0, S.imgH)];
  }

  class TileLayer {
    // kind: "image" (8-bit pixels), "labels" or "prediction" (class values, coloured here), "uncertainty".
    constructor(el, kind) {
      this.el = el;
      this.kind = kind;
      this.tiles = new Map();     // "level/row/col" → {level, r, c, canvas, loaded, stale, loading, values, alpha}
      this.queue = [];
      this.inflight = 0;
      this.waiters = [];
      this.abort = new AbortController();
      this.version = null;        // labels: the newest X-Labels-Version drawn
      this.model = null;          // prediction: X-Model and X-CRF of the tiles drawn
      this.crf = null;
      this.onTile = null;         // called with (tile, headers) after a tile is drawn
      this.active = kind !== "prediction";   // the overlay's tiles are fetched once there is a prediction
    }

    url(t) {
      return `/api/images/${enc(S.current)}/tiles/${this.kind}/${t.level}/${t.r}/${t.c}.png`;
    }

    // Level-0 pixels per level pixel of ``level`` (about 2^level; exactly what places its tiles).
    scales(level) {
      const [lw, lh] = S.levels[level];
      return [S.imgW / lw, S.imgH / lh];
    }

    reset(kind = this.kind) {
      this.abort.abort();
      this.abort = new AbortController();
      this.kind = kind;
      for (const t of this.tiles.values()) t.canvas.remove();
      this.tiles.clear();
      this.queue = [];
      this.inflight = 0;
      this.version = this.model = this.crf = null;
      this.settle(false);
    }

    // The tiles the view needs: [level, keys in order from the centre of the view outwards].
    wanted() {
      const level = levelFor(S.view.scale);
      const [lw, lh] = S.levels[level];
      const [sx, sy] = this.scales(level);
      const [x0, y0, x1, y1] = visibleRect();
      const c0 = Math.floor(x0 / sx / TILE), c1 = Math.min(Math.ceil(x1 / sx / TILE), Math.ceil(lw / TILE));
      const r0 = Math.floor(y0 / sy / TILE), r1 = Math.min(Math.ceil(y1 / sy / TILE), Math.ceil(lh / TILE));
      const keys = [];
      for (let r = r0; r < r1; r++) for (let c = c0; c < c1; c++) keys.push([r, c]);
      const mr = (r0 + r1 - 1) / 2, mc = (c0 + c1 - 1) / 2;
      keys.sort((a, b) => Math.hypot(a[0] - mr, a[1] - mc) - Math.hypot(b[0] - mr, b[1] - mc));
      return [level, keys.map(([r, c]) => `${level}/${r}/${c}`)];
    }

    tile(key) {
      let t = this.tiles.get(key);
      if (!t) {
        const [level, r, c] = key.split("/").map(Number);
        const [lw, lh] = S.levels[level];
        const [sx, sy] = this.scales(level);
        const canvas = document.createElement("canvas");
        canvas.width = Math.min(TILE, lw - c * TILE);
        canvas.height = Math.min(TILE, lh - r * TILE);
        canvas.dataset.level = String(level);
        canvas.dataset.key = key;
        canvas.style.left = `${c * TILE * sx}px`;
        canvas.style.top = `${r * TILE * sy}px`;
        canvas.style.width = `${canvas.width * sx}px`;
        canvas.style.height = `${canvas.height * sy}px`;
        canvas.style.zIndex = String(64 - level);   // finer levels on top
        t = { key, level, r, c, canvas, loaded: false, stale: true, loading: false, values: null, alpha: null };
        this.tiles.set(key, t);
        this.el.appendChild(canvas);
      }
      return t;
    }

    // Labels are not fetched while a stroke is drawn or on its way: the answer would wipe it off the
    // screen (the stroke's answer refreshes them).
    busy() {
      return this.kind === "labels" && (!!S.drawing || S.pendingStrokes > 0);
    }

    // Request what the view needs (nothing while the layer is hidden), and drop what it no longer does.
    update() {
      if (!S.current || !S.levels.length || !this.active) return;
      const [level, keys] = this.wanted();
      this.level = level;
      this.wantedKeys = new Set(keys);
      for (const key of keys) {
        const t = this.tile(key);
        if (t.stale && !t.loading && !this.busy() && !this.queue.includes(t)) this.queue.push(t);
      }
      this.queue.sort((a, b) => keys.indexOf(a.key) - keys.indexOf(b.key));
      this.pump();
      this.prune();
      this.checkSettled();
    }

    // Tiles shown are out of date (new labels, more of the prediction): those in view are fetched
    // again (each stays on screen until its new version arrives); the others are dropped.
    refresh() {
      for (const t of [...this.tiles.values()]) {
        if (this.wantedKeys && this.wantedKeys.has(t.key)) t.stale = true;
        else this.drop(t);
      }
      this.update();
    }

    drop(t) {
      t.canvas.remove();
      this.tiles.delete(t.key);
      const i = this.queue.indexOf(t);
      if (i >= 0) this.queue.splice(i, 1);
    }

    prune() {
      const inView = [...this.wantedKeys].every((k) => { const t = this.tiles.get(k); return t && t.loaded; });
      const extra = [...this.tiles.values()].filter((t) => !this.wantedKeys.has(t.key) && !t.loading);
      for (const t of extra) {
        // other levels go once this level's tiles are all drawn; this level's beyond KEEP_TILES
        if (t.level !== this.level ? inView : this.tiles.size > KEEP_TILES) this.drop(t);
      }
    }

    pump() {
      while (this.inflight < MAX_INFLIGHT && this.queue.length) {
        const t = this.queue.shift();
        if (this.tiles.get(t.key) !== t) continue;
        this.load(t);
      }
    }

    async load(t) {
      const image = S.current, signal = this.abort.signal;
      t.loading = true;
      t.stale = false;
      this.inflight++;
      try {
        const res = await request("GET", this.url(t), { signal });
        const blob = await res.blob();
        const data = this.kind !== "image";
        const bitmap = await createImageBitmap(blob, data ? { colorSpaceConversion: "none", premultiplyAlpha: "none" } : {});
        if (signal.aborted || image !== S.current || this.tiles.get(t.key) !== t) { bitmap.close(); return; }
        if (this.busy()) { bitmap.close(); t.stale = true; return; }
        this.draw(t, bitmap, res.headers);
        t.loaded = true;
        if (this.onTile) this.onTile(t, res.headers);
      } catch (err) {
        if (err instanceof ApiError && (err.status === ABORTED || err.status === 409)) {
          if (err.status === 409) t.loaded = true;   // nothing predicted yet: an empty tile
        } else {
          t.loaded = true;
          showError(err, `tile ${t.key}: `);
        }
      } finally {
        t.loading = false;
        this.inflight--;
        if (!signal.aborted) {
          if (t.stale && !this.busy() && this.tiles.get(t.key) === t) this.queue.unshift(t);   // refreshed meanwhile
          this.pump();
          if (this.wantedKeys) this.prune();
          this.checkSettled();
        }
      }
    }

    draw(t, bitmap, headers) {
      const ctx = t.canvas.getContext("2d", { willReadFrequently: this.kind !== "image" });
      const w = t.canvas.width, h = t.canvas.height;
      if (this.kind === "image") {
        ctx.clearRect(0, 0, w, h);
        ctx.drawImage(bitmap, 0, 0);
        bitmap.close();
        return;
      }
      if (this.kind === "labels") {
        const version = Number(headers.get("X-Labels-Version"));
        if (this.version !== null && version < this.version) { bitmap.close(); t.stale = true; return; }   // overtaken
        this.version = version;
      } else {
        this.model = Number(headers.get("X-Model"));
        this.crf = headers.get("X-CRF") === "true";
      }
      const scratch = new OffscreenCanvas(w, h);
      const sctx = scratch.getContext("2d", { willReadFrequently: true });
      sctx.drawImage(bitmap, 0, 0);
      bitmap.close();
      const rgba = sctx.getImageData(0, 0, w, h).data;
      t.values = new Uint8Array(w * h);
      t.alpha = this.kind === "uncertainty" ? new Uint8Array(w * h) : null;
      for (let i = 0, j = 0; i < t.values.length; i++, j += 4) {
        t.values[i] = rgba[j];   // grey PNG: R = G = B = value
        if (t.alpha) t.alpha[i] = rgba[j + 3];
      }
      this.paintTile(t);
    }

    // Colour a tile's values: class colours (labels, prediction; 0 transparent) or the uncertainty scale.
    paintTile(t) {
      if (!t.values) return;
      const w = t.canvas.width, h = t.canvas.height;
      const out = new ImageData(w, h);
      const px = new Uint32Array(out.data.buffer);
      const v = t.values;
      if (this.kind === "uncertainty") {
        for (let i = 0; i < v.length; i++) if (t.alpha[i]) px[i] = uncertaintyLut[v[i]];
      } else {
        const lut = colourTable();
        for (let i = 0; i < v.length; i++) if (v[i]) px[i] = lut[v[i]];
      }
      t.canvas.getContext("2d").putImageData(out, 0, 0);
    }

    recolour() {
      for (const t of this.tiles.values()) this.paintTile(t);
    }

    // The value under image pixel (x, y) on the tiles of the level in view (null when not loaded).
    valueAt(x, y) {
      if (this.level === undefined) return null;
      const [sx, sy] = this.scales(this.level);
      const lx = Math.floor(x / sx), ly = Math.floor(y / sy);
      const t = this.tiles.get(`${this.level}/${Math.floor(ly / TILE)}/${Math.floor(lx / TILE)}`);
      if (!t || !t.values) return null;
      return t.values[(ly - t.r * TILE) * t.canvas.width + (lx - t.c * TILE)];
    }

    // Paint a stroke segment (image px) on the tiles of the level in view, until the server's labels replace it.
    paint(a, b, stroke) {
      if (this.level === undefined) return;
      const [sx, sy] = this.scales(this.level);
      const pad = stroke.radius + 1;
      const bx0 = Math.min(a.x, b.x) - pad, bx1 = Math.max(a.x, b.x) + pad;
      const by0 = Math.min(a.y, b.y) - pad, by1 = Math.max(a.y, b.y) + pad;
      for (const t of this.tiles.values()) {
        if (t.level !== this.level) continue;
        const x0 = t.c * TILE * sx, y0 = t.r * TILE * sy;
        if (bx1 < x0 || by1 < y0 || bx0 > x0 + t.canvas.width * sx || by0 > y0 + t.canvas.height * sy) continue;
        const ctx = t.canvas.getContext("2d");
        ctx.save();
        ctx.setTransform(1 / sx, 0, 0, 1 / sy, -x0 / sx, -y0 / sy);
        ctx.globalCompositeOperation = stroke.erase ? "destination-out" : "source-over";
        ctx.strokeStyle = ctx.fillStyle = stroke.erase ? "#000" : stroke.colour;
        ctx.lineCap = "round";
        ctx.lineJoin = "round";
        ctx.lineWidth = 2 * stroke.radius + 1;
        ctx.beginPath();
        if (a === b) {
          ctx.arc(a.x + 0.5, a.y + 0.5, stroke.radius + 0.5, 0, 2 * Math.PI);
          ctx.fill();
        } else {
          ctx.moveTo(a.x + 0.5, a.y + 0.5);
          ctx.lineTo(b.x + 0.5, b.y + 0.5);
          ctx.stroke();
        }
        ctx.restore();
      }
    }

    settled() {
      if (!this.wantedKeys) return false;
      for (const key of this.wantedKeys) {
        const t = this.tiles.get(key);
        if (!t || !t.loaded || t.stale || t.loading) return false;
      }
      return true;
    }

    checkSettled() {
      if (this.waiters.length && this.settled()) this.settle(true);
    }

    settle(value) {
      const waiters = this.waiters;
      this.waiters = [];
      for (const resolve of waiters) resolve(value);
    }

    // Resolves (true) once every tile the view needs is drawn and up to date; false when the layer is reset first.
    whenSettled() {
      return new Promise((resolve) => {
        this.waiters.push(resolve);
        this.update();
      });
    }
  }

  const layers = {
    image: new TileLayer(imageLayer, "image"),
    labels: new TileLayer(labelLayer, "labels"),
    overlay: new TileLayer(overlayLayer, "prediction"),
  };

  function updateLayers() {
    for (const layer of Object.values(layers)) layer.update();
  }

  // ---------------------------------------------------------------- state polling and rendering
  async function refreshState() {
    const seq = ++S.stateSeq, settingsGen = S.settingsGen;
    let state;
    try {
      state = await api("GET", "/api/state");
    } catch (err) {
      showError(err);
      schedulePoll(2000);
      return null;
    }
    if (seq < S.stateApplied) return S.state;   // a newer answer is shown already
    S.stateApplied = seq;
    // Settings changed in the page since this request left: the page's controls are newer.
    if ((settingsGen !== S.settingsGen || S.settingsInFlight) && S.state) state.settings = S.state.settings;
    S.state = state;
    if (state.tile) TILE = state.tile;
    render();
    checkFeatures();
    const shown = imageById(S.current);
    if (shown && S.labelsVersion !== null && shown.version !== S.labelsVersion && !S.drawing && !S.pendingStrokes
        && !S.labelsLoading) {
      loadLabels(S.current);   // changed elsewhere (another tab, undo from the API)
    }
    followPrediction(shown);
    const running = state.images.some((im) => im.features === "running");
    const shownWaiting = shown && (shown.features === "running" || shown.features === "pending") && S.openedAt.has(shown.id);
    if (shownWaiting) schedulePoll(POLL_SHOWN_MS);
    else if (running) schedulePoll(POLL_MS);
    return state;
  }

  function schedulePoll(ms) {
    if (S.pollTimer) return;
    S.pollTimer = setTimeout(() => { S.pollTimer = null; refreshState(); }, ms);
  }

  function checkFeatures() {
    const im = imageById(S.current);
    if (!im) return;
    if (im.features === "ready" && S.openedAt.has(im.id) && !S.featuresReported.has(im.id)) {
      S.featuresReported.add(im.id);
      const now = performance.now();
      timing("features_ready", now - S.openedAt.get(im.id), { image: im.id, since_click_ms: Math.round(now - S.clickedAt.get(im.id)) });
    }
    if (im.features === "error" && !S.featuresReported.has(im.id)) {
      S.featuresReported.add(im.id);
      status(`features of ${im.name} failed: ${im.error || "unknown error"}`, "error");
    }
  }

  function render() {
    renderHeader();
    renderImages();
    renderNotes();
    renderClasses();
    renderSettings();
    renderModel();
    renderFeaturesInfo();
    updateStale();
  }

  // What the server could not do with files given (skipped at start) or at start-up: shown until it restarts.
  function renderNotes() {
    const notes = S.state.notes || [];
    const box = $("notes"), list = box.querySelector("ul");
    box.hidden = !notes.length;
    box.querySelector("summary").textContent = `⚠ ${notes.length} note${notes.length === 1 ? "" : "s"} from the server (files not added…)`;
    if (list.children.length === notes.length) return;
    list.innerHTML = "";
    for (const n of notes) {
      const li = document.createElement("li");
      li.textContent = n;
      list.appendChild(li);
    }
  }

  // The overlay says when it no longer matches the model, the CRF switch or the labels.
  function updateStale() {
    const el = $("overlay-stale");
    const m = S.state && S.state.model;
    const im = imageById(S.current);
    // A big image is shown without the CRF (it looks past the blocks predicted first): Save applies it.
    const crf = !!(S.state && S.state.settings && S.state.settings.crf) && !(im && im.chunked);
    let why = null;
    if (S.overlayShown && S.showOverlay) {
      if (!m) why = "its model belongs to other settings";
      else if (S.overlayModel !== m.id) why = `model #${m.id} is newer than this overlay (#${S.overlayModel}): press P to predict`;
      else if (S.overlayCrf !== crf) why = `CRF switched ${crf ? "on" : "off"} since it was computed: press P to predict`;
      else if (m.labels_changed) why = `labels changed since model #${m.id} was trained: press T to train`;
    }
    if (why && S.training) why += " (training…)";
    el.hidden = !why;
    el.textContent = why ? `Stale overlay: ${why}` : "";
    overlayLayer.dataset.stale = why ? "true" : "false";
    $("uncertainty-legend").hidden = !(S.overlayShown && S.showOverlay && overlayLayer.dataset.kind === "uncertainty");
  }

  function renderHeader() {
    $("session-path").textContent = S.state.session || "";
    $("session-path").title = `session folder: ${S.state.session || ""}`;
  }

  function featureText(im) {
    switch (im.features) {
      case "ready": return "features ready";
      case "on demand": return "features on demand";
      case "running": return `features ${Math.round((im.progress || 0) * 100)} %`;
      case "error": return "features failed";
      default: return S.openedAt.has(im.id) ? "features queued" : "not opened";
    }
  }

  function renderImages() {
    const list = $("image-list");
    const images = S.state.images;
    $("no-images").hidden = images.length > 0 || (S.state.volumes || []).length > 0;
    const rows = new Map([...list.children].map((li) => [li.dataset.id, li]));
    images.forEach((im, i) => {
      let li = rows.get(im.id);
      if (!li) {
        li = document.createElement("li");
        li.className = "image-row";
        li.dataset.id = im.id;
        li.dataset.testid = `image-${im.id}`;
        li.innerHTML = '<span class="name"><span class="file"></span><span class="page"></span></span><span class="meta"><span class="size"></span><span class="features"></span></span><span class="bar"><span></span></span><span class="fractions"></span>';
        li.addEventListener("click", () => selectImage(im.id));
      }
      rows.delete(im.id);
      if (list.children[i] !== li) list.insertBefore(li, list.children[i] || null);
      li.classList.toggle("selected", im.id === S.current);
      li.setAttribute("aria-selected", im.id === S.current ? "true" : "false");
      li.dataset.features = im.features;
      const labelled = Object.values(im.labelled || {}).reduce((a, b) => a + b, 0);
      li.querySelector(".file").textContent = im.file || im.name;
      li.querySelector(".page").textContent = im.page === null || im.page === undefined ? "" : `[page ${im.page}]`;
      li.title = `${im.name} (${im.id}, ${im.kind || "?"})${im.error ? `: ${im.error}` : ""}${im.note ? `: ${im.note}` : ""}`;
      renderImageFractions(li.querySelector(".fractions"), im);
      const size = `${im.width}×${im.height}` + (labelled ? ` · ${formatCount(labelled)} px` : "");
      li.querySelector(".size").textContent = size;
      li.querySelector(".features").textContent = featureText(im);
      const p = im.features === "ready" ? 1 : im.features === "running" ? (im.progress || 0) : 0;
      li.querySelector(".bar > span").style.width = `${Math.round(p * 100)}%`;
    });
    rows.forEach((li) => li.remove());
  }

  // A thin bar of the image's predicted area fractions (after Predict all, or once shown), dimmed when stale.
  function renderImageFractions(bar, im) {
    const p = im.prediction;
    const m = S.state.model;
    if (!p || !p.fractions) { bar.hidden = true; return; }
    bar.hidden = false;
    const stale = !m || p.model !== m.id || p.crf !== !!(S.state.settings || {}).crf;
    bar.classList.toggle("stale", stale);
    const key = JSON.stringify([p.model, p.fractions, S.state.classes]);
    if (bar.dataset.key === key) return;
    bar.dataset.key = key;
    bar.innerHTML = "";
    const parts = [];
    for (const [v, f] of Object.entries(p.fractions)) {
      const c = classByValue(Number(v));
      const seg = document.createElement("span");
      seg.style.width = `${(100 * f).toFixed(2)}%`;
      seg.style.background = c ? c.color : "#888888";
      bar.appendChild(seg);
      parts.push(`${c ? c.name : `class ${v}`} ${(100 * f).toFixed(1)} %`);
    }
    bar.title = `model #${p.model}${stale ? " (stale)" : ""}: ${parts.join(", ")}`;
  }

  function renderClasses() {
    const list = $("class-list");
    const classes = S.state.classes;
    if (S.classValue !== null && !classByValue(S.classValue)) S.classValue = null;
    if (S.classValue === null && classes.length) S.classValue = classes[0].value;
    const counts = (imageById(S.current) || {}).labelled || {};
    const rows = new Map([...list.children].map((li) => [Number(li.dataset.value), li]));
    classes.forEach((c, i) => {
      let li = rows.get(c.value);
      if (!li) {
        li = document.createElement("li");
        li.className = "class-row";
        li.dataset.value = String(c.value);
        li.dataset.testid = `class-${c.value}`;
        li.innerHTML = '<span class="key"></span><input type="color" title="class colour"><span class="name" title="double-click to rename"></span><span class="count"></span><button type="button" class="edit" title="rename">✎</button>';
        li.addEventListener("click", (e) => {
          if (e.target.closest("input, button")) return;
          selectClass(c.value);
        });
        const colour = li.querySelector("input[type=color]");
        colour.addEventListener("input", () => previewColour(c.value, colour.value));
        colour.addEventListener("change", () => patchClass(c.value, { color: colour.value }));
        colour.addEventListener("click", () => selectClass(c.value));
        li.querySelector(".name").addEventListener("dblclick", () => startRename(c.value));
        li.querySelector(".edit").addEventListener("click", () => startRename(c.value));
      }
      rows.delete(c.value);
      if (list.children[i] !== li) list.insertBefore(li, list.children[i] || null);
      li.classList.toggle("selected", c.value === S.classValue);
      li.setAttribute("aria-selected", c.value === S.classValue ? "true" : "false");
      li.querySelector(".key").textContent = c.value <= 9 ? String(c.value) : "";
      const colour = li.querySelector("input[type=color]");
      if (document.activeElement !== colour) colour.value = c.color;
      li.dataset.color = c.color;
      const name = li.querySelector(".name");
      if (name) name.textContent = c.name;
      li.querySelector(".count").textContent = counts[c.value] ? formatCount(counts[c.value]) : "";
    });
    rows.forEach((li) => li.remove());
  }

  function renderSettings() {
    const s = S.state.settings || {};
    const select = $("backbone");
    const options = (s.backbones || [null]).map((b) => (b === null ? "" : b));
    const have = [...select.options].map((o) => o.value);
    if (JSON.stringify(have) !== JSON.stringify(options)) {
      select.innerHTML = "";
      for (const b of options) {
        const o = document.createElement("option");
        o.value = b;
        o.textContent = b === "" ? "classical only" : b;
        select.appendChild(o);
      }
    }
    const note = $("backbone-note");
    const random = s.backbone_weights && s.backbone_weights.startsWith("random");
    note.hidden = !random;
    note.textContent = random ? `⚠ ${options[options.length - 1]} has ${s.backbone_weights}.` : "";
    for (const o of select.options) {
      if (o.value) o.textContent = random ? `${o.value} (random weights)` : o.value;
    }
    if (S.settingsInFlight) return;   // the controls show what the user just chose
    select.value = s.backbone === null || s.backbone === undefined ? "" : s.backbone;
    $("crf").checked = !!s.crf;
    S.live = !!s.live;
    $("live").checked = S.live;
  }

  function renderModel() {
    if (document.body.classList.contains("volume-mode")) { renderVolumeModel(); return; }
    const m = S.state.model;
    $("predict").disabled = !m;
    $("predict-all").disabled = !m || !!S.predictJob;
    $("model-info").textContent = m
      ? `model #${m.id}: ${m.classes.length} classes, ${m.images} image(s), ${formatCount(m.pixels)} labelled px, trained in ${Number(m.seconds).toFixed(1)} s`
      : "no model yet: label two classes or more, then train";
  }

  // While a volume is shown (volume.js), the Train panel speaks of the volume model, which is
  // trained and kept apart from the 2D images' model.
  function renderVolumeModel() {
    const m = S.state && S.state.volume_model;
    $("predict").disabled = !m;
    $("predict-all").disabled = true;   // Predict all is for 2D images
    if (!m) { $("model-info").textContent = "no volume model yet: label two classes or more in a volume, then train"; return; }
    const voxels = Object.values(m.voxels || {}).reduce((a, b) => a + b, 0);
    const names = m.classes.map((v) => (classByValue(v) || { name: `class ${v}` }).name);
    $("model-info").textContent = `volume model #${m.id}: ${m.classes.length} classes (${names.join(", ")}), `
      + `${(m.volumes || []).length} volume(s), ${formatCount(voxels)} labelled voxels, trained in ${Number(m.seconds).toFixed(1)} s`;
  }

  function renderFeaturesInfo() {
    const im = imageById(S.current);
    $("image-features").textContent = im ? `${im.name}: ${featureText(im)}` : "";
  }

  // ---------------------------------------------------------------- images
  function resizeLayers(w, h) {
    S.imgW = w;
    S.imgH = h;
    S.levels = levelShapes(w, h);
    for (const el of [imageLayer, labelLayer, overlayLayer]) {
      el.style.width = `${w}px`;
      el.style.height = `${h}px`;
    }
    stage.style.width = `${w}px`;
    stage.style.height = `${h}px`;
    for (const layer of Object.values(layers)) layer.reset();
  }

  async function selectImage(id, { fit = true } = {}) {
    const t0 = performance.now();
    const im = imageById(id);
    if (!im) return;
    const seq = ++S.loadSeq;
    S.leave.abort();   // the server drops work for the image left
    S.leave = new AbortController();
    S.current = id;
    S.labelsVersion = null;
    S.overlayShown = false;
    S.overlayPredicted = null;
    S.drawing = null;
    history.replaceState(null, "", `${location.pathname}${location.search}#image=${enc(id)}`);
    $("empty-hint").hidden = true;
    stage.classList.remove("empty");
    overlayLayer.hidden = true;
    layers.overlay.active = false;
    resizeLayers(im.width, im.height);
    clearFractions();
    if (fit) fitView();
    renderImages();
    renderClasses();
    renderFeaturesInfo();

    // Features start computing in the background once the server has sent the first tiles (on 2
    // cores, computing both at once would delay the image); /api/state says when they are ready.
    let opened = false;
    const open = () => {
      if (opened || seq !== S.loadSeq) return;
      opened = true;
      if (!S.openedAt.has(id)) {
        S.openedAt.set(id, performance.now());
        S.clickedAt.set(id, t0);
      }
      api("POST", `/api/images/${enc(id)}/open`)
        .then(() => refreshState())
        .catch((err) => showError(err, `${im.name}: `));
    };
    layers.image.onTile = open;
    loadLabels(id);
    if (S.state.model) {   // the current model's prediction, the part on screen first
      showPrediction(id).catch((err) => { if (err.status !== 409) showError(err); });
    }
    const shown = await layers.image.whenSettled();
    open();   // (also when no tile could be drawn)
    if (!shown || seq !== S.loadSeq) return;
    await nextFrame();
    if (seq === S.loadSeq) {
      timing("image_shown", performance.now() - t0, { image: id, width: im.width, height: im.height,
        level: layers.image.level, tiles: layers.image.wantedKeys.size });
    }
  }

  // The label layer is redrawn from the server's label tiles (the server is the truth).
  async function loadLabels(id) {
    if (id !== S.current) return;
    S.labelsLoading = true;
    layers.labels.refresh();
    try {
      if (await layers.labels.whenSettled() && id === S.current) S.labelsVersion = layers.labels.version;
    } finally {
      S.labelsLoading = false;
    }
  }

  function colourTable() {
    // value → packed RGBA (little-endian: 0xAABBGGRR); 0 and unknown values transparent.
    const lut = new Uint32Array(256);
    for (const c of (S.state ? S.state.classes : [])) {
      if (c.value < 1 || c.value > 255) continue;
      const [r, g, b] = hexToRgb(c.color);
      lut[c.value] = ((255 << 24) | (b << 16) | (g << 8) | r) >>> 0;
    }
    return lut;
  }

  function paintLabels() {
    layers.labels.recolour();
  }

  // ---------------------------------------------------------------- prediction overlay
  const UNCERTAINTY_STOPS = [[0, "#000004"], [0.25, "#420a68"], [0.5, "#932667"], [0.75, "#dd513a"], [1, "#fcffa4"]];
  const uncertaintyLut = (() => {
    const lut = new Uint32Array(256);
    for (let v = 0; v < 256; v++) {
      const t = v / 255;
      let k = 0;
      while (k < UNCERTAINTY_STOPS.length - 2 && t > UNCERTAINTY_STOPS[k + 1][0]) k++;
      const [t0, c0] = UNCERTAINTY_STOPS[k], [t1, c1] = UNCERTAINTY_STOPS[k + 1];
      const f = (t - t0) / (t1 - t0);
      const a = hexToRgb(c0), b = hexToRgb(c1);
      const rgb = a.map((x, i) => Math.round(x + f * (b[i] - x)));
      lut[v] = ((255 << 24) | (rgb[2] << 16) | (rgb[1] << 8) | rgb[0]) >>> 0;
    }
    return lut;
  })();

  // The region on screen as the server takes it: [top, left, bottom, right] in image px.
  function viewRegion() {
    const [x0, y0, x1, y1] = visibleRect();
    return [Math.floor(y0), Math.floor(x0), Math.ceil(y1), Math.ceil(x1)];
  }

  // Show the current model's prediction of the shown image: the server predicts the region on
  // screen first (the rest follows in the background and the overlay fills in, see refreshState).
  async function showPrediction(id, answer = null) {
    const seq = S.loadSeq;
    const kind = S.showUncertainty ? "uncertainty" : "prediction";
    if (!answer) {
      answer = await api("POST", "/api/predict", { image: id, region: viewRegion() }, S.leave.signal);
    }
    if (seq !== S.loadSeq || id !== S.current) return false;
    const layer = layers.overlay;
    if (layer.kind !== kind) layer.reset(kind);
    layer.active = true;
    layer.refresh();
    const drawn = await layer.whenSettled();
    if (!drawn || seq !== S.loadSeq || id !== S.current) return false;
    S.overlayShown = true;
    S.overlayModel = layer.model;
    S.overlayCrf = layer.crf;
    S.overlayPredicted = answer.prediction ? answer.prediction.predicted : null;
    overlayLayer.dataset.kind = kind;
    overlayLayer.hidden = !S.showOverlay;
    renderFractions(answer.prediction);
    updateStale();
    await nextFrame();
    return true;
  }

  function clearFractions() {
    const body = $("fractions").tBodies[0];
    body.innerHTML = '<tr class="empty"><td colspan="3" class="muted">train to see them</td></tr>';
    $("fractions-note").hidden = true;
  }

  // The area fractions of a prediction (/api/state's image record or a Train or Predict answer),
  // over the part of the image predicted so far.
  function renderFractions(p) {
    if (!p || !p.fractions) { clearFractions(); return; }
    const list = Array.isArray(p.fractions) ? p.fractions
      : Object.entries(p.fractions).map(([v, fraction]) => ({ value: Number(v), fraction }));
    const body = $("fractions").tBodies[0];
    body.innerHTML = "";
    for (const c of list) {
      const cls = classByValue(c.value);
      const tr = document.createElement("tr");
      tr.dataset.value = String(c.value);
      tr.innerHTML = '<td><span class="swatch"></span></td><td class="cname"></td><td class="num"></td>';
      tr.querySelector(".swatch").style.background = cls ? cls.color : "#888888";
      tr.querySelector(".cname").textContent = cls ? cls.name : (c.name || `class ${c.value}`);
      tr.querySelector(".num").textContent = `${(100 * (c.fraction || 0)).toFixed(1)} %`;
      body.appendChild(tr);
    }
    if (!body.children.length) clearFractions();
    const note = $("fractions-note");
    note.hidden = !(p.predicted < 1);
    note.textContent = p.predicted < 1 ? `of the ${(100 * p.predicted).toFixed(1)} % of the image predicted so far` : "";
  }

  // A new view with a model: the server predicts what came on screen first (when it is not done yet).
  let regionTimer = 0;
  function predictView() {
    clearTimeout(regionTimer);
    const im = imageById(S.current);
    if (!S.overlayShown || !im || !im.prediction || im.prediction.complete) return;
    regionTimer = setTimeout(() => {
      const id = S.current;
      api("POST", "/api/predict", { image: id, region: viewRegion() }, S.leave.signal)
        .then(() => { if (id === S.current) layers.overlay.refresh(); })
        .catch((err) => { if (err.status !== 409) showError(err); });
    }, 250);
  }

  // While the rest of the shown image is predicted in the background, the overlay in view fills in.
  let fillRefreshed = 0;
  function followPrediction(im) {
    const p = im && im.prediction;
    if (!p || !S.overlayShown || p.model !== S.overlayModel) return;
    if (p.predicted !== S.overlayPredicted && performance.now() - fillRefreshed > 1000) {
      fillRefreshed = performance.now();
      S.overlayPredicted = p.predicted;
      layers.overlay.refresh();
      renderFractions(p);
      if (p.complete) timing("prediction_complete", performance.now() - (S.trainedAt || 0), { image: im.id, model: p.model });
    }
    if (!p.complete || p.predicted !== S.overlayPredicted) schedulePoll(POLL_MS);
  }

  // ---------------------------------------------------------------- view: zoom and pan
  let viewFrame = 0;
  function applyView() {
    if (viewFrame) return;
    viewFrame = requestAnimationFrame(() => {
      viewFrame = 0;
      const { scale, tx, ty } = S.view;
      stage.style.transform = `translate(${tx}px, ${ty}px) scale(${scale})`;
      stage.classList.toggle("pixelated", scale >= 1);
      $("zoom-value").textContent = `${scale >= 10 ? Math.round(scale * 100) : (scale * 100).toFixed(scale < 0.1 ? 1 : 0)} %`;
      updateBrushCursor();
      updateLayers();
      predictView();
    });
  }

  function fitScale() {
    const w = area.clientWidth, h = area.clientHeight;
    if (!S.imgW || !S.imgH || !w || !h) return 1;
    return Math.min(w / S.imgW, h / S.imgH) * 0.96;
  }

  function fitView() {
    const s = fitScale();
    S.view.scale = s;
    S.view.tx = (area.clientWidth - S.imgW * s) / 2;
    S.view.ty = (area.clientHeight - S.imgH * s) / 2;
    S.fitted = true;
    applyView();
  }

  function zoomAt(mx, my, factor) {
    if (!S.imgW) return;
    const minScale = Math.min(fitScale() / 4, 0.5);
    const s0 = S.view.scale;
    const s1 = clamp(s0 * factor, minScale, MAX_SCALE);
    const k = s1 / s0;
    S.view.tx = mx - (mx - S.view.tx) * k;
    S.view.ty = my - (my - S.view.ty) * k;
    S.view.scale = s1;
    S.fitted = false;
    applyView();
  }

  function zoomCentre(factor) {
    zoomAt(area.clientWidth / 2, area.clientHeight / 2, factor);
  }

  // Area px (relative to the canvas area) → image px (x = column, y = row; pixel centres at integers).
  function toImage(clientX, clientY) {
    const r = area.getBoundingClientRect();
    const { scale, tx, ty } = S.view;
    return { x: (clientX - r.left - tx) / scale - 0.5, y: (clientY - r.top - ty) / scale - 0.5 };
  }

  function brushRadius() {
    return Number($("brush-size").value);
  }

  function updateBrushCursor() {
    const p = S.pointer;
    if (!p || !S.current || S.pan || S.spaceDown) { brushCursor.hidden = true; return; }
    const r = brushRadius();
    const { scale, tx, ty } = S.view;
    const q = toImage(p.clientX, p.clientY);
    // Snap to the pixel grid when zoomed in, so the circle shows which pixels the disc covers.
    const cx = scale >= 4 ? Math.round(q.x) : q.x, cy = scale >= 4 ? Math.round(q.y) : q.y;
    const d = (2 * r + 1) * scale;
    brushCursor.style.width = brushCursor.style.height = `${d}px`;
    brushCursor.style.left = `${tx + (cx + 0.5) * scale - d / 2}px`;
    brushCursor.style.top = `${ty + (cy + 0.5) * scale - d / 2}px`;
    brushCursor.classList.toggle("erase", S.erase);
    brushCursor.hidden = false;
  }

  function updateCursorInfo(clientX, clientY) {
    if (!S.current) { $("cursor-info").textContent = ""; return; }
    const q = toImage(clientX, clientY);
    const x = Math.round(q.x), y = Math.round(q.y);
    if (x < 0 || y < 0 || x >= S.imgW || y >= S.imgH) { $("cursor-info").textContent = ""; return; }
    let text = `x ${x}  y ${y}`;
    const v = layers.labels.valueAt(x, y);   // (at a coarse level: the largest label of the block)
    if (v) {
      const c = classByValue(v);
      text += `  label ${c ? c.name : v}`;
    }
    $("cursor-info").textContent = text;
  }

  // ---------------------------------------------------------------- drawing
  function strokeColour() {
    const c = classByValue(S.classValue);
    return c ? c.color : "#ffffff";
  }

  function paintSegment(a, b, stroke) {
    layers.labels.paint(a, b, stroke);
  }

  function startStroke(e) {
    if (!S.current) return false;
    const classes = S.state ? S.state.classes : [];
    if (!classes.length) { status("add a class first (Classes panel on the left)", "error"); return false; }
    if (!S.erase && !classByValue(S.classValue)) { status("pick a class first", "error"); return false; }
    const radius = brushRadius();
    const p = toImage(e.clientX, e.clientY);
    if (p.x < -radius || p.y < -radius || p.x > S.imgW - 1 + radius || p.y > S.imgH - 1 + radius) return false;
    S.drawing = {
      pointerId: e.pointerId,
      image: S.current,
      cls: S.erase ? (classByValue(S.classValue) || classes[0]).value : S.classValue,
      erase: S.erase,
      radius,
      colour: strokeColour(),
      points: [p],
    };
    paintSegment(p, p, S.drawing);
    return true;
  }

  function extendStroke(st, events) {
    const minStep = Math.max(0.5, st.radius / 4);
    for (const ev of events) {
      const p = toImage(ev.clientX, ev.clientY);
      const last = st.points[st.points.length - 1];
      if (Math.hypot(p.x - last.x, p.y - last.y) < minStep) continue;
      paintSegment(last, p, st);
      st.points.push(p);
    }
  }

  function finishStroke(e) {
    const st = S.drawing;
    S.drawing = null;
    if (!st) return;
    if (e) extendStroke(st, [e]);
    const tUp = performance.now();
    const id = st.image;
    const round2 = (v) => Math.round(v * 100) / 100;
    const body = {
      class: st.cls,
      radius: st.radius,
      points: st.points.map((p) => [round2(p.x), round2(p.y)]),
      erase: st.erase,
    };
    S.pendingStrokes++;
    S.strokeQueue = S.strokeQueue.then(async () => {
      let ok = false;
      try {
        const r = await api("POST", `/api/images/${enc(id)}/strokes`, body);
        const im = imageById(id);
        if (im) { im.version = r.version; im.labelled = r.labelled; }
        // Nothing else changed these labels meanwhile: the page shows this version (its own stroke on top).
        if (id === S.current && S.labelsVersion !== null && r.version === S.labelsVersion + 1) S.labelsVersion = r.version;
        ok = true;
      } catch (err) {
        showError(err, "stroke not saved: ");
      } finally {
        S.pendingStrokes--;
      }
      if (id === S.current) {
        renderImages();
        renderClasses();
        if (ok && S.live) {
          if (S.liveStrokeT0 === null) S.liveStrokeT0 = tUp;
          liveTrain();
        }
      }
      // (not awaited: the next stroke need not wait for the tiles)
      if (S.pendingStrokes === 0 && !S.drawing && S.current) loadLabels(S.current);
      if (ok && S.state && S.state.model && !S.live) refreshState();   // is the overlay stale now?
    });
  }

  // ---------------------------------------------------------------- undo / redo
  async function undoRedo(which) {
    const id = S.current;
    if (!id) return;
    try {
      await S.strokeQueue;   // the server must have every stroke first
      // The version the page shows: when another tab changed the labels since, nothing is undone.
      const r = await api("POST", `/api/images/${enc(id)}/${which}`, { version: S.labelsVersion });
      const im = imageById(id);
      if (im) { im.version = r.version; im.labelled = r.labelled; }
      if (id === S.current) S.labelsVersion = r.version;   // exactly this page's change: its labels load next
      status(which === "undo" ? "undone" : "redone", "ok");
    } catch (err) {
      if (err.status === 409) {
        status(err.message || `nothing to ${which}`);
        if (id === S.current) await loadLabels(id);   // show what the server has
      } else showError(err);
      return;
    }
    if (id !== S.current) return;
    renderImages();
    renderClasses();
    await loadLabels(id);
    if (S.live) {
      if (S.liveStrokeT0 === null) S.liveStrokeT0 = performance.now();
      liveTrain();
    }
  }

  // ---------------------------------------------------------------- train
  function labelledClassCount() {
    const seen = new Set();
    for (const im of S.state ? S.state.images : []) {
      for (const [v, n] of Object.entries(im.labelled || {})) if (n > 0) seen.add(v);
    }
    return seen.size;
  }

  function liveTrain() {
    if (labelledClassCount() < 2) {
      status("live: label at least two classes to train");
      S.liveStrokeT0 = null;
      return;
    }
    train({ live: true });
  }

  function setTrainBusy(busy) {
    const b = $("train");
    b.classList.toggle("busy", busy);
    b.setAttribute("aria-busy", busy ? "true" : "false");
    b.disabled = busy;
  }

  async function train({ live = false } = {}) {
    const id = S.current;
    if (!id) { status("select an image first", "error"); return; }
    if (S.training) {
      if (live) S.trainAgain = true;   // run once more when this one ends
      return;
    }
    S.training = true;
    setTrainBusy(true);
    status(live ? "live: training…" : "training…", "busy");
    const strokeT0 = live ? S.liveStrokeT0 : null;
    if (live) S.liveStrokeT0 = null;
    const t0 = performance.now();
    try {
      if (!live) await S.strokeQueue;   // live training starts from a stroke the server has already
      // The region on screen is predicted before the answer; the rest of the image follows.
      const r = await api("POST", "/api/train", { image: id, region: viewRegion() });
      const tServer = performance.now() - t0;
      S.trainedAt = t0;
      if (S.state) {
        S.state.model = r.model;
        const im = imageById(id);
        if (im) im.prediction = r.prediction;
        renderModel();
      }
      if (id === S.current) {
        const shown = await showPrediction(id, r);
        const t1 = performance.now();
        if (shown) {
          timing("train", t1 - t0, { image: id, server_ms: Math.round(tServer), live, model: r.model.id,
            predicted: r.prediction.predicted });
          if (strokeT0 !== null) timing("stroke_to_overlay", t1 - strokeT0, { image: id, model: r.model.id });
        }
        status(`model #${r.model.id} trained in ${Number(r.model.seconds).toFixed(1)} s; shown in ${((t1 - t0) / 1000).toFixed(1)} s`, "ok");
      }
    } catch (err) {
      showError(err, live ? "live training: " : "");
    } finally {
      S.training = false;
      setTrainBusy(false);
    }
    refreshState();
    if (S.trainAgain) {
      S.trainAgain = false;
      if (S.live && S.current) liveTrain();
    }
  }

  // The current model's prediction of the shown image (after a CRF switch, or for a stale overlay).
  async function predict() {
    const id = S.current;
    if (!id) { status("select an image first", "error"); return; }
    if (!S.state || !S.state.model) { status("no model yet: label two classes or more, then train", "error"); return; }
    status("predicting…", "busy");
    try {
      if (await showPrediction(id)) status(`predicted with model #${S.overlayModel}`, "ok");
    } catch (err) {
      showError(err, "predict: ");
    }
  }

  // Every image with the current model, as a background job: each row of the image list gets its area fractions.
  async function predictAll() {
    let job;
    try {
      job = (await api("POST", "/api/predict", { scope: "all" })).job;
    } catch (err) {
      showError(err, "predict all: ");
      return;
    }
    S.predictJob = job;
    const bar = $("predict-progress");
    bar.hidden = false;
    bar.value = 0;
    renderModel();
    let j;
    for (;;) {
      try {
        j = await api("GET", `/api/jobs/${enc(job)}`);
      } catch (err) {
        j = { state: "error", message: err.message };
      }
      bar.value = j.progress || 0;
      if (j.state !== "running") break;
      await refreshState();
      await sleep(500);
    }
    S.predictJob = null;
    bar.hidden = true;
    await refreshState();
    if (j.state === "done") status(j.message, "ok");
    else status(`predict all: ${j.message || j.state}`, j.state === "error" ? "error" : "");
  }

  // ---------------------------------------------------------------- classes
  function selectClass(value) {
    if (!classByValue(value)) { status(`no class ${value} yet`, "error"); return; }
    S.classValue = value;
    if (S.erase) setEraser(false);
    renderClasses();
  }

  async function addClass(name) {
    name = name.trim();
    if (!name) { status("type a class name first", "error"); return; }
    try {
      const c = await api("POST", "/api/classes", { name });
      S.classValue = c.value;
      $("class-name").value = "";
      if (S.erase) setEraser(false);
      await refreshState();
      status(`added class ${c.value}: ${c.name}`, "ok");
    } catch (err) {
      showError(err);
    }
  }

  async function patchClass(value, patch) {
    try {
      const c = await api("PATCH", `/api/classes/${value}`, patch);
      const old = classByValue(value);
      if (old) Object.assign(old, c);
    } catch (err) {
      showError(err);
    }
    await refreshState();
    paintLabels();
    if (S.overlayShown && S.current) {   // the overlay (class colours) and the fractions' names and swatches
      layers.overlay.recolour();
      renderFractions((imageById(S.current) || {}).prediction);
    }
  }

  function previewColour(value, colour) {
    const c = classByValue(value);
    if (!c) return;
    c.color = colour;
    paintLabels();
    layers.overlay.recolour();
  }

  function startRename(value) {
    const li = document.querySelector(`.class-row[data-value="${value}"]`);
    const c = classByValue(value);
    if (!li || !c || li.querySelector("input.rename")) return;
    const span = li.querySelector(".name");
    const input = document.createElement("input");
    input.type = "text";
    input.className = "rename";
    input.value = c.name;
    input.dataset.testid = "rename";
    span.replaceWith(input);
    input.focus();
    input.select();
    let done = false;
    const finish = async (commit) => {
      if (done) return;
      done = true;
      const name = input.value.trim();
      input.replaceWith(span);
      if (commit && name && name !== c.name) {
        span.textContent = name;
        await patchClass(value, { name });
      }
    };
    input.addEventListener("keydown", (e) => {
      if (e.key === "Enter") { e.preventDefault(); finish(true); }
      if (e.key === "Escape") { e.preventDefault(); finish(false); }
      e.stopPropagation();
    });
    input.addEventListener("blur", () => finish(true));
  }

  // ---------------------------------------------------------------- tools
  function setEraser(on) {
    S.erase = on;
    $("eraser").setAttribute("aria-pressed", on ? "true" : "false");
    if (S.state) renderClasses();
    updateBrushCursor();
  }

  function setBrushSize(r) {
    r = clamp(Math.round(r), 1, 64);
    $("brush-size").value = String(r);
    $("brush-size-value").textContent = String(r);
    updateBrushCursor();
  }

  function setOverlayVisible(on) {
    S.showOverlay = on;
    $("show-overlay").checked = on;
    overlayLayer.hidden = !(on && S.overlayShown);
    updateStale();
  }

  async function setUncertainty(on) {
    S.showUncertainty = on;
    $("show-uncertainty").checked = on;
    if (S.current && S.overlayShown) {
      try {
        await showPrediction(S.current);
      } catch (err) {
        showError(err);
      }
    }
  }

  function setLabelsVisible(on) {
    S.showLabels = on;
    $("show-labels").checked = on;
    labelLayer.style.visibility = on ? "visible" : "hidden";
  }

  async function putSettings(patch) {
    S.settingsGen++;
    S.settingsInFlight++;
    try {
      const s = await api("PUT", "/api/settings", patch);
      if (S.state && s) S.state.settings = { ...S.state.settings, ...s };
    } catch (err) {
      showError(err);
    } finally {
      S.settingsInFlight--;
    }
    await refreshState();
  }

  // ---------------------------------------------------------------- upload
  async function uploadFiles(files) {
    const limitMb = S.state && S.state.limits ? S.state.limits.max_upload_mb : null;
    let added = [], failed = 0;
    for (const f of files) {
      if (limitMb && f.size > limitMb * 1024 * 1024) {
        status(`${f.name}: ${(f.size / 1048576).toFixed(0)} MB is over the server's upload limit of ${limitMb} MB`, "error");
        failed++;
        continue;
      }
      status(`uploading ${f.name}…`, "busy");
      try {
        const res = await request("POST", `/api/images?name=${enc(f.name)}`, { raw: f });
        const r = await res.json();
        added = added.concat(r.ids || []);
      } catch (err) {
        showError(err, `${f.name}: `);
        failed++;
      }
    }
    await refreshState();
    if (added.length) {
      if (!failed) status(`added ${added.length} image(s)`, "ok");
      selectImage(added[0]);
    }
  }

  // ---------------------------------------------------------------- save
  async function save() {
    const what = [...document.querySelectorAll("#save-panel input[name=what]:checked")].map((i) => i.value);
    const scope = document.querySelector("#save-panel input[name=scope]:checked").value;
    if (!what.length) { status("tick what to save first", "error"); return; }
    if (scope === "image" && !S.current) { status("select an image first, or save all images", "error"); return; }
    const body = { what, scope };
    if (S.current) body.image = S.current;
    let job;
    try {
      await S.strokeQueue;
      job = (await api("POST", "/api/save", body)).job;
    } catch (err) {
      showError(err, "save: ");
      return;
    }
    status("saving…", "busy");
    const j = await followSave(job);
    if (j.state === "done") status(`saved to ${j.folder}`, "ok");
    else if (j.state === "cancelled") status("save cancelled");
    else if (j.state === "error") status(`save failed: ${j.message || "unknown error"}`, "error");
  }

  // A Save job, of images or of a volume (volume.js), followed in the Save panel: progress and
  // Cancel while it runs, the folder once done. Resolves to the job's last record.
  async function followSave(job, unit = "") {
    const panel = $("save-panel");
    S.saveJob = job;
    panel.dataset.state = "running";
    $("save").disabled = true;
    $("save-cancel").hidden = false;
    $("save-progress").hidden = false;
    $("save-progress").value = 0;
    $("save-result").hidden = true;
    $("save-folder").textContent = "";
    let j = null;
    for (;;) {
      try {
        j = await api("GET", `/api/jobs/${enc(job)}`);
      } catch (err) {
        j = { state: "error", message: err.message };
        break;
      }
      $("save-progress").value = j.progress || 0;
      $("save-message").textContent = `${j.done ?? 0} / ${j.total ?? "?"}${unit}${j.message ? `: ${j.message}` : ""}`;
      if (j.state !== "running") break;
      await sleep(250);
    }
    S.saveJob = null;
    panel.dataset.state = j.state;
    $("save").disabled = false;
    $("save-cancel").hidden = true;
    $("save-progress").hidden = j.state !== "done";
    if (j.state === "done") {
      $("save-folder").textContent = j.folder || "";
      $("save-result").hidden = false;
    }
    return j;
  }

  async function cancelSave() {
    if (!S.saveJob) return;
    try {
      await api("DELETE", `/api/jobs/${enc(S.saveJob)}`);
    } catch (err) {
      showError(err);
    }
  }

  // ---------------------------------------------------------------- events
  function bindEvents() {
    // pointer: left button draws, middle/right button or space+left pans
    area.addEventListener("pointerdown", (e) => {
      area.focus({ preventScroll: true });
      S.pointer = { clientX: e.clientX, clientY: e.clientY };
      if (S.drawing || S.pan) return;
      if (e.button === 1 || e.button === 2 || (e.button === 0 && S.spaceDown)) {
        e.preventDefault();
        S.pan = { pointerId: e.pointerId, x: e.clientX, y: e.clientY, tx: S.view.tx, ty: S.view.ty };
        area.classList.add("panning");
        area.setPointerCapture(e.pointerId);
        updateBrushCursor();
        return;
      }
      if (e.button !== 0) return;
      e.preventDefault();   // a press on the viewer starts no text selection, stroke or not
      if (startStroke(e)) area.setPointerCapture(e.pointerId);
    });
    // Nor does a stroke or a pan that crosses the side panels select their text.
    document.addEventListener("selectstart", (e) => { if (S.drawing || S.pan) e.preventDefault(); });
    area.addEventListener("pointermove", (e) => {
      S.pointer = { clientX: e.clientX, clientY: e.clientY };
      if (S.pan && e.pointerId === S.pan.pointerId) {
        S.view.tx = S.pan.tx + (e.clientX - S.pan.x);
        S.view.ty = S.pan.ty + (e.clientY - S.pan.y);
        S.fitted = false;
        applyView();
        return;
      }
      if (S.drawing && e.pointerId === S.drawing.pointerId) {
        extendStroke(S.drawing, e.getCoalescedEvents ? e.getCoalescedEvents() : [e]);
      }
      updateBrushCursor();
      updateCursorInfo(e.clientX, e.clientY);
    });
    const end = (e) => {
      if (S.pan && e.pointerId === S.pan.pointerId) {
        S.pan = null;
        area.classList.remove("panning");
        updateBrushCursor();
      }
      if (S.drawing && e.pointerId === S.drawing.pointerId) finishStroke(e.type === "pointerup" ? e : null);
      if (area.hasPointerCapture(e.pointerId)) area.releasePointerCapture(e.pointerId);
    };
    area.addEventListener("pointerup", end);
    area.addEventListener("pointercancel", end);
    area.addEventListener("pointerleave", () => { if (!S.drawing && !S.pan) { S.pointer = null; brushCursor.hidden = true; } });
    area.addEventListener("contextmenu", (e) => e.preventDefault());
    area.addEventListener("auxclick", (e) => e.preventDefault());
    area.addEventListener("wheel", (e) => {
      e.preventDefault();
      const r = area.getBoundingClientRect();
      let dy = e.deltaY;
      if (e.deltaMode === 1) dy *= 16;
      else if (e.deltaMode === 2) dy *= 400;
      zoomAt(e.clientX - r.left, e.clientY - r.top, Math.exp(-clamp(dy, -300, 300) * 0.002));
    }, { passive: false });
    new ResizeObserver(() => { if (S.fitted && S.current) fitView(); else updateBrushCursor(); }).observe(area);

    // keyboard
    const typing = (t) => t && (t.isContentEditable || t.tagName === "TEXTAREA" || t.tagName === "SELECT" ||
      (t.tagName === "INPUT" && !["checkbox", "radio", "range", "color", "button", "file"].includes(t.type)));
    document.addEventListener("keydown", (e) => {
      if (typing(e.target)) return;
      const k = e.key;
      if ((e.ctrlKey || e.metaKey) && !e.altKey) {
        if (k === "z" || k === "Z") { e.preventDefault(); undoRedo(e.shiftKey ? "redo" : "undo"); }
        else if (k === "y" || k === "Y") { e.preventDefault(); undoRedo("redo"); }
        return;
      }
      if (e.altKey) return;
      if (k >= "1" && k <= "9") { selectClass(Number(k)); return; }
      switch (k) {
        case " ":
          e.preventDefault();
          if (!S.spaceDown) { S.spaceDown = true; area.classList.add("space"); updateBrushCursor(); }
          break;
        case "0": fitView(); break;
        case "[": setBrushSize(brushRadius() - Math.max(1, Math.round(brushRadius() * 0.15))); break;
        case "]": setBrushSize(brushRadius() + Math.max(1, Math.round(brushRadius() * 0.15))); break;
        case "e": case "E": setEraser(!S.erase); break;
        case "t": case "T": train(); break;
        case "p": case "P": predict(); break;
        case "o": case "O": setOverlayVisible(!S.showOverlay); break;
        case "u": case "U": setUncertainty(!S.showUncertainty); break;
        case "l": case "L": setLabelsVisible(!S.showLabels); break;
        case "+": case "=": zoomCentre(1.25); break;
        case "-": case "_": zoomCentre(0.8); break;
        default: return;
      }
    });
    document.addEventListener("keyup", (e) => {
      if (e.key === " ") { S.spaceDown = false; area.classList.remove("space"); updateBrushCursor(); }
    });
    window.addEventListener("blur", () => { S.spaceDown = false; area.classList.remove("space"); });

    // controls
    $("upload").addEventListener("change", () => {
      const files = [...$("upload").files];
      $("upload").value = "";
      if (files.length) uploadFiles(files);
    });
    $("add-class-form").addEventListener("submit", (e) => { e.preventDefault(); addClass($("class-name").value); });
    $("brush-size").addEventListener("input", () => setBrushSize(brushRadius()));
    $("eraser").addEventListener("click", () => setEraser(!S.erase));
    $("undo").addEventListener("click", () => undoRedo("undo"));
    $("redo").addEventListener("click", () => undoRedo("redo"));
    $("label-opacity").addEventListener("input", () => { labelLayer.style.opacity = $("label-opacity").value / 100; });
    $("show-labels").addEventListener("change", () => setLabelsVisible($("show-labels").checked));
    $("fit").addEventListener("click", () => fitView());
    $("zoom-in").addEventListener("click", () => zoomCentre(1.25));
    $("zoom-out").addEventListener("click", () => zoomCentre(0.8));
    $("train").addEventListener("click", () => train());
    $("predict").addEventListener("click", () => predict());
    $("predict-all").addEventListener("click", () => predictAll());
    $("live").addEventListener("change", () => {
      S.live = $("live").checked;
      putSettings({ live: S.live });
    });
    $("show-overlay").addEventListener("change", () => setOverlayVisible($("show-overlay").checked));
    $("show-uncertainty").addEventListener("change", () => setUncertainty($("show-uncertainty").checked));
    $("overlay-opacity").addEventListener("input", () => {
      overlayLayer.style.opacity = $("overlay-opacity").value / 100;
      $("overlay-opacity-value").textContent = $("overlay-opacity").value;
    });
    $("backbone").addEventListener("change", async () => {
      const v = $("backbone").value;
      await putSettings({ backbone: v === "" ? null : v });
      // The model is dropped and features are recomputed: clear the overlay and reopen the image.
      S.overlayShown = false;
      overlayLayer.hidden = true;
      layers.overlay.active = false;
      layers.overlay.reset();
      clearFractions();
      if (S.current) {
        S.openedAt.set(S.current, performance.now());
        S.clickedAt.set(S.current, performance.now());
        S.featuresReported.delete(S.current);
        api("POST", `/api/images/${enc(S.current)}/open`).then(() => refreshState()).catch((err) => showError(err));
      }
    });
    $("crf").addEventListener("change", () => putSettings({ crf: $("crf").checked }));
    $("save").addEventListener("click", () => save());
    $("save-cancel").addEventListener("click", () => cancelSave());
    // Buttons give the focus back to the canvas so keys like space keep panning, not clicking.
    document.querySelectorAll("button").forEach((b) => b.addEventListener("mouseup", () => b.blur()));
  }

  // ---------------------------------------------------------------- start
  async function init() {
    bindEvents();
    stage.classList.add("empty");
    setBrushSize(brushRadius());
    overlayLayer.style.opacity = $("overlay-opacity").value / 100;
    labelLayer.style.opacity = $("label-opacity").value / 100;
    const state = await refreshState();
    // Idle, the page still looks at the state now and then: strokes from another tab show up.
    setInterval(() => { if (!document.hidden && !S.pollTimer && !S.drawing) refreshState(); }, POLL_IDLE_MS);
    if (!state) return;
    const m = /(?:^#|&)image=([^&]*)/.exec(location.hash);
    const wanted = m ? decodeURIComponent(m[1]) : null;
    if (wanted && imageById(wanted)) selectImage(wanted);
  }

  init();
})();
