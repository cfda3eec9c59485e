"""Transport through a phase: percolation along each axis, and the tortuosity factor (TauFactor).

Percolation comes from the stitched objects (:mod:`.objects`), so it costs nothing more and runs chunk by
chunk: a phase percolates along an axis when one of its face-connected objects reaches both faces of the
region across that axis; the percolating fraction is the share of the phase's volume in such objects.

The tortuosity factor τ = φ·D/D_eff is TauFactor's: it solves steady diffusion through the phase between
the two faces across an axis (a fixed concentration on each, the other faces closed) and compares the flux
with that of a straight slab. A straight channel gives τ = 1. TauFactor solves on the whole region at once
(PyTorch; on a CUDA GPU when there is one), so the region must fit: the command prints the size and memory it
will take before it starts and refuses past ``--max-memory`` (measure a sub-volume with ``--region``).
Anisotropic voxels go to TauFactor's ``AnisotropicSolver``.
"""

from __future__ import annotations

import numpy as np

from .masks import MeasureError

__all__ = ["TORTUOSITY_BYTES_PER_VOXEL", "percolation", "tortuosity"]

TORTUOSITY_BYTES_PER_VOXEL = 80  # float32 field, neighbour factors and two checkerboards, plus their padding
TORTUOSITY_BASE_BYTES = 500e6  # PyTorch
MEASURE_EXTRA = 'pip install "alibi-vit[measure]"'


def percolation(table: dict, phase_voxels: dict[int, int], ndim: int) -> list[dict]:
    """Per phase and axis: whether it percolates, and the share of its voxels in spanning objects."""
    rows = []
    axes = "zyx" if ndim == 3 else "yx"
    for phase, total in sorted(phase_voxels.items()):
        mine = table["phase"] == phase
        for axis in axes:
            spanning = mine & table[f"spans_{axis}"]
            share = float(table["voxels"][spanning].sum() / total) if total else 0.0
            rows.append({"phase": phase, "axis": axis, "percolates": bool(spanning.any()), "percolating_fraction": share})
    return rows


def import_taufactor():
    try:
        import taufactor
    except ImportError:
        raise MeasureError(f"the tortuosity factor needs TauFactor, which is not installed: {MEASURE_EXTRA}") from None
    return taufactor


def _connects_faces(indicator: np.ndarray) -> bool:
    """Whether a face-connected path of ``indicator`` joins its first and last layers along axis 0."""
    from scipy import ndimage

    labels, _ = ndimage.label(indicator)
    return bool(np.intersect1d(labels[0][labels[0] > 0], labels[-1][labels[-1] > 0]).size)


def tortuosity(values: np.ndarray, phase: int, axis: int, spacing, device: str | None = None,
               iter_limit: int = 20000, tolerance: float = 1e-2) -> dict:
    """TauFactor's tortuosity factor of ``phase`` across ``axis`` of ``values`` (z, y, x; a 2D mask is one slice).
    τ is ``inf`` when the phase does not connect the two faces."""
    taufactor = import_taufactor()
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    indicator = (values == phase).astype(np.uint8)
    if values.shape[0] == 1:  # 2D: TauFactor takes (x, y) and adds a unit axis
        indicator, spacing, axis = indicator[0], tuple(spacing[1:]), axis - 1
    order = [axis] + [a for a in range(indicator.ndim) if a != axis]  # TauFactor's flux runs along its first axis
    indicator = np.ascontiguousarray(np.transpose(indicator, order))
    spacing = tuple(float(spacing[a]) for a in order)
    if indicator.shape[0] < 2:  # no flux to solve for across a single layer
        return {"tau": float("nan"), "effective_diffusivity": float("nan"), "converged": False, "device": device}
    if not _connects_faces(indicator):  # TauFactor would iterate to its limit on a blocked phase
        return {"tau": float("inf"), "effective_diffusivity": 0.0, "converged": True, "device": device}
    if len(set(spacing)) > 1 and indicator.ndim == 3:
        solver = taufactor.AnisotropicSolver(indicator, spacing, device=torch.device(device))
    else:
        solver = taufactor.Solver(indicator, device=device)
    from contextlib import redirect_stdout
    from io import StringIO

    with redirect_stdout(StringIO()):  # TauFactor prints its progress and warnings
        tau = float(np.asarray(solver.solve(iter_limit=iter_limit, verbose=False, conv_crit=tolerance)).ravel()[0])
    d_rel = float(np.asarray(solver.D_rel).ravel()[0])
    if d_rel == 0 or not np.isfinite(tau) or tau == 0:
        tau = float("inf")
    return {"tau": tau, "effective_diffusivity": d_rel, "converged": bool(solver.converged), "device": device}
