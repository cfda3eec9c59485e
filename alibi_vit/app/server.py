"""The app's HTTP server: the page's static files and the JSON/PNG API of ``API.md``.

Built on FastAPI (Starlette routing and static files, request validation with readable 4xx
answers) served by uvicorn: both well kept, pure Python wheels, and the stack the Python data
tools' local servers are usually built on. Handlers are plain functions, which FastAPI runs on a
thread pool, so a long request never blocks the others; compute goes through the engine's single
worker thread.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from urllib.parse import urlsplit

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from .engine import Engine
from .session import Session, SessionError

__all__ = ["STATIC", "TOKEN_COOKIE", "create_app"]

STATIC = Path(__file__).parent / "static"
TOKEN_COOKIE = "alibi_vit_token"


def create_app(session: Session, engine: Engine, token: str | None = None, max_upload_mb: float = 1024,
               hosts=None):
    """The ASGI application. ``token``: when set, every request must carry it (query ``token``,
    header ``X-Token`` or the cookie set when ``/`` is opened with it). ``hosts``: when set, the only
    ``Host`` headers accepted (a tokenless app on 127.0.0.1 names its own addresses, so a web page
    whose domain was re-pointed at 127.0.0.1, DNS rebinding, cannot reach it)."""
    app = FastAPI(title="alibi-vit app", docs_url=None, redoc_url=None, openapi_url=None)
    max_upload = int(max_upload_mb * (1 << 20))

    @app.middleware("http")
    async def check_token(request: Request, call_next):
        if hosts is not None and request.headers.get("host") not in hosts:
            return JSONResponse({"detail": f"host {request.headers.get('host')!r} refused: open the URL printed by "
                                           "alibi-vit app"}, status_code=403)
        origin = request.headers.get("origin")
        if origin and urlsplit(origin).netloc != request.headers.get("host"):
            # Another site's page in the same browser (cross-site request forgery): the page itself is same-origin.
            return JSONResponse({"detail": f"cross-origin request from {origin} refused"}, status_code=403)
        if token is not None:
            given = (request.query_params.get("token") or request.headers.get("x-token")
                     or request.cookies.get(TOKEN_COOKIE) or "")
            if not secrets.compare_digest(given.encode(), token.encode()):
                return JSONResponse({"detail": "missing or wrong token: open the URL printed by alibi-vit app"},
                                    status_code=403)
        response = await call_next(request)
        if token is not None and request.url.path == "/" and request.query_params.get("token"):
            response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict")
        return response

    @app.exception_handler(SessionError)
    async def session_error(request: Request, err: SessionError):
        return JSONResponse({"detail": str(err)}, status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, err: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in err.errors())
        return JSONResponse({"detail": f"malformed request ({problems})"}, status_code=422)

    @app.exception_handler(ValueError)
    async def value_error(request: Request, err: ValueError):  # the engine's checks of images and labels
        return JSONResponse({"detail": str(err)}, status_code=400)

    def png(data: bytes) -> Response:
        return Response(data, media_type="image/png", headers={"Cache-Control": "no-store"})

    @app.get("/")
    def index():
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    # ---- state ------------------------------------------------------------------------------
    def image_record(image_id: str) -> dict:
        entry = session.entry(image_id)
        features = engine.feature_state(image_id)
        prediction = engine.predictions.get(image_id)
        height, width = (entry.shape[:2] or (None, None))
        return {"id": image_id, "name": entry.name, "width": width, "height": height,
                "features": features["state"], "progress": features["progress"], "error": features["error"],
                "labelled": session.counts(image_id), "version": entry.version,
                "prediction": None if prediction is None else {"model": prediction["model"]}}

    @app.get("/api/state")
    def state():
        return {"session": str(session.folder), "classes": session.classes,
                "images": [image_record(i) for i in list(session.images)],
                "settings": {**session.settings, "backbones": engine.backbones()},
                "model": engine.model, "limits": {"max_upload_mb": max_upload_mb}}

    # ---- images -----------------------------------------------------------------------------
    @app.get("/api/images/{image_id}/display.png")
    def display(image_id: str):
        return png(engine.display_png(image_id))

    @app.post("/api/images/{image_id}/open")
    def open_image(image_id: str):
        engine.open(image_id)
        return image_record(image_id)

    @app.post("/api/images")
    async def upload(request: Request, name: str = ""):
        declared = request.headers.get("content-length")
        too_big = SessionError(f"{Path(name).name or 'the upload'} is larger than the upload limit of "
                               f"{max_upload_mb:g} MB (start the app with --max-upload-mb to raise it)", status=413)
        if declared and declared.isdigit() and int(declared) > max_upload:
            raise too_big
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > max_upload:
                raise too_big
        if not data:
            raise SessionError(f"{Path(name).name or 'the upload'} is empty")
        return {"ids": await run_in_threadpool(session.add_upload, name, bytes(data))}

    @app.post("/api/images/add")
    def add_path(body: dict = Body(...)):
        """Add an image file or folder from disk: only inside the folders the app was started with."""
        if not isinstance(body.get("path"), str):
            raise SessionError('give {"path": "FILE_OR_FOLDER"}')
        return {"ids": session.add_path(body["path"])}

    # ---- labels -----------------------------------------------------------------------------
    @app.get("/api/images/{image_id}/labels.png")
    def labels(image_id: str):
        from .session import png_bytes

        return png(png_bytes(session.label_image(image_id)))

    def label_answer(image_id: str, version: int) -> dict:
        return {"version": version, "labelled": session.counts(image_id)}

    @app.post("/api/images/{image_id}/strokes")
    def stroke(image_id: str, body: dict = Body(...)):
        version = session.add_stroke(image_id, body.get("class"), body.get("radius"), body.get("points"),
                                     bool(body.get("erase", False)))
        return label_answer(image_id, version)

    @app.post("/api/images/{image_id}/undo")
    def undo(image_id: str):
        return label_answer(image_id, session.undo(image_id))

    @app.post("/api/images/{image_id}/redo")
    def redo(image_id: str):
        return label_answer(image_id, session.undo(image_id, redo=True))

    # ---- classes and settings -------------------------------------------------------------------
    @app.post("/api/classes")
    def add_class(body: dict = Body(...)):
        return session.add_class(body.get("name"), body.get("color"))

    @app.patch("/api/classes/{value}")
    def update_class(value: int, body: dict = Body(...)):
        return session.update_class(value, body.get("name"), body.get("color"))

    @app.put("/api/settings")
    def settings(body: dict = Body(...)):
        changes = {}
        if "backbone" in body:
            if body["backbone"] not in engine.backbones():
                raise SessionError(f"backbone must be one of {engine.backbones()}, got {body['backbone']!r} (a ViT "
                                   "is offered when the app is started with --backbone)")
            changes["backbone"] = body["backbone"]
        for flag in ("crf", "live"):
            if flag in body:
                if not isinstance(body[flag], bool):
                    raise SessionError(f"{flag} must be true or false")
                changes[flag] = body[flag]
        unknown = set(body) - {"backbone", "crf", "live"}
        if unknown:
            raise SessionError(f"unknown settings {sorted(unknown)}")
        result = session.update_settings(**changes)
        if "backbone" in changes or "crf" in changes:
            engine.settings_changed()
        return {**result, "backbones": engine.backbones()}

    # ---- train and predict -------------------------------------------------------------------
    @app.post("/api/train")
    def train(body: dict = Body(default={})):
        return engine.train(body.get("image"))

    @app.get("/api/images/{image_id}/prediction.png")
    def prediction(image_id: str):
        return png(engine.prediction_png(image_id))

    @app.get("/api/images/{image_id}/mask.png")
    def mask(image_id: str):
        return png(engine.mask_png(image_id))

    @app.get("/api/images/{image_id}/uncertainty.png")
    def uncertainty(image_id: str):
        return png(engine.uncertainty_png(image_id))

    @app.get("/api/images/{image_id}/fractions")
    def fractions(image_id: str):
        return {"classes": engine.fractions(image_id)}

    # ---- save -------------------------------------------------------------------------------
    @app.post("/api/save")
    def save(body: dict = Body(...)):
        return engine.save(body.get("what"), body.get("scope", "image"), body.get("image")).record()

    @app.get("/api/jobs/{job_id}")
    def job(job_id: str):
        return engine.job(job_id).record()

    @app.delete("/api/jobs/{job_id}")
    def cancel(job_id: str):
        job = engine.job(job_id)
        job.cancelled.set()
        return job.record()

    return app
