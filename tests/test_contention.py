"""Link contention: a TP all-reduce and an EP all-to-all on shared ports slow each other down.

Hand-built DAGs (``OpDag`` + ``compile_dag`` + ``Engine``) on a synthetic system with zero
start latencies, so the expected times have a closed form. The engine's sharing is what is
tested here, so the collectives are the textbook ones (a plain ring all-reduce and direct
all-to-all, no start latency) of a small stand-in plugin, not NCCL's (tests/test_nccl.py). Four chips in one node, link
bandwidth ``B`` per port and direction, payload ``N`` bytes per rank:

- ring all-reduce alone: each rank sends ``2 (n-1)/n N = 1.5 N`` to the next; one flow per
  send port: ``1.5 N / B``;
- all-to-all alone: each rank sends ``N/4`` to each of 3 others; 3 flows share each port:
  ``(N/4) / (B/3) = 0.75 N / B``;
- together: 4 flows per port share it fairly (``B/4`` each); the all-to-all flows end at
  ``(N/4) / (B/4) = N / B``; the ring flows then have ``1.5 N - N/4`` left at full ``B``,
  ending at ``2.25 N / B``, the time the port needs for all ``2.25 N`` bytes it carries.
"""
from __future__ import annotations

import pytest
import yaml

from g5core import Lowering, hookimpl
from g5core.lower.builder import plan_deployment
from g5core.api.ops import CommOp
from g5core.lower.dag import OpDag
from g5core.sim.engine import Engine
from g5core.sim.compile import compile_dag
from g5core.api.plugins import make_plugin_manager
from g5core.sim.results import KPI_NAMES, conservation_kpis

LINK_BYTES_PER_S = 100e9
NIC_BYTES_PER_S = 10e9
PAYLOAD_BYTES = 64 * 2 ** 20
REL = 1e-9  # float rounding of the rate integrals only

SYSTEM = {
    "name": "contention-test", "chips_per_node": 4, "hbm_capacity_bytes": 80 * 2 ** 30,
    "hbm_bw_bytes_per_s": 3e12, "peak_flops_per_s": {"bf16": 1e15},
    "intra_node_bw_bytes_per_s": LINK_BYTES_PER_S, "intra_node_latency_s": 0.0,
    "network_bw_bytes_per_s": NIC_BYTES_PER_S, "network_latency_s": 0.0, "launch_overhead_s": 0.0,
    "efficiency": {"gemm": 1.0, "attention": 1.0, "elementwise": 1.0, "hbm": 1.0},
    "compute_capability": 9.0,
}


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("sys") / "contention.yaml"
    path.write_text(yaml.safe_dump(SYSTEM))
    raw = {"model": "llama-3.1-8b", "system": str(path), "chips": 8,
           "parallel": {"dp": 1, "tp": 8, "pp": 1, "cp": 1}, "phase": "decode", "batch": 1, "seq_len": 128}
    return plan_deployment(raw, make_plugin_manager(disabled=["collectives"], extra_plugins=[("textbook", Textbook)]))


class Textbook:
    """A ring all-reduce and a direct all-to-all with no start latency."""

    @staticmethod
    @hookimpl
    def g5_register_primitives(register):
        def all_reduce(group, nbytes, topo):
            n = len(group)
            return Lowering(flows=tuple((group[i], group[(i + 1) % n], 2 * (n - 1) / n * nbytes) for i in range(n)), latency_s=0.0)

        def all_to_all(group, nbytes, topo):
            return Lowering(flows=tuple((s, t, nbytes / len(group)) for s in group for t in group if s != t), latency_s=0.0)

        register("all_reduce", all_reduce)
        register("all_to_all", all_to_all)


def _allreduce(group, key="tp.allreduce"):
    return CommOp(key=key, primitive="all_reduce", group=group, bytes_per_rank=PAYLOAD_BYTES,
                  reason="tp_allreduce", layer=0, name="attn_out_reduce", owner="tp")


def _alltoall(group, key="ep.dispatch"):
    return CommOp(key=key, primitive="all_to_all", group=group, bytes_per_rank=PAYLOAD_BYTES,
                  reason="ep_dispatch", layer=0, name="moe_experts", owner="ep")


def _run(plan, *ops):
    dag = OpDag()
    for op in ops:
        dag.add_op(op)
    engine = Engine(dag=compile_dag(dag, plan)).run()
    times = {op.key: engine.end_s[i] - engine.start_s[i] for i, op in enumerate(dag.ops)}
    return times, conservation_kpis(engine), engine


GROUP = (0, 1, 2, 3)
N_OVER_B_S = PAYLOAD_BYTES / LINK_BYTES_PER_S


def test_each_collective_alone_matches_its_closed_form(plan):
    t_ar, kpis_ar, _ = _run(plan, _allreduce(GROUP))
    t_a2a, kpis_a2a, _ = _run(plan, _alltoall(GROUP))
    assert t_ar["tp.allreduce"] == pytest.approx(1.5 * N_OVER_B_S, rel=REL)
    assert t_a2a["ep.dispatch"] == pytest.approx(0.75 * N_OVER_B_S, rel=REL)
    for kpis in (kpis_ar, kpis_a2a):
        assert set(kpis) == set(KPI_NAMES) and all(v == 0 for v in kpis.values())


def test_allreduce_and_alltoall_on_shared_ports_slow_each_other_down(plan):
    alone_ar = _run(plan, _allreduce(GROUP))[0]["tp.allreduce"]
    alone_a2a = _run(plan, _alltoall(GROUP))[0]["ep.dispatch"]
    together, kpis, engine = _run(plan, _allreduce(GROUP), _alltoall(GROUP))
    # both are launched at t = 0 (no edges) and both take longer than alone
    assert list(engine.start_s) == [0.0, 0.0]
    assert together["tp.allreduce"] > alone_ar * 1.2
    assert together["ep.dispatch"] > alone_a2a * 1.2
    # exactly the max-min fair closed form
    assert together["ep.dispatch"] == pytest.approx(1.0 * N_OVER_B_S, rel=REL)
    assert together["tp.allreduce"] == pytest.approx(2.25 * N_OVER_B_S, rel=REL)
    # the ports were busy all along: the makespan is the sum, not the max, of the two alone
    assert engine.makespan_s == pytest.approx(alone_ar + alone_a2a, rel=REL)
    assert all(kpis[name] == 0 for name in KPI_NAMES)


def test_no_slowdown_on_disjoint_ports(plan):
    alone_ar = _run(plan, _allreduce(GROUP))[0]["tp.allreduce"]
    alone_a2a = _run(plan, _alltoall((4, 5, 6, 7)))[0]["ep.dispatch"]
    together, kpis, _ = _run(plan, _allreduce(GROUP), _alltoall((4, 5, 6, 7)))
    assert together["tp.allreduce"] == alone_ar
    assert together["ep.dispatch"] == alone_a2a
    assert all(v == 0 for v in kpis.values())


def test_cross_node_traffic_shares_the_network_interface(plan):
    # chips 0 and 4 sit in different nodes (4 chips per node): a 2-rank all-reduce and an
    # all-to-all between them both cross chip 0's and chip 4's network-interface ports
    ring = (0, 4)
    alone_ar = _run(plan, _allreduce(ring))[0]["tp.allreduce"]
    # a 2-rank ring: each rank sends 2 * 1/2 * N = N across the NIC
    assert alone_ar == pytest.approx(PAYLOAD_BYTES / NIC_BYTES_PER_S, rel=REL)
    alone_a2a = _run(plan, _alltoall((0, 4)))[0]["ep.dispatch"]
    assert alone_a2a == pytest.approx(PAYLOAD_BYTES / 2 / NIC_BYTES_PER_S, rel=REL)
    together, kpis, engine = _run(plan, _allreduce(ring), _alltoall((0, 4)))
    assert together["tp.allreduce"] > alone_ar and together["ep.dispatch"] > alone_a2a
    # fair share of one NIC port between two flows: the all-to-all ends at 2x its alone time
    assert together["ep.dispatch"] == pytest.approx(2 * alone_a2a, rel=REL)
    assert engine.makespan_s == pytest.approx(alone_ar + alone_a2a, rel=REL)
    assert all(v == 0 for v in kpis.values())


@pytest.mark.parametrize("payload_scale", [0.25, 1.0, 8.0])
def test_contention_scales_with_payload(plan, payload_scale):
    import attrs

    ar = attrs.evolve(_allreduce(GROUP), bytes_per_rank=PAYLOAD_BYTES * payload_scale)
    a2a = attrs.evolve(_alltoall(GROUP), bytes_per_rank=PAYLOAD_BYTES * payload_scale)
    together, kpis, _ = _run(plan, ar, a2a)
    assert together["tp.allreduce"] == pytest.approx(2.25 * N_OVER_B_S * payload_scale, rel=REL)
    assert together["ep.dispatch"] == pytest.approx(1.0 * N_OVER_B_S * payload_scale, rel=REL)
    assert all(v == 0 for v in kpis.values())
