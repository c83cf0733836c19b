"""The serving search's first wave (no bar yet): its capacities are found unconfirmed, the
driver confirms the top ones in cells of their own, and bounds the others out as ties
against the bar those set, as a cell with that bar would."""
from __future__ import annotations

import json
import sqlite3

import pytest

from g5core.study.serving import Scored, SearchSettings, candidate_cell, check_workload, serve_search
from g5core.study.serving.bound import bar_value, objective_value
from g5core.study.serving.capacity import confirm_cell, tie_result
from g5core.study.serving.space import Candidate, PoolChoice

from test_serve_search import layout_runner

RAW = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 8}
SLO = "ttft_p90=1s,tpot_p90=10ms"
SETTINGS = SearchSettings(slo=SLO, chunks=(1024,), seqs=(16,), vary=("tp",), disagg="auto", settle=4, confirm=2,
                          top=2)
SETTLE_S = 1.0 + 64 * 0.01


def _par(**k) -> tuple:
    d = {"dp": 1, "pp": 1, "cp": 1, "sp": 1, "tp": 1, "ep": 1, **k}
    return tuple(sorted(d.items()))


def _wl(seed: int) -> dict:
    return check_workload({"requests": 60, "arrival": {"kind": "poisson"}, "input_tokens": 200,
                           "output_tokens": 64, "seed": seed})


CANDS = [Candidate((PoolChoice(1, _par(), 8),), 16, 1024),
         Candidate((PoolChoice(2, _par(tp=2), 4),), 16, 1024),
         Candidate((PoolChoice(1, _par(), 4), PoolChoice(1, _par(), 4)), 16, 1024)]


def _comparable(cell: dict) -> dict:
    return {k: v for k, v in cell.items() if k not in ("build_s", "engine_points")}


# (candidate, seed, whole_failed): seeds 0 and 4 step the capacity down on confirming, 2 holds it
CASES = [(CANDS[0], 0, False), (CANDS[1], 2, True), (CANDS[2], 4, True), (CANDS[2], 2, False)]


@pytest.mark.parametrize("cand,seed,whole", CASES, ids=lambda x: getattr(x, "label", lambda: str(x))()[:24])
def test_a_capacity_confirmed_in_a_cell_of_its_own_is_the_one_cells(cand, seed, whole):
    """candidate_cell(defer) then confirm_cell gives candidate_cell's result in one: the same
    capacity, runs, trace and figures of its runs (the failing one made whole with
    ``whole_failed``), whether its confirming seeds held at the capacity or stepped it down
    (:data:`CASES`)."""
    wl = _wl(seed)
    one = candidate_cell(RAW, cand, wl, SLO, SETTINGS, 1.0, SETTLE_S, (), layout_runner, whole_failed=whole)
    first = candidate_cell(RAW, cand, wl, SLO, SETTINGS, 1.0, SETTLE_S, (), layout_runner, whole_failed=whole,
                           defer=True)
    assert first["status"] == "unconfirmed"
    assert all(row[1] == seed for row in first["trace"])       # no confirming seed ran
    assert first["tie_upper"] >= objective_value(SETTINGS.objective, Scored(cand, {}, one))
    two = confirm_cell(RAW, cand, wl, SLO, SETTINGS, SETTLE_S, (), layout_runner, first, None, None, whole)
    assert _comparable(two) == _comparable(one)
    assert (two["capacity_requests_per_s"] < first["capacity_requests_per_s"]) == (seed != 2)
    assert any(row[1] != seed for row in two["trace"])          # the confirming seeds ran in the second


def test_the_first_wave_says_what_it_found_then_confirms_its_top_and_bounds_its_ties(tmp_path):
    """A search with confirming seeds (one search for both checks, 3.5 s each):

    - in a log, each first-wave capacity found on the workload's seed gets a line before its
      candidate is decided (confirmed: its capacity line; a tie: counted bounded out);
    - every ranked candidate ran the seeds at its capacity, and a candidate of the first wave
      bounded out as a tie (found unconfirmed, never confirmed) has for its bound its value
      once confirmed at most (``tie_upper``), within the final ranking's bar."""
    db = tmp_path / "search.db"
    lines: list = []
    result = serve_search(RAW, _wl(0), SETTINGS, runner_for=layout_runner, db_path=db, progress=lines.append)
    found = [line for line in lines if line.endswith("unconfirmed")]
    assert found and all("on the workload's seed" in line for line in found)
    first_found = lines.index(found[0])
    for s in result.ranked[:SETTINGS.top]:
        label = s.candidate.label()
        assert any(label in line and "capacity" in line and i > first_found for i, line in enumerate(lines)), label
    assert len(result.ranked) >= SETTINGS.top
    for s in result.ranked:
        cap = s.cell["capacity_requests_per_s"]
        seeds = {row[1] for row in s.cell["trace"] if row[0] == cap and row[2]}
        assert seeds >= {0, 1, 2}, (s.candidate.label(), s.cell["trace"])
    con = sqlite3.connect(db)
    rows = con.execute("SELECT kind, label, payload FROM serve_search WHERE kind IN ('candidate', 'confirm')").fetchall()
    con.close()
    confirmed = {label for kind, label, _ in rows if kind == "confirm"}
    unconfirmed = {label: json.loads(p) for kind, label, p in rows
                   if kind == "candidate" and json.loads(p)["status"] == "unconfirmed"}
    ties = {label: first for label, first in unconfirmed.items() if label not in confirmed}
    assert ties and confirmed, "the case's first wave has ties and confirmed candidates"
    assert {s.candidate.label() for s in result.ranked[:SETTINGS.top]} <= confirmed
    kth = objective_value(SETTINGS.objective, result.ranked[SETTINGS.top - 1])
    first = objective_value(SETTINGS.objective, result.ranked[0])
    bounded = {b.candidate.label(): b for b in result.bounded}
    for label, first_cell in ties.items():
        b = bounded[label]
        assert b.upper == first_cell["tie_upper"] and b.runs == first_cell["runs"]
        assert b.upper <= bar_value(kth, first, SETTINGS.tolerance) * (1 + 1e-12)


def test_a_tie_result_is_bounded_with_its_bar():
    cand = CANDS[0]
    first = candidate_cell(RAW, cand, _wl(0), SLO, SETTINGS, 1.0, SETTLE_S, (), layout_runner, defer=True)
    tie = tie_result(first, 0.5, first["tie_upper"])
    assert tie["status"] == "bounded" and tie["upper"] == first["tie_upper"] and tie["tie_bar"] == first["tie_upper"]
    assert tie["trace"] == first["trace"] and tie["runs"] == first["runs"]
    assert tie["tie_run"] == first["held"]["place"] and first["trace"][tie["tie_run"]][2]


def test_a_terminal_bar_shows_the_first_wave_before_its_candidates_are_decided():
    """On a terminal bar, each first-wave capacity found on the workload's seed shows as a
    count beside the capacity phase's bar before any candidate is counted; the count goes
    once the bar moves."""
    events: list = []

    class Bar:
        def set_postfix_str(self, text, refresh=True):
            events.append(("postfix", text))

        def update(self, n):
            events.append(("update", n))

    class Terminal:
        def start(self, total):
            events.append(("start", total))
            self.bar = Bar()

        def cell(self, n, label, row):
            self.bar.update(1)

        def close(self):
            pass

    serve_search(RAW, _wl(0), SETTINGS, runner_for=layout_runner, progress=Terminal())
    capacity = events[max(i for i, e in enumerate(events) if e[0] == "start") + 1:]   # the last phase's
    assert capacity[:2] == [("postfix", "first wave: 1 capacity found, to confirm"),
                            ("postfix", "first wave: 2 capacities found, to confirm")], capacity[:4]
    first_update = capacity.index(("update", 1))
    assert all(kind == "postfix" and "found" in text for kind, text in capacity[:first_update - 1])
    assert capacity[first_update - 1] == ("postfix", "")
