"""cp = 1 degeneracy, spec v1.1.1: context parallelism of size 1 is no parallelism.

A cp=1 run gives output identical, every number, to the same run with the pass-KV and
pass-Q plugins disabled; no op with a ``cp_*`` reason or owner and no ``cp_*`` memory term
exists at cp=1. The JSON differs only in the deployment's record of which plugins were
disabled, which the comparison drops explicitly (and checks is the only difference).
"""
from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from g5core.api.ops import CommOp
from g5core.session.run import run

from cp_helpers import assert_kpis_zero, tiny_models_fixture
from cp_helpers import raw_config as _raw_config

CP_PLUGINS = ("cp_passkv", "cp_passq")

# kind -> path to a tiny HF config (2 layers)
models = tiny_models_fixture("gqa", "mla", paths_only=True)
# cp = 1 unless a test changes it; ep is always written
raw_config = functools.partial(_raw_config, ep=1)


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
