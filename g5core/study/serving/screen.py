"""Screening (in the workers): one layout at one chunk size, before any rate is tried: the
plugins' refusals, the KV pool, one request alone on an idle instance, the estimate's step
table. The engine's step latencies are cached per worker and layout."""
from __future__ import annotations

from typing import Mapping

from g5core.api.errors import ConfigError, PluginError
from g5core.inputs.framework import graph_islands
from g5core.inputs.step import Step
from g5core.inputs.serving import split_config
from g5core.inputs.speculative import parse_speculative
from g5core.serve.api import attention_dp
from g5core.serve.cost import DpCost, RankedWork, StepWork, plan_experts_runner, plan_step_runner
from g5core.serve.session import ServingSession
from g5core.serve.workload import Request, Workload, synthetic
from g5core.session.run import make_plan
from g5core.study.resultsdb import canonical_json, config_hash
from g5core.study.serving.estimate import step_table
from g5core.study.serving.space import (_layout_config, _longest, _mean_lengths, short_label, speculative_label,
                                        thaw_block)


#: the decode role's bound looks at batches up to this many sequences
MAX_DECODE_BATCH = 1024


#: per worker process: (layout configuration JSON) -> cached step runner, shared by the
#: sessions of every candidate using that layout (the engine's latencies do not depend on
#: the instances, the scheduler limits or the rate)
_RUNNERS: dict = {}


#: id(runner) -> HBM capacity per chip of its layout (the memory ledger's, the tightest chip)
_CAPACITY: dict = {}


#: per worker process: (layout configuration JSON) -> the cached runner's latencies
#: (``groups -> latency_s``), and id(runner) -> its layout's key
_CACHES: dict = {}
_KEYS: dict = {}


#: latencies shipped to this worker (:func:`seed_runners`) for a runner not made yet
_SEEDS: dict = {}


def engine_points(session) -> dict:
    """The engine's step latencies the shared runners of ``session``'s pools hold (this
    worker's), by layout: ``{layout key: [[groups, latency_s], ...]}``, what
    :func:`seed_runners` gives another worker, so that it does not simulate them again."""
    out = {}
    for pool in session.fleet.pools:
        runner = getattr(getattr(pool.cost, "rank", pool.cost), "step_s", None)   # an attention-DP instance: its ranks'
        key = _KEYS.get(id(runner))
        if key is not None:
            out[key] = _listed(_CACHES[key])
    return out


def _listed(cache: Mapping) -> list:
    """``groups -> latency_s`` as :func:`engine_points` ships it (lists, for JSON)."""
    return [[[list(g) for g in groups], latency_s] for groups, latency_s in cache.items()]


def _merge_points(cache: dict, pts) -> dict:
    """``cache`` (``groups -> latency_s``) with the shipped ``pts`` it lacks."""
    for groups, latency_s in pts:
        cache.setdefault(tuple(tuple(g) for g in groups), latency_s)
    return cache


def seed_runners(points) -> None:
    """Take another worker's step latencies (:func:`engine_points`): the engine is
    deterministic, so a latency it gave there is the one it would give here."""
    for key, pts in (points or {}).items():
        cache = _CACHES.get(key)
        if cache is None:
            if len(_SEEDS) > 256:
                _SEEDS.clear()
            _SEEDS[key] = pts
            continue
        _merge_points(cache, pts)


class ShippedPoints:
    """The engine latencies the driver ships with each capacity cell, per layout key
    (:func:`engine_points`' form): its layouts' screens' and those earlier capacity cells'
    runs made, so that one worker does not simulate again what another did (the engine is
    deterministic: the same figures)."""

    def __init__(self):
        self.screens: dict = {}     # (chips, layout label) -> {layout key: [[groups, latency_s], ...]}
        self.ran: dict = {}         # layout key -> {groups: latency_s}: what capacity cells made

    def screened(self, layout: tuple, points) -> None:
        """A layout's screen's latencies (``points``: its cell's ``engine_points``)."""
        self.screens.setdefault(layout, {}).update(points or {})

    def of(self, layouts) -> dict:
        """The latencies of ``layouts`` (``(chips, layout label)`` each) to ship with a cell."""
        out: dict = {}
        for layout in layouts:
            out.update(self.screens.get(layout, {}))
        for key in set(out).intersection(self.ran):
            out[key] = out[key] + _listed(self.ran[key])
        return out

    def learn(self, res: Mapping) -> dict:
        """``res`` (a capacity cell's result) without the latencies its runs made, which are kept."""
        for key, pts in (res.get("engine_points") or {}).items():
            _merge_points(self.ran.setdefault(key, {}), pts)
        return {k: v for k, v in res.items() if k != "engine_points"}


def _remembered(engine, cache: dict):
    """``groups -> engine(groups)``, each asked once (``cache`` holds the answers)."""
    def hit(groups):
        if groups not in cache:
            cache[groups] = engine(groups)
        return cache[groups]
    return hit


def _shared_runner(praw: Mapping, prepared):

    key = canonical_json({k: v for k, v in praw.items() if k != "serving"})
    hit = _RUNNERS.get(key)
    if hit is None:
        cache = _merge_points({}, _SEEDS.pop(key, ()))
        hit = _remembered(plan_step_runner(prepared), cache)
        # an attention-DP layout's experts' part of its steps (DpCost), shared alike
        experts = plan_experts_runner(prepared) if attention_dp(prepared.plan, "parallel.dp") > 1 else None
        if experts is not None:
            hit.experts_s = _remembered(experts, {})

        if len(_RUNNERS) > 256:
            _RUNNERS.clear()
            _CAPACITY.clear()
            _CACHES.clear()
            _KEYS.clear()
        _RUNNERS[key] = hit
        _CACHES[key] = cache
        _KEYS[id(hit)] = key
        probe = prepared.step_rules.round_up(32)   # any step the layout runs (its plugins' token multiple)
        _CAPACITY[id(hit)] = min(c.capacity_bytes for c in prepared.memory(Step.prefill(1, probe)).per_chip)
    return hit


def _session(raw: Mapping, workload: Mapping, slo: str, disabled, runner_for=None):

    return ServingSession(raw, workload, disabled=disabled, slo=slo, runner_for=runner_for or _shared_runner)


def _lone(workload: Mapping) -> dict:
    """One request, the workload's shortest prompt and output (a bound every request's TTFT
    and TPOT are at or above), arriving on an idle deployment."""
    reqs = synthetic(workload).requests
    isl = min(r.input_tokens for r in reqs)
    osl = min(r.output_tokens for r in reqs)
    return Workload((Request(0, 0.0, isl, max(osl, 2)),), source={"lone": [isl, max(osl, 2)]})


def screen_cell(base: Mapping, chips: int, parallel: Mapping, chunk: int, workload: Mapping, slo: str,
                disabled=(), runner_for=None) -> dict:
    """One layout at one chunk size: valid? KV pool? one request alone (TTFT, TPOT)?

    With a ``speculative:`` block of ``k`` drafts the lone request's TPOT is one draw of its
    accepted tokens, not a floor of every request's, so the screen's ``lone_tpot_s`` is
    the floor: the verification step of that one sequence at the shortest prompt's context
    over the ``k + 1`` tokens it keeps at most (its e2e from it); ``speculative_tokens``
    says so."""
    raw = _layout_config(base, chips, parallel)
    raw["serving"] = {"instances": 1, "scheduler": {**dict((base.get("serving") or {}).get("scheduler") or {}),
                                                    "max_num_batched_tokens": chunk, "chunked_prefill": True}}
    lone_wl = _lone(workload)
    try:
        plan = make_plan(split_config(raw)[0], disabled)
        # a lone decode (batch 1) first: a layout whose plugins refuse it (e.g. sp splitting a
        # decode batch) can serve no request, and says so before any step is simulated
        make_plan({**split_config(raw)[0], "phase": "decode", "batch": 1,
                   "seq_len": lone_wl.requests[0].input_tokens}, disabled)
    except (ConfigError, PluginError) as exc:
        return {**refusal(exc), "layout": True}     # the layout itself, whatever the chunk size
    try:
        session = _session(raw, workload, slo, disabled, runner_for)
        lone = session.run(lone_wl)
        info = session.infos[0]
        # decode steps of b sequences at the shortest prompt's context, b over the powers of
        # two up to the first at or above what the pool holds at the longest request (the
        # decode role's bound)
        cost = instance_cost(session.fleet.pools[0].cost)
        isl = lone_wl.requests[0].input_tokens
        spec = parse_speculative(raw)
        k = spec.tokens if spec is not None else 0
        lone_ttft, lone_tpot, lone_e2e = (lone.summary[f"{m}_s"]["p50"] for m in ("ttft", "tpot", "e2e"))
        if k:
            lone_tpot = cost.latency_s(StepWork((), (isl,), k)) / (k + 1)
            lone_e2e = lone_ttft + (lone_wl.requests[0].output_tokens - 1) * lone_tpot
        holds = max(info["kv_capacity_tokens"] // max(_longest(workload), 1), 1)
        batches = [1 << k for k in range(min((holds - 1).bit_length(), MAX_DECODE_BATCH.bit_length() - 1) + 1)]
        isl_mean, osl_mean = (round(x) for x in _mean_lengths(workload))
        decode = [[b, cost.latency_s(StepWork((), (isl,) * b))] for b in batches]
        table = step_table(cost, isl_mean, osl_mean, chunk, batches, getattr(cost, "dp", 1),
                           bool(graph_islands(plan.ctx.system)))
    except (ConfigError, PluginError) as exc:
        return refusal(exc)
    points = engine_points(session)
    return {"status": "ok", "engine_points": points, "kv_capacity_tokens": info["kv_capacity_tokens"],
            "kv_pool_bytes_per_chip": info["kv_pool_bytes_per_chip"], "lone_ttft_s": lone_ttft,
            "lone_tpot_s": lone_tpot, "lone_e2e_s": lone_e2e, "speculative_tokens": k,
            "decode_step_s": decode, "estimate": table}


class _SpreadCost:
    """An attention-DP instance's cost (:class:`~g5core.serve.cost.DpCost`) for the screen and
    the estimate, which see an instance as one server: a step's decodes spread over the ranks
    in turn (as the ranks' schedulers hold them at steady state), its prompt chunks on the
    first ranks in turn."""

    def __init__(self, cost):
        self.cost, self.dp = cost, cost.dp

    def latency_s(self, work: StepWork) -> float:
        ranks = [([], []) for _ in range(self.dp)]
        for k, chunk in enumerate(work.chunks):
            ranks[k % self.dp][0].append(chunk)
        for k, c in enumerate(work.decode_contexts):
            ranks[k % self.dp][1].append(c)
        return self.cost.latency_s(RankedWork(tuple(StepWork(tuple(ch), tuple(sorted(dc))) for ch, dc in ranks)))


def instance_cost(cost):
    """The cost the screen's step tables read: the pool's own, or an attention-DP instance's
    spread over its ranks (:class:`_SpreadCost`)."""
    return _SpreadCost(cost) if isinstance(cost, DpCost) else cost


def screen_layout(base: Mapping, chips: int, parallel: Mapping, chunks, workload: Mapping, slo: str, disabled=(),
                  runner_for=None) -> dict:
    """One layout at every chunk size of ``chunks``, in one cell, so that the chunk sizes
    share the layout's step latencies (one worker's cached runner): ``{"chunks": [the
    screen_cell result per chunk size], "engine_points": those latencies}``
    (:func:`engine_points`, for the workers that simulate its candidates). A refusal of the
    layout itself (before any step of a chunk size) prunes every chunk size at once."""
    out = []
    for chunk in chunks:
        res = screen_cell(base, chips, parallel, chunk, workload, slo, disabled, runner_for)
        if res.get("layout"):
            return {"status": "ok", "chunks": [res] * len(chunks)}
        out.append(res)
    # the layout's latencies once (the last chunk's screen holds every chunk's: one runner)
    points = next((r.pop("engine_points") for r in reversed(out) if "engine_points" in r), {})
    for r in out:
        r.pop("engine_points", None)
    return {"status": "ok", "chunks": out, "engine_points": points}


def layout_screens(base: Mapping, variants, by_layout, pars: Mapping, dsys, ident: Mapping, names, settings,
                   workload: Mapping, disabled: tuple, runner_for) -> list:
    """The search's screen cells (``(key, kind, label, fn, args)``, as the driver runs them):
    every layout of ``by_layout`` (``(chips, layout label)``; ``pars`` their layouts) per
    speculative block of ``variants`` (its proposer's memory and steps), on the
    configuration's system and, with ``dsys`` (--decode-system), again on that one (the
    decode role's: heterogeneous disaggregation); ``ident`` and ``names`` key the cells."""
    cells = []
    for spec in variants:
        sbase = {**base, "speculative": thaw_block(spec)} if spec else base
        on = f" {speculative_label(spec)}" if spec else ""
        systems = [(sbase, "")] + ([({**sbase, "system": dsys}, f" on {dsys}")] if dsys is not None else [])
        for sys_base, where in systems:
            for c, lab in by_layout:
                par = pars[(c, lab)]
                key = config_hash({"kind": "screen", **ident, "base": sys_base, "chips": c, "parallel": par,
                                   "chunks": list(settings.chunks)}, names)
                cells.append((key, "screen", f"[{short_label(par)}]{where}{on}", screen_layout,
                              (sys_base, c, par, settings.chunks, workload, settings.slo, disabled, runner_for)))
    return cells


def refusal(exc: Exception) -> dict:
    """A plugin's or the configuration's refusal as a pruned cell, grouped by family: the
    memory (the KV pool, HBM), the plugin that refused, or the field named. A refusal at
    any point of a layout's screen or runs (a step its plugins refuse to lower, e.g. a
    batch an sp group cannot split) prunes that layout, never the search."""
    text = str(exc)
    if isinstance(exc, PluginError):
        return {"status": "pruned", "family": f"plugin '{exc.plugin}'", "reason": text}
    family = "memory" if "KV pool" in text or "HBM" in text or "fill" in text else (exc.field or "configuration")
    return {"status": "pruned", "family": family, "reason": text}


def _hbm(pool) -> float:
    cost = getattr(pool.cost, "rank", pool.cost)     # an attention-DP instance's: its ranks' plan cost
    return _CAPACITY.get(id(getattr(cost, "step_s", None)), pool.cost.kv_pool_bytes_per_chip)

