"""``g5 plot``: figures from a results database (matplotlib, Agg backend, PNG or SVG).

Kinds:

- ``latency``: TTFT or TPOT against a parallel dimension (``--x``, cp by default), one line
  per value of whatever else varies in the rows (S in a CP scan);
- ``memory``: per-chip memory of each layout (the fullest chip), stacked weights / KV cache /
  activations / workspace, against the chip's capacity;
- ``pareto``: latency against per-chip memory for every layout, with the Pareto front;
- ``timeline``: one layer across the chips of one group (``--x`` dimension, cp by default),
  compute against communication, re-simulated from the configuration of one row.

Every plot has a title naming the model, system, chip count, phase and workload; every axis
label carries its unit; ticks read plainly (32K tokens, 0.05 s); the legend sits outside the
axes with at most 12 entries, in numeric order; a layout that does not fit is drawn hollow
and named so in the legend. ``--where KEY=VALUE,..`` picks the rows of any kind. Fonts and
sizes are chosen for a slide.
"""
from __future__ import annotations

import io
import json
import pathlib
from typing import Mapping, Optional, Sequence

from g5core.api.errors import ConfigError, G5Error, suggest
from g5core.sim.memory import GIB
from g5core.api.ops import ComputeOp
from g5core.session.run import run
from g5core.study.search import Candidate, pareto_front

KINDS = ("latency", "memory", "pareto", "timeline")
FORMATS = {".png": "png", ".svg": "svg"}
FIGSIZE_IN = (11.0, 6.5)
FONT_PT = 14


def _pyplot():
    try:
        import matplotlib  # optional (the plot extra)
    except ImportError:
        raise G5Error("g5 plot needs matplotlib: pip install 'g5[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional (the plot extra)

    plt.rcParams.update({"font.size": FONT_PT, "axes.titlesize": FONT_PT + 2, "axes.labelsize": FONT_PT,
                         "legend.fontsize": FONT_PT - 2, "xtick.labelsize": FONT_PT - 2,
                         "ytick.labelsize": FONT_PT - 2, "svg.hashsalt": "g5"})
    return plt


def image_format(path) -> str:
    suffix = pathlib.Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ConfigError("-o", f"{path}: use a .png or .svg file name")
    return FORMATS[suffix]


MAX_LEGEND = 12
DOES_NOT_FIT = "does not fit (hollow)"


def _layout(par: Mapping, keep: Sequence[str] = ()) -> str:
    """``cp=4 dp=2``: the dimensions larger than 1, and those in ``keep`` whatever their size
    (a dimension that varies across the rows carries information at 1 too: ``cp=1``)."""
    return " ".join(f"{k}={v}" for k, v in sorted(par.items()) if v != 1 or k in keep) or "one chip per replica"


def _varying_dims(rows: Sequence[Mapping]) -> list[str]:
    dims = sorted({k for r in rows for k in r["parallel"]})
    return [d for d in dims if len({r["parallel"].get(d, 1) for r in rows}) > 1]


def tokens_label(n) -> str:
    """Token counts for a slide: 32K, 128K, 1M (binary multiples), else the number."""
    if isinstance(n, (int, float)) and n == int(n) and n > 0:
        n = int(n)
        if n % 2 ** 20 == 0:
            return f"{n // 2 ** 20}M"
        if n % 2 ** 10 == 0:
            return f"{n // 2 ** 10}K"
    return f"{n:g}" if isinstance(n, float) else str(n)


def _value_label(key: str, value) -> str:
    name = key.removeprefix("parallel.")
    return f"{name}={tokens_label(value) if name == 'seq_len' else value}"


def _numeric_key(values: Sequence) -> tuple:
    """Sort numbers as numbers (2 before 16), others after, by text."""
    return tuple((0, float(v), "") if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, 0.0, str(v))
                 for v in values)


def _metric(rows: Sequence[Mapping]) -> str:
    phases = {r["phase"] for r in rows}
    return {"prefill": "TTFT", "decode": "TPOT"}.get(phases.pop(), "latency") if len(phases) == 1 else "latency"


def _one_or_many(values, fmt=str) -> str:
    values = sorted(set(values), key=lambda v: _numeric_key([v]))
    return fmt(values[0]) if len(values) == 1 else "/".join(fmt(v) for v in values)


def plot_title(rows: Sequence[Mapping], what: str) -> str:
    """``what``: model on chips x system, phase, workload (batch, seq_len) of the rows."""
    def values(key):  # a results row's column, or its configuration's key
        return [r[key] if key in r else (r.get("config") or {}).get(key) for r in rows]

    model, system, chips, phase = (_one_or_many(values(k)) for k in ("model", "system", "chips", "phase"))
    work = f"batch {_one_or_many(values('batch'))}, seq_len {_one_or_many(values('seq_len'), tokens_label)}"
    return f"{what}\n{model} on {chips} x {system}, {phase}, {work}"


def _inputs(r: Mapping) -> dict:
    """The row's inputs as flat ``key -> value`` (parallel dimensions as ``parallel.<dim>``)."""
    cfg = r["config"]
    out = {k: json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v
           for k, v in cfg.items() if k != "parallel"}
    for k, v in (cfg.get("parallel") or {}).items():
        out[f"parallel.{k}"] = v
    return out


def series_keys(rows: Sequence[Mapping], x_key: str, auto_dims: Optional[Sequence[str]] = None) -> list[str]:
    """The inputs that tell the lines apart: those that vary, less the x axis and at most one
    parallel dimension that the x axis and the others determine: one the sweep left ``auto``
    (``auto_dims``, from the database: :func:`g5core.present.report.auto_dims`), or where that
    is not known, dp first. Only one, and only an auto one when known: the chip count fixes
    the product of the dimensions, so any one follows from the rest, and dropping it where
    the user did not ask for it would join layouts that differ (a `g5 best` database)."""
    flat = [_inputs(r) for r in rows]
    keys = sorted({k for f in flat for k in f})
    varying = [k for k in keys if k != x_key and len({json.dumps(f.get(k)) for f in flat}) > 1]
    kept = list(varying)
    candidates = sorted((k for k in varying if k.startswith("parallel.")), key=lambda k: (k != "parallel.dp", k))
    if auto_dims is not None:
        candidates = [k for k in candidates if k.removeprefix("parallel.") in auto_dims]
    for k in candidates:
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
            break
    return kept


def parse_where(text: Optional[str]) -> tuple[tuple[str, str], ...]:
    """``seq_len=131072,parallel.cp=8`` -> ((key, value), ...); a bad term names the fix."""
    if not text:
        return ()
    out = []
    for term in text.split(","):
        key, sep, value = term.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ConfigError("--where", f"{term!r} is not KEY=VALUE; e.g. --where seq_len=131072,parallel.cp=8")
        out.append((key.strip(), value.strip()))
    return tuple(out)


def select_rows(rows: Sequence[Mapping], where: Sequence[tuple[str, str]]) -> list[Mapping]:
    """The rows whose inputs match every ``key=value`` of ``where`` (values compared as text)."""
    if not where:
        return list(rows)
    flat = [_inputs(r) for r in rows]
    known = sorted({k for f in flat for k in f})
    for key, _ in where:
        if key not in known:
            raise ConfigError("--where", f"no row has the input {key!r}{suggest(key, known)}; inputs: {', '.join(known)}")
    out = [r for r, f in zip(rows, flat) if all(str(f.get(k)) == v for k, v in where)]
    if not out:
        raise ConfigError("--where", f"no row matches {','.join(f'{k}={v}' for k, v in where)}")
    return out


def _ok(rows: Sequence[Mapping]) -> list[Mapping]:
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        raise G5Error("the database holds no successful row to plot")
    return ok


def _log_if_wide(ax, values: Sequence[float]) -> None:
    """A log y axis where the values span a decade or more, with plain tick labels (0.05,
    0.1, 0.2; never 6x10^-2)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # optional (the plot extra)

    if min(values) > 0 and max(values) / min(values) >= 10:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())


def _legend_outside(ax, handles=None, labels=None, title=None) -> None:
    """The legend to the right of the axes, off the data, at most MAX_LEGEND entries."""
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    if len(handles) > MAX_LEGEND:
        raise AssertionError(f"{len(handles)} legend entries; the plot should have capped them")
    ax.legend(handles, labels, title=title, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _fit_handle():
    from matplotlib.lines import Line2D  # optional (the plot extra)
    return Line2D([], [], marker="o", linestyle="none", markersize=9, markerfacecolor="none",
                  markeredgecolor="black", label=DOES_NOT_FIT)


def _family_lines(ok: Sequence[Mapping], x_key: str, best_first: bool,
                  auto_dims: Optional[Sequence[str]]) -> tuple[list, list[str]]:
    """Points grouped into lines that differ only along ``x_key``: (label values, points) per
    line, and the keys the labels name. A layout family is the rest of the layout."""
    keys = series_keys(ok, x_key, auto_dims)
    lines: dict[tuple, list] = {}
    for r in ok:
        f = _inputs(r)
        lines.setdefault(tuple(f.get(k) for k in keys), []).append((f.get(x_key, 1), r["latency_s"], bool(r["fits"])))
    ordered = sorted(lines.items(), key=lambda kv: _numeric_key(kv[0]))
    if best_first:
        ordered.sort(key=lambda kv: min(p[1] for p in kv[1]))
    return ordered, keys


def latency_figure(rows: Sequence[Mapping], x_dim: str = "cp", auto_dims: Optional[Sequence[str]] = None):
    """One line per layout family (the rows equal but for the x dimension), sorted
    numerically; beyond MAX_LEGEND - 2 families the fastest are drawn as lines and the rest as
    grey points ("other layouts"), so a `g5 best` database reads too. Hollow: does not fit."""
    plt = _pyplot()
    ok = _ok(rows)
    x_key = f"parallel.{x_dim}"
    if not any(x_key in _inputs(r) for r in ok):
        raise ConfigError("--x", f"no row has the dimension {x_dim!r}")
    many = len(_family_lines(ok, x_key, False, auto_dims)[0]) > MAX_LEGEND - 2
    lines, keys = _family_lines(ok, x_key, many, auto_dims)
    metric = _metric(ok)
    scale, unit = _time_unit(ok)
    fig, ax = plt.subplots(figsize=FIGSIZE_IN)
    shown, rest = (lines[:MAX_LEGEND - 3], lines[MAX_LEGEND - 3:]) if many else (lines, [])
    for label_values, pts in shown:
        pts.sort()
        label = ", ".join(_value_label(k, v) for k, v in zip(keys, label_values)) or "all rows"
        (line,) = ax.plot([p[0] for p in pts], [p[1] * scale for p in pts], linewidth=2, marker="o", markersize=8,
                          label=label)
        hollow = [p for p in pts if not p[2]]
        ax.plot([p[0] for p in hollow], [p[1] * scale for p in hollow], marker="o", markersize=8, linestyle="none",
                color=line.get_color(), markerfacecolor="white")
    if rest:
        pts = [p for _, ps in rest for p in ps]
        ax.scatter([p[0] for p in pts], [p[1] * scale for p in pts], s=30, color="0.6", zorder=0,
                   label=f"other layouts ({len(rest)})")
    handles, labels = ax.get_legend_handles_labels()
    if not all(r["fits"] for r in ok):
        handles.append(_fit_handle())
        labels.append(DOES_NOT_FIT)
    from matplotlib.ticker import NullFormatter  # optional (the plot extra)
    xs = sorted({p[0] for _, pts in lines for p in pts})
    if len(xs) > 1 and min(xs) > 0 and max(xs) / min(xs) >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    if ax.get_xscale() == "log":
        ax.xaxis.set_minor_formatter(NullFormatter())
    _log_if_wide(ax, [r["latency_s"] * scale for r in ok])
    ax.set_xlabel(f"{x_dim} (parallel degree, chips)")
    ax.set_ylabel(f"{metric} ({unit})")
    ax.set_title(plot_title(ok, f"{metric} against {x_dim}"))
    ax.grid(True, which="major", alpha=0.3)
    title = ", ".join(k.removeprefix("parallel.") for k in keys) or None
    _legend_outside(ax, handles, labels, title=title if not many else "layout (fastest first)")
    fig.tight_layout()
    return fig


def _time_unit(rows: Sequence[Mapping]) -> tuple[float, str]:
    """Milliseconds when every latency is under a second, else seconds: (scale, unit)."""
    return (1e3, "ms") if max(r["latency_s"] for r in rows) < 1.0 else (1.0, "s")


MEMORY_PARTS = (("weights_bytes", "weights"), ("kv_cache_bytes", "KV cache"), ("activation_bytes", "activations"),
                ("workspace_bytes", "workspace"))


def memory_figure(rows: Sequence[Mapping]):
    """Stacked per-chip memory of each layout against capacity, in numeric order; a layout
    that does not fit is drawn hatched and hollow."""
    plt = _pyplot()
    ok = _ok(rows)
    keys = [k for k in series_keys(ok, "") if not k.startswith("parallel.")]
    vary = _varying_dims(ok)
    ok = sorted(ok, key=lambda r: _numeric_key([_inputs(r).get(k) for k in keys]
                                              + [r["parallel"].get(d, 1) for d in vary]))
    labels = []
    for r in ok:
        f = _inputs(r)
        extra = [_value_label(k, f.get(k)) for k in keys]
        labels.append("\n".join([_layout(r["parallel"], keep=vary)] + extra))
    fig, ax = plt.subplots(figsize=(max(FIGSIZE_IN[0], 0.6 * len(ok) + 4), FIGSIZE_IN[1] + 1))
    xs = range(len(ok))
    bottom = [0.0] * len(ok)
    for column, name in MEMORY_PARTS:
        heights = [r[column] / GIB for r in ok]
        bars = ax.bar(xs, heights, bottom=bottom, label=name)
        for bar, r in zip(bars, ok):
            if not r["fits"]:
                bar.set_hatch("//")
                bar.set_edgecolor(bar.get_facecolor())
                bar.set_facecolor("none")
        bottom = [b + h for b, h in zip(bottom, heights)]
    caps = [r["capacity_bytes"] / GIB for r in ok]
    ax.step([x - 0.5 for x in xs] + [len(ok) - 0.5], caps + caps[-1:], where="post", color="black",
            linestyle="--", linewidth=2, label="capacity")
    handles, legend_labels = ax.get_legend_handles_labels()
    if not all(r["fits"] for r in ok):
        from matplotlib.patches import Patch  # optional (the plot extra)
        handles.append(Patch(facecolor="none", edgecolor="black", hatch="//", label=DOES_NOT_FIT))
        legend_labels.append(DOES_NOT_FIT)
    ax.set_ylim(0, 1.05 * max(max(bottom), max(caps)))
    ax.set_xticks(list(xs), labels, rotation=60 if len(ok) > 6 else 0, ha="right" if len(ok) > 6 else "center")
    ax.set_xlabel("layout")
    ax.set_ylabel("memory on the fullest chip (GiB)")
    ax.set_title(plot_title(ok, "per-chip memory by layout"))
    ax.grid(True, axis="y", alpha=0.3)
    _legend_outside(ax, handles, legend_labels)
    fig.tight_layout()
    return fig


def _workload_keys(rows: Sequence[Mapping]) -> list[str]:
    """The non-layout inputs that vary across the rows (sequence length, batch, ...)."""
    return [k for k in series_keys(rows, "") if not k.startswith("parallel.")]


def pareto_figure(rows: Sequence[Mapping]):
    """Latency against per-chip memory, one Pareto front per workload (the non-layout inputs
    that vary, e.g. each sequence length of a scan); hollow points do not fit."""
    plt = _pyplot()
    ok = _ok(rows)
    keys = _workload_keys(ok)
    groups: dict[tuple, list] = {}
    for r in ok:
        f = _inputs(r)
        groups.setdefault(tuple(f.get(k) for k in keys), []).append(r)
    if 2 * len(groups) + 1 > MAX_LEGEND:
        raise ConfigError("--where", f"the rows hold {len(groups)} workloads ({', '.join(keys)} vary); a Pareto "
                                     f"plot compares layouts of one workload: pick at most {(MAX_LEGEND - 1) // 2} "
                                     f"with --where, e.g. --where {keys[0]}={_inputs(ok[0]).get(keys[0])}")
    metric = _metric(ok)
    scale, unit = _time_unit(ok)
    fig, ax = plt.subplots(figsize=FIGSIZE_IN)
    for values, members in sorted(groups.items(), key=lambda kv: _numeric_key(kv[0])):
        label = ", ".join(_value_label(k, v) for k, v in zip(keys, values))
        cands = [Candidate(parallel=r["parallel"], latency_s=r["latency_s"], objective_value=r["latency_s"],
                           fits=bool(r["fits"]), max_total_bytes=r["max_total_bytes"],
                           tokens_per_s_per_chip=r["tokens_per_s_per_chip"]) for r in members]
        front = pareto_front([c for c in cands if c.fits])
        (line,) = ax.plot([c.max_total_bytes / GIB for c in front], [c.latency_s * scale for c in front], marker="o",
                          markersize=9, linewidth=2,
                          label=f"Pareto front{', ' + label if label else ''}" if front else None)
        for fits in (True, False):
            sel = [c for c in cands if c.fits == fits]
            ax.scatter([c.max_total_bytes / GIB for c in sel], [c.latency_s * scale for c in sel], s=50, alpha=0.7,
                       facecolors=line.get_color() if fits else "none", edgecolors=line.get_color(),
                       label=(f"layouts{', ' + label if label else ''}" if fits else f"{label or 'layouts'}: none fits")
                       if fits == bool(front) else None)
        for c in front:
            ax.annotate(_layout(c.parallel), (c.max_total_bytes / GIB, c.latency_s * scale),
                        textcoords="offset points", xytext=(6, 6), fontsize=FONT_PT - 4)
    handles, labels = ax.get_legend_handles_labels()
    if not all(r["fits"] for r in ok):
        handles.append(_fit_handle())
        labels.append(DOES_NOT_FIT)
    ax.set_xlabel("memory on the fullest chip (GiB)")
    ax.set_ylabel(f"{metric} ({unit})")
    _log_if_wide(ax, [r["latency_s"] * scale for r in ok])
    ax.set_title(plot_title(ok, f"{metric} against per-chip memory"))
    ax.grid(True, which="major", alpha=0.3)
    _legend_outside(ax, handles, labels)
    fig.tight_layout()
    return fig


#: communication colours by reason prefix (what moves: ring KV/Q, TP reductions, experts...)
COMM_COLORS = ("tab:orange", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray")


def timeline_figure(row: Mapping, group_dim: str = "cp", layer: Optional[int] = None):
    """One layer across the chips of the group of chip 0 along ``group_dim``, from a fresh
    simulation: compute in blue, each kind of communication (its reason: ring traffic, TP
    all-reduce, ...) in its own colour; ops wide enough are named on their bars."""
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
    bars: dict[tuple[int, str], list] = {}   # (chip, "compute" | reason) -> [(start, duration, name)]
    for i, op in enumerate(sim.dag.ops):
        if op.layer != layer:
            continue
        s, e = float(sim.start_s[i]), float(sim.end_s[i])
        if isinstance(op, ComputeOp):
            if op.chip in group:
                bars.setdefault((op.chip, "compute"), []).append((s, e - s, op.name))
        else:
            for c in op.group:
                if c in group:
                    bars.setdefault((c, op.reason), []).append((s, e - s, op.reason))
    spans = [iv for ivs in bars.values() for iv in ivs]
    if not spans:
        raise G5Error(f"layer {layer} has no op on chips {list(group)}")
    t0 = min(s for s, _, _ in spans)
    t_end = max(s + d for s, d, _ in spans)
    reasons = sorted({kind for _, kind in bars if kind != "compute"})
    colors = {"compute": "tab:blue", **{r: COMM_COLORS[i % len(COMM_COLORS)] for i, r in enumerate(reasons)}}
    fig, ax = plt.subplots(figsize=FIGSIZE_IN)
    min_label_ms = 0.06 * (t_end - t0) * 1e3
    for kind in ["compute"] + reasons:
        first = True
        offset, height = (0.05, 0.35) if kind == "compute" else (-0.4, 0.35)
        for row_i, c in enumerate(group):
            ivs = [((s - t0) * 1e3, d * 1e3, name) for s, d, name in bars.get((c, kind), [])]
            if not ivs:
                continue
            ax.broken_barh([(s, d) for s, d, _ in ivs], (row_i + offset, height), facecolor=colors[kind],
                           edgecolor="white", linewidth=0.6, label=kind if first else None)
            first = False
            for s, d, name in ivs:
                if d >= min_label_ms:
                    ax.text(s + d / 2, row_i + offset + height / 2, name, ha="center", va="center",
                            fontsize=FONT_PT - 6, color="white", clip_on=True)
    ax.set_yticks(range(len(group)), [f"chip {c}" for c in group])
    ax.invert_yaxis()
    ax.set_xlabel("time since the layer's first op (ms)")
    ax.set_ylabel(f"chip (one {group_dim} group)")
    ax.set_title(plot_title([row], f"layer {layer} on {group_dim} group {_ranges_label(group)} "
                                   f"[{_layout(row['parallel'], keep=(group_dim,))}]"))
    ax.grid(True, axis="x", alpha=0.3)
    _legend_outside(ax, title="op")
    fig.tight_layout()
    return fig


def _ranges_label(group: Sequence[int]) -> str:
    group = list(group)
    if len(group) > 2 and group == list(range(group[0], group[0] + len(group))):
        return f"chips {group[0]}-{group[-1]}"
    return "chips " + ",".join(map(str, group))


def make_figure(kind: str, rows: Sequence[Mapping], x_dim: str = "cp", layer: Optional[int] = None,
                config_hash: Optional[str] = None, where: Sequence[tuple[str, str]] = (),
                auto_dims: Optional[Sequence[str]] = None):
    """The figure of ``kind`` over the rows that match ``where`` (:func:`parse_where`);
    ``auto_dims``: the parallel dimensions the sweeps left ``auto`` (None: not known)."""
    rows = select_rows(rows, where)
    if kind == "latency":
        return latency_figure(rows, x_dim, auto_dims)
    if kind == "memory":
        return memory_figure(rows)
    if kind == "pareto":
        return pareto_figure(rows)
    if kind == "timeline":
        ok = _ok(rows)
        if config_hash:
            match = [r for r in ok if r["config_hash"].startswith(config_hash)]
            if len(match) != 1:
                raise ConfigError("--row", f"{config_hash!r} matches {len(match)} successful rows; give more of the key "
                                           f"or pick the row with --where, e.g. --where seq_len=131072,parallel.cp=8")
            row = match[0]
        else:  # the row with the largest group along the dimension (then the first)
            row = max(enumerate(ok), key=lambda ir: (ir[1]["parallel"].get(x_dim, 1), -ir[0]))[1]
        return timeline_figure(row, x_dim, layer)
    raise ConfigError("--kind", f"unknown kind {kind!r}; use {', '.join(KINDS)}")


def figure_bytes(fig, fmt: str) -> bytes:
    plt = _pyplot()
    buf = io.BytesIO()
    meta = {"Software": None} if fmt == "png" else {"Date": None}
    # bbox "tight": the title and the legend outside the axes are inside the image
    fig.savefig(buf, format=fmt, dpi=150, metadata=meta, bbox_inches="tight", pad_inches=0.2)
    plt.close(fig)
    return buf.getvalue()
