"""Compute kernels: the shapes a compute op is made of, and the one latency lookup.

A compute op (``ComputeOp``) carries, besides its total FLOPs and HBM bytes, the tuple of
kernels it runs, each with its shape:

- :class:`Gemm` ``C[m x n] = A[m x k] @ B[k x n]``; ``groups`` distinct weight matrices
  (a grouped expert GEMM: ``m`` token slots spread over ``groups`` experts);
- :class:`Attention`: ``batch`` sequences, ``q_len`` query and ``kv_len`` key tokens each,
  ``heads`` query and ``kv_heads`` KV heads, head dims ``d_qk`` / ``d_v``; ``block`` is
  ``causal`` (a prefill diagonal block, ``q_len == kv_len``), ``full`` (a rectangular block
  with no mask, a CP ring step off the diagonal) or ``decode`` (one new token per
  sequence); ``mla`` marks DeepSeek multi-head latent attention;
- :class:`Elementwise`: a memory-bound kernel over ``tokens x width`` elements (``kind``
  names it: rmsnorm, residual_add, rotary, embedding).

Two ops with equal FLOPs and bytes but different shapes are different ops: the latency
lookup (:class:`LatencyLookup`, used by the engine and by the Math path alike) is keyed
on ``(op class, dtype, kernels, FLOPs, bytes)`` and asks ``g5_compute_latency`` once per
distinct key. Each kernel's FLOPs and bytes come from :mod:`g5core.flops` (the one place
those formulas live).

A latency plugin answers with seconds, or with a :class:`ComputeTime` that also says how
many of those seconds come from measurements; the lookup keeps, per op, which source gave
its time, so the run can report measured versus roofline coverage.
"""
from __future__ import annotations

import math
from typing import Union

import attrs

from . import flops as F
from .errors import DagError, PluginError

ATTENTION_BLOCKS = ("causal", "full", "decode")
ELEMENTWISE_KINDS = ("rmsnorm", "residual_add", "rotary", "embedding")


def _nonneg(instance, attribute, value) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 and math.isfinite(value)):
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be a finite number >= 0, got {value!r}")


def _num():
    return attrs.field(converter=float, validator=_nonneg)


@attrs.frozen(kw_only=True)
class Gemm:
    """``m x k`` activations times ``groups`` weight matrices of ``k x n`` (``m`` rows in all)."""

    m: float = _num()
    n: float = _num()
    k: float = _num()
    groups: float = attrs.field(converter=float, default=1.0, validator=_nonneg)
    weight_bytes: float = _num()   # bytes per weight element
    act_bytes: float = _num()      # bytes per activation element

    op_class = "gemm"

    @property
    def flops(self) -> float:
        return F.grouped_gemm(self.m, self.k, self.n, self.groups, self.weight_bytes, self.act_bytes)[0]

    @property
    def hbm_bytes(self) -> float:
        return F.grouped_gemm(self.m, self.k, self.n, self.groups, self.weight_bytes, self.act_bytes)[1]


@attrs.frozen(kw_only=True)
class Attention:
    """A fused (flash) attention over one block of ``q_len x kv_len`` per sequence and head."""

    batch: float = _num()
    q_len: float = _num()
    kv_len: float = _num()
    heads: float = _num()
    kv_heads: float = _num()
    d_qk: float = _num()
    d_v: float = _num()
    block: str = attrs.field(validator=attrs.validators.in_(ATTENTION_BLOCKS))
    mla: bool = attrs.field(default=False)
    kv_bytes_per_token: float = _num()   # K and V of one token on this chip (all its KV heads)
    act_bytes: float = _num()

    op_class = "attention"

    @property
    def flops(self) -> float:
        if self.block == "causal":
            return F.causal_attention_flops(self.batch, self.q_len, self.heads, self.d_qk, self.d_v)
        return F.block_attention_flops(self.batch, self.q_len, self.kv_len, self.heads, self.d_qk, self.d_v)

    @property
    def hbm_bytes(self) -> float:
        return F.attention_block_bytes(self.batch, self.q_len, self.kv_len, self.heads, self.d_qk, self.d_v,
                                       self.kv_bytes_per_token, self.act_bytes)

    @property
    def length_tokens(self) -> float:
        """The block length that sets a flash kernel's efficiency: its KV length."""
        return self.kv_len


@attrs.frozen(kw_only=True)
class Elementwise:
    """A memory-bound kernel over ``tokens x width`` elements."""

    tokens: float = _num()
    width: float = _num()
    kind: str = attrs.field(validator=attrs.validators.in_(ELEMENTWISE_KINDS))
    act_bytes: float = _num()

    op_class = "elementwise"

    @property
    def flops(self) -> float:
        return 0.0 if self.kind == "embedding" else F.elementwise(self.tokens, self.width, self.act_bytes)[0]

    @property
    def hbm_bytes(self) -> float:
        return F.elementwise(self.tokens, self.width, self.act_bytes)[1]


Kernel = Union[Gemm, Attention, Elementwise]
KERNEL_TYPES = (Gemm, Attention, Elementwise)


@attrs.frozen
class ComputeTime:
    """A latency plugin's answer with its provenance: ``measured_s`` of ``seconds`` came
    from measurements (a profile table), the rest from a model."""

    seconds: float
    measured_s: float = 0.0


# The coverage sources. A plain float from a plugin other than these counts under the
# plugin's own name.
MEASURED, ROOFLINE = "measured", "roofline"


@attrs.define(eq=False)
class LatencyLookup:
    """The one compute-latency lookup of a run (engine and Math path).

    ``seconds(op)`` validates the answering plugin's value and caches it per distinct
    ``(op class, dtype, kernels, FLOPs, bytes)``; ``source(op)`` says which source gave it
    and how much of it was measured.
    """

    hooks: object
    system: object
    deployment: object
    _cache: dict = attrs.field(factory=dict)

    def _answer(self, op) -> tuple[float, str, float]:
        key = (op.op_class, op.dtype, op.kernels, op.flops, op.hbm_bytes)
        hit = self._cache.get(key)
        if hit is None:
            answer = self.hooks.call_first("g5_compute_latency", op=op, system=self.system, deployment=self.deployment)
            if answer is None:
                raise DagError(f"no enabled plugin gives the compute latency of {op.key} "
                               f"(class {op.op_class}); enable the roofline plugin")
            plugin, value = answer
            if isinstance(value, ComputeTime):
                seconds, measured = value.seconds, value.measured_s
            else:
                seconds, measured = value, None
            if not (isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
                    and seconds >= 0 and math.isfinite(seconds)):
                raise PluginError(plugin, f"g5_compute_latency returned {value!r} for {op.key}; need seconds >= 0")
            seconds = float(seconds)
            if measured is None:
                measured = seconds if plugin == MEASURED else 0.0
            if not (0 <= measured <= seconds):
                raise PluginError(plugin, f"g5_compute_latency for {op.key}: measured_s {measured!r} is not within "
                                          f"0..{seconds!r}")
            source = ROOFLINE if plugin in (ROOFLINE, MEASURED) else plugin
            hit = self._cache[key] = (seconds, source, float(measured))
        return hit

    def seconds(self, op) -> float:
        return self._answer(op)[0]

    def source(self, op) -> tuple[str, float]:
        """(source of the unmeasured part, measured seconds) of ``op``'s time."""
        _, source, measured = self._answer(op)
        return source, measured


def coverage_report(ops, duration_s, lookup: LatencyLookup, system, latency_s: float, n_chips: int) -> dict:
    """Where the compute time came from, and what the chips achieved.

    ``coverage``: per op class and overall, the share of compute time (summed over every
    chip's ops) answered from measurements and from the roofline (or another plugin).
    ``per_chip``: each chip's executed FLOPs over the run's latency (achieved TFLOP/s) and
    its MFU, ``sum(op FLOPs / dense peak of the op's dtype) / latency``.
    """
    by_class: dict[str, dict[str, float]] = {}
    chip_flops = [0.0] * n_chips
    chip_peak_s = [0.0] * n_chips
    for op, d in zip(ops, duration_s):
        source, measured = lookup.source(op)
        row = by_class.setdefault(op.op_class, {})
        row[MEASURED] = row.get(MEASURED, 0.0) + measured
        row[source] = row.get(source, 0.0) + (d - measured)
        chip_flops[op.chip] += op.flops
        if op.flops:
            chip_peak_s[op.chip] += op.flops / system.peak_flops(op.dtype)
    total: dict[str, float] = {}
    for row in by_class.values():
        for k, v in row.items():
            total[k] = total.get(k, 0.0) + v

    def shares(row: dict) -> dict:
        s = math.fsum(row.values())
        out = {k: (v / s if s > 0 else 0.0) for k, v in sorted(row.items())}
        out.setdefault(MEASURED, 0.0)
        out["compute_s"] = s
        return out

    per_chip = [{"chip": c,
                 "achieved_tflops": (chip_flops[c] / latency_s / 1e12) if latency_s > 0 else 0.0,
                 "mfu": (chip_peak_s[c] / latency_s) if latency_s > 0 else 0.0}
                for c in range(n_chips)]
    return {"coverage": {"all": shares(total), **{k: shares(v) for k, v in sorted(by_class.items())}},
            "per_chip": per_chip}


def scaled_kernel(kernel: Kernel, factor: float) -> Kernel:
    """The same kernel over ``factor`` times the rows (GEMM ``m``, attention ``batch``,
    elementwise ``tokens``): ``factor`` times the work, same weights per row."""
    if isinstance(kernel, Gemm):
        return attrs.evolve(kernel, m=kernel.m * factor)
    if isinstance(kernel, Attention):
        return attrs.evolve(kernel, batch=kernel.batch * factor)
    return attrs.evolve(kernel, tokens=kernel.tokens * factor)


def answer_seconds(answer) -> object:
    """The seconds of a ``g5_compute_latency`` answer (a number or a :class:`ComputeTime`)."""
    return answer.seconds if isinstance(answer, ComputeTime) else answer
