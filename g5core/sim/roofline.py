"""The roofline formulas, flat and size-aware: the one place they live.

``plugins/roofline`` answers ``g5_compute_latency`` with :func:`op_latency_s`; the
``measured`` plugin times the kernels its tables do not cover with :func:`kernel_latency_s`.

**Flat** (a system file without ``compute_model``): per op,
``max(flops / (peak[dtype] * efficiency[op_class]), hbm_bytes / (hbm_bw * efficiency["hbm"]))
+ launch_overhead_s``.

**Size-aware** (the system file has a ``compute_model`` block): the op's time is the sum of
its kernels' times (:mod:`g5core.lower.kernels` gives their shapes) plus ``launch_overhead_s`` once
(none under a framework profile that prices each kernel's launch itself:
:func:`g5core.inputs.framework.op_overhead_s`);
each kernel takes ``max(compute_s, memory_s, floor_s)``, with
``memory_s = kernel bytes / (hbm_bw * hbm_fraction)`` (a GEMM, where the block gives
``gemm_hbm_latency_s`` and ``gemm_hbm_fraction``: ``gemm_hbm_latency_s + kernel bytes / (hbm_bw *
gemm_hbm_fraction)``, a fixed time plus the bytes at the achieved bandwidth, both fitted to the
measured GEMMs that stream their weights) and ``floor_s`` the measured shortest kernel of its kind
(``kernel_floor_s``), and:

- GEMM: the output is cut into ``gemm_tile_m x gemm_tile_n`` tiles (per expert for a grouped
  GEMM, each expert's rows by its own token count: :func:`expected_row_tiles`), ``k`` is
  rounded up to ``gemm_tile_k``; when there are fewer tiles than SMs, ``k``
  is split so the tiles fill the SMs (split-K, as cuBLAS/CUTLASS heuristics do, bounded by
  the ``k`` tiles); the tiles run in waves of ``sm_count``. ``compute_s = 2 * waves *
  sm_count * tile_m * tile_n * k_per_split / (peak[dtype] * gemm_peak_fraction[dtype])``:
  tile and wave quantisation of ``m``, ``n`` and ``k``.
- attention: ``compute_s = flops / (peak * attention_peak_fraction * L / (L + L_half) *
  wave_eff)`` with ``L`` the block's KV length, ``L_half`` =
  ``attention_half_length_tokens``, and ``wave_eff`` the wave quantisation of the kernel's
  ``batch x heads x ceil(q_len / gemm_tile_m)`` work units on ``sm_count`` SMs.
- elementwise (norms, residual adds, rotary, embedding): memory-bound, ``compute_s = 0``.
"""
from __future__ import annotations

import math

from g5core.inputs.framework import fused_bytes, kernel_hosts, op_overhead_s
from g5core.lower.kernels import Attention, Gemm


def roofline_latency_s(op_class, flops, hbm_bytes, dtype, system) -> float:
    """The flat roofline of one op (no compute_model block)."""
    compute_s = flops / (system.peak_flops(dtype) * system.op_efficiency(op_class)) if flops else 0.0
    memory_s = hbm_bytes / (system.hbm_bw_bytes_per_s * system.op_efficiency("hbm")) if hbm_bytes else 0.0
    return max(compute_s, memory_s) + op_overhead_s(system)


def gemm_padded_flops(kernel: Gemm, cm) -> float:
    """FLOPs the tiles of a GEMM occupy: tile, split-K and wave quantisation. A grouped GEMM's
    (MoE experts') rows are cut into tiles expert by expert, and the experts' token counts
    differ: the expected tiles of an expert are :func:`expected_row_tiles` of its mean count
    (the routed tokens spread over the experts at random), not the tiles of the mean."""
    tm, tn, tk, sms = cm.gemm_tile_m, cm.gemm_tile_n, cm.gemm_tile_k, cm.sm_count
    groups = max(1, math.ceil(kernel.groups)) if kernel.groups > 0 else 1
    m_per_group = kernel.m / groups
    row_tiles = math.ceil(m_per_group / tm) if groups == 1 else expected_row_tiles(m_per_group, tm)
    tiles = groups * row_tiles * math.ceil(kernel.n / tn)
    k_tiles = math.ceil(kernel.k / tk)
    if tiles == 0 or k_tiles == 0:
        return 0.0
    split = max(1, min(sms // tiles, k_tiles)) if tiles < sms else 1
    k_per_split = math.ceil(k_tiles / split) * tk
    waves = math.ceil(tiles * split / sms)
    return 2.0 * waves * sms * tm * tn * k_per_split


#: the mean tokens of an expert from which its count is taken as normal (Poisson's own
#: approximation: within 0.4% of the Poisson sum from 32 to 4,000 tokens); below it the tiles of the mean
EXPERT_SPREAD_FROM = 32
#: how many standard deviations of an expert's count the expected tiles sum over
EXPERT_SPREAD_SIGMAS = 8


def expected_row_tiles(mean_tokens: float, tile_m: int) -> float:
    """An expert's expected row tiles, ``E[ceil(M / tile_m)]``, its token count ``M`` Poisson of
    mean ``mean_tokens`` (each routed token lands on the expert independently: the least
    spread real routing has; a grouped GEMM pads each expert's rows to the tile, as DeepGEMM's
    contiguous layout and CUTLASS grouped GEMMs do). One ``M`` for every expert made the time
    step by a whole tile row as the mean crossed a tile (Qwen3-235B's experts: +20% for 1.6%
    more tokens at 512 a expert). Below :data:`EXPERT_SPREAD_FROM` tokens, ``ceil`` of the
    mean (an active expert's few tokens fill one tile)."""
    if mean_tokens < EXPERT_SPREAD_FROM:
        return float(math.ceil(mean_tokens / tile_m))
    sd = math.sqrt(mean_tokens)
    top = math.ceil((mean_tokens + EXPERT_SPREAD_SIGMAS * sd) / tile_m)
    low = max(1, math.floor((mean_tokens - EXPERT_SPREAD_SIGMAS * sd) / tile_m))
    # sum over j of P(M > j tile_m) (P(M > 0) = 1 here), the normal with continuity correction;
    # every j below ``low`` counts 1
    tiles = float(low)
    for j in range(low, top + 1):
        tiles += 0.5 * math.erfc((j * tile_m + 0.5 - mean_tokens) / (sd * math.sqrt(2.0)))
    return tiles


def attention_efficiency(kernel: Attention, cm, curve: str = "default") -> float:
    """Fraction of peak a flash-attention kernel reaches on this block (``curve``: the
    attention kernel family, ``ComputeModel.attention_curve``)."""
    peak, half = cm.attention_curve(curve)
    length = kernel.length_tokens
    units = kernel.batch * kernel.heads * math.ceil(kernel.q_len / cm.gemm_tile_m)
    waves = math.ceil(units / cm.sm_count)
    wave_eff = units / (waves * cm.sm_count) if waves else 1.0
    return peak * length / (length + half) * wave_eff


def kernel_latency_s(kernel, dtype: str, system, extra_bytes: float = 0.0) -> float:
    """One kernel's time on the size-aware roofline (``system.compute_model`` must be set);
    ``extra_bytes``: the HBM bytes of the kernels fused into it (g5core.inputs.framework)."""
    cm = system.compute_model
    if isinstance(kernel, Gemm) and cm.gemm_hbm_fraction is not None:
        memory_s = cm.gemm_hbm_latency_s + (kernel.hbm_bytes + extra_bytes) / (system.hbm_bw_bytes_per_s
                                                                                 * cm.gemm_hbm_fraction)
    else:
        memory_s = (kernel.hbm_bytes + extra_bytes) / (system.hbm_bw_bytes_per_s * cm.hbm_fraction)
    if isinstance(kernel, Gemm):
        compute_s = gemm_padded_flops(kernel, cm) / (system.peak_flops(dtype) * cm.gemm_fraction(dtype))
        floor_s = cm.floor_s("gemm")
    elif isinstance(kernel, Attention):
        flops = kernel.flops
        fw = getattr(system, "framework", None)
        curve = fw.attention if fw is not None else "default"
        compute_s = flops / (system.peak_flops(dtype) * attention_efficiency(kernel, cm, curve)) if flops else 0.0
        floor_s = cm.floor_s("decode_attention" if kernel.block == "decode" else "attention")
    else:
        compute_s = 0.0
        floor_s = cm.floor_s("elementwise")
    return max(compute_s, memory_s, floor_s)


def op_latency_s(op, system, phase: str = "") -> float:
    """An op's time: flat without a compute_model (or without kernel shapes), else the sum of
    its launched kernels (a fused kernel adds its bytes to its host's, ``kernel_hosts``) plus
    one launch overhead."""
    if system.compute_model is None or not op.kernels:
        return roofline_latency_s(op.op_class, op.flops, op.hbm_bytes, op.dtype, system)
    hosts = kernel_hosts(op, system, phase)
    extra = fused_bytes(op, hosts)
    return math.fsum(kernel_latency_s(k, op.dtype, system, extra[i]) for i, k in enumerate(op.kernels)
                     if hosts[i] is None) + op_overhead_s(system)
