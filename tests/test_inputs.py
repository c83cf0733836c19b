"""Bad input files and magnitudes (issue 10): one-line errors naming the field, never a
traceback; the fuzzer's minimal triggers R1-R6 each as a test."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from g5core import hookimpl
from g5core.api.errors import ConfigError, G5Error
from g5core.inputs.reading import LIMITS, MAX_MODEL_DIM, MAX_SEQ_LEN
from g5core.inputs.models import ModelSpec
from g5core.session.run import load_raw, run
from g5core.inputs.systems import SystemSpec, get_system

from test_cli import error_line, invoke

REPO = Path(__file__).resolve().parent.parent
EX_8B = REPO / "examples" / "llama-3.1-8b-prefill.yaml"
EX_70B = REPO / "examples" / "llama-3.1-70b-prefill.yaml"
H100 = (REPO / "g5core" / "data" / "systems" / "h100-sxm.yaml").read_text()
LLAMA_8B_HF = json.loads((REPO / "tests" / "data" / "hf" / "llama-3.1-8b.json").read_text())


def _config(tmp_path, text: str, name: str = "c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _system_config(tmp_path, system_text: str) -> Path:
    system = _config(tmp_path, system_text, "sys.yaml")
    return _config(tmp_path, EX_8B.read_text().replace("system: h100-sxm", f"system: {system}"))


# -- files that are not text -------------------------------------------------------------


def test_binary_config_is_one_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    assert "not UTF-8 text" in error_line("run", p)


def test_config_with_nul_bytes_is_one_line(tmp_path):
    p = tmp_path / "c.json"
    p.write_bytes(b'{"model": "llama-3.1-8b"\x00}')
    assert "NUL bytes" in error_line("explain", p)


def test_non_utf8_system_file_is_one_line(tmp_path):
    system = tmp_path / "sys.yaml"
    system.write_bytes(H100.replace("name: h100-sxm", "name: h100-caf\u00e9").encode("latin-1"))
    cfg = _config(tmp_path, EX_8B.read_text().replace("system: h100-sxm", f"system: {system}"))
    line = error_line("run", cfg)
    assert "system file" in line and "not UTF-8" in line


def test_binary_hf_config_is_one_line(tmp_path):
    model = tmp_path / "config.json"
    model.write_bytes(bytes(range(256)))
    cfg = _config(tmp_path, EX_8B.read_text().replace("model: llama-3.1-8b", f"model: {model}"))
    line = error_line("run", cfg)
    assert "Hugging Face config" in line and "not UTF-8" in line


# -- duplicate keys ------------------------------------------------------------------------


def test_duplicate_yaml_key_in_config_names_the_key(tmp_path):
    cfg = _config(tmp_path, EX_8B.read_text() + "seq_len: 1024\n")
    line = error_line("run", cfg)
    assert "'seq_len' is given twice" in line and "line 9" in line


def test_duplicate_nested_yaml_key_names_the_key(tmp_path):
    cfg = _config(tmp_path, EX_8B.read_text().replace("cp: 1}", "cp: 1, tp: 1}"))
    assert "'tp' is given twice" in error_line("explain", cfg)


def test_duplicate_key_in_json_config_names_the_key(tmp_path):
    cfg = _config(tmp_path, '{"model": "llama-3.1-8b", "model": "deepseek-v3"}', "c.json")
    assert "'model' is given twice" in error_line("explain", cfg)


def test_duplicate_key_in_system_file_names_the_key(tmp_path):
    cfg = _system_config(tmp_path, H100 + "launch_overhead_s: 1.0e-6\n")
    line = error_line("run", cfg)
    assert line.startswith("g5: error: system:") and "'launch_overhead_s' is given twice" in line


def test_duplicate_key_in_hf_config_names_the_key(tmp_path):
    model = tmp_path / "config.json"
    text = json.dumps(LLAMA_8B_HF)
    model.write_text(text[:-1] + ', "hidden_size": 1024}')
    with pytest.raises(ConfigError, match="'hidden_size' is given twice"):
        ModelSpec.from_hf_file(model)


def test_yaml_merge_keys_still_work(tmp_path):
    cfg = _config(tmp_path, EX_8B.read_text().replace(
        "parallel: {dp: 1, tp: 1, pp: 1, cp: 1}",
        "base: &b {dp: 1, tp: 1}\nparallel: {<<: *b, pp: 1, cp: 1}").replace("base:", "x-base:"))
    raw = load_raw(cfg)
    assert raw["parallel"] == {"dp": 1, "tp": 1, "pp": 1, "cp": 1}


# -- R1: a 401-digit integer in a system file ------------------------------------------------


@pytest.mark.parametrize("field", ["hbm_bw_bytes_per_s", "intra_node_bw_bytes_per_s", "network_latency_s",
                                   "launch_overhead_s", "hbm_capacity_bytes", "chips_per_node"])
def test_r1_huge_integer_in_system_file_is_refused_naming_the_field(tmp_path, field):
    lines = [f"{field}: {'9' * 401}" if l.startswith(f"{field}:") else l for l in H100.splitlines()]
    line = error_line("run", _system_config(tmp_path, "\n".join(lines)))
    assert f"system.{field}" in line and "401 digits" in line


def test_r1_huge_peak_flops_is_refused():
    data = SystemSpec._from_text(H100, "x").to_dict()
    data["peak_flops_per_s"] = {"bf16": 10 ** 400}
    with pytest.raises(ConfigError, match=r"system\.peak_flops_per_s\.bf16"):
        SystemSpec.from_dict(data)


@pytest.mark.parametrize("field,value", [("hbm_bw_bytes_per_s", 1e-300), ("network_bw_bytes_per_s", 1e300),
                                         ("intra_node_latency_s", 3600.0), ("hbm_capacity_bytes", 10 ** 30)])
def test_absurd_system_magnitudes_are_refused_with_the_range(field, value):
    data = SystemSpec._from_text(H100, "x").to_dict()
    data[field] = value
    with pytest.raises(ConfigError, match=rf"system\.{field}: .* outside the range G5 accepts"):
        SystemSpec.from_dict(data)


def test_efficiency_too_small_to_give_a_finite_time_is_refused():
    data = SystemSpec._from_text(H100, "x").to_dict()
    data["efficiency"] = dict(data["efficiency"], gemm=1e-300)
    with pytest.raises(ConfigError, match=r"system\.efficiency\.gemm"):
        SystemSpec.from_dict(data)


def test_every_shipped_system_lies_inside_the_limits():
    from g5core.inputs.systems import CATALOG_NAMES
    for name in CATALOG_NAMES:
        get_system(name)  # would raise if a shipped figure were outside LIMITS
    assert LIMITS["seconds"][1] >= 1e-3


# -- R2: an unhashable model_type -----------------------------------------------------------


@pytest.mark.parametrize("model_type", [[], {}, 3, None])
def test_r2_model_type_of_the_wrong_type_is_a_config_error(model_type):
    with pytest.raises(ConfigError, match="model_type"):
        ModelSpec.from_hf_config(dict(LLAMA_8B_HF, model_type=model_type), "m")


# -- R3: astronomically large sizes --------------------------------------------------------


@pytest.mark.parametrize("key,value", [("seq_len", 10 ** 300), ("batch", 10 ** 300), ("seq_len", MAX_SEQ_LEN + 1),
                                       ("chips", 10 ** 300), ("parallel.dp", 10 ** 300)])
def test_r3_huge_deployment_sizes_are_refused(key, value):
    line = error_line("run", EX_8B, "--set", f"{key}={value}")
    assert f"error: {key}:" in line and "larger than G5 accepts" in line
    assert len(line) < 300  # the 301-digit number is shortened


def test_r3_batch_times_seq_len_is_bounded():
    line = error_line("run", EX_8B, "--set", "batch=1073741824", "--set", f"seq_len={MAX_SEQ_LEN}")
    assert "batch x seq_len" in line


@pytest.mark.parametrize("key", ["intermediate_size", "vocab_size", "hidden_size", "num_hidden_layers"])
def test_r3_huge_hf_sizes_are_refused(key):
    with pytest.raises(ConfigError, match=rf"^{key}: .*larger than G5 accepts"):
        ModelSpec.from_hf_config(dict(LLAMA_8B_HF, **{key: 10 ** 300}), "m")
    ModelSpec.from_hf_config(dict(LLAMA_8B_HF, **{key: MAX_MODEL_DIM}), "m")  # the limit itself is fine


# -- R4: Math path with the collectives disabled -----------------------------------------------


def test_r4_math_path_without_collectives_gives_the_event_path_error():
    g5 = error_line("run", EX_70B, "--disable", "collectives")
    math_line = error_line("run", EX_70B, "--set", "path=math", "--disable", "collectives")
    assert math_line == g5
    assert "no enabled plugin lowers" in g5 and "enable the collectives plugin" in g5


# -- R5: a result is finite or an error; JSON is always standard ------------------------------


def test_r5_launch_overhead_of_1e308_is_refused(tmp_path):
    text = H100.replace("launch_overhead_s: 4.0e-6", "launch_overhead_s: 1.0e+308")
    line = error_line("run", _system_config(tmp_path, text), "--json")
    assert "system.launch_overhead_s" in line and "outside the range" in line


class _HugeLatency:
    """A compute-latency plugin whose ops each take 1e308 s: finite alone, infinite summed."""

    @hookimpl(tryfirst=True)
    def g5_compute_latency(self, op, system, deployment):
        return 1e308


@pytest.mark.parametrize("path", ["g5", "math"])
def test_r5_a_non_finite_result_is_an_error_not_inf(path):
    raw = load_raw(EX_8B, [f"path={path}", "seq_len=1024"])
    with pytest.raises(G5Error, match="not a finite number"):
        run(raw, extra_plugins=[("huge", _HugeLatency())])


def test_r5_json_output_is_standard_json(tmp_path):
    result = invoke("run", EX_8B, "--set", "seq_len=1024", "--json")
    assert result.exit_code == 0
    json.loads(result.stdout, parse_constant=lambda name: pytest.fail(f"non-standard JSON constant {name}"))


# -- R6: a large legal workload never trips the engine's own accounting ----------------------


@pytest.mark.parametrize("phase,seq_len", [("prefill", 2 ** 32), ("decode", 2 ** 40)])
def test_r6_large_sequences_keep_every_kpi_zero(phase, seq_len):
    raw = load_raw(EX_8B, ["chips=2", "parallel.tp=2", f"phase={phase}", f"seq_len={seq_len}"])
    out = run(raw)
    assert all(v == 0 for v in out.sim.kpis.values())
    assert math.isfinite(out.latency_s) and out.latency_s > 0


def test_r6_long_runs_with_shared_ports_keep_the_port_kpi_zero(tmp_path):
    # ports shared by EP, TP and CP flows for ~1e14 s of simulated time: the rate sums'
    # rounding once added up to whole bytes "beyond capacity"
    hf = json.loads((REPO / "tests" / "data" / "hf" / "deepseek-v3.json").read_text())
    model = tmp_path / "config.json"
    model.write_text(json.dumps(dict(hf, num_hidden_layers=2, first_k_dense_replace=1)))
    out = run(load_raw(REPO / "examples" / "deepseek-v3-1m-prefill-cp8.yaml", [f"model={model}", f"seq_len={2 ** 40}"]))
    assert out.sim.kpis["port_bytes_beyond_capacity"] == 0
    assert all(v == 0 for v in out.sim.kpis.values())
