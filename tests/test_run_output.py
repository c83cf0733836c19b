"""What a run hands back: the JSON report (API and `g5 run --json`), determinism, the trace."""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from g5core.present.cli import main
from g5core.lower.topology import KIND_NAMES, LINK_TX, NIC_TX
from g5core.api.ops import CommOp, ComputeOp
from g5core.sim.results import KPI_NAMES
from g5core.session.run import run
from g5core.present.trace import assign_lanes
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers_engine import raw_config, write_system, write_tiny_model

CHIP_FIELDS = {"chip", "weights_bytes", "kv_cache_bytes", "activation_bytes", "total_bytes", "capacity_bytes", "fits"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny llama (2 layers) on 4 chips, 2 per node: TP inside a node, CP across nodes."""
    d = tmp_path_factory.mktemp("run_output")
    model = write_tiny_model(d, "llama-3.1-8b", layers=2)
    system = write_system(d, chips_per_node=2)
    raws = {
        "prefill": raw_config(model, system, 4, phase="prefill", seq_len=4096, tp=2, cp=2, dp=1),
        "decode": raw_config(model, system, 4, phase="decode", batch=4, seq_len=8192, tp=2, cp=2, dp=1),
    }
    paths = {}
    for phase, raw in raws.items():
        p = d / f"{phase}.yaml"
        p.write_text(yaml.safe_dump(raw), encoding="utf-8")
        paths[phase] = p
    return d, raws, paths


def _without_wall(out: dict) -> dict:
    out = dict(out)
    assert isinstance(out.pop("sim_wall_s"), float)
    return out


# -- determinism -------------------------------------------------------------------------


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_same_config_twice_gives_identical_json_apart_from_wall_time(files, phase):
    _, raws, _ = files
    a, b = run(raws[phase]), run(raws[phase])
    ja, jb = _without_wall(a.to_json_dict()), _without_wall(b.to_json_dict())
    assert json.dumps(ja, sort_keys=True) == json.dumps(jb, sort_keys=True)
    # bit for bit, the whole timeline
    assert np.array_equal(a.sim.start_s, b.sim.start_s)
    assert np.array_equal(a.sim.end_s, b.sim.end_s)
    assert np.array_equal(a.sim.flow_end_s, b.sim.flow_end_s)


# -- `g5 run --json` ---------------------------------------------------------------------


def _cli(args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, (result.output, result.exception)
    return result


@pytest.fixture(scope="module")
def cli_json(files):
    _, _, paths = files
    return {phase: json.loads(_cli(["run", p, "--json"]).stdout) for phase, p in paths.items()}


@pytest.mark.parametrize("phase,metric", [("prefill", "ttft_s"), ("decode", "tpot_s")])
def test_cli_json_is_one_object_with_the_report(cli_json, files, phase, metric):
    out = cli_json[phase]
    assert isinstance(out, dict)
    assert out["phase"] == phase
    assert out[metric] == out["latency_s"] > 0
    other = {"ttft_s": "tpot_s", "tpot_s": "ttft_s"}[metric]
    assert other not in out
    assert out["conservation"] == {name: 0 for name in KPI_NAMES}
    comm = out["comm_bytes"]
    assert set(comm["by_reason"]) == set(comm["per_rank_by_reason"])
    assert "tp_allreduce" in comm["by_reason"]
    assert ("cp_passkv" if phase == "prefill" else "cp_passq_dispatch") in comm["by_reason"]
    for reason, total in comm["by_reason"].items():
        assert 0 < comm["per_rank_by_reason"][reason] <= total
    ov = out["overlap"]
    assert 0 <= ov["exposed_comm_s"] <= ov["comm_time_s"]
    assert ov["comm_time_s"] > 0
    assert isinstance(out["ops"], int) and out["ops"] > 0
    assert isinstance(out["events"], int) and out["events"] >= out["ops"]
    assert isinstance(out["sim_wall_s"], float)
    mem = out["memory"]
    assert [c["chip"] for c in mem["per_chip"]] == [0, 1, 2, 3]
    for c in mem["per_chip"]:
        assert CHIP_FIELDS <= set(c)
        assert c["total_bytes"] >= c["weights_bytes"] + c["kv_cache_bytes"] + c["activation_bytes"] - 1
        assert c["fits"] == (c["total_bytes"] <= c["capacity_bytes"])
    assert mem["max_total_bytes"] == max(c["total_bytes"] for c in mem["per_chip"])


def test_cli_json_matches_the_api(cli_json, files):
    _, raws, _ = files
    api = _without_wall(run(raws["prefill"]).to_json_dict())
    cli = _without_wall(cli_json["prefill"])
    assert json.dumps(cli, sort_keys=True) == json.dumps(api, sort_keys=True)


# -- `g5 run --trace` --------------------------------------------------------------------


@pytest.fixture(scope="module")
def trace(files):
    d, raws, paths = files
    path = d / "trace.json"
    _cli(["run", paths["prefill"], "--trace", path])
    return json.loads(path.read_text(encoding="utf-8")), run(raws["prefill"])


def test_trace_is_valid_json_with_trace_events(trace):
    payload, _ = trace
    assert isinstance(payload["traceEvents"], list) and payload["traceEvents"]
    for ev in payload["traceEvents"]:
        assert {"ph", "name", "pid"} <= set(ev)


def _thread_names(payload) -> dict:
    return {(ev["pid"], ev["tid"]): ev["args"]["name"] for ev in payload["traceEvents"]
            if ev["ph"] == "M" and ev["name"] == "thread_name"}


def test_trace_has_one_compute_slice_per_compute_op_on_its_chip_track(trace):
    payload, out = trace
    sim = out.sim
    names = _thread_names(payload)
    slices = {ev["name"]: ev for ev in payload["traceEvents"]
              if ev["ph"] == "X" and names[(ev["pid"], ev["tid"])] == "compute"}
    compute = [op for op in sim.dag.ops if isinstance(op, ComputeOp)]
    assert len(slices) == len(compute)
    assert len({ev["tid"] for ev in slices.values()}) == 1
    for op in compute:
        ev = slices[op.key]
        assert ev["pid"] == op.chip
        s, e = sim.op_times(op.key)
        assert ev["ts"] == pytest.approx(s * 1e6, rel=1e-12)
        assert ev["dur"] == pytest.approx((e - s) * 1e6, rel=1e-9, abs=1e-9)


def _track(name: str) -> str:
    """'port nic_tx #2' -> 'port nic_tx': the track a lane belongs to."""
    return name.split(" #")[0]


def test_slices_of_one_lane_never_overlap(trace):
    """Perfetto only draws nested slices on a thread: every lane must be overlap-free."""
    payload, _ = trace
    by_thread: dict = {}
    for ev in payload["traceEvents"]:
        if ev["ph"] == "X":
            by_thread.setdefault((ev["pid"], ev["tid"]), []).append((ev["ts"], ev["ts"] + ev["dur"]))
    assert by_thread
    for spans in by_thread.values():
        spans.sort()
        for (_, e0), (s1, _) in zip(spans, spans[1:]):
            assert s1 >= e0 - 1e-6 * max(1.0, abs(e0))


def test_trace_puts_each_flow_on_the_track_of_every_port_it_crosses(trace):
    payload, out = trace
    sim = out.sim
    c = sim.compiled
    topo = out.plan.ctx.topology
    names = _thread_names(payload)
    flows = [ev for ev in payload["traceEvents"] if ev["ph"] == "X"
             and names[(ev["pid"], ev["tid"])].startswith("port ")]
    n_flows = len(c.flow_bytes)
    assert n_flows > 0
    assert len(flows) == sum(len(r) for r in c.flow_ports)
    seen_kinds = set()
    by_track: dict = {}
    for ev in flows:
        by_track.setdefault((ev["pid"], _track(names[(ev["pid"], ev["tid"])])), []).append(ev)
    for f in range(n_flows):
        op = sim.dag.ops[c.flow_op[f]]
        assert isinstance(op, CommOp)
        for port in c.flow_ports[f]:
            kind = topo.resource_kind(port)
            seen_kinds.add(kind)
            track = by_track[(topo.resource_owner_chip(port), f"port {KIND_NAMES[kind]}")]
            match = [ev for ev in track if ev["args"]["op"] == op.key and ev["args"]["port"] == topo.resource_name(port)
                     and ev["args"]["bytes"] == c.flow_bytes[f]
                     and ev["ts"] == pytest.approx(sim.flow_start_s[f] * 1e6, rel=1e-12)
                     and ev["dur"] == pytest.approx((sim.flow_end_s[f] - sim.flow_start_s[f]) * 1e6,
                                                    rel=1e-9, abs=1e-9)]
            assert match, (f, topo.resource_name(port))
            assert all(op.reason in ev["name"] and ev["cat"] == op.reason for ev in match)
    # the layout has both link (TP in a node) and network (CP across nodes) traffic
    assert {LINK_TX, NIC_TX} <= seen_kinds


def test_port_counters_carry_the_bandwidth_and_never_exceed_capacity(trace):
    payload, out = trace
    topo = out.plan.ctx.topology
    counters = [ev for ev in payload["traceEvents"] if ev["ph"] == "C"]
    assert counters
    by_name = {f"{topo.resource_name(r)} GB/s": cap for r, cap in enumerate(topo.capacities())}
    seen_nonzero = False
    for ev in counters:
        cap_gb_s = by_name[ev["name"]] / 1e9
        assert 0.0 <= ev["args"]["GB/s"] <= cap_gb_s * (1 + 1e-9)
        seen_nonzero |= ev["args"]["GB/s"] > 0
    assert seen_nonzero
    # every port's counter falls back to zero when its last flow ends
    last: dict = {}
    for ev in sorted(counters, key=lambda e: e["ts"]):
        last[ev["name"]] = ev["args"]["GB/s"]
    assert all(v == 0.0 for v in last.values())


def test_comm_ops_appear_on_every_member_chip(trace):
    payload, out = trace
    names = _thread_names(payload)
    on_chip = {(ev["pid"], ev["name"]) for ev in payload["traceEvents"]
               if ev["ph"] == "X" and _track(names[(ev["pid"], ev["tid"])]) == "comm ops"}
    comm = [op for op in out.sim.dag.ops if isinstance(op, CommOp)]
    assert comm
    for op in comm:
        for chip in op.group:
            assert (chip, op.key) in on_chip


def test_trace_written_with_json_output_too(files, tmp_path):
    _, _, paths = files
    path = tmp_path / "t.json"
    out = json.loads(_cli(["run", paths["decode"], "--json", "--trace", path]).stdout)
    assert out["phase"] == "decode"
    assert json.loads(path.read_text(encoding="utf-8"))["traceEvents"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 20)), max_size=40))
def test_assign_lanes_uses_the_fewest_overlap_free_lanes(spans):
    intervals = [(float(s), float(s + w)) for s, w in spans]
    lanes = assign_lanes(intervals)
    for lane in set(lanes):
        mine = sorted(iv for iv, ln in zip(intervals, lanes) if ln == lane)
        assert all(b[0] >= a[1] for a, b in zip(mine, mine[1:]))
    # the fewest possible: the most intervals that pairwise conflict at one instant; a
    # zero-length slice conflicts with the slices strictly around it
    points = sorted({p for iv in intervals for p in iv})
    depth = max((max(sum(1 for s, e in intervals if s <= p < e),
                     sum(1 for s, e in intervals if s < p < e) + any(s == e == p for s, e in intervals))
                 for p in points), default=0)
    assert len(set(lanes)) == max(depth, 1 if intervals else 0)


def test_same_output_across_processes_and_hash_seeds(files, tmp_path):
    """Bit for bit: two processes with different string-hash seeds print the same JSON."""
    import os
    import subprocess
    import sys

    _, _, paths = files
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        proc = subprocess.run([sys.executable, "-m", "g5core.present.cli", "run", str(paths["prefill"]), "--json"],
                              capture_output=True, text=True, env=env, check=True)
        data = json.loads(proc.stdout)
        data.pop("sim_wall_s")
        outs.append(json.dumps(data, sort_keys=True))
    assert outs[0] == outs[1]


def test_timeline_csv_has_every_op_with_its_times(files, tmp_path):
    import csv

    _, raws, paths = files
    path = tmp_path / "ops.csv"
    _cli(["run", paths["prefill"], "--timeline", path])
    with open(path, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    sim = run(raws["prefill"]).sim
    assert len(rows) == len(sim.dag.ops)
    for row, op in zip(rows, sim.dag.ops):
        assert row["key"] == op.key
        s, e = sim.op_times(op.key)
        assert float(row["start_s"]) == s and float(row["end_s"]) == e
        if isinstance(op, CommOp):
            assert row["kind"] == "comm" and row["reason"] == op.reason
            assert [int(c) for c in row["chips"].split()] == list(op.group)
            assert float(row["bytes_per_rank"]) == op.bytes_per_rank
        else:
            assert row["kind"] == "compute" and int(row["chips"]) == op.chip
            assert float(row["flops"]) == op.flops
    assert max(float(r["end_s"]) for r in rows) == sim.latency_s
