"""The capacity's search over the rate (in the workers): galloping and bisection to a bracket
within the tolerance, the bar that ends it, and the confirming seeds at the capacity found."""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

from g5core.study.serving.estimate import narrow


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
