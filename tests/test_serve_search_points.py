"""The serving search ships each layout's screened step latencies to the workers that simulate
its candidates (issue 31: a worker that did not screen the layout does not simulate those
steps again): the same cell as a cold worker's, with fewer engine runs."""
from __future__ import annotations

import pytest

from g5core.study.serving import SearchSettings, candidate_cell
from g5core.study.serving import screen as sc
from g5core.study.serving.space import Candidate, PoolChoice, check_workload

RAW = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 1}
SLO = "ttft_p90=1s,tpot_p90=30ms"
PAR = {"cp": 1, "dp": 1, "pp": 1, "tp": 1}


@pytest.fixture
def cold_worker(monkeypatch):
    """A worker process's runner caches, empty, and a count of the engine's steps."""
    for name in ("_RUNNERS", "_CAPACITY", "_CACHES", "_KEYS", "_SEEDS"):
        monkeypatch.setattr(sc, name, {})
    steps = []
    plain = sc.plan_step_runner

    def counted(prepared):
        engine = plain(prepared)

        def run(groups):
            steps.append(groups)
            return engine(groups)
        return run
    monkeypatch.setattr(sc, "plan_step_runner", counted)

    def reset():
        for name in ("_RUNNERS", "_CAPACITY", "_CACHES", "_KEYS", "_SEEDS"):
            getattr(sc, name).clear()
        steps.clear()
    return steps, reset


def test_a_seeded_worker_gives_a_cold_workers_cell_without_the_screens_engine_runs(cold_worker):
    steps, reset = cold_worker
    wl = check_workload({"requests": 100, "arrival": {"kind": "poisson"}, "input_tokens": 2000, "output_tokens": 64,
                         "seed": 0})
    screen = sc.screen_layout(RAW, 1, PAR, (2048,), wl, SLO)
    (points,) = screen["engine_points"].values()
    assert len(points) == len(steps) > 10 and "engine_points" not in screen["chunks"][0]
    settings = SearchSettings(slo=SLO, chunks=(2048,), seqs=(32,), settle=4, confirm=1)
    cand = Candidate((PoolChoice(1, tuple(sorted(PAR.items())), 1),), 32, 2048)
    reset()
    cold = candidate_cell(RAW, cand, wl, SLO, settings, 1.0, 3.0)
    cold_steps, cold_made = len(steps), {tuple(tuple(g) for g in groups) for groups in steps}
    reset()
    seeded = candidate_cell(RAW, cand, wl, SLO, settings, 1.0, 3.0, engine_points=screen["engine_points"])
    # build_s: a wall time; engine_points: the latencies its runner holds (the seeded one's more)
    same = lambda cell: {k: v for k, v in cell.items() if k not in ("build_s", "engine_points")}
    assert same(seeded) == same(cold) and cold["status"] == "ok"
    assert len(steps) < cold_steps
    # a cell gives back every latency its runs made (the driver ships them to later cells),
    # the seeded one the screen's too
    (made,) = cold["engine_points"].values()
    assert {tuple(tuple(g) for g in groups) for groups, _ in made} == cold_made
    (both,) = seeded["engine_points"].values()
    assert {tuple(tuple(g) for g in groups) for groups, _ in both} == cold_made | {
        tuple(tuple(g) for g in groups) for groups, _ in points}
    assert not set(steps) & {tuple(tuple(g) for g in groups) for groups, _ in points}
    # before its runner is made, a worker keeps the points for it
    reset()
    sc.seed_runners(screen["engine_points"])
    assert sc._SEEDS == screen["engine_points"] and not sc._CACHES
