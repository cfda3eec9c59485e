"""Reading images the way microscopists store them, and the fixed image sets the project probes.

``load_image`` turns PNG, JPEG, TIFF (8/16-bit, float, grayscale, RGB, RGBA) into a float
tensor (3, H, W) in [0, 1]. ``resize_center_crop`` and ``normalize`` are the DINOv2
preprocessing (shortest side resized, centre crop, ImageNet mean/std).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "IMAGE_EXTENSIONS", "IMAGENET_MEAN", "IMAGENET_STD", "ImageReadError", "bundled_images", "denormalize",
    "list_images", "load_image", "load_image_set", "noise_images", "normalize", "resize_center_crop", "to_rgb_tensor",
]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# Offline images that ship with scikit-image, grouped as the probe's datasets.
BUNDLED_SETS = {
    "textures": ("brick", "grass", "gravel"),
    "micrographs": ("cell", "immunohistochemistry", "microaneurysms", "hubble_deep_field"),
    "photos": ("astronaut", "chelsea", "coffee", "rocket"),
}


class ImageReadError(ValueError):
    """An image file that cannot be read or has an unusable layout."""


def to_rgb_tensor(array: np.ndarray, source: str = "array") -> torch.Tensor:
    """(H, W), (H, W, 1|3|4) integer or float array → float32 tensor (3, H, W) scaled to [0, 1]."""
    a = np.asarray(array)
    if a.ndim == 3 and a.shape[0] in (1, 3, 4) and a.shape[-1] not in (1, 3, 4):
        a = np.moveaxis(a, 0, -1)  # channels-first TIFF stacks
    if a.ndim == 2:
        a = a[..., None]
    if a.ndim != 3 or a.shape[-1] not in (1, 2, 3, 4):
        raise ImageReadError(f"{source}: expected a 2D grayscale or RGB(A) image, got array of shape {a.shape}")
    if a.shape[-1] in (2, 4):  # drop alpha
        a = a[..., :-1]
    if a.dtype == bool:
        a = a.astype(np.float32)
    elif np.issubdtype(a.dtype, np.integer):
        a = a.astype(np.float32) / float(np.iinfo(a.dtype).max)
    elif np.issubdtype(a.dtype, np.floating):
        a = a.astype(np.float32)
        lo, hi = float(np.nanmin(a)), float(np.nanmax(a))
        if lo < 0.0 or hi > 1.0:  # float micrographs come in arbitrary units
            a = (a - lo) / (hi - lo) if hi > lo else np.zeros_like(a)
    else:
        raise ImageReadError(f"{source}: unsupported pixel type {a.dtype}")
    if a.shape[-1] == 1:
        a = np.repeat(a, 3, axis=-1)
    return torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))


def load_image(path) -> torch.Tensor:
    """Read an image file as a float32 tensor (3, H, W) in [0, 1]; raise ImageReadError naming the file."""
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
                if im.mode in ("P", "CMYK", "YCbCr", "LAB", "HSV"):  # CMYK JPEGs would read as RGBA
                    im = im.convert("RGB")
                elif im.mode == "1":
                    im = im.convert("L")
                elif im.mode in ("I;16", "I;16B", "I;16L"):
                    return to_rgb_tensor(np.array(im, dtype=np.uint16), str(path))
                elif im.mode == "I":
                    array = np.array(im, dtype=np.int32)
                    return to_rgb_tensor(array.astype(np.float32), str(path))
                array = np.array(im)
    except ImageReadError:
        raise
    except Exception as err:  # PIL/tifffile raise many types for corrupt files
        raise ImageReadError(f"{path}: cannot read image ({type(err).__name__}: {err})") from err
    if array.ndim == 3 and array.shape[0] == 1:
        array = array[0]
    return to_rgb_tensor(array, str(path))


def list_images(folder, recursive: bool = True) -> list[Path]:
    """Image files under ``folder`` sorted by path; a missing or image-less folder is an error."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"image folder {folder} does not exist")
    pattern = "**/*" if recursive else "*"
    files = sorted(p for p in folder.glob(pattern) if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
    if not files:
        raise FileNotFoundError(f"image folder {folder} holds no images ({', '.join(IMAGE_EXTENSIONS)})")
    return files


def resize_center_crop(image: torch.Tensor, size) -> torch.Tensor:
    """Resize so the shortest side matches ``size`` then crop the centre; ``size`` is int or (H, W)."""
    out_h, out_w = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    h, w = image.shape[-2:]
    scale = max(out_h / h, out_w / w)
    new_h, new_w = max(out_h, round(h * scale)), max(out_w, round(w * scale))
    if (new_h, new_w) != (h, w):
        image = F.interpolate(image[None], size=(new_h, new_w), mode="bilinear", antialias=True,
                              align_corners=False)[0]
    top, left = (new_h - out_h) // 2, (new_w - out_w) // 2
    return image[..., top:top + out_h, left:left + out_w].clamp(0.0, 1.0)


def _mean_std(like: torch.Tensor):
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


def bundled_images(name: str = "textures") -> list[tuple[str, torch.Tensor]]:
    """Named images that ship with scikit-image: a set from ``BUNDLED_SETS`` or one image name."""
    from skimage import data

    names = BUNDLED_SETS.get(name, (name,))
    images = []
    for n in names:
        loader = getattr(data, n, None)
        if loader is None:
            raise ValueError(f"unknown bundled image or set {n!r}; sets: {', '.join(BUNDLED_SETS)}")
        images.append((n, to_rgb_tensor(loader(), f"skimage.data.{n}")))
    return images


def noise_images(count: int, size, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Uniform-noise RGB images: the probe's control set with no content at all."""
    h, w = (size, size) if isinstance(size, int) else size
    gen = torch.Generator().manual_seed(seed)
    return [(f"noise_{i}", torch.rand(3, h, w, generator=gen)) for i in range(count)]


def load_image_set(source: str, size: int, noise_count: int = 8, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """(name, (3, size, size) image in [0, 1]) for a folder, a bundled set or ``"noise"``, resized and cropped."""
    if source == "noise":
        named = noise_images(noise_count, size, seed)
    elif source in BUNDLED_SETS and not Path(source).exists():
        named = bundled_images(source)
    else:
        named = [(p.stem, load_image(p)) for p in list_images(source)]
    return [(name, resize_center_crop(img, size)) for name, img in named]
