"""g5 serve benchmark: wall time and peak memory of request-level serving runs.

Not a test: it reports figures. Each case runs in a fresh Python process (its own
``ru_maxrss``). The issue's case: 10,000 requests of ISL 2,048 / OSL 256 (Poisson at 40
requests/s) on 8 instances of llama-3.1-70b tp8 on h100-sxm (examples/serving/llama-3.1-70b-serve.yaml),
with the step predictor; the scaling cases repeat it at 1,000 and 100,000 requests. Usage:

    python benchmarks/bench_serve.py                 # 1k, 10k, 100k requests
    python benchmarks/bench_serve.py --requests 10000
    python benchmarks/bench_serve.py --exact 20      # also 20 requests with --exact (every step through the engine)

Per case: ``wall_s`` (the whole simulate_serving call: preparing the plans, the engine's
step simulations, the request loop, the predictor check), ``cpu_s`` (its CPU time: on a
shared machine the wall time also counts other processes), ``loop_s`` (the request loop with
its step-latency lookups), ``engine_runs`` (distinct steps the engine simulated),
``us_per_request`` (wall_s per request), ``max_rss_mib``.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import resource
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "serving" / "llama-3.1-70b-serve.yaml"


def one(requests: int, exact: bool, rate: float) -> dict:
    from g5core.inputs.serving import workload_spec
    from g5core.serve.api import simulate_serving
    from g5core.session.run import load_raw

    raw = load_raw(CONFIG)
    spec = workload_spec(None, None, requests, rate, None, 2048, 256, 0)
    t0, c0 = time.perf_counter(), time.process_time()
    res = simulate_serving(raw, spec, exact=exact, slo="ttft=2s,tpot=50ms")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    out = res.to_json_dict()
    return {"requests": requests, "exact": exact, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "loop_s": round(res.loop.sim_wall_s, 2),
            "engine_runs": out["engine_runs"], "steps": out["steps"], "us_per_request": round(wall / requests * 1e6),
            "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "ttft_p99_s": out["ttft_s"]["p99"], "tpot_p99_s": out["tpot_s"]["p99"],
            "output_tokens_per_s_per_chip": out["throughput"]["output_tokens_per_s_per_chip"],
            "predictor": out["step_predictor"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, nargs="*", default=[1000, 10000, 100000])
    ap.add_argument("--rate", type=float, default=40.0)
    ap.add_argument("--exact", type=int, default=0, metavar="N", help="also N requests with --exact")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one(int(args.child[0]), args.child[1] == "exact", args.rate)))
        return
    cases = [(n, "predictor") for n in args.requests] + ([(args.exact, "exact")] if args.exact else [])
    for n, mode in cases:
        proc = subprocess.run([sys.executable, __file__, "--rate", str(args.rate), "--child", str(n), mode],
                              capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            sys.exit(proc.stderr)
        print(proc.stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
