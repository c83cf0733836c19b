"""The serving search's screen, timed: ``screen_layout`` (every chunk size of the search's
defaults) on a few layouts in this process, repeated, each repeat from cold runners (the
engine's step latencies simulated again).

Not a test: it reports figures. The screen is most of an engine-bound search's first half
(the step latencies of each layout: its lone request, decode and prefill tables). Usage:

    python benchmarks/bench_screen.py                                   # Qwen3-235B on 16 H200, 8 layouts
    python benchmarks/bench_screen.py --layouts "tp=8,ep=8;dp=8,ep=16,tp=2" --repeat 5

Prints one JSON object: the case, the layouts, the CPU seconds of each repeat (all layouts) and
their least, the engine runs a repeat made, the 1-minute load before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import time

#: the default layouts: dense TP, attention DP with wide EP, CP, PP and mixtures (each a
#: ``dim=N`` list; the dimensions left out are 1)
LAYOUTS = "tp=8,ep=8;dp=8,ep=16,tp=2;tp=4,cp=4,ep=4;pp=8,tp=2,ep=2;tp=16,ep=16;dp=4,ep=8,tp=2;tp=4,ep=16,dp=4;tp=2,pp=2,ep=4"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-235b-a22b")
    ap.add_argument("--system", default="h200")
    ap.add_argument("--chips", type=int, default=16)
    ap.add_argument("--framework", default=None)
    ap.add_argument("--isl", type=int, default=4000)
    ap.add_argument("--osl", type=int, default=1000)
    ap.add_argument("--slo", default="ttft_p90=2s,tpot_p90=50ms")
    ap.add_argument("--layouts", default=LAYOUTS, help="';'-separated layouts, each 'dim=N,...'")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    from g5core.api.dimensions import collect_dimensions
    from g5core.api.plugins import Hooks, make_plugin_manager
    from g5core.study import serving as ss
    from g5core.study.serving import screen

    raw = {"model": args.model, "system": args.system, "chips": args.chips,
           **({"framework": args.framework} if args.framework else {})}
    workload = ss.check_workload({"requests": 300, "arrival": {"kind": "poisson"}, "input_tokens": args.isl,
                                  "output_tokens": args.osl, "seed": 0})
    dims = collect_dimensions(Hooks(make_plugin_manager()))
    layouts = []
    for text in args.layouts.split(";"):
        par = {d: 1 for d in ("cp", "dp", "ep", "pp", "sp", "tp")}
        par.update({k: int(v) for k, v in (kv.split("=") for kv in text.split(","))})
        layouts.append((dims.chips(par), par))
    load0 = os.getloadavg()[0]
    cpu, runs, status = [], 0, []
    for _ in range(args.repeat):
        for cache in (screen._RUNNERS, screen._CACHES, screen._KEYS, screen._CAPACITY, screen._SEEDS):
            cache.clear()
        c0 = time.process_time()
        status = [[r.get("status") for r in screen.screen_layout(raw, chips, par, ss.DEFAULT_CHUNKS, workload,
                                                                 args.slo)["chunks"]]
                  for chips, par in layouts]
        cpu.append(round(time.process_time() - c0, 2))
        runs = sum(len(c) for c in screen._CACHES.values())
    print(json.dumps({"case": {**raw, "isl": args.isl, "osl": args.osl, "slo": args.slo,
                               "chunks": list(ss.DEFAULT_CHUNKS)},
                      "layouts": [{k: v for k, v in par.items() if v > 1} for _, par in layouts],
                      "status": status, "cpu_s": cpu, "least_cpu_s": min(cpu), "engine_runs": runs,
                      "load_1min": [round(load0, 2), round(os.getloadavg()[0], 2)]}, indent=2))


if __name__ == "__main__":
    main()
