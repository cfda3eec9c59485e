"""Tiny random-init models and benchmark-script loading shared by the tests."""

import importlib
import sys
from pathlib import Path

import timm
import torch

import alibi_vit  # noqa: F401  (registers the models)

# Small enough for CPU tests; LayerScale at 1 so every block visibly changes the tokens
# (DINOv2's 1e-5 would hide what attention does in a random-init model).
TINY = dict(depth=2, embed_dim=32, num_heads=2, init_values=1.0)


def tiny_model(name="alibi_vit_small_patch14_reg4_dinov2", dtype=torch.float64, seed=0, **kwargs):
    torch.manual_seed(seed)
    return timm.create_model(name, **{**TINY, **kwargs}).eval().to(dtype)


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_module(name: str):
    """A script of benchmarks/ imported as a module (its own ``from report import ...`` included)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
