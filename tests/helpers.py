"""Tiny random-init models, feature and command helpers, and benchmark-script loading shared by the tests."""

import argparse
import contextlib
import importlib
import os
import sys
from pathlib import Path

import timm
import torch

import alibi_vit  # noqa: F401  (registers the models)

# Small enough for CPU tests; LayerScale at 1 so every block visibly changes the tokens
# (DINOv2's 1e-5 would hide what attention does in a random-init model).
TINY = dict(depth=2, embed_dim=32, num_heads=2, init_values=1.0)


def tiny_model(name="alibi_vit_small_patch14_reg4_dinov2", dtype=torch.float64, seed=0, **kwargs):
    torch.manual_seed(seed)
    return timm.create_model(name, **{**TINY, **kwargs}).eval().to(dtype)


def features(model, images, **kwargs):
    """:func:`alibi_vit.patch_features` without autograd."""
    from alibi_vit import patch_features

    with torch.no_grad():
        return patch_features(model, images, **kwargs)


def shuffle_patches(x, patch: int, perm):
    """Image ``x`` (B, C, h·patch, w·patch) with its patches rearranged: patch ``i`` (row-major) of the
    result is patch ``perm[i]`` of ``x``."""
    b, c, height, width = x.shape
    h, w = height // patch, width // patch
    patches = x.unfold(2, patch, patch).unfold(3, patch, patch).reshape(b, c, h * w, patch, patch)
    return patches[:, :, perm].reshape(b, c, h, w, patch, patch).permute(0, 1, 2, 4, 3, 5).reshape(x.shape)


def run_subcommand(cli_module, argv):
    """Parse ``argv`` with an ``alibi-vit`` subcommand module's own arguments and run it in-process."""
    parser = argparse.ArgumentParser()
    cli_module.add_arguments(parser)
    return cli_module.run(parser.parse_args(argv))


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_module(name: str):
    """A script of benchmarks/ imported as a module (its own ``from report import ...`` included)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


# A sitecustomize that makes modules unimportable, as they are on the lent GPU machines' image.
_BLOCKER = """import sys

class _MissingOnTheGpuImage:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (the GPU image lacks it)", name=name)
        return None

sys.meta_path.insert(0, _MissingOnTheGpuImage())
"""


def gpu_image_env(tmp_path, blocked) -> dict:
    """Environment of a CPU process that simulates the GPU image: the ``blocked`` modules cannot be imported,
    Triton runs its interpreter and no CUDA device is visible."""
    site = tmp_path / "gpu_image_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_BLOCKER.format(blocked=set(blocked)))
    return {**os.environ, "PYTHONPATH": str(site), "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}


def full_disk(monkeypatch, hit) -> None:
    """A disk that fills up: a file opened for writing (``open``, ``os.fdopen``) whose path satisfies
    ``hit(path: str)`` takes half of the first bytes written to it, then raises ENOSPC."""
    import builtins
    import errno

    real_open, real_fdopen = builtins.open, os.fdopen

    class FullFile:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(data[: max(1, len(data) // 2)])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def writing(mode) -> bool:
        return any(m in mode for m in "wax+")

    def open_(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return FullFile(f) if isinstance(file, (str, os.PathLike)) and writing(mode) and hit(os.fspath(file)) else f

    def fdopen(fd, mode="r", *args, **kwargs):
        f = real_fdopen(fd, mode, *args, **kwargs)
        return FullFile(f) if writing(mode) and hit(os.readlink(f"/proc/self/fd/{fd}")) else f

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(os, "fdopen", fdopen)


def serve_app(app):
    """An ASGI app on a real uvicorn server in this process (so a client can go away mid-request):
    (base URL, stop())."""
    import socket
    import threading
    import time

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)

    def stop():
        server.should_exit = True
        thread.join(30)
        sock.close()

    return f"http://127.0.0.1:{sock.getsockname()[1]}", stop


def png_pixels(response):
    """The pixels of an app's PNG answer (an HTTP response), after checking it is a 200."""
    import io

    import numpy as np
    from PIL import Image

    assert response.status_code == 200, response.text
    return np.asarray(Image.open(io.BytesIO(response.content)))


@contextlib.contextmanager
def app_clients(session_folder):
    """``start(folder) -> (session, engine, TestClient)``: the app on an image folder, with its session in
    ``session_folder``; every engine started is closed when the block ends."""
    from fastapi.testclient import TestClient

    from alibi_vit.app.engine import Engine
    from alibi_vit.app.server import create_app
    from alibi_vit.app.session import Session

    engines = []

    def start(folder):
        session = Session(session_folder, [folder], allowed_roots=[folder])
        engines.append(Engine(session))
        return session, engines[-1], TestClient(create_app(session, engines[-1]))

    try:
        yield start
    finally:
        for engine in engines:
            engine.close()


def finished_job(client, started, timeout: float = 60) -> dict:
    """The app's record of a background job (``started``: the answer that began it) once it has ended."""
    import time

    assert started.status_code == 200, started.text
    job, deadline = started.json(), time.monotonic() + timeout
    while job["state"] == "running":
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
        job = client.get(f"/api/jobs/{job['job']}").json()
    return job


# A script for ``python -c``: run the CLI in that process with its arguments, then say whether torch was
# imported on the way (what a fresh process costs a user).
TORCH_PROBE = ("import sys\nfrom alibi_vit.cli.main import main\ntry:\n    code = main(sys.argv[1:])\n"
               "except SystemExit as stop:\n    code = stop.code\nprint('torch imported' if 'torch' in sys.modules "
               "else 'torch not imported')\nsys.exit(code)\n")


def run_in_fresh_process(args, cwd, script: str = TORCH_PROBE, timeout: float = 120):
    """``python -c script args`` in ``cwd`` with this checkout first on the path; the completed process."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", script, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
