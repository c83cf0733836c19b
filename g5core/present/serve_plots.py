"""``g5 plot`` serving kinds, from the ``serving_results`` rows of a results database:

- ``serve-cdf``: TTFT and TPOT latency CDFs, one line per row;
- ``serve-occupancy``: KV-pool use and waiting requests over time, one line per row;
- ``serve-cache``: the block cache's cached blocks per tier (HBM, host, disk, remote) over
  time, one line per row and tier (rows of runs with ``serving.prefix_cache`` or
  ``serving.kv_tiers``);
- ``serve-throughput``: output tokens/s per chip against per-user speed (1 / TPOT p50,
  tokens/s) across the rows of a rate sweep, each point labelled with its arrival rate;
- ``serve-pareto``: output tokens/s per chip against output tokens/s per user (1 / TPOT
  p50) of a ``g5 best --serve`` search's candidates at their capacity (per chip: the
  capacity times the mean output tokens, over the chips) (its ``serve_search``
  rows), aggregated and disaggregated deployments told apart, the Pareto front drawn and
  its points labelled in a column that never overlaps.

Each has a title naming the model, system, chips, workload and SLO; runs are labelled by
their rate (a rate sweep) or their trace file; the legend sits outside the axes; a rate
sweep's points are joined along the rate and other runs drawn as markers alone, on axes from
zero; counts over time are step-drawn.
"""
from __future__ import annotations

import json
import math
from typing import Mapping, Sequence

from g5core.api.errors import ConfigError
from g5core.present.plots import FIGSIZE_IN, _legend_outside, _pyplot
from g5core.present.report import load_search, workload_label
from g5core.study.serve_db import load_search_context

SERVE_KINDS = ("serve-cdf", "serve-occupancy", "serve-cache", "serve-throughput", "serve-pareto")
#: front points labelled on serve-pareto (the best by output tokens/s per chip)
MAX_PARETO_LABELS = 12


def _slo_text(row: Mapping) -> str:
    g = (json.loads(row["summary"]) if isinstance(row.get("summary"), str) else row.get("summary") or {}).get("goodput")
    if not g:
        return "no SLO"
    return "SLO " + ", ".join(f"{k} <= {v:g} s" for k, v in g["limits"].items())


def _many(values) -> str:
    seen = list(dict.fromkeys(str(v) for v in values))
    return seen[0] if len(seen) == 1 else " / ".join(seen) if len(seen) <= 3 else f"{len(seen)} kinds"


def serve_title(rows: Sequence[Mapping], what: str) -> str:
    """``what``, then model on chips x system, the workload and the SLO of the rows."""
    cfgs = [json.loads(r["config"]) if isinstance(r["config"], str) else r["config"] for r in rows]
    wls = [json.loads(r["workload"]) if isinstance(r["workload"], str) else r["workload"] for r in rows]
    return (f"{what}\n{_many(c.get('model') for c in cfgs)} on {_many(r.get('chips') for r in rows)} x "
            f"{_many(c.get('system') for c in cfgs)}; {_many(_workload_of(w) for w in wls)}; "
            f"{_many(_slo_text(r) for r in rows)}")


def _workload_of(w) -> str:
    """The workload less its arrival rate (the rate is each point's own label)."""
    if "trace" in (w or {}):
        return "trace " + workload_label(w)
    return workload_label(w).split(", ", 1)[-1] if (w or {}).get("arrival", {}).get("kind") != "closed" else (
        workload_label(w))


def _label(row: Mapping) -> str:
    """A rate sweep's point by its rate; a trace run by its trace file."""
    w = json.loads(row["workload"]) if isinstance(row["workload"], str) else row["workload"]
    rate = row.get("rate_per_s")
    if rate is not None:
        return f"{rate:g} req/s"
    return workload_label(w)


def _sweep_key(row: Mapping) -> str:
    """The rows that differ only in their arrival rate share this key (one swept line)."""
    cfg = json.loads(row["config"]) if isinstance(row["config"], str) else row["config"]
    w = dict(json.loads(row["workload"]) if isinstance(row["workload"], str) else row["workload"])
    arrival = dict(w.get("arrival") or {})
    arrival.pop("rate_per_s", None)
    w["arrival"] = arrival
    cfg = {k: v for k, v in cfg.items() if k != "serving"} | {
        "serving": {k: v for k, v in (cfg.get("serving") or {}).items() if k != "workload"}}
    return json.dumps([cfg, w], sort_keys=True)


def serve_figure(kind: str, rows: Sequence[Mapping]):
    if not rows:
        raise ConfigError("--kind", f"{kind} needs serving rows: run "
                                    + ("g5 best --serve --db first" if kind == "serve-pareto"
                                       else "g5 serve --db or a serving sweep first"))
    plt = _pyplot()
    if kind == "serve-pareto":
        return _pareto_figure(plt, rows, FIGSIZE_IN)
    if kind == "serve-cdf":
        fig, (a, b) = plt.subplots(1, 2, figsize=FIGSIZE_IN)
        for r in rows:
            s = json.loads(r["series"])
            q = [x / 100 for x in s["quantiles"]]
            if s["ttft_s"]:
                a.plot(s["ttft_s"], q, label=_label(r))
            if s["tpot_s"]:
                b.plot([x * 1e3 for x in s["tpot_s"]], q, label=_label(r))
        a.set_xlabel("TTFT (s)")
        b.set_xlabel("TPOT (ms)")
        for ax in (a, b):
            ax.set_ylabel("share of requests")
            ax.grid(alpha=0.3)
        _legend_outside(b, *a.get_legend_handles_labels())
        fig.suptitle(serve_title(rows, "TTFT and TPOT CDFs"))
    elif kind == "serve-occupancy":
        fig, (a, b) = plt.subplots(2, 1, figsize=FIGSIZE_IN, sharex=True)
        for r in rows:
            s = json.loads(r["series"])
            # the series hold each sample's state until the next one: step-drawn (counts are integers)
            a.step(s["time_s"], [x * 100 for x in s["kv_pool_use"]], where="post", label=_label(r))
            b.step(s["time_s"], s["waiting"], where="post", label=_label(r))
        a.set_ylabel("KV pool use (%)")
        b.set_ylabel("waiting requests")
        top = max((max(json.loads(r["series"])["waiting"], default=0) for r in rows), default=0)
        b.set_yticks(range(0, int(top) + 2, max(1, math.ceil((top + 1) / 8))))   # whole requests
        b.set_ylim(bottom=0)
        b.set_xlabel("time (s)")
        _legend_outside(a)
        for ax in (a, b):
            ax.grid(alpha=0.3)
        fig.suptitle(serve_title(rows, "KV-pool use and waiting requests over time"))
    elif kind == "serve-cache":
        cached = [(r, json.loads(r["series"])) for r in rows]
        cached = [(r, s) for r, s in cached if s.get("kv_cache_blocks")]
        if not cached:
            raise ConfigError("--kind", "serve-cache needs rows of runs with a block cache (serving.prefix_cache or "
                                        "serving.kv_tiers)")
        tiers = list(dict.fromkeys(t for _, s in cached for t in s["kv_cache_blocks"]))
        fig, axes = plt.subplots(len(tiers), 1, figsize=FIGSIZE_IN, sharex=True, squeeze=False)
        for ax, tier in zip(axes[:, 0], tiers):
            for r, s in cached:
                if tier in s["kv_cache_blocks"]:
                    ax.step(s["time_s"], s["kv_cache_blocks"][tier], where="post", label=_label(r))
            ax.set_ylabel(f"{tier} blocks")
            ax.grid(alpha=0.3)
        _legend_outside(axes[0, 0])
        axes[-1, 0].set_xlabel("time (s)")
        fig.suptitle(serve_title([r for r, _ in cached], "KV cache occupancy per tier"))
    elif kind == "serve-throughput":
        fig, ax = plt.subplots(figsize=FIGSIZE_IN)
        groups: dict = {}
        for r in rows:
            if r["tpot_p50_s"]:
                groups.setdefault(_sweep_key(r), []).append(r)
        for members in groups.values():
            swept = len(members) > 1 and all(m.get("rate_per_s") is not None for m in members)
            members = sorted(members, key=lambda m: (m.get("rate_per_s") or 0.0, m["key"]))
            xs = [1.0 / m["tpot_p50_s"] for m in members]
            ys = [m["output_tokens_per_s_per_chip"] for m in members]
            if swept:   # a rate sweep: its points joined along the swept rate
                ax.plot(xs, ys, marker="o", label=f"rate sweep, {_workload_of(json.loads(members[0]['workload']))}")
                for x, y, m in zip(xs, ys, members):
                    ax.annotate(_label(m), (x, y), textcoords="offset points", xytext=(4, 4))
            else:       # unrelated runs (traces): a marker each, no line
                for x, y, m in zip(xs, ys, members):
                    ax.plot([x], [y], marker="s", linestyle="none", label=_label(m))
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)   # from zero: a small difference is not magnified
        ax.set_xlabel("per-user speed, 1 / TPOT p50 (tokens/s)")
        ax.set_ylabel("output tokens/s per chip")
        ax.grid(alpha=0.3)
        _legend_outside(ax)
        ax.set_title(serve_title(rows, "output tokens/s per chip against per-user speed"))
    else:
        raise ConfigError("--kind", f"unknown serving kind {kind!r}; use {', '.join(SERVE_KINDS)}")
    fig.tight_layout()
    return fig


def _spread(ys: Sequence[float], gap: float, lo: float, hi: float) -> list[float]:
    """``ys`` (ascending) moved apart to at least ``gap`` between neighbours, within
    ``[lo, hi]`` where the room allows (a column of labels that never overlap)."""
    out = []
    for y in ys:
        out.append(max(y, out[-1] + gap) if out else max(y, lo))
    over = out[-1] - hi if out else 0.0
    if over > 0:
        out = [y - over for y in out]
        for k in range(len(out) - 2, -1, -1):
            out[k] = min(out[k], out[k + 1] - gap)
    return out


def _pareto_figure(plt, rows: Sequence[Mapping], figsize):
    """``rows``: :func:`load_search_rows`'s (one per candidate with a capacity). The front's
    labels sit in a column right of the axes, in the points' order from the top, spaced a
    line apart and joined to their points: they never overlap."""
    fig, ax = plt.subplots(figsize=figsize)
    pts = [(r["per_user"], r["per_chip"], r) for r in rows]
    front, best = [], -1.0
    for x, y, r in sorted(pts, key=lambda p: (-p[0], -p[1])):
        if y > best:
            front.append((x, y, r))
            best = y
    for disagg, marker, name in ((False, "o", "aggregated"), (True, "^", "disaggregated")):
        sel = [p for p in pts if p[2]["disaggregated"] == disagg]
        if sel:
            ax.scatter([p[0] for p in sel], [p[1] for p in sel], marker=marker, label=name, alpha=0.7)
    front.sort(key=lambda p: p[0])
    ax.plot([p[0] for p in front], [p[1] for p in front], color="black", linewidth=1, label="Pareto front")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("output tokens/s per user (1 / TPOT p50)")
    ax.set_ylabel("output tokens/s per chip")
    ax.set_title(search_title(rows))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3)
    fig.tight_layout(rect=(0, 0, 0.72, 1))
    labelled = sorted(front, key=lambda p: -p[1])[:MAX_PARETO_LABELS]
    fig.canvas.draw()
    y0, y1 = ax.get_ylim()
    # label heights in data units: one line of the annotation font, plus a margin
    line_px = 7 * 1.6 * fig.dpi / 72
    gap = line_px * (y1 - y0) / ax.get_window_extent().height
    order = sorted(labelled, key=lambda p: p[1])
    ys = _spread([p[1] for p in order], gap, y0, y1)
    for (x, y, r), ty in zip(order, ys):
        ax.annotate(r["label"], (x, y), xytext=(1.02, ty), textcoords=("axes fraction", "data"), fontsize=7,
                    va="center", annotation_clip=False,
                    arrowprops={"arrowstyle": "-", "color": "0.5", "linewidth": 0.5})
    return fig


def search_title(rows: Sequence[Mapping]) -> str:
    """The searches' model on chips x system, workload and SLO (``g5 best --serve --db``
    records them beside the cells)."""
    ctx = rows[0].get("contexts") or [] if rows else []
    what = "serving search: candidates at their capacity"
    if not ctx:
        return what + "\n(the search's model, system, workload and SLO were not recorded in this file)"
    return (f"{what}\n{_many(c.get('model') for c in ctx)} on {_many(c.get('chips') for c in ctx)} x "
            f"{_many(c.get('system') for c in ctx)}; {_many(c.get('workload') for c in ctx)}; "
            f"SLO {_many(c.get('slo') for c in ctx)}")


def load_search_rows(db_path) -> list[dict]:
    """The candidates of the ``g5 best --serve`` searches in a results database, each at its
    capacity: ``label``, ``disaggregated``, ``per_chip`` and ``per_user`` (output tokens/s),
    and the searches' ``contexts`` (model, system, chips, workload, SLO) where recorded."""
    ctx = load_search_context(db_path)
    return [{"label": r["label"], "disaggregated": r["disaggregated"], "per_chip": r["output_tokens_per_s_per_chip"],
             "per_user": r["output_tokens_per_s_per_user"], "contexts": ctx}
            for r in load_search(db_path)
            if r["kind"] == "candidate" and r["status"] == "ok" and r["output_tokens_per_s_per_user"]]
