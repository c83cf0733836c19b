"""Serving search (``g5 best CONFIG --serve``): on these chips, for this traffic, within these
SLO limits, which deployment serves the most?

1. **Layouts.** Every layout of every per-instance chip count ``c`` dividing ``chips``
   (:func:`g5core.study.search.enumerate_layouts` over the registered dimensions, cp and sp
   included; ``dp`` stays 1 inside an instance: the instances are the data-parallel copies),
   each with every chunk size (``max_num_batched_tokens``) of ``chunks``.
2. **Screening** (one cell per layout and chunk size, before any rate is tried): the
   plugins' refusals, the KV pool (the ledger's pool must hold the longest request), and
   one request alone on an idle instance: its TTFT is the lone prefill (every chunk), its
   TPOT the lone decode at the growing context. A layout whose lone prefill misses a TTFT
   limit, or whose lone decode misses a TPOT limit, can meet it at no rate (a loaded
   instance only adds work to a step), so it is pruned, with its reason, grouped by family.
3. **Candidates.** Aggregated: ``chips / c`` instances of a kept layout, with
   ``max_num_seqs`` over the powers of two from ``min_seqs`` up to the first that the KV pool
   cannot hold with every sequence at its longest (the pool caps the batch beyond it).
   Disaggregated (``--disagg on|auto``): a prefill pool and a decode pool of kept layouts
   (a prefill layout must meet the TTFT screen, a decode layout the TPOT one) with
   ``n_p c_p + n_d c_d = chips``, every pair of layouts (``--beam N`` keeps only the ``N``
   best of each role by their lone step: a heuristic cut, reported as such). The screen is
   the aggregated one: a layout whose pool cannot hold a whole request is out of both
   roles, even though a prefill pool only needs the prompt.
4. **Bounds.** Each candidate gets a saturated throughput ``mu`` (requests/s) from its
   roles as DistServe sizes them, per layout from the screen (:func:`role_rates`: the
   prefill pool's prompts per lone prefill, the decode pool's best tokens per second over
   the batches within the TPOT limit; an aggregated instance is both roles), and, for an
   aggregated candidate that reaches a wave, the lower of that and a run of its own
   deployment with ``SATURATED_ROUNDS`` full batches of requests arriving at once
   (:func:`saturated_run`, in its cell). A run at a rate above ``mu`` builds a queue, so
   the TTFT percentile bounds the capacity (:func:`capacity_bound`).
   **Estimate.** Each candidate also gets an estimated capacity from its layouts' step
   tables (:mod:`g5core.study.serve_estimate`: the scheduler's steady state per instance,
   the prompts' queue of the run's own length and arrivals; the lower of the prefill and
   decode pools' for a disaggregated one); its bound is at most the estimate times ``1 +
   ESTIMATE_MARGIN``, it needs no saturated run, and its bisection starts at
   ``START_ESTIMATE_SHARE x estimate``. The estimate is not a proof either: the tests check
   it against simulated capacities.
5. **Capacity** of each candidate: the highest Poisson arrival rate at which the SLO holds
   (every named percentile under its limit, every request completed) on the workload's
   seed and on ``confirm`` further seeds (a rate holds when every seed's run does; the
   further seeds run only while the earlier ones hold), by seeded runs of ``requests``
   requests: from ``START_ESTIMATE_SHARE x estimate`` the rate gallops by ``1 +
   tolerance`` (the factor squared each step) up while the SLO holds or down while it does
   not, to a bracket; without an estimate (``min_chips``, ``bound=False``) from ``START_SHARE
   x mu`` (without a bound: ``instances / lone end-to-end``) it bisects toward the bound,
   then doubles past it if the SLO still holds there (the bound only guesses the bracket:
   a failing run is required above the capacity), or halves until it holds; then it bisects
   until ``hi / lo <= 1 + tolerance``: the capacity is ``lo``. Each run has ``max(requests,
   settle x rate x (TTFT limit + mean output x TPOT limit))`` requests (``settle`` times the
   requests in the system when the SLO holds, by Little's law). ``min_chips`` also lets a
   deployment use fewer chips and first asks whether it serves ``--rate``.
6. **Branch and bound** (not for ``min_chips``; ``bound=False`` turns it off): candidates run
   best bound first, ``WAVE`` at a time; before each wave, a candidate whose bound of
   the objective (its capacity bound over its chips, the goodput share at most 1) is below
   the ``top``-th best simulated value cannot enter the top ``top`` and is bounded out
   (reported with its bound, not simulated), and so is every one after it. In the wave, a
   candidate's first run is at the rate where its value would equal that one (when its
   start is below it), and a failing run at or below that rate ends its search: its
   capacity is below it (bounded out by simulation); an aggregated candidate without an
   estimate whose saturated run lowers its bound below that value stops there (bounded out
   too). The waves are fixed, so the candidates simulated do not depend on the workers.
   The Pareto front is the simulated candidates' front.
7. **Ranking** by the objective: ``goodput_per_chip`` (requests/s per chip meeting the SLO
   at capacity), ``throughput_per_chip`` (output tokens/s per chip at capacity), or
   ``min_chips`` (fewest chips serving ``--rate``, then the most goodput per chip).

What is approximate: the bounds and the estimates. ``mu`` is a measured steady state (no proof that a lighter
load does better per second), the queue argument takes the queue's growth at its mean, the
decode role counts only batches within ``1 + TPOT_SLACK`` of the TPOT limit, and each
allows ``BOUND_MARGIN`` more; ``tests/test_serve_search.py`` simulates the bounded-out
candidates anyway and checks that none beats the ``top``-th and that no capacity exceeds
its bound.

Every cell runs through the sweep machinery's executors (``--workers``, ``--executor
dask``) and is stored as its own row of the ``serve_search`` table of the results
database the moment it finishes, so a search killed (``kill -9`` included) resumes where it
stopped. The serving runs are :class:`g5core.serve.session.ServingSession` runs (those of
``g5 serve``), the engine's step latencies shared between the candidates of a layout.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
from typing import Mapping, Optional, Sequence

import attrs

from g5core.api.errors import ConfigError, G5Error, PluginError
from g5core.study.resultsdb import ResultsDB, canonical_json, config_hash, sqlite_errors
from g5core.study.search import divisors, enumerate_layouts, layout_label
from g5core.study.serve_estimate import ESTIMATE_MARGIN, Estimator, estimate_for, narrow

SERVE_OBJECTIVES = ("goodput_per_chip", "throughput_per_chip", "min_chips")
DISAGG_MODES = ("off", "on", "auto")
DEFAULT_CHUNKS = (2048, 8192)
DEFAULT_MIN_SEQS = 8
DEFAULT_TOLERANCE = 0.05
DEFAULT_MAX_RATE = 1000.0
DEFAULT_BEAM = None        # every prefill and decode layout pair (the branch and bound bounds them)
#: the decode role's bound looks at batches up to this many sequences
MAX_DECODE_BATCH = 1024
#: the decode role's bound counts batches whose decode step is at most the TPOT limit times
#: ``1 + TPOT_SLACK`` (a request's TPOT is its steps' mean; a percentile lets some run slower)
TPOT_SLACK = 0.25
#: a run at a rate uses at least this many requests (``--requests``; p90 from 300 samples is
#: the 270th) and at least ``SETTLE`` times the requests in the system at that rate when the
#: SLO holds (``rate x (TTFT limit + mean output tokens x TPOT limit)``), so the queue
#: reaches its steady state for most of the run; at most ``MAX_RUN_REQUESTS``
DEFAULT_REQUESTS = 300
SETTLE = 16
MAX_RUN_REQUESTS = 20000
#: seeds besides the workload's on which the capacity found must hold too (else it steps
#: down by the tolerance): a finite run's percentile near the knee varies with the seed
DEFAULT_CONFIRM = 2
#: the saturated run (:func:`saturated_run`): this many batches of requests arrive at once, at
#: this rate (requests/s: all within microseconds)
SATURATED_ROUNDS = 3
SATURATED_RATE = 1e6
#: a candidate's capacity bound (:func:`capacity_bound`) allows this much more than the
#: finite-run reasoning gives: the saturated throughput is itself measured on a short run
BOUND_MARGIN = 0.05
#: the bisection starts at this share of the saturated throughput
START_SHARE = 0.8
#: or, with an estimate of the capacity (:mod:`g5core.study.serve_estimate`), at this share
#: of it (the estimates run a few percent above the simulated capacity of the issue's case)
START_ESTIMATE_SHARE = 0.95
#: candidates simulated together between two branch-and-bound decisions (fixed, so the
#: candidates simulated do not depend on the workers or on which finishes first)
WAVE = 8
DEFAULT_TOP = 10

#: the cells' payload format (screens carry the estimate's step table from 2): part of every
#: cell's key, so a database of an older format is not read as this one
CELL_VERSION = 2

SCHEMA = """
CREATE TABLE IF NOT EXISTS serve_search (
    key TEXT PRIMARY KEY,     -- config_hash of the cell (kind, configuration, workload, SLO, search settings)
    kind TEXT NOT NULL,       -- screen (a layout and chunk size) or candidate (a deployment's capacity)
    label TEXT NOT NULL,
    payload TEXT NOT NULL,    -- JSON, the cell's result
    finished_at TEXT NOT NULL
)
"""


# ----------------------------------------------------------------------------------------
# Settings and records
# ----------------------------------------------------------------------------------------


@attrs.frozen
class SearchSettings:
    slo: str
    objective: str = "goodput_per_chip"
    disagg: str = "off"
    chunks: tuple[int, ...] = DEFAULT_CHUNKS
    min_seqs: int = DEFAULT_MIN_SEQS
    seqs: Optional[tuple[int, ...]] = None     # max_num_seqs values instead of the powers of two
    tolerance: float = DEFAULT_TOLERANCE
    max_rate: float = DEFAULT_MAX_RATE
    beam: Optional[int] = DEFAULT_BEAM         # only the best this many layouts of each role pair up
    rate: Optional[float] = None               # min_chips: the rate to serve
    vary: Optional[tuple[str, ...]] = None     # only these dimensions vary (the others stay 1)
    settle: float = SETTLE                     # runs hold this many times the requests in the system
    confirm: int = DEFAULT_CONFIRM             # further seeds the capacity must hold on
    top: int = DEFAULT_TOP                     # the ranking is exact down to this place (branch and bound)
    bound: bool = True                         # False: simulate every candidate (no branch and bound)

    def check(self) -> None:
        if self.objective not in SERVE_OBJECTIVES:
            raise ConfigError("--objective", f"unknown serving objective {self.objective!r}; use "
                                             f"{', '.join(SERVE_OBJECTIVES)}")
        if self.disagg not in DISAGG_MODES:
            raise ConfigError("--disagg", f"must be one of {', '.join(DISAGG_MODES)}, got {self.disagg!r}")
        if self.objective == "min_chips" and self.rate is None:
            raise ConfigError("--rate", "the min_chips objective needs the rate to serve (--rate R)")
        if self.rate is not None and not 0 < self.rate < math.inf:
            raise ConfigError("--rate", f"must be a positive number of requests per second, got {self.rate!r}")
        if not 0 < self.tolerance < 1:
            raise ConfigError("--tolerance", f"must lie between 0 and 1, got {self.tolerance!r}")
        if not 0 < self.max_rate < math.inf:
            raise ConfigError("--max-rate", f"must be a positive number, got {self.max_rate!r}")
        if self.rate is not None and self.rate > self.max_rate:
            raise ConfigError("--rate", f"{self.rate:g} is above the rate ceiling --max-rate {self.max_rate:g}")
        for name, values in (("--chunks", self.chunks), ("--seqs", self.seqs or (1,))):
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise ConfigError(name, f"must be positive whole numbers, got {values!r}")
        if not self.settle > 0 or self.confirm < 0:
            raise ConfigError("--settle", "must be positive (and the confirming seeds >= 0)")
        if self.beam is not None and self.beam < 1:
            raise ConfigError("--beam", f"must be a positive whole number, got {self.beam!r}")
        if isinstance(self.top, bool) or not isinstance(self.top, int) or self.top < 1:
            raise ConfigError("--top", f"must be a positive whole number, got {self.top!r}")


@attrs.frozen
class PoolChoice:
    """One pool of a candidate: ``instances`` copies of ``parallel`` on ``chips`` chips each."""

    chips: int
    parallel: tuple          # sorted (dimension, size) pairs
    instances: int

    @property
    def layout(self) -> dict:
        return dict(self.parallel)

    def label(self) -> str:
        return f"{self.instances} x [{short_label(self.layout)}]"


@attrs.frozen
class Candidate:
    pools: tuple[PoolChoice, ...]   # one (aggregated) or prefill then decode
    max_num_seqs: int
    chunk: int

    @property
    def disaggregated(self) -> bool:
        return len(self.pools) == 2

    @property
    def chips(self) -> int:
        return sum(p.chips * p.instances for p in self.pools)

    def label(self) -> str:
        pools = " + ".join(("prefill " if i == 0 else "decode ") * self.disaggregated + p.label()
                           for i, p in enumerate(self.pools))
        return f"{pools}, max_num_seqs={self.max_num_seqs}, chunk={self.chunk}"


@attrs.frozen
class Pruned:
    parallel: dict
    chips: int
    chunk: int
    family: str
    reason: str


def short_label(parallel: Mapping) -> str:
    """``tp=4 cp=2``: the dimensions above 1 (``tp=1`` when none is)."""
    return " ".join(f"{k}={v}" for k, v in sorted(parallel.items()) if v != 1) or "tp=1"


def _layout_config(base: Mapping, chips: int, parallel: Mapping) -> dict:
    out = {k: v for k, v in base.items() if k != "serving"}
    out["chips"] = chips
    out["parallel"] = dict(parallel)
    return out


def candidate_config(base: Mapping, cand: Candidate, workload: Mapping, slo: str, rate: Optional[float]) -> dict:
    """The complete configuration of a candidate, as ``g5 serve`` takes it (``rate``: the
    workload's arrival rate, e.g. the capacity)."""
    block = dict(base.get("serving") or {})
    for key in ("instances", "disaggregation"):
        block.pop(key, None)
    sched = {**dict(block.get("scheduler") or {}), "max_num_seqs": cand.max_num_seqs,
             "max_num_batched_tokens": cand.chunk, "chunked_prefill": True}
    block["scheduler"] = sched
    block["slo"] = slo
    block["workload"] = _at_rate(workload, rate) if rate is not None else dict(workload)
    first = cand.pools[0]
    out = _layout_config(base, first.chips, first.layout)
    if cand.disaggregated:
        block["disaggregation"] = {role: {"instances": p.instances, "chips": p.chips, "parallel": p.layout}
                                   for role, p in zip(("prefill", "decode"), cand.pools)}
    else:
        block["instances"] = first.instances
    out["serving"] = block
    return out


def _at_rate(workload: Mapping, rate: float) -> dict:
    arrival = dict(workload.get("arrival") or {})
    arrival["kind"] = arrival.get("kind", "poisson")
    arrival["rate_per_s"] = float(rate)
    return {**dict(workload), "arrival": arrival}


def check_workload(workload: Optional[Mapping]) -> dict:
    if not workload:
        raise ConfigError("--isl", "the serving search needs a synthetic workload: give --isl and --osl (or "
                                   "serving.workload in the configuration)")
    if "trace" in workload:
        raise ConfigError("--workload", "the serving search varies the arrival rate of a synthetic workload; a "
                                        "trace has its own arrival times: give --isl and --osl instead")
    kind = (workload.get("arrival") or {}).get("kind", "poisson")
    if kind not in ("poisson", "gamma"):
        raise ConfigError("--workload", f"the serving search varies an open-loop arrival rate; {kind!r} has none: "
                                        "use poisson or gamma:cv=C")
    out = dict(workload)
    for key, flag in (("input_tokens", "--isl"), ("output_tokens", "--osl")):
        if key not in workload:
            raise ConfigError(flag, f"the serving search needs {flag} (or serving.workload.{key})")
        if isinstance(out[key], str) and out[key].strip().isdigit():
            out[key] = int(out[key])
    out.setdefault("requests", DEFAULT_REQUESTS)
    out.setdefault("seed", 0)
    arrival = dict(out.get("arrival") or {"kind": "poisson"})
    arrival.setdefault("rate_per_s", 1.0)   # a placeholder: every run sets its own rate
    out["arrival"] = arrival
    return out


# ----------------------------------------------------------------------------------------
# Cells (run in the workers)
# ----------------------------------------------------------------------------------------

#: per worker process: (layout configuration JSON) -> cached step runner, shared by the
#: sessions of every candidate using that layout (the engine's latencies do not depend on
#: the instances, the scheduler limits or the rate)
_RUNNERS: dict = {}
#: id(runner) -> HBM capacity per chip of its layout (the memory ledger's, the tightest chip)
_CAPACITY: dict = {}


def _shared_runner(praw: Mapping, prepared):
    from g5core.serve.cost import plan_step_runner

    key = canonical_json({k: v for k, v in praw.items() if k != "serving"})
    hit = _RUNNERS.get(key)
    if hit is None:
        engine = plan_step_runner(prepared)
        cache: dict = {}

        def hit(groups):
            if groups not in cache:
                cache[groups] = engine(groups)
            return cache[groups]
        from g5core.inputs.step import Step

        if len(_RUNNERS) > 256:
            _RUNNERS.clear()
            _CAPACITY.clear()
        _RUNNERS[key] = hit
        probe = 16 * 2 * int(praw["parallel"].get("cp", 1))   # any step the layout runs (cp: 2 cp chunks)
        _CAPACITY[id(hit)] = min(c.capacity_bytes for c in prepared.memory(Step.prefill(1, probe)).per_chip)
    return hit


def _session(raw: Mapping, workload: Mapping, slo: str, disabled, runner_for=None):
    from g5core.serve.session import ServingSession

    return ServingSession(raw, workload, disabled=disabled, slo=slo, runner_for=runner_for or _shared_runner)


def _lone(workload: Mapping) -> dict:
    """One request, the workload's shortest prompt and output (a bound every request's TTFT
    and TPOT are at or above), arriving on an idle deployment."""
    from g5core.serve.workload import Request, Workload, synthetic

    reqs = synthetic(workload).requests
    isl = min(r.input_tokens for r in reqs)
    osl = min(r.output_tokens for r in reqs)
    return Workload((Request(0, 0.0, isl, max(osl, 2)),), source={"lone": [isl, max(osl, 2)]})


def screen_cell(base: Mapping, chips: int, parallel: Mapping, chunk: int, workload: Mapping, slo: str,
                disabled=(), runner_for=None) -> dict:
    """One layout at one chunk size: valid? KV pool? one request alone (TTFT, TPOT)?"""
    from g5core.session.run import make_plan

    raw = _layout_config(base, chips, parallel)
    raw["serving"] = {"instances": 1, "scheduler": {**dict((base.get("serving") or {}).get("scheduler") or {}),
                                                    "max_num_batched_tokens": chunk, "chunked_prefill": True}}
    try:
        from g5core.serve.api import split_config

        make_plan(split_config(raw)[0], disabled)
        session = _session(raw, workload, slo, disabled, runner_for)
    except ConfigError as exc:
        text = str(exc)
        family = "memory" if "KV pool" in text or "HBM" in text or "fill" in text else (exc.field or "configuration")
        return {"status": "pruned", "family": family, "reason": text}
    except PluginError as exc:
        return {"status": "pruned", "family": f"plugin '{exc.plugin}'", "reason": str(exc)}
    lone_wl = _lone(workload)
    lone = session.run(lone_wl)
    info = session.infos[0]
    # decode steps of b sequences at the shortest prompt's context, b over the powers of two
    # up to the first at or above what the pool holds at the longest request (the decode
    # role's bound)
    from g5core.serve.cost import StepWork

    cost = session.fleet.pools[0].cost
    isl = lone_wl.requests[0].input_tokens
    holds = max(info["kv_capacity_tokens"] // max(_longest(workload), 1), 1)
    batches = [1 << k for k in range(min((holds - 1).bit_length(), MAX_DECODE_BATCH.bit_length() - 1) + 1)]
    from g5core.study.serve_estimate import step_table

    isl_mean, osl_mean = (round(x) for x in _mean_lengths(workload))
    return {"status": "ok", "kv_capacity_tokens": info["kv_capacity_tokens"],
            "kv_pool_bytes_per_chip": info["kv_pool_bytes_per_chip"], "lone_ttft_s": lone.summary["ttft_s"]["p50"],
            "lone_tpot_s": lone.summary["tpot_s"]["p50"], "lone_e2e_s": lone.summary["e2e_s"]["p50"],
            "decode_step_s": [[b, cost.latency_s(StepWork((), (isl,) * b))] for b in batches],
            "estimate": step_table(cost, isl_mean, osl_mean, chunk, batches)}


def _holds(result) -> bool:
    s = result.summary
    g = s["goodput"]
    return bool(g and g["all_met"]) and s["completed"] == s["requests"]


class _BelowBar(Exception):
    def __init__(self, rate: float):
        self.rate = rate


def capacity_search(run, start_rate: float, tolerance: float, max_rate: float,
                    floor_rate: Optional[float] = None, upper: Optional[float] = None,
                    bar: Optional[float] = None, gallop: bool = False) -> dict:
    """The highest rate at which ``run(rate)`` (a serving result) holds the SLO, within
    ``hi / lo <= 1 + tolerance``: ``{capacity, held, failed, failed_rate, ceiling}`` with the
    results at the capacity and at the lowest failing rate tried (``None`` when none);
    ``ceiling``: the SLO still held at ``max_rate``. ``floor_rate``: first try this rate;
    if it fails, the capacity is 0 (min_chips: the deployment does not serve it).
    ``upper``: an estimate of a rate the SLO does not hold at (the saturated throughput's
    bound): from a start that holds, the bisection runs toward it first instead of doubling,
    and a failing run there is required before it counts (if the SLO holds at ``upper``
    too, the doubling goes on from there): a guess of the bracket, never of the result.
    ``bar``: a rate the capacity must reach to matter (the branch and bound's top-th value):
    from a start below it the first run is at ``bar``, and the search stops at the first
    run at or below ``bar`` that fails (``below_bar``: the capacity is below that rate).
    ``gallop`` (a start from an estimate of the capacity): from the start the rate moves by
    ``1 + tolerance`` up (while the SLO holds) or down (while it does not), the factor
    squared at each step, to a bracket, then bisects; an estimate within the tolerance
    takes two runs."""
    results: dict = {}

    def ok(rate: float) -> bool:
        results[rate] = run(rate)
        held = _holds(results[rate])
        if not held and bar is not None and rate <= bar:
            raise _BelowBar(rate)
        return held

    def done(lo, hi, ceiling=False, below_bar=False):
        return {"capacity": lo, "held": results.get(lo), "failed": results.get(hi), "failed_rate": hi,
                "ceiling": ceiling, "below_bar": below_bar}

    try:
        return _bisect_rate(ok, done, start_rate, tolerance, max_rate, floor_rate, upper, bar, gallop)
    except _BelowBar as stop:
        return done(0.0, stop.rate, below_bar=True)


def _bisect_rate(ok, done, start_rate, tolerance, max_rate, floor_rate, upper, bar, gallop) -> dict:
    lo, hi = 0.0, None
    rate = min(floor_rate if floor_rate is not None else start_rate, max_rate)
    if bar is not None and floor_rate is None and rate < bar:
        rate = min(bar, max_rate)
    if gallop and floor_rate is None:
        step = 1 + tolerance
        if ok(rate):
            lo = rate
            while hi is None:
                if lo >= max_rate:
                    return done(lo, None, True)
                nxt = min(lo * step, max_rate)
                if ok(nxt):
                    lo, step = nxt, step * step
                else:
                    hi = nxt
        else:
            hi = rate
            while True:
                nxt = hi / step
                if nxt < rate * 1e-4:
                    return done(0.0, hi)
                if ok(nxt):
                    lo = nxt
                    break
                hi, step = nxt, step * step
    elif not ok(rate):
        if floor_rate is not None:
            return done(0.0, rate)
        hi = rate
        while True:  # downwards until it holds (a lone request met it, so a low rate will)
            rate /= 2
            if rate < hi * 1e-4:
                return done(0.0, hi)
            if ok(rate):
                lo = rate
                break
            hi = rate
    else:
        lo = rate
        guess = None if upper is None else min(upper, max_rate)
        while hi is None and guess is not None and guess > lo * (1 + tolerance):
            mid = math.sqrt(lo * guess)
            if ok(mid):
                lo = mid
            else:
                hi = mid
        if hi is None and guess is not None and guess > lo:
            if ok(guess):
                lo = guess
            else:
                hi = guess
        while hi is None:
            if lo >= max_rate:
                return done(lo, None, True)
            rate = min(2 * lo, max_rate)
            if ok(rate):
                lo = rate
            else:
                hi = rate
    lo, hi = narrow(ok, lo, hi, tolerance)
    return done(lo, hi)


def _run_summary(result, session) -> dict:
    s = result.summary
    g = s["goodput"] or {}
    out = {"ttft_s": s["ttft_s"], "tpot_s": s["tpot_s"], "e2e_s": s["e2e_s"], "throughput": s["throughput"],
           "goodput_share": g.get("share", 0.0), "percentile_limits": g.get("percentile_limits"),
           "mean_output_tokens": s["tokens"]["output"] / max(s["requests"], 1), "requests": s["requests"],
           "preemptions": s["preemptions"], "kv_pool_use": s["kv_pool_use"], "running_seqs": s["running_seqs"],
           "waiting_seqs": s["waiting_seqs"], "kv_transfer_s": s["kv_transfer_s"], "chips": result.loop.fleet.chips,
           "pools": result.pools,
           "max_total_bytes": max(_hbm(pool) - pool.cost.kv_pool_bytes_per_chip
                                  + use * pool.cost.kv_pool_bytes_per_chip
                                  for pool, use in zip(session.fleet.pools, _pool_peak_use(result)))}
    return out


def _hbm(pool) -> float:
    return _CAPACITY.get(id(pool.cost.step_s), pool.cost.kv_pool_bytes_per_chip)


def _pool_peak_use(result) -> list[float]:
    """Per pool: the largest share of its KV blocks any of its instances used."""
    import numpy as np

    out = []
    for pool in result.loop.fleet.pools:
        peak = 0.0
        for inst in result.loop.instances:
            if inst.pool is pool:
                rows = np.frombuffer(inst.steps, dtype=float).reshape(-1, 7)
                if len(rows):
                    peak = max(peak, float(rows[:, 4].max()) / pool.total_blocks)
        out.append(peak)
    return out


def run_requests(workload: Mapping, rate: float, settle_s: float, settle: float = SETTLE) -> int:
    """Requests of the run at ``rate`` (see ``SETTLE``)."""
    want = settle * rate * settle_s   # inf (or nan) at an extreme rate: MAX_RUN_REQUESTS, not an OverflowError
    return int(max(workload["requests"], math.ceil(want) if want < MAX_RUN_REQUESTS else MAX_RUN_REQUESTS))


def candidate_cell(base: Mapping, cand: Candidate, workload: Mapping, slo: str, settings: SearchSettings,
                   start_rate: float, settle_s: float, disabled=(), runner_for=None,
                   roles: Optional[Mapping] = None, kth: Optional[float] = None,
                   estimate: Optional[float] = None) -> dict:
    """A candidate's capacity (a bisection over the rate, see the module doc) and its runs at
    the capacity and at the first failing rate. ``roles``: its roles' bound
    (:func:`role_rates`); with it, an aggregated candidate first measures its saturated
    throughput (:func:`saturated_run`), the lower of the two is ``mu``, and when the
    objective's bound from ``mu`` (:func:`capacity_bound`) is below ``kth`` (the wave's
    ``top``-th simulated value) the candidate is bounded out (``status: bounded``);
    otherwise the bisection starts at ``START_SHARE x mu``, toward the bound. ``estimate``:
    the candidate's estimated capacity (:mod:`g5core.study.serve_estimate`); with it (and
    ``roles``) the saturated run is left out, the bound is at most the estimate times ``1 +
    ESTIMATE_MARGIN``, and the bisection starts at ``START_ESTIMATE_SHARE x estimate``."""
    raw = candidate_config(base, cand, workload, slo, None)
    try:
        session = _session(raw, _at_rate({**workload, "requests": max(MAX_RUN_REQUESTS, workload["requests"])}, 1.0),
                           slo, disabled, runner_for)
    except (ConfigError, PluginError) as exc:
        return {"status": "pruned", "family": "memory" if "KV pool" in str(exc) else "configuration",
                "reason": str(exc)}
    floor = settings.rate if settings.objective == "min_chips" else None
    runs = {"n": 0}
    mu = bound = None
    sat = None
    if roles is not None and floor is None:
        from g5core.serve.metrics import parse_slo

        sat = dict(roles)
        if not cand.disaggregated and not estimate:
            run_sat = saturated_run(session, cand, workload)
            if run_sat["saturated_requests_per_s"] and (
                    run_sat["saturated_requests_per_s"] < sat["saturated_requests_per_s"]):
                sat = {**run_sat, "roles": roles["roles"]}
        mu = sat["saturated_requests_per_s"]
        bound = capacity_bound(sat, parse_slo(slo), workload, settle_s, settings)
        if estimate:     # the driver bounded the wave by this bound already
            bound = _estimate_bound(estimate, bound)
        else:
            upper = _upper_value(settings.objective, bound, cand, _longest_output(workload))
            if kth is not None and upper < kth:
                return {"status": "bounded", "label": cand.label(), "saturated": sat, "capacity_bound": bound,
                        "upper": upper, "kth": kth, "source": "saturated run", "runs": 1}

    def run(rate, seed=None):
        runs["n"] += 1
        n = run_requests(workload, rate, settle_s, settings.settle)
        return session.run(_at_rate({**workload, "requests": n, "seed": workload["seed"] if seed is None else seed},
                                    rate))
    if estimate and floor is None:
        start_rate = START_ESTIMATE_SHARE * estimate
    elif mu and floor is None:
        start_rate = START_SHARE * mu
    # the rate at which the candidate's value would equal the top-th's (below it, it cannot enter)
    bar = None if kth is None or floor is not None else _bar_rate(settings.objective, kth, cand,
                                                                   _longest_output(workload))
    seeds = [workload["seed"] + k for k in range(1, settings.confirm + 1)]

    def run_all(rate):
        """The run on the workload's seed, and while it holds on the confirming seeds in turn:
        the first failing run, else the workload seed's (a rate holds when every seed does)."""
        first = run(rate)
        if not _holds(first):
            return first
        return next((r for r in (run(rate, sd) for sd in seeds) if not _holds(r)), first)
    found = capacity_search(run_all, start_rate, settings.tolerance, settings.max_rate, floor,
                            bound if floor is None else None, bar, gallop=bool(estimate) and floor is None)
    if found["below_bar"]:
        rate = found["failed_rate"]
        return {"status": "bounded", "label": cand.label(), "saturated": sat, "capacity_bound": rate,
                "upper": _upper_value(settings.objective, rate, cand, _longest_output(workload)), "kth": kth,
                "runs": runs["n"], "failed_rate_per_s": rate, "source": "simulated"}
    held, failed = found["held"], found["failed"]
    return {"status": "ok", "label": cand.label(), "disaggregated": cand.disaggregated, "chips": cand.chips,
            "capacity_requests_per_s": found["capacity"], "ceiling": found["ceiling"],
            "runs": runs["n"], "failed_rate_per_s": found["failed_rate"],
            "build_s": session.build_s, "saturated_requests_per_s": mu, "capacity_bound": bound, "saturated": sat,
            "held": None if held is None else _run_summary(held, session),
            "failed": None if failed is None else _run_summary(failed, session)}


def saturated_run(session, cand: Candidate, workload: Mapping) -> dict:
    """The candidate's saturated throughput on its session: ``SATURATED_ROUNDS`` batches'
    worth of requests (``max_num_seqs`` times the instances of the last pool, at most what a
    pool holds at the longest request) arrive at once, and the throughput is the
    completions of the middle rounds over their span, the queue never empty. ``None``
    when the run preempted: the pool, not the batch, set its pace."""
    import numpy as np

    last = session.fleet.pools[-1]
    holds = max(last.total_blocks * last.scheduler.block_size // max(session.longest, 1), 1)
    n = SATURATED_ROUNDS * min(cand.max_num_seqs, holds) * last.instances
    res = session.run(_at_rate({**workload, "requests": n}, SATURATED_RATE))
    done = np.sort(np.frombuffer(res.loop.requests.finish_s, dtype=float))
    k1, k2 = n // SATURATED_ROUNDS, n - n // SATURATED_ROUNDS
    span = float(done[k2 - 1] - done[k1 - 1])
    rate = (k2 - k1) / span if span > 0 and not res.summary["preemptions"] else None
    slots = sum(min(cand.max_num_seqs, holds) * p.instances for p in session.fleet.pools)
    return {"saturated_requests_per_s": rate, "requests": n, "slots": slots,
            "preemptions": res.summary["preemptions"]}


# ----------------------------------------------------------------------------------------
# The search (in the driver)
# ----------------------------------------------------------------------------------------


@attrs.frozen
class Scored:
    candidate: Candidate
    config: dict            # g5 serve's configuration at the capacity
    cell: dict              # candidate_cell's result

    @property
    def capacity(self) -> float:
        return self.cell["capacity_requests_per_s"]

    def rates(self) -> tuple[float, float]:
        """``(goodput, output tokens/s)`` per chip at the capacity: the capacity times the
        share of requests meeting the SLO (and times the mean output tokens), over the chips
        (the arrival rate, not a finite run's tokens over its span, which counts the drain)."""
        held = self.cell["held"] or {}
        chips = self.candidate.chips
        share = held.get("goodput_share", 0.0)
        return self.capacity * share / chips, self.capacity * held.get("mean_output_tokens", 0.0) / chips

    def value(self, objective: str) -> tuple:
        chips = self.candidate.chips
        goodput, tokens = self.rates()
        if objective == "min_chips":
            return (0 if self.capacity > 0 else 1, chips, -goodput)
        if objective == "throughput_per_chip":
            return (-tokens, -goodput, chips)
        return (-goodput, -tokens, chips)

    def to_json_dict(self) -> dict:
        held = self.cell["held"] or {}
        chips = self.candidate.chips
        goodput, tokens = self.rates()
        return {"config": self.config, "capacity_requests_per_s": self.capacity,
                "goodput_per_chip": goodput, "output_tokens_per_s_per_chip": tokens,
                "output_tokens_per_s_per_user": _per_user(held), "chips": chips,
                "ttft_s": _pcts(held.get("ttft_s")), "tpot_s": _pcts(held.get("tpot_s")),
                "disaggregated": self.candidate.disaggregated,
                "max_total_bytes": held.get("max_total_bytes", 0.0),
                "kv_pool_bytes_per_chip": min((p["kv_pool_bytes_per_chip"] for p in held.get("pools", [])),
                                              default=0.0),
                "rate_ceiling": self.cell["ceiling"], "limited_by": limiter(self)}


def _pcts(stats: Optional[Mapping]) -> dict:
    stats = stats or {}
    return {k: stats.get(k) for k in ("p50", "p90", "p99")}


def _per_user(held: Mapping) -> float:
    tpot = (held.get("tpot_s") or {}).get("p50")
    return 1.0 / tpot if tpot else 0.0


def limiter(s: Scored) -> str:
    """What stopped the candidate from serving more: the limit its first failing rate broke,
    and the resource behind it (KV pool, max_num_seqs, the KV transfer, the steps)."""
    if s.cell["ceiling"]:
        return "the rate ceiling (--max-rate): the SLO still held there"
    failed = s.cell["failed"]
    if failed is None:
        return "nothing measured"
    broke = [k for k, v in (failed.get("percentile_limits") or {}).items() if not v["met"]] or ["completion"]
    what = ", ".join(f"{k} ({failed['percentile_limits'][k]['value_s']:.3g} s > "
                     f"{failed['percentile_limits'][k]['limit_s']:.3g} s)" if k in (failed.get("percentile_limits") or {})
                     else k for k in broke)
    use = (failed.get("kv_pool_use") or {}).get("max", 0.0)
    running = (failed.get("running_seqs") or {}).get("max", 0.0)
    if failed.get("preemptions") or use >= 0.95:
        cause = f"the KV pool (peak use {use:.0%}, {failed.get('preemptions', 0)} preemptions)"
    elif running >= s.candidate.max_num_seqs:
        cause = f"max_num_seqs={s.candidate.max_num_seqs} (queue builds while the batch is full)"
    elif s.candidate.disaggregated and (failed.get("kv_transfer_s") or {}).get("p90") and \
            failed["kv_transfer_s"]["p90"] > 0.3 * (failed["ttft_s"]["p90"] or math.inf):
        cause = f"the KV transfer link (p90 {failed['kv_transfer_s']['p90']:.3g} s of TTFT)"
    else:
        cause = "the step time (compute and communication of the batched steps)"
    rate = s.cell.get("failed_rate_per_s")
    at = f" at {rate:.3g} req/s" if rate else ""
    return f"{what}{at}; bottleneck: {cause}"


@attrs.frozen
class ServeSearchResult:
    objective: str
    settings: SearchSettings
    layouts: int                      # layout x chunk cells screened
    pruned: tuple[Pruned, ...]
    ranked: tuple[Scored, ...]        # best first
    candidates: int                   # simulated (a capacity search each)
    skipped_by_beam: int
    runs: int                         # serving runs over all candidates
    db_path: Optional[str]
    bounded: tuple = ()               # Bounded: not simulated (branch and bound)
    estimates: Mapping = attrs.field(factory=dict)   # candidate label -> estimated capacity (req/s)

    def families(self) -> list[tuple[str, list[Pruned]]]:
        return _group(self.pruned)

    def pareto(self) -> list[Scored]:
        """Candidates with a capacity that no other beats on both output tokens/s per chip
        and per user (at capacity), by increasing per-user speed."""
        pts = sorted(((_per_user(s.cell["held"]), s.rates()[1], s) for s in self.ranked if s.capacity > 0),
                     key=lambda p: (-p[0], -p[1], p[2].candidate.label()))
        front, best = [], -1.0
        for user, chip, s in pts:
            if chip > best:
                front.append(s)
                best = chip
        return front[::-1]

    def why(self) -> str:
        if not self.ranked or self.ranked[0].capacity <= 0:
            return "No candidate meets the SLO at any rate tried."
        w = self.ranked[0]
        wj = w.to_json_dict()
        text = (f"The winner, {w.candidate.label()}, serves {w.capacity:.3g} req/s "
                f"({wj['output_tokens_per_s_per_chip']:.4g} output tokens/s per chip, "
                f"{wj['goodput_per_chip']:.3g} req/s per chip of goodput) with TTFT p90 "
                f"{wj['ttft_s']['p90']:.3g} s and TPOT p90 {wj['tpot_s']['p90'] * 1e3:.3g} ms; past it, "
                f"{limiter(w)}.")
        # the runner-up: the best other deployment (not the winner with other scheduler limits)
        other = [s for s in self.ranked[1:] if s.candidate.pools != w.candidate.pools]
        if other:
            r = other[0]
            rj = r.to_json_dict()
            text += (f" The runner-up deployment, {r.candidate.label()}, serves {r.capacity:.3g} req/s "
                     f"({rj['output_tokens_per_s_per_chip']:.4g} output tokens/s per chip); it is limited by "
                     f"{limiter(r)}.")
        return text


def _group(pruned: Sequence[Pruned]) -> list[tuple[str, list[Pruned]]]:
    """Pruned layouts grouped by family, largest family first (then by name)."""
    groups: dict[str, list[Pruned]] = {}
    for p in pruned:
        groups.setdefault(p.family, []).append(p)
    return sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))


class _Table:
    def __init__(self, db: ResultsDB):
        self.db = db
        with sqlite_errors(db.path, db.busy_timeout_s):
            db.con.execute(SCHEMA)

    def get(self, key: str) -> Optional[dict]:
        with sqlite_errors(self.db.path, self.db.busy_timeout_s):
            row = self.db.con.execute("SELECT payload FROM serve_search WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def add(self, key: str, kind: str, label: str, payload: Mapping) -> None:
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        with sqlite_errors(self.db.path, self.db.busy_timeout_s):
            self.db.con.execute("INSERT OR IGNORE INTO serve_search VALUES (?, ?, ?, ?, ?)",
                                (key, kind, label, canonical_json(payload), now))


def _drive(table: _Table, exe, cells: Sequence[tuple], reporter, workers: int) -> list:
    """Run ``(key, kind, label, fn, args)`` cells not in the table; every result in order."""
    from g5core.study.sweep import run_windowed

    out: list = [None] * len(cells)
    if reporter is not None:
        reporter.start(len(cells))
    done = 0

    def finish(i, label, payload):
        nonlocal done
        done += 1
        out[i] = payload
        if reporter is not None:
            reporter.cell(done, label, payload)

    def start(exe, item):
        i, (key, kind, label, fn, args) = item
        hit = table.get(key)
        if hit is not None:
            finish(i, label, None)
            out[i] = hit
            return None
        return exe.submit(fn, *args)

    def stored(item, payload) -> None:
        i, (key, kind, label, _, _) = item
        table.add(key, kind, label, payload)
        finish(i, label, payload)

    try:
        run_windowed(exe, enumerate(cells), workers, start, stored)
    finally:
        if reporter is not None:
            reporter.close()
    return out


class _Progress:
    """Adapts the sweep's progress objects to the search's cells."""

    def __init__(self, inner, phase: str):
        self.inner, self.phase = inner, phase

    def start(self, total):
        if hasattr(self.inner, "start"):
            self.inner.start(total)

    def cell(self, n, label, payload):
        if hasattr(self.inner, "bar"):
            self.inner.bar.update(1)
            return
        if hasattr(self.inner, "emit"):
            total = getattr(self.inner, "total", "?")
            if payload is None:
                text = "already in the database"
            elif payload.get("status") == "bounded":
                text = f"bounded out (at most {payload['upper']:.4g} per chip, the top-th has {payload['kth']:.4g})"
            elif payload.get("status") != "ok":
                text = f"pruned: {payload['reason']}"
            elif "capacity_requests_per_s" in payload:
                text = f"capacity {payload['capacity_requests_per_s']:.4g} req/s"
            else:
                text = f"lone TTFT {payload['lone_ttft_s']:.4g} s, TPOT {payload['lone_tpot_s'] * 1e3:.4g} ms"
            self.inner.emit(f"{self.phase} [{n}/{total}] {label}: {text}")

    def skip(self, n):
        """``n`` candidates bounded out before their wave (never run: one update, one line)."""
        if hasattr(self.inner, "bar"):
            self.inner.bar.update(n)
        elif hasattr(self.inner, "emit"):
            self.inner.emit(f"{self.phase}: {n} more candidates bounded out (their bound is below the top-th)")

    def close(self):
        if hasattr(self.inner, "close"):
            self.inner.close()


class _Kept:
    """An executor entered once for the whole search (its workers, and the step latencies
    they cache, serve every phase and wave): entering and leaving it do nothing."""

    def __init__(self, exe):
        self.exe = exe

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *args, **kwargs):
        return self.exe.submit(fn, *args, **kwargs)

    def wait(self, futures):
        return self.exe.wait(futures)


class _Waves:
    """One progress display over the capacity waves (and the candidates bounded out)."""

    def __init__(self, inner, total: int):
        self.inner, self.done = inner, 0
        inner.start(total)

    def start(self, total):
        pass

    def cell(self, n, label, payload):
        self.done += 1
        self.inner.cell(self.done, label, payload)

    def skip(self, n):
        self.done += n
        self.inner.skip(n)

    def close(self):
        pass

    def finish(self):
        self.inner.close()


@attrs.frozen
class Bounded:
    """A candidate not simulated: its bound cannot reach the top-th simulated value."""

    candidate: Candidate
    saturated_requests_per_s: float
    capacity_bound: float  # requests/s (capacity_bound)
    upper: float           # the bound of the objective's value (goodput or output tokens/s per chip)
    kth: float             # the top-th simulated value when it was bounded out
    source: str = "roles"  # where the bound came from: roles, saturated run, estimate, or simulated (a run failed)
    estimate: Optional[float] = None   # the estimated capacity (requests/s), when there is one
    runs: int = 0                      # serving runs it took (a saturated run, or the runs to the bar)

    def reason(self) -> str:
        if self.source == "simulated":
            return (f"a run at {self.capacity_bound:.4g} req/s misses the SLO, so its capacity is below that: at "
                    f"most {self.upper:.4g} per chip, not above the top-th simulated ({self.kth:.4g})")
        if self.estimate:
            return (f"estimated capacity {self.estimate:.4g} req/s, so at most {self.capacity_bound:.4g} req/s "
                    f"with the estimate's margin: at most {self.upper:.4g} per chip, below the top-th simulated "
                    f"({self.kth:.4g})")
        return (f"saturated throughput ({self.source}) {self.saturated_requests_per_s:.4g} req/s, so a capacity "
                f"of at most "
                f"{self.capacity_bound:.4g} req/s: at most {self.upper:.4g} per chip, below the top-th simulated "
                f"({self.kth:.4g})")


def capacity_bound(saturated: Optional[Mapping], limits, workload: Mapping, settle_s: float,
                   settings: SearchSettings) -> Optional[float]:
    """The rate above which a run of the search cannot hold the SLO, from the saturated
    throughput ``mu`` (``None``: no bound). A run at ``rate > mu`` builds a queue: by time
    ``t`` at least ``(rate - mu) t`` requests are in the system, at most ``slots`` of them
    running, so a request arriving at ``t`` waits at least ``((rate - mu) t - slots) / mu``
    for its first token. With a limit ``L`` on the ``p``-th percentile of TTFT (or of
    e2e, or of the queueing delay) the requests arriving after ``p`` percent of the run's span
    ``T`` must meet it, so ``rate / mu <= 1 + (L + slots / mu) / (p/100 T)``; ``T`` is the
    shortest run the search makes near that rate (:func:`run_requests`). Times
    ``1 + BOUND_MARGIN``. Approximate: ``mu`` is a measured steady state (not a proof that
    no load does better) and the queue's growth is taken at its mean."""
    mu = None if saturated is None else saturated.get("saturated_requests_per_s")
    if not mu:
        return None
    best = None
    for lim in limits:
        if lim.metric not in ("ttft", "e2e", "queue"):
            continue
        share = (lim.percentile if lim.percentile is not None else 100) / 100
        rate = 1.5 * mu
        span = run_requests(workload, rate, settle_s, settings.settle) / rate
        cap = mu * (1 + (lim.limit_s + saturated["slots"] / mu) / (share * span)) * (1 + BOUND_MARGIN)
        best = cap if best is None else min(best, cap)
    return best


def _estimate_bound(estimate: Optional[float], bound: Optional[float]) -> Optional[float]:
    """The capacity bound a candidate is ordered and bounded by: its estimate times ``1 +
    ESTIMATE_MARGIN``, or the roles' bound when that is lower (``None``: neither)."""
    if not estimate:
        return bound
    cap = estimate * (1 + ESTIMATE_MARGIN)
    return cap if bound is None else min(cap, bound)


def role_rates(p: Mapping, d: Mapping, n_p: int, n_d: int, max_num_seqs: int, chunk: int, shortest,
               tpot_limits) -> Optional[dict]:
    """A disaggregated candidate's saturated rate from its roles, the way DistServe sizes
    them, per layout from its screen: the prefill pool prefills at most ``max(1, chunk //
    prompt)`` prompts per lone prefill per instance (a step never costs less than the lone
    prompt's); the decode pool emits at most ``max over b of b / D(b)`` tokens per second
    per instance (the mediant: any mix of steps does no better than its best), ``D(b)`` the
    decode step of ``b <= max_num_seqs`` sequences at the shortest prompt's context, counting
    only the batches within the TPOT limit (times ``1 + TPOT_SLACK``), over the shortest
    output's decodes. Approximate: the TPOT cap (a percentile lets some requests run in
    slower batches; the slack covers it) and a step's cost growing with its work."""
    per_step = max(1, chunk // max(shortest.input_tokens, 1))
    prefill = n_p * per_step / p["lone_ttft_s"]
    cap = min((l.limit_s for l in tpot_limits), default=math.inf) * (1 + TPOT_SLACK)
    best = max(b / s for b, s in d["decode_step_s"] if b <= max_num_seqs and (s <= cap or b == 1))
    decodes = shortest.output_tokens - 1
    decode = n_d * best / decodes if decodes > 0 else math.inf
    slots = n_p * per_step + n_d * max(b for b, _ in d["decode_step_s"] if b <= max_num_seqs)
    return {"saturated_requests_per_s": min(prefill, decode), "slots": slots, "roles": [prefill, decode]}


def _upper_value(objective: str, bound: Optional[float], cand: Candidate, top_out: int) -> float:
    """The objective's value (per chip, the larger the better) the candidate cannot exceed:
    its capacity is at most ``bound`` and the goodput share at most 1 (output tokens: at most
    the longest output per request). ``inf`` without a bound."""
    if bound is None:
        return math.inf
    return (bound * top_out if objective == "throughput_per_chip" else bound) / cand.chips


def _bar_rate(objective: str, kth: float, cand: Candidate, top_out: int) -> float:
    """The rate at which the candidate's value could at best equal ``kth`` (the inverse of
    :func:`_upper_value`): a capacity below it cannot enter the top."""
    return kth * cand.chips / (top_out if objective == "throughput_per_chip" else 1)


def _kth_value(settings: SearchSettings, cands, results) -> Optional[float]:
    """The ``top``-th best objective value of the candidates simulated so far (``None``
    while fewer are)."""
    values = []
    for (cand, _), res in zip(cands, results):
        if res is None or res["status"] != "ok" or not res["capacity_requests_per_s"]:
            continue
        goodput, tokens = Scored(cand, {}, res).rates()
        values.append(tokens if settings.objective == "throughput_per_chip" else goodput)
    if len(values) < settings.top:
        return None
    return sorted(values, reverse=True)[settings.top - 1]


def _longest_output(workload: Mapping) -> int:
    from g5core.serve.workload import synthetic

    return max(r.output_tokens for r in synthetic(workload).requests)


def _pow2_seqs(capacity_tokens: int, longest: int, settings: SearchSettings) -> list[int]:
    if settings.seqs is not None:
        return sorted(set(settings.seqs))
    holds = max(capacity_tokens // max(longest, 1), 1)
    out, m = [], 1
    while True:
        if m >= settings.min_seqs or m >= holds:
            out.append(m)
        if m >= holds:
            return out
        m *= 2


def serve_search(raw: Mapping, workload: Mapping, settings: SearchSettings, *, db_path=None, disabled=(),
                 workers: int = 1, executor: str = "local", progress=None, inputs: Sequence = (),
                 runner_for=None, max_work=None) -> ServeSearchResult:
    """Enumerate, screen, simulate (capacity per candidate) and rank; see the module doc.
    ``runner_for``: ``(layout configuration, prepared plan) -> (groups -> latency_s)``
    instead of the engine (tests; in-process only)."""
    import tempfile

    from g5core.api.dimensions import collect_dimensions
    from g5core.api.plugins import Hooks, make_plugin_manager
    from g5core.inputs.config import disabled_from_config
    from g5core.serve.api import check_search_work
    from g5core.serve.metrics import parse_slo
    from g5core.study.sweep import LocalExecutor, make_executor

    from g5core.study.sweep import LineProgress

    settings.check()
    workload = check_workload(workload)
    if callable(progress) and not hasattr(progress, "cell"):
        progress = LineProgress(progress)
    limits = parse_slo(settings.slo)
    if not limits:
        raise ConfigError("--slo", "the serving search needs SLO limits, e.g. --slo ttft_p90=2s,tpot_p90=50ms")
    chips = raw.get("chips")
    if isinstance(chips, bool) or not isinstance(chips, int) or chips <= 0:
        raise ConfigError("chips", f"must be a positive whole number, got {chips!r}")
    exe = make_executor(executor, workers)
    if runner_for is not None and not (isinstance(exe, LocalExecutor) and workers == 1):
        raise ConfigError("runner", "a custom runner needs the in-process executor (local, one worker)")
    names = tuple(dict.fromkeys(tuple(disabled) + tuple(disabled_from_config(raw))))
    dims = collect_dimensions(Hooks(make_plugin_manager(disabled=names)))
    if settings.vary is not None:
        unknown = [d for d in settings.vary if d not in dims.names]
        if unknown:
            raise ConfigError("--vary", f"unknown dimension {unknown[0]!r}; known: {', '.join(dims.names)}")
    base = {k: v for k, v in raw.items() if k not in ("parallel",)}
    ttft_limits = [l for l in limits if l.metric in ("ttft", "e2e")]
    tpot_limits = [l for l in limits if l.metric in ("tpot", "itl")]
    ident = {"base": base, "workload": workload, "slo": settings.slo,
             "runner": None if runner_for is None else getattr(runner_for, "__name__", "custom"),
             "cells": CELL_VERSION}

    # 1. layouts x chunks, screened
    layouts = []
    for c in divisors(chips):
        for par in enumerate_layouts(c, dims):
            if par.get("dp", 1) != 1:
                continue
            if settings.vary is not None and any(v != 1 for k, v in par.items() if k not in settings.vary):
                continue
            for chunk in settings.chunks:
                layouts.append((c, par, chunk))
    screen_cells = []
    for c, par, chunk in layouts:
        key = config_hash({"kind": "screen", **ident, "chips": c, "parallel": par, "chunk": chunk}, names)
        screen_cells.append((key, "screen", f"[{short_label(par)}] chunk={chunk}", screen_cell,
                             (base, c, par, chunk, workload, settings.slo, tuple(disabled), runner_for)))
    own_db = db_path is None
    tmp = tempfile.TemporaryDirectory(prefix="g5-best-serve-") if own_db else None
    path = f"{tmp.name}/best-serve.db" if own_db else db_path
    db = ResultsDB.open(path, inputs=inputs)
    stack = contextlib.ExitStack()
    try:
        table = _Table(db)
        outer = stack.enter_context(make_executor(executor, workers))
        kept = _Kept(outer)
        screened = _drive(table, kept, screen_cells,
                          _Progress(progress, "screen") if progress is not None else None, workers)
        longest = _longest(workload)
        pruned: list[Pruned] = []
        roles: dict[str, list] = {"serve": [], "prefill": [], "decode": []}
        for (c, par, chunk), res in zip(layouts, screened):
            if res["status"] != "ok":
                pruned.append(Pruned(par, c, chunk, res["family"], res["reason"]))
                continue
            ttft_miss = [l for l in ttft_limits if res["lone_ttft_s"] > l.limit_s]
            tpot_miss = [l for l in tpot_limits if res["lone_tpot_s"] is not None and res["lone_tpot_s"] > l.limit_s]
            if not ttft_miss:
                roles["prefill"].append((c, par, chunk, res))
            if not tpot_miss:
                roles["decode"].append((c, par, chunk, res))
            if not ttft_miss and not tpot_miss:
                roles["serve"].append((c, par, chunk, res))
            elif ttft_miss:
                pruned.append(Pruned(par, c, chunk, "lone prefill misses TTFT",
                                     f"one request alone takes {res['lone_ttft_s']:.4g} s to its first token "
                                     f"(limit {ttft_miss[0].key} {ttft_miss[0].limit_s:.4g} s)"))
            else:
                pruned.append(Pruned(par, c, chunk, "lone decode misses TPOT",
                                     f"one request alone decodes at {res['lone_tpot_s'] * 1e3:.4g} ms per token "
                                     f"(limit {tpot_miss[0].key} {tpot_miss[0].limit_s * 1e3:.4g} ms)"))

        # 2. candidates
        cands: list[tuple[Candidate, float]] = []
        fewer = settings.objective == "min_chips"
        roles_bound: dict = {}   # candidate index -> its roles' bound (role_rates)
        screens: dict = {}       # candidate index -> (its pools' screens, their layout keys)
        shortest = _lone(workload).requests[0]
        if settings.disagg in ("off", "auto"):
            for c, par, chunk, res in roles["serve"]:
                for inst in (range(1, chips // c + 1) if fewer else (chips // c,)):
                    pool = PoolChoice(c, tuple(sorted(par.items())), inst)
                    for m in _pow2_seqs(res["kv_capacity_tokens"], longest, settings):
                        roles_bound[len(cands)] = role_rates(res, res, inst, inst, m, chunk, shortest, tpot_limits)
                        screens[len(cands)] = ((res,), ((c, layout_label(par), chunk),))
                        cands.append((Candidate((pool,), m, chunk), inst / res["lone_e2e_s"]))
        skipped = 0
        if settings.disagg in ("on", "auto"):
            prefill = sorted(roles["prefill"], key=lambda x: (x[3]["lone_ttft_s"] * x[0], layout_label(x[1])))
            decode = sorted(roles["decode"], key=lambda x: (
                -(x[3]["kv_capacity_tokens"] / longest) / (x[3]["lone_tpot_s"] * x[0]), layout_label(x[1])))
            beam = settings.beam
            for chunk in settings.chunks:
                p_ok = [x for x in prefill if x[2] == chunk]
                d_ok = [x for x in decode if x[2] == chunk]
                if beam is not None:
                    skipped += len(p_ok) * len(d_ok) - len(p_ok[:beam]) * len(d_ok[:beam])
                    p_ok, d_ok = p_ok[:beam], d_ok[:beam]
                for p in p_ok:
                    for d in d_ok:
                        for n_p in range(1, chips // p[0] + 1):
                            rest = chips - n_p * p[0]
                            for n_d in (range(1, rest // d[0] + 1) if fewer else
                                        ((rest // d[0],) if rest > 0 and rest % d[0] == 0 else ())):
                                if n_d < 1:
                                    continue
                                pools = (PoolChoice(p[0], tuple(sorted(p[1].items())), n_p),
                                         PoolChoice(d[0], tuple(sorted(d[1].items())), n_d))
                                for m in _pow2_seqs(d[3]["kv_capacity_tokens"], longest, settings):
                                    start = min(n_p / p[3]["lone_ttft_s"], n_d / d[3]["lone_e2e_s"])
                                    roles_bound[len(cands)] = role_rates(p[3], d[3], n_p, n_d, m, chunk, shortest,
                                                                         tpot_limits)
                                    screens[len(cands)] = ((p[3], d[3]), ((p[0], layout_label(p[1]), chunk),
                                                                          (d[0], layout_label(d[1]), chunk)))
                                    cands.append((Candidate(pools, m, chunk), start))
        if not cands:
            fams = sorted(((len(m), f, m[0].reason) for f, m in _group(pruned)), reverse=True)
            hint = f"; most ({fams[0][0]}) for {fams[0][1]}: {fams[0][2]}" if fams else ""
            raise G5Error(f"no deployment of {chips} chips is left to simulate ({len(layouts)} layouts and chunk "
                          f"sizes screened){hint}")
        settle_s = _settle_s(workload, ttft_limits, tpot_limits, roles)
        # 3. capacities, best roles' bound first, in waves; a candidate whose bound cannot
        # reach the top-th simulated one is bounded out (by the driver from its roles'
        # bound, or by its cell from its saturated run)
        use_bounds = settings.bound and settings.objective != "min_chips"
        keyed = {k: v for k, v in attrs.asdict(settings).items() if k not in ("top", "bound")}
        top_out = _longest_output(workload)
        caps = [capacity_bound(roles_bound[i], limits, workload, settle_s, settings) if use_bounds else None
                for i in range(len(cands))]
        estimator = Estimator(limits, workload,
                              lambda r: run_requests(workload, r, settle_s, settings.settle), settings.max_rate,
                              MAX_RUN_REQUESTS)
        estimated = [estimate_for(estimator, cand, *screens[i]) if settings.objective != "min_chips" else None
                     for i, (cand, _) in enumerate(cands)]
        estimates = estimated if use_bounds else [None] * len(cands)
        caps = [_estimate_bound(e, cap) for e, cap in zip(estimates, caps)]
        upper = [_upper_value(settings.objective, cap, cand, top_out) for (cand, _), cap in zip(cands, caps)]
        check_search_work(len(cands), workload, max_work)   # issue 36: refused before any capacity run
        order = sorted(range(len(cands)), key=lambda i: (-upper[i], cands[i][0].label()))
        results: list = [None] * len(cands)
        bounded: list[Bounded] = []
        reporter = _Waves(_Progress(progress, "capacity"), len(cands)) if progress is not None else None
        pos = 0
        while pos < len(order):
            kth = _kth_value(settings, cands, results) if use_bounds else None
            wave = []
            while pos < len(order) and len(wave) < WAVE:
                i = order[pos]
                if kth is not None and upper[i] < kth:
                    for j in order[pos:]:
                        bounded.append(Bounded(cands[j][0], roles_bound[j]["saturated_requests_per_s"], caps[j],
                                               upper[j], kth, "estimate" if estimates[j] else "roles",
                                               estimates[j]))
                    if reporter is not None:
                        reporter.skip(len(order) - pos)
                    pos = len(order)
                    break
                wave.append(i)
                pos += 1
            cells = []
            for i in wave:
                cand, start = cands[i]
                roles = roles_bound[i] if use_bounds else None
                key = config_hash({"kind": "candidate", **ident, "candidate": attrs.asdict(cand, recurse=True),
                                   "settings": keyed, "roles": roles, "kth": kth, "estimate": estimates[i]}, names)
                cells.append((key, "candidate", cand.label(), candidate_cell,
                              (base, cand, workload, settings.slo, settings, start, settle_s, tuple(disabled),
                               runner_for, roles, kth, estimates[i])))
            for i, res in zip(wave, _drive(table, kept, cells, reporter, workers)):
                if res["status"] == "bounded":
                    bounded.append(Bounded(cands[i][0], res["saturated"]["saturated_requests_per_s"],
                                           res["capacity_bound"], res["upper"], res["kth"], res["source"],
                                           estimates[i], res.get("runs", 0)))
                else:
                    results[i] = res
        if reporter is not None:
            reporter.finish()
    finally:
        stack.close()
        db.close()
        if tmp is not None:
            tmp.cleanup()
    scored = []
    for (cand, _), res in zip(cands, results):
        if res is None:
            continue
        if res["status"] != "ok":
            pruned.append(Pruned(dict(cand.pools[0].parallel), cand.pools[0].chips, cand.chunk, res["family"],
                                 res["reason"]))
            continue
        rate = res["capacity_requests_per_s"] or None
        scored.append(Scored(cand, candidate_config(base, cand, workload, settings.slo, rate), res))
    scored.sort(key=lambda s: (s.value(settings.objective), s.candidate.label()))
    simulated = [r for r in results if r is not None]
    return ServeSearchResult(settings.objective, settings, len(layouts), tuple(pruned), tuple(scored), len(simulated),
                             skipped, sum(r.get("runs", 0) for r in simulated if r["status"] == "ok")
                             + sum(b.runs for b in bounded),
                             None if own_db else str(db_path), tuple(bounded),
                             {cand.label(): e for (cand, _), e in zip(cands, estimated)})


def _settle_s(workload: Mapping, ttft_limits, tpot_limits, roles) -> float:
    """A request's time in the system when the SLO holds: the TTFT limit plus the mean
    output times the TPOT limit (without a limit: ten times the slowest lone figure)."""
    osl = _mean_lengths(workload)[1]
    kept = [x[3] for r in roles.values() for x in r]
    ttft = max((l.limit_s for l in ttft_limits), default=10 * max((k["lone_ttft_s"] for k in kept), default=0.0))
    tpot = max((l.limit_s for l in tpot_limits), default=10 * max((k["lone_tpot_s"] or 0.0 for k in kept),
                                                                  default=0.0))
    return ttft + osl * tpot


def _mean_lengths(workload: Mapping) -> tuple[float, float]:
    """The workload's mean prompt and output tokens."""
    from g5core.serve.workload import synthetic

    reqs = synthetic(workload).requests
    return sum(r.input_tokens for r in reqs) / len(reqs), sum(r.output_tokens for r in reqs) / len(reqs)


def _longest(workload: Mapping) -> int:
    from g5core.serve.workload import synthetic

    return max(r.input_tokens + r.output_tokens for r in synthetic(workload).requests)


# ----------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------


def best_serve_command(raw: Mapping, config_path, disabled, objective, db_path, workers: int, executor: str, *,
                       disagg: str, workload=None, requests=None, isl=None, osl=None, slo=None, seed=None, rate=None,
                       chunks=None, seqs=None, tolerance=None, max_rate=None, beam=None, vary=None, settle=None,
                       confirm=None, top=DEFAULT_TOP, max_steps=None) -> ServeSearchResult:
    """``g5 best CONFIG --serve``'s flags to a search (the CLI prints its result)."""
    from g5core.serve.api import split_config, workload_spec
    from g5core.study.sweep import default_progress

    if objective is not None and objective not in SERVE_OBJECTIVES:
        raise ConfigError("--objective", f"{objective} ranks single-batch layouts; with --serve use "
                                         f"{', '.join(SERVE_OBJECTIVES)}")
    _, block = split_config(raw)
    base_wl = dict(block.get("workload") or {})
    if rate is not None and objective != "min_chips":
        raise ConfigError("--rate", "the search finds the rate (the capacity); --rate is the min_chips objective's")
    # the flags over the configuration's workload; the search sets each run's rate itself
    spec = workload_spec(base_wl, workload, requests, 1.0 if "arrival" not in base_wl and not workload else None,
                         None, isl, osl, seed)
    slo = slo if slo is not None else block.get("slo")
    if isinstance(slo, Mapping):
        slo = ",".join(f"{k}={v}" for k, v in slo.items())
    if not slo:
        raise ConfigError("--slo", "the serving search needs SLO limits, e.g. --slo ttft_p90=2s,tpot_p90=50ms")
    settings = SearchSettings(
        slo=slo, objective=objective or "goodput_per_chip", disagg=disagg,
        chunks=tuple(chunks) if chunks else DEFAULT_CHUNKS, seqs=tuple(seqs) if seqs else None,
        tolerance=DEFAULT_TOLERANCE if tolerance is None else tolerance,
        max_rate=DEFAULT_MAX_RATE if max_rate is None else max_rate, beam=DEFAULT_BEAM if beam is None else beam,
        rate=rate, vary=tuple(v.strip() for v in vary.split(",") if v.strip()) if vary else None,
        settle=SETTLE if settle is None else settle, confirm=DEFAULT_CONFIRM if confirm is None else confirm,
        top=top)
    return serve_search(raw, spec, settings, db_path=db_path, disabled=disabled, workers=workers,
                        executor=executor, progress=default_progress(), inputs=[config_path], max_work=max_steps)
