"""The request-level event loop: arrivals, routing, steps of every instance, KV transfers.

This loop is its own small discrete-event simulation, one level above the op-level
``Engine.run``: its events are a request arriving, a step of an instance ending, and a
prompt's KV arriving at a decode instance. A step's latency comes from the pool's step
cost (:mod:`g5core.serve.cost`); an instance starts its next step as soon as one ends and
it has work. Ties in time are broken by the order the events were made, so the same input
gives the same output, bit for bit.
"""
from __future__ import annotations

import bisect
import enum
import heapq
import math
import time
from array import array
from typing import Callable, Optional, Sequence

import attrs

from g5core.api.errors import G5Error
from g5core.inputs.serving import SloLimit
from g5core.serve.cost import DpCost, JoinedStep, PlanCost, RankedWork, StepWork
from g5core.serve.router import RoundRobin
from g5core.serve.scheduler import DpScheduler, SchedulerSettings, Seq, VllmScheduler
from g5core.serve.workload import Workload
from g5core.sim.heap import gc_paused



class Event(enum.IntEnum):
    """The loop's events: a request arriving, an instance's step ending, a request or a
    prompt's KV reaching an instance."""

    ARRIVAL = 0
    STEP_END = 1
    ENQUEUE = 2
    RESUME = 3      # the end of a run of decode steps whose last step an arrival fell in or finished sequences


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
class Fleet:
    """What a :class:`ServingLoop` runs: one pool (aggregated) or a prefill and a decode pool.
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
    __slots__ = ("pool", "index", "scheduler", "busy", "picked", "work", "step_start_s", "steps", "itl_s", "dec",
                 "lazy", "lazy_step", "lazy_admitted")

    def __init__(self, pool: Pool, index: int, lazy: bool = False, gaps: bool = True):
        self.pool, self.index = pool, index
        # the decoding sequences' state kept across runs of decode steps (a _DecodeState)
        # while nothing but those runs and the finishes at their ends touches them; ``lazy``:
        # the instance may keep one (its pool's router reads no scheduler state)
        self.dec: Optional[_DecodeState] = None
        self.lazy = lazy
        # the step in flight was built on ``dec`` (ServingLoop._lazy_step): its decodes are
        # not in ``picked``, they advance in the state
        self.lazy_step = False
        self.lazy_admitted: Optional[list] = None      # what each scheduler admitted into it
        self.scheduler = pool.scheduler_factory(pool.scheduler, pool.total_blocks)
        self.busy = False
        self.picked: list = []
        self.work = None
        self.step_start_s = 0.0
        # one row per step: start_s, end_s, prefill tokens, decodes, used blocks, running, waiting
        self.steps = array("d")
        # the gaps between the tokens it emitted, in order (the log joins them); None where the
        # run keeps none (``gaps``: ServingLoop's)
        self.itl_s: Optional[array] = array("d") if gaps else None


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
    fleet: Fleet
    requests: RequestLog
    instances: list
    makespan_s: float
    preemptions: int
    sim_wall_s: float
    steps: int
    requests_time_s: float = 0.0   # integral over time of the requests in the system


#: a value counts as over its limit when above ``limit x (1 + MISS_MARGIN)``: the run's
#: percentile (numpy's interpolation) can come out an ulp below the order statistic that
#: bounds it, and a run stopped on a sure miss must be one the whole run misses
MISS_MARGIN = 1e-9


class MissWatch:
    """Tells, while a run goes on, when its SLO verdict (:func:`g5core.serve.metrics.goodput`)
    is sure to be ``missed``: a capacity search's failing runs need not run to their end.

    For a limit on percentile ``p`` over ``m`` values (every request for TTFT, queueing and
    end to end; those of more than one output token for TPOT), numpy's linear percentile is
    at least the sorted values' element ``floor(p / 100 (m - 1))``, so it is over the limit
    once ``m - floor(p / 100 (m - 1))`` values are; a limit on every request is missed at
    its first value over. A value counts when it is known: a request's queueing at its
    first step, its TTFT at its first token (disaggregated: when its KV will reach the
    decode pool), TPOT and end to end when it finishes; and, for open workloads, a request
    that arrived more than the limit ago without its first step, first token or last
    token is over already (however few are recorded over, at least ``arrived before now -
    limit`` less every value recorded within the limit are). ``itl`` limits are not
    watched (a run with one runs to its end). Exact: a run is stopped only when the whole
    run would miss."""

    __slots__ = ("checks", "sure", "arrivals", "limit")

    #: the metrics watched, and what the loop records them at
    METRICS = ("queue", "ttft", "tpot", "e2e")

    def __init__(self, limits: Sequence[SloLimit], requests: Sequence, closed: bool = False):
        n = len(requests)
        multi = sum(1 for r in requests if r.output_tokens > 1)
        self.arrivals = None if closed else sorted(r.arrival_s for r in requests)
        self.checks: dict = {}
        for lim in limits:
            if lim.metric not in self.METRICS:
                continue
            m = multi if lim.metric == "tpot" else n
            if not m:
                continue
            need = 1 if lim.percentile is None else m - math.floor(lim.percentile / 100 * (m - 1))
            # [threshold, values needed over it, recorded over, recorded within, arrivals passed, key]
            self.checks.setdefault(lim.metric, []).append([lim.limit_s * (1 + MISS_MARGIN), need, 0, 0, 0, lim.key])
        self.sure = False
        self.limit: Optional[str] = None     # the limit whose miss became sure first

    @classmethod
    def of(cls, limits: Sequence[SloLimit], workload: Workload) -> Optional["MissWatch"]:
        """A watch for ``limits`` on ``workload``; ``None`` when none of them is watched."""
        watch = cls(limits, workload.requests, workload.closed)
        return watch if watch.checks else None

    def see(self, metric: str, value_s: float) -> None:
        """A request's ``metric`` became known."""
        for c in self.checks.get(metric, ()):
            if value_s > c[0]:
                c[2] += 1
                if c[2] >= c[1] and not self.sure:
                    self.sure, self.limit = True, c[5]
            else:
                c[3] += 1

    #: the metrics :meth:`at` watches (a disaggregated run's prefill pass: those its pool records)
    TIMED = ("queue", "ttft", "e2e")

    def at(self, now: float, metrics: Sequence[str] = TIMED) -> None:
        """Time passed to ``now``: the requests that waited longer than a limit count (for
        ``metrics``: a value not recorded yet can be recorded later)."""
        arrivals = self.arrivals
        if arrivals is None:
            return
        n = len(arrivals)
        for metric in metrics:
            for c in self.checks.get(metric, ()):
                k, before = c[4], now - c[0]
                while k < n and arrivals[k] < before:
                    k += 1
                c[4] = k
                if k - c[3] >= c[1] and not self.sure:
                    self.sure, self.limit = True, c[5]


#: what a two-pass run's prefill pass records of the watched metrics (:meth:`MissWatch.at`):
#: a request's end to end is recorded in the decode pass
PREFILL_TIMED = ("queue", "ttft")


class Missed(Exception):
    """Raised inside a :class:`ServingLoop` whose :class:`MissWatch` is sure of a miss."""


class ServingLoop:
    """The request-level discrete-event simulation of ``fleet`` serving ``workload``, in
    SimPy's shape: :meth:`step` processes the next event, :meth:`run` processes events up to
    a time (or to the end) and returns the :class:`LoopResult` once every request finished.

    Its events (:class:`Event`) are a request arriving (the router picks an instance), a
    request or a prompt's KV reaching an instance (``ENQUEUE``), and an instance's step
    ending (its sequences advance; finished ones leave; in a disaggregated fleet a prompt's
    KV moves to the decode pool). An instance starts its next step as soon as one ends and it
    has work. Ties in time are broken by the order the events were made.

    ``fast``: run the stretches of steps that nothing else can see in one go (decode-only
    steps, and a prompt's budget-filling chunks beside them, :func:`_decode_run`; an
    attention-DP instance's decode steps, :func:`_dp_decode_run`): the same steps, latencies
    and tokens as one event per step.

    ``miss`` (a :class:`MissWatch`): :meth:`run` stops as soon as the run's SLO verdict is
    sure to be missed (``missed`` is then true, and :meth:`run` returns ``None``).

    :meth:`run` to the end of a disaggregated fleet whose decode pool is round robin
    (``two_pass``) serves every prompt first, then every decode: the prefill pool never reads
    the decode pool, so the same steps, bit for bit (the requests-in-system integral is
    replayed in time order afterwards), and a run whose TTFT verdict is sure to miss stops
    before any decode step. :meth:`step` and :meth:`run` to a time keep one pass in time order."""

    def __init__(self, fleet: Fleet, workload: Workload, progress: Optional[Callable[[int, int], None]] = None,
                 fast: bool = True, miss: Optional[MissWatch] = None, gaps: bool = True):
        self._t_wall = time.perf_counter()
        self.fleet, self.workload, self.progress = fleet, workload, progress
        reqs = self.requests = workload.requests
        n = self.n = len(reqs)
        self.log = RequestLog(n)
        # an instance keeps its decoding sequences' state across runs (_DecodeState) only where
        # no router reads a scheduler's state between them (round robin)
        # ``gaps``: every inter-token gap kept (the log's itl_s); without, only each request's
        # largest (max_itl_s) and the figures that do not read them (the serving search's runs)
        self.pools = [[Instance(p, i, fast and type(p.router) is RoundRobin, gaps) for i in range(p.instances)]
                      for p in fleet.pools]
        self.split = fleet.disaggregated
        self.heap: list = []
        self.order = 0
        # the times of the pending events that can change an instance or read its state (an
        # arrival: the router reads the instances and the request joins one; a request or a
        # prompt's KV reaching an instance; a prefill step's end: it routes to the decode
        # pool); a run of decode steps stops before the first of them. Closed workloads: every
        # finish makes an arrival, so no run (fast is off)
        self.fast = fast and not workload.closed
        self.arrivals = sorted(r.arrival_s for r in reqs) if self.fast else []
        self.arrived = 0
        # a round-robin first pool of an aggregated fleet: the j-th arrival goes to instance
        # (offset + j) % instances whatever the instances' state, so only the arrivals bound
        # for an instance can touch it (its runs of decode steps go past the others'). A
        # disaggregated fleet keeps every arrival: it may start a prefill whose KV reaches
        # any decode instance
        first = fleet.pools[0]
        self.rr = (None if not self.fast or self.split or type(first.router) is not RoundRobin
                   or first.instances == 1 else (first.router.next, first.instances))
        # a disaggregated fleet whose decode pool is round robin: nothing reads a decode
        # instance's state (the prefill pool routes KV to them in turn), so every event only
        # joins a decode instance's queue or makes later events (a prompt's KV arriving): a
        # run of decode steps takes the step the next event falls in, and stops there
        self.soft_decode = self.fast and self.split and type(fleet.pools[-1].router) is RoundRobin
        # a disaggregated fleet's prefill instance (requests reach it as they arrive): only
        # arrivals touch it (a KV moving to the decode pool, another instance's step, do not);
        # under round robin only its own, and those only join its queue. With a routing
        # delay a request reaches it later, as a watched event: the default horizon
        self.prefill_arrivals = None
        if self.fast and self.split and not fleet.routing_s:
            self.prefill_arrivals = ((first.router.next, first.instances) if type(first.router) is RoundRobin
                                     else "any")
        # a disaggregated fleet whose decode pool is round robin: its prefill pool never reads
        # the decode pool (no back-pressure; the router's turns follow the prompts' ends), so
        # :meth:`run` serves every prompt first (the prefill pass; each KV's arrival at its
        # decode instance kept in ``deferred``), then the decodes with every arrival known
        # (their runs stop only at KV arrivals and finishes): the same steps. ``phase``: 0
        # one pass (time order), 1 the prefill pass, 2 the decode pass
        self.two_pass = self.soft_decode and not fleet.routing_s
        self.phase = 0
        self.deferred: list = []
        self.watch: list = []
        self.done = self.steps = 0
        self.now = 0.0
        # Little's law, counted independently of the log (at each change of the requests in
        # the system: arrivals and finishes)
        self.in_system, self.area, self.t_last = 0, 0.0, 0.0
        self.next_closed = 0
        if workload.closed:
            for k in range(min(workload.concurrency, n)):
                self._push(0.0, Event.ARRIVAL, k)
            self.next_closed = min(workload.concurrency, n)
        else:
            for k, r in enumerate(reqs):
                self._push(r.arrival_s, Event.ARRIVAL, k)
        self._result: Optional[LoopResult] = None
        self.miss = miss
        self.missed = False

    # -- the event queue -------------------------------------------------------------------
    def _push(self, t: float, kind: int, a, b=None) -> None:
        heapq.heappush(self.heap, (t, self.order, kind, a, b))
        self.order += 1
        if self.fast and (kind == Event.ENQUEUE or ((kind == Event.STEP_END or kind == Event.RESUME) and self.split
                                                    and a.pool.role == "prefill")):
            heapq.heappush(self.watch, t)

    def _horizon(self, now: float, inst: Instance) -> tuple[float, float]:
        """``(hard, soft)``: the time of the next event that can read ``inst``'s state or
        change it (see ``watch``), and of the next that only joins its queue or makes later
        events (its own next arrival under round robin, ``rr``; any next event for a decode
        instance under ``soft_decode``; else ``inf``; a disaggregated prefill instance's are
        the arrivals alone, ``prefill_arrivals``): a run of decode steps ends before
        ``hard`` and may run the step ``soft`` falls in (an arrival during a step changes
        nothing of that step)."""
        watch = self.watch
        while watch and watch[0] < now:
            heapq.heappop(watch)
        h = watch[0] if watch else math.inf
        j = self.arrived
        if self.prefill_arrivals is not None and inst.pool is self.fleet.pools[0]:
            if self.prefill_arrivals == "any":
                return (self.arrivals[j] if j < self.n else math.inf), math.inf
            return math.inf, self._own_arrival(inst, self.prefill_arrivals)
        if self.soft_decode and inst.pool is self.fleet.pools[-1]:
            return math.inf, (min(h, self.arrivals[j]) if j < self.n else h)
        if self.rr is None:
            return (min(h, self.arrivals[j]) if j < self.n else h), math.inf
        return h, self._own_arrival(inst, self.rr)

    def _own_arrival(self, inst: Instance, turn: tuple) -> float:
        """The time of the next arrival a round robin ``turn`` (``(its first instance, the
        instances)``) sends to ``inst`` (``inf``: none is left)."""
        offset, count = turn
        j = self.arrived
        j += (inst.index - offset - j) % count
        return self.arrivals[j] if j < self.n else math.inf

    def peek(self) -> float:
        """The time of the next event (``inf`` when none is left)."""
        return self.heap[0][0] if self.heap else math.inf

    # -- stepping --------------------------------------------------------------------------
    def step(self) -> tuple[float, Event]:
        """Process the next event; returns its time and kind. Raises IndexError when no
        event is left."""
        try:
            return self._step()
        finally:
            self._settle()

    def _settle(self) -> None:
        """Every instance's sequences brought up to date (:func:`_materialize`): what a
        caller between events reads of the schedulers is what one event per step gives."""
        for insts in self.pools:
            for inst in insts:
                if inst.dec is not None:
                    _materialize(inst)

    def _step(self) -> tuple[float, Event]:
        now, _, kind, a, b = heapq.heappop(self.heap)
        self.now = now
        if kind == Event.ARRIVAL:
            self._arrive(now, a)
        elif kind == Event.ENQUEUE:
            self._enqueue(now, a, b)
        elif kind == Event.STEP_END:
            self._step_end(now, a)
        else:
            self._resume(now, a)
        return now, Event(kind)

    def run(self, until: float = math.inf) -> Optional[LoopResult]:
        """Process every event at or before ``until``; the result once the workload is done
        (``None`` while events are left, or once a :class:`MissWatch` was sure of a miss).
        The cyclic garbage collector is off meanwhile (:func:`g5core.sim.heap.gc_paused`):
        the run's requests, sequences and records live to its end."""
        with gc_paused():
            return self._run(until)

    def _run(self, until: float) -> Optional[LoopResult]:
        heap, step = self.heap, self._step
        if self.missed:
            return None
        two = self.two_pass and until == math.inf and self.phase == 0 and self.order == self.n
        try:
            if two:
                self.phase = 1
            while heap and heap[0][0] <= until:
                step()
            if two:
                self._decode_pass()
                while heap:
                    step()
        except Missed:
            self.missed = True
            return None
        finally:
            self._settle()
        if two:
            self._replay_area()
        return None if heap else self.result()

    def _decode_pass(self) -> None:
        """After the prefill pass: every prompt's KV reaches its decode instance, as the
        prefill pass made them (in that order)."""
        self.phase, self.t_prefill_end = 2, self.now
        for t, seq, inst in self.deferred:
            self._push(t, Event.ENQUEUE, seq, inst)
        self.deferred = []

    def _replay_area(self) -> None:
        """The requests-in-system integral of a two-pass run, in time order as one pass makes
        it (``area += in_system * dt`` at each arrival and finish: ties add nothing)."""
        log = self.log
        marks = sorted([(t, 1) for t in log.arrival_s] + [(t, -1) for t in log.finish_s], key=lambda m: m[0])
        area, last, inside = 0.0, 0.0, 0
        for t, d in marks:
            area += inside * (t - last)
            last = t
            inside += d
        self.area, self.t_last, self.in_system = area, last, inside
        self.now = max(self.now, self.t_prefill_end)

    def result(self) -> LoopResult:
        if self._result is None:
            if self.heap:
                raise G5Error("the serving loop has events left: run it to the end first")
            instances = [i for p in self.pools for i in p]
            log = self.log
            for inst in instances:
                if inst.itl_s is not None:
                    log.itl_s.extend(inst.itl_s)
            if self.done != self.n:
                raise G5Error(f"serving loop ended with {self.n - self.done:,} of {self.n:,} requests unfinished "
                              "(a G5 bug)")
            self._result = LoopResult(self.workload, self.fleet, log, instances, self.now,
                                      sum(i.scheduler.preemptions for i in instances),
                                      time.perf_counter() - self._t_wall, self.steps, self.area)
        return self._result

    # -- the events ------------------------------------------------------------------------
    def _arrive(self, now: float, k: int) -> None:
        """A request arrives: the router of the first pool picks its instance."""
        if not self.phase:
            self.area += self.in_system * (now - self.t_last)
            self.t_last = now
            self.in_system += 1
        self.arrived += 1
        req = self.requests[k]
        log = self.log
        log.arrival_s[k] = now if self.workload.closed else req.arrival_s
        first = self.pools[0]
        i = first[0].pool.router.choose(req, first)
        log.instance[k] = i
        if self.fleet.routing_s:
            self._push(now + self.fleet.routing_s, Event.ENQUEUE, Seq(req), first[i])
        else:
            self._enqueue(now, Seq(req), first[i])

    def _enqueue(self, now: float, seq: Seq, inst: Instance) -> None:
        """A request (or a prompt's KV) reaches its instance."""
        inst.scheduler.add(seq)
        if not inst.busy:
            self._start(inst, now)

    def _start(self, inst: Instance, now: float) -> None:
        """The instance's next step: a run of decode steps first where nothing can see it."""
        sched = inst.scheduler
        kind = type(sched) if self.fast else None
        if (kind is VllmScheduler and sched.running) or (kind is DpScheduler and sched.has_work):
            run = _decode_run if kind is VllmScheduler else _dp_decode_run
            ran, now, crossed = run(inst, now, *self._horizon(now, inst))
            self.steps += ran
            if crossed:     # an arrival fell in its last step, or sequences finished in it
                inst.busy = True
                self._push(now, Event.RESUME, inst)
                return
        if inst.dec is not None:
            if self._lazy_step(inst, now):
                return
            _materialize(inst)      # the scheduler reads every sequence
        io = getattr(sched, "io", False)   # a plugin's scheduler may not say
        if io:
            sched.now = now
        picked = sched.schedule()
        if not picked:
            if sched.running or sched.waiting:
                raise G5Error(f"{inst.pool.role} instance {inst.index}: no sequence can be scheduled (a request needs "
                              "more KV blocks than the pool has); raise the KV pool or lower the lengths")
            return
        self._admitted(now, picked)
        work = sched.work(picked)
        latency = inst.pool.cost.latency_s(work)
        if io:      # a caching scheduler's step waits for the KV it loads from a lower tier
            latency = sched.step_latency_s(now, latency, picked)
        inst.busy, inst.picked, inst.work, inst.step_start_s = True, picked, work, now
        self._push(now + latency, Event.STEP_END, inst)

    def _admitted(self, now: float, picked: list) -> None:
        """The sequences of a step starting at ``now`` that it admitted: their first step."""
        scheduled_s = self.log.scheduled_s
        for q in picked:
            if q.admitted_s is None:
                q.admitted_s = now
                k = q.req.id
                if scheduled_s[k] != scheduled_s[k]:
                    scheduled_s[k] = now
                    if self.miss is not None:
                        self.miss.see("queue", now - self.log.arrival_s[k])

    def _lazy_step(self, inst: Instance, now: float) -> bool:
        """The instance's next step built on its :class:`_DecodeState` where every running
        sequence decodes in it (its KV blocks fit: no preemption) beside what each scheduler
        (each attention-DP rank) admits (:meth:`VllmScheduler.admit`): the step
        :meth:`VllmScheduler.schedule` (:meth:`DpScheduler.schedule`) builds, its decodes
        left in the state. False (nothing done) where it cannot."""
        st, sched = inst.dec, inst.scheduler
        scheds = _schedulers(sched)
        if st.t != now or any(type(r) is not VllmScheduler for r in scheds):
            return False
        s = sched.s
        apart = not s.mixed_prefill     # admissions beside the decodes: only decoding ones (schedule's)
        budget, bs, k = s.max_num_batched_tokens, s.block_size, st.shift
        needs = []
        tails = []      # a prompt still prefilling after the state's decodes (one scheduler): its tokens and blocks
        for r, part in zip(scheds, st.parts):
            b = len(part.base)
            extra = len(r.running) - b
            if extra < 0 or extra > (len(scheds) == 1) or b >= budget:
                return False
            if apart and (extra or (r.waiting and len(r.running) < s.max_num_seqs
                                    and not r._decoding(r.waiting[0]) and r.may_admit(budget))):
                return False    # a prefill step of its own (a rank's, with attention DP): schedule's
            need = part.rbase[-k % bs] if b else 0
            tail = None
            if extra:       # as VllmScheduler.schedule gives it its tokens after the decodes'
                q = r.running[b]
                n = min(q.num_tokens - q.computed, budget - b)
                if 0 < s.long_prefill_token_threshold < n:
                    n = s.long_prefill_token_threshold
                tail = (q, n, -(-(q.computed + n) // bs) - q.blocks)
                need += tail[2]
            if need > r.free_blocks:
                return False
            needs.append(need)
            tails.append(tail)
        admitted: list = []     # per scheduler
        works: list = []        # per scheduler: its work (a JoinedStep on the predictor), None where it only decodes
        # an attention-DP instance's ranks that admit nothing are priced from their part
        # (PlanCost.decode_step_s), their works not built (DpCost.latency_of), unless every
        # rank's work might be alike (_alike: DpCost.latency_s prices that case otherwise)
        dp_cost = inst.pool.cost if len(scheds) > 1 and type(inst.pool.cost) is DpCost else None
        # one scheduler on the engine's predictor: the step is priced from the state's counts
        # and what joins it (PlanCost.joined_step_s), not built
        plan_cost = inst.pool.cost if len(scheds) == 1 and type(inst.pool.cost) is PlanCost else None
        latency = None
        for r, part, need, tail in zip(scheds, st.parts, needs, tails):
            r.free_blocks -= need
            mine: list = []
            left = budget - len(part.base)
            if tail is not None:
                q, n, blocks = tail
                q.blocks += blocks
                q.scheduled = n
                left -= n
                mine.append(q)
            r.admit(left, mine, True if apart else None)
            self._admitted(now, mine)
            admitted.append(mine)
            if dp_cost is not None and not mine:
                works.append(None)
                continue
            joined = []
            chunks = []
            for q in mine:          # as VllmScheduler.work
                if q.scheduled == 1 and q.computed > 0:
                    joined.append(q.computed)
                else:
                    chunks.append((q.scheduled, q.computed))
            if plan_cost is not None or dp_cost is not None:
                # priced from its counts (here, or by _rank_figures) unless built for latency_s
                b = len(part.base)
                rank_work = JoinedStep(tuple(chunks), part.base, k, part.sum_base + k * b, tuple(joined))
                if plan_cost is not None and rank_work.new_tokens:
                    latency = plan_cost.joined_step_s(rank_work)
                works.append(rank_work)
                continue
            contexts = [c + k for c in part.base] + joined
            if joined:
                contexts.sort()
            works.append(StepWork(tuple(chunks), tuple(contexts)))
        if len(scheds) == 1:
            work = works[0]
        else:       # DpScheduler.schedule's idle ranks; no rank is over its pool (the blocks fit)
            tokens = [len(part.base) if w is None else w.new_tokens for w, part in zip(works, st.parts)]
            if any(tokens):
                for i, n in enumerate(tokens):
                    if not n:
                        sched.idle_steps[i] += 1
            sched._picks = admitted
            if None in works and not _alike(dp_cost, works, st.parts, k):
                latency = dp_cost.latency_of([_rank_figures(dp_cost, w, part, k) for w, part in zip(works, st.parts)])
                work = _Counts(sum(tokens), sum(len(part.base) if w is None else w.decodes
                                                for w, part in zip(works, st.parts)))
            else:
                work = RankedWork(tuple(StepWork((), tuple(c + k for c in part.base)) if w is None else w.work()
                                        for w, part in zip(works, st.parts)))
        if not work.new_tokens:
            _materialize(inst)      # nothing to run: as schedule() finds nothing
            return False
        if latency is None:
            latency = inst.pool.cost.latency_s(work)
        inst.busy, inst.work, inst.step_start_s, inst.lazy_step = True, work, now, True
        inst.picked = [q for mine in admitted for q in mine]
        inst.lazy_admitted = admitted
        self._push(now + latency, Event.STEP_END, inst)
        return True

    def _lazy_step_end(self, now: float, inst: Instance) -> None:
        """The end of a step :meth:`_lazy_step` built, scheduler by scheduler (rank by rank):
        the state's decodes emit (one step more pending, those at their last token brought
        up and gone), then the admitted sequences as :meth:`_step_end` takes them; one that
        now decodes joins the state (every state sequence's largest gap brought up first),
        one still prefilling ends it."""
        inst.lazy_step = False
        sched, st = inst.scheduler, inst.dec
        self.steps += 1
        work = inst.work
        decodes = work.decodes
        inst.steps.extend((inst.step_start_s, now, work.new_tokens - decodes, decodes, 0, 0, 0))
        bs = sched.s.block_size
        gap = now - st.t
        k = st.shift = st.shift + 1
        st.t = now
        if gap > st.worst:
            st.worst = gap
        prefill_pool = self.split and inst.pool.role == "prefill"
        scheds = _schedulers(sched)
        joining = []
        kept = True
        itl, one_gap = inst.itl_s, array("d", (gap,))
        for r, part, mine in zip(scheds, st.parts, inst.lazy_admitted):
            if itl is not None and part.base:
                itl.extend(one_gap * len(part.base))
            if part.fin and part.fin[0] == k:       # _leave's own test, before its call
                self._leave(now, inst, st, r, part)
            if mine:        # (r is a VllmScheduler: _lazy_step built the step on no other)
                for q in r.finish_step(mine):
                    self._emitted(now, inst, q, sched, prefill_pool)
            # after the state's decodes: those that now decode join it (their token just
            # emitted: a sequence recomputed after a preemption with one token left to compute
            # has an older last token, and its gap is its own); at most one prompt still
            # prefilling may follow them (one scheduler), else the state ends
            if len(r.running) == len(part.base):
                continue
            after = r.running[len(part.base):]
            n = 0
            while n < len(after) and after[n].num_tokens - after[n].computed == 1 and after[n].last_s == now:
                joining.append((part, after[n]))
                n += 1
            if len(after) - n > (len(scheds) == 1):
                kept = False
        inst.lazy_admitted = None
        if not kept:
            _materialize(inst)
        elif joining:
            worst = st.worst
            if worst:       # the gaps so far are the earlier sequences' only
                for r, part in zip(scheds, st.parts):
                    for q in r.running[:len(part.base)]:
                        if worst > q.max_itl_s:
                            q.max_itl_s = worst
                st.worst = 0.0
            for part, q in joining:
                # kept as if in the state from its start (every sequence's pending steps are
                # the state's shift; a joiner's counts are set back by it until brought up)
                q.computed -= k
                q.num_tokens -= k
                q.emitted -= k
                part.add(q.computed, q.req.output_tokens - q.emitted, bs)
            st.stepper = None
        self._next(now, inst)

    def _step_end(self, now: float, inst: Instance) -> None:
        """The instance's step ends: its sequences advance, finished ones leave; in a
        disaggregated fleet a prompt's first token sends its KV to a decode instance."""
        if inst.lazy_step:
            self._lazy_step_end(now, inst)
            return
        sched = inst.scheduler
        self.steps += 1
        work = inst.work
        decodes = work.decodes
        inst.steps.extend((inst.step_start_s, now, work.new_tokens - decodes, decodes, 0, 0, 0))
        prefill_pool = self.split and inst.pool.role == "prefill"
        for q in sched.finish_step(inst.picked):
            self._emitted(now, inst, q, sched, prefill_pool)
        self._next(now, inst)

    def _emitted(self, now: float, inst: Instance, q: Seq, sched, prefill_pool: bool) -> None:
        """``q`` emitted a token at the end of ``inst``'s step at ``now``: its first (TTFT) or
        the gap since its last; its last leaves; in a disaggregated fleet's prefill pool its
        first token sends its KV to a decode instance."""
        log = self.log
        first_token_s = log.first_token_s
        k = q.req.id
        first = q.last_s is None
        if first:                     # its first token
            first_token_s[k] = now
            q.last_s = now
        else:
            gap = now - q.last_s
            if inst.itl_s is not None:
                inst.itl_s.append(gap)
            if gap > q.max_itl_s:
                q.max_itl_s = gap
            q.last_s = now
        if q.emitted >= q.req.output_tokens:
            self._finish(now, q, sched)
        elif prefill_pool and q.emitted == 1:
            sched.release(q)
            last = self.pools[-1]
            j = last[0].pool.router.choose(q.req, last)
            log.decode_instance[k] = j
            move = self.fleet.transfer_s(q.req.input_tokens, inst.index, j)
            log.transfer_s[k] = move
            # the first token reaches the user with the KV: TTFT includes the transfer
            first_token_s[k] = now + move
            moved = Seq(q.req, computed=q.computed, emitted=q.emitted)
            moved.last_s = now + move
            if self.phase == 1:
                self.deferred.append((now + move, moved, last[j]))
            else:
                self._push(now + move, Event.ENQUEUE, moved, last[j])
        if self.miss is not None and first:
            self.miss.see("ttft", first_token_s[k] - log.arrival_s[k])

    def _finish(self, now: float, q: Seq, sched) -> None:
        """``q`` emitted its last token at ``now``: it leaves its instance and the system."""
        sched.release(q)
        log = self.log
        k = q.req.id
        log.finish_s[k] = now
        log.last_token_s[k] = now
        log.max_itl_s[k] = q.max_itl_s if q.emitted > 1 else float("nan")
        log.emitted[k] = q.emitted
        if not self.phase:
            self.area += self.in_system * (now - self.t_last)
            self.t_last = now
            self.in_system -= 1
        self.done += 1
        if self.progress is not None and (self.done % 256 == 0 or self.done == self.n):
            self.progress(self.done, self.n)
        if self.workload.closed and self.next_closed < self.n:
            self._push(now, Event.ARRIVAL, self.next_closed)
            self.next_closed += 1
        if self.miss is not None:
            arrival = log.arrival_s[k]
            self.miss.see("e2e", now - arrival)
            if q.emitted > 1:
                self.miss.see("tpot", (now - log.first_token_s[k]) / (q.emitted - 1))

    def _next(self, now: float, inst: Instance) -> None:
        """The end of the instance's step at ``now``, after its sequences: the step's row counts
        the KV blocks, running and waiting sequences as they are, and the next step starts."""
        sched = inst.scheduler
        row = len(inst.steps) - 7
        inst.steps[row + 4] = sched.used_blocks
        inst.steps[row + 5] = len(sched.running)
        inst.steps[row + 6] = len(sched.waiting)
        inst.busy = False
        if sched.has_work:
            self._start(inst, now)
        if self.miss is not None:
            self.miss.at(now, PREFILL_TIMED if self.phase == 1 else MissWatch.TIMED)
            if self.miss.sure:
                raise Missed


    def _resume(self, now: float, inst: Instance) -> None:
        """A run of decode steps ends with a step that an arrival fell in or in which sequences
        emitted their last token: those leave now (in the order the step holds them), as at
        that step's end, and the instance goes on (its next step admits what arrived)."""
        sched = inst.scheduler
        st = inst.dec
        if st is None:
            for q in [q for q in sched.running if q.emitted >= q.req.output_tokens]:
                sched.last_token(q)
                self._finish(now, q, sched)
        else:       # sequences that emitted their last token in the run's last step, rank by rank
            for r, part in zip(_schedulers(sched), st.parts):
                self._leave(now, inst, st, r, part)
        self._next(now, inst)

    def _leave(self, now: float, inst: Instance, st: "_DecodeState", r, part: "_Part") -> None:
        """The sequences of ``part`` (scheduler ``r``'s in the state) that emitted their last
        token at the state's time ``now``: brought up to date, gone (in the order ``r``
        holds them), out of the state."""
        k, bs, sched = st.shift, r.s.block_size, inst.scheduler
        if not part.fin or part.fin[0] != k:
            return
        m = bisect.bisect_right(part.fin, k)     # how many leave now (none has fewer tokens left)
        done = []
        for q in r.running[:len(part.base)]:
            if q.req.output_tokens - q.emitted <= k:
                done.append(q)
                if len(done) == m:
                    break
        for q in done:
            _bring_up(q, k, now, st.worst, bs)
            sched.last_token(q)
            self._finish(now, q, sched)
            part.remove(q.computed - k, bs)
        del part.fin[:len(done)]
        st.stepper = None


def serve_requests(fleet: Fleet, workload: Workload, progress: Optional[Callable[[int, int], None]] = None,
                   fast: bool = True, miss: Optional[MissWatch] = None) -> Optional[LoopResult]:
    """Run every request of ``workload`` through ``fleet`` to completion (a
    :class:`ServingLoop` run to its end); ``None`` when ``miss`` was sure of a miss first."""
    return ServingLoop(fleet, workload, progress, fast, miss).run()


#: a run of decode steps shorter than this goes step by step (the run's set-up costs more)
MIN_RUN_STEPS = 2


def _decode_run(inst: Instance, now: float, horizon: float, cross: float = math.inf) -> tuple[int, float, bool]:
    """Run the instance's next steps at once, while nothing else can tell: every running
    sequence decodes one token a step (none is preempted, nothing is admitted: the queue is
    empty or the batch is full), or, with the last admitted sequence still prefilling, the
    steps in which its chunk takes the rest of the token budget (nothing can be admitted
    then either, and its chunk does not complete its prompt), and each step ends before
    ``horizon`` (the next event that can touch or read the instance); the step ``cross``
    falls in (the next event that only joins the instance's queue), and the first in which
    a sequence emits its last token, is the run's last. Each step is the one
    :meth:`VllmScheduler.schedule` would build (its latency from the pool's cost, its KV
    blocks, its row in ``inst.steps``, every inter-token gap), so the result is the
    step-by-step one. Returns ``(steps run, when the next step starts, whether the loop
    resumes the instance then)``: the last step ends at or past ``cross``, or sequences
    finished in it (:meth:`ServingLoop._resume` lets them leave at its end)."""
    sched = inst.scheduler
    s = sched.s
    running = sched.running
    b = len(running)
    budget = s.max_num_batched_tokens
    bs = s.block_size
    last = running[-1]
    rest = last.num_tokens - last.computed
    if rest != 1 or last.last_s is None:
        # the last admitted sequence is prefilling: a run of the chunks that fill the budget
        # (schedule gives the decodes their token first, then it ``budget - b``); without
        # mixed_prefill its chunks run without the decodes, step by step
        if not s.mixed_prefill or last.emitted or last.scheduled or last.blocks != sched._blocks_for(last.computed):
            return 0, now, False
        prompt, b = last, b - 1
        per = budget - b
        cap = s.long_prefill_token_threshold
        if per < 2 or 0 < cap < per:    # one token would count as a decode; a cap leaves budget to admit
            return 0, now, False
        chunks = (rest - 1) // per      # the steps whose chunk leaves some of the prompt for later
        if inst.dec is not None:
            return _lazy_run(inst, inst.dec, now, horizon, cross, prompt, per, chunks)
        decoding = running[:b]
    else:
        # admit stops at the queue's head, and a run of decode steps only takes blocks (a
        # sequence that finishes ends it): a head that does not fit now fits in none of its
        # steps, so the queue does not stop the run (a decode pool whose KV is full). Without
        # mixed_prefill a prompt at the head would take a prefill step of its own, with the
        # whole budget (VllmScheduler.admission_budget)
        if b > budget or (sched.waiting and b < s.max_num_seqs and sched.may_admit(sched.admission_budget(b))):
            return 0, now, False
        if inst.dec is not None:
            return _lazy_run(inst, inst.dec, now, horizon, cross)
        prompt, per, chunks, decoding = None, 0, 1 << 62, running
    rs: Optional[list] = [] if prompt is None and inst.lazy else None
    state = _decoding(decoding, bs, rs)
    if state is None:
        return 0, now, False
    contexts, residues, left = state
    limit = min(left, chunks)     # the step in which a sequence finishes is the run's last
    if limit < MIN_RUN_STEPS:
        return 0, now, False
    cost = inst.pool.cost
    if prompt is not None:
        done = prompt.computed
        chunker = getattr(cost, "chunk_stepper", None)
        if chunker is not None:
            chunk_s = chunker(per, contexts)

            def mixed_s(j):
                return chunk_s(done + j * per, j)
        else:
            def mixed_s(j, latency_s=cost.latency_s):
                return latency_s(StepWork(((per, done + j * per),), tuple(c + j for c in contexts)))
    else:
        stepper = getattr(cost, "decode_stepper", None)
        if stepper is not None:
            decode_s = stepper(contexts)
        else:
            def decode_s(j, total, latency_s=cost.latency_s):
                return latency_s(StepWork((), tuple(c + j for c in contexts)))
    total = sum(contexts)
    free = sched.free_blocks
    used = sched.used_blocks
    waiting = len(sched.waiting)
    seqs = len(running)
    rows = inst.steps
    t = now
    need = taken = 0
    ends = []
    for j in range(limit):
        # a sequence whose tokens fill whole blocks takes a new one (its context c + j); the
        # prompt's chunk takes those its tokens reach
        need += residues[-j % bs]
        if prompt is not None:
            need += -(-(done + (j + 1) * per) // bs) - -(-(done + j * per) // bs)
        if need > free:
            break
        end = t + (mixed_s(j) if prompt is not None else decode_s(j, total + j * b))
        if end >= horizon:
            break
        rows.extend((t, end, per, b, used + need, seqs, waiting))
        ends.append(end)
        taken = need
        t = end
        if end >= cross:
            break
    k = len(ends)
    if not k:
        return 0, now, False
    if b:
        _advance(decoding, ends, inst.itl_s, bs)
    if prompt is not None:
        prompt.computed += k * per
        prompt.blocks = sched._blocks_for(prompt.computed)
    elif rs is not None:
        # the sequences' state, kept for the runs that follow until the scheduler reads them
        inst.dec = _DecodeState([_Part.after(contexts, residues, rs, k, bs)], t)
    sched.free_blocks = free - taken
    return k, t, t >= cross or k == left


def _decoding(seqs, bs: int, rs: Optional[list] = None) -> Optional[tuple]:
    """``(contexts, residues, fewest left)`` of sequences that all decode one token in the
    next step with their KV blocks as the scheduler keeps them (their contexts sorted, how
    many sit at each context modulo ``bs``, the fewest tokens any has left to emit);
    ``None`` when one does not. ``rs``: a list that gets the tokens each has left."""
    left = 1 << 62
    contexts = []
    residues = [0] * bs
    for q in seqs:
        c = q.computed
        if q.num_tokens - c != 1 or q.last_s is None or q.scheduled or q.blocks != -(-c // bs):
            return None
        contexts.append(c)
        residues[c % bs] += 1
        r = q.req.output_tokens - q.emitted
        if r < left:
            left = r
        if rs is not None:
            rs.append(r)
    contexts.sort()
    return tuple(contexts), residues, left


class _Part:
    """One scheduler's decoding sequences in a :class:`_DecodeState`: their contexts when the
    state was made, ``base`` (sorted; ``rbase[r]``: how many of them are ``r`` modulo the
    block size; ``sum_base``: their sum), and the tokens each had left, ``fin`` (sorted)."""

    __slots__ = ("base", "rbase", "sum_base", "fin")

    def __init__(self, base: list, rbase: list, sum_base: int, fin: list):
        self.base, self.rbase, self.sum_base, self.fin = base, rbase, sum_base, fin

    @classmethod
    def after(cls, contexts: tuple, residues: list, rs: list, k: int, bs: int) -> "_Part":
        """The sequences of :func:`_decoding`'s ``(contexts, residues)`` and tokens left ``rs``
        after ``k`` more decode steps."""
        return cls([c + k for c in contexts], residues[-k % bs:] + residues[:-k % bs], sum(contexts) + k * len(contexts),
                   sorted(r - k for r in rs))

    def add(self, base: int, left: int, bs: int) -> None:
        """A sequence of context ``base`` plus the state's shift joined, ``left`` tokens
        left to emit past the state's start."""
        bisect.insort(self.base, base)
        self.rbase[base % bs] += 1
        self.sum_base += base
        bisect.insort(self.fin, left)

    def remove(self, base: int, bs: int) -> None:
        """A sequence of context ``base`` plus the state's shift left (its ``fin`` entry is
        the caller's)."""
        del self.base[bisect.bisect_left(self.base, base)]
        self.rbase[base % bs] -= 1
        self.sum_base -= base


class _DecodeState:
    """An instance's decoding sequences between runs of decode steps (:func:`_lazy_run`):
    after a run every running sequence decodes, and until the scheduler reads them
    (:func:`_materialize`, before :meth:`VllmScheduler.schedule` and whenever the loop
    returns to its caller) only further runs and the finishes at their ends touch them. So
    the sequences are not updated run by run: ``shift`` steps are pending for each, since
    the state was made (``parts``: a :class:`_Part` per scheduler, one, or one per
    attention-DP rank); ``t``: when every one emitted its last token; ``worst``: the largest
    inter-token gap since (each sequence's own largest is at least it). The same steps, rows
    and gaps as the runs that update the sequences each time (:func:`_advance`), bit for bit."""

    __slots__ = ("parts", "t", "shift", "worst", "stepper")

    def __init__(self, parts: list, t: float):
        self.parts, self.t = parts, t
        self.shift, self.worst, self.stepper = 0, 0.0, None


class _Counts:
    """What the end of a step reads of its work (``new_tokens``, ``decodes``), for an
    attention-DP step priced from its ranks' figures (:meth:`ServingLoop._lazy_step`)."""

    __slots__ = ("new_tokens", "decodes")

    def __init__(self, new_tokens: int, decodes: int):
        self.new_tokens, self.decodes = new_tokens, decodes


def _alike(cost: DpCost, works: list, parts: list, k: int) -> bool:
    """Whether every rank's work of an attention-DP step might be the same (their chunks, new
    tokens and decode context sums all equal; ``None``: the part's decodes ``k`` steps past
    its base, an empty part the idle rank's work), the case :meth:`DpCost.latency_s` prices
    as one rank's step."""
    def key(w, part):
        if w is None and part.base:
            return (), len(part.base), part.sum_base + k * len(part.base)
        w = cost.idle if w is None or not w.new_tokens else w
        return w.chunks, w.new_tokens, w.decode_context_tokens
    first = key(works[0], parts[0])
    return all(key(w, part) == first for w, part in zip(works[1:], parts[1:]))


def _rank_figures(cost: DpCost, work: Optional[StepWork | JoinedStep], part: _Part, k: int) -> tuple[float, int]:
    """An attention-DP rank's ``(latency_s, new_tokens)`` in a step (DpCost.latency_of):
    its ``work``'s (a :class:`JoinedStep` from its counts), or, with ``work`` None, its part's decodes ``k`` steps past ``base``
    (:meth:`PlanCost.decode_step_s`: the rank's latency of that work, without building it),
    an idle rank's figures where the part is empty."""
    if work is None:
        b = len(part.base)
        if not b:
            return cost.rank.latency_s(cost.idle), cost.idle.new_tokens
        return cost.rank.decode_step_s(part.base, k, part.sum_base + k * b), b
    if not work.new_tokens:
        work = cost.idle
    elif type(work) is JoinedStep:
        return cost.rank.joined_step_s(work), work.new_tokens
    return cost.rank.latency_s(work), work.new_tokens


def _schedulers(sched) -> list:
    """The schedulers whose sequences a state keeps: an attention-DP instance's ranks, or it."""
    return sched.ranks if type(sched) is DpScheduler else [sched]


def _bring_up(q: Seq, k: int, t: float, worst: float, bs: int) -> None:
    """``q`` after ``k`` pending decode steps, its last token at ``t``, ``worst`` its
    largest gap in them (:class:`_DecodeState`)."""
    c = q.computed + k
    q.computed = c
    q.num_tokens += k
    q.emitted += k
    q.blocks = -(-c // bs)
    q.last_s = t
    if worst > q.max_itl_s:
        q.max_itl_s = worst


def _materialize(inst: Instance) -> None:
    """The state's sequences brought up to date, its :class:`_DecodeState` dropped; a step in
    flight that :meth:`ServingLoop._lazy_step` built becomes the one
    :meth:`VllmScheduler.schedule` builds (its decodes scheduled, their blocks taken)."""
    st, inst.dec = inst.dec, None
    k, t, worst, bs = st.shift, st.t, st.worst, inst.scheduler.s.block_size
    decodes = [q for r, part in zip(_schedulers(inst.scheduler), st.parts) for q in r.running[:len(part.base)]]
    if k:
        for q in decodes:
            _bring_up(q, k, t, worst, bs)
    if inst.lazy_step:      # per scheduler: its decodes, then what it admitted
        picks = []
        for r, part, mine in zip(_schedulers(inst.scheduler), st.parts, inst.lazy_admitted):
            mine = r.running[:len(part.base)] + mine
            for q in mine[:len(part.base)]:
                q.scheduled = 1
                q.blocks = -(-(q.computed + 1) // bs)
            picks.append(mine)
        if type(inst.scheduler) is DpScheduler:
            inst.scheduler._picks = picks
        inst.picked = [q for mine in picks for q in mine]
        inst.lazy_step, inst.lazy_admitted = False, None


def _state_stepper(inst: Instance, st: _DecodeState) -> Callable[[int], float]:
    """``j ->`` the latency of the decode step ``j`` steps past the state's ``base``
    contexts (the pool's cost's ``decode_stepper``, as :func:`_decode_run` and
    :func:`_dp_decode_run` ask it)."""
    cost = inst.pool.cost
    if len(st.parts) > 1 or type(inst.scheduler) is DpScheduler:
        return cost.decode_stepper(tuple(tuple(p.base) for p in st.parts))
    part = st.parts[0]
    base, b, total = tuple(part.base), len(part.base), part.sum_base
    stepper = getattr(cost, "decode_stepper", None)
    if stepper is not None:
        one = stepper(base)
        return lambda j: one(j, total + j * b)
    latency_s = cost.latency_s
    return lambda j: latency_s(StepWork((), tuple(c + j for c in base)))


def _lazy_run(inst: Instance, st: _DecodeState, now: float, horizon: float, cross: float = math.inf,
              prompt: Optional[Seq] = None, per: int = 0, chunks: int = 1 << 62) -> tuple[int, float, bool]:
    """:func:`_decode_run` (or :func:`_dp_decode_run`) on the instance's
    :class:`_DecodeState`: a pure decode run, or (``prompt``, the last running sequence,
    still prefilling) the run of its ``chunks`` budget-filling chunks of ``per`` tokens
    beside the state's decodes: the same steps (latencies, KV blocks, rows, inter-token
    gaps), the decoding sequences left as they are (their steps pending in the state)."""
    sched = inst.scheduler
    scheds = _schedulers(sched)
    parts = st.parts
    b = 0
    for r, part in zip(scheds, parts):
        if len(part.base) != len(r.running) - (prompt is not None):
            return 0, now, False
        b += len(part.base)
    if not (b or prompt) or now != st.t:
        return 0, now, False
    shift = st.shift
    left = min((p.fin[0] for p in parts if p.fin), default=1 << 62) - shift
    limit = min(left, chunks)
    if limit < MIN_RUN_STEPS:
        return 0, now, False
    bs = sched.s.block_size
    if prompt is None:
        step_s = st.stepper
        if step_s is None:
            step_s = st.stepper = _state_stepper(inst, st)
    else:
        step_s = _chunk_stepper(inst, st.parts[0], shift, prompt.computed, per)
    frees = [r.free_blocks for r in scheds]
    used = sched.used_blocks
    waiting = sum(len(r.waiting) for r in scheds)
    seqs = b + (prompt is not None)
    rows = inst.steps
    itl = inst.itl_s
    worst = st.worst
    t = now
    k = 0
    one = len(parts) == 1
    needs = [0] * len(parts)
    taken = needs[:]
    rbase = parts[0].rbase
    done = prompt.computed if prompt is not None else 0
    for i in range(limit):
        j = shift + i
        if one:
            needs[0] += rbase[-j % bs]
            if prompt is not None:     # the blocks its chunk's tokens reach
                needs[0] += -(-(done + (i + 1) * per) // bs) - -(-(done + i * per) // bs)
            if needs[0] > frees[0]:
                break
            need = needs[0]
        else:
            over = False
            for r_i, part in enumerate(parts):
                needs[r_i] += part.rbase[-j % bs]
                if needs[r_i] > frees[r_i]:
                    over = True
            if over:
                break
            need = sum(needs)
        end = t + step_s(j)
        if end >= horizon:
            break
        rows.extend((t, end, per, b, used + need, seqs, waiting))
        gap = end - t
        if b:
            if itl is not None:
                itl.extend(array("d", (gap,)) * b)
            if gap > worst:
                worst = gap
        taken = needs[:]
        t = end
        k += 1
        if end >= cross:
            break
    if not k:
        return 0, now, False
    st.shift, st.t, st.worst = shift + k, t, worst
    for r_i, r in enumerate(scheds):
        r.free_blocks = frees[r_i] - taken[r_i]
        if not r.running:
            sched.idle_steps[r_i] += k       # DpScheduler.schedule counts an idle rank's steps
    if prompt is not None:
        prompt.computed += k * per
        prompt.blocks = sched._blocks_for(prompt.computed)
    return k, t, t >= cross or k == left


def _chunk_stepper(inst: Instance, part: _Part, shift: int, done: int, per: int) -> Callable[[int], float]:
    """``j ->`` the latency of the step of the prompt's chunk of ``per`` tokens after ``done +
    (j - shift) per`` beside the decodes ``j`` steps past the state's ``base`` contexts (the
    pool's cost's ``chunk_stepper``, as :func:`_decode_run` asks it)."""
    cost = inst.pool.cost
    base = tuple(part.base)
    chunker = getattr(cost, "chunk_stepper", None)
    if chunker is not None:
        chunk_s = chunker(per, base)
        return lambda j: chunk_s(done + (j - shift) * per, j)
    latency_s = cost.latency_s
    return lambda j: latency_s(StepWork(((per, done + (j - shift) * per),), tuple(c + j for c in base)))


def _advance(decoding: list, ends: list, itl_s: Optional[array], bs: int) -> None:
    """The decoding sequences after a run's steps ending at ``ends``: each emitted one token
    a step (its context, tokens and KV blocks, ``VllmScheduler._blocks_for``), the
    instance's inter-token gaps (each sequence's first, from its last token, then one per
    step for all; ``itl_s`` None: not kept) and each sequence's largest gap."""
    k, t, b = len(ends), ends[-1], len(decoding)
    gaps = [ends[0] - q.last_s for q in decoding]
    if itl_s is not None:
        itl_s.extend(array("d", gaps))
    prev = ends[0]
    worst = 0.0
    for end in ends[1:]:
        gap = end - prev
        if gap > worst:
            worst = gap
        if itl_s is not None:
            itl_s.extend(array("d", (gap,)) * b)
        prev = end
    for q, gap in zip(decoding, gaps):
        _bring_up(q, k, t, gap if gap > worst else worst, bs)


def _dp_decode_run(inst: Instance, now: float, horizon: float, cross: float = math.inf) -> tuple[int, float, bool]:
    """:func:`_decode_run` for an instance of attention-DP ranks (a :class:`DpScheduler` of
    :class:`VllmScheduler` ranks, a step cost with a ``decode_stepper``): while every rank's
    sequences all decode (a rank with none is idle in each step: it joins the all-to-all,
    counted in ``idle_steps``) and no rank can admit, the instance's steps at once, each the
    one the ranks' schedulers would build (its latency from the pool's cost, every rank's
    KV blocks, the instance's row, every inter-token gap). Returns as :func:`_decode_run`."""
    sched = inst.scheduler
    cost = inst.pool.cost
    stepper = getattr(cost, "decode_stepper", None)
    ranks = sched.ranks
    if stepper is None or any(type(r) is not VllmScheduler for r in ranks):
        return 0, now, False
    s = sched.s
    budget, bs = s.max_num_batched_tokens, s.block_size
    for r in ranks:
        b = len(r.running)
        if b > budget or (r.waiting and b < s.max_num_seqs and r.may_admit(r.admission_budget(b))):
            return 0, now, False
    if inst.dec is not None:
        return _lazy_run(inst, inst.dec, now, horizon, cross)
    left = 1 << 62
    per_rank = []
    decoding = []
    rss: list = []
    for r in ranks:
        running = r.running
        rs: Optional[list] = [] if inst.lazy else None
        state = _decoding(running, bs, rs)
        if state is None:
            return 0, now, False
        contexts, residues, fewest = state
        left = min(left, fewest)
        per_rank.append((contexts, residues, r.free_blocks))
        rss.append(rs)
        decoding.extend(running)
    b = len(decoding)
    limit = left          # the step in which a sequence finishes is the run's last
    if not b or limit < MIN_RUN_STEPS:
        return 0, now, False
    step_s = stepper(tuple(ctx for ctx, _, _ in per_rank))
    used = sched.used_blocks
    waiting = sum(len(r.waiting) for r in ranks)
    rows = inst.steps
    needs = [0] * len(ranks)
    taken = needs[:]
    t = now
    ends = []
    for j in range(limit):
        over = False
        for i, (_, residues, free) in enumerate(per_rank):
            needs[i] += residues[-j % bs]
            if needs[i] > free:
                over = True
        if over:
            break
        end = t + step_s(j)
        if end >= horizon:
            break
        rows.extend((t, end, 0, b, used + sum(needs), b, waiting))
        ends.append(end)
        taken = needs[:]
        t = end
        if end >= cross:
            break
    k = len(ends)
    if not k:
        return 0, now, False
    _advance(decoding, ends, inst.itl_s, bs)
    for i, r in enumerate(ranks):
        r.free_blocks -= taken[i]
        if not r.running:
            sched.idle_steps[i] += k       # DpScheduler.schedule counts an idle rank's steps
    if inst.lazy:   # the ranks' sequences' state, kept for the runs that follow (_DecodeState)
        inst.dec = _DecodeState([_Part.after(ctx, res, rs, k, bs) for (ctx, res, _), rs in zip(per_rank, rss)], t)
    return k, t, t >= cross or k == left


def check_invariants(result: LoopResult) -> dict:
    """The loop's invariants (each must be 0): every request finished once with all its
    tokens, none before it arrived, KV blocks within the pool and all returned (and, with
    a block cache, its own: a block in one place at most, the pool's blocks adding up, no
    tier over its size, bytes moved = blocks moved x bytes per block)."""
    log, reqs = result.requests, result.workload.requests
    bad_tokens = sum(1 for k, r in enumerate(reqs) if log.emitted[k] != r.output_tokens)
    early = sum(1 for k in range(log.n) if not (log.arrival_s[k] <= log.scheduled_s[k] <= log.first_token_s[k]
                                                <= log.finish_s[k]))
    over = sum(1 for inst in result.instances for row in range(0, len(inst.steps), 7)
               if inst.steps[row + 4] > inst.scheduler.total_blocks)
    left = sum(i.scheduler.used_blocks for i in result.instances)
    no_ttft = sum(1 for k in range(log.n) if not log.first_token_s[k] > log.arrival_s[k])
    out = {"requests_with_wrong_token_count": bad_tokens, "requests_out_of_order": early,
           "requests_without_positive_ttft": no_ttft, "requests_not_fcfs": _not_fcfs(result),
           "steps_over_kv_pool": over, "kv_blocks_left_at_end": left}
    ranked = [i for i in result.instances if hasattr(i.scheduler, "ranks")]
    if ranked:   # attention DP: the same per rank, and every request on one rank of each pool it passes
        for inst in ranked:
            for key, value in inst.scheduler.check().items():
                out[key] = out.get(key, 0) + value
        out["requests_not_on_one_rank"] = sum(abs(sum(sum(i.scheduler.added) for i in insts) - log.n)
                                              for insts in _by_pool(result) if hasattr(insts[0].scheduler, "ranks"))
    for inst in result.instances:   # a block cache's own (CachingScheduler.check), named kv_cache_...
        if getattr(inst.scheduler, "io", False) and not hasattr(inst.scheduler, "ranks"):   # ranks: DpScheduler.check
            for key, value in inst.scheduler.check().items():
                out[f"kv_cache_{key}"] = out.get(f"kv_cache_{key}", 0) + value
    return out


def _by_pool(result: LoopResult) -> list[list]:
    return [[i for i in result.instances if i.pool is p] for p in result.fleet.pools]


def _not_fcfs(result: LoopResult) -> int:
    """Requests first scheduled before one that reached the same instance of the first pool
    earlier, where that pool's scheduler is the built-in (FCFS) one; 0 elsewhere."""
    pool = result.fleet.pools[0]
    if pool.scheduler_factory is not VllmScheduler:
        return 0
    log = result.requests
    latest: dict = {}
    count = 0
    for k in sorted(range(log.n), key=lambda k: (log.arrival_s[k], k)):
        i = log.instance[k]
        if log.scheduled_s[k] < latest.get(i, -math.inf):
            count += 1
        latest[i] = max(latest.get(i, -math.inf), log.scheduled_s[k])
    return count


def summarize_pools(pools: Sequence[Pool]) -> list[dict]:
    return [{"role": p.role, "instances": p.instances, "chips_per_instance": p.cost.chips,
             "kv_blocks_per_instance": p.total_blocks, "block_size": p.scheduler.block_size} for p in pools]
