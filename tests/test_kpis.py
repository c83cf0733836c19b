"""The six conservation KPIs: exactly 0 on every shipped example and on random DAGs, and
each one non-zero under an engine broken in the way it guards against."""
from __future__ import annotations

import json
import pathlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from g5core.sim.engine import Engine
from g5core.api.errors import ConservationError
from g5core.sim.results import KPI_NAMES, check_conservation
from g5core.session.run import load_raw, make_plan, simulate_plan

from helpers_engine import (
    BROKEN_ENGINES, EXAMPLES_DIR, DagBuilder, all_zero, raw_config, synthetic_plan, write_system, write_tiny_model,
)

EXAMPLES = sorted(EXAMPLES_DIR.glob("*.yaml"))
# 1M-token examples are shrunk to 64K tokens (same layout, same number of ops) to stay fast
SHRINK = {"seq_len": 65536}
# Examples with over ~200K ops keep their parallel structure on fewer replicas/ring ranks here
# (the full-size runs are in benchmarks/bench.py, which checks the KPIs too).
SHRINK_CHIPS = {"llama-3.1-405b-1m-prefill-cp16": ["chips=32", "parallel.dp=1", "parallel.cp=4"]}


def test_kpi_names_are_the_six_invariants_the_stored_runs_report():
    stored = sorted((pathlib.Path(__file__).parent / "data" / "examples_json").glob("*.json"))
    assert stored
    for path in stored:
        assert sorted(json.loads(path.read_text())["conservation"]) == sorted(KPI_NAMES), path.name
    assert len(set(KPI_NAMES)) == 6


# -- zero on every shipped example -------------------------------------------------------


def test_examples_are_shipped():
    assert len(EXAMPLES) >= 6


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_kpis_are_zero_on_shipped_example(path):
    raw = load_raw(path)
    overrides = [f"{k}={v}" for k, v in SHRINK.items() if raw["seq_len"] > v]
    overrides += SHRINK_CHIPS.get(path.stem, [])
    raw = load_raw(path, overrides)
    sim = simulate_plan(make_plan(raw), check=False)
    assert set(sim.kpis) == set(KPI_NAMES)
    assert sim.kpis == {name: 0 for name in KPI_NAMES}
    assert sim.latency_s > 0
    assert all(sim.end_s == sim.end_s)  # every op finished


# -- zero on random DAGs -----------------------------------------------------------------

_PRIMITIVES = ("p2p", "all_reduce", "all_to_all")
_SYSTEMS = {
    # two chips per node, so 3- and 4-chip groups cross the network
    "timed": dict(chips_per_node=2, intra_node_latency_s=1.0e-6, network_latency_s=4.0e-6,
                  launch_overhead_s=2.0e-6, intra_node_bw_bytes_per_s=100e9, network_bw_bytes_per_s=10e9),
    # zero latencies and no launch overhead: zero-length ops and simultaneous events
    "instant": dict(chips_per_node=2, intra_node_latency_s=0.0, network_latency_s=0.0, launch_overhead_s=0.0,
                    intra_node_bw_bytes_per_s=100e9, network_bw_bytes_per_s=10e9),
}
_CHIPS = (2, 3, 4)


@pytest.fixture(scope="module")
def random_plans(tmp_path_factory):
    d = tmp_path_factory.mktemp("random")
    return {(s, n): synthetic_plan(d, n, **fields) for s, fields in _SYSTEMS.items() for n in _CHIPS}


@st.composite
def random_dags(draw):
    chips = draw(st.sampled_from(_CHIPS))
    system = draw(st.sampled_from(sorted(_SYSTEMS)))
    n_ops = draw(st.integers(1, 12))
    ops = []
    for _ in range(n_ops):
        kind = draw(st.sampled_from(("compute",) + _PRIMITIVES))
        if kind == "compute":
            ops.append(("compute", draw(st.integers(0, chips - 1)),
                        draw(st.sampled_from([0.0, 1e6, 3e9, 2e11])),
                        draw(st.sampled_from([0.0, 1e5, 7e8])),
                        draw(st.sampled_from(["gemm", "attention", "elementwise"]))))
        else:
            perm = draw(st.permutations(range(chips)))
            size = 2 if kind == "p2p" else draw(st.integers(2, chips))
            ops.append((kind, tuple(perm[:size]), draw(st.sampled_from([0.0, 1.0, 4096.0, 3e6, 5e7]))))
    edges = draw(st.lists(st.tuples(st.integers(0, n_ops - 1), st.integers(0, n_ops - 1))
                          .filter(lambda e: e[0] < e[1]), max_size=3 * n_ops))
    return system, chips, ops, sorted(set(edges))


def _build(ops, edges) -> DagBuilder:
    b = DagBuilder()
    for i, op in enumerate(ops):
        if op[0] == "compute":
            _, chip, flops, hbm, op_class = op
            b.compute(f"op{i:02d}", chip, flops, hbm, op_class)
        else:
            kind, group, nbytes = op
            b.comm(f"op{i:02d}", kind, group, nbytes, reason=kind)
    for u, v in edges:
        b.edge(f"op{u:02d}", f"op{v:02d}")
    return b


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=random_dags())
def test_kpis_are_zero_on_random_dags(random_plans, spec):
    system, chips, ops, edges = spec
    run = _build(ops, edges).run(random_plans[(system, chips)])
    assert run.kpis == {name: 0 for name in KPI_NAMES}
    # and the run is complete and causal
    for u, v in edges:
        assert run.engine.start_s[v] >= run.engine.end_s[u]
    assert run.makespan_s == max(run.engine.end_s)


def test_zero_length_ops_on_one_chip_do_not_count_as_overlapping(random_plans):
    """On a system without launch overhead an op with no work takes 0 s; it and the op
    that starts right after it share a start time without overlapping. The KPI must not
    depend on the op ids' order."""
    plan = random_plans[("instant", 2)]
    b = DagBuilder()
    b.compute("0_empty", 0, 0.0)  # op id 0; runs first, from 0 s to 0 s
    b.compute("a_long", 0, 1e9)   # op id 1; runs second, from 0 s
    run = b.run(plan)
    assert run.start_s("0_empty") == run.end_s("0_empty") == 0.0
    assert run.start_s("a_long") == 0.0
    assert run.kpis["overlapping_compute_intervals"] == 0
    # the other way round: the empty op (id 1) starts when the long one ends
    b = DagBuilder()
    b.compute("a_long", 0, 1e9)
    b.compute("0_empty", 0, 0.0)
    run = b.run(plan)
    assert run.start_s("0_empty") == run.end_s("0_empty") == run.end_s("a_long") > 0.0
    assert run.kpis["overlapping_compute_intervals"] == 0


# -- each KPI fails under the engine that breaks it ----------------------------------------


@pytest.fixture(scope="module")
def plan4(tmp_path_factory):
    return synthetic_plan(tmp_path_factory.mktemp("broken"), 4, chips_per_node=4)


def _bait(plan):
    """A small DAG with something for each broken engine to get wrong.

    G (chip 3) -> P3 (P2P 3 -> 1) -> Z (chip 3) is a chain through a transfer; D and E
    are independent on chip 2; two P2P out of chip 0 share its send port.
    """
    b = DagBuilder()
    b.compute("G", 3, 1e9)
    b.p2p("P3", 3, 1, 8e6)
    b.compute("Z", 3, 1e9)
    b.edge("G", "P3")
    b.edge("P3", "Z")
    b.compute("D", 2, 1e9)
    b.compute("E", 2, 1e9)
    b.p2p("P1", 0, 1, 8e6)
    b.p2p("P2", 0, 2, 8e6)
    return b


def test_bait_dag_is_clean_with_the_real_engine(plan4):
    assert all_zero(_bait(plan4).run(plan4, Engine).kpis)


@pytest.mark.parametrize("kpi", KPI_NAMES)
def test_broken_engine_makes_its_kpi_non_zero_on_a_hand_built_dag(plan4, kpi):
    run = _bait(plan4).run(plan4, BROKEN_ENGINES[kpi])
    assert run.kpis[kpi] != 0, run.kpis
    with pytest.raises(ConservationError) as info:
        check_conservation(run.kpis)
    assert kpi in str(info.value)
    assert info.value.kpis == run.kpis


def test_skipped_op_counts_once_and_its_successors_too(plan4):
    b = DagBuilder()
    b.compute("first", 0, 1e9)
    b.compute("then", 0, 1e9)
    b.edge("first", "then")
    run = b.run(plan4, BROKEN_ENGINES["ops_not_executed_once"])
    assert run.kpis["ops_not_executed_once"] == 2


def test_early_release_is_caught_on_the_op_released(plan4):
    b = DagBuilder()
    b.compute("make", 0, 1e9)
    b.p2p("send", 0, 1, 8e6)
    b.compute("use", 1, 1e9)
    b.edge("make", "send")
    b.edge("send", "use")
    run = b.run(plan4, BROKEN_ENGINES["ops_started_before_predecessor_finished"])
    assert run.start_s("use") == run.end_s("make") < run.end_s("send")
    assert run.kpis["ops_started_before_predecessor_finished"] == 1


def test_dropped_flow_is_caught_by_the_byte_kpi(plan4):
    """A flow the engine drops was handed to the network and never arrived: the byte KPI
    counts it, and the comm op it belongs to never completes."""
    nbytes = 8e6
    b = DagBuilder()
    b.p2p("P", 0, 1, nbytes)
    run = b.run(plan4, BROKEN_ENGINES["bytes_injected_minus_delivered"])
    assert run.kpis["bytes_injected_minus_delivered"] == int(nbytes)
    assert run.kpis["ops_not_executed_once"] == 1


def test_greedy_ports_excess_is_the_extra_bytes_carried(plan4):
    """Two flows of N bytes each at full rate B on one port of capacity B for N/B seconds:
    B * N/B = N bytes beyond capacity."""
    nbytes = 8e6
    b = DagBuilder()
    b.p2p("P1", 0, 1, nbytes)
    b.p2p("P2", 0, 2, nbytes)
    run = b.run(plan4, BROKEN_ENGINES["port_bytes_beyond_capacity"])
    assert run.kpis["port_bytes_beyond_capacity"] == pytest.approx(nbytes, abs=1)


def test_half_flops_gap_is_half_the_dag_flops(plan4):
    b = DagBuilder()
    b.compute("x", 0, 4e9)
    b.compute("y", 1, 2e9)
    run = b.run(plan4, BROKEN_ENGINES["dag_flops_minus_executed_flops"])
    assert run.kpis["dag_flops_minus_executed_flops"] == 3e9


# -- simulate_plan() refuses a broken engine's result ---------------------------------------------


@pytest.fixture(scope="module")
def busy_raw(tmp_path_factory):
    """Tiny mixtral on 8 chips with TP, CP pass-KV and EP all-to-alls (shared ports), and
    attention long enough that a ring step overlaps the next block's arrival."""
    d = tmp_path_factory.mktemp("busy")
    model = write_tiny_model(d, "mixtral-8x7b", layers=2)
    system = write_system(d, chips_per_node=8)
    return raw_config(model, system, 8, seq_len=16384, tp=4, cp=2, ep=4, dp=1)


def test_busy_config_is_clean_with_the_real_engine(busy_raw):
    sim = simulate_plan(make_plan(busy_raw))
    assert all_zero(sim.kpis)
    assert {"tp_allreduce", "cp_passkv", "ep_dispatch", "ep_combine"} <= set(sim.comm_bytes["by_reason"])


@pytest.mark.parametrize("kpi", KPI_NAMES)
def test_simulate_raises_conservation_error_with_a_broken_engine(busy_raw, kpi):
    with pytest.raises(ConservationError) as info:
        simulate_plan(make_plan(busy_raw), engine_cls=BROKEN_ENGINES[kpi])
    kpis = info.value.kpis
    assert set(kpis) == set(KPI_NAMES)
    assert kpis[kpi] != 0, kpis
    assert kpi in str(info.value)
