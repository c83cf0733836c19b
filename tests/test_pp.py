"""Pipeline parallelism: stage split, stage-boundary P2P, TTFT as the sum of stages, weights per stage."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from g5core.lower.builder import build_dag
from g5core.api.ops import CommOp, ComputeOp
from g5core.sim.memory import memory_report
from g5core.session.run import make_plan, simulate_plan
from g5plugins.pp import stage_of, stage_sizes

BF16_BYTES = 2


def _raw(model="llama-3.1-8b", pp=1, tp=1, dp=1, phase="prefill", batch=2, seq_len=512, **extra):
    raw = {"model": model, "system": "h100-sxm", "chips": dp * tp * pp,
           "parallel": {"dp": dp, "tp": tp, "pp": pp, "cp": 1}, "phase": phase, "batch": batch, "seq_len": seq_len}
    raw.update(extra)
    return raw


def _stage_of_chip(plan, chip: int) -> int:
    return plan.ctx.rankmap.coords(chip)["pp"]


# ------------------------------------------------------------------------------------------
# Split rule
# ------------------------------------------------------------------------------------------


def test_61_layers_on_4_stages_split_16_15_15_15():
    assert stage_sizes(61, 4) == (16, 15, 15, 15)
    # and the deployment really places them so (deepseek-v3 has 61 layers)
    plan = make_plan(_raw(model="deepseek-v3", pp=4, seq_len=128, batch=1))
    per_stage = [0, 0, 0, 0]
    for layer in range(61):
        chips = plan.ctx.layer_chips(layer)
        assert len(chips) == 1
        per_stage[_stage_of_chip(plan, chips[0])] += 1
    assert per_stage == [16, 15, 15, 15]
    assert plan.ctx.layer_chips(-1) == plan.ctx.layer_chips(0)  # embedding on the first stage
    assert plan.ctx.layer_chips(61) == plan.ctx.layer_chips(60)  # head on the last stage
    # the DAG agrees: every compute op of a layer runs on its stage
    dag = build_dag(plan)
    for op in dag.ops:
        if isinstance(op, ComputeOp) and 0 <= op.layer < 61:
            assert _stage_of_chip(plan, op.chip) == stage_of(op.layer, 61, 4)


@settings(max_examples=60, deadline=None)
@given(n_layers=st.integers(1, 200), data=st.data())
def test_split_rule_closed_form(n_layers, data):
    pp = data.draw(st.integers(1, n_layers))
    sizes = stage_sizes(n_layers, pp)
    q, r = divmod(n_layers, pp)
    assert sizes == tuple([q + 1] * r + [q] * (pp - r))
    layer = data.draw(st.integers(0, n_layers - 1))
    assert sum(sizes[:stage_of(layer, n_layers, pp)]) <= layer < sum(sizes[:stage_of(layer, n_layers, pp) + 1])


# ------------------------------------------------------------------------------------------
# Stage-boundary P2P
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pp, tp, phase", [(2, 1, "prefill"), (4, 2, "prefill"), (4, 1, "decode")])
def test_pp_p2p_only_at_stage_boundaries_with_tokens_x_hidden_bytes(pp, tp, phase):
    batch, seq_len = 2, 512
    plan = make_plan(_raw(pp=pp, tp=tp, phase=phase, batch=batch, seq_len=seq_len))
    m = plan.ctx.model
    dag = build_dag(plan)
    tokens = batch * seq_len if phase == "prefill" else batch
    first_layers = [sum(stage_sizes(m.n_layers, pp)[:s]) for s in range(1, pp)]  # 32 layers, pp=4: 8, 16, 24
    p2p = [op for op in dag.ops if isinstance(op, CommOp)]
    p2p = [op for op in p2p if op.reason == "pp_p2p"]
    assert sorted({op.layer for op in p2p}) == first_layers
    assert len(p2p) == (pp - 1) * tp  # one per chip of the receiving stage
    for op in p2p:
        assert op.primitive == "p2p" and op.owner == "pp" and op.name == "boundary"
        assert op.bytes_per_rank == tokens * m.hidden_size * BF16_BYTES
        src, dst = op.group
        stage = stage_of(op.layer, m.n_layers, pp)
        assert _stage_of_chip(plan, src) == stage - 1 and _stage_of_chip(plan, dst) == stage
        # same coordinates apart from the stage
        cs, cd = plan.ctx.rankmap.coords(src), plan.ctx.rankmap.coords(dst)
        assert {k: v for k, v in cs.items() if k != "pp"} == {k: v for k, v in cd.items() if k != "pp"}


def test_pp_p2p_with_tp_sp_sends_each_ranks_sequence_shard():
    tp, batch, seq_len = 2, 2, 512
    plan = make_plan(_raw(pp=2, tp=tp, tp_sp=True, batch=batch, seq_len=seq_len))
    ops = [op for op in build_dag(plan).ops if isinstance(op, CommOp) and op.reason == "pp_p2p"]
    assert len(ops) == tp
    assert all(op.bytes_per_rank == batch * seq_len / tp * plan.ctx.model.hidden_size * BF16_BYTES for op in ops)


def test_pp1_has_no_p2p():
    assert not [op for op in build_dag(make_plan(_raw())).ops if isinstance(op, CommOp)]


# ------------------------------------------------------------------------------------------
# TTFT: no micro-batching, every stage in turn
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pp_runs():
    return {pp: simulate_plan(make_plan(_raw(pp=pp, batch=1, seq_len=1024))) for pp in (1, 2)}


def test_ttft_with_pp2_is_the_sum_of_both_stages(pp_runs):
    sim = pp_runs[2]
    busy_s = {0: 0.0, 1: 0.0}
    last_end_s = {0: 0.0, 1: 0.0}
    first_start_s = {0: float("inf"), 1: float("inf")}
    p2p_s = 0.0
    for i, op in enumerate(sim.dag.ops):
        s, e = float(sim.start_s[i]), float(sim.end_s[i])
        if isinstance(op, ComputeOp):
            busy_s[op.chip] += e - s
            last_end_s[op.chip] = max(last_end_s[op.chip], e)
            first_start_s[op.chip] = min(first_start_s[op.chip], s)
        else:
            assert op.reason == "pp_p2p"
            p2p_s += e - s
            p2p_start_s, p2p_end_s = s, e
    assert p2p_s > 0
    # stage 1 starts only when the activations arrived, which is after stage 0 finished
    assert p2p_start_s == last_end_s[0]
    assert first_start_s[1] == p2p_end_s
    assert sim.latency_s == pytest.approx(busy_s[0] + p2p_s + busy_s[1], rel=1e-12)


def test_ttft_with_pp2_is_no_faster_than_one_chip(pp_runs):
    one, two = pp_runs[1].latency_s, pp_runs[2].latency_s
    # the same work in turn, plus one activation transfer (2 MiB on NVLink: 6.5 us of start
    # latency and 5.7 us at 370.8 GB/s, about 0.13% of the run)
    assert two > one
    assert two == pytest.approx(one, rel=2e-3)


# ------------------------------------------------------------------------------------------
# Weights and KV per stage
# ------------------------------------------------------------------------------------------


def test_layer_weights_live_only_on_their_stages_chips():
    pp, tp, batch, seq_len = 2, 2, 2, 512
    plan = make_plan(_raw(pp=pp, tp=tp, batch=batch, seq_len=seq_len))
    m = plan.ctx.model
    d, V = m.hidden_size, m.vocab_size
    layer_elements = (sum(i * o for _, i, o in m.projection_shapes()) + 3 * d * m.ffn_dim) / tp + 2 * d
    per_stage_layers = stage_sizes(m.n_layers, pp)  # 16, 16
    expected_weights_bytes = {
        0: (V * d / tp + per_stage_layers[0] * layer_elements) * BF16_BYTES,     # embedding + layers 0-15
        1: (per_stage_layers[1] * layer_elements + d + V * d / tp) * BF16_BYTES,  # layers 16-31 + norm + head
    }
    c_kv = 2 * m.attention.n_kv_heads * m.attention.head_dim * BF16_BYTES
    report = memory_report(plan.ctx)
    assert len(report.per_chip) == pp * tp
    for chip in report.per_chip:
        stage = _stage_of_chip(plan, chip.chip)
        assert chip.weights_bytes == pytest.approx(expected_weights_bytes[stage], rel=1e-12)
        assert chip.kv_cache_bytes == pytest.approx(batch * seq_len * c_kv * per_stage_layers[stage] / tp, rel=1e-12)
    dag = build_dag(plan)
    for op in dag.ops:
        if isinstance(op, ComputeOp):
            assert _stage_of_chip(plan, op.chip) == stage_of(op.layer, m.n_layers, pp), op.key


def test_pp_larger_than_layers_is_an_error():
    from g5core.api.errors import ConfigError

    with pytest.raises(ConfigError, match="larger than the 32 layers") as info:
        make_plan(_raw(pp=33))
    assert info.value.field == "parallel.pp"
