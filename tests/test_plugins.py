"""Plugin manager: disabling, duplicate names, errors inside hooks, load failures, no global state."""
from __future__ import annotations

import importlib.metadata
from types import SimpleNamespace

import pytest

import g5core.api.plugins as plugins_mod
from g5core import ConfigError, Dimension, hookimpl
from g5core.api.dimensions import collect_dimensions
from g5core.api.errors import PluginError
from g5core.api.plugins import (
    Hooks, available_plugin_names, describe_plugins, make_plugin_manager,
)
from g5core.session.run import make_plan

BUILTIN = ("collectives", "cp", "cp_passkv", "cp_passq", "dp", "ep", "math_guard", "pp", "roofline", "tp")

RAW = {
    "model": "llama-3.1-8b", "system": "h100-sxm", "chips": 1,
    "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1},
    "phase": "prefill", "batch": 1, "seq_len": 4096,
}


class _FakeEntryPoint:
    """Stands in for an importlib.metadata.EntryPoint; counts and optionally fails load()."""

    def __init__(self, name, value, target=None, error=None):
        self.name, self.value, self.group = name, value, plugins_mod.ENTRY_POINT_GROUP
        self._target, self._error = target, error
        self.loads = 0

    def load(self):
        self.loads += 1
        if self._error is not None:
            raise self._error
        return self._target


@pytest.fixture
def broken_entry_point(monkeypatch):
    """Adds an installed plugin 'broken' whose import fails."""
    real = plugins_mod._entry_points()
    fake = _FakeEntryPoint("broken", "g5broken.plugin", error=ImportError("No module named 'g5broken'"))
    monkeypatch.setattr(plugins_mod, "_entry_points", lambda: sorted(real + [fake], key=lambda e: e.name))
    return fake


# ----------------------------------------------------------------------------------------
# Discovery and disabling
# ----------------------------------------------------------------------------------------


def test_builtins_come_from_entry_points():
    assert set(BUILTIN) <= set(available_plugin_names())
    pm = make_plugin_manager()
    for name in BUILTIN:
        plugin = pm.get_plugin(name)
        assert plugin is not None, name
        # the cp family is one package: its pass-KV and pass-Q plugins are modules of it
        family = {"cp_passkv": "g5plugins.cp.passkv", "cp_passq": "g5plugins.cp.passq"}
        assert plugin.__name__ == family.get(name, f"g5plugins.{name}")


def test_disabled_plugin_is_not_registered_but_listed():
    pm = make_plugin_manager(disabled=["tp"])
    assert pm.get_plugin("tp") is None
    assert pm.is_blocked("tp")
    infos = {p.name: p for p in describe_plugins(pm)}
    assert set(BUILTIN) <= set(infos)
    assert infos["tp"].enabled is False and infos["tp"].hooks == ()
    assert infos["pp"].enabled is True and "g5_register_dimensions" in infos["pp"].hooks


def test_disabled_plugin_is_blocked_before_loading(broken_entry_point):
    pm = make_plugin_manager(disabled=["broken"])
    assert broken_entry_point.loads == 0
    assert pm.get_plugin("broken") is None
    info = {p.name: p for p in describe_plugins(pm)}["broken"]
    assert info.enabled is False


def test_plugin_that_fails_to_import_is_named(broken_entry_point):
    with pytest.raises(PluginError) as info:
        make_plugin_manager()
    assert info.value.plugin == "broken"
    msg = str(info.value)
    assert msg.startswith("plugin 'broken': failed to load")
    assert "g5broken.plugin" in msg and "ImportError" in msg
    assert broken_entry_point.loads == 1


def test_real_entry_point_with_missing_module_is_named(monkeypatch):
    real = plugins_mod._entry_points()
    ep = importlib.metadata.EntryPoint("ghost", "g5_no_such_module_xyz", plugins_mod.ENTRY_POINT_GROUP)
    monkeypatch.setattr(plugins_mod, "_entry_points", lambda: real + [ep])
    with pytest.raises(PluginError, match="plugin 'ghost': failed to load .*ModuleNotFoundError"):
        make_plugin_manager()
    make_plugin_manager(disabled=["ghost"])  # disabling it is enough


def test_two_distributions_registering_one_plugin_name(monkeypatch):
    group = plugins_mod.ENTRY_POINT_GROUP
    eps = [importlib.metadata.EntryPoint("twin", "pkg_a.plugin", group),
           importlib.metadata.EntryPoint("twin", "pkg_b.plugin", group)]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: eps)
    with pytest.raises(PluginError) as info:
        make_plugin_manager()
    assert info.value.plugin == "twin"
    assert "pkg_a.plugin" in str(info.value) and "pkg_b.plugin" in str(info.value)


def test_disabling_unknown_name_is_error_naming_it():
    with pytest.raises(PluginError) as info:
        make_plugin_manager(disabled=["not_installed"])
    assert info.value.plugin == "not_installed"
    assert "unknown plugin" in str(info.value)
    for name in BUILTIN:
        assert name in str(info.value)


def test_disabling_extra_plugin_by_name():
    extra = SimpleNamespace()
    pm = make_plugin_manager(disabled=["mine"], extra_plugins=[("mine", extra)])
    assert pm.get_plugin("mine") is None


def test_each_call_returns_a_fresh_manager():
    class Extra:
        @hookimpl
        def g5_validate_deployment(self, deployment):
            return None

    a = make_plugin_manager(disabled=["cp_passkv"], extra_plugins=[("extra", Extra())])
    b = make_plugin_manager()
    assert a is not b
    assert a.get_plugin("extra") is not None and b.get_plugin("extra") is None
    assert a.get_plugin("cp_passkv") is None and b.get_plugin("cp_passkv") is not None
    assert not b.is_blocked("cp_passkv")
    a.unregister(name="tp")
    assert b.get_plugin("tp") is not None
    assert make_plugin_manager().get_plugin("tp") is not None


# ----------------------------------------------------------------------------------------
# Registration errors
# ----------------------------------------------------------------------------------------


def _dim_plugin(dim: Dimension):
    @hookimpl
    def g5_register_dimensions(register):
        register(dim)

    return SimpleNamespace(g5_register_dimensions=g5_register_dimensions)


def test_duplicate_dimension_names_both_plugins():
    pm = make_plugin_manager(extra_plugins=[("rival_tp", _dim_plugin(Dimension(name="tp", factor=True, rank_order=31)))])
    with pytest.raises(PluginError) as info:
        collect_dimensions(Hooks(pm))
    msg = str(info.value)
    assert "'tp'" in msg and "'rival_tp'" in msg
    assert "dimension 'tp' is already registered" in msg


def test_duplicate_dimension_between_two_extra_plugins():
    pm = make_plugin_manager(load_entry_points=False, extra_plugins=[
        ("first", _dim_plugin(Dimension(name="sp", factor=True))),
        ("second", _dim_plugin(Dimension(name="sp", factor=True))),
    ])
    with pytest.raises(PluginError) as info:
        collect_dimensions(Hooks(pm))
    assert "'first'" in str(info.value) and "'second'" in str(info.value)


def test_duplicate_dimension_surfaces_through_make_plan():
    with pytest.raises(PluginError, match="rival_cp"):
        make_plan(RAW, extra_plugins=[("rival_cp", _dim_plugin(Dimension(name="cp", factor=True, rank_order=21)))])


def test_new_dimension_from_plugin_becomes_a_parallel_key():
    plan = make_plan(dict(RAW, parallel={**RAW["parallel"], "xsp": 1}),
                     extra_plugins=[("sp_plugin", _dim_plugin(Dimension(name="xsp", factor=True, rank_order=25)))])
    assert plan.ctx.deployment.size("xsp") == 1
    assert plan.ctx.dims.get("xsp").owner == "sp_plugin"


def test_registering_a_non_dimension_is_error():
    @hookimpl
    def g5_register_dimensions(register):
        register("tp2")

    pm = make_plugin_manager(extra_plugins=[("junk", SimpleNamespace(g5_register_dimensions=g5_register_dimensions))])
    with pytest.raises(PluginError, match="plugin 'junk'.*expected a Dimension"):
        collect_dimensions(Hooks(pm))


def test_two_plugins_under_one_name():
    with pytest.raises(PluginError) as info:
        make_plugin_manager(extra_plugins=[("same", SimpleNamespace()), ("same", SimpleNamespace())])
    assert info.value.plugin == "same"
    assert "already registered" in str(info.value)


def test_extra_plugin_named_like_a_builtin():
    with pytest.raises(PluginError) as info:
        make_plugin_manager(extra_plugins=[("tp", SimpleNamespace())])
    assert info.value.plugin == "tp"


def test_hookimpl_with_wrong_arguments_is_named_in_one_line():
    @hookimpl
    def g5_validate_deployment(deployment, colour):
        return None

    with pytest.raises(PluginError) as info:
        make_plugin_manager(extra_plugins=[("badargs", SimpleNamespace(g5_validate_deployment=g5_validate_deployment))])
    assert info.value.plugin == "badargs"
    assert "colour" in str(info.value)
    assert "\n" not in str(info.value)  # G5 errors are one line (the CLI prints exactly one)


def test_hookimpl_for_unknown_hook_is_named():
    @hookimpl
    def g5_validate_deploymnt(deployment):
        return None

    with pytest.raises(PluginError) as info:
        make_plugin_manager(extra_plugins=[("typo", SimpleNamespace(g5_validate_deploymnt=g5_validate_deploymnt))])
    assert info.value.plugin == "typo"
    assert "g5_validate_deploymnt" in str(info.value)


# ----------------------------------------------------------------------------------------
# Errors inside hooks
# ----------------------------------------------------------------------------------------


class _Boom:
    @hookimpl
    def g5_validate_deployment(self, deployment, model, system):
        raise RuntimeError("kaboom")


def test_exception_inside_hook_names_the_plugin():
    with pytest.raises(PluginError) as info:
        make_plan(RAW, extra_plugins=[("boom", _Boom())])
    assert info.value.plugin == "boom"
    msg = str(info.value)
    assert msg.startswith("plugin 'boom': raised RuntimeError in g5_validate_deployment")
    assert "kaboom" in msg
    assert isinstance(info.value.__cause__, RuntimeError)


def test_config_error_from_plugin_passes_through_unwrapped():
    class Strict:
        @hookimpl
        def g5_validate_deployment(self, deployment):
            if deployment.batch < 2:
                raise ConfigError("batch", "strict plugin wants batch >= 2")

    with pytest.raises(ConfigError) as info:
        make_plan(RAW, extra_plugins=[("strict", Strict())])
    assert str(info.value) == "batch: strict plugin wants batch >= 2"


def test_disabling_the_raising_plugin_fixes_the_run():
    plan = make_plan(RAW, disabled=["boom"], extra_plugins=[("boom", _Boom())])
    assert plan.pm.get_plugin("boom") is None


def test_exception_inside_register_dimensions_names_the_plugin():
    @hookimpl
    def g5_register_dimensions(register):
        raise KeyError("oops")

    pm = make_plugin_manager(extra_plugins=[("dimboom", SimpleNamespace(g5_register_dimensions=g5_register_dimensions))])
    with pytest.raises(PluginError, match="plugin 'dimboom': raised KeyError in g5_register_dimensions"):
        collect_dimensions(Hooks(pm))


def test_call_each_returns_plugin_names_and_skips_none():
    class A:
        @hookimpl
        def g5_shard_factors(self, deployment, model):
            return {"tokens": 1}

    class B:
        @hookimpl
        def g5_shard_factors(self, deployment, model):
            return None

    pm = make_plugin_manager(load_entry_points=False, extra_plugins=[("a", A()), ("b", B())])
    answers = Hooks(pm).call_each("g5_shard_factors", deployment=None, model=None)
    assert answers == [("a", {"tokens": 1})]


def test_the_entry_points_are_scanned_once_per_process_and_afresh_when_replaced(monkeypatch):
    calls = []
    real = importlib.metadata.entry_points

    def counting(group=None):
        calls.append(group)
        return real(group=group)
    monkeypatch.setattr(importlib.metadata, "entry_points", counting)
    first = plugins_mod.available_plugin_names()
    make_plugin_manager()
    make_plugin_manager(disabled=[first[0]])
    assert len(calls) == 1 and plugins_mod.available_plugin_names() == first
    group = plugins_mod.ENTRY_POINT_GROUP
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None: [importlib.metadata.EntryPoint("solo", "g5_solo_xyz", group)])
    assert plugins_mod.available_plugin_names() == ("solo",)
