"""Symmetric replicas: one dp replica simulated and its results replicated gives exactly the
results of simulating every chip; symmetry is refused, with the reason, where a dimension or
a shared resource joins the replicas."""
from __future__ import annotations

import json

import pytest
import yaml

from g5core.session.run import make_plan, run
from g5core.lower.symmetry import plan_symmetry
from g5core.inputs.systems import get_system

from test_cli import invoke

# what a symmetric run reports about itself rather than about the cluster
SIMULATED = ("ops", "flows", "events", "sim_wall_s", "symmetry")


def cfg(model="llama-3.1-8b", system="h100-sxm", seq_len=4096, phase="prefill", batch=1, **parallel):
    par = {"dp": 1, "pp": 1, "cp": 1, "tp": 1}
    par.update(parallel)
    chips = 1
    for v in par.values():
        chips *= v
    return {"model": model, "system": system, "chips": chips, "parallel": par, "phase": phase, "batch": batch,
            "seq_len": seq_len}


@pytest.mark.parametrize("raw, replicas", [
    (cfg(dp=4, tp=2), 4),                                   # replicas inside one node
    (cfg(dp=2, pp=2, tp=2), 2),                             # pipeline stages inside each replica
    (cfg(dp=2, cp=4, tp=4, seq_len=8192), 2),               # a CP ring across two nodes per replica
    (cfg(phase="decode", batch=8, dp=2, pp=2, tp=4), 2),    # decode, pp across nodes
])
def test_one_replica_simulated_gives_exactly_the_results_of_every_chip(raw, replicas):
    reduced, full = run(raw), run(raw, symmetry=False)
    assert reduced.sim.symmetry.replicas == replicas and full.sim.symmetry.replicas == 1
    a, b = reduced.to_json_dict(), full.to_json_dict()
    assert a["conservation"] == b["conservation"] == {k: 0 for k in b["conservation"]}
    # latency, memory, comm bytes by reason, overlap, collectives, compute coverage: bit for bit
    assert {k: v for k, v in a.items() if k not in SIMULATED} == {k: v for k, v in b.items() if k not in SIMULATED}
    assert a["latency_s"] == b["latency_s"] and a["comm_bytes"] == b["comm_bytes"] and a["overlap"] == b["overlap"]
    assert a["comm_bytes"]["total_bytes"] > 0
    # what was simulated: one replica's share of everything
    assert a["ops"] * replicas == b["ops"] and a["flows"] * replicas == b["flows"]
    assert a["symmetry"] == {"replicas": replicas, "dimension": "dp", "simulated_chips": raw["chips"] // replicas,
                             "refused": None}
    assert b["symmetry"]["refused"] == "symmetry=False"


def test_symmetry_holds_for_a_moe_model_whose_ep_groups_stay_inside_a_replica():
    raw = cfg(model="deepseek-v3", system="h200", seq_len=2048, dp=2, tp=8)
    raw["parallel"]["ep"] = 8
    plan = make_plan(raw)
    sym = plan_symmetry(plan.ctx)
    assert sym.applied and sym.replicas == 2 and sym.slice_chips == 8


def test_ep_groups_across_replicas_refuse_symmetry_and_say_so():
    # the CP spec's use case: ep = 8 is carved from dp x tp = 4 x 2 chips, one from each replica
    raw = yaml.safe_load(open("examples/deepseek-v3-1m-prefill-cp8.yaml"))
    sym = plan_symmetry(make_plan(raw).ctx)
    assert not sym.applied
    assert sym.reason.startswith("ep group [0, 1, 16, 17") and "spans several dp replicas" in sym.reason
    result = invoke("explain", "examples/deepseek-v3-1m-prefill-cp8.yaml")
    assert "symmetry: every chip simulated (ep group [0, 1, 16, 17" in result.output


def test_an_oversubscribed_fabric_refuses_symmetry(tmp_path):
    fields = get_system("h100-sxm").to_dict()
    fields.update(name="h100-2to1", fabric={"nodes_per_leaf": 1, "oversubscription": 2.0})
    path = tmp_path / "h100-2to1.yaml"
    path.write_text(yaml.safe_dump(fields))
    raw = cfg(system=str(path), dp=2, cp=2, tp=8)
    out = run(raw)
    assert out.sim.symmetry.replicas == 1
    assert out.sim.symmetry.reason == "the system's fabric is 2:1 oversubscribed: replicas share leaf uplinks"
    assert out.to_json_dict()["symmetry"]["refused"] == out.sim.symmetry.reason


def test_replicas_placed_unlike_on_the_nodes_are_refused():
    # replicas of 12 chips on 8-chip nodes: replica 1 starts mid-node
    sym = plan_symmetry(make_plan(cfg(dp=2, cp=3, tp=4, seq_len=6144)).ctx)
    assert sym.reason == "a replica of 12 chips is neither a multiple nor a divisor of the 8 chips of a node"


def test_no_symmetry_flag_simulates_every_chip(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg(dp=4, tp=2)))
    on = json.loads(invoke("run", path, "--json").output)
    off = json.loads(invoke("run", path, "--json", "--no-symmetry").output)
    assert on["symmetry"]["replicas"] == 4 and off["symmetry"]["refused"] == "turned off (--no-symmetry)"
    assert on["latency_s"] == off["latency_s"] and on["ops"] * 4 == off["ops"]
    text = invoke("run", path).output
    assert "(one of 4 identical dp replicas)" in text
    # a timeline lists every chip's ops, so it simulates every chip
    timeline = tmp_path / "t.csv"
    with_timeline = invoke("run", path, "--json", "--timeline", timeline).output
    assert json.loads(with_timeline)["symmetry"]["refused"] == "--trace and --timeline draw every chip"


def test_a_plugin_placing_ops_outside_the_replica_falls_back_to_every_chip():
    from g5core import Fragment, hookimpl

    class Stray:
        """Adds, to the final norm, an op on the last chip whatever it was asked to place."""

        @hookimpl
        def g5_expand_op(self, ctx, lop):
            if lop.kind != "final_norm":
                return None
            chips = sorted(set(ctx.place(lop)) | {ctx.rankmap.chips - 1})
            work = ctx.work(lop.kind)
            return Fragment.single_chip_ops(ctx.compute_op(lop, c, work, owner="stray") for c in chips)

    out = run(cfg(dp=2, tp=2), extra_plugins=[("stray", Stray())])
    assert out.sim.symmetry.replicas == 1
    assert out.sim.symmetry.reason.startswith("plugin 'stray' placed op ") and "outside the simulated replica" \
        in out.sim.symmetry.reason


@pytest.mark.parametrize("dp,max_ops", [
    (2, 1_000_000),                                       # 1.8 M in all, under a limit of 1 M
    pytest.param(16, None, marks=pytest.mark.bench),      # 14 M in all, at the default limit: 5-10 s on 2 cores
])
def test_the_size_guard_counts_the_replica_that_is_simulated(dp, max_ops):
    from g5core.lower.builder import DEFAULT_MAX_OPS, check_size
    from g5core.api.errors import ResourceError

    # llama-3.1-405b, 1M tokens, dp replicas of TP8 x CP16: 891,216 ops and flows each
    raw = yaml.safe_load(open("examples/llama-3.1-405b-1m-prefill-cp16.yaml"))
    raw.update(chips=128 * dp, parallel=dict(raw["parallel"], dp=dp))
    plan = make_plan(raw)
    sym = plan_symmetry(plan.ctx)
    assert sym.replicas == dp
    one = check_size(plan, max_ops, sym.replicas)
    assert one.total < 1_000_000 and f"in one of {dp} identical replicas" in one.describe()
    limit = DEFAULT_MAX_OPS if max_ops is None else max_ops
    with pytest.raises(ResourceError, match=f"above the limit of {limit:,}"):
        check_size(plan, max_ops)


def test_a_timeline_across_replicas_simulates_every_replica():
    from g5core.present.plots import timeline_figure

    raw = cfg(dp=2, tp=2)
    ax = timeline_figure({"config": raw, "parallel": raw["parallel"], "seq_len": raw["seq_len"]}, group_dim="dp",
                         layer=0).axes[0]
    drawn = [len(c.get_paths()) for c in ax.collections]
    # compute and communication bars for both chips of the dp group (chips 0 and 2)
    assert len(drawn) == 4 and all(drawn)


def test_a_trace_of_a_run_that_simulated_one_replica_is_refused():
    import io

    from g5core.api.errors import G5Error
    from g5core.present.trace import dump_timeline

    out = run(cfg(dp=2, tp=2))
    with pytest.raises(G5Error, match="simulated one of 2 identical dp replicas; a trace or timeline needs every"):
        dump_timeline(out.sim, io.StringIO())
    full = run(cfg(dp=2, tp=2), symmetry=False)
    text = io.StringIO()
    dump_timeline(full.sim, text)
    assert len(text.getvalue().splitlines()) == full.sim.ops + 1


def test_traffic_on_another_replicas_port_or_a_lowering_that_moves_unlike_refuses_symmetry():
    import attrs

    from g5core.lower.builder import build_dag
    from g5core.sim.compile import compile_dag
    from g5core.lower.symmetry import check_resources

    plan = make_plan(cfg(dp=2, tp=2))
    sym = plan_symmetry(plan.ctx)
    dag = build_dag(plan, chips=sym.chips())
    compiled = compile_dag(dag, plan)
    assert sym.slice_chips == 2 and check_resources(sym, dag, compiled, plan) is None
    # a flow of replica 0 that also crossed chip 3's receive link (replica 1's)
    topo = plan.ctx.topology
    route = compiled.routes[compiled.flow_route[0]] + (topo.link_rx(3),)
    flow_route = compiled.flow_route.copy()
    flow_route[0] = len(compiled.routes)
    shared = attrs.evolve(compiled, routes=compiled.routes + (route,), flow_route=flow_route)
    assert check_resources(sym, dag, shared, plan) == "resource chip3.link_rx is shared with another replica"
    # a communication op whose start latency differs from what its move to replica 1 lowers to
    first_comm = int(compiled.is_comm.argmax())
    dur = compiled.spec_duration_s.copy()
    dur[compiled.spec[first_comm]] *= 2
    unlike = attrs.evolve(compiled, spec_duration_s=dur)
    assert check_resources(sym, dag, unlike, plan) == (f"op {dag.ops[first_comm].key!r} lowers differently in dp "
                                                       f"replica 1")
