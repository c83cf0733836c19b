"""A capacity search's serving runs (in the workers): each run made once on a candidate's
session and listed in its trace (:class:`_Runs`), and what the search's result says of a
run (:func:`_figures`), shipped from one cell to another (:class:`_Shipped`)."""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import attrs
import numpy as np

from g5core.api.errors import G5Error
from g5core.serve.session import MissedRun, schedulers_peak
from g5core.study.serving.bisect import _holds, _snap
from g5core.study.serving.decode import decode_figures, decode_held, missed_limits
from g5core.study.serving.screen import _hbm
from g5core.study.serving.space import Candidate, SearchSettings, _at_rate, run_requests


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


class _Runs:
    """A capacity search's serving runs on one session (``run(rate, seed)``): each made once,
    and listed in ``trace`` (``[rate, seed, held, the most sequences a scheduler held]``).
    ``trace``: the runs an earlier cell made for this candidate
    (:func:`~g5core.study.serving.capacity.confirm_cell`): one of them asked again is made
    again (the same run bit for bit) and keeps its place."""

    def __init__(self, session, workload: Mapping, settle_s: float, settings: SearchSettings, trace=()):
        self.session, self.workload, self.settle_s, self.settings = session, workload, settle_s, settings
        self.trace = [list(row) for row in trace]
        self.earlier = {(row[0], row[1]): k for k, row in enumerate(self.trace)}
        self.made: dict = {}      # (rate, seed) -> the run's result: a rate tried again is not run again
        self.at: dict = {}        # id(a run's result) -> its place in ``trace``
        self.n = 0

    def __call__(self, rate, seed=None):
        seed = self.workload["seed"] if seed is None else seed
        if (rate, seed) in self.made:
            return self.made[(rate, seed)]
        self.n += 1
        res = self.made[(rate, seed)] = _seeded_run(self.session, self.workload, rate, seed, self.settle_s,
                                                    self.settings)
        place = self.earlier.get((rate, seed))
        if place is None:
            place = len(self.trace)
            self.trace.append([rate, seed, _holds(res), _peak_running(res)])
        self.at[id(res)] = place
        return res

    def snap(self, rate: float) -> float:
        """A rate tried before (here or in the earlier cell) within 1e-9 of ``rate``, else it."""
        return _snap(rate, {**self.earlier, **self.made})

    def place(self, result) -> Optional[int]:
        """A run's place in ``trace`` (an earlier cell's run shipped as :class:`_Shipped`: its own)."""
        return result.place if isinstance(result, _Shipped) else self.at.get(id(result))


@attrs.frozen
class _Shipped:
    """A run an earlier cell made, by the figures the result needs of it (:func:`_figures`):
    the candidate's run at its capacity or its failing run, shipped to
    :func:`~g5core.study.serving.capacity.confirm_cell`."""
    place: Optional[int]
    summary: Optional[dict]        # _run_summary; None for a run stopped at its sure miss
    missed: list
    decode: list                   # decode_figures
    stopped: Optional[dict]        # a run stopped at its sure miss: the limit, completed, requests
    decode_held: Optional[list] = None


def _figures(result, session, slo: str, cand: Candidate, capacity: float, place: Optional[int],
             held: bool = True) -> dict:
    """What a capacity search's result says of one of its runs (``None``: no run), shipped or
    made; ``held``: the run at the capacity (its decode_held)."""
    if result is None:
        return attrs.asdict(_Shipped(place, None, [], [None, None], None))
    if isinstance(result, _Shipped):
        return attrs.asdict(result)
    stopped = ({"limit": result.limit, "completed": result.completed, "requests": result.requests}
               if isinstance(result, MissedRun) else None)
    return attrs.asdict(_Shipped(place, None if stopped else _run_summary(result, session), missed_limits(result),
                                 decode_figures(result), stopped,
                                 decode_held({"held": result, "capacity": capacity}, slo, cand) if held else None))


def _seeded_run(session, workload: Mapping, rate: float, seed: int, settle_s: float, settings: SearchSettings,
                stop_at_miss: bool = True):
    """One capacity run: the workload at ``rate`` on ``seed``, with the search's request count.
    ``stop_at_miss``: a run whose SLO verdict is sure to be missed stops there (a
    :class:`~g5core.serve.session.MissedRun`: the search needs only its verdict)."""
    n = run_requests(workload, rate, settle_s, settings.settle)
    return session.run(_at_rate({**workload, "requests": n, "seed": seed}, rate), stop_at_miss=stop_at_miss,
                       itl_stats=False)


def _whole(session, workload: Mapping, rate: float, seed: int, settle_s: float, settings: SearchSettings):
    """A failing run stopped at its sure SLO miss, made again to its end."""
    whole = _seeded_run(session, workload, rate, seed, settle_s, settings, stop_at_miss=False)
    if _holds(whole):
        raise G5Error(f"a serving run at {rate:g} requests/s stopped at a sure SLO miss holds the SLO when run "
                      "to its end (a G5 bug)")
    return whole


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
