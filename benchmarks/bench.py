"""G5 benchmark: ops, events, wall time and peak memory of representative runs.

Not a test: it reports figures. Each case runs in a fresh Python process so its peak
resident memory (``ru_maxrss``) is its own. Usage:

    python benchmarks/bench.py            # every case, a table and one JSON line per case
    python benchmarks/bench.py --case deepseek-v3-1m-cp16
    python benchmarks/bench.py --scaling docs/scaling.png   # wall time against op count, log-log

Wall time is split into build (hooks, DAG), compile (durations, lowerings, arrays), engine
(event loop) and report (KPIs, overlap, memory); ``total_s`` is the whole run inside the
process, imports excluded. ``bare_heapq_s`` is a bare heapq loop over the same number of
events on a heap as long as the engine's was on average (``mean_heap_len``), run in the same
process right after, the fastest of three (``engine_over_heapq`` = engine_s / bare_heapq_s).
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

#: name: (configuration, overrides, symmetry)
CASES = {
    "llama-3.1-8b-32k-1chip": ("examples/llama-3.1-8b-prefill.yaml", [], True),
    "deepseek-v3-1m-cp8": ("examples/deepseek-v3-1m-prefill-cp8.yaml", [], True),
    # the 1.5 s target: tp2 cp16 dp2 on 64 chips (ep spans the replicas: no symmetry)
    "deepseek-v3-1m-cp16": ("examples/deepseek-v3-1m-prefill-cp16.yaml", [], True),
    "deepseek-v3-1m-decode-cp8": ("examples/deepseek-v3-1m-decode-cp8.yaml", [], True),
    # Meta's CP paper setting per replica (128 H100s, TP8 x CP16, 1M tokens), two replicas
    "llama-3.1-405b-1m-cp16-256chips": ("examples/llama-3.1-405b-1m-prefill-cp16.yaml", [], True),
    "llama-3.1-405b-1m-cp16-256chips-nosym": ("examples/llama-3.1-405b-1m-prefill-cp16.yaml", [], False),
    # 1,024 chips: eight such replicas, simulated once and every one
    "llama-3.1-405b-1m-cp16-1024chips": ("examples/llama-3.1-405b-1m-prefill-cp16.yaml",
                                         ["chips=1024", "parallel.dp=8"], True),
    "llama-3.1-405b-1m-cp16-1024chips-nosym": ("examples/llama-3.1-405b-1m-prefill-cp16.yaml",
                                               ["chips=1024", "parallel.dp=8"], False),
    # wide EP over 128 nodes: deepseek-v3 decode on 1,024 H200s, 512 replicas of tp2, ep32
    # groups of 8 nodes (ep spans the replicas: every chip simulated), 32K context, batch 8
    "deepseek-v3-decode-ep32-1024chips": ("examples/deepseek-v3-1m-decode-cp8.yaml",
                                          ["chips=1024", "parallel.dp=512", "parallel.cp=1", "parallel.ep=32",
                                           "parallel.tp=2", "seq_len=32768", "batch=8"], True),
}

#: the op-count series of the scaling plot (--scaling): every chip simulated, 1K to ~9M ops and flows
SCALING = [
    ("llama-3.1-8b", 4, {"tp": 4}),
    ("llama-3.1-8b", 16, {"tp": 8, "cp": 2}),
    ("llama-3.1-8b", 64, {"tp": 8, "cp": 8}),
    ("llama-3.1-70b", 128, {"tp": 8, "cp": 16}),
    ("llama-3.1-70b", 256, {"tp": 8, "cp": 16, "dp": 2}),
    ("llama-3.1-70b", 512, {"tp": 8, "cp": 16, "dp": 4}),
    ("llama-3.1-70b", 1024, {"tp": 8, "cp": 16, "dp": 8}),
    ("llama-3.1-70b", 2048, {"tp": 8, "cp": 16, "dp": 16}),
]


#: CPython 3.11 specialises a function's bytecode ("quickening") from its 8th call, or
#: within a call after 8 unconditional backward jumps; the bare loop's ``while heap:`` is a
#: conditional one, so it is called this many times on a tiny heap before it is timed,
#: specialised as the engine's loop is (its ``while True`` specialises within the run).
#: Unwarmed, the same loop takes about 1.4 times as long.
WARM_CALLS = 8


def bare_heapq_s(n_events: int, width: int) -> float:
    """Wall seconds of a bare ``heapq`` event loop over ``n_events`` events on a heap of
    ``width`` events (the engine's mean heap length: a pop costs the log of it): the same
    event tuples as the engine's ``(time, kind, item, tag)``, each pop pushing the
    next event, nothing else (the floor any heap-driven engine pays)."""
    import heapq

    heap = [(0.0, 0, i, 0) for i in range(max(1, min(width, n_events)))]
    heapq.heapify(heap)
    pushed = len(heap)
    t0 = time.perf_counter()
    while heap:
        t, kind, item, tag = heapq.heappop(heap)
        if pushed < n_events:
            heapq.heappush(heap, (t + 1e-6 * (item % 7 + 1), kind, item, tag))
            pushed += 1
    return time.perf_counter() - t0


def run_case(name: str, path=None, overrides=(), symmetry=True, max_ops=None) -> dict:
    from g5core.sim.memory import memory_report
    from g5core.session.run import load_raw, make_plan, simulate_plan

    if path is None:
        path, overrides, symmetry = CASES[name]
    t0 = time.perf_counter()
    max_ops = 10 ** 9 if max_ops is None else max_ops  # a benchmark measures what the size guard would refuse
    plan = make_plan(load_raw(ROOT / path, overrides), max_ops=max_ops)
    timings = {"build_s": time.perf_counter() - t0}
    result = simulate_plan(plan, symmetry=symmetry, timings=timings, max_ops=max_ops)
    t1 = time.perf_counter()
    memory_report(plan.ctx)
    timings["report_s"] += time.perf_counter() - t1
    total = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    width = round(result.mean_heap_len)
    for _ in range(WARM_CALLS):
        bare_heapq_s(2, 1)
    heap_s = min(bare_heapq_s(result.events, width) for _ in range(3))  # its fastest: the lowest floor
    dep = plan.ctx.deployment
    return {
        "case": name,
        "config": str(path),
        "overrides": list(overrides),
        "chips": dep.chips,
        "parallel": dict(dep.parallel),
        "seq_len": dep.seq_len,
        "phase": dep.phase,
        "latency_s": result.latency_s,
        "symmetry": result.symmetry.to_json_dict(),
        "ops": result.ops,
        "flows": result.flows,
        "events": result.events,
        "batches": result.batches,
        **{k: round(v, 6) for k, v in timings.items()},
        "total_s": round(total, 6),
        "mean_heap_len": width,
        "bare_heapq_s": round(heap_s, 6),
        "engine_ns_per_event": round(timings["engine_s"] / result.events * 1e9) if result.events else None,
        "bare_heapq_ns_per_event": round(heap_s / result.events * 1e9) if result.events else None,
        "engine_over_heapq": round(timings["engine_s"] / heap_s, 2) if heap_s else None,
        "peak_rss_bytes": peak,
        "peak_rss_bytes_per_op_and_flow": round(peak / (result.ops + result.flows)),
        "peak_rss_bytes_per_op": round(peak / result.ops),
    }


def _in_process(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        print(f"{args}: failed\n{proc.stderr}", file=sys.stderr)
        sys.exit(1)
    return json.loads(proc.stdout)


def scaling(output: pathlib.Path) -> None:
    """Run the SCALING series (each in its own process) and plot wall time and peak memory
    against ops + flows, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from g5core.inputs.outputs import check_outputs

    target = check_outputs({"-o": str(output)})  # before the series runs
    rows = []
    for i in range(len(SCALING)):
        row = _in_process(["--scaling-point", str(i)])
        rows.append(row)
        print(json.dumps(row), flush=True)
    n = [r["ops"] + r["flows"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for key, label in (("total_s", "total"), ("build_s", "build"), ("compile_s", "compile"),
                       ("engine_s", "engine")):
        ax.loglog(n, [r[key] for r in rows], marker="o", label=label)
    ref = rows[len(rows) // 2]
    ax.loglog(n, [ref["total_s"] * x / (ref["ops"] + ref["flows"]) for x in n], "k:", label="linear")
    ax.set_xlabel("ops + flows simulated")
    ax.set_ylabel("wall time (s)")
    ax.set_title("G5 wall time against DAG size (every chip simulated)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    target.write({"-o": lambda fh: fig.savefig(fh, format="png", dpi=110)}, binary=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), help="run one case in this process and print its JSON")
    parser.add_argument("--scaling", metavar="PNG", help="run the op-count series and write the log-log plot here")
    parser.add_argument("--scaling-point", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case)))
        return
    if args.scaling_point is not None:
        model, chips, par = SCALING[args.scaling_point]
        import tempfile

        import yaml

        raw = {"model": model, "system": "h100-sxm", "chips": chips,
               "parallel": {"dp": 1, "pp": 1, "cp": 1, "tp": 1, **par}, "phase": "prefill", "batch": 1,
               "seq_len": 131072}
        with tempfile.TemporaryDirectory() as d:
            path = pathlib.Path(d) / "point.yaml"
            path.write_text(yaml.safe_dump(raw))
            print(json.dumps(run_case(f"{model}-{chips}chips", path, [], symmetry=False, max_ops=10 ** 9)))
        return
    if args.scaling:
        scaling(pathlib.Path(args.scaling))
        return
    rows = []
    for name in CASES:
        row = _in_process(["--case", name])
        rows.append(row)
        print(json.dumps(row), flush=True)
    header = ["case", "ops", "flows", "events", "replicas", "build_s", "compile_s", "engine_s", "total_s",
              "heap", "eng_ns/ev", "heapq_ns/ev", "eng/heapq", "peak_MiB", "B/op+flow", "B/op"]
    print()
    print("  ".join(f"{h:>11}" if i else f"{h:<38}" for i, h in enumerate(header)))
    for r in rows:
        vals = [r["case"], r["ops"], r["flows"], r["events"], r["symmetry"]["replicas"],
                *(f"{r[k]:.3f}" for k in ("build_s", "compile_s", "engine_s", "total_s")), r["mean_heap_len"],
                r["engine_ns_per_event"], r["bare_heapq_ns_per_event"], r["engine_over_heapq"],
                round(r["peak_rss_bytes"] / 2 ** 20), r["peak_rss_bytes_per_op_and_flow"], r["peak_rss_bytes_per_op"]]
        print("  ".join(f"{v:>11}" if i else f"{v:<38}" for i, v in enumerate(vals)))

if __name__ == "__main__":
    main()
