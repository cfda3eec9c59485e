"""Driving `alibi-vit app` in a browser, shared by benchmarks/bench_app.py and tests/test_app_browser.py.

The server runs as a subprocess (:class:`Server`, which also speaks its HTTP API); Playwright drives
Debian's Chromium (:data:`CHROMIUM`, never a downloaded browser) with real mouse strokes in image
pixels (:func:`to_screen`, :func:`draw`), and the page's own ``window.appTimings`` records tell when
something has happened (:func:`timings`, :func:`wait_timing`).

Import it the way the benchmark scripts import ``report``: with benchmarks/ on ``sys.path`` (the
tests use ``tests.helpers.benchmark_module("app_driver")``).
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-dev-shm-usage"]
SERVING = "alibi-vit app: serving at "   # the line the server prints once it listens


def alibi_vit_command() -> list[str]:
    """The ``alibi-vit`` command of this Python environment (or on PATH, or ``python -m``)."""
    exe = Path(sys.executable).with_name("alibi-vit")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("alibi-vit")
    return [found] if found else [sys.executable, "-m", "alibi_vit.cli.main"]


def launch_chromium(playwright):
    """Headless Chromium from :data:`CHROMIUM` for a ``sync_playwright()`` instance."""
    return playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)


def open_app_page(playwright, server: "Server", timeout_ms: float = 300_000):
    """(browser, page): headless Chromium showing ``server``'s app at 1280×800, every page action waiting up
    to ``timeout_ms`` (the benchmarks' long trainings and fills)."""
    browser = launch_chromium(playwright)
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.set_default_timeout(timeout_ms)
    page.goto(server.url)
    return browser, page


def add_class(page, name: str) -> int:
    """Add a class named ``name`` in the page's class form; returns its value once its row is shown.
    Waiting matters: the form clears its name field when the server answers, so a second name typed
    before that answer would be wiped."""
    before = page.locator(".class-row").count()
    page.fill("#class-name", name)
    page.click("#add-class")
    page.wait_for_function("n => document.querySelectorAll('.class-row').length > n", arg=before)
    row = page.locator(".class-row", has_text=name)
    return int(row.get_attribute("data-value"))


class Server:
    """``alibi-vit app DIR --session SESSION --port 0`` as a subprocess, with a small HTTP client.

    ``url`` is the address the server printed (with its token, if any), ``base`` that without the
    query. Its stderr goes to ``log`` (default: a new file beside the session folder).
    """

    def __init__(self, data: Path, session: Path, *extra: str, token: str | None = None,
                 log: Path | None = None, timeout: float = 120):
        self.token = token
        argv = [*alibi_vit_command(), "app", str(data), "--session", str(session), "--port", "0", *extra]
        if token:
            argv += ["--token", token]
        self.log = log or session.parent / f"{session.name}-server-{time.monotonic_ns()}.log"
        self._log = open(self.log, "w")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1)
        self.url = self._wait_for_url(timeout)
        self.base = self.url.split("?")[0].rstrip("/")
        # Keep reading stdout so the server never blocks on a full pipe.
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    def _wait_for_url(self, timeout: float) -> str:
        found: list[str] = []

        def read():
            for line in self.proc.stdout:
                if line.startswith(SERVING):
                    found.append(line.split("serving at ", 1)[1].strip())
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)   # also ends early when the server exits (its stdout closes)
        if not found:
            self.stop()
            raise RuntimeError(f"alibi-vit app did not start within {timeout} s:\n{self.log.read_text()[-3000:]}")
        return found[0]

    def request(self, method: str, path: str, body=None, raw: bytes | None = None,
                timeout: float = 120) -> tuple[int, bytes]:
        """Status and body of ``method path``: ``body`` is sent as JSON, ``raw`` as bytes (an upload)."""
        headers = {"X-Token": self.token} if self.token else {}
        data = raw
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        elif raw is not None:
            headers["Content-Type"] = "application/octet-stream"
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as res:
                return res.status, res.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def json(self, method: str, path: str, body=None, raw: bytes | None = None, expect: int = 200,
             timeout: float = 120):
        """The JSON answer of :meth:`request`; an AssertionError unless the status is ``expect``."""
        code, data = self.request(method, path, body, raw, timeout)
        if code != expect:
            raise AssertionError(f"{method} {path}: {code} {data[:500]!r} (expected {expect})")
        return json.loads(data)

    def png(self, path: str):
        """A PNG the server sends, as a numpy array."""
        import numpy as np
        from PIL import Image

        code, data = self.request("GET", path)
        if code != 200:
            raise AssertionError(f"GET {path}: {code} {data[:300]!r}")
        return np.asarray(Image.open(io.BytesIO(data)))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


# ------------------------------------------------------------------------------------------ the page
def timings(page, event: str, image: str | None = None) -> list[dict]:
    """The page's ``window.appTimings`` records of ``event`` (of ``image`` unless None), oldest first."""
    return page.evaluate("([e, id]) => window.appTimings.filter(t => t.event === e && (id === null || t.image === id))",
                         [event, image])


def wait_timing(page, event: str, image: str | None, count: int, timeout_ms: float = 300_000) -> dict:
    """Waits for the ``count``-th record of ``event`` (of ``image`` unless None) and returns it."""
    page.wait_for_function(
        "([e, id, n]) => window.appTimings.filter(t => t.event === e && (id === null || t.image === id)).length >= n",
        arg=[event, image, count], timeout=timeout_ms)
    return timings(page, event, image)[count - 1]


def to_screen(page, x: float, y: float) -> tuple[float, float]:
    """Image pixel (column x, row y) → page coordinates of its centre, from the image layer's box
    (the image at its full size, zoomed and panned by the view)."""
    box = page.locator("#image-layer").bounding_box()
    w, h = page.evaluate("() => [window.app.imageWidth, window.app.imageHeight]")
    return box["x"] + (x + 0.5) * box["width"] / w, box["y"] + (y + 0.5) * box["height"] / h


def draw(page, points, steps: int = 8, wait_sent: bool = False) -> None:
    """A stroke with the left mouse button through ``points`` (image px), ``steps`` mouse moves per
    segment; with ``wait_sent``, then waits until the server has it (no stroke pending in the page)."""
    page.mouse.move(*to_screen(page, *points[0]))
    page.mouse.down()
    for p in points[1:]:
        page.mouse.move(*to_screen(page, *p), steps=steps)
    page.mouse.up()
    if wait_sent:
        page.wait_for_function("() => window.app.pendingStrokes === 0")


def slice_to_screen(page, x: float, y: float) -> tuple[float, float]:
    """Pixel (column x, row y) of the volume slice shown → page coordinates of its centre."""
    box = page.locator("#volume-stage").bounding_box()
    scale = page.evaluate("() => window.volumeApp.scale")
    return box["x"] + (x + 0.5) * scale, box["y"] + (y + 0.5) * scale


def draw_on_slice(page, points, steps: int = 6) -> None:
    """A stroke with the left mouse button through ``points`` (pixels of the volume slice shown),
    then waits until the server has it."""
    page.mouse.move(*slice_to_screen(page, *points[0]))
    page.mouse.down()
    for p in points[1:]:
        page.mouse.move(*slice_to_screen(page, *p), steps=steps)
    page.mouse.up()
    page.wait_for_function("() => window.volumeApp.pendingStrokes === 0")


def canvas_pixels(page, selector: str):
    """The RGBA pixels of a canvas of the page, as a (height, width, 4) uint8 array."""
    import numpy as np

    w, h, data = page.evaluate("""sel => { const c = document.querySelector(sel);
        return [c.width, c.height, Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data)]; }""",
                               selector)
    return np.asarray(data, np.uint8).reshape(h, w, 4)


def wait_idle(page, timeout_ms: float = 300_000) -> None:
    """No stroke in flight and no training running (nor queued)."""
    page.wait_for_function("() => window.app.pendingStrokes === 0 && !window.app.training", timeout=timeout_ms)
    time.sleep(0.3)
    page.wait_for_function("() => window.app.pendingStrokes === 0 && !window.app.training", timeout=timeout_ms)


def strokes_inside(mask, phase: int, count: int, radius: int, longest: int = 14,
                   narrow_ok: bool = False) -> list[list[tuple[int, int]]]:
    """``count`` horizontal strokes well inside grains of ``phase`` of ``mask``: each a segment of
    half-length at most ``longest`` whose brush discs stay inside the largest disc that fits in the
    grain there (distance transform), in different grains. A grain too narrow for a half-length of
    2 px is an AssertionError, or with ``narrow_ok`` gets a stroke of that half-length anyway."""
    import numpy as np
    from scipy import ndimage

    inside = mask == phase
    inside[:8], inside[-8:], inside[:, :8], inside[:, -8:] = False, False, False, False
    dist = ndimage.distance_transform_edt(inside)
    rows, cols = np.mgrid[:mask.shape[0], :mask.shape[1]]
    strokes = []
    for _ in range(count):
        y, x = np.unravel_index(np.argmax(dist), dist.shape)
        d = dist[y, x]
        half = int(min(d - radius - 2, longest))
        if half < 2:
            if not narrow_ok:
                raise AssertionError(f"phase {phase}: no grain wide enough for a stroke")
            half = 2
        strokes.append([(x - half, y), (x, y), (x + half, y)])
        dist[(rows - y) ** 2 + (cols - x) ** 2 < (3 * d) ** 2] = 0   # the next stroke elsewhere
    return strokes
