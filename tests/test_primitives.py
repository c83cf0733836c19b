"""Communication primitives on hand-built DAGs against independent closed forms.

Every DAG here is written by hand and run on a synthetic system whose link bandwidth B,
link latency a, network bandwidth b_net and network latency a_net are known, so each
timing can be checked against the textbook formula (not against the lowering code).
"""
from __future__ import annotations

import pytest

from g5plugins.collectives import nccl
from helpers_engine import DagBuilder, all_zero, synthetic_plan

LINK_BW_BYTES_PER_S = 100.0e9
LINK_LATENCY_S = 1.0e-6
NET_BW_BYTES_PER_S = 8.0e9
NET_LATENCY_S = 5.0e-6
N_BYTES = 64.0 * 2 ** 20  # 64 MiB buffer per rank

REL = 1e-12


def _system(chips_per_node: int, link_latency_s: float = LINK_LATENCY_S) -> dict:
    # the ring is forced so its time has a closed form (the tuner is tested in test_nccl.py)
    return dict(chips_per_node=chips_per_node, intra_node_bw_bytes_per_s=LINK_BW_BYTES_PER_S,
                intra_node_latency_s=link_latency_s, network_bw_bytes_per_s=NET_BW_BYTES_PER_S,
                network_latency_s=NET_LATENCY_S, nccl={"all_reduce": {"algorithm": "ring", "protocol": "simple"}})


# NCCL 2.29.2 tuning.cc: baseLatencies[Ring][Simple] and hwLatencies[NVLINK][Ring][Simple], us
NCCL_RING_SIMPLE_BASE_S, NCCL_RING_SIMPLE_NVLINK_STEP_S = 8.4e-6, 3.4e-6


@pytest.fixture(scope="module")
def one_node_plan(tmp_path_factory):
    """8 chips in one node."""
    return synthetic_plan(tmp_path_factory.mktemp("one_node"), 8, **_system(8))


@pytest.fixture(scope="module")
def plan_factory(tmp_path_factory):
    cache = {}

    def make(chips: int, chips_per_node: int, link_latency_s: float = LINK_LATENCY_S):
        key = (chips, chips_per_node, link_latency_s)
        if key not in cache:
            cache[key] = synthetic_plan(tmp_path_factory.mktemp("plan"), chips,
                                        **_system(chips_per_node, link_latency_s))
        return cache[key]

    return make


# -- P2P ---------------------------------------------------------------------------------


def test_p2p_inside_a_node_takes_latency_plus_bytes_over_link_bandwidth(one_node_plan):
    b = DagBuilder()
    b.p2p("send", 0, 1, N_BYTES)
    run = b.run(one_node_plan)
    assert run.start_s("send") == 0.0
    # exact: one flow alone on its ports gets the whole link from t = a
    assert run.end_s("send") == LINK_LATENCY_S + N_BYTES / LINK_BW_BYTES_PER_S
    assert all_zero(run.kpis)


def test_p2p_between_nodes_uses_the_network_bandwidth_and_latency(plan_factory):
    plan = plan_factory(4, 2)
    b = DagBuilder()
    b.p2p("send", 1, 2, N_BYTES)
    run = b.run(plan)
    assert run.end_s("send") == NET_LATENCY_S + N_BYTES / NET_BW_BYTES_PER_S
    assert all_zero(run.kpis)


@pytest.mark.parametrize("latency_s", [0.0, LINK_LATENCY_S])
def test_p2p_of_zero_bytes_takes_only_the_latency(plan_factory, latency_s):
    plan = plan_factory(2, 2, latency_s)
    b = DagBuilder()
    b.p2p("empty", 0, 1, 0.0)
    run = b.run(plan)
    assert run.end_s("empty") == latency_s
    assert all_zero(run.kpis)


# -- ring all-reduce ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_all_reduce_in_a_node_matches_the_textbook_time(one_node_plan, n):
    b = DagBuilder()
    b.comm("ar", "all_reduce", tuple(range(n)), N_BYTES)
    run = b.run(one_node_plan)
    latency_s = NCCL_RING_SIMPLE_BASE_S + 2 * (n - 1) * NCCL_RING_SIMPLE_NVLINK_STEP_S
    expected_s = latency_s + 2 * (n - 1) / n * N_BYTES / LINK_BW_BYTES_PER_S
    assert run.end_s("ar") == pytest.approx(expected_s, rel=REL)
    # each rank sends exactly 2 (n-1)/n N bytes
    flows = run.flows_of("ar")
    assert len(flows) == n
    for f in flows:
        assert run.compiled.flow_bytes[f] == pytest.approx(2 * (n - 1) / n * N_BYTES, rel=REL)
    assert all_zero(run.kpis)


# -- port sharing ------------------------------------------------------------------------


@pytest.mark.parametrize("flows", [
    (("to1", 0, 1), ("to2", 0, 2)),         # out of chip 0's send port
    (("from1", 1, 0), ("from2", 2, 0)),     # into chip 0's receive port
], ids=["out_of_one_port", "into_one_port"])
def test_two_flows_through_one_port_each_get_half_and_finish_together(one_node_plan, flows):
    b = DagBuilder()
    for key, src, dst in flows:
        b.p2p(key, src, dst, N_BYTES)
    run = b.run(one_node_plan)
    expected_s = LINK_LATENCY_S + 2 * N_BYTES / LINK_BW_BYTES_PER_S
    (first, _, _), (second, _, _) = flows
    assert run.end_s(first) == pytest.approx(expected_s, rel=REL)
    assert run.end_s(second) == pytest.approx(expected_s, rel=REL)
    assert run.end_s(first) == run.end_s(second)
    assert all_zero(run.kpis)


def test_a_second_flow_that_joins_late_slows_the_first_only_while_both_run(one_node_plan):
    """Flow A alone at B, then A and B share chip 0's send port at B/2, then B alone at B."""
    B, a, N = LINK_BW_BYTES_PER_S, LINK_LATENCY_S, N_BYTES
    b = DagBuilder()
    b.p2p("first", 0, 1, N)
    # a compute op delays the second P2P by about a quarter of the first's transfer time
    b.compute("wait", 0, 0.25 * N / B * 1.0e15)  # synthetic bf16 peak 1e15, efficiency 1
    b.p2p("second", 0, 2, N)
    b.edge("wait", "second")
    run = b.run(one_node_plan)
    assert run.start_s("second") == run.end_s("wait")
    joined_s = run.start_s("second") + a            # the second flow's release
    moved_alone_bytes = (joined_s - a) * B           # what the first moved alone
    assert 0 < moved_alone_bytes < N
    first_end_s = joined_s + (N - moved_alone_bytes) / (B / 2)
    assert run.end_s("first") == pytest.approx(first_end_s, rel=REL)
    # the second moved as much as the first did while they shared; the rest goes alone at B
    second_end_s = first_end_s + moved_alone_bytes / B
    assert run.end_s("second") == pytest.approx(second_end_s, rel=REL)
    assert all_zero(run.kpis)


# -- all-to-all across nodes -------------------------------------------------------------


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (2, 4), (4, 2), (4, 1)])
def test_all_to_all_across_nodes_is_bound_by_the_network_interface(plan_factory, nodes, per_node):
    """Each chip sends N/n to every other chip; its n - k cross-node flows share its NIC.

    With the network much slower than the link, the op takes
    ``a_net + (n - k)/n * N / b_net`` (k chips per node); the link flows, k - 1 per link
    port, finish earlier, at ``a_net + (k - 1)/n * N / B``.
    """
    n = nodes * per_node
    plan = plan_factory(n, per_node)
    b = DagBuilder()
    b.comm("a2a", "all_to_all", tuple(range(n)), N_BYTES)
    run = b.run(plan)
    expected_s = NET_LATENCY_S + (n - per_node) / n * N_BYTES / NET_BW_BYTES_PER_S
    assert run.end_s("a2a") == pytest.approx(expected_s, rel=REL)
    # not the link-bound time
    link_bound_s = NET_LATENCY_S + (n - 1) / n * N_BYTES / LINK_BW_BYTES_PER_S
    assert run.end_s("a2a") > 2 * link_bound_s
    topo = plan.ctx.topology
    c = run.compiled
    for f in run.flows_of("a2a"):
        assert c.flow_bytes[f] == pytest.approx(N_BYTES / n, rel=REL)
        if topo.same_node(c.flow_src[f], c.flow_dst[f]):
            assert run.engine.flow_end_s[f] == pytest.approx(
                NET_LATENCY_S + (per_node - 1) / n * N_BYTES / LINK_BW_BYTES_PER_S, rel=REL)
        else:
            assert run.engine.flow_end_s[f] == pytest.approx(expected_s, rel=REL)
    assert all_zero(run.kpis)


def test_all_to_all_inside_a_node_takes_nccls_channel_copy_time_or_the_link_time(one_node_plan):
    """NCCL's grouped send/receive (nccl.py, "point to point"). On a 100 GB/s link NCCL runs
    4 channels (60 GB/s per search channel: 1, duplicated, doubled), so 4 ranks get one
    channel per peer, and each 16 MiB send goes in 32 Simple steps of 512 KiB: one channel
    copies 16 MiB + one step at r; the links would need ``3 x 16 MiB / (eta B)``."""
    n = 4
    r = nccl.P2P_CHANNEL_COPY_RATE_GBYTES_PER_S * 1e9
    eta = nccl.P2P_NVLINK_EFFICIENCY
    b = DagBuilder()
    b.comm("a2a", "all_to_all", tuple(range(n)), N_BYTES)
    run = b.run(one_node_plan)
    copy_s = (N_BYTES / n + 2 ** 19) / r
    link_s = (n - 1) / n * N_BYTES / (eta * LINK_BW_BYTES_PER_S)
    assert copy_s > link_s
    assert run.end_s("a2a") == pytest.approx(LINK_LATENCY_S + copy_s, rel=1e-9)
    # the flows carry the payload over the links' efficiency for copies; the run reports payload
    c = run.compiled
    for f in run.flows_of("a2a"):
        assert c.flow_bytes[f] == pytest.approx(N_BYTES / n / eta, rel=REL)
    assert all_zero(run.kpis)


# -- max-min fairness --------------------------------------------------------------------


def test_max_min_fairness_gives_a_flow_what_a_bottlenecked_neighbour_leaves(one_node_plan):
    """Chip 0 sends to 1 and to 2; chip 2's receive port also takes flows from 3 and 4.

    Max-min fair: the three flows into chip 2 get B/3 each (their bottleneck), so the flow
    0 -> 1 gets the B - B/3 = 2B/3 left on chip 0's send port, not B/2.
    """
    B, a, N = LINK_BW_BYTES_PER_S, LINK_LATENCY_S, N_BYTES
    b = DagBuilder()
    b.p2p("0to1", 0, 1, N)
    b.p2p("0to2", 0, 2, N)
    b.p2p("3to2", 3, 2, N)
    b.p2p("4to2", 4, 2, N)
    run = b.run(one_node_plan)
    assert run.end_s("0to1") == pytest.approx(a + N / (2 * B / 3), rel=REL)
    for key in ("0to2", "3to2", "4to2"):
        assert run.end_s(key) == pytest.approx(a + 3 * N / B, rel=REL)
    # an equal split of chip 0's port (B/2 each) would have ended 0 -> 1 later
    assert run.end_s("0to1") < a + 2 * N / B
    assert all_zero(run.kpis)


def test_link_and_network_flows_into_one_chip_do_not_share_a_port(plan_factory):
    """Chip 1 sends to 0 over the link, chip 2 (other node) over the network: the flows
    cross different ports of chip 0 (link receive, NIC receive) and run at full speed."""
    plan = plan_factory(4, 2)
    B, b_net, N = LINK_BW_BYTES_PER_S, NET_BW_BYTES_PER_S, N_BYTES
    b = DagBuilder()
    b.p2p("link", 1, 0, N)
    b.p2p("net", 2, 0, N)
    run = b.run(plan)
    assert run.end_s("link") == pytest.approx(LINK_LATENCY_S + N / B, rel=REL)
    assert run.end_s("net") == pytest.approx(NET_LATENCY_S + N / b_net, rel=REL)
    assert all_zero(run.kpis)
