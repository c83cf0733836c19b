"""The ``framework:`` block of a system file: CUDA graphs, kernel launches, the eager
pass-KV ring; the launch time a run adds and reports."""
from __future__ import annotations

import pytest

from g5core.api.errors import ConfigError
from g5core.inputs.framework import FUSIONS, STACKS, Framework, kernel_hosts, launched_kernels
from g5core.inputs.systems import get_system
from g5core.session.run import run


def _system(tmp_path, **framework):
    body = ", ".join(f"{k}: {v}" for k, v in framework.items())
    path = tmp_path / f"fw-{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(f"base: h100-sxm\nname: h100-fw\nframework: {{{body}}}\n")
    return str(path)


def _decode(system, phase="decode", seq_len=4096, cp=1, chips=8):
    return run({"model": "llama-3.1-70b", "system": system, "chips": chips, "phase": phase, "batch": 1,
                "seq_len": seq_len, "parallel": {"dp": 1, "tp": chips // cp, "pp": 1, "cp": cp}})


def test_a_cuda_graph_decode_is_faster_than_an_eager_one_by_its_kernels_launch_cost(tmp_path):
    graphs, eager = _decode(_system(tmp_path, cuda_graphs="decode")), _decode(_system(tmp_path, cuda_graphs="none"))
    added = eager.sim.compute["launch"]["added_s"]
    assert graphs.sim.compute["launch"]["added_s"] == 0.0
    system = eager.plan.ctx.system
    ops = [op for op in eager.sim.dag.ops if hasattr(op, "kernels") and op.chip == 0]
    # every kernel that is launched (the generic stack runs the residual add inside the RMSNorm)
    kernels = sum(launched_kernels(op, system, "decode") for op in ops)
    assert 0 < kernels < sum(len(op.kernels) for op in ops)
    assert added == pytest.approx(kernels * 5e-6, rel=1e-9)
    # TP decode runs its compute ops one after another: the step is longer by exactly that
    assert eager.latency_s - graphs.latency_s == pytest.approx(added, rel=1e-6)
    assert "kernel launches:" in __import__("g5core.present.render", fromlist=["render_compute"]).render_compute(
        eager.sim.compute)[1]


def test_without_the_block_nothing_is_added_and_prefill_runs_eagerly_by_default(tmp_path):
    plain = _decode("h100-sxm", phase="prefill", seq_len=1024)
    assert plain.sim.compute["launch"] == {"framework": None, "added_s": 0.0}
    default = _decode(_system(tmp_path, kernel_launch_s=5e-6), phase="prefill", seq_len=1024)
    assert default.sim.compute["launch"]["added_s"] > 0
    assert default.latency_s > plain.latency_s


def test_the_pass_kv_ring_runs_eagerly_unless_the_block_says_otherwise(tmp_path):
    eager = _decode(_system(tmp_path, cuda_graphs="all"), phase="prefill", seq_len=8192, cp=2, chips=16)
    captured = _decode(_system(tmp_path, cuda_graphs="all", eager_passkv_ring="false"), phase="prefill",
                       seq_len=8192, cp=2, chips=16)
    assert captured.sim.compute["launch"]["added_s"] == 0.0
    assert eager.sim.compute["launch"]["added_s"] > 0


def test_piecewise_graphs_launch_only_the_attention_ops_of_a_decode_step_eagerly(tmp_path):
    full = _decode(_system(tmp_path, cuda_graphs="decode"))
    piecewise = _decode(_system(tmp_path, cuda_graphs="piecewise"))
    system = piecewise.plan.ctx.system
    attention = [op for op in piecewise.sim.dag.ops if getattr(op, "op_class", "") == "attention" and op.chip == 0]
    kernels = sum(launched_kernels(op, system, "decode") for op in attention)
    assert len(attention) == 80 and kernels >= 80
    # every attention op pays its launches, nothing else does
    assert piecewise.sim.compute["launch"]["added_s"] == pytest.approx(kernels * 5e-6, rel=1e-9)
    assert piecewise.latency_s - full.latency_s == pytest.approx(kernels * 5e-6, rel=1e-6)
    # prefill runs eagerly in both
    assert _decode(_system(tmp_path, cuda_graphs="piecewise"), phase="prefill", seq_len=1024).latency_s == \
        _decode(_system(tmp_path, cuda_graphs="decode"), phase="prefill", seq_len=1024).latency_s


@pytest.mark.parametrize("bad, message", [
    ({"cuda_graphs": "prefill"}, "choose one of decode, piecewise, all, none"),
    ({"kernel_launch_s": 2.0}, "expected seconds in 0 .. 1"),
    ({"eager_passkv_ring": "yes"}, "expected true or false"),
    ({"cuda_graph": "all"}, "did you mean .*'cuda_graphs'"),
])
def test_a_bad_framework_block_is_one_clear_error(bad, message):
    with pytest.raises(ConfigError, match=message):
        Framework.from_mapping(bad)
    data = get_system("h100-sxm").to_dict()
    data["framework"] = bad
    with pytest.raises(ConfigError, match="system.framework"):
        type(get_system("h100-sxm")).from_dict(data)


def test_the_framework_chooses_the_attention_kernel_family_and_the_default_is_unchanged(tmp_path):
    long = dict(phase="prefill", seq_len=16384)
    base = _decode("h100-sxm", **long)
    trt = _decode(_system(tmp_path, attention="default"), **long)
    fa3 = _decode(_system(tmp_path, attention="fa3"), **long)
    cm = get_system("h100-sxm").compute_model
    assert cm.attention_curve("fa3") == (0.645, 614.0) and cm.attention_curve() == (0.592, 1341.0)
    assert trt.latency_s == pytest.approx(base.latency_s + trt.sim.compute["launch"]["added_s"], rel=1e-9)
    assert fa3.latency_s < trt.latency_s          # FA3's curve is the faster one at 16K tokens
    with pytest.raises(ConfigError, match="no attention curve 'fa2'"):
        _decode(_system(tmp_path, attention="fa2"), **long)


def _ffn_op(tokens=1.0):
    from g5core.api.ops import ComputeOp
    from g5core.lower.kernels import Elementwise, Gemm

    g = [Gemm(m=tokens, n=28672, k=8192, weight_bytes=1, act_bytes=2),
         Gemm(m=tokens, n=8192, k=14336, weight_bytes=1, act_bytes=2)]
    side = [Elementwise(tokens=tokens, width=14336, kind="swiglu", act_bytes=2),
            Elementwise(tokens=tokens, width=8192, kind="fp8_quant", act_bytes=2),
            Elementwise(tokens=tokens, width=14336, kind="fp8_quant", act_bytes=2)]
    return ComputeOp(key="ffn", chip=0, layer=0, name="ffn", op_class="gemm", dtype="fp8", flops=1.0,
                     hbm_bytes=1.0, kernels=tuple(g + side))


def test_a_framework_that_fuses_fp8_quantisation_runs_no_separate_kernel(tmp_path):
    from g5core.sim.roofline import op_latency_s

    op = _ffn_op(2048)
    fused = get_system(_system(tmp_path, fused_fp8_quant="true"))
    plain = get_system("h100-sxm")
    # the input's quantisation joins the gate/up GEMM, the down GEMM's joins SwiGLU
    assert kernel_hosts(op, fused, "prefill") == (None, None, None, 0, 2)
    assert kernel_hosts(op, plain, "prefill") == (None,) * 5
    assert op_latency_s(op, fused, "prefill") < op_latency_s(op, plain, "prefill")


def test_the_stacks_fuse_what_their_sources_say_and_overrides_win(tmp_path):
    assert Framework.from_mapping({}).fusions == ("add_norm",) == STACKS["generic"]
    trt = Framework.from_mapping({"stack": "trtllm"})
    assert set(trt.fusions) == set(FUSIONS) - {"swiglu_in_gemm"}
    vllm = Framework.from_mapping({"stack": "vllm", "fusions": {"attn_quant": True, "norm_quant": False}})
    assert vllm.fusions == ("add_norm", "act_quant", "attn_quant")
    assert Framework.from_mapping({"stack": "sglang"}).fusions == ("add_norm",)
    assert trt.to_dict()["fusions"]["splitkv_in_attention"] is True
    with pytest.raises(ConfigError, match="system.framework.stack.*choose one of generic, trtllm, vllm, sglang"):
        Framework.from_mapping({"stack": "tensorrt"})
    with pytest.raises(ConfigError, match="system.framework.fusions"):
        Framework.from_mapping({"fusions": {"rope_kv": True}})


def test_fused_kernels_cost_nothing_but_their_bytes_join_the_host(tmp_path):
    """A decode step under TensorRT-LLM runs fewer kernels than under SGLang, and a fused
    kernel's bytes make its host longer where the host is memory-bound (not its floor)."""
    from g5core.sim.roofline import kernel_latency_s, op_latency_s

    trt = get_system(_system(tmp_path, stack="trtllm", cuda_graphs="none"))
    sgl = get_system(_system(tmp_path, stack="sglang", cuda_graphs="none"))
    op = _ffn_op(8192)   # prefill: the side kernels are memory-bound
    swiglu, quant = op.kernels[2], op.kernels[4]
    host_alone = kernel_latency_s(swiglu, "fp8", trt)
    host_fused = kernel_latency_s(swiglu, "fp8", trt, quant.hbm_bytes)
    assert host_fused == pytest.approx(host_alone + quant.hbm_bytes / (trt.hbm_bw_bytes_per_s
                                                                       * trt.compute_model.hbm_fraction))
    gap = op_latency_s(op, sgl, "prefill") - op_latency_s(op, trt, "prefill")
    assert gap > 0
    runs = {name: _decode(_system(tmp_path, stack=name, cuda_graphs="none"), seq_len=16384)
            for name in ("trtllm", "sglang")}
    launched = {name: r.sim.compute["launch"]["added_s"] / 5e-6 for name, r in runs.items()}
    assert launched["trtllm"] < launched["sglang"]
    assert runs["trtllm"].latency_s < runs["sglang"].latency_s


def test_decode_ops_under_each_stack_keep_every_kernel_and_fuse_what_the_stack_fuses(tmp_path):
    """TensorRT-LLM's decode runs rotary and the KV append inside XQA (hosted by the QKV GEMM here),
    the split-KV combine inside XQA and the FP8 quantisations inside their producers; vLLM keeps
    rotary, the append and FA3's combine as kernels of their own. Every kernel stays in the op."""
    fp8 = {"weights": "fp8", "activations": "bf16", "kv_cache": "fp8"}
    runs = {name: run({"model": "llama-3.1-70b", "system": _system(tmp_path, stack=name), "chips": 2,
                       "phase": "decode", "batch": 1, "seq_len": 5250, "dtypes": fp8,
                       "parallel": {"dp": 1, "tp": 2, "pp": 1, "cp": 1}}) for name in ("trtllm", "vllm")}
    for name, r in runs.items():
        system = r.plan.ctx.system
        ops = {op.name: op for op in r.sim.dag.ops if hasattr(op, "kernels") and op.chip == 0 and op.layer == 1}
        qkv, attn, o_proj = ops["qkv_proj"], ops["attention"], ops["o_proj"]
        assert [getattr(k, "kind", k.op_class) for k in qkv.kernels] == ["gemm", "rotary", "fp8_quant", "kv_append"]
        assert [getattr(k, "kind", k.op_class) for k in attn.kernels] == ["attention", "splitkv_combine"]
        hosts = {op.name: kernel_hosts(op, system, "decode") for op in (qkv, attn, o_proj)}
        if name == "trtllm":
            assert hosts == {"qkv_proj": (None, 0, 0, 0), "attention": (None, 0), "o_proj": (None, 0)}
        else:
            assert hosts == {"qkv_proj": (None, None, 0, None), "attention": (None, None), "o_proj": (None, None)}
    assert runs["trtllm"].latency_s < runs["vllm"].latency_s
