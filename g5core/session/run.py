"""The programmatic API: configuration in, results out.

    raw = load_raw("examples/llama-3.1-70b-prefill.yaml", overrides=["parallel.cp=1"])
    out = run(raw, disabled=["cp_passkv"])
    print(out.to_json_dict()["ttft_s"])
"""
from __future__ import annotations

import math
import pathlib
import time
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import attrs

from g5core.lower.builder import Plan, ReplicaSpill, build_dag, check_size, plan_deployment, plan_for_step
from g5core.lower.shape import collect_shard_axes
from g5core.lower.steprules import step_rules
from g5core.lower.microbatch import CYCLES, MAX_CYCLES, steady_cycle_s
from g5core.api.errors import ConfigError, G5Error
from g5core.inputs.config import Deployment, all_disabled, apply_overrides, load_config_file, resolve_config_paths
from g5core.inputs.framework import graph_step
from g5core.sim.engine import Engine
from g5core.sim.heap import gc_paused
from g5core.sim.compile import compile_dag
from g5core.inputs.serving import serving_input_files
from g5core.session.mathpath import MathResult, math_estimate
from g5core.sim.memory import MemoryReport, memory_report, with_terms
from g5core.session.speculative import Proposer, SpeculativeResult, verify_deployment
from g5core.api.plugins import make_plugin_manager
from g5core.sim.results import SimResult, check_conservation, step_choices, summarize
from g5core.lower.symmetry import check_reduced_dag, check_resources, off_reason, plan_symmetry


def load_raw(path, overrides: Iterable[str] = ()) -> dict:
    """Read a configuration file (its relative file paths read beside it,
    :func:`~g5core.inputs.config.resolve_config_paths`) and apply ``dotted.key=value`` overrides
    (whose paths read from the working directory, as a command line's do)."""
    raw = resolve_config_paths(load_config_file(path), pathlib.Path(path).parent)
    return apply_overrides(raw, overrides)


def make_plan(raw: Mapping | Deployment, disabled: Iterable[str] = (), extra_plugins: Sequence = (),
              source: str = "configuration", max_ops: Optional[int] = None) -> Plan:
    """Plugin manager (CLI and config disables together) and a validated, prepared run."""
    names = all_disabled(raw, disabled)
    pm = make_plugin_manager(disabled=names, extra_plugins=extra_plugins)
    plan = plan_deployment(raw, pm, source=source, max_ops=max_ops)
    if names and not plan.ctx.deployment.disabled_plugins == names:
        plan.ctx.deployment = attrs.evolve(plan.ctx.deployment, disabled_plugins=names)
    return plan


def input_files(config_path, raw: Mapping) -> list[tuple[str, Any]]:
    """The files a run reads (configuration, and model or system when given as paths), as
    ``(label, path)`` pairs; no output may overwrite one of them."""
    out: list[tuple[str, Any]] = [("configuration", config_path)]
    for key in ("model", "system"):
        value = raw.get(key) if isinstance(raw, Mapping) else None
        if isinstance(value, str) and value:
            out.append((f"{key} file", value))
    return out + serving_input_files(raw)


Progress = Optional[Callable[[str], None]]


def simulate_plan(plan: Plan, engine_cls: type = Engine, check: bool = True, progress: Progress = None,
             record_port_rates: bool = False, symmetry: bool | str = True,
             timings: Optional[dict] = None, max_ops: Optional[int] = None) -> SimResult:
    """Build the DAG, run the engine, and check the six conservation KPIs.

    ``progress``, when given, receives one line per phase (for long runs);
    ``record_port_rates`` keeps every port's bandwidth over time (for traces).
    ``symmetry``: simulate one of identical independent replicas where that is exact
    (:mod:`g5core.lower.symmetry`); ``False`` (or a string: the reason) simulates every chip.
    ``timings``, when given, receives the wall seconds of each phase (build, compile,
    engine, report: benchmarks/bench.py). Where a symmetric run falls back to every chip
    after its build, the full run is checked against ``max_ops`` first."""
    with gc_paused():
        return _simulate(plan, engine_cls, check, progress, record_port_rates, symmetry, timings, max_ops)


def _simulate(plan, engine_cls, check, progress, record_port_rates, symmetry, timings, max_ops) -> SimResult:
    copies, mb = plan.micro_batches, plan.pipeline
    if mb is None:
        return _simulate_program(plan, engine_cls, check, progress, record_port_rates, symmetry, timings, max_ops)
    cycles = CYCLES if mb.cycles_apply else 1
    n_layers = plan.ctx.model.n_layers
    while True:
        contexts = copies.contexts(cycles)
        program = copies.program(plan.ctx, cycles)
        result = _simulate_program(plan, engine_cls, check, progress, record_port_rates, symmetry, timings, max_ops,
                                   program=program, contexts=contexts, cycles=cycles)
        if not mb.cycles_apply:
            pipeline = {"microbatches": mb.count, "chunk_tokens": list(mb.chunks), "simulated_steps": mb.count}
            chosen = [step_choices(part) for part in copies.parts]
            if any(chosen):   # per chunk: what plugins chose for it (CP prefill under auto)
                pipeline["chunk_choices"] = chosen
            return attrs.evolve(result, pipeline=pipeline)
        times = copies.head_end_times(result.dag, result.end_s, cycles, n_layers)
        cycle_s, steady = steady_cycle_s(times)
        if steady or cycles >= MAX_CYCLES:
            break
        cycles *= 2
        check_size(plan, max_ops, plan_symmetry(plan.ctx, off_reason(symmetry)).replicas, cycles)
    _check_finite([cycle_s])
    pipeline = {"microbatches": mb.count, "batch_sequences": list(mb.batches), "cycles_simulated": cycles,
                "simulated_steps": cycles * mb.count, "steady": bool(steady), "cycle_s": cycle_s,
                "step_interval_s": cycle_s / mb.count, "simulated_s": result.latency_s}
    return attrs.evolve(result, latency_s=cycle_s, pipeline=pipeline)


def _simulate_program(plan, engine_cls, check, progress, record_port_rates, symmetry, timings, max_ops,
                      program=None, contexts=None, cycles: int = CYCLES) -> SimResult:
    say = progress or (lambda line: None)
    clock = _Phases(timings)
    t0 = time.perf_counter()
    sym = plan_symmetry(plan.ctx, off_reason(symmetry))
    say("building the op DAG" + (f" of one of {sym.replicas} {sym.dimension} replicas" if sym.applied else ""))
    try:
        dag = build_dag(plan, program, chips=sym.chips() if sym.applied else None, contexts=contexts)
        reason = check_reduced_dag(sym, dag) if sym.applied else None
    except ReplicaSpill as exc:
        reason = str(exc)
    clock("build_s")
    if reason is None:
        say(f"compiling {len(dag.ops)} ops and {dag.n_edges} edges")
        compiled = compile_dag(dag, plan)
        reason = check_resources(sym, dag, compiled, plan) if sym.applied else None
        clock("compile_s")
    if reason is not None:
        sym = sym.refused(reason)
        check_size(plan, max_ops, cycles=cycles)
        say(f"simulating every chip: {reason}; building the op DAG")
        dag = build_dag(plan, program, contexts=contexts)
        clock("build_s")
        say(f"compiling {len(dag.ops)} ops and {dag.n_edges} edges")
        compiled = compile_dag(dag, plan)
        clock("compile_s")
    say(f"simulating {len(compiled.keys)} ops and {len(compiled.flow_bytes)} flows")
    engine = engine_cls(dag=compiled, record_port_rates=record_port_rates).run()
    clock("engine_s")
    _check_finite([engine.makespan_s])  # before the summary does arithmetic on it
    say(f"{engine.events} events; checking conservation")
    result = summarize(dag, engine, plan.ctx.deployment.phase, time.perf_counter() - t0, sym)
    if check:
        check_conservation(result.kpis)
    clock("report_s")
    return result


class _Phases:
    """Adds the wall seconds since the last call to ``timings[phase]``."""

    def __init__(self, timings: Optional[dict]):
        self.timings, self.last = timings, time.perf_counter()

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        if self.timings is not None:
            self.timings[phase] = self.timings.get(phase, 0.0) + now - self.last
        self.last = now


def tokens_per_s_per_chip(deployment: Deployment, latency_s: float, resident_batches: int = 1) -> float:
    """Tokens the whole deployment produces per second, per chip.

    The step's counts are per data-parallel replica (the configuration's contract), so the
    deployment runs ``dp`` times the step's new tokens (prefill shorthand: ``batch x seq_len``
    per replica; decode: ``batch``), ``resident_batches`` times over where decode
    micro-batches cycle through a pipeline. ``latency_s`` is the time those tokens take: a
    prefill's TTFT, or a decode's time per output token, which with micro-batches is the
    engine's steady cycle (every micro-batch makes one token per cycle: the pipelined
    throughput). Without micro-batches a pipeline holds one batch, in one stage at a time."""
    tokens = deployment.step.new_tokens * resident_batches * deployment.size("dp")
    return tokens / latency_s / deployment.chips


@attrs.frozen(eq=False, kw_only=True)
class RunOutput:
    deployment: Deployment
    plan: Plan
    memory: MemoryReport
    sim: Optional[SimResult] = None
    math: Optional[MathResult] = None
    #: a speculative decode (g5core.session.speculative.SpeculativeResult): ``sim`` / ``math``
    #: is then its verification step, ``latency_s`` the effective time per output token
    speculative: Optional[SpeculativeResult] = None

    @property
    def latency_s(self) -> float:
        if self.speculative is not None:
            return self.speculative.tpot_s
        return self.sim.latency_s if self.sim is not None else self.math.latency_s

    @property
    def tokens_per_s_per_chip(self) -> float:
        return tokens_per_s_per_chip(self.deployment, self.latency_s, self.plan.ctx.resident_batches)

    def to_json_dict(self) -> dict[str, Any]:
        dep = self.deployment
        if self.sim is not None:
            out = self.sim.to_json_dict()
        else:
            out = self.math.to_json_dict()
        out = {"path": dep.path, **out, "tokens_per_s_per_chip": self.tokens_per_s_per_chip}
        if self.speculative is not None:
            out.update(latency_s=self.latency_s, tpot_s=self.latency_s, speculative=self.speculative.to_json_dict())
        out["deployment"] = dep.to_dict()
        out["memory"] = self.memory.to_json_dict()
        choices = step_choices(self.plan.ctx)
        if choices:  # what plugins chose for this step (e.g. the CP prefill algorithm under auto)
            out["choices"] = choices
        if self.sim is not None and self.math is not None:
            out["math"] = self.math.to_json_dict()
        return out


def run(raw: Mapping | Deployment, disabled: Iterable[str] = (), compare_math: bool = False,
        extra_plugins: Sequence = (), progress: Progress = None, record_port_rates: bool = False,
        max_ops: Optional[int] = None, symmetry: bool | str = True) -> RunOutput:
    """Validate, refuse a run above ``max_ops`` ops and flows (default
    ``build.DEFAULT_MAX_OPS``) before building anything, then simulate or estimate.
    ``symmetry``: see :func:`simulate_plan`."""
    plan = make_plan(raw, disabled, extra_plugins, max_ops=max_ops)
    dep = plan.ctx.deployment
    gpu_step = graph_step(dep.step, plan.ctx.system, step_rules(plan.hooks, dep).token_multiple)
    if gpu_step is not dep.step:  # a decode batch padded up to its captured CUDA graph
        plan = plan_for_step(plan, dep.with_step(gpu_step), collect_shard_axes(plan.hooks))
    replicas = plan_symmetry(plan.ctx, off_reason(symmetry)).replicas if dep.path != "math" else 1
    size = check_size(plan, max_ops, replicas)
    if progress is not None:
        progress(f"estimated {size.describe()}")
    if dep.speculative is not None and dep.speculative.enabled:
        return _finite(speculative_run(plan, progress, symmetry, max_ops))
    memory = memory_report(plan.ctx)
    if dep.path == "math":
        return _finite(RunOutput(deployment=dep, plan=plan, memory=memory, math=math_estimate(plan)))
    if compare_math:
        # the Math path's own guards apply to the comparison (cp > 1 is refused there),
        # checked before the simulation so a refused run costs nothing
        as_math = attrs.evolve(dep, path="math")
        try:
            plan.hooks.call_each("g5_validate_deployment", deployment=as_math, model=plan.ctx.model,
                                 system=plan.ctx.system)
        except ConfigError as exc:
            raise ConfigError("--compare-math", f"the Math path refuses this configuration: {exc}") from None
    sim = simulate_plan(plan, progress=progress, record_port_rates=record_port_rates, symmetry=symmetry, max_ops=max_ops)
    mres = math_estimate(plan) if compare_math else None
    return _finite(RunOutput(deployment=dep, plan=plan, memory=memory, sim=sim, math=mres))


def speculative_run(plan: Plan, progress: Progress = None, symmetry: bool | str = True,
                    max_ops: Optional[int] = None) -> RunOutput:
    """A speculative decode (:mod:`g5core.session.speculative`): the verification step, one
    proposer pass and the plain decode step, each simulated (or estimated on the Math path);
    the ledger of the verification step with the proposer's lines."""
    dep = plan.ctx.deployment
    if plan.pipeline is not None:
        raise ConfigError(plan.pipeline.field, "speculative decoding runs one batch per step here, not "
                                               f"micro-batches through a pipeline; set {plan.pipeline.field}: 1")
    vplan = plan_for_step(plan, verify_deployment(dep), collect_shard_axes(plan.hooks))

    def simulate(p: Plan):
        if p.ctx.deployment.path == "math":
            return math_estimate(p)
        return simulate_plan(p, progress=progress, symmetry=symmetry, max_ops=max_ops)

    proposer = Proposer(plan, dep.speculative)
    verify = simulate(vplan)
    result = SpeculativeResult(spec=dep.speculative, verify_s=verify.latency_s, proposer_pass_s=proposer.pass_s(simulate),
                               plain_decode_s=simulate(plan).latency_s, batch=dep.batch)
    memory = with_terms(memory_report(vplan.ctx), proposer.memory_terms())
    sim, mres = (None, verify) if dep.path == "math" else (verify, None)
    return RunOutput(deployment=dep, plan=vplan, memory=memory, sim=sim, math=mres, speculative=result)


def _finite(out: RunOutput) -> RunOutput:
    """A result is finite or it is an error (the input limits keep it finite; this is the
    last line of defence, so no summary or JSON ever shows inf or NaN)."""
    values = [out.latency_s, out.memory.max_total_bytes]
    if out.math is not None:
        values.append(out.math.latency_s)
    _check_finite(values)
    return out


def _check_finite(values: Iterable[float]) -> None:
    if not all(math.isfinite(v) for v in values):
        raise G5Error("the result is not a finite number; an input is out of range (check the magnitudes in the "
                      "configuration, model and system files)")
