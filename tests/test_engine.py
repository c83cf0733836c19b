"""The event engine: compute streams, overlap of compute and communication, DAG errors."""
from __future__ import annotations

import pytest

from g5core import hookimpl
from g5core.api.ops import Fragment
from g5core.sim.compile import compile_dag
from g5core.api.errors import DagError
from g5core.session.run import make_plan, simulate_plan
from g5core.sim.roofline import op_latency_s, roofline_latency_s

from helpers_engine import DagBuilder, all_zero, raw_config, synthetic_plan, write_system, write_tiny_model

LINK_BW_BYTES_PER_S = 100.0e9
LINK_LATENCY_S = 2.0e-6
PEAK_FLOPS_PER_S = 1.0e15  # the synthetic system's bf16 peak (efficiency 1, no launch overhead)


@pytest.fixture(scope="module")
def plan4(tmp_path_factory):
    """4 chips in one node of a synthetic system."""
    return synthetic_plan(tmp_path_factory.mktemp("plan4"), 4, chips_per_node=4,
                          intra_node_bw_bytes_per_s=LINK_BW_BYTES_PER_S, intra_node_latency_s=LINK_LATENCY_S)


# -- single chip: TTFT is the sum of the roofline times -----------------------------------


@pytest.mark.parametrize("model,seq_len", [("llama-3.1-8b", 2048), ("mixtral-8x7b", 1024)])
def test_single_chip_ttft_is_the_sum_of_roofline_op_times(model, seq_len):
    plan = make_plan({"model": model, "system": "h100-sxm", "chips": 1,
                      "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1}, "phase": "prefill", "batch": 1,
                      "seq_len": seq_len})
    sim = simulate_plan(plan)
    dag = sim.dag
    assert not dag.comm_ops()
    system = plan.ctx.system
    times_s = [op_latency_s(op, system) for op in dag.ops]
    order = sorted(range(len(dag.ops)), key=lambda i: (sim.start_s[i], i))
    total_s = 0.0
    for i in order:
        total_s += times_s[i]
    assert sim.latency_s == total_s
    # back to back: every op starts when the one before it ends
    for prev, nxt in zip(order, order[1:]):
        assert sim.start_s[nxt] == sim.end_s[prev]
    assert sim.start_s[order[0]] == 0.0
    assert all_zero(sim.kpis)


def test_single_chip_mixtral_runs_every_expert_op():
    """The MoE model's DAG has router and expert ops, and each ran once."""
    plan = make_plan({"model": "mixtral-8x7b", "system": "h100-sxm", "chips": 1,
                      "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1}, "phase": "prefill", "batch": 1,
                      "seq_len": 512})
    sim = simulate_plan(plan)
    names = {op.name for op in sim.dag.ops}
    assert {"router", "moe_experts"} <= names
    assert len([o for o in sim.dag.ops if o.name == "moe_experts"]) == plan.ctx.model.n_layers


# -- compute streams ---------------------------------------------------------------------


def test_one_compute_op_at_a_time_per_chip_in_op_order(plan4):
    """Three independent ops on chip 0 run one after the other, in the order they were
    added to the DAG (program order, not key order); an op on chip 1 runs at the same time."""
    b = DagBuilder()
    for key in ("c0.b", "c0.c", "c0.a"):
        b.compute(key, 0, 1e9)
    b.compute("c1.x", 1, 1e9)
    run = b.run(plan4)
    d_s = 1e9 / PEAK_FLOPS_PER_S
    assert run.start_s("c0.b") == 0.0
    assert run.start_s("c0.c") == run.end_s("c0.b")
    assert run.start_s("c0.a") == run.end_s("c0.c")
    assert run.end_s("c0.a") == pytest.approx(3 * d_s, rel=1e-15)
    assert run.start_s("c1.x") == 0.0
    assert run.end_s("c1.x") == d_s
    assert all_zero(run.kpis)


def test_ready_compute_op_starts_at_time_zero_when_a_comm_op_is_pending(plan4):
    """An op with no predecessor is ready at 0 and its chip is idle: it starts at 0, not at
    the time of the first event in the queue (here, the release of a P2P after its latency)."""
    b = DagBuilder()
    b.compute("work", 0, 1e9)
    b.p2p("send", 2, 3, 1e6)
    run = b.run(plan4)
    assert run.start_s("work") == 0.0
    assert run.end_s("work") == 1e9 / PEAK_FLOPS_PER_S


# -- overlap of compute and communication -------------------------------------------------


def _compute_and_flow(plan4, chained: bool):
    nbytes = 50e6
    comm_s = LINK_LATENCY_S + nbytes / LINK_BW_BYTES_PER_S
    flops = 0.8 * comm_s * PEAK_FLOPS_PER_S      # compute / comm ratio ~0.8: max and sum differ
    compute_s = roofline_latency_s("gemm", flops, 0.0, "bf16", plan4.ctx.system)
    b = DagBuilder()
    b.compute("gemm", 0, flops)
    b.p2p("send", 0, 1, nbytes)
    if chained:
        b.edge("gemm", "send")
    return b.run(plan4), compute_s, comm_s


def test_independent_compute_and_flow_overlap(plan4):
    run, compute_s, comm_s = _compute_and_flow(plan4, chained=False)
    assert run.start_s("gemm") == 0.0
    assert run.start_s("send") == 0.0
    assert run.makespan_s == pytest.approx(max(compute_s, comm_s), rel=1e-12)
    assert run.makespan_s < 0.7 * (compute_s + comm_s)
    assert all_zero(run.kpis)


def test_dependent_compute_and_flow_serialize(plan4):
    run, compute_s, comm_s = _compute_and_flow(plan4, chained=True)
    assert run.start_s("send") == run.end_s("gemm")
    assert run.makespan_s == pytest.approx(compute_s + comm_s, rel=1e-12)
    assert all_zero(run.kpis)


def test_flow_then_compute_serialize(plan4):
    b = DagBuilder()
    b.p2p("recv", 1, 0, 50e6)
    b.compute("use", 0, 1e12)
    b.edge("recv", "use")
    run = b.run(plan4)
    assert run.start_s("use") == run.end_s("recv") == LINK_LATENCY_S + 50e6 / LINK_BW_BYTES_PER_S
    assert run.makespan_s == pytest.approx(run.end_s("recv") + 1e12 / PEAK_FLOPS_PER_S, rel=1e-12)


# -- DAG errors --------------------------------------------------------------------------


def test_hand_built_cycle_is_a_dag_error_naming_the_op_and_plugin(plan4):
    b = DagBuilder()
    b.compute("first", 0, 1e9)
    b.compute("second", 0, 1e9)
    b.edge("first", "second")
    b.edge("second", "first")
    with pytest.raises(DagError) as info:
        compile_dag(b.dag, plan4)
    msg = str(info.value)
    assert "cycle" in msg
    assert "'first'" in msg or "'second'" in msg
    assert "'test'" in msg


def test_hand_built_comm_op_with_an_unlowered_primitive_is_a_dag_error(plan4):
    """compile_dag, not only build_dag, refuses a primitive no plugin lowers, by name."""
    b = DagBuilder()
    b.comm("beam", "teleport", (0, 1), 1e6)
    with pytest.raises(DagError) as info:
        compile_dag(b.dag, plan4)
    msg = str(info.value)
    assert "'beam'" in msg and "teleport" in msg and "'test'" in msg


class _RoguePlugin:
    """Claims layer 0's attention and returns a fragment of the chosen kind of bad."""

    def __init__(self, mode: str):
        self.mode = mode

    @hookimpl
    def g5_expand_op(self, ctx, lop):
        if lop.kind != "attention" or lop.layer != 0:
            return None
        chips = ctx.place(lop)
        work = ctx.work(lop.kind)
        if self.mode == "cycle":
            ops, edges, heads, tails = [], [], {}, {}
            for c in chips:
                a = ctx.compute_op(lop, c, work, owner="rogue", part="a")
                z = ctx.compute_op(lop, c, work, owner="rogue", part="z")
                ops += [a, z]
                edges += [(a.key, z.key), (z.key, a.key)]
                heads[c] = (a.key,)
                tails[c] = (z.key,)
            return Fragment(ops=ops, edges=edges, heads=heads, tails=tails)
        op = ctx.comm_op(lop, "teleport", chips, 1024.0, "rogue_reason", owner="rogue", part="beam")
        return Fragment.collective(op)


@pytest.fixture(scope="module")
def two_chip_raw(tmp_path_factory):
    d = tmp_path_factory.mktemp("rogue")
    return raw_config(write_tiny_model(d), write_system(d), 2, seq_len=256, dp=2, batch=2)


def test_plugin_made_cycle_is_a_dag_error_naming_the_op_and_plugin(two_chip_raw):
    plan = make_plan(two_chip_raw, extra_plugins=[("rogue", _RoguePlugin("cycle"))])
    with pytest.raises(DagError) as info:
        simulate_plan(plan)
    msg = str(info.value)
    assert "cycle" in msg and "'rogue'" in msg
    assert "L000.attention." in msg


def test_plugin_comm_op_with_an_unlowered_primitive_is_a_dag_error(two_chip_raw):
    plan = make_plan(two_chip_raw, extra_plugins=[("rogue", _RoguePlugin("teleport"))])
    with pytest.raises(DagError) as info:
        simulate_plan(plan)
    msg = str(info.value)
    assert "L000.attention.beam" in msg
    assert "'rogue'" in msg and "'teleport'" in msg


def test_disabling_the_collectives_plugin_leaves_tp_ops_unlowered(tmp_path):
    raw = raw_config(write_tiny_model(tmp_path), write_system(tmp_path), 2, seq_len=256, tp=2)
    plan = make_plan(raw, disabled=["collectives"])
    with pytest.raises(DagError) as info:
        simulate_plan(plan)
    msg = str(info.value)
    assert "'tp'" in msg and "'all_reduce'" in msg and "collectives" in msg


# -- determinism -------------------------------------------------------------------------


def test_same_dag_twice_gives_identical_times(plan4):
    def once():
        b = DagBuilder()
        b.compute("g0", 0, 3e9)
        b.comm("ar", "all_reduce", (0, 1, 2, 3), 7e6)
        b.comm("a2a", "all_to_all", (0, 1, 2, 3), 5e6)
        b.p2p("p", 0, 2, 3e6)
        b.compute("g1", 1, 2e9)
        b.edge("g0", "ar")
        b.edge("ar", "g1")
        run = b.run(plan4)
        return run.engine.start_s, run.engine.end_s, run.engine.flow_end_s, run.engine.events

    assert once() == once()


def test_networkx_view_follows_ops_and_edges_added_after_it_was_built():
    from g5core.api.ops import ComputeOp
    from g5core.lower.dag import OpDag

    def op(key, chip=0):
        return ComputeOp(key=key, chip=chip, op_class="gemm", flops=1.0, hbm_bytes=1.0, layer=0, name="x", dtype="bf16", kernels=())

    dag = OpDag()
    dag.add_op(op("a@c0"))
    assert set(dag.graph.nodes) == {"a@c0"}
    dag.add_op(op("b@c0"))
    assert set(dag.graph.nodes) == {"a@c0", "b@c0"}
    dag.add_edge("a@c0", "b@c0")
    assert list(dag.graph.edges) == [("a@c0", "b@c0")]
    assert dag.graph.nodes["b@c0"]["op"].key == "b@c0"


def test_compiled_successors_drop_repeated_edges():

    from g5core.sim.compile import _successor_lists
    from g5core.api.ops import ComputeOp
    from g5core.lower.dag import OpDag

    dag = OpDag()
    for k in ("a", "b", "c", "d"):
        dag.add_op(ComputeOp(key=f"{k}@c0", chip=0, op_class="gemm", flops=1.0, hbm_bytes=1.0, layer=0, name="x",
                             dtype="bf16", kernels=()))
    for u, v in (("a", "d"), ("a", "b"), ("a", "d"), ("c", "d"), ("a", "c"), ("b", "d")):
        dag.add_edge(f"{u}@c0", f"{v}@c0")
    assert dag.n_edges == 6 and dag.edges[:3] == [(0, 3), (0, 1), (0, 3)]
    succ, preds = _successor_lists(dag.edge_array(), 4)
    assert [list(succ[i]) for i in range(4)] == [[1, 2, 3], [3], [3], []]
    assert preds.tolist() == [0, 1, 1, 3]
