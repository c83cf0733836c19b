"""The discrete-event engine: per-chip compute streams and max-min fair flows on ports.

The engine sees arrays, not hooks: :func:`g5core.sim.compile.compile_dag` asks the plugins
for every compute op's duration and every communication op's lowering once, before the run,
and the event loop then touches only lists of numbers.

Model:
- each chip has one compute stream: one op at a time; among ready ops it starts the one
  that became ready first, ties broken by op id: the order the build added the ops, which
  is program order (layer by layer, as a framework issues its kernels);
- a communication op starts when all its predecessors are done, waits its start latency,
  then releases its flows; each flow crosses the resources (ports) of its route (a chip's
  link send or receive side, a NIC's, a fabric tier's: :mod:`g5core.lower.topology`), and the
  flows on a resource share it max-min fairly; rates are recomputed (per connected set of
  resources and flows) whenever a flow starts or ends; the op ends with its last flow;
- events are kept by time: the events of one time are a batch, processed in the order they
  were added (no result depends on that order), and a heap holds the distinct times; a
  negative delay is an error. The flows of one comm op that finish together may share one
  entry (a cohort: ``docs/design-notes.md``, "Engine"), which counts one event per flow.
"""
from __future__ import annotations

import heapq
import math
from array import array
from collections import defaultdict
from collections.abc import Sequence
from functools import partial

import attrs
import numpy as np

from g5core.api.errors import G5Error
from g5core.sim.compile import CompiledDag

# A flow that ends with |bytes left| below this fraction of its size delivered everything:
# the difference is floating-point rounding of the rate integral, not lost data.
ROUNDING_BYTES_REL = 1e-9
# ... or below what its rate carries in this fraction of the current time (the clock's own
# rounding: late in a long run a double near 2e9 s steps by 5e-7 s, and a fast flow moves
# many bytes in one step of the clock).
CLOCK_ROUNDING_REL = 1e-12

# How many answers of the bandwidth sharing (one per distinct set of routes) a run keeps;
# past this the store starts again (bounds memory on irregular traffic; a store costs a few
# hundred bytes an answer).
SHARES_KEPT = 100_000

# A comm op with at least this many flows adds them to its ports' flow sets a port at a
# time (fewer Python steps for many flows; for few, one at a time is quicker).
BULK_FLOWS = 8

# Flows whose delivered bytes are worked out at once after the run (bounds its memory).
DELIVERED_BLOCK = 1 << 18

# The kinds of event. An event is ``(kind, item, tag)``:
# - COMPUTE_DONE: a compute op ends; item = the op, tag = 0;
# - FLOW_DONE: a flow ends at the rate it was given; item = the flow, tag = the version of
#   that rate (a flow re-shared since has a later version, and this event is stale);
# - COHORT_DONE: the flows of a comm op's release plan that finish together end; item =
#   the op, tag = the cohort's index in its spec's plan (Engine._release_plan);
# - COMM_RELEASE: a comm op's start latency is over and its flows start; item = the op, tag = 0.
# With ``Engine._sort_batches`` the events of one time are sorted by kind (lower first).
COMPUTE_DONE, FLOW_DONE, COHORT_DONE, COMM_RELEASE = 0, 1, 2, 3


def _connected_set(start: int, on_port, routes: tuple, route_id, seen_ports: set) -> set:
    """The flows connected to port ``start`` through the ports they cross: ``on_port[p]``
    are the flows on port ``p``, ``routes[route_id[f]]`` the ports flow ``f`` crosses. The
    ports reached are added to ``seen_ports`` (``start`` is already in it)."""
    stack, members = [start], set()
    while stack:
        for f in on_port[stack.pop()]:
            if f not in members:
                members.add(f)
                for q in routes[route_id[f]]:
                    if q not in seen_ports:
                        seen_ports.add(q)
                        stack.append(q)
    return members


def _nan(n: int) -> array:
    return array("d", [math.nan]) * n


def _zeros(n: int) -> array:
    return array("d", bytes(8 * n))


@attrs.frozen(eq=False, kw_only=True)
class _ReleasePlan:
    """How a comm op's flows are released and, alone on their ports, settled: the same for
    every op of a spec, by flow offset from the op's first flow (:meth:`Engine._release_plan`)."""

    by_port: tuple   # ((port, offsets of the flows that cross it), ...) in port order
    ports: tuple     # the op's ports, in order
    counts: tuple    # ((port, how many of its flows cross it), ...)
    rates: array     # 'd' per flow: its max-min rate among the op's flows alone
    versions: array  # 'l' per flow: 1 (the version of its first rate)
    singles: tuple   # ((offset, bytes over rate), ...): a flow that finishes alone: an event of its own
    cohorts: tuple   # (offsets, ...): two flows or more that finish together (equal bytes over rate)
    cohort_finish_s: tuple  # per cohort: its flows' bytes over their rate
    totals: tuple    # ((port, total rate), ...) in the order the re-share sets them
    over: bool       # whether a total is above its port's capacity


@attrs.define(eq=False, kw_only=True)
class Engine:
    """One simulation. All state lives on the instance; run it once. Results are typed
    arrays (8 bytes a number), index = op id or flow id."""

    dag: CompiledDag
    record_port_rates: bool = False   # keep (time, port, bytes/s) for every rate change (traces)
    # results, filled by run()
    start_s: array = attrs.field(factory=lambda: array("d"))
    end_s: array = attrs.field(factory=lambda: array("d"))
    executed: array = attrs.field(factory=lambda: array("i"))
    executed_flops: array = attrs.field(factory=lambda: array("d"))
    flow_start_s: array = attrs.field(factory=lambda: array("d"))
    flow_end_s: array = attrs.field(factory=lambda: array("d"))
    flow_injected: array = attrs.field(factory=lambda: array("d"))   # bytes per flow when it started
    flow_delivered: array = attrs.field(factory=lambda: array("d"))  # bytes per flow when it ended
    port_excess_bytes: float = 0.0
    port_rate_log: list = attrs.field(factory=list)
    events: int = 0
    batches: int = 0  # distinct event times (each a batch)
    mean_heap_len: float = 0.0  # events pending at a batch's start, the mean of every 16th batch (benchmarks/bench.py)
    makespan_s: float = 0.0
    # run state the helpers share with the loop
    _flow_route: Sequence = attrs.field(factory=list, init=False, repr=False)  # per flow: its route id
    _port_rate: list = attrs.field(factory=list, init=False, repr=False)  # per port, when rates are recorded
    _over: dict = attrs.field(factory=dict, init=False, repr=False)  # port above its capacity -> (rate, since)
    _plans: dict = attrs.field(factory=dict, init=False, repr=False)  # spec -> release plan (see run)
    _shares: dict = attrs.field(factory=dict, init=False, repr=False)   # see _reshare
    _route_cap: list = attrs.field(factory=list, init=False, repr=False)  # per route: its narrowest capacity

    #: Fast paths, on by default; a test turns them off to show they change no result: the
    #: flows of one route alone on its ports taken as a connected set without the search,
    #: and a flow alone given its route's narrowest capacity without the progressive
    #: filling; each connected set's max-min answer kept by its routes; and a comm op's
    #: flows released and settled by its spec's plan (Engine._release_plan).
    _settle_alone = True
    _keep_shares = True
    _release_by_plan = True
    #: Events of one time are processed in the order they were added; a test sorts them by
    #: (kind, item, tag) instead to show the order changes no result.
    _sort_batches = False

    # ---------------------------------------------------------------- overridable seams
    # Tests subclass the engine and break one of these to show each KPI can fail. The event
    # loop calls a seam only when a subclass overrides it (else it reads the arrays).
    def _allocate(self, flows: Sequence[int], ports: dict) -> dict:
        """Max-min fair rates (progressive filling) for one connected set of flows."""
        cap_rem = {p: self.dag.port_capacity[p] for p in ports}
        count = {p: len(fs) for p, fs in ports.items()}  # insertion order = sorted port order
        rate: dict = {}
        routes, flow_route = self.dag.routes, self._flow_route
        while len(rate) < len(flows):
            best_p, best_share = -1, math.inf
            for p, c in count.items():
                if c:
                    share = cap_rem[p] / c
                    if share < best_share:
                        best_p, best_share = p, share
            for f in ports[best_p]:
                if f in rate:
                    continue
                rate[f] = best_share
                for q in routes[flow_route[f]]:
                    cap_rem[q] = max(cap_rem[q] - best_share, 0.0)
                    count[q] -= 1
        return rate

    def _release_flows(self, op: int) -> range:
        return range(int(self.dag.flow_ptr[op]), int(self.dag.flow_ptr[op + 1]))

    def _may_start(self, op: int) -> bool:
        return True

    def _flops_of(self, op: int) -> float:
        return float(self.dag.spec_flops[self.dag.spec[op]])

    def _successors(self, op: int):
        return self.dag.succ[op]

    def _overridden(self, name: str):
        """The bound seam ``name`` when a subclass overrides it, else None."""
        return getattr(self, name) if getattr(type(self), name) is not getattr(Engine, name) else None

    # ---------------------------------------------------------------------------- run
    def run(self) -> "Engine":
        d = self.dag
        n = d.n_ops
        n_flows = len(d.flow_bytes)
        n_ports = len(d.port_capacity)
        bad = np.flatnonzero(~(d.spec_duration_s[d.spec] >= 0.0)) if n else ()
        if len(bad):
            i = int(bad[0])
            raise G5Error(f"engine: op {d.keys[i]!r} has a negative or undefined duration "
                          f"{d.spec_duration_s[d.spec[i]]!r}")
        self.start_s = start_s = _nan(n)
        self.end_s = end_s = _nan(n)
        self.executed = executed = array("i", bytes(4 * n))
        self.executed_flops = executed_flops = _zeros(n)
        self.flow_start_s = flow_start_s = _nan(n_flows)
        self.flow_end_s = flow_end_s = _nan(n_flows)
        self.flow_injected = flow_injected = _zeros(n_flows)
        self.flow_delivered = _zeros(n_flows)
        self.port_rate_log = []
        # the columns the loop reads, in place (typed arrays: no Python object per op);
        # what is alike per spec is read through the op's spec
        spec = memoryview(d.spec) if n else ()
        is_comm = d.spec_is_comm[d.spec].tobytes()
        chip_of = memoryview(d.chip) if n else ()
        spec_dur = d.spec_duration_s.tolist()
        remaining_preds = array("i", d.pred_count.tobytes())
        flow_ptr = memoryview(d.flow_ptr)
        flow_op = memoryview(d.flow_op) if n_flows else ()
        fbytes = memoryview(d.flow_bytes)
        self._flow_route = flow_route = memoryview(d.flow_route) if n_flows else ()
        routes = d.routes
        cap = d.port_capacity
        # pending events by time: (kind, item, tag) in the order they were added;
        # ``times`` is a heap of the distinct times (many events share one: the chips of a
        # layer finish alike, a collective's flows end together)
        buckets: defaultdict = defaultdict(list)
        times: list = []
        heappush, heappop = heapq.heappush, heapq.heappop

        def add(t: float, event: tuple) -> None:
            """Event ``(kind, item, tag)`` at time ``t``."""
            b = buckets[t]
            b.append(event)
            if len(b) == 1:
                heappush(times, t)

        ready = [[] for _ in range(d.n_chips)]   # per chip heap of (ready_time, op id)
        busy = [False] * d.n_chips
        dirty_chips: set = set()
        # flow state
        f_rem = array("d", d.flow_bytes.tobytes())
        f_rate = _zeros(n_flows)
        f_last = _zeros(n_flows)
        f_ver = array("l", bytes(8 * n_flows))
        op_flows_left = array("i", bytes(4 * n))
        port_flows: list[set] = [set() for _ in range(n_ports)]
        self._port_rate = [0.0] * n_ports
        self._over = over = {}
        dirty_ports: set = set()
        released: list = []  # comm ops released in this batch by their spec's plan
        ended: list = []    # routes of the flows that ended in this batch
        events = 0
        heap_len_sum = sampled = batches = 0
        now = 0.0
        # the seams a subclass overrides (None: read the arrays)
        successors, flops_of = self._overridden("_successors"), self._overridden("_flops_of")
        may_start, release_flows = self._overridden("_may_start"), self._overridden("_release_flows")
        targets, bounds = d.succ.targets, d.succ.bounds
        reshare, set_port_rates = self._reshare, self._set_port_rates
        self._plans = plans = {}  # spec -> its release plan (Engine._release_plan), or () if it has none
        by_plan = self._release_by_plan and release_flows is None
        release_plan = self._shared_plan if type(self) is Engine and d.spec_plans else \
            (lambda s, first, last: self._release_plan(first, last))
        sort_batches = self._sort_batches
        inj_mv = memoryview(flow_injected)
        self._route_cap = [min(cap[q] for q in route) for route in routes]
        port_rate, record = self._port_rate, self.record_port_rates

        for op in np.flatnonzero(d.pred_count == 0).tolist() if n else ():
            if is_comm[op]:
                start_s[op] = 0.0
                add(spec_dur[spec[op]], (COMM_RELEASE, op, 0))
            else:
                heappush(ready[chip_of[op]], (0.0, op))
                dirty_chips.add(chip_of[op])

        while True:
            # start compute on idle chips, then re-share the ports whose flow set changed
            if dirty_chips:
                for c in dirty_chips:
                    if not busy[c] and ready[c]:
                        op = heappop(ready[c])[1]
                        if may_start is not None and not may_start(op):
                            continue
                        busy[c] = True
                        start_s[op] = now
                        add(now + spec_dur[spec[op]], (COMPUTE_DONE, op, 0))
                dirty_chips.clear()
            # ports that lost a flow in the last batch: re-shared if flows are left, else idle
            if ended:
                seen = record or over  # port rates are seen (Engine._set_port_rates)
                idle = []
                for route in ended:
                    for p in route:
                        if port_flows[p]:
                            dirty_ports.add(p)
                        elif seen and (port_rate[p] if record else p in over):
                            idle.append((p, 0.0))
                if idle:
                    set_port_rates(idle, now)
                ended.clear()
            # comm ops released in the last batch: where an op's flows are alone on their
            # ports, its connected sets are its own, and its rates the ones worked out for
            # its spec (Engine._release_plan); else its ports are re-shared with the rest
            if released:
                for op in released:
                    plan = plans[spec[op]]
                    for p, count in plan.counts:
                        if len(port_flows[p]) != count:
                            dirty_ports.update(plan.ports)
                            break
                    else:
                        first, last = flow_ptr[op], flow_ptr[op + 1]
                        f_rate[first:last] = plan.rates
                        f_ver[first:last] = plan.versions
                        for k, finish_s in plan.singles:
                            add(now + finish_s, (FLOW_DONE, first + k, 1))
                        for g, finish_s in enumerate(plan.cohort_finish_s):
                            add(now + finish_s, (COHORT_DONE, op, g))
                        if record or over or plan.over:  # port rates are seen (Engine._set_port_rates)
                            set_port_rates(plan.totals, now)
                        if dirty_ports:  # settled: nothing to re-share there
                            dirty_ports.difference_update(plan.ports)
                released.clear()
            if dirty_ports:
                reshare(now, dirty_ports, port_flows, f_rate, f_last, f_rem, f_ver, add)
                dirty_ports.clear()
            if not times:
                break
            now = times[0]
            if not batches & 15:  # the events pending, at every 16th batch
                heap_len_sum += sum(map(len, buckets.values()))
                sampled += 1
            batches += 1
            while times and times[0] == now:
                heappop(times)
                batch = buckets.pop(now)
                if sort_batches:
                    batch.sort()
                events += len(batch)
                for kind, item, tag in batch:
                    if kind == COMPUTE_DONE:
                        op = item
                        c = chip_of[op]
                        busy[c] = False
                        dirty_chips.add(c)
                        if flops_of is not None:
                            executed_flops[op] += flops_of(op)
                    elif kind != COMM_RELEASE:
                        if kind == FLOW_DONE:  # one flow at its current rate
                            if tag != f_ver[item]:  # re-shared since: a later event ends it
                                continue
                            flows = (item,)
                            op = flow_op[item]
                        else:  # COHORT_DONE: the flows of an op's plan that finish together
                            op = item
                            cohort = plans[spec[op]].cohorts[tag]
                            events += len(cohort) - 1   # an event per flow, as one each would be
                            first = flow_ptr[op]
                            # those still at their first rate (a re-shared one has its own event)
                            flows = [first + k for k in cohort if f_ver[first + k] == 1]
                            if not flows:
                                continue
                        for f in flows:
                            # done: no later event of this flow counts, and its rate, bytes left
                            # and last settle time stay as they are (Engine._add_delivered)
                            f_ver[f] = -1
                            flow_end_s[f] = now
                            route = routes[flow_route[f]]
                            for p in route:
                                port_flows[p].discard(f)
                            ended.append(route)
                        op_flows_left[op] -= len(flows)
                        if op_flows_left[op]:
                            continue
                    else:  # COMM_RELEASE: every flow of the op is injected; the op ends with the last
                        op = item
                        first, last = flow_ptr[op], flow_ptr[op + 1]
                        op_flows_left[op] = last - first
                        inj_mv[first:last] = fbytes[first:last]
                        if by_plan and first != last:
                            # its flows' bytes and times in slices, its ports' flow sets grouped
                            # by port: the same for every op of a spec (Engine._release_plan)
                            s = spec[op]
                            plan = plans.get(s)
                            if plan is None:
                                plan = plans[s] = release_plan(s, first, last)
                            if plan:
                                if last - first < BULK_FLOWS:
                                    for f in range(first, last):
                                        flow_start_s[f] = now
                                        f_last[f] = now
                                        for p in routes[flow_route[f]]:
                                            port_flows[p].add(f)
                                else:
                                    nows = array("d", [now]) * (last - first)
                                    flow_start_s[first:last] = nows
                                    f_last[first:last] = nows
                                    for p, offsets in plan.by_port:
                                        port_flows[p].update(map(first.__add__, offsets))
                                released.append(op)
                                continue
                        for f in (range(first, last) if release_flows is None else release_flows(op)):
                            flow_start_s[f] = now
                            f_last[f] = now
                            if fbytes[f] <= 0.0:
                                add(now, (FLOW_DONE, f, f_ver[f]))
                                continue
                            route = routes[flow_route[f]]
                            for p in route:
                                port_flows[p].add(f)
                            dirty_ports.update(route)
                        if first != last:
                            continue
                    # the op is done: release its successors
                    end_s[op] = now
                    executed[op] += 1
                    for v in (targets[bounds[op]:bounds[op + 1]] if successors is None else successors(op)):
                        remaining_preds[v] -= 1
                        if not remaining_preds[v]:
                            if is_comm[v]:
                                start_s[v] = now
                                add(now + spec_dur[spec[v]], (COMM_RELEASE, v, 0))
                            else:
                                heappush(ready[chip_of[v]], (now, v))
                                dirty_chips.add(chip_of[v])
        # close the port-excess integral
        self._set_port_rates([(p, 0.0) for p in sorted(over)], now)
        if flops_of is None and n:
            self._add_executed_flops()
        self._add_delivered(f_rem, f_rate, f_last)
        self.events, self.batches = events, batches
        self.mean_heap_len = heap_len_sum / sampled if sampled else 0.0
        ends = np.frombuffer(end_s, dtype=float) if n else np.zeros(0)
        done = ends[~np.isnan(ends)]
        self.makespan_s = float(done.max()) if len(done) else 0.0
        return self

    # ----------------------------------------------------------------------- helpers
    def _reshare(self, now, dirty_ports, port_flows, f_rate, f_last, f_rem, f_ver, add) -> None:
        """New rates for the connected sets of ports and active flows around ``dirty_ports``.

        Max-min fair rates depend only on the routes of a set's flows (capacities are fixed),
        and the same sets recur all run long (the flows of a ring step, of a collective), so
        each set's answer is kept by its routes: (rate per flow, total per port)."""
        routes, flow_route = self.dag.routes, self._flow_route
        answer_of, set_port_rates, shares = self._answer, self._set_port_rates, self._shares
        seen = self.record_port_rates or self._over  # port rates are seen (Engine._set_port_rates)
        one_route = self._settle_alone
        seen_ports: set = set()
        for start in sorted(dirty_ports):
            if start in seen_ports:
                continue
            # the connected set of ports and active flows around this port
            seen_ports.add(start)
            if not port_flows[start]:  # no flow left on the port
                if seen:
                    set_port_rates(((start, 0.0),), now)
                continue
            # the common set: flows on one route, alone on its ports (a ring step's sends
            # and the next step's, a lone flow): a set of their own
            here = port_flows[start]
            k = len(here)
            r = flow_route[next(iter(here))]
            route = routes[r]
            if one_route:
                for q in route:
                    if len(port_flows[q]) != k:
                        break
                else:
                    for f in here:
                        if flow_route[f] != r:
                            break
                    else:
                        route = None
            if route is None:
                seen_ports.update(routes[r])
                flows = sorted(here)
                key = (r,) * k
            else:  # any set: found port by port
                flows = sorted(_connected_set(start, port_flows, routes, flow_route, seen_ports))
                key = tuple([flow_route[f] for f in flows])
            rates, totals, over = shares.get(key) or answer_of(flows, key)
            # settle progress at the old rates, then apply the new ones (all positive)
            for f, new in zip(flows, rates):
                old = f_rate[f]
                if old:
                    rem = f_rem[f] - old * (now - f_last[f])
                    f_rem[f] = rem if rem > 0.0 else 0.0
                f_last[f] = now
                if new != old:
                    f_rate[f] = new
                    f_ver[f] += 1
                    add(now + f_rem[f] / new, (FLOW_DONE, f, f_ver[f]))
            if seen or over:
                set_port_rates(totals, now)
                seen = True

    def _add_delivered(self, f_rem: array, f_rate: array, f_last: array) -> None:
        """Each ended flow's delivered bytes, from the state it ended in: what its integrated
        rate left undelivered at its end, ``bytes left - rate x (end - last settle)``; within
        rounding of its size (``ROUNDING_BYTES_REL``, ``CLOCK_ROUNDING_REL``) it delivered
        exactly its bytes. The same floating-point operations, element by element, as at
        the flow's end; in blocks, to bound the memory."""
        n = len(f_rem)
        if not n:
            return
        as_np = partial(np.frombuffer, dtype=float)
        end_all, rem_all, rate_all, last_all = as_np(self.flow_end_s), as_np(f_rem), as_np(f_rate), as_np(f_last)
        nbytes_all, out = self.dag.flow_bytes, as_np(self.flow_delivered)
        for lo in range(0, n, DELIVERED_BLOCK):
            hi = min(lo + DELIVERED_BLOCK, n)
            ended = np.flatnonzero(~np.isnan(end_all[lo:hi])) + lo
            end, rate, nbytes = end_all[ended], rate_all[ended], nbytes_all[ended]
            residual = rem_all[ended] - rate * (end - last_all[ended])
            tolerance = ROUNDING_BYTES_REL * nbytes + rate * np.abs(end) * CLOCK_ROUNDING_REL + 1.0
            out[ended] = np.where(np.abs(residual) <= tolerance, nbytes, nbytes - residual)

    def _add_executed_flops(self) -> None:
        """Each compute op's FLOPs, added to ``executed_flops`` as many times as the run
        completed it (``executed``), as the loop would at each completion."""
        d = self.dag
        executed = np.frombuffer(self.executed, dtype=np.int32)
        per_op = d.spec_flops[d.spec]
        flops = np.frombuffer(self.executed_flops, dtype=float)
        once = executed == 1
        flops[once] += per_op[once]
        for op in np.flatnonzero(executed > 1).tolist():
            for _ in range(int(executed[op])):
                flops[op] += per_op[op]

    def _shared_plan(self, s: int, first: int, last: int):
        """:meth:`_release_plan` of spec ``s``'s op (flows ``first .. last - 1``), kept with
        the spec's lowering (:attr:`~g5core.sim.compile.CompiledDag.spec_plans`): a plan is
        a function of the lowering's flows (routes, bytes) and the topology's capacities
        alone, so every DAG compiled with that lowering on the topology (a prepared plan's
        cut models and steps) takes the one worked out first. Keyed on the fast paths'
        switches (a test turns them off)."""
        kept = self.dag.spec_plans[s]
        key = (self._settle_alone, self._keep_shares)
        plan = kept.get(key)
        if plan is None:
            plan = kept[key] = self._release_plan(first, last)
        return plan

    def _release_plan(self, first: int, last: int):
        """How the flows ``first .. last - 1`` of one comm op are released and settled, the
        same for every op of its spec (their routes and bytes are); ``()`` when a flow
        carries no bytes (those take the per-flow path).

        The settlement holds when the op's flows are alone on their ports: its connected sets
        are then sets of its own flows, found as :meth:`_reshare` finds them (from the
        lowest port up), and their rates are :meth:`_answer`'s."""
        d = self.dag
        nbytes = d.flow_bytes[first:last]
        if not bool((nbytes > 0.0).all()):
            return ()
        routes = d.routes
        route_ids = d.flow_route[first:last].tolist()
        by_port: dict = {}
        for k, r in enumerate(route_ids):
            for p in routes[r]:
                by_port.setdefault(p, []).append(k)
        ports = tuple(sorted(by_port))
        rates = array("d", bytes(8 * len(route_ids)))
        totals: list = []
        over = False
        seen: set = set()
        for start in ports:
            if start in seen:
                continue
            seen.add(start)
            ks = sorted(_connected_set(start, by_port, routes, route_ids, seen))
            answer, answer_totals, answer_over = self._answer([first + k for k in ks], tuple([route_ids[k] for k in ks]))
            over = over or answer_over
            for k, rate in zip(ks, answer):
                rates[k] = rate
            totals.extend(answer_totals)
        cohorts: dict = {}  # bytes over rate -> offsets of the flows that take that long
        for k, (b, r) in enumerate(zip(nbytes.tolist(), rates)):
            cohorts.setdefault(b / r, []).append(k)
        return _ReleasePlan(
            by_port=tuple((p, tuple(by_port[p])) for p in ports), ports=ports,
            counts=tuple((p, len(by_port[p])) for p in ports), rates=rates,
            versions=array("l", [1]) * len(route_ids),
            singles=tuple([(ks[0], t) for t, ks in cohorts.items() if len(ks) == 1]),
            cohorts=tuple([tuple(ks) for ks in cohorts.values() if len(ks) > 1]),
            cohort_finish_s=tuple([t for t, ks in cohorts.items() if len(ks) > 1]), totals=tuple(totals), over=over)

    def _answer(self, flows: Sequence[int], key: tuple) -> tuple:
        """(rate per flow, ((port, total rate), ...), whether a total is above its port's
        capacity) of one connected set: ``flows`` (by id) on the routes ``key``, kept by its
        routes. A flow alone runs at its route's narrowest capacity (what the progressive
        filling gives it). A flow given no bandwidth is an error."""
        shares = self._shares
        answer = shares.get(key)
        if answer is None:
            if len(shares) >= SHARES_KEPT:
                shares.clear()
            if len(flows) == 1 and self._settle_alone:
                rate = self._route_cap[key[0]]
                answer = (rate,), tuple([(q, rate) for q in sorted(self.dag.routes[key[0]])]), False
            else:
                rates, totals = self._share(flows, key)
                cap = self.dag.port_capacity
                answer = rates, totals, any(total > cap[q] for q, total in totals)
            for f, rate in zip(flows, answer[0]):
                if not rate > 0.0:
                    raise G5Error(f"engine: flow {f} got no bandwidth")
            if self._keep_shares:
                shares[key] = answer
        return answer

    def _set_port_rates(self, totals, now: float) -> None:
        """Each port ``p`` of ``totals`` ((port, bytes per second), ...) carries its total
        from ``now``: what it carried beyond its capacity since its rate last changed is
        added to the port excess, and the change is logged for traces.

        A port's rate is seen only there: when rates are not recorded and no port is or
        goes above its capacity (max-min shares never do), setting them changes nothing,
        and the loop leaves them unset."""
        over, cap = self._over, self.dag.port_capacity
        for p, total in totals:
            if p in over:
                rate, since = over.pop(p)
                self.port_excess_bytes += (rate - cap[p]) * (now - since)
            if total > cap[p]:
                over[p] = (total, now)
        if self.record_port_rates:
            rate, log = self._port_rate, self.port_rate_log
            for p, total in totals:
                if total != rate[p]:
                    log.append((now, p, total))
                    rate[p] = total

    def _share(self, flows: Sequence[int], route_ids: tuple) -> tuple:
        """(rate per flow of ``flows``, ((port, total rate), ...) in port order) for one
        connected set of flows (sorted) on their routes."""
        routes = self.dag.routes
        ports: dict = {}
        for f, r in zip(flows, route_ids):
            for q in routes[r]:
                ports.setdefault(q, []).append(f)
        ports = {q: ports[q] for q in sorted(ports)}
        rates = self._allocate(flows, ports)
        totals = []
        for q, fs in ports.items():
            total = 0.0
            for f in fs:
                total += rates[f]
            totals.append((q, total))
        return tuple(rates[f] for f in flows), tuple(totals)
