"""The serving search's result: the simulated candidates ranked (:class:`Scored`), the bounded
out (:class:`Bounded`), the pruned layouts by family, the Pareto front and the "why"."""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import attrs

from g5core.inputs.serving import parse_slo
from g5core.inputs.speculative import Speculative
from g5core.study.serving.space import Candidate, Pruned, SearchSettings, candidate_config, thaw_block


def scored_results(cands: Sequence, results: Sequence, pruned: list, base: Mapping, workload: Mapping,
                   settings: SearchSettings) -> list:
    """The simulated candidates (``results``, each candidate's cell or None) ranked by the
    objective, each with its ``g5 serve`` configuration at its capacity; one a plugin refused
    joins ``pruned``."""
    scored = []
    for (cand, _), res in zip(cands, results):
        if res is None:
            continue
        if res["status"] != "ok":
            pruned.append(Pruned(dict(cand.pools[0].parallel), cand.pools[0].chips, cand.chunk, res["family"],
                                 res["reason"], cand.speculative))
            continue
        rate = res["capacity_requests_per_s"] or None
        # the workload its capacity was measured with: the run's requests and seed (g5 serve on
        # this configuration reproduces the capacity run on the workload's seed)
        measured = {**workload, "requests": (res.get("held") or {}).get("requests", workload["requests"])}
        scored.append(Scored(cand, candidate_config(base, cand, measured, settings.slo, rate), res))
    scored.sort(key=lambda s: s.rank_key(settings.objective))
    return scored


@attrs.frozen
class Scored:
    candidate: Candidate
    config: dict            # g5 serve's configuration at the capacity
    cell: dict              # candidate_cell's result

    @property
    def capacity(self) -> float:
        return self.cell["capacity_requests_per_s"]

    def rates(self) -> tuple[float, float]:
        """``(goodput, output tokens/s)`` per chip at the capacity: the capacity times the
        share of requests meeting the SLO (and times the mean output tokens), over the chips
        (the arrival rate, not a finite run's tokens over its span, which counts the drain)."""
        held = self.cell["held"] or {}
        chips = self.candidate.chips
        share = held.get("goodput_share", 0.0)
        return self.capacity * share / chips, self.capacity * held.get("mean_output_tokens", 0.0) / chips

    def value(self, objective: str) -> tuple:
        chips = self.candidate.chips
        goodput, tokens = self.rates()
        if objective == "min_chips":
            return (0 if self.capacity > 0 else 1, chips, -goodput)
        if objective == "throughput_per_chip":
            return (-tokens, -goodput, chips)
        return (-goodput, -tokens, chips)

    def rank_key(self, objective: str) -> tuple:
        """The search's ranking order: :meth:`value`, then the label (best first)."""
        return self.value(objective), self.candidate.label()

    def to_json_dict(self) -> dict:
        held = self.cell["held"] or {}
        chips = self.candidate.chips
        goodput, tokens = self.rates()
        return {"config": self.config, "capacity_requests_per_s": self.capacity,
                "goodput_per_chip": goodput, "output_tokens_per_s_per_chip": tokens,
                "output_tokens_per_s_per_user": _per_user(held), "chips": chips,
                "ttft_s": _pcts(held.get("ttft_s")), "tpot_s": _pcts(held.get("tpot_s")),
                "disaggregated": self.candidate.disaggregated,
                "speculative": speculative_summary(self.candidate.speculative),
                "host_tier_bytes_per_chip": self.candidate.host_tier_bytes_per_chip,
                "cp_prefill": self.candidate.cp_prefill,
                "max_total_bytes": held.get("max_total_bytes", 0.0),
                "kv_pool_bytes_per_chip": min((p["kv_pool_bytes_per_chip"] for p in held.get("pools", [])),
                                              default=0.0),
                "rate_ceiling": self.cell["ceiling"], "limited_by": limiter(self)}


def speculative_summary(frozen: tuple) -> Optional[dict]:
    """A candidate's speculation for ``--json``: method, draft tokens, per-position acceptance
    and where it came from, expected tokens per verification step; None for plain decode."""
    block = thaw_block(frozen)
    if block is None:
        return None
    spec = Speculative.from_dict(block)
    return {"method": spec.method, "tokens": spec.tokens, "acceptance": list(spec.acceptance),
            "acceptance_source": spec.source, "tokens_per_step": spec.tokens_per_step}


def _at_limits(s: Scored, slo: str) -> str:
    """``TTFT p99 1.2 s and TPOT p99 31 ms``: the held run's figures at the limits the SLO
    names (each at its own percentile)."""
    checks = (s.cell.get("held") or {}).get("percentile_limits") or {}
    parts = [f"{lim.metric.upper()} p{lim.percentile:g} " + (f"{checks[lim.key]['value_s'] * 1e3:.3g} ms"
                                                           if lim.metric in ("tpot", "itl") else
                                                           f"{checks[lim.key]['value_s']:.3g} s")
             for lim in parse_slo(slo) if lim.key in checks]
    return " and ".join(parts) or "every request within the SLO's limits"


def _pcts(stats: Optional[Mapping]) -> dict:
    stats = stats or {}
    return {k: stats.get(k) for k in ("p50", "p90", "p99")}


def _per_user(held: Mapping) -> float:
    tpot = (held.get("tpot_s") or {}).get("p50")
    return 1.0 / tpot if tpot else 0.0


def limiter(s: Scored) -> str:
    """What stopped the candidate from serving more: the limit its first failing rate broke,
    and the resource behind it (KV pool, max_num_seqs, the KV transfer, the steps)."""
    if s.cell["ceiling"]:
        return "the rate ceiling (--max-rate): the SLO still held there"
    failed = s.cell["failed"]
    if failed is None:
        stopped, rate = s.cell.get("failed_stopped"), s.cell.get("failed_rate_per_s")
        if stopped and rate:    # a candidate not shown: its failing run stopped at its sure miss
            return (f"{stopped['limit'] or 'the SLO'} sure to be missed at {rate:.3g} req/s (its run stopped there "
                    f"after {stopped['completed']:,} of {stopped['requests']:,} requests)")
        return "nothing measured"
    broke = [k for k, v in (failed.get("percentile_limits") or {}).items() if not v["met"]] or ["completion"]
    what = ", ".join(f"{k} ({failed['percentile_limits'][k]['value_s']:.3g} s > "
                     f"{failed['percentile_limits'][k]['limit_s']:.3g} s)" if k in (failed.get("percentile_limits") or {})
                     else k for k in broke)
    use = (failed.get("kv_pool_use") or {}).get("max", 0.0)
    running = (failed.get("running_seqs") or {}).get("max", 0.0)
    if failed.get("preemptions") or use >= 0.95:
        cause = f"the KV pool (peak use {use:.0%}, {failed.get('preemptions', 0)} preemptions)"
    elif running >= s.candidate.max_num_seqs:
        cause = f"max_num_seqs={s.candidate.max_num_seqs} (queue builds while the batch is full)"
    elif s.candidate.disaggregated and (failed.get("kv_transfer_s") or {}).get("p90") and \
            failed["kv_transfer_s"]["p90"] > 0.3 * (failed["ttft_s"]["p90"] or math.inf):
        cause = f"the KV transfer link (p90 {failed['kv_transfer_s']['p90']:.3g} s of TTFT)"
    else:
        cause = "the step time (compute and communication of the batched steps)"
    rate = s.cell.get("failed_rate_per_s")
    at = f" at {rate:.3g} req/s" if rate else ""
    return f"{what}{at}; bottleneck: {cause}"


#: two objective values within this relative difference are the same value (rounding)
SAME_VALUE = 1e-9


@attrs.frozen
class ServeSearchResult:
    objective: str
    settings: SearchSettings
    layouts: int                      # layout x chunk cells screened
    pruned: tuple[Pruned, ...]
    ranked: tuple[Scored, ...]        # best first
    candidates: int                   # simulated (a capacity search each)
    skipped_by_beam: int
    runs: int                         # serving runs over all candidates
    db_path: Optional[str]
    bounded: tuple = ()               # Bounded: not simulated (branch and bound)
    estimates: Mapping = attrs.field(factory=dict)   # candidate label -> estimated capacity (req/s)
    same_runs: int = 0                # candidates that took a max_num_seqs variant's runs (not simulated again)

    def families(self) -> list[tuple[str, list[Pruned]]]:
        return _group(self.pruned)

    def pareto(self) -> list[Scored]:
        """Candidates with a capacity that no other beats on both output tokens/s per chip
        and per user (at capacity), by increasing per-user speed."""
        pts = sorted(((_per_user(s.cell["held"]), s.rates()[1], s) for s in self.ranked if s.capacity > 0),
                     key=lambda p: (-p[0], -p[1], p[2].candidate.label()))
        front, best = [], -1.0
        for user, chip, s in pts:
            if chip > best:
                front.append(s)
                best = chip
        return front[::-1]

    def sides(self) -> dict:
        """The best aggregated and the best disaggregated answer, whichever wins, and their
        ratio: ``{"aggregated": ..., "disaggregated": ..., "disaggregated_over_aggregated":
        r}``. A side is its best simulated candidate's figures (``simulated: true``; ``exact``
        false when ``bounded_above`` candidates of the side, bounded out by the overall
        ranking's bar, have bounds above it, up to ``at_most_value``, at most the winner's
        value), or,
        when none of its candidates was simulated, its best bound, labelled so
        (``simulated: false``, ``at_most_*``); ``None`` when the search had no candidate of
        that kind (``--disagg off|on``). The ratio is of the objective's per-chip value (the
        goodput or the output tokens), ``None`` unless both sides were simulated."""
        key = "output_tokens_per_s_per_chip" if self.objective == "throughput_per_chip" else "goodput_per_chip"
        out: dict = {}
        # the winner's value (rates(): goodput, output tokens, per chip)
        best = (self.ranked[0].rates()[key == "output_tokens_per_s_per_chip"]
                if self.ranked and self.ranked[0].capacity > 0 else math.inf)
        for name, flag in (("aggregated", False), ("disaggregated", True)):
            mine = [s for s in self.ranked if s.candidate.disaggregated == flag and s.capacity > 0]
            if mine:
                j = mine[0].to_json_dict()
                # candidates of this side bounded out by the overall ranking's bar may still pass
                # the side's best simulated one: then that best is exact only up to their bound,
                # which is at most the winner's value (what is bounded out cannot pass the
                # winner beyond the search's resolution: a failing run at the bar, a tie, an
                # estimate below the top-th), so the winner's side is exact
                above = [min(b.upper, best) for b in self.bounded if b.candidate.disaggregated == flag]
                above = [u for u in above if u > j[key] * (1 + SAME_VALUE)]
                out[name] = {"simulated": True, "deployment": mine[0].candidate.label(),
                             "capacity_requests_per_s": j["capacity_requests_per_s"],
                             "goodput_per_chip": j["goodput_per_chip"],
                             "output_tokens_per_s_per_chip": j["output_tokens_per_s_per_chip"], "value": j[key],
                             "exact": not above, "bounded_above": len(above),
                             "at_most_value": max(above) if above else j[key]}
                continue
            out_of = [b for b in self.bounded if b.candidate.disaggregated == flag]
            if out_of:
                b = max(out_of, key=lambda b: (b.upper, b.candidate.label()))
                out[name] = {"simulated": False, "deployment": b.candidate.label(),
                             "at_most_capacity_requests_per_s": b.capacity_bound, "at_most_value": b.upper,
                             "reason": b.reason()}
            else:
                out[name] = None
        a, d = out["aggregated"], out["disaggregated"]
        out["disaggregated_over_aggregated"] = (d["value"] / a["value"] if a and d and a["simulated"]
                                                and d["simulated"] and a["value"] else None)
        out["value"] = key
        return out

    def to_json_dict(self, top: int) -> dict:
        """``g5 best --serve --json``: the ranking (``top`` rows), both answers side by side
        (:meth:`sides`), and the search's counts."""
        return {"ranked": [s.to_json_dict() for s in self.ranked[:top]], "sides": self.sides(),
                "counts": {"layout_chunk_cells": self.layouts, "pruned": len(self.pruned),
                           "simulated": self.candidates, "same_runs": self.same_runs,
                           "bounded_out": len(self.bounded),
                           "estimated": sum(1 for e in self.estimates.values() if e is not None),
                           "serving_runs": self.runs, "skipped_by_beam": self.skipped_by_beam}}

    def why(self) -> str:
        if not self.ranked or self.ranked[0].capacity <= 0:
            return "No candidate meets the SLO at any rate tried."
        w = self.ranked[0]
        wj = w.to_json_dict()
        text = (f"The winner, {w.candidate.label()}, serves {w.capacity:.3g} req/s "
                f"({wj['output_tokens_per_s_per_chip']:.4g} output tokens/s per chip, "
                f"{wj['goodput_per_chip']:.3g} req/s per chip of goodput) with {_at_limits(w, self.settings.slo)}; "
                f"past it, {limiter(w)}.")
        # the runner-up: the best other deployment (not the winner with other scheduler limits)
        other = [s for s in self.ranked[1:]
                 if (s.candidate.pools, s.candidate.speculative, s.candidate.host_tier_bytes_per_chip)
                 != (w.candidate.pools, w.candidate.speculative, w.candidate.host_tier_bytes_per_chip)]
        if other:
            r = other[0]
            rj = r.to_json_dict()
            text += (f" The runner-up deployment, {r.candidate.label()}, serves {r.capacity:.3g} req/s "
                     f"({rj['output_tokens_per_s_per_chip']:.4g} output tokens/s per chip); it is limited by "
                     f"{limiter(r)}.")
        return text


def _group(pruned: Sequence[Pruned]) -> list[tuple[str, list[Pruned]]]:
    """Pruned layouts grouped by family, largest family first (then by name)."""
    groups: dict[str, list[Pruned]] = {}
    for p in pruned:
        groups.setdefault(p.family, []).append(p)
    return sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))


@attrs.frozen
class Bounded:
    """A candidate not simulated: its bound cannot reach the simulated value at the last place
    the ranking is exact to (``--top``)."""
    candidate: Candidate
    saturated_requests_per_s: float
    capacity_bound: float  # requests/s (capacity_bound)
    upper: float           # the bound of the objective's value (goodput or output tokens/s per chip)
    kth: float             # the simulated value at place ``place`` when it was bounded out
    source: str = "roles"  # where the bound came from: roles, saturated run, estimate, simulated (a run
    # failed) or same runs (a max_num_seqs variant's failing run, the same runs)
    estimate: Optional[float] = None   # the estimated capacity (requests/s), when there is one
    runs: int = 0                      # serving runs it took (a saturated run, or the runs to the bar)
    place: int = 0                     # the place the ranking is exact to (--top)
    via: Optional[str] = None          # source "decode pool": the candidate whose run with that decode pool missed

    def _kth_name(self) -> str:
        return f"{ordinal(self.place)} best simulated" if self.place else "last ranked place"

    def reason(self) -> str:
        if self.source in ("simulated", "same runs"):
            same = (" (a max_num_seqs variant's capacity search, whose runs hold or fail alike on both)"
                    if self.source == "same runs" else "")
            # the bar is the top-th value times 1 + the tolerance: a failing run there leaves a
            # capacity that could at most tie the top-th within the search's resolution
            than = "not above" if self.upper <= self.kth else "within the tolerance of"
            return (f"a run at {self.capacity_bound:.4g} req/s misses the SLO{same}, so its capacity is below that: "
                    f"at most {self.upper:.4g} per chip, {than} the {self._kth_name()} ({self.kth:.4g})")
        if self.source == "decode pool":
            return (f"its decode pool missed a TPOT limit one tolerance step above {self.capacity_bound:.4g} req/s "
                    f"with another prefill pool ({self.via}); a decode pool's TPOT (and the share of requests "
                    f"within it) depends on its prefill pool only through its KV arrivals, so its capacity is taken "
                    f"to be at most {self.capacity_bound:.4g} req/s (the search's resolution): at most "
                    f"{self.upper:.4g} per chip, not above the {self._kth_name()} ({self.kth:.4g}) by more than the "
                    "tolerance")
        # a bound up to the bar's value (the top-th's times 1 + the tolerance) at most ties the top-th
        than = "below" if self.upper < self.kth else "within the tolerance of"
        if self.estimate:
            return (f"estimated capacity {self.estimate:.4g} req/s, so at most {self.capacity_bound:.4g} req/s "
                    f"with the estimate's margin: at most {self.upper:.4g} per chip, {than} the {self._kth_name()} "
                    f"({self.kth:.4g})")
        return (f"saturated throughput ({self.source}) {self.saturated_requests_per_s:.4g} req/s, so a capacity "
                f"of at most "
                f"{self.capacity_bound:.4g} req/s: at most {self.upper:.4g} per chip, {than} the {self._kth_name()} "
                f"({self.kth:.4g})")



def ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``10th``, ``11th``, ``22nd``."""
    tail = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{tail}"


def shown(cands, results, objective: str, top: int) -> list[int]:
    """The simulated candidates a search shows with their figures: the ``top`` best by the
    objective (:meth:`Scored.value`'s order) and each side's (aggregated, disaggregated)
    best."""
    ok = [i for i, res in enumerate(results) if res is not None and res.get("status") == "ok"]
    order = sorted(ok, key=lambda i: Scored(cands[i][0], {}, results[i]).rank_key(objective))
    out = list(order[:top])
    for side in (False, True):
        best = next((i for i in order if cands[i][0].disaggregated == side), None)
        if best is not None and best not in out:
            out.append(best)
    return out
