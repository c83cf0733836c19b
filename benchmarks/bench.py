"""G5 benchmark: ops, events, wall time and peak memory of representative runs.

Not a test: it reports figures. Each case runs in a fresh Python process so its peak
resident memory (``ru_maxrss``) is its own. Usage:

    python benchmarks/bench.py            # every case, a table and one JSON line per case
    python benchmarks/bench.py --case deepseek-v3-1m-cp16

Wall time is split into build (hooks, DAG), compile (durations, lowerings, arrays), engine
(event loop) and report (KPIs, overlap, memory); ``total_s`` is the whole run inside the
process, imports excluded.
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

CASES = {
    "llama-3.1-8b-32k-1chip": ("examples/llama-3.1-8b-prefill.yaml", []),
    "deepseek-v3-1m-cp8": ("examples/deepseek-v3-1m-prefill-cp8.yaml", []),
    "deepseek-v3-1m-cp16": ("examples/deepseek-v3-1m-prefill-cp16.yaml", []),
    "deepseek-v3-1m-decode-cp8": ("examples/deepseek-v3-1m-decode-cp8.yaml", []),
    # Meta's CP paper setting per replica (128 H100s, TP8 x CP16, 1M tokens), two replicas
    "llama-3.1-405b-1m-cp16-256chips": ("examples/llama-3.1-405b-1m-prefill-cp16.yaml", []),
}


def run_case(name: str) -> dict:
    from g5core.build import build_dag
    from g5core.engine import Engine, compile_dag
    from g5core.memory import memory_report
    from g5core.results import check_conservation, summarize
    from g5core.run import load_raw, make_plan

    path, overrides = CASES[name]
    t0 = time.perf_counter()
    plan = make_plan(load_raw(ROOT / path, overrides))
    dag = build_dag(plan)
    t1 = time.perf_counter()
    compiled = compile_dag(dag, plan)
    t2 = time.perf_counter()
    engine = Engine(compiled).run()
    t3 = time.perf_counter()
    result = summarize(dag, engine, plan.ctx.deployment.phase, t3 - t0)
    check_conservation(result.kpis)
    memory_report(plan.ctx)
    t4 = time.perf_counter()
    dep = plan.ctx.deployment
    return {
        "case": name,
        "config": path,
        "chips": dep.chips,
        "parallel": dict(dep.parallel),
        "seq_len": dep.seq_len,
        "phase": dep.phase,
        "latency_s": result.latency_s,
        "ops": result.ops,
        "flows": result.flows,
        "events": result.events,
        "build_s": round(t1 - t0, 3),
        "compile_s": round(t2 - t1, 3),
        "engine_s": round(t3 - t2, 3),
        "report_s": round(t4 - t3, 3),
        "total_s": round(t4 - t0, 3),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), help="run one case in this process and print its JSON")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case)))
        return
    rows = []
    for name in CASES:
        proc = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            print(f"{name}: failed\n{proc.stderr}", file=sys.stderr)
            sys.exit(1)
        rows.append(json.loads(proc.stdout))
        print(proc.stdout.strip())
    header = ["case", "ops", "flows", "events", "build_s", "compile_s", "engine_s", "total_s", "peak_MiB"]
    print()
    print("  ".join(f"{h:>12}" if i else f"{h:<28}" for i, h in enumerate(header)))
    for r in rows:
        vals = [r["case"], r["ops"], r["flows"], r["events"], r["build_s"], r["compile_s"], r["engine_s"],
                r["total_s"], round(r["peak_rss_bytes"] / 2 ** 20)]
        print("  ".join(f"{v:>12}" if i else f"{v:<28}" for i, v in enumerate(vals)))


if __name__ == "__main__":
    main()
