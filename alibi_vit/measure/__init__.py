"""Measurements of segmentation masks: the numbers materials scientists report (docs/measure.md).

One module per family of metrics, each working on ``(z, y, x)`` blocks of class values (a 2D mask is one
slice), so that the *local* ones run chunk by chunk on masks larger than memory:

- :mod:`.masks`: opening masks (PNG, TIFF stacks, zarr/OME-Zarr) and probability maps, spacing, regions;
- :mod:`.chunks`: the blocks a mask is read in, with a halo on their far sides;
- :mod:`.fractions`: phase fractions per cell, their confidence intervals, the representative-volume check;
- :mod:`.surfaces`: interface area (length in 2D) per phase pair, from face counts;
- :mod:`.correlation`: two-point correlation S2(r) along each axis, up to a radius;
- :mod:`.objects`: connected objects per phase, stitched across block borders, and their instance labels;
- :mod:`.sizes`: chord lengths and local thickness (porespy) of a region held in memory;
- :mod:`.transport`: percolation (from the objects) and tortuosity factor (TauFactor) of a region;
- :mod:`.analysis`: one pass over a mask computing the chosen metrics; :mod:`.report` and :mod:`.plots`
  write them.

Nothing here imports PyTorch; porespy and TauFactor (``pip install "alibi-vit[measure]"``) are imported
only by the metrics that need them.
"""

from .masks import MeasureError

__all__ = ["MeasureError"]
