"""Micro-batches: one step run as copies of the model program, plus a schedule.

Two plugin hooks split a step, each with its own schedule; this module is the one mechanism
that turns their answers into program copies (``LogicalOp.micro``), a build context per
copy and the dependencies between copies (:class:`MicroBatches`):

- *pipeline* (``g5_pipeline_microbatches``, a :class:`PipelineMicrobatches`; the PP plugin
  answers it from ``plugins.pp.microbatches``): parts that follow one another through the
  layers' chips.

  - ``batches`` (decode): independent batches of sequences, each of which *cycles*: after
    its LM head (its logits gathered: ``logits_gather``) its sampled tokens return to the
    embedding's chips (``token_return``,
    claimed by the plugin that moves them) and its next step starts there. Every
    micro-batch keeps its sequences' KV on the chips (``BuildContext.resident_batches``).
    :data:`CYCLES` cycles are simulated (more when the last two differ), so the engine
    reaches its steady state; the interval between two cycles of the same micro-batch is
    the time per output token.
  - ``chunks`` (prefill): a prompt's tokens in consecutive chunks; chunk ``j`` attends over
    the KV of the chunks before it (a prefix, :func:`g5core.lower.flops.prefix_attention`)
    and only the last one runs the LM head. The step ends when the last chunk does.

- *overlap* (``g5_micro_batches``: the sequences of each; the EP plugin answers it for
  two-batch overlap): sides that run at once, their programs interleaved op by op, each
  consuming only its own outputs, so the engine runs one's communication under the
  other's compute.

The two compose: each pipeline part (each one a deployment of its own, validated by every
plugin) is asked for its overlap split, so a pipeline micro-batch can run as two sides;
whatever a plugin refuses of a part is refused by that plugin's own rules, naming its field.

Copy ``k = (cycle * m + j) * s + t`` is side ``t`` of pipeline part ``j`` in ``cycle``
(``m`` parts, ``s`` sides; one of either when that split is absent), its logical ops tagged
``LogicalOp.micro = k`` (``L003.m5.attention``: with ``m = 4`` and no sides, cycle 1 of
micro-batch 1); a step split by neither is the program once, untagged (``micro = -1``).
Nothing here is a formula for the bubbles or the overlap: three dependencies, and the
engine's per-chip streams and links, make them:

1. one forward at a time on a group of chips: on the chips that hold a layer (a pipeline
   stage), a part's first op (each side's) waits for the previous part's last op there
   (every side's: a stage worker runs the micro-batches it is handed in order; sends and
   receives are not held back);
2. a decode micro-batch's next cycle waits for its tokens (``token_return``), side by side;
3. a prompt chunk's attention at a layer waits for the previous chunk's K/V projection at
   that layer (the same side's: the same sequences).
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


def overlap_batches(hooks, deployment, model) -> tuple[int, ...]:
    """The sequences of each side when a plugin splits ``deployment``'s step to overlap them
    (``g5_micro_batches``), else none."""
    answers = hooks.call_each("g5_micro_batches", deployment=deployment, model=model)
    if not answers:
        return ()
    if len(answers) > 1:
        raise ConfigError("plugins", f"plugins {' and '.join(p for p, _ in answers)} both split the step into "
                                     "micro-batches; enable one of their options")
    plugin, batches = answers[0]
    batches = tuple(batches)
    if (len(batches) < 2 or any(type(b) is not int or b < 1 for b in batches)
            or sum(batches) != deployment.batch):
        raise PluginError(plugin, f"g5_micro_batches must give two or more positive batches summing to "
                                  f"{deployment.batch}, got {batches!r}")
    return batches


def side_deployment(deployment, batch: int):
    """``deployment`` running ``batch`` of its step's sequences (a step of one group of
    sequences; a split of a mixed step is refused by the plugin that asks for it)."""
    (group,) = deployment.step
    part = attrs.evolve(deployment, batch=batch)
    return attrs.evolve(part, step=type(deployment.step)([attrs.evolve(group, count=batch)]))


def overlap_contexts(ctx, shape_of) -> tuple:
    """One build context per side when a plugin splits ``ctx``'s step to overlap them
    (``g5_micro_batches``): the same deployment with that side's sequences, and its local
    shape (``shape_of``: as for :func:`part_contexts`); none otherwise."""
    return tuple(attrs.evolve(ctx, deployment=dep, shape=shape_of(dep), layer_chips={}, works={})
                 for dep in (side_deployment(ctx.deployment, b)
                             for b in overlap_batches(ctx.hooks, ctx.deployment, ctx.model)))


@attrs.frozen(eq=False)
class MicroBatches:
    """A step's program copies and their schedule (the module docstring): ``pipeline``, the
    pipeline split (None: one part, the step itself); ``parts``, one build context per
    pipeline part (``()`` without a pipeline); ``sides``, per part (one entry, the step's,
    without a pipeline) the build contexts of its overlap sides, ``()`` where none split."""

    pipeline: Optional[PipelineMicrobatches] = None
    parts: tuple = ()
    sides: tuple = ()

    @property
    def side_count(self) -> int:
        """Sides per part (1: no overlap split)."""
        return len(self.sides[0]) if self.sides and self.sides[0] else 1

    @property
    def part_count(self) -> int:
        return self.pipeline.count if self.pipeline is not None else 1

    def copy(self, cycle: int, part: int, side: int = 0) -> int:
        """The program copy (``LogicalOp.micro``) of ``side`` of ``part`` in ``cycle``."""
        return (cycle * self.part_count + part) * self.side_count + side

    def contexts(self, cycles: int = 1) -> dict:
        """The build context of every program copy of ``cycles`` cycles (empty for a step
        split by neither)."""
        out = {}
        for c in range(cycles if self.pipeline is not None else 1):
            for j in range(self.part_count):
                sides = self.sides[j] if self.sides else ()
                if sides:
                    out.update((self.copy(c, j, t), side) for t, side in enumerate(sides))
                elif self.pipeline is not None:
                    out[self.copy(c, j)] = self.parts[j]
        return out

    def pass_program(self, model) -> tuple[LogicalOp, ...]:
        """One pass of the step, without the pipeline's schedule: the model program, once per
        side of the first part when split to overlap (copies ``0 .. s-1``)."""
        if self.side_count == 1:
            return build_program(model)
        return tuple(interleave([build_program(model, micro=t) for t in range(self.side_count)]))

    def program(self, ctx, cycles: int) -> tuple[LogicalOp, ...]:
        """The logical ops of every part, side and cycle of a pipeline, in the order they are
        issued, with the three dependencies of the module docstring added to their inputs."""
        mb, model = self.pipeline, ctx.model
        program: list[LogicalOp] = []
        last_on: dict[tuple, tuple] = {}      # chips -> ids of the last logical ops issued on them
        n, sides = model.n_layers, range(self.side_count)
        for cycle in range(cycles):
            for j in range(mb.count):
                head = bool(mb.batches) or j == mb.count - 1
                copies = []
                for t in sides:
                    k = self.copy(cycle, j, t)
                    copy = list(build_program(model, micro=k, head=head))
                    if cycle > 0:   # rule 2: the tokens of this side's previous cycle
                        before = LogicalOp("logits_gather", n, micro=self.copy(cycle - 1, j, t))
                        back = LogicalOp("token_return", EMBED_LAYER, (before.id,), micro=k)
                        copy[0] = attrs.evolve(copy[0], inputs=copy[0].inputs + (back.id,))
                        copy.insert(0, back)
                    copies.append(copy)
                started: set[tuple] = set()
                mine: dict[tuple, dict] = {}
                for i in range(len(copies[0])):
                    for t in sides:
                        lop = copies[t][i]
                        chips = ctx.layer_chips(lop.layer)
                        extra = ()
                        if lop.kind not in SYNC_KINDS and (t, chips) not in started:
                            started.add((t, chips))
                            extra += last_on.get(chips, ())   # rule 1
                        if lop.kind == "attention" and mb.chunks and j > 0:   # rule 3
                            extra += (LogicalOp("qkv_proj", lop.layer, micro=self.copy(cycle, j - 1, t)).id,)
                        if extra:
                            copies[t][i] = lop = attrs.evolve(lop, inputs=lop.inputs + extra)
                        mine.setdefault(chips, {})[t] = lop.id
                last_on.update((chips, tuple(ids[t] for t in sorted(ids))) for chips, ids in mine.items())
                program += interleave(copies)
        return tuple(program)

    def head_end_times(self, dag, end_s: np.ndarray, cycles: int, n_layers: int) -> np.ndarray:
        """``[cycle, part]``: when each decode micro-batch's LM head ended, its logits gathered
        (its token made: its last side's), from the engine's op end times."""
        stems = dag.stems
        stem_of = np.asarray(dag.key_stem)
        out = np.full((cycles, self.part_count), np.nan)
        for cycle in range(cycles):
            for j in range(self.part_count):
                heads = tuple(LogicalOp(kind, n_layers, micro=self.copy(cycle, j, t)).prefix
                              for t in range(self.side_count) for kind in ("lm_head", "logits_gather"))
                ids = [s for s, stem in enumerate(stems)
                       if stem in heads or stem.startswith(tuple(h + sep for h in heads for sep in ".@"))]
                out[cycle, j] = float(np.max(end_s[np.isin(stem_of, ids)]))
        return out


def interleave(copies) -> list[LogicalOp]:
    """Program copies of the same shape issued op by op (copy 0's op, then 1's...): streams
    of the same work that the engine overlaps (one's communication under another's compute)."""
    return [lop for ops in zip(*copies) for lop in ops]


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


def steady_cycle_s(times: np.ndarray) -> tuple[float, bool]:
    """The mean interval between two cycles of a micro-batch over the last two cycles, and
    whether the last two intervals agree (the pipeline is in its steady state)."""
    per_cycle = np.mean(np.diff(times, axis=0), axis=1)
    last, before = float(per_cycle[-1]), float(per_cycle[-2])
    return last, abs(last - before) <= STEADY_REL * last
