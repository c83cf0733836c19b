"""The memory-bound kernels around the GEMMs and attention: each in its op with its shape,
its FLOPs and bytes from its formula (g5core/lower/flops.py), in the op's totals and in
``--timeline``."""
from __future__ import annotations

import csv
import io

import pytest

from g5core.lower import flops as F
from g5core.lower.layers import split_kv_partitions
from g5core.inputs.models import get_model
from g5core.present.trace import dump_timeline
from g5core.lower.kernels import Elementwise
from g5core.session.run import run


def _cfg(model="llama-3.1-70b", phase="decode", seq_len=32768, tp=8, weights="bf16", batch=1):
    return {"model": model, "system": "h100-sxm", "chips": tp, "phase": phase, "batch": batch, "seq_len": seq_len,
            "parallel": {"dp": 1, "tp": tp, "pp": 1, "cp": 1},
            "dtypes": {"weights": weights, "activations": "bf16", "kv_cache": "bf16"}}


def _works(cfg):
    out = run(cfg)
    by_kind = {}
    for op in out.sim.dag.ops:
        if hasattr(op, "kernels") and op.layer == 0 and op.chip == 0:
            by_kind.setdefault(op.name, op)
    return out, by_kind


def _side(op, kind):
    return [k for k in op.kernels if isinstance(k, Elementwise) and k.kind == kind]


@pytest.mark.parametrize("kind, args, formula", [
    ("swiglu", (64, 3584, 2), F.swiglu(64, 3584, 2)),
    ("fp8_quant", (64, 8192, 2), F.fp8_quantize(64, 8192, 2)),
    ("kv_append", (64, 256, 2), F.kv_cache_append(64, 256, 2)),
])
def test_each_kernel_takes_its_flops_and_bytes_from_its_formula(kind, args, formula):
    k = Elementwise(tokens=args[0], width=args[1], kind=kind, act_bytes=args[2])
    assert (k.flops, k.hbm_bytes) == formula
    merge = Elementwise(tokens=512, width=128, kind="attn_merge", act_bytes=2, parts=4)
    assert (merge.flops, merge.hbm_bytes) == F.partials_merge(512, 128, 4, 2)
    assert F.partials_merge(1, 128, 2, 2) == (2 * (2 * 128 + 4), 3 * (128 * 2 + 4))
    assert F.swiglu(1, 10, 2) == (50.0, 60.0) and F.fp8_quantize(1, 10, 2) == (30.0, 50.0)
    assert F.moe_unpermute(8, 10, 8, 2) == (160.0, 8 * (20 + 8) + 20)


def test_a_dense_decode_layer_runs_swiglu_kv_append_and_the_split_kv_combine():
    out, ops = _works(_cfg())
    ffn, attn = ops["ffn"], ops["attention"]
    (act,) = _side(ffn, "swiglu")
    gate_up = ffn.kernels[0]
    assert act.tokens == gate_up.m and act.width == gate_up.n / 2 == 28672 / 8
    (append,) = _side(ops["qkv_proj"], "kv_append")
    assert append.tokens == 1 and append.width == 2 * 1 * 128     # K and V of one KV head on this chip
    (combine,) = _side(attn, "splitkv_combine")
    assert combine.parts == 32768 / 512 and combine.tokens == 64 / 8
    # the op's totals stay its GEMMs' (MFU counts them); the side kernels carry their own
    gemms = [k for k in ffn.kernels if not isinstance(k, Elementwise)]
    assert ffn.flops == pytest.approx(sum(k.flops for k in gemms))
    # no FP8 GEMM: no quantisation
    assert not _side(ops["qkv_proj"], "fp8_quant")


def test_the_lm_head_samples_greedily_over_the_whole_vocabulary():
    """The sampler after the LM head (vLLM V1's Sampler with default parameters): the logits
    cast to fp32, then their argmax, over every row that needs logits and the whole vocabulary
    on every TP rank (the logits are gathered first), in decode and in prefill."""
    for phase, batch in (("decode", 4), ("prefill", 2)):
        out = run(_cfg(phase=phase, seq_len=1024, batch=batch))
        (head,) = [op for op in out.sim.dag.ops if getattr(op, "name", "") == "lm_head" and op.chip == 0]
        (cast,), (argmax,) = _side(head, "logits_cast"), _side(head, "argmax")
        gemm = head.kernels[0]
        vocab = get_model("llama-3.1-70b").vocab_size
        assert gemm.n == vocab / 8 and cast.width == argmax.width == vocab      # TP8: a shard, then all
        assert cast.tokens == argmax.tokens == gemm.m == batch                   # one row a sequence
        assert (cast.flops, cast.hbm_bytes) == F.logits_cast(batch, vocab, 2)
        assert (argmax.flops, argmax.hbm_bytes) == F.greedy_argmax(batch, vocab)
        assert head.flops == pytest.approx(gemm.flops)                           # side kernels: time only
    assert F.logits_cast(2, 10, 2) == (20.0, 120.0) and F.greedy_argmax(2, 10) == (20.0, 96.0)


def test_fp8_weights_quantise_each_gemm_input_once():
    out, ops = _works(_cfg(weights="fp8", phase="prefill", seq_len=2048))
    quant = _side(ops["qkv_proj"], "fp8_quant")
    assert [(q.tokens, q.width) for q in quant] == [(2048, 8192)]              # one fused QKV input
    assert sorted(q.width for q in _side(ops["ffn"], "fp8_quant")) == [28672 / 8, 8192]
    assert not _side(ops["attention"], "splitkv_combine")                        # prefill: no flash-decoding


def test_split_kv_follows_vllms_rule():
    assert split_kv_partitions(1, 8, 4096) == 8             # few rows: v2 even below 8192 tokens
    assert split_kv_partitions(64, 64, 4096) == 1           # many rows, short context: v1
    assert split_kv_partitions(64, 64, 16384) == 32         # past 8192 tokens: v2
    assert split_kv_partitions(1, 8, 512) == 1              # one partition


def test_moe_layers_route_permute_and_unpermute():
    model = get_model("deepseek-v3")
    out, ops = _works(dict(_cfg(model="deepseek-v3", phase="prefill", seq_len=1024), system="h200"))
    layer = next(i for i in range(model.n_layers) if model.is_moe_layer(i))
    router = next(op for op in out.sim.dag.ops if hasattr(op, "kernels") and op.layer == layer
                  and op.name == "router" and op.chip == 0)
    (topk,) = _side(router, "moe_topk")
    assert topk.width == model.moe.n_routed_experts and topk.parts == model.moe.n_active_experts
    experts = next(op for op in out.sim.dag.ops if hasattr(op, "kernels") and op.layer == layer
                   and op.name == "moe_experts" and op.chip == 0)
    kinds = [k.kind for k in experts.kernels if isinstance(k, Elementwise)]
    assert {"swiglu", "moe_permute", "moe_unpermute"} <= set(kinds)


def test_every_side_kernel_appears_in_the_timeline_with_shape_flops_and_bytes():
    out = run(_cfg())
    buf = io.StringIO()
    dump_timeline(out.sim, buf)
    rows = list(csv.DictReader(io.StringIO(buf.getvalue())))
    text = " ".join(r["kernels"] for r in rows)
    for kind in ("swiglu(", "kv_append(", "splitkv_combine(", "gemm(", "attention_decode("):
        assert kind in text
    one = next(r for r in rows if r["name"] == "ffn")
    sw = next(part for part in one["kernels"].split("; ") if part.startswith("swiglu("))
    fl, by = F.swiglu(1, 28672 / 8, 2)
    assert f"flops={fl!r}" in sw and f"bytes={by!r}" in sw
    # given the system, a kernel that runs inside another says where (the generic stack: the
    # residual add inside the RMSNorm); the kernel, its shape, FLOPs and bytes stay listed
    marked = io.StringIO()
    dump_timeline(out.sim, marked, out.plan.ctx.system, "decode")
    norm = next(r for r in csv.DictReader(io.StringIO(marked.getvalue())) if r["name"] == "ffn_norm")
    add, rms = norm["kernels"].split("; ")
    assert add.startswith("residual_add(") and add.endswith(" fused=add_norm") and "fused=" not in rms
    assert "fused=" not in buf.getvalue()
