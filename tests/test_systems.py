"""Systems: catalogue, user files, strict validation, figures."""
from __future__ import annotations

import copy

import attrs
import pytest
import yaml

from g5core.api.errors import ConfigError
from g5core.inputs.systems import (
    CATALOG_NAMES,
    EFFICIENCY_KEYS,
    OP_CLASSES,
    SystemSpec,
    get_system,
)

EXPECTED = {"h100-sxm", "h200", "h800", "b200", "a100-80gb", "gb200-nvl72", "gb300-nvl72", "gh200-nvl32", "h20"}

GOOD = {
    "name": "my-cluster",
    "chips_per_node": 8,
    "hbm_capacity_bytes": 85899345920,
    "hbm_bw_bytes_per_s": 3.35e12,
    "peak_flops_per_s": {"bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12, "fp32": 66.9e12},
    "intra_node_bw_bytes_per_s": 450e9,
    "intra_node_latency_s": 2.0e-6,
    "network_bw_bytes_per_s": 50e9,
    "network_latency_s": 5.0e-6,
    "launch_overhead_s": 4.0e-6,
    "efficiency": {"gemm": 0.7, "attention": 0.5, "elementwise": 0.8, "hbm": 0.8},
}


def good(**changes):
    data = copy.deepcopy(GOOD)
    data.update(changes)
    return data


def error_of(data) -> str:
    with pytest.raises(ConfigError) as info:
        SystemSpec.from_dict(data)
    return str(info.value)


# -- catalogue ------------------------------------------------------------------------


def test_catalog_names():
    assert set(CATALOG_NAMES) == EXPECTED
    assert list(CATALOG_NAMES) == sorted(CATALOG_NAMES)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_catalog_system_loads(name):
    spec = get_system(name)
    assert isinstance(spec, SystemSpec)
    assert spec.name == name
    assert spec.chips_per_node == {"gb200-nvl72": 72, "gb300-nvl72": 72, "gh200-nvl32": 32}.get(name, 8)
    assert set(spec.efficiency) == set(EFFICIENCY_KEYS)
    for op in OP_CLASSES + ("hbm",):
        assert 0 < spec.op_efficiency(op) <= 1
    for dtype in ("bf16", "fp16", "fp32"):
        assert spec.peak_flops(dtype) > 0
    hash(spec)  # hashable
    assert get_system(name) is spec  # cached
    assert SystemSpec.from_dict(spec.to_dict()) == spec


def test_unknown_system_name_suggests_and_lists():
    with pytest.raises(ConfigError) as info:
        get_system("h100")
    msg = str(info.value)
    assert msg.startswith("system: unknown system 'h100'")
    assert "did you mean" in msg
    assert "known: a100-80gb, b200, gb200-nvl72, gb300-nvl72, gh200-nvl32, h100-sxm, h20, h200, h800" in msg
    assert "path to a system YAML file" in msg


def test_missing_system_file(tmp_path):
    with pytest.raises(ConfigError, match="no system file at"):
        get_system(str(tmp_path / "nope.yaml"))


# -- user files -----------------------------------------------------------------------


def test_user_yaml_equals_from_dict(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(GOOD), encoding="utf-8")
    from_file = get_system(str(path))
    assert from_file == SystemSpec.from_dict(GOOD)
    assert from_file == SystemSpec.from_yaml(path)
    assert hash(from_file) == hash(SystemSpec.from_dict(GOOD))
    assert from_file.peak_flops_per_s == GOOD["peak_flops_per_s"]


def test_user_yaml_reads_short_exponents(tmp_path):
    # YAML 1.1 would read 450e9 as a string; G5 reads it as a number, like the catalogue does.
    text = (
        "name: short\nchips_per_node: 4\nhbm_capacity_bytes: 80e9\nhbm_bw_bytes_per_s: 2e12\n"
        "peak_flops_per_s: {bf16: 312e12}\nintra_node_bw_bytes_per_s: 300e9\n"
        "intra_node_latency_s: 2e-6\nnetwork_bw_bytes_per_s: 25e9\nnetwork_latency_s: 5e-6\n"
        "launch_overhead_s: 0\nefficiency: {gemm: 1, attention: .5, elementwise: 0.8, hbm: 0.8}\n"
    )
    path = tmp_path / "short.yaml"
    path.write_text(text, encoding="utf-8")
    spec = get_system(path.as_posix())
    assert spec.hbm_capacity_bytes == 80_000_000_000 and isinstance(spec.hbm_capacity_bytes, int)
    assert spec.intra_node_bw_bytes_per_s == 300e9
    assert spec.op_efficiency("attention") == 0.5
    assert spec.launch_overhead_s == 0.0


def test_catalog_file_as_user_file_is_identical(tmp_path):
    spec = get_system("h100-sxm")
    path = tmp_path / "copy.yaml"
    path.write_text(yaml.safe_dump(spec.to_dict()), encoding="utf-8")
    assert SystemSpec.from_yaml(path) == spec


def test_invalid_yaml_is_config_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: [unclosed\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"invalid YAML in .*bad\.yaml"):
        SystemSpec.from_yaml(path)


def test_yaml_not_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="must hold one system as a mapping"):
        SystemSpec.from_yaml(path)


def test_file_errors_name_the_file(tmp_path):
    path = tmp_path / "neg.yaml"
    path.write_text(yaml.safe_dump(good(hbm_bw_bytes_per_s=-1.0)), encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        SystemSpec.from_yaml(path)
    assert info.value.field == "system.hbm_bw_bytes_per_s"
    assert "neg.yaml" in str(info.value)


# -- validation -----------------------------------------------------------------------


def test_unknown_key_suggests_closest():
    data = good()
    data["hbm_bandwidth_bytes_per_s"] = data.pop("hbm_bw_bytes_per_s")
    msg = error_of(data)
    assert msg.startswith("system.hbm_bandwidth_bytes_per_s: unknown key")
    assert "did you mean 'hbm_bw_bytes_per_s'" in msg


def test_missing_key_is_named():
    data = good()
    del data["network_latency_s"]
    msg = error_of(data)
    assert msg.startswith("system.network_latency_s: missing")


def test_several_missing_keys_are_all_named():
    data = good()
    del data["network_latency_s"], data["chips_per_node"]
    msg = error_of(data)
    assert "chips_per_node" in msg and "network_latency_s" in msg


@pytest.mark.parametrize("value", [0, -3.0])
def test_non_positive_number(value):
    msg = error_of(good(hbm_bw_bytes_per_s=value))
    assert msg.startswith("system.hbm_bw_bytes_per_s: expected a positive number")


@pytest.mark.parametrize("value", ["fast", True, None, [1], float("nan"), float("inf")])
def test_non_numeric_number(value):
    msg = error_of(good(network_bw_bytes_per_s=value))
    assert msg.startswith("system.network_bw_bytes_per_s: expected a positive number")


def test_numeric_string_is_rejected_in_dict():
    msg = error_of(good(hbm_bw_bytes_per_s="3.35e12"))
    assert "system.hbm_bw_bytes_per_s" in msg and "str" in msg


@pytest.mark.parametrize("value", [0, -8, 8.5, "8", True])
def test_chips_per_node_positive_integer(value):
    msg = error_of(good(chips_per_node=value))
    assert msg.startswith("system.chips_per_node: expected a positive integer")


def test_capacity_integral_float_becomes_int():
    spec = SystemSpec.from_dict(good(hbm_capacity_bytes=80e9))
    assert spec.hbm_capacity_bytes == 80_000_000_000
    assert isinstance(spec.hbm_capacity_bytes, int)


def test_negative_latency_rejected_zero_allowed():
    msg = error_of(good(network_latency_s=-1e-6))
    assert msg.startswith("system.network_latency_s: expected a number of seconds >= 0")
    assert SystemSpec.from_dict(good(network_latency_s=0)).network_latency_s == 0.0


def test_peak_flops_unknown_dtype_key():
    msg = error_of(good(peak_flops_per_s={"bf61": 1e12}))
    assert msg.startswith("system.peak_flops_per_s.bf61: unknown dtype 'bf61'")
    assert "did you mean 'bf16'" in msg


def test_peak_flops_non_positive_value():
    msg = error_of(good(peak_flops_per_s={"bf16": 0}))
    assert msg.startswith("system.peak_flops_per_s.bf16: expected a positive number")


def test_peak_flops_empty_or_not_mapping():
    assert error_of(good(peak_flops_per_s={})).startswith("system.peak_flops_per_s:")
    assert "expected a mapping" in error_of(good(peak_flops_per_s=[1e12]))


@pytest.mark.parametrize("value", [0, 1.5, -0.1, "high"])
def test_efficiency_outside_unit_interval(value):
    eff = dict(GOOD["efficiency"], gemm=value)
    msg = error_of(good(efficiency=eff))
    assert msg.startswith("system.efficiency.gemm: expected a fraction in (0, 1]")


def test_efficiency_one_is_allowed():
    eff = dict(GOOD["efficiency"], gemm=1)
    assert SystemSpec.from_dict(good(efficiency=eff)).op_efficiency("gemm") == 1.0


def test_efficiency_unknown_key_suggests():
    eff = dict(GOOD["efficiency"])
    eff["attn"] = eff.pop("attention")
    msg = error_of(good(efficiency=eff))
    assert msg.startswith("system.efficiency.attn: unknown key")
    assert "did you mean 'attention'" in msg


def test_efficiency_missing_key():
    eff = dict(GOOD["efficiency"])
    del eff["hbm"]
    assert error_of(good(efficiency=eff)).startswith("system.efficiency.hbm: missing")


def test_empty_name():
    assert error_of(good(name="")).startswith("system.name: expected a non-empty string")


def test_from_dict_not_a_mapping():
    with pytest.raises(ConfigError, match="expected a mapping"):
        SystemSpec.from_dict([1, 2])


def test_direct_construction_validates_too():
    with pytest.raises(ConfigError, match="system.launch_overhead_s"):
        attrs.evolve(SystemSpec.from_dict(GOOD), launch_overhead_s="slow")


# -- lookups --------------------------------------------------------------------------


def test_peak_flops_missing_dtype_names_system_and_dtype():
    a100 = get_system("a100-80gb")
    with pytest.raises(ConfigError) as info:
        a100.peak_flops("fp8")
    msg = str(info.value)
    assert "a100-80gb" in msg and "'fp8'" in msg
    assert "bf16, fp16, fp32" in msg


def test_peak_flops_unknown_dtype_suggests():
    with pytest.raises(ConfigError, match=r"h100-sxm.*did you mean 'bf16'"):
        get_system("h100-sxm").peak_flops("bf17")


def test_op_efficiency_unknown_class():
    with pytest.raises(ConfigError, match=r"unknown op class 'gem'.*did you mean 'gemm'"):
        get_system("h100-sxm").op_efficiency("gem")


def test_spec_is_immutable_and_hashable():
    spec = get_system("h200")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        spec.name = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.peak_flops_per_s["bf16"] = 1.0  # type: ignore[index]
    assert len({spec, get_system("h200"), get_system("h100-sxm")}) == 2


# -- figures sanity -------------------------------------------------------------------


def test_figures_sanity():
    a100, h100, h200, h800, b200 = (
        get_system(n) for n in ("a100-80gb", "h100-sxm", "h200", "h800", "b200")
    )
    GiB = 2**30
    assert h100.hbm_capacity_bytes == 80 * GiB == a100.hbm_capacity_bytes == h800.hbm_capacity_bytes
    assert h200.hbm_capacity_bytes > h100.hbm_capacity_bytes
    assert b200.hbm_capacity_bytes > h200.hbm_capacity_bytes
    assert a100.hbm_bw_bytes_per_s < h100.hbm_bw_bytes_per_s == h800.hbm_bw_bytes_per_s
    assert h100.hbm_bw_bytes_per_s < h200.hbm_bw_bytes_per_s < b200.hbm_bw_bytes_per_s
    # NVLink per direction as NCCL models it (links x per-link GB/s of src/graph/topo.h):
    # H100/H200 18 x 20.6, H800 cut to 8 links, A100 12 x 20.0, B200 18 x 40.1
    assert h800.intra_node_bw_bytes_per_s < h100.intra_node_bw_bytes_per_s
    assert h800.intra_node_bw_bytes_per_s == pytest.approx(8 * 20.6e9)
    assert h100.intra_node_bw_bytes_per_s == h200.intra_node_bw_bytes_per_s == pytest.approx(18 * 20.6e9)
    assert b200.intra_node_bw_bytes_per_s == pytest.approx(18 * 40.1e9)
    assert a100.intra_node_bw_bytes_per_s == pytest.approx(12 * 20.0e9)
    gb200 = get_system("gb200-nvl72")
    assert gb200.chips_per_node == gb200.nics == 72 and gb200.nvls
    assert gb200.intra_node_bw_bytes_per_s == b200.intra_node_bw_bytes_per_s
    # one NIC per GPU everywhere; NVLS from Hopper on; compute capabilities for NCCL's tables
    assert all(s.nics == s.chips_per_node for s in (a100, h100, h200, h800, b200))
    assert not a100.nvls and h100.nvls and b200.nvls
    assert (a100.compute_capability, h100.compute_capability, b200.compute_capability) == (8.0, 9.0, 10.0)
    # Hopper parts share one die: same compute.
    assert h100.peak_flops_per_s == h200.peak_flops_per_s == h800.peak_flops_per_s
    assert "fp8" not in a100.peak_flops_per_s
    for spec in (a100, h100, h200, h800, b200):
        # fp32 is plain FP32 (well below the tensor peaks), fp8 doubles bf16, fp16 == bf16.
        assert spec.peak_flops("fp32") < spec.peak_flops("bf16") / 4
        assert spec.peak_flops("fp16") == spec.peak_flops("bf16")
        if "fp8" in spec.peak_flops_per_s:
            assert spec.peak_flops("fp8") == pytest.approx(2 * spec.peak_flops("bf16"), rel=1e-3)
        # inside a node is faster than the network; the network is per GPU (<= 400 Gb/s).
        assert spec.network_bw_bytes_per_s < spec.intra_node_bw_bytes_per_s
        assert spec.network_bw_bytes_per_s <= 50e9
        assert spec.intra_node_latency_s <= spec.network_latency_s
    assert b200.peak_flops("bf16") > h100.peak_flops("bf16") > a100.peak_flops("bf16")
    assert h100.peak_flops("bf16") == 989.4e12
    assert a100.peak_flops("fp32") == 19.5e12


def test_systems_show_prints_the_resolved_values_of_a_base_file(tmp_path):
    from click.testing import CliRunner
    from g5core.present.cli import main
    from g5core.inputs.systems import SystemSpec, get_system

    path = tmp_path / "h200-fast-nic.yaml"
    path.write_text("base: h200\nname: h200-fast-nic\nnetwork_bw_bytes_per_s: 96e9\n")
    res = CliRunner().invoke(main, ["systems", "show", str(path)])
    assert res.exit_code == 0, res.output
    head, resolved = res.output.split("# resolved:")
    assert "network_bw_bytes_per_s: 96e9" in head
    lines = resolved.splitlines()[1:]
    assert "network_bw_bytes_per_s: 9.6e+10  # this file" in lines
    assert "hbm_bw_bytes_per_s: 4.8e+12  # base h200" in lines
    assert SystemSpec._from_text("\n".join(lines), "<resolved>") == get_system(str(path))  # every field, as run
    plain = CliRunner().invoke(main, ["systems", "show", "h200"])
    assert "# resolved" not in plain.output  # a file without base: is its own listing
