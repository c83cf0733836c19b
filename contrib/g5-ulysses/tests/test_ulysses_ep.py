"""Ulysses with experts: the EP rank space includes the sp ranks, experts are sharded over ep
(not replicated over sp), attention weights are replicated over sp unless tp splits them and
the ledger shows them on their own; the ledger's terms add up and decide what fits."""
from __future__ import annotations

import json
import pathlib

import pytest

from g5core import ConfigError
from g5core.sim.memory import memory_report
from g5core.session.run import make_plan, run
from g5core.testing import plugin_checks

DATA = pathlib.Path(__file__).parent / "data"
MLA = str(DATA / "tiny-mla.json")          # 2 layers, layer 1 MoE with 4 routed experts
REPLICATE = {"ulysses": {"replicate_kv": True}}


def cfg(tp=1, sp=4, ep=4, phase="prefill", batch=4, seq_len=256, system="h100-sxm"):
    return {"model": MLA, "system": system, "chips": tp * sp, "phase": phase, "batch": batch, "seq_len": seq_len,
            "parallel": {"dp": 1, "pp": 1, "cp": 1, "tp": tp, "sp": sp, "ep": ep}, "plugins": REPLICATE}


@pytest.mark.parametrize("name, check", plugin_checks("ulysses", [cfg(), cfg(tp=2, sp=2, ep=4, phase="decode")]))
def test_contract_with_ep(name, check):
    check()


def _terms(raw):
    mem = memory_report(make_plan(raw).ctx)
    return mem, {t.name: t for t in mem.terms}


def test_ep_groups_span_the_sp_ranks_and_shard_the_experts():
    plan = make_plan(cfg())
    assert plan.ctx.rankmap.groups("ep") == plan.ctx.rankmap.groups("sp") == ((0, 1, 2, 3),)
    assert plan.ctx.shape.experts == 1.0            # 4 routed experts over ep=4
    sharded, _ = _terms(cfg())
    replicated, _ = _terms(cfg(ep=1))               # sp alone: every chip holds all 4 experts
    m = plan.ctx.model
    expert_bytes = 3 * m.hidden_size * m.moe.expert_ffn_dim * 2  # one routed expert, bf16
    drop = replicated.per_chip[0].weights_bytes - sharded.per_chip[0].weights_bytes
    assert drop == pytest.approx(3 * expert_bytes)  # 3 of the 4 experts leave each chip


def test_attention_weights_replicated_over_sp_shown_apart_and_split_by_tp():
    from g5core.inputs.models import get_model
    m = get_model(MLA)
    full = sum(i * o for _, i, o in m.projection_shapes()) + m.hidden_size  # projections + attn_norm, per layer
    _, terms = _terms(cfg())
    part = terms["sp_replicated_attention_weights"]
    assert part.part_of == "weights" and part.category == "weights"
    assert [b for _, b in part.bytes_per_chip] == pytest.approx([m.n_layers * full * 2] * 4)  # whole, on every chip
    _, terms2 = _terms(cfg(tp=2, sp=2))
    assert terms2["sp_replicated_attention_weights"].on(0) < part.on(0)  # tp splits q_b, kv_b and o_proj


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_terms_add_up_and_decide_what_fits(phase):
    mem, terms = _terms(cfg(phase=phase))
    for c in mem.per_chip:
        whole = sum(t.on(c.chip) for t in mem.terms if not t.part_of)
        assert c.total_bytes == pytest.approx(whole)
        assert c.total_bytes == pytest.approx(c.weights_bytes + c.kv_cache_bytes + c.activation_bytes
                                              + c.workspace_bytes)
        assert terms["sp_replicated_attention_weights"].on(c.chip) <= c.weights_bytes
        assert c.fits == (c.total_bytes <= c.capacity_bytes)
    out = run(cfg(phase=phase))
    assert out.memory.fits == mem.fits and out.memory.max_total_bytes == mem.max_total_bytes
    js = out.to_json_dict()["memory"]["terms"]["sp_replicated_attention_weights"]
    assert js["part_of"] == "weights"


def test_a_layout_the_ledger_says_does_not_fit_is_excluded_by_best(tmp_path):
    """deepseek-v3 on 8 H200s at 64K decode: sp=8 ep=8 needs batch 8 (sp splits the batch)
    and does not fit; the ledger says so and the search excludes it for memory."""
    raw = {"model": "deepseek-v3", "system": "h200", "chips": 8, "phase": "decode", "batch": 8, "seq_len": 65536,
           "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "sp": 8, "ep": 8}, "plugins": REPLICATE,
           "dtypes": {"weights": {"default": "bf16", "experts": "fp8"}}}
    mem = memory_report(make_plan(raw).ctx)
    assert not mem.fits and "does not fit by" in mem.shortfall_summary()
    from g5core.study.search import prefilter
    keep, excluded = prefilter(raw, [raw["parallel"]])
    assert not keep and excluded[0].family == "memory"


def test_ep_that_does_not_divide_dp_sp_tp_names_the_rank_space():
    with pytest.raises(ConfigError, match="does not divide dp x sp x tp = 4"):
        make_plan(cfg(ep=8))


def test_the_comparison_script_runs_the_layouts_it_names():
    import importlib.util
    path = pathlib.Path(__file__).parents[3] / "benchmarks" / "ulysses_deepseek_v3.py"
    spec = importlib.util.spec_from_file_location("cmp", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.largest_batch("TP8", "decode", 131072) > 0
    for layout in mod.LAYOUTS:
        json.dumps(mod.config(layout, "prefill", 32768, 1))
