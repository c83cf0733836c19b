"""Expert parallelism: all-to-all bytes, expert weights per chip, and the configuration rules.

From the plugins' docstrings: with ``ep > 1`` experts are whole on their EP rank and each
TP rank routes a disjoint ``1/tp`` of its tokens (``moe_tokens = tokens / tp``); dispatch
and combine are all-to-alls whose per-rank buffer is ``moe_tokens x top_k x hidden x dtype``,
of which ``(ep - 1) / ep`` goes to other ranks.
"""
from __future__ import annotations

import pytest

from g5core.lower.builder import build_dag
from g5core.api.ops import CommOp
from g5core.sim.compile import compile_dag
from g5core.api.errors import ConfigError
from g5core.sim.memory import memory_report
from g5core.inputs.models import get_model
from g5core.session.run import make_plan, simulate_plan

BF16_BYTES = 2
MIXTRAL = get_model("mixtral-8x7b")  # 8 routed experts, top-2, hidden 4096, expert FFN 14336


def _raw(model="mixtral-8x7b", dp=1, tp=1, ep=1, phase="prefill", batch=2, seq_len=256):
    """The flat all-to-all with uniform expert load: the EP lowering these tests describe
    (tests/test_ep_deepep.py covers the DeepEP kernels and the load imbalance)."""
    return {"model": model, "system": "h100-sxm", "chips": dp * tp,
            "parallel": {"dp": dp, "tp": tp, "pp": 1, "cp": 1, "ep": ep}, "phase": phase, "batch": batch,
            "seq_len": seq_len, "plugins": {"ep": {"kernel": "flat", "imbalance": 1.0}}}


@pytest.mark.parametrize("dp, tp, ep, phase", [
    (2, 1, 2, "prefill"), (1, 2, 2, "prefill"), (2, 2, 4, "prefill"), (4, 1, 4, "decode"), (1, 4, 4, "decode"),
])
def test_dispatch_and_combine_bytes(dp, tp, ep, phase):
    batch, seq_len = 2, 256
    plan = make_plan(_raw(dp=dp, tp=tp, ep=ep, phase=phase, batch=batch, seq_len=seq_len))
    m = plan.ctx.model
    dag = build_dag(plan)
    compiled = compile_dag(dag, plan)
    tokens = batch * seq_len if phase == "prefill" else batch  # per replica = per TP rank's input
    moe_tokens = tokens / tp  # each TP rank routes a disjoint 1/tp of the tokens
    buffer_bytes = moe_tokens * m.moe.n_active_experts * m.hidden_size * BF16_BYTES
    crossing_bytes_per_rank = (ep - 1) / ep * buffer_bytes
    groups = plan.ctx.rankmap.groups("ep")
    assert len(groups) == dp * tp // ep and all(len(g) == ep for g in groups)
    for reason in ("ep_dispatch", "ep_combine"):
        ops = [(i, op) for i, op in enumerate(dag.ops) if isinstance(op, CommOp) and op.reason == reason]
        assert len(ops) == m.n_layers * len(groups)
        for i, op in ops:
            assert op.primitive == "all_to_all"
            assert op.bytes_per_rank == pytest.approx(buffer_bytes, rel=1e-12)
            sent, received = {}, {}
            for f in range(compiled.flow_ptr[i], compiled.flow_ptr[i + 1]):
                # payload: a flow carries wire bytes, the payload times the op's wire factor
                s, t, b = compiled.flow_src[f], compiled.flow_dst[f], compiled.flow_bytes[f] / compiled.wire_factor[i]
                sent[s] = sent.get(s, 0.0) + b
                received[t] = received.get(t, 0.0) + b
            assert sorted(sent) == sorted(op.group) == sorted(received)
            for rank in op.group:
                assert sent[rank] == pytest.approx(crossing_bytes_per_rank, rel=1e-12)
                assert received[rank] == pytest.approx(crossing_bytes_per_rank, rel=1e-12)


def test_ep_run_has_zero_kpis_and_reports_the_all_to_all_volume():
    dp, tp, ep, batch, seq_len = 1, 2, 2, 1, 128
    sim = simulate_plan(make_plan(_raw(dp=dp, tp=tp, ep=ep, batch=batch, seq_len=seq_len)))
    assert all(v == 0 for v in sim.kpis.values())
    per_rank = (ep - 1) / ep * (batch * seq_len / tp) * 2 * MIXTRAL.hidden_size * BF16_BYTES
    total = per_rank * ep * MIXTRAL.n_layers
    assert sim.comm_bytes["by_reason"]["ep_dispatch"] == pytest.approx(total, rel=1e-12)
    assert sim.comm_bytes["by_reason"]["ep_combine"] == pytest.approx(total, rel=1e-12)


# ------------------------------------------------------------------------------------------
# Weights
# ------------------------------------------------------------------------------------------


def _hand_mixtral_weights_per_chip(tp: int, ep: int) -> float:
    """From the published shapes: attention, embedding and LM head split by tp, norms and
    router replicated, routed experts split by ep (whole experts) or, with ep = 1, column-split by tp."""
    m = MIXTRAL
    d, L, E, f = m.hidden_size, m.n_layers, m.moe.n_routed_experts, m.moe.expert_ffn_dim
    attention = sum(i * o for _, i, o in m.projection_shapes())  # 8 KV heads >= tp: all split by tp
    experts = E / ep * 3 * d * f / (tp if ep == 1 else 1)
    elements = L * (attention / tp + experts + d * E + 2 * d) + 2 * m.vocab_size * d / tp + d
    return elements * BF16_BYTES


@pytest.mark.parametrize("dp, tp, ep", [(1, 1, 1), (2, 1, 2), (4, 1, 4), (8, 1, 8), (1, 2, 1), (1, 2, 2),
                                        (2, 2, 4)])
def test_expert_weights_per_chip_divide_by_ep(dp, tp, ep):
    report = memory_report(make_plan(_raw(dp=dp, tp=tp, ep=ep)).ctx)
    expected = _hand_mixtral_weights_per_chip(tp, ep)
    for chip in report.per_chip:
        assert chip.weights_bytes == pytest.approx(expected, rel=1e-12)


def test_expert_bytes_saved_by_ep_are_exactly_the_experts_moved_away():
    m = MIXTRAL
    expert_bytes_total = m.n_layers * m.moe.n_routed_experts * 3 * m.hidden_size * m.moe.expert_ffn_dim * BF16_BYTES
    w = {ep: memory_report(make_plan(_raw(dp=4, ep=ep)).ctx).per_chip[0].weights_bytes for ep in (1, 2, 4)}
    for ep in (2, 4):
        assert w[1] - w[ep] == pytest.approx(expert_bytes_total * (1 - 1 / ep), rel=1e-12)


def test_ep_adds_all_to_all_buffers_as_workspace():
    dp, ep, batch, seq_len = 2, 2, 2, 256
    report = memory_report(make_plan(_raw(dp=dp, ep=ep, batch=batch, seq_len=seq_len)).ctx)
    buffer_bytes = batch * seq_len * 2 * MIXTRAL.hidden_size * BF16_BYTES
    assert all(c.workspace_bytes == pytest.approx(2 * buffer_bytes, rel=1e-12) for c in report.per_chip)
    assert all(c.workspace_bytes == 0 for c in memory_report(make_plan(_raw(dp=2)).ctx).per_chip)


# ------------------------------------------------------------------------------------------
# Configuration rules
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dp, tp, ep", [(1, 2, 4), (3, 1, 2), (1, 1, 2), (3, 2, 4)])
def test_ep_must_divide_dp_times_tp(dp, tp, ep):
    with pytest.raises(ConfigError, match="does not divide dp x sp x tp") as info:
        make_plan(_raw(dp=dp, tp=tp, ep=ep))
    assert info.value.field == "parallel.ep"


def test_ep_on_a_dense_model_is_an_error():
    with pytest.raises(ConfigError, match="no MoE layers") as info:
        make_plan(_raw(model="llama-3.1-8b", dp=2, ep=2))
    assert info.value.field == "parallel.ep"


def test_ep_must_divide_the_routed_experts():
    with pytest.raises(ConfigError, match="not divisible by ep=16") as info:
        make_plan(_raw(dp=16, ep=16))
    assert info.value.field == "parallel.ep"


def test_ep_1_on_a_dense_model_is_fine_and_adds_nothing():
    dag = build_dag(make_plan(_raw(model="llama-3.1-8b", dp=2, ep=1)))
    assert not [op for op in dag.ops if op.owner == "ep"]
