"""Layout search (``g5 best``): which split of the chips is best for this model, context and system?

1. Enumerate every split of ``chips`` over the registered dimensions (:func:`enumerate_layouts`):
   every ordered factorisation over the factor dimensions (dp, pp, cp, tp and any a
   third-party plugin adds), and for each non-factor dimension (ep) every divisor of the
   rank space it regroups. Nothing here names a strategy: the registry says what exists.
2. Validate each layout and compute its memory ledger without simulating; a layout that
   the plugins refuse (head limit, divisibility...) or that does not fit is excluded, with
   its reason, grouped into families (the field or cause that excluded it).
3. Simulate the rest through the sweep machinery and the results database, in parallel.
4. Rank by the objective, and give the Pareto front of latency against per-chip memory.
"""
from __future__ import annotations

import itertools
import tempfile
from typing import Mapping, Optional, Sequence

import attrs

from g5core.inputs.step import Step
from g5core.inputs.config import all_disabled
from g5core.api.dimensions import DimensionRegistry, collect_dimensions
from g5core.api.errors import ConfigError, G5Error, PluginError
from g5core.api.plugins import Hooks, make_plugin_manager
from g5core.inputs.models import get_model
from g5core.session.run import make_plan
from g5core.sim.memory import memory_report
from g5core.study.sweep import run_sweep

#: objective -> (column, best is the largest)
OBJECTIVES = {"ttft": ("ttft_s", False), "tpot": ("tpot_s", False), "tokens_per_s_per_chip": ("tokens_per_s_per_chip", True),
              "latency": ("latency_s", False)}
OBJECTIVE_PHASE = {"ttft": "prefill", "tpot": "decode"}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorizations(n: int, slots: int) -> list[tuple[int, ...]]:
    """Every ordered tuple of ``slots`` positive integers whose product is ``n``."""
    if slots == 0:
        return [()] if n == 1 else []
    if slots == 1:
        return [(n,)]
    return [(d,) + rest for d in divisors(n) for rest in factorizations(n // d, slots - 1)]


def enumerate_layouts(chips: int, dims: DimensionRegistry, moe: bool = True) -> list[dict[str, int]]:
    """Every split of ``chips`` over the registered dimensions, in a fixed order; with
    ``moe=False`` (a dense model) the expert-only dimensions are left out (they stay 1)."""
    factor_names = [d.name for d in dims.factors]
    others = [d for d in dims.dims if not d.factor and (moe or not d.moe_only)]
    out = []
    for split in factorizations(chips, len(factor_names)):
        sizes = dict(zip(factor_names, split))
        choices = []
        for d in others:
            space = 1
            for r in d.regroups:
                space *= sizes.get(r, 1)
            choices.append([(d.name, v) for v in divisors(space)])
        for combo in itertools.product(*choices):
            out.append({**sizes, **dict(combo)})
    return out


def layout_label(parallel: Mapping[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(parallel.items()))


@attrs.frozen(kw_only=True)
class Exclusion:
    parallel: dict
    family: str            # "memory", a configuration field, or "plugin '<name>'"
    reason: str
    shortfall_bytes: float = 0.0


@attrs.frozen(kw_only=True)
class Candidate:
    parallel: dict
    latency_s: float
    objective_value: float
    fits: bool
    max_total_bytes: float
    tokens_per_s_per_chip: float

    #: the full resolved configuration the candidate ran (model, system, dtypes, options...)
    config: dict = attrs.field(factory=dict, eq=False)

    def to_json_dict(self) -> dict:
        return {"parallel": dict(sorted(self.parallel.items())), "latency_s": self.latency_s, "fits": self.fits,
                "max_total_bytes": self.max_total_bytes, "tokens_per_s_per_chip": self.tokens_per_s_per_chip,
                "objective_value": self.objective_value, "config": self.config}


@attrs.frozen(kw_only=True)
class SearchResult:
    objective: str
    layouts: int
    ranked: tuple[Candidate, ...]      # best first
    pareto: tuple[Candidate, ...]      # by latency
    excluded: tuple[Exclusion, ...]
    sweep_id: int

    def families(self) -> list[tuple[str, list[Exclusion]]]:
        """Exclusions grouped by family, largest family first (then by name)."""
        groups: dict[str, list[Exclusion]] = {}
        for e in self.excluded:
            groups.setdefault(e.family, []).append(e)
        return sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))


def _objective(objective: Optional[str], phase: str) -> str:
    if objective is None:  # a step's own metric: TTFT (prefill), TPOT (decode), its latency (mixed)
        return {"prefill": "ttft", "decode": "tpot"}.get(phase, "latency")
    if objective not in OBJECTIVES:
        raise ConfigError("--objective", f"unknown objective {objective!r}; use {', '.join(OBJECTIVES)}")
    need = OBJECTIVE_PHASE.get(objective)
    if need and need != phase:
        raise ConfigError("--objective", f"{objective} is a {need} metric but the configuration is {phase}; "
                                         f"use {'ttft' if phase == 'prefill' else 'tpot'} or tokens_per_s_per_chip")
    return objective


def pareto_front(cands: Sequence[Candidate]) -> tuple[Candidate, ...]:
    """Candidates no other beats on both latency and per-chip memory, by increasing latency."""
    front = []
    best_mem = float("inf")
    for c in sorted(cands, key=lambda c: (c.latency_s, c.max_total_bytes, layout_label(c.parallel))):
        if c.max_total_bytes < best_mem:
            front.append(c)
            best_mem = c.max_total_bytes
    return tuple(front)


def prefilter(raw: Mapping, layouts: Sequence[dict], disabled: Sequence[str] = (),
              extra_plugins: Sequence = ()) -> tuple[list[dict], list[Exclusion]]:
    """Split layouts into those to simulate and those excluded (invalid, or not fitting by the ledger)."""
    keep, excluded = [], []
    for par in layouts:
        try:
            plan = make_plan(dict(raw, parallel=par), disabled, extra_plugins)
        except ConfigError as exc:
            excluded.append(Exclusion(parallel=par, family=exc.field or "configuration", reason=str(exc)))
            continue
        except PluginError as exc:
            excluded.append(Exclusion(parallel=par, family=f"plugin '{exc.plugin}'", reason=str(exc)))
            continue
        mem = memory_report(plan.ctx)
        if not mem.fits:
            short = mem.max_total_bytes - mem.capacity_bytes
            excluded.append(Exclusion(parallel=par, family="memory", reason=mem.shortfall_summary(), shortfall_bytes=short))
            continue
        keep.append(par)
    return keep, excluded


def best_layouts(raw: Mapping, objective: Optional[str] = None, db_path=None, disabled: Sequence[str] = (),
                 workers: int = 1, executor: str = "local", progress=None, extra_plugins: Sequence = (),
                 inputs: Sequence = ()) -> SearchResult:
    """Enumerate, pre-filter, simulate (through the sweep machinery) and rank every layout."""
    phase = raw.get("phase")
    if "step" in raw:  # a step list: its phase (prefill, decode or mixed)
        try:
            phase = Step.from_list(raw["step"]).phase
        except ConfigError:
            pass  # the layouts' runs report the error
    objective = _objective(objective, phase)
    names = all_disabled(raw, disabled)
    dims = collect_dimensions(Hooks(make_plugin_manager(disabled=names, extra_plugins=extra_plugins)))
    chips = raw.get("chips")
    if isinstance(chips, bool) or not isinstance(chips, int) or chips <= 0:
        raise ConfigError("chips", f"must be a positive whole number, got {chips!r}")
    model = get_model(raw.get("model")) if isinstance(raw.get("model"), str) else None
    layouts = enumerate_layouts(chips, dims, moe=model is None or model.moe is not None)
    keep, excluded = prefilter(raw, layouts, disabled, extra_plugins)
    if not keep:
        mem = [e for e in excluded if e.family == "memory"]
        hint = (f"; the closest, {layout_label(min(mem, key=lambda e: e.shortfall_bytes).parallel)}, "
                f"{min(mem, key=lambda e: e.shortfall_bytes).reason}") if mem else ""
        raise G5Error(f"no layout of {chips} chips is valid and fits ({len(layouts)} tried){hint}")
    base = dict(raw, parallel=keep[0])
    grid = (("parallel", tuple(keep)),)
    kwargs = dict(disabled=disabled, workers=workers, executor=executor, kind="best",
                  options={"objective": objective}, progress=progress, extra_plugins=extra_plugins, inputs=inputs)
    if db_path is None:
        with tempfile.TemporaryDirectory(prefix="g5-best-") as tmp:
            report = run_sweep(base, grid, f"{tmp}/best.db", **kwargs)
    else:
        report = run_sweep(base, grid, db_path, **kwargs)
    column, largest = OBJECTIVES[objective]
    cands = []
    for row in report.rows:
        if row["status"] != "ok":
            excluded.append(Exclusion(parallel=row["point"]["parallel"], family="simulation", reason=row["error"]))
            continue
        cands.append(Candidate(parallel=row["point"]["parallel"], latency_s=row["latency_s"],
                               objective_value=row[column], fits=bool(row["fits"]),
                               max_total_bytes=row["max_total_bytes"],
                               tokens_per_s_per_chip=row["tokens_per_s_per_chip"], config=row["config"]))
    sign = -1.0 if largest else 1.0
    ranked = sorted(cands, key=lambda c: (sign * c.objective_value, c.max_total_bytes, layout_label(c.parallel)))
    return SearchResult(objective=objective, layouts=len(layouts), ranked=tuple(ranked), pareto=pareto_front(cands),
                        excluded=tuple(excluded), sweep_id=report.sweep_id)


