"""aiconfigurator-core's per-op tables, read directly, and log-space grid interpolation.

The package (PyPI ``aiconfigurator-core``, NVIDIA, Apache-2.0; the ``g5[measured]`` extra)
is used only as a data source: its parquet files under
``aiconfigurator_core/systems/data/<gpu>/<op>/<framework>/<version>/``; nothing of it is
imported. Latencies in the tables are milliseconds per kernel call.

Interpolation (:class:`Grid`): the table's rows for one exact key (dtype, head_dim, ...)
form a grid over a few size axes (e.g. ``m, n, k``); between grid points the log latency
is multilinear in the log coordinates. It is exact on grid points and monotone between
adjacent ones along every axis. Corners with zero weight are not needed, so a query on a
grid line needs only the points on it. A point outside the grid is clamped onto it; the
caller scales the clamped latency by its roofline's work ratio (the extrapolation rule,
see ``docs/measured-compute.md``).
"""
from __future__ import annotations

import importlib.util
import itertools
import math
from functools import lru_cache
from pathlib import Path

import numpy as np

#: table name -> (op folder, parquet file)
TABLES = {
    "gemm": ("gemm", "gemm_perf.parquet"),
    "context_attention": ("attention", "context_attention_perf.parquet"),
    "generation_attention": ("attention", "generation_attention_perf.parquet"),
    "context_mla": ("mla", "context_mla_perf.parquet"),
    "generation_mla": ("mla", "generation_mla_perf.parquet"),
    "computescale": ("quantize", "computescale_perf.parquet"),
    "scale_matrix": ("quantize", "scale_matrix_perf.parquet"),
}

EXTRA_HINT = "install the extra: python3 -m pip install -e '.[measured]' (PyPI aiconfigurator-core, pandas, pyarrow)"


class MissingExtra(LookupError):
    """The g5[measured] extra (aiconfigurator-core, pandas, pyarrow) is not installed."""


def find_spec(name: str):
    """``importlib.util.find_spec``, a seam tests replace to simulate a missing extra."""
    return importlib.util.find_spec(name)


def data_root() -> Path:
    """``aiconfigurator_core/systems/data``; MissingExtra when the extra is not installed."""
    missing = [m for m in ("aiconfigurator_core", "pandas", "pyarrow") if find_spec(m) is None]
    if missing:
        raise MissingExtra(f"{', '.join(missing)} not installed; {EXTRA_HINT}")
    spec = find_spec("aiconfigurator_core")
    root = Path(list(spec.submodule_search_locations)[0]) / "systems" / "data"
    if not root.is_dir():
        raise MissingExtra(f"aiconfigurator_core at {root.parent.parent} has no systems/data folder")
    return root


def gpus() -> tuple[str, ...]:
    return tuple(sorted(p.name for p in data_root().iterdir() if p.is_dir()))


def _version_key(text: str):
    try:
        from packaging.version import Version
        return (0, Version(text))
    except Exception:  # noqa: BLE001 - an unparsable folder name sorts before every version
        return (-1, text)


def table_path(gpu: str, framework: str, table: str, version: str = "") -> Path:
    """The parquet file of ``table``; ``version`` "" picks the newest version that has it.

    LookupError (with what is available) when there is none."""
    folder, name = TABLES[table]
    root = data_root()
    if not (root / gpu).is_dir():
        raise LookupError(f"aiconfigurator has no GPU '{gpu}'; known: {', '.join(gpus())}")
    base = root / gpu / folder / framework
    versions = sorted((p.name for p in base.iterdir() if (p / name).is_file()), key=_version_key) \
        if base.is_dir() else []
    if version:
        if version not in versions:
            raise LookupError(f"aiconfigurator {gpu}/{folder}/{framework} has no version '{version}' with {name}; "
                              f"has: {', '.join(versions) or 'none'}")
        return base / version / name
    if not versions:
        raise LookupError(f"aiconfigurator has no {name} for {gpu} / {framework}")
    return base / versions[-1] / name


@lru_cache(maxsize=None)
def table_frame(gpu: str, framework: str, table: str, version: str = ""):
    """The table as a pandas DataFrame (read once per process)."""
    import pandas as pd
    return pd.read_parquet(table_path(gpu, framework, table, version))


class Grid:
    """Latency (ms) over a grid of positive size axes, interpolated in log space."""

    def __init__(self, axes: tuple[np.ndarray, ...], values: np.ndarray):
        self.axes = axes                       # sorted unique positive values per axis
        self.log_axes = tuple(np.log(a) for a in axes)
        self.values = values                   # ndarray, NaN where not measured
        self.log_values = np.log(values)

    @classmethod
    def from_frame(cls, frame, axes: tuple[str, ...], value: str = "latency") -> "Grid":
        """Rows -> grid; repeated rows of one point are averaged in log space."""
        coords = [np.unique(frame[a].to_numpy(dtype=float)) for a in axes]
        shape = tuple(len(c) for c in coords)
        idx = tuple(np.searchsorted(c, frame[a].to_numpy(dtype=float)) for c, a in zip(coords, axes))
        flat = np.ravel_multi_index(idx, shape)
        logs = np.log(frame[value].to_numpy(dtype=float))
        sums = np.bincount(flat, weights=logs, minlength=int(np.prod(shape)))
        counts = np.bincount(flat, minlength=int(np.prod(shape)))
        raw = np.bincount(flat, weights=frame[value].to_numpy(dtype=float), minlength=int(np.prod(shape)))
        with np.errstate(invalid="ignore", divide="ignore"):
            values = np.where(counts == 1, raw, np.exp(sums / counts))
        values[counts == 0] = np.nan
        return cls(tuple(coords), values.reshape(shape))

    def clamp(self, point) -> tuple[float, ...]:
        return tuple(float(min(max(x, a[0]), a[-1])) for x, a in zip(point, self.axes))

    def __call__(self, point) -> float | None:
        """Latency (ms) at ``point`` (already inside the grid); None where a needed corner
        was not measured."""
        lo, frac = [], []
        for x, a, la in zip(point, self.axes, self.log_axes):
            i = int(np.searchsorted(a, x, side="right")) - 1
            i = min(max(i, 0), len(a) - 1)
            if a[i] == x or i == len(a) - 1:
                lo.append(i)
                frac.append(0.0)
            else:
                lo.append(i)
                frac.append((math.log(x) - la[i]) / (la[i + 1] - la[i]))
        total = 0.0
        used = []
        for corner in itertools.product((0, 1), repeat=len(lo)):
            w = 1.0
            for c, f in zip(corner, frac):
                w *= f if c else 1.0 - f
            if w == 0.0:
                continue
            index = tuple(i + c for i, c in zip(lo, corner))
            v = self.values[index]
            if not np.isfinite(v):
                return None
            used.append((index, w))
            total += w * self.log_values[index]
        if len(used) == 1:
            return float(self.values[used[0][0]])
        return math.exp(total)
