"""A candidate's capacity (in the workers): the highest arrival rate at which its serving runs
hold the SLO on every seed, by galloping and bisection over the rate, and its saturated run."""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import numpy as np

from g5core.api.errors import ConfigError, G5Error, PluginError
from g5core.inputs.serving import parse_slo
from g5core.serve.metrics import goodput, per_request
from g5core.serve.session import MissedRun
from g5core.study.serving.bound import (_bar_rate, _estimate_bound, _upper_value, bar_value, capacity_bound,
                                        tie_bound)
from g5core.study.serving.estimate import narrow
from g5core.study.serving.screen import _hbm, _session, refusal, seed_runners
from g5core.study.serving.space import (MAX_RUN_REQUESTS, Candidate, SearchSettings, _at_rate, _longest_output,
                                        candidate_config, run_requests)


#: the saturated run (:func:`saturated_run`): this many batches of requests arrive at once, at
#: this rate (requests/s: all within microseconds)
SATURATED_ROUNDS = 3


SATURATED_RATE = 1e6
#: the bisection starts at this share of the saturated throughput
START_SHARE = 0.8


#: or, with an estimate of the capacity (:mod:`g5core.study.serving.estimate`), at this share
#: of it (the estimates run a few percent above the simulated capacity of the issue's case)
START_ESTIMATE_SHARE = 0.95


def _holds(result) -> bool:
    s = result.summary
    g = s["goodput"]
    return bool(g and g["all_met"]) and s["completed"] == s["requests"]


class _BelowBar(Exception):
    def __init__(self, rate: float):
        self.rate = rate


def capacity_search(run, start_rate: float, tolerance: float, max_rate: float,
                    floor_rate: Optional[float] = None, upper: Optional[float] = None,
                    bar: Optional[float] = None, gallop: bool = False) -> dict:
    """The highest rate at which ``run(rate)`` (a serving result) holds the SLO, within
    ``hi / lo <= 1 + tolerance``: ``{capacity, held, failed, failed_rate, ceiling}`` with the
    results at the capacity and at the lowest failing rate tried (``None`` when none);
    ``ceiling``: the SLO still held at ``max_rate``. ``floor_rate``: first try this rate;
    if it fails, the capacity is 0 (min_chips: the deployment does not serve it).
    ``upper``: an estimate of a rate the SLO does not hold at (the saturated throughput's
    bound): from a start that holds, the bisection runs toward it first instead of doubling,
    and a failing run there is required before it counts (if the SLO holds at ``upper``
    too, the doubling goes on from there): a guess of the bracket, never of the result.
    ``bar``: a rate the capacity must pass to matter (the rate of the branch and bound's
    :func:`~g5core.study.serving.bound.bar_value`, :func:`~g5core.study.serving.bound._bar_rate`):
    from a start below it the first run is at ``bar``, and the search stops at the first
    run at or below ``bar`` that fails (``below_bar``: the capacity is below that rate).
    ``gallop`` (a start from an estimate of the capacity): from the start the rate moves by
    ``1 + tolerance`` up (while the SLO holds) or down (while it does not), the factor
    squared at each step, to a bracket, then bisects; an estimate within the tolerance
    takes two runs. Downwards no step goes past ``bar``: the bar's rate is tried instead."""
    results: dict = {}

    def ok(rate: float) -> bool:
        results[rate] = run(rate)
        held = _holds(results[rate])
        if not held and bar is not None and rate <= bar:
            raise _BelowBar(rate)
        return held

    def done(lo, hi, ceiling=False, below_bar=False):
        return {"capacity": lo, "held": results.get(lo), "failed": results.get(hi), "failed_rate": hi,
                "ceiling": ceiling, "below_bar": below_bar}

    try:
        return _bisect_rate(ok, done, start_rate, tolerance, max_rate, floor_rate, upper, bar, gallop)
    except _BelowBar as stop:
        return done(0.0, stop.rate, below_bar=True)


def _bisect_rate(ok, done, start_rate, tolerance, max_rate, floor_rate, upper, bar, gallop) -> dict:
    lo, hi = 0.0, None
    rate = min(floor_rate if floor_rate is not None else start_rate, max_rate)
    if bar is not None and floor_rate is None and rate < bar:
        rate = min(bar, max_rate)
    if gallop and floor_rate is None:
        step = 1 + tolerance
        if ok(rate):
            lo = rate
            while hi is None:
                if lo >= max_rate:
                    return done(lo, None, True)
                nxt = min(lo * step, max_rate)
                if ok(nxt):
                    lo, step = nxt, step * step
                else:
                    hi = nxt
        else:
            hi = rate
            while True:
                nxt = _not_past(hi / step, bar, hi)
                if nxt < rate * 1e-4:
                    return done(0.0, hi)
                if ok(nxt):
                    lo = nxt
                    break
                hi, step = nxt, step * step
    elif not ok(rate):
        if floor_rate is not None:
            return done(0.0, rate)
        hi = rate
        while True:  # downwards until it holds (a lone request met it, so a low rate will)
            rate = _not_past(rate / 2, bar, hi)
            if rate < hi * 1e-4:
                return done(0.0, hi)
            if ok(rate):
                lo = rate
                break
            hi = rate
    else:
        lo = rate
        guess = None if upper is None else min(upper, max_rate)
        while hi is None and guess is not None and guess > lo * (1 + tolerance):
            mid = math.sqrt(lo * guess)
            if ok(mid):
                lo = mid
            else:
                hi = mid
        if hi is None and guess is not None and guess > lo:
            if ok(guess):
                lo = guess
            else:
                hi = guess
        while hi is None:
            if lo >= max_rate:
                return done(lo, None, True)
            rate = min(2 * lo, max_rate)
            if ok(rate):
                lo = rate
            else:
                hi = rate
    lo, hi = narrow(ok, lo, hi, tolerance)
    return done(lo, hi)


def _not_past(rate: float, bar: Optional[float], hi: float) -> float:
    """The next rate down from a failing ``hi``: ``rate``, or ``bar`` where ``rate`` would step
    past it (a failing run at the bar ends the search at once, and a holding one leaves the
    tightest bracket the step allowed)."""
    return bar if bar is not None and rate < bar < hi else rate


def _run_summary(result, session) -> dict:
    s = result.summary
    g = s["goodput"] or {}
    out = {"ttft_s": s["ttft_s"], "tpot_s": s["tpot_s"], "e2e_s": s["e2e_s"], "throughput": s["throughput"],
           "goodput_share": g.get("share", 0.0), "percentile_limits": g.get("percentile_limits"),
           "mean_output_tokens": s["tokens"]["output"] / max(s["requests"], 1), "requests": s["requests"],
           "preemptions": s["preemptions"], "kv_pool_use": s["kv_pool_use"], "running_seqs": s["running_seqs"],
           "waiting_seqs": s["waiting_seqs"], "kv_transfer_s": s["kv_transfer_s"], "chips": result.loop.fleet.chips,
           "pools": result.pools,
           "max_total_bytes": max(_hbm(pool) - pool.cost.kv_pool_bytes_per_chip
                                  + use * pool.cost.kv_pool_bytes_per_chip
                                  for pool, use in zip(session.fleet.pools, _pool_peak_use(result)))}
    return out


def _pool_peak_use(result) -> list[float]:
    """Per pool: the largest share of its KV blocks any of its instances used."""
    out = []
    for pool in result.loop.fleet.pools:
        peak = 0.0
        for inst in result.loop.instances:
            if inst.pool is pool:
                rows = np.frombuffer(inst.steps, dtype=float).reshape(-1, 7)
                if len(rows):
                    peak = max(peak, float(rows[:, 4].max()) / pool.total_blocks)
        out.append(peak)
    return out


def candidate_cell(base: Mapping, cand: Candidate, workload: Mapping, slo: str, settings: SearchSettings,
                   start_rate: float, settle_s: float, disabled=(), runner_for=None,
                   roles: Optional[Mapping] = None, kth: Optional[float] = None,
                   estimate: Optional[float] = None, start_share: float = START_ESTIMATE_SHARE,
                   engine_points: Optional[Mapping] = None, first: Optional[float] = None) -> dict:
    """A candidate's capacity (a bisection over the rate, see the module doc) and its runs at
    the capacity and at the first failing rate. ``roles``: its roles' bound
    (:func:`role_rates`); with it, an aggregated candidate first measures its saturated
    throughput (:func:`saturated_run`), the lower of the two is ``mu``, and when the
    objective's bound from ``mu`` (:func:`capacity_bound`) is below ``kth`` (the wave's
    ``top``-th simulated value) the candidate is bounded out (``status: bounded``);
    otherwise the bisection starts at ``START_SHARE x mu``, toward the bound. ``estimate``:
    the candidate's estimated capacity (:mod:`g5core.study.serving.estimate`); with it (and
    ``roles``) the saturated run is left out, the bound is at most the estimate times ``1 +
    ESTIMATE_MARGIN``, and the bisection starts at ``start_share x estimate`` (the driver's
    calibrated share, :func:`~g5core.study.serving.driver.start_share`; by default
    ``START_ESTIMATE_SHARE``). ``engine_points``: its layouts' step latencies from their
    screens (:func:`~g5core.study.serving.screen.seed_runners`; the same figures, not
    simulated again)."""
    seed_runners(engine_points)
    try:
        return _capacity(base, cand, workload, slo, settings, start_rate, settle_s, disabled, runner_for, roles, kth,
                         estimate, start_share, first)
    except (ConfigError, PluginError) as exc:   # a plugin refusing one of its steps prunes the candidate
        return refusal(exc)


def _candidate_session(base: Mapping, cand: Candidate, workload: Mapping, slo: str, disabled, runner_for):
    """The candidate's serving session (its pools built once, sized for the longest run)."""
    raw = candidate_config(base, cand, workload, slo, None)
    return _session(raw, _at_rate({**workload, "requests": max(MAX_RUN_REQUESTS, workload["requests"])}, 1.0),
                    slo, disabled, runner_for)


def _capacity(base, cand, workload, slo, settings, start_rate, settle_s, disabled, runner_for, roles, kth,
              estimate, start_share, first) -> dict:
    session = _candidate_session(base, cand, workload, slo, disabled, runner_for)
    floor = settings.rate if settings.objective == "min_chips" else None
    runs = {"n": 0}
    mu = bound = None
    sat = None
    if roles is not None and floor is None:

        sat = dict(roles)
        if not cand.disaggregated and not estimate:
            run_sat = saturated_run(session, cand, workload)
            if run_sat["saturated_requests_per_s"] and (
                    run_sat["saturated_requests_per_s"] < sat["saturated_requests_per_s"]):
                sat = {**run_sat, "roles": roles["roles"]}
        mu = sat["saturated_requests_per_s"]
        bound = capacity_bound(sat, parse_slo(slo), workload, settle_s, settings)
        if estimate:     # the driver bounded the wave by this bound already
            bound = _estimate_bound(estimate, bound)
        else:
            upper = _upper_value(settings.objective, bound, cand, _longest_output(workload))
            if kth is not None and upper < kth:
                return {"status": "bounded", "label": cand.label(), "saturated": sat, "capacity_bound": bound,
                        "upper": upper, "kth": kth, "source": "saturated run", "runs": 1}

    trace: list = []      # every run: [rate, seed, held, the most sequences a scheduler held]
    at: dict = {}         # id(a run's result) -> its place in ``trace``

    made: dict = {}       # (rate, seed) -> the run's result: a rate tried again is not run again

    def run(rate, seed=None):
        seed = workload["seed"] if seed is None else seed
        if (rate, seed) in made:
            return made[(rate, seed)]
        runs["n"] += 1
        res = made[(rate, seed)] = _seeded_run(session, workload, rate, seed, settle_s, settings)
        at[id(res)] = len(trace)
        trace.append([rate, seed, _holds(res), _peak_running(res)])
        return res
    if estimate and floor is None:
        start_rate = start_share * estimate
    elif mu and floor is None:
        start_rate = START_SHARE * mu
    # the value to pass (bar_value: the top-th's, up to the tolerance, never the first's)
    # and the rate at which the candidate's value would equal it
    top_out = _longest_output(workload)
    passing = None if floor is not None else bar_value(kth, first, settings.tolerance)
    bar = None if passing is None else _bar_rate(settings.objective, passing, cand, top_out)
    seeds = [workload["seed"] + k for k in range(1, settings.confirm + 1)]

    found = capacity_search(run, start_rate, settings.tolerance, settings.max_rate, floor,
                            bound if floor is None else None, bar, gallop=bool(estimate) and floor is None)
    tie = None
    if (not found["below_bar"] and seeds and found["capacity"] > 0 and bar is not None
            and found["failed_rate"] is not None):
        # a tie: whatever its confirming seeds say, its value cannot pass the bar's value
        # (bar_value), so they are not run
        tie = tie_bound(settings.objective, cand, found["capacity"], _run_summary(found["held"], session),
                        found["failed_rate"], settings.tolerance, top_out)
        if tie <= passing:
            found = {**found, "below_bar": True}
        else:
            tie = None
    if not found["below_bar"] and seeds and found["capacity"] > 0:
        found = confirm(found, run, seeds, settings.tolerance, bar, lambda r: _snap(r, made))
    if found["below_bar"]:
        rate = found["failed_rate"]
        out = {"status": "bounded", "label": cand.label(), "saturated": sat, "capacity_bound": rate,
               "upper": _upper_value(settings.objective, rate, cand, top_out) if tie is None else tie, "kth": kth,
               "runs": runs["n"], "failed_rate_per_s": rate, "source": "simulated",
               "missed": missed_limits(found["failed"]), "decode_failed": decode_figures(found["failed"]),
               "peak_running_seqs": trace_peak(trace), "trace": trace}
        if tie is not None:     # what a max_num_seqs variant taking these runs checks again (the driver)
            out.update(tie_bar=passing, tie_run=at.get(id(found["held"])), decode_held=decode_held(found, slo, cand))
        return out
    held, failed = found["held"], found["failed"]
    # a failing run stopped at its sure miss has no figures: the driver makes the shown
    # candidates' again to their end (whole_cell); the others keep the limit it missed
    stopped = {"limit": failed.limit, "completed": failed.completed, "requests": failed.requests} if isinstance(
        failed, MissedRun) else None
    failed_at = None if failed is None else at.get(id(failed))
    failed = None if stopped else failed
    return {"status": "ok", "label": cand.label(), "disaggregated": cand.disaggregated, "chips": cand.chips,
            "failed_stopped": stopped,
            "capacity_requests_per_s": found["capacity"], "ceiling": found["ceiling"],
            "runs": runs["n"], "failed_rate_per_s": found["failed_rate"], "peak_running_seqs": trace_peak(trace),
            "trace": trace, "held_run": None if held is None else at.get(id(held)),
            "failed_run": failed_at, "missed": missed_limits(found["failed"]),
            "decode_held": decode_held(found, slo, cand), "decode_failed": decode_figures(found["failed"]),
            "build_s": session.build_s, "saturated_requests_per_s": mu, "capacity_bound": bound, "saturated": sat,
            "held": None if held is None else _run_summary(held, session),
            "failed": None if failed is None else _run_summary(failed, session)}


def decode_held(found: Mapping, slo: str, cand: Candidate) -> Optional[list]:
    """``[capacity, share, mean output tokens, preemptions, decode peak]`` of a
    disaggregated candidate's run at its capacity on the workload's seed: the share of its
    requests within every TPOT and ITL limit (what its decode pool decides; the driver's
    ``decode_upper``) and :func:`decode_figures`. None for an aggregated candidate, without
    such a limit or without that run."""
    held = found.get("held")
    limits = tuple(lim for lim in parse_slo(slo) if lim.metric in ("tpot", "itl"))
    if not cand.disaggregated or not limits or held is None or isinstance(held, MissedRun) or not found["capacity"]:
        return None
    arrays = per_request(held.loop)
    share = goodput(arrays, limits, 1.0, np.frombuffer(held.loop.requests.itl_s, dtype=float))["share"]
    s = held.summary
    return [found["capacity"], share, s["tokens"]["output"] / max(s["requests"], 1), *decode_figures(held)]


def decode_figures(result) -> list:
    """``[preemptions, decode peak]`` of a run (stopped at its sure miss or whole): its
    preemptions in every pool and the most sequences a scheduler of its last pool held
    (``None`` each where it does not say). A disaggregated run without preemption never
    prefilled in its decode pool, and one whose decode peak stayed below a limit never met
    it: such a decode pool ran alike under any chunk size and max_num_seqs above its peak."""
    if result is None:
        return [None, None]
    if isinstance(result, MissedRun):
        return [result.preemptions, result.last_pool_peak]
    last = result.loop.fleet.pools[-1]
    peaks = [getattr(inst.scheduler, "peak_running", None) for inst in result.loop.instances if inst.pool is last]
    return [result.summary["preemptions"], None if None in peaks else max(peaks, default=0)]


def missed_limits(result) -> list[str]:
    """The SLO limits (their keys, ``tpot_p90``) a failing run missed: a run stopped at its
    sure miss names the one it was sure of, a whole run every percentile limit over its
    value (``[]``: none named, e.g. a run that did not complete)."""
    if result is None:
        return []
    if isinstance(result, MissedRun):
        return [result.limit] if result.limit else []
    checks = (result.summary["goodput"] or {}).get("percentile_limits") or {}
    return sorted(k for k, v in checks.items() if not v["met"])


def _seeded_run(session, workload: Mapping, rate: float, seed: int, settle_s: float, settings: SearchSettings,
                stop_at_miss: bool = True):
    """One capacity run: the workload at ``rate`` on ``seed``, with the search's request count.
    ``stop_at_miss``: a run whose SLO verdict is sure to be missed stops there (a
    :class:`~g5core.serve.session.MissedRun`: the search needs only its verdict)."""
    n = run_requests(workload, rate, settle_s, settings.settle)
    return session.run(_at_rate({**workload, "requests": n, "seed": seed}, rate), stop_at_miss=stop_at_miss,
                       itl_stats=False)


def whole_cell(base: Mapping, cand: Candidate, workload: Mapping, slo: str, settings: SearchSettings,
               settle_s: float, disabled, runner_for, rate: float, seed: int,
               engine_points: Optional[Mapping] = None) -> dict:
    """A candidate's failing run at ``rate`` on ``seed``, which its capacity search stopped at
    its sure SLO miss, made again to its end (a shown candidate's figures past its
    capacity): ``{"status": "ok", "failed": its summary, "peak_running_seqs": ...}``.
    ``engine_points``: as :func:`candidate_cell`'s."""
    seed_runners(engine_points)
    try:
        session = _candidate_session(base, cand, workload, slo, disabled, runner_for)
        whole = _seeded_run(session, workload, rate, seed, settle_s, settings, stop_at_miss=False)
    except (ConfigError, PluginError) as exc:
        return refusal(exc)
    if _holds(whole):
        raise G5Error(f"a serving run at {rate:g} requests/s stopped at a sure SLO miss holds the SLO when run "
                      "to its end (a G5 bug)")
    return {"status": "ok", "failed": _run_summary(whole, session), "peak_running_seqs": _peak_running(whole)}


def variant_cell(base: Mapping, cand: Candidate, workload: Mapping, slo: str, settings: SearchSettings,
                 settle_s: float, disabled, runner_for, runs: Sequence, engine_points: Optional[Mapping] = None) -> dict:
    """A max_num_seqs variant's check (the driver's ``variant_runs``): ``runs`` (``[rate,
    seed]`` each, the runs of a simulated variant whose batches reached either's limit)
    made on ``cand``: ``{"runs": [[held, peak, summary], ...]}``. Where every run holds or
    fails as the variant's did, the variant's capacity search is ``cand``'s, run for run.
    ``engine_points``: as :func:`candidate_cell`'s."""
    seed_runners(engine_points)
    try:
        session = _candidate_session(base, cand, workload, slo, disabled, runner_for)
        out = []
        for rate, seed in runs:   # whole runs: the driver takes their figures for the variant's
            res = _seeded_run(session, workload, rate, seed, settle_s, settings, stop_at_miss=False)
            out.append([_holds(res), _peak_running(res), _run_summary(res, session)])
        return {"status": "ok", "label": cand.label(), "runs": out}
    except (ConfigError, PluginError) as exc:
        return refusal(exc)


def _peak_running(result) -> Optional[int]:
    """The most sequences any scheduler of the run held at once (per attention-DP rank);
    ``None`` when a scheduler does not say."""
    if isinstance(result, MissedRun):
        return result.peak_running
    peaks = [getattr(inst.scheduler, "peak_running", None) for inst in result.loop.instances]
    return None if None in peaks else max(peaks, default=0)


def trace_peak(trace: Sequence) -> Optional[int]:
    """The most sequences any scheduler held over a capacity search's runs (its ``trace``
    rows ``[rate, seed, held, peak]``); ``None`` when a run's schedulers did not say."""
    peaks = [row[3] for row in trace]
    return None if None in peaks else max(peaks, default=0)


def _snap(rate: float, made: Mapping) -> float:
    """A rate tried before within a relative 1e-9 of ``rate`` (stepping down by ``1 +
    tolerance`` from a bisection's midpoint lands on its lower end up to rounding), else
    ``rate``."""
    for r, _ in made:
        if abs(r - rate) <= 1e-9 * rate:
            return r
    return rate


def confirm(found: dict, run, seeds: Sequence[int], tolerance: float, bar: Optional[float],
            snap=lambda rate: rate) -> dict:
    """The capacity found on the workload's seed, confirmed on the further ``seeds``: the
    capacity holds when every seed's run does there; while one fails the rate steps down by
    ``1 + tolerance`` (the failing run is the new failed one, and the seeds run again, the
    workload's first). The confirming seeds run only at the capacity, not at every rate the
    bisection tried (a rate holds on the workload's seed before the others can tell)."""
    lo, held = found["capacity"], found["held"]
    first = lo
    while True:
        miss = next((r for r in (run(lo, sd) for sd in seeds) if not _holds(r)), None)
        if miss is None:
            return {**found, "capacity": lo, "held": held}
        found = {**found, "failed": miss, "failed_rate": lo, "ceiling": False}
        while True:
            lo = snap(lo / (1 + tolerance))
            if bar is not None and lo <= bar:
                return {**found, "capacity": 0.0, "held": None, "below_bar": True}
            if lo < first * 1e-4:
                return {**found, "capacity": 0.0, "held": None}
            held = run(lo)
            if _holds(held):
                break
            found = {**found, "failed": held, "failed_rate": lo}


def saturated_run(session, cand: Candidate, workload: Mapping) -> dict:
    """The candidate's saturated throughput on its session: ``SATURATED_ROUNDS`` batches'
    worth of requests (``max_num_seqs`` times the instances of the last pool, at most what a
    pool holds at the longest request) arrive at once, and the throughput is the
    completions of the middle rounds over their span, the queue never empty. ``None``
    when the run preempted: the pool, not the batch, set its pace."""
    last = session.fleet.pools[-1]
    holds = max(last.total_blocks * last.scheduler.block_size // max(session.longest, 1), 1)
    n = SATURATED_ROUNDS * min(cand.max_num_seqs, holds) * last.instances
    res = session.run(_at_rate({**workload, "requests": n}, SATURATED_RATE))
    done = np.sort(np.frombuffer(res.loop.requests.finish_s, dtype=float))
    k1, k2 = n // SATURATED_ROUNDS, n - n // SATURATED_ROUNDS
    span = float(done[k2 - 1] - done[k1 - 1])
    rate = (k2 - k1) / span if span > 0 and not res.summary["preemptions"] else None
    slots = sum(min(cand.max_num_seqs, holds) * p.instances for p in session.fleet.pools)
    return {"saturated_requests_per_s": rate, "requests": n, "slots": slots,
            "preemptions": res.summary["preemptions"]}

