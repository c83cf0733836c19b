"""The max_num_seqs variants of one deployment (the same pools and chunk size) in the serving
search's waves: a later variant makes again only the simulated one's runs that reached the
lower limit (the others are its runs, bit for bit) and takes that capacity search as its own
where each holds or fails alike (:class:`Variants`)."""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import attrs

from g5core.study.serving.bound import tie_bound
from g5core.study.serving.runs import trace_peak
from g5core.study.serving.space import Candidate, SearchSettings


def variant_key(cand: Candidate) -> tuple:
    """What a candidate's max_num_seqs variants share: its pools, its chunk size, its
    speculative: block, its host KV tier and cp prefill choice."""
    return cand.pools, cand.chunk, cand.speculative, cand.host_tier_bytes_per_chip, cand.cp_prefill


class Variants:
    """The variants simulated so far and the candidates that took one's capacity search.
    ``results``, ``bounded``, ``bounded_cell`` and ``bounded_at`` are the driver's (a
    candidate's result, the bounded-out list, the cell that bounded a candidate out and its
    place in that list), updated in place; ``reporter`` the capacity phase's progress."""

    def __init__(self, cands: Sequence, results: list, bounded: list, bounded_cell: dict, bounded_at: dict,
                 estimates: Sequence, settings: SearchSettings, top_out: int, reporter=None):
        self.cands, self.results, self.bounded = cands, results, bounded
        self.bounded_cell, self.bounded_at, self.estimates = bounded_cell, bounded_at, estimates
        self.settings, self.top_out, self.reporter = settings, top_out, reporter
        self.simulated: dict = {}   # variant_key -> the candidates simulated with it, in order
        self.same_runs: dict = {}   # candidate index -> the index whose capacity search it took
        self.differs: set = set()   # (i, j): a run of j's made on i held or failed otherwise
        self.wasted = 0             # runs of checks whose variant was then simulated

    def simulated_one(self, i: int) -> None:
        """Candidate ``i`` was simulated (its variants may take its runs)."""
        self.simulated.setdefault(variant_key(self.cands[i][0]), []).append(i)

    def cell_of(self, j: int):
        """A simulated candidate's cell: its result, or the cell that bounded it out."""
        return self.results[j] if self.results[j] is not None else self.bounded_cell.get(j)

    def runs_of(self, i: int):
        """``(j, the runs of j to make again on i)`` for the first simulated max_num_seqs
        variant ``j`` of candidate ``i`` with a trace of its runs (the runs in which a
        scheduler held as many sequences as the lower of the two limits: only there can
        the limit have stopped an admission), or None."""
        cands = self.cands
        m = cands[i][0].max_num_seqs
        for j in self.simulated.get(variant_key(cands[i][0]), ()):
            res = self.cell_of(j)
            if (i, j) in self.differs or res is None or res.get("trace") is None:
                continue
            lim = min(m, cands[j][0].max_num_seqs)
            places = [k for k, (_, _, _, peak) in enumerate(res["trace"]) if peak is None or peak >= lim]
            # making most of j's runs again costs a capacity search of its own, and more
            # when one of them then holds or fails otherwise: such a variant is simulated
            if 2 * len(places) > len(res["trace"]):
                continue
            return j, places
        return None

    def tie_upper(self, i: int, j: int, again: Mapping):
        """Where ``j`` was bounded out as a tie with the top (before its confirming seeds)
        and its run at the capacity was made again on ``i`` (``again``): ``i``'s bound from
        that run (its figures may differ though it holds alike), else None."""
        src = self.cell_of(j)
        place = src.get("tie_run")
        if src.get("tie_bar") is None or place not in again:
            return None
        s = self.settings
        return tie_bound(s.objective, self.cands[i][0], src["trace"][place][0], again[place][2],
                         src["failed_rate_per_s"], s.tolerance, self.top_out)

    def adopt(self, i: int, j: int, again: Mapping) -> None:
        """Candidate ``i`` takes ``j``'s capacity search: every run of it holds or fails on
        ``i`` as on ``j`` (the runs in ``again``, ``{place: [held, peak, summary]}``, were
        made on ``i``; the others are ``i``'s bit for bit); a tie's bound is ``i``'s own
        (:meth:`tie_upper`)."""
        cands, results = self.cands, self.results
        src = self.cell_of(j)
        trace = [list(t) for t in src["trace"]]
        for k, (_, peak, _) in again.items():
            trace[k][3] = peak
        peak = trace_peak(trace)
        self.same_runs[i] = j
        self.simulated_one(i)
        if results[j] is not None:
            res = {**src, "label": cands[i][0].label(), "runs": len(again), "same_runs_as": cands[j][0].label(),
                   "trace": trace, "peak_running_seqs": peak}
            if res.pop("failed_made_whole", False):   # j's whole run ran past what its trace says of i
                res["failed"] = None
            for place, field in ((src.get("held_run"), "held"), (src.get("failed_run"), "failed")):
                if place in again:
                    res[field] = again[place][2]
            results[i] = res
        else:
            upper = self.tie_upper(i, j, again)
            own = {} if upper is None else {"upper": upper}
            self.bounded_cell[i] = {**src, "trace": trace, "peak_running_seqs": peak, **own}
            self.bounded_at[i] = len(self.bounded)
            self.bounded.append(attrs.evolve(self.bounded[self.bounded_at[j]], candidate=cands[i][0],
                                             estimate=self.estimates[i], runs=len(again), source="same runs", **own))
        if self.reporter is not None:
            self.reporter.skip(1, "same runs")

    def check(self, checks: Sequence[tuple], made_on: Callable[[list], list]) -> list:
        """Make each ``(i, j, places)`` check's runs on ``i`` (``made_on``: ``[(i, runs), ...]
        ->`` the variant cells' results, ``runs`` the ``[rate, seed]`` of each); adopt ``j``'s
        search where every run holds or fails as on ``j``. Returns the candidates that must
        be simulated."""
        asked = [(i, [self.cell_of(j)["trace"][k][:2] for k in places]) for i, j, places in checks]
        again = []
        for (i, j, places), res in zip(checks, made_on(asked)):
            src = self.cell_of(j)
            made = dict(zip(places, res.get("runs") or ()))
            upper = self.tie_upper(i, j, made) if res["status"] == "ok" else None
            if res["status"] == "ok" and all(src["trace"][k][2] == held
                                             for k, (held, _, _) in zip(places, res["runs"])) and (
                    upper is None or upper <= src["tie_bar"]):   # a tie's bar still holds on i
                self.adopt(i, j, made)
            else:
                self.differs.add((i, j))
                again.append(i)
                self.wasted += len(res.get("runs") or ())   # made, then not used: still counted
        return again
