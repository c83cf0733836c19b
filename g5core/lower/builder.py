"""From a deployment to a validated op DAG: the build phase, where every hook is called.

Phases (desmod-style): plan_deployment (model, system, dimensions, rank map, local shape) ->
expand every logical op through the op-expansion hooks -> validate (placed, lowered,
acyclic, keys owned) -> hand arrays to the engine. No hook is called after this.
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping, Optional

import attrs
import numpy as np
import pluggy

from g5core.lower.collective import collect_primitives
from g5core.lower.topology import Topology
from g5core.inputs.config import Deployment
from g5core.lower.dag import ID_DTYPE, ID_LIMIT, OpDag, require_lowering
from g5core.api.ops import KEY_VERBATIM, CommOp, ComputeOp, Fragment, Replicated, Tiled, _slot_op, split_key
from g5core.api.dimensions import DimensionRegistry, collect_dimensions
from g5core.api.errors import ConfigError, DagError, G5Error, PluginError, ResourceError
from g5core.lower.flops import activation_tensor_bytes
from g5core.lower.microbatch import CYCLES, MicroBatches, collect_pipeline_microbatches, overlap_contexts, part_contexts
from g5core.lower.layers import (EMBED_LAYER, SYNC_KINDS, build_program, decode_query_rows, default_work,
                                 local_kv_bytes_per_token)
from g5core.api.work import LogicalOp, Work
from g5core.api.context import BuildContext
from g5core.inputs.models import ModelSpec, get_model
from g5core.api.plugins import Hooks, describe_plugins
from g5core.lower.rankmap import RankMap
from g5core.api.options import collect_options
from g5core.lower.shape import LocalShape, collect_shard_axes, merge_factors
from g5core.inputs.framework import with_framework
from g5core.inputs.systems import SystemSpec, get_system


_MISSING = object()


@attrs.define(eq=False)
class CoreBuildContext(BuildContext):
    """The build context the core makes: :class:`BuildContext` answered by the core's formulas."""

    _works: dict = attrs.field(factory=dict, repr=False)
    #: batches of ``deployment.batch`` sequences whose KV the chips keep at once: the decode
    #: micro-batches cycling through a pipeline (g5core.lower.microbatch), else 1
    resident_batches: int = 1
    #: the shape whose activations a chip holds at its peak, where not ``shape``'s: the
    #: largest prompt chunk of a chunked (micro-batched) prefill
    activation_shape: Optional[LocalShape] = attrs.field(default=None, repr=False)

    def restricted(self, chips: tuple[int, ...]) -> "BuildContext":
        """The same context with ops placed on ``chips`` only (the works made are shared)."""
        return attrs.evolve(self, layer_chips={}, works=self._works, replica_chips=tuple(chips))

    def reshaped(self, deployment: Deployment, shape: LocalShape) -> "BuildContext":
        """The same context running another step of the same deployment (``deployment``
        differs in its step only; ``shape`` is its share): the layer placement is kept, the
        work made per kind is not."""
        return attrs.evolve(self, deployment=deployment, shape=shape, layer_chips=self._layer_chips, works={})

    def work(self, kind: str, layer: int | None = None) -> Work | None:
        """The default work of ``kind`` on one chip (of ``layer``, whose attention window it
        follows), made once per context and kind, and per layer for a windowed layer's
        attention (it depends on those, the model, the deployment and the shape only; a Work
        is immutable)."""
        key = (kind, layer) if kind == "attention" and layer is not None and self.model.kv_window(layer) else kind
        got = self._works.get(key, _MISSING)
        if got is _MISSING:
            got = self._works[key] = default_work(kind, self.model, self.deployment, self.shape, layer)
        return got

    def hidden_states_bytes(self, tokens: float) -> float:
        return activation_tensor_bytes(tokens, self.model.hidden_size, self.deployment.dtypes.activation_element_bytes)

    def logits_bytes(self) -> float:
        return activation_tensor_bytes(decode_query_rows(self.shape), self.model.vocab_size,
                                       self.deployment.dtypes.activation_element_bytes)

    @property
    def kv_bytes_per_token_local(self) -> float:
        return local_kv_bytes_per_token(self.model, self.deployment, self.shape)


@attrs.define(eq=False, kw_only=True)
class Plan:
    """A prepared run: validated deployment and everything derived from it, before the DAG."""

    pm: pluggy.PluginManager
    hooks: Hooks
    ctx: BuildContext
    primitives: Mapping
    #: the step's micro-batches: its program copies and their schedule (pipeline parts,
    #: overlap sides: g5core.lower.microbatch); none for a step run whole
    micro_batches: MicroBatches = MicroBatches()
    #: the compute-latency lookup to compile with, when one outlives the run (a prepared
    #: plan's, shared by its steps: g5core.session.prepared); None: a fresh one per compile
    lookup: Optional[object] = None

    @property
    def pipeline(self):
        """The step's split into pipeline parts (a :class:`PipelineMicrobatches`), or None."""
        return self.micro_batches.pipeline

    def program(self) -> tuple[LogicalOp, ...]:
        """The logical ops of one pass of the step (without a pipeline's schedule): the
        model's, once per overlap side when split (:meth:`MicroBatches.pass_program`)."""
        return self.micro_batches.pass_program(self.ctx.model)

    def context(self, micro: int, ctx: BuildContext | None = None) -> BuildContext:
        """The context the ops of copy ``micro`` of :meth:`program` (-1: the whole step)
        expand in, restricted to ``ctx``'s chips."""
        ctx = self.ctx if ctx is None else ctx
        if micro < 0 or not self.micro_batches.sides:
            return ctx
        part = self.micro_batches.sides[0][micro]
        return part if ctx.replica_chips is None else part.restricted(ctx.replica_chips)


def plan_deployment(raw_or_deployment, pm: pluggy.PluginManager, source: str = "configuration",
            max_ops: int | None = None, model: ModelSpec | None = None) -> Plan:
    """Validate a raw configuration mapping (or a Deployment) against the enabled plugins.

    A deployment whose op count is certainly above ``max_ops`` (default DEFAULT_MAX_OPS)
    is refused here, before the rank map of its chips is built."""
    hooks = Hooks(pm)
    dims = collect_dimensions(hooks)
    options = collect_options(hooks)
    axes = collect_shard_axes(hooks)
    if isinstance(raw_or_deployment, Deployment):
        deployment = raw_or_deployment
    else:
        try:
            deployment = Deployment.from_dict(raw_or_deployment, dims, source, options)
        except ConfigError as exc:
            raise _name_disabled_plugins(exc, pm, dims) from None
    # ``model``: a model given as a spec (a speculative proposer: g5core.session.speculative)
    model = get_model(deployment.model) if model is None else model
    system = get_system(deployment.system)
    if deployment.framework:   # the configuration's framework profile (g5core.inputs.framework)
        system = with_framework(system, deployment.framework, "framework")
    shape = validated_shape(hooks, deployment, model, system, axes)
    _check_floor(deployment, model, max_ops)
    sizes = dict(deployment.parallel)
    try:
        rankmap = RankMap.build(sizes, dims, system.chips_per_node)
    except ValueError as exc:
        raise ConfigError("parallel", str(exc)) from None
    topology = make_topology(hooks, system, rankmap.chips)
    ctx = CoreBuildContext(deployment=deployment, model=model, system=system, dims=dims, rankmap=rankmap, shape=shape,
                           topology=topology, hooks=hooks)
    mb = collect_pipeline_microbatches(hooks, deployment, model)
    shape_of = lambda dep: validated_shape(hooks, dep, model, system, axes)  # noqa: E731
    parts = tuple(part_contexts(ctx, mb, shape_of)) if mb is not None else ()
    if mb is not None and mb.cycles_apply:
        ctx.resident_batches = mb.count
    elif mb is not None:
        ctx.activation_shape = max((p.shape for p in parts), key=lambda s: s.tokens)
    return Plan(pm=pm, hooks=hooks, ctx=ctx, primitives=collect_primitives(hooks),
                micro_batches=_micro_batches(ctx, mb, parts, shape_of))


def _micro_batches(ctx: BuildContext, mb, parts: tuple, shape_of) -> MicroBatches:
    """The step's program copies: its pipeline parts (``mb``, ``parts``), each (or the step,
    without a pipeline) split into the sides a plugin overlaps (``g5_micro_batches``), which
    that plugin's own rules accept or refuse for each part."""
    sides = tuple(overlap_contexts(part, shape_of) for part in (parts or (ctx,)))
    if len({len(s) for s in sides}) > 1:
        raise ConfigError(mb.field, f"the plugins split its micro-batches into different numbers of overlapped "
                                    f"sides ({', '.join(str(len(s)) for s in sides)}); use {mb.field}: 1")
    return MicroBatches(pipeline=mb, parts=parts, sides=sides if sides[0] else ())


def validated_shape(hooks: Hooks, deployment: Deployment, model: ModelSpec, system: SystemSpec,
                    axes: tuple[str, ...]) -> LocalShape:
    """The plugins' checks of a deployment, then one chip's share of its step."""
    for _plugin, _ in hooks.call_each("g5_validate_deployment", deployment=deployment, model=model, system=system):
        pass
    factors = merge_factors(hooks.call_each("g5_shard_factors", deployment=deployment, model=model), axes)
    return LocalShape.from_factors(deployment, model, factors)


def plan_for_step(plan: Plan, deployment: Deployment, axes: tuple[str, ...], lookup=None) -> Plan:
    """``plan`` running another step (``deployment`` differs from the plan's in its step
    only): validated and shaped again; the plugin manager, rank map, topology, primitives
    and layer placement are reused; ``lookup`` is the compute-latency lookup to keep."""
    ctx = plan.ctx
    shape = validated_shape(plan.hooks, deployment, ctx.model, ctx.system, axes)
    step_ctx = ctx.reshaped(deployment, shape)
    shape_of = lambda dep: validated_shape(plan.hooks, dep, ctx.model, ctx.system, axes)  # noqa: E731
    return Plan(pm=plan.pm, hooks=plan.hooks, ctx=step_ctx, primitives=plan.primitives, lookup=lookup,
                micro_batches=_micro_batches(step_ctx, None, (), shape_of))


def make_topology(hooks: Hooks, system: SystemSpec, chips: int) -> Topology:
    """The topology a plugin provides (``g5_topology``), else the system file's."""
    answer = hooks.call_first("g5_topology", system=system, chips=chips)
    if answer is None:
        return Topology.from_system(system, chips)
    plugin, topo = answer
    if not isinstance(topo, Topology) or topo.chips != chips:
        raise PluginError(plugin, f"g5_topology must return a Topology of {chips} chips, got {topo!r}")
    return topo


def _name_disabled_plugins(exc: ConfigError, pm: pluggy.PluginManager, dims: DimensionRegistry) -> ConfigError:
    """An unknown ``parallel`` key while plugins are disabled: say which are disabled (one
    of them likely registers it) instead of guessing a similar dimension name."""
    key = exc.field[len("parallel."):] if exc.field.startswith("parallel.") else ""
    if not key or key in dims.names:
        return exc
    disabled = [p.name for p in describe_plugins(pm) if not p.enabled]
    if not disabled:
        return exc
    hint = (f"the plugin '{key}' is disabled" if key in disabled
            else f"disabled plugins: {', '.join(disabled)}")
    return ConfigError(exc.field, f"no enabled plugin registers the dimension '{key}' ({hint}); enable the plugin "
                                  f"that provides it, or remove parallel.{key} (registered: {', '.join(dims.names)})")


# ----------------------------------------------------------------------------------------
# DAG
# ----------------------------------------------------------------------------------------


def default_fragment(ctx: BuildContext, lop: LogicalOp, chips: tuple[int, ...]) -> Fragment:
    if lop.kind in SYNC_KINDS:
        return Fragment(ops=())
    work = ctx.work(lop.kind, lop.layer)
    # one template for every chip; its key and chip stand for each chip's (lop.key(chip))
    template = ctx.compute_op(lop, chips[0] if chips else 0, work, owner="core")
    return Fragment.replicated(template, lop.prefix, chips)


def expand(ctx: BuildContext, lop: LogicalOp) -> tuple[str, Fragment]:
    """The fragment of one logical op and the name of the plugin (or "core") that owns it."""
    answers = ctx.hooks.call_each("g5_expand_op", ctx=ctx, lop=lop)
    if len(answers) > 1:
        names = " and ".join(f"'{p}'" for p, _ in answers)
        raise DagError(f"{lop.id}: plugins {names} both claim this op; exactly one plugin may expand it "
                       f"(disable one with --disable NAME)")
    if answers:
        owner, frag = answers[0]
        if not isinstance(frag, Fragment):
            raise PluginError(owner, f"g5_expand_op must return a Fragment or None, got {type(frag).__name__}")
        return owner, frag
    objections = ctx.hooks.call_each("g5_require_owner", ctx=ctx, lop=lop)
    if objections:
        plugin, message = objections[0]
        raise ConfigError("plugins", f"{message} (raised by plugin '{plugin}')")
    return "core", default_fragment(ctx, lop, ctx.place(lop))


def build_dag(plan: Plan, program: tuple[LogicalOp, ...] | None = None,
              chips: tuple[int, ...] | None = None, contexts: Mapping[int, BuildContext] | None = None) -> OpDag:
    """The op DAG; with ``chips``, only the ops placed on them (one symmetric replica).

    ``contexts``: the build context of each program copy (``LogicalOp.micro``) of a
    micro-batched program (g5core.lower.microbatch); the plan's for the others.

    Ops, edges and each logical op's outputs (its tails per chip) are op ids; no key string
    is made for a repeated (:meth:`Fragment.tiled`, :meth:`Fragment.replicated`) fragment.
    Keys of different logical ops cannot collide when the program's prefixes are prefix-free
    (checked once; every op key starts with its logical op's prefix), so keys are checked
    for repeats within each fragment, and across the whole DAG only otherwise."""
    ctx = plan.ctx if chips is None else plan.ctx.restricted(chips)
    program = program if program is not None else plan.program()
    # the context of each copy of the program (LogicalOp.micro, g5core.lower.microbatch)
    copies = contexts if contexts is not None else plan.micro_batches.contexts()
    by_copy = {k: (c if chips is None else c.restricted(chips)) for k, c in copies.items()}
    dag = OpDag()
    n_chips = ctx.rankmap.chips
    if chips is not None and tuple(chips) == tuple(range(len(chips))):
        # one replica, chips 0 .. R-1: the per-chip columns of the build span those alone,
        # so its cost does not grow with the replicas; an op outside is a ReplicaSpill
        n_chips = _ReplicaChips(len(chips), n_chips)
    seen: dict[str, int] | None = None if _prefix_free(program) else {}
    last_use: dict[str, int] = {}
    for at, lop in enumerate(program):
        for name in lop.inputs:
            last_use[name] = at
    outputs: dict[str, _PerChip] = {}
    pairs = dag.edge_pairs
    tiles_cache = _TileCache()
    for at, lop in enumerate(program):
        owner, frag = expand(by_copy.get(lop.micro, ctx) if by_copy else ctx, lop)
        prefixes = (lop.prefix + ".", lop.prefix + "@")
        base = len(dag)
        if frag.repeated is not None and frag.plain:
            heads, tails = _add_tiled(dag, frag.repeated, lop, owner, prefixes, n_chips, plan.primitives, tiles_cache)
        else:
            heads, tails = _add_ops(dag, frag, lop, owner, prefixes, n_chips, plan.primitives, tiles_cache)
        if seen is not None:
            for i in range(base, len(dag)):
                key = dag.key(i)
                if key in seen:
                    raise DagError(f"op key {key!r} made twice (by {dag.owner(seen[key])} and {dag.owner(i)})")
                seen[key] = i
        inputs = _PerChip.merge([outputs[name] for name in lop.inputs], n_chips)
        if inputs is not None and len(heads[0]):
            _head_edges(pairs, inputs, *heads)
        if last_use.get(lop.id, -1) > at:
            outputs[lop.id] = _PerChip.outputs(inputs, tails, n_chips)
        for name in lop.inputs:
            if last_use[name] == at:
                outputs.pop(name, None)
    return dag


def _prefix_free(program: Iterable[LogicalOp]) -> bool:
    """Whether no logical op's key prefix (``id + "."`` or ``id + "@"``) starts another's:
    then keys of different logical ops never collide. Sorted, a prefix sits just before the
    strings it starts (those between them start with it too), so neighbours suffice."""
    prefixes = sorted(p for lop in program for p in (lop.prefix + ".", lop.prefix + "@"))
    return not any(b.startswith(a) for a, b in zip(prefixes, prefixes[1:]))


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The ranges ``starts[i] .. starts[i] + counts[i] - 1``, concatenated."""
    ends = np.cumsum(counts)
    total = int(ends[-1]) if len(ends) else 0
    if not total:
        return np.zeros(0, dtype=np.int64)
    return np.repeat(starts - (ends - counts), counts) + np.arange(total, dtype=np.int64)


def _extend_pairs(pairs, u: np.ndarray, v: np.ndarray) -> None:
    if len(u):
        pairs.frombytes(np.column_stack((u, v)).astype(ID_DTYPE, copy=False).tobytes())


class _PerChip:
    """Op ids per chip, stored flat (CSR over every chip): chip ``c``'s are
    ``ids[ptr[c]:ptr[c + 1]]``, in order. ``unique``: no chip lists an op twice."""

    __slots__ = ("ptr", "ids", "unique")

    def __init__(self, ptr: np.ndarray, ids: np.ndarray, unique: bool):
        self.ptr, self.ids, self.unique = ptr, ids, unique

    @classmethod
    def of(cls, chips: np.ndarray, ids: np.ndarray, n_chips: int, unique: bool) -> "_PerChip":
        """From ``(chip, id)`` entries, each chip's ids in the order given."""
        ptr = np.zeros(n_chips + 1, dtype=np.int64)
        np.cumsum(np.bincount(chips, minlength=n_chips), out=ptr[1:])
        return cls(ptr, np.asarray(ids, dtype=np.int64)[np.argsort(chips, kind="stable")], unique)

    def entry_chips(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.ptr) - 1), np.diff(self.ptr))

    @classmethod
    def merge(cls, lists: list["_PerChip"], n_chips: int) -> "_PerChip | None":
        """Each chip's ids of every list, list after list (None without lists)."""
        if len(lists) <= 1:
            return lists[0] if lists else None
        chips = np.concatenate([p.entry_chips() for p in lists])
        return cls.of(chips, np.concatenate([p.ids for p in lists]), n_chips, unique=False)

    def deduplicated(self, n_chips: int) -> "_PerChip":
        """Each chip's ids, a repeat dropped (the first kept)."""
        if self.unique or not len(self.ids):
            return self
        chips = self.entry_chips()
        _, first = np.unique(chips * (int(self.ids.max()) + 1) + self.ids, return_index=True)
        first.sort()
        return _PerChip.of(chips[first], self.ids[first], n_chips, unique=True)

    @classmethod
    def outputs(cls, inputs: "_PerChip | None", tails: tuple, n_chips: int) -> "_PerChip":
        """A logical op's output per chip: its tails on the chips it names tails on, else
        its inputs passed through (repeats dropped)."""
        tail, listed = tails
        through = inputs.deduplicated(n_chips) if inputs is not None else None
        if through is None or listed.all():
            return tail if tail is not None else cls(np.zeros(n_chips + 1, dtype=np.int64), np.zeros(0, np.int64), True)
        if tail is None or not listed.any():
            return through
        start = np.where(listed, tail.ptr[:-1], len(tail.ids) + through.ptr[:-1])
        counts = np.where(listed, np.diff(tail.ptr), np.diff(through.ptr))
        ptr = np.zeros(n_chips + 1, dtype=np.int64)
        np.cumsum(counts, out=ptr[1:])
        ids = np.concatenate((tail.ids, through.ids))[_ranges(start, counts)]
        return cls(ptr, ids, tail.unique)


def _head_edges(pairs, inputs: _PerChip, chips: np.ndarray, ids: np.ndarray) -> None:
    """An edge from each of a chip's inputs to each head on that chip, head by head."""
    counts = np.diff(inputs.ptr)[chips]
    _extend_pairs(pairs, inputs.ids[_ranges(inputs.ptr[chips], counts)], np.repeat(ids, counts))


@attrs.frozen(kw_only=True)
class _CommFamily:
    """The comm ops of tiled templates that differ only by tile: one spec per tile, its
    group the family's ``slots`` on the tile's chips."""

    primitive: str
    slots: tuple[int, ...]
    reason: str
    name: str
    owner: str
    bytes_per_rank: float
    tiles_id: int

    def spec_on(self, dag: OpDag, tile: tuple[int, ...]) -> int:
        return dag._comm_spec(primitive=self.primitive, group=tuple(tile[s] for s in self.slots), reason=self.reason,
                              name=self.name, owner=self.owner, bytes_per_rank=self.bytes_per_rank)


class _TileCache:
    """What the tiled fragments of one build share: each distinct tiles tuple, checked, as
    an array with an id; and per comm-op family the spec id of each tile."""

    def __init__(self):
        self.tiles: dict[tuple, tuple[np.ndarray, int]] = {}
        self.specs: dict[_CommFamily, object] = {}


_NO_HEADS = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))


def _add_ops(dag: OpDag, frag: Fragment, lop: LogicalOp, owner: str, prefixes: tuple[str, str], n_chips: int,
             primitives: Mapping, tiles_cache: "_TileCache") -> tuple[tuple, tuple]:
    """Store a fragment op by op (a repeated part, if any, as columns first); its edges;
    its (head chips, head ids) in order and (tails per chip, chips naming tails)."""
    base = len(dag)
    own: dict[str, int] = {}
    if frag.repeated is not None:
        _add_tiled(dag, frag.repeated, lop, owner, prefixes, n_chips, primitives, tiles_cache)
        own = {dag.key(i): i for i in range(base, len(dag))}
    append = dag.append
    for op in frag._ops:
        key = op.key
        if not (type(op) is ComputeOp and type(op.chip) is int and 0 <= op.chip < n_chips
                and key.startswith(prefixes)):
            check_op(op, prefixes, owner, n_chips, primitives)
        if key in own:
            raise DagError(f"op key {key!r} made twice (by {dag.owner(own[key])} and {op.owner})")
        own[key] = append(op)
    pairs = dag.edge_pairs
    for a, b in frag._edges:
        if a not in own or b not in own:
            raise DagError(f"{lop.id}: plugin '{owner}' made an edge {a!r} -> {b!r} between ops it does not own")
        pairs.extend((own[a], own[b]))
    out = []
    for label, entries in (("head", frag.heads), ("tail", frag.tails)):
        chips, ids, per_chip = [], [], {}
        for chip, keys in entries:
            if not (type(chip) is int and 0 <= chip < n_chips):
                if type(chip) is int and n_chips <= chip < getattr(n_chips, "full", n_chips):
                    raise ReplicaSpill(f"plugin '{owner}' names a {label} of {lop.id} outside the simulated replica")
                raise DagError(f"{lop.id}: plugin '{owner}' names a {label} on chip {chip!r}, outside 0..{n_chips - 1}")
            for k in keys:
                if k not in own:
                    raise DagError(f"{lop.id}: plugin '{owner}' names {label} {k!r}, which it did not make")
            per_chip[chip] = keys   # a tail named twice on a chip: the last names it
            chips += [chip] * len(keys)
            ids += [own[k] for k in keys]
        out.append((np.array(chips, dtype=np.int64), np.array(ids, dtype=np.int64), per_chip))
    heads = out[0][:2]
    per_chip = out[1][2]
    if not per_chip:
        return heads, (None, np.zeros(n_chips, dtype=bool))
    listed = np.zeros(n_chips, dtype=bool)
    listed[list(per_chip)] = True
    chips = [c for c, keys in per_chip.items() for _ in keys]
    ids = [own[k] for keys in per_chip.values() for k in keys]
    unique = all(len(set(keys)) == len(keys) for keys in per_chip.values())
    return heads, (_PerChip.of(np.array(chips, dtype=np.int64), np.array(ids, dtype=np.int64), n_chips, unique), listed)


def _add_tiled(dag: OpDag, rep: Replicated | Tiled, lop: LogicalOp, owner: str, prefixes: tuple[str, str],
               n_chips: int, primitives: Mapping, tiles_cache: "_TileCache") -> tuple[tuple, tuple]:
    """Store a repeated fragment as columns with numpy: check its template once, then
    every tile's rows, edges, heads and tails at once (ops tile by tile, template order
    within a tile: the order the per-op API makes them). Returns what :func:`_add_ops` does."""
    if type(rep) is Replicated:
        if type(rep.template) is not ComputeOp:
            raise PluginError(owner, f"Fragment.replicated needs a ComputeOp template, got {rep.template!r}")
        if rep.chips and (rep.stem + "@").startswith(prefixes):
            return _add_replicated(dag, rep, owner, n_chips, tiles_cache)
        rep = rep.as_tiled()   # no chips, or a message to give
    template, tiles = rep.template, rep.tiles
    ops = template._ops
    n, k = len(tiles), len(ops)
    if not n:
        return _NO_HEADS, (None, np.zeros(n_chips, dtype=bool))
    m = len(tiles[0])
    cached = tiles_cache.tiles.get(tiles)
    if cached is None:
        for tile in tiles:
            for s, c in enumerate(tile):
                if not (type(c) is int and 0 <= c < n_chips):
                    on = [op for op in ops if s in (op.chips if type(op) is CommOp else (op.chip,))] or [None]
                    key = _tile_key(on[0], tile, lop)
                    raise _outside(key, owner, c, n_chips)
        cached = tiles_cache.tiles[tiles] = (np.array(tiles, dtype=np.int64).reshape(n, m), len(tiles_cache.tiles))
    T, tiles_id = cached
    t_chip = np.full(k, -1, dtype=np.int64)
    t_arg = np.empty(k, dtype=np.int64)
    t_stem = np.empty(k, dtype=np.int64)
    t_layer = np.empty(k, dtype=np.int64)
    t_spec = np.full(k, -1, dtype=np.int64)
    t_fam = np.full(k, -1, dtype=np.int64)
    local: dict[str, int] = {}
    families: dict[_CommFamily, int] = {}  # comm spec family (group on slots) -> column
    new: list[tuple] = []                 # families first seen here: their specs per tile
    spec_tables = tiles_cache.specs
    for j, op in enumerate(ops):
        check_op(op, prefixes, owner, m, primitives, on_slots=True)
        kind = type(op)
        group = op.group if kind is CommOp else None
        stem, arg = split_key(op.key, group)
        if arg == KEY_VERBATIM or arg >= m:
            raise DagError(f"op {op.key!r} made by plugin '{owner}' in a tiled template is not keyed on its slots "
                           f"(...@c<slot>, or its group's ...@c<a>->c<b> or ...@g<a>-<b>-...)")
        if op.key in local:
            raise DagError(f"op key {op.key!r} made twice (by {ops[local[op.key]].owner} and {op.owner})")
        local[op.key] = j
        t_arg[j], t_stem[j], t_layer[j] = arg, dag.stem_id(stem), op.layer
        if kind is ComputeOp:
            t_chip[j], t_spec[j] = op.chip, dag._compute_spec(op)
            continue
        family = _CommFamily(primitive=op.primitive, slots=group, reason=op.reason, name=op.name, owner=op.owner,
                             bytes_per_rank=op.bytes_per_rank, tiles_id=tiles_id)
        col = families.get(family)
        if col is None:
            col = families[family] = len(families)
            if family not in spec_tables:
                # intern tile 0's spec here, at the op the per-op API would intern it at
                new.append(family)
                spec_tables[family] = [family.spec_on(dag, tiles[0])]
        t_fam[j] = col
    for t in range(1, n):                 # later tiles' new specs, in the order ops make them
        tile = tiles[t]
        for family in new:
            spec_tables[family].append(family.spec_on(dag, tile))
    for family in new:
        spec_tables[family] = np.array(spec_tables[family], dtype=np.int64)
    # rows, tile by tile
    comm = t_fam >= 0
    chip = np.where(comm, -1, T[:, np.maximum(t_chip, 0)])
    spec = np.repeat(t_spec[None, :], n, axis=0)
    if comm.any():
        table = np.column_stack([spec_tables[f] for f in families])
        spec[:, comm] = table[:, t_fam[comm]]
    arg = np.where(t_arg >= 0, T[:, np.maximum(t_arg, 0)], t_arg)
    base = len(dag)
    dag.extend_columns(chip.ravel(), np.tile(t_layer, n), spec.ravel(), np.tile(t_stem, n), arg.ravel())
    offsets = base + k * np.arange(n, dtype=np.int64)[:, None]
    # edges, tile by tile
    if template._edges:
        ends = []
        for a, b in template._edges:
            if a not in local or b not in local:
                raise DagError(f"{lop.id}: plugin '{owner}' made an edge {a!r} -> {b!r} between ops it does not own")
            ends.append((local[a], local[b]))
        ends = np.array(ends, dtype=np.int64)
        _extend_pairs(dag.edge_pairs, (offsets + ends[:, 0]).ravel(), (offsets + ends[:, 1]).ravel())
    # heads and tails: each template entry on its tile's chip, sorted by chip
    out = []
    for label, entries in (("head", template._heads), ("tail", template._tails)):
        slots, ids, listed_slots = [], [], []
        unique = True
        for s, keys in entries:
            if not (type(s) is int and 0 <= s < m) or s in listed_slots:
                raise DagError(f"{lop.id}: plugin '{owner}' names a {label} on slot {s!r} of a tiled template "
                               f"(slots 0..{m - 1}, each once)")
            listed_slots.append(s)
            unique = unique and len(set(keys)) == len(keys)
            for key in keys:
                if key not in local:
                    raise DagError(f"{lop.id}: plugin '{owner}' names {label} {key!r}, which it did not make")
                slots.append(s)
                ids.append(local[key])
        chips = T[:, slots].ravel()
        ids = (offsets + np.array(ids, dtype=np.int64)).ravel()
        out.append((chips, ids, listed_slots, unique))
    chips, ids = out[0][:2]
    order = np.argsort(chips, kind="stable")
    heads = (chips[order], ids[order])
    chips, ids, listed_slots, unique = out[1]
    listed = np.zeros(n_chips, dtype=bool)
    listed[T[:, listed_slots].ravel()] = True
    return heads, (_PerChip.of(chips, ids, n_chips, unique) if listed_slots else None, listed)


def _add_replicated(dag: OpDag, rep: Replicated, owner: str, n_chips: int, tiles_cache: "_TileCache") -> tuple[tuple, tuple]:
    """:func:`_add_tiled` of a one-slot tiling (one op per chip), what depends on the chips
    alone made once per distinct chips."""
    chips = rep.chips
    cached = tiles_cache.tiles.get(chips)
    if cached is None:
        for c in chips:
            if not (type(c) is int and 0 <= c < n_chips):
                raise _outside(rep.key(c), owner, c, n_chips)
        column = np.array(chips, dtype=np.int64)
        order = np.argsort(column, kind="stable")
        ptr = np.zeros(n_chips + 1, dtype=np.int64)
        np.cumsum(np.bincount(column, minlength=n_chips), out=ptr[1:])
        cached = tiles_cache.tiles[chips] = (column, order, column[order], ptr, ptr[1:] > ptr[:-1])
    column, order, sorted_chips, ptr, listed = cached
    n, t, base = len(chips), rep.template, len(dag)
    dag.extend_columns(column, np.full(n, t.layer), np.full(n, dag._compute_spec(t)),
                       np.full(n, dag.stem_id(rep.stem)), column)
    ids = base + order
    return (sorted_chips, ids), (_PerChip(ptr, ids, True), listed)


def _tile_key(op, tile: tuple, lop: LogicalOp) -> str:
    """A template op's key on ``tile`` (for messages; any key when it cannot be made)."""
    if op is None:
        return lop.prefix
    try:
        return _slot_op(op, tile).key
    except Exception:
        return op.key


class ReplicaSpill(DagError):
    """A plugin placed an op outside the replica a symmetric build makes (condition 5 of
    :mod:`g5core.lower.symmetry`): the run falls back to every chip."""


class _ReplicaChips(int):
    """The chip count a symmetric build makes ops on (one replica: chips ``0 .. self - 1``),
    which remembers the whole cluster's (``full``): a chip in between is a plugin placing an
    op outside the replica, not a chip that does not exist."""

    def __new__(cls, chips: int, full: int):
        self = super().__new__(cls, chips)
        self.full = full
        return self


def _outside(key: str, owner: str, chip, n_chips: int) -> DagError:
    """The error for an op placed on ``chip``, outside ``0 .. n_chips - 1``."""
    if type(chip) is int and n_chips <= chip < getattr(n_chips, "full", n_chips):
        return ReplicaSpill(f"plugin '{owner}' placed op {key!r} outside the simulated replica")
    return DagError(f"op {key!r} made by plugin '{owner}' is placed on chip {chip!r}, outside 0..{n_chips - 1}")


def check_op(op, prefixes: tuple[str, str], owner: str, chips: int, primitives: Mapping,
             on_slots: bool = False) -> None:
    """The one check of an op a plugin made (the build's, per op and per tiled template, and
    the contract suite's): a ComputeOp, or a CommOp of an enabled primitive over two members
    or more, each once; keyed under its logical op's ``prefixes``; on chips ``0 .. chips - 1``
    (slots of a tiled template with ``on_slots``)."""
    kind = type(op)
    if kind is ComputeOp:
        members = (op.chip,)
    elif kind is CommOp:
        members = op.group
        require_lowering(op, primitives)
        if len(set(members)) != len(members) or len(members) < 2:
            raise DagError(f"op {op.key!r} made by plugin '{owner}' has a bad group {members}")
    else:
        raise PluginError(owner, f"fragment holds {op!r}, not a ComputeOp or CommOp")
    if not op.key.startswith(prefixes):
        raise DagError(f"op {op.key!r} made by plugin '{owner}' does not start with its logical op's prefix "
                       f"{prefixes[0][:-1]!r}")
    for c in members:
        if not (type(c) is int and 0 <= c < chips):
            if on_slots:
                raise DagError(f"op {op.key!r} made by plugin '{owner}' in a tiled template is on slot {c!r}, "
                               f"outside 0..{chips - 1}")
            raise _outside(op.key, owner, c, chips)


# ----------------------------------------------------------------------------------------
# Size guard: the op and flow count, estimated before the DAG is built
# ----------------------------------------------------------------------------------------

#: Ops plus flows a run may build unless ``--max-ops`` says otherwise: a refused run would
#: take more than about 30 s. Measured (issue 25) on the 2-core development machine,
#: 2026-12-01, CPU seconds of ``run(..., symmetry=False)`` (the machine was shared, load
#: average 8 to 10, so wall times were 5 to 10 times these), two runs just under 8 M ops and
#: flows (commands in README, "Benchmarks"): llama-3.1-70b 128K prefill on 1,792 H100s
#: (tp8 cp16 dp14; 7,922,656 ops and flows) 37.6 s = 4.75 us each; deepseek-v3 32K decode on
#: 1,792 H200s (tp2 ep32 dp896; 7,647,584) 17.5 s = 2.28 us each. At the faster of the two
#: a run of 12 M takes 27 s, at the slower 57 s; 12 M ops and flows need about 1.7 GiB.
DEFAULT_MAX_OPS = 12_000_000
#: Peak memory per op or flow: the llama-3.1-405b 1M-token benchmark with every chip
#: simulated (README, `benchmarks/bench.py`, case llama-3.1-405b-1m-cp16-256chips-nosym,
#: 2026-12-01, median of three runs) peaks at 245 MiB for 1,169,568 ops + 612,864 flows =
#: 144 B each (rounded up; larger runs need less each).
PEAK_BYTES_PER_OP = 150
#: Time per op or flow for the estimate the guard prints: the slower of the two runs above
#: (4.75 us, rounded up), so that "about N s" is not an underestimate on a shared machine;
#: on an idle one the scaling series' largest run took 1.69 us (15.30 s for 9,054,464,
#: `python benchmarks/bench.py --scaling`, llama-3.1-70b on 2,048 H100s).
WALL_S_PER_OP = 4.8e-6
#: Build time per logical op (the expansion hooks, the plugin's fragment and its checks, once
#: per logical op whether or not its ops tile): measured on the 2-core machine (2026-12-02,
#: idle), CPU of ``build_dag`` alone for a llama-like model of hidden 1024 on one chip, 1,000
#: and 4,000 layers (11,004 and 44,004 logical ops): 127.6 and 131.4 us each, rounded up. A
#: model of many layers on few chips is build-bound (about 30 times its engine time), so the
#: size guard charges it: each logical op counts as BUILD_S_PER_LOGICAL_OP / WALL_S_PER_OP
#: ops against the limit.
BUILD_S_PER_LOGICAL_OP = 1.4e-4


@attrs.frozen
class SizeEstimate:
    ops: int
    flows: int
    replicas: int = 1   # identical replicas, of which these ops and flows are one (g5core.lower.symmetry)
    logical_ops: int = 0   # the logical ops the build expands (each costs BUILD_S_PER_LOGICAL_OP)

    @property
    def total(self) -> int:
        return self.ops + self.flows

    @property
    def charged(self) -> int:
        """What counts against the limit: the ops and flows, and the build's time per logical
        op in ops of the engine's time."""
        return self.total + math.ceil(self.logical_ops * BUILD_S_PER_LOGICAL_OP / WALL_S_PER_OP)

    @property
    def memory_bytes(self) -> int:
        return self.total * PEAK_BYTES_PER_OP

    @property
    def wall_s(self) -> float:
        return self.total * WALL_S_PER_OP + self.logical_ops * BUILD_S_PER_LOGICAL_OP

    def describe(self) -> str:
        flows = f" and {self.flows:,} flows" if self.flows else ""
        mib = self.memory_bytes / 2 ** 20
        memory = (f"about {mib / 1024:.1f} GiB" if mib >= 1024 else f"about {mib:.0f} MiB" if mib >= 1
                  else "under 1 MiB")
        of = f" in one of {self.replicas} identical replicas" if self.replicas > 1 else ""
        return (f"about {self.ops:,} ops{flows}{of} ({memory} of memory and {_fmt_duration(self.wall_s)} "
                f"to simulate)")


def _fmt_duration(seconds: float) -> str:
    if seconds < 1:
        return "under 1 s"
    if seconds < 120:
        return f"about {seconds:.0f} s"
    if seconds < 7200:
        return f"about {seconds / 60:.0f} minutes"
    return f"about {seconds / 3600:.0f} hours"


def _check_floor(deployment: Deployment, model: ModelSpec, max_ops: int | None) -> None:
    """Every chip runs the work ops of at least one layer, and every layer runs its work
    ops at least once: ``max(chips, layers) x (fewest work ops of a layer)`` is a floor on
    the op count that needs neither the rank map nor the full program."""
    limit = DEFAULT_MAX_OPS if max_ops is None else max_ops
    first = model.moe.first_dense_layers if model.moe is not None else 0
    sample = model.first_layers(min(model.n_layers, first + 1))  # one dense and one MoE layer
    per_layer: dict[int, int] = {}
    for lop in build_program(sample):
        if lop.kind not in SYNC_KINDS and 0 <= lop.layer < sample.n_layers:
            per_layer[lop.layer] = per_layer.get(lop.layer, 0) + 1
    floor = max(deployment.chips, model.n_layers) * min(per_layer.values(), default=1)
    if floor > limit:
        _refuse(SizeEstimate(ops=floor, flows=0), limit, exact=False)


def _refuse(est: "SizeEstimate", limit: int, exact: bool) -> None:
    what = est.describe() if exact else est.describe().replace("about", "at least", 1)
    build = (f" (with its {est.logical_ops:,} logical ops' build, counted as {est.charged - est.total:,} ops)"
             if est.charged - est.total > est.total else "")
    raise ResourceError(f"this deployment would simulate {what}{build}, above the limit of {limit:,} ops and "
                        f"flows; use fewer chips or layers, or raise the limit with --max-ops {est.charged}")


def _check_placed_floor(plan: Plan, limit: int) -> None:
    """Refuse at once a run whose ops alone are certainly above ``limit``: every chip a
    layer's work op (not a synchronisation kind) is placed on runs at least one op of it, so
    the sum over the layers' work ops of the chips they are placed on is a floor on the op
    count. Found from the
    placements (set operations over the chips, once per alike layer), before any op is
    made: a run too large for the guard's own expansion is refused in about a second."""
    ctx = plan.ctx
    layers: dict[int, list[LogicalOp]] = {}
    for lop in build_program(ctx.model):
        if 0 <= lop.layer < ctx.model.n_layers:
            layers.setdefault(lop.layer, []).append(lop)
    floor = 0
    seen: dict[tuple, int] = {}
    for layer, lops in layers.items():
        chips = ctx.layer_chips(layer)
        kind = (tuple(lop.kind for lop in lops), chips)
        if kind not in seen:
            # a work op placed on a chip makes at least one op there (_check_floor's premise)
            seen[kind] = sum(len(ctx.place(lop)) for lop in lops if lop.kind not in SYNC_KINDS)
        floor += seen[kind]
    if floor > limit:
        _refuse(SizeEstimate(ops=floor, flows=0), limit, exact=False)


def estimate_size(plan: Plan, program: tuple[LogicalOp, ...] | None = None) -> SizeEstimate:
    """Ops and flows :func:`build_dag` would make, from the same expansion hooks and lowerings,
    without building the DAG: one layer of each kind (the same sequence of logical ops, on
    the same chips, after a layer on the same chips: so a pipeline stage's first layer is
    a kind of its own) is expanded and counted, then multiplied by the number of such
    layers. Exact as long as alike layers expand alike, which the tests check.

    """
    ctx = plan.ctx
    program = program if program is not None else plan.program()
    layers: dict[int, list[LogicalOp]] = {}
    for lop in program:
        layers.setdefault(lop.layer, []).append(lop)
    kinds: dict[tuple, list[int]] = {}
    previous: tuple[int, ...] = ()
    for layer, lops in layers.items():
        chips = ctx.layer_chips(layer) if 0 <= layer < ctx.model.n_layers else ()
        # layers alike: the same logical ops, on the same chips, after a layer on the same chips
        kinds.setdefault((tuple(lop.kind for lop in lops), chips, previous), []).append(layer)
        previous = chips
    ops = flows = 0
    flow_cache: dict = {}
    for same in kinds.values():
        n_ops = n_flows = 0
        for lop in layers[same[0]]:
            _, frag = expand(plan.context(lop.micro), lop)
            n_ops += len(frag.ops)
            for op in frag.ops:
                if type(op) is CommOp:
                    n_flows += _flow_count(op, plan, flow_cache)
        ops += n_ops * len(same)
        flows += n_flows * len(same)
    return SizeEstimate(ops=ops, flows=flows, logical_ops=len(program))


def _flow_count(op: CommOp, plan: Plan, cache: dict) -> int:
    key = (op.primitive, op.group, op.bytes_per_rank)
    if key not in cache:
        require_lowering(op, plan.primitives)
        plugin, lower = plan.primitives[op.primitive]
        try:
            cache[key] = len(lower(op.group, op.bytes_per_rank, plan.ctx.topology).flows)
        except G5Error:
            raise
        except Exception as exc:
            raise PluginError(plugin, f"lowering {op.primitive} for {op.key} raised {type(exc).__name__}: {exc}") from exc
    return cache[key]


def check_size(plan: Plan, max_ops: int | None = None, replicas: int = 1, cycles: int = CYCLES) -> SizeEstimate:
    """Refuse, before building anything, a run above ``max_ops`` ops and flows together
    (default :data:`DEFAULT_MAX_OPS`), stating the estimate and the memory it would need.
    With ``replicas > 1`` one of that many identical replicas is simulated (g5core.lower.symmetry):
    its share is what counts, estimated from the reduced plan (the cost of the check does
    not grow with the replicas). A micro-batched step counts one whole step per micro-batch
    (and per decode cycle, ``cycles`` of them, each with its token return): an upper bound,
    as a prompt chunk before the last has no LM head and the first cycle returns no tokens."""
    limit = DEFAULT_MAX_OPS if max_ops is None else max_ops
    if limit > ID_LIMIT:
        raise ConfigError("--max-ops", f"must be at most {ID_LIMIT:,} (op and flow ids are 32-bit), got {limit:,}")
    if replicas > 1:
        # one replica, the one the symmetric run builds: chips 0 .. chips/replicas - 1
        plan = attrs.evolve(plan, ctx=plan.ctx.restricted(tuple(range(plan.ctx.rankmap.chips // replicas))))
    _check_placed_floor(plan, limit)
    mb = plan.pipeline
    program = plan.program()   # once per overlap side of a split step (two-batch overlap)
    if mb is not None and mb.cycles_apply:   # each step of a cycling micro-batch (each side) gets its tokens back
        sides = range(plan.micro_batches.side_count) if plan.micro_batches.sides else (-1,)
        program = tuple(LogicalOp("token_return", EMBED_LAYER, micro=t) for t in sides) + program
    est = estimate_size(plan, program)
    if mb is not None:
        copies = mb.count * (cycles if mb.cycles_apply else 1)
        est = SizeEstimate(ops=est.ops * copies, flows=est.flows * copies, logical_ops=est.logical_ops * copies)
    if replicas > 1:
        est = attrs.evolve(est, replicas=replicas)
    if est.charged > limit:
        _refuse(est, limit, exact=True)
    return est
