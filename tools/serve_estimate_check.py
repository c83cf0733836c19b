"""How close the serving search's capacity estimates come to the simulated capacities.

Simulates every candidate of a small space without the branch and bound (``bound=False``)
and prints each candidate's simulated capacity, its estimate
(:mod:`g5core.study.serving.estimate`) and their ratio, then the range of the ratios. The
default space is the tests' engine case: llama-3.1-8b on 8 h100-sxm chips, tp only, ISL
2,000 / OSL 16 Poisson, ``ttft_p90=1s,tpot_p90=40ms``, chunk 1,024, max_num_seqs 4 and 16,
aggregated and disaggregated, runs of 4 x the requests in the system, no confirming seeds.

    python tools/serve_estimate_check.py
"""
from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--chips", type=int, default=8)
    ap.add_argument("--slo", default="ttft_p90=1s,tpot_p90=40ms")
    ap.add_argument("--isl", type=int, default=2000)
    ap.add_argument("--osl", type=int, default=16)
    args = ap.parse_args()

    from g5core.study.serving import SearchSettings, serve_search

    raw = {"model": args.model, "system": "h100-sxm", "chips": args.chips}
    wl = {"requests": 60, "arrival": {"kind": "poisson"}, "input_tokens": args.isl, "output_tokens": args.osl,
          "seed": 0}
    settings = SearchSettings(slo=args.slo, chunks=(1024,), seqs=(4, 16), vary=("tp",), disagg="auto", settle=4,
                              confirm=0, bound=False)
    result = serve_search(raw, wl, settings)
    ratios = []
    for s in result.ranked:
        est = result.estimates[s.candidate.label()]
        ratio = s.capacity / est if est else float("nan")
        ratios.append(ratio)
        print(f"{s.candidate.label():72s} simulated {s.capacity:8.3f}  estimate {est:8.3f}  ratio {ratio:.3f}")
    print(f"{len(ratios)} candidates: simulated / estimate from {min(ratios):.3f} to {max(ratios):.3f}")


if __name__ == "__main__":
    main()
