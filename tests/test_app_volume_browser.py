"""The app's volume mode in a real browser (Debian's Chromium driven by Playwright, real mouse and keys):
a small volume opens as one entry, labels drawn in the XZ view train a model, and the overlay of
slices in every view shows the planted layers.

    ALIBI_VIT_SCREENSHOT=1 pytest tests/test_app_volume_browser.py   # also writes benchmarks/results/app_volume_screenshot.png
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import benchmark_module

app_driver = benchmark_module("app_driver")

if not app_driver.CHROMIUM.exists():
    pytest.skip("the browser tests need Debian's Chromium at /usr/bin/chromium (apt-get install chromium)",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api",
                               reason="the browser tests need the playwright package (pip install playwright)")

SHAPE = (48, 64, 64)  # z, y, x
COLOURS = {1: (230, 25, 75), 2: (60, 180, 75)}  # the first two default class colours


def layered_volume(seed=0):
    """Two phases stacked along z (class 1 above z = 20, class 2 below), noisy: the layers show as
    bands in XZ and YZ; each XY slice is one phase."""
    rng = np.random.default_rng(seed)
    z = np.arange(SHAPE[0])[:, None, None]
    truth = np.broadcast_to(np.where(z < 20, 1, 2), SHAPE).astype(np.uint8)
    volume = np.where(truth == 1, 900.0, 1500.0) + rng.normal(0, 180, SHAPE)
    return volume.astype(np.uint16), truth


def classes_shown(pixels: np.ndarray) -> np.ndarray:
    """Class value of each opaque overlay pixel by its colour (0 elsewhere)."""
    out = np.zeros(pixels.shape[:2], np.uint8)
    for value, rgb in COLOURS.items():
        out[(pixels[..., :3] == rgb).all(-1) & (pixels[..., 3] == 255)] = value
    return out


def test_labels_drawn_in_xz_train_a_model_whose_overlay_matches_the_planted_layers(tmp_path):
    import tifffile

    data = tmp_path / "data"
    data.mkdir()
    volume, truth = layered_volume()
    tifffile.imwrite(data / "stack.tif", volume)
    server = app_driver.Server(data, tmp_path / "session")
    try:
        with sync_api.sync_playwright() as p:
            browser = app_driver.launch_chromium(p)
            page = browser.new_context(viewport={"width": 1280, "height": 800}).new_page()
            page.set_default_timeout(60_000)
            errors = []
            page.on("pageerror", lambda err: errors.append(str(err)))
            page.goto(server.url)
            page.wait_for_selector('.volume-row[data-id="stack"]')
            assert page.locator("#image-list .image-row").count() == 0  # one entry, not 48 pages
            for name in ("top", "bottom"):
                app_driver.add_class(page, name)
            page.wait_for_function("() => document.querySelectorAll('.class-row').length === 2")

            page.click('.volume-row[data-id="stack"]')
            app_driver.wait_timing(page, "volume_open", "stack", 1)
            page.click('[data-testid="view-xz"]')
            app_driver.wait_timing(page, "volume_view", "stack", 1)
            y = page.evaluate("() => window.volumeApp.index")
            assert y == SHAPE[1] // 2
            page.keyboard.press("1")
            app_driver.draw_on_slice(page, [(4, 6), (58, 6), (58, 10)])
            page.keyboard.press("2")
            app_driver.draw_on_slice(page, [(4, 40), (58, 40)])

            # the strokes landed in the label volume at y = the XZ slice shown
            xz = app_driver.canvas_pixels(page, "#volume-labels")
            labelled = server.json("GET", "/api/state")["volumes"][0]["labelled"]
            assert set(labelled) == {"1", "2"}
            xy = server.png("/api/volumes/stack/labels/xy/6.png")
            assert xy[y, 30, 3] == 255 and xy[y - 8, 30, 3] == 0  # the row y of slice z = 6, only there
            assert xz[6, 30, 3] > 0  # and the page shows its own stroke

            page.click("#train")
            app_driver.wait_timing(page, "volume_train_overlay", None, 1, timeout_ms=120_000)
            shown = classes_shown(app_driver.canvas_pixels(page, "#volume-overlay"))
            assert np.mean(shown == truth[:, y, :]) > 0.95
            share = float(page.inner_text('#fractions tr[data-value="1"] .num').rstrip(" %")) / 100
            assert abs(share - np.mean(truth[:, y, :] == 1)) < 0.05  # the slice's area fractions
            if os.environ.get("ALIBI_VIT_SCREENSHOT"):  # the docs' picture (docs/app.md "Volumes")
                page.screenshot(path=str(Path(__file__).resolve().parents[1] / "benchmarks" / "results"
                                         / "app_volume_screenshot.png"))

            page.keyboard.press("ArrowUp")  # the next XZ slice, with its overlay
            app_driver.wait_timing(page, "volume_overlay", "stack", 1, timeout_ms=120_000)
            assert page.evaluate("() => window.volumeApp.index") == y + 1
            shown = classes_shown(app_driver.canvas_pixels(page, "#volume-overlay"))
            assert np.mean(shown == truth[:, y + 1, :]) > 0.95

            page.keyboard.press("v")  # YZ
            app_driver.wait_timing(page, "volume_overlay", "stack", 2, timeout_ms=120_000)
            x = page.evaluate("() => window.volumeApp.index")
            assert page.evaluate("() => window.volumeApp.view") == "yz"
            assert np.mean(classes_shown(app_driver.canvas_pixels(page, "#volume-overlay")) == truth[:, :, x]) > 0.95

            page.keyboard.press("v")  # XY, then its last slice (class 2) and ten slices back up
            page.keyboard.press("End")
            page.keyboard.press("PageDown")
            page.wait_for_function("() => window.volumeApp.overlayShown && window.volumeApp.overlayShown.startsWith('xy/37/')")
            assert np.mean(classes_shown(app_driver.canvas_pixels(page, "#volume-overlay")) == 2) > 0.95
            assert not errors, f"script errors in the page: {errors}"
            browser.close()
    finally:
        server.stop()
