"""Step rules live in the plugins (``g5_step_rules``); the core merges them and the serving
cost model follows them, knowing no dimension."""
from __future__ import annotations

import pytest

from g5core import PluginError, Step, StepGroup, StepRules, hookimpl, make_plugin_manager, prepare
from g5core.api.plugins import Hooks
from g5core.lower.steprules import split_step, step_rules
from g5core.serve.cost import PlanCost, StepWork

BASE = {"model": "llama-3.1-8b", "system": "h100-sxm", "phase": "prefill", "batch": 1, "seq_len": 1024}


def _rules(*plugins, deployment=None):
    pm = make_plugin_manager(extra_plugins=[(f"rules{i}", p) for i, p in enumerate(plugins)])
    dep = deployment if deployment is not None else prepare({**BASE, "chips": 1,
                                                               "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1}}).deployment
    return step_rules(Hooks(pm), dep)


class Phases:
    """A stand-in dimension plugin: token multiple ``m``, no mixed step (prefill, then decode)."""

    def __init__(self, m, mixed=False, split=None):
        self.m, self.mixed = m, mixed
        self.split = split or (lambda step: (Step(g for g in step if not g.is_decode),
                                             Step(g for g in step if g.is_decode)))

    @hookimpl
    def g5_step_rules(self, deployment):
        return StepRules(token_multiple=self.m, mixed=self.mixed, split=None if self.mixed else self.split)


MIXED = Step([StepGroup(new_tokens=6, count=1), StepGroup(new_tokens=1, cached_tokens=5, count=2)])


def test_the_cp_plugin_states_its_rules():
    one = prepare({**BASE, "chips": 1, "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1}}).step_rules
    two = prepare({**BASE, "chips": 2, "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 2}}).step_rules
    assert (one.token_multiple, one.mixed) == (1, True)
    assert (two.token_multiple, two.mixed, two.owner) == (4, False, "cp")
    assert split_step(two, MIXED) == (Step([StepGroup(new_tokens=6, count=1)]),
                                      Step([StepGroup(new_tokens=1, cached_tokens=5, count=2)]))
    assert split_step(one, MIXED) == (MIXED,)


def test_rules_merge_lcm_and_any_refusal():
    merged = _rules(Phases(4, mixed=True), Phases(6))
    assert merged.token_multiple == 12 and not merged.mixed
    assert merged.round_up(13) == 24
    assert len(split_step(merged, MIXED)) == 2
    assert _rules(Phases(3, mixed=True)).mixed


def test_a_split_that_loses_groups_is_the_plugins_error():
    bad = _rules(Phases(1, split=lambda step: (Step([StepGroup(new_tokens=6, count=1)]),)))
    with pytest.raises(PluginError, match="holding the step's groups"):
        bad.split(MIXED)
    with pytest.raises(ValueError, match="needs split"):
        StepRules(mixed=False)


def test_plan_cost_follows_any_plugins_rules():
    """Serving pads and splits as the rules say, whichever plugin gave them (here not cp)."""
    seen = []

    def runner(groups):
        seen.append(groups)
        return 1.0

    cost = PlanCost(runner, True, _rules(Phases(4)))
    # a 6-token chunk after 5 cached and two decodes at context 6 (5 cached + the new one)
    latency = cost.latency_s(StepWork(((6, 5),), (5, 5)))
    assert latency == 2.0                                   # prefill, then decode: two engine steps
    assert seen == [((8, 8, 1),), ((1, 7, 2),)]             # each padded to multiples of 4
    assert PlanCost(runner, True).latency_s(StepWork(((6, 5),), (5, 5))) == 1.0   # no rule: one mixed step
