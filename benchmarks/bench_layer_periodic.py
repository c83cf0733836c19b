"""Layer-periodic engine runs in the serving search's screen: CPU seconds of one layout's
screen (``g5core.study.serving.screen.screen_layout``, both default chunk sizes) with the
step runners' periodic runs and with full runs, and the largest relative difference of the
step latencies the screen computed.

Not a test: it reports figures. Each mode runs in a fresh process (no cache shared).
Usage:

    python benchmarks/bench_layer_periodic.py                     # every case below
    python benchmarks/bench_layer_periodic.py --case qwen-dp4-ep8-tp2

Prints one JSON object per case: ``cpu_s`` per mode, their ratio, the engine points and
``max_rel_diff`` (periodic against full).
"""
from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time

#: name -> (base configuration, chips per instance, layout)
CASES = {
    "llama-70b-tp4": ({"model": "llama-3.1-70b", "system": "h100-sxm", "chips": 16}, 4, {"tp": 4}),
    "llama-70b-tp8": ({"model": "llama-3.1-70b", "system": "h100-sxm", "chips": 16}, 8, {"tp": 8}),
    "qwen-dp4-ep8-tp2": ({"model": "qwen3-235b-a22b", "system": "h200", "chips": 16}, 8, {"dp": 4, "ep": 8, "tp": 2}),
    "qwen-dp8-ep16-tp2": ({"model": "qwen3-235b-a22b", "system": "h200", "chips": 16}, 16,
                          {"dp": 8, "ep": 16, "tp": 2}),
}
WORKLOAD = {"requests": 300, "arrival": {"kind": "poisson"}, "input_tokens": 8192, "output_tokens": 1024, "seed": 0}
SLO = "ttft_p90=2s,tpot_p90=50ms"


def one(case: str, periodic: bool) -> dict:
    """One layout's screen in this process: CPU seconds and the engine's step latencies."""
    from g5core.serve import cost
    from g5core.study import serving as ss
    from g5core.study.serving import screen

    screen.plan_step_runner = functools.partial(cost.plan_step_runner, periodic=periodic)
    screen.plan_experts_runner = functools.partial(cost.plan_experts_runner, periodic=periodic)
    base, chips, layout = CASES[case]
    par = {**{d: 1 for d in ("cp", "dp", "ep", "pp", "sp", "tp")}, **layout}
    wl = ss.check_workload(WORKLOAD)
    c0 = time.process_time()
    res = screen.screen_layout(base, chips, par, ss.DEFAULT_CHUNKS, wl, SLO)
    cpu_s = time.process_time() - c0
    points = {json.dumps(g): s for pts in res.get("engine_points", {}).values() for g, s in pts}
    return {"cpu_s": cpu_s, "points": points, "status": [c.get("status") for c in res["chunks"]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=sorted(CASES), action="append")
    ap.add_argument("--one", nargs=2, metavar=("CASE", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1] == "periodic")))
        return
    for case in args.case or list(CASES):
        got = {}
        for mode in ("full", "periodic"):
            out = subprocess.run([sys.executable, __file__, "--one", case, mode], check=True, capture_output=True,
                                 text=True).stdout
            got[mode] = json.loads(out.strip().splitlines()[-1])
        full, per = got["full"], got["periodic"]
        if full["points"].keys() != per["points"].keys():
            raise SystemExit(f"{case}: the two screens computed different steps")
        diff = max((abs(per["points"][k] / v - 1) for k, v in full["points"].items() if v), default=0.0)
        print(json.dumps({"case": case, "cpu_s_full": round(full["cpu_s"], 2), "cpu_s_periodic": round(per["cpu_s"], 2),
                          "speedup": round(full["cpu_s"] / per["cpu_s"], 2), "engine_points": len(full["points"]),
                          "max_rel_diff": diff, "status": per["status"]}))


if __name__ == "__main__":
    main()
