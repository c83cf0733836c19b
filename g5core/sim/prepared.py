"""A deployment prepared once, simulating many steps: the API a serving simulator drives.

    import g5core
    from g5core import Step, StepGroup

    plan = g5core.prepare("examples/llama-3.1-70b-decode.yaml", overrides=["parallel.pp=1", "chips=8"])
    step = Step([StepGroup(new_tokens=2048, cached_tokens=30000, count=1),   # a prefill chunk
                 StepGroup(new_tokens=1, cached_tokens=8191, count=64)])     # 64 decode tokens
    result = plan.simulate(step)
    result.latency_s                 # seconds the step takes
    result.memory.kv_bytes_per_token # KV bytes one context token costs on the fullest chip
    plan.kv_capacity_tokens(step)    # context tokens per replica that fit beside weights,
                                     # this step's activations and the workspace

:func:`prepare` validates the deployment once and keeps what does not depend on the step:
the plugin manager, the validated deployment, rank map, topology, collective primitives,
the symmetry decision (which replicas are alike) and the compute-latency lookup with its
cache (shared by every step: a kernel shape seen in one step costs a dictionary lookup in
the next). :meth:`PreparedPlan.simulate` then validates and shapes the step, expands each
logical op once, compiles, runs the event engine and checks the conservation KPIs; its
result is cached per step shape (:class:`~g5core.inputs.step.Step` is canonical, so a step
and the same groups in another order are one shape), so a repeated shape costs a lookup.

The compute-latency answers are cached across steps on the op's kernels (their shapes),
FLOPs, bytes and dtype: a ``g5_compute_latency`` plugin's answer must depend on those, the
system and the deployment's dtypes, not on other fields of the step.
"""
from __future__ import annotations

import math
import pathlib
from typing import Any, Iterable, Mapping, Optional, Sequence

import attrs

from g5core.api.errors import ResourceError
from g5core.build.builder import DEFAULT_MAX_OPS, check_size, plan_for_step
from g5core.build.shape import collect_shard_axes
from g5core.build.symmetry import off_reason, plan_symmetry
from g5core.inputs.config import Deployment, apply_overrides, load_config_file
from g5core.inputs.step import Step, as_step, phase_metrics
from g5core.sim.compute import LatencyLookup
from g5core.sim.memory import ChipMemory, MemoryReport, kv_cache_bytes, memory_report


#: prepared runs of distinct steps kept for plan_for / memory (each holds its shape only)
PLANS_KEPT = 1024


@attrs.frozen(kw_only=True)
class StepMemory(ChipMemory):
    """A step's memory ledger, per chip: ``chip`` is the fullest chip (its total is
    ``total_bytes``), every other figure the largest over the chips (fields of
    :class:`~g5core.sim.memory.ChipMemory`), and ``kv_bytes_per_token``: KV-cache bytes one
    context token of one sequence costs on the chip that stores the most per token (its
    layers' ``c_kv``, divided by the head and sequence splits)."""

    kv_bytes_per_token: float


@attrs.frozen(kw_only=True, eq=False)
class StepResult:
    """What one step costs. ``ttft_s`` / ``tpot_s`` are set where the step is a pure
    prefill or a pure decode (else None); ``new_tokens`` are per replica."""

    step: Step
    phase: str
    latency_s: float
    ttft_s: Optional[float]
    tpot_s: Optional[float]
    new_tokens: int
    tokens_per_s_per_chip: float
    memory: StepMemory
    #: per plugin, the choices it made for this step (e.g. ``{"cp": {"prefill": "pass_q"}}``)
    choices: dict = attrs.field(factory=dict)
    #: the full simulation result (g5core.sim.results.SimResult), for detail
    sim: Any = attrs.field(default=None, repr=False)
    ledger: Optional[MemoryReport] = attrs.field(default=None, repr=False)

    def to_json_dict(self) -> dict:
        out = {"step": self.step.to_list(), "phase": self.phase, "latency_s": self.latency_s,
               **phase_metrics(self.phase, self.latency_s), "new_tokens": self.new_tokens,
               "tokens_per_s_per_chip": self.tokens_per_s_per_chip, "memory": attrs.asdict(self.memory)}
        if self.choices:
            out["choices"] = self.choices
        return out


class PreparedPlan:
    """One deployment, validated and prepared once; :meth:`simulate` runs any step on it.

    Build it with :func:`prepare`. Attributes: ``deployment`` (the validated deployment of
    the configuration's own step), ``plan`` (the prepared run of that step,
    :class:`g5core.build.builder.Plan`), ``symmetry`` (the replica decision, made once),
    ``lookup`` (the compute-latency lookup shared by every step)."""

    def __init__(self, plan, symmetry: bool | str = True, max_ops: Optional[int] = None, check: bool = True):
        self.plan = plan
        self.deployment: Deployment = plan.ctx.deployment
        self.max_ops = DEFAULT_MAX_OPS if max_ops is None else max_ops
        self.check = check
        self._symmetry_arg = symmetry
        self.symmetry = plan_symmetry(plan.ctx, off_reason(symmetry))
        self._axes = collect_shard_axes(plan.hooks)
        self.lookup = LatencyLookup(plan.hooks, plan.ctx.system, self.deployment)
        self._results: dict[Step, StepResult] = {}
        self._plans: dict[Step, Any] = {self.deployment.step: plan}
        self.hits = 0
        self.misses = 0
        self.reused = 0
        self._templates: dict = {}
        # the configuration's own step is checked against the size guard once, here
        check_size(plan, max_ops, self.symmetry.replicas)

    # -- steps -----------------------------------------------------------------------------

    def plan_for(self, step) -> Any:
        """The prepared run (:class:`g5core.build.builder.Plan`) of ``step``: validated and
        shaped, everything else shared with this plan."""
        step = as_step(step)
        got = self._plans.get(step)
        if got is None:
            dep = self.deployment.with_step(step)
            got = plan_for_step(self.plan, dep, self._axes)
            if len(self._plans) < PLANS_KEPT:
                self._plans[step] = got
        got.lookup = self.lookup
        return got

    def simulate(self, step, detail: bool = False) -> StepResult:
        """Simulate one step (a :class:`Step`, StepGroups, or a configuration list of
        ``{new_tokens, cached_tokens, count}``); cached per step shape.

        ``detail``: also return the full simulation (``sim``: op DAG, timings, traffic by
        reason) and memory ledger (``ledger``); the cache keeps only the figures (a cached
        DAG per shape would hold thousands of DAGs), so a detailed call of a cached shape
        simulates it again."""
        step = as_step(step)
        hit = self._results.get(step)
        if hit is not None and not detail:
            self.hits += 1
            return hit
        self.misses += 1
        from g5core.sim.run import simulate as simulate_plan  # run imports this module's users

        plan = self.plan_for(step)
        self.lookup.deployment = plan.ctx.deployment
        sim = self._from_template(step, plan)
        if sim is None:
            sim = simulate_plan(plan, check=self.check, symmetry=self._symmetry_arg, max_ops=self.max_ops)
            self._keep_template(step, plan, sim)
        total = sim.ops + sim.flows
        if total > self.max_ops:
            raise ResourceError(f"step {step.describe()} simulated {total:,} ops and flows, above the limit of "
                                f"{self.max_ops:,}; raise the limit (max_ops) or use a smaller deployment")
        ledger = memory_report(plan.ctx)
        dep = plan.ctx.deployment
        from g5core.study.sweep import tokens_per_s_per_chip

        metrics = phase_metrics(dep.phase, sim.latency_s)
        result = StepResult(
            step=step, phase=dep.phase, latency_s=sim.latency_s, ttft_s=metrics.get("ttft_s"),
            tpot_s=metrics.get("tpot_s"), new_tokens=step.new_tokens,
            tokens_per_s_per_chip=tokens_per_s_per_chip(dep, sim.latency_s),
            memory=self._step_memory(ledger), choices=step_choices(plan.ctx))
        self._results[step] = result
        return attrs.evolve(result, sim=sim, ledger=ledger) if detail else result

    # -- the op DAG of a step structure, reused ------------------------------------------

    def _keep_template(self, step: Step, plan, sim) -> None:
        key = _structure(step)
        if key is not None and key not in self._templates and _reusable(plan, sim.dag):
            if len(self._templates) >= TEMPLATES_KEPT:
                self._templates.pop(next(iter(self._templates)))
            self._templates[key] = (sim.dag, sim.symmetry, plan)

    def _from_template(self, step: Step, plan):
        """The step simulated on the op DAG of an earlier step of the same structure (the
        same groups but for their cached tokens), its attention specs replaced by this
        step's; None where there is none or it does not apply (:func:`_reusable`)."""
        key = _structure(step)
        got = self._templates.get(key) if key is not None else None
        if got is None:
            return None
        dag, sym, old_plan = got
        old_ctx, ctx = old_plan.ctx, plan.ctx
        kinds = {lop_kind for lop_kind in _program_kinds(ctx.model) if lop_kind != "attention"}
        if any(old_ctx.work(k) != ctx.work(k) for k in kinds):
            return None
        old_work, work = old_ctx.work("attention"), ctx.work("attention")
        specs = list(dag.specs)
        for i, (spec, comm) in enumerate(zip(specs, dag.spec_is_comm)):
            if comm or spec[1] != "attention":
                continue
            if spec[3] != "core" or spec[4] != old_work.kernels:
                return None
            specs[i] = spec[:4] + (work.kernels, work.flops, work.hbm_bytes)
        self.reused += 1
        step_dag = attrs.evolve(dag, specs=specs, spec_ids={}, index={}, indexed=0, graph=None, graph_size=(-1, -1))
        return _run_built(plan, step_dag, sym, self.check)

    def memory(self, step) -> MemoryReport:
        """The memory ledger of ``step`` (no simulation)."""
        return memory_report(self.plan_for(step).ctx)

    # -- KV-cache sizing -------------------------------------------------------------------

    def kv_bytes_per_token_by_chip(self) -> dict[int, float]:
        """KV-cache bytes per context token (one token of one sequence) on each chip."""
        ctx = self.plan.ctx
        c_kv = ctx.model.kv_bytes_per_token_per_layer(self.deployment.dtypes.kv_cache_element_bytes)
        s = ctx.shape
        out = {}
        for c, layers in _layers_by_chip(ctx).items():
            out[c] = kv_cache_bytes(1, c_kv, layers, s.factor("kv_len"), s.kv_shard * s.kv_cache_shard)
        return out

    @property
    def kv_bytes_per_token(self) -> float:
        """KV-cache bytes per context token on the chip that stores the most per token."""
        return max(self.kv_bytes_per_token_by_chip().values())

    def kv_capacity_tokens(self, step) -> float:
        """Context tokens per replica whose KV fits beside the weights, the activations of
        ``step`` (size a pool with the largest step it will run) and the workspace, on the
        tightest chip: ``min over chips (capacity - weights - activations - workspace) /
        kv_bytes_per_token``. Negative when the step does not fit even with no KV."""
        ledger = self.memory(step)
        per_token = self.kv_bytes_per_token_by_chip()
        room = []
        for c in ledger.per_chip:
            free = c.capacity_bytes - c.weights_bytes - c.activation_bytes - c.workspace_bytes
            if per_token.get(c.chip, 0.0) > 0:
                room.append(free / per_token[c.chip])
        return min(room) if room else math.inf

    def _step_memory(self, ledger: MemoryReport) -> StepMemory:
        chips = ledger.per_chip
        fullest = max(chips, key=lambda c: (c.total_bytes, -c.chip))
        most = {k: max(getattr(c, k) for c in chips)
                for k in ("weights_bytes", "kv_cache_bytes", "activation_bytes", "workspace_bytes")}
        return StepMemory(chip=fullest.chip, **most, total_bytes=ledger.max_total_bytes,
                          capacity_bytes=chips[0].capacity_bytes, fits=ledger.fits,
                          kv_bytes_per_token=self.kv_bytes_per_token)

    def cache_info(self) -> dict:
        """Step results cached, and how often :meth:`simulate` found one."""
        return {"steps": len(self._results), "hits": self.hits, "misses": self.misses,
                "dags_reused": self.reused, "latency_answers": len(self.lookup.answers)}


#: op DAGs kept for reuse, one per step structure (oldest dropped first)
TEMPLATES_KEPT = 64
#: owners whose ops depend on the step only through its new tokens (the built-in TP, EP, PP
#: and DP plugins: shape.tokens, moe_tokens, norm_tokens), never on its cached tokens
CACHE_FREE_OWNERS = frozenset({"core", "tp", "ep", "pp", "dp"})


def _structure(step: Step):
    """A step's groups without their cached tokens: steps alike here differ only in the
    attention over their cached prefixes."""
    return tuple((g.new_tokens, g.count) for g in step)


def _reusable(plan, dag) -> bool:
    """Whether another step's DAG may be this one's with other attention specs: no context
    parallelism (its rings carry the cached KV), every op owned by the core or a plugin of
    ``CACHE_FREE_OWNERS``, and attention the core's default work."""
    if plan.ctx.size("cp") > 1:
        return False
    owners = {spec[4] if comm else spec[3] for spec, comm in zip(dag.specs, dag.spec_is_comm)}
    return owners <= CACHE_FREE_OWNERS


def _program_kinds(model) -> tuple[str, ...]:
    from g5core.build.layers import build_program

    return tuple(dict.fromkeys(lop.kind for lop in build_program(model)))


def _run_built(plan, dag, sym, check: bool):
    """Compile, run and summarise an op DAG already built for ``plan`` (one replica where
    ``sym`` applies, as it did for the DAG's first step)."""
    import time

    from g5core.sim.engine import Engine, compile_dag
    from g5core.sim.results import check_conservation, summarize
    from g5core.sim.run import _check_finite, _gc_paused

    with _gc_paused():
        t0 = time.perf_counter()
        compiled = compile_dag(dag, plan)
        engine = Engine(compiled).run()
        _check_finite([engine.makespan_s])
        result = summarize(dag, engine, plan.ctx.deployment.phase, time.perf_counter() - t0, sym)
        if check:
            check_conservation(result.kpis)
    return result


def _layers_by_chip(ctx) -> dict[int, int]:
    """Transformer layers each chip holds."""
    out = {c: 0 for c in ctx.all_chips}
    for layer in range(ctx.model.n_layers):
        for c in ctx.layer_chips(layer):
            out[c] += 1
    return out


def step_choices(ctx) -> dict:
    """What plugins chose for this step (``g5_step_choices`` answers, by plugin)."""
    return {plugin: dict(answer) for plugin, answer in ctx.hooks.call_each("g5_step_choices", ctx=ctx) if answer}


def prepare(config: Mapping | Deployment | str | pathlib.Path, *, overrides: Iterable[str] = (),
            disabled: Iterable[str] = (), extra_plugins: Sequence = (), symmetry: bool | str = True,
            max_ops: Optional[int] = None, check: bool = True) -> PreparedPlan:
    """Validate a deployment once and return a :class:`PreparedPlan` that simulates steps.

    ``config``: a configuration mapping, a validated Deployment, or the path of a YAML, TOML
    or JSON file; ``overrides`` are ``dotted.key=value`` strings as ``--set`` takes them
    (``step.0.cached_tokens=4096``); ``disabled`` names plugins to disable; ``symmetry``
    and ``max_ops`` as for :func:`g5core.sim.run.run`. Bad input raises ConfigError."""
    from g5core.sim.run import make_plan

    if isinstance(config, (str, pathlib.Path)):
        config = load_config_file(config)
    overrides = tuple(overrides)
    if overrides:
        if isinstance(config, Deployment):
            config = config.to_dict()
        config = apply_overrides(config, overrides)
    plan = make_plan(config, disabled, extra_plugins, max_ops=max_ops)
    return PreparedPlan(plan, symmetry=symmetry, max_ops=max_ops, check=check)
