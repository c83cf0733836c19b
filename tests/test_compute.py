"""Compute fidelity: kernel shapes, the size-aware roofline, the measured tables, coverage."""
from __future__ import annotations

import math
import warnings

import attrs
import numpy as np
import pandas as pd
import pytest
import yaml

from g5core.inputs.systems import ComputeModel, Profile
from g5core.inputs.framework import Framework
from g5core.lower.kernels import Attention, Elementwise, Gemm
from g5core.api.errors import ConfigError
from g5core.session.run import make_plan, run
from g5core.inputs.systems import SystemSpec, get_system
from g5plugins import measured as M
from g5plugins.measured import tables as T
from g5core.sim.roofline import gemm_padded_flops, kernel_latency_s

H100 = get_system("h100-sxm")
PROFILE = Profile(source="aiconfigurator", gpu="h100_sxm", framework="trtllm")
H100_AIC = attrs.evolve(H100, profile=PROFILE)


class _Dtypes:
    kv_cache = "bf16"


class _Deployment:
    dtypes = _Dtypes


def _cfg(system="h100-sxm", **kw):
    raw = {"model": "llama-3.1-8b", "system": system, "chips": 1, "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1},
           "phase": "prefill", "batch": 1, "seq_len": 1024}
    raw.update(kw)
    return raw


@pytest.fixture(scope="module")
def aic_system_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("sys") / "h100-aic.yaml"
    p.write_text(yaml.safe_dump(dict(H100.to_dict(), name="h100-aic", profile=PROFILE.to_dict())))
    return str(p)


# -- the seam ---------------------------------------------------------------------------


def test_equal_flops_and_bytes_with_different_shapes_get_different_latencies(aic_system_file):
    """Two ops with the same FLOPs and bytes (the old cache key) but transposed GEMM shapes
    get their own measured times: the lookup key includes the kernels."""
    from g5core.lower.builder import build_dag
    from g5core.sim.compute import LatencyLookup
    plan = make_plan(_cfg(system=aic_system_file))
    op = next(o for o in build_dag(plan).ops if o.name == "lm_head")
    g = Gemm(m=64, n=8192, k=4096, weight_bytes=2, act_bytes=2)
    t = attrs.evolve(g, m=8192, n=64)
    assert (g.flops, g.hbm_bytes) == (t.flops, t.hbm_bytes)
    lookup = LatencyLookup(hooks=plan.hooks, system=plan.ctx.system, deployment=plan.ctx.deployment)
    a = lookup.seconds(attrs.evolve(op, kernels=(g,), flops=g.flops, hbm_bytes=g.hbm_bytes))
    b = lookup.seconds(attrs.evolve(op, kernels=(t,), flops=g.flops, hbm_bytes=g.hbm_bytes))
    assert a != b


def test_every_compute_op_carries_kernel_shapes_whose_work_matches_the_op():
    plan = make_plan(_cfg(parallel={"dp": 1, "tp": 2, "pp": 1, "cp": 2}, chips=4))
    from g5core.lower.builder import build_dag
    for op in build_dag(plan).ops:
        if not hasattr(op, "kernels"):
            continue
        assert op.kernels, op.key
        side = ("residual_add", "rotary", "swiglu", "fp8_quant", "kv_append", "splitkv_combine", "attn_merge",
                "moe_topk", "moe_permute", "moe_unpermute", "logits_cast", "argmax")  # time, not the op's FLOPs
        main = [k for k in op.kernels if not (isinstance(k, Elementwise) and k.kind in side)]
        assert math.isclose(sum(k.flops for k in main), op.flops, rel_tol=1e-9), op.key


def test_cp_ring_steps_are_a_causal_diagonal_then_full_blocks_of_equal_flops():
    plan = make_plan(_cfg(parallel={"dp": 1, "tp": 1, "pp": 1, "cp": 4}, chips=4, seq_len=4096))
    from g5core.lower.builder import build_dag
    steps = [o for o in build_dag(plan).ops if o.key.startswith("L000.attention.step") and o.chip == 0]
    assert [s.kernels[0].block for s in steps] == ["causal", "full", "full", "full"]
    assert steps[0].kernels[0].q_len == steps[0].kernels[0].kv_len == 1024
    assert (steps[1].kernels[0].q_len, steps[1].kernels[0].kv_len) == (1024, 512)
    assert steps[0].kernels[0].flops == steps[1].kernels[0].flops == steps[0].flops


# -- the size-aware roofline ------------------------------------------------------------


def test_gemm_tile_and_wave_quantisation():
    cm = H100.compute_model
    g = Gemm(m=128 * 132, n=128, k=4096, weight_bytes=2, act_bytes=2)       # exactly one full wave
    assert gemm_padded_flops(g, cm) == g.flops
    g2 = attrs.evolve(g, m=128 * 132 + 1)                                    # one tile more: a second wave
    assert gemm_padded_flops(g2, cm) == 2 * g.flops
    small = Gemm(m=1, n=1024, k=8192, weight_bytes=2, act_bytes=2)           # split-K fills the SMs
    # 8 tiles; k split 16 ways (16 x 8 = 128 of 132 SMs): one wave of 512-deep tiles, not 8192-deep
    assert gemm_padded_flops(small, cm) == 2.0 * 132 * 128 * 128 * 512


def test_a_grouped_gemm_pads_each_experts_rows_by_its_own_count():
    """The experts' token counts differ (routed at random), so a grouped GEMM's expected row
    tiles per expert follow the mean count smoothly (one count for all made Qwen3-235B's experts
    +20% for 1.6% more tokens, as the mean crossed 512): within 0.4% of the Poisson sum, the
    same tiles as before where the spread cannot reach another tile, and a plain GEMM as it was."""
    import math

    from g5core.sim.roofline import expected_row_tiles

    def poisson_tiles(mu, t):
        return sum(math.exp(m * math.log(mu) - mu - math.lgamma(m + 1)) * math.ceil(m / t)
                   for m in range(int(mu + 20 * math.sqrt(mu)) + 50))

    for mu in (40, 120, 128, 256, 507, 515, 1000, 4000):
        assert expected_row_tiles(mu, 128) == pytest.approx(poisson_tiles(mu, 128), rel=4e-3)
    assert expected_row_tiles(20, 128) == 1 and expected_row_tiles(200, 128) == pytest.approx(2, abs=1e-4)
    cm = H100.compute_model
    experts = [gemm_padded_flops(Gemm(m=32 * m, n=3072, k=4096, groups=32, weight_bytes=2, act_bytes=2), cm)
               for m in (500, 507, 512, 515, 520)]
    assert experts == sorted(experts) and experts[-1] / experts[0] < 1.1     # 4% more tokens: 1.25 with one count
    plain = Gemm(m=515, n=3072, k=4096, weight_bytes=2, act_bytes=2)
    assert gemm_padded_flops(plain, cm) == gemm_padded_flops(attrs.evolve(plain, m=640), cm)   # one count: 5 tiles


def test_attention_efficiency_rises_with_length_and_decode_has_a_floor():
    def tflops(L):
        a = Attention(batch=16, q_len=L, kv_len=L, heads=64, kv_heads=8, d_qk=128, d_v=128, block="causal",
                      kv_bytes_per_token=4096, act_bytes=2)
        return a.flops / kernel_latency_s(a, "bf16", H100) / 1e12
    rates = [tflops(L) for L in (512, 2048, 8192, 32768)]
    assert rates == sorted(rates) and rates[-1] > 2 * rates[0]
    tiny = Attention(batch=1, q_len=1, kv_len=16, heads=8, kv_heads=1, d_qk=128, d_v=128, block="decode",
                     kv_bytes_per_token=512, act_bytes=2)
    assert kernel_latency_s(tiny, "bf16", H100) == H100.compute_model.floor_s("decode_attention")
    norm = Elementwise(tokens=1, width=8192, kind="rmsnorm", act_bytes=2)
    assert kernel_latency_s(norm, "bf16", H100) == H100.compute_model.floor_s("elementwise")


def test_a_weight_streaming_gemm_pays_a_fixed_time_plus_its_bytes_at_the_fitted_bandwidth():
    cm = H100.compute_model
    assert (cm.gemm_hbm_latency_s, cm.gemm_hbm_fraction) == (3.04e-6, 0.814)
    gemv = Gemm(m=1, n=8192, k=8192, weight_bytes=2, act_bytes=2)
    assert kernel_latency_s(gemv, "bf16", H100) == cm.gemm_hbm_latency_s + gemv.hbm_bytes / (
        H100.hbm_bw_bytes_per_s * cm.gemm_hbm_fraction)
    # without the two keys, the bytes at hbm_fraction alone: faster, and the fixed time gone
    plain = attrs.evolve(H100, compute_model=attrs.evolve(cm, gemm_hbm_latency_s=None, gemm_hbm_fraction=None))
    assert kernel_latency_s(gemv, "bf16", plain) == gemv.hbm_bytes / (H100.hbm_bw_bytes_per_s * cm.hbm_fraction)
    assert kernel_latency_s(gemv, "bf16", plain) < kernel_latency_s(gemv, "bf16", H100)
    # the table's 8192 x 1024 bf16 GEMV (8.76 us on H100): 9.20 us now (+5%), 5.76 us before (-34%)
    small = Gemm(m=1, n=8192, k=1024, weight_bytes=2, act_bytes=2)
    assert kernel_latency_s(small, "bf16", H100) * 1e6 == pytest.approx(8.76, rel=0.06)
    assert kernel_latency_s(small, "bf16", plain) * 1e6 == pytest.approx(8.76 * 0.66, rel=0.03)
    # other memory-bound kernels keep hbm_fraction
    norm = Elementwise(tokens=65536, width=8192, kind="rmsnorm", act_bytes=2)
    assert kernel_latency_s(norm, "bf16", H100) == kernel_latency_s(norm, "bf16", plain)
    # a compute-bound GEMM is unchanged
    big = Gemm(m=8192, n=8192, k=8192, weight_bytes=2, act_bytes=2)
    assert kernel_latency_s(big, "bf16", H100) == kernel_latency_s(big, "bf16", plain)


def test_gemm_hbm_keys_go_together_and_are_checked():
    data = H100.compute_model.to_dict()
    assert ComputeModel.from_mapping(data) == H100.compute_model
    del data["gemm_hbm_fraction"]
    with pytest.raises(ConfigError, match=r"^system.compute_model.gemm_hbm_fraction: missing; gemm_hbm_latency_s "
                                          r"and gemm_hbm_fraction go together"):
        ComputeModel.from_mapping(data)
    for key, value, message in (("gemm_hbm_latency_s", -1e-6, "expected seconds >= 0"),
                                ("gemm_hbm_latency_s", "3us", "expected seconds >= 0"),
                                ("gemm_hbm_fraction", 1.5, "")):
        bad = dict(H100.compute_model.to_dict(), **{key: value})
        with pytest.raises(ConfigError, match=rf"^system.compute_model.{key}: {message}"):
            ComputeModel.from_mapping(bad)
    neither = H100.compute_model.to_dict()
    del neither["gemm_hbm_fraction"], neither["gemm_hbm_latency_s"]
    assert ComputeModel.from_mapping(neither).gemm_hbm_fraction is None


def test_system_without_compute_model_runs_the_flat_roofline_and_says_so(tmp_path):
    flat = tmp_path / "flat.yaml"
    data = H100.to_dict()
    del data["compute_model"]
    flat.write_text(yaml.safe_dump(data))
    out_flat = run(_cfg(system=str(flat)))
    out = run(_cfg())
    assert out_flat.latency_s != out.latency_s
    assert out_flat.sim.compute["model"].startswith("flat roofline")
    assert out.sim.compute["model"] == "size-aware roofline"


def test_compute_model_errors_name_the_field():
    data = H100.compute_model.to_dict()
    del data["hbm_fraction"]
    with pytest.raises(ConfigError, match=r"^system.compute_model.hbm_fraction: missing"):
        ComputeModel.from_mapping(data)
    bad = dict(H100.compute_model.to_dict(), gemm_tile_m=0)
    with pytest.raises(ConfigError, match=r"^system.compute_model.gemm_tile_m: expected a positive integer"):
        SystemSpec.from_dict(dict(H100.to_dict(), compute_model=bad))
    with pytest.raises(ConfigError, match=r"^system.profile.source: unknown source"):
        SystemSpec.from_dict(dict(H100.to_dict(), profile={"source": "x", "gpu": "h100_sxm", "framework": "t"}))


def test_system_file_with_base_adds_a_profile(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("base: h100-sxm\nname: mine\nprofile: {source: aiconfigurator, gpu: h100_sxm, framework: trtllm}\n")
    spec = get_system(str(p))
    assert spec.profile == PROFILE and spec.hbm_bw_bytes_per_s == H100.hbm_bw_bytes_per_s and spec.name == "mine"


# -- interpolation ----------------------------------------------------------------------


def _synthetic_grid():
    m = np.array([1, 4, 16, 64.0])
    n = np.array([8, 32, 128.0])
    rows = [(a, b, 0.01 * a ** 0.7 * b ** 0.9 + 0.003) for a in m for b in n]
    return T.Grid.from_frame(pd.DataFrame(rows, columns=["m", "n", "latency"]), ("m", "n")), rows


def test_interpolation_is_exact_on_grid_points_and_monotone_between():
    grid, rows = _synthetic_grid()
    for a, b, v in rows:
        assert grid((a, b)) == v
    for b in (8.0, 20.0, 128.0):
        xs = np.geomspace(1, 64, 200)
        ys = [grid((x, b)) for x in xs]
        assert all(y2 >= y1 for y1, y2 in zip(ys, ys[1:]))
    # between two grid points the value stays between them
    v = grid((2.0, 8.0))
    assert grid((1.0, 8.0)) < v < grid((4.0, 8.0))


def test_interpolation_needs_measured_corners():
    frame = pd.DataFrame([(1, 1, 1.0), (2, 2, 2.0), (1, 2, 1.5)], columns=["a", "b", "latency"])
    grid = T.Grid.from_frame(frame, ("a", "b"))
    assert grid((1.0, 2.0)) == 1.5
    assert grid((1.5, 1.5)) is None       # corner (2, 1) not measured


# -- the aiconfigurator tables ----------------------------------------------------------


def _table_value(table, **match):
    f = T.table_frame("h100_sxm", "trtllm", table)
    for k, v in match.items():
        f = f[f[k] == v]
    return float(np.exp(np.log(f.latency).mean()))


def test_gemm_8192_cubed_bf16_matches_the_table():
    g = Gemm(m=8192, n=8192, k=8192, weight_bytes=2, act_bytes=2)
    table = _table_value("gemm", gemm_dtype="bfloat16", m=8192, n=8192, k=8192)
    assert M.gemm_ms(PROFILE, g, "bf16", H100_AIC) == pytest.approx(table, rel=0.05)
    # off the grid (m between 4353 and 8192) it lies between its neighbours
    lo = M.gemm_ms(PROFILE, attrs.evolve(g, m=4353), "bf16", H100_AIC)
    mid = M.gemm_ms(PROFILE, attrs.evolve(g, m=6000), "bf16", H100_AIC)
    assert lo < mid < M.gemm_ms(PROFILE, g, "bf16", H100_AIC)


def test_context_attention_at_8k_matches_the_table():
    a = Attention(batch=1, q_len=8192, kv_len=8192, heads=64, kv_heads=8, d_qk=128, d_v=128, block="causal",
                  kv_bytes_per_token=8 * 128 * 2 * 2, act_bytes=2)
    table = _table_value("context_attention", batch_size=1, isl=8192, num_heads=64, num_key_value_heads=8,
                         head_dim=128, window_size=0, attn_dtype="bfloat16", kv_cache_dtype="bfloat16")
    assert M.attention_ms(PROFILE, a, "bf16", _Deployment, H100_AIC) == pytest.approx(table, rel=0.05)


def test_extrapolation_scales_the_edge_by_the_roofline_work_ratio():
    edge = Gemm(m=32768, n=8192, k=8192, weight_bytes=2, act_bytes=2)
    beyond = attrs.evolve(edge, m=65536)                                  # twice the largest measured m
    ratio = M.gemm_ms(PROFILE, beyond, "bf16", H100_AIC) / M.gemm_ms(PROFILE, edge, "bf16", H100_AIC)
    assert ratio == pytest.approx(2.0, rel=1e-3)                          # compute-bound: twice the FLOPs


def test_fp8_gemm_rows_are_taken_less_the_input_quantisation_they_include():
    """The FP8 rows time TRT-LLM's Linear with dynamic input quantisation; G5's GEMM is the row
    less compute_scale + scale_matrix (aiconfigurator's fp8_static), and the unfused GEMM plus its
    fp8_quant kernel add up to the row again."""
    from g5core.api.ops import ComputeOp

    g = Gemm(m=4096, n=8192, k=8192, weight_bytes=1, act_bytes=2)
    quant = Elementwise(tokens=4096, width=8192, kind="fp8_quant", act_bytes=2)
    row = _table_value("gemm", gemm_dtype="fp8", m=4096, n=8192, k=8192)
    q = _table_value("computescale", m=4096, k=8192) + _table_value("scale_matrix", m=4096, k=8192)
    assert M.fp8_quant_ms(PROFILE, quant, "fp8", H100_AIC) == pytest.approx(q, rel=1e-9)
    assert M.gemm_ms(PROFILE, g, "fp8", H100_AIC) == pytest.approx(row - q, rel=1e-9)
    bf16 = attrs.evolve(g, weight_bytes=2)
    assert M.gemm_ms(PROFILE, bf16, "bf16", H100_AIC) == pytest.approx(
        _table_value("gemm", gemm_dtype="bfloat16", m=4096, n=8192, k=8192), rel=1e-9)
    op = ComputeOp(key="o", chip=0, layer=0, name="qkv_proj", op_class="gemm", dtype="fp8", flops=g.flops,
                   hbm_bytes=g.hbm_bytes, kernels=(g, quant))
    unfused = M.g5_compute_latency(op=op, system=H100_AIC, deployment=_Deployment)
    assert unfused.seconds == pytest.approx(row * 1e-3 + H100_AIC.launch_overhead_s, rel=1e-9)
    trt = attrs.evolve(H100_AIC, framework=Framework.from_mapping({"stack": "trtllm"}))
    fused = M.g5_compute_latency(op=op, system=trt, deployment=_Deployment)
    assert fused.seconds == pytest.approx((row - q) * 1e-3 + H100_AIC.launch_overhead_s, rel=1e-9)


def test_mla_and_grouped_gemm_and_full_blocks_map_onto_tables():
    mla = Attention(batch=1, q_len=4096, kv_len=4096, heads=16, kv_heads=1, d_qk=192, d_v=128, block="causal",
                    mla=True, kv_bytes_per_token=1152, act_bytes=2)
    assert M.attention_ms(PROFILE, mla, "bf16", _Deployment, H100_AIC) == pytest.approx(
        _table_value("context_mla", batch_size=1, isl=4096, num_heads=16, kv_cache_dtype="bfloat16"), rel=1e-9)
    dec = attrs.evolve(mla, q_len=1, kv_len=4096, d_qk=576, d_v=512, block="decode")
    assert M.attention_ms(PROFILE, dec, "bf16", _Deployment, H100_AIC) > 0
    g = Gemm(m=256, n=4096, k=7168, groups=8, weight_bytes=1, act_bytes=2)
    one = M.gemm_ms(PROFILE, attrs.evolve(g, m=32, groups=1), "fp8", H100_AIC)
    assert M.gemm_ms(PROFILE, g, "fp8", H100_AIC) == pytest.approx(8 * one)
    # an unmasked 8192 x 4096 block maps onto the causal table at the length with its FLOPs
    full = Attention(batch=1, q_len=8192, kv_len=4096, heads=8, kv_heads=1, d_qk=128, d_v=128, block="full",
                     kv_bytes_per_token=512, act_bytes=2)
    assert M.attention_ms(PROFILE, full, "bf16", _Deployment, H100_AIC) == pytest.approx(
        M.attention_ms(PROFILE, attrs.evolve(full, kv_len=8192, block="causal"), "bf16", _Deployment, H100_AIC))


# -- coverage and the missing extra -----------------------------------------------------


def test_measured_run_reports_coverage_and_achieved_flops(aic_system_file):
    out = run(_cfg(system=aic_system_file))
    cov = out.sim.compute["coverage"]
    # what is not measured is each op's launch_overhead_s and the side kernels (rotary, KV append,
    # FP8 quantisation, SwiGLU) at the size-aware roofline: under a tenth of the GEMM and attention time
    assert cov["gemm"]["measured"] > 0.9 and cov["attention"]["measured"] > 0.9
    assert cov["elementwise"]["measured"] == 0.0
    assert 0 < cov["all"]["measured"] < 1
    assert math.isclose(cov["all"]["measured"] + cov["all"]["roofline"], 1.0)
    chip = out.sim.compute["per_chip"][0]
    flops = sum(o.flops for o in out.sim.dag.ops)
    assert chip["achieved_tflops"] == pytest.approx(flops / out.latency_s / 1e12)
    assert 0 < chip["mfu"] < 1
    assert out.to_json_dict()["compute"]["coverage"]["all"]["measured"] == cov["all"]["measured"]


def test_without_the_extra_a_clear_warning_and_the_roofline(aic_system_file, monkeypatch):
    real = T.find_spec
    monkeypatch.setattr(T, "find_spec", lambda name: None if name == "aiconfigurator_core" else real(name))
    M.warn_missing.cache_clear()
    M.check_profile.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run(_cfg(system=aic_system_file))
    msgs = [str(w.message) for w in caught]
    assert any("g5[measured]" in m and "aiconfigurator_core not installed" in m for m in msgs), msgs
    assert out.sim.compute["coverage"]["all"]["measured"] == 0.0
    assert out.latency_s == run(_cfg()).latency_s
    M.check_profile.cache_clear()


def test_unknown_profile_gpu_is_a_config_error(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("base: h100-sxm\nname: x\nprofile: {source: aiconfigurator, gpu: h999, framework: trtllm}\n")
    with pytest.raises(ConfigError, match=r"^system.profile: aiconfigurator has no GPU 'h999'"):
        run(_cfg(system=str(p)))


def test_math_path_reports_the_same_coverage(aic_system_file):
    raw = _cfg(system=aic_system_file)
    sim = run(raw).sim.compute["coverage"]["all"]
    math_cov = run(dict(raw, path="math")).math.compute["coverage"]["all"]
    assert math_cov["measured"] == pytest.approx(sim["measured"], rel=1e-12)


def test_run_summary_reports_coverage_and_achieved_flops(tmp_path, aic_system_file):
    from click.testing import CliRunner
    from g5core.present.cli import main
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(_cfg(system=aic_system_file)))
    out = CliRunner().invoke(main, ["run", str(cfg)])
    assert out.exit_code == 0, out.output
    line = next(x for x in out.output.splitlines() if x.startswith("compute time:"))
    assert "measured (profile aiconfigurator/h100_sxm/trtllm)" in line and "elementwise 0%" in line
    assert any(x.startswith("achieved per chip:") and "MFU" in x for x in out.output.splitlines())


def test_a_captured_batch_between_eager_ones_is_an_island_of_the_predictors_grid():
    """Under a framework that runs the batches between its captured sizes eagerly
    (TensorRT-LLM: 1-32, 64, 128), a captured grid point is cheaper than the batches next to
    it: a batch of 63 is priced on the line toward 63 (eager), not 15/16 of the way to the
    captured 64; 64 itself keeps its graph cost; 33 starts past the captured 32. Without
    islands the line runs to the grid points as before."""
    from g5core.serve.cost import _interp

    calls = []

    def g(n):       # 1 us a sequence, 5 ms of eager launches off the captured sizes
        calls.append(n)
        return 1e-6 * n + (0.0 if n in islands else 5e-3)

    islands = frozenset([*range(1, 33), 64, 128])
    assert _interp(g, 63, islands=islands) == pytest.approx(g(63))
    assert _interp(g, 64, islands=islands) == pytest.approx(64e-6)
    assert _interp(g, 33, islands=islands) == pytest.approx(g(33))
    assert _interp(g, 40, islands=islands) == pytest.approx(g(40))   # linear between eager 33 and 48
    assert _interp(g, 63) == pytest.approx(g(48) / 16 + 15 * g(64) / 16)   # no islands: as before


def test_under_trtllm_a_serving_decode_step_off_a_captured_size_pays_its_eager_launches():
    """The serving step cost under the trtllm profile: 63 and 65 sequences run eagerly and
    cost more than the captured 64 (before, 63 was priced nearly as 64); under vllm, which
    pads, the steps rise with the batch."""
    from g5core.serve.cost import StepWork
    from g5core.study.serving.screen import _layout_config, _session, instance_cost
    from g5core.study.serving.space import check_workload

    wl = check_workload({"requests": 10, "arrival": {"kind": "poisson"}, "input_tokens": 512, "output_tokens": 16,
                         "seed": 0})
    steps = {}
    for fw in ("trtllm", "vllm"):
        raw = _layout_config({"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 1, "framework": fw}, 1,
                             {"cp": 1, "dp": 1, "ep": 1, "pp": 1, "sp": 1, "tp": 1})
        raw["serving"] = {"instances": 1, "scheduler": {"max_num_batched_tokens": 2048, "chunked_prefill": True}}
        cost = instance_cost(_session(raw, wl, "ttft_p90=2s", ()).fleet.pools[0].cost)
        steps[fw] = [cost.latency_s(StepWork((), (1000,) * b)) for b in (63, 64, 65)]
    assert steps["trtllm"][0] > steps["trtllm"][1] < steps["trtllm"][2]
    assert steps["trtllm"][0] - steps["trtllm"][1] > 0.5 * (steps["trtllm"][2] - steps["trtllm"][1])
    assert steps["vllm"][0] <= steps["vllm"][1] <= steps["vllm"][2]
