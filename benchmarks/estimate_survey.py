"""How far the serving search's estimates are from the simulated capacities: the survey behind
``ESTIMATE_MARGIN`` (``g5core/study/serving/estimate.py``).

Not a test: it reports figures. Per case it runs ``g5 best --serve``'s search (defaults, 2
workers) for its candidates and their estimates, then simulates, without any bound or bar
(every confirming seed), the candidates whose estimate is at least ``--floor`` of the best
estimate, one per set of pools (its max_num_seqs and chunk variants estimate alike): the
``--top`` best by estimate and an evenly spaced sample of ``--sample`` of the rest (no random
draw: the same candidates every time), beside the candidates the search simulated itself. A
candidate the search bounds out by its estimate has ``estimate x (1 + ESTIMATE_MARGIN)``
below the bar; the margin is safe where no candidate can do more than that. Usage:

    python benchmarks/estimate_survey.py                        # every preset case
    python benchmarks/estimate_survey.py --case qwen3 --top 10 --sample 5
    python benchmarks/estimate_survey.py --case qwen3 --framework sglang   # under a profile
    python benchmarks/estimate_survey.py --disagg off           # aggregated candidates alone

Prints one JSON line per case (``ratios``: simulated capacity / estimate and failing rate /
estimate, highest first, with the candidates' labels) and a summary line (the highest of
each over every case). A capacity is the lower end of its bracket, so the failing rate is
what bounds the candidate: the margin is safe where it is at least ``max_failing_ratio - 1``.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import tempfile
import time

from g5core.study import serving as ss
from g5core.study.serving.capacity import candidate_cell, run_settle_s
from g5core.study.serving.inputs import checked_inputs

#: name -> (model, system, chips, ISL, OSL, SLO)
CASES = {
    "qwen3": ("qwen3-235b-a22b", "h200", 16, 4000, 1000, "ttft_p90=2s,tpot_p90=50ms"),
    "70b-4k": ("llama-3.1-70b", "h100-sxm", 16, 4000, 1000, "ttft_p90=2s,tpot_p90=50ms"),
    "70b-8k": ("llama-3.1-70b", "h100-sxm", 16, 8192, 1024, "ttft_p90=2s,tpot_p90=50ms"),
    "8b-tight": ("llama-3.1-8b", "h100-sxm", 8, 2000, 200, "ttft_p90=0.5s,tpot_p90=15ms"),
    "8b-4chips": ("llama-3.1-8b", "h100-sxm", 4, 4000, 1000, "ttft_p90=2s,tpot_p90=50ms"),
    "qwen3-tpot": ("qwen3-235b-a22b", "h200", 16, 2000, 500, "ttft_p90=1s,tpot_p90=30ms"),
}


def survey(name: str, top: int, sample: int, floor: float, workers: int, framework: str | None = None,
           disagg: str = "auto") -> dict:
    model, system, chips, isl, osl, slo = CASES[name]
    raw = {"model": model, "system": system, "chips": chips, **({"framework": framework} if framework else {})}
    workload = {"requests": 300, "arrival": {"kind": "poisson"}, "input_tokens": isl, "output_tokens": osl,
                "seed": 0}
    settings = ss.SearchSettings(slo=slo, disagg=disagg, chunks=ss.DEFAULT_CHUNKS, seqs=None, vary=None,
                                 settle=ss.SETTLE, confirm=ss.DEFAULT_CONFIRM, beam=ss.DEFAULT_BEAM,
                                 top=ss.DEFAULT_TOP, bound=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="g5-survey-") as tmp:
        res = ss.serve_search(raw, workload, settings, workers=workers, db_path=f"{tmp}/s.db")
    search_s = time.time() - t0
    wl, limits = checked_inputs(raw, workload, settings, (), "local", workers, None)[:2]
    settle_s = run_settle_s(wl, [l for l in limits if l.metric in ("ttft", "e2e")],
                            [l for l in limits if l.metric in ("tpot", "itl")], {})
    base = {k: v for k, v in raw.items() if k not in ("parallel", "speculative")}
    cands = {s.candidate.label(): s.candidate for s in res.ranked}
    cands.update({b.candidate.label(): b.candidate for b in res.bounded})
    est = {lab: e for lab, e in res.estimates.items() if e and lab in cands}
    best = max(est.values())
    near = sorted((lab for lab in est if est[lab] >= floor * best), key=lambda lab: (-est[lab], lab))
    # one candidate per set of pools (its max_num_seqs and chunk variants estimate alike)
    distinct = list({cands[lab].pools: lab for lab in reversed(near)}.values())[::-1]
    distinct.sort(key=lambda lab: (-est[lab], lab))
    rest = distinct[top:]
    step = max(len(rest) / sample, 1.0) if sample else 0
    chosen = distinct[:top] + ([rest[int(k * step)] for k in range(min(sample, len(rest)))] if sample else [])
    t1 = time.time()
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers) as pool:
        futs = [pool.submit(candidate_cell, base, cands[lab], wl, slo, settings, est[lab], settle_s, (), None,
                            None, None, est[lab]) for lab in chosen]
        cells = [f.result() for f in futs]
    # a capacity is the lower end of its bracket: the candidate fails at its failing rate (none:
    # it held up to the search's --max-rate), so what it can do is below that
    # and the candidates the search itself simulated (its ranking's, with their confirming seeds)
    done = dict(zip(chosen, cells))
    done.update({s.candidate.label(): s.cell for s in res.ranked if s.candidate.label() in est and s.cell})
    ratios = sorted(((c["capacity_requests_per_s"] / est[lab], (c.get("failed_rate_per_s") or math.inf) / est[lab],
                      lab, c["capacity_requests_per_s"], est[lab])
                     for lab, c in done.items() if c.get("status") == "ok" and c.get("capacity_requests_per_s")),
                    reverse=True)
    return {"case": name, "disagg": disagg, "model": model, "system": system, "chips": chips, "isl": isl, "osl": osl,
            "slo": slo,
            "candidates": len(res.estimates), "within_floor": len(near), "distinct_pools": len(distinct),
            "simulated": len(chosen), "with_search": len(ratios),
            "refused": sum(c.get("status") != "ok" for c in cells), "search_wall_s": round(search_s, 1),
            "survey_wall_s": round(time.time() - t1, 1),
            "max_ratio": round(ratios[0][0], 4) if ratios else None,
            "max_failing_ratio": round(max(r[1] for r in ratios), 4) if ratios else None,
            "ratios": [[round(r, 4), round(f, 4), lab, round(cap, 4), round(e, 4)] for r, f, lab, cap, e in ratios]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="a preset case (default: every one)")
    ap.add_argument("--top", type=int, default=24, help="the best candidates by estimate simulated (default 24)")
    ap.add_argument("--sample", type=int, default=16, help="evenly spaced others simulated (default 16)")
    ap.add_argument("--floor", type=float, default=0.5,
                    help="only candidates whose estimate is at least this share of the best's (default 0.5)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--framework", default=None, help="a framework profile (vllm, sglang, trtllm); default none")
    ap.add_argument("--disagg", default="auto", choices=("auto", "off", "on"),
                    help="the search's --disagg (off: aggregated candidates alone, whose estimates are "
                         "otherwise mostly below the floor; default auto)")
    args = ap.parse_args()
    worst = None
    for name in args.case or list(CASES):
        out = survey(name, args.top, args.sample, args.floor, args.workers, args.framework, args.disagg)
        print(json.dumps(out), flush=True)
        if out["max_ratio"] is not None and (worst is None or out["max_failing_ratio"] > worst[0]):
            worst = (out["max_failing_ratio"], name, max(out["ratios"], key=lambda r: r[1])[2])
    print(json.dumps({"summary": True, "ESTIMATE_MARGIN": ss.ESTIMATE_MARGIN,
                      "max_failing_ratio": worst and worst[0], "case": worst and worst[1],
                      "candidate": worst and worst[2]}))


if __name__ == "__main__":
    main()
