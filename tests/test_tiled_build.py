"""Fragment.tiled and the op-id build (issue 13): a tiled fragment builds exactly the op DAG
the per-op API builds (same op ids, keys, chips, specs and edges, in the same order), keys
are made only when asked for, and the build's checks still name what is wrong."""
from __future__ import annotations

import attrs
import numpy as np
import pytest

from g5core import CommOp, ComputeOp, DagError, Fragment
from g5core.lower.builder import _prefix_free, build_dag
from g5core.api.ops import KEY_GROUP, KEY_PAIR, KEY_VERBATIM, join_key, split_key
from g5core.lower.dag import OpDag
from g5core.api.work import LogicalOp
from g5core.lower.layers import build_program
from g5core.session.run import make_plan
from plugin_sets import THIRD_PARTY
import plugins.cp.passkv as passkv
import plugins.tp as tp


def _raw(tp=2, dp=2, cp=4, seq_len=2048, **extra):
    return dict({"model": "llama-3.1-8b", "system": "h100-sxm", "chips": tp * dp * cp,
                 "parallel": {"dp": dp, "tp": tp, "pp": 1, "cp": cp}, "phase": "prefill", "batch": 1,
                 "seq_len": seq_len}, **extra)


# The per-op expansions of cp_passkv and tp, as they were before Fragment.tiled: one object
# per op, ring by ring (group by group) on the real chips, from the same per-ring (per-group)
# function the plugins now make their template with.

def _per_op_passkv(ctx, lop):
    work, nbytes = passkv.ring_parts(ctx)
    return Fragment.combine(passkv.ring_fragment(ctx, lop, ring, work, nbytes) for ring in passkv.placed_rings(ctx, lop))


def _per_op_tp(ctx, lop):
    collective = tp.collective_of(ctx, lop)
    return Fragment.combine(tp.group_fragment(ctx, lop, group, collective) for group in tp._tp_groups(ctx, ctx.place(lop)))


def _columns(dag: OpDag) -> dict:
    return {"keys": list(dag.keys), "chip": list(dag.chip), "layer": list(dag.layer), "spec": list(dag.spec),
            "specs": dag.specs, "spec_is_comm": dag.spec_is_comm, "edges": list(dag.edge_pairs)}


@pytest.mark.parametrize("raw", [
    _raw(),                                                               # rings of 4 ranks, tp pairs, 2 replicas
    _raw(tp=1, dp=1, cp=8, seq_len=4096),                                 # one ring over a whole node
    dict(_raw(tp=2, dp=1, cp=2), parallel={"dp": 1, "tp": 2, "pp": 2, "cp": 2}, chips=8),  # rings per stage
    _raw(tp=4, dp=1, cp=1, plugins={"tp": {"sp": True}}),                # reduce-scatter + all-gather
])
def test_tiled_plugins_build_exactly_what_their_per_op_expansion_builds(raw, monkeypatch):
    import g5core.lower.builder as build

    plan = make_plan(raw, disabled=THIRD_PARTY)
    tiled = build_dag(plan)
    expand = build.expand

    def per_op(ctx, lop):
        owner, frag = expand(ctx, lop)
        if owner in ("cp_passkv", "tp"):
            assert frag.repeated is not None and frag.plain
            frag = _per_op_passkv(ctx, lop) if owner == "cp_passkv" else _per_op_tp(ctx, lop)
            assert frag.repeated is None
        return owner, frag

    monkeypatch.setattr(build, "expand", per_op)
    reference = build_dag(plan)
    assert _columns(tiled) == _columns(reference)
    assert {tiled.owner(i) for i in range(len(tiled))} >= ({"tp"} if plan.ctx.size("tp") > 1 else set()) | (
        {"cp_passkv"} if plan.ctx.size("cp") > 1 else set())
    assert [tiled.op(i) for i in range(len(tiled))] == [reference.op(i) for i in range(len(reference))]


def _ring_template(prefix="L000.attention", m=3):
    """A ring on slots 0..m-1: a compute op per slot, a p2p to the next slot that waits for it."""
    ops, edges = [], []
    for s in range(m):
        c = ComputeOp(key=f"{prefix}.step@c{s}", chip=s, op_class="attention", flops=1.0, hbm_bytes=2.0, layer=0,
                      name="attention", dtype="bf16", owner="ring", kernels=())
        p = CommOp(key=f"{prefix}.p2p@c{s}->c{(s + 1) % m}", primitive="p2p", group=(s, (s + 1) % m),
                   bytes_per_rank=8.0, reason="ring", layer=0, name="attention", owner="ring")
        ops += [c, p]
        edges.append((c.key, p.key))
    heads = {s: (ops[2 * s].key,) for s in range(m)}
    tails = {s: (ops[2 * s + 1].key, ops[2 * s].key) for s in range(m)}
    return Fragment(ops=ops, edges=edges, heads=heads, tails=tails)


def test_a_tiled_fragment_reads_as_the_per_op_fragment_it_stands_for():
    tiles = [(4, 5, 6), (1, 0, 2)]
    frag = Fragment.tiled(_ring_template(), tiles)
    keys = [op.key for op in frag.ops]
    assert keys == ["L000.attention.step@c4", "L000.attention.p2p@c4->c5", "L000.attention.step@c5",
                    "L000.attention.p2p@c5->c6", "L000.attention.step@c6", "L000.attention.p2p@c6->c4",
                    "L000.attention.step@c1", "L000.attention.p2p@c1->c0", "L000.attention.step@c0",
                    "L000.attention.p2p@c0->c2", "L000.attention.step@c2", "L000.attention.p2p@c2->c1"]
    assert [op.chips for op in frag.ops][:2] == [(4,), (4, 5)]
    assert frag.edges[0] == ("L000.attention.step@c4", "L000.attention.p2p@c4->c5") and len(frag.edges) == 6
    assert dict(frag.heads)[0] == ("L000.attention.step@c0",)
    assert dict(frag.tails)[6] == ("L000.attention.p2p@c6->c4", "L000.attention.step@c6")
    assert [c for c, _ in frag.heads] == [0, 1, 2, 4, 5, 6]
    with pytest.raises(DagError, match="a chip is in two tiles"):
        Fragment.tiled(_ring_template(), [(0, 1, 2), (2, 3, 4)])
    with pytest.raises(DagError, match="tiles differ in length"):
        Fragment.tiled(_ring_template(), [(0, 1, 2), (3, 4)])
    for bad in ([(0, 1, 2.0)], [(0, True, 2)]):
        with pytest.raises(DagError, match="tiles must be tuples of chip numbers"):
            Fragment.tiled(_ring_template(), bad)
    assert Fragment.tiled(_ring_template(), np.array([[4, 5, 6], [1, 0, 2]])) == frag


def _plan_with(monkeypatch, frag_of, raw=None):
    """A plan whose core default fragment is ``frag_of(ctx, lop, chips)``."""
    import g5core.lower.builder as build

    monkeypatch.setattr(build, "default_fragment", frag_of)
    return make_plan(raw or _raw(tp=1, dp=1, cp=1), disabled=THIRD_PARTY)


def test_a_tiled_fragment_builds_with_its_heads_fed_and_its_tails_passed_on(monkeypatch):
    def frag_of(ctx, lop, chips):
        if lop.kind == "attention":
            return Fragment.tiled(_ring_template(lop.prefix, m=2), [(1, 0)])
        return Fragment.replicated(ComputeOp(key="t", chip=0, op_class="gemm", flops=1.0, hbm_bytes=1.0,
                                             layer=lop.layer, name=lop.kind, dtype="bf16", kernels=()),
                                   lop.prefix, chips)

    dag = build_dag(_plan_with(monkeypatch, frag_of, _raw(tp=1, dp=2, cp=1)))
    index = dag.index
    step = index["L000.attention.step@c1"]
    assert dag.predecessors("L000.attention.step@c1") == ["L000.qkv_proj@c1"]
    # both tails on chip 0 feed the next logical op there, in the order named
    assert dag.predecessors("L000.o_proj@c0") == ["L000.attention.p2p@c0->c1", "L000.attention.step@c0"]
    assert dag.successors("L000.attention.p2p@c1->c0") == ["L000.o_proj@c1"]
    assert dag.op_chips(index["L000.attention.p2p@c1->c0"]) == (1, 0) and dag.chip[step] == 1


@pytest.mark.parametrize("bad, message", [
    (lambda t: attrs.evolve(t, ops=(attrs.evolve(t._ops[0], key="L000.attention.step"),) + t._ops[1:],
                            edges=(), heads={}, tails={}),
     "is not keyed on its slots"),
    (lambda t: attrs.evolve(t, ops=(attrs.evolve(t._ops[0], chip=5),) + t._ops[1:]), r"on slot 5, outside 0..2"),
    (lambda t: attrs.evolve(t, edges=(("L000.attention.step@c0", "nowhere"),)), "between ops it does not own"),
    (lambda t: attrs.evolve(t, heads={0: ("nowhere",)}), "names head 'nowhere', which it did not make"),
    (lambda t: attrs.evolve(t, tails={0: ("nowhere",)}), "names tail 'nowhere', which it did not make"),
    (lambda t: attrs.evolve(t, ops=t._ops + (t._ops[0],)), r"made twice \(by ring and ring\)"),
    (lambda t: Fragment(ops=[attrs.evolve(op, key=op.key.replace("L000.attention", "L000.other"))
                             for op in t._ops]), "does not start with its logical op's prefix"),
])
def test_a_bad_tiled_template_is_refused_naming_what_is_wrong(monkeypatch, bad, message):
    def frag_of(ctx, lop, chips):
        if lop.kind == "attention":
            return Fragment.tiled(bad(_ring_template()), [(0, 1, 2)])
        return Fragment(ops=())

    with pytest.raises(DagError, match=message):
        build_dag(_plan_with(monkeypatch, frag_of, _raw(tp=1, dp=4, cp=1)))


def test_a_tile_chip_out_of_range_is_refused(monkeypatch):
    def frag_of(ctx, lop, chips):
        return Fragment.tiled(_ring_template(lop.prefix), [(0, 1, 9)]) if lop.kind == "attention" else Fragment(ops=())

    with pytest.raises(DagError, match=r"'L000.attention.p2p@c1->c9' made by plugin 'core' is placed on chip 9, outside 0..3"):
        build_dag(_plan_with(monkeypatch, frag_of, _raw(tp=1, dp=4, cp=1)))


def test_keys_are_columns_made_on_demand_and_the_index_on_first_use():
    dag = OpDag()
    made = [
        ComputeOp(key="L001.ffn@c12", chip=12, op_class="gemm", flops=1.0, hbm_bytes=1.0, layer=1, name="ffn",
                  dtype="bf16", kernels=()),
        CommOp(key="L001.x.p2p@c3->c4", primitive="p2p", group=(3, 4), bytes_per_rank=1.0, reason="r", layer=1,
               name="x"),
        CommOp(key="L001.x.ar@g0-1-2", primitive="all_reduce", group=(0, 1, 2), bytes_per_rank=1.0, reason="r",
               layer=1, name="x"),
        ComputeOp(key="odd key", chip=0, op_class="gemm", flops=1.0, hbm_bytes=1.0, layer=1, name="ffn",
                  dtype="bf16", kernels=()),
        ComputeOp(key="L001.ffn@c05", chip=5, op_class="gemm", flops=1.0, hbm_bytes=1.0, layer=1, name="ffn",
                  dtype="bf16", kernels=()),
    ]
    for op in made:
        dag.append(op)
    assert not dag._index and dag._indexed == 0        # nothing made yet
    assert list(dag.keys) == [op.key for op in made] and dag.keys[-1] == "L001.ffn@c05"
    assert list(dag.key_arg) == [12, KEY_PAIR, KEY_GROUP, KEY_VERBATIM, KEY_VERBATIM - 1]
    assert dag.stems == ["L001.ffn", "L001.x.p2p", "L001.x.ar"] and dag.odd_keys == ["odd key", "L001.ffn@c05"]
    assert dag.index["L001.x.ar@g0-1-2"] == 2 and len(dag.index) == 5 and dag.keys.index("odd key") == 3
    with pytest.raises(TypeError):
        dag.index["new"] = 9                           # read-only
    dag.add_op(attrs.evolve(made[0], key="L001.ffn@c13", chip=13))
    assert dag.index["L001.ffn@c13"] == 5 and "L001.ffn@c13" in dag.keys
    with pytest.raises(DagError, match="made twice"):
        dag.add_op(made[1])


@pytest.mark.parametrize("key, group, split", [
    ("L003.attention.step02@c12", None, ("L003.attention.step02", 12)),
    ("a@b@c0", None, ("a@b", 0)),
    ("L0.x@c1->c2", (1, 2), ("L0.x", KEY_PAIR)),
    ("L0.x@c1->c2", (2, 1), ("L0.x@c1->c2", KEY_VERBATIM)),
    ("L0.x@g1-2-3", (1, 2, 3), ("L0.x", KEY_GROUP)),
    ("L0.x@c007", None, ("L0.x@c007", KEY_VERBATIM)),
    ("L0.x@c", None, ("L0.x@c", KEY_VERBATIM)),
    ("L0.x@c\u00b2", None, ("L0.x@c\u00b2", KEY_VERBATIM)),
    ("plain", None, ("plain", KEY_VERBATIM)),
])
def test_split_key_and_join_key_round_trip(key, group, split):
    assert split_key(key, group) == split
    if split[1] != KEY_VERBATIM:
        assert join_key(*split, group) == key


def test_keys_of_two_logical_ops_that_collide_are_found_when_the_program_is_not_prefix_free(monkeypatch):
    program = (LogicalOp("embedding", -1), LogicalOp("a", 0, ("E.embedding",)), LogicalOp("a.b", 0, ("L000.a",)))
    assert not _prefix_free(program) and _prefix_free(program[:2])
    assert _prefix_free(build_program(make_plan(_raw(), disabled=THIRD_PARTY).ctx.model))

    def frag_of(ctx, lop, chips):   # L000.a and L000.a.b both make L000.a.b@c0
        template = ComputeOp(key="t", chip=0, op_class="gemm", flops=1.0, hbm_bytes=1.0, layer=lop.layer,
                             name=lop.kind, dtype="bf16", owner=lop.kind, kernels=())
        return Fragment.replicated(template, "L000.a.b" if lop.layer == 0 else lop.prefix, chips)

    plan = _plan_with(monkeypatch, frag_of)
    with pytest.raises(DagError, match=r"'L000.a.b@c0' made twice \(by a and a.b\)"):
        build_dag(plan, program=program)


def test_outputs_pass_through_a_logical_op_that_makes_nothing_on_a_chip(monkeypatch):
    """A logical op without ops on a chip passes its inputs on there, each producer once."""
    def frag_of(ctx, lop, chips):
        template = ComputeOp(key="t", chip=0, op_class="gemm", flops=1.0, hbm_bytes=1.0, layer=lop.layer,
                             name=lop.kind, dtype="bf16", kernels=())
        return Fragment.replicated(template, lop.prefix, chips if lop.kind != "b" else chips[:1])

    program = (LogicalOp("a", 0), LogicalOp("c", 0), LogicalOp("b", 0, ("L000.a", "L000.c", "L000.a")),
               LogicalOp("d", 0, ("L000.b",)))
    dag = build_dag(_plan_with(monkeypatch, frag_of, _raw(tp=1, dp=2, cp=1)),
                    program=program)
    assert dag.predecessors("L000.d@c0") == ["L000.b@c0"]
    assert dag.predecessors("L000.d@c1") == ["L000.a@c1", "L000.c@c1"]
    pairs = dag.edge_array()
    d1 = dag.index["L000.d@c1"]
    assert [dag.keys[u] for u, v in pairs if v == d1] == ["L000.a@c1", "L000.c@c1"]   # a once, in input order
