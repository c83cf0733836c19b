"""The serving search's bounds across candidates and sides: a decode pool's TPOT miss bounds
its other prefill partners, and a side's best says when candidates bounded out by the overall
bar could pass it."""
from __future__ import annotations

import pytest

from g5core.present.render import _sides
from g5core.study.serving import SearchSettings, Scored, candidate_cell, check_workload, serve_search
from g5core.study.serving.bound import objective_value
from g5core.study.serving.decode import decode_side
from g5core.study.serving.result import Bounded, ServeSearchResult
from g5core.study.serving.space import Candidate, PoolChoice

from test_serve_search import layout_runner

RAW = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 8}
SLO = "ttft_p90=1s,tpot_p90=10ms"
WL = {"requests": 60, "arrival": {"kind": "poisson"}, "input_tokens": 200, "output_tokens": 64, "seed": 0}
SETTINGS = SearchSettings(slo=SLO, chunks=(1024,), seqs=(4, 16), vary=("tp",), disagg="on", settle=4, confirm=0,
                          top=2)


def test_a_decode_pool_missing_its_tpot_bounds_its_other_prefill_partners():
    """A disaggregated candidate whose decode pool (with its scheduler limits) missed a TPOT
    limit at rate ``r`` with one prefill pool is bounded out (source ``decode pool``) when
    its value at ``r / (1 + tolerance)`` cannot pass the bar; simulated anyway with its own
    prefill pool, its capacity is below ``r`` and its value within the bar."""
    result = serve_search(RAW, WL, SETTINGS, runner_for=layout_runner)
    by_label = {s.candidate.label(): s for s in result.ranked}
    decode = [b for b in result.bounded if b.source == "decode pool"]
    assert decode, "the case has a decode pool bounded by another partner's run"
    kth = objective_value(SETTINGS.objective, result.ranked[SETTINGS.top - 1])
    first = objective_value(SETTINGS.objective, result.ranked[0])
    tie = 1 + SETTINGS.tolerance
    wl = check_workload(WL)
    settle_s = 1.0 + 64 * 0.01
    for b in decode:
        # the candidate whose run missed: same decode side, another prefill pool
        via = next(c for c in [s.candidate for s in result.ranked] + [x.candidate for x in result.bounded]
                   if c.label() == b.via)
        assert decode_side(via) == decode_side(b.candidate) and via.pools[0] != b.candidate.pools[0]
        assert "decode pool missed a TPOT limit" in b.reason() and b.via in b.reason()
        assert b.upper <= min(b.kth * tie, first) * (1 + 1e-12)
        cell = candidate_cell(RAW, b.candidate, wl, SLO, SETTINGS, 1.0, settle_s, (), layout_runner)
        assert cell["status"] == "ok"
        # its decode pool misses at the rate it was bounded by, with its own prefill pool too
        assert cell["capacity_requests_per_s"] < b.capacity_bound * tie * (1 + 1e-12), b.candidate.label()
        value = Scored(b.candidate, {}, cell).rates()[0]
        assert value <= b.upper * (1 + 1e-12) and value < min(kth * tie, first)
        assert b.candidate.label() not in by_label


def _result(ranked, bounded) -> ServeSearchResult:
    return ServeSearchResult("goodput_per_chip", SearchSettings(slo=SLO), 1, (), tuple(ranked), len(ranked), 0, 0,
                             None, tuple(bounded))


def _scored(cand: Candidate, capacity: float) -> Scored:
    held = {"goodput_share": 1.0, "mean_output_tokens": 64.0}
    return Scored(cand, {}, {"capacity_requests_per_s": capacity, "held": held, "ceiling": False, "failed": None})


def test_a_side_whose_candidates_were_bounded_above_its_best_is_labelled_not_exact():
    par = (("tp", 1),)
    agg = Candidate((PoolChoice(1, par, 8),), 16, 1024)
    agg2 = Candidate((PoolChoice(2, (("tp", 2),), 4),), 16, 1024)
    dis = Candidate((PoolChoice(1, par, 4), PoolChoice(1, par, 4)), 16, 1024)
    ranked = [_scored(dis, 16.0), _scored(agg, 8.0)]          # 2.0 and 1.0 req/s per chip
    exact = _result(ranked, []).sides()
    assert exact["aggregated"]["exact"] and exact["aggregated"]["bounded_above"] == 0
    assert exact["disaggregated_over_aggregated"] == pytest.approx(2.0)
    # an aggregated candidate bounded out by the overall bar (2.0) with a bound above 1.0
    above = Bounded(agg2, 20.0, 12.0, 1.5, 2.0, "estimate", 10.0, place=1)
    below = Bounded(agg2, 20.0, 6.0, 0.75, 2.0, "estimate", 5.0, place=1)
    # a tie bounded at the winner's own value (up to rounding) does not pass it, nor (on the
    # winner's side) a failing run's looser bound: nothing bounded out passes the winner
    at_first = Bounded(dis, 20.0, 16.0, 2.0 * (1 + 1e-12), 2.0, "simulated", None, place=1)
    loose = Bounded(dis, 20.0, 17.0, 2.1, 2.0, "simulated", None, place=1)
    over = Bounded(agg2, 20.0, 17.0, 2.1, 2.0, "simulated", None, place=1)
    sides = _result(ranked, [above, below, at_first, loose]).sides()
    side = sides["aggregated"]
    assert not side["exact"] and side["bounded_above"] == 1 and side["at_most_value"] == 1.5
    capped = _result(ranked, [above, over]).sides()["aggregated"]
    assert capped["bounded_above"] == 2 and capped["at_most_value"] == pytest.approx(2.0)
    assert side["simulated"] and side["value"] == pytest.approx(1.0)
    assert sides["disaggregated"]["exact"]
    text = "\n".join(_sides(sides))
    assert "1 candidate of this side bounded out by the ranking's bar could reach at most 1.5" in text
    assert text.count("could reach") == 1


def test_a_decode_pool_runs_alike_under_other_limits_only_where_none_was_met():
    """Another max_num_seqs or chunk size leaves a decode pool's runs alike only where they
    never preempted (no recompute prefilled in it) and its schedulers' peak stayed below
    both limits of both candidates."""
    from g5core.study.serving.decode import runs_alike

    par = (("tp", 1),)
    pools = (PoolChoice(1, par, 2), PoolChoice(1, par, 2))
    ran = Candidate(pools, 64, 2048)
    assert runs_alike(ran, Candidate(pools, 64, 2048), None, None)       # the same limits
    assert runs_alike(ran, Candidate(pools, 128, 8192), 0, 63)
    assert not runs_alike(ran, Candidate(pools, 128, 8192), 0, 64)      # max_num_seqs met
    assert not runs_alike(ran, Candidate(pools, 32, 2048), 0, 40)       # above the other's limit
    assert runs_alike(ran, Candidate(pools, 32, 2048), 0, 31)
    assert not runs_alike(ran, Candidate(pools, 64, 8192), 1, 10)       # a recompute prefilled
    assert not runs_alike(ran, Candidate(pools, 64, 8192), None, 10)    # not said
    assert not runs_alike(Candidate(pools, 64, 32), Candidate(pools, 64, 16), 0, 20)   # a chunk met
