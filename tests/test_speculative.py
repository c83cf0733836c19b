"""Speculative decoding (issue 33): the speculative: block, the verification step, the proposer."""
import numpy as np
import pytest

from g5core import ConfigError, Step, StepGroup
from g5core.inputs.speculative import Speculative, constant_rate, expected_tokens_per_step
from g5core.lower import flops as F
from g5core.lower.layers import step_attention_work, verify_attention_kernel, _head_tokens
from g5core.session.run import make_plan, run

BASE = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 2, "parallel": {"tp": 2, "pp": 1, "dp": 1, "cp": 1},
        "phase": "decode", "batch": 8, "seq_len": 4096}


def _with(**spec):
    return {**BASE, "speculative": spec}


@pytest.mark.parametrize("spec, field", [
    ({"method": "medusa", "tokens": 2}, "speculative.method"),
    ({"method": "eagle", "tokens": -1, "acceptance": []}, "speculative.tokens"),
    ({"method": "eagle", "tokens": 3, "acceptance": [0.8, 0.6]}, "speculative.acceptance"),
    ({"method": "eagle", "tokens": 2, "acceptance": [0.8, 1.5]}, "speculative.acceptance.1"),
    ({"method": "eagle", "tokens": 2, "acceptance": [0.8, 0.5], "mean_accepted": 2.0}, "speculative.mean_accepted"),
    ({"method": "eagle", "tokens": 2, "mean_accepted": 3.5}, "speculative.mean_accepted"),
    ({"method": "eagle", "tokens": 6}, "speculative.acceptance"),           # the EAGLE figure covers five tokens
    ({"method": "draft_model", "tokens": 2, "draft_model": "qwen2.5-7b"}, "speculative.acceptance"),  # no default
    ({"method": "mtp", "tokens": 3}, "speculative.acceptance"),             # the MTP figure covers one token
    ({"method": "draft_model", "tokens": 2, "mean_accepted": 2.0}, "speculative.draft_model"),
    ({"method": "mtp", "tokens": 1, "speed": 2}, "speculative.speed"),
])
def test_bad_blocks_name_the_field(spec, field):
    with pytest.raises(ConfigError) as err:
        make_plan(_with(**spec))
    assert err.value.field == field
    assert "\n" not in str(err.value)


def test_speculation_needs_a_decode_step():
    raw = {**_with(method="ngram", tokens=2, mean_accepted=1.5), "phase": "prefill"}
    with pytest.raises(ConfigError) as err:
        make_plan(raw)
    assert err.value.field == "speculative"


def test_k0_is_todays_decode_bit_for_bit():
    plain = run(BASE).to_json_dict()
    zero = run(_with(method="eagle", tokens=0)).to_json_dict()
    assert "speculative" not in zero
    zero["deployment"].pop("speculative")
    for out in (zero, plain):
        out.pop("sim_wall_s")                     # wall time of the simulation itself
    assert zero == plain


def test_acceptance_one_and_zero():
    full = run(_with(method="eagle", tokens=3, acceptance=1.0)).speculative
    none = run(_with(method="eagle", tokens=3, acceptance=0.0)).speculative
    assert full.tokens_per_step == 4.0 and none.tokens_per_step == 1.0
    assert none.tpot_s > none.plain_decode_s            # verification of 4 queries + 3 proposer passes, for 1 token
    assert full.tpot_s < full.plain_decode_s
    assert full.proposer_s > 0 and 0 < full.proposer_share < 1


def test_eagle_default_is_the_papers_chain_rates():
    """Without acceptance an EAGLE block takes the EAGLE paper's chain-draft rates (Table 2,
    LLaMA2-Chat 7B, MT-bench, temperature 0), the first k of them, and names its source."""
    three = Speculative.from_dict({"method": "eagle", "tokens": 3})
    assert three.acceptance == (0.76, 0.69, 0.67)
    assert three.source.startswith("EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty")
    five = Speculative.from_dict({"method": "eagle", "tokens": 5})
    assert five.tokens_per_step == pytest.approx(3.04, abs=0.005)   # the paper's chain tau is 3.00
    given = Speculative.from_dict({"method": "eagle", "tokens": 3, "mean_accepted": 2.0})
    assert given.source == "configuration" and given.tokens_per_step == pytest.approx(2.0)


def test_expected_length_matches_a_seeded_draw():
    spec = Speculative.from_dict({"method": "eagle", "tokens": 4, "acceptance": [0.9, 0.7, 0.5, 0.3]})
    drawn = spec.draw(100_000, np.random.default_rng(7))
    assert abs(drawn.mean() / spec.tokens_per_step - 1) < 0.01
    assert drawn.min() >= 1 and drawn.max() <= 5
    again = spec.draw(100_000, np.random.default_rng(7))
    assert np.array_equal(drawn, again)
    # mean_accepted gives one constant rate with that expected length
    a = constant_rate(2.5, 3)
    assert expected_tokens_per_step((a,) * 3) == pytest.approx(2.5, rel=1e-9)


@pytest.mark.parametrize("b, k, context", [(1, 1, 128), (8, 3, 4096), (64, 7, 32768)])
def test_verification_step_matches_the_formula(b, k, context):
    plan = make_plan(BASE)
    from g5core.lower.builder import plan_for_step
    from g5core.lower.shape import collect_shard_axes

    dep = plan.ctx.deployment.with_step(Step.verify(b, context, k))
    shape = plan_for_step(plan, dep, collect_shard_axes(plan.hooks)).ctx.shape
    work = step_attention_work(plan.ctx.model, dep, shape)
    heads, d = 32 / 2, 128                        # llama-3.1-8b at tp=2
    kv_bytes = 2 * (8 / 2) * d * 2                # K and V of the local KV heads, bf16
    assert work.flops == pytest.approx(F.prefix_attention_flops(b, k + 1, context - 1, heads, d, d))
    assert work.hbm_bytes == pytest.approx(F.attention_block_bytes(b, k + 1, context + k, heads, d, d, kv_bytes, 2))
    assert shape.tokens == b * (k + 1)            # the GEMMs run on every query token
    assert _head_tokens(shape) == b * (k + 1)     # and the LM head scores every one
    kernel = verify_attention_kernel(plan.ctx.model, dep, shape, b, k + 1, context + k)
    assert (kernel.flops, kernel.hbm_bytes) == (work.flops, work.hbm_bytes)


def test_verify_groups_in_steps():
    g = StepGroup(new_tokens=4, cached_tokens=100, count=2, verify=True)
    assert g.is_decode and Step((g,)).phase == "decode" and Step((g,)).shorthand() is None
    assert Step.from_list([g.to_dict()]) == Step((g,))
    with pytest.raises(ConfigError):
        Step.from_list([{"new_tokens": 1, "cached_tokens": 5, "count": 1, "verify": True}])


def test_ledger_shows_the_proposer():
    eagle = run(_with(method="eagle", tokens=2, acceptance=[0.8, 0.6])).to_json_dict()["memory"]["terms"]
    assert eagle["speculative_eagle_head"]["max_bytes"] > 0
    assert eagle["speculative_eagle_head_kv_cache"]["max_bytes"] > 0
    draft = run(_with(method="draft_model", tokens=2, draft_model="qwen2.5-7b", mean_accepted=2.0))
    terms = draft.to_json_dict()["memory"]["terms"]
    assert terms["speculative_draft_model"]["max_bytes"] > eagle["speculative_eagle_head"]["max_bytes"]
    ngram = run(_with(method="ngram", tokens=2, mean_accepted=1.6))
    assert ngram.speculative.proposer_s == 0.0
    assert not any(t.startswith("speculative") for t in ngram.to_json_dict()["memory"]["terms"])


def test_mtp_proposer_times_its_eh_proj():
    """The MTP module's eh_proj (2d -> d on the proposer's tokens, after enorm and hnorm) is an
    op of the proposer's pass, on every chip of the layout: the MTP pass of a dense target
    (the same layer as an EAGLE head's) costs more by it, and its weights are in the ledger."""
    from g5core.lower.builder import build_dag
    from g5core.session.speculative import Proposer

    raw = _with(method="mtp", tokens=1, acceptance=0.8)
    plan = make_plan(raw)
    proposer = Proposer(plan, plan.ctx.deployment.speculative)
    assert [lop.kind for lop in proposer.plan.program()].count("eh_proj") == 1
    d, b = 4096, 8                                # llama-3.1-8b, batch 8
    work = proposer.plan.ctx.work("eh_proj", 0)
    assert work.flops == 2.0 * b * (2 * d) * d
    gemm, *norms = work.kernels
    assert (gemm.m, gemm.k, gemm.n) == (b, 2 * d, d) and [k.kind for k in norms] == ["rmsnorm", "rmsnorm"]
    dag = build_dag(proposer.plan)
    assert sorted(dag.chip[i] for i in range(len(dag)) if ".eh_proj" in dag.key(i)) == [0, 1]   # tp=2: whole on each
    mtp, eagle = run(raw), run(_with(method="eagle", tokens=1, acceptance=0.8))
    assert mtp.speculative.proposer_pass_s > eagle.speculative.proposer_pass_s
    terms = lambda out, name: out.to_json_dict()["memory"]["terms"][name]["max_bytes"]
    # MTP: eh_proj (2d x d) and its enorm, hnorm (d each); EAGLE: fc (2d x d) and its bias (d)
    assert terms(mtp, "speculative_mtp_layers") - terms(eagle, "speculative_eagle_head") == d * 2


def _eagle_proposer(raw, monkeypatch=None):
    """The EAGLE proposer of ``raw``; with ``monkeypatch``, as it was before its fc was
    modelled (the same head without ``eagle_fc``)."""
    import attrs

    from g5core.session import speculative as S

    if monkeypatch is not None:
        former = S.proposer_model
        monkeypatch.setattr(S, "proposer_model", lambda spec, target: attrs.evolve(former(spec, target), eagle_fc=False))
    plan = make_plan(raw)
    return S.Proposer(plan, plan.ctx.deployment.speculative)


def _per_chip_totals(proposer):
    """(FLOPs, HBM bytes) of the proposer's step on each chip, over every compute op of its DAG."""
    from g5core.lower.builder import build_dag

    dag = build_dag(proposer.plan)
    flops, hbm = {}, {}
    for i in range(len(dag)):
        if not dag.is_comm(i):
            op = dag.op(i)
            flops[op.chip] = flops.get(op.chip, 0.0) + op.flops
            hbm[op.chip] = hbm.get(op.chip, 0.0) + op.hbm_bytes
    return flops, hbm


@pytest.mark.parametrize("layers", [1, 2])
def test_eagle_proposer_times_its_fc(monkeypatch, layers):
    """The EAGLE head's fc ([embedding; the target's feature], 2d -> d) is one op of the
    proposer's pass, before its first layer (however many layers), whole on every chip: each
    chip's FLOPs and bytes of the pass grow by exactly that GEMM's against the head without it."""
    raw = _with(method="eagle", tokens=2, acceptance=[0.8, 0.6], layers=layers)
    proposer = _eagle_proposer(raw)
    kinds = [lop.kind for lop in proposer.plan.program()]
    assert kinds.count("eagle_fc") == 1 and kinds.index("eagle_fc") < kinds.index("attn_norm")
    assert "eh_proj" not in kinds
    d, b = 4096, 8                                # llama-3.1-8b, batch 8, bf16
    work = proposer.plan.ctx.work("eagle_fc", 0)
    (gemm,) = work.kernels                        # no norm before it, no FP8 input quantisation in bf16
    assert (gemm.m, gemm.k, gemm.n) == (b, 2 * d, d)
    fc_flops, fc_bytes = 2.0 * b * (2 * d) * d, (2 * d) * d * 2 + b * (2 * d + d) * 2
    assert (work.flops, work.hbm_bytes) == (fc_flops, fc_bytes)
    flops, hbm = _per_chip_totals(proposer)
    former_flops, former_hbm = _per_chip_totals(_eagle_proposer(raw, monkeypatch))
    assert sorted(flops) == sorted(former_flops) == [0, 1]          # tp=2: the fc on each chip
    for chip in flops:
        assert flops[chip] - former_flops[chip] == fc_flops
        assert hbm[chip] - former_hbm[chip] == fc_bytes


def test_eagle_ledger_shows_the_fc(monkeypatch):
    """The fc's weights (2d x d and its bias d, bf16, whole on every chip) are in the EAGLE head's
    line, which grows by them against the head without the fc, and on their own line within it."""
    raw = _with(method="eagle", tokens=2, acceptance=[0.8, 0.6])
    d = 4096
    fc_bytes = (2 * d * d + d) * 2
    out = run(raw)
    terms = out.to_json_dict()["memory"]["terms"]
    assert terms["speculative_eagle_head_fc"] == {"category": "weights", "max_bytes": fc_bytes,
                                                  "part_of": "speculative_eagle_head"}
    fc = next(t for t in out.memory.terms if t.name == "speculative_eagle_head_fc")
    assert dict(fc.bytes_per_chip) == {0: fc_bytes, 1: fc_bytes}
    head = terms["speculative_eagle_head"]["max_bytes"]
    former = {t.name: t for t in _eagle_proposer(raw, monkeypatch).memory_terms()}
    assert head - max(b for _, b in former["speculative_eagle_head"].bytes_per_chip) == fc_bytes
    # a part of the head's line, not counted again in the totals
    weights = out.memory.columns["weights_bytes"]
    whole = sum(t.vector(2) for t in out.memory.terms if t.category == "weights" and not t.part_of)
    assert np.array_equal(weights, whole)
    from g5core.present.render import render_summary
    assert "of the speculative_eagle_head: speculative eagle head fc 64.01 MiB" in render_summary(out)


def test_speculation_under_context_parallel_pass_q():
    raw = {**BASE, "chips": 4, "parallel": {"tp": 2, "cp": 2, "pp": 1, "dp": 1}}
    plain = run(raw)
    spec = run({**raw, "speculative": {"method": "eagle", "tokens": 2, "acceptance": 1.0}}).speculative
    assert spec.verify_s > plain.latency_s and spec.plain_decode_s == plain.latency_s


def _serve(acceptance, arrival, n):
    from g5core.serve.api import simulate_serving

    raw = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 1, "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1},
           "serving": {"instances": 1, "scheduler": {"max_num_batched_tokens": 4096}}}
    if acceptance is not None:
        raw["speculative"] = {"method": "eagle", "tokens": 3, "acceptance": acceptance}
    workload = {"requests": n, "input_tokens": 512, "output_tokens": 64, "seed": 0, "arrival": arrival}
    return simulate_serving(raw, workload, check_predictor=0).summary


def test_serving_speed_rises_with_acceptance_and_the_gain_shrinks_at_saturation():
    low = {"kind": "poisson", "rate_per_s": 0.5}
    per_user = [1.0 / _serve(a, low, 12)["tpot_s"]["p50"] for a in (None, 0.5, 0.9)]
    assert per_user[0] < per_user[1] < per_user[2]
    busy = {"kind": "closed", "concurrency": 128}
    plain, fast = (_serve(a, busy, 128) for a in (None, 0.9))
    gain_low = per_user[2] / per_user[0]
    gain_busy = fast["throughput"]["output_tokens_per_s"] / plain["throughput"]["output_tokens_per_s"]
    assert gain_busy < gain_low
    spec = fast["speculative"]
    assert spec["kept_tokens"] == 128 * 63          # every token after the first came from a verification
    assert abs(spec["mean_accepted_length"] / spec["expected_tokens_per_step"] - 1) < 0.05
    assert "speculative" not in plain and "per_user_tokens_per_s" in fast


def test_serving_draws_are_seeded():
    low = {"kind": "poisson", "rate_per_s": 2.0}
    assert _serve(0.7, low, 8) == _serve(0.7, low, 8)


def test_search_variants():
    from g5core.inputs.speculative import speculative_variants

    assert speculative_variants(None) == [None]
    assert speculative_variants({"method": "mtp", "tokens": 1}) == [None, {"method": "mtp", "tokens": 1}]
    got = speculative_variants({"method": "eagle", "tokens": 3, "acceptance": [0.8, 0.6, 0.4]}, (0, 1, 3, 5))
    assert got == [None, {"method": "eagle", "tokens": 1, "acceptance": [0.8]},
                   {"method": "eagle", "tokens": 3, "acceptance": [0.8, 0.6, 0.4]}]


def test_search_blocks_take_the_configurations_acceptance_or_the_published_default():
    """``g5 best --serve --speculative``: off, METHOD:K, K (the configuration's method); the
    acceptance is the configuration's block's (same method, its first k rates) or the
    method's published default; neither is a one-line error naming the field."""
    from g5core.inputs.speculative import search_blocks

    block = {"method": "eagle", "tokens": 3, "acceptance": [0.8, 0.7, 0.6]}
    assert search_blocks("off,eagle:1,3,eagle:0,off", block) == (
        None, {"method": "eagle", "tokens": 1, "acceptance": [0.8]}, {**block})
    assert search_blocks("eagle:2,mtp:1", None) == ({"method": "eagle", "tokens": 2}, {"method": "mtp", "tokens": 1})
    assert Speculative.from_dict(search_blocks("eagle:2", None)[0]).acceptance == (0.76, 0.69)
    for text, given, field in [("ngram:2", None, "speculative.acceptance"),        # no default, none given
                               ("eagle:4", block, "speculative.acceptance"),       # the block has rates for 3
                               ("2", None, "--speculative"),                       # no method to take
                               ("eagle3:2", None, "--speculative"),
                               ("eagle:x", None, "--speculative")]:
        with pytest.raises(ConfigError) as err:
            search_blocks(text, given)
        assert err.value.field == field and "\n" not in str(err.value)


def test_a_session_runs_a_speculative_workload_the_same_each_time():
    """Each run of a serving session makes its schedulers anew: instance i draws from seed i
    in every run, so the same workload gives the same figures the second and third time (a
    capacity search reruns a stopped run to its end and must see the same run)."""
    from g5core.serve.session import ServingSession

    raw = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 1, "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1},
           "serving": {"instances": 2}, "speculative": {"method": "eagle", "tokens": 3, "acceptance": 0.6}}
    wl = {"requests": 24, "input_tokens": 256, "output_tokens": 32, "seed": 0, "arrival": {"kind": "poisson", "rate_per_s": 40}}
    session = ServingSession(raw, wl)
    first, second, third = (session.run(wl).summary for _ in range(3))
    for s in (second, third):
        assert s["tpot_s"] == first["tpot_s"] and s["speculative"] == first["speculative"]
