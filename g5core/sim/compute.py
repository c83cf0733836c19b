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
distinct key. Each kernel's FLOPs and bytes come from :mod:`g5core.build.flops` (the one place
those formulas live).

A latency plugin answers with seconds, or with a :class:`ComputeTime` that also says how
many of those seconds come from measurements; the lookup keeps, per op, which source gave
its time, so the run can report measured versus roofline coverage.
"""
from __future__ import annotations

import math
from typing import Union

import attrs

from g5core.build import flops as F
from g5core.api.errors import DagError, PluginError

ATTENTION_BLOCKS = ("causal", "full", "decode")
ELEMENTWISE_KINDS = ("rmsnorm", "residual_add", "rotary", "embedding", "swiglu", "fp8_quant", "kv_append",
                     "splitkv_combine", "attn_merge", "moe_topk", "moe_permute", "moe_unpermute")


def _nonneg(instance, attribute, value) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 and math.isfinite(value)):
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be a finite number >= 0, got {value!r}")


def _num():
    return attrs.field(converter=float, validator=_nonneg)


@attrs.frozen(kw_only=True, cache_hash=True)
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

    def describe(self) -> str:
        groups = f",groups={self.groups:g}" if self.groups != 1 else ""
        return f"gemm(m={self.m:g},n={self.n:g},k={self.k:g}{groups})"

    @property
    def hbm_bytes(self) -> float:
        return F.grouped_gemm(self.m, self.k, self.n, self.groups, self.weight_bytes, self.act_bytes)[1]


@attrs.frozen(kw_only=True, cache_hash=True)
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

    def describe(self) -> str:
        return (f"attention_{self.block}(batch={self.batch:g},q={self.q_len:g},kv={self.kv_len:g},"
                f"heads={self.heads:g},kv_heads={self.kv_heads:g},d_qk={self.d_qk:g},d_v={self.d_v:g})")

    @property
    def length_tokens(self) -> float:
        """The block length that sets a flash kernel's efficiency: its KV length."""
        return self.kv_len


@attrs.frozen(kw_only=True, cache_hash=True)
class Elementwise:
    """A memory-bound kernel over ``tokens x width`` elements. ``parts``: the partials a
    merge reads (``splitkv_combine``, ``attn_merge``: ``tokens`` are (query, head) rows and
    ``width`` is ``d_v``) or the experts per token (``moe_topk``: ``width`` is the expert
    count; ``moe_unpermute``: ``tokens`` are the (token, expert) slots); ``kv_append``:
    ``width`` KV elements per token of ``act_bytes`` each (the cache's dtype)."""

    tokens: float = _num()
    width: float = _num()
    kind: str = attrs.field(validator=attrs.validators.in_(ELEMENTWISE_KINDS))
    act_bytes: float = _num()
    parts: float = attrs.field(converter=float, default=1.0, validator=_nonneg)

    op_class = "elementwise"

    def _work(self) -> tuple[float, float]:
        t, w, b = self.tokens, self.width, self.act_bytes
        if self.kind == "residual_add":
            return F.residual_add(t, w, b)
        if self.kind == "swiglu":
            return F.swiglu(t, w, b)
        if self.kind == "fp8_quant":
            return F.fp8_quantize(t, w, b)
        if self.kind == "kv_append":
            return F.kv_cache_append(t, w, b)
        if self.kind in ("splitkv_combine", "attn_merge"):
            return F.partials_merge(t, w, self.parts, b)
        if self.kind == "moe_topk":
            return F.moe_topk(t, w, self.parts)
        if self.kind == "moe_permute":
            return F.moe_permute(t, w, b)
        if self.kind == "moe_unpermute":
            return F.moe_unpermute(t, w, self.parts, b)
        return F.elementwise(t, w, b)

    def describe(self) -> str:
        extra = f",parts={self.parts:g}" if self.parts != 1 else ""
        return f"{self.kind}(tokens={self.tokens:g},width={self.width:g}{extra})"

    @property
    def flops(self) -> float:
        return 0.0 if self.kind == "embedding" else self._work()[0]

    @property
    def hbm_bytes(self) -> float:
        return self._work()[1]


Kernel = Union[Gemm, Attention, Elementwise]


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
    # (class, dtype, id(kernels), FLOPs, bytes) -> (kernels, answer): ops made from one Work
    # share its kernels tuple, so most ops find their answer without hashing the kernels;
    # the entry holds the tuple, so its id is not reused while the entry lives
    _by_kernels: dict = attrs.field(factory=dict)
    #: every distinct answer, by id: (op class, dtype, seconds, source, measured seconds)
    answers: list = attrs.field(factory=list)
    _answer_ids: dict = attrs.field(factory=dict)  # key -> id into ``answers``
    #: per answer id: the seconds the kernel launches added to its time (g5core.inputs.framework)
    launch: list = attrs.field(factory=list)
    _added: dict = attrs.field(factory=dict)   # key -> launch seconds added

    def _launch_s(self, op) -> float:
        from g5core.inputs.framework import launch_s

        return launch_s(op, self.system, getattr(self.deployment, "phase", ""))

    def answer_id(self, op) -> int:
        """The id (into :attr:`answers`) of ``op``'s answer; compile records one per op."""
        kernels = op.kernels
        fast = (op.op_class, op.dtype, id(kernels), op.flops, op.hbm_bytes, self._launch_s(op))
        seen = self._by_kernels.get(fast)
        if seen is not None and seen[0] is kernels:
            return seen[2]
        self._answer(op)
        return self._by_kernels[fast][2]

    def _answer(self, op) -> tuple[float, str, float]:
        kernels = op.kernels
        launch = self._launch_s(op)
        fast = (op.op_class, op.dtype, id(kernels), op.flops, op.hbm_bytes, launch)
        seen = self._by_kernels.get(fast)
        if seen is not None and seen[0] is kernels:
            return seen[1]
        key = (op.op_class, op.dtype, kernels, op.flops, op.hbm_bytes, launch)
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
            # an uncaptured op's kernel launches add to its time (g5core.inputs.framework)
            hit = self._cache[key] = (seconds + launch, source, float(measured))
            self._added[key] = launch
        aid = self._answer_ids.get(key)
        if aid is None:
            aid = self._answer_ids[key] = len(self.answers)
            self.answers.append((op.op_class, op.dtype) + hit)
            self.launch.append(self._added[key])
        self._by_kernels[fast] = (kernels, hit, aid)
        return hit

    def seconds(self, op) -> float:
        return self._answer(op)[0]

    def source(self, op) -> tuple[str, float]:
        """(source of the unmeasured part, measured seconds) of ``op``'s time."""
        _, source, measured = self._answer(op)
        return source, measured


def exact_sum(values) -> float:
    """The exactly-rounded sum (order-independent); an overflowing one is +-inf, as a plain
    sum would be (the run then reports it as out of range)."""
    try:
        return math.fsum(values)
    except OverflowError:
        return sum(values)


def exact_sum_repeated(pairs) -> float:
    """:func:`exact_sum` of every value ``v`` repeated ``n`` times, for ``(v, n)`` in
    ``pairs`` (in that order), without making the list."""
    return exact_sum(_Repeated(pairs))


class _Repeated:
    """Each ``v`` of ``pairs`` ``n`` times, iterable again and again (made when iterated)."""

    def __init__(self, pairs):
        self.pairs = list(pairs)

    def __iter__(self):
        from itertools import chain, repeat

        return chain.from_iterable(repeat(v, n) for v, n in self.pairs)


def coverage_report(timed_ops, system, latency_s: float, n_chips: int, lookup: LatencyLookup) -> dict:
    """:func:`coverage_from_columns` of ``timed_ops``, (compute op, seconds) for every
    compute op run (the Math path)."""
    ids = [lookup.answer_id(op) for op, _ in timed_ops]
    chips = [op.chip for op, _ in timed_ops]
    flops = [float(op.flops) for op, _ in timed_ops]
    return coverage_from_columns(ids, chips, flops, system, latency_s, n_chips, lookup)


def coverage_from_columns(answer_ids, chips, flops, system, latency_s: float, n_chips: int, lookup: LatencyLookup,
                          replicas: int = 1, replica_chips: int = 0) -> dict:
    """Where the compute time came from, and what the chips achieved.

    Per compute op run: its answer id (:meth:`LatencyLookup.answer_id`), chip and FLOPs, in
    op order. ``coverage``: per op class and overall (``all``), the share of compute time
    (summed over every chip's ops) answered from measurements and from the roofline (or
    another plugin, by name), and the seconds. ``per_chip``: each chip's FLOPs over the
    run's latency (achieved TFLOP/s) and its MFU, ``sum(op FLOPs / dense peak of the op's
    dtype) / latency`` (each chip's sums in op order). With ``replicas > 1`` the ops are
    those of chips ``0..replica_chips-1``, and every other replica of that many chips ran
    the same (g5core.build.symmetry). Coverage sums are exactly rounded (``math.fsum``).
    """
    import numpy as np

    ids = np.asarray(answer_ids, dtype=np.int64)
    chip = np.asarray(chips, dtype=np.int64)
    fl = np.asarray(flops, dtype=float)
    table = lookup.answers
    count = np.bincount(ids, minlength=len(table)).tolist() if len(ids) else [0] * len(table)
    parts: dict[str, dict[str, list]] = {}
    for aid, n in enumerate(count):
        if not n:
            continue
        op_class, _, seconds, source, measured = table[aid]
        row = parts.setdefault(op_class, {})
        row.setdefault(MEASURED, []).append((measured, n))
        row.setdefault(source, []).append((seconds - measured, n))

    def copies(pairs) -> float:  # the exact sum of every op's value, over every replica
        return exact_sum_repeated((v, n * replicas) for v, n in pairs)

    by_class = {cls: {k: copies(v) for k, v in row.items()} for cls, row in parts.items()}
    total_pairs: dict[str, list] = {}
    for row in parts.values():
        for k, v in row.items():
            total_pairs.setdefault(k, []).extend(v)
    total = {k: copies(v) for k, v in total_pairs.items()}
    peak = np.asarray([system.peak_flops(dtype) for _, dtype, *_ in table], dtype=float) if table else np.zeros(0)
    # bincount adds each chip's values in op order, as a loop over the ops would
    chip_flops = np.bincount(chip, weights=fl, minlength=n_chips).tolist()
    busy = fl != 0
    chip_peak_s = np.bincount(chip[busy], weights=fl[busy] / peak[ids[busy]], minlength=n_chips).tolist()
    if replicas > 1:
        for c in range(replica_chips, n_chips):
            chip_flops[c] = chip_flops[c % replica_chips]
            chip_peak_s[c] = chip_peak_s[c % replica_chips]

    def shares(row: dict) -> dict:
        s = math.fsum(row.values())
        out = {k: (v / s if s > 0 else 0.0) for k, v in sorted(row.items())}
        out.setdefault(MEASURED, 0.0)
        out.setdefault(ROOFLINE, 0.0)
        out["compute_s"] = s
        return out

    per_chip = [{"chip": c,
                 "achieved_tflops": (chip_flops[c] / latency_s / 1e12) if latency_s > 0 else 0.0,
                 "mfu": (chip_peak_s[c] / latency_s) if latency_s > 0 else 0.0}
                for c in range(n_chips)]
    launch = np.asarray(lookup.launch, dtype=float)
    chip_launch = np.bincount(chip, weights=launch[ids], minlength=n_chips) if len(ids) and len(launch) \
        else np.zeros(n_chips)
    model = "size-aware roofline" if system.compute_model is not None else \
        "flat roofline (the system file has no compute_model block)"
    fw = getattr(system, "framework", None)
    return {"model": model,
            "profile": system.profile.to_dict() if system.profile is not None else None,
            "launch": {"framework": fw.to_dict() if fw is not None else None,
                       "added_s": float(chip_launch.max()) if len(chip_launch) else 0.0},
            "coverage": {"all": shares(total), **{k: shares(v) for k, v in sorted(by_class.items())}},
            "per_chip": per_chip}


def render_compute(report: dict) -> list[str]:
    """Summary lines of a :func:`coverage_report`."""
    cov = report["coverage"]
    prof = report["profile"]
    where = f"profile {prof['source']}/{prof['gpu']}/{prof['framework']}" if prof else "no measured profile"
    parts = ", ".join(f"{k} {100 * v[MEASURED]:.0f}%" for k, v in cov.items() if k != "all")
    lines = [f"compute time: {100 * cov['all'][MEASURED]:.1f}% measured ({where}), "
             f"{100 * (1 - cov['all'][MEASURED]):.1f}% {report['model']}; measured by class: {parts or 'none'}"]
    launch = report.get("launch") or {}
    if launch.get("framework"):
        fw = launch["framework"]
        lines.append(f"kernel launches: {launch['added_s'] * 1e3:.3f} ms added on the busiest chip "
                     f"(cuda_graphs: {fw['cuda_graphs']}, {fw['kernel_launch_s'] * 1e6:g} us per kernel not captured)")
    chips = report["per_chip"]
    if chips:
        best = max(chips, key=lambda c: (c["mfu"], -c["chip"]))
        low = min(chips, key=lambda c: (c["mfu"], c["chip"]))
        lines.append(f"achieved per chip: {best['achieved_tflops']:.1f} TFLOP/s, MFU {100 * best['mfu']:.1f}% "
                     f"(chip {best['chip']}; lowest: chip {low['chip']}, {low['achieved_tflops']:.1f} TFLOP/s, "
                     f"MFU {100 * low['mfu']:.1f}%)")
    return lines


def describe_kernels(kernels) -> str:
    """The kernels of a compute op as the timeline shows them: each kernel's name and shape,
    its FLOPs and HBM bytes (:mod:`g5core.build.flops`), separated by ``;``."""
    return "; ".join(f"{k.describe()} flops={k.flops!r} bytes={k.hbm_bytes!r}" for k in kernels)


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


# ----------------------------------------------------------------------------------------
# The size-aware roofline's parameters (the ``compute_model`` block of a system file)
# ----------------------------------------------------------------------------------------

FLOOR_KEYS = ("gemm", "attention", "decode_attention", "elementwise")


def _cm_fraction(field: str, v) -> float:
    from g5core.api.errors import ConfigError
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v <= 1:
        raise ConfigError(field, f"expected a fraction in (0, 1], got {v!r}")
    return float(v)


def _cm_positive(field: str, v, integer: bool = False) -> float:
    from g5core.api.errors import ConfigError
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
    if ok and integer and float(v) != int(v):
        ok = False
    if not ok:
        raise ConfigError(field, f"expected a positive {'integer' if integer else 'number'}, got {v!r}")
    return int(v) if integer else float(v)


@attrs.frozen(kw_only=True)
class ComputeModel:
    """Parameters of the size-aware roofline (:mod:`g5core.sim.roofline` documents the formulas).

    All required when the block is given; a system file without the block runs the flat
    roofline (``efficiency`` per op class) and the run output says so.
    """

    gemm_peak_fraction: tuple        # ((dtype, fraction), ...): large-GEMM fraction of dense peak
    gemm_tile_m: int
    gemm_tile_n: int
    gemm_tile_k: int
    sm_count: int                    # streaming multiprocessors: one GEMM tile per SM per wave
    attention_peak_fraction: float   # flash attention's asymptotic fraction of peak (long blocks)
    attention_half_length_tokens: float  # block length at which it reaches half that fraction
    hbm_fraction: float              # achieved fraction of HBM bandwidth of a streaming kernel
    kernel_floor_s: tuple            # ((kernel kind, seconds), ...) for FLOOR_KEYS
    #: optional other attention kernel families: ((name, (peak_fraction, half_length_tokens)), ...),
    #: chosen by the system file's ``framework: {attention: NAME}``
    attention_curves: tuple = ()

    KEYS = ("gemm_peak_fraction", "gemm_tile_m", "gemm_tile_n", "gemm_tile_k", "sm_count",
            "attention_peak_fraction", "attention_half_length_tokens", "hbm_fraction", "kernel_floor_s")
    OPTIONAL = ("attention_curves",)

    @classmethod
    def from_mapping(cls, data, field: str = "system.compute_model") -> "ComputeModel":
        from g5core.api.errors import ConfigError, suggest
        if not hasattr(data, "items"):
            raise ConfigError(field, f"expected a mapping with keys {', '.join(cls.KEYS)}, got {data!r}")
        for key in data:
            if key not in cls.KEYS + cls.OPTIONAL:
                raise ConfigError(f"{field}.{key}", f"unknown key{suggest(str(key), cls.KEYS + cls.OPTIONAL)}; "
                                                    f"valid keys: {', '.join(cls.KEYS + cls.OPTIONAL)}")
        curves = data.get("attention_curves", {})
        if not hasattr(curves, "items"):
            raise ConfigError(f"{field}.attention_curves", "expected a mapping such as "
                                                           "{fa3: {peak_fraction: 0.645, half_length_tokens: 614}}")
        parsed_curves = []
        for name, curve in sorted(curves.items()):
            where = f"{field}.attention_curves.{name}"
            if not hasattr(curve, "items") or set(curve) != {"peak_fraction", "half_length_tokens"}:
                raise ConfigError(where, "expected {peak_fraction: F, half_length_tokens: N}")
            parsed_curves.append((str(name), (_cm_fraction(f"{where}.peak_fraction", curve["peak_fraction"]),
                                              _cm_positive(f"{where}.half_length_tokens",
                                                           curve["half_length_tokens"]))))
        for key in cls.KEYS:
            if key not in data:
                raise ConfigError(f"{field}.{key}", f"missing; the compute_model block needs all of "
                                                    f"{', '.join(cls.KEYS)} (see the shipped system files)")
        peaks = data["gemm_peak_fraction"]
        if not hasattr(peaks, "items") or not peaks:
            raise ConfigError(f"{field}.gemm_peak_fraction", f"expected a mapping of dtype to fraction, got {peaks!r}")
        floors = data["kernel_floor_s"]
        if not hasattr(floors, "items"):
            raise ConfigError(f"{field}.kernel_floor_s", f"expected a mapping with keys {', '.join(FLOOR_KEYS)}")
        for key in floors:
            if key not in FLOOR_KEYS:
                raise ConfigError(f"{field}.kernel_floor_s.{key}", f"unknown kernel kind; valid: {', '.join(FLOOR_KEYS)}")
        out = {}
        for key in FLOOR_KEYS:
            if key not in floors:
                raise ConfigError(f"{field}.kernel_floor_s.{key}", f"missing; give all of {', '.join(FLOOR_KEYS)}")
            v = floors[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"{field}.kernel_floor_s.{key}", f"expected seconds >= 0, got {v!r}")
            out[key] = float(v)
        return cls(
            gemm_peak_fraction=tuple(sorted((str(k), _cm_fraction(f"{field}.gemm_peak_fraction.{k}", v))
                                            for k, v in peaks.items())),
            gemm_tile_m=_cm_positive(f"{field}.gemm_tile_m", data["gemm_tile_m"], True),
            gemm_tile_n=_cm_positive(f"{field}.gemm_tile_n", data["gemm_tile_n"], True),
            gemm_tile_k=_cm_positive(f"{field}.gemm_tile_k", data["gemm_tile_k"], True),
            sm_count=_cm_positive(f"{field}.sm_count", data["sm_count"], True),
            attention_peak_fraction=_cm_fraction(f"{field}.attention_peak_fraction", data["attention_peak_fraction"]),
            attention_half_length_tokens=_cm_positive(f"{field}.attention_half_length_tokens",
                                                      data["attention_half_length_tokens"]),
            hbm_fraction=_cm_fraction(f"{field}.hbm_fraction", data["hbm_fraction"]),
            kernel_floor_s=tuple((k, out[k]) for k in FLOOR_KEYS),
            attention_curves=tuple(parsed_curves),
        )

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self.KEYS}
        out["gemm_peak_fraction"] = dict(self.gemm_peak_fraction)
        out["kernel_floor_s"] = dict(self.kernel_floor_s)
        if self.attention_curves:
            out["attention_curves"] = {n: {"peak_fraction": p, "half_length_tokens": h}
                                       for n, (p, h) in self.attention_curves}
        return out

    def attention_curve(self, name: str = "default") -> tuple[float, float]:
        """(peak fraction, half length in tokens) of the attention kernel family ``name``."""
        from g5core.api.errors import ConfigError
        if name == "default":
            return self.attention_peak_fraction, self.attention_half_length_tokens
        table = dict(self.attention_curves)
        if name not in table:
            raise ConfigError("system.framework.attention",
                              f"no attention curve {name!r} in compute_model.attention_curves (it lists "
                              f"{', '.join(['default', *table]) }); add it or choose one of those")
        return table[name]

    def gemm_fraction(self, dtype: str) -> float:
        from g5core.api.errors import ConfigError
        table = dict(self.gemm_peak_fraction)
        if dtype not in table:
            raise ConfigError("system.compute_model.gemm_peak_fraction",
                              f"no GEMM peak fraction for dtype '{dtype}' (it lists {', '.join(table)}); add it")
        return table[dtype]

    def floor_s(self, kind: str) -> float:
        return dict(self.kernel_floor_s)[kind]


PROFILE_SOURCES = ("aiconfigurator",)
PROFILE_KEYS = ("source", "gpu", "framework", "version")


@attrs.frozen(kw_only=True)
class Profile:
    """A measured per-op table set chosen in the system file (``profile:``)."""

    source: str
    gpu: str
    framework: str
    version: str = ""   # "" = the newest version the tables hold for each op

    @classmethod
    def from_mapping(cls, data, field: str = "system.profile") -> "Profile":
        from g5core.api.errors import ConfigError, suggest
        if not hasattr(data, "items"):
            raise ConfigError(field, "expected a mapping such as {source: aiconfigurator, gpu: h100_sxm, "
                                     f"framework: trtllm}}, got {data!r}")
        for key in data:
            if key not in PROFILE_KEYS:
                raise ConfigError(f"{field}.{key}", f"unknown key{suggest(str(key), PROFILE_KEYS)}; "
                                                    f"valid keys: {', '.join(PROFILE_KEYS)}")
        for key in PROFILE_KEYS[:3]:
            v = data.get(key)
            if not isinstance(v, str) or not v.strip():
                raise ConfigError(f"{field}.{key}", "missing or empty; give e.g. source: aiconfigurator, "
                                                    "gpu: h100_sxm, framework: trtllm")
        if data["source"] not in PROFILE_SOURCES:
            raise ConfigError(f"{field}.source", f"unknown source {data['source']!r}; known: "
                                                 f"{', '.join(PROFILE_SOURCES)}")
        version = data.get("version", "")
        if not isinstance(version, str):
            raise ConfigError(f"{field}.version", f"expected a version string such as '1.3.0rc20', got {version!r}")
        return cls(source=data["source"], gpu=data["gpu"], framework=data["framework"], version=version)

    def to_dict(self) -> dict:
        out = {"source": self.source, "gpu": self.gpu, "framework": self.framework}
        if self.version:
            out["version"] = self.version
        return out
