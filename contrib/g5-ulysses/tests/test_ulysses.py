"""The Ulysses plugin: G5's contract suite, the byte, memory and head formulas, and that
installing it changes nothing but `g5 plugins`."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import yaml

from g5core import CommOp, ComputeOp, ConfigError
from g5core.sim.memory import memory_report
from g5core.session.run import make_plan, run
from g5core.testing import plugin_checks

DATA = pathlib.Path(__file__).parent / "data"
GQA, MHA, MLA = (str(DATA / f"tiny-{k}.json") for k in ("gqa", "mha", "mla"))
BF16 = 2
LAYERS = 2


def cfg(model=GQA, phase="prefill", tp=1, sp=1, cp=1, batch=2, seq_len=256, **extra):
    raw = {"model": model, "system": "h100-sxm", "chips": tp * sp * cp,
           "parallel": {"dp": 1, "pp": 1, "cp": cp, "tp": tp, "sp": sp}, "phase": phase, "batch": batch,
           "seq_len": seq_len}
    raw.update(extra)
    return raw


REPLICATE = {"plugins": {"ulysses": {"replicate_kv": True}}}
CONTRACT_CONFIGS = [cfg(tp=2, sp=2), cfg(sp=2, phase="decode", batch=4), cfg(tp=2, sp=4, **REPLICATE),
                    cfg(model=MLA, sp=2, **REPLICATE)]


@pytest.mark.parametrize("name, check", plugin_checks("ulysses", CONTRACT_CONFIGS))
def test_contract(name, check):
    check()


# ------------------------------------------------------------------------------ DAG and bytes


def _ops(out, layer=0):
    return [op for op in out.sim.dag.ops if op.layer == layer and op.owner == "ulysses"]


def _flows(sim, key):
    c, i = sim.compiled, sim.dag.index[key]
    # payload per flow: a flow carries wire bytes, the payload times the op's wire factor
    return sorted((c.flow_src[f], c.flow_dst[f], c.flow_bytes[f] / c.wire_factor[i])
                  for f in range(c.flow_ptr[i], c.flow_ptr[i + 1]))


@pytest.mark.parametrize("tp,sp", [(2, 2), (1, 4), (4, 1)])
def test_prefill_a2a_bytes_follow_the_all_to_all_formula(tp, sp):
    """tiny-gqa: 16 heads of 32, 4 KV heads. Per rank: t = b*S/sp tokens; Q t*(16/tp)*32,
    K+V t*2*32*(KV heads per destination)*sp, output t*(16/tp)*32, bf16."""
    b, s = 2, 256
    out = run(cfg(tp=tp, sp=sp, batch=b, seq_len=s))
    ops = _ops(out)
    if sp == 1:
        assert ops == [] and "ulysses_a2a" not in out.sim.comm_bytes["by_reason"]
        return
    t = b * s / sp
    kv_dest = (4 // tp) // sp if (4 // tp) % sp == 0 else 1
    qkv = t * (16 / tp * 32 + 2 * 32 * kv_dest * sp) * BF16
    o = t * (16 / tp * 32) * BF16
    comm = {op.key.split(".")[2].split("@")[0]: op for op in ops if isinstance(op, CommOp)}
    assert comm["a2a_qkv"].bytes_per_rank == qkv and comm["a2a_out"].bytes_per_rank == o
    assert {op.reason for op in comm.values()} == {"ulysses_a2a"}
    # what crosses the links: every rank sends 1/sp of its buffer to each other rank
    group = comm["a2a_qkv"].group
    assert _flows(out.sim, comm["a2a_qkv"].key) == sorted((x, y, qkv / sp) for x in group for y in group if x != y)
    per_rank = out.sim.comm_bytes["per_rank_by_reason"]["ulysses_a2a"]
    assert per_rank == pytest.approx(LAYERS * (qkv + o) * (sp - 1) / sp, rel=1e-12)


def test_mha_bytes_are_four_n_h_over_p():
    """The textbook figure: 4 N h / P per rank per layer (times (P-1)/P that leaves the chip)."""
    b, s, sp, h = 1, 512, 4, 512
    out = run(cfg(model=MHA, sp=sp, batch=b, seq_len=s))
    per_layer = out.sim.comm_bytes["per_rank_by_reason"]["ulysses_a2a"] / LAYERS
    assert per_layer == 4 * (b * s) * h * BF16 / sp * (sp - 1) / sp


def test_dag_structure_and_attention_work():
    tp, sp, b, s = 2, 2, 2, 256
    out = run(cfg(tp=tp, sp=sp, batch=b, seq_len=s))
    dag = out.sim.dag
    for group in out.plan.ctx.rankmap.groups("sp"):
        ops = [op for op in _ops(out) if set(op.chips) <= set(group)]
        a2a_in = next(op for op in ops if isinstance(op, CommOp) and "a2a_qkv" in op.key)
        a2a_out = next(op for op in ops if isinstance(op, CommOp) and "a2a_out" in op.key)
        heads = [op for op in ops if isinstance(op, ComputeOp)]
        assert sorted(op.chip for op in heads) == sorted(group)
        for op in heads:
            assert dag.predecessors(op.key) == [a2a_in.key] and dag.successors(op.key) == [a2a_out.key]
            # the full causal sequence for 16 / (tp*sp) heads: b * S^2 * h * (d_qk + d_v)
            assert op.flops == b * s * s * (16 / (tp * sp)) * (32 + 32)
        assert sorted(dag.predecessors(a2a_in.key)) == sorted(f"L000.qkv_proj@c{c}" for c in group)
        assert sorted(dag.successors(a2a_out.key)) == sorted(f"L000.o_proj@c{c}" for c in group)
    assert all(v == 0 for v in out.sim.kpis.values())


def test_decode_shards_the_batch_and_reads_head_sharded_kv():
    sp, b, s = 2, 4, 1024
    out = run(cfg(sp=sp, phase="decode", batch=b, seq_len=s))
    assert out.plan.ctx.shape.tokens == b / sp
    heads = [op for op in _ops(out) if isinstance(op, ComputeOp)]
    # every sequence's new token, 16/sp heads, against the whole context: 2 b S h (d_qk + d_v)
    assert {op.flops for op in heads} == {2 * b * s * (16 / sp) * 64}
    a2a = [op for op in _ops(out) if isinstance(op, CommOp)]
    assert {op.bytes_per_rank for op in a2a} == {(b / sp) * (16 * 32 + 2 * 32 * 2 * sp) * BF16,
                                                 (b / sp) * 16 * 32 * BF16}


# ------------------------------------------------------------------------------------ memory


def _terms(raw):
    return {t.name: t.on(0) for t in memory_report(make_plan(raw).ctx).terms}


def test_kv_is_stored_head_sharded_and_activations_divide_by_sp():
    b, s = 2, 256
    c_kv = 2 * 4 * 32 * BF16
    base, split = _terms(cfg(tp=2, batch=b, seq_len=s)), _terms(cfg(tp=2, sp=2, batch=b, seq_len=s))
    assert split["kv_cache"] == b * s * c_kv * LAYERS / (2 * 2)
    assert split["weights"] == base["weights"]          # sp replicates the TP shard of the weights
    assert split["activations"] == base["activations"] / 2
    assert split["ulysses_a2a_buffers"] == (b * s / 2) * (8 * 32 + 2 * 32 * 1 * 2 + 8 * 32) * BF16


def test_replicated_kv_heads_cost_memory_and_are_shown():
    """tp=2 leaves 2 KV heads per TP rank; sp=4 replicates each twice: KV per chip is twice
    the even split over tp*sp = 8."""
    b, s = 2, 256
    c_kv = 2 * 4 * 32 * BF16
    with pytest.raises(ConfigError) as info:
        make_plan(cfg(tp=2, sp=4))
    msg = str(info.value)
    assert info.value.field == "parallel.sp" and "replicated 2 times" in msg and "KV memory x2" in msg
    assert "fewer sp" in msg and "more tp" in msg and "cp" in msg and "replicate_kv: true" in msg
    kv = _terms(cfg(tp=2, sp=4, batch=b, seq_len=s, **REPLICATE))["kv_cache"]
    assert kv == 2 * (b * s * c_kv * LAYERS / 8)


def test_mla_is_refused_or_replicated_with_the_memory_shown():
    with pytest.raises(ConfigError, match="single KV latent cannot be head-sharded.*replicate_kv: true.*use cp"):
        make_plan(cfg(model=MLA, sp=2))
    replicated = _terms(cfg(model=MLA, sp=2, **REPLICATE))["kv_cache"]
    assert replicated == _terms(cfg(model=MLA))["kv_cache"] == 2 * 256 * (64 + 16) * BF16 * LAYERS


# ------------------------------------------------------------------------------- constraints


@pytest.mark.parametrize("raw,field,needles", [
    (cfg(model=MHA, tp=2, sp=8), "parallel.sp", ("not divisible by tp x sp = 16", "fewer sp", "more tp", "cp")),
    (cfg(tp=1, sp=2, cp=2), "parallel.sp", ("not modelled", "use sp or cp")),
    (cfg(sp=2, seq_len=255), "seq_len", ("not divisible by sp=2",)),
    (cfg(sp=2, phase="decode", batch=3), "batch", ("not divisible by 2", "fewer sp")),
    (cfg(model=MHA, sp=3, seq_len=255), "parallel.sp", ("not divisible by tp x sp = 3",)),
])
def test_bad_layouts_name_the_fix(raw, field, needles):
    with pytest.raises(ConfigError) as info:
        make_plan(raw)
    assert info.value.field == field and "\n" not in str(info.value)
    for needle in needles:
        assert needle in str(info.value)


def test_disabling_it_with_sp_above_one_is_a_clear_error():
    with pytest.raises(ConfigError) as info:
        make_plan(cfg(tp=2, sp=2), disabled=["ulysses"])
    assert info.value.field == "parallel.sp" and "(disabled plugins: ulysses)" in str(info.value)
    with pytest.raises(ConfigError, match="plugin 'ulysses' is disabled or declares no options"):
        make_plan(dict(cfg(), parallel={"dp": 1, "pp": 1, "cp": 1, "tp": 1}, **REPLICATE), disabled=["ulysses"])


def test_sp_one_is_identical_to_a_run_without_the_plugin():
    a = run(cfg(tp=2, seq_len=512))
    raw = cfg(tp=2, seq_len=512)
    del raw["parallel"]["sp"]
    b = run(raw, disabled=["ulysses"])
    ja, jb = a.to_json_dict(), b.to_json_dict()
    for j in (ja, jb):
        j.pop("sim_wall_s")
    jb["deployment"].pop("plugins")
    ja["deployment"]["parallel"].pop("sp")
    assert ja == jb


# --------------------------------------------------------------------- installing changes nothing else

HIDE = """
import contextlib, importlib.metadata as md, io, json, sys
_orig = md.entry_points
def entry_points(**kw):
    eps = _orig(**kw)
    if kw.get("group") == "g5.plugins" and HIDE:
        return md.EntryPoints(ep for ep in eps if ep.name != "ulysses")
    return eps
md.entry_points = entry_points
from g5core.present.cli import main
outputs = []
for args in json.loads(sys.argv[1]):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(args, standalone_mode=False)
    outputs.append(buf.getvalue())
print(json.dumps(outputs))
"""


def _g5(tmp_path, hidden: bool, *commands) -> list[str]:
    """Outputs of ``g5 COMMAND`` for each command, in one fresh process."""
    script = tmp_path / f"g5_{hidden}.py"
    script.write_text(f"HIDE = {hidden}\n" + HIDE)
    done = subprocess.run([sys.executable, str(script), json.dumps(commands)], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout)


def test_installing_changes_g5_plugins_and_nothing_else(tmp_path):
    """The entry point hidden (as if uninstalled) versus registered, in fresh processes."""
    config = tmp_path / "c.yaml"
    raw = cfg(tp=2)
    del raw["parallel"]["sp"]
    config.write_text(yaml.safe_dump(raw))
    commands = (["plugins"], ["run", str(config), "--json"], ["explain", str(config)])
    (plugins_without, run_without, explain_without), (plugins_with, run_with, explain_with) = (
        _g5(tmp_path, h, *commands) for h in (True, False))
    # rows as words (the table's column widths follow its widest row)
    without, with_ = ([" ".join(line.split()) for line in out.splitlines() if line.strip("- ")]
                      for out in (plugins_without, plugins_with))
    added = [line for line in with_ if line not in without]
    assert len(added) == 1 and added[0].split()[:2] == ["ulysses", "enabled"]
    assert [line for line in without if line not in with_] == []

    runs = [json.loads(out) for out in (run_without, run_with)]
    for r in runs:
        r.pop("sim_wall_s")
    assert runs[0] == runs[1]
    explain = [out.splitlines() for out in (explain_without, explain_with)]
    # only the line listing what the installed plugins default differs
    diff = [(a, b) for a, b in zip(*explain) if a != b]
    assert len(explain[0]) == len(explain[1]) and len(diff) == 1 and diff[0][0].startswith("defaults:")
    assert "parallel.sp is 1 when omitted" in diff[0][1]


# ------------------------------------------------------------------------- the comparison example


def test_comparison_example_reports_the_largest_batch_that_fits():
    import importlib.util

    path = pathlib.Path(__file__).resolve().parents[3] / "examples" / "ulysses_tp_sp.py"
    spec = importlib.util.spec_from_file_location("ulysses_tp_sp", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for tp, sp in ((8, 1), (4, 2)):
        raw = example.config("llama-3.1-70b", "h100-sxm", tp, sp, 32768, 1, "bf16")
        best = example.largest_batch(raw)
        assert best >= 1 and example.fits(dict(raw, batch=best)) and not example.fits(dict(raw, batch=best + 1))
    # 1 x 8 holds the whole bf16 model on every chip: one sequence does not fit in 80 GiB
    assert example.largest_batch(example.config("llama-3.1-70b", "h100-sxm", 1, 8, 32768, 1, "bf16")) == 0


@pytest.mark.parametrize("model,sp", [(GQA, 2), (GQA, 4), (GQA, 8), (MHA, 4)])
def test_a2a_bytes_match_what_the_numerical_reference_exchanges(model, sp):
    """The plugin's all-to-all widths against the elements g5core.testing.reference.ulysses_attention
    really sends to other ranks (tp = 1; sp = 8 on 4 KV heads replicates them)."""
    import numpy as np

    from g5_ulysses import a2a_widths
    from g5core.testing import reference as R

    spec = make_plan(cfg(model=model, sp=sp, seq_len=64, **(REPLICATE if sp == 8 else {}))).ctx.model
    a = spec.attention
    rng = np.random.default_rng(sp)
    seq = 64
    q = rng.standard_normal((seq, a.n_heads, a.head_dim))
    k = rng.standard_normal((seq, a.n_kv_heads, a.head_dim))
    v = rng.standard_normal((seq, a.n_kv_heads, a.head_dim))
    out, sent = R.ulysses_attention(q, k, v, sp)
    assert np.max(np.abs(out - R.causal_attention(q, k, v))) < 1e-9
    q_w, kv_w, out_w = a2a_widths(spec, "prefill", 1, sp)
    leaves = (seq / sp) * (sp - 1) / sp
    assert sent["q"] + sent["k"] + sent["v"] == (q_w + kv_w) * leaves
    assert sent["out"] == out_w * leaves
