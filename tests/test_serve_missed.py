"""A serving run stopped at its sure SLO miss (issue 31: the search's failing runs need only
their verdict): it stops only when the whole run misses, a run that holds is not stopped
and gives the same summary, and a capacity search with stopped runs finds what it finds
with whole runs."""
from __future__ import annotations

import numpy as np
import pytest

from g5core.inputs.serving import parse_slo
from g5core.serve.loop import MissWatch
from g5core.serve.session import MissedRun, ServingSession
from g5core.serve.workload import Request
from g5core.study.serving import SearchSettings, candidate_cell
from g5core.study.serving import capacity, runs
from g5core.study.serving.space import Candidate, PoolChoice, check_workload

from tests.test_serve_search import layout_runner

BASE = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 1, "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1}}
AGG = {**BASE, "serving": {"instances": 2, "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 1024}}}
DISAGG = {**BASE, "serving": {"scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 1024},
                              "disaggregation": {"prefill": {"instances": 1}, "decode": {"instances": 1}}}}
WL = {"requests": 300, "arrival": {"kind": "poisson", "rate_per_s": 1.0}, "input_tokens": 900,
      "output_tokens": 24, "seed": 3}
SLOS = ("ttft_p90=1s,tpot_p90=40ms", "ttft_p99=400ms", "tpot_p50=25ms", "e2e_p90=2s", "queue_p90=200ms",
        "ttft=1.5s", "tpot=60ms,e2e=3s")


@pytest.mark.parametrize("raw", [AGG, DISAGG], ids=["aggregated", "disaggregated"])
def test_a_stopped_run_is_one_the_whole_run_misses_and_a_held_run_is_not_stopped(raw):
    stopped_early = held = 0
    for slo in SLOS:
        session = ServingSession(raw, WL, runner=layout_runner(raw), slo=slo)
        for rate in (4.0, 20.0, 80.0):
            wl = {**WL, "arrival": {"kind": "poisson", "rate_per_s": rate}}
            whole = session.run(wl)
            stopped = session.run(wl, stop_at_miss=True)
            if isinstance(stopped, MissedRun):
                assert not whole.summary["goodput"]["all_met"], (slo, rate)
                assert stopped.summary["goodput"]["all_met"] is False
                assert stopped.completed <= stopped.requests == WL["requests"]
                stopped_early += stopped.completed < stopped.requests
            else:
                # not sure of a miss to its end: the same run as without the watch, bit for bit
                assert stopped.summary == whole.summary, (slo, rate)
                held += whole.summary["goodput"]["all_met"]
    assert stopped_early >= 6 and held >= 3      # both kinds of run occur in the grid


@pytest.mark.parametrize("m", [1, 2, 3, 10, 101, 2000])
@pytest.mark.parametrize("p", [50, 90, 99, 99.9])
def test_the_watch_is_sure_at_the_fewest_values_over_that_make_the_percentile_miss(m, p):
    """``need`` values over the limit make numpy's percentile miss however they lie; one
    fewer (the rest at 0, those over just over) can still hold."""
    limit = 1.0
    (lim,) = parse_slo(f"ttft_p{p:g}=1s")
    watch = MissWatch((lim,), [Request(k, 0.0, 10, 2) for k in range(m)], closed=True)
    need = watch.checks["ttft"][0][1]
    assert 1 <= need <= m
    over = limit * (1 + 2e-9)
    assert np.percentile(np.r_[np.zeros(m - need), np.full(need, over)], p) > limit
    if need > 1:
        assert np.percentile(np.r_[np.zeros(m - need + 1), np.full(need - 1, over)], p) <= limit
    for k in range(need):
        assert not watch.sure
        watch.see("ttft", over)
    assert watch.sure


def test_a_request_waiting_longer_than_the_limit_counts_before_its_first_token():
    (lim,) = parse_slo("ttft=1s")
    watch = MissWatch((lim,), [Request(0, 0.0, 10, 2), Request(1, 5.0, 10, 2)])
    watch.at(0.9)
    assert not watch.sure
    watch.see("ttft", 0.5)       # request 0's first token within the limit
    watch.at(5.9)
    assert not watch.sure
    watch.at(6.1)                # request 1 has waited 1.1 s: its TTFT is over
    assert watch.sure


@pytest.mark.parametrize("disagg", [False, True], ids=["aggregated", "disaggregated"])
def test_a_capacity_search_with_stopped_runs_finds_what_whole_runs_find(monkeypatch, disagg):
    raw = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 2}
    slo = "ttft_p90=1s,tpot_p90=40ms"
    wl = check_workload({"requests": 120, "arrival": {"kind": "poisson"}, "input_tokens": 2000,
                         "output_tokens": 16, "seed": 0})
    settings = SearchSettings(slo=slo, chunks=(1024,), seqs=(16,), vary=("tp",), settle=4, confirm=1)
    par = (("cp", 1), ("dp", 1), ("pp", 1), ("tp", 1))
    one = PoolChoice(1, par, 1)
    cand = Candidate((one, one) if disagg else (PoolChoice(1, par, 2),), 16, 1024)
    args = (raw, cand, wl, slo, settings, 1.0, 1.64, (), layout_runner)
    fast = candidate_cell(*args)
    plain = runs._seeded_run

    def whole(*a, **kw):
        return plain(*a, **{**kw, "stop_at_miss": False})
    monkeypatch.setattr(runs, "_seeded_run", whole)
    slow = candidate_cell(*args)
    assert fast["status"] == slow["status"] == "ok"
    for key in ("capacity_requests_per_s", "failed_rate_per_s", "held", "held_run", "failed_run", "runs"):
        assert fast[key] == slow[key], key
    # the same rates and seeds, holding alike; the held run's peak is its whole run's
    assert [row[:3] for row in fast["trace"]] == [row[:3] for row in slow["trace"]]
    assert fast["trace"][fast["held_run"]] == slow["trace"][slow["held_run"]]
    # the failed run stopped at its sure miss keeps no figures, only the limit it missed;
    # made again to its end (whole_cell, what the driver does for a shown candidate) it is
    # the whole run's, figures and peak
    assert fast["failed"] is None and slow["failed"] is not None and slow["failed_stopped"] is None
    assert fast["failed_stopped"]["limit"] in ("ttft_p90", "tpot_p90")
    rate, seed = fast["trace"][fast["failed_run"]][:2]
    monkeypatch.setattr(runs, "_seeded_run", plain)
    again = capacity.whole_cell(raw, cand, wl, slo, settings, 1.64, (), layout_runner, rate, seed)
    assert again["failed"] == slow["failed"]
    assert again["peak_running_seqs"] == slow["trace"][slow["failed_run"]][3]


@pytest.mark.parametrize("raw", [AGG, DISAGG], ids=["aggregated", "disaggregated"])
def test_a_run_without_its_inter_token_gaps_gives_the_same_figures(raw):
    """A run whose figures read no inter-token gap (``itl_stats=False``, no ITL limit: the
    serving search's runs) keeps none of them (the loop's ``gaps``), and its summary, its
    steps and every request's largest gap are the run's that keeps them; an ITL limit keeps
    them."""
    session = ServingSession(raw, WL, runner=layout_runner(raw), slo="ttft_p90=1s,tpot_p90=40ms")
    wl = {**WL, "arrival": {"kind": "poisson", "rate_per_s": 6.0}}
    kept, lean = session.run(wl), session.run(wl, itl_stats=False)
    assert len(kept.loop.requests.itl_s) > 0 and len(lean.loop.requests.itl_s) == 0
    assert kept.summary["itl_s"] is not None and lean.summary["itl_s"] is None
    assert {k: v for k, v in kept.summary.items() if k != "itl_s"} == {
        k: v for k, v in lean.summary.items() if k != "itl_s"}
    assert kept.loop.requests.max_itl_s.tobytes() == lean.loop.requests.max_itl_s.tobytes()
    assert [i.steps.tobytes() for i in kept.loop.instances] == [i.steps.tobytes() for i in lean.loop.instances]
    limited = ServingSession(raw, WL, runner=layout_runner(raw), slo="itl_p99=80ms").run(wl, itl_stats=False)
    assert limited.loop.requests.itl_s.tobytes() == kept.loop.requests.itl_s.tobytes()
