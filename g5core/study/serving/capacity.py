"""A candidate's capacity (in the workers): the highest arrival rate at which its serving runs
hold the SLO on every seed (the search over the rate: :mod:`.bisect`), and its saturated run."""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np

from g5core.api.errors import ConfigError, G5Error, PluginError
from g5core.inputs.serving import parse_slo
from g5core.serve.session import MissedRun, schedulers_peak
from g5core.study.serving.bisect import _holds, _snap, capacity_search, confirm
from g5core.study.serving.bound import (_bar_rate, _estimate_bound, _upper_value, bar_value, capacity_bound,
                                        tie_bound)
from g5core.study.serving.decode import decode_figures, decode_held, missed_limits
from g5core.study.serving.screen import _hbm, _session, refusal, seed_runners
# engine_points is also the cells' parameter (the latencies shipped with them)
from g5core.study.serving.screen import engine_points as points_held
from g5core.study.serving.space import (MAX_RUN_REQUESTS, Candidate, SearchSettings, _at_rate, _longest_output,
                                        _mean_lengths, candidate_config, run_requests)


#: the saturated run (:func:`saturated_run`): this many batches of requests arrive at once, at
#: this rate (requests/s: all within microseconds)
SATURATED_ROUNDS = 3


SATURATED_RATE = 1e6
#: the bisection starts at this share of the saturated throughput
START_SHARE = 0.8


#: or, with an estimate of the capacity (:mod:`g5core.study.serving.estimate`), at this share
#: of it (the estimates run a few percent above the simulated capacity of the issue's case)
START_ESTIMATE_SHARE = 0.95


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
                   engine_points: Optional[Mapping] = None, first: Optional[float] = None,
                   whole_failed: bool = False) -> dict:
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
    calibrated share, :func:`start_share`; by default
    ``START_ESTIMATE_SHARE``). ``engine_points``: its layouts' step latencies from their
    screens (:func:`~g5core.study.serving.screen.seed_runners`; the same figures, not
    simulated again). ``whole_failed``: a failing run stopped at its sure miss is made
    again to its end here (the figures a shown candidate gives, :func:`whole_cell`'s)."""
    seed_runners(engine_points)
    try:
        session = _candidate_session(base, cand, workload, slo, disabled, runner_for)
        out = _capacity(session, cand, workload, slo, settings, start_rate, settle_s, roles, kth, estimate,
                        start_share, first, whole_failed)
    except (ConfigError, PluginError) as exc:   # a plugin refusing one of its steps prunes the candidate
        return refusal(exc)
    # the step latencies its runs made, for the driver to ship with the later cells of its layouts
    return {**out, "engine_points": points_held(session)}


def _candidate_session(base: Mapping, cand: Candidate, workload: Mapping, slo: str, disabled, runner_for):
    """The candidate's serving session (its pools built once, sized for the longest run)."""
    raw = candidate_config(base, cand, workload, slo, None)
    return _session(raw, _at_rate({**workload, "requests": max(MAX_RUN_REQUESTS, workload["requests"])}, 1.0),
                    slo, disabled, runner_for)


def _capacity(session, cand, workload, slo, settings, start_rate, settle_s, roles, kth, estimate, start_share, first,
              whole_failed=False) -> dict:
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
    failed_at = None if failed is None else at.get(id(failed))
    made_whole = whole_failed and isinstance(failed, MissedRun) and failed_at is not None
    if made_whole:
        runs["n"] += 1
        failed = _whole(session, workload, *trace[failed_at][:2], settle_s, settings)
    # a failing run stopped at its sure miss has no figures: the driver makes the shown
    # candidates' again to their end (whole_cell); the others keep the limit it missed
    stopped = {"limit": failed.limit, "completed": failed.completed, "requests": failed.requests} if isinstance(
        failed, MissedRun) else None
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
            "failed": None if failed is None else _run_summary(failed, session),
            **({"failed_made_whole": True} if made_whole else {})}


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
        whole = _whole(session, workload, rate, seed, settle_s, settings)
    except (ConfigError, PluginError) as exc:
        return refusal(exc)
    return {"status": "ok", "failed": _run_summary(whole, session), "peak_running_seqs": _peak_running(whole)}


def _whole(session, workload: Mapping, rate: float, seed: int, settle_s: float, settings: SearchSettings):
    """A failing run stopped at its sure SLO miss, made again to its end."""
    whole = _seeded_run(session, workload, rate, seed, settle_s, settings, stop_at_miss=False)
    if _holds(whole):
        raise G5Error(f"a serving run at {rate:g} requests/s stopped at a sure SLO miss holds the SLO when run "
                      "to its end (a G5 bug)")
    return whole


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
    return schedulers_peak(result.loop.instances)


def trace_peak(trace: Sequence) -> Optional[int]:
    """The most sequences any scheduler held over a capacity search's runs (its ``trace``
    rows ``[rate, seed, held, peak]``); ``None`` when a run's schedulers did not say."""
    peaks = [row[3] for row in trace]
    return None if None in peaks else max(peaks, default=0)


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


def start_share(cands, results, estimates, disaggregated: bool) -> float:
    """Where a candidate's capacity search starts, as a share of its estimate: the median
    (the lower middle) of simulated over estimated capacity among the candidates of its side
    (aggregated or disaggregated; the other side's while its own has none) simulated so far,
    ``START_ESTIMATE_SHARE`` before any. Only the start: the bisection's result does not
    depend on it beyond the tolerance, and no bound uses it."""
    ratios: dict = {False: [], True: []}
    for (cand, _), res, est in zip(cands, results, estimates):
        if (res is None or res.get("status") != "ok" or "same_runs_as" in res or not est or res["ceiling"]
                or not res["capacity_requests_per_s"]):
            continue
        ratios[cand.disaggregated].append(res["capacity_requests_per_s"] / est)
    pick = sorted(ratios[disaggregated] or ratios[not disaggregated])
    return pick[(len(pick) - 1) // 2] if pick else START_ESTIMATE_SHARE


def run_settle_s(workload: Mapping, ttft_limits, tpot_limits, roles) -> float:
    """A request's time in the system when the SLO holds: the TTFT limit plus the mean
    output times the TPOT limit (without a limit: ten times the slowest lone figure)."""
    osl = _mean_lengths(workload)[1]
    kept = [x[3] for r in roles.values() for x in r]
    ttft = max((l.limit_s for l in ttft_limits), default=10 * max((k["lone_ttft_s"] for k in kept), default=0.0))
    tpot = max((l.limit_s for l in tpot_limits), default=10 * max((k["lone_tpot_s"] or 0.0 for k in kept),
                                                                  default=0.0))
    return ttft + osl * tpot
