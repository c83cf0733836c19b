"""The Math path (closed form, no DAG) against the G5 event simulation, and its CP refusal."""
from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from g5core.present.cli import main
from g5core.api.errors import ConfigError
from g5core.session.run import make_plan, run

# Multi-chip tolerance. In the configurations below every communication op sits alone on
# its ports (each chip's work is a chain: compute, then the collective, then compute), and
# no compute hides any communication, so the event simulation produces the same sum of
# compute and alpha-beta communication times the Math path adds up; the results differ only
# by the order floating-point additions happen in (measured: below 4e-15 relative).
# 1e-9 leaves room for that and nothing else: contention or overlap would move the result by
# percent, not parts per billion.
MULTI_CHIP_REL = 1e-9


def _raw(model="llama-3.1-8b", phase="prefill", path="g5", batch=2, seq_len=512, **par):
    p = {"dp": 1, "tp": 1, "pp": 1, "cp": 1}
    p.update(par)
    chips = p["dp"] * p["tp"] * p["pp"] * p["cp"]
    return {"model": model, "system": "h100-sxm", "chips": chips, "parallel": p, "phase": phase,
            "batch": batch, "seq_len": seq_len, "path": path}


ONE_CHIP = [("llama-3.1-8b", "prefill"), ("llama-3.1-8b", "decode"),
            ("mixtral-8x7b", "prefill"), ("mixtral-8x7b", "decode"), ("deepseek-v3", "decode")]


@pytest.mark.parametrize("model, phase", ONE_CHIP)
def test_math_equals_g5_exactly_on_one_chip(model, phase):
    out = run(_raw(model=model, phase=phase), compare_math=True)
    assert out.sim is not None and out.math is not None
    assert out.math.latency_s == out.sim.latency_s
    assert out.math.comm_s == 0.0
    # the Math path on its own gives the same number
    alone = run(_raw(model=model, phase=phase, path="math"))
    assert alone.sim is None
    assert alone.latency_s == out.sim.latency_s


MULTI_CHIP = [
    dict(phase="decode", pp=2),
    dict(phase="prefill", pp=4),
    dict(phase="prefill", tp=2, seq_len=64),
    dict(phase="decode", tp=8),
    dict(model="mixtral-8x7b", phase="prefill", tp=2, ep=2, seq_len=128),
]


@pytest.mark.parametrize("kw", MULTI_CHIP, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_math_matches_g5_within_tolerance_where_comm_is_alone(kw):
    out = run(_raw(**kw), compare_math=True)
    assert out.math.comm_s > 0  # communication is really there
    assert out.math.latency_s == pytest.approx(out.sim.latency_s, rel=MULTI_CHIP_REL)


def test_cp_on_the_math_path_is_an_error():
    with pytest.raises(ConfigError, match="cp=2 is not supported on the Math path") as info:
        make_plan(_raw(path="math", cp=2))
    assert info.value.field == "path"
    with pytest.raises(ConfigError, match="cp=2 is not supported on the Math path"):
        run(_raw(path="math", cp=2, phase="decode"))


def test_compare_math_with_cp_is_refused_too():
    # the G5 path runs cp=2, but the comparison would need the Math path's CP formula
    with pytest.raises(ConfigError, match="refuses this configuration: path: cp=2 is not supported") as info:
        run(_raw(cp=2, seq_len=256), compare_math=True)
    assert info.value.field == "--compare-math"
    assert run(_raw(cp=2, seq_len=256)).sim is not None


def test_cp1_on_the_math_path_is_fine():
    assert run(_raw(path="math", cp=1)).math.latency_s > 0


@pytest.fixture()
def config_file(tmp_path):
    def write(raw):
        p = tmp_path / "cfg.yaml"
        p.write_text(yaml.safe_dump(raw))
        return str(p)
    return write


def test_cli_compare_math_shows_both(config_file):
    path = config_file(_raw(tp=2, seq_len=64))
    runner = CliRunner()
    res = runner.invoke(main, ["run", path, "--compare-math"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    g5_line = next(line for line in lines if line.startswith("TTFT: "))
    math_line = next(line for line in lines if line.startswith("TTFT (Math path): "))
    assert "math / g5 = 1.000" in math_line
    assert g5_line != math_line
    js = runner.invoke(main, ["run", path, "--compare-math", "--json"])
    assert js.exit_code == 0, js.output
    data = json.loads(js.output)
    assert data["path"] == "g5"
    assert data["math"]["ttft_s"] == pytest.approx(data["ttft_s"], rel=MULTI_CHIP_REL)
    assert data["math"]["comm_s"] > 0 and data["math"]["compute_s"] > 0
    # without the flag there is no Math result
    plain = json.loads(runner.invoke(main, ["run", path, "--json"]).output)
    assert "math" not in plain


def test_cli_decode_compare_math_reports_tpot(config_file):
    res = CliRunner().invoke(main, ["run", config_file(_raw(phase="decode")), "--compare-math"])
    assert res.exit_code == 0, res.output
    assert "TPOT: " in res.output and "TPOT (Math path): " in res.output
    assert "math / g5 = 1.000" in res.output


def test_cli_cp_with_math_path_fails_with_one_line(config_file):
    res = CliRunner().invoke(main, ["run", config_file(_raw(path="math", cp=2))])
    assert res.exit_code == 2
    out = res.output.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("g5: error: path: cp=2")
    res = CliRunner().invoke(main, ["run", config_file(_raw(cp=2, seq_len=256)), "--compare-math"])
    assert res.exit_code == 2
    out = res.output.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("g5: error: --compare-math: the Math path refuses this configuration: "
                                               "path: cp=2 is not supported on the Math path")
