"""`g5 best`: layout enumeration from the dimension registry, memory pre-filter, ranking, Pareto front."""
from __future__ import annotations

import json
import types

import pytest
import yaml
from click.testing import CliRunner

from g5core import Dimension, hookimpl
from g5core.present.cli import main
from g5core.api.dimensions import collect_dimensions
from g5core.api.errors import ConfigError
from plugin_sets import THIRD_PARTY, builtin_plugin_manager
from g5core.api.plugins import Hooks
from g5core.session.run import make_plan, run
from g5core.study.search import Candidate, best_layouts, enumerate_layouts, factorizations, pareto_front
from g5core.sim.memory import memory_report

# 4 chips, 4 x 128K prompts: the KV cache (64 GiB per replica) does not fit on one chip per replica
RAW = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 4, "parallel": {"dp": 4, "tp": 1, "pp": 1, "cp": 1},
       "phase": "prefill", "batch": 4, "seq_len": 131072}
if THIRD_PARTY:   # the built-in dimensions only (contrib/g5-ulysses would add sp)
    RAW["plugins"] = {"disable": list(THIRD_PARTY)}


def _dims(extra=()):
    # the built-in dimensions only: an installed third-party plugin (contrib/g5-ulysses) adds its own
    return collect_dimensions(Hooks(builtin_plugin_manager(extra_plugins=extra)))


def test_factorizations_are_every_ordered_split():
    assert factorizations(4, 2) == [(1, 4), (2, 2), (4, 1)]
    assert len(factorizations(8, 4)) == 20          # C(3 + 3, 3)
    assert factorizations(1, 3) == [(1, 1, 1)]


def test_layouts_cover_every_registered_dimension_including_a_third_party_one():
    layouts = enumerate_layouts(8, _dims())
    assert all(l["dp"] * l["pp"] * l["cp"] * l["tp"] == 8 for l in layouts)
    assert all((l["dp"] * l["tp"]) % l["ep"] == 0 for l in layouts)
    assert len({json.dumps(l, sort_keys=True) for l in layouts}) == len(layouts)
    assert {"dp": 1, "pp": 1, "cp": 2, "tp": 4, "ep": 4} in layouts
    plugin = types.SimpleNamespace(g5_register_dimensions=hookimpl(
        lambda register: register(Dimension(name="sp", factor=True, rank_order=25, doc="test"))))
    with_sp = enumerate_layouts(8, _dims([("sp_test", plugin)]))
    assert all(l["dp"] * l["pp"] * l["cp"] * l["sp"] * l["tp"] == 8 for l in with_sp)
    assert any(l["sp"] == 8 for l in with_sp)
    # one more factor dimension: more splits (35 ordered splits of 2^3 over 5 instead of 20 over 4)
    assert len({tuple(l[k] for k in ("dp", "pp", "cp", "sp", "tp")) for l in with_sp}) == 35


def test_pareto_front_keeps_only_undominated_layouts():
    def c(lat, mem, name):
        return Candidate(parallel={"x": name}, latency_s=lat, objective_value=lat, fits=True, max_total_bytes=mem,
                         tokens_per_s_per_chip=1.0)

    cands = [c(1.0, 50, 1), c(2.0, 40, 2), c(2.5, 45, 3), c(3.0, 10, 4), c(3.0, 20, 5)]
    assert [x.parallel["x"] for x in pareto_front(cands)] == [1, 2, 4]


def test_best_returns_the_fastest_layout_of_an_exhaustive_simulation_and_says_why_others_were_dropped(tmp_path):
    result = best_layouts(RAW, db_path=tmp_path / "best.db")
    # exhaustive: simulate every layout the plugins accept, fitting or not
    latency, fits = {}, {}
    for par in enumerate_layouts(4, _dims(), moe=False):  # a dense model: no ep
        try:
            out = run(dict(RAW, parallel=par))
        except ConfigError:
            continue
        key = json.dumps(par, sort_keys=True)
        latency[key], fits[key] = out.latency_s, out.memory.fits
    fastest_fitting = min((k for k in latency if fits[k]), key=latency.get)
    assert json.dumps(result.ranked[0].parallel, sort_keys=True) == fastest_fitting
    assert [c.latency_s for c in result.ranked] == sorted(c.latency_s for c in result.ranked)
    assert {json.dumps(c.parallel, sort_keys=True) for c in result.ranked} == {k for k in latency if fits[k]}
    # every non-fitting layout is excluded with the ledger's reason, before simulation
    unfit = {k for k in latency if not fits[k]}
    assert unfit and {json.dumps(e.parallel, sort_keys=True) for e in result.excluded if e.family == "memory"} == unfit
    for e in result.excluded:
        if e.family == "memory":
            assert e.reason.startswith("does not fit by") and e.shortfall_bytes > 0
            mem = memory_report(make_plan(dict(RAW, parallel=e.parallel)).ctx)
            assert e.shortfall_bytes == max(c.total_bytes - c.capacity_bytes for c in mem.per_chip)
    # a dense model: no ep layout is enumerated (none is excluded for it either)
    assert all("ep" not in c.parallel for c in result.ranked)
    assert not [e for e in result.excluded if e.family == "parallel.ep"]
    assert len(enumerate_layouts(4, _dims())) > len(enumerate_layouts(4, _dims(), moe=False))
    assert result.pareto[0] == result.ranked[0]


def test_cli_best_json_schema_and_text(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(RAW))
    no_third_party = [a for name in THIRD_PARTY for a in ("--disable", name)]
    res = CliRunner().invoke(main, ["best", str(cfg), "--json", "--top", "3", "--objective", "tokens_per_s_per_chip"]
                             + no_third_party)
    assert res.exit_code == 0, res.stderr
    data = json.loads(res.stdout)
    assert len(data) == 3
    assert all(set(d) == {"parallel", "latency_s", "fits", "max_total_bytes", "tokens_per_s_per_chip",
                          "objective_value", "config"} for d in data)
    assert all(d["fits"] is True and d["latency_s"] > 0 and d["tokens_per_s_per_chip"] > 0 for d in data)
    assert [d["objective_value"] for d in data] == [d["tokens_per_s_per_chip"] for d in data]
    assert set(data[0]["parallel"]) == {"dp", "tp", "pp", "cp"}  # a dense model: no ep
    # the full configuration: rerunning it gives the candidate's latency
    cfg0 = data[0]["config"]
    assert cfg0["model"] == RAW["model"] and cfg0["parallel"] == {**cfg0["parallel"], **data[0]["parallel"]}
    assert run(cfg0, disabled=THIRD_PARTY).latency_s == data[0]["latency_s"]
    res = CliRunner().invoke(main, ["best", str(cfg), "--top", "2"] + no_third_party)
    assert res.exit_code == 0
    assert "Pareto front" in res.stdout and "does not fit: 1 layout(s), short by" in res.stdout
    header = next(l for l in res.stdout.splitlines() if l.startswith("rank"))
    assert header.split()[:5] == ["rank", "cp", "dp", "pp", "tp"] and " ep " not in header
    assert "parallel.ep:" not in res.stdout


def test_an_objective_of_the_other_phase_is_refused():
    with pytest.raises(ConfigError, match="tpot is a decode metric"):
        best_layouts(RAW, objective="tpot")
