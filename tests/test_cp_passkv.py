"""Pass-KV (context-parallel prefill) acceptance tests, spec v1.1.1.

Rows covered: byte conservation (the pass-KV bytes each rank sends per layer, summed from
the DAG's CommOps and from the compiled flows, equal ``(cp-1) * (S/cp) * c_kv`` exactly),
the prefill DAG structure (cp ring-step computes of ``F_attn/cp^2`` FLOPs plus cp-1 P2Ps
per layer and rank, the internal edge set equal to the dependency contract, no edge from a
ring-step compute to a P2P), the prefill memory split, and the six conservation KPIs on
every run. Models are tiny Hugging Face configs (2-3 layers) derived from tests/data/hf.
"""
from __future__ import annotations

import math
import re

import pytest

from g5core.api.ops import CommOp, ComputeOp
from g5core.lower.flops import causal_attention_flops
from g5core.session.run import make_plan, run
from g5plugins.cp.passkv import passkv_bytes_per_rank_per_layer

from cp_helpers import (
    assert_kpis_zero, literal_c_kv_bytes, literal_kv_cache_bytes, literal_head_dims, raw_config, simulate_raw, single_compute_key,
    tiny_models_fixture,
)

STEP_RE = re.compile(r"^L(\d{3})\.attention\.step(\d+)@c(\d+)$")
P2P_RE = re.compile(r"^L(\d{3})\.attention\.p2p(\d+)@c(\d+)->c(\d+)$")

# kind -> (path to a tiny HF config, the config dict). ``*3`` variants have 3 layers.
models = tiny_models_fixture("gqa", "mla", "gqa3", "mla3")


# ------------------------------------------------------------------------ byte conservation


def test_c_kv_literals_are_the_models_known_values(models):
    # llama-3.1-8b: 8 KV heads x 128 x 2 (K and V) x 2 bytes; deepseek-v3: (512 + 64) x 2 bytes
    assert literal_c_kv_bytes(models["gqa"][1]) == 4096
    assert literal_c_kv_bytes(models["mla"][1]) == 1152


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("cp,seq_len", [(2, 4096), (4, 8192), (4, 6144), (8, 8192)])
def test_passkv_bytes_sent_per_rank_per_layer_are_exact(models, kind, cp, seq_len):
    path, cfg = models[kind]
    c_kv_bytes = literal_c_kv_bytes(cfg)
    plan, sim = simulate_raw(raw_config(path, cp=cp, seq_len=seq_len))
    dag, compiled = sim.dag, sim.compiled
    n_layers = cfg["num_hidden_layers"]

    expected_literal_bytes = (cp - 1) * (seq_len // cp) * c_kv_bytes
    expected_code_bytes = passkv_bytes_per_rank_per_layer(seq_len, cp, c_kv_bytes, batch=1)
    assert expected_code_bytes == expected_literal_bytes

    passkv = dag.comm_ops("cp_passkv")
    assert passkv, "cp > 1 prefill made no cp_passkv communication"
    assert all(op.primitive == "p2p" and len(op.group) == 2 for op in passkv)
    assert {op.layer for op in passkv} == set(range(n_layers))

    ops_sent: dict = {}
    ops_received: dict = {}
    for op in passkv:
        src, dst = op.group
        ops_sent[(op.layer, src)] = ops_sent.get((op.layer, src), 0.0) + op.bytes_per_rank
        ops_received[(op.layer, dst)] = ops_received.get((op.layer, dst), 0.0) + op.bytes_per_rank
    flows_sent: dict = {}
    for f, op_id in enumerate(compiled.flow_op):
        op = dag.ops[op_id]
        if isinstance(op, CommOp) and op.reason == "cp_passkv":
            key = (op.layer, compiled.flow_src[f])
            flows_sent[key] = flows_sent.get(key, 0.0) + compiled.flow_bytes[f]

    chips = plan.ctx.all_chips
    for layer in range(n_layers):
        for chip in chips:
            assert ops_sent.get((layer, chip)) == expected_literal_bytes, (layer, chip)
            assert ops_received.get((layer, chip)) == expected_literal_bytes, (layer, chip)
            assert flows_sent.get((layer, chip)) == expected_literal_bytes, (layer, chip)
    # the run's own report: busiest rank over all layers
    assert sim.comm_bytes["per_rank_by_reason"]["cp_passkv"] == n_layers * expected_literal_bytes
    assert sim.comm_bytes["by_reason"]["cp_passkv"] == n_layers * len(chips) * expected_literal_bytes


def test_passkv_formula_matches_literal_on_a_grid():
    for cp in (2, 3, 4, 8, 16):
        for seq_len in (2 * cp, 1024 * cp, 131072):
            if seq_len % (2 * cp):
                continue
            for c_kv_bytes in (1152, 4096, 320):
                for batch in (1, 3):
                    literal = batch * (cp - 1) * (seq_len // cp) * c_kv_bytes
                    assert passkv_bytes_per_rank_per_layer(seq_len, cp, c_kv_bytes, batch=batch) == literal


# --------------------------------------------------------------------------- DAG structure


def _ring_ops(dag, layer: int):
    """compute[(chip, step)] and p2p[(src, step)] -> op of one layer's pass-KV ring."""
    compute, p2p = {}, {}
    for op in dag.ops:
        if op.layer != layer or op.owner != "cp_passkv":
            continue
        if isinstance(op, ComputeOp):
            m = STEP_RE.match(op.key)
            assert m, f"ring-step compute op key {op.key!r} does not name its step"
            assert int(m.group(3)) == op.chip
            assert (op.chip, int(m.group(2))) not in compute
            compute[(op.chip, int(m.group(2)))] = op
        else:
            m = P2P_RE.match(op.key)
            assert m, f"ring P2P op key {op.key!r} does not name its step"
            assert (int(m.group(3)), int(m.group(4))) == tuple(op.group)
            assert (op.group[0], int(m.group(2))) not in p2p
            p2p[(op.group[0], int(m.group(2)))] = op
    return compute, p2p


@pytest.mark.parametrize("kind,cp,dp,tp,seq_len", [
    ("gqa", 4, 1, 1, 8192),
    ("gqa", 3, 1, 1, 6144),
    ("mla", 2, 1, 1, 4096),
    ("mla", 8, 1, 1, 8192),
    ("gqa", 2, 2, 2, 4096),   # two CP groups (dp) of TP pairs: rings stay inside their group
])
def test_prefill_ring_structure_matches_the_contract(models, kind, cp, dp, tp, seq_len):
    path, cfg = models[kind]
    plan, sim = simulate_raw(raw_config(path, cp=cp, dp=dp, tp=tp, seq_len=seq_len))
    dag = sim.dag
    rankmap = plan.ctx.rankmap
    d_qk, d_v = literal_head_dims(cfg, "prefill")
    n_heads_local = cfg["num_attention_heads"] / tp
    f_attn = causal_attention_flops(1, seq_len, n_heads_local, d_qk, d_v)
    step_flops = f_attn / cp ** 2
    c_kv_local_bytes = literal_c_kv_bytes(cfg) / (min(tp, cfg["num_key_value_heads"]) if kind == "gqa" else 1)
    rings = rankmap.groups("cp")
    assert len(rings) == dp * tp and all(len(r) == cp for r in rings)
    # ring order is the cp rank
    for ring in rings:
        assert [rankmap.coords(c)["cp"] for c in ring] == list(range(cp))

    for layer in range(cfg["num_hidden_layers"]):
        compute, p2p = _ring_ops(dag, layer)
        # every attention op of the layer is the ring's: the core made none
        attention = [op for op in dag.ops if op.layer == layer and op.name == "attention"]
        assert all(op.owner == "cp_passkv" for op in attention)
        assert len(attention) == len(compute) + len(p2p)
        expected_edges = set()
        for ring in rings:
            for r, chip in enumerate(ring):
                prev, nxt = ring[(r - 1) % cp], ring[(r + 1) % cp]
                steps = sorted(i for (c, i) in compute if c == chip)
                sends = sorted(i for (c, i) in p2p if c == chip)
                assert steps == list(range(cp)), (layer, chip, steps)
                assert sends == list(range(cp - 1)), (layer, chip, sends)
                for i in range(cp):
                    op = compute[(chip, i)]
                    assert op.op_class == "attention"
                    assert op.flops == step_flops
                for i in range(cp - 1):
                    op = p2p[(chip, i)]
                    assert op.primitive == "p2p" and op.reason == "cp_passkv"
                    assert tuple(op.group) == (chip, nxt)
                    assert op.bytes_per_rank == (seq_len // cp) * c_kv_local_bytes
                for i in range(1, cp):
                    expected_edges.add((p2p[(prev, i - 1)].key, compute[(chip, i)].key))
                for i in range(1, cp - 1):
                    expected_edges.add((p2p[(prev, i - 1)].key, p2p[(chip, i)].key))
                # external dependencies: the ring's heads need the local Q/K/V, the next
                # op needs every step of the chip
                qkv = single_compute_key(dag, "qkv_proj", layer, chip)
                o_proj = single_compute_key(dag, "o_proj", layer, chip)
                assert dag.predecessors(compute[(chip, 0)].key) == [qkv]
                assert dag.predecessors(p2p[(chip, 0)].key) == [qkv]
                for i in range(1, cp):
                    assert dag.predecessors(compute[(chip, i)].key) == [p2p[(prev, i - 1)].key]
                for i in range(1, cp - 1):
                    assert dag.predecessors(p2p[(chip, i)].key) == [p2p[(prev, i - 1)].key]
                assert set(dag.predecessors(o_proj)) == {compute[(chip, i)].key for i in range(cp)}
        assert len(compute) == len(plan.ctx.all_chips) * cp
        assert len(p2p) == len(plan.ctx.all_chips) * (cp - 1)
        ring_keys = {op.key for op in compute.values()} | {op.key for op in p2p.values()}
        internal = {(u, v) for u, v in dag.graph.edges if u in ring_keys and v in ring_keys}
        assert internal == expected_edges

    # no edge, anywhere, from a ring-step compute to a P2P (it would serialise the ring)
    for u, v in dag.graph.edges:
        a, b = dag.graph.nodes[u]["op"], dag.graph.nodes[v]["op"]
        if isinstance(a, ComputeOp) and a.owner == "cp_passkv":
            assert not isinstance(b, CommOp), f"forbidden edge {u} -> {v}"


def test_ring_step_flops_add_up_to_one_cp_share_of_f_attn(models):
    path, cfg = models["gqa"]
    cp, seq_len = 4, 8192
    plan, sim = simulate_raw(raw_config(path, cp=cp, seq_len=seq_len))
    d_qk, d_v = literal_head_dims(cfg, "prefill")
    # F_attn written out: b * S^2 * n_h * (d_qk + d_v) (causal: half the score matrix, x2 FLOPs/MAC)
    f_attn_literal = 1 * seq_len * seq_len * cfg["num_attention_heads"] * (d_qk + d_v)
    assert causal_attention_flops(1, seq_len, cfg["num_attention_heads"], d_qk, d_v) == f_attn_literal
    for chip in plan.ctx.all_chips:
        steps = [op for op in sim.dag.ops if isinstance(op, ComputeOp) and op.owner == "cp_passkv"
                 and op.layer == 0 and op.chip == chip]
        assert math.fsum(op.flops for op in steps) == f_attn_literal / cp


# ---------------------------------------------------------------------------- memory split


@pytest.mark.parametrize("kind", ["gqa3", "mla3"])
@pytest.mark.parametrize("cp,pp,batch", [(2, 1, 1), (4, 1, 2), (2, 2, 1), (4, 2, 3)])
def test_prefill_kv_per_rank_is_split_by_cp(models, kind, cp, pp, batch):
    path, cfg = models[kind]
    seq_len = 8192
    out = run(raw_config(path, cp=cp, pp=pp, batch=batch, seq_len=seq_len))
    assert_kpis_zero(out.sim)
    rankmap = out.plan.ctx.rankmap
    for chip_mem in out.memory.per_chip:
        expected_bytes = literal_kv_cache_bytes(cfg, batch=batch, seq_len=seq_len, cp=cp, pp=pp,
                                                stage=rankmap.coords(chip_mem.chip)["pp"])
        assert chip_mem.kv_cache_bytes == expected_bytes, chip_mem
    # and the cp=1 ledger holds exactly cp times as much on every chip
    ref = run(raw_config(path, cp=1, pp=pp, batch=batch, seq_len=seq_len))
    by_stage = {}
    for chip_mem in ref.memory.per_chip:
        by_stage[ref.plan.ctx.rankmap.coords(chip_mem.chip)["pp"]] = chip_mem.kv_cache_bytes
    for chip_mem in out.memory.per_chip:
        assert chip_mem.kv_cache_bytes * cp == by_stage[rankmap.coords(chip_mem.chip)["pp"]]


def test_ring_buffer_workspace_is_the_received_blocks_of_one_layer(models):
    """The ring may run ahead of compute, so all cp-1 received blocks can be resident."""
    from g5core.sim.memory import memory_report

    path, cfg = models["gqa"]
    cp, seq_len = 4, 8192
    plan = make_plan(raw_config(path, cp=cp, seq_len=seq_len, batch=2))
    terms = {t.name: t for t in memory_report(plan.ctx).terms}
    expected = (cp - 1) * 2 * (seq_len // cp) * literal_c_kv_bytes(cfg)
    assert {b for _, b in terms["cp_ring_buffers"].bytes_per_chip} == {expected}
    assert terms["cp_ring_buffers"].category == "workspace"
    decode = make_plan(raw_config(path, cp=cp, seq_len=seq_len, phase="decode"))
    assert "cp_ring_buffers" not in {t.name for t in memory_report(decode.ctx).terms}
