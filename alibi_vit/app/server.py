"""The app's HTTP server: the page's static files and the JSON/PNG API of ``API.md``.

Built on FastAPI (Starlette routing and static files, request bodies validated by pydantic models
with readable 4xx answers) served by uvicorn: both well kept, pure Python wheels, and the stack the
Python data tools' local servers are usually built on. Quick handlers are plain functions, which
FastAPI runs on a thread pool; handlers that wait for compute (Train, predictions) are coroutines
awaiting the engine's worker, so any number of waiting requests holds no thread, and a request
whose client has gone away stops waiting (its work is dropped if nobody else waits for it). Display
tiles, which may build a level the file lacks, run on the thread pool and stop being built when
their client has gone (:func:`while_connected`).

Every answer is JSON or PNG; every error is JSON ``{"detail": ...}`` (a 500 too). Which requests
are refused, and how, is in docs/app.md "Security" and API.md "Who may ask".
"""

from __future__ import annotations

import asyncio
import errno
import json
import secrets
import threading
import traceback
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import MutableHeaders

from .engine import NOW, Engine
from .imagefiles import OutsideStore
from .measurements import start_image_measurement, start_slice_measurement, start_volume_measurement
from .pyramid import TILE
from .scheduler import Cancelled, abandoned_when
from .session import MAX_POINTS, Session, SessionError, not_saved
from .volume import Volumes

__all__ = ["MAX_JSON_BYTES", "STATIC", "TOKEN_COOKIE", "create_app"]

STATIC = Path(__file__).parent / "static"
TOKEN_COOKIE = "alibi_vit_token"
MAX_JSON_BYTES = 16 << 20  # request bodies other than uploads
DISCONNECT_POLL_S = 0.5  # how often a waiting request checks that its client is still there
# Headers on every answer: no other site may frame the page, embed its PNGs, or learn its URL.
SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Cross-Origin-Resource-Policy": "same-origin",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; frame-ancestors 'none'; "
                               "base-uri 'none'; form-action 'self'",
}


# ---- request bodies ---------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StrokeBody(_Body):
    cls: StrictInt | None = Field(None, alias="class")
    radius: StrictInt | StrictFloat
    points: list[tuple[StrictInt | StrictFloat, StrictInt | StrictFloat]] = Field(max_length=MAX_POINTS)
    erase: StrictBool = False


class UndoBody(_Body):
    version: StrictInt | None = None  # the label version the page shows (409 when it changed since)


class ClassBody(_Body):
    name: str | None = None
    color: str | None = None


class SettingsBody(_Body):
    backbone: str | None = None
    crf: StrictBool | None = None
    live: StrictBool | None = None


class ImageBody(_Body):
    image: str | None = Field(None, max_length=512)


Region = tuple[StrictInt | StrictFloat, StrictInt | StrictFloat, StrictInt | StrictFloat, StrictInt | StrictFloat]


class TrainBody(ImageBody):
    region: Region | None = None  # [top, left, bottom, right] in image px: what is on screen, predicted first


class PredictBody(TrainBody):
    scope: Literal["image", "all"] = "image"


class SaveBody(ImageBody):
    what: list[str]
    scope: str = "image"


class VolumeStrokeBody(StrokeBody):
    view: Literal["xy", "xz", "yz"]
    index: StrictInt  # the slice shown: z in XY, y in XZ, x in YZ


class VolumeMeasureBody(_Body):
    """What of a volume Measure measures: the slice shown (view and index) or the whole volume (whole)."""
    view: Literal["xy", "xz", "yz"] | None = None
    index: StrictInt | None = None  # the slice shown: z in XY, y in XZ, x in YZ
    whole: StrictBool = False


class VolumeSaveBody(_Body):
    what: list[Literal["labels", "model", "masks"]] = Field(min_length=1)


class PathBody(_Body):
    path: str = Field(max_length=4096)


# ---- waiting for the worker -----------------------------------------------------------------------
async def outcome(request: Request, engine: Engine, task):
    """The result of an engine task, awaited without holding a thread; when the client goes away
    first, the request stops waiting (and the task is dropped if nobody else waits for it)."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    task.future.add_done_callback(lambda _: loop.call_soon_threadsafe(done.set))
    try:
        while not done.is_set():
            try:
                await asyncio.wait_for(done.wait(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise SessionError("the client went away", status=499) from None
        return task.future.result()
    finally:
        engine.scheduler.release(task)


async def while_connected(request: Request, fn, *args):
    """``fn(*args)`` on the thread pool, for as long as the client waits: when it goes away first, the
    request stops waiting and the work stops at its next :func:`~alibi_vit.app.scheduler.request_checkpoint`
    (a display tile of a level the file does not store can take the whole image below it)."""
    gone = threading.Event()
    with abandoned_when(gone):  # the task copies the context now: the thread it runs on sees the mark
        work = asyncio.ensure_future(run_in_threadpool(fn, *args))
    while True:
        done, _ = await asyncio.wait({work}, timeout=DISCONNECT_POLL_S)
        if done:
            return work.result()
        if await request.is_disconnected():
            gone.set()
            work.add_done_callback(lambda w: w.cancelled() or w.exception())  # its error is nobody's to see
            raise SessionError("the client went away", status=499)


def _same_site(request: Request) -> bool:
    """Whether a request comes from the app's own page (or none): browsers say where a request comes
    from in Sec-Fetch-Site, also for the GETs an <img> or <script> tag makes, which carry no Origin.
    The one exception is opening the page itself from a link elsewhere (a top-level navigation)."""
    site = request.headers.get("sec-fetch-site")
    if site in (None, "same-origin", "none"):
        return True
    return (request.method == "GET" and request.url.path == "/"
            and request.headers.get("sec-fetch-mode") == "navigate"
            and request.headers.get("sec-fetch-dest") == "document")


class Guard:
    """ASGI middleware: refuses what docs/app.md "Security" lists (403, or 413 for an oversized body)
    before any handler runs, and adds SECURITY_HEADERS (and, when ``/`` is opened with the token,
    the token cookie) to every answer. A plain ASGI middleware, not Starlette's BaseHTTPMiddleware,
    which hides a client's disconnection from the handlers."""

    def __init__(self, app, token: str | None = None, hosts=None):
        self.app, self.token, self.hosts = app, token, hosts

    def problem(self, request: Request) -> tuple[str, int] | None:
        host = request.headers.get("host")
        if self.hosts is not None and host not in self.hosts:
            return f"host {host!r} refused: open the URL printed by alibi-vit app", 403
        origin = request.headers.get("origin")
        if origin and urlsplit(origin).netloc != host:
            # Another site's page in the same browser (cross-site request forgery): the page itself is same-origin.
            return f"cross-origin request from {origin} refused", 403
        if not _same_site(request):
            return (f"request from another site's page refused (Sec-Fetch-Site: "
                    f"{request.headers.get('sec-fetch-site')}): open the app's own page"), 403
        if self.token is not None:
            given = (request.query_params.get("token") or request.headers.get("x-token")
                     or request.cookies.get(TOKEN_COOKIE) or "")
            if not secrets.compare_digest(given.encode(), self.token.encode()):
                return "missing or wrong token: open the URL printed by alibi-vit app", 403
        declared = request.headers.get("content-length", "")
        if request.url.path != "/api/images" and declared.isdigit() and int(declared) > MAX_JSON_BYTES:
            return f"request body of {int(declared) >> 20} MB refused: at most {MAX_JSON_BYTES >> 20} MB", 413
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        problem = self.problem(request)
        if problem is not None:
            response = JSONResponse({"detail": problem[0]}, status_code=problem[1], headers=SECURITY_HEADERS)
            return await response(scope, receive, send)
        cookie = None
        if self.token is not None and request.url.path == "/" and request.query_params.get("token"):
            carrier = Response()
            carrier.set_cookie(TOKEN_COOKIE, self.token, httponly=True, samesite="strict")
            cookie = carrier.headers["set-cookie"]

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers.update(SECURITY_HEADERS)
                if cookie:
                    headers.append("set-cookie", cookie)
            await send(message)

        await self.app(scope, receive, send_with_headers)


def create_app(session: Session, engine: Engine, token: str | None = None, max_upload_mb: float = 1024,
               hosts=None, volumes: Volumes | None = None):
    """The ASGI application. ``token``: when set, every request must carry it (query ``token``,
    header ``X-Token`` or the cookie set when ``/`` is opened with it). ``hosts``: when set, the only
    ``Host`` headers accepted (a tokenless app on 127.0.0.1 names its own addresses, so a web page
    whose domain was re-pointed at 127.0.0.1, DNS rebinding, cannot reach it). ``volumes``: the
    session's volume mode (the one whose ``claim`` the session was given; default: the volumes the
    session folder lists)."""
    volumes = volumes if volumes is not None else Volumes(session.folder)
    app = FastAPI(title="alibi-vit app", docs_url=None, redoc_url=None, openapi_url=None)
    max_upload = int(max_upload_mb * (1 << 20))

    app.add_middleware(Guard, token=token, hosts=hosts)

    @app.exception_handler(SessionError)
    async def session_error(request: Request, err: SessionError):
        return JSONResponse({"detail": str(err)}, status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, err: RequestValidationError):
        def where(e):
            return ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body"

        problems = "; ".join(f"{where(e)}: {e.get('msg')}" for e in err.errors()[:5])
        return JSONResponse({"detail": f"malformed request ({problems})"[:1000]}, status_code=422)

    @app.exception_handler(ValueError)
    async def value_error(request: Request, err: ValueError):  # the engine's checks of images and labels
        refused = isinstance(err.__cause__, OutsideStore)  # a chunk that leads out of its store: as a link out
        return JSONResponse({"detail": str(err)}, status_code=403 if refused else 400)

    @app.exception_handler(OSError)
    async def os_error(request: Request, err: OSError):
        if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
            problem = not_saved("the result", Path(err.filename or session.folder), err)
            return JSONResponse({"detail": str(problem)}, status_code=problem.status)
        traceback.print_exception(err)
        return JSONResponse({"detail": f"the server could not read or write a file: {err}"}, status_code=500)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        traceback.print_exception(err)
        return JSONResponse({"detail": f"internal error ({type(err).__name__}: {err}); the server's log has the "
                                       "details"[:1000]}, status_code=500)

    def png(data: bytes, headers: dict | None = None) -> Response:
        return Response(data, media_type="image/png", headers={"Cache-Control": "no-store", **(headers or {})})

    @app.get("/")
    def index():
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    # ---- state ------------------------------------------------------------------------------
    def image_record(image_id: str) -> dict:
        entry = session.entry(image_id)
        features = engine.feature_state(image_id)
        height, width = (entry.shape[:2] or (None, None))
        return {"id": image_id, "name": entry.name, "file": entry.source.name, "page": entry.page,
                "width": width, "height": height, "kind": entry.kind, "chunked": entry.chunked,
                "features": features["state"], "progress": features["progress"], "error": features["error"],
                "note": features.get("note"), "labelled": session.counts(image_id), "version": entry.version,
                "prediction": engine.predicted.get(image_id)}

    @app.get("/api/state")
    def state():
        return {"session": str(session.folder), "classes": session.classes,
                "images": [image_record(i) for i in list(session.images)],
                "settings": {**session.settings, "backbones": engine.backbones(),
                             "backbone_weights": engine.backbone_weights()},
                "volumes": [volumes.record(v) for v in list(volumes.volumes)],
                "volume_model": volumes.model,
                "model": engine.model_state(), "notes": session.skipped + engine.notes, "tile": TILE,
                "limits": {"max_upload_mb": max_upload_mb, "max_megapixels": session.max_pixels / 1e6}}

    # ---- images -----------------------------------------------------------------------------
    @app.get("/api/images/{image_id}/display.png")
    def display(image_id: str):
        return png(engine.display_png(image_id))

    @app.get("/api/images/{image_id}/tiles/{layer}/{level}/{row}/{col}.png")
    async def tile(request: Request, image_id: str, layer: Literal["image", "labels", "prediction", "uncertainty"],
                   level: int, row: int, col: int):
        data, headers = await while_connected(request, engine.tile, image_id, layer, level, row, col)
        return png(data, headers)

    @app.post("/api/images/{image_id}/open")
    def open_image(image_id: str):
        engine.open(image_id)
        return image_record(image_id)

    @app.post("/api/images")
    async def upload(request: Request, name: str = ""):
        shown = Path(name).name[:80] or "the upload"
        declared = request.headers.get("content-length")
        too_big = SessionError(f"{shown} is larger than the upload limit of {max_upload_mb:g} MB (start the app "
                               "with --max-upload-mb to raise it)", status=413)
        if declared and declared.isdigit() and int(declared) > max_upload:
            raise too_big
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > max_upload:
                raise too_big
        if not data:
            raise SessionError(f"{shown} is empty")
        known = set(volumes.volumes)
        ids = await run_in_threadpool(session.add_upload, name, bytes(data))
        return {"ids": ids, "volumes": [v for v in volumes.volumes if v not in known]}

    @app.post("/api/images/add")
    def add_path(body: PathBody):
        """Add an image file or folder from disk: only inside the folders the app was started with."""
        known = set(volumes.volumes)
        ids, skipped = session.add_path(body.path)
        return {"ids": ids, "skipped": skipped, "volumes": [v for v in volumes.volumes if v not in known]}

    # ---- labels -----------------------------------------------------------------------------
    @app.get("/api/images/{image_id}/labels.png")
    def labels(image_id: str):
        data, version = session.label_png(image_id)
        return png(data, {"X-Labels-Version": str(version)})

    def label_answer(image_id: str, version: int) -> dict:
        return {"version": version, "labelled": session.counts(image_id)}

    @app.post("/api/images/{image_id}/strokes")
    def stroke(image_id: str, body: StrokeBody):
        version = session.add_stroke(image_id, body.cls, body.radius, [list(p) for p in body.points], body.erase)
        return label_answer(image_id, version)

    @app.post("/api/images/{image_id}/undo")
    def undo(image_id: str, body: UndoBody | None = Body(None)):
        return label_answer(image_id, session.undo(image_id, expected_version=body and body.version))

    @app.post("/api/images/{image_id}/redo")
    def redo(image_id: str, body: UndoBody | None = Body(None)):
        return label_answer(image_id, session.undo(image_id, redo=True, expected_version=body and body.version))

    # ---- classes and settings -------------------------------------------------------------------
    @app.post("/api/classes")
    def add_class(body: ClassBody):
        return session.add_class(body.name, body.color)

    @app.patch("/api/classes/{value}")
    def update_class(value: int, body: ClassBody):
        return session.update_class(value, body.name, body.color)

    @app.put("/api/settings")
    def settings(body: SettingsBody):
        changes = body.model_dump(include=body.model_fields_set)
        if "backbone" in changes and changes["backbone"] not in engine.backbones():
            raise SessionError(f"backbone must be one of {engine.backbones()}, got {changes['backbone']!r} (a ViT "
                               "is offered when the app is started with --backbone)")
        for flag in ("crf", "live"):
            if flag in changes and changes[flag] is None:
                raise SessionError(f"{flag} must be true or false")
        backbone_changed = "backbone" in changes and changes["backbone"] != session.settings.get("backbone")
        result = session.update_settings(**changes)
        if backbone_changed:
            engine.backbone_changed()
        return {**result, "backbones": engine.backbones(), "backbone_weights": engine.backbone_weights()}

    # ---- train and predict -------------------------------------------------------------------
    @app.post("/api/train")
    async def train(request: Request, body: TrainBody = Body(TrainBody())):
        return await outcome(request, engine, engine.submit_train(body.image, body.region))

    @app.post("/api/predict")
    async def predict(request: Request, body: PredictBody):
        if body.scope == "all":
            return engine.predict_all().record()
        if body.image is None:
            raise SessionError('give {"image": ID} (or {"scope": "all"})')
        if body.region is not None:
            return {"model": engine.model_state(),
                    "prediction": await outcome(request, engine, engine.submit_region(body.image, body.region))}
        store = await outcome(request, engine, engine.submit_prediction(body.image))
        return {"model": engine.model_state(), "fractions": engine.fractions_of(store)}

    async def rendered(request: Request, image_id: str, render):
        engine.refuse_chunked(image_id, "prediction")
        store = await outcome(request, engine, engine.submit_prediction(image_id))
        return png(await run_in_threadpool(render, store),
                   {"X-Model": str(store.model), "X-CRF": "true" if store.crf else "false"})

    @app.get("/api/images/{image_id}/prediction.png")
    async def prediction(request: Request, image_id: str):
        return await rendered(request, image_id, engine.prediction_png)

    @app.get("/api/images/{image_id}/mask.png")
    async def mask(request: Request, image_id: str):
        return await rendered(request, image_id, engine.mask_png)

    @app.get("/api/images/{image_id}/uncertainty.png")
    async def uncertainty(request: Request, image_id: str):
        return await rendered(request, image_id, engine.uncertainty_png)

    @app.get("/api/images/{image_id}/fractions")
    async def fractions(request: Request, image_id: str):
        store = await outcome(request, engine, engine.submit_prediction(image_id))
        return {"classes": engine.fractions_of(store)}

    # ---- measure (the Measure panel: alibi_vit.measure on the prediction shown) -------------------------
    @app.post("/api/images/{image_id}/measure")
    def measure_image(image_id: str):
        return start_image_measurement(engine, image_id).record()

    # ---- save -------------------------------------------------------------------------------
    @app.post("/api/save")
    def save(body: SaveBody):
        return engine.save(body.what, body.scope, body.image).record()

    @app.get("/api/jobs/{job_id}")
    def job(job_id: str):
        return engine.job(job_id).record()

    @app.delete("/api/jobs/{job_id}")
    def cancel(job_id: str):
        job = engine.job(job_id)
        job.cancelled.set()
        return job.record()

    add_volume_routes(app, session, engine, volumes, png)
    return app


def add_volume_routes(app: FastAPI, session: Session, engine: Engine, volumes: Volumes, png) -> None:
    """The volume mode's API (:mod:`~alibi_vit.app.volume`; API.md "Volumes"): slices of a volume in
    each view, their labels and predictions, strokes on a slice, Train and Save. Compute runs on the
    engine's worker, after the 2D Train and predictions already queued at the same priority."""
    async def on_worker(request: Request, key, fn):
        return await outcome(request, engine, engine.scheduler.submit(key, fn, NOW))

    @app.get("/api/volumes/{volume_id}/slice/{view}/{index}.png")
    def volume_slice(volume_id: str, view: str, index: int):
        return png(volumes.slice_png(volume_id, view, index))

    @app.get("/api/volumes/{volume_id}/labels/{view}/{index}.png")
    def volume_labels(volume_id: str, view: str, index: int):
        data, version = volumes.labels_png(volume_id, view, index, session.classes)
        return png(data, {"X-Labels-Version": str(version)})

    @app.get("/api/volumes/{volume_id}/prediction/{view}/{index}.png")
    async def volume_prediction(request: Request, volume_id: str, view: str, index: int):
        volumes.check_slice(volume_id, view, index)
        volumes.trained()
        model = volumes.model["id"]
        data, fractions = await on_worker(request, ("volume-slice", volume_id, view, index, model),
                                          lambda: volumes.prediction_png(volume_id, view, index, session.classes))
        return png(data, {"X-Model": str(model), "X-Fractions": json.dumps(fractions)})

    def label_answer(volume_id: str, version: int) -> dict:
        return {"version": version, "labelled": volumes.counts(volume_id)}

    @app.post("/api/volumes/{volume_id}/strokes")
    def volume_stroke(volume_id: str, body: VolumeStrokeBody):
        axis, index = volumes.check_slice(volume_id, body.view, body.index)
        stroke = session.check_stroke(volumes.entry(volume_id).plane_shape(axis), body.cls, body.radius,
                                      [list(p) for p in body.points], body.erase)
        return label_answer(volume_id, volumes.add_stroke(volume_id, body.view, index, stroke))

    @app.post("/api/volumes/{volume_id}/undo")
    def volume_undo(volume_id: str, body: UndoBody | None = Body(None)):
        return label_answer(volume_id, volumes.undo(volume_id, expected_version=body and body.version))

    @app.post("/api/volumes/{volume_id}/redo")
    def volume_redo(volume_id: str, body: UndoBody | None = Body(None)):
        return label_answer(volume_id, volumes.undo(volume_id, redo=True, expected_version=body and body.version))

    @app.post("/api/volumes/train")
    async def volume_train(request: Request):
        return {"model": await on_worker(request, ("volume-train",), volumes.train)}

    @app.post("/api/volumes/{volume_id}/measure")
    def volume_measure(volume_id: str, body: VolumeMeasureBody):
        """A background job measuring the prediction of the slice shown, or of the whole volume (predicted first
        into a mask, as its Save writes it)."""
        slice_given = body.view is not None or body.index is not None
        if body.whole == slice_given or (slice_given and (body.view is None or body.index is None)):
            raise SessionError('measure either a slice, {"view": "xy"|"xz"|"yz", "index": n}, or the whole volume, '
                               '{"whole": true}')
        if body.whole:
            return start_volume_measurement(engine, volumes, volume_id).record()
        return start_slice_measurement(engine, volumes, volume_id, body.view, body.index).record()

    @app.post("/api/volumes/{volume_id}/save")
    def volume_save(volume_id: str, body: VolumeSaveBody):
        """A background job (as a 2D Save), off the worker: slices and overlays are shown meanwhile."""
        what, name = volumes.check_save(volume_id, body.what), volumes.entry(volume_id).name

        def run(job):
            written = {}

            def progress(done, total):
                job.done, job.total = done, total
                if job.cancelled.is_set():
                    raise Cancelled("cancelled")

            try:
                volumes.save(volume_id, engine.out, what, progress, written)
            except Cancelled:
                kept = f"; {', '.join(written)} written" if written else ""
                return job.finish("cancelled", f"cancelled after {job.done} of {job.total} steps{kept}")
            job.finish("done", f"saved {', '.join(written)} of {name} to {engine.out}")

        return engine.start_job(1, engine.out, run).record()
