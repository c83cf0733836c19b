"""Fuzz the configuration boundary (issue 10): configurations, Hugging Face config.json files
and system files, sane and absurd, and assert that every outcome is either a result with
all six conservation KPIs at 0 and a finite latency, or a G5 error (one line, exit 2 on the
command line), never another exception.

The budget is fixed and the search derandomized, so CI runs the same ~100 cases in a few
seconds; runs are kept small by ``max_ops`` (a larger case is a ResourceError, itself one
of the allowed outcomes).
"""
from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from g5core.api.errors import G5Error
from g5core.session.run import run
from g5core.inputs.systems import CATALOG_NAMES, SystemSpec

REPO = Path(__file__).resolve().parent.parent
H100 = SystemSpec._from_text((REPO / "g5core" / "data" / "systems" / "h100-sxm.yaml").read_text(), "h100").to_dict()
LLAMA_HF = json.loads((REPO / "tests" / "data" / "hf" / "llama-3.1-8b.json").read_text())
DEEPSEEK_HF = json.loads((REPO / "tests" / "data" / "hf" / "deepseek-v3.json").read_text())

SETTINGS = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))

# values a user might put anywhere by mistake
junk = st.one_of(st.none(), st.booleans(), st.text(max_size=5), st.floats(allow_nan=True),
                 st.integers(min_value=-2, max_value=2), st.just(10 ** 400), st.just(2 ** 63), st.lists(st.integers(), max_size=2),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
small_pow2 = st.sampled_from([1, 2, 4, 8])
size = st.sampled_from([1, 1, 2, 3, 4, 64, 256, 1024, 4096, 2 ** 20, 2 ** 32, 2 ** 40, 2 ** 41, 10 ** 300])


def sometimes(draw) -> bool:
    """True in about one case of four: when to put junk in."""
    return draw(st.integers(0, 3)) == 3  # not 0: hypothesis leans to its simplest values


@st.composite
def hf_configs(draw):
    base = dict(draw(st.sampled_from([LLAMA_HF, DEEPSEEK_HF])))
    small = {"num_hidden_layers": draw(st.integers(1, 4)), "hidden_size": draw(st.sampled_from([64, 128, 4096])),
             "intermediate_size": draw(st.sampled_from([128, 14336, 10 ** 300])),
             "vocab_size": draw(st.sampled_from([1000, 128256, 10 ** 300]))}
    if base["model_type"] == "deepseek_v3":
        small["first_k_dense_replace"] = draw(st.integers(0, 2))
    base.update(small)
    if sometimes(draw):
        base[draw(st.sampled_from(sorted(base)))] = draw(junk)
    if sometimes(draw):
        base["model_type"] = draw(st.one_of(st.sampled_from(["llama", "qwen2", "qwen3", "mixtral"]), junk))
    return base


@st.composite
def systems(draw):
    data = dict(H100)
    data["peak_flops_per_s"] = dict(data["peak_flops_per_s"])
    data["efficiency"] = dict(data["efficiency"])
    if sometimes(draw):
        data[draw(st.sampled_from(sorted(data)))] = draw(junk)
    if sometimes(draw):
        data[draw(st.sampled_from(sorted(data)))] = draw(st.sampled_from([0.0, 1e-300, 1e308, 4.0e-6, 50e9, 10 ** 401]))
    return data


@st.composite
def configs(draw):
    tp, pp, cp = draw(small_pow2), draw(st.sampled_from([1, 2])), draw(small_pow2)
    dp = draw(st.sampled_from([1, 2]))
    raw = {
        "model": draw(st.sampled_from(["llama-3.1-8b", "mixtral-8x7b", "qwen3-235b-a22b", "deepseek-v3", "HF", "HF"])),
        "system": draw(st.sampled_from(list(CATALOG_NAMES) + ["FILE", "FILE"])),
        "chips": dp * tp * pp * cp,
        "parallel": {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": draw(st.sampled_from([1, 1, 2]))},
        "phase": draw(st.sampled_from(["prefill", "decode"])),
        "batch": draw(size),
        "seq_len": draw(size),
        "dtypes": draw(st.sampled_from([{}, {"weights": "fp8"}, {"kv_cache": "fp8"},
                                        {"weights": {"default": "bf16", "ffn": "fp8"}}, {"weights": "int3"}])),
        "path": draw(st.sampled_from(["g5", "g5", "math"])),
        "tp_sp": draw(st.sampled_from([False, False, True])),
    }
    if sometimes(draw):
        raw["parallel"][draw(st.sampled_from(sorted(raw["parallel"])))] = draw(st.one_of(junk, small_pow2))
    if sometimes(draw):
        raw[draw(st.sampled_from(sorted(raw)))] = draw(junk)
    return raw


def _check(raw: dict, hf: dict, system: dict) -> None:
    with tempfile.TemporaryDirectory() as d:
        if raw.get("model") == "HF":
            p = Path(d) / "config.json"
            p.write_text(json.dumps(hf, default=str))
            raw["model"] = str(p)
        if raw.get("system") == "FILE":
            p = Path(d) / "system.yaml"
            p.write_text(yaml.safe_dump(system))
            raw["system"] = str(p)
        try:
            out = run(raw, max_ops=4000)
        except G5Error as exc:
            assert "\n" not in str(exc)
            return
    assert math.isfinite(out.latency_s) and out.latency_s > 0
    if out.sim is not None:
        assert all(v == 0 for v in out.sim.kpis.values()), out.sim.kpis
    json.dumps(out.to_json_dict(), allow_nan=False)  # standard JSON, never Infinity or NaN


@SETTINGS
@given(configs(), hf_configs(), systems())
def test_every_outcome_is_a_result_or_a_g5_error(raw, hf, system):
    _check(raw, hf, system)


def _plain(model: str, system: str, tp: int, phase: str) -> dict:
    return {"model": model, "system": system, "chips": tp, "parallel": {"dp": 1, "tp": tp, "pp": 1, "cp": 1},
            "phase": phase, "batch": 1, "seq_len": 1024}


@SETTINGS
@given(hf_configs())
def test_hf_configs_give_a_model_or_a_g5_error(hf):
    _check(_plain("HF", "h200", 1, "decode"), hf, H100)


@SETTINGS
@given(systems())
def test_system_files_give_a_system_or_a_g5_error(system):
    _check(_plain("llama-3.1-8b", "FILE", 2, "prefill"), LLAMA_HF, system)


@st.composite
def sane_configs(draw):
    """Legal-looking layouts of small models, so most cases reach the engine."""
    tp, cp, dp, pp = draw(small_pow2), draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2])), \
        draw(st.sampled_from([1, 2]))
    return {
        "model": draw(st.sampled_from(["HF", "HF", "llama-3.1-8b"])),
        "system": draw(st.sampled_from(list(CATALOG_NAMES))),
        "chips": dp * tp * pp * cp,
        "parallel": {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": draw(st.sampled_from([1, 2]))},
        "phase": draw(st.sampled_from(["prefill", "decode"])),
        "batch": draw(st.sampled_from([1, 2, 3, 8])),
        "seq_len": draw(st.sampled_from([64, 256, 1000, 4096, 2 ** 30])),
        "dtypes": draw(st.sampled_from([{}, {"weights": "fp8"}, {"weights": {"default": "bf16", "ffn": "fp8"}}])),
        "path": "math" if cp == 1 and draw(st.booleans()) else "g5",
        "tp_sp": cp == 1 and draw(st.booleans()),
    }


@st.composite
def tiny_hf_configs(draw):
    base = dict(draw(st.sampled_from([LLAMA_HF, DEEPSEEK_HF])))
    base.update(num_hidden_layers=draw(st.integers(1, 3)), vocab_size=draw(st.sampled_from([1000, 32000])))
    if base["model_type"] == "deepseek_v3":
        base["first_k_dense_replace"] = draw(st.integers(0, base["num_hidden_layers"] - 1))
    return base


@SETTINGS
@given(sane_configs(), tiny_hf_configs())
def test_legal_small_deployments_run_with_zero_kpis(raw, hf):
    _check(raw, hf, H100)
