"""Configuration: every error by its message, file formats, --set overrides, plugin disabling.

Each test builds a fresh plugin manager (through ``make_plan``) so that no state leaks
between tests. A few errors are also checked end to end through the CLI: exit status 2,
one ``g5: error:`` line on stderr, no traceback, no output file written.
"""
from __future__ import annotations

import copy
import json

import pytest
import yaml
from click.testing import CliRunner

from g5core.lower.builder import build_dag, plan_deployment
from g5core.present.cli import main
from g5core.inputs.config import Deployment, apply_overrides, load_config_file
from g5core.api.dimensions import collect_dimensions
from g5core.api.options import collect_options
from g5core.api.errors import ConfigError, PluginError
from g5core.api.plugins import Hooks, make_plugin_manager
from g5core.session.run import load_raw, make_plan
from plugin_sets import THIRD_PARTY

BASE = {
    "model": "llama-3.1-8b",
    "system": "h100-sxm",
    "chips": 1,
    "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1},
    "phase": "prefill",
    "batch": 1,
    "seq_len": 4096,
}


def raw(**changes) -> dict:
    """A copy of BASE with top-level changes; ``parallel`` changes merge into the mapping."""
    out = copy.deepcopy(BASE)
    par = changes.pop("parallel", None)
    if par is not None:
        out["parallel"].update(par)
    out.update(changes)
    return out


def config_error(data, disabled=()) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        make_plan(data, disabled)
    return info.value


THIRD_PARTY_DIMS = tuple(d.name for d in collect_dimensions(Hooks(make_plugin_manager())).dims
                         if d.owner in THIRD_PARTY)


def dims(disabled=()):
    return collect_dimensions(Hooks(make_plugin_manager(disabled=disabled)))


def options(disabled=()):
    return collect_options(Hooks(make_plugin_manager(disabled=disabled)))


# ----------------------------------------------------------------------------------------
# The base configuration is valid (so every error below comes from the one change made)
# ----------------------------------------------------------------------------------------


def test_base_config_is_valid_and_fills_defaults():
    plan = make_plan(raw())
    dep = plan.ctx.deployment
    assert dep.chips == 1
    # every registered dimension (a third-party one such as Ulysses' sp at its default)
    assert {k: v for k, v in dep.parallel if k not in THIRD_PARTY_DIMS} == {"cp": 1, "dp": 1, "ep": 1, "pp": 1, "tp": 1}
    assert all(dep.size(k) == 1 for k in THIRD_PARTY_DIMS)
    assert dep.path == "g5" and dep.option("tp", "sp") is False
    assert dep.dtypes.kv_cache == dep.dtypes.activations == "bf16"


def test_prepare_with_explicit_fresh_plugin_manager():
    plan = plan_deployment(raw(), make_plugin_manager())
    assert plan.ctx.deployment == make_plan(raw()).ctx.deployment


# ----------------------------------------------------------------------------------------
# Keys
# ----------------------------------------------------------------------------------------


def test_unknown_top_level_key_suggests_closest():
    data = raw()
    data["phse"] = "decode"
    err = config_error(data)
    assert err.field == "phse"
    assert "unknown key" in str(err)
    assert "did you mean 'phase'" in str(err)


def test_unknown_top_level_key_far_from_all_lists_valid_keys():
    data = raw()
    data["zzzzzz"] = 1
    msg = str(config_error(data))
    assert "did you mean" not in msg
    assert "valid keys:" in msg and "seq_len" in msg


@pytest.mark.parametrize("key", ["model", "system", "chips", "parallel", "phase", "batch", "seq_len"])
def test_required_top_level_key(key):
    data = raw()
    del data[key]
    err = config_error(data)
    assert err.field == key
    assert "is required" in str(err)


def test_top_level_not_a_mapping():
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        make_plan([1, 2, 3])


def test_missing_cp_explains_migration():
    data = raw()
    del data["parallel"]["cp"]
    err = config_error(data)
    msg = str(err)
    assert err.field == "parallel.cp"
    assert "required" in msg
    assert "`cp: 1`" in msg
    assert "previous behaviour" in msg


def test_missing_tp_names_its_plugin():
    data = raw()
    del data["parallel"]["tp"]
    err = config_error(data)
    assert err.field == "parallel.tp"
    assert "required" in str(err) and "'tp'" in str(err)


def test_ep_defaults_to_one_when_omitted():
    assert make_plan(raw()).ctx.deployment.size("ep") == 1


def test_parallel_not_a_mapping():
    data = raw()
    data["parallel"] = 8
    err = config_error(data)
    assert err.field == "parallel"
    assert "must be a mapping" in str(err)


# ----------------------------------------------------------------------------------------
# Chip product and plugin rules
# ----------------------------------------------------------------------------------------


def test_chip_product_mismatch_shows_the_product():
    err = config_error(raw(chips=16, parallel={"dp": 2, "tp": 2, "pp": 1, "cp": 2}))
    msg = str(err)
    assert err.field == "parallel"
    assert "= 8, but chips = 16" in msg
    for part in ("dp=2", "tp=2", "pp=1", "cp=2"):
        assert part in msg
    assert msg.endswith("(e.g. dp=4)")


def test_chip_product_mismatch_without_a_whole_dp_gives_no_hint():
    err = config_error(raw(chips=6, parallel={"dp": 1, "tp": 4, "pp": 1, "cp": 1}))
    assert "e.g." not in str(err)


def test_chip_product_is_checked_with_ep_outside_it():
    # ep regroups dp x tp and is not a factor: dp2 x tp2 = 4 chips with ep=4 is valid
    plan = make_plan(raw(model="mixtral-8x7b", chips=4, parallel={"dp": 2, "tp": 2, "ep": 4}))
    assert plan.ctx.rankmap.chips == 4
    err = config_error(raw(model="mixtral-8x7b", chips=16, parallel={"dp": 2, "tp": 2, "ep": 4}))
    assert "= 4, but chips = 16" in str(err)


def test_ep_must_divide_dp_times_tp():
    err = config_error(raw(model="mixtral-8x7b", chips=4, parallel={"dp": 1, "tp": 2, "pp": 2, "ep": 4}))
    assert err.field == "parallel.ep"
    assert "ep=4 does not divide dp x sp x tp = 2" in str(err)


def test_ep_on_a_dense_model():
    err = config_error(raw(chips=2, parallel={"tp": 2, "ep": 2}))
    assert err.field == "parallel.ep"
    assert "no MoE" in str(err)


def test_heads_not_divisible_by_tp():
    err = config_error(raw(chips=3, parallel={"tp": 3}))
    assert err.field == "parallel.tp"
    assert "32 attention heads" in str(err) and "tp=3" in str(err)


def test_pp_larger_than_layers():
    err = config_error(raw(chips=64, parallel={"pp": 64}))
    assert err.field == "parallel.pp"
    assert "pp=64" in str(err) and "32 layers" in str(err)


def test_seq_len_not_divisible_by_two_cp():
    err = config_error(raw(chips=4, seq_len=4100, parallel={"cp": 4}))
    assert err.field == "seq_len"
    assert "2 x cp = 8" in str(err)


def test_seq_len_divisible_by_cp_but_not_two_cp():
    err = config_error(raw(chips=4, seq_len=4 * 1025, parallel={"cp": 4}))
    assert err.field == "seq_len"


def test_odd_seq_len_is_fine_without_cp():
    assert make_plan(raw(seq_len=4099)).ctx.deployment.seq_len == 4099


def test_cp_with_tp_sp_is_refused():
    for spelling in ({"tp_sp": True}, {"plugins": {"tp": {"sp": True}}}):
        err = config_error(raw(chips=4, parallel={"tp": 2, "cp": 2}, **spelling))
        assert err.field == "plugins.tp.sp"


def test_cp_on_math_path_is_refused():
    err = config_error(raw(chips=2, path="math", parallel={"cp": 2}))
    assert err.field == "path"
    assert "cp=2" in str(err)


# ----------------------------------------------------------------------------------------
# Sizes: zero, negative, non-integer
# ----------------------------------------------------------------------------------------

SIZE_FIELDS = ["chips", "batch", "seq_len", "parallel.dp", "parallel.tp", "parallel.pp", "parallel.cp",
               "parallel.ep"]
BAD_SIZES = [0, -1, -8, 2.5, "8", True, None]


@pytest.mark.parametrize("field", SIZE_FIELDS)
@pytest.mark.parametrize("value", BAD_SIZES, ids=repr)
def test_bad_sizes(field, value):
    data = raw()
    if field.startswith("parallel."):
        data["parallel"][field.split(".", 1)[1]] = value
    else:
        data[field] = value
    err = config_error(data)
    assert err.field == field
    assert str(err).startswith(f"{field}: must be a positive whole number, got {value!r}")


# ----------------------------------------------------------------------------------------
# Names: phase, dtype, path, model, system, parallel keys
# ----------------------------------------------------------------------------------------


def test_unknown_phase_suggests():
    err = config_error(raw(phase="prefil"))
    assert err.field == "phase"
    assert "did you mean 'prefill'" in str(err)


def test_unknown_kv_cache_dtype_suggests():
    err = config_error(raw(dtypes={"kv_cache": "bf8"}))
    assert err.field == "dtypes.kv_cache"
    assert "unknown dtype 'bf8'" in str(err)
    assert "did you mean" in str(err)
    assert "bf16" in str(err) and "fp8" in str(err)


@pytest.mark.parametrize("key", ["activations", "weights"])
def test_unknown_dtype_other_fields(key):
    err = config_error(raw(dtypes={key: "int3"}))
    assert err.field == f"dtypes.{key}"


def test_unknown_dtypes_key_suggests():
    err = config_error(raw(dtypes={"kvcache": "fp8"}))
    assert err.field == "dtypes.kvcache"
    assert "did you mean 'kv_cache'" in str(err)


def test_weight_class_mapping_needs_default():
    err = config_error(raw(dtypes={"weights": {"ffn": "fp8"}}))
    assert err.field == "dtypes.weights"
    assert "default" in str(err)


def test_unknown_path_suggests():
    err = config_error(raw(path="maths"))
    assert err.field == "path"
    assert "did you mean 'math'" in str(err)


def test_unknown_model_suggests():
    err = config_error(raw(model="llama-3.1-8"))
    assert err.field == "model"
    assert "did you mean 'llama-3.1-8b'" in str(err)


def test_unknown_system_suggests():
    err = config_error(raw(system="h100-sx"))
    assert err.field == "system"
    assert "did you mean 'h100-sxm'" in str(err)


@pytest.mark.parametrize("key", ["model", "system"])
@pytest.mark.parametrize("value", ["", 3, None])
def test_model_and_system_must_be_names(key, value):
    err = config_error(raw(**{key: value}))
    assert err.field == key


def test_unregistered_parallel_key_asks_for_plugin():
    err = config_error(raw(parallel={"xsp": 2}))
    msg = str(err)
    assert err.field == "parallel.xsp"
    assert "no enabled plugin registers the dimension 'xsp'" in msg
    assert "plugin that provides it installed" in msg


@pytest.mark.parametrize("disabled", [("tp",), ("tp", "ep")])
def test_disabling_tp_makes_parallel_tp_unknown(disabled):
    # ep regroups dp x tp; without tp it regroups dp alone, so disabling tp alone is enough
    err = config_error(raw(), disabled=disabled)
    assert err.field == "parallel.tp"
    assert "no enabled plugin registers the dimension 'tp'" in str(err)
    assert "tp" not in dims(disabled=disabled).names


def test_disabled_tp_plugin_runs_without_tp_key():
    data = raw()
    del data["parallel"]["tp"]
    dep = make_plan(data, ("tp",)).ctx.deployment
    assert "tp" not in dict(dep.parallel)
    assert dep.size("tp") == 1


@pytest.mark.parametrize("key,value", [("tp_sp", "yes"), ("name", 5)])
def test_bad_flag_and_name_types(key, value):
    assert config_error(raw(**{key: value})).field == key


# ----------------------------------------------------------------------------------------
# Files: YAML, TOML, JSON give equal Deployments
# ----------------------------------------------------------------------------------------

RICH = {
    "name": "rich",
    "model": "llama-3.1-8b",
    "system": "h100-sxm",
    "chips": 4,
    "parallel": {"dp": 1, "tp": 2, "pp": 1, "cp": 2},
    "tp_sp": False,
    "phase": "prefill",
    "batch": 2,
    "seq_len": 8192,
    "dtypes": {"weights": {"default": "bf16", "ffn": "fp8"}, "activations": "bf16", "kv_cache": "fp8"},
    "path": "g5",
}

RICH_TOML = """\
name = "rich"
model = "llama-3.1-8b"
system = "h100-sxm"
chips = 4
tp_sp = false
phase = "prefill"
batch = 2
seq_len = 8192
path = "g5"

[parallel]
dp = 1
tp = 2
pp = 1
cp = 2

[dtypes]
activations = "bf16"
kv_cache = "fp8"

[dtypes.weights]
default = "bf16"
ffn = "fp8"
"""


def test_yaml_toml_json_give_equal_deployments(tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(RICH))
    (tmp_path / "c.yml").write_text(yaml.safe_dump(RICH))
    (tmp_path / "c.toml").write_text(RICH_TOML)
    (tmp_path / "c.json").write_text(json.dumps(RICH))
    registry, opts = dims(), options()
    deps = [Deployment.from_dict(load_config_file(tmp_path / f"c.{ext}"), registry, options=opts)
            for ext in ("yaml", "yml", "toml", "json")]
    assert deps[0] == Deployment.from_dict(RICH, registry, options=opts)
    assert all(d == deps[0] for d in deps)
    assert deps[0].dtypes.weight_dtype("ffn") == "fp8"
    assert deps[0].dtypes.weight_dtype("attention") == "bf16"


def test_deployment_round_trips_through_to_dict():
    registry, opts = dims(), options()
    dep = Deployment.from_dict(RICH, registry, options=opts)
    assert Deployment.from_dict(dep.to_dict(), registry, options=opts) == dep
    # the legacy top-level key is written back in its new place
    assert "tp_sp" not in dep.to_dict() and dep.to_dict()["plugins"]["tp"] == {"sp": False}


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config_file(tmp_path / "nope.yaml")


@pytest.mark.parametrize("name,text", [
    ("bad.yaml", "model: [unclosed\n"),
    ("bad.json", "{\"model\": }"),
    ("bad.toml", "model = \n"),
])
def test_unparsable_config_file_is_one_line(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config_file(tmp_path / name)
    assert "not valid" in str(info.value)
    assert "\n" not in str(info.value)


def test_config_file_top_level_list(tmp_path):
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config_file(tmp_path / "list.yaml")


# ----------------------------------------------------------------------------------------
# --set overrides
# ----------------------------------------------------------------------------------------


def test_overrides_nested_numbers_booleans_strings():
    data = raw()
    before = copy.deepcopy(data)
    out = apply_overrides(data, [
        "parallel.cp=2", "chips=2", "tp_sp=true", "dtypes.kv_cache=fp8", "name=my run", "seq_len=8192",
    ])
    assert data == before  # input not mutated
    assert out["parallel"] == {"dp": 1, "tp": 1, "pp": 1, "cp": 2}
    assert out["chips"] == 2 and isinstance(out["chips"], int)
    assert out["tp_sp"] is True
    assert out["dtypes"] == {"kv_cache": "fp8"}  # intermediate mapping created
    assert out["name"] == "my run"
    assert out["seq_len"] == 8192


def test_override_does_not_share_nested_objects():
    data = raw()
    out = apply_overrides(data, [])
    out["parallel"]["cp"] = 99
    assert data["parallel"]["cp"] == 1


def test_later_override_wins():
    assert apply_overrides(raw(), ["batch=2", "batch=3"])["batch"] == 3


def test_override_float_and_false():
    out = apply_overrides(raw(), ["batch=2.5", "tp_sp=false"])
    assert out["batch"] == 2.5 and out["tp_sp"] is False
    assert config_error(out).field == "batch"


def test_override_through_non_mapping_is_error():
    with pytest.raises(ConfigError) as info:
        apply_overrides(raw(), ["model.name=x"])
    assert info.value.field == "--set"
    assert "model is not a mapping" in str(info.value)


def test_override_deep_through_non_mapping_names_the_prefix():
    with pytest.raises(ConfigError, match="parallel.cp is not a mapping"):
        apply_overrides(raw(), ["parallel.cp.x=1"])


@pytest.mark.parametrize("item", ["parallel.cp", "parallel..cp=2", "=3"])
def test_malformed_override(item):
    with pytest.raises(ConfigError) as info:
        apply_overrides(raw(), [item])
    assert info.value.field == "--set"


def test_load_raw_applies_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw()))
    data = load_raw(path, ["parallel.cp=2", "chips=2"])
    assert data["parallel"]["cp"] == 2 and data["chips"] == 2
    assert load_config_file(path)["parallel"]["cp"] == 1


# ----------------------------------------------------------------------------------------
# plugins: {disable: [...]} in the configuration
# ----------------------------------------------------------------------------------------


def test_config_disable_removes_plugin():
    plan = make_plan(raw(plugins={"disable": ["cp_passkv"]}))
    assert plan.pm.get_plugin("cp_passkv") is None
    assert plan.pm.is_blocked("cp_passkv")
    assert plan.ctx.deployment.disabled_plugins == ("cp_passkv",)
    assert plan.pm.get_plugin("cp_passq") is not None


def test_config_disable_of_needed_plugin_fails_naming_it():
    plan = make_plan(raw(chips=2, parallel={"cp": 2}, plugins={"disable": ["cp_passkv"]}))
    with pytest.raises(ConfigError) as info:
        build_dag(plan)
    assert "cp_passkv" in str(info.value)
    assert "cp=2" in str(info.value)


def test_cli_and_config_disables_combine():
    plan = make_plan(raw(plugins={"disable": ["cp_passkv"]}), disabled=["cp_passq"])
    assert plan.pm.get_plugin("cp_passkv") is None and plan.pm.get_plugin("cp_passq") is None
    assert set(plan.ctx.deployment.disabled_plugins) == {"cp_passkv", "cp_passq"}


def test_config_disable_unknown_plugin_names_it():
    with pytest.raises(PluginError) as info:
        make_plan(raw(plugins={"disable": ["cp_paskv"]}))
    assert info.value.plugin == "cp_paskv"
    assert "cp_paskv" in str(info.value)
    assert "did you mean 'cp_passkv'" in str(info.value)


@pytest.mark.parametrize("plugins,field", [
    ({"enable": ["tp"]}, "plugins.enable"),
    (["cp_passkv"], "plugins"),
    ({"disable": "cp_passkv"}, "plugins.disable"),
    ({"disable": [3]}, "plugins.disable"),
])
def test_bad_plugins_section(plugins, field):
    assert config_error(raw(plugins=plugins)).field == field


# ----------------------------------------------------------------------------------------
# The same errors through the CLI
# ----------------------------------------------------------------------------------------


def _runner() -> CliRunner:
    try:
        return CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        return CliRunner()


def _no_cp(data):
    del data["parallel"]["cp"]
    return data


CLI_BAD = {
    "unknown_key": (lambda d: d | {"phse": "decode"}, "did you mean 'phase'"),
    "missing_cp": (_no_cp, "`cp: 1`"),
    "product": (lambda d: d | {"chips": 8}, "but chips = 8"),
    "bad_size": (lambda d: d | {"batch": 0}, "batch: must be a positive whole number"),
    "unknown_system": (lambda d: d | {"system": "h100-sx"}, "did you mean 'h100-sxm'"),
    "unknown_disable": (lambda d: d | {"plugins": {"disable": ["nope"]}}, "plugin 'nope'"),
    "needed_plugin_disabled": (
        lambda d: d | {"chips": 2, "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 2},
                       "plugins": {"disable": ["cp_passkv"]}},
        "cp_passkv",
    ),
}


def _assert_one_line_error(result, expected: str):
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("g5: error: ")
    assert expected in lines[0]
    assert "Traceback" not in result.output
    assert result.stdout == ""


@pytest.mark.parametrize("case", sorted(CLI_BAD))
def test_cli_run_config_errors(tmp_path, case):
    mutate, expected = CLI_BAD[case]
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump(mutate(copy.deepcopy(BASE))))
    trace = tmp_path / "out.json"
    result = _runner().invoke(main, ["run", str(cfg), "--trace", str(trace), "--json"])
    _assert_one_line_error(result, expected)
    assert not trace.exists()


def test_cli_run_missing_file(tmp_path):
    result = _runner().invoke(main, ["run", str(tmp_path / "none.yaml")])
    _assert_one_line_error(result, "not found")


def test_cli_set_override_error(tmp_path):
    cfg = tmp_path / "ok.yaml"
    cfg.write_text(yaml.safe_dump(BASE))
    result = _runner().invoke(main, ["run", str(cfg), "--set", "model.x=1", "--trace", str(tmp_path / "t.json")])
    _assert_one_line_error(result, "model is not a mapping")
    assert not (tmp_path / "t.json").exists()


def test_cli_disable_flag_unknown_plugin(tmp_path):
    cfg = tmp_path / "ok.yaml"
    cfg.write_text(yaml.safe_dump(BASE))
    result = _runner().invoke(main, ["explain", str(cfg), "--disable", "cp_paskv"])
    _assert_one_line_error(result, "did you mean 'cp_passkv'")


def test_cli_toml_and_json_configs_explain_alike(tmp_path):
    (tmp_path / "c.toml").write_text(RICH_TOML)
    (tmp_path / "c.json").write_text(json.dumps(RICH))
    out = [_runner().invoke(main, ["explain", str(tmp_path / f"c.{ext}")]) for ext in ("toml", "json")]
    assert all(r.exit_code == 0 for r in out), [r.output for r in out]
    assert out[0].stdout == out[1].stdout


def test_a_configuration_files_relative_paths_name_files_beside_it(tmp_path, monkeypatch):
    """``model: models/m.json`` in a configuration file reads the file beside the configuration
    from any working directory (``g5 run validation/configs/X.yaml`` from the repository's root
    failed: "cannot read Hugging Face config '../models/llama-2-70b.json'"); a command line's
    ``--set`` path reads from the working directory; a catalog name, an absolute path and a
    path with no file beside the configuration are kept as given."""
    import pathlib
    repo = pathlib.Path(__file__).resolve().parent.parent
    cfg_dir = tmp_path / "cfg"
    (cfg_dir / "models").mkdir(parents=True)
    (cfg_dir / "models" / "m.json").write_text((repo / "validation/models/qwq-32b.json").read_text())
    (cfg_dir / "trace.csv").write_text("arrival_s,input_tokens,output_tokens\n0,10,2\n")
    config = {**BASE, "model": "models/m.json", "system": "../elsewhere/s.yaml",
              "serving": {"workload": {"trace": "trace.csv"}}}
    (cfg_dir / "c.yaml").write_text(yaml.safe_dump(config))
    work = tmp_path / "work"
    (work / "models").mkdir(parents=True)
    (work / "models" / "m2.json").write_text((repo / "validation/models/llama-2-70b.json").read_text())
    monkeypatch.chdir(work)

    got = load_raw("../cfg/c.yaml")
    assert got["model"] == str(pathlib.Path("../cfg/models/m.json"))
    assert got["serving"]["workload"]["trace"] == str(pathlib.Path("../cfg/trace.csv"))
    assert got["system"] == "../elsewhere/s.yaml"           # nothing beside it: kept, read from here
    assert load_raw("../cfg/c.yaml", ["model=models/m2.json"])["model"] == "models/m2.json"
    assert load_raw("../cfg/c.yaml", ["model=llama-3.1-8b"])["model"] == "llama-3.1-8b"
    absolute = {**config, "model": str(cfg_dir / "models" / "m.json")}
    (cfg_dir / "a.yaml").write_text(yaml.safe_dump(absolute))
    assert load_raw(cfg_dir / "a.yaml")["model"] == absolute["model"]

    (cfg_dir / "step.yaml").write_text(yaml.safe_dump({**BASE, "model": "models/m.json"}))
    assert make_plan(load_raw("../cfg/step.yaml")).ctx.model.name == "m"   # named by its file
    result = CliRunner().invoke(main, ["run", "../cfg/step.yaml", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["deployment"]["model"] == str(pathlib.Path("../cfg/models/m.json"))
