"""Writing measurements: CSV tables over all masks, one JSON per mask, a per-object CSV, and a short report.

Units: lengths in the mask's unit (``--unit``; pixels when no spacing is known), areas and volumes in its
square and cube. ``NaN`` and infinities become empty CSV cells and JSON ``null``.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np

__all__ = ["object_summary", "plain", "write_mask_outputs", "write_tables"]


def plain(value):
    """``value`` with numpy scalars and arrays as Python values, non-finite floats as None (valid JSON)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return plain(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _write_csv(path: Path, rows: list[dict]) -> Path:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in plain(row).items()})
    return path


def write_object_csv(path: Path, table: dict, rows_at_a_time: int = 20000) -> Path:
    """The per-object table, written a slice of rows at a time (a mosaic can hold millions of objects)."""
    columns = ["id"] + [k for k, v in table.items() if isinstance(v, np.ndarray) and k != "id"]
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        for start in range(0, len(table["id"]), rows_at_a_time):
            part = slice(start, start + rows_at_a_time)
            writer.writerows(zip(*(table[c][part].tolist() for c in columns)))
    return path


def object_summary(result: dict) -> list[dict]:
    """Per phase: number of objects, how many are cut by the border, their mean and median equivalent diameter
    (of the whole ones, when there are any)."""
    table, rows = result["objects"], []
    for phase in sorted(result["fractions"]["phases"]):
        mine = table["phase"] == phase
        whole = mine & ~table["border"]
        chosen = whole if whole.any() else mine
        diameters = table["equivalent_diameter"][chosen]
        rows.append({"mask": result["mask"], "phase": phase, "objects": int(mine.sum()),
                     "border_objects": int((mine & table["border"]).sum()),
                     "mean_equivalent_diameter": float(diameters.mean()) if len(diameters) else None,
                     "median_equivalent_diameter": float(np.median(diameters)) if len(diameters) else None,
                     "diameters_of": "whole objects" if whole.any() else "all objects (every one is cut)"})
    return rows


def write_mask_outputs(out: Path, stem: str, result: dict) -> list[Path]:
    """``<stem>_measure.json`` (everything but the per-object rows) and ``<stem>_objects.csv``."""
    written = []
    summary = {k: v for k, v in result.items() if k != "objects"}
    if "objects" in result:
        summary["object_summary"] = object_summary(result)
        written.append(write_object_csv(out / f"{stem}_objects.csv", result["objects"]))
    path = out / f"{stem}_measure.json"
    path.write_text(json.dumps(plain(summary), indent=1))
    return [path] + written


def _table_rows(results: list[dict]):
    tables = {name: [] for name in ("fractions", "rve", "interfaces", "s2", "objects_summary", "percolation",
                                    "chords", "thickness", "tortuosity")}
    for result in results:
        mask = {"mask": result["mask"]}
        unit = result["unit"]
        for phase, entry in result["fractions"]["phases"].items():
            row = {**mask, **entry}
            if "specific_surface" in result:
                row[f"specific_surface_faces_per_{unit}"] = result["specific_surface"][phase]["faces"]
                row[f"specific_surface_isotropic_per_{unit}"] = result["specific_surface"][phase]["isotropic"]
            tables["fractions"].append(row)
        tables["rve"] += [{**mask, **row} for row in result["fractions"]["windows"]]
        tables["interfaces"] += [{**mask, **row} for row in result.get("interfaces", [])]
        tables["s2"] += [{**mask, **row} for row in result.get("s2", [])]
        if "objects" in result:
            tables["objects_summary"] += object_summary(result)
        tables["percolation"] += [{**mask, **row} for row in result.get("percolation", [])]
        tables["chords"] += [{**mask, **{k: v for k, v in row.items() if k != "histogram"},
                              "peak": row["histogram"]["peak"]} for row in result.get("chords", [])]
        tables["thickness"] += [{**mask, "phase": phase, "mean_diameter": h["mean"], "peak_diameter": h["peak"]}
                                for phase, h in result.get("thickness", {}).items()]
        tables["tortuosity"] += [{**mask, **row} for row in result.get("tortuosity", [])]
    return tables


def write_tables(out: Path, results: list[dict]) -> list[Path]:
    """One CSV per family over every mask (``fractions.csv``, ``interfaces.csv``, …) and ``report.md``."""
    written = [_write_csv(out / f"{name}.csv", rows) for name, rows in _table_rows(results).items() if rows]
    written.append(write_report(out / "report.md", results))
    return written


def _number(value, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:.{digits}g}"


def write_report(path: Path, results: list[dict]) -> Path:
    lines = ["# Measurements", ""]
    for result in results:
        unit = result["unit"]
        size = "×".join(str(n) for n in result["shape"])
        spacing = ", ".join(_number(s) for s in result["spacing"])
        lines += [f"## {result['mask']}", "",
                  f"{size} {'voxels' if result['ndim'] == 3 else 'pixels'} from {tuple(result['origin'])}, spacing "
                  f"({spacing}) {unit}; measured in {result['seconds']:.1f} s.", "",
                  "| phase | fraction | 95 % CI (tiles) | tiles | RVE side | probability view | specific surface "
                  f"(isotropic, 1/{unit}) |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for phase, e in result["fractions"]["phases"].items():
            proba = (f"{_number(e['proba_fraction'])} ({_number(e['proba_ci95_low'])}–{_number(e['proba_ci95_high'])})"
                     if "proba_fraction" in e else "–")
            surface = _number(result["specific_surface"][phase]["isotropic"]) if "specific_surface" in result else "–"
            rve = f"{e['rve_side']} {'px' if result['ndim'] == 2 else 'voxels'}" if e["settled"] else "not reached"
            lines.append(f"| {phase} | {_number(e['fraction'])} | {_number(e['tile_ci95_low'])}–"
                         f"{_number(e['tile_ci95_high'])} | {e['tiles']} | {rve} | {proba} | {surface} |")
        if "objects" in result:
            lines += ["", "Objects (face-connected): " + "; ".join(
                f"phase {r['phase']}: {r['objects']} ({r['border_objects']} cut by the border), median equivalent "
                f"diameter {_number(r['median_equivalent_diameter'])} {unit}" for r in object_summary(result))]
            if result.get("objects_dropped_small"):
                lines.append(f"{result['objects_dropped_small']} objects under the minimum size were dropped.")
        if "percolation" in result:
            spans = [f"{r['phase']} along {r['axis']}" for r in result["percolation"] if r["percolates"]]
            lines += ["", "Percolating: " + (", ".join(spans) if spans else "no phase spans the region")]
        if "tortuosity" in result:
            lines += ["", "Tortuosity factor: " + "; ".join(
                f"phase {r['phase']} along {r['axis']}: {_number(r['tau'])}" for r in result["tortuosity"])]
        lines.append("")
    lines += ["Definitions, units and when not to trust these numbers: docs/measure.md.", ""]
    path.write_text("\n".join(lines))
    return path
