"""The fuzzer's uncaught signatures (issue 25, item 3), each with its minimal input: every
one is now a one-line G5 error naming the field, never a traceback."""
from __future__ import annotations

import json

import pytest
import yaml

from g5core.api.errors import ConfigError
from g5core.inputs.config import load_config_file
from g5core.inputs.models import ModelSpec
from g5core.inputs.reading import MAX_NESTING
from g5core.inputs.systems import SystemSpec, get_system

from test_cli import error_line

H100 = get_system("h100-sxm").to_dict()


def _system_file(tmp_path, name="sys.yaml", **changes) -> str:
    data = json.loads(json.dumps(H100))
    for dotted, value in changes.items():
        node = data
        *path, last = dotted.split("__")
        for key in path:
            node = node[key]
        node[last] = value
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return str(p)


# -- deep nesting -------------------------------------------------------------------------


@pytest.mark.parametrize("suffix, text", [
    (".yaml", "a: " + "[" * 5000 + "]" * 5000 + "\n"),
    (".json", '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    (".yaml", "a:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 200)) + "  " * 200 + "v: 1\n"),
])
def test_a_deeply_nested_configuration_is_one_line(tmp_path, suffix, text):
    p = tmp_path / f"deep{suffix}"
    p.write_text(text)
    with pytest.raises(ConfigError, match=f"nested more than {MAX_NESTING} deep"):
        load_config_file(p)


def test_nesting_at_the_bound_is_read(tmp_path):
    p = tmp_path / "ok.json"
    p.write_text('{"a": ' + "[" * (MAX_NESTING - 1) + "]" * (MAX_NESTING - 1) + "}")
    data = load_config_file(p)["a"]
    for _ in range(MAX_NESTING - 2):
        data = data[0]
    assert data == []


def test_a_deeply_nested_hf_config_and_system_file_are_one_line(tmp_path):
    hf = tmp_path / "config.json"
    hf.write_text('{"model_type": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ConfigError, match="nested more than"):
        ModelSpec.from_hf_file(hf)
    sysfile = tmp_path / "s.yaml"
    sysfile.write_text("name: x\nnccl: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n")
    with pytest.raises(ConfigError, match="nested more than"):
        get_system(str(sysfile))


def test_the_cli_prints_one_line_for_a_deep_file(tmp_path):
    p = tmp_path / "deep.yaml"
    p.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    assert "nested more than" in error_line("run", p)


# -- base: cycles -------------------------------------------------------------------------


def test_a_base_that_names_its_own_file_is_refused_naming_the_chain(tmp_path):
    a = tmp_path / "a.yaml"
    a.write_text("base: a.yaml\nname: a\n")
    with pytest.raises(ConfigError, match=r"system\.base: .*loops.*a\.yaml -> .*a\.yaml"):
        get_system(str(a))


def test_a_base_chain_that_loops_is_refused_naming_every_file(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: ./a.yaml\nname: b\n")
    with pytest.raises(ConfigError) as e:
        get_system(str(tmp_path / "a.yaml"))
    msg = str(e.value)
    assert msg.startswith("system.base:") and "\n" not in msg
    assert msg.index("a.yaml") < msg.index("b.yaml") < msg.rindex("a.yaml")


def test_a_base_chain_without_a_loop_still_resolves(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\nname: a\n")
    (tmp_path / "b.yaml").write_text("base: h100-sxm\nname: b\nlaunch_overhead_s: 7.0e-6\n")
    spec = get_system(str(tmp_path / "a.yaml"))
    assert spec.name == "a" and spec.launch_overhead_s == 7.0e-6
    # and a second read (the chain was unwound) gives the same
    assert get_system(str(tmp_path / "a.yaml")) == spec


# -- NVLS below Hopper --------------------------------------------------------------------


def test_nvls_below_compute_capability_9_is_refused_naming_the_field(tmp_path):
    path = _system_file(tmp_path, nvls=True, compute_capability=8.0)
    with pytest.raises(ConfigError, match=r"^system\.nvls: .*compute capability 9\.0.*is 8\.0; set nvls: false"):
        get_system(path)
    assert get_system(_system_file(tmp_path, "ok.yaml", nvls=True, compute_capability=9.0)).nvls


def test_the_cli_run_with_nvls_on_ampere_is_exit_2(tmp_path):
    path = _system_file(tmp_path, nvls=True, compute_capability=8.0)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": "llama-3.1-8b", "system": path, "chips": 8,
                                   "parallel": {"dp": 1, "tp": 8, "pp": 1, "cp": 1}, "phase": "decode",
                                   "batch": 1, "seq_len": 1024}))
    assert error_line("run", cfg).startswith("g5: error: system.nvls:")


# -- absurd but finite system values --------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("compute_model__kernel_floor_s__gemm", 1e300),
    ("compute_model__attention_half_length_tokens", 1e308),
    ("compute_model__sm_count", 10 ** 400),
    ("compute_model__gemm_tile_m", 10 ** 400),
    ("compute_model__hbm_fraction", 1e-300),
    ("compute_model__gemm_peak_fraction__bf16", 1e-300),
    ("hbm_bw_bytes_per_s", 10 ** 400),
    ("launch_overhead_s", 1e300),
])
def test_values_outside_their_physical_range_are_refused(tmp_path, field, value):
    path = _system_file(tmp_path, **{field: value})
    with pytest.raises(ConfigError) as e:
        get_system(path)
    msg = str(e.value)
    assert msg.startswith(f"system.{field.replace('__', '.')}:") and "outside the range" in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize("field", ["efficiency__gemm", "compute_model__gemm_peak_fraction__fp8",
                                   "compute_model__attention_peak_fraction", "fabric"])
def test_a_401_digit_integer_where_a_fraction_goes_is_one_line(tmp_path, field):
    # found by tests/fuzz/fuzzer.py (seed 1, cases 950 and 1016; seed 2, case 1260): an
    # OverflowError from math.isfinite on an integer too large for a double
    value = {"nodes_per_leaf": 10 ** 400, "oversubscription": 2.0} if field == "fabric" else 10 ** 400
    path = _system_file(tmp_path, **{field: value})
    with pytest.raises(ConfigError) as e:
        get_system(path)
    assert str(e.value).startswith("system.") and "\n" not in str(e.value)


def test_the_shipped_systems_are_inside_every_range():
    from g5core.inputs.systems import CATALOG_NAMES
    for name in CATALOG_NAMES:
        SystemSpec.from_dict(get_system(name).to_dict())
