"""The serving contract is public: a third-party scheduler and router that import only
``g5core`` (``standin_scheduler.py``), installed as a distribution of their own (an entry
point on the path, as pip would leave it), run a ``g5 serve`` end to end."""
from __future__ import annotations

import ast
import json
import pathlib

import pytest
from click.testing import CliRunner

import g5core
from g5core.present.cli import main

HERE = pathlib.Path(__file__).resolve().parent
CONFIG = """model: llama-3.1-8b
system: h100-sxm
chips: 1
parallel: {dp: 1, tp: 1, pp: 1, cp: 1}
serving:
  instances: 2
  router: ROUTER
  scheduler: {name: SCHEDULER, max_num_batched_tokens: 2048}
"""
FLAGS = ["--rate", "20", "--requests", "24", "--isl", "uniform:200:900", "--osl", "16", "--seed", "5", "--json"]


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """``standin_scheduler`` as an installed distribution's ``g5.plugins`` entry point."""
    dist = tmp_path / "site" / "g5_standin-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: g5-standin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[g5.plugins]\nstandin = standin_scheduler\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.syspath_prepend(str(HERE))
    return tmp_path


def _serve(tmp_path, scheduler, router, *extra):
    config = tmp_path / f"{scheduler}-{router}.yaml"
    config.write_text(CONFIG.replace("SCHEDULER", scheduler).replace("ROUTER", router))
    return CliRunner().invoke(main, ["serve", str(config), *FLAGS, *extra])


def test_the_standin_imports_only_g5core():
    tree = ast.parse((HERE / "standin_scheduler.py").read_text(encoding="utf-8"))
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
              {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert {m for m in modules if m.startswith("g5core")} == {"g5core"}
    for name in ("Request", "StepWork", "Seq", "TraceFormat", "TraceFieldError", "Scheduler", "Router",
                 "RoutedInstance", "SchedulerSettings"):
        assert name in g5core.__all__


def test_a_third_party_scheduler_and_router_serve_end_to_end(installed, monkeypatch):
    import standin_scheduler

    monkeypatch.setattr(standin_scheduler.ReserveScheduler, "admissions", 0)
    out = _serve(installed, "reserve", "fewest_sequences")
    assert out.exit_code == 0, out.output
    got = json.loads(out.output)
    assert got["requests"] == got["completed"] == 24
    assert got["preemptions"] == 0
    assert got["conservation"] == {"requests_with_wrong_token_count": 0, "requests_out_of_order": 0,
                                   "requests_without_positive_ttft": 0, "requests_not_fcfs": 0,
                                   "steps_over_kv_pool": 0, "kv_blocks_left_at_end": 0}
    # the plugin's scheduler admitted every request (the loop made its instances)
    assert standin_scheduler.ReserveScheduler.admissions == 24


def test_the_standin_meets_the_protocols(installed):
    import standin_scheduler as s

    sched = s.ReserveScheduler(g5core.SchedulerSettings(), 100)
    for name in ("add", "schedule", "work", "finish_step", "release", "outstanding_tokens", "used_blocks",
                 "has_work", "running", "waiting", "total_blocks", "preemptions"):
        assert hasattr(sched, name), name
    assert callable(s.FewestSequences().choose)


def test_without_the_distribution_the_name_is_unknown(tmp_path):
    out = _serve(tmp_path, "reserve", "round_robin")
    assert out.exit_code == 2 and "serving.scheduler.name" in out.output
