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


def test_an_attention_dp_instance_serves_every_ranks_prompts_in_a_step():
    """Each attention-DP rank schedules its own budget: under load a step of 4 ranks serves 4
    times the prompts (short prompts: 2 a rank; long ones: one chunk a rank), each rank's
    decodes a quarter of the instance's; before, the table priced the prompts of one rank's
    budget spread over the ranks, a DP prefill instance at a fraction of its capacity."""
    from g5core.serve.cost import DpCost, PlanCost
    from g5core.study.serving.screen import instance_cost

    def runner(groups):     # _LinearCost on a rank's (tokens, context, count) groups
        return 1e-3 + sum(k * (2e-5 if n == 1 else 1e-5 * n) for n, _, k in groups)

    rank = PlanCost(runner, exact=True)
    cost = instance_cost(DpCost(rank, 4))       # a step as long as its slowest rank's
    short = {row[0]: row[1:] for row in step_table(cost, 1000, 16, 2048, [1, 8], cost.dp)["prefill"]}
    p, k, full = short[0]
    assert k == 1 / 8 and full == pytest.approx(1e-3 + 1e-5 * 2000) and p == pytest.approx(full / 8)
    p8, k8, _ = short[8]                        # 8 decodes: 2 a rank, 2,046 tokens of budget left
    assert k8 == 1 / 8 and p8 == pytest.approx((1e-3 + 1e-5 * 2000 + 2 * 2e-5) / 8)
    long = {row[0]: row[1:] for row in step_table(cost, 4000, 16, 2048, [1], cost.dp)["prefill"]}
    p, k, first = long[0]
    assert k == pytest.approx(4000 / 2048 / 4) and p == pytest.approx(k * (1e-3 + 1e-5 * 2048))
    assert first == pytest.approx(2 * 1e-3 + 1e-5 * 4000)     # the lone prompt on its rank
    # one rank: the table of before, bit for bit
    assert step_table(_LinearCost(), 4000, 16, 2048, [1, 8]) == step_table(_LinearCost(), 4000, 16, 2048, [1, 8], 1)
