"""g5 best --serve benchmark: wall time of the serving search and how many candidates it
simulated and pruned.

Not a test: it reports figures. The issue's case: llama-3.1-70b on 16 h100-sxm chips, ISL
8,192 / OSL 1,024 (Poisson), SLO ttft_p90=2s,tpot_p90=50ms, aggregated and disaggregated
(``--disagg auto``), 2 local workers. Usage:

    python benchmarks/bench_serve_search.py                       # the search's defaults
    python benchmarks/bench_serve_search.py --vary tp,cp --chunks 8192 --seqs 32,64,128 --settle 4 --confirm 0

Prints one JSON object: ``wall_s``, ``cpu_s_driver`` (this process) and ``cpu_s_workers``
(the worker processes, counted once they have exited), ``load_1min`` before and after (the
machine is shared), the counts (layout x chunk cells screened, pruned by family, candidates
simulated, bounded out by the branch and bound, serving runs), the settings and the winner
(its deployment, capacity, per-chip figures and the "why").
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import resource
import shutil
import subprocess
import tempfile
import time

#: G5's model and system names -> aiconfigurator's (its --model-path, a Hugging Face id it
#: ships the config of, and its --system)
PEER_MODELS = {"llama-3.1-70b": "meta-llama/Meta-Llama-3.1-70B", "llama-3.1-8b": "meta-llama/Meta-Llama-3.1-8B",
               "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B", "deepseek-v3": "deepseek-ai/DeepSeek-V3"}
PEER_SYSTEMS = {"h100-sxm": "h100_sxm", "h200": "h200_sxm", "h200-sxm": "h200_sxm", "b200": "b200_sxm"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-70b")
    ap.add_argument("--system", default="h100-sxm")
    ap.add_argument("--chips", type=int, default=16)
    ap.add_argument("--isl", type=int, default=8192)
    ap.add_argument("--osl", type=int, default=1024)
    ap.add_argument("--slo", default="ttft_p90=2s,tpot_p90=50ms")
    ap.add_argument("--disagg", default="auto")
    ap.add_argument("--framework", default=None, help="a framework profile (vllm, sglang, trtllm); default none")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--vary", default=None, help="e.g. tp,cp (default: every registered dimension)")
    ap.add_argument("--chunks", default=None, help="e.g. 2048,8192")
    ap.add_argument("--seqs", default=None, help="e.g. 32,64,128")
    ap.add_argument("--settle", type=float, default=None)
    ap.add_argument("--confirm", type=int, default=None)
    ap.add_argument("--beam", type=int, default=None)
    ap.add_argument("--top", type=int, default=None, help="the ranking is exact down to this place (default 5)")
    ap.add_argument("--no-bound", action="store_true", help="simulate every candidate (no branch and bound)")
    ap.add_argument("--peer", action="store_true",
                    help="also run aiconfigurator's CLI (pip install .[peers]) on the same case and print both")
    ap.add_argument("--candidate", default=None, metavar="tp=8,instances=2,seqs=64,chunk=8192",
                    help="time one aggregated candidate's capacity search alone (in this process) instead")
    ap.add_argument("--step-by-step", action="store_true",
                    help="--candidate: the serving loop one event per step (no runs of decode steps)")
    ap.add_argument("--bracket", action="store_true",
                    help="--candidate: start from its saturated throughput (as the search does) instead of "
                         "instances / lone end-to-end")
    args = ap.parse_args()

    from g5core.study import serving as ss

    ints = lambda text: tuple(int(v) for v in text.split(",")) if text else None  # noqa: E731
    settings = ss.SearchSettings(
        slo=args.slo, disagg=args.disagg, chunks=ints(args.chunks) or ss.DEFAULT_CHUNKS, seqs=ints(args.seqs),
        vary=tuple(args.vary.split(",")) if args.vary else None,
        settle=ss.SETTLE if args.settle is None else args.settle,
        confirm=ss.DEFAULT_CONFIRM if args.confirm is None else args.confirm,
        beam=ss.DEFAULT_BEAM if args.beam is None else args.beam, top=ss.DEFAULT_TOP if args.top is None else args.top,
        bound=not args.no_bound)
    raw = {"model": args.model, "system": args.system, "chips": args.chips,
           **({"framework": args.framework} if args.framework else {})}
    workload = {"requests": args.requests, "arrival": {"kind": "poisson"}, "input_tokens": args.isl,
                "output_tokens": args.osl, "seed": 0}
    load0 = os.getloadavg()[0]
    if args.candidate:
        return one_candidate(args, raw, workload, settings, load0)
    with tempfile.TemporaryDirectory() as tmp:
        t0, c0 = time.perf_counter(), time.process_time()
        kids0 = os.times()
        res = ss.serve_search(raw, workload, settings, db_path=f"{tmp}/bench.db", workers=args.workers)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        kids = os.times()
        workers_cpu = (kids.children_user - kids0.children_user) + (kids.children_system - kids0.children_system)
    win = res.ranked[0].to_json_dict() if res.ranked else None
    sim = max(res.candidates, 1)
    out = {
        "case": {**raw, "isl": args.isl, "osl": args.osl, "slo": args.slo, "workers": args.workers},
        "settings": {k: v for k, v in vars(args).items()},
        "wall_s": round(wall, 1), "cpu_s_driver": round(cpu, 1), "cpu_s_workers": round(workers_cpu, 1),
        "load_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "screened": res.layouts, "pruned": len(res.pruned),
        "pruned_by_family": {f: len(m) for f, m in res.families()},
        "simulated": res.candidates, "bounded_out": len(res.bounded),
        "bounded_by_source": {src: sum(b.source == src for b in res.bounded)
                              for src in sorted({b.source for b in res.bounded})},
        "beyond_beam": res.skipped_by_beam,
        "serving_runs": res.runs,
        "estimated": sum(1 for e in res.estimates.values() if e is not None),
        "cpu_s_per_simulated_candidate": round(workers_cpu / sim, 2),
        "sides": res.sides(),
        "winner": None if win is None else {
            "deployment": res.ranked[0].candidate.label(), "disaggregated": win["disaggregated"],
            "capacity_requests_per_s": win["capacity_requests_per_s"], "goodput_per_chip": win["goodput_per_chip"],
            "output_tokens_per_s_per_chip": win["output_tokens_per_s_per_chip"], "ttft_s": win["ttft_s"],
            "tpot_s": win["tpot_s"]},
        "why": res.why(),
    }
    if args.peer:       # one JSON document: the peer's run under "peer"
        out["peer"] = peer(args, wall, workers_cpu + cpu, res)
    print(json.dumps(out, indent=2))


def peer(args, wall: float, cpu: float, res) -> dict:
    """aiconfigurator's ``cli default`` on the same case (model, system, chips, ISL/OSL,
    TTFT and TPOT limits), in this process tree: its wall and CPU time, the ratio to G5's,
    and both tools' winners side by side (aiconfigurator's as its own summary lines);
    ``{"skipped": why}`` without aiconfigurator."""
    exe = shutil.which("aiconfigurator")
    if exe is None:
        return {"peer": "aiconfigurator", "skipped": "not installed (pip install '.[peers]')"}
    limits = dict(kv.split("=") for kv in args.slo.split(","))
    ms = lambda text: float(text[:-2]) if text.endswith("ms") else float(text[:-1]) * 1e3  # noqa: E731
    cmd = [exe, "cli", "default", "--model-path", PEER_MODELS.get(args.model, args.model),
           "--total-gpus", str(args.chips), "--system", PEER_SYSTEMS.get(args.system, args.system),
           "--isl", str(args.isl), "--osl", str(args.osl),
           "--ttft", f"{ms(limits.get('ttft_p90', '2s')):g}", "--tpot", f"{ms(limits.get('tpot_p90', '50ms')):g}"]
    with tempfile.TemporaryDirectory() as tmp:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        done = subprocess.run(cmd + ["--save-dir", tmp], capture_output=True, text=True)
        peer_wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    peer_cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    text = done.stdout + done.stderr
    best = [re.sub(r"\s+", " ", line.strip()) for line in text.splitlines()
            if re.search(r"Best Experiment Chosen|Per-GPU Throughput|Top Configurations|^\|\s+1\s+\|", line)]
    g5_sides = res.sides()
    return {
        "peer": "aiconfigurator", "command": " ".join(cmd), "exit": done.returncode,
        "wall_s": {"g5": round(wall, 1), "aiconfigurator": round(peer_wall, 1),
                   "g5_over_aiconfigurator": round(wall / peer_wall, 2) if peer_wall else None},
        "cpu_s": {"g5": round(cpu, 1), "aiconfigurator": round(peer_cpu, 1)},
        "winners": {"g5": {k: g5_sides[k] and g5_sides[k]["deployment"] for k in ("aggregated", "disaggregated")},
                    "g5_output_tokens_per_s_per_chip": {
                        k: g5_sides[k] and g5_sides[k].get("output_tokens_per_s_per_chip")
                        for k in ("aggregated", "disaggregated")},
                    "aiconfigurator": best},
    }


def one_candidate(args, raw, workload, settings, load0) -> None:
    """One candidate's capacity search, timed (CPU of this process)."""
    from g5core.serve import loop, session
    from g5core.inputs.serving import parse_slo
    from g5core.study import serving as ss
    from g5core.study.serving.capacity import run_settle_s as _settle_s
    from g5core.study.serving.screen import _lone

    from g5core.api.dimensions import collect_dimensions
    from g5core.api.plugins import Hooks, make_plugin_manager

    spec = dict(kv.split("=") for kv in args.candidate.split(","))
    missing = [k for k in ("instances", "seqs", "chunk") if k not in spec]
    if missing:
        raise SystemExit(f"--candidate {args.candidate}: add {', '.join(f'{k}=N' for k in missing)}")
    par = {d: 1 for d in ("cp", "dp", "ep", "pp", "sp", "tp")}
    par.update({k: int(v) for k, v in spec.items() if k in par})
    chips = collect_dimensions(Hooks(make_plugin_manager())).chips(par)
    wl = ss.check_workload(workload)
    screen = ss.screen_cell(raw, chips, par, int(spec["chunk"]), wl, args.slo)
    if screen.get("status") != "ok":
        raise SystemExit(f"{args.candidate}: the screen refused it ({screen.get('family')}): {screen.get('reason')}")
    pool = ss.PoolChoice(chips, tuple(sorted(par.items())), int(spec["instances"]))
    cand = ss.Candidate((pool,), int(spec["seqs"]), int(spec["chunk"]))
    limits = parse_slo(args.slo)
    settle_s = _settle_s(wl, [l for l in limits if l.metric in ("ttft", "e2e")],
                         [l for l in limits if l.metric in ("tpot", "itl")], {})
    roles = None
    if args.bracket:
        roles = ss.role_rates(screen, screen, pool.instances, pool.instances, cand.max_num_seqs, cand.chunk,
                              _lone(wl).requests[0], [l for l in limits if l.metric in ("tpot", "itl")])
    if args.step_by_step:
        session.ServingLoop = functools.partial(loop.ServingLoop, fast=False)
    t0, c0 = time.perf_counter(), time.process_time()
    cell = ss.candidate_cell(raw, cand, wl, args.slo, settings, pool.instances / screen["lone_e2e_s"], settle_s,
                             (), None, roles)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(json.dumps({"candidate": cand.label(), "step_by_step": args.step_by_step, "bracket": args.bracket,
                      "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
                      "load_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],
                      "capacity_requests_per_s": cell["capacity_requests_per_s"], "serving_runs": cell["runs"]},
                     indent=2))


if __name__ == "__main__":
    main()
