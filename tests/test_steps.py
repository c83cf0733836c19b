"""Steps: the step configuration, its shorthand, and the prepared plan that simulates steps."""
from __future__ import annotations

import pytest

import g5core
from g5core import ConfigError, Step, StepGroup
from g5core.session.run import load_raw, run

DECODE = "examples/llama-3.1-70b-decode.yaml"
TP8 = ["parallel.pp=1", "chips=8"]


def as_step_config(raw: dict) -> dict:
    """The shorthand of ``raw`` written as the equivalent ``step:`` list."""
    out = {k: v for k, v in raw.items() if k not in ("phase", "batch", "seq_len")}
    b, s = raw["batch"], raw["seq_len"]
    if raw["phase"] == "prefill":
        out["step"] = [{"new_tokens": s, "cached_tokens": 0, "count": b}]
    else:
        out["step"] = [{"new_tokens": 1, "cached_tokens": s - 1, "count": b}]
    return out


def test_step_is_canonical():
    a = Step([StepGroup(new_tokens=1, cached_tokens=10, count=2), StepGroup(new_tokens=5, count=1),
              StepGroup(new_tokens=1, cached_tokens=10, count=3)])
    b = Step([StepGroup(new_tokens=5, cached_tokens=0, count=1), StepGroup(new_tokens=1, cached_tokens=10, count=5)])
    assert a == b and hash(a) == hash(b)
    assert a.phase == "mixed" and a.new_tokens == 10 and a.context_tokens == 5 + 55 and a.sequences == 6
    assert Step.decode(64, 8192) == Step([StepGroup(new_tokens=1, cached_tokens=8191, count=64)])
    assert Step.decode(64, 8192).shorthand() == ("decode", 64, 8192)
    assert Step.prefill(2, 4096).shorthand() == ("prefill", 2, 4096)
    assert Step.prefill(1, 2048, cached_tokens=30000).shorthand() is None


def test_prepared_plan_matches_run_and_caches():
    raw = load_raw(DECODE, TP8)
    plan = g5core.prepare(DECODE, overrides=TP8)
    step = Step.decode(raw["batch"], raw["seq_len"])
    first = plan.simulate(step)
    assert first.latency_s == run(raw).latency_s
    assert first.tpot_s == first.latency_s and first.ttft_s is None and first.phase == "decode"
    again = plan.simulate([StepGroup(new_tokens=1, cached_tokens=raw["seq_len"] - 1, count=raw["batch"])])
    assert again is first
    assert plan.cache_info()["hits"] == 1 and plan.cache_info()["misses"] == 1


def test_prepared_plan_memory_figures_size_a_kv_pool():
    plan = g5core.prepare(DECODE, overrides=TP8)
    step = Step([StepGroup(new_tokens=1, cached_tokens=4095, count=32), StepGroup(new_tokens=512, cached_tokens=0,
                                                                                    count=1)])
    res = plan.simulate(step)
    mem = res.memory
    assert mem.kv_cache_bytes == pytest.approx(mem.kv_bytes_per_token * step.context_tokens, rel=1e-12)
    room = plan.kv_capacity_tokens(step)
    free = mem.capacity_bytes - mem.weights_bytes - mem.activation_bytes - mem.workspace_bytes
    assert room == pytest.approx(free / mem.kv_bytes_per_token, rel=1e-12)
    assert res.phase == "mixed" and res.ttft_s is None and res.tpot_s is None


def test_step_with_shorthand_is_refused():
    raw = load_raw(DECODE)
    raw["step"] = [{"new_tokens": 1, "cached_tokens": 10, "count": 1}]
    with pytest.raises(ConfigError, match="phase"):
        run(raw)


# ----------------------------------------------------------------------------------------
# The shorthand and the step: bit-identical results
# ----------------------------------------------------------------------------------------

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import attrs  # noqa: E402

from g5core.lower.layers import attention_work, step_attention_work  # noqa: E402
from g5core.lower.flops import prefix_attention_flops  # noqa: E402
from g5core.session.run import make_plan  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
REFERENCE = Path(__file__).resolve().parent / "data" / "examples_json"


def _json(out) -> dict:
    data = json.loads(json.dumps(out.to_json_dict(), sort_keys=True, allow_nan=False))
    data.pop("sim_wall_s")
    data.pop("deployment")
    return data


#: the examples of a benchmark's size (2-5 s a run on 2 cores idle): their full runs are bench
#: checks; the default suite runs each on few of its layers, as a step list and as its shorthand
#: (test_the_largest_examples_on_few_layers_as_a_step_list_give_their_shorthand_json); the model
#: of few layers: the shipped HF configuration with these changes
LARGEST = {"llama-3.1-405b-1m-prefill-cp16@seq_len=131072": ("llama-3.1-405b.json", {"num_hidden_layers": 4}),
           "deepseek-v3-1m-prefill-cp16": ("deepseek-v3.json", {"num_hidden_layers": 3, "first_k_dense_replace": 1})}


def _example_raw(case: str, extra: list[str] = ()) -> dict:
    name, _, override = case.partition("@")
    return load_raw(REPO / "examples" / f"{name}.yaml", ([override] if override else []) + list(extra))


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.bench) if c in LARGEST else c
                                  for c in sorted(p.stem for p in REFERENCE.glob("*.json"))])
def test_every_example_as_a_step_list_gives_the_shorthand_json(case):
    """The reference JSON of every shipped example (its shorthand) and the same run written
    as a step: list agree key for key, bit for bit (the deployment echo aside)."""
    raw = as_step_config(_example_raw(case))
    reference = json.loads((REFERENCE / f"{case}.json").read_text())
    reference.pop("deployment")
    assert _json(run(raw)) == reference


@pytest.mark.parametrize("case", sorted(LARGEST))
def test_the_largest_examples_on_few_layers_as_a_step_list_give_their_shorthand_json(case, tmp_path):
    """The examples whose full runs are bench checks, on few of their layers (the same layout,
    sequence and dtypes; a DeepSeek dense layer and MoE layers): the step list and the shorthand
    agree key for key, bit for bit (the deployment echo aside)."""
    source, changes = LARGEST[case]
    hf = dict(json.loads((REPO / "tests" / "data" / "hf" / source).read_text()), **changes)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    raw = _example_raw(case, [f"model={tmp_path / 'config.json'}"])
    assert _json(run(as_step_config(raw))) == _json(run(raw))


@pytest.mark.parametrize("name,phase,overrides", [
    ("llama-3.1-70b-decode", "prefill", ["seq_len=4096", "batch=2"]),
    ("llama-3.1-70b-prefill", "decode", ["batch=16"]),
    ("llama-3.1-8b-prefill", "decode", ["batch=8"]),
    ("deepseek-v3-1m-decode-cp8", "prefill", ["seq_len=16384"]),
])
def test_both_phases_agree_with_their_step_list(name, phase, overrides):
    raw = load_raw(REPO / "examples" / f"{name}.yaml", [f"phase={phase}"] + overrides)
    assert _json(run(as_step_config(raw))) == _json(run(raw))


# ----------------------------------------------------------------------------------------
# Configuration errors
# ----------------------------------------------------------------------------------------


def _with_step(step) -> dict:
    raw = {k: v for k, v in load_raw(DECODE, TP8).items() if k not in ("phase", "batch", "seq_len")}
    raw["step"] = step
    return raw


@pytest.mark.parametrize("step,field", [
    ([], "step"),
    ("decode", "step"),
    ([{"new_tokens": 0, "cached_tokens": 0, "count": 1}], "step.0.new_tokens"),
    ([{"new_tokens": 4, "cached_tokens": -1, "count": 1}], "step.0.cached_tokens"),
    ([{"new_tokens": 4, "cached_tokens": 0, "count": 0}], "step.0.count"),
    ([{"new_tokens": 1, "count": 1}, {"new_tokens": 2.5, "count": 1}], "step.1.new_tokens"),
    ([{"new_tokens": 4, "count": True}], "step.0.count"),
    ([{"new_tokens": 4}], "step.0.count"),
    ([{"new_tokens": 4, "count": 1, "cache": 3}], "step.0.cache"),
])
def test_bad_steps_name_the_field(step, field):
    with pytest.raises(ConfigError) as err:
        run(_with_step(step))
    assert err.value.field == field


def test_set_and_grids_reach_step_entries():
    from g5core.inputs.config import apply_overrides

    raw = _with_step([{"new_tokens": 1, "cached_tokens": 10, "count": 2}])
    out = apply_overrides(raw, ["step.0.cached_tokens=4095", "step.0.count=8"])
    assert out["step"] == [{"new_tokens": 1, "cached_tokens": 4095, "count": 8}]
    assert raw["step"][0]["cached_tokens"] == 10
    with pytest.raises(ConfigError, match="index 0..0"):
        apply_overrides(raw, ["step.3.count=1"])


def test_a_cached_prefix_beyond_the_models_context_warns():
    from g5core.present.caveats import deployment_warnings

    plan = make_plan(_with_step([{"new_tokens": 1024, "cached_tokens": 140_000, "count": 1}]))
    assert any("longest context" in w and "141,024" in w for w in deployment_warnings(plan.ctx))


# ----------------------------------------------------------------------------------------
# Attention over a cached prefix, varlen decode, GEMMs on the step's tokens
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("p,t", [(30000, 2048), (1, 2), (4096, 4096), (100_000, 512)])
def test_prefix_attention_flops_follow_the_formula(p, t):
    ctx = g5core.prepare(_with_step([{"new_tokens": t, "cached_tokens": p, "count": 3}])).plan.ctx
    work = ctx.work("attention")
    a = ctx.model.attention
    heads = a.n_heads / 8
    assert work.flops == pytest.approx(3 * heads * 2 * a.head_dim * (t * t + 2 * t * p), rel=1e-12)
    # it reads Q and O of the new tokens and the KV of every token
    c_kv = ctx.kv_bytes_per_token_local
    assert work.hbm_bytes == pytest.approx(3 * (t * heads * 2 * a.head_dim * 2 + (p + t) * c_kv), rel=1e-12)


def test_no_prefix_is_todays_causal_prefill_and_one_new_token_is_decode():
    plan = make_plan(load_raw(DECODE, TP8 + ["phase=prefill", "seq_len=2048", "batch=2"]))
    ctx = plan.ctx
    shape = ctx.shape
    old = attention_work(ctx.model, ctx.deployment, shape, shape.q_tokens, shape.kv_len)
    new = step_attention_work(ctx.model, ctx.deployment, shape)
    assert (new.flops, new.hbm_bytes) == old
    assert prefix_attention_flops(2, 2048, 0, 8, 128, 128) == g5core.causal_attention_flops(2, 2048, 8, 128, 128)
    # T = 1 is a decode group: the step [{1, P, b}] is the decode shorthand at seq_len P + 1
    one = g5core.prepare(DECODE, overrides=TP8).simulate([StepGroup(new_tokens=1, cached_tokens=4095, count=8)])
    assert one.latency_s == run(load_raw(DECODE, TP8 + ["batch=8", "seq_len=4096"])).latency_s


def test_varlen_decode_reads_each_sequences_kv():
    mixed = [StepGroup(new_tokens=1, cached_tokens=1023, count=16), StepGroup(new_tokens=1, cached_tokens=8191, count=16)]
    plan = g5core.prepare(DECODE, overrides=TP8)
    work = plan.plan_for(mixed).ctx.work("attention")
    parts = [plan.plan_for([g]).ctx.work("attention") for g in mixed]
    assert work.flops == pytest.approx(sum(p.flops for p in parts), rel=1e-12)
    assert work.hbm_bytes == pytest.approx(sum(p.hbm_bytes for p in parts), rel=1e-12)
    flash = [k for k in work.kernels if isinstance(k, g5core.Attention)]    # beside it: the split-KV combine
    assert len(flash) == 1 and flash[0].batch == 32   # one flash-decoding kernel


def test_a_mixed_step_lies_between_its_slowest_part_and_the_sum_of_its_parts():
    plan = g5core.prepare(DECODE, overrides=TP8)
    chunk = StepGroup(new_tokens=2048, cached_tokens=30000, count=1)
    decode = StepGroup(new_tokens=1, cached_tokens=8191, count=64)
    both = plan.simulate([chunk, decode]).latency_s
    alone = [plan.simulate([g]).latency_s for g in (chunk, decode)]
    assert max(alone) < both < sum(alone)
    # the GEMMs see the step's total tokens: those of one 2112-token prompt
    total = plan.plan_for([StepGroup(new_tokens=2048 + 64, count=1)]).ctx
    ctx = plan.plan_for([chunk, decode]).ctx
    for kind in ("qkv_proj", "o_proj", "ffn"):
        assert ctx.work(kind).flops == total.work(kind).flops
        assert ctx.work(kind).kernels == total.work(kind).kernels


# ----------------------------------------------------------------------------------------
# Memory follows the step
# ----------------------------------------------------------------------------------------


def test_a_chunked_long_prefill_needs_less_activation_memory_and_the_same_kv():
    plan = g5core.prepare(DECODE, overrides=TP8)
    whole = plan.memory([StepGroup(new_tokens=131072, count=1)])
    chunk = plan.memory([StepGroup(new_tokens=16384, cached_tokens=131072 - 16384, count=1)])
    assert max(c.activation_bytes for c in chunk.per_chip) < max(c.activation_bytes for c in whole.per_chip) / 4
    assert [c.kv_cache_bytes for c in chunk.per_chip] == [c.kv_cache_bytes for c in whole.per_chip]


# ----------------------------------------------------------------------------------------
# Partial prefill under CP: pass-KV, pass-Q, auto
# ----------------------------------------------------------------------------------------

CP4 = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 8, "parallel": {"dp": 1, "tp": 2, "pp": 1, "cp": 4}}


def _cp_plan(mode: str):
    raw = dict(CP4, step=[{"new_tokens": 8192, "cached_tokens": 0, "count": 1}], plugins={"cp": {"prefill": mode}})
    return g5core.prepare(raw)


def _per_rank(res, reason: str) -> float:
    return res.sim.comm_bytes["per_rank_by_reason"][reason]


@pytest.mark.parametrize("t,p,count", [(2048, 30720, 1), (8192, 8192, 2), (1024, 0, 1)])
def test_partial_prefill_bytes_per_rank_follow_the_formulas(t, p, count):
    step = [StepGroup(new_tokens=t, cached_tokens=p, count=count)]
    kv = _cp_plan("pass_kv").simulate(step, detail=True)
    q = _cp_plan("pass_q").simulate(step, detail=True)
    m = _cp_plan("pass_kv").plan.ctx.model
    layers, cp, e = m.n_layers, 4, 2
    heads, d = m.attention.n_heads / 2, m.attention.head_dim
    c_kv = 2 * (m.attention.n_kv_heads / 2) * d * e                     # one TP rank's KV heads
    # pass-KV: (cp-1)/cp * (P+T) * c_kv per layer
    assert _per_rank(kv, "cp_passkv") == pytest.approx(layers * (cp - 1) / cp * count * (p + t) * c_kv, rel=1e-12)
    # pass-Q: the query blocks around the ring, then the partial outputs and statistics back
    assert _per_rank(q, "cp_passq_prefill") == pytest.approx(layers * (cp - 1) / cp * count * t * heads * d * e,
                                                             rel=1e-12)
    assert _per_rank(q, "cp_passq_prefill_return") == pytest.approx(
        layers * (cp - 1) / cp * count * t * (heads * d + 2 * heads) * e, rel=1e-12)
    assert kv.sim.kpis == q.sim.kpis == dict.fromkeys(kv.sim.kpis, 0)


def test_pass_q_moves_fewer_bytes_at_a_small_new_share():
    step = [StepGroup(new_tokens=1024, cached_tokens=64512, count=1)]      # T/(T+P) = 1/64
    kv = _cp_plan("pass_kv").simulate(step, detail=True)
    q = _cp_plan("pass_q").simulate(step, detail=True)
    assert _per_rank(q, "cp_passq_prefill") + _per_rank(q, "cp_passq_prefill_return") < _per_rank(kv, "cp_passkv") / 4
    whole = [StepGroup(new_tokens=65536, count=1)]                             # T/(T+P) = 1
    kv, q = _cp_plan("pass_kv").simulate(whole, detail=True), _cp_plan("pass_q").simulate(whole, detail=True)
    assert _per_rank(q, "cp_passq_prefill") + _per_rank(q, "cp_passq_prefill_return") > _per_rank(kv, "cp_passkv")


def test_auto_picks_per_the_papers_rule_and_says_so():
    from g5plugins.cp import auto_prefill_mode

    # the rule itself (arXiv:2411.01783, Algorithm 5), at figures worked by hand: N=4,
    # C=1e15 FLOP/s, BW=1e11 B/s, e=2, 2 N_KV / N_H = 0.25: T >= 4*1e15*0.125*2/(2*1e11) = 5000
    assert auto_prefill_mode(6000, 10**6, 4, 1e15, 1e11, 0.25, 2)[0] == "pass_kv"      # hidden by compute
    assert auto_prefill_mode(4000, 4000, 4, 1e15, 1e11, 0.25, 2)[0] == "pass_kv"       # T/(T+P) = 0.5 >= 0.25 - 0.2
    assert auto_prefill_mode(1000, 99000, 4, 1e15, 1e11, 0.25, 2)[0] == "pass_q"       # 0.01 < 0.25 - 0.05
    auto = _cp_plan("auto")
    for t, p in ((1024, 64512), (65536, 0)):
        res = auto.simulate([StepGroup(new_tokens=t, cached_tokens=p, count=1)])
        chosen = res.choices["cp"]["prefill"]
        expect = _cp_plan(chosen).simulate([StepGroup(new_tokens=t, cached_tokens=p, count=1)])
        assert res.latency_s == expect.latency_s
        assert "T/(T+P)" in res.choices["cp"]["rule"]
    assert auto.simulate([StepGroup(new_tokens=1024, cached_tokens=64512, count=1)]).choices["cp"]["prefill"] == "pass_q"
    assert auto.simulate([StepGroup(new_tokens=65536, count=1)]).choices["cp"]["prefill"] == "pass_kv"
    out = run(dict(CP4, step=[{"new_tokens": 1024, "cached_tokens": 64512, "count": 1}],
                   plugins={"cp": {"prefill": "auto"}})).to_json_dict()
    assert out["choices"]["cp"]["prefill"] == "pass_q"


def test_a_mixed_step_under_cp_is_refused():
    with pytest.raises(ConfigError, match="mixing prefill and decode"):
        run(dict(CP4, step=[{"new_tokens": 1024, "count": 1}, {"new_tokens": 1, "cached_tokens": 1023, "count": 4}]))


# ----------------------------------------------------------------------------------------
# The prepared plan reuses the op DAG of a step structure
# ----------------------------------------------------------------------------------------


def _sim_json(sim) -> dict:
    data = json.loads(json.dumps(sim.to_json_dict(), sort_keys=True, allow_nan=False))
    data.pop("sim_wall_s")
    return data


def test_a_reused_dag_gives_the_fresh_runs_results_bit_for_bit():
    plan = g5core.prepare(DECODE, overrides=TP8)
    base = {k: v for k, v in load_raw(DECODE, TP8).items() if k not in ("phase", "batch", "seq_len")}
    plan.simulate(Step.decode(16, 4096))
    plan.simulate([StepGroup(new_tokens=256, count=1), StepGroup(new_tokens=1, cached_tokens=99, count=8)])
    for step in (Step.decode(16, 30000),
                 Step([StepGroup(new_tokens=256, cached_tokens=4096, count=1),
                       StepGroup(new_tokens=1, cached_tokens=2047, count=8)])):
        reused = plan.simulate(step, detail=True)
        fresh = run(dict(base, step=step.to_list()))
        assert _sim_json(reused.sim) == _sim_json(fresh.sim)
    assert plan.cache_info()["dags_reused"] == 3          # the mixed step too: the decode step's ops and edges


def test_a_reused_dag_carries_the_new_steps_messages_and_work():
    """Another batch, another prefix, another ring's bytes: the same ops and edges, so the
    DAG is reused with the step's own specs, and the results are a fresh run's."""
    plan = _cp_plan("pass_kv")
    plan.simulate([StepGroup(new_tokens=1024, cached_tokens=1024, count=1)])
    base = {k: v for k, v in load_raw(DECODE, TP8).items() if k not in ("phase", "batch", "seq_len")}
    for step in ([StepGroup(new_tokens=1024, cached_tokens=8192, count=3)],
                 [StepGroup(new_tokens=4096, count=1), StepGroup(new_tokens=512, cached_tokens=512, count=2)]):
        res = plan.simulate(step, detail=True)
        assert _sim_json(res.sim) == _sim_json(run(dict(CP4, step=res.step.to_list())).sim)
    assert plan.cache_info()["dags_reused"] == 2
    tp8 = g5core.prepare(DECODE, overrides=TP8)
    tp8.simulate(Step.decode(16, 4096))
    res = tp8.simulate(Step.decode(48, 1000), detail=True)                   # another batch
    assert _sim_json(res.sim) == _sim_json(run(dict(base, step=res.step.to_list())).sim)
    res = tp8.simulate(Step.prefill(2, 512), detail=True)                    # prefill on the decode DAG
    assert _sim_json(res.sim) == _sim_json(run(dict(base, step=res.step.to_list())).sim)
    assert tp8.cache_info()["dags_reused"] == 2


def test_sweeps_and_search_read_the_step():
    from g5core.study.search import _objective
    from g5core.study.sweep import _input_columns

    assert _objective(None, "mixed") == "latency" and _objective(None, "prefill") == "ttft"
    cols = _input_columns(_with_step([{"new_tokens": 2048, "cached_tokens": 30000, "count": 1},
                                      {"new_tokens": 1, "cached_tokens": 8191, "count": 64}]))
    assert (cols["phase"], cols["batch"], cols["seq_len"]) == ("mixed", 65, 32048)


def test_a_sweep_grid_varies_step_entries(tmp_path):
    from g5core.study.sweep import parse_grid, run_sweep

    base = _with_step([{"new_tokens": 1, "cached_tokens": 1023, "count": 8},
                       {"new_tokens": 256, "cached_tokens": 0, "count": 1}])
    report = run_sweep(base, parse_grid(["step.1.cached_tokens=0,4096"]), tmp_path / "s.db")
    rows = report.rows
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert [r["phase"] for r in rows] == ["mixed", "mixed"]
    assert rows[0]["latency_s"] < rows[1]["latency_s"]                 # attention over a 4096-token prefix
    assert rows[0]["kv_cache_bytes"] < rows[1]["kv_cache_bytes"]
    assert rows[0]["ttft_s"] is None and rows[0]["tpot_s"] is None


def test_the_measured_tables_leave_a_prefix_block_to_the_roofline():
    from g5core.lower.kernels import Attention
    from g5core.inputs.systems import get_system
    from g5plugins.measured import attention_ms, has_prefix

    def kernel(q, kv):
        return Attention(batch=1, q_len=q, kv_len=kv, heads=8, kv_heads=1, d_qk=128, d_v=128, block="causal",
                         kv_bytes_per_token=512, act_bytes=2)

    assert not has_prefix(kernel(2048, 2048)) and has_prefix(kernel(2048, 2048 + 30000))
    system = get_system("h100-sxm")
    dep = make_plan(load_raw(DECODE, TP8)).ctx.deployment
    assert attention_ms(None, kernel(2048, 32048), "bf16", dep, system) is None


def test_a_prepared_plan_refuses_a_step_beyond_the_input_limits():
    plan = g5core.prepare(DECODE, overrides=TP8)
    with pytest.raises(ConfigError) as err:
        plan.simulate([StepGroup(new_tokens=1, cached_tokens=2 ** 41, count=1)])
    assert err.value.field == "step.0.cached_tokens"
    with pytest.raises(ConfigError, match="must be a positive whole number"):
        plan.simulate([{"new_tokens": 0, "count": 1}])


def test_a_prepared_plan_on_the_math_path_gives_the_closed_form():
    raw = load_raw(DECODE, TP8 + ["path=math"])
    plan = g5core.prepare(raw)
    res = plan.simulate(Step.decode(raw["batch"], raw["seq_len"]))
    assert res.latency_s == run(raw).latency_s
    assert plan.simulate([StepGroup(new_tokens=512, count=1), StepGroup(new_tokens=1, cached_tokens=99, count=4)]
                         ).latency_s > 0


@pytest.mark.parametrize("parallel,model", [
    ({"dp": 2, "tp": 2, "pp": 2, "cp": 1}, "llama-3.1-8b"),               # pipeline stages, replicas simulated once
    ({"dp": 2, "tp": 2, "pp": 1, "cp": 2, "ep": 4}, "mixtral-8x7b"),      # experts and a CP ring
])
def test_reuse_across_layouts_is_a_fresh_runs_result(parallel, model):
    base = {"model": model, "system": "h100-sxm", "chips": 8, "parallel": parallel}
    if parallel["cp"] == 1:
        steps = [[StepGroup(new_tokens=1, cached_tokens=1023, count=4)], [StepGroup(new_tokens=1, cached_tokens=4095, count=12)],
                 [StepGroup(new_tokens=512, count=1), StepGroup(new_tokens=1, cached_tokens=999, count=8)]]
    else:
        steps = [[StepGroup(new_tokens=1024, count=1)], [StepGroup(new_tokens=512, cached_tokens=2048, count=2)]]
    plan = g5core.prepare(dict(base, step=[g.to_dict() for g in steps[0]]))
    for step in steps:
        res = plan.simulate(step, detail=True)
        assert _sim_json(res.sim) == _sim_json(run(dict(base, step=res.step.to_list())).sim)
    assert plan.cache_info()["dags_reused"] == len(steps) - 1


def test_a_step_on_a_windowed_model_warns_that_its_attention_spans_the_context():
    from g5core.present.caveats import deployment_warnings

    base = {"model": "gemma-2-9b", "system": "h100-sxm", "chips": 1, "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1}}
    step = make_plan(dict(base, step=[{"new_tokens": 1024, "cached_tokens": 8192, "count": 1}]))
    assert any("windowed attention" in w and "cached prefix" in w for w in deployment_warnings(step.ctx))
    short = make_plan(dict(base, phase="prefill", batch=1, seq_len=8192))
    assert not any("windowed attention" in w for w in deployment_warnings(short.ctx))
