"""Derive the compute_model defaults of the shipped system files from aiconfigurator-core's
per-op tables (kernel microbenchmarks). Prints, per GPU, the figures cited in the files.

    python tools/fit_compute_model.py            # needs the g5[measured] extra
    python tools/fit_compute_model.py --check    # the size-aware roofline's error against the tables

Figures: best achieved fraction of dense peak of large GEMMs per dtype; best achieved
fraction of HBM bandwidth of weight-bound GEMMs (m <= 16) and of decode attention; the fixed
time and achieved bandwidth fraction of those GEMMs, ``latency = gemm_hbm_latency_s + bytes /
(hbm_bw * gemm_hbm_fraction)`` (least squares on the relative error, every bf16 row with m <= 16,
bytes as G5 counts them); the
smallest measured latency of any GEMM, context-attention and decode-attention kernel, and
of an elementwise kernel (the quantize table's scale_matrix: one static FP8 quantisation kernel
in a CUDA graph; compute_scale is the dynamic quantisation call less the static one, not one kernel).
"""
from __future__ import annotations

import sys

import numpy as np
from scipy.optimize import least_squares

from g5plugins.measured.tables import table_frame

GPUS = {"a100_sxm": ("a100-80gb", {"bfloat16": 312e12}, 2.039e12),
        "h100_sxm": ("h100-sxm", {"bfloat16": 989.4e12, "fp8": 1978.9e12}, 3.35e12),
        "h200_sxm": ("h200", {"bfloat16": 989.4e12, "fp8": 1978.9e12}, 4.8e12),
        "b200_sxm": ("b200", {"bfloat16": 2250e12, "fp8": 4500e12, "nvfp4": 9000e12}, 8.0e12),
        "gb200": ("gb200-nvl72", {"bfloat16": 2500e12, "fp8": 5000e12, "nvfp4": 10000e12}, 8.0e12),
        "gb300": ("gb300-nvl72", {"bfloat16": 2500e12, "fp8": 5000e12, "nvfp4": 15000e12}, 8.0e12)}


def gemm_hbm_fit(small, hbm_bw: float) -> dict:
    """``gemm_hbm_latency_s`` and ``gemm_hbm_fraction`` of the weight-bound GEMM rows ``small``:
    ``latency = a + bytes / b`` by least squares on the relative error (each row divided by its
    latency), bytes as G5's Gemm kernel counts them; with the median and 90th-percentile
    |error| of the fit."""
    from g5core.lower.kernels import Gemm
    nbytes = np.array([Gemm(m=int(m), n=int(n), k=int(k), weight_bytes=2, act_bytes=2).hbm_bytes
                       for m, n, k in zip(small.m, small.n, small.k)])
    latency_s = small.latency.to_numpy() * 1e-3
    design = np.vstack([np.ones_like(nbytes), nbytes]).T / latency_s[:, None]
    (a, s_per_byte), *_ = np.linalg.lstsq(design, np.ones_like(latency_s), rcond=None)
    err = np.abs((a + s_per_byte * nbytes) / latency_s - 1)
    return {"gemm_hbm_latency_s": float(f"{a:.3g}"), "gemm_hbm_fraction": round(float(1 / s_per_byte / hbm_bw), 3),
            "gemm_hbm_fit_rows": len(small), "gemm_hbm_fit_median_abs_error": round(float(np.median(err)), 3),
            "gemm_hbm_fit_p90_abs_error": round(float(np.percentile(err, 90)), 3)}


def main() -> int:
    for gpu, (system, peaks, hbm) in GPUS.items():
        g = table_frame(gpu, "trtllm", "gemm")
        g = g.assign(tflops=2.0 * g.m * g.n * g.k / (g.latency * 1e-3))
        out = {}
        for dt, peak in peaks.items():
            big = g[(g.gemm_dtype == dt) & (g.m >= 4096) & (g.n >= 4096) & (g.k >= 4096)]
            out[f"gemm_peak_fraction[{dt}] (median, m,n,k >= 4096)"] = round(float(big.tflops.median() / peak), 3)
        small = g[(g.gemm_dtype == "bfloat16") & (g.m <= 16)]
        bw = 2.0 * small.n * small.k / (small.latency * 1e-3)
        out["hbm_fraction(gemm m<=16)"] = round(float(bw.max() / hbm), 3)
        out.update(gemm_hbm_fit(small, hbm))
        out["gemm_floor_us"] = round(float(g.latency.min() * 1e3), 2)
        ctx = table_frame(gpu, "trtllm", "context_attention")
        gen = table_frame(gpu, "trtllm", "generation_attention")
        c = ctx[(ctx.attn_dtype == "bfloat16") & (ctx.kv_cache_dtype == "bfloat16") & (ctx.window_size == 0)
                & (ctx.head_dim == 128) & (ctx.batch_size * ctx.num_heads >= 512) & (ctx.isl >= 256)]
        eff = c.batch_size * c.isl ** 2 * c.num_heads * 256 / (c.latency * 1e-3) / peaks["bfloat16"]
        fit = least_squares(lambda p: np.log(p[0] * c.isl / (c.isl + p[1])) - np.log(eff), [0.6, 500.0],
                            bounds=([0.01, 1.0], [1.0, 1e5]))
        out["attention_peak_fraction"] = round(float(fit.x[0]), 3)
        out["attention_half_length_tokens"] = round(float(fit.x[1]))
        out["attention_fit_rows"] = len(c)
        out["attention_fit_rms_log_error"] = round(float(np.sqrt(np.mean(fit.fun ** 2))), 3)
        out["context_attention_floor_us"] = round(float(ctx.latency.min() * 1e3), 2)
        out["decode_attention_floor_us"] = round(float(gen.latency.min() * 1e3), 2)
        gb = gen[(gen.kv_cache_dtype == "bfloat16") & (gen.window_size == 0)]
        kvb = gb.batch_size * (gb.step + 1) * gb.num_key_value_heads * gb.head_dim * 2 * 2
        out["hbm_fraction(decode attention)"] = round(float((kvb / (gb.latency * 1e-3)).max() / hbm), 3)
        try:
            q = table_frame(gpu, "trtllm", "scale_matrix")
            out["elementwise_floor_us"] = round(float(q.latency.min() * 1e3), 2)
        except LookupError as exc:
            out["elementwise_floor_us"] = f"n/a ({exc})"
        print(system, gpu, out)
    return 0


if __name__ == "__main__" and "--check" not in sys.argv:
    sys.exit(main())


def roofline_vs_tables(system_name: str = "h100-sxm", gpu: str = "h100_sxm") -> dict:
    """Median and 90th-percentile |error| of the size-aware roofline against the tables'
    bf16 GEMMs and bf16 context attentions (head_dim 128, no window)."""
    from g5core.lower.kernels import Attention, Gemm
    from g5core.inputs.systems import get_system
    from g5core.sim.roofline import kernel_latency_s
    system = get_system(system_name)
    g = table_frame(gpu, "trtllm", "gemm")
    g = g[g.gemm_dtype == "bfloat16"]
    err = [kernel_latency_s(Gemm(m=m, n=n, k=k, weight_bytes=2, act_bytes=2), "bf16", system) * 1e3 / lat - 1
           for m, n, k, lat in zip(g.m, g.n, g.k, g.latency)]
    c = table_frame(gpu, "trtllm", "context_attention")
    c = c[(c.attn_dtype == "bfloat16") & (c.kv_cache_dtype == "bfloat16") & (c.window_size == 0) & (c.head_dim == 128)]
    aerr = [kernel_latency_s(Attention(batch=b, q_len=s, kv_len=s, heads=h, kv_heads=hk, d_qk=128, d_v=128,
                                       block="causal", kv_bytes_per_token=hk * 512, act_bytes=2), "bf16", system)
            * 1e3 / lat - 1 for b, s, h, hk, lat in zip(c.batch_size, c.isl, c.num_heads, c.num_key_value_heads,
                                                        c.latency)]
    out = {}
    for name, e in (("gemm", err), ("context_attention", aerr)):
        a = np.abs(np.asarray(e))
        out[name] = {"rows": len(a), "median_abs_error": round(float(np.median(a)), 3),
                     "p90_abs_error": round(float(np.percentile(a, 90)), 3)}
    return out


if __name__ == "__main__" and "--check" in sys.argv:
    print("size-aware roofline vs h100_sxm tables:", roofline_vs_tables())
