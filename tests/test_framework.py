"""The ``framework:`` block of a system file: CUDA graphs, kernel launches, the eager
pass-KV ring; the launch time a run adds and reports."""
from __future__ import annotations

import pytest

from g5core.api.errors import ConfigError
from g5core.inputs.framework import Framework
from g5core.inputs.systems import get_system
from g5core.sim.run import run


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
    kernels = sum(len(op.kernels) for op in eager.sim.dag.ops if hasattr(op, "kernels") and op.chip == 0)
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


@pytest.mark.parametrize("bad, message", [
    ({"cuda_graphs": "prefill"}, "choose one of decode, all, none"),
    ({"kernel_launch_s": 2.0}, "expected seconds in 0 .. 1"),
    ({"eager_passkv_ring": "yes"}, "expected true or false"),
    ({"cuda_graph": "all"}, "did you mean 'cuda_graphs'"),
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


def test_a_framework_that_fuses_fp8_quantisation_runs_no_separate_kernel(tmp_path):
    from g5core.sim.compute import Elementwise
    from g5core.sim.roofline import kernel_latency_s

    quant = Elementwise(tokens=2048, width=8192, kind="fp8_quant", act_bytes=2)
    fused = get_system(_system(tmp_path, fused_fp8_quant="true"))
    assert kernel_latency_s(quant, "fp8", fused) == 0.0
    assert kernel_latency_s(quant, "fp8", get_system("h100-sxm")) > 0.0
