"""cp = 1 degeneracy, spec v1.1.1: context parallelism of size 1 is no parallelism.

A cp=1 run gives output identical, every number, to the same run with the pass-KV and
pass-Q plugins disabled; no op with a ``cp_*`` reason or owner and no ``cp_*`` memory term
exists at cp=1. The JSON differs only in the deployment's record of which plugins were
disabled, which the comparison drops explicitly (and checks is the only difference).
"""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from g5core.dag import CommOp
from g5core.results import KPI_NAMES
from g5core.run import run

HF_DIR = pathlib.Path(__file__).parent / "data" / "hf"
CP_PLUGINS = ("cp_passkv", "cp_passq")


def _tiny_llama(n_layers: int) -> dict:
    cfg = json.loads((HF_DIR / "llama-3.1-8b.json").read_text())
    cfg["num_hidden_layers"] = n_layers
    return cfg


def _tiny_deepseek(n_layers: int) -> dict:
    cfg = json.loads((HF_DIR / "deepseek-v3.json").read_text())
    cfg.update(num_hidden_layers=n_layers, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2)
    return cfg


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("cp_degeneracy_models")
    out = {}
    for kind, cfg in (("gqa", _tiny_llama(2)), ("mla", _tiny_deepseek(2))):
        path = d / f"{kind}.json"
        path.write_text(json.dumps(cfg))
        out[kind] = str(path)
    return out


def raw_config(model: str, *, phase: str, dp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1,
               batch: int = 1, seq_len: int = 4096) -> dict:
    return {
        "model": model, "system": "h100-sxm", "chips": dp * tp * pp,
        "parallel": {"dp": dp, "tp": tp, "pp": pp, "cp": 1, "ep": ep},
        "phase": phase, "batch": batch, "seq_len": seq_len,
    }


def assert_kpis_zero(sim) -> None:
    assert set(sim.kpis) == set(KPI_NAMES)
    for name in KPI_NAMES:
        assert sim.kpis[name] == 0, f"conservation KPI {name} = {sim.kpis[name]}"


def comparable_json(out) -> dict:
    d = out.to_json_dict()
    d.pop("sim_wall_s")
    return d


def assert_no_cp_artefacts(out) -> None:
    for op in out.sim.dag.ops:
        assert not op.owner.startswith("cp_"), op.key
        if isinstance(op, CommOp):
            assert not op.reason.startswith("cp_"), op.key
    assert not any(r.startswith("cp_") for r in out.sim.comm_bytes["by_reason"])
    assert not any(t.name.startswith("cp_") for t in out.memory.terms)


CASES = [
    # kind, phase, dp, tp, pp, ep, batch
    ("gqa", "prefill", 1, 1, 1, 1, 1),
    ("gqa", "decode", 1, 1, 1, 1, 1),
    ("mla", "prefill", 1, 1, 1, 1, 1),
    ("mla", "decode", 1, 1, 1, 1, 2),
    ("gqa", "prefill", 2, 2, 2, 1, 2),
    ("gqa", "decode", 2, 2, 2, 1, 3),
    ("mla", "prefill", 2, 2, 1, 4, 1),
    ("mla", "decode", 1, 2, 2, 2, 4),
]


@pytest.mark.parametrize("kind,phase,dp,tp,pp,ep,batch", CASES)
def test_cp1_is_identical_to_a_run_without_the_cp_plugins(models, kind, phase, dp, tp, pp, ep, batch):
    raw = raw_config(models[kind], phase=phase, dp=dp, tp=tp, pp=pp, ep=ep, batch=batch)
    with_cp = run(raw)
    without_cp = run(raw, disabled=CP_PLUGINS)
    for out in (with_cp, without_cp):
        assert_kpis_zero(out.sim)
        assert_no_cp_artefacts(out)

    a, b = comparable_json(with_cp), comparable_json(without_cp)
    # the only legitimate difference: the disabled plugins are recorded in the deployment
    assert "plugins" not in a["deployment"]
    assert b["deployment"].pop("plugins") == {"disable": list(CP_PLUGINS)}
    assert a == b
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)   # bit for bit, floats included
    assert a["ttft_s" if phase == "prefill" else "tpot_s"] == b["ttft_s" if phase == "prefill" else "tpot_s"]

    # the same DAG and the same timeline, op by op
    assert [op for op in with_cp.sim.dag.ops] == [op for op in without_cp.sim.dag.ops]
    assert with_cp.sim.dag.edges == without_cp.sim.dag.edges
    assert np.array_equal(with_cp.sim.start_s, without_cp.sim.start_s)
    assert np.array_equal(with_cp.sim.end_s, without_cp.sim.end_s)
    assert with_cp.memory == without_cp.memory


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_cp1_memory_and_latency_match_the_cp_free_path_in_the_catalog_model(phase):
    """A full-size catalog model at cp=1: memory ledger and latency as without the plugins."""
    raw = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 2,
           "parallel": {"dp": 1, "tp": 2, "pp": 1, "cp": 1}, "phase": phase, "batch": 1, "seq_len": 2048}
    with_cp = run(raw)
    without_cp = run(raw, disabled=CP_PLUGINS)
    assert_kpis_zero(with_cp.sim)
    assert_no_cp_artefacts(with_cp)
    assert with_cp.latency_s == without_cp.latency_s
    assert with_cp.memory.to_json_dict() == without_cp.memory.to_json_dict()


def test_cp_gt_1_is_not_degenerate(models):
    """Control: at cp=2 the CP ops exist, so the artefact check above can fail."""
    raw = raw_config(models["gqa"], phase="prefill")
    raw["chips"], raw["parallel"]["cp"] = 2, 2
    out = run(raw)
    assert_kpis_zero(out.sim)
    with pytest.raises(AssertionError):
        assert_no_cp_artefacts(out)
