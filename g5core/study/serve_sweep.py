"""Serving sweeps: ``g5 sweep`` over a configuration with a ``serving:`` block (or a grid
with ``serving.*`` keys) runs :func:`~g5core.serve.api.simulate_serving` at every grid point
and adds each run's row to the database's ``serving_results`` table, so a rate sweep is one
command:

    g5 sweep examples/serving/llama-3.1-70b-serve.yaml --db s.db \\
        --set serving.workload='{requests: 2000, arrival: {kind: poisson, rate_per_s: 10}, input_tokens: 2048, output_tokens: 256}' \\
        --grid serving.workload.arrival.rate_per_s=10,20,40,80

Points already in the table (same configuration, workload and disabled plugins) are reused.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

from g5core.api.errors import ConfigError, G5Error
from g5core.inputs.serving import split_config
from g5core.serve.api import simulate_serving
from g5core.study.serve_db import open_serving_db
from g5core.serve.metrics import series
from g5core.study.resultsdb import config_hash
from g5core.study.sweep import apply_point, grid_points, point_label


def is_serving_sweep(raw: Mapping, grid) -> bool:
    return "serving" in raw or any(k == "serving" or k.startswith("serving.") for k, _ in grid)


def run_serving_sweep(raw: Mapping, grid, db_path, disabled: Sequence[str] = (), inputs: Sequence = (),
                      progress: Optional[Callable[[str], None]] = None, runner=None) -> list[dict]:
    """Every grid point simulated (or found in the database); the rows in grid order."""
    points = grid_points(grid)
    configs = [apply_point(raw, p) for p in points]
    for c in configs:
        _, block = split_config(c)
        if not block.get("workload"):
            raise ConfigError("serving.workload", "a serving sweep needs the workload in the configuration "
                                                  "(serving.workload: {requests, arrival, input_tokens, output_tokens})")
    db = open_serving_db(db_path, inputs)
    rows = []
    try:
        done = {r["key"]: r for r in db.rows()}
        for n, (point, cfg) in enumerate(zip(points, configs), start=1):
            workload = split_config(cfg)[1]["workload"]
            key = config_hash({"config": dict(cfg), "workload": dict(workload)}, disabled)
            if key not in done:
                try:
                    res = simulate_serving(cfg, workload, disabled=disabled, runner=runner)
                except G5Error as exc:
                    raise G5Error(f"grid point {point_label(point)}: {exc}") from None
                db.add(cfg, disabled, workload, res.to_json_dict(), series(res.loop))
                done = {r["key"]: r for r in db.rows()}
            row = {**done[key], "point": point}
            rows.append(row)
            if progress is not None:
                progress(f"[{n}/{len(points)}] {point_label(point)}: {row['output_tokens_per_s_per_chip']:.1f} output "
                         f"tokens/s per chip, TTFT p99 {row['ttft_p99_s']:.4g} s, TPOT p99 {row['tpot_p99_s']:.4g} s")
    finally:
        db.close()
    return rows


def render_rows(rows: Sequence[Mapping]) -> str:
    keys = list(rows[0]["point"]) if rows else []
    head = keys + ["tokens/s/chip", "req/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "goodput"]
    body = []
    for r in rows:
        body.append([str(r["point"][k]) for k in keys] + [
            f"{r['output_tokens_per_s_per_chip']:.1f}", f"{r['requests_per_s']:.3g}", f"{r['ttft_p50_s']:.4g} s",
            f"{r['ttft_p99_s']:.4g} s", f"{r['tpot_p50_s'] * 1e3:.4g} ms", f"{r['tpot_p99_s'] * 1e3:.4g} ms",
            "-" if r["goodput_share"] is None else f"{r['goodput_share']:.1%}"])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head] + body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
