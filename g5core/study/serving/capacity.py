"""A candidate's capacity (in the workers): the highest arrival rate at which its serving runs
hold the SLO on every seed (the search over the rate: :mod:`.bisect`), and its saturated run."""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np

from g5core.api.errors import ConfigError, PluginError
from g5core.inputs.serving import parse_slo
from g5core.study.serving.bisect import _holds, capacity_search, confirm
from g5core.study.serving.bound import (_bar_rate, _estimate_bound, _upper_value, bar_value, capacity_bound,
                                        tie_bound)
from g5core.study.serving.runs import (_figures, _peak_running, _run_summary, _Runs, _seeded_run, _Shipped, _whole,
                                       trace_peak)
from g5core.study.serving.screen import _session, refusal, seed_runners
# engine_points is also the cells' parameter (the latencies shipped with them)
from g5core.study.serving.screen import engine_points as points_held
from g5core.study.serving.space import (MAX_RUN_REQUESTS, Candidate, SearchSettings, _at_rate, _longest_output,
                                        _mean_lengths, candidate_config)


#: the saturated run (:func:`saturated_run`): this many batches of requests arrive at once, at
#: this rate (requests/s: all within microseconds)
SATURATED_ROUNDS = 3


SATURATED_RATE = 1e6
#: the bisection starts at this share of the saturated throughput
START_SHARE = 0.8


#: or, with an estimate of the capacity (:mod:`g5core.study.serving.estimate`), at this share
#: of it (the estimates run a few percent above the simulated capacity of the issue's case)
START_ESTIMATE_SHARE = 0.95


def candidate_cell(base: Mapping, cand: Candidate, workload: Mapping, slo: str, settings: SearchSettings,
                   start_rate: float, settle_s: float, disabled=(), runner_for=None,
                   roles: Optional[Mapping] = None, kth: Optional[float] = None,
                   estimate: Optional[float] = None, start_share: float = START_ESTIMATE_SHARE,
                   engine_points: Optional[Mapping] = None, first: Optional[float] = None,
                   whole_failed: bool = False, defer: bool = False) -> dict:
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
    again to its end here (the figures a shown candidate gives, :func:`whole_cell`'s).
    ``defer``: a capacity its confirming seeds would run at is returned unconfirmed
    (``status: unconfirmed``, :func:`_unconfirmed`), for the driver to confirm
    (:func:`confirm_cell`) or bound it out as a tie."""
    seed_runners(engine_points)
    try:
        session = _candidate_session(base, cand, workload, slo, disabled, runner_for)
        out = _capacity(session, cand, workload, slo, settings, start_rate, settle_s, roles, kth, estimate,
                        start_share, first, whole_failed, defer)
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
              whole_failed=False, defer=False) -> dict:
    floor = settings.rate if settings.objective == "min_chips" else None
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

    run = _Runs(session, workload, settle_s, settings)
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
        if defer:
            return _unconfirmed(session, cand, slo, settings, run, found, sat, mu, bound, top_out)
        found = confirm(found, run, seeds, settings.tolerance, bar, run.snap)
    return _result(session, cand, workload, slo, settings, settle_s, run, found, sat, mu, bound, kth, passing, tie,
                   whole_failed, top_out)


def _unconfirmed(session, cand, slo, settings, run: _Runs, found, sat, mu, bound, top_out) -> dict:
    """A capacity found on the workload's seed, before its confirming seeds (``defer``): its
    runs, the figures of its runs at the capacity and at the failing rate (``held``,
    ``failed``: :class:`_Shipped`'s fields), and ``tie_upper``, the most its value can be
    once confirmed (:func:`tie_bound`; None without a failing rate)."""
    held = _figures(found["held"], session, slo, cand, found["capacity"], run.place(found["held"]))
    failed = _figures(found["failed"], session, slo, cand, found["capacity"], run.place(found["failed"]), held=False)
    tie = None if found["failed_rate"] is None else tie_bound(
        settings.objective, cand, found["capacity"], held["summary"], found["failed_rate"], settings.tolerance, top_out)
    return {"status": "unconfirmed", "label": cand.label(), "capacity_requests_per_s": found["capacity"],
            "failed_rate_per_s": found["failed_rate"], "ceiling": found["ceiling"], "runs": run.n,
            "trace": run.trace, "held": held, "failed": failed, "tie_upper": tie, "saturated": sat,
            "saturated_requests_per_s": mu, "capacity_bound": bound}


def confirm_cell(base: Mapping, cand: Candidate, workload: Mapping, slo: str, settings: SearchSettings,
                 settle_s: float, disabled, runner_for, first: Mapping, kth: Optional[float],
                 passing: Optional[float], whole_failed: bool = False,
                 engine_points: Optional[Mapping] = None) -> dict:
    """The confirming seeds of a capacity :func:`candidate_cell` found unconfirmed (``first``,
    its ``status: unconfirmed`` result): :func:`~g5core.study.serving.bisect.confirm` from
    it, against the bar of ``passing`` (the driver's :func:`bar_value`, with ``kth`` the
    top-th value; None: no bar), and the candidate's result as the one cell would have given
    it. ``whole_failed``, ``engine_points``: as :func:`candidate_cell`'s."""
    seed_runners(engine_points)
    try:
        session = _candidate_session(base, cand, workload, slo, disabled, runner_for)
        run = _Runs(session, workload, settle_s, settings, first["trace"])
        found = {"capacity": first["capacity_requests_per_s"], "failed_rate": first["failed_rate_per_s"],
                 "ceiling": first["ceiling"], "below_bar": False,
                 "held": _Shipped(**first["held"]), "failed": _Shipped(**first["failed"])}
        top_out = _longest_output(workload)
        bar = None if passing is None else _bar_rate(settings.objective, passing, cand, top_out)
        seeds = [workload["seed"] + k for k in range(1, settings.confirm + 1)]
        found = confirm(found, run, seeds, settings.tolerance, bar, run.snap)
        run.n += first["runs"]
        out = _result(session, cand, workload, slo, settings, settle_s, run, found, first["saturated"],
                      first["saturated_requests_per_s"], first["capacity_bound"], kth, passing, None, whole_failed,
                      top_out)
    except (ConfigError, PluginError) as exc:
        return refusal(exc)
    return {**out, "engine_points": points_held(session)}


def tie_result(first: Mapping, kth: float, passing: float) -> dict:
    """An unconfirmed capacity (``first``, :func:`_unconfirmed`'s) whose ``tie_upper`` is at
    most ``passing``: bounded out as a tie, as :func:`candidate_cell` bounds one with that bar."""
    return {"status": "bounded", "label": first["label"], "saturated": first["saturated"],
            "capacity_bound": first["failed_rate_per_s"], "upper": first["tie_upper"], "kth": kth,
            "runs": first["runs"], "failed_rate_per_s": first["failed_rate_per_s"], "source": "simulated",
            "missed": first["failed"]["missed"], "decode_failed": first["failed"]["decode"],
            "peak_running_seqs": trace_peak(first["trace"]), "trace": first["trace"], "tie_bar": passing,
            "tie_run": first["held"]["place"], "decode_held": first["held"]["decode_held"]}


def _result(session, cand, workload, slo, settings, settle_s, run: _Runs, found, sat, mu, bound, kth, passing, tie,
            whole_failed, top_out) -> dict:
    """A capacity cell's result from its search (``found``, confirmed)."""
    trace = run.trace
    held = _figures(found["held"], session, slo, cand, found["capacity"], run.place(found["held"]))
    failed = _figures(found["failed"], session, slo, cand, found["capacity"], run.place(found["failed"]), held=False)
    if found["below_bar"]:
        rate = found["failed_rate"]
        out = {"status": "bounded", "label": cand.label(), "saturated": sat, "capacity_bound": rate,
               "upper": _upper_value(settings.objective, rate, cand, top_out) if tie is None else tie, "kth": kth,
               "runs": run.n, "failed_rate_per_s": rate, "source": "simulated",
               "missed": failed["missed"], "decode_failed": failed["decode"],
               "peak_running_seqs": trace_peak(trace), "trace": trace}
        if tie is not None:     # what a max_num_seqs variant taking these runs checks again (the driver)
            out.update(tie_bar=passing, tie_run=held["place"], decode_held=held["decode_held"])
        return out
    failed_at = failed["place"] if found["failed"] is not None else None
    made_whole = whole_failed and failed["stopped"] is not None and failed_at is not None
    shown = failed      # the failing run's figures shown: made whole, or as it stopped
    if made_whole:
        run.n += 1
        shown = _figures(_whole(session, workload, *trace[failed_at][:2], settle_s, settings), session, slo, cand,
                         found["capacity"], failed_at, held=False)
    # a failing run stopped at its sure miss has no figures: the driver makes the shown
    # candidates' again to their end (whole_cell); the others keep the limit it missed
    return {"status": "ok", "label": cand.label(), "disaggregated": cand.disaggregated, "chips": cand.chips,
            "failed_stopped": shown["stopped"],
            "capacity_requests_per_s": found["capacity"], "ceiling": found["ceiling"],
            "runs": run.n, "failed_rate_per_s": found["failed_rate"], "peak_running_seqs": trace_peak(trace),
            "trace": trace, "held_run": held["place"] if found["held"] is not None else None,
            "failed_run": failed_at, "missed": failed["missed"],
            "decode_held": held["decode_held"], "decode_failed": failed["decode"],
            "build_s": session.build_s, "saturated_requests_per_s": mu, "capacity_bound": bound, "saturated": sat,
            "held": held["summary"] if found["held"] is not None else None,
            "failed": shown["summary"] if found["failed"] is not None else None,
            **({"failed_made_whole": True} if made_whole else {})}


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


def variant_cell(base: Mapping, cand: Candidate, workload: Mapping, slo: str, settings: SearchSettings,
                 settle_s: float, disabled, runner_for, runs: Sequence, engine_points: Optional[Mapping] = None) -> dict:
    """A max_num_seqs variant's check (:meth:`~g5core.study.serving.variants.Variants.runs_of`):
    ``runs`` (``[rate, seed]`` each, the runs of a simulated variant whose batches reached
    either's limit) made on ``cand``: ``{"runs": [[held, peak, summary], ...]}``. Where every run holds or
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
