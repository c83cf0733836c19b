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
  its points labelled.
"""
from __future__ import annotations

import json
from typing import Mapping, Sequence

from g5core.api.errors import ConfigError
from g5core.present.plots import FIGSIZE_IN, _pyplot
from g5core.study.resultsdb import ResultsDB

SERVE_KINDS = ("serve-cdf", "serve-occupancy", "serve-cache", "serve-throughput", "serve-pareto")


def _label(row: Mapping) -> str:
    rate = row.get("rate_per_s")
    return f"{rate:g} req/s" if rate is not None else row["key"][:8]


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
        a.legend()
        fig.suptitle("latency CDFs")
    elif kind == "serve-occupancy":
        fig, (a, b) = plt.subplots(2, 1, figsize=FIGSIZE_IN, sharex=True)
        for r in rows:
            s = json.loads(r["series"])
            a.plot(s["time_s"], [x * 100 for x in s["kv_pool_use"]], label=_label(r))
            b.plot(s["time_s"], s["waiting"], label=_label(r))
        a.set_ylabel("KV pool use (%)")
        b.set_ylabel("waiting requests")
        b.set_xlabel("time (s)")
        a.legend()
        for ax in (a, b):
            ax.grid(alpha=0.3)
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
                    ax.plot(s["time_s"], s["kv_cache_blocks"][tier], label=_label(r))
            ax.set_ylabel(f"{tier} blocks")
            ax.grid(alpha=0.3)
        axes[0, 0].legend()
        axes[-1, 0].set_xlabel("time (s)")
        fig.suptitle("KV cache occupancy")
    elif kind == "serve-throughput":
        fig, ax = plt.subplots(figsize=FIGSIZE_IN)
        pts = sorted((1.0 / r["tpot_p50_s"], r["output_tokens_per_s_per_chip"], _label(r)) for r in rows
                     if r["tpot_p50_s"])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
        for x, y, label in pts:
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4))
        ax.set_xlabel("per-user speed, 1 / TPOT p50 (tokens/s)")
        ax.set_ylabel("output tokens/s per chip")
        ax.grid(alpha=0.3)
    else:
        raise ConfigError("--kind", f"unknown serving kind {kind!r}; use {', '.join(SERVE_KINDS)}")
    fig.tight_layout()
    return fig


def _pareto_figure(plt, rows: Sequence[Mapping], figsize):
    """``rows``: :func:`load_search_rows`'s (one per candidate with a capacity)."""
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
    for x, y, r in front:
        ax.annotate(r["label"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("output tokens/s per user (1 / TPOT p50)")
    ax.set_ylabel("output tokens/s per chip")
    ax.set_title("serving search: candidates at their capacity")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def load_search_rows(db_path) -> list[dict]:
    """The candidates of the ``g5 best --serve`` searches in a results database, each at its
    capacity: ``label``, ``disaggregated``, ``per_chip`` and ``per_user`` (output tokens/s)."""
    db = ResultsDB.open_existing(db_path)
    try:
        tables = {r[0] for r in db.con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "serve_search" not in tables:
            return []
        out = []
        for (payload,) in db.con.execute("SELECT payload FROM serve_search WHERE kind = 'candidate' ORDER BY key"):
            p = json.loads(payload)
            held = p.get("held")
            if p.get("status") != "ok" or not held or not held["tpot_s"]["p50"]:
                continue
            out.append({"label": p["label"], "disaggregated": p["disaggregated"],
                        "per_chip": p["capacity_requests_per_s"] * held["mean_output_tokens"] / p["chips"],
                        "per_user": 1.0 / held["tpot_s"]["p50"]})
        return out
    finally:
        db.close()
