"""From a deployment to a validated op DAG: the build phase, where every hook is called.

Phases (desmod-style): prepare (model, system, dimensions, rank map, local shape) ->
expand every logical op through the op-expansion hooks -> validate (placed, lowered,
acyclic, keys owned) -> hand arrays to the engine. No hook is called after this.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional

import attrs
import pluggy

from .collective import collect_primitives
from .topology import Topology
from .config import Deployment
from .dag import CommOp, ComputeOp, Fragment, OpDag, require_lowering
from .dimensions import DimensionRegistry, collect_dimensions
from .errors import ConfigError, DagError, G5Error, PluginError, ResourceError
from .flops import activation_tensor_bytes
from .layers import (
    SYNC_KINDS, LogicalOp, Work, build_program, default_work, local_kv_bytes_per_token,
)
from .models import ModelSpec, get_model
from .plugins import Hooks, describe_plugins
from .rankmap import RankMap
from .options import collect_options
from .shape import LocalShape, collect_shard_axes, merge_factors
from .systems import SystemSpec, get_system


@attrs.define(eq=False)
class BuildContext:
    """Everything a plugin may read while contributing to a run. Plugins must not mutate it."""

    deployment: Deployment
    model: ModelSpec
    system: SystemSpec
    dims: DimensionRegistry
    rankmap: RankMap
    shape: LocalShape
    topology: Topology
    hooks: Hooks = attrs.field(repr=False)
    _layer_chips: dict = attrs.field(factory=dict, repr=False)
    #: when set, the only chips ops are placed on (one replica of a symmetric run:
    #: g5core.symmetry); every other field still describes the whole cluster
    replica_chips: Optional[tuple[int, ...]] = attrs.field(default=None, repr=False)

    def restricted(self, chips: tuple[int, ...]) -> "BuildContext":
        """The same context with ops placed on ``chips`` only."""
        return attrs.evolve(self, layer_chips={}, replica_chips=tuple(chips))

    @property
    def phase(self) -> str:
        return self.deployment.phase

    def size(self, dim: str) -> int:
        return self.deployment.size(dim)

    @property
    def all_chips(self) -> tuple[int, ...]:
        return tuple(range(self.rankmap.chips))

    def layer_chips(self, layer: int) -> tuple[int, ...]:
        """Chips holding ``layer`` (intersection of every plugin's answer)."""
        if layer not in self._layer_chips:
            chips = set(self.all_chips if self.replica_chips is None else self.replica_chips)
            for plugin, answer in self.hooks.call_each("g5_layer_chips", ctx=self, layer=layer):
                chips &= _chip_set(plugin, "g5_layer_chips", answer, self.rankmap.chips)
            self._layer_chips[layer] = tuple(sorted(chips))
        return self._layer_chips[layer]

    def place(self, lop: LogicalOp) -> tuple[int, ...]:
        """Chips that run ``lop``: the layer's chips, restricted by g5_place_op answers."""
        chips = set(self.layer_chips(lop.layer))
        for plugin, answer in self.hooks.call_each("g5_place_op", ctx=self, lop=lop):
            chips &= _chip_set(plugin, "g5_place_op", answer, self.rankmap.chips)
        return tuple(sorted(chips))

    def work(self, kind: str) -> Optional[Work]:
        return default_work(kind, self.model, self.deployment, self.shape)

    def hidden_states_bytes(self, tokens: float) -> float:
        """Bytes of ``tokens`` hidden-state rows (``tokens x hidden x activation dtype``)."""
        return activation_tensor_bytes(tokens, self.model.hidden_size, self.deployment.dtypes.activation_element_bytes)

    @property
    def kv_bytes_per_token_local(self) -> float:
        """c_kv as one chip stores it (GQA heads split by TP; the MLA latent is whole)."""
        return local_kv_bytes_per_token(self.model, self.deployment, self.shape)

    def compute_dtype(self, work_or_class) -> str:
        weight_class = work_or_class.weight_class if isinstance(work_or_class, Work) else work_or_class
        d = self.deployment.dtypes
        return d.weight_dtype(weight_class) if weight_class else d.activations

    def compute_op(self, lop: LogicalOp, chip: int, work: Work, owner: str, part: str = "",
                   flops: float | None = None, hbm_bytes: float | None = None) -> ComputeOp:
        """A compute op of ``lop`` on ``chip``; ``flops``/``hbm_bytes`` override the work's."""
        return ComputeOp(
            key=lop.key(chip, part), chip=chip, op_class=work.op_class,
            flops=work.flops if flops is None else flops,
            hbm_bytes=work.hbm_bytes if hbm_bytes is None else hbm_bytes,
            layer=lop.layer, name=lop.kind, dtype=self.compute_dtype(work), owner=owner, kernels=work.kernels,
        )

    def comm_op(self, lop: LogicalOp, primitive: str, group: Iterable[int], bytes_per_rank: float,
                reason: str, owner: str, part: str) -> CommOp:
        group = tuple(group)
        return CommOp(
            key=f"{lop.prefix}.{part}@g{'-'.join(map(str, group))}" if len(group) > 2 or primitive != "p2p"
            else f"{lop.prefix}.{part}@c{group[0]}->c{group[1]}",
            primitive=primitive, group=group, bytes_per_rank=bytes_per_rank, reason=reason,
            layer=lop.layer, name=lop.kind, owner=owner,
        )


def _chip_set(plugin: str, hook: str, answer, chips: int) -> set[int]:
    try:
        out = {int(c) for c in answer}
    except TypeError:
        raise PluginError(plugin, f"{hook} must return chip ids or None, got {answer!r}") from None
    bad = [c for c in out if not 0 <= c < chips]
    if bad:
        raise PluginError(plugin, f"{hook} returned chips outside 0..{chips - 1}: {sorted(bad)[:5]}")
    return out


@attrs.define(eq=False)
class Plan:
    """A prepared run: validated deployment and everything derived from it, before the DAG."""

    pm: pluggy.PluginManager
    hooks: Hooks
    ctx: BuildContext
    primitives: Mapping


def prepare(raw_or_deployment, pm: pluggy.PluginManager, source: str = "configuration",
            max_ops: int | None = None) -> Plan:
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
    model = get_model(deployment.model)
    system = get_system(deployment.system)
    for _plugin, _ in hooks.call_each("g5_validate_deployment", deployment=deployment, model=model, system=system):
        pass
    factors = merge_factors(hooks.call_each("g5_shard_factors", deployment=deployment, model=model), axes)
    shape = LocalShape.from_factors(deployment, model, factors)
    _check_floor(deployment, model, max_ops)
    sizes = dict(deployment.parallel)
    try:
        rankmap = RankMap.build(sizes, dims, system.chips_per_node)
    except ValueError as exc:
        raise ConfigError("parallel", str(exc)) from None
    topology = make_topology(hooks, system, rankmap.chips)
    ctx = BuildContext(deployment, model, system, dims, rankmap, shape, topology, hooks)
    return Plan(pm=pm, hooks=hooks, ctx=ctx, primitives=collect_primitives(hooks))


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
    work = ctx.work(lop.kind)
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
              chips: tuple[int, ...] | None = None) -> OpDag:
    """The op DAG; with ``chips``, only the ops placed on them (one symmetric replica)."""
    ctx = plan.ctx if chips is None else plan.ctx.restricted(chips)
    program = program if program is not None else build_program(ctx.model)
    dag = OpDag()
    chips = ctx.rankmap.chips
    outputs: dict[str, dict[int, tuple[str, ...]]] = {}
    # the per-op work below is OpDag.add_op / add_edge inlined (millions of ops)
    index, append, pairs = dag.index, dag.append, dag.edge_pairs
    for lop in program:
        owner, frag = expand(ctx, lop)
        own = set()
        prefixes = (lop.prefix + ".", lop.prefix + "@")
        rep = frag.repeated
        if rep is not None:
            _check_replicated(rep, prefixes, owner, chips)
            keys = rep.keys()
            if not index.keys().isdisjoint(keys):
                for op in rep.ops():
                    if op.key in index:
                        dag.add_op(op)  # names both owners
            dag.extend_replicated(rep)
            own.update(keys)
        for op in frag._ops:
            key = op.key
            if not (type(op) is ComputeOp and type(op.chip) is int and 0 <= op.chip < chips
                    and key.startswith(prefixes)):
                _check_op(op, prefixes, owner, chips, plan.primitives)
            if key in index:
                dag.add_op(op)  # names both owners
            append(op)
            own.add(key)
        for a, b in frag.edges:
            if a not in own or b not in own:
                raise DagError(f"{lop.id}: plugin '{owner}' made an edge {a!r} -> {b!r} between ops it does not own")
            pairs.extend((index[a], index[b]))
        inputs: dict[int, list[str]] = {}
        for name in lop.inputs:
            for chip, keys in outputs[name].items():
                inputs.setdefault(chip, []).extend(keys)
        for chip, keys in frag.heads:
            for k in keys:
                if k not in own:
                    raise DagError(f"{lop.id}: plugin '{owner}' names head {k!r}, which it did not make")
                ik = index[k]
                for src in inputs.get(chip, ()):
                    pairs.extend((index[src], ik))
        out = {c: tuple(dict.fromkeys(keys)) for c, keys in inputs.items()}
        for chip, keys in frag.tails:
            for k in keys:
                if k not in own:
                    raise DagError(f"{lop.id}: plugin '{owner}' names tail {k!r}, which it did not make")
            out[chip] = keys
        outputs[lop.id] = out
    return dag


def _check_replicated(rep, prefixes: tuple[str, str], owner: str, chips: int) -> None:
    """The checks of :func:`_check_op` on every op of a replicated template, made once."""
    if type(rep.template) is not ComputeOp:
        raise PluginError(owner, f"Fragment.replicated needs a ComputeOp template, got {rep.template!r}")
    if not (rep.stem + "@").startswith(prefixes):
        raise DagError(f"op {rep.key(rep.chips[0] if rep.chips else 0)!r} made by plugin '{owner}' does not start "
                       f"with its logical op's prefix {prefixes[0][:-1]!r}")
    for c in rep.chips:
        if not (type(c) is int and 0 <= c < chips):
            raise DagError(f"op {rep.key(c)!r} made by plugin '{owner}' is placed on chip {c!r}, outside 0..{chips - 1}")


def _check_op(op, prefixes: tuple[str, str], owner: str, chips: int, primitives: Mapping) -> None:
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
            raise DagError(f"op {op.key!r} made by plugin '{owner}' is placed on chip {c!r}, outside 0..{chips - 1}")


# ----------------------------------------------------------------------------------------
# Size guard: the op and flow count, estimated before the DAG is built
# ----------------------------------------------------------------------------------------

#: Ops plus flows a run may build unless ``--max-ops`` says otherwise: about 2 GiB of
#: memory and 22 s on the 2-core development machine (the figures below).
DEFAULT_MAX_OPS = 4_000_000
#: Peak memory per op or flow: the llama-3.1-405b 1M-token benchmark with every chip
#: simulated (README, `benchmarks/bench.py`, case llama-3.1-405b-1m-cp16-256chips-nosym,
#: 2026-12-01, columnar op DAG, median of three runs) peaks at 821 MiB for 1,169,568 ops +
#: 612,864 flows = 483 B each (rounded up).
PEAK_BYTES_PER_OP = 500
#: Wall time per op or flow on the same runs: 10.05 s / 1,782,432 = 5.6 us.
WALL_S_PER_OP = 5.6e-6


@attrs.frozen
class SizeEstimate:
    ops: int
    flows: int
    replicas: int = 1   # identical replicas, of which these ops and flows are one (g5core.symmetry)

    @property
    def total(self) -> int:
        return self.ops + self.flows

    @property
    def memory_bytes(self) -> int:
        return self.total * PEAK_BYTES_PER_OP

    @property
    def wall_s(self) -> float:
        return self.total * WALL_S_PER_OP

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
    sample = attrs.evolve(model, n_layers=min(model.n_layers, first + 1))  # one dense and one MoE layer
    per_layer: dict[int, int] = {}
    for lop in build_program(sample):
        if lop.kind not in SYNC_KINDS and 0 <= lop.layer < sample.n_layers:
            per_layer[lop.layer] = per_layer.get(lop.layer, 0) + 1
    floor = max(deployment.chips, model.n_layers) * min(per_layer.values(), default=1)
    if floor > limit:
        _refuse(SizeEstimate(ops=floor, flows=0), limit, exact=False)


def _refuse(est: "SizeEstimate", limit: int, exact: bool) -> None:
    what = est.describe() if exact else est.describe().replace("about", "at least", 1)
    raise ResourceError(f"this deployment would simulate {what}, above the limit of {limit:,} ops and flows; "
                        f"use fewer chips or layers, or raise the limit with --max-ops {est.total}")


def estimate_size(plan: Plan, program: tuple[LogicalOp, ...] | None = None) -> SizeEstimate:
    """Ops and flows :func:`build_dag` would make, from the same expansion hooks and lowerings,
    without building the DAG: one layer of each kind (the same sequence of logical ops, on
    the same chips, after a layer on the same chips: so a pipeline stage's first layer is
    a kind of its own) is expanded and counted, then multiplied by the number of such
    layers. Exact as long as alike layers expand alike, which the tests check.

    """
    ctx = plan.ctx
    program = program if program is not None else build_program(ctx.model)
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
            _, frag = expand(ctx, lop)
            n_ops += len(frag.ops)
            for op in frag.ops:
                if type(op) is CommOp:
                    n_flows += _flow_count(op, plan, flow_cache)
        ops += n_ops * len(same)
        flows += n_flows * len(same)
    return SizeEstimate(ops=ops, flows=flows)


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


def check_size(plan: Plan, max_ops: int | None = None, replicas: int = 1) -> SizeEstimate:
    """Refuse, before building anything, a run above ``max_ops`` ops and flows together
    (default :data:`DEFAULT_MAX_OPS`), stating the estimate and the memory it would need.
    With ``replicas > 1`` one of that many identical replicas is simulated (g5core.symmetry):
    its share is what counts."""
    limit = DEFAULT_MAX_OPS if max_ops is None else max_ops
    est = estimate_size(plan)
    if replicas > 1:
        est = SizeEstimate(ops=est.ops // replicas, flows=est.flows // replicas, replicas=replicas)
    if est.total > limit:
        _refuse(est, limit, exact=True)
    return est
