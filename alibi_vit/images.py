"""Reading images the way microscopists store them, and the fixed image sets the project probes.

``load_image`` turns PNG, JPEG, TIFF (8/16/32-bit integer, float, grayscale, RGB, RGBA) into a
float32 tensor (3, H, W) in [0, 1]; ``load_grayscale`` gives a float32 array (H, W) in [0, 1],
colour reduced to luma (what per-pixel tools such as trainable segmentation need). ``resize_center_crop`` and
``normalize`` are the DINOv2 preprocessing (shortest side resized, centre crop, ImageNet mean/std).

How stored pixel values become [0, 1] is the *intensity mode*, one convention wherever the
project reads images (``scale_intensity``; ``--intensity`` on the command line; the
``intensity`` argument of the image DataModules):

- ``"dtype"``: integers divided by their type's maximum (uint8 255, uint16 65535; negative
  values of signed types become 0), booleans as 0/1. Floats already within [0, 1] are kept;
  other floats have no maximum to divide by and are min-max scaled.
- ``"minmax"``: the image's minimum becomes 0 and its maximum 1.
- ``"percentile"``: a robust stretch: the 0.5th percentile becomes 0 and the 99.5th 1, values
  beyond are clipped. The 0.5 % tails absorb hot and dead pixels and saturated spots, which
  would otherwise decide the whole range, while real structure is left unsaturated. When the
  two percentiles coincide (e.g. a few bright spots on an empty background) it falls back to
  ``minmax``.
- ``"auto"`` (the default): ``percentile`` for single-channel images, ``dtype`` for colour
  images, so 8-bit photos keep their look while a 12-bit camera's uint16 image (values up to
  4095, i.e. below 0.07 when divided by 65535) or a low-contrast micrograph fills the range.

Statistics are taken over all channels together (colours keep their balance) and over finite
values only; constant images become 0 everywhere, and NaN or infinite pixels become 0.
"""

from __future__ import annotations

import difflib
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Union

import numpy as np

if TYPE_CHECKING:  # torch is imported where it is used, so `alibi-vit probe --help` does not load it
    import torch

__all__ = [
    "BUNDLED_SETS", "IMAGE_EXTENSIONS", "IMAGENET_MEAN", "IMAGENET_STD", "INTENSITY_MODES", "PERCENTILES",
    "ImageReadError", "IntensityMode", "POOLED_PERCENTILES", "bundled_images", "check_intensity", "denormalize",
    "fit_intensity_range", "grey_values", "list_images", "load_grayscale", "load_image", "load_image_set",
    "noise_images", "normalize", "read_array", "resize_center_crop", "scale_colour", "scale_intensity", "scale_to_range",
    "to_rgb_tensor",
]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
MAX_UPSCALE = 4  # load_image_set warns about images enlarged more than this (the thumbnail of a thumbnail)

IntensityMode = Literal["auto", "dtype", "minmax", "percentile"]
INTENSITY_MODES: tuple[str, ...] = ("auto", "dtype", "minmax", "percentile")
PERCENTILES = (0.5, 99.5)  # the "percentile" mode's black and white points, in percent
# Black and white points fitted on the pooled pixels of a set of images (fit_intensity_range): tails
# this thin still absorb hot pixels, but a phase covering 0.2 % of the area is not clipped flat.
POOLED_PERCENTILES = (0.01, 99.99)

# Offline images that ship with scikit-image, grouped by what they show.
BUNDLED_SETS = {
    "textures": ("brick", "grass", "gravel"),                    # grayscale texture photographs
    "photos": ("astronaut", "chelsea", "coffee", "rocket"),      # everyday colour photographs
    "microscopy": ("cell", "immunohistochemistry"),              # quantitative-phase image of a cell; IHC-stained tissue
    "retina": ("microaneurysms", "retina"),                      # fundus images of the eye
    "astronomy": ("hubble_deep_field", "moon"),                  # telescope images
    # Generated 3-phase microstructures (12-bit data in 16-bit images, alibi_vit.synthetic):
    # micrograph-like and offline, but not real micrographs.
    "synthetic_micrographs": tuple(f"synthetic_micrograph_{seed}" for seed in range(4)),
}
_SYNTHETIC_PREFIX = "synthetic_micrograph_"
_SYNTHETIC_SIZE = 512
# Former set names, still read (with a warning) so old configs keep their images.
_RENAMED_SETS = {
    "micrographs": (("cell", "immunohistochemistry", "microaneurysms", "hubble_deep_field"),
                    "it held more than micrographs: use 'microscopy' (cell, immunohistochemistry), "
                    "'retina' (microaneurysms) and 'astronomy' (hubble_deep_field)"),
}
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)  # ITU-R BT.601 luma weights
_BUNDLED_IMAGES = tuple(dict.fromkeys(n for names in BUNDLED_SETS.values() for n in names))

PathLike = Union[str, os.PathLike]


class ImageReadError(ValueError):
    """An image file that cannot be read or has an unusable layout."""


# -- intensity --------------------------------------------------------------------------------------

def check_intensity(intensity) -> str:
    """The intensity mode's name, ``None`` read as ``"auto"``; an unknown mode is a ValueError listing the modes."""
    mode = str(intensity or "auto")
    if mode not in INTENSITY_MODES:
        raise ValueError(f"unknown intensity mode {intensity!r}; choose one of {', '.join(INTENSITY_MODES)}")
    return mode


def _stretch(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    if not hi > lo:  # constant image: zeros rather than 0/0
        return np.zeros_like(x)
    return (x - np.float32(lo)) / np.float32(hi - lo)


def scale_intensity(array, intensity: IntensityMode = "auto", percentiles: tuple[float, float] = PERCENTILES,
                    source: str = "array") -> np.ndarray:
    """Pixel values → float32 in [0, 1], same shape, by an intensity mode (see the module docstring).

    Args:
        array: an image (H, W) or channels-last (H, W, C) of bool, integer or float pixels.
        intensity: ``"auto"`` (default: ``"percentile"`` for (H, W) and (H, W, 1), ``"dtype"``
            otherwise), ``"dtype"``, ``"minmax"`` or ``"percentile"``.
        percentiles: black and white points of ``"percentile"``, in percent (default 0.5, 99.5).
        source: what the array is (a file name), for error messages.
    """
    mode = check_intensity(intensity)
    a = np.asarray(array)
    if a.dtype.kind not in "biuf":
        raise ImageReadError(f"{source}: unsupported pixel type {a.dtype}")
    if mode == "auto":
        single_channel = a.ndim < 3 or a.shape[-1] == 1
        mode = "percentile" if single_channel else "dtype"
    lo_pct, hi_pct = (float(p) for p in percentiles)
    if not 0.0 <= lo_pct < hi_pct <= 100.0:
        raise ValueError(f"percentiles must satisfy 0 <= low < high <= 100, got {percentiles}")
    x = a.astype(np.float32)  # float32 (not 64) keeps a large micrograph's copy small
    finite = np.isfinite(x) if a.dtype.kind == "f" else None
    # Statistics on the stored integers where possible: numpy's percentile is about twice as fast there.
    values = x[finite] if finite is not None else a.ravel() if a.dtype.kind in "iu" else x.ravel()
    if mode == "dtype":
        if a.dtype.kind in "iu":
            x = np.clip(x, 0.0, None) / np.float32(np.iinfo(a.dtype).max)
        elif a.dtype.kind == "f" and values.size and (values.min() < 0.0 or values.max() > 1.0):
            x = _stretch(x, float(values.min()), float(values.max()))
    elif values.size == 0:
        x = np.zeros_like(x)
    else:
        lo, hi = float(values.min()), float(values.max())
        if mode == "percentile":
            p_lo, p_hi = np.percentile(values, (lo_pct, hi_pct))
            if p_hi > p_lo:  # else the bulk of the image is one value: keep min-max
                lo, hi = float(p_lo), float(p_hi)
        x = _stretch(x, lo, hi)
    if finite is not None:
        x[~finite] = 0.0
    return np.clip(x, 0.0, 1.0, out=x)


def grey_values(array, source: str = "array", colour: bool = False) -> np.ndarray:
    """(H, W) float32 grey values of an image as stored, unscaled: the image itself, or the luma of
    colour (alpha dropped, the weights of :func:`load_grayscale`); non-finite pixels become NaN.
    ``colour=True`` keeps a colour image's channels: (H, W, 3) values (grayscale stays (H, W))."""
    a = _channels_last(array, source)
    if a.dtype.kind not in "biuf":
        raise ImageReadError(f"{source}: unsupported pixel type {a.dtype}")
    if a.shape[-1] == 1:
        g = a[..., 0].astype(np.float32)
    else:
        g = a.astype(np.float32) if colour else a.astype(np.float32) @ _LUMA
    if a.dtype.kind == "f":
        g[~np.isfinite(g)] = np.nan
    return g


def fit_intensity_range(images, percentiles: tuple[float, float] = POOLED_PERCENTILES, max_pixels: int = 1 << 20,
                        seed: int = 0, colour: bool = False) -> tuple[float, float]:
    """Black and white points (lo, hi) for a whole set of images: the ``percentiles`` of their pooled
    grey values (:func:`grey_values`), from at most ``max_pixels`` seeded random pixels per image.

    Fitted once (on a segmenter's training images) and then applied unchanged with
    :func:`scale_to_range`, the same stored value maps to the same float in every image, whatever
    mix of phases an image holds; a per-image stretch (``"percentile"``) maps it by each image's own
    content. A set whose values are all equal gives (v, v), which :func:`scale_to_range` maps to 0.
    ``colour=True``: colour images' channels are pooled as they are (one range for all channels,
    so colours keep their balance) instead of their luma.
    """
    rng = np.random.default_rng(seed)
    pooled = []
    for i, image in enumerate(images):
        g = grey_values(image, f"image {i}", colour).ravel()
        if g.size > max_pixels:
            g = g[rng.choice(g.size, max_pixels, replace=False)]
        pooled.append(g[np.isfinite(g)])
    pooled = np.concatenate(pooled) if pooled else np.zeros(0, np.float32)
    if pooled.size == 0:
        raise ValueError("the images hold no finite pixel: cannot fit an intensity range")
    lo, hi = np.percentile(pooled, percentiles)
    if not hi > lo:
        lo, hi = pooled.min(), pooled.max()
    return float(lo), float(hi)


def scale_to_range(array, lo: float, hi: float, source: str = "array", colour: bool = False) -> np.ndarray:
    """(H, W) float32 in [0, 1]: the grey values (:func:`grey_values`) mapped lo → 0, hi → 1, clipped;
    NaN or infinite pixels become 0, and lo == hi gives 0 everywhere. ``colour=True``: a colour
    image gives (H, W, 3), each channel mapped by the same range."""
    x = _stretch(grey_values(array, source, colour), float(lo), float(hi))
    x[~np.isfinite(x)] = 0.0
    return np.clip(x, 0.0, 1.0, out=x)


# -- reading ------------------------------------------------------------------------------------------

def read_array(path: PathLike) -> np.ndarray:
    """The pixels of an image file as stored (dtype and value range untouched), without scaling.

    Palette, CMYK and other colour models are converted to RGB, 1-bit images to uint8 0/255;
    16-bit PNGs come back as uint16. Raises :class:`ImageReadError` naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise ImageReadError(f"{path}: no such image file")
    try:
        if path.suffix.lower() in (".tif", ".tiff"):
            import tifffile

            array = tifffile.imread(path)
        else:
            from PIL import Image

            with Image.open(path) as im:
                if im.mode in ("P", "PA", "CMYK", "YCbCr", "LAB", "HSV"):  # CMYK JPEGs would read as RGBA
                    im = im.convert("RGB")
                elif im.mode == "1":
                    im = im.convert("L")
                if im.mode in ("I;16", "I;16B", "I;16L"):
                    array = np.array(im, dtype=np.uint16)
                else:
                    array = np.array(im)
            if array.dtype == np.int32 and array.size and array.min() >= 0 and array.max() <= 65535:
                array = array.astype(np.uint16)  # PIL's 32-bit mode "I" holding a 16-bit image
    except Exception as err:  # PIL/tifffile raise many types for corrupt files
        raise ImageReadError(f"{path}: cannot read image ({type(err).__name__}: {err})") from err
    if array.ndim == 3 and array.shape[0] == 1:
        array = array[0]
    return array


def _channels_last(array, source: str) -> np.ndarray:
    """(H, W), (H, W, C) or channels-first (C, H, W) → (H, W, 1|3), alpha dropped."""
    a = np.asarray(array)
    if a.ndim == 3 and a.shape[0] in (1, 3, 4) and a.shape[-1] not in (1, 3, 4):
        a = np.moveaxis(a, 0, -1)  # channels-first TIFF stacks
    if a.ndim == 2:
        a = a[..., None]
    if a.ndim != 3 or a.shape[-1] not in (1, 2, 3, 4):
        raise ImageReadError(f"{source}: expected a 2D grayscale or RGB(A) image, got array of shape {a.shape}")
    if a.shape[-1] in (2, 4):  # drop alpha: it says where to draw, not what is there
        a = a[..., :-1]
    return a


def to_rgb_tensor(array: np.ndarray, source: str = "array", intensity: IntensityMode = "auto") -> torch.Tensor:
    """(H, W), (H, W, 1|2|3|4) or (1|3|4, H, W) bool, integer or float array → float32 tensor (3, H, W) in [0, 1].

    ``intensity`` picks how values are scaled (:func:`scale_intensity`); grayscale is repeated
    over the three channels, alpha dropped.
    """
    a = scale_intensity(_channels_last(array, source), intensity, source=source)
    if a.shape[-1] == 1:
        a = np.repeat(a, 3, axis=-1)
    import torch

    return torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))


def load_image(path: PathLike, intensity: IntensityMode = "auto") -> torch.Tensor:
    """Read an image file as a float32 tensor (3, H, W) in [0, 1]; raise ImageReadError naming the file.

    ``intensity``: ``"auto"`` (default), ``"dtype"``, ``"minmax"`` or ``"percentile"``; see the module docstring.
    """
    return to_rgb_tensor(read_array(path), str(path), intensity)


def load_grayscale(source, intensity: IntensityMode = "auto") -> np.ndarray:
    """A single-channel float32 array (H, W) in [0, 1] from an image file or an array.

    ``source`` is a path or an array laid out as :func:`to_rgb_tensor` accepts. Colour is reduced
    to luma with the ITU-R BT.601 weights (0.299 R + 0.587 G + 0.114 B, as PIL's "L" conversion
    and Fiji's weighted conversion). ``intensity`` as in :func:`scale_intensity`, with ``"auto"``
    decided by the image's own channels (``dtype`` for colour, ``percentile`` for grayscale);
    ``minmax`` and ``percentile`` measure the luma, so their output spans [0, 1] as for grayscale.
    """
    if isinstance(source, (str, os.PathLike)):
        array, name = read_array(source), str(source)
    else:
        array, name = source, "array"
    a = _channels_last(array, name)
    mode = check_intensity(intensity)
    if a.shape[-1] == 1:
        return np.ascontiguousarray(scale_intensity(a[..., 0], mode, source=name))
    if mode in ("auto", "dtype"):  # divide by the dtype's maximum first: luma of values in [0, 1]
        return np.clip(scale_intensity(a, "dtype", source=name) @ _LUMA, 0.0, 1.0)
    if a.dtype.kind not in "biuf":
        raise ImageReadError(f"{name}: unsupported pixel type {a.dtype}")
    return scale_intensity(a.astype(np.float32) @ _LUMA, mode, source=name)


def scale_colour(array, intensity: IntensityMode = "auto", source: str = "array") -> np.ndarray:
    """A colour image as (H, W, 3) float32 in [0, 1] by :func:`scale_intensity` (statistics over all
    channels together), alpha dropped; a grayscale image gives (H, W) as :func:`load_grayscale`."""
    a = _channels_last(array, source)
    if a.shape[-1] == 1:
        return np.ascontiguousarray(scale_intensity(a[..., 0], intensity, source=source))
    return np.ascontiguousarray(scale_intensity(a, intensity, source=source))


def list_images(folder, recursive: bool = True) -> list[Path]:
    """Image files under ``folder`` sorted by path, each real file once (a link to an image listed
    beside it is not a second image); a missing or image-less folder is an error."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"image folder {folder} does not exist")
    pattern = "**/*" if recursive else "*"
    found = sorted((p for p in folder.glob(pattern) if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS),
                   key=lambda p: (p.is_symlink(), p))  # (glob's ** does not enter linked folders)
    real = {}
    for p in found:
        real.setdefault(p.resolve(), p)
    files = sorted(real.values())
    if not files:
        raise FileNotFoundError(f"image folder {folder} holds no images ({', '.join(IMAGE_EXTENSIONS)})")
    return files


# -- preprocessing ------------------------------------------------------------------------------------

def resize_center_crop(image: torch.Tensor, size) -> torch.Tensor:
    """Resize so the shortest side matches ``size`` then crop the centre; ``size`` is int or (H, W)."""
    out_h, out_w = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    h, w = image.shape[-2:]
    scale = max(out_h / h, out_w / w)
    new_h, new_w = max(out_h, round(h * scale)), max(out_w, round(w * scale))
    if (new_h, new_w) != (h, w):
        import torch.nn.functional as F

        image = F.interpolate(image[None], size=(new_h, new_w), mode="bilinear", antialias=True,
                              align_corners=False)[0]
    top, left = (new_h - out_h) // 2, (new_w - out_w) // 2
    return image[..., top:top + out_h, left:left + out_w].clamp(0.0, 1.0)


def _mean_std(like: torch.Tensor):
    import torch

    mean = torch.tensor(IMAGENET_MEAN, dtype=like.dtype, device=like.device).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD, dtype=like.dtype, device=like.device).view(3, 1, 1)
    return mean, std


def normalize(image: torch.Tensor) -> torch.Tensor:
    """ImageNet mean/std normalisation used by DINOv2, for (3, H, W) or (B, 3, H, W) in [0, 1]."""
    mean, std = _mean_std(image)
    return (image - mean) / std


def denormalize(image: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`normalize`, clamped to [0, 1] for display."""
    mean, std = _mean_std(image)
    return (image * std + mean).clamp(0.0, 1.0)


# -- image sets ---------------------------------------------------------------------------------------

def _sets_listing() -> str:
    def contents(images):
        return f"{len(images)} generated" if images[0].startswith(_SYNTHETIC_PREFIX) else ", ".join(images)

    return "; ".join(f"{name} ({contents(images)})" for name, images in BUNDLED_SETS.items())


def _did_you_mean(name: str, candidates) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _is_bundled(name: str) -> bool:
    return name in BUNDLED_SETS or name in _RENAMED_SETS or name in _BUNDLED_IMAGES


def bundled_images(name: str = "textures", intensity: IntensityMode = "auto") -> list[tuple[str, torch.Tensor]]:
    """(image name, (3, H, W) tensor in [0, 1]) for a set of ``BUNDLED_SETS`` or one of its images.

    The images ship with scikit-image (no download). ``intensity`` as in :func:`load_image`;
    with ``"auto"`` the grayscale ones (textures, cell, microaneurysms, moon) are percentile-stretched.
    """
    if name in _RENAMED_SETS:
        names, advice = _RENAMED_SETS[name]
        warnings.warn(f"the bundled set {name!r} was renamed: {advice}", FutureWarning, stacklevel=2)
    elif name in BUNDLED_SETS:
        names = BUNDLED_SETS[name]
    elif name in _BUNDLED_IMAGES:
        names = (name,)
    else:
        raise ValueError(f"unknown bundled set or image {name!r}; sets: {_sets_listing()}"
                         f"{_did_you_mean(name, [*BUNDLED_SETS, *_BUNDLED_IMAGES])}")
    return [(n, to_rgb_tensor(_bundled_array(n), n, intensity)) for n in names]


def _bundled_array(name: str) -> np.ndarray:
    """The pixels of one bundled image: from ``skimage.data``, or generated for the synthetic set."""
    if name.startswith(_SYNTHETIC_PREFIX):
        from .synthetic import synthetic_micrograph

        return synthetic_micrograph(_SYNTHETIC_SIZE, seed=int(name[len(_SYNTHETIC_PREFIX):]))[0]
    from skimage import data

    return getattr(data, name)()


def noise_images(count: int, size, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Uniform-noise RGB images: the probe's control set with no content at all."""
    h, w = (size, size) if isinstance(size, int) else size
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [(f"noise_{i}", torch.rand(3, h, w, generator=gen)) for i in range(count)]


def load_image_set(source: str, size, noise_count: int = 8, seed: int = 0,
                   intensity: IntensityMode = "auto") -> list[tuple[str, torch.Tensor]]:
    """(name, (3, size, size) image in [0, 1]) resized and centre-cropped, from ``source``:

    ``"noise"``; a folder of images (searched recursively) or a single image file; else a
    bundled set (``BUNDLED_SETS``) or one of its images. A path wins over a set of the same
    name. Anything else is a FileNotFoundError that lists the bundled sets and suggests the
    closest name. ``intensity`` as in :func:`load_image` (noise is already in [0, 1]).
    ``size=None`` keeps every image at its own size (noise needs a size).
    """
    source = str(source)
    path = Path(source)
    if source == "noise" and size is None:
        raise ValueError("noise images need a size")
    if source == "noise":
        named = noise_images(noise_count, size, seed)
    elif path.is_dir():
        named = [(p.stem, load_image(p, intensity)) for p in list_images(path)]
    elif path.is_file():
        named = [(path.stem, load_image(path, intensity))]
    elif _is_bundled(source):
        named = bundled_images(source, intensity)
    else:
        hint = "" if os.sep in source else _did_you_mean(source, [*BUNDLED_SETS, "noise", *_BUNDLED_IMAGES])
        raise FileNotFoundError(f"{source!r} does not exist as a folder, an image file or a bundled set{hint} "
                                f"(bundled sets: {_sets_listing()}; or 'noise')")
    if size is None:
        return named
    out_h, out_w = (size, size) if isinstance(size, int) else size
    for name, img in named:
        factor = max(out_h / img.shape[-2], out_w / img.shape[-1])
        if factor > MAX_UPSCALE:  # a thumbnail blown up: the features describe the interpolation, not the image
            warnings.warn(f"image {name} is {img.shape[-2]}×{img.shape[-1]} px: upscaled {factor:.3g}× to "
                          f"{out_h}×{out_w} px, its features say little about its content", stacklevel=2)
    return [(name, resize_center_crop(img, size)) for name, img in named]
