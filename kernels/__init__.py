"""Attention kernels with the 2D wrapped, normalised ALiBi bias (docs/method.md §2)."""

from .alibi_bias import METRICS, alibi_bias, check_grid, max_distance, patch_distances
from .attention import BACKENDS, alibi_attention, explain, resolve_backend

__all__ = ["BACKENDS", "METRICS", "alibi_attention", "alibi_bias", "check_grid", "explain", "max_distance",
           "patch_distances", "resolve_backend"]
