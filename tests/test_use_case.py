"""The CP spec's use case, on the shipped examples (at 128K tokens to keep the suite fast):
deepseek-v3 on 64 chips, tp=2; raising cp from 8 (dp=4) to 16 (dp=2) lowers TTFT and
halves the KV cache per chip, the ring traffic is reported with how much compute hid it."""
from __future__ import annotations

import pathlib

import pytest

from g5core.session.run import load_raw, run

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
SEQ_LEN = 131072


@pytest.fixture(scope="module")
def outs():
    return {cp: run(load_raw(EXAMPLES / f"deepseek-v3-1m-prefill-cp{cp}.yaml", [f"seq_len={SEQ_LEN}"]))
            for cp in (8, 16)}


def test_layout_is_the_spec_use_case(outs):
    for cp, dp in ((8, 4), (16, 2)):
        dep = outs[cp].deployment
        assert (dep.model, dep.chips, dep.phase) == ("deepseek-v3", 64, "prefill")
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
