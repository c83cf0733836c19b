"""The struct-of-arrays op DAG and Fragment.replicated (issue 13): ops stored as columns come
back equal to the ones added, and a replicated template builds what the per-op API builds."""
from __future__ import annotations

import attrs
import pytest

from g5core.lower.builder import build_dag, default_fragment
from g5core.api.ops import CommOp, ComputeOp, Fragment
from g5core.lower.dag import OpDag
from g5core.api.errors import DagError, PluginError
from g5core.lower.layers import build_program
from g5core.session.run import make_plan, simulate_plan


def _raw(tp=2, dp=2, cp=1, seq_len=512):
    return {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": tp * dp * cp,
            "parallel": {"dp": dp, "tp": tp, "pp": 1, "cp": cp}, "phase": "prefill", "batch": 1, "seq_len": seq_len}


def _compute(key, chip, flops=1.0, owner="core", kernels=()):
    return ComputeOp(key=key, chip=chip, op_class="gemm", flops=flops, hbm_bytes=2.0, layer=0, name="qkv_proj",
                     dtype="bf16", owner=owner, kernels=kernels)


def test_ops_stored_as_columns_come_back_equal_and_share_one_spec_when_alike():
    dag = OpDag()
    kernels = ("k",)
    made = [_compute(f"L000.q@c{c}", c, kernels=kernels) for c in range(3)]
    made.append(CommOp(key="L000.ar@g0-1-2", primitive="all_reduce", group=(0, 1, 2), bytes_per_rank=8.0,
                       reason="tp_allreduce", layer=0, name="qkv_proj", owner="tp"))
    made.append(_compute("L000.q.other@c0", 0, flops=3.0, kernels=kernels))
    for op in made:
        dag.add_op(op)
    assert list(dag.ops) == made
    assert dag.ops[-1] == made[-1] and dag.ops[1:3] == made[1:3]
    assert [dag.is_comm(i) for i in range(len(dag))] == [False, False, False, True, False]
    assert dag.comm_indices() == [3] and dag.comm_ops("tp_allreduce") == [made[3]] and dag.comm_ops("x") == []
    assert dag.op_chips(3) == (0, 1, 2) and dag.op_chips(1) == (1,) and dag.owner(3) == "tp"
    # the three alike ops share one spec; other FLOPs make another
    assert dag.spec[0] == dag.spec[1] == dag.spec[2] != dag.spec[4]
    assert len(dag.specs) == 3
    with pytest.raises(IndexError):
        dag.ops[5]
    with pytest.raises(DagError, match=r"made twice \(by core and core\)"):
        dag.add_op(made[0])


def test_replicated_fragment_reads_as_the_per_op_fragment_it_stands_for():
    template = _compute("ignored", 0)
    frag = Fragment.replicated(template, "L000.qkv_proj", (2, 0, 5))
    per_op = Fragment.single_chip_ops(attrs.evolve(template, key=f"L000.qkv_proj@c{c}", chip=c) for c in (2, 0, 5))
    assert frag.ops == per_op.ops and frag.heads == per_op.heads and frag.tails == per_op.tails
    assert frag.edges == ()
    with pytest.raises(DagError, match="chips of 'L000.x' repeat"):
        Fragment.replicated(template, "L000.x", (1, 1))


def test_the_core_default_fragment_builds_the_dag_the_per_op_api_builds():
    plan = make_plan(_raw())
    ctx = plan.ctx
    replicated = build_dag(plan)
    # the same program with every default fragment turned into per-op ComputeOps
    per_op = OpDag()
    for lop in build_program(ctx.model):
        frag = default_fragment(ctx, lop, ctx.place(lop))
        assert frag.repeated is not None or not frag.ops
        for op in frag.ops:
            per_op.add_op(op)
    core = [op for op in replicated.ops if op.owner == "core"]
    assert core == list(per_op.ops) and core
    assert all(op.key == f"{op.key.split('@')[0]}@c{op.chip}" for op in core)


def _plugin_dag(monkeypatch, frag_of):
    """Build with the core's default fragment replaced by ``frag_of(ctx, lop, chips)``."""
    import g5core.lower.builder as build

    monkeypatch.setattr(build, "default_fragment", frag_of)
    return build_dag(make_plan(_raw(tp=1, dp=1)))


def test_a_replicated_template_off_its_chips_or_prefix_or_not_compute_is_refused(monkeypatch):
    def off_chip(ctx, lop, chips):
        return Fragment.replicated(_compute("t", 0), lop.prefix, (0, 7))

    with pytest.raises(DagError, match=r"placed on chip 7, outside 0..0"):
        _plugin_dag(monkeypatch, off_chip)

    def bad_prefix(ctx, lop, chips):
        return Fragment.replicated(_compute("t", 0), "Z999.x", chips)

    with pytest.raises(DagError, match="does not start with its logical op's prefix"):
        _plugin_dag(monkeypatch, bad_prefix)

    def comm_template(ctx, lop, chips):
        op = CommOp(key="t", primitive="p2p", group=(0, 1), bytes_per_rank=1.0, reason="r", layer=0, name="n")
        return Fragment.replicated(op, lop.prefix, chips)

    with pytest.raises(PluginError, match="needs a ComputeOp template"):
        _plugin_dag(monkeypatch, comm_template)


def test_a_replicated_key_made_twice_names_both_owners(monkeypatch):
    def twice(ctx, lop, chips):
        if not chips:
            return Fragment(ops=())
        rep = Fragment.replicated(_compute("t", 0, owner="other"), lop.prefix, chips).repeated
        return Fragment(ops=[_compute(lop.key(chips[0]), chips[0])], repeated=rep)

    with pytest.raises(DagError, match=r"made twice \(by other and core\)"):
        _plugin_dag(monkeypatch, twice)


def test_a_columnar_run_reports_what_the_engine_recorded_on_a_cp_ring():
    sim = simulate_plan(make_plan(_raw(tp=2, dp=1, cp=2, seq_len=1024)), symmetry=False)
    assert all(v == 0 for v in sim.kpis.values())
    comm = [i for i, op in enumerate(sim.dag.ops) if isinstance(op, CommOp)]
    assert comm == sim.dag.comm_indices() and comm
    assert [sim.compiled.is_comm[i] for i in range(len(sim.dag))] == [sim.dag.is_comm(i) for i in range(len(sim.dag))]
