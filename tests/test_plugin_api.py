"""The plugin API a third party builds on: options, shard axes, hook calls, public names."""
from __future__ import annotations

import ast
import pathlib
import types

import pytest

import g5core
from g5core import ConfigError, Dimension, PluginError, PluginOption, hookimpl
from g5core.api.plugins import Hooks, make_plugin_manager
from g5core.session.run import make_plan

ROOT = pathlib.Path(__file__).resolve().parents[1]
RAW = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 2, "parallel": {"dp": 1, "pp": 1, "tp": 2, "cp": 1},
       "phase": "prefill", "batch": 1, "seq_len": 1024}


def raw(**kw):
    return dict(RAW, **kw)


# ----------------------------------------------------------------------------------- options


def test_tp_sp_is_a_tp_plugin_option_and_the_old_key_means_the_same():
    new = make_plan(raw(plugins={"tp": {"sp": True}})).ctx
    old = make_plan(raw(tp_sp=True)).ctx
    assert new.deployment == old.deployment
    assert new.deployment.option("tp", "sp") is True
    assert new.shape.factor("norm_tokens") == 2
    assert make_plan(raw()).ctx.deployment.option("tp", "sp") is False


def test_both_spellings_must_agree():
    make_plan(raw(tp_sp=True, plugins={"tp": {"sp": True}}))
    with pytest.raises(ConfigError) as info:
        make_plan(raw(tp_sp=False, plugins={"tp": {"sp": True}}))
    assert info.value.field == "tp_sp" and "keep only plugins.tp.sp" in str(info.value)


@pytest.mark.parametrize("plugins,field,text", [
    ({"tp": {"spp": True}}, "plugins.tp.spp", "did you mean 'sp'"),
    ({"tp": {"sp": "yes"}}, "plugins.tp.sp", "must be true or false"),
    ({"tp": True}, "plugins.tp", "must be a mapping"),
    ({"tpp": {"sp": True}}, "plugins.tpp", "did you mean 'tp'"),
])
def test_bad_plugin_options_are_one_line_errors_naming_the_field(plugins, field, text):
    with pytest.raises(ConfigError) as info:
        make_plan(raw(plugins=plugins))
    assert info.value.field == field and text in str(info.value) and "\n" not in str(info.value)


def test_options_of_a_disabled_plugin_are_an_error_not_ignored():
    with pytest.raises(ConfigError, match="plugin 'tp' is disabled or declares no options; remove plugins.tp"):
        make_plan(raw(parallel={"dp": 1, "pp": 1, "cp": 1}, chips=1, plugins={"tp": {"sp": True}, "disable": ["tp"]}))
    with pytest.raises(ConfigError, match="tp_sp: unknown key"):
        make_plan(raw(parallel={"dp": 1, "pp": 1, "cp": 1}, chips=1, tp_sp=True, plugins={"disable": ["tp"]}))


def _option_plugin(**option):
    @hookimpl
    def g5_register_options(register):
        register(PluginOption(**option))

    return types.SimpleNamespace(g5_register_options=g5_register_options)


def test_a_third_party_choice_option_is_validated_and_defaults():
    extra = [("mine", _option_plugin(name="mode", default="fast", doc="how", kind="choice", choices=("fast", "exact")))]
    assert make_plan(raw(), extra_plugins=extra).ctx.deployment.option("mine", "mode") == "fast"
    dep = make_plan(raw(plugins={"mine": {"mode": "exact"}}), extra_plugins=extra).ctx.deployment
    assert dep.option("mine", "mode") == "exact"
    assert dep.to_dict()["plugins"]["mine"] == {"mode": "exact"}
    with pytest.raises(ConfigError, match=r"plugins.mine.mode: must be one of fast, exact, got 'exakt' \(did you mean"):
        make_plan(raw(plugins={"mine": {"mode": "exakt"}}), extra_plugins=extra)


def test_bad_option_declarations_name_the_plugin():
    with pytest.raises(PluginError, match="plugin 'mine'"):
        make_plan(raw(), extra_plugins=[("mine", _option_plugin(name="n", default=0, doc="x", kind="int"))])
    with pytest.raises(PluginError, match=r"legacy key 'tp_sp' is already claimed by plugin '(tp|mine)'"):
        make_plan(raw(), extra_plugins=[("mine", _option_plugin(name="sp", default=False, doc="x", legacy_key="tp_sp"))])


# -------------------------------------------------------------------------------- shard axes


def _axis_plugin(axis="widgets", factor=4):
    @hookimpl
    def g5_register_shard_axes(register):
        register(axis, "test axis")

    @hookimpl
    def g5_shard_factors(deployment, model):
        return {axis: factor}

    return types.SimpleNamespace(g5_register_shard_axes=g5_register_shard_axes, g5_shard_factors=g5_shard_factors)


def test_a_plugin_axis_reaches_the_local_shape_and_other_plugins_may_divide_it():
    def other():
        @hookimpl
        def g5_shard_factors(deployment, model):
            return {"widgets": 3}
        return types.SimpleNamespace(g5_shard_factors=g5_shard_factors)

    shape = make_plan(raw(), extra_plugins=[("axes", _axis_plugin()), ("other", other())]).ctx.shape
    assert shape.factor("widgets") == 12
    assert shape.factor("q_heads") == 2


def test_an_unregistered_axis_and_a_core_axis_are_refused():
    with pytest.raises(PluginError, match="unknown shard axis 'widgets'"):
        make_plan(raw(), extra_plugins=[("other", types.SimpleNamespace(
            g5_shard_factors=hookimpl(lambda deployment, model: {"widgets": 2})))])
    with pytest.raises(PluginError, match="'tokens' is one of the core's axes"):
        make_plan(raw(), extra_plugins=[("axes", _axis_plugin(axis="tokens"))])


def test_kv_cache_heads_divides_the_stored_cache_only():
    def split():
        return types.SimpleNamespace(g5_shard_factors=hookimpl(lambda deployment, model: {"kv_cache_heads": 2}))

    from g5core.sim.memory import memory_report
    base = make_plan(raw())
    more = make_plan(raw(), extra_plugins=[("split", split())])
    kv = {t.name: t for t in memory_report(base.ctx).terms}["kv_cache"].on(0)
    assert {t.name: t for t in memory_report(more.ctx).terms}["kv_cache"].on(0) == kv / 2
    assert {t.name: t for t in memory_report(more.ctx).terms}["weights"] == \
        {t.name: t for t in memory_report(base.ctx).terms}["weights"]


# ------------------------------------------------------------------------------- hook calls


@pytest.mark.parametrize("marker", [dict(wrapper=True), dict(hookwrapper=True)])
def test_wrappers_are_refused_at_registration(marker):
    @hookimpl(**marker)
    def g5_shard_factors(deployment, model):
        yield

    with pytest.raises(PluginError) as info:
        make_plugin_manager(extra_plugins=[("wrapping", types.SimpleNamespace(g5_shard_factors=g5_shard_factors))])
    assert info.value.plugin == "wrapping" and "g5_shard_factors as a wrapper" in str(info.value)


def test_tryfirst_sets_the_order_of_implementations():
    @hookimpl(tryfirst=True)
    def g5_register_dimensions(register):
        register(Dimension(name="zz", factor=True, rank_order=5, default=1, doc="test"))

    hooks = Hooks(make_plugin_manager(extra_plugins=[("early", types.SimpleNamespace(
        g5_register_dimensions=g5_register_dimensions))]))
    assert hooks.implementations("g5_register_dimensions")[0].plugin_name == "early"
    assert [i.plugin_name for i in hooks.plugin_implementations("g5_register_dimensions", "tp")] == ["tp"]
    seen = []
    hooks.call_registration("g5_register_dimensions", lambda plugin, dim: seen.append((plugin, dim.name)))
    assert seen[0] == ("early", "zz") and ("tp", "tp") in seen


def test_an_exception_inside_a_plugin_names_it():
    def boom(deployment, model):
        raise KeyError("x")

    with pytest.raises(PluginError, match="plugin 'boom': raised KeyError in g5_shard_factors"):
        make_plan(raw(), extra_plugins=[("boom", types.SimpleNamespace(g5_shard_factors=hookimpl(boom)))])


# ------------------------------------------------------------------------------ public names


def test_the_public_api_is_importable_from_g5core():
    for name in g5core.__all__:
        assert getattr(g5core, name) is not None
    for name in ("Work", "attention_work", "attention_dims", "PluginOption", "Hooks", "describe_plugins"):
        assert name in g5core.__all__


def _private_imports(path: pathlib.Path) -> list[str]:
    bad = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("g5core."):
            bad.append(f"{path.name}: from {node.module}")
        if isinstance(node, ast.Import):
            bad += [f"{path.name}: import {a.name}" for a in node.names if a.name.startswith("g5core.")]
        if isinstance(node, ast.Attribute) and node.attr in ("_impls", "_call"):
            bad.append(f"{path.name}: .{node.attr}")
    return bad


def test_every_plugin_imports_only_the_public_api():
    """Built-in (plugins/) and third-party (contrib/) plugins alike import ``g5core`` only,
    never one of its submodules (their own tests may)."""
    files = sorted((ROOT / "plugins").rglob("*.py")) + sorted((ROOT / "contrib").rglob("*.py"))
    assert len([f for f in files if f.name == "__init__.py"]) >= 10
    assert [b for f in files if "tests" not in f.parts for b in _private_imports(f)] == []


def test_the_import_check_catches_a_submodule_import(tmp_path):
    plugin = tmp_path / "plugin.py"
    plugin.write_text("from g5core import hookimpl\nfrom g5core.lower.layers import expert_work\n"
                      "def f():\n    import g5core.sim.engine\n")
    assert _private_imports(plugin) == ["plugin.py: from g5core.lower.layers", "plugin.py: import g5core.sim.engine"]


def test_the_core_uses_no_private_hook_names_outside_plugins_py():
    # collective.py is being rewritten (issue 8) and still uses the kept aliases
    offenders = [b for f in sorted((ROOT / "g5core").glob("*.py")) if f.name not in ("plugins.py", "collective.py")
                 for b in _private_imports(f) if b.endswith(("._impls", "._call"))]
    assert offenders == []


def test_the_contracts_type_names_are_exported():
    """Every type the hook specifications and the build context name (strings: api/ imports no
    implementation module) resolves among ``g5core``'s public names."""
    import typing

    from g5core.api import context, hookspecs
    from g5core.testing import hook_names

    public = {name: getattr(g5core, name) for name in g5core.__all__}
    for hook in hook_names():
        typing.get_type_hints(getattr(hookspecs, hook), globalns={**vars(hookspecs), **public})
    typing.get_type_hints(context.BuildContext, globalns={**vars(context), **public})
    with pytest.raises(NameError):
        typing.get_type_hints(getattr(hookspecs, "g5_topology"), globalns=vars(hookspecs))
