"""The request-level event loop: arrivals, routing, steps of every instance, KV transfers.

This loop is its own small discrete-event simulation, one level above the op-level
``Engine.run``: its events are a request arriving, a step of an instance ending, and a
prompt's KV arriving at a decode instance. A step's latency comes from the pool's step
cost (:mod:`g5core.serve.cost`); an instance starts its next step as soon as one ends and
it has work. Ties in time are broken by the order the events were made, so the same input
gives the same output, bit for bit.
"""
from __future__ import annotations

import heapq
import math
import time
from array import array
from typing import Callable, Optional, Sequence

import attrs

from g5core.api.errors import G5Error
from g5core.serve.cost import StepWork
from g5core.serve.scheduler import SchedulerSettings, Seq, VllmScheduler
from g5core.serve.workload import Workload

ARRIVAL, STEP_END, ENQUEUE = 0, 1, 2


@attrs.define(eq=False)
class Pool:
    """``instances`` copies of one layout. ``role``: ``serve`` (prefill and decode),
    ``prefill`` (hands each prompt's KV to the decode pool) or ``decode``."""

    role: str
    instances: int
    cost: object                         # a StepCost
    scheduler: SchedulerSettings
    total_blocks: int
    router: object                       # choose(request, instances) -> index
    scheduler_factory: Callable = VllmScheduler
    first_chip: int = 0                  # chips of instance i: first_chip + i * cost.chips ...

    @property
    def chips(self) -> int:
        return self.instances * self.cost.chips


@attrs.define(eq=False)
class Deployment:
    """What ``simulate_serving`` runs: one pool (aggregated) or a prefill and a decode pool.
    ``transfer_s(tokens, prefill_instance, decode_instance)``: the KV move of a prompt."""

    pools: tuple[Pool, ...]
    routing_s: float = 0.0
    transfer_s: Optional[Callable[[int, int, int], float]] = None
    transfer_bytes: Optional[Callable[[int], float]] = None

    @property
    def chips(self) -> int:
        return sum(p.chips for p in self.pools)

    @property
    def disaggregated(self) -> bool:
        return len(self.pools) == 2


class Instance:
    __slots__ = ("pool", "index", "scheduler", "busy", "picked", "work", "step_start_s", "steps", "itl_s")

    def __init__(self, pool: Pool, index: int):
        self.pool, self.index = pool, index
        self.scheduler = pool.scheduler_factory(pool.scheduler, pool.total_blocks)
        self.busy = False
        self.picked: list = []
        self.work = None
        self.step_start_s = 0.0
        # one row per step: start_s, end_s, prefill tokens, decodes, used blocks, running, waiting
        self.steps = array("d")
        self.itl_s = array("d")   # the gaps between the tokens it emitted, in order (the log joins them)


@attrs.define(eq=False)
class RequestLog:
    """Per request (index = position in the workload): the times the loop saw."""

    n: int
    arrival_s: array = attrs.field(init=False)
    scheduled_s: array = attrs.field(init=False)
    first_token_s: array = attrs.field(init=False)
    finish_s: array = attrs.field(init=False)
    max_itl_s: array = attrs.field(init=False)
    instance: array = attrs.field(init=False)
    decode_instance: array = attrs.field(init=False)
    emitted: array = attrs.field(init=False)
    transfer_s: array = attrs.field(init=False)
    last_token_s: array = attrs.field(init=False)
    itl_s: array = attrs.field(factory=lambda: array("d"))

    def __attrs_post_init__(self):
        nan = float("nan")
        for name in ("arrival_s", "scheduled_s", "first_token_s", "finish_s", "max_itl_s", "transfer_s",
                     "last_token_s"):
            setattr(self, name, array("d", [nan]) * self.n)
        for name in ("instance", "decode_instance", "emitted"):
            setattr(self, name, array("q", [-1 if name != "emitted" else 0]) * self.n)


@attrs.define(eq=False)
class LoopResult:
    workload: Workload
    deployment: Deployment
    requests: RequestLog
    instances: list
    makespan_s: float
    preemptions: int
    sim_wall_s: float
    steps: int
    requests_time_s: float = 0.0   # integral over time of the requests in the system


def simulate(dep: Deployment, workload: Workload, progress: Optional[Callable[[int, int], None]] = None,
             fast: bool = True) -> LoopResult:
    """Run every request of ``workload`` through ``dep`` to completion. ``fast``: run the
    stretches of decode-only steps that nothing else can see in one go (:func:`_decode_run`;
    the same steps, latencies and tokens as one event per step)."""
    t_wall = time.perf_counter()
    reqs = workload.requests
    n = len(reqs)
    log = RequestLog(n)
    pools = [[Instance(p, i) for i in range(p.instances)] for p in dep.pools]
    first, last = pools[0], pools[-1]
    split = dep.disaggregated
    heap: list = []
    order = 0
    # the times of the pending events that can change an instance or read its state (an
    # arrival: the router reads the instances and the request joins one; a request or a
    # prompt's KV reaching an instance; a prefill step's end: it routes to the decode pool);
    # a run of decode steps stops before the first of them. Closed workloads: every finish
    # makes an arrival, so no run (fast is off)
    fast = fast and not workload.closed
    arrivals = sorted(r.arrival_s for r in reqs) if fast else []
    arrived = 0
    watch: list = []

    def push(t, kind, a, b=None):
        nonlocal order
        heapq.heappush(heap, (t, order, kind, a, b))
        order += 1
        if fast and (kind == ENQUEUE or (kind == STEP_END and split and a.pool.role == "prefill")):
            heapq.heappush(watch, t)

    def horizon(now: float) -> float:
        while watch and watch[0] < now:
            heapq.heappop(watch)
        h = watch[0] if watch else math.inf
        return min(h, arrivals[arrived]) if arrived < n else h

    next_closed = 0
    if workload.closed:
        for k in range(min(workload.concurrency, n)):
            push(0.0, ARRIVAL, k)
        next_closed = min(workload.concurrency, n)
    else:
        for k, r in enumerate(reqs):
            push(r.arrival_s, ARRIVAL, k)

    scheduled_s, first_token_s, finish_s = log.scheduled_s, log.first_token_s, log.finish_s
    max_itl_s, last_token_s = log.max_itl_s, log.last_token_s

    def start(inst: Instance, now: float) -> None:
        nonlocal steps
        sched = inst.scheduler
        if fast and type(sched) is VllmScheduler and sched.running and inst.pool.role != "prefill":
            ran, now = _decode_run(inst, now, horizon(now))
            steps += ran
        picked = sched.schedule()
        if not picked:
            if sched.running or sched.waiting:
                raise G5Error(f"{inst.pool.role} instance {inst.index}: no sequence can be scheduled (a request needs "
                              "more KV blocks than the pool has); raise the KV pool or lower the lengths")
            return
        for q in picked:
            if q.admitted_s is None:
                q.admitted_s = now
                k = q.req.id
                if scheduled_s[k] != scheduled_s[k]:
                    scheduled_s[k] = now
        work = sched.work(picked)
        latency = inst.pool.cost.latency_s(work)
        inst.busy, inst.picked, inst.work, inst.step_start_s = True, picked, work, now
        push(now + latency, STEP_END, inst)

    done = 0
    steps = 0
    now = 0.0
    # Little's law, counted independently of the log (at each change of the requests in the
    # system: arrivals and finishes)
    in_system, area, t_last = 0, 0.0, 0.0
    while heap:
        now, _, kind, a, b = heapq.heappop(heap)
        if kind == ARRIVAL:
            area += in_system * (now - t_last)
            t_last = now
            in_system += 1
            arrived += 1
            req = reqs[a]
            log.arrival_s[a] = now if workload.closed else req.arrival_s
            pool = first[0].pool
            i = pool.router.choose(req, first)
            log.instance[a] = i
            if dep.routing_s:
                push(now + dep.routing_s, ENQUEUE, Seq(req), first[i])
                continue
            kind, a, b = ENQUEUE, Seq(req), first[i]
        if kind == ENQUEUE:  # a request (or a prompt's KV) reaches its instance
            b.scheduler.add(a)
            if not b.busy:
                start(b, now)
            continue
        inst = a
        sched = inst.scheduler
        steps += 1
        work = inst.work
        decodes = len(work.decode_contexts)
        inst.steps.extend((inst.step_start_s, now, work.new_tokens - decodes, decodes, 0, 0, 0))
        prefill_pool = split and inst.pool.role == "prefill"
        itl_append = inst.itl_s.append
        for q in sched.finish_step(inst.picked):
            k = q.req.id
            if q.last_s is None:          # its first token
                first_token_s[k] = now
                q.last_s = now
            else:
                gap = now - q.last_s
                itl_append(gap)
                if gap > q.max_itl_s:
                    q.max_itl_s = gap
                q.last_s = now
            if q.emitted >= q.req.output_tokens:
                sched.release(q)
                finish_s[k] = now
                last_token_s[k] = now
                max_itl_s[k] = q.max_itl_s if q.emitted > 1 else float("nan")
                log.emitted[k] = q.emitted
                area += in_system * (now - t_last)
                t_last = now
                in_system -= 1
                done += 1
                if progress is not None and (done % 256 == 0 or done == n):
                    progress(done, n)
                if workload.closed and next_closed < n:
                    push(now, ARRIVAL, next_closed)
                    next_closed += 1
            elif prefill_pool and q.emitted == 1:
                sched.release(q)
                j = last[0].pool.router.choose(q.req, last)
                log.decode_instance[k] = j
                move = dep.transfer_s(q.req.input_tokens, inst.index, j)
                log.transfer_s[k] = move
                # the first token reaches the user with the KV: TTFT includes the transfer
                first_token_s[k] = now + move
                moved = Seq(q.req, computed=q.computed, emitted=q.emitted)
                moved.last_s = now + move
                push(now + move, ENQUEUE, moved, last[j])
        row = len(inst.steps) - 7
        inst.steps[row + 4] = sched.used_blocks
        inst.steps[row + 5] = len(sched.running)
        inst.steps[row + 6] = len(sched.waiting)
        inst.busy = False
        if sched.has_work:
            start(inst, now)
    instances = [i for p in pools for i in p]
    for inst in instances:
        log.itl_s.extend(inst.itl_s)
    if done != n:
        raise G5Error(f"serving loop ended with {n - done:,} of {n:,} requests unfinished (a G5 bug)")
    return LoopResult(workload, dep, log, instances, now, sum(i.scheduler.preemptions for i in instances),
                      time.perf_counter() - t_wall, steps, area)


#: a run of decode steps shorter than this goes step by step (the run's set-up costs more)
MIN_RUN_STEPS = 2


def _decode_run(inst: Instance, now: float, horizon: float) -> tuple[int, float]:
    """Run the instance's next decode-only steps at once, while nothing else can tell: every
    running sequence decodes one token a step (none is prefilling, none finishes, none is
    preempted, nothing is admitted: the queue is empty or the batch is full) and each step
    ends before ``horizon`` (the next event that can touch or read the instance). Each
    step is the one :meth:`VllmScheduler.schedule` would build (its latency from the pool's
    cost, its KV blocks, its row in ``inst.steps``, every inter-token gap), so the result is
    the step-by-step one. Returns ``(steps run, when the next step starts)``."""
    sched = inst.scheduler
    s = sched.s
    running = sched.running
    b = len(running)
    if b > s.max_num_batched_tokens or (sched.waiting and b < s.max_num_seqs):
        return 0, now
    bs = s.block_size
    left = 1 << 62
    contexts = []
    residues = [0] * bs
    for q in running:
        c = q.computed
        if q.num_tokens - c != 1 or q.last_s is None or q.scheduled or q.blocks != sched._blocks_for(c):
            return 0, now
        contexts.append(c)
        residues[c % bs] += 1
        r = q.req.output_tokens - q.emitted
        if r < left:
            left = r
    limit = left - 1              # the step in which a sequence finishes goes the usual way
    if limit < MIN_RUN_STEPS:
        return 0, now
    contexts.sort()
    cost = inst.pool.cost
    decode_s = getattr(cost, "decode_latency_s", None)
    if decode_s is None:
        def decode_s(contexts, j, total, latency_s=cost.latency_s):
            return latency_s(StepWork((), tuple(c + j for c in contexts)))
    contexts = tuple(contexts)
    total = sum(contexts)
    free = sched.free_blocks
    used = sched.used_blocks
    waiting = len(sched.waiting)
    rows = inst.steps
    itl_extend = inst.itl_s.extend
    t = now
    need = taken = 0
    ends = []
    for j in range(limit):
        # a sequence whose tokens fill whole blocks takes a new one (its context c + j)
        need += residues[-j % bs]
        if need > free:
            break
        end = t + decode_s(contexts, j, total + j * b)
        if end >= horizon:
            break
        rows.extend((t, end, 0, b, used + need, b, waiting))
        ends.append(end)
        taken = need
        t = end
    k = len(ends)
    if not k:
        return 0, now
    # the gaps: each sequence's first (from its last token), then one per step for all
    gaps = [ends[0] - q.last_s for q in running]
    itl_extend(array("d", gaps))
    prev = ends[0]
    worst = 0.0
    for end in ends[1:]:
        gap = end - prev
        if gap > worst:
            worst = gap
        itl_extend(array("d", (gap,)) * b)
        prev = end
    for q, gap in zip(running, gaps):
        q.computed += k
        q.num_tokens += k
        q.emitted += k
        q.blocks = sched._blocks_for(q.computed)
        q.last_s = t
        top = gap if gap > worst else worst
        if top > q.max_itl_s:
            q.max_itl_s = top
    sched.free_blocks = free - taken
    return k, t


def check_conservation(result: LoopResult) -> dict:
    """The loop's invariants (each must be 0): every request finished once with all its
    tokens, none before it arrived, KV blocks within the pool and all returned."""
    log, reqs = result.requests, result.workload.requests
    bad_tokens = sum(1 for k, r in enumerate(reqs) if log.emitted[k] != r.output_tokens)
    early = sum(1 for k in range(log.n) if not (log.arrival_s[k] <= log.scheduled_s[k] <= log.first_token_s[k]
                                                <= log.finish_s[k]))
    over = sum(1 for inst in result.instances for row in range(0, len(inst.steps), 7)
               if inst.steps[row + 4] > inst.scheduler.total_blocks)
    left = sum(i.scheduler.used_blocks for i in result.instances)
    return {"requests_with_wrong_token_count": bad_tokens, "requests_out_of_order": early,
            "steps_over_kv_pool": over, "kv_blocks_left_at_end": left}


def summarize_pools(pools: Sequence[Pool]) -> list[dict]:
    return [{"role": p.role, "instances": p.instances, "chips_per_instance": p.cost.chips,
             "kv_blocks_per_instance": p.total_blocks, "block_size": p.scheduler.block_size} for p in pools]
