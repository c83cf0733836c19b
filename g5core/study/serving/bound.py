"""Bounds of a candidate's capacity (branch and bound): its roles' saturated rate
(:func:`role_rates`), the queue argument (:func:`capacity_bound`), the estimate's margin, and
the objective's value they allow against the simulated one at the last place the ranking is exact to."""
from __future__ import annotations

import math
from typing import Mapping, Optional

from g5core.study.serving.estimate import ESTIMATE_MARGIN
from g5core.study.serving.result import Scored
from g5core.study.serving.space import Candidate, SearchSettings, run_requests


#: the decode role's bound counts batches whose decode step is at most the TPOT limit times
#: ``1 + TPOT_SLACK`` (a request's TPOT is its steps' mean; a percentile lets some run slower)
TPOT_SLACK = 0.25


#: a candidate's capacity bound (:func:`capacity_bound`) allows this much more than the
#: finite-run reasoning gives: the saturated throughput is itself measured on a short run
BOUND_MARGIN = 0.05


def capacity_bound(saturated: Optional[Mapping], limits, workload: Mapping, settle_s: float,
                   settings: SearchSettings) -> Optional[float]:
    """The rate above which a run of the search cannot hold the SLO, from the saturated
    throughput ``mu`` (``None``: no bound). A run at ``rate > mu`` builds a queue: by time
    ``t`` at least ``(rate - mu) t`` requests are in the system, at most ``slots`` of them
    running, so a request arriving at ``t`` waits at least ``((rate - mu) t - slots) / mu``
    for its first token. With a limit ``L`` on the ``p``-th percentile of TTFT (or of
    e2e, or of the queueing delay) the requests arriving after ``p`` percent of the run's span
    ``T`` must meet it, so ``rate / mu <= 1 + (L + slots / mu) / (p/100 T)``; ``T`` is the
    shortest run the search makes near that rate (:func:`run_requests`). Times
    ``1 + BOUND_MARGIN``. Approximate: ``mu`` is a measured steady state (not a proof that
    no load does better) and the queue's growth is taken at its mean."""
    mu = None if saturated is None else saturated.get("saturated_requests_per_s")
    if not mu:
        return None
    best = None
    for lim in limits:
        if lim.metric not in ("ttft", "e2e", "queue"):
            continue
        share = (lim.percentile if lim.percentile is not None else 100) / 100
        rate = 1.5 * mu
        span = run_requests(workload, rate, settle_s, settings.settle) / rate
        cap = mu * (1 + (lim.limit_s + saturated["slots"] / mu) / (share * span)) * (1 + BOUND_MARGIN)
        best = cap if best is None else min(best, cap)
    return best


def _estimate_bound(estimate: Optional[float], bound: Optional[float]) -> Optional[float]:
    """The capacity bound a candidate is ordered and bounded by: its estimate times ``1 +
    ESTIMATE_MARGIN``, or the roles' bound when that is lower (``None``: neither)."""
    if not estimate:
        return bound
    cap = estimate * (1 + ESTIMATE_MARGIN)
    return cap if bound is None else min(cap, bound)


def role_rates(p: Mapping, d: Mapping, n_p: int, n_d: int, max_num_seqs: int, chunk: int, shortest,
               tpot_limits) -> Optional[dict]:
    """A disaggregated candidate's saturated rate from its roles, the way DistServe sizes
    them, per layout from its screen: the prefill pool prefills at most ``max(1, chunk //
    prompt)`` prompts per lone prefill per instance (a step never costs less than the lone
    prompt's); the decode pool emits at most ``max over b of b / D(b)`` tokens per second
    per instance (the mediant: any mix of steps does no better than its best), ``D(b)`` the
    decode step of ``b <= max_num_seqs`` sequences at the shortest prompt's context, counting
    only the batches within the TPOT limit (times ``1 + TPOT_SLACK``), over the shortest
    output's decodes. Approximate: the TPOT cap (a percentile lets some requests run in
    slower batches; the slack covers it) and a step's cost growing with its work."""
    per_step = max(1, chunk // max(shortest.input_tokens, 1))
    prefill = n_p * per_step / p["lone_ttft_s"]
    cap = min((l.limit_s for l in tpot_limits), default=math.inf) * (1 + TPOT_SLACK)
    best = max(b / s for b, s in d["decode_step_s"] if b <= max_num_seqs and (s <= cap or b == 1))
    decodes = shortest.output_tokens - 1
    decode = n_d * best / decodes if decodes > 0 else math.inf
    slots = n_p * per_step + n_d * max(b for b, _ in d["decode_step_s"] if b <= max_num_seqs)
    return {"saturated_requests_per_s": min(prefill, decode), "slots": slots, "roles": [prefill, decode]}


def _upper_value(objective: str, bound: Optional[float], cand: Candidate, top_out: int) -> float:
    """The objective's value (per chip, the larger the better) the candidate cannot exceed:
    its capacity is at most ``bound`` and the goodput share at most 1 (output tokens: at most
    the longest output per request). ``inf`` without a bound."""
    if bound is None:
        return math.inf
    return (bound * top_out if objective == "throughput_per_chip" else bound) / cand.chips


def _bar_rate(objective: str, value: float, cand: Candidate, top_out: int) -> float:
    """The rate at which the candidate's value could at best equal ``value`` (the inverse of
    :func:`_upper_value`; ``value`` the wave's :func:`bar_value`): a capacity below it cannot
    enter the top."""
    return value * cand.chips / (top_out if objective == "throughput_per_chip" else 1)


def bar_value(kth: Optional[float], first: Optional[float], tolerance: float) -> Optional[float]:
    """The value a simulated candidate must pass to enter the ranking's exact top: the
    top-th simulated value times ``1 + tolerance``, but never above the first's. A capacity
    is the lower end of a bracket ``hi / lo <= 1 + tolerance``, so a candidate that cannot
    pass the top-th by more than that is tied with it within the search's own resolution
    (places 2 to ``top`` are exact up to the tolerance), while one that could pass the
    first is always simulated (the winner is exact). ``first`` None: ``kth`` (exact)."""
    if kth is None:
        return None
    return kth if first is None else min(kth * (1 + tolerance), first)


def objective_value(objective: str, scored: Scored) -> float:
    """The per-chip figure the ranking compares (min_chips: goodput, its tie-break)."""
    goodput, tokens = scored.rates()
    return tokens if objective == "throughput_per_chip" else goodput


def confirmed_upper(objective: str, cand: Candidate, capacity: float, held: Mapping, tolerance: float,
                    top_out: int) -> float:
    """The most the candidate's value can be once its confirming seeds have run, from its
    capacity ``capacity`` on the workload's seed (``held``: that run's summary): confirmed
    there, the value at it; else the capacity steps down by ``1 + tolerance`` at least
    (:func:`~g5core.study.serving.bisect.confirm`), where the value is at most
    :func:`_upper_value`'s."""
    there = objective_value(objective, Scored(cand, {}, {"capacity_requests_per_s": capacity, "held": held}))
    return max(there, _upper_value(objective, capacity / (1 + tolerance), cand, top_out))


def tie_bound(objective: str, cand: Candidate, capacity: float, held: Mapping, failed_rate: float,
              tolerance: float, top_out: int) -> float:
    """The bound of a candidate's value before its confirming seeds run, from its capacity
    search on the workload's seed (``capacity``, ``held`` the summary of its run there,
    ``failed_rate`` the lowest failing rate): :func:`confirmed_upper`, and at most what the
    failing rate allows. At or below the wave's :func:`bar_value` the candidate is a tie
    with the top (bounded out by the cell, and checked again by the driver for a
    max_num_seqs variant taking its runs)."""
    return min(confirmed_upper(objective, cand, capacity, held, tolerance, top_out),
               _upper_value(objective, failed_rate, cand, top_out))


def _top_values(settings: SearchSettings, cands, results) -> tuple[Optional[float], Optional[float]]:
    """``(kth, first)``: the ``top``-th best and the best objective value of the candidates
    simulated so far (``(None, None)`` while fewer than ``top`` are)."""
    values = []
    for (cand, _), res in zip(cands, results):
        if res is None or res["status"] != "ok" or not res["capacity_requests_per_s"]:
            continue
        values.append(objective_value(settings.objective, Scored(cand, {}, res)))
    if len(values) < settings.top:
        return None, None
    values.sort(reverse=True)
    return values[settings.top - 1], values[0]

