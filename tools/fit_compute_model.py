"""Derive the compute_model defaults of the shipped system files from aiconfigurator-core's
per-op tables (kernel microbenchmarks). Prints, per GPU, the figures cited in the files.

    python tools/fit_compute_model.py            # needs the g5[measured] extra

Figures: best achieved fraction of dense peak of large GEMMs per dtype; best achieved
fraction of HBM bandwidth of weight-bound GEMMs (m <= 16) and of decode attention; the
smallest measured latency of any GEMM, context-attention and decode-attention kernel, and
of an elementwise kernel (the quantize table's compute_scale).
"""
from __future__ import annotations

import sys

import numpy as np
from scipy.optimize import least_squares

from g5plugins.measured.tables import table_frame

GPUS = {"a100_sxm": ("a100-80gb", {"bfloat16": 312e12}, 2.039e12),
        "h100_sxm": ("h100-sxm", {"bfloat16": 989.4e12, "fp8": 1978.9e12}, 3.35e12),
        "h200_sxm": ("h200", {"bfloat16": 989.4e12, "fp8": 1978.9e12}, 4.8e12),
        "b200_sxm": ("b200", {"bfloat16": 2250e12, "fp8": 4500e12}, 8.0e12)}


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
            q = table_frame(gpu, "trtllm", "computescale")
            out["elementwise_floor_us"] = round(float(q.latency.min() * 1e3), 2)
        except LookupError as exc:
            out["elementwise_floor_us"] = f"n/a ({exc})"
        print(system, gpu, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
