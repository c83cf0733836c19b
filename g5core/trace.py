"""Chrome / Perfetto trace of a run: one track per chip compute stream and per port.

Compute ops are complete ("X") slices on their chip's ``compute`` track. Flows are async
slices ("b"/"e", which may overlap) on the ports they cross, and communication ops are
async slices on a per-chip ``comm`` track, each with its reason and bytes. Times are in
microseconds, as the format wants. The file is written to a temporary name and renamed,
so a failed write never leaves a partial trace behind.
"""
from __future__ import annotations

import json
import os
import pathlib
import tempfile

from .collective import PORT_NAMES, PORTS_PER_CHIP, Topology
from .dag import CommOp, ComputeOp
from .results import SimResult

_COMPUTE_TID = 0
_COMM_TID = 1


def trace_events(sim: SimResult, topo: Topology) -> list[dict]:
    d = sim.compiled
    events: list[dict] = []
    chips = d.n_chips
    for c in range(chips):
        events.append({"ph": "M", "name": "process_name", "pid": c, "args": {"name": f"chip {c} (node {topo.node_of(c)})"}})
        events.append({"ph": "M", "name": "thread_name", "pid": c, "tid": _COMPUTE_TID, "args": {"name": "compute"}})
        events.append({"ph": "M", "name": "thread_name", "pid": c, "tid": _COMM_TID, "args": {"name": "comm ops"}})
        for k, pname in enumerate(PORT_NAMES):
            events.append({"ph": "M", "name": "thread_name", "pid": c, "tid": 2 + k, "args": {"name": f"port {pname}"}})
    for i, op in enumerate(sim.dag.ops):
        s, e = sim.start_s[i], sim.end_s[i]
        if isinstance(op, ComputeOp):
            events.append({"ph": "X", "name": op.key, "cat": op.op_class, "pid": op.chip, "tid": _COMPUTE_TID,
                           "ts": s * 1e6, "dur": (e - s) * 1e6,
                           "args": {"flops": op.flops, "hbm_bytes": op.hbm_bytes, "owner": op.owner}})
        elif isinstance(op, CommOp):
            for c in op.group:
                args = {"reason": op.reason, "primitive": op.primitive, "bytes_per_rank": op.bytes_per_rank,
                        "group": list(op.group)}
                events.append({"ph": "b", "name": op.key, "cat": op.reason, "id": f"op{i}", "pid": c,
                               "tid": _COMM_TID, "ts": s * 1e6, "args": args})
                events.append({"ph": "e", "name": op.key, "cat": op.reason, "id": f"op{i}", "pid": c,
                               "tid": _COMM_TID, "ts": e * 1e6})
    for f in range(len(d.flow_bytes)):
        s, e = sim.flow_start_s[f], sim.flow_end_s[f]
        op = sim.dag.ops[d.flow_op[f]]
        for port in (d.flow_src_port[f], d.flow_dst_port[f]):
            pid, tid = port // PORTS_PER_CHIP, 2 + port % PORTS_PER_CHIP
            name = f"{op.reason} c{d.flow_src[f]}->c{d.flow_dst[f]}"
            events.append({"ph": "b", "name": name, "cat": op.reason, "id": f"f{f}p{port}", "pid": pid, "tid": tid,
                           "ts": s * 1e6, "args": {"bytes": d.flow_bytes[f], "op": op.key}})
            events.append({"ph": "e", "name": name, "cat": op.reason, "id": f"f{f}p{port}", "pid": pid, "tid": tid,
                           "ts": e * 1e6})
    return events


def write_trace(sim: SimResult, topo: Topology, path) -> None:
    path = pathlib.Path(path)
    payload = {"traceEvents": trace_events(sim, topo), "displayTimeUnit": "ns",
               "otherData": {"latency_s": sim.latency_s, "phase": sim.phase}}
    directory = path.parent if str(path.parent) else pathlib.Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, separators=(",", ":"))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
