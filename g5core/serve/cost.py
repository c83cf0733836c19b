"""What a step costs: the protocol the serving loop needs, a synthetic model, and the engine.

The serving loop asks a :class:`StepCost` three things: the latency of a step
(:class:`StepWork`: the prefill chunks and the decodes the scheduler put in it), the KV
bytes one token of one sequence takes per chip, and the KV pool per chip. Two models answer:

- :class:`SyntheticCost`: ``fixed_s + per_token_s * new tokens + per_context_token_s *
  (cached tokens attended)``: deterministic, for tests and queueing checks;
- :class:`EngineCost`: the event engine through :func:`g5core.sim.run.run`, on pure
  prefill and pure decode runs of the deployment (see its doc for how a step maps onto
  them), cached per run shape, with an interpolating predictor unless ``exact``.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping, Optional, Protocol

import attrs

from g5core.api.errors import ConfigError


@attrs.frozen(slots=True)
class StepGroup:
    """``count`` sequences each computing ``new_tokens`` after ``cached_tokens`` already in
    the KV cache (a decode: ``new_tokens = 1``)."""

    new_tokens: int
    cached_tokens: int
    count: int


@attrs.frozen(slots=True)
class StepWork:
    """What one step of one instance computes: its prefill chunks as ``(new_tokens,
    cached_tokens)`` pairs, and ``decodes`` sequences of one token each whose cached tokens
    add up to ``decode_context_tokens``."""

    chunks: tuple[tuple[int, int], ...]
    decodes: int
    decode_context_tokens: int

    @property
    def new_tokens(self) -> int:
        return sum(n for n, _ in self.chunks) + self.decodes

    def groups(self) -> tuple[StepGroup, ...]:
        """The step as groups; the decodes as one group at their mean context (rounded)."""
        out = [StepGroup(n, c, 1) for n, c in self.chunks]
        if self.decodes:
            out.append(StepGroup(1, round(self.decode_context_tokens / self.decodes), self.decodes))
        return tuple(out)


class StepCost(Protocol):
    chips: int                          # chips of one instance
    kv_bytes_per_token_per_chip: float  # one token of one sequence, on the chip that holds most
    kv_pool_bytes_per_chip: float       # what the memory ledger leaves for the KV cache

    def latency_s(self, work: StepWork) -> float: ...

    def kv_tokens(self) -> int:
        """Tokens the pool holds (one sequence's tokens count once)."""
        ...


@attrs.define
class SyntheticCost:
    """A deterministic step cost: ``fixed_s + per_token_s * new + per_context_token_s * cached``
    (``cached``: the context tokens every sequence of the step attends, besides its new ones)."""

    fixed_s: float = 0.01
    per_token_s: float = 0.0
    per_context_token_s: float = 0.0
    kv_bytes_per_token_per_chip: float = 1.0
    kv_pool_bytes_per_chip: float = 1e12
    chips: int = 1
    calls: int = 0

    def latency_s(self, work: StepWork) -> float:
        self.calls += 1
        cached = sum(c for _, c in work.chunks) + work.decode_context_tokens
        return self.fixed_s + self.per_token_s * work.new_tokens + self.per_context_token_s * cached

    def kv_tokens(self) -> int:
        return int(self.kv_pool_bytes_per_chip // self.kv_bytes_per_token_per_chip)


def grid_below(x: float) -> int:
    """The largest point of the predictor's grid ``{1, 2, 3, 4, 6, 8, 12, 16, ...}`` (powers
    of two and 1.5 times them) at or below ``x >= 1``."""
    p = 1 << (int(x).bit_length() - 1)
    return p + p // 2 if p >= 2 and x >= p + p // 2 else p


def grid_above(x: float) -> int:
    g = grid_below(x)
    if g >= x:
        return g
    p = 1 << (g.bit_length() - 1)
    return p + p // 2 if g == p and p >= 2 else 2 * p


def _interp(f: Callable[[int], float], x: float) -> float:
    lo, hi = grid_below(x), grid_above(x)
    if lo == hi:
        return f(lo)
    w = (x - lo) / (hi - lo)
    return (1 - w) * f(lo) + w * f(hi)


@attrs.define
class EngineCost:
    """Step latencies from the event engine, on runs of the deployment the configuration gives.

    Until the prepared plan of the steps issue simulates a mixed step directly, a step maps
    onto the runs ``g5 run`` already does:

    - a prefill chunk of ``T`` new tokens after ``P`` cached ones costs ``F(P + T) - F(P)``,
      where ``F(n)`` is the prefill of one sequence of ``n`` tokens (``F(T)`` when ``P = 0``):
      exact for the FLOPs of causal attention over a prefix and for the GEMMs;
    - the decodes cost ``D(b, c)``: a decode of ``b`` sequences at the step's mean context
      ``c`` (``seq_len = c + 1``), which reads the same KV bytes as the step's decodes;
    - a step holding both costs the sum of its parts (an upper bound: the parts would share
      one pass over the weights).

    ``exact``: every distinct ``F(n)`` and ``D(b, c)`` is an engine run. Otherwise runs are
    made at the grid points ``{1, 2, 3, 4, 6, 8, ...}`` of ``n``, ``b`` and ``c`` around the
    step and interpolated linearly (decode latency is close to affine in ``b`` and ``c``, so
    the grid's corners carry it); :meth:`predictor_error` checks a sample against the engine.
    """

    raw: Mapping
    runner: Callable[[Mapping], float]
    exact: bool = False
    kv_bytes_per_token_per_chip: float = 0.0
    kv_pool_bytes_per_chip: float = 0.0
    kv_capacity_tokens: int = 0
    chips: int = 1
    runs: int = 0
    _prefill: dict = attrs.field(factory=dict)
    _decode: dict = attrs.field(factory=dict)
    _steps: dict = attrs.field(factory=dict)

    def kv_tokens(self) -> int:
        return self.kv_capacity_tokens

    def prefill_s(self, n: int) -> float:
        if n not in self._prefill:
            self._prefill[n] = self.runner({**self.raw, "phase": "prefill", "batch": 1, "seq_len": int(n)})
            self.runs += 1
        return self._prefill[n]

    def decode_s(self, b: int, c: int) -> float:
        key = (int(b), int(c))
        if key not in self._decode:
            self._decode[key] = self.runner({**self.raw, "phase": "decode", "batch": key[0], "seq_len": key[1] + 1})
            self.runs += 1
        return self._decode[key]

    def _f(self, n: float, exact: bool) -> float:
        return self.prefill_s(round(n)) if exact else _interp(self.prefill_s, n)

    def _d(self, b: int, c: float, exact: bool) -> float:
        if exact:
            return self.decode_s(b, round(c))
        return _interp(lambda bb: _interp(lambda cc: self.decode_s(bb, cc), max(c, 1.0)), b)

    def chunk_s(self, new: int, cached: int, exact: bool) -> float:
        if cached == 0:
            return self._f(new, exact)
        return max(self._f(cached + new, exact) - self._f(cached, exact), 0.0)

    def latency_s(self, work: StepWork, exact: Optional[bool] = None) -> float:
        exact = self.exact if exact is None else exact
        key = (work, exact)
        hit = self._steps.get(key)
        if hit is not None:
            return hit
        total = sum(self.chunk_s(n, c, exact) for n, c in work.chunks)
        if work.decodes:
            total += self._d(work.decodes, work.decode_context_tokens / work.decodes, exact)
        self._steps[key] = total
        return total

    def predictor_error(self, sample: list[StepWork]) -> dict:
        """Relative error of the predicted latency against the engine on ``sample``."""
        errors = sorted(abs(self.latency_s(w, False) / self.latency_s(w, True) - 1.0) for w in sample)
        if not errors:
            return {"steps_checked": 0}
        mid = len(errors) // 2
        median = errors[mid] if len(errors) % 2 else 0.5 * (errors[mid - 1] + errors[mid])
        return {"steps_checked": len(errors), "median_rel": median, "max_rel": errors[-1]}


def engine_runner(disabled=()) -> Callable[[Mapping], float]:
    """``raw -> latency_s`` through ``g5 run``'s path (the engine, with symmetry)."""
    from g5core.sim.run import run

    def go(raw: Mapping) -> float:
        return run(dict(raw), disabled=disabled).latency_s
    return go


@attrs.frozen
class KvSizing:
    """The KV pool of one instance, from the memory ledger of its largest step."""

    pool_bytes_per_chip: float      # the smallest over the instance's chips
    kv_bytes_per_token_per_chip: float  # on the chip that holds most per token
    capacity_tokens: int            # tokens the tightest chip holds
    chips: int
    kv_bytes_per_token: float       # summed over the instance's chips (what a transfer moves)
    per_chip_kv_bytes_per_token: tuple[float, ...] = ()


def kv_sizing(raw: Mapping, largest_step_tokens: int, disabled=(), field: str = "serving"):
    """Pool per chip = HBM - weights - activations of the largest step - workspace, per the
    ledger (so cp and sp shrink a token's footprint exactly as the ledger says)."""
    from g5core.sim.memory import memory_report
    from g5core.sim.run import make_plan

    n = int(largest_step_tokens)
    plan = make_plan({**raw, "phase": "prefill", "batch": 1, "seq_len": n}, disabled)
    mem = memory_report(plan.ctx)
    pools, per_token, caps = [], [], []
    for c in mem.per_chip:
        pool = c.capacity_bytes - c.weights_bytes - c.activation_bytes - c.workspace_bytes
        kvpt = c.kv_cache_bytes / n
        pools.append(pool)
        per_token.append(kvpt)
        caps.append(math.inf if kvpt == 0 else max(pool, 0.0) / kvpt)
    if min(pools) <= 0:
        worst = min(range(len(pools)), key=lambda i: pools[i])
        raise ConfigError(field, f"weights, activations and workspace of a {n:,}-token step fill chip {worst}'s HBM "
                                 f"({-pools[worst] / 2 ** 30:.2f} GiB over); no room is left for a KV cache: use more "
                                 "chips per instance or lower max_num_batched_tokens")
    chips = plan.ctx.deployment.chips
    return KvSizing(min(pools), max(per_token), int(min(caps)), chips, sum(per_token), tuple(per_token)), plan

