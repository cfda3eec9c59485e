"""What a person sees of `alibi-vit app`: screenshots of the page in Debian's Chromium (driven by
Playwright), compared pixel by pixel with what the screen must show, composed here from the
server's own PNGs: the image's grey values, then the prediction (or uncertainty) in its colours at
the overlay's opacity, then the scribbles at the labels' opacity. The other browser tests read the
page's canvases; a layer stacked under the image is invisible on screen but not in its canvas, so
only a screenshot tells.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import benchmark_module

app_driver = benchmark_module("app_driver")   # benchmarks/app_driver.py, shared with the other browser tests

if not app_driver.CHROMIUM.exists():
    pytest.skip("the browser tests need Debian's Chromium at /usr/bin/chromium (apt-get install chromium)",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api",
                               reason="the browser tests need the playwright package (pip install playwright)")

PHASES = ("matrix", "speckle", "stripes")
OVERLAY_OPACITY, LABEL_OPACITY = 0.5, 0.7   # the page's defaults (index.html's sliders)
# The uncertainty colour scale (stops from certain to uncertain), as the legend in the page shows it.
UNCERTAINTY_STOPS = [(0, "#000004"), (0.25, "#420a68"), (0.5, "#932667"), (0.75, "#dd513a"), (1, "#fcffa4")]
TOLERANCE = 6   # grey levels: rounding in the browser's blending


@pytest.fixture
def servers():
    started = []

    def start(*args, **kwargs):
        started.append(app_driver.Server(*args, **kwargs))
        return started[-1]

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
def page(browser):
    """A fresh 1280×800 page (device scale 1: a screenshot pixel is a page pixel); fails the test on a script error."""
    context = browser.new_context(viewport={"width": 1280, "height": 800}, device_scale_factor=1)
    page = context.new_page()
    page.set_default_timeout(60_000)
    errors = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    yield page
    context.close()
    assert not errors, f"script errors in the page: {errors}"


# ------------------------------------------------------------------------------------------ helpers
def rgb(hex_colour: str) -> np.ndarray:
    return np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)], np.float64)


def uncertainty_colours(values: np.ndarray) -> np.ndarray:
    """RGB of uncertainty grey values 0..255 on the colour scale (linear between its stops)."""
    t = values.astype(np.float64) / 255
    stops = np.array([s for s, _ in UNCERTAINTY_STOPS])
    colours = np.stack([rgb(c) for _, c in UNCERTAINTY_STOPS])
    return np.stack([np.interp(t, stops, colours[:, i]) for i in range(3)], axis=-1)


def blend(under: np.ndarray, colour: np.ndarray, alpha: float, where: np.ndarray) -> np.ndarray:
    """``colour`` over ``under`` at opacity ``alpha`` where ``where`` (per sample), as a browser composites a layer."""
    return np.where(where[:, None], under * (1 - alpha) + colour * alpha, under)


def class_colours(server) -> np.ndarray:
    """(256, 3) RGB of each class value (value 0: none)."""
    table = np.zeros((256, 3))
    for c in server.json("GET", "/api/state")["classes"]:
        table[c["value"]] = rgb(c["color"])
    return table


def screenshot(page) -> np.ndarray:
    """The page as shown, (800, 1280, 3), with the pointer off the image (no brush circle on it)."""
    from PIL import Image

    page.mouse.move(640, 5)   # the top bar
    page.wait_for_function("() => document.getElementById('brush-cursor').hidden")
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
    return np.asarray(Image.open(io.BytesIO(page.screenshot())).convert("RGB")).astype(np.float64)


def covered_by_notes(page, points) -> np.ndarray:
    """Which page points lie under a note drawn over the image (the stale-overlay line, the uncertainty legend)."""
    boxes = page.evaluate("""() => ['#overlay-stale', '#uncertainty-legend'].map(s => document.querySelector(s))
        .filter(e => !e.hidden).map(e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; })""")
    out = np.zeros(len(points), bool)
    for x0, y0, x1, y1 in boxes:
        out |= (points[:, 0] >= x0 - 2) & (points[:, 0] <= x1 + 2) & (points[:, 1] >= y0 - 2) & (points[:, 1] <= y1 + 2)
    return out


def compare(shot, points, expected, what: str, min_share: float = 0.95) -> None:
    """The screenshot's pixels at page ``points`` match ``expected`` RGB (within TOLERANCE) at ``min_share`` of them."""
    xy = np.floor(points).astype(int)
    seen = shot[xy[:, 1], xy[:, 0]]
    error = np.abs(seen - expected).max(axis=1)
    share = float(np.mean(error <= TOLERANCE))
    worst = np.argsort(error)[-3:]
    assert share >= min_share, (
        f"{what}: only {share:.0%} of {len(points)} screen pixels show the expected colours; e.g. at page "
        f"{xy[worst].tolist()} the screen shows {seen[worst].astype(int).tolist()}, "
        f"expected {expected[worst].round().astype(int).tolist()}")


def image_samples(page, rows: slice, cols: slice, step: int):
    """Image pixels (x, y) on a grid over ``rows`` × ``cols`` and the page points of their centres."""
    ys, xs = np.mgrid[rows.start:rows.stop:step, cols.start:cols.stop:step]
    xs, ys = xs.ravel(), ys.ravel()
    box = page.locator("#image-layer").bounding_box()
    w, h = page.evaluate("() => [window.app.imageWidth, window.app.imageHeight]")
    points = np.stack([box["x"] + (xs + 0.5) * box["width"] / w, box["y"] + (ys + 0.5) * box["height"] / h], axis=1)
    return xs, ys, points


def label_three_phases(page, truth, offset=(0, 0)) -> None:
    """Three classes, two strokes inside each phase of ``truth`` (a crop at ``offset`` = (x, y) of the image), Train."""
    values = {phase: app_driver.add_class(page, name) for phase, name in enumerate(PHASES, start=1)}
    for phase, value in values.items():
        page.keyboard.press(str(value))
        for stroke in app_driver.strokes_inside(truth, phase, 2, 4):
            app_driver.draw(page, [(x + offset[0], y + offset[1]) for x, y in stroke], steps=6, wait_sent=True)
    page.click("#train")
    app_driver.wait_timing(page, "train", None, 1, timeout_ms=180_000)
    page.wait_for_function("() => window.app.overlayShown && window.app.labelsShown")


def check_2d_screen(page, server, image: dict, xs, ys, points, what: str, uncertainty=None) -> None:
    """The screen at ``points`` (image pixels ``xs``, ``ys``) shows ``image``'s arrays ("display" grey,
    "mask" classes, "labels" classes) composed at the default opacities."""
    colours = class_colours(server)
    expected = np.repeat(image["display"][ys, xs].astype(np.float64)[:, None], 3, axis=1)
    if uncertainty is None:
        mask = image["mask"][ys, xs]
        expected = blend(expected, colours[mask], OVERLAY_OPACITY, mask > 0)
    else:
        values, mask = uncertainty
        expected = blend(expected, uncertainty_colours(values[ys, xs]), OVERLAY_OPACITY, mask[ys, xs] > 0)
    labels = image["labels"][ys, xs]
    expected = blend(expected, colours[labels], LABEL_OPACITY, labels > 0)
    shot = screenshot(page)
    keep = ~covered_by_notes(page, points)
    assert keep.sum() > 100 and (image["labels"][ys, xs][keep] > 0).sum() > 5, "too few samples on screen"
    compare(shot, points[keep], expected[keep], what)
    # The overlay's colours are there: not the grey image alone (the samples would match it too if
    # prediction and image were alike).
    grey = np.repeat(image["display"][ys, xs].astype(np.float64)[:, None], 3, axis=1)[keep]
    seen = shot[np.floor(points[keep, 1]).astype(int), np.floor(points[keep, 0]).astype(int)]
    assert np.mean(np.abs(seen - grey).max(axis=1) > 3 * TOLERANCE) > 0.5, f"{what}: the screen shows the bare image"


# ------------------------------------------------------------------------------------------ tests
def test_overlay_scribbles_and_uncertainty_are_on_the_screen_of_a_2d_image(tmp_path, servers, page):
    """A 256² micrograph after Train, at the default opacities: every screen pixel over the image is
    its grey value, then the predicted class's colour at 50 %, then the scribbles' at 70 %; the
    uncertainty view likewise with its colour scale."""
    import tifffile

    from alibi_vit.synthetic import synthetic_micrograph

    data = tmp_path / "images"
    data.mkdir()
    image, truth = synthetic_micrograph(256, 3, seed=3)
    tifffile.imwrite(data / "m0.tif", image)
    server = servers(data, tmp_path / "session")
    page.goto(server.url)
    page.click('.image-row[data-id="m0"]')
    app_driver.wait_timing(page, "image_shown", "m0", 1)
    assert (page.input_value("#overlay-opacity"), page.input_value("#label-opacity")) == ("50", "70")
    label_three_phases(page, truth)
    assert page.evaluate("() => window.app.view.scale") >= 1   # pixels are squares of screen pixels: exact samples

    arrays = {"display": server.png("/api/images/m0/display.png"), "mask": server.png("/api/images/m0/mask.png"),
              "labels": server.png("/api/images/m0/labels.png")}
    xs, ys, points = image_samples(page, slice(2, 254), slice(2, 254), 5)
    check_2d_screen(page, server, arrays, xs, ys, points, "prediction overlay and scribbles")

    page.keyboard.press("u")
    page.wait_for_function("() => document.getElementById('overlay-layer').dataset.kind === 'uncertainty'"
                           " && window.app.overlayShown")
    uncertainty = server.png("/api/images/m0/uncertainty.png")   # the whole image is predicted: all of it shown
    check_2d_screen(page, server, arrays, xs, ys, points, "uncertainty view",
                    uncertainty=(uncertainty, arrays["mask"]))


def test_overlay_and_scribbles_are_on_the_screen_of_a_big_image(tmp_path, servers, page):
    """A 1024² OME-Zarr (read chunk by chunk, shown from display tiles), zoomed in to screen pixels:
    after Train the screen shows the tiles' grey values under the prediction and the scribbles at
    the default opacities."""
    from alibi_vit.synthetic import synthetic_micrograph
    from alibi_vit.trainable.writers import ZarrOutput

    base, base_truth = synthetic_micrograph(256, 3, seed=3)
    image, truth = np.tile(base, (4, 4)), np.tile(base_truth, (4, 4))
    data = tmp_path / "images"
    data.mkdir()
    out = ZarrOutput(data / "big.ome.zarr", image.shape, image.dtype, 256)
    out.write((slice(0, 1024), slice(0, 1024)), image)
    out.finish()
    server = servers(data, tmp_path / "session")
    page.goto(server.url)
    page.click('.image-row[data-id="big"]')
    app_driver.wait_timing(page, "image_shown", "big", 1)
    assert page.evaluate("() => window.app.state.images[0].chunked")
    page.mouse.move(*app_driver.to_screen(page, 512, 512))
    while page.evaluate("() => window.app.view.scale") < 1.2:
        page.mouse.wheel(0, -200)
        page.wait_for_timeout(50)
    page.wait_for_function("() => window.app.level === 0 && window.app.labelsShown")
    top, left, bottom, right = page.evaluate("() => window.app.region")
    crop = (slice(top + 30, bottom - 30), slice(left + 30, right - 30))
    label_three_phases(page, truth[crop], offset=(crop[1].start, crop[0].start))

    def mosaic(layer):
        out = np.zeros(image.shape, np.uint8)
        for r in range(2):
            for c in range(2):
                out[r * 512:(r + 1) * 512, c * 512:(c + 1) * 512] = server.png(f"/api/images/big/tiles/{layer}/0/{r}/{c}.png")
        return out

    arrays = {"display": mosaic("image"), "mask": mosaic("prediction"), "labels": mosaic("labels")}
    xs, ys, points = image_samples(page, slice(top + 4, bottom - 4), slice(left + 4, right - 4), 7)
    assert (arrays["mask"][ys, xs] > 0).all()   # the view is predicted before Train answers
    check_2d_screen(page, server, arrays, xs, ys, points, "big image: prediction overlay and scribbles")


def test_a_volume_slice_shows_overlay_and_scribbles_and_the_panels_speak_of_the_volume(tmp_path, servers, page):
    """A 32 × 48 × 48 volume, scribbled and trained in XY: the slice on screen is its grey values under
    the predicted classes and the scribbles, at the default opacities. While it is shown, the Train
    panel names the volume model (also after the page has polled the server's state again) and the
    Save panel offers only what a volume's Save writes (labels, model, mask); back on a 2D image both
    panels are the 2D images' again."""
    import tifffile

    rng = np.random.default_rng(0)
    x = np.arange(48)[None, None, :]
    truth = np.broadcast_to(np.where(x < 24, 1, 2), (32, 48, 48))   # two halves side by side in every XY slice
    volume = (np.where(truth == 1, 900.0, 1500.0) + rng.normal(0, 150, truth.shape)).astype(np.uint16)
    data = tmp_path / "data"
    data.mkdir()
    tifffile.imwrite(data / "stack.tif", volume)
    tifffile.imwrite(data / "flat.tif", volume[0])
    server = servers(data, tmp_path / "session")
    page.goto(server.url)
    page.wait_for_selector('.volume-row[data-id="stack"]')
    for name in ("left", "right"):
        app_driver.add_class(page, name)
    page.click('.volume-row[data-id="stack"]')
    app_driver.wait_timing(page, "volume_open", "stack", 1)
    assert "no volume model yet" in page.inner_text("#model-info")
    shown = {w: page.is_visible(f"#save-{w}") for w in ("labels", "model", "masks", "overlays", "fractions")}
    assert shown == {"labels": True, "model": True, "masks": True, "overlays": False, "fractions": False}
    assert not page.is_visible("#scope-image") and not page.is_visible("#scope-all")
    assert "labels, the volume model and its mask" in page.inner_text("#save-panel")
    page.keyboard.press("1")
    app_driver.draw_on_slice(page, [(6, 8), (6, 40)])
    page.keyboard.press("2")
    app_driver.draw_on_slice(page, [(40, 8), (40, 40)])
    page.click("#train")
    app_driver.wait_timing(page, "volume_train_overlay", None, 1, timeout_ms=180_000)
    index = page.evaluate("() => window.volumeApp.index")

    grey = server.png(f"/api/volumes/stack/slice/xy/{index}.png").astype(np.float64)
    overlay = server.png(f"/api/volumes/stack/prediction/xy/{index}.png").astype(np.float64)
    labels = server.png(f"/api/volumes/stack/labels/xy/{index}.png").astype(np.float64)
    ys, xs = (a.ravel() for a in np.mgrid[1:47:2, 1:47:2])
    points = np.array([app_driver.slice_to_screen(page, x, y) for x, y in zip(xs, ys)])
    expected = np.repeat(grey[ys, xs][:, None], 3, axis=1)
    expected = blend(expected, overlay[ys, xs, :3], OVERLAY_OPACITY, overlay[ys, xs, 3] > 0)
    expected = blend(expected, labels[ys, xs, :3], LABEL_OPACITY, labels[ys, xs, 3] > 0)
    assert (overlay[ys, xs, 3] > 0).all() and (labels[ys, xs, 3] > 0).sum() > 10
    shot = screenshot(page)
    compare(shot, points, expected, "volume slice: prediction overlay and scribbles")

    with page.expect_response(lambda r: r.url.split("?")[0].endswith("/api/state"), timeout=10_000):
        pass  # the page's next look at the server's state (every 3 s when idle)
    page.evaluate("() => new Promise(r => requestAnimationFrame(r))")
    info = page.inner_text("#model-info")
    assert "volume model #1" in info and "left, right" in info and "no model yet" not in info, info
    assert not page.is_disabled("#predict")

    page.click("#save")   # a background job the Save panel follows to its end, then names the folder
    page.wait_for_selector('#save-panel[data-state="done"]', timeout=120_000)
    assert page.is_visible("#save-result") and page.is_hidden("#save-cancel") and not page.is_disabled("#save")
    folder = Path(page.inner_text("#save-folder"))
    mask = tifffile.imread(folder / "masks" / "stack_mask.tif")
    assert mask.shape == volume.shape and (mask == truth).mean() > 0.95
    assert (folder / "model_volume").is_dir() and (folder / "labels" / "stack_labels.zarr").exists()

    page.click('.image-row[data-id="flat"]')  # a 2D image: its panels again
    app_driver.wait_timing(page, "image_shown", "flat", 1)
    assert "no model yet: label two classes" in page.inner_text("#model-info")
    assert page.is_visible("#save-overlays") and page.is_visible("#scope-all")
    assert not page.is_visible('[data-testid="save-volume-note"]')


def test_strokes_across_the_side_panels_select_no_text(tmp_path, servers, page):
    """Strokes that start on the image (2D) or the slice (volume), or in the viewer beside it, and
    sweep over the side panels leave no text selected; a drag that starts on the panels' text does
    select it (what a stroke must not do)."""
    import tifffile

    data = tmp_path / "images"
    data.mkdir()
    rng = np.random.default_rng(0)
    tifffile.imwrite(data / "m0.tif", rng.integers(0, 4000, (128, 128), dtype=np.uint16))
    tifffile.imwrite(data / "vol.tif", rng.integers(0, 4000, (8, 48, 48), dtype=np.uint16))
    server = servers(data, tmp_path / "session")
    page.goto(server.url)
    app_driver.add_class(page, "matrix")
    selected = "() => { const t = window.getSelection().toString(); window.getSelection().removeAllRanges(); return t; }"

    def sweep(start):
        for target in ((1150, 300), (1150, 120), (100, 560), (640, 795)):   # right, left panels; the bar below
            page.mouse.move(*start)
            page.mouse.down()
            page.mouse.move(*target, steps=12)
            page.mouse.up()
            assert page.evaluate(selected) == "", (start, target)

    page.click('.image-row[data-id="m0"]')
    app_driver.wait_timing(page, "image_shown", "m0", 1)
    area = page.locator("#canvas-area").bounding_box()
    sweep(app_driver.to_screen(page, 64, 64))
    sweep((area["x"] + 4, area["y"] + area["height"] / 2))   # beside the image
    page.click('.volume-row[data-id="vol"]')
    app_driver.wait_timing(page, "volume_open", "vol", 1)
    sweep(app_driver.slice_to_screen(page, 24, 24))
    page.wait_for_function("() => window.volumeApp.pendingStrokes === 0")

    row = page.locator('.class-row .name').bounding_box()   # a drag on the panels' own text selects it
    page.mouse.move(row["x"] + 2, row["y"] + row["height"] / 2)
    page.mouse.down()
    page.mouse.move(1150, 300, steps=12)
    page.mouse.up()
    assert "matrix" in page.evaluate(selected)
