"""Figures of one mask's measurements, each as PNG and SVG: the fraction against window side (the
representative-volume check), S2(r), and the size distributions (objects, chords, local thickness)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["write_plots"]

FORMATS = ("png", "svg")


def _save(figure, path: Path, dpi: int) -> list[Path]:
    written = []
    for suffix in FORMATS:
        target = path.with_suffix(f".{suffix}")
        figure.savefig(target, dpi=dpi, bbox_inches="tight")
        written.append(target)
    return written


def _figure(panels: int):
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    figure = Figure(figsize=(4.2 * panels, 3.4), layout="constrained")
    return figure, [figure.add_subplot(1, panels, i + 1) for i in range(panels)]


def _colour(phase: int):
    from matplotlib import colormaps

    return colormaps["tab10"](phase % 10)


def plot_windows(result: dict, path: Path, dpi: int) -> list[Path]:
    figure, (ax,) = _figure(1)
    rows = result["fractions"]["windows"]
    for phase, entry in result["fractions"]["phases"].items():
        mine = [r for r in rows if r["phase"] == phase]
        sides = np.array([r["window_side"] for r in mine], float) * result["spacing"][-1]
        mean, std = np.array([r["mean"] for r in mine]), np.array([r["std"] for r in mine])
        ax.errorbar(sides, mean, yerr=std, marker="o", capsize=3, color=_colour(phase), label=f"phase {phase}")
        ax.axhline(entry["fraction"], color=_colour(phase), lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"window side ({result['unit']})")
    ax.set_ylabel("fraction (mean ± s.d. over windows)")
    ax.set_title("representative-volume check")
    ax.legend(fontsize=8)
    return _save(figure, path, dpi)


def plot_s2(result: dict, path: Path, dpi: int) -> list[Path]:
    figure, (ax,) = _figure(1)
    for phase in sorted({r["phase"] for r in result["s2"]}):
        for axis, style in (("z", "--"), ("y", "-."), ("x", ":"), ("mean", "-")):
            rows = [r for r in result["s2"] if r["phase"] == phase and r["axis"] == axis]
            if rows:
                ax.plot([r["distance"] for r in rows], [r["s2"] for r in rows], style, color=_colour(phase),
                        label=f"phase {phase}, {axis}", lw=1.6 if axis == "mean" else 1)
        fraction = result["fractions"]["phases"][phase]["fraction"]
        ax.axhline(fraction ** 2, color=_colour(phase), lw=0.6, alpha=0.6)
    ax.set_xlabel(f"r ({result['unit']})")
    ax.set_ylabel("S2(r)")
    ax.set_title("two-point correlation (thin lines: φ²)")
    ax.legend(fontsize=7)
    return _save(figure, path, dpi)


def _bars(ax, histogram: dict, colour, label: str) -> None:
    edges, share = np.asarray(histogram["edges"]), np.asarray(histogram["share"])
    if len(share):
        ax.stairs(share, edges, color=colour, label=label)


def plot_sizes(result: dict, path: Path, dpi: int) -> list[Path]:
    from .sizes import size_histogram

    panels = [name for name in ("objects", "chords", "thickness") if name in result]
    figure, axes = _figure(len(panels))
    unit = result["unit"]
    for ax, name in zip(axes, panels):
        if name == "objects":
            table = result["objects"]
            for phase in sorted(result["fractions"]["phases"]):
                whole = (table["phase"] == phase) & ~table["border"]
                _bars(ax, size_histogram(table["equivalent_diameter"][whole]), _colour(phase), f"phase {phase}")
            ax.set_xlabel(f"equivalent diameter ({unit}), whole objects")
            ax.set_ylabel("share of objects")
        elif name == "chords":
            for row in result["chords"]:
                _bars(ax, row["histogram"], _colour(row["phase"]), f"phase {row['phase']}, {row['axis']}")
            ax.set_xlabel(f"chord length ({unit})")
            ax.set_ylabel("share of chords")
        else:
            for phase, histogram in result["thickness"].items():
                _bars(ax, histogram, _colour(phase), f"phase {phase}")
            ax.set_xlabel(f"local thickness, diameter ({unit})")
            ax.set_ylabel("share of volume")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:  # e.g. every object cut by the border: say so rather than leave an empty frame
            ax.text(0.5, 0.5, "nothing to show" + (": every object is cut by the border" if name == "objects" else ""),
                    ha="center", va="center", transform=ax.transAxes, fontsize=8)
    return _save(figure, path, dpi)


def write_plots(out: Path, stem: str, result: dict, dpi: int = 150) -> list[Path]:
    written = plot_windows(result, out / f"{stem}_fraction_vs_window", dpi)
    if result.get("s2"):
        written += plot_s2(result, out / f"{stem}_s2", dpi)
    if any(name in result for name in ("objects", "chords", "thickness")):
        written += plot_sizes(result, out / f"{stem}_sizes", dpi)
    return written
