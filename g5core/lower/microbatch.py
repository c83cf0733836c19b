"""Micro-batches: one step split into parts that follow one another through the layers' chips.

A plugin splits the step by answering ``g5_pipeline_microbatches`` with a :class:`PipelineMicrobatches`
(the PP plugin does, from ``plugins.pp.microbatches``):

- ``batches`` (decode): independent batches of sequences, each of which *cycles*: after its
  LM head its sampled tokens return to the embedding's chips (``token_return``, claimed by
  the plugin that moves them) and its next step starts there. Every micro-batch keeps its
  sequences' KV on the chips (``BuildContext.resident_batches``). :data:`CYCLES` cycles are
  simulated (more when the last two differ), so the engine reaches its steady state; the
  interval between two cycles of the same micro-batch is the time per output token.
- ``chunks`` (prefill): a prompt's tokens in consecutive chunks; chunk ``j`` attends over
  the KV of the chunks before it (a prefix, :func:`g5core.lower.flops.prefix_attention`)
  and only the last one runs the LM head. The step ends when the last chunk does.

The program is one copy of the model program per part (and cycle), issued in that order:
copy ``k = cycle * m + j`` is micro-batch ``j`` of cycle ``cycle``, its logical ops tagged
``LogicalOp.micro = k`` (``L003.m5.attention``: with ``m = 4``, cycle 1 of micro-batch 1). Nothing here is a formula for the bubbles: three dependencies, and the engine's
per-chip streams and links, make them:

1. one forward at a time on a group of chips: on the chips that hold a layer (a pipeline
   stage), a part's first op waits for the previous part's last op there (a stage worker
   runs the micro-batches it is handed in order; sends and receives are not held back);
2. a decode micro-batch's next cycle waits for its tokens (``token_return``);
3. a prompt chunk's attention at a layer waits for the previous chunk's K/V projection at
   that layer.
"""
from __future__ import annotations

from typing import Optional

import attrs
import numpy as np

from g5core.api.errors import ConfigError, PluginError
from g5core.lower.layers import EMBED_LAYER, SYNC_KINDS, LogicalOp, build_program
from g5core.inputs.step import Step

#: Decode cycles simulated first; doubled (up to MAX_CYCLES) while the last two cycle
#: intervals differ by more than STEADY_REL.
CYCLES = 4
MAX_CYCLES = 16
STEADY_REL = 1e-6


@attrs.frozen
class PipelineMicrobatches:
    """How a plugin splits the work: ``batches`` (decode: sequences of each micro-batch, all
    ``deployment.batch``: independent batches, one step each per cycle) or ``chunks``
    (prefill: tokens of each chunk of every prompt, adding up to ``seq_len``), exactly one;
    ``field``: the plugin option that set it, ``plugins.<plugin>.<option>`` (error messages
    name it; each part is a deployment of its own with that option at 1)."""

    field: str
    batches: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    chunks: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    @property
    def parts(self) -> tuple[int, ...]:
        return self.batches or self.chunks

    @property
    def count(self) -> int:
        return len(self.parts)

    @property
    def cycles_apply(self) -> bool:
        return bool(self.batches)

    def check(self, deployment, plugin: str) -> None:
        """The parts are the step's batch, or add up to its prompt (a plugin's mistake, not the user's)."""
        if len(self.field.split(".")) != 3 or not self.field.startswith("plugins."):
            raise PluginError(plugin, f"g5_pipeline_microbatches: field must be plugins.<plugin>.<option>, got {self.field!r}")
        if bool(self.batches) == bool(self.chunks):
            raise PluginError(plugin, f"g5_pipeline_microbatches: give batches or chunks, exactly one, got {self!r}")
        if any(isinstance(p, bool) or not isinstance(p, int) or p <= 0 for p in self.parts):
            raise PluginError(plugin, f"g5_pipeline_microbatches: every part must be a positive int, got {self.parts!r}")
        if self.batches and set(self.batches) != {deployment.batch}:
            raise PluginError(plugin, f"g5_pipeline_microbatches: decode micro-batches {self.batches} must each be "
                                      f"batch={deployment.batch} sequences")
        if self.chunks and sum(self.chunks) != deployment.seq_len:
            raise PluginError(plugin, f"g5_pipeline_microbatches: the chunks {self.chunks} do not add up to "
                                      f"seq_len={deployment.seq_len}")


def collect_pipeline_microbatches(hooks, deployment, model) -> Optional[PipelineMicrobatches]:
    """The one plugin's split of the step, or None (one part: the step as it is)."""
    answers = [(p, a) for p, a in hooks.call_each("g5_pipeline_microbatches", deployment=deployment, model=model)
               if a is not None]
    if len(answers) > 1:
        names = " and ".join(f"'{p}'" for p, _ in answers)
        raise ConfigError("plugins", f"plugins {names} both split the step into micro-batches; keep one at 1")
    if not answers:
        return None
    plugin, mb = answers[0]
    if not isinstance(mb, PipelineMicrobatches):
        raise PluginError(plugin, f"g5_pipeline_microbatches must return PipelineMicrobatches or None, got {type(mb).__name__}")
    mb.check(deployment, plugin)
    return mb if mb.count > 1 else None


def copy_index(cycle: int, part: int, parts: int) -> int:
    """The program copy (``LogicalOp.micro``) of micro-batch ``part`` in ``cycle``."""
    return cycle * parts + part


def copy_contexts(plan, cycles: int) -> dict:
    """The build context of every program copy of ``cycles`` cycles."""
    n = len(plan.part_contexts)
    return {copy_index(c, j, n): part for c in range(cycles) for j, part in enumerate(plan.part_contexts)}


def part_contexts(ctx, mb: PipelineMicrobatches, shape_of) -> list:
    """One build context per part, validated by every plugin as a deployment of its own (the
    option that split the step at 1), with its local shape: a decode micro-batch is the
    step itself; prompt chunk ``j`` is the step of ``batch`` sequences running the chunk's
    tokens after the earlier chunks' (``Step.prefill(batch, T_j, cached_tokens=P_j)``).
    ``shape_of(deployment)``: the plugins' checks of a deployment, then its local shape
    (:func:`g5core.lower.builder.validated_shape`)."""
    out, prefix = [], 0
    _, owner, name = mb.field.split(".")
    options = tuple((p, tuple((k, 1 if (p, k) == (owner, name) else v) for k, v in values))
                    for p, values in ctx.deployment.options)
    whole = attrs.evolve(ctx.deployment, options=options)
    for j, size in enumerate(mb.parts):
        if mb.batches:
            dep, what = whole, f"{size} sequences"
        else:
            step = Step.prefill(whole.batch, size, cached_tokens=prefix)
            dep = whole.with_step(step) if prefix else attrs.evolve(
                whole, seq_len=size, step=step)
            what = f"tokens {prefix}..{prefix + size - 1}"
        try:
            shape = shape_of(dep)
        except ConfigError as exc:
            raise ConfigError(mb.field, f"micro-batch {j} ({what}) is refused ({exc}); use a number of micro-batches "
                                        f"whose parts the plugins accept") from None
        out.append(ctx.reshaped(dep, shape))
        prefix += 0 if mb.batches else size
    return out


def microbatch_program(ctx, mb: PipelineMicrobatches, cycles: int) -> tuple[LogicalOp, ...]:
    """The logical ops of every part (and cycle), in the order they are issued, with the
    three dependencies of the module docstring added to their inputs."""
    model = ctx.model
    program: list[LogicalOp] = []
    last_on: dict[tuple, str] = {}      # chips -> id of the last logical op issued on them
    n = model.n_layers
    for cycle in range(cycles):
        for j in range(mb.count):
            k = copy_index(cycle, j, mb.count)
            head = bool(mb.batches) or j == mb.count - 1
            copy = list(build_program(model, micro=k, head=head))
            if cycle > 0:   # rule 2: the tokens of this micro-batch's previous cycle
                before = LogicalOp("lm_head", n, micro=copy_index(cycle - 1, j, mb.count))
                back = LogicalOp("token_return", EMBED_LAYER, (before.id,), micro=k)
                copy[0] = attrs.evolve(copy[0], inputs=copy[0].inputs + (back.id,))
                copy.insert(0, back)
            started: set[tuple] = set()
            mine: dict[tuple, str] = {}
            for i, lop in enumerate(copy):
                chips = ctx.layer_chips(lop.layer)
                extra = ()
                if lop.kind not in SYNC_KINDS and chips not in started:
                    started.add(chips)
                    if chips in last_on:   # rule 1
                        extra += (last_on[chips],)
                if lop.kind == "attention" and mb.chunks and j > 0:   # rule 3
                    extra += (LogicalOp("qkv_proj", lop.layer, micro=k - 1).id,)
                if extra:
                    copy[i] = lop = attrs.evolve(lop, inputs=lop.inputs + extra)
                mine[chips] = lop.id
            last_on.update(mine)
            program += copy
    return tuple(program)


def head_end_times(dag, end_s: np.ndarray, mb: PipelineMicrobatches, cycles: int, n_layers: int) -> np.ndarray:
    """``[cycle, part]``: when each decode micro-batch's LM head ended (its token made), from
    the engine's op end times."""
    stems = dag.stems
    stem_of = np.asarray(dag.key_stem)
    out = np.full((cycles, mb.count), np.nan)
    for cycle in range(cycles):
        for j in range(mb.count):
            head = LogicalOp("lm_head", n_layers, micro=copy_index(cycle, j, mb.count)).prefix
            ids = [s for s, stem in enumerate(stems) if stem == head or stem.startswith((head + ".", head + "@"))]
            out[cycle, j] = float(np.max(end_s[np.isin(stem_of, ids)]))
    return out


def steady_cycle_s(times: np.ndarray) -> tuple[float, bool]:
    """The mean interval between two cycles of a micro-batch over the last two cycles, and
    whether the last two intervals agree (the pipeline is in its steady state)."""
    per_cycle = np.mean(np.diff(times, axis=0), axis=1)
    last, before = float(per_cycle[-1]), float(per_cycle[-2])
    return last, abs(last - before) <= STEADY_REL * last
