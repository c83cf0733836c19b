"""Chrome / Perfetto trace of a run: one track per chip compute stream and per port.

Each chip is a process ("chip N (node M)") with these threads:

- ``compute``: its compute ops, complete ("X") slices with FLOPs, HBM bytes and owner;
- ``comm ops``: the communication ops it takes part in, with reason, primitive, bytes per
  rank and group;
- ``port link_tx`` / ``link_rx``: the flows crossing its scale-up link ports, with reason,
  bytes and op; ``port nic_tx`` / ``nic_rx``: the same for the NIC whose rail it heads
  (the first chip that uses a NIC draws it);
- a counter per port (``chipN.link_tx GB/s``, ``nodeN.nicK.tx GB/s``): the bandwidth the
  port carries over time.

Fabric tiers (``leafL.up`` / ``down``) are processes of their own after the chips. A
communication op's slice names its algorithm, protocol and channels.

Perfetto draws the slices of one thread only when they nest, and flows on a port (and
communication ops on a chip) overlap freely, so such a track is split into as many lanes
as it needs (``port nic_tx``, ``port nic_tx #2``, ...), each lane holding slices that do
not overlap. Times are in microseconds, as the format wants. The file is written to a
temporary name and renamed (``g5core.inputs.outputs``), so a failed write never leaves a partial
trace behind.
"""
from __future__ import annotations

import heapq
import json

from g5core.lower.topology import KIND_NAMES, LINK_RX, LINK_TX, Topology
from g5core.api.ops import CommOp, ComputeOp
from g5core.api.errors import G5Error
from g5core.lower.kernels import describe_kernels
from g5core.sim.results import SimResult

COMPUTE_TID = 0
COMM_TID_BASE = 1000          # + lane
PORT_TID_BASE = 2000          # + port kind * PORT_TID_STRIDE + lane
PORT_TID_STRIDE = 1000


def assign_lanes(intervals: list[tuple[float, float]]) -> list[int]:
    """Lane of each interval so that the intervals of one lane never overlap (fewest lanes,
    greedy by start time; deterministic)."""
    order = sorted(range(len(intervals)), key=lambda i: (intervals[i][0], intervals[i][1], i))
    free: list[tuple[float, int]] = []  # (end of the lane's last interval, lane)
    lanes = [0] * len(intervals)
    n_lanes = 0
    for i in order:
        start, end = intervals[i]
        if free and free[0][0] <= start:
            _, lane = heapq.heappop(free)
        else:
            lane = n_lanes
            n_lanes += 1
        lanes[i] = lane
        heapq.heappush(free, (end, lane))
    return lanes


def _lane_name(base: str, lane: int) -> str:
    return base if lane == 0 else f"{base} #{lane + 1}"


def _every_chip(sim: SimResult) -> None:
    """Traces and timelines draw every chip: refuse a run that simulated one replica."""
    if sim.symmetry.applied:
        raise G5Error(f"this run simulated one of {sim.symmetry.replicas} identical {sim.symmetry.dimension} "
                      f"replicas; a trace or timeline needs every chip: simulate with symmetry=False")


def trace_events(sim: SimResult, topo: Topology) -> list[dict]:
    _every_chip(sim)
    d = sim.compiled
    ops = sim.dag.ops
    events: list[dict] = []
    threads: dict[tuple[int, int], str] = {}
    for c in range(d.n_chips):
        events.append({"ph": "M", "name": "process_name", "pid": c, "args": {"name": f"chip {c} (node {topo.node_of(c)})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": c, "args": {"sort_index": c}})
        threads[(c, COMPUTE_TID)] = "compute"

    # compute streams: never overlap (a conservation KPI), one track each
    for i, op in enumerate(ops):
        if isinstance(op, ComputeOp):
            s, e = sim.start_s[i], sim.end_s[i]
            events.append({"ph": "X", "name": op.key, "cat": op.op_class, "pid": op.chip, "tid": COMPUTE_TID,
                           "ts": s * 1e6, "dur": (e - s) * 1e6,
                           "args": {"flops": op.flops, "hbm_bytes": op.hbm_bytes, "owner": op.owner}})

    # communication ops, per chip, in lanes
    per_chip: dict[int, list[int]] = {}
    for i, op in enumerate(ops):
        if isinstance(op, CommOp):
            for c in op.group:
                per_chip.setdefault(c, []).append(i)
    for c, idx in sorted(per_chip.items()):
        lanes = assign_lanes([(sim.start_s[i], sim.end_s[i]) for i in idx])
        for i, lane in zip(idx, lanes):
            op = ops[i]
            tid = COMM_TID_BASE + lane
            threads[(c, tid)] = _lane_name("comm ops", lane)
            s, e = sim.start_s[i], sim.end_s[i]
            algorithm, protocol, channels = d.comm_algo[i]
            events.append({"ph": "X", "name": op.key, "cat": op.reason, "pid": c, "tid": tid, "ts": s * 1e6,
                           "dur": (e - s) * 1e6,
                           "args": {"reason": op.reason, "primitive": op.primitive,
                                    "bytes_per_rank": op.bytes_per_rank, "group": list(op.group),
                                    "algorithm": algorithm, "protocol": protocol, "channels": channels}})

    # flows, per port, in lanes
    per_port: dict[int, list[int]] = {}
    for f in range(len(d.flow_bytes)):
        for r in d.flow_ports[f]:
            per_port.setdefault(r, []).append(f)
    leaf_pid = d.n_chips
    for port, flows in sorted(per_port.items()):
        pid, kind = _port_pid(topo, port, leaf_pid, events)
        lanes = assign_lanes([(sim.flow_start_s[f], sim.flow_end_s[f]) for f in flows])
        for f, lane in zip(flows, lanes):
            op = ops[d.flow_op[f]]
            tid = PORT_TID_BASE + kind * PORT_TID_STRIDE + lane
            threads[(pid, tid)] = _lane_name(f"port {KIND_NAMES[kind]}", lane)
            s, e = sim.flow_start_s[f], sim.flow_end_s[f]
            events.append({"ph": "X", "name": f"{op.reason} {flow_ends(topo, int(d.flow_src[f]), int(d.flow_dst[f]), port)}",
                           "cat": op.reason,
                           "pid": pid, "tid": tid, "ts": s * 1e6, "dur": (e - s) * 1e6,
                           "args": {"reason": op.reason, "bytes": d.flow_bytes[f], "op": op.key,
                                    "port": topo.resource_name(port)}})

    # port bandwidth counters
    for t, port, rate in sim.port_rate_log:
        pid, _ = _port_pid(topo, port, leaf_pid, None)
        events.append({"ph": "C", "name": f"{topo.resource_name(port)} GB/s", "pid": pid, "ts": t * 1e6,
                       "args": {"GB/s": rate / 1e9}})

    for (pid, tid), name in sorted(threads.items()):
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return events


def flow_ends(topo: Topology, src: int, dst: int, port: int) -> str:
    """``c0->c1``; a flow to an in-switch reduction (NVLS: ``src == dst``) names the switch:
    ``c0->node0.nvswitch`` on the chip's send link, ``node0.nvswitch->c0`` on its receive link."""
    if src != dst:
        return f"c{src}->c{dst}"
    switch = f"node{topo.node_of(src)}.nvswitch"
    kind = topo.resource_kind(port)
    if kind == LINK_TX:
        return f"c{src}->{switch}"
    if kind == LINK_RX:
        return f"{switch}->c{dst}"
    return f"c{src}->{topo.resource_name(port)}"


def _port_pid(topo: Topology, port: int, leaf_pid: int, events) -> tuple[int, int]:
    """(process, resource kind) a port is drawn in; fabric tiers get processes of their own
    (named once, when ``events`` is given)."""
    kind = topo.resource_kind(port)
    chip = topo.resource_owner_chip(port)
    if chip >= 0:
        return chip, kind
    pid = leaf_pid + topo.leaf_of_resource(port)
    if events is not None and kind == KIND_NAMES.index("leaf_up"):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"fabric {topo.resource_name(port).split('.')[0]}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
    return pid, kind


TIMELINE_COLUMNS = ("key", "kind", "name", "layer", "owner", "chips", "op_class", "reason", "primitive",
                    "algorithm", "protocol", "channels", "flops", "hbm_bytes", "bytes_per_rank", "start_s", "end_s",
                    "kernels")


def timeline_rows(sim: SimResult):
    """One row per op, in op order: what ran where, when, and how much."""
    _every_chip(sim)
    for i, op in enumerate(sim.dag.ops):
        start, end = repr(float(sim.start_s[i])), repr(float(sim.end_s[i]))
        if isinstance(op, ComputeOp):
            yield (op.key, "compute", op.name, op.layer, op.owner, str(op.chip), op.op_class, "", "", "", "", "",
                   repr(op.flops), repr(op.hbm_bytes), "", start, end, describe_kernels(op.kernels))
        else:
            algorithm, protocol, channels = sim.compiled.comm_algo[i]
            yield (op.key, "comm", op.name, op.layer, op.owner, " ".join(map(str, op.group)), "", op.reason,
                   op.primitive, algorithm, protocol, channels, "", "", repr(op.bytes_per_rank), start, end, "")


def dump_timeline(sim: SimResult, fh) -> None:
    """Per-op start and end times as CSV (one header line, then one row per op)."""
    import csv

    w = csv.writer(fh, lineterminator="\n")
    w.writerow(TIMELINE_COLUMNS)
    w.writerows(timeline_rows(sim))


def dump_trace(sim: SimResult, topo: Topology, fh) -> None:
    """Write the trace JSON to an open text file."""
    payload = {"traceEvents": trace_events(sim, topo), "displayTimeUnit": "ns",
               "otherData": {"latency_s": sim.latency_s, "phase": sim.phase}}
    json.dump(payload, fh, separators=(",", ":"), allow_nan=False)
