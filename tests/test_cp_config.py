"""Configuration checks for context parallelism, spec v1.1.1.

Each refusal is an error whose message names the fix; each has a control run (the same
configuration with the offending choice removed) that must pass, so a guard that refuses
everything fails too.
"""
from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from g5core.present.cli import main
from g5core.api.errors import ConfigError, G5Error
from g5core.sim.results import KPI_NAMES
from g5core.session.run import make_plan, run

from cp_helpers import assert_kpis_zero, raw_config, tiny_model_path_fixture

# path to a 1-layer llama-3.1-8b HF config
tiny_llama = tiny_model_path_fixture("gqa1")


# ------------------------------------------------------------------------ chip product


@pytest.mark.parametrize("dp,tp,pp,cp,chips", [(1, 1, 1, 4, 8), (2, 1, 1, 4, 4), (1, 2, 1, 2, 2), (1, 1, 1, 2, 3)])
def test_chip_product_mismatch_is_an_error_naming_the_rule(tiny_llama, dp, tp, pp, cp, chips):
    raw = raw_config(tiny_llama, cp=cp, dp=dp, tp=tp, pp=pp, chips=chips)
    with pytest.raises(ConfigError) as info:
        make_plan(raw)
    msg = str(info.value)
    assert info.value.field == "parallel"
    assert f"cp={cp}" in msg
    assert f"= {dp * tp * pp * cp}" in msg and f"chips = {chips}" in msg
    assert "product of the parallel sizes must equal chips" in msg


def test_chip_product_match_passes(tiny_llama):
    out = run(raw_config(tiny_llama, cp=4, dp=2))
    assert out.deployment.chips == 8
    assert_kpis_zero(out.sim)


def test_missing_cp_is_an_error_telling_how_to_migrate(tiny_llama):
    raw = raw_config(tiny_llama, cp=1)
    del raw["parallel"]["cp"]
    with pytest.raises(ConfigError) as info:
        make_plan(raw)
    assert info.value.field == "parallel.cp"
    assert "cp: 1" in str(info.value)


@pytest.mark.parametrize("cp", [0, -2, 2.0, "2", True])
def test_cp_must_be_a_positive_whole_number(tiny_llama, cp):
    raw = raw_config(tiny_llama, cp=1)
    raw["parallel"]["cp"] = cp
    with pytest.raises(ConfigError) as info:
        make_plan(raw)
    assert info.value.field == "parallel.cp"


def test_seq_len_must_divide_by_two_cp(tiny_llama):
    with pytest.raises(ConfigError) as info:
        make_plan(raw_config(tiny_llama, cp=4, seq_len=4100))
    assert info.value.field == "seq_len" and "multiple of 8" in str(info.value)
    make_plan(raw_config(tiny_llama, cp=4, seq_len=4104))  # 4104 = 8 x 513


# -------------------------------------------------------------------------- Math path


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_math_path_with_cp_is_refused_naming_the_fix(tiny_llama, phase):
    with pytest.raises(ConfigError) as info:
        make_plan(raw_config(tiny_llama, cp=2, phase=phase, path="math"))
    msg = str(info.value)
    assert info.value.field == "path"
    assert "cp=2" in msg and "Math" in msg
    assert "path: g5" in msg or "cp: 1" in msg


def test_math_path_without_cp_is_accepted(tiny_llama):
    out = run(raw_config(tiny_llama, cp=1, dp=2, path="math"))
    assert out.math is not None and out.math.latency_s > 0


def test_compare_math_with_cp_is_refused(tiny_llama):
    with pytest.raises(ConfigError) as info:
        run(raw_config(tiny_llama, cp=2), compare_math=True)
    assert "cp=2" in str(info.value) and "Math" in str(info.value)


# -------------------------------------------------------------------------------- TP-SP


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_tp_sp_with_cp_is_refused_naming_the_fix(tiny_llama, phase):
    with pytest.raises(ConfigError) as info:
        make_plan(raw_config(tiny_llama, cp=2, tp=2, phase=phase, tp_sp=True))
    msg = str(info.value)
    assert info.value.field == "plugins.tp.sp"
    assert "cp=2" in msg
    assert "plugins.tp.sp: false" in msg and "tp_sp: false" in msg and "cp: 1" in msg


def test_tp_sp_without_cp_and_cp_without_tp_sp_are_accepted(tiny_llama):
    for raw in (raw_config(tiny_llama, cp=1, tp=2, tp_sp=True), raw_config(tiny_llama, cp=2, tp=2, tp_sp=False)):
        out = run(raw)
        assert_kpis_zero(out.sim)


# ------------------------------------------------------------------ disabled CP plugins


@pytest.mark.parametrize("phase,plugin", [("prefill", "cp_passkv"), ("decode", "cp_passq")])
def test_cp_with_its_phase_plugin_disabled_is_an_error_naming_the_plugin(tiny_llama, phase, plugin):
    with pytest.raises(ConfigError) as info:
        run(raw_config(tiny_llama, cp=2, phase=phase), disabled=[plugin])
    msg = str(info.value)
    assert plugin in msg
    assert f"--disable {plugin}" in msg or "parallel.cp: 1" in msg
    assert "\n" not in msg


@pytest.mark.parametrize("phase,plugin", [("prefill", "cp_passkv"), ("decode", "cp_passq")])
def test_cp_plugin_disabled_in_the_config_file_is_the_same_error(tiny_llama, phase, plugin):
    raw = raw_config(tiny_llama, cp=2, phase=phase, plugins={"disable": [plugin]})
    with pytest.raises(ConfigError) as info:
        run(raw)
    assert plugin in str(info.value)


@pytest.mark.parametrize("phase,other", [("prefill", "cp_passq"), ("decode", "cp_passkv")])
def test_disabling_the_other_phase_plugin_is_harmless(tiny_llama, phase, other):
    out = run(raw_config(tiny_llama, cp=2, phase=phase))
    ref = out.to_json_dict()
    alt = run(raw_config(tiny_llama, cp=2, phase=phase), disabled=[other])
    assert_kpis_zero(alt.sim)
    alt_json = alt.to_json_dict()
    for d in (ref, alt_json):
        d.pop("sim_wall_s")
        d["deployment"].pop("plugins", None)
    assert alt_json == ref


@pytest.mark.parametrize("phase,plugin", [("prefill", "cp_passkv"), ("decode", "cp_passq")])
def test_cp_plugin_disabled_at_cp1_is_fine(tiny_llama, phase, plugin):
    out = run(raw_config(tiny_llama, cp=1, dp=2, phase=phase), disabled=[plugin])
    assert_kpis_zero(out.sim)


# ----------------------------------------------------------------------------------- CLI


def test_cli_reports_cp_errors_on_one_line_with_status_2(tiny_llama, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw_config(tiny_llama, cp=4, chips=8)))
    runner = CliRunner()
    res = runner.invoke(main, ["run", str(path)])
    assert res.exit_code == 2
    lines = [ln for ln in (res.stderr if hasattr(res, "stderr") else res.output).splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("g5: error: ")
    assert "must equal chips" in lines[0]

    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(raw_config(tiny_llama, cp=2)))
    res = runner.invoke(main, ["run", str(good), "--disable", "cp_passkv"])
    assert res.exit_code == 2
    err = res.stderr if hasattr(res, "stderr") else res.output
    assert err.startswith("g5: error: ") and "cp_passkv" in err
    res = runner.invoke(main, ["run", str(good), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["conservation"] == {k: 0 for k in KPI_NAMES}


def test_errors_are_g5_errors(tiny_llama):
    with pytest.raises(G5Error):
        make_plan(raw_config(tiny_llama, cp=2, path="math"))
