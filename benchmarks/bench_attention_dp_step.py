"""Benchmark: the step of an attention-DP instance whose ranks bring unequal batches.

Not a test: it reports figures. Qwen3-235B-A22B on 16 H200s as one instance of 16
attention-DP ranks with the experts over ep=16 (``examples/serving/qwen3-235b-a22b-
attention-dp.yaml``'s layout), through the serving cost path (``g5core.serve.cost.DpCost``,
every step through the engine). For one rank prefilling ``n`` tokens while the other 15 are
idle, and for the same tokens spread evenly (``n / 16`` a rank), in milliseconds:

- ``max_rank_bound_ms``: the slowest of the layout's steps at each rank's batch (every rank
  costed as if it brought the busy rank's tokens to the experts: the step before the
  composition);
- ``composed_ms``: DpCost's step (each rank's own part, the slowest, plus the experts of the
  tokens all ranks route, from the engine's op breakdown);
- ``even_ms``: the step of the same tokens spread evenly (every rank ``n / 16`` tokens);
- ``experts_busy_ms`` / ``experts_mean_ms``: the routed experts' compute on the busiest chip
  at the busy rank's tokens and at the mean.

    python benchmarks/bench_attention_dp_step.py [--tokens 4096 1024]
"""
from __future__ import annotations

import argparse
import json
import resource

from g5core.serve.cost import DpCost, PlanCost, RankedWork, StepWork, plan_experts_runner, plan_step_runner
from g5core.session.prepared import prepare

DP = 16
LAYOUT = {"model": "qwen3-235b-a22b", "system": "h200", "chips": DP,
          "parallel": {"dp": DP, "tp": 1, "pp": 1, "cp": 1, "ep": DP}, "phase": "decode", "batch": 1, "seq_len": 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 1024], help="the busy rank's prefill tokens")
    args = ap.parse_args()
    plan = prepare(LAYOUT)
    rank = PlanCost(plan_step_runner(plan), exact=True, rules=plan.step_rules)
    bound, cost = DpCost(rank, DP), DpCost(rank, DP, experts_s=plan_experts_runner(plan))
    for n in args.tokens:
        one = RankedWork((StepWork(((n, 0),), ()),) + (StepWork((), ()),) * (DP - 1))
        even = RankedWork((StepWork(((n // DP, 0),), ()),) * DP)
        print(json.dumps({"busy_rank_prefill_tokens": n, "max_rank_bound_ms": round(bound.latency_s(one) * 1e3, 2),
                          "composed_ms": round(cost.latency_s(one) * 1e3, 2),
                          "even_ms": round(cost.latency_s(even) * 1e3, 2),
                          "experts_busy_ms": round(cost.expert_s(n, True) * 1e3, 2),
                          "experts_mean_ms": round(cost.expert_s((n + DP - 1) / DP, True) * 1e3, 2)}))
    use = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"cpu_s": round(use.ru_utime + use.ru_stime, 2)}))


if __name__ == "__main__":
    main()
