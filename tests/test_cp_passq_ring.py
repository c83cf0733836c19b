"""The ring form of pass-Q decode (``plugins: {cp_passq: {form: ring}}``): its DAG per layer
and CP group, its bytes by the formulas of g5plugins.cp_passq, the batch padded to a
multiple of cp, and the trend against the spec's gather form."""
from __future__ import annotations

import functools

import pytest

from g5core.api.errors import ConfigError
from g5core.build.dag import CommOp, ComputeOp
from g5core.sim.run import run
from g5plugins.cp_passq import (
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
