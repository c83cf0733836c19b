"""The plugin contract suite: checks any G5 plugin, built-in or third-party, runs on itself.

In the spirit of scikit-learn's ``parametrize_with_checks``: a plugin author gives the
plugin's name and a few raw configurations that make it active, and gets back named
checks of the extension contract (:mod:`g5core.api.hookspecs`). Each check also runs on
every configuration's step variant (:func:`step_variant`: the same deployment on a mixed
step, or on a partial prefill or decode at two context lengths where cp > 1 refuses a mixed
step), wherever the plugins accept it::

    from g5core.testing import CHECKS, applicable_checks

    CONFIGS = [{"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 4,
                "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "sp": 4},
                "phase": "prefill", "batch": 1, "seq_len": 4096}]

    @pytest.mark.parametrize("check", applicable_checks("ulysses"))
    def test_ulysses_contract(check):
        CHECKS[check]("ulysses", CONFIGS)

(``plugin_checks(name, configs)`` gives the same checks as ``(name, bound callable)`` pairs),
or, in one call that raises one :class:`ContractError` listing every failure,
``check_plugin("ulysses", CONFIGS)``. A plugin that is not installed through the
``g5.plugins`` entry points is passed as ``extra_plugins=(("ulysses", module),)``.

Every check has the signature ``check(plugin_name, configs, extra_plugins=())``, raises
:class:`ContractError` (an ``AssertionError``) naming the plugin, the check and what is
wrong, and returns ``None`` when the contract holds. ``HOOK_CHECKS`` maps every hook of
:mod:`g5core.api.hookspecs` to the checks that test it; :func:`check_hook_coverage` (the
meta-check) fails when a hook is added without a check or a docstring.

The checks only call the build phase (:func:`g5core.lower.builder.plan_deployment`, :func:`~g5core.lower.builder.expand`,
:func:`~g5core.lower.builder.build_dag`), the plugins' own hook implementations through the
:class:`~g5core.api.plugins.Hooks` facade, and, for communication primitives, the engine on a
one-op DAG. Use small models (a Hugging Face ``config.json`` with two layers) to keep them fast.
"""
from __future__ import annotations

import functools
import inspect
import json
import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import attrs
import networkx as nx

from g5core.api import hookspecs
from g5core.lower.builder import Plan, build_dag, check_op, expand, plan_deployment
from g5core.api.records import Lowering
from g5core.lower.topology import Topology
from g5core.inputs.config import TOP_LEVEL_KEYS, all_disabled
from g5core.lower.kernels import scaled_kernel
from g5core.sim.compute import answer_seconds
from g5core.api.ops import CommOp, ComputeOp, Fragment
from g5core.lower.dag import OpDag
from g5core.api.dimensions import collect_dimensions
from g5core.api.errors import ConfigError, DagError, G5Error, PluginError
from g5core.lower.layers import SYNC_KINDS, build_program, iter_layers
from g5core.api.records import CATEGORIES, MemoryTerm, StepRules
from g5core.inputs.step import Step, StepGroup
from g5core.lower.steprules import checked_split
from g5core.api.work import LogicalOp
from g5core.sim.memory import memory_report
from g5core.api.plugins import Hooks, describe_plugins, make_plugin_manager
from g5core.lower.shape import SHARD_AXES
from g5core.api.options import collect_options
from g5core.lower.microbatch import PipelineMicrobatches
from g5core.lower.shape import collect_shard_axes
from g5core.serve.registry import serving_registry
from g5core.serve.scheduler import SchedulerSettings
from g5core.serve.traces import BUILTIN_FORMATS
from g5core.sim.compile import compile_dag, compile_ops
from g5core.sim.engine import Engine
from g5core.study.sweep import collect_presets

__all__ = [
    "CHECKS", "ContractError", "applicable_checks", "GENERAL_CHECKS", "GUARD_HOOKS", "HOOK_CHECKS", "check_plugin",
    "check_hook_coverage", "hook_names", "plugin_checks", "plugin_contributions",
]

# Hooks whose contract answer in a valid configuration is "no objection" (None): a
# configuration cannot show them contributing anything.
GUARD_HOOKS = frozenset({"g5_validate_deployment", "g5_require_owner"})

# Byte sizes (multiples of a base payload) a primitive is lowered at to check that its cost
# grows with the bytes; 0 checks that an empty message still lowers.
_BYTE_SCALES = (0.0, 0.5, 1.0, 2.0, 4.0)
_DEFAULT_PROBE_BYTES = float(2 ** 20)


class ContractError(AssertionError):
    """A plugin broke the extension contract; the message names the plugin and the check."""

    def __init__(self, plugin: str, check: str, message: str):
        self.plugin, self.check = plugin, check
        super().__init__(f"plugin '{plugin}' fails {check}: {message}")


# ----------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------


def hook_names() -> tuple[str, ...]:
    """Every hook specification in :mod:`g5core.api.hookspecs`, in definition order."""
    return tuple(name for name, f in vars(hookspecs).items()
                 if callable(f) and hasattr(f, "g5_spec"))


def _given_configs(configs) -> tuple[Mapping, ...]:
    """The raw configurations given (one mapping or several), checked to be mappings."""
    if isinstance(configs, Mapping):
        configs = (configs,)
    configs = tuple(configs)
    if not configs:
        raise ValueError("give at least one raw configuration that makes the plugin active")
    for c in configs:
        if not isinstance(c, Mapping):
            raise TypeError(f"a configuration must be a raw mapping, got {type(c).__name__}")
    return configs


def _as_configs(configs, extra_plugins: Sequence = (), verify: bool = True) -> tuple[Mapping, ...]:
    """The configurations given, each followed by its step variants (:func:`step_variant`,
    :func:`verify_variant`) where the plugins accept them: every check also runs the plugin
    on a mixed step and on a speculative verification step."""
    configs = _given_configs(configs)
    out = list(configs)
    for c in configs:
        for variant in (step_variant(c), verify_variant(c) if verify else None):
            if variant is not None and variant not in out and _accepted(variant, tuple(extra_plugins)):
                out.append(variant)
    return tuple(out)


#: drafts per sequence of the contract suite's verification step
VERIFY_DRAFT_TOKENS = 2


def verify_variant(raw: Mapping) -> Mapping | None:
    """A decode configuration in the shorthand run as the verification step of a speculative
    decode instead (``b`` sequences each verifying ``VERIFY_DRAFT_TOKENS`` drafts after ``S - 1``
    cached tokens, :meth:`g5core.inputs.step.Step.verify`), so every check also sees the step
    shape of speculative decoding. None for any other configuration."""
    if "step" in raw or raw.get("phase") != "decode" or not all(k in raw for k in ("batch", "seq_len")):
        return None
    b, s = raw["batch"], raw["seq_len"]
    if not (isinstance(b, int) and isinstance(s, int) and b > 0 and s > 1):
        return None
    out = {k: v for k, v in raw.items() if k not in ("phase", "batch", "seq_len")}
    out["step"] = Step.verify(b, s, VERIFY_DRAFT_TOKENS).to_list()
    return out


def step_variant(raw: Mapping) -> Mapping | None:
    """A configuration given in the shorthand (``phase``, ``batch: b``, ``seq_len: S``) run
    as a step of several kinds of sequences instead, for the contract suite:

    - ``cp = 1``: a mixed step, ``b`` prompts of ``S`` new tokens after ``S`` cached ones
      and ``b * S`` decode sequences at context ``S`` (``2 b S`` new tokens: divisible by
      whatever divides ``b`` or ``S``);
    - ``cp > 1`` (where a mixed step is refused), prefill: a partial prefill, ``b`` prompts
      of ``S`` new tokens after ``S`` cached; decode: decode at two context lengths, ``S``
      and ``2 S``.

    None for a configuration that already gives a ``step:``."""
    if "step" in raw or not all(k in raw for k in ("phase", "batch", "seq_len")):
        return None
    b, s, phase = raw["batch"], raw["seq_len"], raw["phase"]
    if not (isinstance(b, int) and isinstance(s, int) and b > 0 and s > 1):
        return None
    par = raw.get("parallel")
    cp = par.get("cp", 1) if isinstance(par, Mapping) else 1
    if cp == 1:
        step = [{"new_tokens": s, "cached_tokens": s, "count": b}, {"new_tokens": 1, "cached_tokens": s - 1, "count": b * s}]
    elif phase == "prefill":
        step = [{"new_tokens": s, "cached_tokens": s, "count": b}]
    else:
        step = [{"new_tokens": 1, "cached_tokens": s - 1, "count": b}, {"new_tokens": 1, "cached_tokens": 2 * s - 1,
                                                                         "count": b}]
    out = {k: v for k, v in raw.items() if k not in ("phase", "batch", "seq_len")}
    out["step"] = step
    return out


_ACCEPTED: dict = {}


def _accepted(raw: Mapping, extra_plugins: tuple) -> bool:
    """Whether the enabled plugins accept ``raw`` (a ConfigError: a step they refuse)."""
    # the plugin objects themselves, not only their names: two plugins given under one name
    # (the contract suite's broken plugins) are two answers; each entry keeps its plugins, so
    # their ids are not reused while it is cached
    key = (json.dumps(raw, sort_keys=True, default=str), tuple((name, id(obj)) for name, obj in extra_plugins))
    if key not in _ACCEPTED:
        try:
            _plan(raw, extra_plugins)
            _ACCEPTED[key] = (True, extra_plugins)
        except ConfigError:
            _ACCEPTED[key] = (False, extra_plugins)
    return _ACCEPTED[key][0]


def _pm(extra_plugins: Sequence, disabled: Iterable[str] = (), raw: Mapping | None = None):
    return make_plugin_manager(disabled=all_disabled(raw, disabled), extra_plugins=tuple(extra_plugins))


def _plan(raw: Mapping, extra_plugins: Sequence, disabled: Iterable[str] = ()) -> Plan:
    return plan_deployment(raw, _pm(extra_plugins, disabled, raw))


def _own_impls(hooks: Hooks, hook_name: str, plugin: str) -> list:
    return hooks.plugin_implementations(hook_name, plugin)


def _call_own(hooks: Hooks, hook_name: str, plugin: str, **kwargs) -> list:
    """Answers of ``plugin``'s own implementations of ``hook_name`` (None included)."""
    return [Hooks.call_impl(impl, hook_name, kwargs) for impl in _own_impls(hooks, hook_name, plugin)]


def _implemented_hooks(plugin: str, extra_plugins: Sequence) -> tuple[str, ...]:
    pm = _pm(extra_plugins)
    obj = pm.get_plugin(plugin)
    if obj is None:
        known = ", ".join(sorted(name for name, _ in pm.list_name_plugin()))
        raise ValueError(f"no plugin named '{plugin}' is installed or given in extra_plugins (known: {known})")
    return tuple(sorted(h.name for h in (pm.get_hookcallers(obj) or ())))


def _fail(plugin: str, check: Callable | str, message: str) -> ContractError:
    return ContractError(plugin, getattr(check, "__name__", str(check)), message)


def _where(raw: Mapping) -> str:
    par = raw.get("parallel", {})
    par = " ".join(f"{k}={v}" for k, v in sorted(par.items())) if isinstance(par, Mapping) else str(par)
    opts = {k: v for k, v in (raw.get("plugins") or {}).items() if k != "disable"} if isinstance(raw.get("plugins"), Mapping) else {}
    legacy = " ".join(f"{k}={v}" for k, v in sorted(raw.items()) if k not in TOP_LEVEL_KEYS)  # e.g. tp_sp
    work = raw.get("phase") if "step" not in raw else f"step {raw.get('step')}"
    return f"[{raw.get('model')} {work} {par}{' ' + str(opts) if opts else ''}{' ' + legacy if legacy else ''}]"


def _chips_ok(chips: Iterable, n: int) -> bool:
    return all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < n for c in chips)


def _contract_check(f: Callable[..., None]) -> Callable[..., None]:
    """Report the core's refusal of what the plugin made (a PluginError naming it, a DagError
    quoting it) as a breach of the check, not as an unexplained error."""

    @functools.wraps(f)
    def wrapper(plugin: str, configs, extra_plugins: Sequence = ()) -> None:
        try:
            return f(plugin, configs, extra_plugins)
        except ContractError:
            raise
        except PluginError as exc:
            if exc.plugin != plugin:
                raise
            raise _fail(plugin, f, f"the core refused it: {exc}") from exc
        except DagError as exc:
            if f"plugin '{plugin}'" not in str(exc):
                raise
            raise _fail(plugin, f, f"the core refused its DAG: {exc}") from exc

    return wrapper


# ----------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------


@_contract_check
def check_configs_exercise_plugin(plugin: str, configs, extra_plugins: Sequence = ()) -> None:
    """The configurations make the plugin active, so the other checks are not vacuous.

    For every hook the plugin implements, except the guard hooks (``GUARD_HOOKS``, whose
    contract answer in a valid configuration is ``None``), at least one configuration must
    show it contributing: a registered dimension or primitive, a shard factor, a layer or
    op placement, a claimed logical op, a memory term, or a compute latency.
    """
    configs = _as_configs(configs, extra_plugins)
    implemented = set(_implemented_hooks(plugin, extra_plugins)) - GUARD_HOOKS
    seen: dict[str, int] = {h: 0 for h in implemented}
    for raw in configs:
        for hook, count in plugin_contributions(plugin, raw, extra_plugins).items():
            if hook in seen:
                seen[hook] += count
    idle = sorted(h for h, n in seen.items() if n == 0)
    if idle:
        raise _fail(plugin, check_configs_exercise_plugin,
                    f"no configuration makes it contribute through {', '.join(idle)}; add one that does "
                    f"(e.g. a parallel size > 1 of the dimension it owns)")


@_contract_check
def check_dimensions(plugin: str, configs, extra_plugins: Sequence = ()) -> None:
    """``g5_register_dimensions``: what the plugin registers is owned by it and disappears with it.

    Every dimension the plugin registers is recorded with ``owner == plugin``; registering
    is deterministic (a second plugin manager registers the same dimensions); each has a
    ``doc`` line; and with the plugin disabled none of its dimensions is registered (or a
    plugin that regroups them refuses with a :class:`~g5core.api.errors.G5Error`).
    """
    pm = _pm(extra_plugins)
    dims = collect_dimensions(Hooks(pm))
    own = [d for d in dims.dims if d.owner == plugin]
    again = [d for d in collect_dimensions(Hooks(_pm(extra_plugins))).dims if d.owner == plugin]
    if own != again:
        raise _fail(plugin, check_dimensions, f"registers different dimensions on two calls: {own} vs {again}")
    for d in own:
        if not d.doc:
            raise _fail(plugin, check_dimensions, f"dimension '{d.name}' has no doc string (shown by `g5 explain`)")
    try:
        off = collect_dimensions(Hooks(_pm(extra_plugins, disabled=[plugin])))
    except G5Error:
        return  # another plugin needs these dimensions and says so: a clear error, not a fallback
    left = sorted({d.name for d in own} & set(off.names))
    if left:
        raise _fail(plugin, check_dimensions, f"dimensions {left} are still registered with the plugin disabled")


@_contract_check
def check_options(plugin: str, configs, extra_plugins: Sequence = ()) -> None:
    """``g5_register_options``: the plugin's options are its own, documented, stable and validated.

    Every declared option is recorded with ``owner == plugin`` and has a doc line; declaring
    is deterministic; each configuration's deployment holds a value for every option; an
    unknown option under ``plugins.<plugin>`` is a :class:`~g5core.api.errors.ConfigError` naming
    that field; and with the plugin disabled none of its options is declared.
    """
    own = collect_options(Hooks(_pm(extra_plugins))).of(plugin)
    if own != collect_options(Hooks(_pm(extra_plugins))).of(plugin):
        raise _fail(plugin, check_options, "declares different options on two calls")
    for o in own:
        if not o.doc:
            raise _fail(plugin, check_options, f"option '{o.name}' has no doc string")
    for raw in _as_configs(configs, extra_plugins):
        dep = _plan(raw, extra_plugins).ctx.deployment
        for o in own:
            if dep.option(plugin, o.name, _MISSING) is _MISSING:
                raise _fail(plugin, check_options, f"{_where(raw)}: the deployment has no value for option '{o.name}'")
        bad = dict(raw)
        section = dict(bad.get("plugins") or {})
        section[plugin] = dict(section.get(plugin) or {}, no_such_option_x=True)
        bad["plugins"] = section
        try:
            _plan(bad, extra_plugins)
        except G5Error as exc:
            if getattr(exc, "field", "") != f"plugins.{plugin}.no_such_option_x":
                raise _fail(plugin, check_options, f"an unknown option is refused naming {exc}, not the option") from exc
        else:
            raise _fail(plugin, check_options, f"{_where(raw)}: an unknown option under plugins.{plugin} is accepted")
    if collect_options(Hooks(_pm(extra_plugins, disabled=[plugin]))).of(plugin):
        raise _fail(plugin, check_options, "its options are still declared with the plugin disabled")


_MISSING = object()


@_contract_check
def check_shard_axes(plugin: str, configs, extra_plugins: Sequence = ()) -> None:
    """``g5_register_shard_axes``: the plugin's axes reach the local shape and leave with it.

    Each configuration's local shape has a factor for every registered axis (1 when nobody
    divides it); registering is deterministic; with the plugin disabled the axes are gone.
    """
    axes = collect_shard_axes(Hooks(_pm(extra_plugins)))
    if axes != collect_shard_axes(Hooks(_pm(extra_plugins))):
        raise _fail(plugin, check_shard_axes, "registers different axes on two calls")
    own = tuple(a for a in axes if a not in SHARD_AXES)
    try:
        off = collect_shard_axes(Hooks(_pm(extra_plugins, disabled=[plugin])))
    except G5Error:
        off = SHARD_AXES
    mine = tuple(a for a in own if a not in off)
    if not mine:
        raise _fail(plugin, check_shard_axes, "registers no axis of its own (or they stay registered when disabled)")
    for raw in _as_configs(configs, extra_plugins):
        factors = dict(_plan(raw, extra_plugins).ctx.shape.factors)
        missing = [a for a in mine if a not in factors]
        if missing:
            raise _fail(plugin, check_shard_axes, f"{_where(raw)}: axes {missing} are not in the local shape")


@_contract_check
def check_validate_deployment(plugin: str, configs, extra_plugins: Sequence = ()) -> None:
    """``g5_validate_deployment``: on a valid configuration the plugin's guard returns ``None``.

    The hook's contract is to raise :class:`~g5core.api.errors.ConfigError` or return ``None``;
    a plugin returning a value would be ignored silently. Called twice, it answers the same.
    """
    for raw in _as_configs(configs, extra_plugins):
        plan = _plan(raw, extra_plugins)
        ctx = plan.ctx
        for _ in range(2):
            for answer in _call_own(plan.hooks, "g5_validate_deployment", plugin,
                                    deployment=ctx.deployment, model=ctx.model, system=ctx.system):
                if answer is not None:
                    raise _fail(plugin, check_validate_deployment,
                                f"{_where(raw)} returned {answer!r}; raise ConfigError or return None")


def _stable_deployment_answers(plugin: str, check, raw: Mapping, extra_plugins: Sequence, hook: str,
                              comparable=lambda a: a):
    """The prepared context of ``raw`` and ``plugin``'s answers to ``hook(deployment, model)``,
    which must be the same on two calls (compared through ``comparable``)."""
    ctx = _plan(raw, extra_plugins).ctx
    first = _call_own(ctx.hooks, hook, plugin, deployment=ctx.deployment, model=ctx.model)
    second = _call_own(ctx.hooks, hook, plugin, deployment=ctx.deployment, model=ctx.model)
    if [comparable(a) for a in first] != [comparable(a) for a in second]:
        raise _fail(plugin, check, f"{_where(raw)} answers differ between two calls")
    return ctx, first


@_contract_check
def check_pipeline_microbatches(plugin: str, configs, extra_plugins: Sequence = ()) -> None:
    """``g5_pipeline_microbatches``: ``None`` or a :class:`~g5core.lower.microbatch.PipelineMicrobatches` whose
    parts are the step's (decode batches of ``batch`` sequences, prefill chunks adding up
    to ``seq_len``), the same on two calls.
    """
    for raw in _as_configs(configs, extra_plugins):
        ctx, answers = _stable_deployment_answers(plugin, check_pipeline_microbatches, raw, extra_plugins, "g5_pipeline_microbatches")
        for answer in answers:
            if answer is None:
                continue
            if not isinstance(answer, PipelineMicrobatches):
                raise _fail(plugin, check_pipeline_microbatches, f"{_where(raw)} returned {answer!r}, not PipelineMicrobatches")
            answer.check(ctx.deployment, plugin)


@_contract_check
def check_shard_factors(plugin: str, configs, extra_plugins: Sequence = ()) -> None:
    """``g5_shard_factors``: ``None`` or a mapping of known shard axes to positive ints, stable.

    Axes must be among :data:`g5core.lower.shape.SHARD_AXES` or the registered ones, values positive ``int`` (not bool);
    two calls on the same deployment give equal answers.
    """
    for raw in _as_configs(configs, extra_plugins):
        ctx, answers = _stable_deployment_answers(plugin, check_shard_factors, raw, extra_plugins, "g5_shard_factors",
                                                  lambda a: dict(a) if a else a)
        for answer in answers:
            if answer is None:
                continue
            if not isinstance(answer, Mapping):
                raise _fail(plugin, check_shard_factors, f"{_where(raw)} returned {answer!r}, not a mapping")
            for axis, value in answer.items():
                if axis not in dict(ctx.shape.factors):
                    raise _fail(plugin, check_shard_factors, f"{_where(raw)} unknown shard axis {axis!r}")
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise _fail(plugin, check_shard_factors, f"{_where(raw)} factor {axis}={value!r} is not a positive int")


@_contract_check
def check_placement(plugin: str, configs, extra_plugins: Sequence = ()) -> None:
    """``g5_layer_chips`` / ``g5_place_op``: answers are chip ids in range, and nothing is left unplaced.

    Each answer of the plugin is ``None`` or chip ids in ``0..chips-1``; after every
    plugin's answers are intersected, every layer (embedding, decoder layers, head) is held
    by at least one chip and every logical op that does work runs on at least one chip.
    """
    for raw in _as_configs(configs, extra_plugins):
        plan = _plan(raw, extra_plugins)
        ctx = plan.ctx
        n = ctx.rankmap.chips
        for layer in iter_layers(ctx.model):
            for answer in _call_own(plan.hooks, "g5_layer_chips", plugin, ctx=ctx, layer=layer):
                if answer is not None and not _chips_ok(list(answer), n):
                    raise _fail(plugin, check_placement, f"{_where(raw)} layer {layer}: chips {answer!r} outside 0..{n - 1}")
            if not ctx.layer_chips(layer):
                raise _fail(plugin, check_placement, f"{_where(raw)} layer {layer} is held by no chip")
        for lop in build_program(ctx.model):
            for answer in _call_own(plan.hooks, "g5_place_op", plugin, ctx=ctx, lop=lop):
                if answer is not None and not _chips_ok(list(answer), n):
                    raise _fail(plugin, check_placement, f"{_where(raw)} {lop.id}: chips {answer!r} outside 0..{n - 1}")
            if lop.kind not in SYNC_KINDS and not ctx.place(lop):
                raise _fail(plugin, check_placement, f"{_where(raw)} {lop.id} is placed on no chip")


def _check_fragment(plugin: str, raw: Mapping, lop, frag: Fragment, n_chips: int, primitives) -> None:
    check = check_fragments
    where = f"{_where(raw)} {lop.id}"
    keys = [op.key for op in frag.ops]
    if len(set(keys)) != len(keys):
        raise _fail(plugin, check, f"{where}: op keys made twice: {sorted(k for k in set(keys) if keys.count(k) > 1)[:3]}")
    own = set(keys)
    by_key = {op.key: op for op in frag.ops}
    for op in frag.ops:
        try:
            check_op(op, (lop.prefix + ".", lop.prefix + "@"), plugin, n_chips, primitives)
        except (DagError, PluginError) as exc:
            raise _fail(plugin, check, f"{where}: {exc}") from None
        if op.owner != plugin:
            raise _fail(plugin, check, f"{where}: op {op.key!r} has owner {op.owner!r}, not the plugin that made it")
    for a, b in frag.edges:
        if a not in own or b not in own:
            raise _fail(plugin, check, f"{where}: edge {a!r} -> {b!r} references an op outside its fragment")
    g = nx.DiGraph()
    g.add_nodes_from(keys)
    g.add_edges_from(frag.edges)
    if not nx.is_directed_acyclic_graph(g):
        cycle = " -> ".join(u for u, _ in nx.find_cycle(g))
        raise _fail(plugin, check, f"{where}: the fragment has a cycle: {cycle}")
    for label, entries in (("head", frag.heads), ("tail", frag.tails)):
        for chip, ks in entries:
            if not (0 <= chip < n_chips):
                raise _fail(plugin, check, f"{where}: {label} on chip {chip}, outside 0..{n_chips - 1}")
            for k in ks:
                if k not in own:
                    raise _fail(plugin, check, f"{where}: {label} {k!r} on chip {chip} is not an op of the fragment")
                if chip not in by_key[k].chips:
                    raise _fail(plugin, check, f"{where}: {label} {k!r} is named on chip {chip}, which it does not run on")


@_contract_check
def check_fragments(plugin: str, configs, extra_plugins: Sequence = ()) -> None:
    """``g5_expand_op``: every fragment the plugin returns is a well-formed, self-contained DAG piece.

    For every logical op the plugin claims (:func:`g5core.lower.builder.expand` names it as owner):
    the fragment's ops and edges form an acyclic graph (networkx); edges, heads and tails
    name only the fragment's own ops; a head or tail on chip ``c`` names an op that runs on
    ``c``; op keys are unique and start with the logical op's prefix (``lop.prefix`` then
    ``.`` or ``@``); every op's ``owner`` is the plugin; chips are in range; a comm op has
    a group of at least two distinct chips and a registered primitive. The whole DAG then
    builds (:func:`g5core.lower.builder.build_dag`) and its ops owned by the plugin are exactly
    those of its fragments, field for field (a :meth:`~g5core.api.ops.Fragment.tiled` or
    ``replicated`` fragment, stored as columns, reads back as the ops it stands for).
    """
    for raw in _as_configs(configs, extra_plugins):
        plan = _plan(raw, extra_plugins)
        ctx = plan.ctx
        made: dict[str, object] = {}
        for lop in plan.program():
            owner, frag = expand(plan.context(lop.micro), lop)
            if owner != plugin:
                continue
            _check_fragment(plugin, raw, lop, frag, ctx.rankmap.chips, plan.primitives)
            made.update((op.key, op) for op in frag.ops)
        dag = build_dag(plan)
        # the ops as built (a tiled or replicated fragment is stored as columns) equal the
        # ones its fragments read as
        in_dag = {op.key: op for op in dag.ops if op.owner == plugin}
        if in_dag != made:
            extra = sorted(k for k in in_dag.keys() | made.keys() if in_dag.get(k) != made.get(k))[:3]
            raise _fail(plugin, check_fragments, f"{_where(raw)}: ops owned by the plugin in the DAG differ from its "
                                                 f"fragments (e.g. {extra})")


@_contract_check
def check_require_owner(plugin: str, configs, extra_plugins: Sequence = ()) -> None:
    """``g5_require_owner``: the guard answers ``None`` or a non-empty one-line message.

    Asked for every logical op of each configuration; a message must name the fix in one
    line (it becomes the CLI's one-line ``g5: error: ...``).
    """
    for raw in _as_configs(configs, extra_plugins):
        plan = _plan(raw, extra_plugins)
        for lop in build_program(plan.ctx.model):
            for answer in _call_own(plan.hooks, "g5_require_owner", plugin, ctx=plan.ctx, lop=lop):
                if answer is None:
                    continue
                if not isinstance(answer, str) or not answer.strip() or "\n" in answer:
                    raise _fail(plugin, check_require_owner,
                                f"{_where(raw)} {lop.id}: answered {answer!r}; return None or a one-line message")


@_contract_check
def check_memory_terms(plugin: str, configs, extra_plugins: Sequence = ()) -> None:
    """``g5_memory_terms``: named, categorised, non-negative per-chip terms the report accepts.

    Every term is a :class:`~g5core.api.records.MemoryTerm` with a category in
    :data:`g5core.sim.memory.CATEGORIES`, bytes ``>= 0`` and finite on chips in range, names
    unique; :func:`g5core.sim.memory.memory_report` accepts them and each chip's total is at
    least the plugin's terms on it.
    """
    for raw in _as_configs(configs, extra_plugins):
        plan = _plan(raw, extra_plugins)
        ctx = plan.ctx
        n = ctx.rankmap.chips
        names: list[str] = []
        own: list[MemoryTerm] = []
        for answer in _call_own(plan.hooks, "g5_memory_terms", plugin, ctx=ctx):
            for term in answer or ():
                if not isinstance(term, MemoryTerm):
                    raise _fail(plugin, check_memory_terms, f"{_where(raw)} yielded {term!r}, not a MemoryTerm")
                if term.category not in CATEGORIES:
                    raise _fail(plugin, check_memory_terms, f"{_where(raw)} term {term.name!r}: bad category")
                for chip, nbytes in term.bytes_per_chip:
                    if not (0 <= chip < n):
                        raise _fail(plugin, check_memory_terms, f"{_where(raw)} term {term.name!r} on chip {chip}")
                    if not (math.isfinite(nbytes) and nbytes >= 0):
                        raise _fail(plugin, check_memory_terms,
                                    f"{_where(raw)} term {term.name!r} has {nbytes!r} bytes on chip {chip}")
                names.append(term.name)
                own.append(term)
        if len(set(names)) != len(names):
            raise _fail(plugin, check_memory_terms, f"{_where(raw)} term names repeat: {names}")
        report = memory_report(ctx)
        for cm in report.per_chip:
            mine = sum(t.on(cm.chip) for t in own)
            if cm.total_bytes < mine or cm.total_bytes < 0:
                raise _fail(plugin, check_memory_terms, f"{_where(raw)} chip {cm.chip}: total {cm.total_bytes} < own {mine}")


def _probe_args(plan: Plan, chips_needed: int) -> dict[str, Any]:
    """:func:`~g5core.sim.compile.compile_ops`'s arguments for ``plan``'s ops on a topology of
    at least two nodes and ``chips_needed`` chips."""
    topo: Topology = plan.ctx.topology
    chips = max(chips_needed, 2 * topo.chips_per_node, 2)
    return dict(topology=attrs.evolve(topo, chips=chips), primitives=plan.primitives, hooks=plan.hooks,
                system=plan.ctx.system, deployment=plan.ctx.deployment)


def _lone_comm_time_s(probe, primitive: str, group: tuple, nbytes: float) -> tuple[float, dict]:
    """Engine time of one comm op alone on idle ports, and the bytes each rank sends."""
    dag = OpDag()
    dag.add_op(CommOp(key="contract.probe", primitive=primitive, group=group, bytes_per_rank=nbytes,
                      reason="contract_probe", layer=0, name="probe", owner="contract"))
    compiled = compile_ops(dag, **probe)   # checks every flow (members, bytes, route)
    engine = Engine(dag=compiled).run()
    sent: dict[int, float] = {}
    payload_per_wire_byte = 1.0 / compiled.wire_factor[0]
    for s, b in zip(compiled.flow_src, compiled.flow_bytes):
        sent[s] = sent.get(s, 0.0) + b * payload_per_wire_byte
    return engine.makespan_s, sent


@_contract_check
def check_step_choices(plugin: str, configs, extra_plugins: Sequence = ()) -> None:
    """``g5_step_choices``: ``None`` or a mapping of string keys to JSON scalars (what the
    plugin chose for the step: the run's JSON and summary report it as given)."""
    for raw in _as_configs(configs, extra_plugins):
        plan = _plan(raw, extra_plugins)
        for answer in _call_own(plan.hooks, "g5_step_choices", plugin, ctx=plan.ctx):
            if answer is None:
                continue
            if not isinstance(answer, Mapping) or not all(
                    isinstance(k, str) and (v is None or isinstance(v, (str, int, float, bool)))
                    for k, v in answer.items()):
                raise _fail(plugin, check_step_choices, f"{_where(raw)} answered {answer!r}, not a mapping of "
                                                        "names to strings or numbers")


@_contract_check
def check_step_rules(plugin: str, configs, extra_plugins: Sequence = ()) -> None:
    """``g5_step_rules``: ``None`` or a :class:`~g5core.api.records.StepRules`; when it
    refuses mixed steps, its split of a mixed step (a prefill chunk and decodes, at its
    token multiple) is steps, none mixed, holding the step's groups between them."""
    for raw in _as_configs(configs, extra_plugins):
        plan = _plan(raw, extra_plugins)
        for answer in _call_own(plan.hooks, "g5_step_rules", plugin, deployment=plan.ctx.deployment):
            if answer is None:
                continue
            if not isinstance(answer, StepRules):
                raise _fail(plugin, check_step_rules, f"{_where(raw)} answered {answer!r}, not a StepRules")
            if answer.mixed:
                continue
            m = answer.token_multiple
            mixed = Step([StepGroup(new_tokens=4 * m, cached_tokens=2 * m, count=1),
                          StepGroup(new_tokens=1, cached_tokens=8 * m - 1, count=3)])
            try:
                checked_split(plugin, answer.split, mixed)
            except PluginError as exc:
                raise _fail(plugin, check_step_rules, f"{_where(raw)}: {exc}") from None


def check_comm_cost_monotone(plugin: str, configs, extra_plugins: Sequence = ()) -> None:
    """``g5_register_primitives``: a primitive's cost grows with the bytes it carries.

    For every primitive the plugin registers, on the groups the configurations' DAGs use it
    with (plus a two-chip group inside a node and one across two nodes), lowered at
    ``{0, 0.5, 1, 2, 4} x`` a base payload: the lowering is a :class:`~g5core.api.records.Lowering`
    whose flows stay inside the group; the bytes each rank sends and the engine time of the
    op alone never decrease as ``bytes_per_rank`` grows, and the bytes grow strictly between
    positive sizes when the primitive moves any data. (The time may stay level: NCCL spreads a
    larger send over more channels, so a send limited by its channels' copy rate takes as
    long at twice the size, as nccl-tests alltoall measures between 128 KiB and 2 MiB.)
    """
    configs = _as_configs(configs, extra_plugins)
    plans = [_plan(raw, extra_plugins) for raw in configs]
    base = max(plans, key=lambda p: p.ctx.rankmap.chips)
    mine = sorted(name for name, (owner, _) in base.primitives.items() if owner == plugin)
    if not mine:
        return
    probes: dict[str, dict[tuple, float]] = {name: {} for name in mine}
    for plan in plans:
        for op in build_dag(plan).comm_ops():
            if op.primitive in probes and len(probes[op.primitive]) < 4:
                probes[op.primitive].setdefault(op.group, op.bytes_per_rank or _DEFAULT_PROBE_BYTES)
    cpn = base.ctx.topology.chips_per_node
    max_chip = max([c for p in probes.values() for g in p for c in g] + [0])
    probe = _probe_args(base, max_chip + 1)
    for name in mine:
        groups = dict(probes[name])
        groups.setdefault((0, 1) if cpn >= 2 else (0, cpn), _DEFAULT_PROBE_BYTES)
        groups.setdefault((cpn - 1, cpn), _DEFAULT_PROBE_BYTES)
        _, lower = base.primitives[name]
        for group, nbytes in sorted(groups.items()):
            times, sent = [], []
            for scale in _BYTE_SCALES:
                low = lower(group, scale * nbytes, probe["topology"])
                if not isinstance(low, Lowering):
                    raise _fail(plugin, check_comm_cost_monotone, f"{name} on {group} returned {low!r}, not a Lowering")
                t_s, per_rank = _lone_comm_time_s(probe, name, group, scale * nbytes)
                times.append(t_s)
                sent.append(max(per_rank.values(), default=0.0))
            moves = sent[-1] > 0
            for i in range(1, len(_BYTE_SCALES)):
                grew = _BYTE_SCALES[i - 1] > 0 and moves
                for label, vals in (("time", times), ("bytes sent per rank", sent)):
                    # a level time may differ by rounding (latency + extra - link + link)
                    fell = vals[i] < vals[i - 1] * (1.0 - 1e-12) if label == "time" else vals[i] < vals[i - 1]
                    if fell or (grew and label != "time" and not vals[i] > vals[i - 1]):
                        raise _fail(plugin, check_comm_cost_monotone,
                                    f"{name} on group {group}: {label} {vals} is not increasing with bytes_per_rank "
                                    f"{[s * nbytes for s in _BYTE_SCALES]}")


@_contract_check
def check_topology(plugin: str, configs, extra_plugins: Sequence = ()) -> None:
    """``g5_topology``: ``None`` or a :class:`~g5core.lower.topology.Topology` of exactly the chips
    asked for, every resource with a positive, finite capacity, and every chip's
    point-to-point routes made of valid resources.
    """
    for raw in _as_configs(configs, extra_plugins):
        plan = _plan(raw, extra_plugins)
        chips = plan.ctx.rankmap.chips
        for answer in _call_own(plan.hooks, "g5_topology", plugin, system=plan.ctx.system, chips=chips):
            if answer is None:
                continue
            if not isinstance(answer, Topology) or answer.chips != chips:
                raise _fail(plugin, check_topology, f"{_where(raw)} answered {answer!r} for {chips} chips")
            caps = answer.capacities()
            if len(caps) != answer.n_resources or not all(math.isfinite(c) and c > 0 for c in caps):
                raise _fail(plugin, check_topology, f"{_where(raw)} capacities {caps[:8]}... are not all positive")
            for src in range(min(chips, 16)):
                for dst in range(chips):
                    route = answer.route(src, dst) if src != dst else ()
                    if any(not 0 <= r < len(caps) for r in route):
                        raise _fail(plugin, check_topology, f"{_where(raw)} route {src}->{dst} is {route}")


@_contract_check
def check_compute_latency(plugin: str, configs, extra_plugins: Sequence = ()) -> None:
    """``g5_compute_latency``: ``None`` or finite seconds ``>= 0`` that never fall as work grows.

    Asked for every compute op of each configuration's DAG: the plugin's answer is ``None``
    (let the next plugin answer) or a finite number ``>= 0``; where it answers, doubling the
    op's FLOPs and HBM bytes does not make it faster.
    """
    # not on the verification variant: the measured plugin's GEMM rows (aiconfigurator's
    # tables) are not monotone in m at 4 -> 8 and 6 -> 12 for the tiny model's QKV shape, which
    # only a verification step's b (k + 1) tokens reach; a property of the measured data
    for raw in _as_configs(configs, extra_plugins, verify=False):
        plan = _plan(raw, extra_plugins)
        ctx = plan.ctx
        seen = set()
        for op in build_dag(plan).ops:
            if not isinstance(op, ComputeOp):
                continue
            sig = (op.op_class, op.flops, op.hbm_bytes, op.dtype, op.kernels)
            if sig in seen:
                continue
            seen.add(sig)
            kw = dict(system=ctx.system, deployment=ctx.deployment)
            for answer in _call_own(plan.hooks, "g5_compute_latency", plugin, op=op, **kw):
                if answer is None:
                    continue
                answer = answer_seconds(answer)
                if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not (
                        math.isfinite(answer) and answer >= 0):
                    raise _fail(plugin, check_compute_latency, f"{_where(raw)} {op.key}: answered {answer!r}")
                bigger = attrs.evolve(op, flops=2 * op.flops, hbm_bytes=2 * op.hbm_bytes,
                                      kernels=tuple(scaled_kernel(k, 2.0) for k in op.kernels))
                for more in _call_own(plan.hooks, "g5_compute_latency", plugin, op=bigger, **kw):
                    more = answer_seconds(more)
                    if more is not None and more < answer:
                        raise _fail(plugin, check_compute_latency,
                                    f"{_where(raw)} {op.key}: {answer} s, but {more} s with twice the work")


@_contract_check
def check_disabled_contributes_nothing(plugin: str, configs, extra_plugins: Sequence = ()) -> None:
    """A disabled plugin contributes nothing, and a configuration that needs it fails clearly.

    With ``make_plugin_manager(disabled=[plugin])`` the plugin is not registered, no hook
    has an implementation from it, and :func:`g5core.api.plugins.describe_plugins` lists it as
    disabled with no hooks. For each configuration, either the build raises a
    :class:`~g5core.api.errors.G5Error` (the configuration needs the plugin: a clear error,
    never a silent fallback; any other exception is a failure), or the DAG has no op owned
    by the plugin and no dimension or primitive is registered by it.
    """
    pm = _pm(extra_plugins, disabled=[plugin])
    if pm.get_plugin(plugin) is not None:
        raise _fail(plugin, check_disabled_contributes_nothing, "still registered when disabled")
    for hook in hook_names():
        if _own_impls(Hooks(pm), hook, plugin):
            raise _fail(plugin, check_disabled_contributes_nothing, f"still implements {hook} when disabled")
    info = {p.name: p for p in describe_plugins(pm)}.get(plugin)
    if info is not None and (info.enabled or info.hooks):
        raise _fail(plugin, check_disabled_contributes_nothing, f"described as {info} when disabled")
    for raw in _as_configs(configs, extra_plugins):
        try:
            plan = _plan(raw, extra_plugins, disabled=[plugin])
            dag = build_dag(plan)
        except G5Error:
            continue
        except Exception as exc:  # noqa: BLE001 - the contract is a G5Error, nothing else
            raise _fail(plugin, check_disabled_contributes_nothing,
                        f"{_where(raw)}: disabling it raised {type(exc).__name__}: {exc} instead of a G5Error") from exc
        owned = [op.key for op in dag.ops if op.owner == plugin]
        if owned:
            raise _fail(plugin, check_disabled_contributes_nothing, f"{_where(raw)}: disabled, yet owns {owned[:3]}")
        if any(d.owner == plugin for d in plan.ctx.dims.dims):
            raise _fail(plugin, check_disabled_contributes_nothing, f"{_where(raw)}: disabled, yet registers a dimension")
        if any(owner == plugin for owner, _ in plan.primitives.values()):
            raise _fail(plugin, check_disabled_contributes_nothing, f"{_where(raw)}: disabled, yet registers a primitive")


@_contract_check
def check_deterministic(plugin: str, configs, extra_plugins: Sequence = ()) -> None:
    """Equal inputs give equal outputs: two builds from fresh plugin managers are identical.

    For each configuration, building twice gives equal op lists (every field of every op),
    equal edge lists in the same order, equal compiled durations and flows, and an equal
    memory report.
    """
    for raw in _as_configs(configs, extra_plugins):
        outs = []
        for _ in range(2):
            plan = _plan(raw, extra_plugins)
            dag = build_dag(plan)
            c = compile_dag(dag, plan)
            outs.append((list(dag.ops), list(dag.edges),
                         [a.tolist() for a in (c.duration_s, c.flow_src, c.flow_dst, c.flow_bytes)], memory_report(plan.ctx)))
        for label, a, b in zip(("op list", "edge list", "compiled durations and flows", "memory report"), *outs):
            if a != b:
                raise _fail(plugin, check_deterministic, f"{_where(raw)}: the {label} differs between two builds")


@_contract_check
def check_micro_batches(plugin: str, configs, extra_plugins: Sequence = ()) -> None:
    """``g5_micro_batches``: where the plugin splits the step, two or more positive whole
    batches that sum to the deployment's, and the split DAG holds every logical op once per
    micro-batch (op keys tagged ``.m0``, ``.m1``...), none of the whole step."""
    for raw in _as_configs(configs):
        plan = _plan(raw, extra_plugins)
        dep = plan.ctx.deployment
        for answer in _call_own(plan.hooks, "g5_micro_batches", plugin, deployment=dep, model=plan.ctx.model):
            if answer is None:
                continue
            batches = tuple(answer)
            if len(batches) < 2 or any(type(b) is not int or b < 1 for b in batches) or sum(batches) != dep.batch:
                raise _fail(plugin, check_micro_batches, f"{_where(raw)}: micro-batches {batches!r} are not two or "
                                                         f"more positive batches summing to {dep.batch}")
            ids = {lop.id for lop in plan.program()}
            want = {LogicalOp(lop.kind, lop.layer, micro=m).id for lop in build_program(plan.ctx.model)
                    for m in range(len(batches))}
            if ids != want:
                raise _fail(plugin, check_micro_batches, f"{_where(raw)}: the split step's logical ops are not the "
                                                         f"model's once per micro-batch")


@_contract_check
def check_bench_ops(plugin: str, configs, extra_plugins: Sequence = ()) -> None:
    """``g5_bench_ops``: a benchmark name the plugin does not offer gets ``None``."""
    plan = _plan(_as_configs(configs)[0], extra_plugins)
    for answer in _call_own(plan.hooks, "g5_bench_ops", plugin, name="no-such-benchmark",
                            topology=plan.ctx.topology, params={}):
        if answer is not None:
            raise _fail(plugin, check_bench_ops, f"answered an unknown benchmark name with {answer!r}")


@_contract_check
def check_run_notes(plugin: str, configs, extra_plugins: Sequence = ()) -> None:
    """``g5_run_notes``: ``None`` or lines of text, the same for the same configuration."""
    for raw in _as_configs(configs):
        answers = []
        for _ in range(2):
            plan = _plan(raw, extra_plugins)
            answers.append([None if a is None else list(a)
                            for a in _call_own(plan.hooks, "g5_run_notes", plugin, ctx=plan.ctx)])
        for a in answers[0]:
            if a is not None and not all(isinstance(line, str) for line in a):
                raise _fail(plugin, check_run_notes, f"{_where(raw)}: notes must be strings, got {a!r}")
        if answers[0] != answers[1]:
            raise _fail(plugin, check_run_notes, f"{_where(raw)}: notes differ between two builds")


@_contract_check
def check_sweep_presets(plugin: str, configs, extra_plugins: Sequence = ()) -> None:
    """``g5_register_sweep_presets``: presets owned by the plugin, documented, stable, and gone with it.

    Every preset the plugin registers is recorded with ``owner == plugin`` and is equal on a
    second registration; it has a ``doc`` line and a grid whose every axis has values; its
    check (if any) answers an empty sequence of rows with no violation; and with the plugin
    disabled none of its presets is registered.
    """
    own = {n: p for n, p in collect_presets(Hooks(_pm(extra_plugins))).items() if p.owner == plugin}
    again = {n: p for n, p in collect_presets(Hooks(_pm(extra_plugins))).items() if p.owner == plugin}
    if own != again:
        raise _fail(plugin, check_sweep_presets, f"registers different presets on two calls: {own} vs {again}")
    for name, preset in own.items():
        if not preset.doc:
            raise _fail(plugin, check_sweep_presets, f"preset '{name}' has no doc string")
        if not preset.grid or any(not values for _, values in preset.grid):
            raise _fail(plugin, check_sweep_presets, f"preset '{name}' has an empty grid or axis: {preset.grid}")
        if preset.check is not None and tuple(preset.check((), dict(preset.options))):
            raise _fail(plugin, check_sweep_presets, f"preset '{name}' reports violations for an empty sweep")
    try:
        off = collect_presets(Hooks(_pm(extra_plugins, disabled=[plugin])))
    except G5Error:
        return
    left = sorted(set(own) & {n for n, p in off.items() if p.owner == plugin})
    if left:
        raise _fail(plugin, check_sweep_presets, f"presets {left} are still registered with the plugin disabled")


@_contract_check
def check_serving_registrations(plugin: str, configs, extra_plugins: Sequence = ()) -> None:
    """``g5_register_schedulers`` / ``g5_register_routers`` / ``g5_register_workload_formats``:
    what the plugin registers is owned by it, the same on a second call, usable, and gone with it.

    A scheduler factory called with the default settings and 64 blocks returns an object
    with ``add``, ``schedule``, ``work``, ``finish_step``, ``release``, ``running``,
    ``waiting``, ``used_blocks``, ``total_blocks`` and ``preemptions``, whose ``schedule()``
    on an empty queue picks nothing; a router factory returns an object with ``choose``;
    formats are :class:`g5core.TraceFormat` values with a container (csv or
    jsonl) and identifying columns.
    """
    def own():
        reg = serving_registry(Hooks(_pm(extra_plugins)))
        return ({n: f for n, (o, f) in reg.schedulers.items() if o == plugin},
                {n: f for n, (o, f) in reg.routers.items() if o == plugin},
                [f for f in reg.formats if f not in _builtin_formats()])
    first, again = own(), own()
    if first != again:
        raise _fail(plugin, check_serving_registrations, "registers different serving names on two calls")
    schedulers, routers, formats = first
    needed = ("add", "schedule", "work", "finish_step", "release", "running", "waiting", "used_blocks",
              "total_blocks", "preemptions")
    for name, factory in schedulers.items():
        sched = factory(SchedulerSettings(), 64)
        missing = [a for a in needed if not hasattr(sched, a)]
        if missing:
            raise _fail(plugin, check_serving_registrations, f"scheduler '{name}' lacks {', '.join(missing)}")
        if sched.schedule():
            raise _fail(plugin, check_serving_registrations, f"scheduler '{name}' schedules work from an empty queue")
    for name, factory in routers.items():
        if not callable(getattr(factory(), "choose", None)):
            raise _fail(plugin, check_serving_registrations, f"router '{name}' has no choose(request, instances)")
    for fmt in formats:
        if fmt.container not in ("csv", "jsonl") or not fmt.columns:
            raise _fail(plugin, check_serving_registrations, f"trace format '{fmt.name}' needs a container (csv or "
                                                             "jsonl) and the columns that identify it")
    try:
        off = serving_registry(Hooks(_pm(extra_plugins, disabled=[plugin])))
    except G5Error:
        return
    left = sorted(n for n, (o, _) in {**off.schedulers, **off.routers}.items() if o == plugin)
    if left:
        raise _fail(plugin, check_serving_registrations, f"{left} are still registered with the plugin disabled")


def _builtin_formats():
    return BUILTIN_FORMATS


# ----------------------------------------------------------------------------------------
# Registry, selection, meta-check
# ----------------------------------------------------------------------------------------

CheckFn = Callable[..., None]

#: Checks every plugin runs, whatever hooks it implements.
GENERAL_CHECKS: tuple[CheckFn, ...] = (
    check_configs_exercise_plugin, check_disabled_contributes_nothing, check_deterministic,
)

#: Every hook of :mod:`g5core.api.hookspecs` -> the hook-specific checks that test it.
HOOK_CHECKS: Mapping[str, tuple[CheckFn, ...]] = {
    "g5_register_dimensions": (check_dimensions,),
    "g5_register_options": (check_options,),
    "g5_register_shard_axes": (check_shard_axes,),
    "g5_validate_deployment": (check_validate_deployment,),
    "g5_shard_factors": (check_shard_factors,),
    "g5_pipeline_microbatches": (check_pipeline_microbatches,),
    "g5_layer_chips": (check_placement,),
    "g5_place_op": (check_placement,),
    "g5_expand_op": (check_fragments,),
    "g5_require_owner": (check_require_owner,),
    "g5_memory_terms": (check_memory_terms,),
    "g5_step_choices": (check_step_choices,),
    "g5_step_rules": (check_step_rules,),
    "g5_register_primitives": (check_comm_cost_monotone,),
    "g5_topology": (check_topology,),
    "g5_compute_latency": (check_compute_latency,),
    "g5_register_sweep_presets": (check_sweep_presets,),
    "g5_register_schedulers": (check_serving_registrations,),
    "g5_register_routers": (check_serving_registrations,),
    "g5_register_workload_formats": (check_serving_registrations,),
    "g5_register_kv_cache_policies": (check_serving_registrations,),
    "g5_micro_batches": (check_micro_batches,),
    "g5_bench_ops": (check_bench_ops,),
    "g5_run_notes": (check_run_notes,),
}

#: Every check by name.
CHECKS: Mapping[str, CheckFn] = {
    f.__name__: f for f in GENERAL_CHECKS + tuple(f for fs in HOOK_CHECKS.values() for f in fs)
}


def plugin_contributions(plugin: str, raw: Mapping, extra_plugins: Sequence = ()) -> dict[str, int]:
    """How many things ``plugin`` contributed through each hook it implements, for one configuration.

    Registration hooks count what was registered; collect-all hooks count non-empty answers
    (shard factors, layer chips per layer, place-op per logical op, claimed logical ops,
    memory terms, compute latencies per distinct op); guard hooks count objections.
    """
    implemented = _implemented_hooks(plugin, extra_plugins)
    plan = _plan(raw, extra_plugins)
    ctx, hooks = plan.ctx, plan.hooks
    out: dict[str, int] = {}
    program = build_program(ctx.model)
    for hook in implemented:
        if hook == "g5_register_dimensions":
            n = sum(d.owner == plugin for d in ctx.dims.dims)
        elif hook == "g5_register_options":
            n = len(collect_options(hooks).of(plugin))
        elif hook == "g5_register_shard_axes":
            n = len(collect_shard_axes(hooks)) - len(collect_shard_axes(Hooks(_pm(extra_plugins, disabled=[plugin]))))
        elif hook == "g5_register_primitives":
            n = sum(owner == plugin for owner, _ in plan.primitives.values())
        elif hook == "g5_validate_deployment":
            n = 0  # a valid configuration: the guard had no objection
        elif hook == "g5_shard_factors":
            n = sum(bool(a) for a in _call_own(hooks, hook, plugin, deployment=ctx.deployment, model=ctx.model))
        elif hook == "g5_layer_chips":
            n = sum(a is not None for layer in iter_layers(ctx.model)
                    for a in _call_own(hooks, hook, plugin, ctx=ctx, layer=layer))
        elif hook in ("g5_place_op", "g5_require_owner"):
            n = sum(a is not None for lop in program for a in _call_own(hooks, hook, plugin, ctx=ctx, lop=lop))
        elif hook == "g5_expand_op":
            n = sum(expand(ctx, lop)[0] == plugin for lop in program)
        elif hook == "g5_memory_terms":
            n = sum(len(list(a)) for a in _call_own(hooks, hook, plugin, ctx=ctx) if a)
        elif hook == "g5_compute_latency":
            ops = {(o.op_class, o.flops, o.hbm_bytes, o.dtype, o.kernels): o for o in build_dag(plan).ops
                   if isinstance(o, ComputeOp)}
            n = sum(a is not None for o in ops.values()
                    for a in _call_own(hooks, hook, plugin, op=o, system=ctx.system, deployment=ctx.deployment))
        elif hook in ("g5_register_schedulers", "g5_register_routers", "g5_register_workload_formats"):
            reg = serving_registry(hooks)
            n = (sum(o == plugin for o, _ in reg.schedulers.values()) if hook == "g5_register_schedulers" else
                 sum(o == plugin for o, _ in reg.routers.values()) if hook == "g5_register_routers" else
                 len(reg.formats) - len(BUILTIN_FORMATS))
        else:  # a hook added to hookspecs without a counter here: count implementations
            n = len(_own_impls(hooks, hook, plugin))
        out[hook] = n
    return out


def applicable_checks(plugin: str, extra_plugins: Sequence = ()) -> tuple[str, ...]:
    """Names of the checks that apply to ``plugin``: ``GENERAL_CHECKS`` and those of each hook it implements.

    Needs no configuration, so a test can parametrize over it at collection time.
    """
    chosen: list[CheckFn] = list(GENERAL_CHECKS)
    for hook in _implemented_hooks(plugin, extra_plugins):
        for f in HOOK_CHECKS.get(hook, ()):
            if f not in chosen:
                chosen.append(f)
    return tuple(f.__name__ for f in chosen)


def plugin_checks(plugin: str, configs, extra_plugins: Sequence = ()) -> list[tuple[str, Callable[[], None]]]:
    """``[(check_name, check)]`` for ``plugin``: the general checks plus those of every hook it implements.

    Each ``check`` takes no argument (it is bound to the plugin, the configurations and
    ``extra_plugins``) and raises :class:`ContractError` on a breach. Meant for
    ``pytest.mark.parametrize``; the names are stable test ids.
    """
    # each check adds the step variants itself (inside its own report of a plugin's error)
    configs = _given_configs(configs)
    out = []
    for name in applicable_checks(plugin, extra_plugins):
        f = CHECKS[name]
        bound = functools.partial(f, plugin, configs, tuple(extra_plugins))
        functools.update_wrapper(bound, f)
        out.append((f.__name__, bound))
    return out


def check_plugin(plugin: str, configs, extra_plugins: Sequence = ()) -> list[str]:
    """Run every check of :func:`plugin_checks`; raise one :class:`ContractError` listing all failures.

    A check that raises anything else (e.g. the core's :class:`~g5core.api.errors.DagError` for
    a cycle the plugin made) counts as a failure of that check.

    Returns the names of the checks that ran (all passed).
    """
    failures, ran = [], []
    for name, check in plugin_checks(plugin, configs, extra_plugins):
        ran.append(name)
        try:
            check()
        except ContractError as exc:
            failures.append(str(exc))
        except Exception as exc:  # noqa: BLE001 - e.g. the core refusing the plugin's DAG
            failures.append(f"{name} raised {type(exc).__name__}: {exc}")
    if failures:
        raise ContractError(plugin, "check_plugin", f"{len(failures)} of {len(ran)} checks failed:\n  "
                            + "\n  ".join(failures))
    return ran


def check_hook_coverage() -> dict[str, tuple[str, ...]]:
    """The meta-check: every hook in :mod:`g5core.api.hookspecs` is documented and has a contract check.

    Fails when a hook specification has no docstring, when a hook has no entry (or an
    empty one) in ``HOOK_CHECKS``, when ``HOOK_CHECKS`` names a hook that does not exist,
    or when a check has no docstring. Returns ``{hook: check names}``.
    """
    hooks = hook_names()
    problems = []
    for hook in hooks:
        doc = inspect.getdoc(getattr(hookspecs, hook))
        if not doc or not doc.strip():
            problems.append(f"hook {hook} has no docstring")
        if not HOOK_CHECKS.get(hook):
            problems.append(f"hook {hook} has no contract check in g5core.testing.HOOK_CHECKS")
    for hook in HOOK_CHECKS:
        if hook not in hooks:
            problems.append(f"HOOK_CHECKS names {hook}, which is not a hook in g5core.api.hookspecs")
    for name, f in CHECKS.items():
        if not (inspect.getdoc(f) or "").strip():
            problems.append(f"check {name} has no docstring")
    if problems:
        raise AssertionError("; ".join(problems))
    return {hook: tuple(f.__name__ for f in HOOK_CHECKS[hook]) for hook in hooks}
