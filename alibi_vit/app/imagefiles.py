"""Image files as the app reads them: dimensions checked before any pixel is decoded, and the
pixel kind every image of one session shares.

A decompression bomb is a small file that decodes to a huge image (a 437 KB PNG of 60000² px
decodes to 3.6 GB). The app reads each file's header first (Pillow's lazy ``Image.open``,
tifffile's page headers) and refuses an image of more than ``max_pixels`` pixels, or a file
(a stack) of more than ``STACK_IMAGES`` such images, before decoding anything. ``alibi-vit app``
also sets Pillow's own decompression-bomb limit (``PIL.Image.MAX_IMAGE_PIXELS``) to the same cap,
so Pillow itself refuses anything past twice the cap even on a path that skipped the check.

Big images are never read whole: zarr/OME-Zarr stores, and TIFFs (BigTIFF, pyramidal OME-TIFF)
of one image of more than ``CHUNKED_PIXELS`` pixels (the size above which ``alibi-vit segment
apply`` streams them too) are opened as chunked images (:func:`open_chunked`): their header and
metadata are read, and later only the chunks a tile needs. What such a file declares is bounded
all the same, before anything is read (a 300-byte ``.zarray`` can declare 2,000,000² px): one image
at most ``CHUNKED_SCALE`` × ``max_pixels`` pixels, and each storage chunk, which is decoded whole,
at most ``max_pixels`` (:func:`check_chunked`). A zarr store is read through a store that refuses a
chunk or metadata file that leads out of the store's folder (a symbolic link to a file elsewhere),
as files that lead out of the folders given are refused (:func:`confined`).

One session segments one kind of image: one bit depth, all grey or all colour. Its black and
white points are fitted on the pooled pixels of its images, so an 8-bit image among 16-bit ones
would be shown, and featurised, almost black, and a 16-bit one among 8-bit ones pure white.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import SessionError

__all__ = ["CHUNKED_PIXELS", "CHUNKED_SCALE", "DEFAULT_MAX_PIXELS", "STACK_IMAGES", "OutsideStore", "check_chunked",
           "check_dimensions", "confined", "describe_kind", "inspect_file", "open_chunked", "pixel_kind", "read_images"]

DEFAULT_MAX_PIXELS = 1 << 26  # 67.1 Mpx (8192²): the classical features of one such image take ~17 GB
STACK_IMAGES = 16  # a file may hold at most this many images of max_pixels pixels (a stack of pages)
CHUNKED_PIXELS = 4096 * 4096  # a TIFF image larger than this is read chunk by chunk (as segment apply streams it)
CHUNKED_SCALE = 1024  # an image read chunk by chunk may declare this many times max_pixels (68.7 Gpx by default)

_DEPTHS = {"uint8": "8-bit", "uint16": "16-bit", "uint32": "32-bit", "int8": "8-bit signed", "int16": "16-bit signed",
           "int32": "32-bit signed", "float16": "16-bit float", "float32": "32-bit float", "float64": "64-bit float",
           "bool": "1-bit"}


def _megapixels(n: int) -> str:
    return f"{n / 1e6:.1f} Mpx" if n < 1e10 else f"{n / 1e9:,.1f} Gpx"


def _dimensions(path: Path) -> list[tuple[int, int]]:
    """(height, width) of every image in the file, from its headers alone."""
    if path.suffix.lower() in (".tif", ".tiff"):
        import tifffile

        with tifffile.TiffFile(path) as tif:
            return [(int(p.imagelength), int(p.imagewidth)) for p in tif.pages]
    from PIL import Image

    with Image.open(path) as img:  # reads the header only; Pillow raises DecompressionBombError past 2x its limit
        width, height = img.size
    return [(int(height), int(width))]


def check_dimensions(path, max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
    """A 413 SessionError when an image of the file has more than ``max_pixels`` pixels, or the file
    more than ``STACK_IMAGES`` times that; a ValueError when its header cannot be read."""
    from PIL import Image

    path = Path(path)
    try:
        dims = _dimensions(path)
    except Image.DecompressionBombError as err:  # Pillow's own limit, past twice its MAX_IMAGE_PIXELS
        raise SessionError(f"{path.name} is refused as a decompression bomb ({err}); the app reads images of at most "
                           f"{_megapixels(max_pixels)} (--max-megapixels)", status=413) from None
    except FileNotFoundError:
        raise
    except Exception as err:  # noqa: BLE001 - any header the readers cannot parse is an unreadable file
        raise ValueError(f"cannot read image {path}: {err}") from None
    for i, (h, w) in enumerate(dims):
        if h * w > max_pixels:
            page = f" (page {i})" if len(dims) > 1 else ""
            raise SessionError(f"{path.name}{page} is {w}×{h} px = {_megapixels(h * w)}, over the app's limit of "
                               f"{_megapixels(max_pixels)} per image (start it with --max-megapixels to raise it)",
                               status=413)
    total = sum(h * w for h, w in dims)
    if total > STACK_IMAGES * max_pixels:
        raise SessionError(f"{path.name} holds {len(dims)} images of {_megapixels(total)} in all, over the app's "
                           f"limit of {_megapixels(STACK_IMAGES * max_pixels)} per file (--max-megapixels × "
                           f"{STACK_IMAGES})", status=413)


def read_images(path, max_pixels: int = DEFAULT_MAX_PIXELS) -> list[np.ndarray]:
    """The image(s) in a file, after :func:`check_dimensions`: one array, or one per page of a
    multi-page TIFF; a clear ValueError for anything unreadable."""
    from PIL import Image

    from ..trainable.io import as_grayscale, read_array, read_slices

    path = Path(path)
    check_dimensions(path, max_pixels)
    try:
        pages = read_slices(path)
        if pages is None:
            pages = [read_array(path)]
    except Image.DecompressionBombError as err:  # the file changed since its header was checked
        raise SessionError(f"{path.name}: {err}", status=413) from None
    for i, page in enumerate(pages):
        as_grayscale(page, f"{path.name}" + (f" page {i}" if len(pages) > 1 else ""))
    return pages


def pixel_kind(image) -> str:
    """What one session's images must share: dtype, and grey or colour (e.g. ``"uint16 grey"``), of
    an array or a chunked image."""
    from ..chunked import ChunkedImage

    colour = image.channels > 1 if isinstance(image, ChunkedImage) else image.ndim == 3
    return f"{image.dtype.name} {'colour' if colour else 'grey'}"


def check_chunked(image, name: str, max_pixels: int = DEFAULT_MAX_PIXELS, chunk_pixels: int | None = None) -> None:
    """A 413 SessionError when a chunked image (:class:`~alibi_vit.chunked.ChunkedImage`) declares more
    than ``CHUNKED_SCALE`` × ``max_pixels`` pixels per plane, or any level stores them in chunks of more
    than ``chunk_pixels`` pixels (default ``max_pixels``; across every axis but the channels'): a chunk
    is decoded whole, as an image read whole is. Only the metadata are looked at."""
    h, w = (int(n) for n in image.shape)
    limit = CHUNKED_SCALE * max_pixels
    if h * w > limit:
        raise SessionError(f"{name} declares {w}×{h} px = {_megapixels(h * w)}, over the app's limit of "
                           f"{_megapixels(limit)} for an image read chunk by chunk ({CHUNKED_SCALE} × "
                           "--max-megapixels): its metadata are damaged, or it must be split", status=413)
    chunk_pixels = max_pixels if chunk_pixels is None else chunk_pixels
    for level, array in enumerate(image.levels):
        chunks = getattr(array, "chunks", None)  # (memory-mapped TIFFs are read by region: no chunks)
        if not chunks or len(chunks) != len(image.axes):
            continue
        pixels = int(np.prod([int(n) for a, n in zip(image.axes, chunks) if a != "c"], dtype=np.int64))
        if pixels > chunk_pixels:
            shown = "×".join(str(int(n)) for n in chunks)
            raise SessionError(f"{name} stores {'its pixels' if level == 0 else f'pyramid level {level}'} in chunks of "
                               f"{shown} (axes {image.axes}) = {_megapixels(pixels)}, each read whole: over the app's "
                               f"limit of {_megapixels(chunk_pixels)} per chunk (--max-megapixels); store it in "
                               "smaller chunks", status=413)


class OutsideStore(PermissionError):
    """A file of a zarr store that leads out of the store's folder (a symbolic link)."""


def _confined_store_class():
    from zarr.storage import LocalStore

    class ConfinedStore(LocalStore):
        """A read-only local zarr store that refuses a key whose file resolves outside its folder
        (a chunk that is a symbolic link to a file elsewhere); links within the store are read."""

        def _check(self, key: str) -> None:
            path = self.root / key
            real = path.resolve()
            if real != path and not real.is_relative_to(self.root.resolve()):
                raise OutsideStore(f"{key} of the zarr store {self.root} leads to {real}, outside the store (a "
                                   "symbolic link): not read")

        def get_sync(self, key, *args, **kwargs):
            self._check(key)
            return super().get_sync(key, *args, **kwargs)

        async def get(self, key, *args, **kwargs):
            self._check(key)
            return await super().get(key, *args, **kwargs)

        async def get_partial_values(self, prototype, key_ranges):
            key_ranges = list(key_ranges)
            for key, _ in key_ranges:
                self._check(key)
            return await super().get_partial_values(prototype, key_ranges)

    return ConfinedStore


def confined(image):
    """``image`` (a :class:`~alibi_vit.chunked.ChunkedImage`) with every level stored in a local zarr
    store read through a store that refuses files leading out of it (:class:`OutsideStore`; a read
    of them is an :class:`~alibi_vit.images.ImageReadError` naming the file). Other levels (TIFF
    pages) are kept as they are."""
    import dataclasses

    import zarr
    from zarr.storage import LocalStore

    store_class, levels = _confined_store_class(), []
    for array in image.levels:
        if isinstance(array, zarr.Array) and type(array.store) is LocalStore:
            store = store_class(Path(array.store.root), read_only=True)
            array = zarr.open_array(store=store, path=array.path, mode="r")
        levels.append(array)
    return dataclasses.replace(image, levels=levels)


def _chunked_candidate(path: Path):
    """The chunked view of ``path`` when it is read chunk by chunk (a zarr store, or a TIFF of one image
    larger than CHUNKED_PIXELS), else None. A zarr store that cannot be read is an ImageReadError;
    a TIFF the chunked reader cannot take is left to the whole-file reader (and its messages)."""
    from ..chunked import TIFF_SUFFIXES, is_zarr_path, open_image
    from ..images import ImageReadError

    if is_zarr_path(path):
        return open_image(path)
    if path.suffix.lower() not in TIFF_SUFFIXES:
        return None
    try:
        image = open_image(path)
    except ImageReadError:
        return None
    return image if image.planes == 1 and image.shape[0] * image.shape[1] > CHUNKED_PIXELS else None


def open_chunked(path, max_pixels: int = DEFAULT_MAX_PIXELS):
    """The chunked view of an image the app reads chunk by chunk, its zarr levels :func:`confined`; a
    ValueError naming the problem for a file that cannot be read so, or holds more than one 2D image
    (planes); a 413 SessionError for one that declares more than the app takes (:func:`check_chunked`)."""
    from ..images import ImageReadError

    path = Path(path)
    try:
        image = _chunked_candidate(path)
    except ImageReadError as err:
        raise ValueError(str(err)) from None
    if image is None:
        raise ValueError(f"{path.name} is not read chunk by chunk (a zarr store, or a TIFF of more than "
                         f"{_megapixels(CHUNKED_PIXELS)})")
    if image.planes != 1:
        raise ValueError(f"{path.name} holds {image.planes} planes (axes {image.axes}): the app opens 2D images; "
                         "store one plane per image")
    if image.channels not in (1, 3, 4):
        raise ValueError(f"{path.name} has {image.channels} channels (axes {image.axes}): the app opens grey or "
                         "RGB(A) images")
    check_chunked(image, path.name, max_pixels)
    return confined(image)


def inspect_file(path, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[list[tuple[tuple, str]], bool]:
    """([(shape, pixel kind)] of each image in the file, whether it is read chunk by chunk). A file
    read whole is decoded here (an unreadable one fails now); a chunked one only opened."""
    from ..images import ImageReadError

    path = Path(path)
    try:
        chunked = _chunked_candidate(path) is not None
    except ImageReadError as err:
        raise ValueError(str(err)) from None
    if chunked:
        image = open_chunked(path, max_pixels)
        shape = image.shape + ((image.channels,) if image.channels > 1 else ())
        return [(shape, pixel_kind(image))], True
    return [(tuple(page.shape), pixel_kind(page)) for page in read_images(path, max_pixels)], False


def describe_kind(kind: str) -> str:
    """``"uint16 grey"`` → ``"16-bit grey"``, for messages."""
    dtype, _, tone = kind.partition(" ")
    return f"{_DEPTHS.get(dtype, dtype)} {tone}"
