"""The CP spec's use case, on the shipped examples (at 128K tokens to keep the suite fast):
deepseek-v3 on 64 chips, tp=2; raising cp from 8 (dp=4) to 16 (dp=2) lowers TTFT and
halves the KV cache per chip, the ring traffic is reported with how much compute hid it.
The default suite runs it on 3 of deepseek-v3's 61 layers (one dense, two MoE: the same
layouts, 0.5 s instead of 4.5 s on 2 cores); the whole model is a bench check."""
from __future__ import annotations

import json
import pathlib

import pytest

from g5core.session.run import load_raw, run

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
SEQ_LEN = 131072



@pytest.fixture(scope="module", params=["3 layers", pytest.param("61 layers", marks=pytest.mark.bench)])
def outs(request, tmp_path_factory):
    overrides = [f"seq_len={SEQ_LEN}"]
    if request.param == "3 layers":
        hf = json.loads((EXAMPLES.parent / "tests" / "data" / "hf" / "deepseek-v3.json").read_text())
        model = tmp_path_factory.mktemp("use_case") / "deepseek-v3.json"
        model.write_text(json.dumps(dict(hf, num_hidden_layers=3, first_k_dense_replace=1)))
        overrides.append(f"model={model}")
    return {cp: run(load_raw(EXAMPLES / f"deepseek-v3-1m-prefill-cp{cp}.yaml", overrides)) for cp in (8, 16)}


def test_layout_is_the_spec_use_case(outs):
    for cp, dp in ((8, 4), (16, 2)):
        dep = outs[cp].deployment
        assert (pathlib.Path(dep.model).stem, dep.chips, dep.phase) == ("deepseek-v3", 64, "prefill")
        assert (dep.size("tp"), dep.size("cp"), dep.size("dp"), dep.size("pp")) == (2, cp, dp, 1)


def test_raising_cp_lowers_ttft_and_halves_kv_per_chip(outs):
    assert outs[16].latency_s < outs[8].latency_s
    kv8 = {c.kv_cache_bytes for c in outs[8].memory.per_chip}
    kv16 = {c.kv_cache_bytes for c in outs[16].memory.per_chip}
    assert len(kv8) == len(kv16) == 1
    assert kv16.pop() * 2 == kv8.pop()


def test_ring_traffic_is_reported_with_what_compute_hid(outs):
    for out in outs.values():
        data = out.to_json_dict()
        assert data["comm_bytes"]["per_rank_by_reason"]["cp_passkv"] > 0
        ring = data["overlap"]["by_reason"]["cp_passkv"]
        assert 0.0 <= ring["hidden_fraction"] <= 1.0
        assert ring["exposed_comm_s"] <= ring["comm_time_s"]
        assert all(v == 0 for v in data["conservation"].values())
        assert data["memory"]["max_total_bytes"] > 0
