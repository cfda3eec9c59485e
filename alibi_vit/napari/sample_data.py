"""napari sample data: the labelled micrographs that ship with the package
(:func:`alibi_vit.trainable.datasets.load_micrographs`; sources and licences in its ``micrographs/README.md``).

Each sample is the micrograph and, where its authors drew them, their scribbles as a Labels layer
named like the widget's scribble layers, so Train works at once."""

from __future__ import annotations

from ..trainable.datasets import load_micrographs

__all__ = ["barrier_coating", "superalloy", "tem"]

SCRIBBLE_SUFFIX = " scribbles"  # the widget finds an image's scribble layer by this name


def _layers(name: str) -> list[tuple]:
    (m,) = load_micrographs("all", names=[name])
    layers = [(m.image, {"name": m.name, "metadata": {"classes": list(m.classes), "source": m.source}}, "image")]
    if m.authors_scribbles is not None:
        layers.append((m.authors_scribbles.astype("uint8"), {"name": m.name + SCRIBBLE_SUFFIX}, "labels"))
    return layers


def superalloy() -> list[tuple]:
    """Etched Ni-superalloy SEM, three phases, with the interactive-seg-backend authors' scribbles."""
    return _layers("super_45kx_etched")


def barrier_coating() -> list[tuple]:
    """Barrier-coating SEM, 1024², three phases, one of them thin cracks (no scribbles)."""
    return _layers("ebc_010417_4_S2480009")


def tem() -> list[tuple]:
    """A TEM image, two phases, with the interactive-seg-backend authors' scribbles."""
    return _layers("isb_tem")
