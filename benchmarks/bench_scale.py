"""G5 benchmark: a run's cost against the number of data-parallel replicas.

Not a test: it reports figures. llama-3.1-70b prefill (examples/llama-3.1-70b-prefill.yaml:
tp8, batch 4, 32K tokens) on 8 x dp H100s, each case in a fresh Python process so its peak
resident memory (``ru_maxrss``) is its own; wall time is the whole ``g5core.session.run.run``
(plan, size guard, memory ledger, build, engine, report), imports excluded. Usage:

    python benchmarks/bench_scale.py                 # dp = 1, 16, 1024, 16384 (131,072 chips)
    python benchmarks/bench_scale.py --dp 16384
    python benchmarks/bench_scale.py --refuse        # the same without symmetry: the guard's refusal
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHILD = """
import json, resource, sys, time
from g5core.api.errors import ResourceError
from g5core.session.run import load_raw, run
dp, refuse = int(sys.argv[1]), sys.argv[2] == "1"
raw = load_raw(sys.argv[3], [f"chips={8 * dp}", f"parallel.dp={dp}", "parallel.tp=8"])
t0 = time.perf_counter()
try:
    out = run(raw, symmetry=not refuse)
    result = {"latency_s": out.latency_s, "simulated_chips": out.sim.symmetry.slice_chips or 8 * dp}
except ResourceError as exc:
    result = {"refused": str(exc)[:80] + "..."}
wall = time.perf_counter() - t0
print(json.dumps({"dp": dp, "chips": 8 * dp, "wall_s": round(wall, 2),
                  "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024), **result}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, action="append", help="replicas (repeatable)")
    ap.add_argument("--refuse", action="store_true", help="symmetry off: time the size guard's refusal")
    args = ap.parse_args()
    config = str(ROOT / "examples" / "llama-3.1-70b-prefill.yaml")
    for dp in args.dp or [1, 16, 1024, 16384]:
        res = subprocess.run([sys.executable, "-c", CHILD, str(dp), "1" if args.refuse else "0", config],
                             capture_output=True, text=True, check=True)
        print(res.stdout.strip(), flush=True)


if __name__ == "__main__":
    sys.exit(main())
