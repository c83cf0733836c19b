"""Serving from a configuration: the ``serving:`` block, the pools it builds, and
:func:`simulate_serving`, the function ``g5 serve`` (and later ``g5 best --serve``) calls.

    raw = load_raw("examples/serving/llama-3.1-70b-serve.yaml")
    result = simulate_serving(raw, synthetic_workload(raw, requests=1000, rate_per_s=8))
    print(result.summary["ttft_s"]["p99"])

The ``serving:`` block is parsed and checked in :mod:`g5core.inputs.serving` (its keys are
listed there).
"""
from __future__ import annotations

import functools
import time
from typing import Callable, Mapping, Optional

import attrs

from g5core.api.errors import ConfigError, G5Error
from g5core.serve.cost import (
    DpCost, Groups, KvSizing, PlanCost, SpeculativeCost, StepWork, kv_sizing, plan_experts_runner, plan_step_runner,
    speculative_extra,
)
from g5core.serve.loop import Fleet, LoopResult, Pool, check_invariants, serve_requests, summarize_pools
from g5core.serve.metrics import summary
from g5core.serve.registry import ServingRegistry, serving_registry
from g5core.serve.scheduler import DpScheduler, speculative_factory
from g5core.serve.traces import read_trace
from g5core.serve.workload import MAX_REQUESTS, Workload, synthetic
from g5core.inputs.kv_tiers import CacheSpec, resolve_tiers
from g5core.serve.kvcache import CacheConfig, CachingScheduler
from g5core.api.plugins import Hooks, make_plugin_manager
from g5core.inputs.config import disabled_from_config
from g5core.inputs.framework import graph_islands
from g5core.lower.builder import make_topology
from g5core.lower.collective import idle_transfer_s
from g5core.session.prepared import PreparedPlan, prepare
from g5core.session.speculative import Proposer
from g5core.inputs.serving import (PLACEHOLDERS, ServingSpec, WorkloadSpec, _positive_int, parse_serving,
                                   scheduler_under, split_config)

GIB = float(2 ** 30)


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n < 10 * GIB else f"{n / GIB:.1f} GiB"


def load_workload(spec: Mapping, registry: ServingRegistry, field: str = "serving.workload") -> Workload:
    """A trace (``{trace: FILE[, requests: N]}``: its first ``N`` requests) or a synthetic workload."""
    if "trace" in spec:
        extra = set(spec) - {"trace", "requests"}
        if extra:
            raise ConfigError(f"{field}.{sorted(extra)[0]}", "a trace workload takes only trace and requests")
        w = read_trace(spec["trace"], registry.formats, f"{field}.trace")
        if "requests" in spec:
            n = _positive_int(spec["requests"], f"{field}.requests", MAX_REQUESTS)
            w = attrs.evolve(w, requests=w.requests[:n])
        return w
    return synthetic(spec, field)


def load_flagged_workload(spec: Mapping, registry: ServingRegistry) -> Workload:
    """:func:`load_workload` of a mapping ``g5 serve``'s flags made over the configuration's
    ``serving.workload`` (a :class:`WorkloadSpec`): an error names the flag that gave the bad
    value, or its ``serving.workload`` key when no flag did. A plain mapping (the Python API)
    is named ``--workload``."""
    if not isinstance(spec, WorkloadSpec):
        return load_workload(spec, registry, "--workload")
    try:
        return load_workload(spec, registry)
    except ConfigError as exc:
        raise spec.named(exc) from None


#: The loop's cost, measured (issue 36) on the 2-core development machine, 2026-12-02, CPU
#: seconds of simulate_serving on examples/serving/llama-3.1-8b-agg.yaml less its 0.6 s of
#: plans (/tmp measure script in the issue's closing note; the machine was shared): 2,000
#: requests of 200 + 256 tokens at 50/s (514,000 sequence-steps in 11,921 steps) 1.4 s, and
#: one request of 20,000 output tokens (20,000 steps of one sequence) 0.4 s: about 2.3 us per
#: sequence in a step and 20 us per step, so a step costs as much as STEP_WORK sequences.
STEP_WORK = 9
SEQ_STEP_CPU_S = 2.3e-6
#: Work (sequence-steps plus STEP_WORK per step) a serving run may take unless --max-steps
#: says otherwise: about 46 s of the loop at the rate above.
DEFAULT_MAX_WORK = 20_000_000


def serving_work(workload: Workload, spec: ServingSpec) -> tuple[int, int]:
    """A lower bound of the loop's work before it starts: ``(sequence_steps, steps)``.
    Each request takes a step per output token and at least one per prefill chunk of
    ``max_num_batched_tokens`` (once per pool it runs on); the steps are at least the
    longest request's own, and at least the sequence-steps over every instance's
    ``max_num_seqs``. Preemptions only add to it."""
    pools = spec.pools
    budget = min(p.scheduler.max_num_batched_tokens for p in pools)
    seq_steps = longest = 0
    for r in workload.requests:
        own = r.output_tokens + -(-r.input_tokens // budget)
        seq_steps += own
        longest = max(longest, own)
    width = sum(p.instances * p.scheduler.max_num_seqs for p in pools)
    return seq_steps * len(pools), max(longest, -(-seq_steps // width))


def check_work(workload: Workload, spec: ServingSpec, max_work: Optional[int] = None) -> int:
    """Refuse a run whose :func:`serving_work` is above ``max_work`` (default
    :data:`DEFAULT_MAX_WORK`), naming ``--max-steps``; returns the estimate."""
    limit = DEFAULT_MAX_WORK if max_work is None else max_work
    seq_steps, steps = serving_work(workload, spec)
    work = seq_steps + STEP_WORK * steps
    if work > limit:
        raise ConfigError("--max-steps", f"this serving run is at least {work:,} sequence-steps ({seq_steps:,} "
                                         f"sequences in {steps:,}+ steps, a step counted as {STEP_WORK}), above the "
                                         f"limit of {limit:,} (about {limit * SEQ_STEP_CPU_S:.0f} s of the loop); "
                                         "give fewer or shorter requests, or raise --max-steps")
    return work


#: runs a candidate of the serving search takes at the least (a bisection from an estimate
#: within the tolerance: two)
MIN_SEARCH_RUNS = 2


def check_search_work(candidates: int, workload: Mapping, max_work: Optional[int] = None) -> int:
    """Refuse a serving search whose work is certainly above ``max_work`` (default
    :data:`DEFAULT_MAX_WORK` each candidate, ``--max-steps``): ``candidates`` x
    :data:`MIN_SEARCH_RUNS` runs x the sequence-steps of one run of ``workload`` (its
    ``requests`` requests, each its mean output tokens plus one prefill step); returns the
    estimate. A lower bound: the bisection and the confirming seeds add runs, the settling
    rule more requests."""
    sample = synthetic({**workload, "requests": min(int(workload["requests"]), 1000)})
    per_request = sum(r.output_tokens + 1 for r in sample.requests) / len(sample.requests)
    work = int(candidates * MIN_SEARCH_RUNS * int(workload["requests"]) * per_request)
    limit = DEFAULT_MAX_WORK * max(candidates, 1) if max_work is None else max_work
    if work > limit:
        raise ConfigError("--max-steps", f"this serving search is at least {work:,} sequence-steps ({candidates:,} "
                                         f"candidates x {MIN_SEARCH_RUNS} runs x {int(workload['requests']):,} "
                                         f"requests x {per_request:,.0f} steps), above the limit of {limit:,} (about "
                                         f"{limit * SEQ_STEP_CPU_S:.0f} s of the loop); narrow the search (--vary, "
                                         "--chunks, --seqs), give fewer or shorter requests, or raise --max-steps")
    return work


@attrs.define(eq=False)
class ServeResult:
    """What :func:`simulate_serving` returns: the loop's record, the summary (``g5 serve
    --json``'s keys), the pools, and the step-cost models (with their engine run counts).
    ``sim_wall_s``: the whole call (plans, KV sizing, engine steps, loop, predictor check)."""

    loop: LoopResult
    summary: dict
    pools: list
    costs: list
    conservation: dict
    sim_wall_s: float
    predictor: Optional[dict] = None

    def to_json_dict(self) -> dict:
        out = dict(self.summary)
        out["pools"] = self.pools
        out["kv_pool_bytes_per_chip"] = min(p["kv_pool_bytes_per_chip"] for p in self.pools)
        out["chips"] = self.loop.fleet.chips
        out["conservation"] = self.conservation
        out["engine_runs"] = sum(getattr(c, "runs", 0) for c in self.costs)
        out["step_predictor"] = self.predictor
        out["sim_wall_s"] = self.sim_wall_s
        out["workload"] = self.loop.workload.source
        return out


def build_pools(raw: Mapping, spec: ServingSpec, registry: ServingRegistry, workload: Workload, disabled=(),
                exact: bool = False, runner: Optional[Callable[[Groups], float]] = None,
                runner_for: Optional[Callable] = None) -> tuple[Fleet, list]:
    """The pools of a deployment, each a prepared plan with its KV pool from the ledger,
    checked against the workload's longest request before anything is simulated.
    ``runner``: ``groups -> latency_s`` instead of the plan's engine (tests);
    ``runner_for``: ``(pool configuration, prepared plan) -> runner``, one per pool (a
    caller sharing step latencies between deployments of the same layout); for an
    attention-DP layout the runner may carry ``experts_s`` (the experts' part of a step,
    :class:`DpCost`), shared alike."""
    longest_prompt = max(r.input_tokens for r in workload.requests)
    longest = max(r.input_tokens + r.output_tokens - 1 for r in workload.requests)
    pools, infos, plans = [], [], []
    first_chip = 0
    for ps in spec.pools:
        praw = {**raw, **dict(ps.overrides)}
        field = "serving" if ps.role == "serve" else f"serving.disaggregation.{ps.role}"
        s = ps.scheduler
        if not s.chunked_prefill and longest_prompt > s.max_num_batched_tokens:
            raise ConfigError(f"{field}.scheduler.max_num_batched_tokens",
                              f"{s.max_num_batched_tokens:,} tokens cannot hold the longest prompt "
                              f"({longest_prompt:,} tokens) without chunked prefill; turn chunked_prefill on or "
                              "raise max_num_batched_tokens")
        prepared = prepare(praw, disabled=disabled)
        plan = prepared.plan
        # the framework profile's scheduling where the configuration is silent
        s = scheduler_under(ps.scheduler, ps.given, plan.ctx.system)
        rules = prepared.step_rules   # what the layout's dimensions require of a step (see PlanCost)
        sizing = kv_sizing(prepared, rules.round_up(s.max_num_batched_tokens), field)
        speculative = prepared.deployment.speculative
        proposer = None
        if speculative is not None and speculative.enabled and ps.role != "prefill":
            proposer = Proposer(prepared.plan, speculative)
            sizing = proposer_sizing(sizing, proposer)
        need = longest_prompt if ps.role == "prefill" else longest
        blocks = sizing.capacity_tokens // s.block_size
        if blocks * s.block_size < need:
            raise ConfigError(field, f"KV pool {_gib(sizing.pool_bytes_per_chip)} per chip holds "
                                     f"{blocks * s.block_size:,} tokens; the longest request needs {need:,}: "
                                     "use more chips per instance (tp, pp, cp) or shorter requests")
        dp = attention_dp(plan, field)
        step_runner = runner or (runner_for(praw, prepared) if runner_for else plan_step_runner(prepared))
        cost = PlanCost(step_runner, exact, rules,
                        sizing.kv_bytes_per_token_per_chip, sizing.pool_bytes_per_chip, sizing.capacity_tokens,
                        sizing.chips, graph_islands(plan.ctx.system))
        factory = registry.scheduler(ps.scheduler_name)
        if dp > 1:
            if proposer is not None:
                raise ConfigError("speculative", "speculative decoding is not yet modelled with attention DP "
                                  "(parallel.dp > 1): drop the speculative block, or use dp: 1 with more instances")
            # the experts' part of an unequal step from the engine's op breakdown (or the
            # runner_for runner's ``experts_s``); a stand-in runner (``runner``) has none, and
            # its steps are the slowest rank's (DpCost's doc)
            experts = None if runner else (getattr(step_runner, "experts_s", None) or plan_experts_runner(prepared))
            cost = DpCost(cost, dp, experts_s=experts)
        if spec.cache is not None:
            if proposer is not None:
                raise ConfigError("speculative", "speculative decoding is not yet modelled with the block cache "
                                  "(serving.prefix_cache, serving.kv_tiers): drop one of them")
            # one cache per scheduler: the instance's, or each attention-DP rank's (DpScheduler)
            factory = functools.partial(CachingScheduler, cache=cache_config(spec.cache, registry, plan, sizing, cost, dp))
        elif proposer is not None:
            cost, factory = speculative_pool(prepared, proposer, cost, ps, field)
        if dp > 1:
            factory = functools.partial(DpScheduler, dp=dp, balance=ps.dp_balance, factory=factory)
        pool = Pool(ps.role, ps.instances, cost, s, blocks * dp, registry.router(ps.router)(), factory, first_chip)
        first_chip += pool.chips
        pools.append(pool)
        plans.append((plan, sizing))
        infos.append({"kv_pool_bytes_per_chip": sizing.pool_bytes_per_chip,
                      "kv_bytes_per_token_per_chip": sizing.kv_bytes_per_token_per_chip,
                      "kv_capacity_tokens": blocks * s.block_size * dp, "layout": dict(plan.ctx.deployment.parallel),
                      "system": plan.ctx.system.name, "mixed_prefill": s.mixed_prefill})
        if dp > 1:
            infos[-1].update(attention_dp_ranks=dp, dp_balance=ps.dp_balance,
                             kv_capacity_tokens_per_rank=blocks * s.block_size)
    dep = Fleet(tuple(pools), spec.routing_s)
    if len(pools) == 2:
        dep.transfer_s, dep.transfer_bytes = kv_transfer(pools, plans)
    for info, base in zip(infos, summarize_pools(pools)):
        info.update(base)
    return dep, infos


def attention_dp(plan, field: str = "serving") -> int:
    """The attention-DP ranks of an instance's layout: its ``dp``, checked. ``dp > 1`` inside
    an instance steps the ranks together because the MoE all-to-all joins them, so it needs
    an MoE model with ``ep > 1`` whose every EP group spans every rank; independent copies of
    a layout are ``instances``."""
    ctx = plan.ctx
    dep = ctx.deployment
    dp = dep.size("dp")
    if dp == 1:
        return 1
    where = "parallel.dp" if field == "serving" else f"{field}.parallel.dp"
    space = dp * dep.size("sp") * dep.size("tp")
    if ctx.model.moe is None or dep.size("ep") == 1:
        raise ConfigError(where, f"dp={dp} inside an instance is attention DP: its ranks step together because the "
                                 f"MoE all-to-all joins them, so it needs an MoE model with ep > 1 (ep = dp x sp x tp "
                                 f"= {space}); for independent copies of the layout use dp: 1 and more instances")
    rm = ctx.rankmap
    for group in rm.groups("ep"):
        ranks = len({rm.rank_in("dp", c) for c in group})
        if ranks != dp:
            raise ConfigError(where, f"an EP group of ep={dep.size('ep')} spans {ranks} of the {dp} attention-DP "
                                     f"ranks, so the ranks would not step together; set ep = dp x sp x tp = {space}, "
                                     "or use fewer dp ranks and more instances")
    return dp


def rank_chips(plan) -> tuple[int, ...]:
    """The chips of attention-DP rank 0 of an instance (every chip when dp is 1): where one
    sequence's KV lives."""
    rm = plan.ctx.rankmap
    return tuple(c for c in range(rm.chips) if rm.rank_in("dp", c) == 0)


def cache_config(spec: CacheSpec, registry: ServingRegistry, plan, sizing, cost, dp: int) -> CacheConfig:
    """A pool's block cache: its tiers with the system's defaults, its policy, the ledger's
    KV bytes, the model's layers (a fetch overlaps them) and the step cost of recomputing.
    With attention DP (``dp`` ranks) the cache is one rank's: a block's bytes are those of the rank's chips
    (:func:`rank_chips`; every rank's are alike), each chip's tier its own, and recomputing
    is the instance's step with that rank prefilling (``cost``: a :class:`DpCost`)."""
    def recompute_s(tokens: int, cached: int) -> float:
        return cost.latency_s(StepWork(((tokens, cached),), ()))
    if dp == 1:
        block_bytes_per_token = sizing.kv_bytes_per_token
    else:
        per_token = dict(zip(range(sizing.chips), sizing.per_chip_kv_bytes_per_token))
        block_bytes_per_token = sum(per_token[c] for c in rank_chips(plan))
    return CacheConfig(registry.cache_policies[spec.policy][1], resolve_tiers(spec, plan.ctx.system), spec.miss,
                       spec.overlap, plan.ctx.model.n_layers, sizing.kv_bytes_per_token_per_chip,
                       block_bytes_per_token, recompute_s, spec.policy)


def proposer_sizing(sizing: KvSizing, proposer: Proposer) -> KvSizing:
    """The KV pool with a speculative proposer on the chips: its weights (its ledger line) come
    out of the pool, and every token also stores the proposer's KV (its layers' ``c_kv``)."""
    terms = {t.name: t for t in proposer.memory_terms()}
    if not terms:
        return sizing
    weights = max(b for name, t in terms.items() if not name.endswith("_kv_cache") and not t.part_of
                  for _, b in t.bytes_per_chip)
    per_token = sizing.kv_bytes_per_token_per_chip + PreparedPlan(proposer.plan).kv_bytes_per_token
    pool = max(sizing.pool_bytes_per_chip - weights, 0.0)
    return attrs.evolve(sizing, pool_bytes_per_chip=pool, kv_bytes_per_token_per_chip=per_token,
                        capacity_tokens=int(pool // per_token))


def speculative_pool(prepared, proposer: Proposer, cost: PlanCost, ps, field: str) -> tuple:
    """A pool's cost and scheduler factory with speculative decoding: :class:`SpeculativeCost`
    (the verification excess and the proposer's passes from the engine) and the seeded
    :class:`SpeculativeScheduler` (instance ``i`` draws from seed ``i``)."""
    if ps.scheduler_name != "vllm":
        raise ConfigError(f"{field}.scheduler.name", f"speculative decoding runs on the vllm scheduler, not "
                                                     f"{ps.scheduler_name!r}; remove the name or the speculative block")
    runner = None if proposer.plan is None else PreparedPlan(proposer.plan)
    cost = SpeculativeCost(cost, speculative_extra(prepared, runner, cost.rules))
    return cost, speculative_factory(prepared.deployment.speculative, ps.instances)


def kv_transfer(pools, plans):
    """``(transfer_s(tokens, i, j), transfer_bytes(tokens))`` of a prompt's KV from prefill
    instance ``i`` to decode instance ``j``: chip ``k`` of the prefill instance sends the KV it
    holds (the ledger's bytes per token on that chip) to chip ``k * Cd // Cp`` of the decode
    instance, all at once; the time is when the busiest resource is done plus one message's
    start latency. Transfers do not contend with one another or with the steps.
    With attention DP a sequence's KV is on one rank's chips: ``Cp`` and ``Cd`` are then the
    chips of one rank (rank 0's, :func:`rank_chips`; every rank's chips are alike).

    Both pools on one system: one network of both pools' chips (prefill first): scale-up
    links inside a node, NICs and fabric between nodes. Pools on two systems (a pool's
    ``system``, heterogeneous disaggregation) are two clusters, each its system's topology
    of its pool's chips: every flow leaves through its prefill chip's NIC (the prefill
    system's NIC bandwidth and rail, and its leaf's uplink with an oversubscribed fabric)
    and enters through its decode chip's NIC (the decode system's), over a fabric between
    the clusters that limits nothing else, so the busiest NIC, on either side, sets the time;
    the start latency is the larger of the two systems' ``network_latency_s``. A scale-up
    domain never spans two systems, so no cross-system byte uses NVLink."""
    (pp, (plan, sizing)), (dp, (dplan, _)) = (pools[0], plans[0]), (pools[1], plans[1])
    src, dst = rank_chips(plan), rank_chips(dplan)
    cp, cd = len(src), len(dst)
    per_token = dict(zip(range(sizing.chips), sizing.per_chip_kv_bytes_per_token))
    cache: dict = {}
    if plan.ctx.system == dplan.ctx.system:
        topo = make_topology(plan.hooks, plan.ctx.system, pools[0].chips + pools[1].chips)

        def per_token_s(i: int, j: int) -> tuple[float, float]:
            if (i, j) not in cache:
                flows = [(pp.first_chip + i * pp.cost.chips + src[k],
                          dp.first_chip + j * dp.cost.chips + dst[k * cd // cp], per_token[src[k]])
                         for k in range(cp) if per_token[src[k]] > 0]
                latency = max(topo.message_latency_s([a, b]) for a, b, _ in flows) if flows else 0.0
                cache[(i, j)] = (idle_transfer_s(flows, topo), latency)
            return cache[(i, j)]
    else:
        ptopo = make_topology(plan.hooks, plan.ctx.system, pools[0].chips)
        dtopo = make_topology(dplan.hooks, dplan.ctx.system, pools[1].chips)
        caps = {"p": ptopo.capacities(), "d": dtopo.capacities()}
        latency = max(ptopo.network_latency_s, dtopo.network_latency_s)

        def per_token_s(i: int, j: int) -> tuple[float, float]:
            if (i, j) not in cache:
                load: dict = {}
                for k in range(cp):
                    b = per_token[src[k]]
                    if b <= 0:
                        continue
                    a, z = i * pp.cost.chips + src[k], j * dp.cost.chips + dst[k * cd // cp]
                    for side, r in [("p", r) for r in ptopo.egress_route(a)] + [("d", r) for r in
                                                                              dtopo.ingress_route(z)]:
                        load[(side, r)] = load.get((side, r), 0.0) + b
                cache[(i, j)] = (max((b / caps[side][r] for (side, r), b in load.items()), default=0.0),
                                 latency if load else 0.0)
            return cache[(i, j)]

    def transfer_s(tokens: int, i: int, j: int) -> float:
        rate, latency = per_token_s(i, j)
        return tokens * rate + latency

    per_sequence_token = sum(per_token[c] for c in src)

    def transfer_bytes(tokens: int) -> float:
        return tokens * per_sequence_token
    return transfer_s, transfer_bytes


def simulate_serving(raw: Mapping, workload: Workload | Mapping | None = None, *, disabled=(), slo=None,
                     exact: bool = False, progress=None, runner: Optional[Callable[[Groups], float]] = None,
                     check_predictor: int = 16, overrides: Optional[Mapping] = None,
                     max_work: Optional[int] = None) -> ServeResult:
    """Simulate serving ``workload`` (a :class:`Workload`, a workload mapping as
    :func:`workload_spec` makes, or None: the configuration's ``serving.workload``) on the
    deployment ``raw`` describes. ``slo``: ``--slo``'s text (else ``serving.slo``).
    ``runner``: ``groups -> step latency`` (default: the engine, through each pool's
    prepared plan). ``check_predictor``: steps
    checked against the engine when the predictor is used (0: none). ``max_work``: the work
    limit (:func:`check_work`, ``--max-steps``)."""
    t0 = time.perf_counter()
    base, block = split_config(raw)
    names = tuple(dict.fromkeys(tuple(disabled) + tuple(disabled_from_config(base))))
    registry = serving_registry(Hooks(make_plugin_manager(disabled=names)))
    spec = parse_serving(block, registry, slo)
    if workload is None:
        if spec.workload is None:
            raise ConfigError("--workload", "no workload: give --workload, --rate or --concurrency, or "
                                            "serving.workload in the configuration")
        workload = load_workload(spec.workload, registry)
    elif isinstance(workload, Mapping):
        workload = load_flagged_workload(workload, registry)
    if not workload.requests:
        raise ConfigError("--requests", "the workload has no requests")
    check_work(workload, spec, max_work)
    dep, infos = build_pools(base, spec, registry, workload, disabled, exact, runner)
    loop = serve_requests(dep, workload, progress)
    checks = check_invariants(loop)
    if any(checks.values()):
        raise G5Error("serving invariants violated: " + ", ".join(f"{k}={v}" for k, v in checks.items() if v))
    predictor = None
    if not exact and check_predictor:
        predictor = {}
        for pool in dep.pools:
            predictor[pool.role] = pool.cost.predictor_error(_sample_steps(loop, pool, check_predictor))
    return ServeResult(loop, summary(loop, spec.slo), infos, [p.cost for p in dep.pools], checks,
                       time.perf_counter() - t0, predictor)


def _sample_steps(loop: LoopResult, pool: Pool, n: int) -> list[StepWork]:
    """Up to ``n`` distinct steps the pool ran, spread evenly over the cost cache's order."""
    seen = pool.cost.predicted_steps()
    if len(seen) <= n:
        return list(seen)
    return [seen[round(k * (len(seen) - 1) / (n - 1))] for k in range(n)]




@attrs.frozen
class RepresentativeStep:
    """One step of a serving pool, as a one-step configuration (``g5 run`` / ``g5 explain``)."""

    role: str          # serve (aggregated), prefill or decode
    raw: dict          # the pool's configuration, its step in phase/batch/seq_len (no serving block)
    what: str          # which step, and why (one line)


#: the context a decode step is timed at when the configuration names no workload (said so)
ASSUMED_CONTEXT_TOKENS = PLACEHOLDERS["seq_len"]


def representative_steps(raw: Mapping, disabled=()) -> list[RepresentativeStep]:
    """One representative step per pool of a serving configuration: the configuration's own
    ``phase``/``batch``/``seq_len`` (or ``step``) when it gives them; else, from the workload's
    mean lengths (``serving.workload``; without one a 4,096-token context, said so), a prefill
    pool's full chunk (``max_num_batched_tokens // isl`` prompts of ``min(isl, chunk)`` tokens)
    and a decode or aggregated pool's decode-only step (``max_num_seqs`` sequences at ``isl + osl /
    2`` context, bounded by the sequences the KV pool holds at ``isl + osl``)."""
    own = {k: raw[k] for k in ("phase", "batch", "seq_len", "step") if k in raw}
    base, block = split_config(raw)
    for key in PLACEHOLDERS:
        if key not in own:
            base.pop(key)
    names = tuple(dict.fromkeys(tuple(disabled) + tuple(disabled_from_config(base))))
    registry = serving_registry(Hooks(make_plugin_manager(disabled=names)))
    spec = parse_serving(block, registry)
    if spec.workload is not None:
        reqs = load_workload(spec.workload, registry).requests
        isl = max(1, round(sum(r.input_tokens for r in reqs) / len(reqs)))
        osl = max(1, round(sum(r.output_tokens for r in reqs) / len(reqs)))
        source = f"serving.workload's mean lengths: input {isl:,}, output {osl:,}"
    else:
        isl, osl = ASSUMED_CONTEXT_TOKENS, 0
        source = (f"a {ASSUMED_CONTEXT_TOKENS:,}-token context assumed, as the configuration has no serving.workload "
                  "(give one, or phase/batch/seq_len, to choose)")
    out = []
    for ps in spec.pools:
        praw = {**base, **dict(ps.overrides)}
        pool = "the aggregated pool" if ps.role == "serve" else f"the {ps.role} pool"
        s = ps.scheduler
        if own:
            out.append(RepresentativeStep(ps.role, praw, f"{pool}: the configuration's own step"))
            continue
        if ps.role == "prefill":
            tokens = min(isl, s.max_num_batched_tokens)
            batch = max(1, min(s.max_num_seqs, s.max_num_batched_tokens // tokens))
            praw.update(phase="prefill", batch=batch, seq_len=tokens)
            out.append(RepresentativeStep(ps.role, praw, (
                f"{pool}: a full prefill chunk, {batch:,} prompt{'s' if batch > 1 else ''} of {tokens:,} tokens, "
                f"max_num_batched_tokens {s.max_num_batched_tokens:,}; {source}")))
            continue
        context = isl + osl // 2
        field = "serving" if ps.role == "serve" else f"serving.disaggregation.{ps.role}"
        prepared = prepare({**praw, **PLACEHOLDERS}, disabled=disabled)
        held = kv_sizing(prepared, s.max_num_batched_tokens, field).capacity_tokens // (isl + osl)
        batch = max(1, min(s.max_num_seqs, held))
        bound = (f"max_num_seqs {s.max_num_seqs:,}" if batch == s.max_num_seqs else
                 f"as many sequences of {isl + osl:,} tokens as the KV pool holds, under max_num_seqs "
                 f"{s.max_num_seqs:,}")
        praw.update(phase="decode", batch=batch, seq_len=context)
        out.append(RepresentativeStep(ps.role, praw, (
            f"{pool}: a decode-only step, {batch:,} sequence{'s' if batch > 1 else ''} at {context:,} tokens of "
            f"context, {bound}; {source}")))
    return out
