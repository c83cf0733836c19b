"""The step rules of a layout: what its dimensions require of every step it runs.

Each plugin states its own through ``g5_step_rules`` (a :class:`~g5core.api.records.StepRules`:
a token multiple, whether prefill and decode may share a step, how to split one that may
not); :func:`step_rules` merges them once per deployment, and the callers (the serving cost
model, the serving search) apply the merged rules with no knowledge of any dimension.
"""
from __future__ import annotations

import math

from g5core.api.errors import PluginError
from g5core.api.records import StepRules
from g5core.inputs.step import Step


def step_rules(hooks, deployment) -> StepRules:
    """Every enabled plugin's ``g5_step_rules`` answer for ``deployment``, merged: the least
    common multiple of the token multiples, ``mixed`` only if every plugin allows it, the
    splits of those that do not applied in turn (in plugin order)."""
    answers = []
    for plugin, answer in hooks.call_each("g5_step_rules", deployment=deployment):
        if answer is None:
            continue
        if not isinstance(answer, StepRules):
            raise PluginError(plugin, f"g5_step_rules must return a StepRules or None, got {answer!r}")
        answers.append((plugin, answer))
    if not answers:
        return StepRules()
    splits = tuple((p, r.split) for p, r in answers if not r.mixed)
    multiple = math.lcm(*(r.token_multiple for _, r in answers))
    owner = ",".join(p for p, _ in answers)
    if not splits:
        return StepRules(token_multiple=multiple, owner=owner)

    def split(step: Step) -> tuple[Step, ...]:
        parts = (step,)
        for plugin, one in splits:
            parts = tuple(q for part in parts for q in checked_split(plugin, one, part))
        return parts
    return StepRules(token_multiple=multiple, mixed=False, split=split, owner=owner)


def checked_split(plugin: str, split, step: Step) -> tuple[Step, ...]:
    """``plugin``'s ``split`` of ``step`` (itself when not mixed), refused unless it is steps,
    none mixed, holding the step's groups between them."""
    if step.phase != "mixed":
        return (step,)
    parts = tuple(split(step))
    if not all(isinstance(p, Step) and p.phase != "mixed" for p in parts) or \
            Step(g for p in parts for g in p) != step:
        raise PluginError(plugin, f"g5_step_rules' split of {step.to_list()} returned {parts!r}: need steps, none "
                                  "mixed, holding the step's groups between them")
    return parts


def split_step(rules: StepRules, step: Step) -> tuple[Step, ...]:
    """The steps ``step`` runs as under ``rules``: itself, or, when it mixes prefill and
    decode groups and the layout may not, the rules' split of it."""
    if rules.mixed or step.phase != "mixed":
        return (step,)
    return tuple(rules.split(step))
