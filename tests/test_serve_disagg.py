"""Prefill/decode disaggregation: the KV transfer (bytes from the ledger, time from the
network model) is part of TTFT, and keeping prefills off the decode instances lowers TPOT."""
from __future__ import annotations

import numpy as np
import pytest

from g5core.serve.api import simulate_serving
from g5core.serve.metrics import per_request
from g5core.serve.workload import Request, Workload, synthetic

BASE = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 1, "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1}}


def runner(groups):
    """A stand-in for the engine: 5 ms a step, 20 us a prefill token, 50 us a decode."""
    return 5e-3 + sum(k * (5e-5 if n == 1 else 2e-5 * n) for n, c, k in groups)


def disagg(prefill=1, decode=1, chips=1):
    return {**BASE, "serving": {"disaggregation": {"prefill": {"instances": prefill},
                                                   "decode": {"instances": decode, "chips": chips,
                                                              "parallel": {"dp": 1, "tp": chips, "pp": 1,
                                                                           "cp": 1}}}}}


def test_ttft_includes_the_kv_transfer_and_its_bytes_follow_the_ledger():
    from g5core.sim.memory import memory_report
    from g5core.session.run import make_plan

    isl = 3000
    w = Workload((Request(0, 0.0, isl, 4),))
    res = simulate_serving(disagg(), w, runner=runner, check_predictor=0)
    a = per_request(res.loop)
    move = a["kv_transfer_s"][0]
    assert move > 0
    assert a["ttft_s"][0] == pytest.approx(runner(((isl, 0, 1),)) + move, rel=1e-12)
    ledger_plan = make_plan({**BASE, "phase": "prefill", "batch": 1, "seq_len": isl})
    ledger = memory_report(ledger_plan.ctx)
    kv = sum(c.kv_cache_bytes for c in ledger.per_chip)
    assert res.loop.fleet.transfer_bytes(isl) == pytest.approx(kv, rel=1e-12)
    # one H100 to its neighbour over NVLink: the bytes at the link's rate, plus its latency
    from g5core.lower.topology import Topology

    topo = Topology.from_system(ledger_plan.ctx.system, 2)
    link = min(topo.capacities()[topo.link_tx(0)], topo.capacities()[topo.link_rx(1)])
    assert move == pytest.approx(kv / link + topo.link_latency_s, rel=1e-12)


def test_transfer_across_nodes_is_slower_than_inside_one():
    isl = 3000
    w = Workload((Request(0, 0.0, isl, 2),))
    near = simulate_serving(disagg(1, 1), w, runner=runner, check_predictor=0)
    far = simulate_serving(disagg(8, 1), w, runner=runner, check_predictor=0)  # decode chip 8: the next node
    assert per_request(far.loop)["kv_transfer_s"][0] > per_request(near.loop)["kv_transfer_s"][0]


def test_disaggregation_lowers_tpot_p99_at_a_prefill_heavy_load():
    w = synthetic({"requests": 300, "arrival": {"kind": "poisson", "rate_per_s": 12}, "input_tokens": 4000,
                   "output_tokens": 64, "seed": 1})
    agg = simulate_serving({**BASE, "serving": {"instances": 2}}, w, runner=runner, check_predictor=0)
    split = simulate_serving(disagg(1, 1), w, runner=runner, check_predictor=0)
    assert split.loop.fleet.chips == agg.loop.fleet.chips == 2
    assert split.summary["tpot_s"]["p99"] < agg.summary["tpot_s"]["p99"]
    assert split.summary["completed"] == 300
    assert np.all(per_request(split.loop)["kv_transfer_s"] > 0)
