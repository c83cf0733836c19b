"""Serving sweeps (a rate sweep is one command) and the serving plot kinds."""
from __future__ import annotations

import pytest

from g5core.study.serve_sweep import is_serving_sweep, run_serving_sweep
from g5core.study.sweep import parse_grid

BASE = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 1, "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1},
        "serving": {"instances": 1, "workload": {"requests": 200, "arrival": {"kind": "poisson", "rate_per_s": 1},
                                                  "input_tokens": 500, "output_tokens": 50}}}
CALLS = []


def runner(groups):
    CALLS.append(groups)
    return 5e-3 + sum(k * (5e-5 if n == 1 else 2e-5 * n) for n, c, k in groups)


def test_rate_sweep_rows_in_grid_order_reused_on_a_second_run(tmp_path):
    grid = parse_grid(["serving.workload.arrival.rate_per_s=2,20,200"])
    assert is_serving_sweep(BASE, grid)
    db = tmp_path / "s.db"
    rows = run_serving_sweep(BASE, grid, db, runner=runner)
    assert [r["rate_per_s"] for r in rows] == [2, 20, 200]
    thr = [r["output_tokens_per_s_per_chip"] for r in rows]
    assert thr[0] < thr[1] < thr[2]
    assert rows[0]["tpot_p50_s"] < rows[2]["tpot_p50_s"]
    CALLS.clear()
    again = run_serving_sweep(BASE, grid, db, runner=runner)
    assert not CALLS and [r["key"] for r in again] == [r["key"] for r in rows]


@pytest.mark.parametrize("kind", ["serve-cdf", "serve-occupancy", "serve-throughput"])
def test_serving_plot_kinds(tmp_path, kind):
    pytest.importorskip("matplotlib")
    from g5core.present.plots import figure_bytes
    from g5core.study.serve_db import load_serving_rows
    from g5core.present.serve_plots import serve_figure

    db = tmp_path / "s.db"
    run_serving_sweep(BASE, parse_grid(["serving.workload.arrival.rate_per_s=5,50"]), db, runner=runner)
    data = figure_bytes(serve_figure(kind, load_serving_rows(db)), "png")
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
