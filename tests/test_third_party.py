"""A third-party plugin adds a parallel dimension without touching the core (Ulysses' `sp`).

The real Ulysses plugin (contrib/g5-ulysses) is disabled here when installed: this one stands in for it."""
from __future__ import annotations

import types

import pytest

from g5core import ConfigError, DagError, Dimension, hookimpl
from g5core.present.render import render_explain
from g5core.session.run import make_plan, run
from plugin_sets import THIRD_PARTY


def _sp_plugin():
    @hookimpl
    def g5_register_dimensions(register):
        register(Dimension(name="sp", factor=True, rank_order=25, doc="sequence parallel (test)"))

    @hookimpl
    def g5_shard_factors(deployment, model):
        sp = deployment.size("sp")
        return {"tokens": sp} if sp > 1 and deployment.phase == "prefill" else None

    return types.SimpleNamespace(g5_register_dimensions=g5_register_dimensions, g5_shard_factors=g5_shard_factors)


RAW = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 8,
       "parallel": {"dp": 1, "tp": 2, "pp": 1, "cp": 1, "sp": 4}, "phase": "decode", "batch": 4, "seq_len": 4096}


def test_a_plugin_dimension_joins_the_chip_product_and_the_rank_order():
    plan = make_plan(RAW, extra_plugins=[("ulysses_like", _sp_plugin())], disabled=THIRD_PARTY)
    rm = plan.ctx.rankmap
    assert rm.factor_names == ("dp", "pp", "cp", "sp", "tp")
    assert rm.groups("sp")[0] == (0, 2, 4, 6)       # tp innermost, then sp
    assert rm.groups("tp")[0] == (0, 1)
    assert "sp groups: 2 of 4" in render_explain(plan)


def test_the_product_counts_the_new_dimension():
    with pytest.raises(ConfigError, match=r"sp=4 x tp=2 = 8, but chips = 4"):
        make_plan(dict(RAW, chips=4), extra_plugins=[("ulysses_like", _sp_plugin())], disabled=THIRD_PARTY)


def test_without_the_plugin_the_key_is_unknown():
    with pytest.raises(ConfigError, match=r"no enabled plugin registers the dimension 'sp' \(disabled plugins: "):
        make_plan(RAW, disabled=THIRD_PARTY)


def test_its_shard_factors_reach_the_local_shape():
    raw = dict(RAW, phase="prefill")
    plan = make_plan(raw, extra_plugins=[("ulysses_like", _sp_plugin())], disabled=THIRD_PARTY)
    assert plan.ctx.shape.tokens == 4 * 4096 / 4
    assert plan.ctx.shape.factor("tokens") == 4


def test_sharding_the_sequence_without_owning_attention_is_refused_not_guessed():
    """The core's single-chip attention cannot run on a sequence shard: an error, not a number."""
    with pytest.raises(DagError, match="needs a plugin that owns it"):
        run(dict(RAW, phase="prefill"), extra_plugins=[("ulysses_like", _sp_plugin())], disabled=THIRD_PARTY)


def test_a_run_with_the_new_dimension_conserves():
    out = run(RAW, extra_plugins=[("ulysses_like", _sp_plugin())], disabled=THIRD_PARTY)
    assert all(v == 0 for v in out.sim.kpis.values())
    assert len(out.memory.per_chip) == 8
