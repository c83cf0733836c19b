"""The compile step: the op DAG turned into the arrays the event engine reads.

:func:`compile_dag` asks the plugins for every compute op's duration (the one
:class:`~g5core.sim.compute.LatencyLookup`) and every communication op's lowering into flows
(:func:`g5core.lower.collective.lower_op`) once, before the run; :class:`CompiledDag` holds
the result as numpy columns per op, per flow and per spec, with each op's successors, the
DAG checked acyclic.
"""
from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import Optional

import attrs
import networkx as nx
import numpy as np

from g5core.api.errors import DagError
from g5core.lower.collective import lower_op
from g5core.lower.dag import OpDag
from g5core.lower.topology import Topology
from g5core.sim.compute import LatencyLookup


class TableView(Sequence):
    """A per-item column stored as ids into a table of distinct values: ``view[i]`` is
    ``table[ids[i]]`` (a comm op's algorithm, a flow's route: few distinct values, many items)."""

    __slots__ = ("table", "ids")

    def __init__(self, table: tuple, ids: np.ndarray):
        self.table, self.ids = table, ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.table[k] for k in self.ids[i].tolist()]
        return self.table[self.ids[i]]

    def __iter__(self):
        table = self.table
        return (table[k] for k in self.ids.tolist())


def _per_op(column: str, doc: str) -> property:
    """A per-op array made from the per-spec ``column`` through each op's spec."""
    return property(lambda self: getattr(self, column)[self.spec], doc=f"Per op: {doc}.")


@attrs.frozen(eq=False, kw_only=True)
class CompiledDag:
    """The DAG as the engine runs it: numpy columns (struct of arrays), index = op id (the
    order of ``OpDag.ops``) or flow id. What is alike for every op of one spec (its
    duration, FLOPs, lowering: :attr:`OpDag.specs`) is stored once per spec and read through
    ``spec``; few distinct values (a flow's route, a comm op's algorithm) are stored once in
    a table and referenced by id."""

    n_chips: int
    source: OpDag = attrs.field(repr=False)   # the DAG compiled (keys, error messages)
    spec: np.ndarray             # int32 per op: its spec (a view of ``OpDag.spec``)
    chip: np.ndarray             # int32 per op: chip of a compute op, -1 for comm (a view of ``OpDag.chip``)
    succ: "Successors"           # successor ids per op (succ[i]), CSR
    pred_count: np.ndarray       # int32 per op: distinct predecessors
    flow_ptr: np.ndarray         # int32 per op (int64 past 2**31 flows): first flow; flow_ptr[n] = total flows
    flow_op: np.ndarray          # int32 per flow: the comm op it belongs to
    flow_src: np.ndarray         # int32 chip
    flow_dst: np.ndarray
    flow_route: np.ndarray       # int32 per flow: id into ``routes``
    routes: tuple                # distinct routes: each a tuple of resource ids (ports)
    flow_bytes: np.ndarray       # float64
    port_capacity: tuple         # per resource id: bytes per second
    algos: tuple                 # (algorithm, protocol, channels) of a comm op; algos[0] == () (compute)
    # per spec
    spec_is_comm: np.ndarray     # bool
    spec_duration_s: np.ndarray  # compute: duration; comm: start latency
    spec_flops: np.ndarray       # compute FLOPs (0 for comm)
    spec_algo: np.ndarray        # int64: id into ``algos``
    spec_wire: np.ndarray        # wire bytes per payload byte of a comm op (1.0 for compute)
    spec_answer: np.ndarray      # int64: compute: id of its answer in ``compute.answers``; -1 for comm
    compute: LatencyLookup = attrs.field(default=None, repr=False)  # where each compute time came from
    #: per spec: a comm op's lowering's release plans (:meth:`g5core.sim.engine.Engine._release_plan`,
    #: a dict the engine fills), shared by every DAG compiled with that lowering on the same
    #: topology (a prepared plan's steps and cut models); None for compute
    spec_plans: tuple = attrs.field(default=(), repr=False)

    @property
    def n_ops(self) -> int:
        return len(self.spec)

    @property
    def keys(self):
        """Op keys (made when read: :attr:`OpDag.keys`)."""
        return self.source.keys

    # per-op columns, made from the per-spec ones when read (a new array each time)
    is_comm = _per_op("spec_is_comm", "bool per op")
    duration_s = _per_op("spec_duration_s", "compute: duration; comm: start latency")
    flops = _per_op("spec_flops", "compute FLOPs (0 for comm)")
    comm_algo_id = _per_op("spec_algo", "id into ``algos``")
    wire_factor = _per_op("spec_wire", "wire bytes per payload byte of a comm op (1.0 for compute)")
    compute_answer = _per_op("spec_answer", "id of a compute op's answer in ``compute.answers``; -1 for comm")

    @property
    def flow_ports(self) -> TableView:
        """Per flow: the resource ids of its route."""
        return TableView(self.routes, self.flow_route)

    @property
    def comm_algo(self) -> TableView:
        """Per op: (algorithm, protocol, channels) of a comm op, () for compute."""
        return TableView(self.algos, self.comm_algo_id)


#: the comm lowerings a latency lookup keeps per topology (and topologies it keeps them for)
LOWERINGS_KEPT = 4096


def compile_dag(dag: OpDag, plan, edges: Optional[tuple] = None) -> CompiledDag:
    """:func:`compile_ops` of a prepared run's DAG (``plan``: g5core.lower.builder.Plan),
    with the plan's compute-latency lookup where it keeps one (a prepared plan's, shared by
    its steps); ``edges`` as :func:`compile_ops` takes them."""
    ctx = plan.ctx
    return compile_ops(dag, topology=ctx.topology, primitives=plan.primitives, hooks=plan.hooks, system=ctx.system,
                       deployment=ctx.deployment, lookup=plan.lookup, edges=edges)


def compile_ops(dag: OpDag, *, topology: Topology, primitives: Mapping, hooks, system, deployment,
                lookup: Optional[LatencyLookup] = None, edges: Optional[tuple] = None) -> CompiledDag:
    """Ask the plugins once per distinct op (spec) for durations and lowerings; validate;
    return columns made with numpy from the per-spec answers (no Python work per op).
    Edges are de-duplicated and turned into successor lists. ``primitives`` are the
    lowerings (g5core.lower.collective.collect_primitives); ``hooks``, ``system`` and
    ``deployment`` answer the compute latencies (a DAG of comm ops only needs none), through
    ``lookup`` when given (its cache kept), else a fresh lookup. ``edges``, when given, are
    the successor lists (``(succ, pred_count)`` of a compiled DAG with the same ops and
    edges, already checked acyclic: a prepared plan's DAG reused for another step)."""
    topo = topology
    n = len(dag)
    compute = lookup or LatencyLookup(hooks=hooks, system=system, deployment=deployment)
    answer_id, answers = compute.answer_id, compute.answers
    spec = dag.spec_array()
    n_specs = len(dag.specs)
    used, at = np.unique(spec, return_index=True)
    # per distinct op (spec): compute (answer id, duration, FLOPs), or the comm op's lowering
    s_comm = np.zeros(n_specs, dtype=bool)
    s_dur = np.zeros(n_specs)
    s_flops = np.zeros(n_specs)
    s_answer = np.full(n_specs, -1, dtype=np.int64)
    s_algo = np.zeros(n_specs, dtype=np.int64)
    s_wire = np.ones(n_specs)
    s_nflows = np.zeros(n_specs, dtype=np.int64)
    s_fstart = np.zeros(n_specs, dtype=np.int64)
    algo_ids: dict = {(): 0}
    route_ids: dict = {}
    t_src: list = []
    t_dst: list = []
    t_bytes: list = []
    t_route: list = []
    # (primitive, group, bytes per rank) -> (template flow start, count, latency, algo, wire, release plans)
    lowering_cache: dict = {}
    s_plans: list = [None] * n_specs
    # the lowerings of earlier runs on this topology with these primitives (a prepared
    # plan's steps and cut models share the lookup): a lowering depends on nothing else
    mine = compute.lowerings.get((id(topo), id(primitives)))
    if mine is None:
        if len(compute.lowerings) >= LOWERINGS_KEPT:
            compute.lowerings.clear()
        mine = compute.lowerings[(id(topo), id(primitives))] = (topo, primitives, {})
    lowered_before = mine[2]
    for s, first in zip(used.tolist(), at.tolist()):
        p = dag.specs[s]
        if not dag.spec_is_comm[s]:
            a = answer_id(dag.op(first))
            s_answer[s], s_dur[s], s_flops[s] = a, answers[a].seconds, float(p.flops)
            continue
        s_comm[s] = True
        key = (p.primitive, p.group, p.bytes_per_rank)
        low = lowering_cache.get(key)
        if low is None:
            got = lowered_before.get(key)
            if got is None:
                lowered, flows = lower_op(dag.op(first), primitives, topo)
                got = (flows, float(lowered.latency_s), (lowered.algorithm, lowered.protocol, lowered.channels),
                       float(lowered.wire_bytes_per_payload_byte), {})
                if len(lowered_before) < LOWERINGS_KEPT:
                    lowered_before[key] = got
            flows, latency_s, algo, wire, plans = got
            low = lowering_cache[key] = (len(t_src), len(flows), latency_s, algo_ids.setdefault(algo, len(algo_ids)),
                                         wire, plans)
            for src, dst, nbytes, route in flows:
                t_src.append(src)
                t_dst.append(dst)
                t_bytes.append(nbytes)
                t_route.append(route_ids.setdefault(route, len(route_ids)))
        s_fstart[s], s_nflows[s], s_dur[s], s_algo[s], s_wire[s], s_plans[s] = low
    counts = s_nflows[spec]
    flow_ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=flow_ptr[1:])
    i32 = np.int32 if max(n, int(flow_ptr[-1])) < 2 ** 31 else np.int64  # ids of ops and flows
    flow_op = np.repeat(np.arange(n, dtype=i32), counts)
    # each flow's row in the per-spec template: its op's first template flow + its rank in the op
    t_index = s_fstart[spec[flow_op]] + (np.arange(len(flow_op), dtype=np.int64) - flow_ptr[flow_op])
    if edges is None:
        succ, pred_count = _successor_lists(dag.edge_array(), n)
        _check_acyclic(dag, succ, pred_count)
    else:
        succ, pred_count = edges
    return CompiledDag(
        n_chips=topo.chips, source=dag, spec=spec,
        chip=dag.chip_array(),
        succ=succ, pred_count=pred_count, flow_ptr=flow_ptr.astype(i32),
        flow_op=flow_op, flow_src=np.asarray(t_src, dtype=i32)[t_index], flow_dst=np.asarray(t_dst, dtype=i32)[t_index],
        flow_route=np.asarray(t_route, dtype=i32)[t_index], routes=tuple(route_ids),
        flow_bytes=np.asarray(t_bytes, dtype=float)[t_index], port_capacity=topo.capacities(), algos=tuple(algo_ids),
        spec_is_comm=s_comm, spec_duration_s=s_dur, spec_flops=s_flops, spec_algo=s_algo, spec_wire=s_wire,
        spec_answer=s_answer, compute=compute, spec_plans=tuple(s_plans),
    )


class Successors:
    """Successor ids per op, stored flat (CSR): ``succ[i]`` is op ``i``'s successors, in
    ascending id order."""

    __slots__ = ("targets", "bounds")

    def __init__(self, targets: array, bounds: array):
        self.targets, self.bounds = targets, bounds

    def __getitem__(self, i: int) -> array:
        b = self.bounds
        return self.targets[b[i]:b[i + 1]]

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def targets_array(self) -> np.ndarray:
        dtype = np.int32 if self.targets.typecode == "i" else np.int64
        return np.frombuffer(self.targets, dtype=dtype) if len(self.targets) else np.zeros(0, dtype=dtype)

    def bounds_array(self) -> np.ndarray:
        return np.frombuffer(self.bounds, dtype=np.int32 if self.bounds.typecode == "i" else np.int64)


def _successor_lists(edges, n: int) -> tuple[Successors, np.ndarray]:
    """(successors per op, predecessor count per op) of the distinct edges, each op's
    successors in ascending id order (the engine's event order does not depend on the
    order it releases successors in: its event key is the time, the kind and the id). Ids
    are int32 below 2**31 ops."""
    ids = np.int32 if n < 2 ** 31 else np.int64
    e = np.asarray(edges).reshape(-1, 2)
    u, v = e[:, 0].astype(ids), e[:, 1].astype(ids)  # contiguous copies
    order = np.lexsort((v, u))
    u, v = u[order], v[order]
    del order
    distinct = np.ones(len(u), dtype=bool)
    distinct[1:] = (u[1:] != u[:-1]) | (v[1:] != v[:-1])
    u, v = u[distinct], v[distinct]
    del distinct
    code = "i" if ids is np.int32 else "q"
    targets = array(code, v.tobytes())
    bounds = array(code, np.searchsorted(u, np.arange(n + 1, dtype=ids)).astype(ids).tobytes())
    pred_count = np.bincount(v, minlength=n).astype(np.int32)
    return Successors(targets, bounds), pred_count


def _check_acyclic(dag: OpDag, succ: Successors, pred_count: np.ndarray) -> None:
    """DagError naming a cycle's op and plugin, unless every op can be ordered (Kahn's
    algorithm a frontier at a time, in numpy)."""
    targets, bounds = succ.targets_array(), succ.bounds_array()
    remaining = pred_count.copy()
    frontier = np.flatnonzero(remaining == 0)
    seen = 0
    while len(frontier):
        seen += len(frontier)
        lo, hi = bounds[frontier], bounds[frontier + 1]
        counts = hi - lo
        total = int(counts.sum())
        if not total:
            break
        # the successors of the whole frontier, gathered from the CSR rows
        starts = np.repeat(lo - np.cumsum(counts) + counts, counts)
        nxt = targets[starts + np.arange(total, dtype=np.int64)]
        ids, dec = np.unique(nxt, return_counts=True)
        remaining[ids] -= dec
        frontier = ids[remaining[ids] == 0]
    if seen != len(remaining):
        cycle = nx.find_cycle(dag.graph)
        key = cycle[0][0]
        owner = dag.owner(dag.index[key])
        path = " -> ".join(u for u, _ in cycle[:6])
        raise DagError(f"the op DAG has a cycle through {key!r} (made by plugin '{owner}'): {path} ...")
