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

import csv
import heapq
import itertools
import json

import numpy as np

from g5core.lower.topology import KIND_NAMES, LINK_RX, LINK_TX, Topology
from g5core.api.ops import KEY_VERBATIM, CommOp, ComputeOp
from g5core.api.errors import ConfigError, G5Error
from g5core.inputs.framework import kernel_fusions
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


def parse_layers(text: str, option: str = "--trace-layers") -> frozenset:
    """The layers a ``--trace-layers`` value names: ``0-3``, ``5``, ``0-1,80`` (layer
    numbers as op keys give them: ``L000`` is 0; the embedding is -1, the head the last)."""
    layers: set = set()
    for part in str(text).split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            a = int(lo)
            b = int(hi) if dash else a
        except ValueError:
            raise ConfigError(option, f"expected layer numbers such as 0-3 or 0-1,80, got {text!r}") from None
        if a < 0 or b < a:
            raise ConfigError(option, f"{part.strip()!r} is not a range of layers low-high (0 or more); e.g. 0-3")
        layers.update(range(a, b + 1))
    return frozenset(layers)


#: JSON text of a value as ``json.dump(..., separators=(",", ":"), allow_nan=False)`` writes it
_dumps = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
#: ... of a string (the C function json uses for one)
_string = json.encoder.encode_basestring_ascii


def _finite(*columns) -> None:
    """The trace is standard JSON (json.dump's ``allow_nan=False``): refuse inf/NaN times."""
    for c in columns:
        if len(c) and not np.isfinite(c).all():
            raise ValueError("Out of range float values are not JSON compliant")


def iter_trace_events(sim: SimResult, topo: Topology, layers: frozenset | None = None):
    """The trace's events as JSON texts, one at a time, in the trace's order (chips'
    metadata, compute slices, communication ops per chip, flows per port, port counters,
    thread names). Linear in ops, flows and counter samples: what is alike for every op of
    one spec is encoded once. ``layers``: draw only the ops (and their flows) of these
    layers, and the counter samples within their time span."""
    _every_chip(sim)
    d = sim.compiled
    dag = sim.dag
    n = d.n_ops
    _finite(sim.start_s, sim.end_s, sim.flow_start_s, sim.flow_end_s)
    # times in microseconds, as json would write ``s * 1e6`` and ``(e - s) * 1e6`` (numpy's
    # float64 arithmetic is Python's)
    start, end = sim.start_s.tolist(), sim.end_s.tolist()
    ts_us, dur_us = (sim.start_s * 1e6).tolist(), ((sim.end_s - sim.start_s) * 1e6).tolist()
    spec, specs, is_comm = dag.spec, dag.specs, dag.spec_is_comm
    layer_of = dag.layer
    name_json = _key_encoder(dag)
    threads: dict[tuple[int, int], str] = {}
    for c in range(d.n_chips):
        yield _dumps({"ph": "M", "name": "process_name", "pid": c, "args": {"name": f"chip {c} (node {topo.node_of(c)})"}})
        yield _dumps({"ph": "M", "name": "process_sort_index", "pid": c, "args": {"sort_index": c}})
        threads[(c, COMPUTE_TID)] = "compute"

    # compute streams: never overlap (a conservation KPI), one track each
    comm = np.asarray(is_comm, dtype=bool)[dag.spec_array()]
    kept = np.ones(n, dtype=bool) if layers is None else np.isin(
        np.asarray(layer_of), np.fromiter(layers, dtype=np.int64))
    cat: dict[int, str] = {}
    args: dict[int, str] = {}
    chip = dag.chip
    for i in np.flatnonzero(~comm & kept).tolist():
        s = spec[i]
        text = args.get(s)
        if text is None:
            p = specs[s]   # a ComputeSpec
            cat[s] = _dumps(p.op_class)
            text = args[s] = _dumps({"flops": p.flops, "hbm_bytes": p.hbm_bytes, "owner": p.owner})
        yield (f'{{"ph":"X","name":{name_json(i)},"cat":{cat[s]},"pid":{chip[i]},"tid":{COMPUTE_TID},'
               f'"ts":{ts_us[i]!r},"dur":{dur_us[i]!r},"args":{text}}}')

    # communication ops, per chip, in lanes
    algos, spec_algo = d.algos, d.spec_algo
    per_chip: dict[int, list[int]] = {}
    for i in np.flatnonzero(comm & kept).tolist():
        for c in specs[spec[i]].group:
            per_chip.setdefault(c, []).append(i)
    args.clear()
    for c, idx in sorted(per_chip.items()):
        lanes = assign_lanes([(start[i], end[i]) for i in idx])
        for i, lane in zip(idx, lanes):
            s = spec[i]
            text = args.get(s)
            if text is None:
                p = specs[s]   # a CommSpec
                algorithm, protocol, channels = algos[spec_algo[s]]
                cat[s] = _dumps(p.reason)
                text = args[s] = _dumps({"reason": p.reason, "primitive": p.primitive, "bytes_per_rank": p.bytes_per_rank,
                                         "group": list(p.group), "algorithm": algorithm, "protocol": protocol,
                                         "channels": channels})
            tid = COMM_TID_BASE + lane
            threads[(c, tid)] = _lane_name("comm ops", lane)
            yield (f'{{"ph":"X","name":{name_json(i)},"cat":{cat[s]},"pid":{c},"tid":{tid},'
                   f'"ts":{ts_us[i]!r},"dur":{dur_us[i]!r},"args":{text}}}')
    del per_chip, ts_us, dur_us

    # flows, per port, in lanes (the flows of each port in ascending id order)
    flow_op = d.flow_op
    if layers is not None:
        flows_kept = np.flatnonzero(np.isin(np.asarray(layer_of)[flow_op], np.fromiter(layers, dtype=np.int64)))
    else:
        flows_kept = np.arange(len(flow_op))
    port_of_entry, flow_of_entry = _flows_by_port(d, flows_kept)
    ports, first = np.unique(port_of_entry, return_index=True)
    bounds = first.tolist() + [len(port_of_entry)]
    flow_of_entry = flow_of_entry.tolist()
    src, dst, nbytes, flow_op = d.flow_src.tolist(), d.flow_dst.tolist(), d.flow_bytes.tolist(), flow_op.tolist()
    fstart, fend = sim.flow_start_s.tolist(), sim.flow_end_s.tolist()
    fts_us = (sim.flow_start_s * 1e6).tolist()
    fdur_us = ((sim.flow_end_s - sim.flow_start_s) * 1e6).tolist()
    op_key: dict[int, str] = {}
    leaf_pid = d.n_chips
    for k, port in enumerate(ports.tolist()):
        pid, kind = _port_pid(topo, port, leaf_pid)
        if pid >= leaf_pid and kind == KIND_NAMES.index("leaf_up"):
            yield from _fabric_process(topo, port, pid)
        flows = flow_of_entry[bounds[k]:bounds[k + 1]]
        lanes = assign_lanes([(fstart[f], fend[f]) for f in flows])
        port_name = _dumps(topo.resource_name(port))
        tid_base = PORT_TID_BASE + kind * PORT_TID_STRIDE
        for f, lane in zip(flows, lanes):
            i = flow_op[f]
            okey = op_key.get(i)
            if okey is None:
                okey = op_key[i] = name_json(i)
            reason = specs[spec[i]].reason
            tid = tid_base + lane
            threads[(pid, tid)] = _lane_name(f"port {KIND_NAMES[kind]}", lane)
            r = cat.get(spec[i]) or _dumps(reason)
            yield (f'{{"ph":"X","name":{_string(f"{reason} {flow_ends(topo, src[f], dst[f], port)}")},"cat":{r},"pid":{pid},'
                   f'"tid":{tid},"ts":{fts_us[f]!r},"dur":{fdur_us[f]!r},'
                   f'"args":{{"reason":{r},"bytes":{nbytes[f]!r},"op":{okey},"port":{port_name}}}}}')
    del flow_of_entry, op_key

    # port bandwidth counters
    log = sim.port_rate_log
    if log:
        _finite(np.fromiter(itertools.chain.from_iterable(log), dtype=float, count=3 * len(log)))
    span = None
    if layers is not None:
        span = ((float(sim.start_s[kept].min()), float(sim.end_s[kept].max())) if kept.any() else (1.0, 0.0))
    counter: dict[int, str] = {}
    for t, port, rate in log:
        if span is not None and not span[0] <= t <= span[1]:
            continue
        c = counter.get(port)
        if c is None:
            pid, _ = _port_pid(topo, port, leaf_pid)
            c = counter[port] = f'{{"ph":"C","name":{_dumps(f"{topo.resource_name(port)} GB/s")},"pid":{pid},"ts":'
        yield f'{c}{t * 1e6!r},"args":{{"GB/s":{rate / 1e9!r}}}}}'

    for (pid, tid), name in sorted(threads.items()):
        yield _dumps({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        yield _dumps({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})


def _flows_by_port(d, flows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(port, flow) of every port each of ``flows`` crosses, grouped by port, each port's
    flows in ascending id order (numpy: no Python step per flow)."""
    lengths = np.array([len(r) for r in d.routes], dtype=np.int64)
    flat = np.fromiter((q for r in d.routes for q in r), dtype=np.int64, count=int(lengths.sum()))
    route_start = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    route = np.asarray(d.flow_route)[flows]
    count = lengths[route]
    flow_of_entry = np.repeat(flows, count)
    rank = np.arange(len(flow_of_entry), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    port_of_entry = flat[np.repeat(route_start[route], count) + rank]
    order = np.argsort(port_of_entry, kind="stable")
    return port_of_entry[order], flow_of_entry[order]


def _key_encoder(dag):
    """``name_json(i)``: op ``i``'s key as a JSON string, the escaped stem made once per stem
    (a compute op's key is ``<stem>@c<chip>``)."""
    key_stem, key_arg, stems, key, spec = dag.key_stem, dag.key_arg, dag.stems, dag.key, dag.spec
    prefix: dict[int, str] = {}
    whole: dict[tuple, str] = {}   # a communication op's key: its stem, form and group (its spec)

    def name_json(i: int) -> str:
        a = key_arg[i]
        if a >= 0:
            st = key_stem[i]
            pre = prefix.get(st)
            if pre is None:
                pre = prefix[st] = _string(stems[st])[:-1] + "@c"
            return f'{pre}{a}"'
        if a <= KEY_VERBATIM:
            return _string(key(i))
        k = (key_stem[i], a, spec[i])
        text = whole.get(k)
        if text is None:
            text = whole[k] = _string(key(i))
        return text
    return name_json


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


def trace_events(sim: SimResult, topo: Topology, layers: frozenset | None = None) -> list[dict]:
    """The trace's events as a list of dicts (for inspection; files are streamed by
    :func:`dump_trace`)."""
    return [json.loads(e) for e in iter_trace_events(sim, topo, layers)]


def _port_pid(topo: Topology, port: int, leaf_pid: int) -> tuple[int, int]:
    """(process, resource kind) a port is drawn in; fabric tiers get processes of their own."""
    kind = topo.resource_kind(port)
    chip = topo.resource_owner_chip(port)
    if chip >= 0:
        return chip, kind
    return leaf_pid + topo.leaf_of_resource(port), kind


def _fabric_process(topo: Topology, port: int, pid: int):
    """The metadata events naming a fabric tier's process (emitted at its uplink port)."""
    yield _dumps({"ph": "M", "name": "process_name", "pid": pid,
                  "args": {"name": f"fabric {topo.resource_name(port).split('.')[0]}"}})
    yield _dumps({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})


TIMELINE_COLUMNS = ("key", "kind", "name", "layer", "owner", "chips", "op_class", "reason", "primitive",
                    "algorithm", "protocol", "channels", "flops", "hbm_bytes", "bytes_per_rank", "start_s", "end_s",
                    "kernels")


def timeline_rows(sim: SimResult, system=None, phase: str = ""):
    """One row per op, in op order: what ran where, when, and how much (what is alike for
    every op of one spec is made once). With ``system``, a kernel that runs inside another
    under the system's framework is marked ``fused=<fusion>`` (g5core.inputs.framework)."""
    _every_chip(sim)
    d = sim.compiled
    dag = sim.dag
    spec, specs, is_comm, layer, chip, key = dag.spec, dag.specs, dag.spec_is_comm, dag.layer, dag.chip, dag.key
    algos, spec_algo = d.algos, d.spec_algo
    start, end = sim.start_s.tolist(), sim.end_s.tolist()
    parts: dict[int, tuple] = {}
    for i in range(d.n_ops):
        s = spec[i]
        part = parts.get(s)
        if part is None:
            p = specs[s]
            if is_comm[s]:   # a CommSpec
                algorithm, protocol, channels = algos[spec_algo[s]]
                part = parts[s] = ("comm", p.name, p.owner, " ".join(map(str, p.group)), "", p.reason, p.primitive, algorithm,
                                   protocol, channels, "", "", repr(p.bytes_per_rank), "")
            else:            # a ComputeSpec
                fusions = kernel_fusions(p, system, phase) if system is not None else None
                part = parts[s] = ("compute", p.name, p.owner, None, p.op_class, "", "", "", "", "", repr(p.flops),
                                   repr(p.hbm_bytes), "", describe_kernels(p.kernels, fusions))
        kind, name, owner, chips, *rest, kernels = part
        yield (key(i), kind, name, layer[i], owner, str(chip[i]) if chips is None else chips, *rest,
               repr(start[i]), repr(end[i]), kernels)


def dump_timeline(sim: SimResult, fh, system=None, phase: str = "") -> None:
    """Per-op start and end times as CSV (one header line, then one row per op), streamed;
    with ``system`` the fused kernels are marked (:func:`timeline_rows`)."""
    w = csv.writer(fh, lineterminator="\n")
    w.writerow(TIMELINE_COLUMNS)
    rows = timeline_rows(sim, system, phase)
    while True:
        block = list(itertools.islice(rows, STREAM_BLOCK))
        if not block:
            break
        w.writerows(block)


#: events or rows formatted before one write to the file (bounds memory, amortises writes)
STREAM_BLOCK = 4096


def dump_trace(sim: SimResult, topo: Topology, fh, layers: frozenset | None = None) -> None:
    """Write the trace JSON to an open text file, event by event (never the whole list in
    memory); ``layers``: only those layers' ops (:func:`iter_trace_events`)."""
    events = iter_trace_events(sim, topo, layers)
    fh.write('{"traceEvents":[')
    first = True
    while True:
        block = list(itertools.islice(events, STREAM_BLOCK))
        if not block:
            break
        fh.write(("" if first else ",") + ",".join(block))
        first = False
    fh.write('],"displayTimeUnit":"ns","otherData":')
    fh.write(_dumps({"latency_s": sim.latency_s, "phase": sim.phase}))
    fh.write("}")
