"""The network model: topology resources, NCCL's algorithms, protocols and tuner, the
agreement with published NCCL measurements, and the layout trends that must follow."""
from __future__ import annotations

import csv
import importlib.util
import json
import pathlib

import attrs
import pytest
import yaml
from click.testing import CliRunner

from g5core.present.cli import main
from g5core.session.collbench import collective_rows, size_range
from g5core.api.ops import CommOp
from g5core.api.errors import ConfigError
from g5core.session.run import run
from g5core.inputs.systems import SystemSpec, get_system
from g5core.lower.topology import Topology
from g5plugins.collectives import dtree_edges, forced_choices, lower_collective
from g5plugins.collectives import nccl
from g5core import idle_transfer_s

from helpers_engine import SYSTEM_FIELDS

H100 = get_system("h100-sxm")
REPO = pathlib.Path(__file__).resolve().parent.parent


def _group(coll="all_reduce", n=8, nodes=1, system=H100):
    topo = Topology.from_system(system, n)
    from g5plugins.collectives import _nccl_group

    return _nccl_group(coll, tuple(range(n)), topo)


# ------------------------------------------------------------------------------ NCCL's formulas
def test_ring_latency_is_nccls_base_plus_one_hop_latency_per_step():
    g = _group(n=8)
    # tuning.cc: baseLat[Ring][LL] 6.6 + 2 (n-1) steps x hwLat[NVLINK][Ring][LL] 0.6
    assert nccl.latency_us(g, "ring", "ll") == pytest.approx(6.6 + 14 * 0.6)
    ag = _group("all_gather", n=8)
    assert nccl.latency_us(ag, "ring", "simple") == pytest.approx(8.4 + 7 * 3.4)


def test_ring_across_nodes_pays_the_network_latency_on_its_inter_node_steps():
    g = _group(n=16)   # 2 nodes, 8 per node
    # 2 (nodes-1) = 2 network steps (hwLat[NET][Ring][Simple] 14), the other 28 at
    # max(NVLink 3.4, 3 x 1 us net overhead)
    assert nccl.latency_us(g, "ring", "simple") == pytest.approx(8.4 + 28 * 3.4 + 2 * 14.0)
    # tree: 2 x ((ppn-1) intra + log2(nodes) inter)
    assert nccl.latency_us(g, "tree", "ll") == pytest.approx(6.8 + 2 * (7 * 0.6 + 1 * 5.0))


def test_channels_on_an_8xh100_node_are_the_24_nccl_prints():
    assert nccl.graph_channels(370.8, 9.0) == 24
    # small messages use fewer channels (enqueue.cc): Simple needs 512 threads x 64 B per channel
    assert nccl.op_channels(32 * 1024, 24, "simple", "ring", 8) == 1
    assert nccl.op_channels(24 * 512 * 64, 24, "simple", "ring", 8) == 24


@pytest.mark.parametrize("n", range(2, 33))
def test_double_binary_tree_spans_every_rank_twice_and_no_rank_is_inner_in_both(n):
    trees = dtree_edges(n)
    for edges in trees:
        assert len(edges) == n - 1                   # a spanning tree: every rank but the root has a parent
        assert len({c for c, _ in edges}) == n - 1
        children: dict = {}
        for c, p in edges:
            children.setdefault(p, []).append(c)
        assert all(len(cs) <= 2 for cs in children.values())
    if n % 2 == 0 and n > 2:
        inner = [{p for _, p in edges} for edges in trees]
        assert not (inner[0] & inner[1])


def test_tuner_picks_ll_for_small_nvls_for_large_and_ring_where_the_switch_cannot_reduce():
    g = _group(n=8)
    assert nccl.choose(g, 1024)[:2] == ("ring", "ll")
    assert nccl.choose(g, 2 ** 30)[:2] == ("nvls", "simple")
    a100 = _group(n=8, system=get_system("a100-80gb"))
    assert nccl.choose(a100, 2 ** 30)[:2] == ("ring", "simple")
    # NCCL keeps NVLS off with 2 GPUs or fewer (nvls.cc ncclNvlsInit)
    assert nccl.choose(_group(n=2), 2 ** 30)[0] == "ring"
    assert nccl.choose(_group(n=4), 2 ** 30)[0] == "nvls"
    # across nodes the switch reduces inside each node and a tree joins the nodes
    assert nccl.choose(_group(n=16), 2 ** 30)[:2] == ("nvls_tree", "simple")
    # the choice is the fastest by NCCL's own formula
    a, p, lat, transfer = nccl.choose(g, 2 ** 20)
    for alg in nccl.ALGORITHMS:
        for proto in nccl.PROTOCOLS:
            if nccl.enabled(g, alg, proto):
                assert sum(nccl.cost_us(g, alg, proto, 2 ** 20)) >= lat + transfer


def test_a_forced_choice_is_honoured_and_one_that_does_not_apply_is_a_clear_error():
    forced = attrs.evolve(H100, nccl={"all_reduce": {"algorithm": "ring", "protocol": "simple"}})
    low = lower_collective("all_reduce", tuple(range(8)), 2 ** 30, Topology.from_system(forced, 8))
    assert (low.algorithm, low.protocol) == ("ring", "simple")
    nvls_only = attrs.evolve(H100, nccl={"all_reduce": {"algorithm": "nvls"}})
    with pytest.raises(ConfigError, match=r"system\.nccl\.all_reduce: the forced choice .* does not apply"):
        lower_collective("all_reduce", tuple(range(16)), 2 ** 30, Topology.from_system(nvls_only, 16))


# ------------------------------------------------------------------------------ flows on resources
def _nic_ports(low, topo, side="tx"):
    return {topo.resource_name(r) for f in low.flows if len(f) > 3 for r in f[3]
            if ".nic" in topo.resource_name(r) and topo.resource_name(r).endswith(side)}


def test_a_ring_across_two_nodes_crosses_through_every_nic_and_a_small_one_through_few():
    ring = attrs.evolve(H100, nccl={"all_gather": {"protocol": "simple"}})
    topo = Topology.from_system(ring, 16)
    big = lower_collective("all_gather", tuple(range(16)), 2 ** 30, topo)
    assert big.algorithm == "ring" and big.channels == 24
    assert _nic_ports(big, topo) == {f"node{n}.nic{r}.tx" for n in (0, 1) for r in range(8)}
    small = lower_collective("all_gather", tuple(range(16)), 64 * 1024, topo)
    assert small.channels < 8
    assert len(_nic_ports(small, topo)) == 2 * small.channels
    # payload conservation: the node-crossing hop carries the ring share in total
    cross = sum(f[2] for f in big.flows if len(f) > 3 and topo.node_of(f[0]) == 0 and topo.node_of(f[1]) == 1)
    assert cross == pytest.approx(15 / 16 * 2 ** 30)


def test_a_p2p_between_nodes_uses_one_nic_on_each_side():
    topo = Topology.from_system(H100, 16)
    route = topo.route(3, 11)
    assert [topo.resource_name(r) for r in route] == ["node0.nic3.tx", "node1.nic3.rx"]
    assert [topo.resource_name(r) for r in topo.route(3, 5)] == ["chip3.link_tx", "chip5.link_rx"]


def test_protocol_overhead_occupies_the_wire_but_the_run_reports_payload():
    topo = Topology.from_system(H100, 8)
    low = lower_collective("all_reduce", tuple(range(8)), 4096, topo)
    assert low.protocol == "ll" and low.wire_bytes_per_payload_byte == 2.0
    sent = sum(f[2] for f in low.flows if f[0] == 0)
    assert sent == pytest.approx(2 * 2 * 7 / 8 * 4096)


def test_an_oversubscribed_fabric_slows_cross_node_traffic_that_a_full_bisection_one_carries():
    sizes = [2 ** 30]
    full = collective_rows("all_to_all", "h100-sxm", 32, sizes)[0]["time_s"]
    path = None
    fields = H100.to_dict()
    fields["fabric"] = {"nodes_per_leaf": 1, "oversubscription": 2.0}
    fields["name"] = "h100-2to1"
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "h100-2to1.yaml"
        path.write_text(yaml.safe_dump(fields))
        over = collective_rows("all_to_all", str(path), 32, sizes)[0]["time_s"]
        one_leaf = dict(fields, fabric={"nodes_per_leaf": 4, "oversubscription": 2.0})
        path.write_text(yaml.safe_dump(one_leaf))
        same_leaf = collective_rows("all_to_all", str(path), 32, sizes)[0]["time_s"]
    assert over > 1.5 * full
    assert same_leaf == pytest.approx(full, rel=1e-12)    # no traffic leaves the leaf


# ------------------------------------------------------------------------------ system files
@pytest.mark.parametrize("change, field, message", [
    ({"nics_per_node": 3}, "system.nics_per_node", "3 NICs do not divide the 4 chips"),
    ({"network_bw_bytes_per_s": 0}, "system.network_bw_bytes_per_s", "positive"),
    ({"intra_node_bw_bytes_per_s": -1.0}, "system.intra_node_bw_bytes_per_s", "positive"),
    ({"fabric": {"nodes_per_leaf": 2, "oversubscription": 0.5}}, "system.fabric.oversubscription", "1 .. 1000"),
    ({"fabric": {"nodes_per_leaf": 2, "oversubscription": 1e300}}, "system.fabric.oversubscription", "1 .. 1000"),
    ({"compute_capability": 0.5}, "system.compute_capability", "such as 9.0"),
    ({"fabric": {"nodes_per_leaf": 2}}, "system.fabric.oversubscription", "missing"),
    ({"nccl": {"all_reduce": "ring"}}, "system.nccl.all_reduce", "expected a mapping"),
    ({"nvls": "yes"}, "system.nvls", "true or false"),
])
def test_an_impossible_topology_is_a_one_line_error_naming_the_field(change, field, message):
    with pytest.raises(ConfigError) as info:
        SystemSpec.from_dict(dict(SYSTEM_FIELDS, **change))
    text = str(info.value)
    assert text.startswith(field) and message in text and "\n" not in text


NCCL_BLOCKS = [
    ({"all_reduce": {"algorithm": "butterfly"}}, "system.nccl.all_reduce.algorithm", "ring, tree, nvls"),
    ({"all_gather": {"algorithm": "tree"}}, "system.nccl.all_gather.algorithm", "only for all_reduce"),
    ({"all_reduce": {"algorithm": "nvls"}}, "system.nccl.all_reduce.algorithm", "set nvls: true"),
    ({"all_reduce": {"protocol": "ll256"}}, "system.nccl.all_reduce.protocol", "ll, ll128, simple"),
    ({"all_reduce": {"algo": "ring"}}, "system.nccl.all_reduce.algo", "valid keys: algorithm, protocol"),
    ({"alltoall": {"algorithm": "ring"}}, "system.nccl.alltoall", "unknown collective"),
]


@pytest.mark.parametrize("block, field, message", NCCL_BLOCKS)
def test_the_collectives_plugin_refuses_a_bad_nccl_block_naming_the_field(tmp_path, block, field, message):
    """The nccl block is the collectives plugin's schema: it checks it when a run is prepared
    (and when g5 collective lowers), one line naming the field."""
    system = SystemSpec.from_dict(dict(SYSTEM_FIELDS, nccl=block))   # the core only sees a mapping of mappings
    with pytest.raises(ConfigError) as info:
        forced_choices(system)
    text = str(info.value)
    assert text.startswith(field) and message in text and "\n" not in text
    path = tmp_path / "system.yaml"
    path.write_text(yaml.safe_dump(dict(SYSTEM_FIELDS, nccl=block)))
    with pytest.raises(ConfigError, match=f"^{field}"):
        run({"model": "llama-3.1-8b", "system": str(path), "chips": 4, "parallel": {"dp": 1, "pp": 1, "cp": 1, "tp": 4},
             "phase": "decode", "batch": 1, "seq_len": 1024})


def test_an_old_system_file_keeps_working_with_one_nic_per_chip_and_asks_only_for_the_gpu_generation(tmp_path):
    old = {k: v for k, v in SYSTEM_FIELDS.items() if k != "compute_capability"}
    spec = SystemSpec.from_dict(old)
    assert spec.nics == spec.chips_per_node and not spec.nvls and not spec.fabric
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(old))
    result = CliRunner().invoke(main, ["collective", "all_reduce", "--system", str(path), "--chips", "4"])
    assert result.exit_code == 2
    assert "add e.g. 'compute_capability: 9.0'" in result.output and result.output.count("\n") == 1
    # p2p needs no NCCL table: it still runs
    ok = CliRunner().invoke(main, ["collective", "sendrecv", "--system", str(path), "--chips", "2", "--sizes", "1K:1K"])
    assert ok.exit_code == 0, ok.output


# ------------------------------------------------------------------------------ g5 collective
def test_g5_collective_prints_an_nccl_tests_table_and_json_rows():
    result = CliRunner().invoke(main, ["collective", "all_reduce", "--system", "h100-sxm", "--chips", "16",
                                       "--sizes", "8B:8GiB", "--factor", "64"])
    assert result.exit_code == 0, result.output
    lines = [ln for ln in result.output.splitlines() if ln and not ln.startswith("#")]
    assert [int(ln.split()[0]) for ln in lines] == size_range("8B:8GiB", 64)
    assert "out-of-place" in result.output and "in-place" in result.output and "busbw" in result.output
    header = next(ln for ln in result.output.splitlines() if ln.startswith("#") and "count" in ln).split()
    assert header[:14] == ["#", "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong",
                           "time", "algbw", "busbw", "#wrong"]  # nccl-tests' columns, in its order
    first = lines[0].split()
    assert first[1:5] == ["2", "float", "sum", "-1"]  # 8 B = 2 floats
    assert first[5:8] == first[9:12]  # in-place repeats out-of-place
    bf = CliRunner().invoke(main, ["collective", "allgather", "--system", "h100-sxm", "--chips", "8", "--sizes",
                                   "1K:1K", "--dtype", "bfloat16", "--redop", "max"])
    row = [ln for ln in bf.output.splitlines() if ln and not ln.startswith("#")][0].split()
    assert row[1:5] == ["512", "bfloat16", "none", "-1"]  # all_gather reduces nothing: redop none
    js = CliRunner().invoke(main, ["collective", "allgather", "--system", "h100-sxm", "--chips", "8",
                                   "--sizes", "1K:1M", "--json"])
    rows = json.loads(js.output)
    assert len(rows) == 11
    for r in rows:
        assert {"size_bytes", "time_s", "algbw_bytes_per_s", "busbw_bytes_per_s", "algorithm", "protocol"} <= set(r)
        assert r["busbw_bytes_per_s"] == pytest.approx(r["algbw_bytes_per_s"] * 7 / 8)
    assert rows[0]["time_s"] < rows[-1]["time_s"]


@pytest.mark.parametrize("args, message", [
    (["all_reduce", "--system", "h100-sxm", "--chips", "1"], "--chips: a collective needs at least 2 chips"),
    (["all_reduse", "--system", "h100-sxm", "--chips", "8"], "did you mean 'all_reduce'"),
    (["all_reduce", "--system", "h100-sxm", "--chips", "8", "--sizes", "8GiB:1K"], "--sizes: need 0 < MIN <= MAX"),
    (["all_reduce", "--system", "h100-sxm", "--chips", "8", "--sizes", "1Q:2K"], "cannot read size '1Q'"),
    (["all_reduce", "--system", "h100-sxm", "--chips", "8", "--dtype", "bf16"], "did you mean 'bfloat16'"),
    (["all_reduce", "--system", "h100-sxm", "--chips", "8", "--redop", "add"], "--redop: unknown reduction"),
])
def test_g5_collective_bad_input_is_one_line(args, message):
    result = CliRunner().invoke(main, ["collective"] + args)
    assert result.exit_code == 2 and message in result.output and result.output.count("\n") == 1


# ------------------------------------------------------------------------------ published measurements
def _agreement(ops=None):
    spec = importlib.util.spec_from_file_location("nccl_agreement", REPO / "benchmarks" / "nccl_agreement.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.agreement(ops)


@pytest.fixture(scope="module")
def agreement():
    return _agreement(("all_reduce", "all_gather", "reduce_scatter"))


def test_published_nccl_bandwidths_of_large_messages_within_15_percent(agreement):
    """Bus bandwidth from 64 MiB up, 8 GPUs in a node, 16 over two nodes and 32 over four."""
    checked = 0
    for r in agreement:
        if r["size_bytes"] >= 64 * 2 ** 20 and r["gpus"] >= 8:
            checked += 1
            assert abs(r["error"]) <= 0.15, r
    assert checked >= 20


def test_nvls_all_reduce_on_8_gpus_from_2_mib_within_20_percent(agreement):
    """Mid sizes of NVLS all-reduce, which its chunking and pipeline fill slow down (NVLS_CHUNK_COST_BYTES,
    NVLS_FILL_LOOPS)."""
    rows = [r for r in agreement if r["algorithm"] == "nvls" and r["size_bytes"] >= 2 * 2 ** 20 and r["gpus"] == 8]
    assert len(rows) >= 20
    assert all(abs(r["error"]) <= 0.20 for r in rows), [r for r in rows if abs(r["error"]) > 0.20]


def test_the_shipped_nvls_chunk_cost_and_fill_are_the_fit_rounded():
    """tools/fit_nvls_chunk.py on the two H100 NVLS tables; the H200 table it never saw within 10%."""
    spec = importlib.util.spec_from_file_location("fit_nvls_chunk", REPO / "tools" / "fit_nvls_chunk.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    (c0, fill), rms, _ = tool.fit()
    assert nccl.NVLS_CHUNK_COST_BYTES == pytest.approx(c0, rel=0.01)
    assert nccl.NVLS_FILL_LOOPS == pytest.approx(fill, rel=0.01)
    assert rms < 0.07
    for size, measured_us in tool.rows("azure-nd-h200-v5.csv"):
        assert abs(tool.model_us(size, nccl.NVLS_CHUNK_COST_BYTES, nccl.NVLS_FILL_LOOPS) / measured_us - 1) <= 0.10


@pytest.mark.parametrize("system", ["h200", "b200"])
def test_nvls_all_reduce_on_tables_the_fit_did_not_see_from_128_mib_within_15_percent(system):
    """aiconfigurator's NCCL 2.29.2 all-reduce on 8 x H200 and 8 x B200 (NVLS by NCCL's choice):
    NCCL's own nvlsEfficiency per generation (0.85 Hopper, 0.74 Blackwell) with the H100 fit's
    chunk cost and fill. (With one H100-fitted cost per chunk and no efficiency, B200 was 9-19% slow
    from 128 MiB.)"""
    name = f"aiconfigurator-{system}-sxm-nccl2.29.2.csv"
    with open(REPO / "tests" / "data" / "nccl" / name, encoding="utf-8") as fh:
        measured = [(int(r["size_bytes"]), float(r["time_us"])) for r in csv.DictReader(
            line for line in fh if not line.startswith("#"))
            if r["collective"] == "all_reduce" and r["gpus"] == "8" and int(r["size_bytes"]) >= 2 ** 27]
    assert len(measured) == 3
    rows = collective_rows("all_reduce", system, 8, [s for s, _ in measured])
    for (size, time_us), row in zip(measured, rows):
        assert row["algorithm"] == "nvls"
        assert abs(row["time_s"] * 1e6 / time_us - 1) <= 0.15, (system, size, row["time_s"], time_us)


def test_published_nccl_times_of_latency_bound_messages_within_25_percent(agreement):
    """Messages whose measured time is within 1.25x of the smallest message's: at least 80% of
    the op's time is its fixed latency."""
    floor: dict = {}
    for r in agreement:
        k = (r["source"], r["op"], r["gpus"])
        floor[k] = min(floor.get(k, r["measured_us"]), r["measured_us"])
    checked = 0
    for r in agreement:
        if r["gpus"] == 8 and r["measured_us"] <= 1.25 * floor[(r["source"], r["op"], r["gpus"])]:
            checked += 1
            assert abs(r["error"]) <= 0.25, r
    assert checked >= 30


def test_two_and_four_node_all_reduce_against_nccl_issue_1221(agreement):
    rows = {(r["gpus"]): r for r in agreement if r["source"].startswith("nccl-issue-1221")}
    assert abs(rows[32]["error"]) <= 0.15
    # two nodes with NVLS: G5's 8 GiB figure is about 10% above #1221's 430, a rounded figure
    # (NCCL 2.19.3, RoCE, possibly the average over 4 and 8 GiB), and within 1% of nccl-tests
    # #309's full two-node tables at 8 GiB (the test below holds every size from 32 MiB to 10%)
    # and of the HF playbook's 479: #1221's precision supports +-15%, no tighter
    assert abs(rows[16]["error"]) <= 0.15


def _nebius_rows():
    with open(REPO / "tests" / "data" / "nccl" / "nebius-h100-2node-pytorch.csv", encoding="utf-8") as fh:
        for r in csv.DictReader(line for line in fh if not line.startswith("#")):
            yield int(r["size_bytes"]), float(r["time_us"])


def test_two_node_all_reduce_from_10_mib_within_15_percent_of_the_nebius_runs():
    """Two 8 x H100 nodes, 10 MiB .. 1000 MiB (NCCL 2.20.5, two runs): the NVLS tree with the
    pipeline fill of its node crossings (nccl.nvls_tree_fill_loops); without it 10 and 100 MiB
    came out 40% and 29% fast."""
    measured = [(s, t) for s, t in _nebius_rows() if s >= 10 * 2 ** 20]
    assert len(measured) == 6
    rows = {r["size_bytes"]: r for r in collective_rows("all_reduce", "h100-sxm", 16, sorted({s for s, _ in measured}))}
    for size, time_us in measured:
        assert rows[size]["algorithm"] == "nvls_tree"
        assert abs(rows[size]["time_s"] * 1e6 / time_us - 1) <= 0.15, (size, rows[size]["time_s"], time_us)


def test_two_node_all_reduce_from_32_mib_within_10_percent_of_nccl_tests_309():
    """nccl-tests #309's two-node tables (two HGX H100 hosts, 8 x 400 Gb/s IB, NCCL 2.26.2; runs
    qoofyk-bm and gj-aion), every size from 32 MiB: the NVLS tree with its crossings' fill is
    within 6% (without the fill 64 MiB came out 33% fast)."""
    with open(REPO / "tests" / "data" / "nccl" / "nccl-tests-issue-309.csv", encoding="utf-8") as fh:
        measured = [(int(r["size_bytes"]), min(float(r["time_us"]), float(r["time_inplace_us"])))
                    for r in csv.DictReader(line for line in fh if not line.startswith("#"))
                    if r["collective"] == "all_reduce" and r["nodes"] == "2" and r["size_bytes"]
                    and int(r["size_bytes"]) >= 32 * 2 ** 20]
    assert len(measured) == 19          # 32 MiB .. 16 GiB (qoofyk-bm), .. 8 GiB (gj-aion)
    rows = {r["size_bytes"]: r for r in collective_rows("all_reduce", "h100-sxm", 16, sorted({s for s, _ in measured}))}
    for size, time_us in measured:
        assert rows[size]["algorithm"] == "nvls_tree"
        assert abs(rows[size]["time_s"] * 1e6 / time_us - 1) <= 0.10, (size, rows[size]["time_s"], time_us)


def test_nvls_tree_fill_is_two_loops_per_tree_level(monkeypatch):
    """NCCL cuts each channel's part into loops of nvlsChannels x nHeads chunks; every tree level
    is crossed up and down, one loop of the pipeline each at the NICs' rate (nccl.nvls_tree_fill_loops),
    after the one-node pipeline's measured fill at the switch's rate (nccl.NVLS_FILL_LOOPS): time that
    holds the op (its start latency), not its links."""
    assert [nccl.nvls_tree_fill_loops(n) for n in (2, 3, 4, 8)] == [2, 2, 4, 6]
    assert nccl.nvls_loop_bytes(131072, 8) == 16 * 2 ** 20
    topo = Topology.from_system(H100, 16)
    group = tuple(range(16))
    for size in (2 ** 20, 2 ** 26, 2 ** 30):
        with_fill = lower_collective("all_reduce", group, size, topo)
        with monkeypatch.context() as m:
            m.setattr(nccl, "nvls_tree_fill_loops", lambda n_nodes: 0)
            no_tree = lower_collective("all_reduce", group, size, topo)
            m.setattr(nccl, "NVLS_FILL_LOOPS", 0.0)
            without = lower_collective("all_reduce", group, size, topo)
        assert with_fill.algorithm == without.algorithm == "nvls_tree" or size == 2 ** 20
        if with_fill.algorithm != "nvls_tree":
            assert with_fill.latency_s == without.latency_s     # the tuner's pick (tree LL128) has no fill
            continue
        assert with_fill.flows == without.flows
        loop = nccl.nvls_loop_bytes(nccl.nvls_tree_chunk_bytes(size, 8, 2), 8)
        share = min(loop, size) / size
        net_s = idle_transfer_s([f for f in with_fill.flows if f[0] != f[1]], topo)
        switch_s = idle_transfer_s([f for f in with_fill.flows if f[0] == f[1]], topo)
        assert 0 < net_s < switch_s        # the NICs carry each chip's slice, the switch the whole buffer
        assert with_fill.latency_s - no_tree.latency_s == pytest.approx(2 * net_s * share, rel=1e-9)
        assert no_tree.latency_s - without.latency_s == pytest.approx(nccl.NVLS_FILL_LOOPS * switch_s * share,
                                                                      rel=1e-9)
    # one node: the measured fill alone
    one = lower_collective("all_reduce", tuple(range(8)), 2 ** 28, Topology.from_system(H100, 8))
    with monkeypatch.context() as m:
        m.setattr(nccl, "NVLS_FILL_LOOPS", 0.0)
        bare = lower_collective("all_reduce", tuple(range(8)), 2 ** 28, Topology.from_system(H100, 8))
    assert one.algorithm == "nvls"
    loop = nccl.nvls_loop_bytes(nccl.nvls_chunk_bytes(2 ** 28, 8), 8)
    switch_s = idle_transfer_s(one.flows, Topology.from_system(H100, 8))
    assert one.latency_s - bare.latency_s == pytest.approx(nccl.NVLS_FILL_LOOPS * switch_s * loop / 2 ** 28, rel=1e-9)


# ------------------------------------------------------------------------------ trends
def _405b(tp, cp=1, phase="prefill", seq_len=131072):
    return {"model": "llama-3.1-405b", "system": "h100-sxm", "chips": tp * cp,
            "parallel": {"dp": 1, "tp": tp, "pp": 1, "cp": cp}, "phase": phase, "batch": 1, "seq_len": seq_len}


def test_long_context_prefill_gets_faster_when_tp_spans_two_and_four_nodes():
    ttft = {tp: run(_405b(tp)).latency_s for tp in (8, 16, 32)}
    assert ttft[16] < ttft[8]
    assert ttft[32] < ttft[16]


@pytest.mark.parametrize("seq_len", [8192, 32768, 131072])
def test_cross_node_pass_q_decode_costs_more_per_token_than_no_cp(seq_len):
    cp1 = run(_405b(8, 1, "decode", seq_len))
    cp2 = run(_405b(8, 2, "decode", seq_len))
    assert cp2.plan.ctx.rankmap.crosses_nodes(cp2.plan.ctx.rankmap.groups("cp")[0])
    assert cp2.latency_s > cp1.latency_s


def test_million_token_cp16_prefill_still_hides_the_pass_kv_ring():
    out = run({"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 16,
               "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 16}, "phase": "prefill", "batch": 1,
               "seq_len": 1048576})
    ring = out.sim.overlap["by_reason"]["cp_passkv"]
    assert ring["comm_time_s"] > 0 and ring["hidden_fraction"] >= 0.99


def test_the_run_json_and_timeline_say_how_each_collective_ran(tmp_path):
    raw = _405b(16, seq_len=4096)
    out = run(raw)
    entries = out.to_json_dict()["collectives"]
    assert entries and all({"algorithm", "protocol", "channels", "ops"} <= set(e) for e in entries)
    assert sum(e["ops"] for e in entries) == sum(1 for op in out.sim.dag.ops if isinstance(op, CommOp))
    assert {e["algorithm"] for e in entries} <= {"ring", "tree", "nvls", "nvls_tree"}


def test_the_trace_draws_nic_and_fabric_tier_ports_with_their_names(tmp_path):
    from g5core.present.trace import trace_events

    fields = H100.to_dict()
    fields.update(name="h100-2to1", fabric={"nodes_per_leaf": 1, "oversubscription": 2.0})
    path = tmp_path / "h100-2to1.yaml"
    path.write_text(yaml.safe_dump(fields))
    out = run({"model": "llama-3.1-8b", "system": str(path), "chips": 16,
               "parallel": {"dp": 1, "tp": 16, "pp": 1, "cp": 1}, "phase": "prefill", "batch": 1, "seq_len": 8192},
              record_port_rates=True)
    events = trace_events(out.sim, out.plan.ctx.topology)
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert {procs[16], procs[17]} == {"fabric leaf0", "fabric leaf1"}
    ports = {e["args"]["port"] for e in events if e["ph"] == "X" and "port" in e.get("args", {})}
    assert {"leaf0.up", "leaf1.down", "node0.nic7.tx", "node1.nic0.rx"} <= ports
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert "leaf0.up GB/s" in counters


def test_a_system_may_map_chips_to_nics_and_a_bad_map_is_one_line():
    fields = dict(SYSTEM_FIELDS, chips_per_node=4, nics_per_node=2, nic_of_chip=[1, 1, 0, 0])
    spec = SystemSpec.from_dict(fields)
    topo = Topology.from_system(spec, 8)
    assert [topo.rail_of(c) for c in range(8)] == [1, 1, 0, 0, 1, 1, 0, 0]
    assert [topo.resource_name(r) for r in topo.route(0, 4)] == ["node0.nic1.tx", "node1.nic1.rx"]
    assert SystemSpec.from_dict(spec.to_dict()) == spec
    for bad, message in (([0, 1], "lists 2 chips"), ([0, 0, 0, 2], "NIC index 2 is outside"),
                         ([0, 0, 0, 0], "no chip uses NIC 1")):
        with pytest.raises(ConfigError, match=message):
            SystemSpec.from_dict(dict(fields, nic_of_chip=bad))


def test_every_comm_op_in_the_timeline_names_its_algorithm_protocol_and_channels():
    import csv
    import io

    from g5core.present.trace import TIMELINE_COLUMNS, dump_timeline

    out = run(_405b(16, seq_len=2048), symmetry=False)
    fh = io.StringIO()
    dump_timeline(out.sim, fh)
    rows = list(csv.DictReader(io.StringIO(fh.getvalue())))
    assert set(TIMELINE_COLUMNS) >= {"algorithm", "protocol", "channels"}
    comm = [r for r in rows if r["kind"] == "comm"]
    assert comm and all(r["algorithm"] in ("ring", "tree", "nvls", "nvls_tree") and r["protocol"]
                        and int(r["channels"]) >= 1 for r in comm)
    assert all(r["algorithm"] == "" for r in rows if r["kind"] == "compute")


def test_nvls_flows_in_the_trace_name_the_switch():
    from g5core.present.trace import trace_events

    out = run({"model": "llama-3.1-8b", "system": "h200", "chips": 8,
               "parallel": {"dp": 1, "tp": 8, "pp": 1, "cp": 1}, "phase": "prefill", "batch": 1, "seq_len": 4096})
    assert any(e["algorithm"].startswith("nvls") for e in out.to_json_dict()["collectives"])
    names = [e["name"] for e in trace_events(out.sim, out.plan.ctx.topology)
             if e["ph"] == "X" and "port" in e.get("args", {})]
    assert any(n.endswith("c0->node0.nvswitch") for n in names)
    assert any(n.endswith("node0.nvswitch->c0") for n in names)
    assert not [n for n in names if any(n.endswith(f"c{c}->c{c}") for c in range(8))]
