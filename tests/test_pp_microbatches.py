"""Micro-batches through the pipeline (plugins.pp.microbatches, g5core.lower.microbatch).

Decode micro-batches cycle through the stages and the engine measures the steady cycle;
prefill chunks follow one another and attend over the earlier chunks (prefix attention).
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from g5core import ConfigError
from g5core.lower.builder import build_dag
from g5core.sim.memory import memory_report
from g5core.session.run import make_plan, run
from g5core.study.search import best_layouts

BATCH = 8


def _raw(phase="decode", m=1, pp=4, tp=1, dp=1, batch=BATCH, seq_len=2048, model="llama-3.1-8b", **extra):
    raw = {"model": model, "system": "h100-sxm", "chips": dp * tp * pp, "parallel": {"dp": dp, "tp": tp, "pp": pp, "cp": 1},
           "phase": phase, "batch": batch, "seq_len": seq_len}
    if m is not None:
        raw["plugins"] = {"pp": {"microbatches": m}}
    raw.update(extra)
    return raw


def _tps(raw) -> float:
    return run(raw).to_json_dict()["tokens_per_s_per_chip"]


# ------------------------------------------------------------------------------------------
# Decode: micro-batches cycling through the stages
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def decode_runs():
    return {m: run(_raw(m=m)) for m in (1, 2, 3, 4, 8)}


def test_decode_throughput_rises_with_m_up_to_pp_and_stays_within_pp_times(decode_runs):
    tps = {m: out.to_json_dict()["tokens_per_s_per_chip"] for m, out in decode_runs.items()}
    assert tps[1] < tps[2] < tps[3] < tps[4]
    for m, value in tps.items():
        assert value <= 4 * tps[1] * (1 + 1e-12), m
    # past pp the stages are full: more micro-batches add nothing
    assert tps[8] <= tps[4] * (1 + 1e-9)
    # each micro-batch's cycle at m <= pp is about one pass through the stages: the
    # throughput is far above the m=1 figure (the last stage, with the LM head, is busiest)
    assert tps[4] > 3 * tps[1]


def test_decode_reports_the_steady_cycle_and_step_interval(decode_runs):
    for m in (2, 3, 4, 8):
        d = decode_runs[m].to_json_dict()
        p = d["pipeline"]
        assert p["microbatches"] == m and p["batch_sequences"] == [BATCH] * m
        assert p["steady"] and p["cycles_simulated"] >= 4
        assert d["tpot_s"] == d["latency_s"] == p["cycle_s"]
        assert p["step_interval_s"] == pytest.approx(p["cycle_s"] / m, rel=1e-12)
        # the throughput is m batches per cycle
        assert d["tokens_per_s_per_chip"] == pytest.approx(m * BATCH / p["cycle_s"] / 4, rel=1e-12)
        assert p["simulated_s"] > (p["cycles_simulated"] - 1) * p["cycle_s"]
    assert "pipeline" not in decode_runs[1].to_json_dict()


def test_decode_cycle_at_m_above_pp_is_set_by_the_busiest_stage(decode_runs):
    # with 8 micro-batches on 4 stages every stage is always busy: the cycle is 8 passes of
    # the slowest stage, twice the cycle at m = pp
    c4 = decode_runs[4].sim.pipeline["cycle_s"]
    c8 = decode_runs[8].sim.pipeline["cycle_s"]
    assert c8 == pytest.approx(2 * c4, rel=1e-6)


def test_one_forward_at_a_time_per_stage(decode_runs):
    # on each chip the micro-batches' compute does not interleave: in start order, a
    # micro-batch's ops on a stage form one run per cycle
    sim = decode_runs[4].sim
    dag, start = sim.dag, sim.start_s
    chip = np.asarray(sim.compiled.chip)
    tags = np.asarray([dag.stems[s].split(".")[1] if s >= 0 else "" for s in dag.key_stem])
    for c in range(4):
        ops = np.flatnonzero(chip == c)
        seq = tags[ops[np.argsort(start[ops], kind="stable")]]
        runs = [t for i, t in enumerate(seq) if i == 0 or seq[i - 1] != t]
        assert len(runs) == len(set(runs)) == 4 * 4   # 4 cycles x 4 micro-batches, each one run


def test_tokens_return_to_the_first_stage(decode_runs):
    p = decode_runs[4].sim.pipeline
    sent = decode_runs[4].sim.comm_bytes["by_reason"]["pp_token"]
    # every cycle after the first: each micro-batch's int32 token ids, last stage -> first
    assert sent == (p["cycles_simulated"] - 1) * 4 * BATCH * 4


def test_decode_micro_batches_keep_their_kv(decode_runs):
    one = memory_report(make_plan(_raw(m=1)).ctx)
    four = memory_report(make_plan(_raw(m=4)).ctx)
    for a, b in zip(one.per_chip, four.per_chip):
        assert b.kv_cache_bytes == 4 * a.kv_cache_bytes
        assert b.weights_bytes == a.weights_bytes and b.activation_bytes == a.activation_bytes


def test_micro_batches_with_tp_and_dp_replicas_agree_with_every_chip_simulated():
    raw = _raw(m=2, pp=2, tp=2, dp=2, seq_len=1024)
    sym = run(raw)
    full = run(raw, symmetry=False)
    assert sym.sim.symmetry.applied and not full.sim.symmetry.applied
    assert sym.latency_s == full.latency_s
    assert sym.to_json_dict()["tokens_per_s_per_chip"] == full.to_json_dict()["tokens_per_s_per_chip"]


# ------------------------------------------------------------------------------------------
# Prefill: a long prompt in chunks through the stages
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prefill_runs():
    return {m: run(_raw(phase="prefill", m=m, batch=1, seq_len=32768)) for m in (1, 4)}


def test_chunked_long_prefill_has_a_lower_ttft_on_pp_stages(prefill_runs):
    whole, chunked = prefill_runs[1].to_json_dict(), prefill_runs[4].to_json_dict()
    assert chunked["ttft_s"] < 0.75 * whole["ttft_s"]
    assert chunked["pipeline"] == {"microbatches": 4, "chunk_tokens": [8192] * 4, "simulated_steps": 4}
    assert chunked["tokens_per_s_per_chip"] == pytest.approx(32768 / chunked["ttft_s"] / 4, rel=1e-12)


def test_chunks_do_the_whole_prompts_work(prefill_runs):
    # chunks attending over their prefix add up to the whole causal attention, and every
    # other op sees the same tokens in all: the DAG's FLOPs are the same
    def total(out):
        d = out.sim.compiled
        return math.fsum(np.asarray(d.flops, dtype=float)[~np.asarray(d.is_comm)].tolist())

    assert total(prefill_runs[4]) == pytest.approx(total(prefill_runs[1]), rel=1e-12)


def test_chunked_prefill_needs_a_chunks_activations_and_the_whole_prompts_kv():
    whole = memory_report(make_plan(_raw(phase="prefill", m=1, batch=1, seq_len=131072)).ctx)
    chunked = memory_report(make_plan(_raw(phase="prefill", m=4, batch=1, seq_len=131072)).ctx)
    for a, b in zip(whole.per_chip, chunked.per_chip):
        assert b.activation_bytes == pytest.approx(a.activation_bytes / 4, rel=1e-12)
        assert b.kv_cache_bytes == a.kv_cache_bytes and b.weights_bytes == a.weights_bytes


def test_later_chunks_attend_over_the_earlier_ones():
    plan = make_plan(_raw(phase="prefill", m=3, pp=2, batch=2, seq_len=3000))
    parts = plan.micro_batches.parts
    assert [p.shape.kv_len - p.shape.q_tokens for p in parts] == [0, 1000, 2000]
    assert [p.shape.kv_len for p in parts] == [1000, 2000, 3000]
    heads, d = plan.ctx.model.attention.n_heads, plan.ctx.model.attention.head_dim
    for p, prefix in zip(parts, (0, 1000, 2000)):
        work = p.work("attention")
        assert work.flops == pytest.approx(2 * 1000 * (2 * prefix + 1000) * heads * 2 * d, rel=1e-12)
        (kernel,) = work.kernels
        assert kernel.block == "causal" and (kernel.q_len, kernel.kv_len) == (1000, 1000 + prefix)
        assert kernel.flops == work.flops
    # chunk j's attention waits for chunk j-1's K/V at the same layer
    program = {lop.id: lop for lop in plan.micro_batches.program(plan.ctx, 1)}
    assert "L005.m1.qkv_proj" in program["L005.m2.attention"].inputs
    assert "lm_head" not in {lop.kind for lop in program.values() if lop.micro != 2}
    dag = build_dag(plan, tuple(program.values()), contexts=dict(enumerate(parts)))
    assert len(dag.ops) > 0




# ------------------------------------------------------------------------------------------
# m = 1 and bad m
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_m_equal_1_changes_nothing(phase):
    def body(out):
        d = json.loads(json.dumps(out.to_json_dict()))
        d.pop("sim_wall_s")
        d.pop("deployment")
        return d

    assert body(run(_raw(phase=phase, m=1, pp=2, seq_len=512))) == body(run(_raw(phase=phase, m=None, pp=2, seq_len=512)))


@pytest.mark.parametrize("m, phase, words", [
    (0, "decode", "positive whole number"), (-2, "prefill", "positive whole number"),
    (2.5, "decode", "positive whole number"), ("4", "decode", "positive whole number"),
    (513, "prefill", "cannot be cut from seq_len=512"),
])
def test_bad_m_is_a_one_line_error_naming_the_field(m, phase, words):
    with pytest.raises(ConfigError) as exc:
        make_plan(_raw(phase=phase, m=m, pp=2, seq_len=512))
    assert exc.value.field == "plugins.pp.microbatches"
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_refused_combinations_name_the_field():
    with pytest.raises(ConfigError, match="math path") as exc:
        make_plan(_raw(m=2, pp=2, path="math"))
    assert exc.value.field == "plugins.pp.microbatches"
    # a chunk the CP plugin refuses (2731 tokens: not divisible by 2 x cp)
    raw = _raw(phase="prefill", m=3, pp=2, seq_len=8192)
    raw["parallel"]["cp"] = 2
    raw["chips"] = 4
    with pytest.raises(ConfigError, match=r"micro-batch 0 \(tokens 0..2730\) is refused .*2 x cp") as exc:
        make_plan(raw)
    assert exc.value.field == "plugins.pp.microbatches" and "\n" not in str(exc.value)
    # a step: list is one engine iteration of its own
    raw = _raw(m=2, pp=2)
    for key in ("phase", "batch", "seq_len"):
        raw.pop(key)
    raw["step"] = [{"new_tokens": 1, "cached_tokens": 100, "count": 4}, {"new_tokens": 64, "cached_tokens": 0, "count": 1}]
    with pytest.raises(ConfigError, match="shorthand") as exc:
        make_plan(raw)
    assert exc.value.field == "plugins.pp.microbatches"


@pytest.mark.parametrize("extra", [{"cp": 2}, {"sp": 2}], ids=["cp-pass-kv", "ulysses"])
def test_chunked_prefill_with_sequence_parallel_attention(extra):
    # the chunks run the sequence-sharding plugin's attention over their cached prefix
    # (pass-KV over the prefix, Ulysses over whole sequences): the same FLOPs, a lower TTFT
    def total(out):
        d = out.sim.compiled
        return math.fsum(np.asarray(d.flops, dtype=float)[~np.asarray(d.is_comm)].tolist())

    def raw(m):
        r = _raw(phase="prefill", m=m, pp=2, batch=1, seq_len=8192)
        r["parallel"].update(extra)
        r["chips"] = 4
        return r

    whole, chunked = run(raw(1)), run(raw(4))
    assert total(chunked) == pytest.approx(total(whole), rel=1e-12)
    assert chunked.latency_s < 0.9 * whole.latency_s


def test_cli_bad_m_exits_2_and_writes_nothing(tmp_path):
    from click.testing import CliRunner

    from g5core.present.cli import main

    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(_raw(m=0, pp=2)))
    out = tmp_path / "trace.json"
    res = CliRunner().invoke(main, ["run", str(cfg), "--json", "--trace", str(out)])
    assert res.exit_code == 2
    assert "plugins.pp.microbatches" in res.output and not out.exists()


# ------------------------------------------------------------------------------------------
# g5 best ranks pp layouts on the pipelined throughput
# ------------------------------------------------------------------------------------------


@pytest.mark.bench   # 25 s on 2 cores: a g5 best search (python3 -m pytest -q -m bench)
def test_best_ranks_pp_layouts_on_pipelined_throughput(tmp_path):
    raw = _raw(m=4, pp=4)
    result = best_layouts(raw, objective="tokens_per_s_per_chip", db_path=tmp_path / "b.db")
    values = [c.objective_value for c in result.ranked]
    assert values == sorted(values, reverse=True)
    pp4 = next(c for c in result.ranked if c.parallel["pp"] == 4)
    assert pp4.tokens_per_s_per_chip == pytest.approx(_tps(raw), rel=1e-12)
    dp4 = next(c for c in result.ranked if c.parallel["dp"] == 4)
    # with 4 micro-batches the pipeline is no longer a quarter of the data-parallel layout
    assert pp4.tokens_per_s_per_chip > 0.75 * dp4.tokens_per_s_per_chip


# ------------------------------------------------------------------------------------------
# The hook's contract: a plugin's bad split names the plugin
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("answer, words", [
    ({"chunks": (100, 100)}, "do not add up to seq_len=512"),
    ({"batches": (8, 4)}, "must each be batch=8"),
    ({"batches": (8,), "chunks": (512,)}, "exactly one"),
    ({"chunks": (512, 0)}, "positive int"),
])
def test_a_plugins_bad_split_is_refused_naming_it(answer, words):
    from g5core import PipelineMicrobatches, PluginError, hookimpl

    class Splitter:
        @hookimpl
        def g5_pipeline_microbatches(self, deployment, model):
            return PipelineMicrobatches("plugins.splitter.parts", **answer)

    phase = "prefill" if "chunks" in answer else "decode"
    with pytest.raises(PluginError, match=words) as exc:
        make_plan(_raw(phase=phase, m=None, pp=2, seq_len=512), extra_plugins=[("splitter", Splitter())])
    assert exc.value.plugin == "splitter"


def test_the_size_guard_counts_every_micro_batch_and_cycle():
    from g5core import G5Error
    from g5core.lower.builder import check_size

    whole = check_size(make_plan(_raw(m=1, pp=2, seq_len=512)))
    split = check_size(make_plan(_raw(m=3, pp=2, seq_len=512)))
    # 3 micro-batches, 4 cycles each, each step with its token return (one send, one flow)
    assert split.total == 3 * 4 * (whole.total + 2)
    out = run(_raw(m=3, pp=2, seq_len=512), symmetry=False)
    assert out.sim.ops + out.sim.flows == split.total - 3 * 2   # the first cycle returns no tokens
    chunks = check_size(make_plan(_raw(phase="prefill", m=3, pp=2, seq_len=512)))
    out = run(_raw(phase="prefill", m=3, pp=2, seq_len=512), symmetry=False)
    assert chunks.total == 3 * check_size(make_plan(_raw(phase="prefill", m=1, pp=2, seq_len=512))).total
    assert out.sim.ops + out.sim.flows < chunks.total   # two chunks without the LM head
    with pytest.raises(G5Error, match="--max-ops"):
        run(_raw(m=3, pp=2, seq_len=512), max_ops=2 * whole.total)


def test_each_chunk_says_what_cp_auto_chose_for_it():
    raw = _raw(phase="prefill", m=4, pp=2, batch=1, seq_len=8192)
    raw["parallel"]["cp"] = 2
    raw["chips"] = 4
    raw["plugins"]["cp"] = {"prefill": "auto"}
    chosen = run(raw).to_json_dict()["pipeline"]["chunk_choices"]
    assert len(chosen) == 4
    assert all(c["cp"]["prefill"] in ("pass_kv", "pass_q") for c in chosen)
    assert "T/(T+P)=1 " in chosen[0]["cp"]["rule"] and "T/(T+P)=0.25 " in chosen[3]["cp"]["rule"]
