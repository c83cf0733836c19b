"""What a step costs: the protocol the serving loop needs, a synthetic model, and the engine.

The serving loop asks a :class:`StepCost` three things: the latency of a step
(:class:`g5core.StepWork`: the prefill chunks and the decodes the scheduler put in it), the KV
bytes one token of one sequence takes per chip, and the KV pool per chip. Two models answer:

- :class:`SyntheticCost`: ``fixed_s + per_token_s * new tokens + per_context_token_s *
  (cached tokens attended)``: deterministic, for tests and queueing checks;
- :class:`PlanCost`: the event engine through the prepared plan of the steps API
  (``g5core.prepare(config).simulate(step)``), cached per step shape, with a predictor
  composed of single-group steps unless ``exact``;
- :class:`DpCost`: an instance of attention-DP ranks (a :class:`RankedWork` a step): each
  rank's own part of a :class:`PlanCost` step, the slowest's, plus the experts of the tokens
  every rank routes (from the engine's op breakdown).
"""
from __future__ import annotations

import collections.abc
from typing import Callable, Optional, Protocol, Sequence

import attrs

from g5core.api.errors import ConfigError
from g5core.api.records import StepRules
from g5core.api.serving import GroupShape, StepWork
from g5core.inputs.step import Step, StepGroup
from g5core.lower.steprules import split_step


#: what an idle attention-DP rank runs while the others step: SGLang's idle batch
#: (``ForwardMode.IDLE``, ``python/sglang/srt/model_executor/forward_batch_info.py``) runs the
#: MoE layers with no tokens so that the rank joins every all-to-all; the engine cannot run a
#: step of no tokens, so G5 runs one dummy token at no context (a decode of one sequence)
IDLE_WORK = StepWork((), (0,))


@attrs.frozen(slots=True)
class RankedWork:
    """One step of an instance of attention-DP ranks: each rank's own :class:`StepWork`
    (an idle rank's is empty). ``new_tokens`` and ``decode_contexts`` are the instance's."""

    ranks: tuple[StepWork, ...]

    @property
    def chunks(self) -> tuple[tuple[int, int], ...]:
        return tuple(c for w in self.ranks for c in w.chunks)

    @property
    def decode_contexts(self) -> tuple[int, ...]:
        return tuple(sorted(c for w in self.ranks for c in w.decode_contexts))

    @property
    def decodes(self) -> int:
        return sum(w.decodes for w in self.ranks)

    @property
    def new_tokens(self) -> int:
        return sum(w.new_tokens for w in self.ranks)

    @property
    def idle_ranks(self) -> int:
        return sum(1 for w in self.ranks if not w.new_tokens)


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
        cached = sum(c for _, c in work.chunks) + sum(work.decode_contexts)
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


#: token counts from which the predictor's cells start just past their grid point (below
#: it the engine's step latency is smooth in the token count: llama-3.1-8b on one H100 and
#: llama-3.1-70b on tp8 show no jump below 128 tokens; the predictor check would show one)
JUMP_FROM = 64


def _interp(f: Callable[[int], float], x: float, tokens: bool = True, islands: frozenset = frozenset()) -> float:
    """``f`` at ``x`` from the grid cell ``(lo, hi]`` around it. Along a token count
    (``tokens``: the GEMMs' M) the engine's step latency jumps just past grid points (kernel
    tiles and the measured tables' shapes are powers of two and 1.5 times them: a 1,025-token
    prefill costs 26% more than a 1,024-token one on llama-3.1-8b), so the line runs from
    ``lo + 1`` to ``hi``; along a context length it is smooth and runs from ``lo``.
    ``islands``: batch sizes a framework captures as CUDA graphs while running the batches
    between them eagerly (:attr:`PlanCost.islands`): such an end whose neighbour inside the
    cell is not captured is cheaper than the cell, so the line runs from the neighbour
    instead (TensorRT-LLM captures 32, 64 and 128: a batch of 63 was priced 15/16 of the way
    to the captured 64, 33.2 ms on Qwen3-235B [ep=8 tp=8], where 65 cost 38.2)."""
    lo, hi = grid_below(x), grid_above(x)
    if lo == hi:
        return f(lo)
    left = lo + 1 if tokens and lo >= JUMP_FROM else lo
    right = hi
    if islands:
        if left in islands and left + 1 not in islands:
            left += 1
        if hi in islands and hi - 1 not in islands:
            right = hi - 1
    if left >= right:
        return f(right)
    w = max(x - left, 0.0) / (right - left)
    return (1 - w) * f(left) + w * f(right)


def _batch_points(b: int) -> tuple[tuple[int, ...], float]:
    """The batch grid of :meth:`PlanCost._attention` (powers of 4) around ``b``: ``((b,),
    0.0)`` on a point, else the two around it and ``b``'s weight on the upper one."""
    lo = 1 << (2 * ((b.bit_length() - 1) // 2))
    if lo == b:
        return (b,), 0.0
    return (lo, 4 * lo), (b - lo) / (3 * lo)


def _on_cell(cell: tuple, x: float) -> float:
    """Linear between a grid cell's ends (:meth:`PlanCost._cell`) at ``x`` in ``[lo, hi)``."""
    lo, hi, f_lo, f_hi = cell
    if lo >= x:     # on a grid point
        return f_lo
    w = max(x - lo, 0.0) / (hi - lo)
    return (1 - w) * f_lo + w * f_hi


Groups = tuple  # (GroupShape, ...): one step's groups, the key of the step caches


class PredictedSteps(collections.abc.Sequence):
    """The steps a :class:`PlanCost`'s predictor answered, as it keeps them (a
    :class:`StepWork`, a :class:`JoinedStep`, or ``(base contexts, j, *chunks)`` from its
    steppers), each built into its :class:`StepWork` when read."""

    def __init__(self, kept: list):
        self._kept = kept

    def __len__(self) -> int:
        return len(self._kept)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        work = self._kept[i]
        if isinstance(work, StepWork):
            return work
        if isinstance(work, JoinedStep):
            return work.work()
        return StepWork(work[2:], tuple(c + work[1] for c in work[0]))


class JoinedStep:
    """A step on a kept decode state (the serving loop's ``_lazy_step``), by its counts:
    ``chunks`` beside the decodes at ``base`` (sorted) plus ``j`` each, ``base_total`` the sum
    of those, and the decodes that join at ``joined``; what the predictor reads of it
    (``decodes``, ``new_tokens``, ``decode_context_tokens``, as :class:`StepWork` has them)
    worked out once. :meth:`work` builds the StepWork (``base`` may be the state's own list:
    :meth:`kept` snapshots it)."""

    __slots__ = ("chunks", "base", "j", "base_total", "joined", "decodes", "new_tokens", "decode_context_tokens")

    def __init__(self, chunks: tuple, base: Sequence[int], j: int, base_total: int, joined: tuple = ()):
        self.chunks, self.base, self.j, self.base_total, self.joined = chunks, base, j, base_total, joined
        self.decodes = len(base) + len(joined)
        self.new_tokens = sum(n for n, _ in chunks) + self.decodes
        self.decode_context_tokens = base_total + sum(joined)

    def kept(self) -> "JoinedStep":
        """This step with its own copy of ``base`` (the state's list moves on)."""
        return JoinedStep(self.chunks, tuple(self.base), self.j, self.base_total, self.joined)

    def work(self) -> StepWork:
        contexts = [c + self.j for c in self.base]
        if self.joined:
            contexts += self.joined
            contexts.sort()
        return StepWork(self.chunks, tuple(contexts))


@attrs.define
class PlanCost:
    """Step latencies from the event engine: ``step_s(groups) -> seconds`` simulates a step
    (:func:`plan_step_runner`: the prepared plan's ``simulate``, cached per step shape).

    ``exact``: every step the scheduler builds runs through the engine as it is (every
    decode at its own context). Otherwise a predictor composes the step from single-group
    steps at grid points (``{1, 2, 3, 4, 6, 8, 12, ...}``, linear interpolation between them),
    the way Vidur sums per-operation predictions:

        latency = G(N) + sum over chunks [F(T, P) - G(T)] + [D(b, c) - G(b)]

    where ``N`` is the step's new tokens, ``G(n)`` a step of ``n`` one-token sequences at
    context 1 (the token-proportional work: GEMMs, norms, communication), ``F(T, P)`` a
    step of one chunk of ``T`` tokens after ``P`` cached, and ``D(b, c)`` a decode of ``b``
    sequences at their mean context ``c`` (``D - G`` is interpolated on a coarser grid of
    ``b``: it is smooth). A prefill step of one chunk is ``F(T, P)`` (up to the grid).
    :meth:`predictor_error` checks a sample against the engine.

    ``rules``: what the layout's dimensions require of a step (:class:`g5core.StepRules`,
    from the plugins' ``g5_step_rules``): the engine runs each group padded up to multiples
    of ``rules.token_multiple`` (new and cached tokens of a chunk, the context of a decode),
    and a step mixing prefill and decode groups on a layout that cannot mix them as the
    rules' split of it, its steps one after the other.
    """

    step_s: Callable[[Groups], float]
    exact: bool = False
    rules: StepRules = StepRules()
    kv_bytes_per_token_per_chip: float = 0.0
    kv_pool_bytes_per_chip: float = 0.0
    kv_capacity_tokens: int = 0
    chips: int = 1
    #: the decode batch sizes captured as CUDA graphs where the batches between them run
    #: eagerly (a framework without padding: :func:`graph_islands`); empty otherwise
    islands: frozenset = frozenset()
    _groups: dict = attrs.field(factory=dict)
    _steps: dict = attrs.field(factory=dict)
    _cells: dict = attrs.field(factory=dict)
    _points: dict = attrs.field(factory=dict)     # (kind, a, b) -> g / f / d at a grid point (engine_s's, kept)
    _chunk_parts: dict = attrs.field(factory=dict)    # (n, c) -> F(n, c) - G(n) between grid points (_chunk_part_s)
    _tokens: dict = attrs.field(factory=dict)         # n -> G(n) between grid points (_tokens_s)

    @property
    def runs(self) -> int:
        """Distinct steps simulated by the engine."""
        return len(self._groups)

    def kv_tokens(self) -> int:
        return self.kv_capacity_tokens

    def engine_s(self, groups: Groups) -> float:
        """The engine's latency of a step, padded to the rules' token multiple and split where
        the layout cannot run prefill and decode groups in one step (see the class doc)."""
        multiple = self.rules.token_multiple
        if multiple > 1:
            groups = _canonical(tuple(_pad(g, multiple) for g in groups))
        hit = self._groups.get(groups)
        if hit is None:
            if self.rules.mixed:
                hit = self.step_s(groups)
            else:
                parts = split_step(self.rules, to_step(groups))
                hit = self.step_s(groups) if len(parts) == 1 else sum(self.engine_s(shapes(p)) for p in parts)
            self._groups[groups] = hit
        return hit

    def g(self, n: int) -> float:
        hit = self._points.get(("g", n))
        if hit is None:
            hit = self._points[("g", n)] = self.engine_s((GroupShape(1, 1, n),))
        return hit

    def f(self, new: int, cached: int) -> float:
        hit = self._points.get(("f", new, cached))
        if hit is None:
            hit = self._points[("f", new, cached)] = self.engine_s((GroupShape(max(new, 1), cached, 1),))
        return hit

    def d(self, b: int, c: int) -> float:
        hit = self._points.get(("d", b, c))
        if hit is None:
            hit = self._points[("d", b, c)] = self.engine_s((GroupShape(1, c, b),))
        return hit

    def predict_s(self, work: StepWork) -> float:
        return self._predict_s(work.chunks, work.decodes, work.decode_context_tokens, work.new_tokens)

    def _predict_s(self, chunks: tuple, decodes: int, context_tokens: int, new_tokens: int) -> float:
        """:meth:`predict_s` of the step of ``chunks`` and ``decodes`` decodes whose contexts
        sum to ``context_tokens`` (``new_tokens``: the chunks' tokens and one a decode)."""
        if not chunks:
            return self._decode_predict_s(decodes, context_tokens) if decodes else 0.0
        if len(chunks) == 1 and not decodes:
            (new, cached), = chunks
            return _interp(lambda t: self._f_cached(t, cached), new)
        total = self._tokens_s(new_tokens)
        for n, c in chunks:
            total += self._chunk_part_s(n, c)
        if decodes:
            total += self._attention(decodes, context_tokens / decodes)
        return total

    def _chunk_part_s(self, n: int, c: int) -> float:
        """``F(n, c) - G(n)`` between the grid's points: what a chunk of ``n`` tokens after
        ``c`` cached adds to a step beside its tokens' share of ``G`` (kept per chunk)."""
        hit = self._chunk_parts.get((n, c))
        if hit is None:
            hit = self._chunk_parts[(n, c)] = _interp(lambda t: self._f_cached(t, c), n) - self._tokens_s(n)
        return hit

    def _tokens_s(self, n: float) -> float:
        """``G(n)`` between the grid's points (the token-proportional work of ``n`` new
        tokens), the framework's captured islands kept (:func:`_interp`)."""
        hit = self._tokens.get(n)
        if hit is None:
            hit = self._tokens[n] = _interp(self.g, n, islands=self.islands)
        return hit

    def _f_cached(self, t: int, cached: float) -> float:
        if cached == 0:
            return self.f(t, 0)
        return _interp(lambda p: self.f(t, p), cached, tokens=False)

    def _attention(self, b: int, c: float) -> float:
        """``D(b, c) - G(b)``: what decoding at context ``c`` adds to ``b`` tokens' work
        (the attention over the KV cache), bilinear over ``b`` in powers of 4 and the grid of
        ``c``: it is close to proportional to ``b * c`` (within 0.01% for llama-3.1-70b tp8
        at b = 26..250, 0.6% at b = 9). The grid cells' end points are kept (``_cells``):
        the same arithmetic as :func:`_interp`, without its calls."""
        x = max(c, 1.0)
        points, w = _batch_points(b)
        if len(points) == 1:
            return self._attention_at(b, x)
        return (1 - w) * self._attention_at(points[0], x) + w * self._attention_at(points[1], x)

    def _cell(self, bb: int, lo: int) -> tuple:
        """``(lo, hi, f_lo, f_hi)``: the grid cell of the context from grid point ``lo`` and
        ``D - G`` of ``bb`` sequences at its ends (kept in ``_cells``)."""
        cell = self._cells.get((bb, lo))
        if cell is None:
            hi = grid_above(lo + 0.5)
            gb = self.g(bb)
            cell = self._cells[(bb, lo)] = (lo, hi, self.d(bb, lo) - gb, self.d(bb, hi) - gb)
        return cell

    def _attention_at(self, bb: int, x: float) -> float:
        """``D(bb, x) - G(bb)`` along the grid of the context ``x >= 1`` (see :meth:`_attention`)."""
        return _on_cell(self._cell(bb, grid_below(x)), x)

    def latency_s(self, work: StepWork, exact: Optional[bool] = None) -> float:
        exact = self.exact if exact is None else exact
        if exact:
            return self.engine_s(_canonical(work.groups()))
        key = (work.chunks, work.decodes, work.decode_context_tokens)
        hit = self._steps.get(key)
        if hit is None:
            hit = self._steps[key] = (self.predict_s(work), work)
        return hit[0]

    def joined_step_s(self, step: JoinedStep) -> float:
        """:meth:`latency_s` of a step on a kept decode state (:class:`JoinedStep`: the
        serving loop's step of a state's decodes with what its scheduler admits): the same key
        and value without building the step unless the engine answers."""
        if self.exact:
            return self.latency_s(step.work())
        key = (step.chunks, step.decodes, step.decode_context_tokens)
        hit = self._steps.get(key)
        if hit is None:
            hit = self._steps[key] = (self._predict_s(step.chunks, step.decodes, step.decode_context_tokens,
                                                      step.new_tokens), step.kept())
        return hit[0]

    def decode_step_s(self, base: Sequence[int], j: int, total: int) -> float:
        """:meth:`latency_s` of the decode-only step of ``len(base)`` sequences at ``base``
        (sorted) plus ``j`` each, ``total`` the sum of those: the same key and value (the
        predictor's decode-only case, :meth:`_decode_predict_s`) without building the step
        unless the engine answers (``exact``)."""
        if self.exact:
            return self.latency_s(StepWork((), tuple(c + j for c in base)))
        b = len(base)
        key = ((), b, total)
        hit = self._steps.get(key)
        if hit is None:
            hit = self._steps[key] = (self._decode_predict_s(b, total), (tuple(base), j))
        return hit[0]

    def _decode_predict_s(self, b: int, total: int) -> float:
        """:meth:`predict_s` of a decode-only step of ``b`` sequences whose contexts sum to
        ``total``: its tokens' part and its attention at the mean context."""
        return self._tokens_s(b) + self._attention(b, total / b)

    def decode_stepper(self, contexts: tuple) -> Callable[[int, int], float]:
        """``(j, total) ->`` :meth:`latency_s` of the decode-only step of ``len(contexts)``
        sequences at ``contexts`` plus ``j`` each (``contexts`` sorted; ``total``: the sum of
        those), the same value from the same arithmetic without building the step (the
        serving loop's runs of decode steps), with what does not change along a run (the
        batch, its token-proportional part) worked out once."""
        if self.exact:
            return lambda j, total: self.latency_s(StepWork((), tuple(c + j for c in contexts)))
        b = len(contexts)
        steps = self._steps
        tokens_s = None     # G at b, on the first step not cached (the engine runs as it did before)
        points, w_b = _batch_points(b)     # as _attention
        # per batch point, the grid cell of the context the run is in (a run's mean context
        # grows by one a step; the cells are wide): not found again each step
        cells: list = [None] * len(points)

        def at(slot: int, x: float) -> float:
            cell = cells[slot]
            if cell is None or not cell[0] <= x < cell[1]:
                cell = cells[slot] = self._cell(points[slot], grid_below(x))
            return _on_cell(cell, x)

        def step_s(j: int, total: int) -> float:
            nonlocal tokens_s
            key = ((), b, total)
            hit = steps.get(key)
            if hit is None:
                if tokens_s is None:
                    tokens_s = self._tokens_s(b)
                x = max(total / b, 1.0)
                attention = at(0, x) if len(points) == 1 else (1 - w_b) * at(0, x) + w_b * at(1, x)
                hit = steps[key] = (tokens_s + attention, (contexts, j))
            return hit[0]
        return step_s

    def chunk_stepper(self, per: int, contexts: tuple) -> Callable[[int, int], float]:
        """``(cached, j) ->`` :meth:`latency_s` of the step of one prompt chunk of ``per``
        tokens after ``cached`` beside the decodes of ``len(contexts)`` sequences at
        ``contexts`` plus ``j`` each (``contexts`` sorted): the serving loop's runs of a
        prompt's budget-filling chunks. The same value from the same arithmetic as
        :meth:`predict_s` without building the step, with what does not change along a run
        (the token counts' grid points, the chunk's grid cells of the cached tokens) worked
        out once."""
        if self.exact:
            return lambda cached, j: self.latency_s(StepWork(((per, cached),), tuple(c + j for c in contexts)))
        b = len(contexts)
        total0 = sum(contexts)
        steps = self._steps
        # _interp over the chunk's tokens (tokens=True) at ``per``: its points and weight
        lo, hi = grid_below(per), grid_above(per)
        if lo == hi:
            points, w_t = (lo,), 0.0
        else:
            left = lo + 1 if lo >= JUMP_FROM else lo
            points, w_t = ((hi,), 0.0) if left >= hi else ((left, hi), max(per - left, 0.0) / (hi - left))
        cells: list = [None] * len(points)    # per point: the grid cell of the cached tokens it is in
        fixed: list = []                      # G(per + b) and G(per), on the first step not cached

        def f_cached(slot: int, cached: int) -> float:
            """:meth:`_f_cached` at ``points[slot]``, the cell of ``cached`` kept."""
            t = points[slot]
            if cached == 0:
                return self.f(t, 0)
            cell = cells[slot]
            if cell is None or not cell[0] <= cached < cell[1]:
                c_lo = grid_below(cached)
                c_hi = grid_above(c_lo + 0.5)
                cell = cells[slot] = (c_lo, c_hi, self.f(t, c_lo), self.f(t, c_hi))
            return _on_cell(cell, cached)

        def step_s(cached: int, j: int) -> float:
            ctx_total = total0 + j * b
            key = (((per, cached),), b, ctx_total)
            hit = steps.get(key)
            if hit is None:
                chunk = f_cached(0, cached) if len(points) == 1 else (
                    (1 - w_t) * f_cached(0, cached) + w_t * f_cached(1, cached))
                if not b:
                    value = chunk
                else:
                    if not fixed:
                        fixed.extend((self._tokens_s(per + b), self._tokens_s(per)))
                    value = fixed[0]
                    value += chunk - fixed[1]
                    value += self._attention(b, ctx_total / b)
                hit = steps[key] = (value, (contexts, j, (per, cached)))
            return hit[0]
        return step_s

    def predicted_steps(self) -> "PredictedSteps":
        """The distinct steps the predictor answered, in the order first asked (each built
        when read: the predictor check reads a sample of them)."""
        return PredictedSteps([work for _, work in self._steps.values()])

    def predictor_error(self, sample: list[StepWork]) -> dict:
        """Relative error of the predicted latency against the engine on ``sample``, and the
        step it is worst on (``worst``: its chunks, decodes, both latencies; the first of
        equal errors)."""
        checked = [(w, self.latency_s(w, False), self.latency_s(w, True)) for w in sample]
        if not checked:
            return {"steps_checked": 0}
        errors = sorted(abs(p / e - 1.0) for _, p, e in checked)
        mid = len(errors) // 2
        median = errors[mid] if len(errors) % 2 else 0.5 * (errors[mid - 1] + errors[mid])
        w, p, e = max(checked, key=lambda one: abs(one[1] / one[2] - 1.0))
        worst = {"chunks": [list(c) for c in w.chunks], "decodes": w.decodes,
                 "decode_context_tokens": w.decode_context_tokens, "predicted_s": p, "engine_s": e}
        return {"steps_checked": len(errors), "median_rel": median, "max_rel": errors[-1], "worst": worst}


@attrs.define
class DpCost:
    """The step cost of an instance of ``dp`` attention-DP ranks with the experts over EP
    across them (SGLang's ``--enable-dp-attention``, TensorRT-LLM's attention DP): each rank
    has its own batch, and the MoE all-to-all of every layer synchronises the ranks, so a
    step of the instance lasts as long as its slowest rank's, and an idle rank still runs the
    MoE layers (:data:`IDLE_WORK`).

    ``rank``: a :class:`PlanCost` whose step is the layout's step with that batch on every
    rank (the engine's ``count`` is per data-parallel replica). The engine lowers one shape
    for every rank, so a step of equal ranks is that step (``g5 run``'s). A step of unequal
    ranks is composed from engine runs (``experts_s``: the busiest chip's routed-expert
    compute in the engine's step of ``n`` new tokens a rank, from the op breakdown of its
    :class:`~g5core.sim.results.SimResult`, :func:`plan_experts_runner`)::

        step = max over ranks r [L(w_r) - E(n_r)] + E(mean n)

    ``L(w_r)``: the layout's step with every rank at rank ``r``'s batch, which holds ``r``'s
    own attention and dense layers and its share of the dispatch/combine (what ``r`` sends
    and receives back: the all-to-all waits for the busiest sender); ``E(n_r)``: its
    experts' part, replaced by ``E`` at the mean of the tokens every rank routes (an idle
    rank's dummy token counted): each expert's grouped GEMM sees the tokens ALL ranks
    route to it. One layer of the real step is ``max_r(attention_r + exchange_r) +
    experts(all tokens)``; layers alike, the sum over layers is the formula. Without
    ``experts_s`` (a stand-in step runner that has no op breakdown) the step is the
    slowest of the ranks' ``L(w_r)``: exact for equal ranks, an overestimate of the experts
    when the other ranks bring fewer tokens than the slowest."""

    rank: PlanCost
    dp: int
    idle: StepWork = IDLE_WORK
    experts_s: Optional[Callable[[Groups], float]] = None
    _experts: dict = attrs.field(factory=dict)
    _expert_memo: dict = attrs.field(factory=dict)    # (tokens, exact) -> expert_s's answer

    @property
    def chips(self) -> int:
        return self.rank.chips

    @property
    def kv_bytes_per_token_per_chip(self) -> float:
        return self.rank.kv_bytes_per_token_per_chip

    @property
    def kv_pool_bytes_per_chip(self) -> float:
        return self.rank.kv_pool_bytes_per_chip

    @property
    def runs(self) -> int:
        """Distinct steps simulated by the engine (the ranks' and the experts' runs)."""
        return self.rank.runs + len(self._experts)

    def kv_tokens(self) -> int:
        """Tokens one rank's pool holds."""
        return self.rank.kv_tokens()

    def latency_s(self, work, exact: Optional[bool] = None) -> float:
        """The instance's step (``work``: a :class:`RankedWork`, or a :class:`StepWork` of
        one rank, the others idle); see the class doc."""
        ranks = work.ranks if isinstance(work, RankedWork) else (work,) + (StepWork((), ()),) * (self.dp - 1)
        ranks = [w if w.new_tokens else self.idle for w in ranks]
        # the distinct works in the ranks' order (a set's order of StepWorks follows the
        # process's string hash seed: attrs salts their hash with the class; the order the
        # rank's step cache learns them in is the predictor check's sample, g5 serve's output)
        seen = list(dict.fromkeys(ranks))
        if len(seen) == 1 or self.experts_s is None:
            return max(self.rank.latency_s(w, exact) for w in seen)
        exact = self.rank.exact if exact is None else exact
        own = max(self.rank.latency_s(w, exact) - self.expert_s(w.new_tokens, exact) for w in seen)
        return own + self.expert_s(sum(w.new_tokens for w in ranks) / len(ranks), exact)

    def latency_of(self, ranks: Sequence[tuple[float, int]]) -> float:
        """:meth:`latency_s` of a step from its ranks' own figures, ``(latency_s, new_tokens)``
        each (the rank's :meth:`PlanCost.latency_s` of its work; an idle rank's of
        ``self.idle``), where at least two ranks' works differ: the same arithmetic, without
        the ranks' works (the serving loop's admission steps on a kept state price the ranks
        that only decode by their steppers)."""
        if self.experts_s is None:
            return max(latency for latency, _ in ranks)
        exact = self.rank.exact
        own = max(latency - self.expert_s(n, exact) for latency, n in ranks)
        return own + self.expert_s(sum(n for _, n in ranks) / len(ranks), exact)

    def decode_stepper(self, rank_contexts: tuple) -> Callable[[int], float]:
        """``j ->`` :meth:`latency_s` of the decode-only step whose rank ``r`` decodes its
        sequences at ``rank_contexts[r]`` plus ``j`` each (sorted; empty: an idle rank), the
        same value from the same arithmetic without building the step (the serving loop's
        runs of decode steps of an attention-DP instance): the ranks' own steppers
        (:meth:`PlanCost.decode_stepper`), and what does not change along a run (which ranks
        are alike, the idle rank's step, the experts' parts) worked out once."""
        exact = self.rank.exact
        live = [ctx for ctx in rank_contexts if ctx]
        steppers = [(self.rank.decode_stepper(ctx), sum(ctx), len(ctx)) for ctx in dict.fromkeys(live)]
        if len(steppers) == 1 and len(live) == len(rank_contexts):     # every rank alike: that step
            one, total, b = steppers[0]
            return lambda j: one(j, total + j * b)
        idle_s = self.rank.latency_s(self.idle) if len(live) < len(rank_contexts) else None
        if self.experts_s is None:
            def slowest(j: int) -> float:
                own = [f(j, total + j * b) for f, total, b in steppers]
                if idle_s is not None:
                    own.append(idle_s)
                return max(own)
            return slowest
        parts = [(f, total, b, self.expert_s(b, exact)) for f, total, b in steppers]
        idle_own = None if idle_s is None else idle_s - self.expert_s(self.idle.new_tokens, exact)
        tokens = [len(ctx) if ctx else self.idle.new_tokens for ctx in rank_contexts]
        mean_s = self.expert_s(sum(tokens) / len(tokens), exact)

        def step_s(j: int) -> float:
            own = [f(j, total + j * b) - e for f, total, b, e in parts]
            if idle_own is not None:
                own.append(idle_own)
            return max(own) + mean_s
        return step_s

    def expert_s(self, tokens: float, exact: bool = False) -> float:
        """``E(n)``: the routed experts' compute on the busiest chip in the layout's step of
        ``tokens`` new tokens a rank (one-token sequences at context 1: the experts see only
        the token count). ``exact``: the engine at ``tokens`` (linear between the whole
        counts around a mean); otherwise on the predictor's grid (:func:`_interp`). Each
        answer is kept (the same arithmetic on the same engine figures)."""
        key = (tokens, exact)
        hit = self._expert_memo.get(key)
        if hit is not None:
            return hit
        if not exact:
            hit = _interp(self._expert_at, tokens)
        else:
            lo = int(tokens)
            if lo == tokens:
                hit = self._expert_at(lo)
            else:
                w = tokens - lo
                hit = (1 - w) * self._expert_at(lo) + w * self._expert_at(lo + 1)
        self._expert_memo[key] = hit
        return hit

    def _expert_at(self, n: int) -> float:
        hit = self._experts.get(n)
        if hit is None:
            groups = (GroupShape(1, 1, n),)
            multiple = self.rank.rules.token_multiple
            if multiple > 1:
                groups = _canonical(tuple(_pad(g, multiple) for g in groups))
            hit = self._experts[n] = self.experts_s(groups)
        return hit

    def predicted_steps(self) -> list[StepWork]:
        return self.rank.predicted_steps()

    def predictor_error(self, sample: list[StepWork]) -> dict:
        return self.rank.predictor_error(sample)


@attrs.define
class SpeculativeCost:
    """A pool's step cost with speculative decoding: ``base`` (a :class:`PlanCost`) prices the
    step as plain decode, and ``extra_s(b, c)`` adds what speculation costs a decode of ``b``
    sequences at context ``c``: the verification step's excess over the plain decode step
    (``k`` more query tokens per sequence through every layer) plus ``k`` proposer passes,
    interpolated on the predictor's grid of ``b`` and ``c`` (each point from the engine)."""

    base: PlanCost
    extra_s: Callable[[int, int], float]
    _points: dict = attrs.field(factory=dict)

    def __getattr__(self, name):     # chips, the KV sizing, runs, predicted_steps: the base's
        if name.startswith("_") or name in ("base", "extra_s"):
            raise AttributeError(name)
        return getattr(self.base, name)

    def kv_tokens(self) -> int:
        return self.base.kv_tokens()

    def _at(self, b: int, c: int) -> float:
        hit = self._points.get((b, c))
        if hit is None:
            hit = self._points[(b, c)] = self.extra_s(b, c)
        return hit

    def latency_s(self, work: StepWork, exact: Optional[bool] = None) -> float:
        plain = StepWork(work.chunks, work.decode_contexts) if work.draft_tokens else work
        total = self.base.latency_s(plain, exact)
        if work.draft_tokens and work.decodes:
            c = max(work.decode_context_tokens / work.decodes, 1.0)
            total += _interp(lambda b: _interp(lambda cc: self._at(b, cc), c, tokens=False), work.decodes)
        return total

    def predictor_error(self, sample: list[StepWork]) -> dict:
        """The base predictor's error (the speculative excess is the same in both)."""
        return self.base.predictor_error([StepWork(w.chunks, w.decode_contexts) for w in sample])


def _pad(group: GroupShape, m: int) -> GroupShape:
    up = lambda x: -(-x // m) * m  # noqa: E731
    if group.new_tokens == 1:  # a decode: its context (cached + the new token) is split
        return GroupShape(1, up(group.cached_tokens + 1) - 1, group.count)
    return GroupShape(up(group.new_tokens), up(group.cached_tokens), group.count)


def _canonical(groups: Groups) -> Groups:
    """Equal ``(new_tokens, cached_tokens)`` shapes merged, sorted: one key per step shape."""
    merged: dict = {}
    for g in groups:
        shape = (g.new_tokens, g.cached_tokens)
        merged[shape] = merged.get(shape, 0) + g.count
    return tuple(GroupShape(n, c, k) for (n, c), k in sorted(merged.items()))


def to_step(groups: Groups) -> Step:
    """Groups (:class:`g5core.GroupShape`) as the :class:`g5core.Step` they stand for."""
    return Step([StepGroup(new_tokens=g.new_tokens, cached_tokens=g.cached_tokens, count=g.count) for g in groups])


def shapes(step: Step) -> Groups:
    """A step's groups as :class:`g5core.GroupShape` (the keys of the caches)."""
    return tuple(GroupShape(g.new_tokens, g.cached_tokens, g.count) for g in step)


def speculative_extra(prepared, proposer, rules: StepRules) -> Callable[[int, int], float]:
    """``(b, c) -> seconds`` for :class:`SpeculativeCost`: the verification step of ``b``
    sequences at ``c`` cached tokens minus their plain decode step, plus the proposer's ``k``
    passes (``proposer``: its :class:`g5core.PreparedPlan`, or None for ngram), each padded
    to the rules' token multiple like the engine's steps."""
    k = prepared.deployment.speculative.tokens

    def extra(b: int, c: int) -> float:
        cached = _pad(GroupShape(1, c, b), rules.token_multiple).cached_tokens
        verify = prepared.simulate(Step.verify(b, cached + 1, k)).latency_s
        plain = prepared.simulate(Step.decode(b, cached + 1)).latency_s
        passes = k * proposer.simulate(Step.decode(b, cached + 1)).latency_s if proposer is not None else 0.0
        return verify - plain + passes

    return extra


def plan_step_runner(plan, periodic: bool = True) -> Callable[[Groups], float]:
    """``groups -> latency_s`` on a :class:`g5core.PreparedPlan` (the event engine);
    ``periodic``: the engine's part from three short models where the layers repeat
    (:meth:`g5core.PreparedPlan.periodic_latency_s`: the full run's to a relative 1e-9)."""
    if periodic:
        return lambda groups: plan.periodic_latency_s(to_step(groups))
    return lambda groups: plan.simulate(to_step(groups)).latency_s


#: the owner of the routed experts' compute ops (``plugins/ep``'s ``g5_expand_op``, part "experts")
EXPERTS_OWNER = "ep"


def plan_experts_runner(plan, periodic: bool = True) -> Optional[Callable[[Groups], float]]:
    """``groups -> seconds`` of the routed experts on the busiest chip in the engine's step
    (:meth:`g5core.PreparedPlan.busiest_compute_s`, ``periodic`` as for
    :func:`plan_step_runner`), for :class:`DpCost`; None where the plan's path has no op
    breakdown (``path: math``)."""
    if plan.plan.ctx.deployment.path == "math":
        return None
    return lambda groups: plan.busiest_compute_s(to_step(groups), EXPERTS_OWNER, periodic)


@attrs.frozen
class KvSizing:
    """The KV pool of one instance, from the memory ledger of its largest step."""

    pool_bytes_per_chip: float      # the smallest over the instance's chips
    kv_bytes_per_token_per_chip: float  # on the chip that holds most per token
    capacity_tokens: int            # tokens the tightest chip holds
    chips: int
    kv_bytes_per_token: float       # summed over the instance's chips (what a transfer moves)
    per_chip_kv_bytes_per_token: tuple[float, ...] = ()


def kv_sizing(plan, largest_step_tokens: int, field: str = "serving") -> KvSizing:
    """Pool per chip = HBM - weights - activations of the largest step (a prefill chunk of
    ``largest_step_tokens``) - workspace, per the prepared plan's ledger, so cp and sp
    shrink a token's footprint exactly as the ledger says."""
    n = int(largest_step_tokens)
    step = Step.prefill(1, n)
    mem = plan.memory(step)
    per_token = plan.kv_bytes_per_token_by_chip()
    pools = {c.chip: c.capacity_bytes - c.weights_bytes - c.activation_bytes - c.workspace_bytes for c in mem.per_chip}
    worst = min(pools, key=lambda c: (pools[c], c))
    if pools[worst] <= 0:
        raise ConfigError(field, f"weights, activations and workspace of a {n:,}-token step fill chip {worst}'s HBM "
                                 f"({-pools[worst] / 2 ** 30:.2f} GiB over); no room is left for a KV cache: use more "
                                 "chips per instance or lower max_num_batched_tokens")
    capacity = plan.kv_capacity_tokens(step)
    chips = sorted(per_token)
    return KvSizing(pools[worst], max(per_token.values()), int(min(capacity, 2 ** 62)), len(chips),
                    sum(per_token.values()), tuple(per_token[c] for c in chips))
