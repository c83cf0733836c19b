"""What a run produced: latency, conservation KPIs, communication by cause, overlap."""
from __future__ import annotations

import math
from typing import Any, Optional

import attrs
import numpy as np

from g5core.inputs.step import phase_metrics
from g5core.sim.compute import coverage_from_columns, exact_sum_repeated
from g5core.lower.dag import OpDag
from g5core.sim.engine import Engine
from g5core.sim.compile import CompiledDag
from g5core.api.errors import ConservationError
from g5core.lower.symmetry import WHOLE_RUN, Symmetry
from g5core.lower.topology import KIND_NAMES

# Sums of intervals (comm time, its exposed part) agree with one another to about this
# fraction of their size: closer than this they are equal, the difference float rounding.
INTERVAL_SUM_ROUNDING_REL = 1e-9
# A port's rate is a float sum of its flows' shares, so it may exceed the capacity by a few
# ulps; over a very long run that rounding adds up to whole bytes. Excess below this
# fraction of what all ports can carry in the run is rounding, not a violation.
ROUNDING_PORT_REL = 1e-12

KPI_NAMES = (
    "ops_not_executed_once",
    "ops_started_before_predecessor_finished",
    "bytes_injected_minus_delivered",
    "dag_flops_minus_executed_flops",
    "port_bytes_beyond_capacity",
    "overlapping_compute_intervals",
)


def conservation_kpis(engine: Engine) -> dict[str, float]:
    """The six engine invariants, computed from what the engine recorded (each must be 0).

    Byte and port KPIs are whole bytes (floating-point rounding below one byte, or for ports
    below ROUNDING_PORT_REL of the run's whole port capacity, is not a violation); the FLOP
    KPI compares exactly-rounded sums (``math.fsum``) of the DAG's and the executed FLOPs.
    """
    d = engine.dag
    executed = np.asarray(engine.executed, dtype=np.int64)
    start = np.asarray(engine.start_s, dtype=float)
    end = np.asarray(engine.end_s, dtype=float)
    not_once = int(np.count_nonzero(executed != 1))
    early = _early_starts(d, start, end)
    byte_gap = math.fsum(engine.flow_injected) - math.fsum(engine.flow_delivered)
    bytes_kpi = int(math.floor(abs(byte_gap))) if math.isfinite(byte_gap) else -1
    per_spec = np.bincount(d.spec, minlength=len(d.spec_flops)).tolist() if d.n_ops else []
    flops_kpi = exact_sum_repeated(zip(d.spec_flops.tolist(), per_spec)) - math.fsum(engine.executed_flops)
    allowance = ROUNDING_PORT_REL * math.fsum(d.port_capacity) * engine.makespan_s
    port_kpi = int(math.floor(engine.port_excess_bytes)) if engine.port_excess_bytes > allowance else 0
    comp = np.flatnonzero(~d.is_comm & ~np.isnan(start))
    overlap = 0
    if len(comp):
        o = comp[np.lexsort((end[comp], start[comp], d.chip[comp]))]
        del comp
        c, s, e = d.chip[o], start[o], end[o]
        overlap = int(np.count_nonzero((c[1:] == c[:-1]) & (s[1:] < e[:-1])))
    return dict(zip(KPI_NAMES, (not_once, early, bytes_kpi, flops_kpi, port_kpi, overlap), strict=True))


#: Ops whose out-edges the causality KPI checks at once (bounds its temporary arrays).
EDGE_CHECK_OPS = 1 << 18


def _early_starts(d: CompiledDag, start: np.ndarray, end: np.ndarray) -> int:
    """Edges ``u -> v`` where ``v`` started before ``u`` ended, or only one of them ran,
    checked a block of predecessors at a time."""
    targets, bounds = d.succ.targets_array(), d.succ.bounds_array()
    early = 0
    for a in range(0, d.n_ops, EDGE_CHECK_OPS):
        b = min(a + EDGE_CHECK_OPS, d.n_ops)
        lo, hi = int(bounds[a]), int(bounds[b])
        if lo == hi:
            continue
        s_v = start[targets[lo:hi]]
        e_u = np.repeat(end[a:b], np.diff(bounds[a:b + 1]))
        early += int(np.count_nonzero((s_v < e_u) | (np.isnan(s_v) != np.isnan(e_u))))
    return early


def check_conservation(kpis: dict) -> None:
    bad = {k: v for k, v in kpis.items() if v != 0}
    if bad:
        raise ConservationError(kpis, "engine invariants violated: " + ", ".join(f"{k}={v}" for k, v in bad.items()))


# ----------------------------------------------------------------------------------------
# Result
# ----------------------------------------------------------------------------------------


@attrs.frozen(eq=False, kw_only=True)
class SimResult:
    phase: str
    latency_s: float
    kpis: dict
    comm_bytes: dict
    #: the overlap report (:func:`overlap_report`), given or worked out on first use
    #: (:attr:`overlap`): the serving step runners read only a run's latency
    _overlap: Optional[dict] = attrs.field(default=None, repr=False)
    collectives: list     # how the comm ops ran: one entry per (reason, primitive, algorithm, protocol, channels)
    ops: int
    flows: int
    events: int
    sim_wall_s: float
    dag: OpDag = attrs.field(repr=False)
    compiled: CompiledDag = attrs.field(repr=False)
    start_s: np.ndarray = attrs.field(repr=False)
    end_s: np.ndarray = attrs.field(repr=False)
    flow_start_s: np.ndarray = attrs.field(repr=False)
    flow_end_s: np.ndarray = attrs.field(repr=False)
    port_rate_log: tuple = attrs.field(repr=False, default=())  # (time_s, port, bytes_per_s)
    compute: dict = attrs.field(repr=False, factory=dict)  # g5core.sim.compute.coverage_report
    symmetry: Symmetry = attrs.field(factory=Symmetry)  # what was simulated (ops, flows, events: of that)
    mean_heap_len: float = attrs.field(repr=False, default=0.0)  # Engine.mean_heap_len (benchmarks)
    batches: int = attrs.field(repr=False, default=0)  # Engine.batches: distinct event times (benchmarks)
    #: a micro-batched step (g5core.lower.microbatch): how it was split and what the engine
    #: measured; None for a whole step
    pipeline: Optional[dict] = None

    @property
    def overlap(self) -> dict:
        """How much communication the compute streams hid (:func:`overlap_report`), worked out
        from the run's op times the first time it is read."""
        if self._overlap is None:
            object.__setattr__(self, "_overlap", overlap_report(self.dag, self.compiled, self.start_s, self.end_s))
        return self._overlap

    def op_times(self, key: str) -> tuple[float, float]:
        i = self.dag.index[key]
        return float(self.start_s[i]), float(self.end_s[i])

    def to_json_dict(self) -> dict[str, Any]:
        out = {
            "phase": self.phase,
            "latency_s": self.latency_s,
            **phase_metrics(self.phase, self.latency_s),
            "conservation": dict(self.kpis),
            "comm_bytes": self.comm_bytes,
            "overlap": self.overlap,
            "collectives": self.collectives,
            "ops": self.ops,
            "flows": self.flows,
            "events": self.events,
            "sim_wall_s": self.sim_wall_s,
            "compute": self.compute,
            "symmetry": self.symmetry.to_json_dict(),
        }
        if self.pipeline is not None:
            out["pipeline"] = dict(self.pipeline)
        return out


def busiest_compute_by_owner(sim) -> dict[str, float]:
    """Per owner of compute ops (the plugin that expanded them: ``ep`` for the routed
    experts), their compute time on the chip that runs most of it, from a simulation's op
    breakdown: each op's end minus start in the engine, summed per chip, the largest sum."""
    dag = sim.dag
    owners: dict[str, list[int]] = {}
    for i, spec in enumerate(dag.specs):
        if not dag.spec_is_comm[i]:
            owners.setdefault(spec.owner, []).append(i)
    if not owners:
        return {}
    spec = np.frombuffer(dag.spec, dtype=np.dtype(dag.spec.typecode))
    chip = np.frombuffer(dag.chip, dtype=np.dtype(dag.chip.typecode))
    duration_s = np.asarray(sim.end_s) - np.asarray(sim.start_s)
    out = {}
    for owner, specs in owners.items():
        mine = np.isin(spec, specs)
        out[owner] = float(np.bincount(chip[mine], weights=duration_s[mine]).max()) if mine.any() else 0.0
    return out


def summarize(dag: OpDag, engine: Engine, phase: str, sim_wall_s: float, symmetry: Symmetry = WHOLE_RUN) -> SimResult:
    """The results of a run; with symmetry applied, ``dag`` and ``engine`` hold one replica and
    the totals are those of ``symmetry.replicas`` alike replicas (g5core.lower.symmetry)."""
    d = engine.dag
    k = symmetry.replicas
    kpis = conservation_kpis(engine)
    start = np.asarray(engine.start_s, dtype=float)
    end = np.asarray(engine.end_s, dtype=float)
    return SimResult(
        phase=phase,
        latency_s=float(engine.makespan_s),
        kpis=kpis,
        comm_bytes=comm_bytes_by_reason(dag, d, k),
        collectives=collectives_report(dag, d, k),
        ops=d.n_ops,
        flows=len(d.flow_bytes),
        events=engine.events,
        mean_heap_len=engine.mean_heap_len,
        batches=engine.batches,
        sim_wall_s=sim_wall_s,
        dag=dag,
        compiled=d,
        start_s=start,
        end_s=end,
        flow_start_s=np.asarray(engine.flow_start_s, dtype=float),
        flow_end_s=np.asarray(engine.flow_end_s, dtype=float),
        port_rate_log=tuple(engine.port_rate_log),
        compute=compute_report(dag, d, engine.makespan_s, symmetry),
        symmetry=symmetry,
    )


def collectives_report(dag: OpDag, d: CompiledDag, replicas: int = 1) -> list[dict]:
    """How the communication ops ran: per reason, primitive, algorithm, protocol and channel
    count, the number of ops and their payload bytes per rank (exactly-rounded sums, over
    ``replicas`` alike replicas of ``dag``)."""
    specs = dag.specs
    comm = np.flatnonzero(dag.comm_mask())
    if not len(comm):
        return []
    # ops alike in spec (and so in algorithm), counted at once (few specs, many ops)
    spec_ids, counts = np.unique(d.spec[comm], return_counts=True)
    groups: dict[tuple, list] = {}
    for s_id, count in zip(spec_ids.tolist(), counts.tolist()):
        spec, a_id = specs[s_id], int(d.spec_algo[s_id])
        groups.setdefault((spec.reason, spec.primitive) + tuple(d.algos[a_id]), []).append((spec.bytes_per_rank, count))
    return [{"reason": r, "primitive": p, "algorithm": a, "protocol": pr, "channels": ch,
             "ops": sum(c for _, c in b) * replicas,
             "bytes_per_rank": exact_sum_repeated((v, c * replicas) for v, c in b)}
            for (r, p, a, pr, ch), b in sorted(groups.items())]


def _spec_reason_ids(dag: OpDag, reasons: list[str]) -> np.ndarray:
    """Per spec: the id (in ``reasons``) of a comm spec's reason, -1 for compute."""
    rindex = {r: k for k, r in enumerate(reasons)}
    return np.asarray([rindex.get(spec.reason, -1) if comm else -1 for spec, comm in zip(dag.specs, dag.spec_is_comm)],
                      dtype=np.int64)


def compute_report(dag: OpDag, d: CompiledDag, latency_s: float, symmetry: Symmetry = WHOLE_RUN) -> dict:
    """Measured/roofline coverage and achieved FLOP/s per chip (g5core.sim.compute)."""
    if d.compute is None:
        return {}
    comp = ~np.asarray(d.is_comm, dtype=bool)
    return coverage_from_columns(np.asarray(d.compute_answer)[comp], np.asarray(d.chip)[comp],
                                 np.asarray(d.flops, dtype=float)[comp], d.compute.system, float(latency_s), d.n_chips,
                                 d.compute, replicas=symmetry.replicas, replica_chips=symmetry.slice_chips)


def _reasons(dag: OpDag) -> list[str]:
    used = set(np.unique(dag.spec_array()).tolist())
    return sorted({spec.reason for s, (spec, comm) in enumerate(zip(dag.specs, dag.spec_is_comm)) if comm and s in used})


def comm_bytes_by_reason(dag: OpDag, d: CompiledDag, replicas: int = 1) -> dict:
    """Total payload bytes per reason, and payload bytes sent by the busiest rank per reason
    (totals over ``replicas`` alike replicas of ``dag``; the busiest rank is the same in each)."""
    reasons = _reasons(dag)
    if not len(d.flow_bytes):
        return {"total_bytes": 0.0, "by_reason": {}, "per_rank_by_reason": {}}
    spec = dag.spec_array()
    flow_reason = _spec_reason_ids(dag, reasons)[spec[d.flow_op]]
    # payload bytes: the wire bytes of a flow over its op's protocol overhead
    fbytes = d.flow_bytes / d.wire_factor[d.flow_op]
    fsrc = d.flow_src
    # a flow whose first resource is a receive side (a chip's traffic down from an in-switch
    # reduction) is received, not sent (send sides have even resource ids: g5core.lower.topology)
    sends = np.asarray([route[0] % 2 == 0 for route in d.routes], dtype=bool)[d.flow_route]
    by_reason, per_rank = {}, {}
    for r, name in enumerate(reasons):
        m = flow_reason == r
        by_reason[name] = _fsum_replicated(fbytes[m], replicas)
        sent = np.bincount(fsrc[m & sends], weights=fbytes[m & sends], minlength=d.n_chips)
        per_rank[name] = float(sent.max())
    return {"total_bytes": _fsum_replicated(fbytes, replicas), "by_reason": by_reason, "per_rank_by_reason": per_rank}


def _fsum_replicated(values: np.ndarray, replicas: int) -> float:
    """The exactly-rounded sum of ``replicas`` copies of ``values`` (what the full run sums)."""
    distinct, counts = np.unique(np.asarray(values, dtype=float), return_counts=True)
    return float(exact_sum_repeated(zip(distinct.tolist(), (counts * replicas).tolist())))


def _merged_length(s: np.ndarray, e: np.ndarray) -> float:
    """The length of the union of intervals ``[s, e)`` given in ascending order of ``s``:
    the sum, in order, of the lengths of the merged (disjoint) intervals."""
    if not len(s):
        return 0.0
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    starts = np.flatnonzero(new)
    return float(np.sum(np.maximum.reduceat(e, starts) - s[starts]))


def _by_chip(chip: np.ndarray, s: np.ndarray, n_chips: int) -> tuple[np.ndarray, np.ndarray]:
    """(order sorting items by chip, then start; bounds: chip c's items are
    ``order[bounds[c]:bounds[c + 1]]``)."""
    order = np.lexsort((s, chip))
    bounds = np.searchsorted(chip[order], np.arange(n_chips + 1))
    return order, bounds


def overlap_report(dag: OpDag, d: CompiledDag, start: np.ndarray, end: np.ndarray) -> dict:
    """How much communication the compute streams hid.

    Per chip: ``comm_time`` is the union of the intervals of the communication ops it takes
    part in (start latency included); ``exposed`` is the part of that union during which its
    compute stream was idle. Reported for the chip where exposure is largest (ties: more
    communication, then the lower chip id), overall and per reason. Worked out chip by
    chip, so what it holds at once is one chip's intervals.
    """
    n_chips = d.n_chips
    is_comm = d.is_comm
    done = ~(np.isnan(start) | np.isnan(end))
    comp = np.flatnonzero(~is_comm & done)
    comp_chip = d.chip[comp]
    comp_order, comp_bounds = _by_chip(comp_chip, start[comp], n_chips)
    comp = comp[comp_order]
    del comp_chip, comp_order
    reasons = _reasons(dag)
    comm = np.flatnonzero(is_comm & done)
    del is_comm, done
    # every (member chip, comm op) pair, from each spec's group
    spec = d.spec[comm]
    groups = [spec_.group if is_c else () for spec_, is_c in zip(dag.specs, dag.spec_is_comm)]
    g_size = np.asarray([len(g) for g in groups], dtype=np.int64)
    g_start = np.zeros(len(groups) + 1, dtype=np.int64)
    np.cumsum(g_size, out=g_start[1:])
    g_members = np.asarray([c for g in groups for c in g], dtype=np.int64)
    sizes = g_size[spec]
    op_of = np.repeat(comm, sizes)
    rank = np.arange(len(op_of), dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    members = g_members[np.repeat(g_start[spec], sizes) + rank] if len(op_of) else np.zeros(0, dtype=np.int64)
    del rank
    pair_order, pair_bounds = _by_chip(members, start[op_of], n_chips)
    op_of = op_of[pair_order]
    reason_of = _spec_reason_ids(dag, reasons)[d.spec[op_of]]
    del members, pair_order, spec, sizes
    # per chip, overall (row 0) and per reason (row 1 + reason id): the comm union, and
    # the union of comm and compute
    comm_len = np.zeros((len(reasons) + 1, n_chips))
    union_len = np.zeros((len(reasons) + 1, n_chips))
    comp_len = np.zeros(n_chips)
    for c in range(n_chips):
        ci = comp[comp_bounds[c]:comp_bounds[c + 1]]
        cs, ce = start[ci], end[ci]
        comp_len[c] = _merged_length(cs, ce)
        lo, hi = pair_bounds[c], pair_bounds[c + 1]
        if lo == hi:
            continue
        ops, why = op_of[lo:hi], reason_of[lo:hi]
        for row, pick in [(0, None)] + [(1 + r, why == r) for r in np.unique(why).tolist()]:
            o = ops if pick is None else ops[pick]
            ms, me = start[o], end[o]
            comm_len[row, c] = _merged_length(ms, me)
            both_s = np.concatenate([ms, cs])
            both = np.argsort(both_s, kind="stable")
            union_len[row, c] = _merged_length(both_s[both], np.concatenate([me, ce])[both])

    def worst(row: int) -> dict:
        comm_row = comm_len[row]
        exposed = np.maximum(union_len[row] - comp_len, 0.0)  # comm time outside compute
        has = comm_row > 0
        if not has.any():
            return {"comm_time_s": 0.0, "exposed_comm_s": 0.0, "hidden_fraction": 1.0, "chip": None}
        cand = np.flatnonzero(has)
        best = cand[np.lexsort((cand, -comm_row[cand], -exposed[cand]))[0]]
        total, exp = float(comm_row[best]), float(min(exposed[best], comm_row[best]))
        # the union arithmetic rounds; snap differences below a nanosecond-per-second
        if abs(total - exp) <= INTERVAL_SUM_ROUNDING_REL * total:
            exp = total
        elif exp <= INTERVAL_SUM_ROUNDING_REL * total:
            exp = 0.0
        return {"comm_time_s": total, "exposed_comm_s": exp,
                "hidden_fraction": 1.0 - exp / total if total > 0 else 1.0, "chip": int(best)}

    out = worst(0)
    out["by_reason"] = {r: worst(1 + i) for i, r in enumerate(reasons)}
    return out


#: network tiers of the summary: (name, the resource kinds of its two directions)
NETWORK_TIERS = (("NVLink", ("link_tx", "link_rx")), ("NIC", ("nic_tx", "nic_rx")),
                 ("leaf uplink", ("leaf_up", "leaf_down")))


def network_load(sim: SimResult, topology) -> list[dict]:
    """The load on each network tier a run used (scale-up links, NICs, leaf uplinks):
    ``tier, ports`` (used, of the tier's ports in the simulated chips' reach), ``bytes``
    (carried one way: the sending direction, wire bytes, times the symmetric replicas),
    ``busiest_port``, ``busiest_bytes``, ``utilization`` (its bytes over its capacity times
    the step) and ``busy_fraction`` (the share of the step a flow was on it). A tier no
    flow crossed is left out."""
    d = sim.compiled
    n_ports = len(d.port_capacity)
    if not len(d.flow_bytes) or sim.latency_s <= 0:
        return []
    route_bytes = np.bincount(d.flow_route, weights=d.flow_bytes, minlength=len(d.routes))
    port_bytes = np.zeros(n_ports)
    for rid, route in enumerate(d.routes):
        if route_bytes[rid]:
            port_bytes[list(route)] += route_bytes[rid]
    kinds = np.asarray([topology.resource_kind(p) for p in range(n_ports)])
    capacity = np.asarray(d.port_capacity, dtype=float)
    out = []
    for tier, names in NETWORK_TIERS:
        ids = [KIND_NAMES.index(n) for n in names]
        in_tier = np.isin(kinds, ids)
        used = in_tier & (port_bytes > 0)
        if not used.any():
            continue
        busiest = int(np.flatnonzero(used)[np.argmax((port_bytes / capacity)[used])])
        on = np.asarray([busiest in route for route in d.routes], dtype=bool)[d.flow_route]
        fs, fe = np.asarray(sim.flow_start_s)[on], np.asarray(sim.flow_end_s)[on]
        order = np.argsort(fs, kind="stable")
        out.append({
            "tier": tier, "ports": int(used.sum()),
            "bytes": float(port_bytes[kinds == ids[0]].sum()) * sim.symmetry.replicas,
            "busiest_port": topology.resource_name(busiest), "busiest_bytes": float(port_bytes[busiest]),
            "utilization": float(port_bytes[busiest] / (capacity[busiest] * sim.latency_s)),
            "busy_fraction": _merged_length(fs[order], fe[order]) / sim.latency_s,
        })
    return out



def step_choices(ctx) -> dict:
    """What plugins chose for the step a context runs (``g5_step_choices`` answers, by plugin)."""
    return {plugin: dict(answer) for plugin, answer in ctx.hooks.call_each("g5_step_choices", ctx=ctx) if answer}
