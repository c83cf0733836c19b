"""Measured compute latency from a per-op kernel database (aiconfigurator-core).

Chosen in the system file, e.g. ``profile: {source: aiconfigurator, gpu: h100_sxm,
framework: trtllm}`` (optionally ``version``). It answers ``g5_compute_latency`` first: an
op's time is the sum of its kernels' times, each from the tables where they cover it and
from the roofline (``g5core.sim.roofline``) where they do not, plus the system's
``launch_overhead_s`` once, as the roofline adds it. It answers with a ``ComputeTime`` so the
run reports the measured share; an op with no measured kernel is left to the roofline.

Without the ``g5[measured]`` extra it warns once (naming the extra) and answers nothing:
the roofline runs and the coverage is 0 %. The mapping of every G5 kernel onto a table, the
interpolation and the extrapolation rule are in ``docs/measured-compute.md``.
"""
from __future__ import annotations

import math
import warnings
from functools import lru_cache

from g5core import (
    Attention, ComputeTime, ConfigError, Elementwise, Gemm, fused_bytes, hookimpl, kernel_hosts, kernel_latency_s,
    op_overhead_s, roofline_latency_s,
)

from . import tables as T

#: G5 dtype -> the tables' dtype name (a dtype not listed is not measured: roofline)
TABLE_DTYPE = {"bf16": "bfloat16", "fp8": "fp8"}
#: The head dims the MLA tables were measured with (DeepSeek-V3/R1): prefill (qk, v), decode (latent+rope, latent)
MLA_PREFILL_DIMS = (192.0, 128.0)
MLA_DECODE_DIMS = (576.0, 512.0)


@lru_cache(maxsize=None)
def warn_missing(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


@lru_cache(maxsize=None)
def _grid(gpu: str, framework: str, version: str, table: str, exact: tuple, axes: tuple):
    """The grid of one table slice; None when the slice has no rows."""
    frame = T.table_frame(gpu, framework, table, version)
    for column, value in exact:
        frame = frame[frame[column] == value]
    if not len(frame):
        return None
    return T.Grid.from_frame(frame, axes)


@lru_cache(maxsize=None)
def check_profile(profile) -> None:
    """ConfigError for a GPU or framework the tables do not have (once per profile)."""
    try:
        T.table_path(profile.gpu, profile.framework, "gemm", profile.version)
    except T.MissingExtra:
        raise
    except LookupError as exc:
        raise ConfigError("system.profile", f"{exc}; fix the profile's gpu/framework/version") from None


def _roofline_s(kernel, dtype: str, system, extra_bytes: float = 0.0) -> float:
    """A kernel's time without the table (size-aware, or flat without compute_model), with
    ``extra_bytes`` of fused kernels."""
    if system.compute_model is not None:
        return kernel_latency_s(kernel, dtype, system, extra_bytes)
    return roofline_latency_s(kernel.op_class, kernel.flops, kernel.hbm_bytes + extra_bytes, dtype, system) \
        - op_overhead_s(system)


def _ideal_s(kernel, dtype: str, system) -> float:
    """Work of a kernel on the ideal roofline: sets the extrapolation ratio."""
    return max(kernel.flops / system.peak_flops(dtype), kernel.hbm_bytes / system.hbm_bw_bytes_per_s)


def _lookup_ms(grid, point, make_kernel, dtype, system):
    """Grid value at ``point``; outside the grid, the clamped value scaled by the ideal
    roofline's work ratio (``t(x) = t(clamp(x)) * ideal(x) / ideal(clamp(x))``)."""
    if grid is None:
        return None
    clamped = grid.clamp(point)
    value = grid(clamped)
    if value is None or clamped == tuple(float(x) for x in point):
        return value
    inside = _ideal_s(make_kernel(*clamped), dtype, system)
    return value * _ideal_s(make_kernel(*point), dtype, system) / inside if inside > 0 else None


def gemm_ms(profile, kernel: Gemm, dtype: str, system):
    """GEMM table by (m, n, k); a grouped GEMM is ``groups`` GEMMs of ``m / groups`` rows.

    The FP8 rows time TensorRT-LLM's ``Linear`` with no input scale, so they include the dynamic
    quantisation of the input (aiconfigurator collector/trtllm/collect_gemm.py: "the collected fp8
    GEMM includes the compute-scale overhead"). G5 times that quantisation as its own
    ``fp8_quant`` kernel, so the GEMM is the row less ``compute_scale + scale_matrix`` at its
    ``(m, k)`` -- aiconfigurator's own ``fp8_static`` with a low-precision input (aic-core
    operators/gemm.rs, ``GemmOp::query``) -- and never below the ideal roofline."""
    tdt = TABLE_DTYPE.get(dtype)
    if tdt is None or kernel.m <= 0:
        return None
    groups = max(kernel.groups, 1.0)
    grid = _grid(profile.gpu, profile.framework, profile.version, "gemm", (("gemm_dtype", tdt),), ("m", "n", "k"))

    def make(m, n, k):
        return Gemm(m=m, n=n, k=k, weight_bytes=kernel.weight_bytes, act_bytes=kernel.act_bytes)

    one = _lookup_ms(grid, (kernel.m / groups, kernel.n, kernel.k), make, dtype, system)
    if one is None:
        return None
    if tdt == "fp8":
        quant = fp8_quant_ms(profile, Elementwise(tokens=kernel.m / groups, width=kernel.k, kind="fp8_quant",
                                                  act_bytes=kernel.act_bytes), dtype, system)
        if quant is not None:
            ideal = _ideal_s(make(kernel.m / groups, kernel.n, kernel.k), dtype, system) * 1e3
            one = max(one - quant, ideal)
    return one * groups


def _table_length(kernel: Attention) -> float:
    """The causal-table length with the block's FLOPs: ``q`` for a causal block,
    ``sqrt(2 q kv)`` for an unmasked ``q x kv`` block (a CP ring step off the diagonal)."""
    return kernel.q_len if kernel.block == "causal" else math.sqrt(2.0 * kernel.q_len * kernel.kv_len)


def has_prefix(kernel: Attention) -> bool:
    """A causal block after a cached prefix (``kv_len > q_len``). The context tables have a
    prefix column (``step``), but every shipped table holds only ``step = 0``
    (aiconfigurator-core's context_attention tables, every GPU and framework, checked
    2026-12-01): such a kernel is not covered, and the roofline times it."""
    return kernel.block == "causal" and kernel.kv_len != kernel.q_len


def attention_ms(profile, kernel: Attention, dtype: str, deployment, system):
    if has_prefix(kernel):
        return None
    act = TABLE_DTYPE.get(dtype)
    kv = TABLE_DTYPE.get(deployment.dtypes.kv_cache)
    if act is None or kv is None:
        return None
    g = (profile.gpu, profile.framework, profile.version)
    decode = kernel.block == "decode"
    if kernel.mla:
        if (kernel.d_qk, kernel.d_v) != (MLA_DECODE_DIMS if decode else MLA_PREFILL_DIMS):
            return None
        table = "generation_mla" if decode else "context_mla"
        grid = _grid(*g, table, (("mla_dtype", act), ("kv_cache_dtype", kv)),
                     ("batch_size", "step" if decode else "isl", "num_heads"))
        if decode:
            point = (kernel.batch, kernel.kv_len - 1.0, kernel.heads)

            def make(b, step, h):
                return Attention(batch=b, q_len=1, kv_len=step + 1.0, heads=h, kv_heads=1, d_qk=kernel.d_qk,
                                 d_v=kernel.d_v, block="decode", mla=True,
                                 kv_bytes_per_token=kernel.kv_bytes_per_token, act_bytes=kernel.act_bytes)
        else:
            point = (kernel.batch, _table_length(kernel), kernel.heads)

            def make(b, isl, h):
                return Attention(batch=b, q_len=isl, kv_len=isl, heads=h, kv_heads=1, d_qk=kernel.d_qk,
                                 d_v=kernel.d_v, block="causal", mla=True,
                                 kv_bytes_per_token=kernel.kv_bytes_per_token, act_bytes=kernel.act_bytes)
        return _lookup_ms(grid, point, make, dtype, system)
    if kernel.d_qk != kernel.d_v:
        return None
    head_dim = int(kernel.d_qk)
    per_head_kv = kernel.kv_bytes_per_token / kernel.kv_heads if kernel.kv_heads else 0.0
    if decode:
        if act != "bfloat16":
            return None
        grid = _grid(*g, "generation_attention", (("head_dim", head_dim), ("window_size", 0),
                                                  ("attn_dtype", act), ("kv_cache_dtype", kv)),
                     ("batch_size", "step", "num_heads", "num_key_value_heads"))
        point = (kernel.batch, kernel.kv_len - 1.0, kernel.heads, kernel.kv_heads)

        def make(b, step, h, hkv):
            return Attention(batch=b, q_len=1, kv_len=step + 1.0, heads=h, kv_heads=hkv, d_qk=head_dim,
                             d_v=head_dim, block="decode", kv_bytes_per_token=per_head_kv * hkv,
                             act_bytes=kernel.act_bytes)
    else:
        grid = _grid(*g, "context_attention", (("head_dim", head_dim), ("window_size", 0),
                                               ("attn_dtype", act), ("kv_cache_dtype", kv)),
                     ("batch_size", "isl", "num_heads", "num_key_value_heads"))
        point = (kernel.batch, _table_length(kernel), kernel.heads, kernel.kv_heads)

        def make(b, isl, h, hkv):
            return Attention(batch=b, q_len=isl, kv_len=isl, heads=h, kv_heads=hkv, d_qk=head_dim, d_v=head_dim,
                             block="causal", kv_bytes_per_token=per_head_kv * hkv, act_bytes=kernel.act_bytes)
    return _lookup_ms(grid, point, make, dtype, system)


def fp8_quant_ms(profile, kernel: Elementwise, dtype: str, system):
    """FP8 activation quantisation of an ``m x k`` tensor: the quantize tables' compute_scale
    (the amax pass) plus scale_matrix (scale and convert), both by (m, k)."""
    total = 0.0
    for table in ("computescale", "scale_matrix"):
        grid = _grid(profile.gpu, profile.framework, profile.version, table, (("quant_dtype", "fp8"),), ("m", "k"))

        def make(m, k):
            return Elementwise(tokens=m, width=k, kind="fp8_quant", act_bytes=kernel.act_bytes)

        one = _lookup_ms(grid, (kernel.tokens, kernel.width), make, dtype, system)
        if one is None:
            return None
        total += one
    return total


def kernel_ms(profile, kernel, dtype: str, deployment, system):
    """Measured milliseconds of one kernel, or None where the tables do not cover it."""
    if isinstance(kernel, Gemm):
        return gemm_ms(profile, kernel, dtype, system)
    if isinstance(kernel, Attention):
        return attention_ms(profile, kernel, dtype, deployment, system)
    if isinstance(kernel, Elementwise) and kernel.kind == "fp8_quant" and kernel.tokens > 0:
        return fp8_quant_ms(profile, kernel, dtype, system)
    return None  # norms, residual adds, rotary, embedding, SwiGLU, merges, MoE routing: no table


def profile_available(profile) -> bool:
    """True when the tables can be read; otherwise warns once and returns False."""
    try:
        check_profile(profile)
    except T.MissingExtra as exc:
        warn_missing(f"system profile {profile.source}/{profile.gpu}/{profile.framework} needs the g5[measured] "
                      f"extra ({exc}); compute times come from the roofline (measured coverage 0%)")
        return False
    return True


@hookimpl(tryfirst=True)
def g5_compute_latency(op, system, deployment):
    profile = system.profile
    if profile is None or not op.kernels or not profile_available(profile):
        return None
    measured, modelled = [], []
    hosts = kernel_hosts(op, system, getattr(deployment, "phase", ""))
    extra = fused_bytes(op, hosts)
    for kernel, host, more in zip(op.kernels, hosts, extra):
        if host is not None:
            continue  # runs inside another kernel (g5core.inputs.framework.kernel_hosts)
        ms = kernel_ms(profile, kernel, op.dtype, deployment, system)
        if ms is None:
            modelled.append(_roofline_s(kernel, op.dtype, system, more))
        else:
            measured.append(ms * 1e-3)
            if more:  # the fused kernels' bytes: what they add to the host on the roofline
                modelled.append(_roofline_s(kernel, op.dtype, system, more) - _roofline_s(kernel, op.dtype, system))
    if not measured:
        return None
    measured_s = math.fsum(measured)
    return ComputeTime(seconds=measured_s + math.fsum(modelled) + op_overhead_s(system), measured_s=measured_s)
