"""Reading micrographs and label images as arrays, and writing masks and overlays.

Images become (H, W) float32 arrays in [0, 1] (RGB is converted to luminance); label images
become (H, W) int64 arrays. Every function here checks its input and names the problem.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..images import check_intensity, load_grayscale

__all__ = ["IMAGE_SUFFIXES", "area_fractions", "as_grayscale", "as_label_image", "list_image_files", "overlay",
           "read_array", "read_grayscale", "read_labels", "read_slices", "to_unit_float", "write_colour_key",
           "write_fractions_csv", "write_mask", "write_overlay", "write_proba"]

IMAGE_SUFFIXES = (".png", ".tif", ".tiff", ".btf", ".jpg", ".jpeg", ".bmp")
# zlib levels of the PNGs written: above level 1 an overlay (photo-like) compresses no better and takes four
# times longer (4096² RGB: 1.5 s and 24.7 MB at level 1, 6.1 s and 28.9 MB at Pillow's default 6); a mask's few
# values still gain a little from level 3 (0.25 s, 1.6 MB, against 0.64 s and 1.3 MB at 6).
OVERLAY_PNG_LEVEL = 1
MASK_PNG_LEVEL = 3


def as_grayscale(image, source: str = "image") -> np.ndarray:
    """``image`` as an array, checked to be one 2D image: (H, W) grayscale or (H, W, 3|4) RGB(A).

    Anything else (a 3D stack, a channel-first array) is a ValueError: pass the slices one by one.
    """
    image = np.asarray(image)
    if not (image.ndim == 2 or (image.ndim == 3 and image.shape[-1] in (3, 4))):
        raise ValueError(f"{source} has shape {image.shape}: expected a 2D grayscale (H, W) or RGB (H, W, 3) image; "
                         "pass the slices of a 3D stack as separate images")
    if image.dtype.kind not in "uifb":
        raise ValueError(f"{source} has dtype {image.dtype}: expected integers or floats")
    if min(image.shape[:2]) < 1:
        raise ValueError(f"{source} is empty (shape {image.shape})")
    return image


def to_unit_float(image, intensity: str = "auto", source: str = "image") -> np.ndarray:
    """``image`` as (H, W) float32 in [0, 1], by the project's intensity convention.

    ``intensity`` is one of :data:`alibi_vit.images.INTENSITY_MODES` (``auto``: a 0.5–99.5th
    percentile stretch for grayscale, dtype scaling for colour); colour becomes luma. See
    :func:`alibi_vit.images.load_grayscale`, which does the work.
    """
    return load_grayscale(as_grayscale(image, source), check_intensity(intensity))


def as_label_image(labels, shape=None, source: str = "labels") -> np.ndarray:
    """Check a label image (0 = unlabelled, 1..K = classes) and return it as int64.

    Floats are accepted only if every value is a whole number; RGB label images, negative values
    and a shape other than ``shape`` (the image's) are ValueErrors.
    """
    labels = np.asarray(labels)
    if labels.ndim == 3 and labels.shape[-1] in (3, 4):
        raise ValueError(f"{source} is an RGB image {labels.shape}: save labels as a single-channel (grayscale or "
                         "indexed/palette) image whose pixel values are the class numbers 0..K")
    if labels.ndim != 2:
        raise ValueError(f"{source} has shape {labels.shape}: expected a 2D (H, W) label image")
    if shape is not None and labels.shape != tuple(shape):
        raise ValueError(f"{source} is {labels.shape[0]}×{labels.shape[1]} px but its image is "
                         f"{shape[0]}×{shape[1]} px")
    if labels.dtype.kind == "b":
        labels = labels.astype(np.int64)
    elif labels.dtype.kind == "f":
        if not np.isfinite(labels).all() or (labels != np.round(labels)).any():
            raise ValueError(f"{source} has non-integer values: labels must be class numbers 0..K")
    elif labels.dtype.kind not in "ui":
        raise ValueError(f"{source} has dtype {labels.dtype}: expected integer class numbers")
    labels = labels.astype(np.int64)
    if labels.min() < 0:
        raise ValueError(f"{source} has negative values: labels must be 0 (unlabelled) or 1..K")
    return labels


def read_array(path) -> np.ndarray:
    """The pixel array of an image file as stored (TIFF via tifffile, others via PIL; palette images as indices)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"image {path} does not exist")
    try:
        if path.suffix.lower() in (".tif", ".tiff"):
            import tifffile

            return np.asarray(tifffile.imread(path))
        from PIL import Image

        with Image.open(path) as img:
            array = np.asarray(img)  # palette ("P") images give their indices: what label images hold
            return array[..., 0] if img.mode == "PA" else array
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read image {path}: {err}") from err


def read_slices(path) -> list[np.ndarray] | None:
    """The slices of a multi-page TIFF stack (FIB-SEM, X-ray CT), each (H, W) or (H, W, 3|4) as stored,
    or None when ``path`` holds a single image (any other file, or a TIFF of one page).

    Every page of the file's first series is a slice (an ImageJ hyperstack's channels and times
    too, in file order); a file written page by page, one single-page series each of one shape,
    is a stack of those pages."""
    path = Path(path)
    if path.suffix.lower() not in (".tif", ".tiff"):
        return None
    import tifffile

    from ..chunked import check_tiff_pages
    from ..images import ImageReadError

    try:
        with tifffile.TiffFile(path) as tif:
            if len(tif.pages) < 2:
                return None
            if not tif.is_ome:
                check_tiff_pages(tif, f"stack {path}")  # names the first page of another size or dtype
            series = tif.series[0]
            page_shape = tuple(tif.pages[0].shape)
            if len(tif.series) == len(tif.pages) and all(tuple(s.shape) == page_shape for s in tif.series):
                array = np.stack([s.asarray() for s in tif.series])  # written page by page: a series each
            else:
                array = series.asarray()
    except ImageReadError:
        raise
    except (OSError, ValueError, tifffile.TiffFileError) as err:
        raise ValueError(f"cannot read image {path}: {err}") from err
    if array.size % int(np.prod(page_shape)):
        raise ValueError(f"stack {path}: its pages differ in size ({series.shape}); save slices of one size")
    return list(array.reshape((-1,) + page_shape))


def read_grayscale(path, intensity: str = "auto") -> np.ndarray:
    """Read an image file (PNG, TIFF incl. 16-bit, JPEG) as (H, W) float32 in [0, 1]; see :func:`to_unit_float`."""
    return load_grayscale(Path(path), check_intensity(intensity))


LOSSY_SUFFIXES = (".jpg", ".jpeg", ".jpe", ".jfif")
KEY_FONT_PX = 18  # text height of the colour key (colour_key.png): legible beside masks of any size


def read_labels(path, shape=None) -> np.ndarray:
    """Read a label image file (single-channel or palette PNG/TIFF) as (H, W) int64; see :func:`as_label_image`.

    JPEG files are refused: lossy compression invents values (classes) at every stroke edge."""
    path = Path(path)
    if path.suffix.lower() in LOSSY_SUFFIXES:
        raise ValueError(f"labels {path} is a JPEG: lossy compression invents classes at stroke edges; "
                         "save labels as PNG or TIFF")
    return as_label_image(read_array(path), shape, source=f"labels {path}")


def _folder_images(folder: Path, recursive: bool, seen: set, again: list) -> list[Path]:
    """Image files and zarr stores (folders, not searched inside) in ``folder``, sorted. ``seen`` holds the
    resolved paths met so far: a file or folder reached again through a symlink (a link to an image, a
    ``self -> .`` loop) is skipped (and put in ``again``), so each real file is listed once. Real entries
    come before links, so the name kept is the file's own where both are in one folder."""
    from ..chunked import is_zarr_path

    found = []
    for p in sorted(folder.iterdir(), key=lambda p: (p.is_symlink(), p.name)):
        try:
            real = p.resolve(strict=True)
        except (OSError, RuntimeError):  # a dangling link, or a loop the resolver gives up on
            continue
        if real in seen:
            if is_zarr_path(p) or (p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES):
                again.append(p)
            continue
        if p.is_dir():
            if is_zarr_path(p):
                seen.add(real)
                found.append(p)
            elif recursive:
                seen.add(real)
                found.extend(_folder_images(p, recursive, seen, again))
        elif p.suffix.lower() in IMAGE_SUFFIXES and p.is_file():
            seen.add(real)
            found.append(p)
    return sorted(found)


def list_image_files(sources, recursive: bool = False) -> list[Path]:
    """Image files (and zarr stores) from folders (their images, sorted; with ``recursive`` also those
    in subfolders) and/or paths, in order. A zarr store given as a folder is one image."""
    from ..chunked import is_zarr_path

    if isinstance(sources, (str, Path)):
        sources = [sources]
    files, seen = [], set()  # seen: resolved paths, so a file reached twice (links, a folder given twice) is one
    for src in sources:
        src = Path(src)
        if is_zarr_path(src) or src.is_file():
            if src.resolve() not in seen:
                seen.add(src.resolve())
                files.append(src)
        elif src.is_dir():
            seen.add(src.resolve())
            again = []
            found = _folder_images(src, recursive, seen, again)
            if not found and not again:  # (a folder whose images were all listed already is no mistake)
                raise FileNotFoundError(f"folder {src} holds no images ({', '.join(IMAGE_SUFFIXES)}, or zarr stores)")
            files.extend(found)
        else:
            raise FileNotFoundError(f"{src} is neither an image file nor a folder")
    return files


def palette(k: int) -> np.ndarray:
    """(k + 1, 3) uint8 colours: index 0 black, then well-separated hues for classes 1..k."""
    base = np.array([[230, 25, 75], [60, 180, 75], [0, 130, 200], [255, 225, 25], [145, 30, 180], [70, 240, 240],
                     [245, 130, 48], [240, 50, 230], [210, 245, 60], [250, 190, 190]], np.uint8)
    reps = -(-k // len(base)) if k else 1
    return np.concatenate([np.zeros((1, 3), np.uint8), np.tile(base, (reps, 1))[:k]])


# Rows of an overlay blended at a time, one band per thread (as many as the process's thread budget): the blend's
# float temporaries stay small (a band's, not the image's: 0.6 GB at 4096²) and both cores work (4096²: 1.3 s on
# one core).
OVERLAY_BAND = 256


def overlay(image01: np.ndarray, mask: np.ndarray, alpha: float = 0.4, k: int | None = None,
            colours: np.ndarray | None = None) -> np.ndarray:
    """(H, W, 3) uint8: the image (grayscale (H, W), or RGB (H, W, 3) in its own colours) with the
    classes of ``mask`` tinted on it (0 stays untinted), in :func:`palette` colours or in ``colours``
    (a (max class + 1, 3) uint8 table indexed by class value)."""
    from concurrent.futures import ThreadPoolExecutor

    from ..runtime import thread_budget

    k = int(mask.max()) if k is None else k
    table = (palette(k) if colours is None else np.asarray(colours, np.uint8)).astype(np.float32)
    out = np.empty(mask.shape[:2] + (3,), np.uint8)

    def blend(top: int) -> None:
        rows = slice(top, top + OVERLAY_BAND)
        band, m = image01[rows], mask[rows]
        if band.ndim == 3:
            gray = np.clip(band[..., :3], 0, 1) * 255.0
        else:
            gray = np.repeat(np.clip(band, 0, 1)[..., None] * 255.0, 3, axis=-1)
        out[rows] = np.where(m[..., None] > 0, (1 - alpha) * gray + alpha * table[m], gray).round()

    with ThreadPoolExecutor(max_workers=min(thread_budget(), 8)) as pool:
        list(pool.map(blend, range(0, mask.shape[0], OVERLAY_BAND)))
    return out


def write_mask(path, mask: np.ndarray, k: int | None = None) -> Path:
    """Write a class mask losslessly: PNG or TIFF by suffix, pixel value = class value.

    PNGs of values below 256 are palette ("P") images whose colour for value v is :func:`palette`
    (``k``, default the mask's maximum)[v], the overlays' colours, so any viewer shows the classes
    in colour while the stored indices stay the class values; above 255, a 16-bit grey PNG.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    dtype = np.uint8 if mask.max() < 256 else np.uint16
    if path.suffix.lower() in (".tif", ".tiff"):
        import tifffile

        tifffile.imwrite(path, mask.astype(dtype), photometric="minisblack")  # a (Z, H, W) stack: one page a slice
    else:
        from PIL import Image

        if dtype == np.uint8:
            m = np.ascontiguousarray(mask, dtype=np.uint8)
            img = Image.frombytes("P", (m.shape[1], m.shape[0]), m.tobytes())  # indices = class values
            img.putpalette(palette(int(mask.max()) if k is None else int(k))[:256].ravel().tolist())
        else:
            img = Image.fromarray(mask.astype(dtype))
        img.save(path, compress_level=MASK_PNG_LEVEL)
    return path


def write_overlay(path, rgb: np.ndarray) -> Path:
    """An (H, W, 3) uint8 overlay (:func:`overlay`) as a PNG, quickly (:data:`OVERLAY_PNG_LEVEL`)."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rgb).save(path, compress_level=OVERLAY_PNG_LEVEL)
    return path


def write_colour_key(path, classes, k: int | None = None, names=None) -> Path:
    """A PNG key to the masks' and overlays' colours: per class a swatch of :func:`palette` colour
    and its name (default "class <value>"), in text of ``KEY_FONT_PX`` px, the image sized to fit it."""
    from PIL import Image, ImageDraw, ImageFont

    classes = [int(c) for c in classes]
    colours = palette(max(classes) if k is None else int(k))
    names = [f"class {c}" for c in classes] if names is None else list(names)
    try:
        font, upscale = ImageFont.load_default(size=KEY_FONT_PX), 1
    except (TypeError, ImportError, OSError):  # a Pillow without FreeType: its small bitmap font, enlarged
        font, upscale = ImageFont.load_default(), 2
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    boxes = [measure.textbbox((0, 0), name, font=font) for name in names]
    text_h = max(b[3] for b in boxes)
    pad, swatch = text_h // 2 + 2, text_h + 6  # the swatch a little taller than the text, rows apart by pad
    img = Image.new("RGB", (3 * pad + swatch + max(b[2] for b in boxes), pad + len(classes) * (swatch + pad)), "white")
    draw = ImageDraw.Draw(img)
    for i, (c, name) in enumerate(zip(classes, names)):
        y = pad + i * (swatch + pad)
        draw.rectangle([pad, y, pad + swatch - 1, y + swatch - 1], fill=tuple(int(v) for v in colours[c]),
                       outline="black")
        draw.text((2 * pad + swatch, y + (swatch - text_h) // 2), name, fill="black", font=font)
    if upscale > 1:
        img = img.resize((img.width * upscale, img.height * upscale), Image.NEAREST)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path


def write_proba(folder, stem: str, proba: np.ndarray, classes) -> list[Path]:
    """One float32 TIFF per class, ``<stem>_proba_<class value>.tif``, of the (H, W, K) probabilities
    (or (Z, H, W, K) of a stack: one page per slice)."""
    import tifffile

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for j, c in enumerate(classes):
        paths.append(folder / f"{stem}_proba_{int(c)}.tif")
        tifffile.imwrite(paths[-1], np.ascontiguousarray(proba[..., j], dtype=np.float32), photometric="minisblack")
    return paths


def area_fractions(mask: np.ndarray, classes) -> tuple[np.ndarray, np.ndarray]:
    """(pixel counts, area fractions) of each class value of ``classes`` in ``mask``; fractions are
    counts over the mask's pixel count (they sum to 1 when every pixel holds one of ``classes``)."""
    counts = np.array([int((mask == c).sum()) for c in classes], np.int64)
    return counts, counts / mask.size


def write_fractions_csv(path, names, masks_counts, classes, class_names=None) -> Path:
    """The area-fraction CSV: one row per image (``image``, then per class ``fraction_<c>`` and
    ``pixels_<c>``), then a ``mean`` and a ``std`` row over the images (sample standard deviation,
    ddof=1; empty with a single image). ``masks_counts``: per image its class pixel counts and size.
    ``class_names``: {class value: name}; the columns then read ``fraction_<name>``, ``pixels_<name>``."""
    import csv

    classes = [int(c) for c in classes]
    label = {c: (class_names or {}).get(c, c) for c in classes}
    header = ["image"] + [f"fraction_{label[c]}" for c in classes] + [f"pixels_{label[c]}" for c in classes]
    rows = []
    for name, (counts, size) in zip(names, masks_counts):
        counts = np.asarray(counts, np.int64)
        rows.append([name] + list(counts / size) + list(counts))
    values = np.array([r[1:] for r in rows], np.float64).reshape(len(rows), 2 * len(classes))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for r in rows:
            writer.writerow([r[0]] + [f"{v:.6f}" for v in r[1:1 + len(classes)]] + [int(v) for v in r[1 + len(classes):]])
        if rows:
            writer.writerow(["mean"] + [f"{v:.6f}" for v in values.mean(0)])
            std = values.std(0, ddof=1) if len(rows) > 1 else None
            writer.writerow(["std"] + ([f"{v:.6f}" for v in std] if std is not None else [""] * values.shape[1]))
    return path
