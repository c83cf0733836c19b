"""The serving search's capacity estimate: its step table (in the screen cell)."""
from __future__ import annotations

import math

import pytest

from g5core.api.serving import StepWork
from g5core.study.serving.estimate import step_table


class _LinearCost:
    """A step costing 1 ms plus 10 us per prompt token and 20 us per decode."""

    @staticmethod
    def latency_s(work: StepWork) -> float:
        return 1e-3 + 1e-5 * sum(n for n, _ in work.chunks) + 2e-5 * len(work.decode_contexts)


def test_the_step_table_prices_a_long_prompt_at_its_share_of_full_steps():
    """A 4,000-token prompt in a 2,048-token budget: its first token after its two whole
    steps (2,048 + 1,952 tokens), and, under a queue that fills every step's budget, about
    4000 / 2048 full steps of the prompt's time (the next prompt's chunk takes what the last
    one leaves)."""
    table = step_table(_LinearCost(), 4000, 16, 2048, [1, 8, 64])
    rows = {row[0]: row[1:] for row in table["prefill"]}
    p, k, first = rows[0]
    full = 1e-3 + 1e-5 * 2048
    assert first == pytest.approx(2 * 1e-3 + 1e-5 * 4000)
    assert k == pytest.approx(4000 / 2048) and p == pytest.approx(k * full)
    # with 64 decodes running, the budget is 1,984 tokens: three steps for the lone prompt
    p64, k64, first64 = rows[64]
    assert k64 == pytest.approx(4000 / 1984) and first64 == pytest.approx(3 * (1e-3 + 64 * 2e-5) + 1e-5 * 4000)
    assert p64 == pytest.approx(k64 * (1e-3 + 64 * 2e-5 + 1e-5 * 1984))
    # a prompt within the budget shares a step: two 1,000-token prompts per 2,048-token step
    short = {row[0]: row[1:] for row in step_table(_LinearCost(), 1000, 16, 2048, [1])["prefill"]}
    assert short[0][1] == 0.5 and short[0][0] == pytest.approx((1e-3 + 2e-5 * 1000) / 2)
    assert not math.isnan(p)
