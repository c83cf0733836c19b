"""``g5 plot``: figures from a results database (matplotlib, Agg backend, PNG or SVG).

Kinds:

- ``latency``: TTFT or TPOT against a parallel dimension (``--x``, cp by default), one line
  per value of whatever else varies in the rows (S in a CP scan);
- ``memory``: per-chip memory of each layout (the fullest chip), stacked weights / KV cache /
  activations / workspace, against the chip's capacity;
- ``pareto``: latency against per-chip memory for every layout, with the Pareto front;
- ``timeline``: one layer across the chips of one group (``--x`` dimension, cp by default),
  compute against communication, re-simulated from the configuration of one row.

Every axis label carries its unit; fonts and sizes are chosen for a slide.
"""
from __future__ import annotations

import io
import json
import pathlib
from typing import Mapping, Optional, Sequence

from g5core.api.errors import ConfigError, G5Error
from g5core.sim.memory import GIB

KINDS = ("latency", "memory", "pareto", "timeline")
FORMATS = {".png": "png", ".svg": "svg"}
FIGSIZE_IN = (11.0, 6.5)
FONT_PT = 14


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise G5Error("g5 plot needs matplotlib: pip install 'g5[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": FONT_PT, "axes.titlesize": FONT_PT + 2, "axes.labelsize": FONT_PT,
                         "legend.fontsize": FONT_PT - 2, "xtick.labelsize": FONT_PT - 2,
                         "ytick.labelsize": FONT_PT - 2, "svg.hashsalt": "g5"})
    return plt


def image_format(path) -> str:
    suffix = pathlib.Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ConfigError("-o", f"{path}: use a .png or .svg file name")
    return FORMATS[suffix]


def _layout(par: Mapping) -> str:
    """``cp=4 dp=2``: the dimensions larger than 1 (a label for a slide)."""
    return " ".join(f"{k}={v}" for k, v in sorted(par.items()) if v != 1) or "one chip per replica"


def _metric(rows: Sequence[Mapping]) -> str:
    phases = {r["phase"] for r in rows}
    return {"prefill": "TTFT", "decode": "TPOT"}.get(phases.pop(), "latency") if len(phases) == 1 else "latency"


def _inputs(r: Mapping) -> dict:
    """The row's inputs as flat ``key -> value`` (parallel dimensions as ``parallel.<dim>``)."""
    cfg = r["config"]
    out = {k: json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v
           for k, v in cfg.items() if k != "parallel"}
    for k, v in (cfg.get("parallel") or {}).items():
        out[f"parallel.{k}"] = v
    return out


def series_keys(rows: Sequence[Mapping], x_key: str) -> list[str]:
    """The inputs that tell the lines apart: those that vary, less the x axis and any parallel
    dimension that the x axis and the others determine (dp with dp=auto)."""
    flat = [_inputs(r) for r in rows]
    keys = sorted({k for f in flat for k in f})
    varying = [k for k in keys if k != x_key and len({json.dumps(f.get(k)) for f in flat}) > 1]
    kept = list(varying)
    for k in [k for k in varying if k.startswith("parallel.")]:
        others = [o for o in kept if o != k] + [x_key]
        seen: dict = {}
        determined = True
        for f in flat:
            sig = json.dumps([f.get(o) for o in others])
            if seen.setdefault(sig, f.get(k)) != f.get(k):
                determined = False
                break
        if determined:
            kept.remove(k)
    return kept


def _ok(rows: Sequence[Mapping]) -> list[Mapping]:
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        raise G5Error("the database holds no successful row to plot")
    return ok


def _latency_scale(ax, values: Sequence[float]) -> None:
    """A log axis where latencies span a decade or more, a linear one otherwise."""
    if min(values) > 0 and max(values) / min(values) >= 10:
        ax.set_yscale("log")


def latency_figure(rows: Sequence[Mapping], x_dim: str = "cp"):
    plt = _pyplot()
    ok = _ok(rows)
    x_key = f"parallel.{x_dim}"
    if not any(x_key in _inputs(r) for r in ok):
        raise ConfigError("--x", f"no row has the dimension {x_dim!r}")
    keys = series_keys(ok, x_key)
    lines: dict[tuple, list] = {}
    for r in ok:
        f = _inputs(r)
        lines.setdefault(tuple(f.get(k) for k in keys), []).append((f.get(x_key, 1), r["latency_s"]))
    metric = _metric(ok)
    fig, ax = plt.subplots(figsize=FIGSIZE_IN)
    for label_values, pts in sorted(lines.items(), key=lambda kv: json.dumps(kv[0])):
        pts.sort()
        label = ", ".join(f"{k.removeprefix('parallel.')}={v}" for k, v in zip(keys, label_values)) or "all rows"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linewidth=2, label=label)
    xs = sorted({p[0] for pts in lines.values() for p in pts})
    if len(xs) > 1 and min(xs) > 0 and max(xs) / min(xs) >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    _latency_scale(ax, [r["latency_s"] for r in ok])
    ax.set_xlabel(f"{x_dim} (parallel degree, chips)")
    ax.set_ylabel(f"{metric} (s)")
    ax.set_title(f"{metric} against {x_dim}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(title=", ".join(k.removeprefix("parallel.") for k in keys) or None)
    fig.tight_layout()
    return fig


MEMORY_PARTS = (("weights_bytes", "weights"), ("kv_cache_bytes", "KV cache"), ("activation_bytes", "activations"),
                ("workspace_bytes", "workspace"))


def memory_figure(rows: Sequence[Mapping]):
    plt = _pyplot()
    ok = _ok(rows)
    keys = series_keys(ok, "")
    labels = []
    for r in ok:
        f = _inputs(r)
        extra = [f"{k}={f.get(k)}" for k in keys if not k.startswith("parallel.")]
        labels.append("\n".join([_layout(r["parallel"])] + extra))
    fig, ax = plt.subplots(figsize=(max(FIGSIZE_IN[0], 0.6 * len(ok) + 3), FIGSIZE_IN[1] + 1))
    xs = range(len(ok))
    bottom = [0.0] * len(ok)
    for column, name in MEMORY_PARTS:
        heights = [r[column] / GIB for r in ok]
        ax.bar(xs, heights, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights)]
    caps = [r["capacity_bytes"] / GIB for r in ok]
    ax.step([x - 0.5 for x in xs] + [len(ok) - 0.5], caps + caps[-1:], where="post", color="black",
            linestyle="--", linewidth=2, label="capacity")
    ax.set_xticks(list(xs), labels, rotation=60 if len(ok) > 6 else 0, ha="right" if len(ok) > 6 else "center")
    ax.set_xlabel("layout")
    ax.set_ylabel("memory on the fullest chip (GiB)")
    ax.set_title("per-chip memory by layout")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def pareto_figure(rows: Sequence[Mapping]):
    from g5core.study.search import Candidate, pareto_front

    plt = _pyplot()
    ok = _ok(rows)
    cands = [Candidate(parallel=r["parallel"], latency_s=r["latency_s"], objective_value=r["latency_s"],
                       fits=bool(r["fits"]), max_total_bytes=r["max_total_bytes"],
                       tokens_per_s_per_chip=r["tokens_per_s_per_chip"]) for r in ok]
    front = pareto_front(cands)
    metric = _metric(ok)
    fig, ax = plt.subplots(figsize=FIGSIZE_IN)
    ax.scatter([c.max_total_bytes / GIB for c in cands], [c.latency_s for c in cands], s=60, alpha=0.6,
               label="layouts")
    ax.plot([c.max_total_bytes / GIB for c in front], [c.latency_s for c in front], marker="o", markersize=9,
            linewidth=2, color="tab:red", label="Pareto front")
    for c in front:
        ax.annotate(_layout(c.parallel), (c.max_total_bytes / GIB, c.latency_s), textcoords="offset points",
                    xytext=(6, 6), fontsize=FONT_PT - 4)
    ax.set_xlabel("memory on the fullest chip (GiB)")
    ax.set_ylabel(f"{metric} (s)")
    _latency_scale(ax, [c.latency_s for c in cands])
    ax.set_title(f"{metric} against per-chip memory")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def timeline_figure(row: Mapping, group_dim: str = "cp", layer: Optional[int] = None):
    """One layer across the chips of the group of chip 0 along ``group_dim``, from a fresh simulation."""
    from g5core.api.ops import ComputeOp
    from g5core.sim.run import run

    plt = _pyplot()
    out = run(row["config"], disabled=row.get("disabled") or ())
    if out.sim is None:
        raise G5Error("the timeline needs the G5 path (path: g5)")
    rm = out.plan.ctx.rankmap
    if group_dim not in rm.dims:
        raise ConfigError("--x", f"no dimension {group_dim!r} in this layout; dimensions: {', '.join(rm.dims)}")
    group = rm.groups(group_dim)[0]
    sym = out.sim.symmetry
    if sym.applied and max(group) >= sym.slice_chips:  # the group spans replicas: simulate them all
        out = run(row["config"], disabled=row.get("disabled") or (),
                  symmetry=f"the timeline draws a {group_dim} group across {sym.dimension} replicas")
    n_layers = out.plan.ctx.model.n_layers
    layer = n_layers // 2 if layer is None else layer
    if not 0 <= layer < n_layers:
        raise ConfigError("--layer", f"must be in 0..{n_layers - 1}, got {layer}")
    sim = out.sim
    bars = {(c, kind): [] for c in group for kind in ("compute", "communication")}
    for i, op in enumerate(sim.dag.ops):
        if op.layer != layer:
            continue
        s, e = float(sim.start_s[i]), float(sim.end_s[i])
        if isinstance(op, ComputeOp):
            if op.chip in group:
                bars[(op.chip, "compute")].append((s, e - s))
        else:
            for c in op.group:
                if c in group:
                    bars[(c, "communication")].append((s, e - s))
    spans = [iv for ivs in bars.values() for iv in ivs]
    if not spans:
        raise G5Error(f"layer {layer} has no op on chips {list(group)}")
    t0 = min(s for s, _ in spans)
    fig, ax = plt.subplots(figsize=FIGSIZE_IN)
    colors = {"compute": "tab:blue", "communication": "tab:orange"}
    for kind, offset in (("compute", 0.05), ("communication", -0.4)):
        first = True
        for row_i, c in enumerate(group):
            ivs = [((s - t0) * 1e3, d * 1e3) for s, d in bars[(c, kind)]]
            ax.broken_barh(ivs, (row_i + offset, 0.35), facecolor=colors[kind], edgecolor="white", linewidth=0.6,
                           label=kind if first else None)
            first = False
    ax.set_yticks(range(len(group)), [f"chip {c}" for c in group])
    ax.invert_yaxis()
    ax.set_xlabel("time since the layer's first op (ms)")
    ax.set_ylabel(f"{group_dim} group")
    ax.set_title(f"layer {layer} on {group_dim} group {list(group)}: {_layout(row['parallel'])}, "
                 f"seq_len {row['seq_len']}")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def make_figure(kind: str, rows: Sequence[Mapping], x_dim: str = "cp", layer: Optional[int] = None,
                config_hash: Optional[str] = None):
    if kind == "latency":
        return latency_figure(rows, x_dim)
    if kind == "memory":
        return memory_figure(rows)
    if kind == "pareto":
        return pareto_figure(rows)
    if kind == "timeline":
        ok = _ok(rows)
        if config_hash:
            match = [r for r in ok if r["config_hash"].startswith(config_hash)]
            if len(match) != 1:
                raise ConfigError("--row", f"{config_hash!r} matches {len(match)} successful rows; give more of the key")
            row = match[0]
        else:  # the row with the largest group along the dimension (then the first)
            row = max(enumerate(ok), key=lambda ir: (ir[1]["parallel"].get(x_dim, 1), -ir[0]))[1]
        return timeline_figure(row, x_dim, layer)
    raise ConfigError("--kind", f"unknown kind {kind!r}; use {', '.join(KINDS)}")


def figure_bytes(fig, fmt: str) -> bytes:
    plt = _pyplot()
    buf = io.BytesIO()
    meta = {"Software": None} if fmt == "png" else {"Date": None}
    fig.savefig(buf, format=fmt, dpi=150, metadata=meta)
    plt.close(fig)
    return buf.getvalue()
