"""docs/system-file.md stays in step with the loader: every field documented, ranges as in
g5core/inputs/reading.py, and its example file loads."""
from __future__ import annotations

import re
from pathlib import Path

import attrs

from g5core.inputs.reading import LIMITS
from g5core.inputs.systems import SystemSpec

DOC = (Path(__file__).resolve().parent.parent / "docs" / "system-file.md").read_text()


def _rows() -> dict[str, str]:
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| [^|]+ \| ([^|]+) \|", DOC, re.M)}


def test_every_field_has_a_row_and_no_row_is_stale():
    assert set(_rows()) == {f.name for f in attrs.fields(SystemSpec)}


def _range(text: str) -> tuple[float, float]:
    def number(v: str) -> float:  # "1e3", "65536" or "2^20"
        base, _, exp = v.strip().partition("^")
        return float(base) ** int(exp) if exp else float(base)
    lo, hi = text.replace("each", "").split("..")
    return number(lo), number(hi)


def test_documented_ranges_match_the_limits():
    rows = _rows()
    kinds = {"hbm_bw_bytes_per_s": "bytes_per_s", "intra_node_bw_bytes_per_s": "bytes_per_s",
             "network_bw_bytes_per_s": "bytes_per_s", "peak_flops_per_s": "flops_per_s",
             "launch_overhead_s": "seconds", "intra_node_latency_s": "seconds", "network_latency_s": "seconds",
             "hbm_capacity_bytes": "bytes", "chips_per_node": "chips_per_node", "efficiency": "fraction"}
    for field, kind in kinds.items():
        assert _range(rows[field]) == LIMITS[kind][:2], field


def test_the_example_file_loads():
    block = DOC.split("```yaml\n", 1)[1].split("```", 1)[0]
    spec = SystemSpec._from_text(block, "docs/system-file.md")
    assert spec.name == "my-cluster" and spec.chips_per_node == 4


def test_compute_model_keys_have_rows_with_their_ranges():
    from g5core.inputs.systems import ComputeModel
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `compute_model\.(\w+)` \| [^|]+ \| ([^|]+) \|", DOC, re.M)}
    assert set(rows) == set(ComputeModel.KEYS + ComputeModel.GEMM_HBM_KEYS)
    kinds = {"gemm_tile_m": "tile", "gemm_tile_n": "tile", "gemm_tile_k": "tile", "sm_count": "sm_count",
             "attention_half_length_tokens": "tokens", "attention_peak_fraction": "fraction",
             "hbm_fraction": "fraction", "gemm_peak_fraction": "fraction", "kernel_floor_s": "seconds",
             "gemm_hbm_latency_s": "seconds", "gemm_hbm_fraction": "fraction"}
    for key, kind in kinds.items():
        assert _range(rows[key]) == LIMITS[kind][:2], key


def test_the_worked_nodes_per_leaf_example():
    """The 4-node example's figures are the topology's: two leaves of two nodes, 384 GB/s up."""
    from g5core.lower.topology import Topology
    from g5core.inputs.systems import get_system

    assert "fabric: {nodes_per_leaf: 2, oversubscription: 2}" in DOC
    spec = attrs.evolve(get_system("h100-sxm"), fabric={"nodes_per_leaf": 2, "oversubscription": 2.0})
    topo = Topology.from_system(spec, 32)
    assert [topo.leaf_of(n) for n in range(4)] == [0, 0, 1, 1]
    caps = topo.capacities()
    names = [topo.resource_name(r) for r in range(len(caps))]
    assert caps[names.index("leaf0.up")] == 2 * 8 * 48e9 / 2 == 384e9
    assert "2 x 8 x 48 / 2 = 384 GB/s" in DOC
    # node 0 to node 1: NICs only; node 0 to node 2: through leaf0.up and leaf1.down
    inside = [names[r] for r in topo.network_route(0, 0, 1, 0)]
    across = [names[r] for r in topo.network_route(0, 0, 2, 0)]
    assert not any(n.startswith("leaf") for n in inside)
    assert "leaf0.up" in across and "leaf1.down" in across
