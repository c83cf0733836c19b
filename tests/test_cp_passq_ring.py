"""The ring form of pass-Q (``plugins: {cp_passq: {form: ring}}``): in decode its DAG per layer
and CP group, its bytes by the formulas of g5plugins.cp.passq, the batch padded to a
multiple of cp, and the trend against the spec's gather form; in partial prefill (pass_q) its
DAG with the merge after the return all-to-all; the ring buffers in the memory ledger."""
from __future__ import annotations

import functools

import pytest

from g5core.api.errors import ConfigError
from g5core.lower.dag import CommOp, ComputeOp
from g5core.session.run import make_plan, run
from g5plugins.cp.passq import (
    queries_per_rank, reduce_bytes_per_rank, ring_a2a_bytes_per_rank, ring_step_bytes,
)

from cp_helpers import BF16_BYTES, assert_kpis_zero, literal_head_dims, simulate_raw, tiny_models_fixture
from cp_helpers import raw_config as _raw_config

models = tiny_models_fixture("gqa", "mla")


def ring_config(path, **kw):
    return _raw_config(path, phase="decode", plugins={"cp_passq": {"form": "ring"}}, **kw)


def test_bytes_follow_the_formulas_and_batch_1_pads_to_cp():
    assert queries_per_rank(1, 4) == 1 and queries_per_rank(5, 4) == 2 and queries_per_rank(8, 4) == 2
    assert ring_step_bytes(2, 4096, 2) == 2 * 4096 * 2
    # the all-to-all's send buffer: cp peers x q queries x (n_h d_v + 2 n_h) elements
    assert ring_a2a_bytes_per_rank(2, 4, 32, 128, 2) == 4 * 2 * (32 * 128 + 2 * 32) * 2
    assert ring_a2a_bytes_per_rank(1, 4, 32, 128, 2) == 4 * reduce_bytes_per_rank(1, 32, 128, 2)


@pytest.mark.parametrize("kind,cp,batch", [("gqa", 4, 1), ("mla", 4, 1), ("gqa", 2, 3)])
def test_ring_form_structure_and_bytes(models, kind, cp, batch):
    path, cfg = models[kind]
    plan, sim = simulate_raw(ring_config(path, cp=cp, batch=batch, seq_len=8192))
    assert_kpis_zero(sim)
    dag = sim.dag
    (group,) = plan.ctx.rankmap.groups("cp")
    q = queries_per_rank(batch, cp)
    n_h = cfg["num_attention_heads"]
    # the partial's value width: v_head_dim for MLA (up-projected before sending), head_dim for GQA
    d_v = cfg["v_head_dim"] if "kv_lora_rank" in cfg else literal_head_dims(cfg, "decode")[1]
    ops = [op for op in dag.ops if op.layer == 0 and op.name == "attention"]
    sends = [op for op in ops if isinstance(op, CommOp) and op.primitive == "p2p"]
    (a2a,) = [op for op in ops if isinstance(op, CommOp) and op.primitive == "all_to_all"]
    steps = [op for op in ops if isinstance(op, ComputeOp) and ".step" in op.key]
    merges = [op for op in ops if isinstance(op, ComputeOp) and ".merge" in op.key]
    # cp partials and cp - 1 sends per rank, one all-to-all, one merge per rank
    assert len(steps) == cp * cp and len(sends) == cp * (cp - 1) and len(merges) == cp
    assert all(op.bytes_per_rank == ring_step_bytes(q, cfg["hidden_size"], BF16_BYTES) for op in sends)
    assert {op.reason for op in sends} == {"cp_passq_ring"} and a2a.reason == "cp_passq_a2a"
    assert a2a.bytes_per_rank == ring_a2a_bytes_per_rank(q, cp, n_h, d_v, BF16_BYTES)
    assert a2a.group == tuple(group)
    for r, chip in enumerate(group):
        nxt = group[(r + 1) % cp]
        mine = sorted((op for op in sends if op.group[0] == chip), key=lambda o: o.key)
        assert {op.group for op in mine} == {(chip, nxt)}
        # each partial runs q padded queries (batch 1 pads to cp: one per rank)
        step0 = next(op for op in steps if op.chip == chip and ".step00" in op.key)
        assert step0.kernels[0].batch == q
    # dependencies: every partial -> the all-to-all -> every merge; step i <- the previous rank's send i-1
    preds = {k for k in dag.predecessors(a2a.key)}
    assert preds == {op.key for op in steps}
    for m in merges:
        assert dag.predecessors(m.key) == [a2a.key]
        assert any(isinstance(k, object) and getattr(k, "kind", "") == "attn_merge" and k.parts == cp
                   for k in m.kernels)
    for op in steps:
        i = int(op.key.split(".step")[1][:2])
        if i:
            (pred,) = [p for p in dag.predecessors(op.key)]
            assert pred.endswith(f"p2p{i - 1:02d}@c{group[(group.index(op.chip) - 1) % cp]}->c{op.chip}")


def test_a_bad_form_is_one_clear_error(models):
    path, _ = models["gqa"]
    raw = _raw_config(path, phase="decode", cp=2, plugins={"cp_passq": {"form": "rings"}})
    with pytest.raises(ConfigError, match="plugins.cp_passq.form"):
        run(raw)


def test_ring_decode_over_two_nodes_costs_more_than_the_gather_form_at_batch_1():
    base = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 16, "phase": "decode", "batch": 1,
            "seq_len": 131072, "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 16}}
    gather = run(base)
    ring = run(dict(base, plugins={"cp_passq": {"form": "ring"}}))
    assert_kpis_zero(ring.sim)
    assert ring.latency_s > gather.latency_s


# ------------------------------------------------------------------------------ memory
def test_ring_buffers_are_the_query_blocks_in_flight_and_both_all_to_all_buffers():
    from g5core.sim.memory import memory_report
    from g5plugins.cp.passq import ring_buffer_bytes

    assert ring_buffer_bytes(100.0, 4, 1000.0) == 3 * 100.0 + 2 * 1000.0
    assert ring_buffer_bytes(100.0, 1, 1000.0) == 2000.0
    base = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 8, "phase": "decode", "batch": 5,
            "seq_len": 65536, "parallel": {"dp": 1, "tp": 2, "pp": 1, "cp": 4}}
    ring = make_plan(dict(base, plugins={"cp_passq": {"form": "ring"}}))
    terms = {t.name: t for t in memory_report(ring.ctx).terms}
    term = terms["cp_passq_buffers"]
    q, n_h, d, d_h = 2, 32 // 2, 4096 // 2, 128        # 5 sequences over cp 4: 2 each; one TP rank's heads
    step, a2a = q * d * BF16_BYTES, 4 * q * (n_h * d_h + 2 * n_h) * BF16_BYTES
    assert ring_step_bytes(q, 4096 / 2, BF16_BYTES) == step and ring_a2a_bytes_per_rank(q, 4, n_h, d_h, BF16_BYTES) == a2a
    assert term.category == "workspace" and dict(term.bytes_per_chip) == {c: 3 * step + 2 * a2a for c in range(8)}
    gather = make_plan(base)
    assert "cp_passq_buffers" not in {t.name for t in memory_report(gather.ctx).terms}


# ------------------------------------------------------------------------------ the prefill ring form
PREFILL = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 8, "parallel": {"dp": 1, "tp": 2, "pp": 1, "cp": 4},
           "step": [{"new_tokens": 8192, "cached_tokens": 57344, "count": 2}]}


def _prefill(form):
    return simulate_raw(dict(PREFILL, plugins={"cp": {"prefill": "pass_q"}, "cp_passq": {"form": form}}))


def _merges(op):
    return [k for k in op.kernels if getattr(k, "kind", "") == "attn_merge"]


def test_prefill_ring_form_structure_bytes_and_merge_after_the_return():
    from g5plugins.cp.passq import query_block_bytes, return_buffer_bytes

    plan, sim = _prefill("ring")
    cp, t, count, e = 4, 8192, 2, BF16_BYTES
    n_h, d_h = 32 // 2, 128
    dag = sim.dag
    for group in plan.ctx.rankmap.groups("cp"):
        ops = [op for op in dag.ops if op.layer == 0 and op.name == "attention"
               and (op.group[0] if isinstance(op, CommOp) else op.chip) in group]
        sends = [op for op in ops if isinstance(op, CommOp) and op.primitive == "p2p"]
        (back,) = [op for op in ops if isinstance(op, CommOp) and op.primitive == "all_to_all"]
        steps = [op for op in ops if isinstance(op, ComputeOp) and ".step" in op.key]
        merges = [op for op in ops if isinstance(op, ComputeOp) and ".merge" in op.key]
        assert len(steps) == cp * cp and len(sends) == cp * (cp - 1) and len(merges) == cp
        # bytes: one rank's T/cp queries of each sequence; the return buffer of every rank's partials
        assert {op.bytes_per_rank for op in sends} == {count * t / cp * n_h * d_h * e}
        assert back.bytes_per_rank == count * t * (n_h * d_h + 2 * n_h) * e
        assert back.reason == "cp_passq_prefill_return" and {op.reason for op in sends} == {"cp_passq_prefill"}
        assert back.group == tuple(group)
        # no step merges; the return waits for every step, each merge for the return only
        assert not any(_merges(op) for op in steps)
        assert set(dag.predecessors(back.key)) == {op.key for op in steps}
        for m in merges:
            assert dag.predecessors(m.key) == [back.key]
            (k,) = _merges(m)
            assert k.parts == cp and k.kind == "attn_merge"
        for op in steps:
            i = int(op.key.split(".step")[1][:2])
            if i:
                (pred,) = dag.predecessors(op.key)
                assert pred.endswith(f"p2p{i - 1:02d}@c{group[(group.index(op.chip) - 1) % cp]}->c{op.chip}")
    assert query_block_bytes(plan.ctx) == count * t / cp * n_h * d_h * e
    assert return_buffer_bytes(plan.ctx) == count * t * (n_h * d_h + 2 * n_h) * e


def test_prefill_forms_move_the_same_bytes_and_the_gather_form_merges_in_its_last_step():
    plan_g, gather = _prefill("gather")
    plan_r, ring = _prefill("ring")
    assert gather.comm_bytes == ring.comm_bytes
    last = [op for op in gather.dag.ops if op.layer == 0 and ".step03" in op.key and op.owner == "cp_passq"]
    assert last and all(_merges(op) for op in last)
    assert not [op for op in gather.dag.ops if op.layer == 0 and ".merge" in op.key and op.owner == "cp_passq"]
    # the same merge kernels, in the step or after the return
    ring_merges = [op for op in ring.dag.ops if op.layer == 0 and ".merge" in op.key and op.owner == "cp_passq"]
    assert sorted(k.flops for op in last for k in _merges(op)) == sorted(k.flops for op in ring_merges
                                                                         for k in _merges(op))


def test_prefill_pass_q_declares_its_ring_buffers():
    from g5core.sim.memory import memory_report
    from g5plugins.cp.passq import query_block_bytes, return_buffer_bytes, ring_buffer_bytes

    for form in ("gather", "ring"):
        plan = make_plan(dict(PREFILL, plugins={"cp": {"prefill": "pass_q"}, "cp_passq": {"form": form}}))
        term = {t.name: t for t in memory_report(plan.ctx).terms}["cp_passq_buffers"]
        expected = ring_buffer_bytes(query_block_bytes(plan.ctx), 4, return_buffer_bytes(plan.ctx))
        assert dict(term.bytes_per_chip) == {c: expected for c in range(8)}
    kv = make_plan(dict(PREFILL, plugins={"cp": {"prefill": "pass_kv"}}))
    assert "cp_passq_buffers" not in {t.name for t in memory_report(kv.ctx).terms}
