"""Number formats: bytes per parameter with block scales, the peak each runs at, and clear
errors where a chip has no such unit or a format cannot hold activations or KV."""
from __future__ import annotations

import pytest

from g5core.api.errors import ConfigError
from g5core.inputs.config import Dtypes
from g5core.inputs.dtypes import FORMATS, dtype_bytes
from g5core.inputs.systems import get_system


@pytest.mark.parametrize("name, expected", [
    ("fp32", 4), ("bf16", 2), ("fp16", 2), ("fp8", 1),
    ("nvfp4", 0.5 + 1 / 16),        # E2M1 + one E4M3 scale per 16 elements
    ("mxfp4", 0.5 + 1 / 32),        # E2M1 + one E8M0 scale per 32 elements
    ("int4", 0.5 + 2.5 / 128),      # 4-bit + fp16 scale and 4-bit zero per group of 128
])
def test_bytes_per_parameter_include_scales(name, expected):
    assert dtype_bytes(name, weights=True) == expected
    assert FORMATS[name].bytes_per_element == expected


def test_weight_formats_refused_for_activations_and_kv():
    for key in ("activations", "kv_cache"):
        with pytest.raises(ConfigError) as e:
            Dtypes.from_dict({key: "nvfp4"})
        assert e.value.field == f"dtypes.{key}" and "weight format" in str(e.value)
    assert Dtypes.from_dict({"kv_cache": "fp8"}).kv_cache_element_bytes == 1


def test_gemm_dtype_follows_the_format():
    d = Dtypes.from_dict({"weights": {"default": "bf16", "experts": "nvfp4", "ffn": "int4", "attention": "fp8"}})
    assert d.gemm_dtype("experts") == "fp4"     # FP4 tensor cores
    assert d.gemm_dtype("ffn") == "bf16"        # weight-only: dequantized, runs at the activations'
    assert d.gemm_dtype("attention") == "fp8"
    assert d.weight_element_bytes("experts") == 0.5625


def test_fp4_peak_where_the_chip_has_one_and_a_clear_error_where_not():
    assert get_system("b200").peak_flops("fp4") == 9.0e15
    assert get_system("gb200-nvl72").peak_flops("fp4") == 10.0e15
    with pytest.raises(ConfigError) as e:
        get_system("h200").peak_flops("fp4")
    assert "no FP4 tensor-core peak" in str(e.value) and "int4" in str(e.value)


def _run(system, weights, phase="decode"):
    from g5core.session.run import make_plan, simulate_plan
    plan = make_plan({"model": "llama-3.1-8b", "system": system, "chips": 1,
                      "parallel": {"tp": 1, "cp": 1, "dp": 1, "pp": 1, "ep": 1}, "phase": phase, "batch": 8,
                      "seq_len": 4096, "dtypes": {"weights": weights}})
    from g5core.sim.memory import memory_report
    return simulate_plan(plan), memory_report(plan.ctx)


def test_memory_and_gemm_time_follow_the_format():
    (bf16, m16), (int4, m4) = _run("h200", "bf16"), _run("h200", "int4")
    ratio = m4.per_chip[0].weights_bytes / m16.per_chip[0].weights_bytes
    assert ratio == pytest.approx((0.5 + 2.5 / 128) / 2)
    assert int4.latency_s < bf16.latency_s  # decode reads a quarter of the weight bytes
    (fp4, _), (fp8, _) = _run("b200", "nvfp4", "prefill"), _run("b200", "fp8", "prefill")
    assert fp4.latency_s < fp8.latency_s    # the FP4 peak is twice the FP8 one
    with pytest.raises(ConfigError, match="FP4"):
        _run("h200", "mxfp4")
