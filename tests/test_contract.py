"""The plugin contract suite (g5core.testing) run against every built-in plugin, and shown to fail.

Each installed plugin runs every check that applies to it (the general checks plus those of
each hook it implements) on small configurations (two-layer synthetic models) chosen so
the plugin is active. Deliberately broken third-party plugins, passed as extra plugins,
show that each check can fail.
"""
from __future__ import annotations

import itertools
import json

import pytest
import yaml

from g5core import Fragment, Lowering, MemoryTerm, hookimpl
from g5core import testing as contract
from g5core.api.plugins import available_plugin_names
from plugin_sets import BUILTIN
from g5core.inputs.systems import get_system
from g5core.testing import (
    CHECKS, ContractError, applicable_checks, check_hook_coverage, check_plugin, hook_names, plugin_checks, plugin_contributions,
)

TINY_DENSE = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
              "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 1000}
TINY_MOE = {"model_type": "mixtral", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
            "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 1000, "num_local_experts": 4,
            "num_experts_per_tok": 2}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    out = {}
    for name, data in (("tiny-dense", TINY_DENSE), ("tiny-moe", TINY_MOE)):
        p = d / f"{name}.json"
        p.write_text(json.dumps(data))
        out[name] = str(p)
    # a system with a measured profile (the measured plugin answers only there)
    system = dict(get_system("h100-sxm").to_dict(), profile={"source": "aiconfigurator", "gpu": "h100_sxm",
                                                              "framework": "trtllm"})
    p = d / "h100-aic.yaml"
    p.write_text(yaml.safe_dump(system))
    out["h100-aic"] = str(p)
    return out


def _cfg(models, model="tiny-dense", phase="prefill", tp_sp=False, path="g5", system="h100-sxm", **par):
    p = {"dp": 1, "tp": 1, "pp": 1, "cp": 1}
    p.update(par)
    chips = p["dp"] * p["tp"] * p["pp"] * p["cp"]
    raw = {"model": models[model], "system": models.get(system, system), "chips": chips, "parallel": p, "phase": phase,
           "batch": 2, "seq_len": 256, "path": path}
    if tp_sp:
        raw["tp_sp"] = True
    return raw


def _configs(models) -> dict[str, list[dict]]:
    """Configurations that make each built-in plugin active (every hook it implements contributes)."""
    c = lambda **kw: _cfg(models, **kw)  # noqa: E731
    return {
        "dp": [c(dp=2)],
        "pp": [c(pp=2), c(pp=2, tp=2, phase="decode"),
               dict(c(pp=2, phase="decode"), plugins={"pp": {"microbatches": 2}}),
               dict(c(pp=2), plugins={"pp": {"microbatches": 2}})],
        "tp": [c(tp=2), c(tp=2, tp_sp=True), c(model="tiny-moe", tp=2, phase="decode")],
        "ep": [c(model="tiny-moe", tp=2, ep=2), c(model="tiny-moe", dp=2, ep=2, phase="decode"),
               {**c(model="tiny-moe", dp=2, ep=2), "plugins": {"ep": {"two_batch_overlap": True, "kernel": "flat"}}}],
        "cp": [c(cp=2), c(cp=2, phase="decode")],
        "cp_passkv": [c(cp=2), c(cp=2, tp=2)],
        "cp_passq": [c(cp=2, phase="decode"), c(cp=2, tp=2, phase="decode"),
                     dict(c(cp=2, phase="decode"), plugins={"cp_passq": {"form": "ring"}})],
        "math_guard": [c(path="math"), c(path="math", tp=2, phase="decode")],
        "collectives": [c(tp=2), c(pp=2), c(model="tiny-moe", tp=2, ep=2), c(cp=2), c(cp=2, phase="decode"),
                        c(tp=2, tp_sp=True)],
        "roofline": [c(), c(model="tiny-moe", phase="decode")],
        "measured": [c(system="h100-aic"), c(system="h100-aic", model="tiny-moe", phase="decode")],
    }


def _configs_for(models, plugin):
    table = _configs(models)
    if plugin in table:
        return table[plugin]
    # a plugin installed later (third-party): every configuration; if none makes it active,
    # check_configs_exercise_plugin says so and this table needs an entry for it
    return [raw for raws in table.values() for raw in raws]


# The built-in plugins (package g5plugins); a third-party plugin runs this suite in its own
# tests with configurations that make it active (contrib/g5-ulysses/tests does).
CASES = [(p, name) for p in BUILTIN for name in applicable_checks(p)]


def test_every_builtin_plugin_is_covered():
    names = set(available_plugin_names())
    assert {"dp", "pp", "tp", "ep", "cp", "cp_passkv", "cp_passq", "math_guard", "collectives",
            "roofline"} <= names
    for p in names:
        assert {"check_configs_exercise_plugin", "check_disabled_contributes_nothing",
                "check_deterministic"} <= set(applicable_checks(p))


@pytest.mark.parametrize("plugin, check", CASES, ids=[f"{p}-{c}" for p, c in CASES])
def test_builtin_plugin_contract(models, plugin, check):
    CHECKS[check](plugin, _configs_for(models, plugin))


def test_applicable_checks_follow_implemented_hooks():
    assert "check_fragments" in applicable_checks("tp")
    assert "check_comm_cost_monotone" in applicable_checks("collectives")
    assert "check_comm_cost_monotone" not in applicable_checks("tp")
    assert "check_compute_latency" in applicable_checks("roofline")
    assert "check_placement" in applicable_checks("pp")
    assert "check_memory_terms" in applicable_checks("ep")
    assert "check_fragments" not in applicable_checks("dp")


def test_configs_really_activate_the_plugins(models):
    # the EP plugin claims the MoE op and adds its buffers; TP claims the reductions
    ep = plugin_contributions("ep", _configs(models)["ep"][0])
    assert ep["g5_expand_op"] == 2 and ep["g5_memory_terms"] == 1 and ep["g5_register_dimensions"] == 1
    tp = plugin_contributions("tp", _configs(models)["tp"][0])
    # attn_out_reduce and ffn_out_reduce in each of 2 layers, and the logits' all-gather
    assert tp["g5_expand_op"] == 2 * 2 + 1
    pp = plugin_contributions("pp", _configs(models)["pp"][0])
    assert pp["g5_layer_chips"] == 2 + 2  # embedding, 2 layers, head: each answered
    # with tp=1 the TP plugin claims nothing
    assert plugin_contributions("tp", _cfg(models))["g5_expand_op"] == 0


def test_plugin_checks_bind_and_check_plugin_runs_all(models):
    pairs = plugin_checks("tp", _configs(models)["tp"])
    names = [n for n, _ in pairs]
    assert names == list(applicable_checks("tp"))
    for _, check in pairs:
        check()
    assert check_plugin("tp", _configs(models)["tp"]) == names


def test_unknown_plugin_name_is_refused():
    with pytest.raises(ValueError, match="no plugin named 'nope'"):
        applicable_checks("nope")


# ------------------------------------------------------------------------------------------
# The meta-check
# ------------------------------------------------------------------------------------------


def test_every_hook_has_a_docstring_and_a_contract_check():
    mapping = check_hook_coverage()
    assert set(mapping) == set(hook_names())
    assert {"g5_expand_op", "g5_memory_terms", "g5_register_primitives", "g5_compute_latency"} <= set(mapping)
    assert all(mapping[h] for h in mapping)
    assert all(n in CHECKS for checks in mapping.values() for n in checks)


def test_meta_check_fails_for_a_hook_without_a_check(monkeypatch):
    monkeypatch.delitem(contract.HOOK_CHECKS, "g5_memory_terms")
    with pytest.raises(AssertionError, match="g5_memory_terms has no contract check"):
        check_hook_coverage()


def test_meta_check_fails_for_an_undocumented_check(monkeypatch):
    def check_undocumented(plugin, configs, extra_plugins=()):
        pass

    monkeypatch.setitem(contract.CHECKS, "check_undocumented", check_undocumented)
    with pytest.raises(AssertionError, match="check_undocumented has no docstring"):
        check_hook_coverage()


# ------------------------------------------------------------------------------------------
# Broken third-party plugins: each check can fail
# ------------------------------------------------------------------------------------------


class _ClaimsFfnReduce:
    """Base of the broken plugins: claims ``ffn_out_reduce`` (nothing else does at tp=1)."""

    name = "bad"

    def fragment(self, ctx, lop):
        raise NotImplementedError

    @hookimpl
    def g5_expand_op(self, ctx, lop):
        if lop.kind != "ffn_out_reduce":
            return None
        return self.fragment(ctx, lop)


def _two_ops(ctx, lop, owner="bad"):
    work = ctx.work("ffn")
    return (ctx.compute_op(lop, 0, work, owner=owner, part="a"),
            ctx.compute_op(lop, 0, work, owner=owner, part="b"))


class _Cyclic(_ClaimsFfnReduce):
    def fragment(self, ctx, lop):
        a, b = _two_ops(ctx, lop)
        return Fragment(ops=(a, b), edges=((a.key, b.key), (b.key, a.key)), heads={0: (a.key,)}, tails={0: (b.key,)})


class _ForeignEdge(_ClaimsFfnReduce):
    def fragment(self, ctx, lop):
        a, b = _two_ops(ctx, lop)
        return Fragment(ops=(a, b), edges=((a.key, "L000.ffn@c0"),), heads={0: (a.key,)}, tails={0: (b.key,)})


class _WrongOwner(_ClaimsFfnReduce):
    def fragment(self, ctx, lop):
        a, b = _two_ops(ctx, lop, owner="tp")
        return Fragment(ops=(a, b), edges=((a.key, b.key),), heads={0: (a.key,)}, tails={0: (b.key,)})


class _WrongPrefix(_ClaimsFfnReduce):
    def fragment(self, ctx, lop):
        import attrs

        a, b = _two_ops(ctx, lop)
        a = attrs.evolve(a, key=a.key.replace(lop.prefix, lop.prefix + "x"))
        return Fragment(ops=(a, b), edges=((a.key, b.key),), heads={0: (a.key,)}, tails={0: (b.key,)})


class _HeadOnWrongChip(_ClaimsFfnReduce):
    def fragment(self, ctx, lop):
        a, b = _two_ops(ctx, lop)
        return Fragment(ops=(a, b), edges=((a.key, b.key),), heads={0: (a.key,), 1: (a.key,)}, tails={0: (b.key,)})


class _Counter(_ClaimsFfnReduce):
    """Nondeterministic: op keys from a process-wide counter."""

    _n = itertools.count()

    def fragment(self, ctx, lop):
        work = ctx.work("ffn")
        a = ctx.compute_op(lop, 0, work, owner="bad", part=f"n{next(self._n)}")
        return Fragment.single_chip_ops([a])


class _NegativeMemory:
    @hookimpl
    def g5_memory_terms(self, ctx):
        return [MemoryTerm(name="bad_buffer", category="workspace", bytes_per_chip={0: -1.0})]


def _shrinking_lowering(group, nbytes, topo):
    # more bytes, fewer bytes on the wire: the cost falls as the payload grows
    return Lowering(flows=((group[0], group[1], 1e9 / (1.0 + nbytes)),), latency_s=0.0)


class _ShrinkingPrimitive:
    @hookimpl
    def g5_register_primitives(self, register):
        register("bad_shrink", _shrinking_lowering)


class _FasterWithMoreWork:
    @hookimpl(tryfirst=True)
    def g5_compute_latency(self, op, system, deployment):
        return 1.0 / (1.0 + op.flops + op.hbm_bytes)


class _BadShardAxis:
    @hookimpl
    def g5_shard_factors(self, deployment, model):
        return {"tokenz": 2}


class _ReturnsFromGuard:
    @hookimpl
    def g5_validate_deployment(self, deployment, model, system):
        return "looks fine"


class _MultiLineObjection:
    @hookimpl
    def g5_require_owner(self, ctx, lop):
        return "line one\nline two" if lop.kind == "lm_head" else None


class _OutOfRangeLayerChips:
    @hookimpl
    def g5_layer_chips(self, ctx, layer):
        return [0, 99]


BROKEN = [
    ("cyclic fragment", _Cyclic(), "check_fragments", "cycle"),
    ("edge to a foreign op", _ForeignEdge(), "check_fragments", "outside its fragment"),
    ("owner is another plugin", _WrongOwner(), "check_fragments", "owner 'tp'"),
    ("key outside the prefix", _WrongPrefix(), "check_fragments", "does not start with its logical op's prefix"),
    ("head on a chip the op does not run on", _HeadOnWrongChip(), "check_fragments", "does not run on"),
    ("nondeterministic keys", _Counter(), "check_deterministic", "differs between two builds"),
    ("negative memory", _NegativeMemory(), "check_memory_terms", "-1.0 bytes"),
    ("cost falls with bytes", _ShrinkingPrimitive(), "check_comm_cost_monotone", "not increasing"),
    ("faster with more work", _FasterWithMoreWork(), "check_compute_latency", "twice the work"),
    ("unknown shard axis", _BadShardAxis(), "check_shard_factors", "unknown shard axis"),
    ("guard returns a value", _ReturnsFromGuard(), "check_validate_deployment", "looks fine"),
    ("multi-line objection", _MultiLineObjection(), "check_require_owner", "one-line"),
    ("layer on a chip out of range", _OutOfRangeLayerChips(), "check_placement", "outside 0..1"),
]


@pytest.mark.parametrize("label, plugin, check, message", BROKEN, ids=[b[0] for b in BROKEN])
def test_each_check_catches_a_broken_plugin(models, label, plugin, check, message):
    extra = (("bad", plugin),)
    raws = [_cfg(models, dp=2)]
    assert check in applicable_checks("bad", extra)
    with pytest.raises(ContractError, match=message) as info:
        contract.CHECKS[check]("bad", raws, extra)
    assert info.value.plugin == "bad" and info.value.check == check
    # check_plugin reports the same breach among all checks
    with pytest.raises(ContractError, match=check):
        check_plugin("bad", raws, extra)


def test_unexercised_plugin_is_reported(models):
    # the TP plugin on a tp=1 configuration contributes no fragment: the suite refuses to
    # call that a pass
    with pytest.raises(ContractError, match="g5_expand_op"):
        contract.check_configs_exercise_plugin("tp", [_cfg(models)])


def test_a_well_behaved_third_party_plugin_passes(models):
    class Good(_ClaimsFfnReduce):
        def fragment(self, ctx, lop):
            a, b = _two_ops(ctx, lop, owner="good")
            return Fragment(ops=(a, b), edges=((a.key, b.key),), heads={0: (a.key,)}, tails={0: (b.key,)})

    ran = check_plugin("good", [_cfg(models)], (("good", Good()),))
    assert "check_fragments" in ran


def test_disabled_plugin_needed_by_a_config_is_a_clear_error_not_a_pass(models):
    from g5core.lower.builder import build_dag, plan_deployment
    from g5core.api.errors import ConfigError
    from g5core.api.plugins import make_plugin_manager

    # disabling collectives on a tp=2 configuration fails the build with a G5Error (no
    # primitive lowers the all-reduce): the check accepts that as the contract's clear error
    contract.check_disabled_contributes_nothing("collectives", [_cfg(models, tp=2), _cfg(models)])
    # pass-KV disabled: cp=1 builds with no op of it; cp=2 prefill is refused, naming it
    dag = build_dag(plan_deployment(_cfg(models), make_plugin_manager(disabled=["cp_passkv"])))
    assert dag.ops and not any(op.owner == "cp_passkv" for op in dag.ops)
    with pytest.raises(ConfigError, match="cp_passkv"):
        build_dag(plan_deployment(_cfg(models, cp=2), make_plugin_manager(disabled=["cp_passkv"])))


# ------------------------------------------------------------------------------------------
# Every check also runs on a mixed step
# ------------------------------------------------------------------------------------------


def test_each_configuration_is_also_checked_on_a_step(models):
    raws = [_cfg(models), _cfg(models, cp=2), _cfg(models, cp=2, phase="decode")]
    configs = contract._as_configs(raws)
    steps = [c["step"] for c in configs if "step" in c]
    assert configs[:3] == tuple(raws) and len(steps) == 4
    assert steps[0] == [{"new_tokens": 256, "cached_tokens": 256, "count": 2},       # cp = 1: a mixed step
                        {"new_tokens": 1, "cached_tokens": 255, "count": 512}]
    assert steps[1] == [{"new_tokens": 256, "cached_tokens": 256, "count": 2}]        # cp > 1: partial prefill
    assert [g["cached_tokens"] for g in steps[2]] == [255, 511]                     # decode at two contexts
    assert steps[3] == [{"new_tokens": 3, "cached_tokens": 255, "count": 2, "verify": True}]  # speculative verification
    assert contract._as_configs(configs) == configs                                  # no variant of a variant


def test_a_plugin_broken_only_on_a_mixed_step_is_caught(models):
    class BadOnMixedSteps:
        @hookimpl
        def g5_memory_terms(self, ctx):
            nbytes = -1.0 if ctx.deployment.phase == "mixed" else 1.0
            return [MemoryTerm(name="scratch", category="workspace", bytes_per_chip={0: nbytes})]

    extra = (("bad", BadOnMixedSteps()),)
    with pytest.raises(ContractError, match=r"step .* has -1.0 bytes"):
        contract.check_memory_terms("bad", [_cfg(models)], extra)
