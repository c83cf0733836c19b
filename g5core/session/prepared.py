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
import time
from typing import Any, Iterable, Mapping, Optional, Sequence

import attrs
import numpy as np

from g5core.api.errors import ConfigError, PluginError, ResourceError
from g5core.lower.builder import DEFAULT_MAX_OPS, check_size, plan_deployment, plan_for_step
from g5core.lower.shape import collect_shard_axes
from g5core.lower.steprules import step_rules
from g5core.lower.symmetry import off_reason, plan_symmetry
from g5core.inputs.config import Deployment, apply_overrides, load_config_file, resolve_config_paths
from g5core.inputs.framework import graph_step, host_step_s
from g5core.inputs.step import Step, as_step, phase_metrics
from g5core.sim.results import step_choices
from g5core.sim.compute import LatencyLookup
from g5core.sim.memory import ChipMemory, MemoryReport, kv_cache_bytes, memory_report
from g5core.lower.builder import build_dag
from g5core.lower.layers import build_program
from g5core.lower.symmetry import check_resources
from g5core.session.mathpath import math_estimate
from g5core.sim.heap import gc_paused
from g5core.session.run import _check_finite, make_plan, simulate_plan, tokens_per_s_per_chip
from g5core.sim.compile import compile_dag
from g5core.sim.engine import Engine
from g5core.sim.results import busiest_compute_by_owner, check_conservation, conservation_kpis, summarize


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
    #: the full simulation result (g5core.sim.results.SimResult; a MathResult for
    #: ``path: math``), for detail
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
    :class:`g5core.lower.builder.Plan`), ``symmetry`` (the replica decision, made once),
    ``lookup`` (the compute-latency lookup shared by every step), ``step_rules`` (what the
    layout's dimensions require of every step: :func:`g5core.lower.steprules.step_rules`)."""

    def __init__(self, plan, symmetry: bool | str = True, max_ops: Optional[int] = None, check: bool = True):
        if plan.pipeline is not None:
            # each step here is one engine iteration; pipelining iterations is the caller's
            raise ConfigError(plan.pipeline.field, "a prepared plan simulates one step at a time, not "
                                                   f"micro-batches through a pipeline; set {plan.pipeline.field}: 1")
        self.plan = plan
        self.deployment: Deployment = plan.ctx.deployment
        self.max_ops = DEFAULT_MAX_OPS if max_ops is None else max_ops
        self.check = check
        self._symmetry_arg = symmetry
        self.symmetry = plan_symmetry(plan.ctx, off_reason(symmetry))
        self._axes = collect_shard_axes(plan.hooks)
        self.lookup = LatencyLookup(hooks=plan.hooks, system=plan.ctx.system, deployment=self.deployment)
        self.step_rules = step_rules(plan.hooks, self.deployment)
        self._results: dict[Step, StepResult] = {}
        self._plans: dict[Step, Any] = {self.deployment.step: plan}
        self.hits = 0
        self.misses = 0
        self.reused = 0
        self._templates: dict = {}
        # layer-periodic runs (periodic_gpu_figure): the repeating layers' start (False:
        # not decided yet), the cut models' prepared plans and their figures per step
        self._periodic_d: Optional[int] | bool = False
        self._periodic_more = 0      # layers (per stage) past the last cut model's
        self._cuts: list[PreparedPlan] = []
        self._cut_results: dict[Step, Optional[list]] = {}
        self._cut_templates: dict = {}
        # the layers a step's DAG is recognised by: the same for every step (placement and
        # the model's program do not depend on it)
        self._sample_program = sample_program(plan.ctx)
        # the configuration's own step is checked against the size guard once, here
        check_size(plan, max_ops, self.symmetry.replicas)

    # -- steps -----------------------------------------------------------------------------

    def plan_for(self, step) -> Any:
        """The prepared run (:class:`g5core.lower.builder.Plan`) of ``step``: validated and
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

        # the step the GPU runs: a decode batch padded up to its captured CUDA graph
        gpu_step = graph_step(step, self.plan.ctx.system, self.step_rules.token_multiple)
        plan, sim = self._engine_run(step, gpu_step)
        ledger = memory_report(plan.ctx)
        dep = plan.ctx.deployment if gpu_step is step else self.deployment.with_step(step)

        # the framework's host work per step, overlapped with the GPU's or added to it
        latency_s = host_step_s(sim.latency_s, step, self.plan.ctx.system)
        metrics = phase_metrics(dep.phase, latency_s)
        result = StepResult(
            step=step, phase=dep.phase, latency_s=latency_s, ttft_s=metrics.get("ttft_s"),
            tpot_s=metrics.get("tpot_s"), new_tokens=step.new_tokens,
            tokens_per_s_per_chip=tokens_per_s_per_chip(dep, latency_s),
            memory=self._step_memory(ledger), choices=step_choices(plan.ctx))
        self._results[step] = result
        return attrs.evolve(result, sim=sim, ledger=ledger) if detail else result

    def _engine_run(self, step: Step, gpu_step: Step):
        """The prepared run of ``gpu_step`` (``step`` padded to its CUDA graph) and its
        simulation: the closed form for ``path: math``, else the event engine."""
        plan = self.plan_for(gpu_step)
        self.lookup.deployment = plan.ctx.deployment
        if plan.ctx.deployment.path == "math":  # the closed form, as `g5 run` gives it for path: math
            sim = math_estimate(plan)
        else:
            sim = self._from_template(step, plan)
            if sim is None:
                sim = simulate_plan(plan, check=self.check, symmetry=self._symmetry_arg, max_ops=self.max_ops)
                self._keep_template(step, plan, sim)
        total = getattr(sim, "ops", 0) + getattr(sim, "flows", 0)
        if total > self.max_ops:
            raise ResourceError(f"step {step.describe()} simulated {total:,} ops and flows, above the limit of "
                                f"{self.max_ops:,}; raise the limit (max_ops) or use a smaller deployment")
        return plan, sim

    # -- layer-periodic steps: the serving step runners' ---------------------------------

    def periodic_latency_s(self, step) -> float:
        """``simulate(step).latency_s`` with the GPU's part (the engine's step, before the
        framework's host time is applied around it) from :meth:`periodic_gpu_figure`: the
        same figure to a relative 1e-9 where the layers repeat, at the cost of three
        short models' runs (the serving step runners', ``g5 run`` stays on the full run)."""
        step = as_step(step)
        gpu_s = self.periodic_gpu_figure(step)
        if gpu_s is None:
            return self.simulate(step).latency_s
        return host_step_s(gpu_s, step, self.plan.ctx.system)

    def busiest_compute_s(self, step, owner: str, periodic: bool = False) -> float:
        """The compute time of ``owner``'s ops on the chip that runs most of it in the
        engine's step (:func:`g5core.sim.results.busiest_compute_by_owner`); ``periodic``:
        from :meth:`periodic_gpu_figure` where the layers repeat."""
        step = as_step(step)
        got = self.periodic_gpu_figure(step, owner) if periodic else None
        if got is None:
            got = busiest_compute_by_owner(self.simulate(step, detail=True).sim).get(owner, 0.0)
        return got

    def periodic_gpu_figure(self, step, owner: Optional[str] = None) -> Optional[float]:
        """A figure of the engine's run of ``step`` (padded to its CUDA graph), extrapolated
        along the layers: the GPU latency (``owner`` None) or the busiest chip's compute of
        ``owner``'s ops. Where the layers are alike past a prefix of ``d``
        (:meth:`_periodic_prefix`), the step runs on the model cut to ``d + 2``, ``d + 3``
        and ``d + 4`` layers and, when the two increments agree (:func:`layer_extrapolation`),
        the figure is the last cut's plus one increment per layer left. Where the layers sit
        on stages (contiguous runs of layers on the same chips: pipeline stages), a cut adds
        one layer to every stage, and the increments are per layer of each stage. None where
        the layers do not repeat, the path has no engine, or the increments disagree: the
        caller takes the full run."""
        d = self._periodic_prefix()
        if d is None:
            return None
        gpu_step = graph_step(as_step(step), self.plan.ctx.system, self.step_rules.token_multiple)
        figures = self._cut_figures(d, gpu_step)
        if figures is None:
            return None
        return layer_extrapolation([f.get(owner, 0.0) for f in figures], self._periodic_more)

    def _periodic_prefix(self) -> Optional[int]:
        """The layers before the repeating ones (``d``), decided once; None where the step
        cannot be extrapolated along the layers: ``path: math`` (no engine), a model whose
        layers past the dense prefix differ (:meth:`g5core.inputs.models.ModelSpec.alike_from`),
        too few layers to gain from it, layers past the prefix that do not expand alike,
        pipeline stages (runs of layers on different chips) beside a dense prefix or of too
        few layers (the three cut models' layers as many as the model's), cut models whose
        layers the plugins split over the stages otherwise, or a cut model that cannot be
        prepared."""
        if self._periodic_d is not False:
            return self._periodic_d
        self._periodic_d = None
        ctx = self.plan.ctx
        model = ctx.model
        d = model.alike_from()
        if ctx.deployment.path == "math" or d is None or model.n_layers <= d + PERIODIC_CUT_LAYERS[-1]:
            return None
        kinds: dict[int, list] = {}
        for lop in build_program(model):
            if d <= lop.layer < model.n_layers:
                kinds.setdefault(lop.layer, []).append(lop.kind)
        if len({tuple(k) for k in kinds.values()}) != 1:
            return None
        stages = _stage_sizes(ctx, model.n_layers)
        if len(stages) == 1:
            # one run of alike layers on the same chips: cuts of d + k layers
            cut_layers = [d + k for k in PERIODIC_CUT_LAYERS]
            more = model.n_layers - d - PERIODIC_CUT_LAYERS[-1]
        else:
            # stages (pipeline parallelism): a cut has k layers more than the fewest on every
            # stage (each stage keeps its extra layers), for a model of alike layers only
            fewest = min(stages)
            if d or fewest <= PERIODIC_CUT_LAYERS[-1]:
                return None
            extra = [n - fewest for n in stages]
            cut_layers = [sum(extra) + k * len(stages) for k in PERIODIC_CUT_LAYERS]
            more = fewest - PERIODIC_CUT_LAYERS[-1]
            if sum(cut_layers) >= model.n_layers:
                return None     # the three cuts' layers are as many as the model's: no gain
        try:
            self._cuts = [PreparedPlan(plan_deployment(self.deployment, self.plan.pm, max_ops=self.max_ops,
                                                       model=model.first_layers(n)),
                                       symmetry=self._symmetry_arg, max_ops=self.max_ops, check=self.check)
                          for n in cut_layers]
        except (ConfigError, PluginError, ResourceError):
            return None
        if len(stages) > 1 and any(_stage_sizes(cut.plan.ctx, n) != [e + k for e in extra]
                                   for cut, n, k in zip(self._cuts, cut_layers, PERIODIC_CUT_LAYERS)):
            return None     # the plugins split a cut's layers over the stages otherwise
        for cut in self._cuts:
            cut.lookup = self.lookup    # one compute-latency cache: the cut layers' kernels are the model's
        self._periodic_d, self._periodic_more = d, more
        return d

    def _cut_figures(self, d: int, gpu_step: Step) -> Optional[list[dict]]:
        """Per cut model (:data:`PERIODIC_CUT_LAYERS`), ``{None: GPU latency, owner: busiest
        chip's compute}`` of ``gpu_step``; None where a cut model refuses the step (the full
        run then answers, or refuses). The three runs share one sample of the step (the
        cut models' sample layers are alike): the op DAGs of an earlier step of the same
        structure, one per cut, with this step's specs (:meth:`_from_template`'s reuse)."""
        if gpu_step in self._cut_results:
            return self._cut_results[gpu_step]
        try:
            plans = [cut.plan_for(gpu_step) for cut in self._cuts]
            self.lookup.deployment = plans[0].ctx.deployment
            sims = self._cuts_from_template(plans)
            if sims is None:
                sims = [simulate_plan(plan, check=self.check, symmetry=self._symmetry_arg, max_ops=self.max_ops)
                        for plan in plans]
                self._keep_cut_templates(plans, sims)
            got = [{None: sim.latency_s, **busiest_compute_by_owner(sim)} for sim in sims]
        except (ConfigError, PluginError, ResourceError):
            got = None
        if len(self._cut_results) < PLANS_KEPT:
            self._cut_results[gpu_step] = got
        return got

    def _keep_cut_templates(self, plans: list, sims: list) -> None:
        """Keep the cut models' op DAGs of a fully built step, keyed on the structure of the
        first cut's sample, where every cut simulated the same replica and the sample's
        specs are every cut's whole DAG's."""
        sym = sims[0].symmetry
        if any(s.symmetry.applied != sym.applied or (sym.applied and s.symmetry.chips() != sym.chips())
               for s in sims) or len(self._cut_templates) >= TEMPLATES_KEPT:
            return
        sample = _sample_dag(plans[0], sym, self._cuts[0]._sample_program)
        if any(_specs_key(sample.specs) != _specs_key(s.dag.specs) for s in sims):
            return
        self._cut_templates.setdefault(_structure_key(sample), [
            (s.dag, s.symmetry, (s.compiled.succ, s.compiled.pred_count)) for s in sims])

    def _cuts_from_template(self, plans: list) -> Optional[list]:
        """The step simulated on each cut model's op DAG of an earlier step whose first cut's
        sample has the same structure, with this step's specs from that one sample; None
        where no kept DAGs match, or a run's messages leave the replica."""
        got = sample = None
        for sym in {t[0][1].applied: t[0][1] for t in self._cut_templates.values()}.values():
            sample = _sample_dag(plans[0], sym, self._cuts[0]._sample_program)
            got = self._cut_templates.get(_structure_key(sample))
            if got is not None:
                break
        if got is None:
            return None
        sims = []
        for plan, (dag, sym, edges) in zip(plans, got):
            step_dag = attrs.evolve(dag, specs=list(sample.specs), spec_is_comm=list(sample.spec_is_comm), spec_ids={},
                                    index={}, indexed=0, graph=None, graph_size=(-1, -1))
            result = _run_built(plan, step_dag, sym, self.check, edges, figures_only=True)
            if result is None:
                return None
            sims.append(result)
        self.reused += len(sims)
        return sims

    # -- the op DAG of a step structure, reused ------------------------------------------

    def _keep_template(self, step: Step, plan, sim) -> None:
        """Keep a fully built step's op DAG, keyed on the structure of its sample (one layer
        of each kind, :func:`sample_program`), where the sample's specs are the whole
        DAG's (layers alike expand alike, so every spec appears first in a sample layer)."""
        sample = _sample_dag(plan, sim.symmetry, self._sample_program)
        if _specs_key(sample.specs) != _specs_key(sim.dag.specs) or len(self._templates) >= TEMPLATES_KEPT:
            return
        self._templates.setdefault(_structure_key(sample), (sim.dag, sim.symmetry,
                                                            (sim.compiled.succ, sim.compiled.pred_count)))

    def _from_template(self, step: Step, plan):
        """The step simulated on the op DAG of an earlier step whose sample layers expand to
        the same ops, edges and keys: that DAG with this step's specs (its FLOPs, bytes,
        kernels and messages, from its own sample). None where no kept DAG matches."""
        got = sample = None
        for sym in {t[1].applied: t[1] for t in self._templates.values()}.values():
            sample = _sample_dag(plan, sym, self._sample_program)
            got = self._templates.get(_structure_key(sample))
            if got is not None:
                break
        if got is None:
            return None
        dag, sym, edges = got
        step_dag = attrs.evolve(dag, specs=list(sample.specs), spec_is_comm=list(sample.spec_is_comm), spec_ids={},
                                index={}, indexed=0, graph=None, graph_size=(-1, -1))
        result = _run_built(plan, step_dag, sym, self.check, edges)
        if result is not None:
            self.reused += 1
        return result

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
                "dags_reused": self.reused, "latency_answers": len(self.lookup.answers),
                "periodic_steps": len(self._cut_results)}


#: op DAGs kept for reuse, one per structure
TEMPLATES_KEPT = 64


#: the cut models of a layer-periodic run: the repeating layers' start plus these many
#: layers (two layers before the first increment, so that a layer's overlap with the one
#: before it is the steady one)
PERIODIC_CUT_LAYERS = (2, 3, 4)

#: how closely the two increments along the layers must agree (relative to the larger) for
#: a layer-periodic run to be taken; the engine gives equal increments to about 1e-15
PERIODIC_REL_TOLERANCE = 1e-9


def _stage_sizes(ctx, n_layers: int) -> list[int]:
    """The layers of each run of consecutive layers on the same chips (one run without
    pipeline stages)."""
    sizes: list[int] = []
    last = None
    for layer in range(n_layers):
        chips = ctx.layer_chips(layer)
        if chips == last:
            sizes[-1] += 1
        else:
            sizes.append(1)
            last = chips
    return sizes


def layer_extrapolation(figures: Sequence[float], more_layers: int) -> Optional[float]:
    """A figure at ``more_layers`` layers past the last of three runs one layer apart
    (``figures``): ``f[2] + more_layers * (f[2] - f[1])``, where the increments ``f[1] -
    f[0]`` and ``f[2] - f[1]`` agree to :data:`PERIODIC_REL_TOLERANCE`; None where they do
    not (the figure is not affine in the layers there)."""
    f0, f1, f2 = figures
    first, second = f1 - f0, f2 - f1
    if abs(second - first) > PERIODIC_REL_TOLERANCE * max(abs(first), abs(second)):
        return None
    return f2 + more_layers * second


def sample_program(ctx):
    """The logical ops of one layer of each kind (the same logical ops, on the same chips,
    after a layer on the same chips: the size estimate's classes), the embedding and the
    head, in program order, each keeping only the inputs the sample holds."""
    model = ctx.model
    program = build_program(model)
    layers: dict[int, list] = {}
    for lop in program:
        layers.setdefault(lop.layer, []).append(lop)
    seen, keep, previous = set(), set(), ()
    for layer, lops in layers.items():
        chips = ctx.layer_chips(layer) if 0 <= layer < model.n_layers else (layer,)
        # a layer after one on its own chips: one of each kind, on whichever chips (on each
        # pipeline stage it expands as on the first, its groups its stage's first layer's)
        kind = (tuple(lop.kind for lop in lops),) + ((chips, previous) if chips != previous else ())
        if kind not in seen:
            seen.add(kind)
            keep.add(layer)
        previous = chips
    kept = [lop for lop in program if lop.layer in keep]
    ids = {lop.id for lop in kept}
    return tuple(attrs.evolve(lop, inputs=tuple(i for i in lop.inputs if i in ids)) for lop in kept)


def _sample_dag(plan, sym, program):
    return build_dag(plan, program=program, chips=sym.chips() if sym.applied else None)


def _specs_key(specs) -> tuple:
    return tuple(specs)


def _structure_key(dag) -> tuple:
    """What a sample DAG's ops, edges and keys are, without their work and bytes: two steps
    alike here build whole DAGs alike but for their specs' numbers (and messages)."""
    kinds = tuple((spec.primitive, spec.owner, spec.group) if comm else (spec.op_class, spec.owner, spec.dtype)
                  for spec, comm in zip(dag.specs, dag.spec_is_comm))
    return (dag.chip.tobytes(), dag.layer.tobytes(), dag.spec.tobytes(), dag.key_stem.tobytes(), dag.key_arg.tobytes(),
            dag.edge_pairs.tobytes(), tuple(dag.stems), tuple(dag.odd_keys), tuple(dag.spec_is_comm), kinds)


@attrs.frozen(eq=False)
class _Figures:
    """What a cut model's run gives the layer-periodic figures (:meth:`PreparedPlan._cut_figures`):
    its latency and each op's start and end (:func:`busiest_compute_by_owner`), as
    :func:`summarize` makes them, without the rest of its report."""
    latency_s: float
    dag: Any
    start_s: np.ndarray
    end_s: np.ndarray


def _run_built(plan, dag, sym, check: bool, edges, figures_only: bool = False):
    """Compile, run and summarise an op DAG already built for ``plan`` (one replica where
    ``sym`` applies, as it did for the DAG's first step), ``edges`` its successor lists;
    ``figures_only``: a :class:`_Figures` (the engine's invariants still checked with
    ``check``)."""
    with gc_paused():
        t0 = time.perf_counter()
        compiled = compile_dag(dag, plan, edges)
        if sym.applied and check_resources(sym, dag, compiled, plan) is not None:
            return None  # this step's messages leave the replica: the full path decides
        engine = Engine(dag=compiled).run()
        _check_finite([engine.makespan_s])
        if figures_only:
            if check:
                check_conservation(conservation_kpis(engine))
            return _Figures(float(engine.makespan_s), dag, np.asarray(engine.start_s, dtype=float),
                            np.asarray(engine.end_s, dtype=float))
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


def prepare(config: Mapping | Deployment | str | pathlib.Path, *, overrides: Iterable[str] = (),
            disabled: Iterable[str] = (), extra_plugins: Sequence = (), symmetry: bool | str = True,
            max_ops: Optional[int] = None, check: bool = True) -> PreparedPlan:
    """Validate a deployment once and return a :class:`PreparedPlan` that simulates steps.

    ``config``: a configuration mapping, a validated Deployment, or the path of a YAML, TOML
    or JSON file; ``overrides`` are ``dotted.key=value`` strings as ``--set`` takes them
    (``step.0.cached_tokens=4096``); ``disabled`` names plugins to disable; ``symmetry``
    and ``max_ops`` as for :func:`g5core.session.run.run`. Bad input raises ConfigError."""
    if isinstance(config, (str, pathlib.Path)):
        config = resolve_config_paths(load_config_file(config), pathlib.Path(config).parent)
    overrides = tuple(overrides)
    if overrides:
        if isinstance(config, Deployment):
            config = config.to_dict()
        config = apply_overrides(config, overrides)
    plan = make_plan(config, disabled, extra_plugins, max_ops=max_ops)
    return PreparedPlan(plan, symmetry=symmetry, max_ops=max_ops, check=check)
