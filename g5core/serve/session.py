"""A deployment built once and served many workloads: what a rate search (``g5 best
--serve``'s capacity bisection) needs, since building the pools (prepared plans, KV sizing)
and the engine's step latencies (cached per step shape in each pool's cost model) are most
of a serving run's time and do not depend on the arrival rate.

    session = ServingSession(raw, workload_at_any_rate, slo="ttft_p90=2s")
    for rate in (1, 2, 4):
        result = session.run(workload_at(rate))   # a ServeResult, as simulate_serving's

Each run gets fresh routers and schedulers (the loop builds its instances), so a run's
result is the one :func:`~g5core.serve.api.simulate_serving` gives for the same
configuration and workload, bit for bit.
"""
from __future__ import annotations

import json
import time
from typing import Callable, Mapping, Optional

import attrs

from g5core.api.errors import ConfigError, G5Error
from g5core.serve.api import ServeResult, build_pools, load_flagged_workload
from g5core.serve.loop import MissWatch, ServingLoop, check_invariants
from g5core.serve.metrics import summary
from g5core.serve.workload import Workload
from g5core.api.plugins import Hooks, make_plugin_manager
from g5core.inputs.config import disabled_from_config
from g5core.serve.registry import serving_registry
from g5core.inputs.serving import parse_serving, split_config


class ServingSession:
    """The pools of ``raw`` (its ``serving:`` block), sized against ``workload``'s longest
    request; :meth:`run` simulates a workload on them. ``runner``/``runner_for``: as
    :func:`~g5core.serve.api.build_pools`'s."""

    def __init__(self, raw: Mapping, workload: Workload | Mapping, *, disabled=(), slo=None, exact: bool = False,
                 runner: Optional[Callable] = None, runner_for: Optional[Callable] = None):
        t0 = time.perf_counter()
        base, block = split_config(raw)
        names = tuple(dict.fromkeys(tuple(disabled) + tuple(disabled_from_config(base))))
        self.registry = serving_registry(Hooks(make_plugin_manager(disabled=names)))
        self.spec = parse_serving(block, self.registry, slo)
        workload = self._workload(workload)
        self.fleet, self.infos = build_pools(base, self.spec, self.registry, workload, disabled, exact, runner,
                                                    runner_for)
        self.longest = max(r.input_tokens + r.output_tokens for r in workload.requests)
        self.build_s = time.perf_counter() - t0

    def _workload(self, workload) -> Workload:
        if isinstance(workload, Mapping):
            workload = _synthetic_once(workload, lambda: load_flagged_workload(workload, self.registry))
        if not workload.requests:
            raise ConfigError("--requests", "the workload has no requests")
        return workload

    def run(self, workload: Workload | Mapping, stop_at_miss: bool = False,
            itl_stats: bool = True) -> "ServeResult | MissedRun":
        """The workload served on the session's pools. ``stop_at_miss``: the run stops as soon
        as its SLO verdict is sure to be missed (:class:`~g5core.serve.loop.MissWatch`) and
        gives a :class:`MissedRun` instead; otherwise (and when it holds) the whole run's
        :class:`~g5core.serve.api.ServeResult`, the same either way. ``itl_stats``: as
        :func:`~g5core.serve.metrics.summary`'s."""
        t0 = time.perf_counter()
        workload = self._workload(workload)
        if max(r.input_tokens + r.output_tokens for r in workload.requests) > self.longest:
            raise ConfigError("--workload", "a request is longer than the ones the session's pools were sized for")
        for pool, ps in zip(self.fleet.pools, self.spec.pools):
            pool.router = self.registry.router(ps.router)()
        watch = MissWatch.of(self.spec.slo, workload) if stop_at_miss else None
        # every inter-token gap only where a figure reads them (their statistics, an ITL limit)
        gaps = itl_stats or any(lim.metric == "itl" for lim in self.spec.slo)
        run = ServingLoop(self.fleet, workload, miss=watch, gaps=gaps)
        loop = run.run()
        if loop is None:
            return MissedRun(len(workload.requests), run.done, schedulers_peak(i for p in run.pools for i in p),
                             time.perf_counter() - t0, watch.limit,
                             sum(i.scheduler.preemptions for p in run.pools for i in p),
                             schedulers_peak(run.pools[-1]))
        checks = check_invariants(loop)
        if any(checks.values()):
            raise G5Error("serving invariants violated: " + ", ".join(f"{k}={v}" for k, v in checks.items() if v))
        return ServeResult(loop, summary(loop, self.spec.slo, itl_stats), [dict(i) for i in self.infos],
                           [p.cost for p in self.fleet.pools], checks, time.perf_counter() - t0)


#: per process: a synthetic workload's mapping (its JSON) -> the :class:`Workload` it makes
#: (seeded, immutable): the serving search sizes every candidate's session with the same
#: 20,000 requests, and runs the same rates and seeds on several candidates
_SYNTHETIC: dict = {}


def _synthetic_once(spec: Mapping, make: Callable[[], Workload]) -> Workload:
    """``make()``, the workload of the synthetic mapping ``spec``, made once per process (a
    trace's is read each time: its file may change)."""
    if "trace" in spec:
        return make()
    try:
        key = json.dumps(dict(spec), sort_keys=True)
    except (TypeError, ValueError):
        return make()
    hit = _SYNTHETIC.get(key)
    if hit is None:
        if len(_SYNTHETIC) >= 16:
            _SYNTHETIC.clear()
        hit = _SYNTHETIC[key] = make()
    return hit


def schedulers_peak(instances) -> Optional[int]:
    """The most sequences any of the instances' schedulers held at once (per attention-DP
    rank); ``None`` when a scheduler does not say."""
    peaks = [getattr(inst.scheduler, "peak_running", None) for inst in instances]
    return None if None in peaks else max(peaks, default=0)


@attrs.frozen
class MissedRun:
    """A run stopped once its SLO verdict was sure to be missed
    (:meth:`ServingSession.run` with ``stop_at_miss``): it has no figures, only its verdict.
    ``summary`` carries that verdict in a serving summary's keys (``goodput.all_met``
    false), so code reading a run's verdict reads both alike."""

    requests: int
    completed: int                     # the requests finished when it stopped
    peak_running: Optional[int]        # the most sequences a scheduler held until then (None: one did not say)
    sim_wall_s: float
    limit: Optional[str] = None        # the SLO limit whose miss was sure (e.g. ``ttft_p90``)
    preemptions: Optional[int] = None  # the preemptions until then, every pool's
    last_pool_peak: Optional[int] = None   # the most sequences a scheduler of the last pool (decode) held

    @property
    def summary(self) -> dict:
        return {"requests": self.requests, "completed": self.completed, "goodput": {"all_met": False, "verdict": "missed"},
                "stopped_at_miss": True}
