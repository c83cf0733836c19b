"""What a run produced: latency, conservation KPIs, communication by cause, overlap."""
from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np

from .dag import CommOp, OpDag
from .engine import CompiledDag, Engine
from .errors import ConservationError

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

    Byte and port KPIs are whole bytes (floating-point rounding below one byte is not a
    violation); the FLOP KPI compares exactly-rounded sums (``math.fsum``) of the DAG's and
    the executed FLOPs.
    """
    d = engine.dag
    executed = np.asarray(engine.executed, dtype=np.int64)
    start = np.asarray(engine.start_s, dtype=float)
    end = np.asarray(engine.end_s, dtype=float)
    not_once = int(np.count_nonzero(executed != 1))
    if len(d.edges_u):
        s_v, e_u = start[d.edges_v], end[d.edges_u]
        early = int(np.count_nonzero((s_v < e_u) | (np.isnan(s_v) != np.isnan(e_u))))
    else:
        early = 0
    byte_gap = math.fsum(engine.flow_injected) - math.fsum(engine.flow_delivered)
    bytes_kpi = int(math.floor(abs(byte_gap))) if math.isfinite(byte_gap) else -1
    flops_kpi = math.fsum(d.flops) - math.fsum(engine.executed_flops)
    port_kpi = int(math.floor(engine.port_excess_bytes))
    chips = np.asarray(d.chip)
    comp = ~np.asarray(d.is_comm, dtype=bool) & ~np.isnan(start)
    idx = np.nonzero(comp)[0]
    overlap = 0
    if len(idx):
        o = np.lexsort((start[idx], chips[idx]))
        c, s, e = chips[idx][o], start[idx][o], end[idx][o]
        same = c[1:] == c[:-1]
        overlap = int(np.count_nonzero(same & (s[1:] < e[:-1])))
    return {
        "ops_not_executed_once": not_once,
        "ops_started_before_predecessor_finished": early,
        "bytes_injected_minus_delivered": bytes_kpi,
        "dag_flops_minus_executed_flops": flops_kpi,
        "port_bytes_beyond_capacity": port_kpi,
        "overlapping_compute_intervals": overlap,
    }


def check_conservation(kpis: dict) -> None:
    bad = {k: v for k, v in kpis.items() if v != 0}
    if bad:
        raise ConservationError(kpis, "engine invariants violated: " + ", ".join(f"{k}={v}" for k, v in bad.items()))


# ----------------------------------------------------------------------------------------
# Interval helpers
# ----------------------------------------------------------------------------------------


def _union(intervals: np.ndarray) -> np.ndarray:
    """Merge ``(n, 2)`` intervals into disjoint sorted ones."""
    if len(intervals) == 0:
        return intervals.reshape(0, 2)
    iv = intervals[np.argsort(intervals[:, 0], kind="stable")]
    out = []
    cs, ce = iv[0]
    for s, e in iv[1:]:
        if s <= ce:
            if e > ce:
                ce = e
        else:
            out.append((cs, ce))
            cs, ce = s, e
    out.append((cs, ce))
    return np.asarray(out, dtype=float)


def _length(u: np.ndarray) -> float:
    return float(np.sum(u[:, 1] - u[:, 0])) if len(u) else 0.0


def _intersection_length(a: np.ndarray, b: np.ndarray) -> float:
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i, 0], b[j, 0]), min(a[i, 1], b[j, 1])
        if hi > lo:
            total += hi - lo
        if a[i, 1] < b[j, 1]:
            i += 1
        else:
            j += 1
    return total


# ----------------------------------------------------------------------------------------
# Result
# ----------------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class SimResult:
    phase: str
    latency_s: float
    kpis: dict
    comm_bytes: dict
    overlap: dict
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

    def op_times(self, key: str) -> tuple[float, float]:
        i = self.dag.index[key]
        return float(self.start_s[i]), float(self.end_s[i])

    def to_json_dict(self) -> dict[str, Any]:
        out = {
            "phase": self.phase,
            "latency_s": self.latency_s,
            ("ttft_s" if self.phase == "prefill" else "tpot_s"): self.latency_s,
            "conservation": dict(self.kpis),
            "comm_bytes": self.comm_bytes,
            "overlap": self.overlap,
            "ops": self.ops,
            "flows": self.flows,
            "events": self.events,
            "sim_wall_s": self.sim_wall_s,
        }
        return out


def summarize(dag: OpDag, engine: Engine, phase: str, sim_wall_s: float) -> SimResult:
    d = engine.dag
    kpis = conservation_kpis(engine)
    start = np.asarray(engine.start_s, dtype=float)
    end = np.asarray(engine.end_s, dtype=float)
    return SimResult(
        phase=phase,
        latency_s=float(engine.makespan_s),
        kpis=kpis,
        comm_bytes=comm_bytes_by_reason(dag, d),
        overlap=overlap_report(dag, d, start, end),
        ops=len(d.keys),
        flows=len(d.flow_bytes),
        events=engine.events,
        sim_wall_s=sim_wall_s,
        dag=dag,
        compiled=d,
        start_s=start,
        end_s=end,
        flow_start_s=np.asarray(engine.flow_start_s, dtype=float),
        flow_end_s=np.asarray(engine.flow_end_s, dtype=float),
    )


def _reasons(dag: OpDag) -> list[str]:
    return sorted({op.reason for op in dag.ops if isinstance(op, CommOp)})


def comm_bytes_by_reason(dag: OpDag, d: CompiledDag) -> dict:
    """Total bytes on the wire per reason, and bytes sent by the busiest rank per reason."""
    reasons = _reasons(dag)
    if not len(d.flow_bytes):
        return {"total_bytes": 0.0, "by_reason": {}, "per_rank_by_reason": {}}
    reason_of_op = {}
    for i, op in enumerate(dag.ops):
        if isinstance(op, CommOp):
            reason_of_op[i] = reasons.index(op.reason)
    flow_reason = np.asarray([reason_of_op[o] for o in d.flow_op], dtype=np.int64)
    fbytes = np.asarray(d.flow_bytes, dtype=float)
    fsrc = np.asarray(d.flow_src, dtype=np.int64)
    by_reason, per_rank = {}, {}
    for r, name in enumerate(reasons):
        m = flow_reason == r
        by_reason[name] = float(math.fsum(fbytes[m]))
        sent = np.bincount(fsrc[m], weights=fbytes[m], minlength=d.n_chips)
        per_rank[name] = float(sent.max())
    return {"total_bytes": float(math.fsum(fbytes)), "by_reason": by_reason, "per_rank_by_reason": per_rank}


def overlap_report(dag: OpDag, d: CompiledDag, start: np.ndarray, end: np.ndarray) -> dict:
    """How much communication the compute streams hid.

    Per chip: ``comm_time`` is the union of the intervals of the communication ops it takes
    part in (start latency included); ``exposed`` is the part of that union during which its
    compute stream was idle. Reported for the chip where exposure is largest, overall and
    per reason.
    """
    n_chips = d.n_chips
    compute = [[] for _ in range(n_chips)]
    comm: dict[str, list[list]] = {}
    all_comm = [[] for _ in range(n_chips)]
    for i, op in enumerate(dag.ops):
        s, e = start[i], end[i]
        if not (s == s and e == e):
            continue
        if d.is_comm[i]:
            per = comm.setdefault(op.reason, [[] for _ in range(n_chips)])
            for c in op.group:
                per[c].append((s, e))
                all_comm[c].append((s, e))
        else:
            compute[d.chip[i]].append((s, e))
    comp_u = [_union(np.asarray(iv, dtype=float).reshape(-1, 2)) for iv in compute]

    def worst(per_chip) -> dict:
        best = {"comm_time_s": 0.0, "exposed_comm_s": 0.0, "hidden_fraction": 1.0, "chip": None}
        best_key = (-1.0, -1.0)
        for c in range(n_chips):
            if not per_chip[c]:
                continue
            u = _union(np.asarray(per_chip[c], dtype=float))
            total = _length(u)
            exposed = total - _intersection_length(u, comp_u[c])
            key = (exposed, total)
            if key > best_key:
                best_key = key
                best = {
                    "comm_time_s": total,
                    "exposed_comm_s": max(exposed, 0.0),
                    "hidden_fraction": (1.0 - exposed / total) if total > 0 else 1.0,
                    "chip": c,
                }
        return best

    out = worst(all_comm)
    out["by_reason"] = {r: worst(per) for r, per in sorted(comm.items())}
    return out
