"""The discrete-event engine: per-chip compute streams and max-min fair flows on ports.

The engine sees arrays, not hooks: :func:`compile_dag` asks the plugins for every compute
op's duration and every communication op's lowering once, before the run, and the event
loop then touches only lists of numbers.

Model:
- each chip has one compute stream: one op at a time; among ready ops it starts the one
  that became ready first, ties broken by op id: the order the build added the ops, which
  is program order (layer by layer, as a framework issues its kernels);
- a communication op starts when all its predecessors are done, waits its start latency,
  then releases its flows; each flow crosses the resources (ports) of its route (a chip's
  link send or receive side, a NIC's, a fabric tier's: :mod:`g5core.topology`), and the
  flows on a resource share it max-min fairly; rates are recomputed (per connected set of
  resources and flows) whenever a flow starts or ends; the op ends with its last flow;
- the heap key ``(time, priority, sequence number)`` is the only event order; a negative
  delay is an error.
"""
from __future__ import annotations

import heapq
import math
from array import array
from typing import Sequence

import attrs
import numpy as np

from .collective import lower_op
from .compute import LatencyLookup
from .topology import Topology
from .dag import OpDag
from .errors import DagError, G5Error

# A flow that ends with |bytes left| below this fraction of its size delivered everything:
# the difference is floating-point rounding of the rate integral, not lost data.
ROUNDING_BYTES_REL = 1e-9
# ... or below what its rate carries in this fraction of the current time: late in a long
# run the clock itself rounds (a double near 2e9 s steps by 5e-7 s), and a fast flow moves
# many bytes in one step of the clock.
ROUNDING_TIME_REL = 1e-12

# Event priorities at equal time (lower first).
_COMPUTE_DONE, _FLOW_DONE, _COMM_RELEASE = 0, 1, 2


@attrs.frozen
class CompiledDag:
    """The DAG as the engine runs it. Lists, index = op id (same order as ``OpDag.ops``)."""

    n_chips: int
    keys: tuple
    is_comm: tuple          # bool per op
    chip: tuple             # chip of a compute op, -1 for comm
    duration_s: tuple       # compute: duration; comm: start latency
    flops: tuple            # compute FLOPs (0 for comm)
    succ: "Successors"      # successor ids per op (succ[i])
    pred_count: tuple
    edges_u: np.ndarray
    edges_v: np.ndarray
    flow_ptr: tuple         # per op: first flow index; flow_ptr[n] = total flows
    flow_op: tuple          # per flow: the comm op it belongs to
    flow_src: tuple         # chip
    flow_dst: tuple
    flow_ports: tuple       # per flow: the resource ids (ports) of its route
    flow_bytes: tuple
    port_capacity: tuple    # per resource id: bytes per second
    comm_algo: tuple = ()   # per op: (algorithm, protocol, channels) of a comm op, () for compute
    wire_factor: tuple = () # per op: wire bytes per payload byte of a comm op (1.0 for compute)
    compute: LatencyLookup = attrs.field(default=None, repr=False)  # where each compute time came from
    compute_answer: tuple = ()  # per op: id of its answer in ``compute.answers`` (-1 for comm)


def compile_dag(dag: OpDag, plan) -> CompiledDag:
    """Ask the plugins once per distinct op for durations and lowerings; validate; return
    arrays. Edges are de-duplicated and turned into successor lists with numpy, keeping each
    op's successors in the order their edges were first made."""
    ctx = plan.ctx
    topo: Topology = ctx.topology
    hooks = plan.hooks
    n = len(dag)
    compute = LatencyLookup(hooks, ctx.system, ctx.deployment)
    # per distinct op (spec): compute (answer id, duration, FLOPs), or the comm op's lowering
    per_spec: list = []
    lowering_cache: dict = {}
    answer_id, answers = compute.answer_id, compute.answers
    used, at = np.unique(np.frombuffer(dag.spec, dtype=np.int64), return_index=True) if n else ((), ())
    first = dict(zip(used.tolist(), at.tolist())) if n else {}  # the first op of each spec in use
    for s, (spec, comm) in enumerate(zip(dag.specs, dag.spec_is_comm)):
        if s not in first:
            per_spec.append(None)
        elif not comm:
            a = answer_id(dag.op(first[s]))
            per_spec.append((a, answers[a][2], float(spec[5])))
        else:
            key = (spec[0], spec[1], spec[5])
            low = lowering_cache.get(key)
            if low is None:
                lowered, flows = lower_op(dag.op(first[s]), plan.primitives, topo)
                low = lowering_cache[key] = (
                    float(lowered.latency_s), (lowered.algorithm, lowered.protocol, lowered.channels),
                    float(lowered.wire_bytes_per_payload_byte), len(flows),
                    [f[0] for f in flows], [f[1] for f in flows], [f[2] for f in flows], [f[3] for f in flows])
            per_spec.append(low)
    spec_is_comm = dag.spec_is_comm
    chip_int = list(range(max(dag.chip, default=-1) + 1))  # one int object per chip id, shared by its ops
    is_comm, chip, dur, fl = [False] * n, [-1] * n, [0.0] * n, [0.0] * n
    flow_ptr = [0] * (n + 1)
    fsrc, fdst, fports, fbytes, fop = [], [], [], [], []
    algo: list = [()] * n
    wire: list = [1.0] * n
    answer = [-1] * n
    n_flows = 0
    for i, (s, c) in enumerate(zip(dag.spec, dag.chip)):
        flow_ptr[i] = n_flows
        low = per_spec[s]
        if not spec_is_comm[s]:
            answer[i], dur[i], fl[i] = low
            chip[i] = chip_int[c] if c >= 0 else c
        else:
            is_comm[i] = True
            dur[i], algo[i], wire[i], count = low[0], low[1], low[2], low[3]
            if count:
                fsrc += low[4]; fdst += low[5]; fbytes += low[6]; fports += low[7]
                fop += [i] * count
                n_flows += count
    flow_ptr[n] = n_flows
    eu, ev, succ, pred_count = _successor_lists(np.frombuffer(dag.edge_pairs, dtype=np.int64) if len(dag.edge_pairs) else (), n)
    keys = tuple(dag.keys)
    _check_acyclic(dag, succ, pred_count)
    return CompiledDag(
        n_chips=topo.chips, keys=keys, is_comm=tuple(is_comm), chip=tuple(chip), duration_s=tuple(dur),
        flops=tuple(fl), succ=succ,
        pred_count=tuple(pred_count), edges_u=eu, edges_v=ev,
        flow_ptr=tuple(flow_ptr), flow_op=tuple(fop), flow_src=tuple(fsrc), flow_dst=tuple(fdst),
        flow_ports=tuple(fports), flow_bytes=tuple(fbytes), port_capacity=topo.capacities(), comm_algo=tuple(algo),
        wire_factor=tuple(wire), compute=compute, compute_answer=tuple(answer),
    )


class Successors:
    """Successor ids per op, stored flat (CSR): ``succ[i]`` is op ``i``'s successors, in the
    order their edges were first made."""

    __slots__ = ("targets", "bounds")

    def __init__(self, targets: array, bounds: array):
        self.targets, self.bounds = targets, bounds

    def __getitem__(self, i: int) -> array:
        b = self.bounds
        return self.targets[b[i]:b[i + 1]]

    def __len__(self) -> int:
        return len(self.bounds) - 1


def _successor_lists(edges, n: int):
    """(edges_u, edges_v, successors per op, predecessor count per op) of the distinct
    edges, in the order each was first made."""
    e = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    _, first = np.unique(e[:, 0] * n + e[:, 1], return_index=True)
    first.sort()
    eu, ev = e[first, 0], e[first, 1]
    order = np.argsort(eu, kind="stable")
    targets = array("q", ev[order].tobytes())
    bounds = array("q", np.searchsorted(eu[order], np.arange(n + 1)).astype(np.int64).tobytes())
    pred_count = np.bincount(ev, minlength=n).tolist()
    return eu, ev, Successors(targets, bounds), pred_count


def _check_acyclic(dag: OpDag, succ, pred_count) -> None:
    remaining = list(pred_count)
    stack = [i for i, c in enumerate(remaining) if c == 0]
    seen = 0
    while stack:
        u = stack.pop()
        seen += 1
        for v in succ[u]:
            remaining[v] -= 1
            if remaining[v] == 0:
                stack.append(v)
    if seen != len(remaining):
        import networkx as nx

        cycle = nx.find_cycle(dag.graph)
        key = cycle[0][0]
        owner = dag.owner(dag.index[key])
        path = " -> ".join(u for u, _ in cycle[:6])
        raise DagError(f"the op DAG has a cycle through {key!r} (made by plugin '{owner}'): {path} ...")


@attrs.define(eq=False)
class Engine:
    """One simulation. All state lives on the instance; run it once."""

    dag: CompiledDag
    record_port_rates: bool = False   # keep (time, port, bytes/s) for every rate change (traces)
    # results, filled by run()
    start_s: list = attrs.field(factory=list)
    end_s: list = attrs.field(factory=list)
    executed: list = attrs.field(factory=list)
    executed_flops: list = attrs.field(factory=list)
    flow_start_s: list = attrs.field(factory=list)
    flow_end_s: list = attrs.field(factory=list)
    flow_injected: list = attrs.field(factory=list)   # bytes per flow when it started
    flow_delivered: list = attrs.field(factory=list)  # bytes per flow when it ended
    port_excess_bytes: float = 0.0
    port_rate_log: list = attrs.field(factory=list)
    events: int = 0
    makespan_s: float = 0.0

    # ---------------------------------------------------------------- overridable seams
    # Tests subclass the engine and break one of these to show each KPI can fail.
    def _allocate(self, flows: Sequence[int], ports: dict) -> dict:
        """Max-min fair rates (progressive filling) for one connected set of flows."""
        cap_rem = {p: self.dag.port_capacity[p] for p in ports}
        count = {p: len(fs) for p, fs in ports.items()}  # insertion order = sorted port order
        rate: dict = {}
        flow_ports = self.dag.flow_ports
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
                for q in flow_ports[f]:
                    cap_rem[q] = max(cap_rem[q] - best_share, 0.0)
                    count[q] -= 1
        return rate

    def _release_flows(self, op: int) -> range:
        return range(self.dag.flow_ptr[op], self.dag.flow_ptr[op + 1])

    def _may_start(self, op: int) -> bool:
        return True

    def _flops_of(self, op: int) -> float:
        return self.dag.flops[op]

    def _successors(self, op: int):
        return self.dag.succ[op]

    # ---------------------------------------------------------------------------- run
    def run(self) -> "Engine":
        d = self.dag
        n = len(d.keys)
        n_flows = len(d.flow_bytes)
        n_ports = len(d.port_capacity)
        self.start_s = [math.nan] * n
        self.end_s = [math.nan] * n
        self.executed = [0] * n
        self.executed_flops = [0.0] * n
        self.flow_start_s = [math.nan] * n_flows
        self.flow_end_s = [math.nan] * n_flows
        self.flow_injected = [0.0] * n_flows
        self.flow_delivered = [0.0] * n_flows
        self.port_rate_log = []
        remaining_preds = list(d.pred_count)
        heap: list = []
        seq = 0
        ready = [[] for _ in range(d.n_chips)]   # per chip heap of (ready_time, op id)
        busy = [False] * d.n_chips
        dirty_chips: set = set()
        # flow state
        f_rem = list(d.flow_bytes)
        f_rate = [0.0] * n_flows
        f_last = [0.0] * n_flows
        f_ver = [0] * n_flows
        f_done = [False] * n_flows
        op_flows_left = [0] * n
        port_flows: list[set] = [set() for _ in range(n_ports)]
        port_rate = [0.0] * n_ports
        port_since = [0.0] * n_ports
        dirty_ports: set = set()
        flow_ports, fbytes, flow_op = d.flow_ports, d.flow_bytes, d.flow_op
        is_comm, chip_of, dur, keys = d.is_comm, d.chip, d.duration_s, d.keys
        cap = d.port_capacity
        events = 0
        now = 0.0
        # the result lists and seams, bound once (the loop below runs once per event)
        start_s, end_s, executed, executed_flops = self.start_s, self.end_s, self.executed, self.executed_flops
        flow_start_s, flow_injected = self.flow_start_s, self.flow_injected
        successors, flops_of, may_start = self._successors, self._flops_of, self._may_start
        release_flows, complete_flow = self._release_flows, self._complete_flow
        heappush, heappop = heapq.heappush, heapq.heappop

        def push(t: float, prio: int, item: int, version: int = 0) -> None:
            nonlocal seq
            if t < now:
                raise G5Error(f"engine: negative delay scheduling event at {t} < now {now}")
            heappush(heap, (t, prio, seq, item, version))
            seq += 1

        def make_ready(op: int, t: float) -> None:
            if is_comm[op]:
                start_s[op] = t
                push(t + dur[op], _COMM_RELEASE, op)
            else:
                heappush(ready[chip_of[op]], (t, op))
                dirty_chips.add(chip_of[op])

        # the successors straight from the CSR arrays, unless a subclass overrides the seam
        direct = type(self)._successors is Engine._successors and isinstance(d.succ, Successors)
        targets, bounds = (d.succ.targets, d.succ.bounds) if direct else ((), ())

        def finish(op: int, t: float) -> None:
            end_s[op] = t
            executed[op] += 1
            for v in (targets[bounds[op]:bounds[op + 1]] if direct else successors(op)):
                remaining_preds[v] -= 1
                if remaining_preds[v] == 0:
                    make_ready(v, t)

        for op in range(n):
            if remaining_preds[op] == 0:
                make_ready(op, 0.0)

        flow_ptr = d.flow_ptr
        while True:
            # start compute on idle chips, then re-share the ports whose flow set changed
            for c in sorted(dirty_chips):
                if not busy[c] and ready[c]:
                    _, op = heappop(ready[c])
                    if not may_start(op):
                        continue
                    busy[c] = True
                    start_s[op] = now
                    push(now + dur[op], _COMPUTE_DONE, op)
            dirty_chips.clear()
            if dirty_ports:
                self._reshare(now, dirty_ports, port_flows, port_rate, port_since, f_rate, f_last, f_rem, f_ver, push)
                dirty_ports.clear()
            if not heap:
                break
            now = heap[0][0]
            while heap and heap[0][0] == now:
                t, prio, _, item, version = heappop(heap)
                events += 1
                if prio == _COMPUTE_DONE:
                    busy[chip_of[item]] = False
                    dirty_chips.add(chip_of[item])
                    executed_flops[item] += flops_of(item)
                    finish(item, t)
                elif prio == _FLOW_DONE:
                    f = item
                    if version != f_ver[f] or f_done[f]:
                        continue
                    complete_flow(f, t, f_rate, f_last, f_rem, f_done)
                    for p in flow_ports[f]:
                        port_flows[p].discard(f)
                        dirty_ports.add(p)
                    op = flow_op[f]
                    op_flows_left[op] -= 1
                    if op_flows_left[op] == 0:
                        finish(op, t)
                else:  # _COMM_RELEASE: every flow of the op is injected; the op ends with the last
                    op = item
                    first, last = flow_ptr[op], flow_ptr[op + 1]
                    op_flows_left[op] = last - first
                    for f in range(first, last):
                        flow_injected[f] = fbytes[f]
                    if first == last:
                        finish(op, t)
                    for f in release_flows(op):
                        flow_start_s[f] = t
                        f_last[f] = t
                        if fbytes[f] <= 0.0:
                            push(t, _FLOW_DONE, f, f_ver[f])
                            continue
                        for p in flow_ports[f]:
                            port_flows[p].add(f)
                            dirty_ports.add(p)
        # close the port-excess integral
        for p in range(n_ports):
            if port_rate[p] > cap[p]:
                self.port_excess_bytes += (port_rate[p] - cap[p]) * (now - port_since[p])
        self.events = events
        ends = [e for e in self.end_s if e == e]
        self.makespan_s = max(ends) if ends else 0.0
        return self

    # ----------------------------------------------------------------------- helpers
    def _complete_flow(self, f, t, f_rate, f_last, f_rem, f_done) -> None:
        # what the integrated rate left undelivered; within rounding of the flow's size the
        # flow delivered exactly its bytes
        residual = f_rem[f] - f_rate[f] * (t - f_last[f])
        nbytes = self.dag.flow_bytes[f]
        tolerance = ROUNDING_BYTES_REL * nbytes + f_rate[f] * abs(t) * ROUNDING_TIME_REL + 1.0
        self.flow_delivered[f] = nbytes if abs(residual) <= tolerance else nbytes - residual
        f_rem[f] = 0.0
        f_done[f] = True
        f_rate[f] = 0.0
        self.flow_end_s[f] = t

    def _reshare(self, now, dirty_ports, port_flows, port_rate, port_since, f_rate, f_last, f_rem, f_ver, push) -> None:
        flow_ports = self.dag.flow_ports
        cap = self.dag.port_capacity
        seen_ports: set = set()
        for start in sorted(dirty_ports):
            if start in seen_ports:
                continue
            # the connected set of ports and active flows around this port
            seen_ports.add(start)
            here = port_flows[start]
            route = None
            if len(here) == 1:
                (f,) = here
                route = flow_ports[f]
                for q in route:
                    if len(port_flows[q]) != 1:
                        route = None
                        break
            if not here:  # no flow left on the port
                comp_ports, flows, rates = (start,), (), {}
            elif route is not None:
                # the common case, one flow alone on every port of its route: its own
                # component, with its ports in the order the search below finds them
                comp_ports = [start] + [q for q in route if q != start]
                seen_ports.update(route)
                flows, rates = (f,), {f: min(cap[q] for q in route)}
            else:
                comp_ports = [start]
                stack = [start]
                comp_flows: set = set()
                while stack:
                    p = stack.pop()
                    for f in port_flows[p]:
                        if f in comp_flows:
                            continue
                        comp_flows.add(f)
                        for q in flow_ports[f]:
                            if q not in seen_ports:
                                seen_ports.add(q)
                                comp_ports.append(q)
                                stack.append(q)
                if len(comp_flows) == 1:
                    (f,) = comp_flows
                    flows = (f,)
                    rates = {f: min(cap[q] for q in flow_ports[f])}
                else:
                    flows = sorted(comp_flows)
                    comp_ports.sort()
                    ports = {p: sorted(port_flows[p]) for p in comp_ports}
                    rates = self._allocate(flows, ports)
            # settle progress at the old rates, then apply the new ones
            for f in flows:
                old = f_rate[f]
                if old:
                    f_rem[f] -= old * (now - f_last[f])
                    if f_rem[f] < 0.0:
                        f_rem[f] = 0.0
                f_last[f] = now
                new = rates[f]
                if new != old:
                    if new <= 0.0:
                        raise G5Error(f"engine: flow {f} got no bandwidth")
                    f_rate[f] = new
                    f_ver[f] += 1
                    push(now + f_rem[f] / new, _FLOW_DONE, f, f_ver[f])
            for p in comp_ports:
                if port_rate[p] > cap[p]:
                    self.port_excess_bytes += (port_rate[p] - cap[p]) * (now - port_since[p])
                total = 0.0
                for f in port_flows[p]:
                    total += rates[f]
                if self.record_port_rates and total != port_rate[p]:
                    self.port_rate_log.append((now, p, total))
                port_rate[p] = total
                port_since[p] = now
