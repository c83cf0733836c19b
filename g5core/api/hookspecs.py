"""The G5 extension contract: every hook a plugin may implement, grouped by phase.

All hooks are called while a run is being *built* (configuration, DAG, memory), never
inside the engine's event loop. Calling modes:

- registration hooks take a ``register`` callable owned by the core, which validates what
  it is given; registering a name twice is an error;
- contribution hooks are collect-all: every plugin may answer and the core merges the
  answers (``None`` means "nothing to add");
- guard hooks return ``None`` for "no objection" or a message explaining the refusal;
- first-answer hooks (``g5_topology``, ``g5_compute_latency``): the core asks the plugins in
  order and the first that answers (not ``None``) wins; the roofline plugin answers
  ``g5_compute_latency`` last, as the default. The core calls every hook through its facade
  (:class:`g5core.api.plugins.Hooks`), one implementation at a time, so no spec carries
  pluggy's ``firstresult`` flag.

The annotations name the types by their public names (``BuildContext``, ``Fragment``,
``MemoryTerm``, ``Deployment``, ``ModelSpec``, ``SystemSpec``... each exported from ``g5core``:
``tests/test_plugin_api.py`` resolves every one there) without importing them: this module imports nothing of the core, so the
contract depends on no implementation module (tests/test_layout.py).
"""
from __future__ import annotations

from typing import Callable, Iterable, Mapping, Optional

import pluggy

hookspec = pluggy.HookspecMarker("g5")

# --------------------------------------------------------------------------------------
# Family 1: parallel dimensions
# --------------------------------------------------------------------------------------


@hookspec
def g5_register_dimensions(register: Callable[["Dimension"], None]) -> None:
    """Register the parallel dimensions this plugin owns (registration hook).

    Call ``register(Dimension(...))`` once per dimension. A dimension is a factor of the
    chip count (dp, tp, pp, cp) or regroups factor dimensions (ep regroups dp x sp x tp). A
    ``parallel`` key that no enabled plugin registers is an unknown key. Registering a name
    that another plugin registered is an error naming both plugins.
    """


@hookspec
def g5_register_options(register: Callable[["PluginOption"], None]) -> None:
    """Declare this plugin's configuration options (registration hook).

    Call ``register(PluginOption(name=..., default=..., doc=..., kind=...))`` once per option. A
    configuration sets them under ``plugins: {PLUGIN_NAME: {option: value}}``; the core
    validates them (unknown option, wrong type: a one-line ConfigError naming the field) and
    plugins read them with ``deployment.option(PLUGIN_NAME, option)``. Declaring a name twice
    is an error.
    """


@hookspec
def g5_register_shard_axes(register: Callable[[str, str], None]) -> None:
    """Add shard axes beyond the core's (registration hook).

    Call ``register(name, doc)`` once per axis. Any plugin may then divide the axis in
    ``g5_shard_factors`` and read the product with ``ctx.shape.factor(name)``. Registering a
    core axis or another plugin's axis is an error naming both.
    """


@hookspec
def g5_validate_deployment(
    deployment: "Deployment", model: "ModelSpec", system: "SystemSpec"
) -> None:
    """Check a deployment against the rules this plugin owns (collect-all).

    Raise :class:`g5core.api.errors.ConfigError` naming the field and the fix. Return ``None``.
    """


@hookspec
def g5_shard_factors(
    deployment: "Deployment", model: "ModelSpec"
) -> Optional[Mapping[str, int]]:
    """Divisors this plugin applies to one chip's share of the work (collect-all).

    Keys are the shard axes of :class:`g5core.lower.shape.LocalShape` (``tokens``, ``kv_len``,
    ``q_heads``, ``kv_heads``, ``kv_cache_heads``, ``ffn_cols``, ``experts``, ``expert_cols``,
    ``moe_tokens``, ``vocab``, ``norm_tokens``) or axes a plugin registered through
    ``g5_register_shard_axes``; values are positive integers. The core multiplies the
    factors of every plugin per axis. Return ``None`` or ``{}`` to contribute nothing.
    """


@hookspec
def g5_pipeline_microbatches(deployment: "Deployment", model: "ModelSpec") -> Optional["PipelineMicrobatches"]:
    """Split the step into micro-batches that follow one another through the layers' chips
    (collect-all; at most one plugin may answer).

    Return :class:`g5core.lower.microbatch.PipelineMicrobatches`: ``batches`` (decode micro-batches
    of sequences, which cycle) or ``chunks`` (consecutive prompt chunks), adding up to the
    deployment's ``batch`` or ``seq_len``; ``None`` (or one part) leaves the step whole. Each
    part is validated as a deployment of its own (``g5_validate_deployment``), and may be split
    again into overlapped sides (``g5_micro_batches``, asked of each part): the one
    micro-batch mechanism, :mod:`g5core.lower.microbatch`.
    """


@hookspec
def g5_step_rules(deployment: "Deployment") -> Optional["StepRules"]:
    """What this plugin's dimensions require of every step the deployment's layout runs
    (collect-all): the serving cost model and the serving search follow them, knowing no
    dimension.

    Return :class:`g5core.StepRules` (``token_multiple``: each sequence's token counts padded
    up to a multiple of it; ``mixed``: whether prefill and decode groups may share a step;
    ``split``: when not, ``split(step) -> (step, ...)``, the unmixed steps run instead, one
    after the other, holding the step's groups) or ``None`` for no rule. The core merges
    every plugin's answer (:func:`g5core.lower.steprules.step_rules`).
    """


# --------------------------------------------------------------------------------------
# Family 2: op expansion
# --------------------------------------------------------------------------------------


@hookspec
def g5_micro_batches(deployment: "Deployment", model: "ModelSpec") -> Optional[Iterable[int]]:
    """Split the step into micro-batches that run as independent copies of the program
    (collect-all; at most one plugin may answer): the ``batch`` of each, summing to the
    deployment's. Every logical op is then expanded once per micro-batch, with that
    micro-batch's deployment and local shape, its ids tagged ``.m0``, ``.m1``...; the engine
    overlaps one micro-batch's communication with another's compute (two-batch overlap). In
    a pipeline (``g5_pipeline_microbatches``) the hook is asked of each pipeline part's
    deployment, so the part runs as overlapped sides; refuse (``ConfigError``) what you
    cannot split (:mod:`g5core.lower.microbatch`).
    """


@hookspec
def g5_layer_chips(ctx: "BuildContext", layer: int) -> Optional[Iterable[int]]:
    """Chips that hold ``layer`` (its weights and its work), or ``None`` for no opinion.

    Collect-all; the core intersects every answer with the set of all chips. Layer ``-1`` is
    the embedding, ``n_layers`` the final norm and LM head.
    """


@hookspec
def g5_place_op(ctx: "BuildContext", lop: "LogicalOp") -> Optional[Iterable[int]]:
    """Restrict which of the layer's chips run logical op ``lop`` (collect-all, intersected).

    Return ``None`` for no restriction.
    """


@hookspec
def g5_expand_op(ctx: "BuildContext", lop: "LogicalOp") -> Optional["Fragment"]:
    """Claim logical op ``lop`` and return its fragment of concrete ops and edges.

    Collect-all with exactly-one ownership: at most one plugin may return a fragment for a
    given logical op (two claimants is an error naming both). When no plugin claims it the
    core's default expansion runs one compute op per placed chip (or nothing for a pure
    synchronisation point). Op keys must start with ``lop.prefix``.
    """


@hookspec
def g5_require_owner(ctx: "BuildContext", lop: "LogicalOp") -> Optional[str]:
    """Guard: object to the core's default expansion of an unclaimed ``lop``.

    Return ``None`` for no objection, or a one-line message naming the fix (e.g. which
    plugin to enable). Called only when no plugin claimed the op.
    """


# --------------------------------------------------------------------------------------
# Family 3: memory
# --------------------------------------------------------------------------------------


@hookspec
def g5_memory_terms(ctx: "BuildContext") -> Optional[Iterable["MemoryTerm"]]:
    """Extra named per-chip memory terms (collect-all).

    The core computes weights, KV cache and activations from the sharded shapes; plugins add
    what only they know (ring buffers, all-to-all buffers...). Each term's ``bytes_per_chip``
    is non-negative.
    """


@hookspec
def g5_step_choices(ctx: "BuildContext") -> Optional[Mapping[str, object]]:
    """What this plugin chose for the step the context runs (collect-all), e.g.
    ``{"prefill": "pass_q", "rule": "..."}`` for a per-step algorithm choice. The run reports
    the answers by plugin name in its JSON (``choices``) and summary; ``None``: no choice."""


# --------------------------------------------------------------------------------------
# Family 4: communication primitives
# --------------------------------------------------------------------------------------


@hookspec
def g5_register_primitives(
    register: Callable[[str, Callable[..., "Lowering"]], None]
) -> None:
    """Register collective lowerings (registration hook).

    ``register(name, lower)`` where ``lower(group, bytes_per_rank, topology) -> Lowering``
    turns one communication op into flows between chips plus a start latency. Registering
    a primitive name twice is an error naming both plugins.
    """


@hookspec
def g5_topology(system: "SystemSpec", chips: int) -> Optional["Topology"]:
    """The network of ``chips`` chips on ``system`` (first answer wins).

    Return a :class:`g5core.lower.topology.Topology`, or ``None`` to let the core build it from
    the system file (scale-up links, NICs, and an optional oversubscribed fabric tier).
    """


@hookspec
def g5_bench_ops(name: str, topology: "Topology", params: Mapping) -> Optional[tuple]:
    """The ops of ``g5 collective NAME`` when NAME is more than one primitive (collect-all;
    one plugin answers per name).

    ``params`` are the command's options (e.g. ``tokens``, ``topk``). Return ``None`` for a
    name the plugin does not know, else ``(fragment, logical_bytes)``: a
    :class:`~g5core.lower.dag.Fragment` of communication ops over chips ``0 .. n-1`` of
    ``topology`` (its edges order them) and a mapping from a bandwidth column's name to the
    bytes per rank it divides by the time (the figures the benchmark being reproduced
    reports).
    """


@hookspec
def g5_run_notes(ctx: "BuildContext") -> Optional[Iterable[str]]:
    """Lines the run's summary shows under its latency: how this plugin ran the deployment
    (a kernel it chose, a factor it applied). Collect-all; ``None`` for nothing."""


# --------------------------------------------------------------------------------------
# Family 5: compute latency
# --------------------------------------------------------------------------------------


@hookspec
def g5_compute_latency(
    op: "ComputeOp", system: "SystemSpec", deployment: "Deployment"
) -> Optional[float]:
    """Seconds a compute op takes on its chip (first answer wins).

    Return ``None`` to let the next plugin answer, seconds, or a
    ``g5core.ComputeTime(seconds, measured_s)`` saying how much of the time came
    from measurements (reported as coverage). ``op.kernels`` gives the shapes of the kernels
    the op runs. The roofline plugin answers last.
    """


# --------------------------------------------------------------------------------------
# Family 6: sweeps
# --------------------------------------------------------------------------------------


@hookspec
def g5_register_sweep_presets(register: Callable[["SweepPreset"], None]) -> None:
    """Register named sweep presets (registration hook).

    ``register(SweepPreset(...))`` once per preset: a default grid over configuration keys,
    fixed overrides, and an optional check over the sweep's rows that returns the
    violations (``g5 scan`` runs the ``cp`` plugin's preset). Registering a name that
    another plugin registered is an error naming both plugins.
    """


# --------------------------------------------------------------------------------------
# Family 7: serving (``g5 serve``)
# --------------------------------------------------------------------------------------


@hookspec
def g5_register_schedulers(register: Callable[[str, Callable], None]) -> None:
    """Register per-instance schedulers for ``serving.scheduler.name`` (registration hook).

    ``register(name, factory)`` where ``factory(settings, total_blocks)`` (``settings``: a
    :class:`g5core.SchedulerSettings`) returns a :class:`g5core.Scheduler` (``add``,
    ``schedule``, ``work``, ``finish_step``, ``release``, ``running``, ``waiting``,
    ``used_blocks``, ``total_blocks``, ``has_work``, ``preemptions``,
    ``outstanding_tokens``), working on :class:`g5core.Seq` and making
    :class:`g5core.StepWork`. The core's ``vllm`` is built in. Registering a name twice is an
    error naming both plugins.
    """


@hookspec
def g5_register_routers(register: Callable[[str, Callable], None]) -> None:
    """Register request routers for ``serving.router`` (registration hook).

    ``register(name, factory)`` where ``factory()`` returns a :class:`g5core.Router`
    (``choose(request, instances) -> index``; ``instances``: :class:`g5core.RoutedInstance`,
    each with its ``scheduler``). Built in: ``round_robin``,
    ``least_outstanding_tokens``, ``least_kv``.
    """


@hookspec
def g5_register_kv_cache_policies(register: Callable[[str, Callable], None]) -> None:
    """Register eviction policies for ``serving.prefix_cache.policy`` (registration hook).

    ``register(name, factory)`` where ``factory()`` returns an ordered store of block hashes
    with ``add(h)`` (a block just freed), ``remove(h)`` (held again), ``victim()`` (the
    block to evict, removed from the store), ``len()``, ``in`` and iteration; one store per
    instance for HBM and one per tier below it. Built in: ``lru``
    (:class:`g5core.serve.kvcache.LruPolicy`).
    """


@hookspec
def g5_register_workload_formats(register: Callable[[object], None]) -> None:
    """Register request-trace formats (registration hook).

    ``register(TraceFormat(...))`` (:class:`g5core.TraceFormat`): the container (``csv`` or
    ``jsonl``), the columns that identify the format and how one record becomes a request
    (its ``row`` raises :class:`g5core.TraceFieldError` on a bad field). Built in: ``g5`` (CSV and JSONL), ``azure``, ``mooncake``.
    """
