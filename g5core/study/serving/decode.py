"""What a disaggregated candidate's decode pool tells of its other prefill partners: a run
that missed a TPOT (or ITL) limit bounds every candidate with the same decode pool
(:class:`DecodeSides`), and the figures of a run it reads (:func:`decode_held`,
:func:`decode_figures`, :func:`missed_limits`)."""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np

from g5core.inputs.serving import parse_slo
from g5core.serve.metrics import goodput, per_request
from g5core.serve.session import MissedRun, schedulers_peak
from g5core.study.serving.bound import _upper_value, confirmed_upper
from g5core.study.serving.result import SAME_VALUE, Bounded
from g5core.study.serving.space import Candidate, SearchSettings


class DecodeSides:
    """The runs of each decode pool (:func:`decode_side`) that missed a decode limit, learnt
    from the candidates' cells in the driver's wave order (:meth:`learn`), and the bound
    they give another candidate with that decode pool (:meth:`upper`)."""

    def __init__(self, cands: Sequence, limits, settings: SearchSettings, top_out: int):
        self.cands, self.settings, self.top_out = cands, settings, top_out
        self.keys = {lim.key for lim in limits if lim.metric in ("tpot", "itl")}
        self.fails: dict = {}   # decode side -> [(failing rate, candidate index, preemptions, decode peak)]
        self.holds: dict = {}   # decode side -> [(capacity, share within TPOT, mean output, index, preemptions, peak)]

    def __bool__(self) -> bool:
        return bool(self.fails)

    def learn(self, i: int, res: Mapping) -> None:
        """Keep candidate ``i``'s failing rate for its decode side when its failing run
        missed a decode limit (TPOT, ITL), and, where that rate is one tolerance step above
        its capacity, its run there (:func:`decode_held`)."""
        rate = res.get("failed_rate_per_s")
        cand = self.cands[i][0]
        if not (cand.disaggregated and rate and self.keys.intersection(res.get("missed") or ())):
            return
        side = decode_side(cand)
        failed = res.get("decode_failed") or [None, None]
        self.fails.setdefault(side, []).append((rate, i, *failed))
        held = res.get("decode_held")
        if held and rate <= held[0] * (1 + self.settings.tolerance) * (1 + SAME_VALUE):
            c, share, mean_out, preempted, peak = held
            both = (None if None in (preempted, failed[0]) else preempted + failed[0],
                    None if None in (peak, failed[1]) else max(peak, failed[1]))
            self.holds.setdefault(side, []).append((c, share, mean_out, i, *both))

    def upper(self, cand: Candidate) -> Optional[tuple]:
        """``(value, capacity at most, index)``: the least bound of a disaggregated
        candidate's value its decode side's runs with other prefill pools give (None:
        none). Its capacity search may take their bracket: from a failing rate ``r``, ``r /
        (1 + tolerance)`` (its capacity at most that, whatever it holds); from a bracket
        ``[c, r]`` run with another prefill pool, ``c`` with at most the share of requests
        that held the TPOT there (its confirming seeds, or a miss at ``c``, step down by
        the tolerance: :func:`~g5core.study.serving.bound.confirmed_upper`)."""
        side = decode_side(cand)
        s, best = self.settings, None
        for rate, j, preempted, peak in self.fails.get(side, ()):
            if runs_alike(self.cands[j][0], cand, preempted, peak):
                low = rate / (1 + s.tolerance)
                value = _upper_value(s.objective, low, cand, self.top_out)
                if best is None or value < best[0]:
                    best = (value, low, j)
        for c, share, mean_out, j, preempted, peak in self.holds.get(side, ()):
            if runs_alike(self.cands[j][0], cand, preempted, peak):
                held = {"goodput_share": share, "mean_output_tokens": mean_out}
                value = confirmed_upper(s.objective, cand, c, held, s.tolerance, self.top_out)
                if best is None or value < best[0]:
                    best = (value, c, j)
        return best

    def bounded_out(self, remaining: Sequence[int], passing: float, kth: float, roles_bound: Sequence[Mapping],
                    estimates: Sequence) -> tuple[list, list]:
        """``(kept, bounded)``: ``remaining`` (candidate indices) less the disaggregated
        candidates whose decode side missed its TPOT at a rate ``r`` where their value could
        at most tie the bar's (``passing``, :func:`~g5core.study.serving.bound.bar_value`),
        and those as :class:`~g5core.study.serving.result.Bounded` (source ``decode pool``,
        ``kth`` the ``top``-th value). Such a candidate's capacity search may start from the
        bracket ``[r / (1 + tolerance), r]`` (the search's resolution): its capacity is at
        most its lower end whether that holds or not."""
        kept, out = [], []
        for i in remaining:
            cand = self.cands[i][0]
            hit = self.upper(cand) if cand.disaggregated else None
            if hit is None or hit[0] > passing:
                kept.append(i)
                continue
            out.append(Bounded(cand, roles_bound[i]["saturated_requests_per_s"], hit[1], hit[0], kth, "decode pool",
                               estimates[i], place=self.settings.top, via=self.cands[hit[2]][0].label()))
        return kept, out


def decode_side(cand: Candidate) -> tuple:
    """What a disaggregated candidate's TPOT depends on: its decode pool, speculative: block
    and host KV tier, and (:func:`runs_alike`) its scheduler limits. Its prefill pool
    reaches the decode pool only through when each prompt's KV arrives (each request's
    first token plus its transfer), the same arrivals shifted by at most the TTFT limit on a
    run of the same rate and seed: a decode pool missing a TPOT limit at a rate with one
    prefill pool is taken to miss it with any. A heuristic, not a proof (the arrivals'
    spacing differs a little); the ranking's top is still simulated, and the search's
    exhaustive small case checks that it finds the same top."""
    return cand.pools[1:], cand.speculative, cand.host_tier_bytes_per_chip


def runs_alike(ran: Candidate, cand: Candidate, preemptions: Optional[int], peak: Optional[int]) -> bool:
    """Whether the decode pool of ``ran``'s runs (their preemptions and the most sequences
    a decode scheduler held) ran as ``cand``'s would (the same :func:`decode_side`): the
    same max_num_seqs and chunk size, or runs that never preempted (a decode pool then never
    prefills: the chunk size is never met) and whose decode peak stayed below both
    max_num_seqs and chunk sizes (no limit stopped an admission)."""
    if (ran.max_num_seqs, ran.chunk) == (cand.max_num_seqs, cand.chunk):
        return True
    return (preemptions == 0 and peak is not None
            and peak < min(ran.max_num_seqs, cand.max_num_seqs, ran.chunk, cand.chunk))


def decode_held(found: Mapping, slo: str, cand: Candidate) -> Optional[list]:
    """``[capacity, share, mean output tokens, preemptions, decode peak]`` of a
    disaggregated candidate's run at its capacity on the workload's seed: the share of its
    requests within every TPOT and ITL limit (what its decode pool decides:
    :meth:`DecodeSides.upper`) and :func:`decode_figures`. None for an aggregated candidate, without
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
    return [result.summary["preemptions"], schedulers_peak(i for i in result.loop.instances if i.pool is last)]


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
