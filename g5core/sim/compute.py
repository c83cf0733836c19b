"""The one compute-latency lookup, and the coverage report.

A compute op (``ComputeOp``) carries, besides its total FLOPs and HBM bytes, the tuple of
kernels it runs, each with its shape (:mod:`g5core.lower.kernels`: ``Gemm``, ``Attention``,
``Elementwise``). Two ops with equal FLOPs and bytes but different shapes are different ops:
the latency lookup (:class:`LatencyLookup`, used by the engine and by the Math path alike) is
keyed on ``(op class, dtype, kernels, FLOPs, bytes)`` and asks ``g5_compute_latency`` once per
distinct key.

A latency plugin answers with seconds, or with a :class:`~g5core.api.records.ComputeTime` that
also says how many of those seconds come from measurements; the lookup keeps, per op, which
source gave its time, so the run can report measured versus roofline coverage.
"""
from __future__ import annotations

import math
from itertools import chain, repeat

import attrs
import numpy as np

from g5core.api.errors import DagError, PluginError
from g5core.api.records import ComputeTime
from g5core.inputs.framework import launch_s, step_sequences



# The coverage sources. A plain float from a plugin other than these counts under the
# plugin's own name.
MEASURED, ROOFLINE = "measured", "roofline"


@attrs.frozen(kw_only=True)
class LatencyAnswer:
    """One distinct compute-latency answer: ops of ``op_class`` in ``dtype`` take ``seconds``,
    of which ``measured_s`` came from measurements; ``source`` gave the rest."""

    op_class: str
    dtype: str
    seconds: float
    source: str
    measured_s: float
    #: the seconds uncaptured kernel launches added to ``seconds`` (g5core.inputs.framework)
    launch_s: float = 0.0


@attrs.define(eq=False, kw_only=True)
class LatencyLookup:
    """The one compute-latency lookup of a run (engine and Math path).

    ``answer_id(op)`` validates the answering plugin's value and keeps it, once per distinct
    ``(op class, dtype, kernels, FLOPs, bytes)``, in :attr:`answers`.
    """

    hooks: object
    system: object
    deployment: object
    # (class, dtype, id(kernels), FLOPs, bytes) -> (kernels, answer id): ops made from one
    # Work share its kernels tuple, so most ops find their answer without hashing the
    # kernels; the entry holds the tuple, so its id is not reused while the entry lives
    _by_kernels: dict = attrs.field(factory=dict)
    #: every distinct answer, by id
    answers: list[LatencyAnswer] = attrs.field(factory=list)
    _answer_ids: dict = attrs.field(factory=dict)  # (class, dtype, kernels, FLOPs, bytes, launch, name) -> id into ``answers``
    _launches: dict = attrs.field(factory=dict)  # (kernels, name, owner) -> launch seconds
    #: comm lowerings of the runs compiled with this lookup (:func:`g5core.sim.compile.compile_ops`):
    #: ``(id(topology), id(primitives)) -> (topology, primitives, {(primitive, group, bytes per
    #: rank): (flows, latency_s, algorithm, wire bytes per payload byte)})``; the entry holds
    #: the topology and primitives, so their ids are not reused while it lives
    lowerings: dict = attrs.field(factory=dict)

    def _launch_s(self, op) -> float:
        # the step's sequences too: a decode step above the largest captured batch runs eagerly
        sequences = step_sequences(self.deployment)
        key = (op.kernels, op.name, op.owner, getattr(self.deployment, "phase", ""), sequences)
        seconds = self._launches.get(key)
        if seconds is None:
            seconds = self._launches[key] = launch_s(op, self.system, key[3], sequences)
        return seconds

    def answer_id(self, op) -> int:
        """The id (into :attr:`answers`) of ``op``'s answer; compile records one per op."""
        kernels = op.kernels
        launch = self._launch_s(op)
        # the name too: which kernels fuse can depend on it (framework.kernel_fusions: o_proj)
        fast = (op.op_class, op.dtype, id(kernels), op.flops, op.hbm_bytes, launch, op.name)
        seen = self._by_kernels.get(fast)
        if seen is not None and seen[0] is kernels:
            return seen[1]
        key = (op.op_class, op.dtype, kernels, op.flops, op.hbm_bytes, launch, op.name)
        aid = self._answer_ids.get(key)
        if aid is None:
            aid = self._answer_ids[key] = len(self.answers)
            self.answers.append(self._ask(op, launch))
        self._by_kernels[fast] = (kernels, aid)
        return aid

    def _ask(self, op, launch: float = 0.0) -> LatencyAnswer:
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
        return LatencyAnswer(op_class=op.op_class, dtype=op.dtype, seconds=seconds + launch, source=source,
                             measured_s=float(measured), launch_s=launch)

    def seconds(self, op) -> float:
        return self.answers[self.answer_id(op)].seconds


def exact_sum(values) -> float:
    """The exactly-rounded sum (order-independent); an overflowing one is +-inf, as a plain
    sum would be (the run then reports it as out of range)."""
    try:
        return math.fsum(values)
    except OverflowError:
        return sum(values)


def exact_sum_repeated(pairs) -> float:
    """:func:`exact_sum` of every value ``v`` repeated ``n`` times, for ``(v, n)`` in
    ``pairs``, in time independent of the ``n`` (a run's sums over many alike replicas).

    The exact sum is formed in integers (every finite double is an integer times a power of
    two) and rounded once, by Python's correctly rounded integer division: the value
    ``math.fsum`` gives for the repeated list, which is the exact sum correctly rounded."""
    pairs = list(pairs)
    num, shift = 0, 0          # the sum is num / 2**shift
    try:
        for v, n in pairs:
            p, q = float(v).as_integer_ratio()
            k = q.bit_length() - 1   # q is a power of two
            if k > shift:
                num <<= k - shift
                shift = k
            num += (p * int(n)) << (shift - k)
    except (OverflowError, ValueError):   # inf or NaN among the values: as fsum would say
        return exact_sum(_Repeated(pairs))
    try:
        return num / (1 << shift) if shift else float(num)
    except OverflowError:     # beyond the largest double: inf, as a plain sum would be
        return math.inf if num > 0 else -math.inf


class _Repeated:
    """Each ``v`` of ``pairs`` ``n`` times, iterable again and again (made when iterated)."""

    def __init__(self, pairs):
        self.pairs = list(pairs)

    def __iter__(self):
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
    the same (g5core.lower.symmetry). Coverage sums are exactly rounded (``math.fsum``).
    """
    ids = np.asarray(answer_ids, dtype=np.int64)
    chip = np.asarray(chips, dtype=np.int64)
    fl = np.asarray(flops, dtype=float)
    table = lookup.answers
    count = np.bincount(ids, minlength=len(table)).tolist() if len(ids) else [0] * len(table)
    parts: dict[str, dict[str, list]] = {}
    for aid, n in enumerate(count):
        if not n:
            continue
        answer = table[aid]
        row = parts.setdefault(answer.op_class, {})
        row.setdefault(MEASURED, []).append((answer.measured_s, n))
        row.setdefault(answer.source, []).append((answer.seconds - answer.measured_s, n))

    def copies(pairs) -> float:  # the exact sum of every op's value, over every replica
        return exact_sum_repeated((v, n * replicas) for v, n in pairs)

    by_class = {cls: {k: copies(v) for k, v in row.items()} for cls, row in parts.items()}
    total_pairs: dict[str, list] = {}
    for row in parts.values():
        for k, v in row.items():
            total_pairs.setdefault(k, []).extend(v)
    total = {k: copies(v) for k, v in total_pairs.items()}
    peak = np.asarray([system.peak_flops(a.dtype) for a in table], dtype=float) if table else np.zeros(0)
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
    launch = np.asarray([a.launch_s for a in table], dtype=float)
    chip_launch = np.bincount(chip, weights=launch[ids], minlength=n_chips) if len(ids) and len(launch) \
        else np.zeros(n_chips)
    fw = getattr(system, "framework", None)
    model = "size-aware roofline" if system.compute_model is not None else \
        "flat roofline (the system file has no compute_model block)"
    return {"model": model,
            "profile": system.profile.to_dict() if system.profile is not None else None,
            "launch": {"framework": fw.to_dict() if fw is not None else None,
                       "added_s": float(chip_launch.max()) if len(chip_launch) else 0.0},
            "coverage": {"all": shares(total), **{k: shares(v) for k, v in sorted(by_class.items())}},
            "per_chip": per_chip}


def answer_seconds(answer) -> object:
    """The seconds of a ``g5_compute_latency`` answer (a number or a :class:`ComputeTime`)."""
    return answer.seconds if isinstance(answer, ComputeTime) else answer
