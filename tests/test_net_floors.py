"""Cross-node small messages and point-to-point: the measured floors (tools/fit_net_floors.py)
on the public rows the fit did not see, NCCL's choice kept apart from the time of the chosen
algorithm, NCCL's channels per network peer, sendrecv_perf's ring of sends, and the two-node
NVLS tree against one node."""
from __future__ import annotations

import importlib.util
import pathlib

import attrs
import pytest
from click.testing import CliRunner

from g5core.api.errors import ConfigError
from g5core.lower.topology import Topology
from g5core.inputs.systems import SystemSpec, get_system
from g5core.present.cli import main
from g5core.session.collbench import collective_rows
from g5plugins.collectives import _nccl_group, forced_choices, lower_collective, nccl, p2p, sendrecv

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("fit_net_floors", ROOT / "tools" / "fit_net_floors.py")
fit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fit)

H100 = get_system("h100-sxm")


# ------------------------------------------------------------------------------ the fit, on rows it did not see
@pytest.mark.parametrize("name", list(fit.FITS))
def test_each_floor_reproduces_the_rows_the_fit_held_back_within_25_percent(name):
    f = fit.FITS[name]
    system = f.setter(f.base(), f.shipped(name, H100))       # the shipped figure, not a refit
    held = f.held_back()
    assert held
    for n, size, measured_us in held:
        g5_us, _ = fit.model_us(system, f.primitive, n, size)
        assert abs(measured_us / g5_us - 1) <= 0.25, (name, n, size, measured_us, g5_us)


def test_the_shipped_floors_are_the_fit_rounded():
    for name, f in fit.FITS.items():
        value, rms, _, _ = fit.fit_one(name)
        assert f.shipped(name, H100) == pytest.approx(value, rel=0.02), name
        assert rms < 0.1


def test_the_tree_hop_is_checked_on_another_node_count():
    """Fitted on two nodes, held back on four (nccl-tests #309's second run)."""
    checked = {r[0] for r in fit.FITS["network_hop_latency_s.tree"].held_back()}
    assert checked == {16, 32}


def _within(primitive, rows, system=H100, tolerance=0.25):
    for n, size, measured in rows:
        t = collective_rows(primitive, system, n, [size])[0]["time_s"] * 1e6
        assert abs(measured / t - 1) <= tolerance, (primitive, n, size, measured, t)


def test_two_node_floors_on_16_chips_from_8_b_within_25_percent_of_the_public_rows():
    """Two 8 x H100 nodes with 8 x 400 Gb/s IB (nccl-tests #309): all_reduce 8 B .. 256 KiB.
    At 512 KiB and 1 MiB the public run takes 70-71 us where G5 gives 47-52 us (tree LL128 as
    NCCL's 2.29 tuner picks; the run's NCCL 2.26 steps up there), outside 25%: README."""
    _within("all_reduce", fit.rows("nccl-tests-issue-309.csv", "all_reduce", "qoofyk-bm", 2 ** 18))
    # sendrecv_perf on 16 chips: two of its pairs cross the nodes; the public 2-node rows are 2 x A40
    sendrecv_rows = fit.rows("nccl-tests-issue-214.csv", "sendrecv")
    _within("sendrecv", [(16, size, t) for _, size, t in sendrecv_rows])
    floor = min(r[2] for r in sendrecv_rows)
    for size in (8, 65536, 2 ** 20):
        assert collective_rows("sendrecv", H100, 16, [size])[0]["time_s"] * 1e6 >= 0.75 * floor
    # alltoall: the only 16-GPU two-node table is of PCIe GPUs over Spectrum-X (no NVLink): its
    # floor is the network's, and G5's h100-sxm stays within 25% of it up to 64 KiB
    _within("all_to_all", fit.rows("pcie-rtx-spectrumx-2node-alltoall.csv", "alltoall", max_size_bytes=2 ** 16))
    forced = attrs.evolve(H100, nccl={"all_reduce": {"algorithm": "nvls_tree"}})
    _within("all_reduce", fit.rows("nccl-issue-1244.csv", "all_reduce_nvls_tree"), forced)


def test_nccls_choice_is_its_own_the_time_is_the_measured_one():
    topo = Topology.from_system(H100, 16)
    bare = Topology.from_system(attrs.evolve(H100, network_hop_latency_s={}), 16)
    group = tuple(range(16))
    for size in (8, 4096, 2 ** 18, 2 ** 24):
        measured, tuner = lower_collective("all_reduce", group, size, topo), lower_collective("all_reduce", group,
                                                                                               size, bare)
        assert (measured.algorithm, measured.protocol) == (tuner.algorithm, tuner.protocol)
    small_m, small_t = lower_collective("all_reduce", group, 8, topo), lower_collective("all_reduce", group, 8, bare)
    assert small_m.algorithm == "tree" and small_m.protocol == "ll"
    # tree LL on 2 nodes: 2 log2(2) node-crossing hops, each the measured 6.0 us, not NCCL's 5 us
    assert H100.network_hop_latency_s["tree"] == 6.0e-6
    assert small_m.latency_s - small_t.latency_s == pytest.approx(2 * (6.0e-6 - 5.0e-6), rel=1e-6)
    g = _nccl_group("all_reduce", group, topo)
    assert nccl.choose(g, 8) == nccl.choose(g, 8, {})      # the tuner never sees the measured hops


def test_a_system_file_overrides_the_floors_and_refuses_a_bad_one():
    data = H100.to_dict()
    data["name"] = "mine"
    data["network_hop_latency_s"] = {"tree": 50e-6}
    spec = SystemSpec.from_dict(data)
    a = collective_rows("all_reduce", spec, 16, [8])[0]["time_s"]
    b = collective_rows("all_reduce", H100, 16, [8])[0]["time_s"]
    assert a - b == pytest.approx(2 * (50e-6 - H100.network_hop_latency_s["tree"]), rel=1e-6)
    for bad, message in (({"trees": 1e-6}, "did you mean 'tree'"), ({"ring": 5.0}, "outside the range")):
        data["network_hop_latency_s"] = bad
        with pytest.raises(ConfigError, match=message):
            SystemSpec.from_dict(data)


# ------------------------------------------------------------------------------ sendrecv_perf
def test_sendrecv_with_n_chips_sends_to_the_next_and_two_pairs_cross_the_nodes():
    topo = Topology.from_system(H100, 16)
    low = sendrecv(tuple(range(16)), 4096, topo)
    assert sorted((f[0], f[1]) for f in low.flows) == sorted((i, (i + 1) % 16) for i in range(16))
    crossing = [f for f in low.flows if not topo.same_node(f[0], f[1])]
    assert sorted((f[0], f[1]) for f in crossing) == [(7, 8), (15, 0)]
    assert low.latency_s >= H100.network_latency_s
    inside = sendrecv(tuple(range(8)), 4096, Topology.from_system(H100, 8))
    assert inside.latency_s == H100.intra_node_latency_s
    ok = CliRunner().invoke(main, ["collective", "sendrecv", "--system", "h100-sxm", "--chips", "16",
                                   "--sizes", "8B:1MiB", "--factor", "64"])
    assert ok.exit_code == 0, ok.output
    bad = CliRunner().invoke(main, ["collective", "p2p", "--system", "h100-sxm", "--chips", "16"])
    assert bad.exit_code == 2 and "run sendrecv" in bad.output


# ------------------------------------------------------------------------------ channels per network peer
def test_nccls_channels_per_network_peer():
    # paths.cc: max(1 local NIC, divUp(48 GB/s, NCCL_P2P_PER_CHANNEL_NET_BW 14)) = 4, a power of two already
    assert nccl.net_peer_channels(48.0, 1, 16, 32) == 4
    # more ranks than 8 x (32 / 4) batches: halved until they fit
    assert nccl.net_peer_channels(48.0, 1, 72, 32) == 2
    assert nccl.net_peer_channels(48.0, 1, 16, 32, per_net_peer=2) == 2     # NCCL_NCHANNELS_PER_NET_PEER
    # enqueue.cc: the op's channels: nChannelsMin halved to fit the ranks, parts of 64 .. 128 KiB
    assert nccl.net_op_channels(8, 2, 4, 32) == 1
    assert nccl.net_op_channels(200_000, 2, 4, 32) == 4
    assert nccl.net_op_channels(200_000, 16, 4, 32) == 2
    assert nccl.net_op_channels(2 ** 24, 16, 4, 32) == 4


def test_a_cross_node_p2p_uses_the_channels_nccl_gives_one_peer_at_the_fitted_rate():
    topo = Topology.from_system(H100, 16)
    low = p2p((0, 8), 2 ** 26, topo)
    assert low.channels == 4
    data = H100.to_dict()
    data.update(name="one-channel", nccl={"p2p": {"net_peer_channels": 1}})
    one = SystemSpec.from_dict(data)
    slow = p2p((0, 8), 2 ** 26, Topology.from_system(one, 16))
    assert slow.channels == 1
    # one channel copies at the fitted 16.5 GB/s, below the 48 GB/s NIC: the copies set the time
    copy_s = nccl.net_copy_time_us(2 ** 26, 1) * 1e-6
    assert slow.latency_s == pytest.approx(H100.network_latency_s + copy_s - 2 ** 26 / 48e9, rel=1e-9)
    inside = p2p((0, 1), 2 ** 26, topo)      # inside a node: one flow at the link's rate, as before
    assert inside.channels == 1 and inside.latency_s == H100.intra_node_latency_s
    # the collectives plugin owns the nccl block and checks it when a run is prepared
    data["nccl"] = {"p2p": {"net_peer_channels": 64}}
    with pytest.raises(ConfigError, match="1 .. 32"):
        forced_choices(SystemSpec.from_dict(data))
    data["nccl"] = {"p2p": {"net_peer_chanels": 2}}
    with pytest.raises(ConfigError, match="did you mean 'net_peer_channels'"):
        forced_choices(SystemSpec.from_dict(data))


def test_eight_concurrent_cross_node_sends_from_one_node_use_eight_nics():
    topo = Topology.from_system(H100, 16)
    nics = set()
    for i in range(8):
        for f in p2p((i, i + 8), 2 ** 24, topo).flows:
            route = f[3] if len(f) > 3 else topo.route(f[0], f[1])
            nics |= {r for r in route if ".nic" in topo.resource_name(r) and topo.resource_name(r).endswith(".tx")}
    assert len(nics) == 8


def test_two_gpu_cross_node_sendrecv_from_4_mib_runs_near_the_nic_rate():
    """NCCL gives the pair 4 channels (4 x 16.5 GB/s > 48 GB/s): the NIC sets the rate. The one
    published 2-GPU cross-node point on a 400 Gb/s NIC: 48.4 GB/s at 1 GiB (H100, CX-7 RoCE,
    NCCL 2.31.2; nccl #2409, resolved state), within 15%; the maintainers' figure is 46-48 GB/s
    per NIC (nccl-tests #290). No whole published curve from 4 MiB was found (README)."""
    one_per_node = fit.one_chip_per_node(H100)
    rows = collective_rows("sendrecv", one_per_node, 2, [2 ** 22, 2 ** 26, 2 ** 30])
    bw = [r["busbw_bytes_per_s"] / 1e9 for r in rows]
    assert bw == sorted(bw) and 40 <= bw[-1] <= 48
    (n, size, measured_us), = fit.rows("nccl-issue-2409.csv", "sendrecv")
    assert (n, size) == (2, 2 ** 30)
    assert abs(measured_us / (rows[-1]["time_s"] * 1e6) - 1) <= 0.15


# ------------------------------------------------------------------------------ the two-node NVLS tree
def test_two_node_nvls_tree_is_below_one_node_and_within_15_percent_of_published_runs():
    """Below one node at every size from 64 MiB: the fill of the tree's crossings
    (nccl.nvls_tree_fill_loops) and NCCL's bus-rate scaling to 16 ranks, with the one-node NVLS
    pipeline's measured fill (nccl.NVLS_FILL_LOOPS) in both. Before that fill was measured, the
    one-node chunk cost alone put one node 6-9% under the measured one-node runs at 256 and 512 MiB
    (azure-nd-h100-v5.csv: 423, 438 GB/s), and two nodes above it there."""
    sizes = [2 ** k for k in range(26, 35)]
    one = {r["size_bytes"]: r for r in collective_rows("all_reduce", H100, 8, sizes)}
    two = {r["size_bytes"]: r for r in collective_rows("all_reduce", H100, 16, sizes)}
    for size in sizes:
        assert two[size]["algorithm"] == "nvls_tree" and one[size]["algorithm"] == "nvls"
        assert two[size]["busbw_bytes_per_s"] < one[size]["busbw_bytes_per_s"], size
    for size, measured_one_node in ((2 ** 28, 423.38e9), (2 ** 29, 438.46e9)):
        assert abs(one[size]["busbw_bytes_per_s"] / measured_one_node - 1) <= 0.03
        assert two[size]["busbw_bytes_per_s"] < measured_one_node
    two = [two[s] for s in (2 ** 30, 2 ** 32, 2 ** 33)]
    # NVIDIA/nccl #1221: 430 GB/s on two 8 x H100 nodes with NVLS; HF playbook (AWS P5): 479;
    # nccl-tests #309: 470 (two HGX hosts' maximum)
    for published in (430e9, 479e9, 470e9):
        assert abs(two[-1]["busbw_bytes_per_s"] / published - 1) <= 0.15


# ------------------------------------------------------------------------------ trends that follow
def test_cross_node_tp16_decode_all_reduces_cost_more_per_layer_than_tp8_plus_one_intra_node_latency():
    """The issue's trend, on the communication of a layer: TP16's two cross-node all-reduces
    cost more than TP8's two plus one intra-node all-reduce latency. The whole layer is no
    longer dearer: with the healthy two-node all-reduce (25 us at 8 B, nccl-tests #309) the
    halved weight reads win, as Meta measured for Llama3 405B at 128K, batch 1 (TTIT 39.52 ms
    with TP16 against 46.26 ms with TP8, arXiv:2411.01783 Table 7)."""
    from g5core.session.run import run

    def per_layer_s(tp):
        cfg = {"model": "llama-3.1-70b", "system": "h100-sxm", "chips": tp, "phase": "decode", "batch": 1,
               "seq_len": 4096, "parallel": {"dp": 1, "tp": tp, "pp": 1, "cp": 1}}
        result = run(cfg).to_json_dict()
        return result["latency_s"] / 80, result["overlap"]["by_reason"]["tp_allreduce"]["comm_time_s"] / 80
    g8 = _nccl_group("all_reduce", tuple(range(8)), Topology.from_system(H100, 8))
    intra_latency_s = min(nccl.latency_us(g8, a, p) for a in ("ring", "tree") for p in nccl.PROTOCOLS) * 1e-6
    (layer8, comm8), (layer16, comm16) = per_layer_s(8), per_layer_s(16)
    assert comm16 > comm8 + intra_latency_s
    assert layer16 < layer8


# ------------------------------------------------------------------------------ the tuner of the run's NCCL release
NCCL_2_26 = attrs.evolve(H100, nccl={"tuner": {"release": "2.26.2"}})


def test_the_2_26_tuner_differs_from_2_29_only_in_the_nvls_terms():
    """v2.26.2-1 tuning.cc: the NVLS tree's network step is 14 us (20.9 since 2.28.9), NVLS and NVLS-tree
    bus bandwidth is nChannels x min(bwIntra, bwInter), the tree's bwInter halved beyond two nodes,
    converted by 5/6; the tree and ring terms of Hopper are 2.29.2's."""
    topo = Topology.from_system(NCCL_2_26, 32)
    for n in (16, 32):
        old = _nccl_group("all_reduce", tuple(range(n)), topo)
        new = attrs.evolve(old, tuner="2.29.2")
        assert old.tuner == "2.26.2"
        for a, p in (("tree", "ll"), ("tree", "ll128"), ("ring", "simple")):
            assert nccl.latency_us(old, a, p) == nccl.latency_us(new, a, p)
            assert nccl.algbw_gbytes_per_s(old, a, p) == nccl.algbw_gbytes_per_s(new, a, p)
        assert nccl.latency_us(old, "nvls_tree", "simple") == 25.0 + 2 * (n // 16) * 14.0
        assert nccl.latency_us(new, "nvls_tree", "simple") == pytest.approx(25.0 + 2 * (n // 16) * 20.9)
    two, four = (_nccl_group("all_reduce", tuple(range(n)), topo) for n in (16, 32))
    assert nccl.algbw_gbytes_per_s(two, "nvls_tree", "simple") == pytest.approx(370.8 * 5 / 6)
    assert nccl.algbw_gbytes_per_s(four, "nvls_tree", "simple") == pytest.approx(384.0 / 2 * 5 / 6)


def test_with_the_runs_tuner_two_nodes_pick_the_nvls_tree_from_1_mib_and_four_nodes_the_ring():
    """nccl-tests #309 ran NCCL 2.26.2. Its tuner picks the NVLS tree on two nodes from 1 MiB (2.29.2
    waits until 4 MiB), which puts 1 and 2 MiB within 15% of the run (2.29.2's tree LL128: -24%, -14%);
    at 512 KiB its tree LL128 and NVLS tree are within 1.3% of each other (54.0 against 54.7 us) and G5,
    like the model, runs tree LL128: 30% under the run's 70 us, the one row from 8 B to 1 MiB outside
    25% (README). On four nodes 2.26.2 halves the NVLS tree's network bandwidth and picks the ring from
    1 GiB, which #309's four-node run follows (365 GB/s busbw; G5's 2.29.2 NVLS tree: 314)."""
    rows = fit.rows("nccl-tests-issue-309.csv", "all_reduce", "qoofyk-bm", 2 ** 21)
    _within("all_reduce", [r for r in rows if r[1] != 2 ** 19], NCCL_2_26)
    _within("all_reduce", [r for r in rows if r[1] >= 2 ** 20], NCCL_2_26, tolerance=0.15)
    picks = {r["size_bytes"]: r["algorithm"] for r in collective_rows("all_reduce", NCCL_2_26, 16, [2 ** 19, 2 ** 20])}
    assert picks == {2 ** 19: "tree", 2 ** 20: "nvls_tree"}
    assert collective_rows("all_reduce", H100, 16, [2 ** 20])[0]["algorithm"] == "tree"
    four = [r for r in fit.rows("nccl-tests-issue-309.csv", "all_reduce", "qoofyk-vm") if r[1] >= 2 ** 28]
    assert len(four) == 7
    _within("all_reduce", four, NCCL_2_26, tolerance=0.10)
    big = collective_rows("all_reduce", NCCL_2_26, 32, [2 ** 30, 2 ** 34])
    assert {r["algorithm"] for r in big} == {"ring"}
    assert collective_rows("all_reduce", H100, 32, [2 ** 34])[0]["algorithm"] == "nvls_tree"


def test_a_system_file_names_a_tuner_release_g5_has_or_gets_a_one_line_error():
    data = H100.to_dict()
    data.update(name="old-nccl", nccl={"tuner": {"release": "2.26.2"}})
    assert forced_choices(SystemSpec.from_dict(data))["tuner"]["release"] == "2.26.2"
    data["nccl"] = {"tuner": {"release": "2.18.5"}}
    with pytest.raises(ConfigError, match="system.nccl.tuner.release.*2.29.2, 2.26.2"):
        forced_choices(SystemSpec.from_dict(data))
    data["nccl"] = {"tuner": {"version": "2.26.2"}}
    with pytest.raises(ConfigError, match="tuner.version: unknown key; valid keys: release"):
        forced_choices(SystemSpec.from_dict(data))
