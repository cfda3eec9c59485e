"""`alibi-vit app` end to end in a real browser: Playwright drives Debian's Chromium (/usr/bin/chromium,
never a downloaded browser) against the server started as a subprocess, the way a person uses it:
real mouse strokes, clicks and keys on the page; the server's answers are checked over HTTP.

    ALIBI_VIT_SCREENSHOT=1 pytest tests/test_app_browser.py   # also writes benchmarks/results/app_screenshot.png
"""

from __future__ import annotations

import functools
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import benchmark_module

app_driver = benchmark_module("app_driver")   # benchmarks/app_driver.py, shared with benchmarks/bench_app.py
CHROMIUM, Server, alibi_vit_command, to_screen, wait_timing, strokes_inside = (
    app_driver.CHROMIUM, app_driver.Server, app_driver.alibi_vit_command, app_driver.to_screen,
    app_driver.wait_timing, app_driver.strokes_inside)
# A stroke through image points, then waits until the server has it.
draw = functools.partial(app_driver.draw, steps=6, wait_sent=True)

if not CHROMIUM.exists():
    pytest.skip("the browser tests need Debian's Chromium at /usr/bin/chromium (apt-get install chromium)",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api",
                               reason="the browser tests need the playwright package (pip install playwright)")

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOT = ROOT / "benchmarks" / "results" / "app_screenshot.png"
SIZE = 256           # the test micrograph: big enough for three phases of several grains, small enough for seconds
PHASES = ("matrix", "speckle", "stripes")   # phase 1..3 of synthetic_micrograph (smooth, speckle, stripes)
VIEWPORT = {"width": 1280, "height": 800}


# ------------------------------------------------------------------------------------------ helpers
@pytest.fixture(scope="module")
def micrograph(tmp_path_factory):
    """A folder with one 3-phase 16-bit TIFF micrograph (m0.tif) and its ground-truth mask (1..3)."""
    import tifffile

    from alibi_vit.synthetic import synthetic_micrograph

    folder = tmp_path_factory.mktemp("images")
    image, mask = synthetic_micrograph(SIZE, 3, seed=3)
    tifffile.imwrite(folder / "m0.tif", image)
    return folder, mask


@pytest.fixture
def servers():
    """Start servers with ``servers(data, session, ...)``; every one is stopped at the end."""
    started: list[Server] = []

    def start(*args, **kwargs) -> Server:
        server = Server(*args, **kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = app_driver.launch_chromium(p)
        yield b
        b.close()


@pytest.fixture
def new_page(browser):
    """A fresh page (own context) at 1280×800; fails the test on an uncaught script error."""
    contexts, errors = [], []

    def make():
        context = browser.new_context(viewport=VIEWPORT)
        contexts.append(context)
        page = context.new_page()
        page.set_default_timeout(30_000)
        page.on("pageerror", lambda err: errors.append(str(err)))
        return page

    yield make
    for context in contexts:
        context.close()
    assert not errors, f"script errors in the page: {errors}"


def open_app(page, server: Server):
    page.goto(server.url)
    page.wait_for_selector(".image-row")


def open_image(page, image_id: str = "m0"):
    page.click(f'.image-row[data-id="{image_id}"]')
    wait_timing(page, "image_shown", image_id, 1, timeout_ms=30_000)
    wait_timing(page, "features_ready", image_id, 1, timeout_ms=60_000)
    page.keyboard.press("0")   # fit


def add_class(page, name: str) -> int:
    before = page.locator(".class-row").count()
    page.fill("#class-name", name)
    page.click("#add-class")
    page.wait_for_function("n => document.querySelectorAll('.class-row').length > n", arg=before)
    row = page.locator(".class-row", has_text=name)
    return int(row.get_attribute("data-value"))


def label_layer_counts(page, colours: dict[int, str]) -> dict[int, int]:
    """Pixels of each class colour on the page's label layer (the colourised labels.png)."""
    return {int(k): v for k, v in page.evaluate(
        """colours => {
            const c = document.getElementById('label-layer');
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            const want = Object.entries(colours).map(([v, hex]) =>
                [v, parseInt(hex.slice(1, 3), 16), parseInt(hex.slice(3, 5), 16), parseInt(hex.slice(5, 7), 16)]);
            const counts = Object.fromEntries(want.map(([v]) => [v, 0]));
            for (let i = 0; i < d.length; i += 4) {
                if (!d[i + 3]) continue;
                for (const [v, r, g, b] of want) if (d[i] === r && d[i + 1] === g && d[i + 2] === b) { counts[v]++; break; }
            }
            return counts;
        }""", {str(k): v for k, v in colours.items()}).items()}


def value_counts(labels: np.ndarray, values) -> dict[int, int]:
    return {v: int((labels == v).sum()) for v in values}


def miou(pred: np.ndarray, truth: np.ndarray, phases) -> float:
    ious = []
    for p in phases:
        inter = np.logical_and(pred == p, truth == p).sum()
        union = np.logical_or(pred == p, truth == p).sum()
        ious.append(inter / union)
    return float(np.mean(ious))


def wait_status(page, kind: str = "error"):
    page.wait_for_function("k => document.getElementById('status').classList.contains(k)", arg=kind)
    return page.inner_text("#status")


def detail(data: bytes) -> str:
    return json.loads(data)["detail"]


# ------------------------------------------------------------------------------------------ tests
def test_scribble_train_reload_save_apply(micrograph, servers, new_page, tmp_path):
    """The main flow: add three classes in the page, scribble inside grains of each phase with the
    mouse, train, and get a mask of mIoU ≥ 0.7; a reload shows every stroke; Save writes a model that
    ``segment apply`` turns into the very same mask."""
    data, truth = micrograph
    server = servers(data, tmp_path / "session")
    page = new_page()
    open_app(page, server)
    open_image(page)
    assert page.locator('.image-row[data-id="m0"]').get_attribute("class").split().count("selected") == 1
    assert page.locator(".image-row[data-id=m0]").get_attribute("data-features") == "ready"

    values = {phase: add_class(page, name) for phase, name in enumerate(PHASES, start=1)}
    assert sorted(values.values()) == [1, 2, 3]
    page.keyboard.press("]")   # brush radius 4 → 5 (keys [ and ])
    assert page.input_value("#brush-size") == "5"
    radius = 5
    for phase, value in values.items():
        page.keyboard.press(str(value))   # keys 1..9 pick the class
        assert "selected" in page.locator(f'.class-row[data-value="{value}"]').get_attribute("class")
        for stroke in strokes_inside(truth, phase, 3, radius):
            draw(page, stroke)

    labels = server.png("/api/images/m0/labels.png")
    assert labels.shape == truth.shape and labels.dtype == np.uint8
    for phase, value in values.items():   # every labelled pixel lies in its phase: strokes land where drawn
        assert (labels == value).sum() > 200
        assert (truth[labels == value] == phase).all()
    state = server.json("GET", "/api/state")
    assert {int(k): n for k, n in state["images"][0]["labelled"].items()} == value_counts(labels, values.values())

    page.click("#train")
    wait_timing(page, "train", None, 1, timeout_ms=120_000)
    assert page.locator("#overlay-layer").is_visible()
    assert page.get_attribute("#overlay-layer", "data-kind") == "prediction"
    fractions = page.locator("#fractions tbody tr")
    assert fractions.count() == 3
    table = page.inner_text("#fractions")
    assert all(name in table for name in PHASES) and "%" in table
    shown = sum(float(t.split("%")[0]) for t in fractions.locator("td.num").all_inner_texts())
    assert abs(shown - 100) < 0.5

    if os.environ.get("ALIBI_VIT_SCREENSHOT"):   # the docs' picture (docs/app.md): the micrograph shows through the overlay
        page.fill("#overlay-opacity", "40")
        page.evaluate("() => document.activeElement && document.activeElement.blur()")
        page.mouse.move(*to_screen(page, SIZE * 0.62, SIZE * 0.4))   # the brush circle on the image
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOT))

    mask = server.png("/api/images/m0/mask.png")
    phase_of = np.zeros(256, np.int64)
    for phase, value in values.items():
        phase_of[value] = phase
    score = miou(phase_of[mask], truth, values)
    assert score >= 0.7, f"mIoU {score:.3f} of the app's mask against the ground truth"

    page.keyboard.press("o")   # overlay off and on; its opacity slider
    assert not page.locator("#overlay-layer").is_visible()
    page.keyboard.press("o")
    assert page.locator("#overlay-layer").is_visible()
    page.fill("#overlay-opacity", "60")
    assert page.evaluate("() => getComputedStyle(document.getElementById('overlay-layer')).opacity") == "0.6"
    page.keyboard.press("u")   # the uncertainty instead of the prediction, and back
    page.wait_for_function("() => document.getElementById('overlay-layer').dataset.kind === 'uncertainty'")
    page.keyboard.press("u")
    page.wait_for_function("() => document.getElementById('overlay-layer').dataset.kind === 'prediction'")


    # A reload shows every stroke: labels come from the server.
    colours = {c["value"]: c["color"] for c in server.json("GET", "/api/state")["classes"]}
    page.reload()
    page.wait_for_function("() => window.app.labels !== null && window.app.current === 'm0'")
    after = server.png("/api/images/m0/labels.png")
    np.testing.assert_array_equal(after, labels)
    assert label_layer_counts(page, colours) == value_counts(labels, colours)

    # Save labels and model through the page; segment apply with that model gives the app's mask.
    for what in ("masks", "overlays", "fractions"):
        page.uncheck(f"#save-{what}")
    page.check("#save-labels")
    page.check("#save-model")
    page.check("#scope-image")
    page.click("#save")
    page.wait_for_selector("#save-panel[data-state=done]", timeout=60_000)
    out = Path(page.inner_text("#save-folder").strip())
    assert (out / "model").is_dir()
    from PIL import Image

    saved = sorted((out / "labels").glob("*"))
    assert [p.name for p in saved] == ["m0_labels.png"]
    np.testing.assert_array_equal(np.asarray(Image.open(saved[0])), labels)
    applied = tmp_path / "applied"
    run = subprocess.run([*alibi_vit_command(), "segment", "apply", "--model", str(out / "model"), "--images",
                          str(data), "--out", str(applied)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    np.testing.assert_array_equal(np.asarray(Image.open(applied / "m0_mask.png")), mask)
    assert server.alive()


def test_restart_keeps_classes_and_labels(micrograph, servers, new_page, tmp_path):
    """Classes (renamed and recoloured in the page), strokes, an undone and an erased stroke: a new
    server process on the same session folder shows them all again."""
    data, truth = micrograph
    session = tmp_path / "session"
    first = servers(data, session)
    page = new_page()
    open_app(page, first)
    open_image(page)
    matrix, other = add_class(page, "matrix"), add_class(page, "pores")
    page.dblclick(f'.class-row[data-value="{other}"] .name')   # rename by double-click
    page.fill('.class-row input.rename', "pore space")
    page.keyboard.press("Enter")
    page.wait_for_selector(f'.class-row[data-value="{other}"] .name:text-is("pore space")')
    page.locator(f'.class-row[data-value="{matrix}"] input[type=color]').fill("#ff8800")   # recolour
    page.wait_for_function(f"() => window.app.state.classes.find(c => c.value === {matrix}).color === '#ff8800'")

    page.keyboard.press(str(matrix))
    draw(page, [(40, 40), (80, 60)])
    page.keyboard.press(str(other))
    draw(page, [(150, 150), (200, 150), (200, 200)])
    two = first.png("/api/images/m0/labels.png")
    draw(page, [(40, 200), (100, 200)])   # a third stroke, undone, redone, undone again
    three = first.png("/api/images/m0/labels.png")
    assert (three != two).any()
    page.keyboard.press("Control+z")
    page.wait_for_function("() => document.getElementById('status').textContent === 'undone'")
    np.testing.assert_array_equal(first.png("/api/images/m0/labels.png"), two)
    page.keyboard.press("Control+Shift+z")
    page.wait_for_function("() => document.getElementById('status').textContent === 'redone'")
    np.testing.assert_array_equal(first.png("/api/images/m0/labels.png"), three)
    page.click("#undo")
    page.wait_for_function("() => document.getElementById('status').textContent === 'undone'")
    np.testing.assert_array_equal(first.png("/api/images/m0/labels.png"), two)
    page.keyboard.press("e")   # the eraser over part of the first stroke
    assert page.get_attribute("#eraser", "aria-pressed") == "true"
    draw(page, [(40, 40), (50, 45)])
    page.keyboard.press("e")
    server_labels = first.png("/api/images/m0/labels.png")
    assert 0 < (server_labels == matrix).sum() < (two == matrix).sum()
    assert (server_labels == other).sum() == (two == other).sum()
    page.wait_for_function("() => window.app.labels !== null && window.app.pendingStrokes === 0")
    # The view: the wheel zooms around the cursor, right drag and space + drag pan (and draw nothing).
    box = page.locator("#canvas-area").bounding_box()
    cx, cy = box["x"] + 300, box["y"] + 250
    under = "([x, y]) => { const r = document.getElementById('canvas-area').getBoundingClientRect(), v = window.app.view;" \
            " return [(x - r.left - v.tx) / v.scale, (y - r.top - v.ty) / v.scale, v.scale]; }"
    page.mouse.move(cx, cy)
    x0, y0, s0 = page.evaluate(under, [cx, cy])
    for _ in range(3):
        page.mouse.wheel(0, -200)
    x1, y1, s1 = page.evaluate(under, [cx, cy])
    assert s1 > 1.5 * s0 and abs(x1 - x0) < 1e-6 and abs(y1 - y0) < 1e-6
    version = first.json("GET", "/api/state")["images"][0]["version"]
    view = page.evaluate("() => window.app.view")
    page.mouse.down(button="right")
    page.mouse.move(cx + 50, cy + 30, steps=3)
    page.mouse.up(button="right")
    moved = page.evaluate("() => window.app.view")
    assert (moved["tx"] - view["tx"], moved["ty"] - view["ty"]) == pytest.approx((50, 30))
    page.keyboard.down(" ")
    page.mouse.down()
    page.mouse.move(cx, cy, steps=3)
    page.mouse.up()
    page.keyboard.up(" ")
    back = page.evaluate("() => window.app.view")
    assert (back["tx"], back["ty"]) == pytest.approx((view["tx"], view["ty"]))
    assert first.json("GET", "/api/state")["images"][0]["version"] == version
    page.keyboard.press("0")

    page.check("#crf")   # settings are the session's too
    page.wait_for_function("() => window.app.state.settings.crf === true")
    page.check("#live")
    page.wait_for_function("() => window.app.state.settings.live === true")
    classes = first.json("GET", "/api/state")["classes"]
    first.stop()

    second = servers(data, session)
    page = new_page()
    open_app(page, second)
    assert second.json("GET", "/api/state")["classes"] == classes
    page.click('.image-row[data-id="m0"]')
    page.wait_for_function("() => window.app.labels !== null")
    assert page.inner_text(f'.class-row[data-value="{matrix}"] .name') == "matrix"
    assert page.inner_text(f'.class-row[data-value="{other}"] .name') == "pore space"
    assert page.input_value(f'.class-row[data-value="{matrix}"] input[type=color]') == "#ff8800"
    assert page.is_checked("#crf") and page.is_checked("#live")
    assert page.input_value("#backbone") == "" and page.inner_text("#backbone") == "classical only"
    np.testing.assert_array_equal(second.png("/api/images/m0/labels.png"), server_labels)
    colours = {c["value"]: c["color"] for c in classes}
    assert label_layer_counts(page, colours) == value_counts(server_labels, colours)


def test_bad_input_shows_the_servers_message(micrograph, servers, new_page, tmp_path):
    """A non-image upload, a duplicate class name, a stroke without classes and Train with one
    class labelled: the page shows the server's own message and the server keeps running. The
    server wants a token here and the page's cookie is dropped: every request carries X-Token."""
    data, truth = micrograph
    server = servers(data, tmp_path / "session", token="s3cret-token")
    page = new_page()
    open_app(page, server)
    page.context.clear_cookies()
    open_image(page)
    page.mouse.click(*to_screen(page, 100, 100))   # no class yet
    assert "add a class" in wait_status(page)

    page.set_input_files("#upload", files=[{"name": "notes.tif", "mimeType": "image/tiff",
                                            "buffer": b"these are my notes, not a TIFF"}])
    shown = wait_status(page)
    code, answer = server.request("POST", "/api/images?name=notes.tif", raw=b"these are my notes, not a TIFF")
    assert code == 400 and detail(answer) in shown
    assert server.alive() and [i["id"] for i in server.json("GET", "/api/state")["images"]] == ["m0"]
    assert page.locator(".image-row").count() == 1

    add_class(page, "matrix")
    add_class(page, "pores")
    page.evaluate("() => { const s = document.getElementById('status'); s.textContent = ''; s.className = ''; }")
    page.fill("#class-name", "Matrix")
    page.click("#add-class")
    shown = wait_status(page)
    code, answer = server.request("POST", "/api/classes", {"name": "Matrix"})
    assert code == 400 and detail(answer) in shown

    page.keyboard.press("1")
    draw(page, [(60, 60), (90, 70)])
    page.click("#train")
    shown = wait_status(page)
    code, answer = server.request("POST", "/api/train", {"image": "m0"})
    assert code == 400 and detail(answer) in shown
    assert not page.locator("#overlay-layer").is_visible()
    assert page.get_attribute("#train", "aria-busy") == "false"
    assert server.alive()
    assert server.json("GET", "/api/state")["model"] is None

    # A good upload: the image is listed and shown.
    from PIL import Image

    png = io.BytesIO()
    Image.fromarray((np.arange(64 * 80) % 251).reshape(64, 80).astype(np.uint8)).save(png, "PNG")
    page.set_input_files("#upload", files=[{"name": "small grey.png", "mimeType": "image/png", "buffer": png.getvalue()}])
    page.wait_for_function("() => window.appTimings.some(t => t.event === 'image_shown' && t.width === 80)")
    images = server.json("GET", "/api/state")["images"]
    assert len(images) == 2 and images[1]["name"].startswith("small") and images[1]["width"] == 80
    new_id = images[1]["id"]
    assert "selected" in page.get_attribute(f'.image-row[data-id="{new_id}"]', "class")
    assert page.evaluate("() => [document.getElementById('image-layer').width, document.getElementById('image-layer').height]") == [80, 64]


def test_speed_benchmark_script_runs(tmp_path):
    """benchmarks/bench_app.py (the app speed figures of docs/app.md) still drives the page: a smoke run."""
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_app.py"), "--smoke", "--big", "0",
                          "--strokes", "1", "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "app_speed_cpu.json").read_text())
    assert result["measured_s"]["features_ready_s"] > 0 and result["measured_s"]["stroke_to_overlay_s"] > 0
    assert result["measured_s"]["image_shown_4096_s"] is None
    assert "| open a 256² image" in (tmp_path / "app_speed_cpu.md").read_text()
