"""Layer-periodic engine runs of the serving step runners (``PreparedPlan.periodic_latency_s``,
``busiest_compute_s(periodic=True)``): the step on the model cut to ``d + 2``, ``d + 3``
and ``d + 4`` layers, extrapolated to the whole model, equals the full engine run to a
relative 1e-9 (dense tp, cp, an MoE with a dense prefix, attention DP with EP, a framework
with CUDA-graph padding and host time, pipeline stages: a cut adds one layer to each); where
the layers do not repeat (alternating windows, every other layer MoE, stages beside a dense
prefix) or the self-check fails, the full run answers, bit for bit."""
from __future__ import annotations

import pytest

import g5core.session.prepared as prepared_mod
from g5core import prepare
from g5core.inputs.models import get_model
from g5core.inputs.step import Step, StepGroup
from g5core.serve.cost import EXPERTS_OWNER, plan_experts_runner, plan_step_runner, shapes
from g5core.session.prepared import PERIODIC_REL_TOLERANCE, layer_extrapolation
from helpers_engine import write_tiny_model

DECODE = Step.decode(16, 2048)
PREFILL = Step.prefill(1, 4096)
MIXED = Step([StepGroup(new_tokens=1024, cached_tokens=2048, count=1), StepGroup(new_tokens=1, cached_tokens=3000, count=12)])


def config(model: str, chips: int, system: str = "h100-sxm", **parallel) -> dict:
    par = {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1, **parallel}
    return {"model": model, "system": system, "chips": chips, "parallel": par, "phase": "decode", "batch": 1,
            "seq_len": 4096}


def assert_periodic_matches(plan, steps, experts: bool = False) -> None:
    """Periodic and full runs agree to the self-check's tolerance, and the periodic path ran."""
    assert plan.periodic_gpu_figure(steps[0]) is not None
    for step in steps:
        full = plan.simulate(step).latency_s
        assert plan.periodic_latency_s(step) == pytest.approx(full, rel=PERIODIC_REL_TOLERANCE, abs=0)
        if experts:
            whole = plan.busiest_compute_s(step, EXPERTS_OWNER)
            assert whole > 0
            assert plan.busiest_compute_s(step, EXPERTS_OWNER, periodic=True) == pytest.approx(
                whole, rel=PERIODIC_REL_TOLERANCE, abs=0)


def test_dense_tp_prefill_decode_and_mixed_steps_match_the_full_run():
    plan = prepare(config("llama-3.1-8b", 2, tp=2))
    assert plan.cache_info()["periodic_steps"] == 0
    assert_periodic_matches(plan, [PREFILL, DECODE, MIXED])
    assert plan.cache_info()["periodic_steps"] == 3       # each step's three cut runs made once


def test_cp_layout_matches_the_full_run():
    assert_periodic_matches(prepare(config("llama-3.1-8b", 2, cp=2)), [PREFILL, DECODE])


@pytest.mark.parametrize("overlap", [False, True])
def test_framework_host_time_and_graph_padding_stay_around_the_extrapolated_gpu_latency(tmp_path, overlap):
    # 2 ms of host work: more than a cut model's decode step takes on the GPU (under 1 ms),
    # less than the whole model's (about 4 ms): overlapped, it must not show
    system = tmp_path / "h100-host.yaml"
    system.write_text("base: h100-sxm\nname: h100-host\n"
                      f"framework: {{name: vllm, host: {{fixed_s: 0.002, overlap: {str(overlap).lower()}}}}}\n")
    plan = prepare(config("llama-3.1-8b", 2, system=str(system), tp=2))
    odd = Step.decode(7, 1000)     # padded up to a captured CUDA-graph batch
    assert prepared_mod.graph_step(odd, plan.plan.ctx.system) != odd
    gpu_s = plan.periodic_gpu_figure(odd)
    assert gpu_s > 0.002
    assert plan.periodic_latency_s(odd) == (gpu_s if overlap else gpu_s + 0.002)
    assert_periodic_matches(plan, [odd, DECODE, PREFILL])


def test_moe_with_a_dense_prefix_matches_the_full_run(tmp_path):
    path = write_tiny_model(tmp_path, "deepseek-v3", layers=12, first_k_dense_replace=3, n_routed_experts=8,
                            num_experts_per_tok=2)
    assert get_model(path).alike_from() == 3
    assert_periodic_matches(prepare(config(path, 2, tp=2, ep=2)), [PREFILL, DECODE, MIXED], experts=True)


def test_attention_dp_with_ep_matches_the_full_run_and_its_experts_runner():
    plan = prepare(config("qwen3-30b-a3b", 2, system="h200", dp=2, ep=2))
    assert_periodic_matches(plan, [PREFILL, DECODE, MIXED, Step.decode(1, 1)], experts=True)
    groups = shapes(DECODE)
    assert plan_step_runner(plan)(groups) == plan.periodic_latency_s(DECODE)
    assert plan_step_runner(plan, periodic=False)(groups) == plan.simulate(DECODE).latency_s
    assert plan_experts_runner(plan)(groups) == plan.busiest_compute_s(DECODE, EXPERTS_OWNER, periodic=True)


def test_pipeline_stages_match_the_full_run_even_and_uneven_splits():
    """A cut adds one layer to every stage: 32 layers on 2 stages (16 + 16, cuts of 4 to 8
    layers), 94 on 4 (24, 24, 23, 23: cuts keep the first two stages' extra layer), an MoE
    with tp and ep on the stages too."""
    plan = prepare(config("llama-3.1-8b", 2, pp=2))
    assert_periodic_matches(plan, [PREFILL, DECODE, MIXED])
    assert plan._periodic_more == 16 - 4
    uneven = prepare(config("qwen3-235b-a22b", 8, system="h200", tp=2, pp=4, ep=2))
    assert_periodic_matches(uneven, [DECODE, MIXED], experts=True)
    assert [c.plan.ctx.model.n_layers for c in uneven._cuts] == [2 + 4 * k for k in (2, 3, 4)]
    assert uneven._periodic_more == 23 - 4


def test_pipeline_stages_beside_a_dense_prefix_fall_back_to_the_full_run_bit_for_bit(tmp_path):
    path = write_tiny_model(tmp_path, "deepseek-v3", layers=12, first_k_dense_replace=3, n_routed_experts=8,
                            num_experts_per_tok=2)
    plan = prepare(config(path, 2, pp=2))
    assert plan.periodic_gpu_figure(DECODE) is None
    for step in (PREFILL, DECODE):
        assert plan.periodic_latency_s(step) == plan.simulate(step).latency_s


def test_a_failed_self_check_falls_back_to_the_full_run_bit_for_bit(monkeypatch):
    plan = prepare(config("llama-3.1-8b", 2, tp=2))
    monkeypatch.setattr(prepared_mod, "PERIODIC_REL_TOLERANCE", -1.0)   # no two increments agree
    assert plan.periodic_gpu_figure(DECODE) is None
    for step in (PREFILL, DECODE, MIXED):
        assert plan.periodic_latency_s(step) == plan.simulate(step).latency_s
        assert plan_step_runner(plan)(shapes(step)) == plan.simulate(step).latency_s


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gemma-3-27b", "llama-4-maverick-17b-128e"])
def test_models_whose_layers_alternate_are_not_periodic(name):
    assert get_model(name).alike_from() is None


def test_alike_from_is_the_dense_prefix():
    assert get_model("llama-3.1-70b").alike_from() == 0
    assert get_model("qwen3-235b-a22b").alike_from() == 0
    assert get_model("deepseek-v3").alike_from() == 3


def test_alternating_windows_fall_back_to_the_full_run():
    plan = prepare(config("gpt-oss-20b", 2, system="h200", tp=2))
    assert plan.periodic_gpu_figure(DECODE) is None
    assert plan.periodic_latency_s(DECODE) == plan.simulate(DECODE).latency_s


def test_extrapolation_takes_agreeing_increments_only():
    assert layer_extrapolation([1.0, 3.0, 5.0], 10) == 25.0
    assert layer_extrapolation([0.0, 0.0, 0.0], 10) == 0.0
    assert layer_extrapolation([1.0, 3.0, 5.0 + 1e-6], 10) is None
