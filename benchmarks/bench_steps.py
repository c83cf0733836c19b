"""Benchmark: many decode steps through one prepared plan, against `g5 run`.

Not a test: it reports figures. llama-3.1-70b on 8 H100s (tp=8), 100 different decode
steps simulated through one ``g5core.prepare`` plan, in two series:

- ``contexts``: 64 sequences at contexts 8,192 + 97 i (i = 0..99): one step structure, so
  every step after the first runs on the first one's op DAG with its own attention;
- ``batches``: 1 + i sequences (i = 0..99) at context 8,192: every step a new structure
  (a full build each).

Reported, in seconds (per series where it says so):

- ``cold_g5_run_s``: a whole ``g5 run --json`` of the first step in a fresh process
  (interpreter start and imports included), the median of ``--repeats`` runs;
- ``run_in_process_s``: ``g5core.session.run.run`` of the same step in a warm process (no
  imports; everything else rebuilt), the median of ``--repeats`` runs;
- ``prepare_s``: ``g5core.prepare`` (validation, rank map, topology, primitives, symmetry);
- ``first_step_s``: the first ``simulate`` of a series;
- ``mean_other_step_s``: the mean of its 99 others (the compute-latency cache shared);
- ``repeat_step_s``: a step shape simulated before (a cache lookup);
- the ratios of the further steps to the cold and to the in-process run.

    python benchmarks/bench_steps.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = {"model": "llama-3.1-70b", "system": "h100-sxm", "chips": 8, "parallel": {"dp": 1, "tp": 8, "pp": 1, "cp": 1}}
BATCH = 64
CONTEXTS = [8192 + 97 * i for i in range(100)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import g5core
    from g5core import Step
    from g5core.session.run import run

    first = dict(CONFIG, phase="decode", batch=BATCH, seq_len=CONTEXTS[0])
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "step.json"
        path.write_text(json.dumps(first))
        cold = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "g5core", "run", str(path), "--json"], check=True,
                           stdout=subprocess.DEVNULL, cwd=ROOT)
            cold.append(time.perf_counter() - t0)
    warm = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        reference = run(first).latency_s
        warm.append(time.perf_counter() - t0)
    out = {"case": "llama-3.1-70b-tp8-decode-100-steps", "cold_g5_run_s": statistics.median(cold),
           "run_in_process_s": statistics.median(warm)}
    series = {"contexts": [(BATCH, ctx) for ctx in CONTEXTS], "batches": [(1 + i, CONTEXTS[0]) for i in range(100)]}
    for name, steps in series.items():
        t0 = time.perf_counter()
        plan = g5core.prepare(first)
        out["prepare_s"] = time.perf_counter() - t0
        costs = []
        for batch, ctx in steps:
            t0 = time.perf_counter()
            res = plan.simulate(Step.decode(batch, ctx))
            costs.append(time.perf_counter() - t0)
            if (batch, ctx) == (BATCH, CONTEXTS[0]):
                assert res.latency_s == reference, "the prepared plan must give run()'s latency"
        t0 = time.perf_counter()
        plan.simulate(Step.decode(*steps[50]))
        repeat_s = time.perf_counter() - t0
        mean_other = statistics.fmean(costs[1:])
        out[name] = {"first_step_s": costs[0], "mean_other_step_s": mean_other, "max_other_step_s": max(costs[1:]),
                     "repeat_step_s": repeat_s, "other_over_cold_run": mean_other / out["cold_g5_run_s"],
                     "other_over_in_process_run": mean_other / out["run_in_process_s"], "cache": plan.cache_info()}
    for k, v in out.items():
        if isinstance(v, dict):
            for kk, vv in v.items():
                print(f"{k + '.' + kk:40s} {vv:.4g}" if isinstance(vv, float) else f"{k + '.' + kk:40s} {vv}")
        else:
            print(f"{k:40s} {v:.4g}" if isinstance(v, float) else f"{k:40s} {v}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
