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
    rows = {row[0]: row[1:4] for row in table["prefill"]}
    lone = {row[0]: row[4:] for row in table["prefill"]}
    p, k, first = rows[0]
    full = 1e-3 + 1e-5 * 2048
    assert first == pytest.approx(2 * 1e-3 + 1e-5 * 4000)
    assert k == pytest.approx(4000 / 2048) and p == pytest.approx(k * full)
    # with 64 decodes running, the budget is 1,984 tokens: three steps for the lone prompt
    p64, k64, first64 = rows[64]
    assert k64 == pytest.approx(4000 / 1984) and first64 == pytest.approx(3 * (1e-3 + 64 * 2e-5) + 1e-5 * 4000)
    assert p64 == pytest.approx(k64 * (1e-3 + 64 * 2e-5 + 1e-5 * 1984))
    # the lone prompt: its own steps (two, three with 64 decodes), all its time
    assert lone[0] == [first, 2.0] and lone[64] == [first64, 3.0]
    # a prompt within the budget shares a step: two 1,000-token prompts per 2,048-token step
    short = {row[0]: row[1:] for row in step_table(_LinearCost(), 1000, 16, 2048, [1])["prefill"]}
    assert short[0][1] == 0.5 and short[0][0] == pytest.approx((1e-3 + 2e-5 * 1000) / 2)
    assert short[0][3:] == [pytest.approx(1e-3 + 1e-5 * 1000), 1.0]     # the lone prompt's step
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
    short = {row[0]: row[1:4] for row in step_table(cost, 1000, 16, 2048, [1, 8], cost.dp)["prefill"]}
    p, k, full = short[0]
    assert k == 1 / 8 and full == pytest.approx(1e-3 + 1e-5 * 2000) and p == pytest.approx(full / 8)
    p8, k8, _ = short[8]                        # 8 decodes: 2 a rank, 2,046 tokens of budget left
    assert k8 == 1 / 8 and p8 == pytest.approx((1e-3 + 1e-5 * 2000 + 2 * 2e-5) / 8)
    long = {row[0]: row[1:4] for row in step_table(cost, 4000, 16, 2048, [1], cost.dp)["prefill"]}
    p, k, first = long[0]
    assert k == pytest.approx(4000 / 2048 / 4) and p == pytest.approx(k * (1e-3 + 1e-5 * 2048))
    assert first == pytest.approx(2 * 1e-3 + 1e-5 * 4000)     # the lone prompt on its rank
    # one rank: the table of before, bit for bit
    assert step_table(_LinearCost(), 4000, 16, 2048, [1, 8]) == step_table(_LinearCost(), 4000, 16, 2048, [1, 8], 1)


def test_an_aggregated_step_holds_the_prompts_that_arrived_since_the_last():
    """At a TPOT limit the prompts arriving between two steps are a fraction of one
    (``b / decodes``): an aggregated step holding a prompt holds about one, not a full
    budget's (an attention-DP instance's: every rank's), and costs the lone prompt's step.
    Under load it fills toward the budget, never past it, and where the budget holds one
    prompt there is nothing to share."""
    from g5core.study.serving.estimate import shared

    # 8 prompts fill a step of 8 ranks' budgets at 0.8 s; one prompt's step takes 0.2 s
    pre = [[0, 0.1, 1 / 8, 0.8, 0.2, 1.0], [64, 0.11, 1 / 8, 0.88, 0.25, 1.0]]
    p, k = shared(pre, 0, 1000)                   # no decodes: one prompt a step
    assert (p, k) == (0.2, 1.0)
    p, k = shared(pre, 64, 1023)                  # x = 64 / 1023: about 1.03 prompts a step
    q = 1 / k
    x = 64 / 1023
    assert q == pytest.approx(x / -math.expm1(-x)) and 1 < q < 1.05
    assert p * q == pytest.approx(0.25 + (q - 1) / 7 * (0.88 - 0.25))   # the step, between the two
    assert shared(pre, 64, 2)[1] == 1 / 8         # 32 arrivals a step: the budget is full
    # a budget of one prompt: the full rows as they are
    one = [[0, 0.2, 1.0, 0.2, 0.2, 1.0]]
    assert shared(one, 0, 1000) == (0.2, 1.0)


def test_a_larger_max_num_seqs_never_estimates_less_where_the_smaller_does_not_bind():
    """An aggregated instance's time per request ``f(b)`` falls with the batch and rises again
    where the decodes leave a prompt less of the budget (a 2,000-token prompt in a 2,048-token
    budget takes two steps beside 64 decodes). The batch grows from empty until the instance
    keeps up, so it settles on the falling side: a max_num_seqs of 256 serves what 128 does
    (the table is Llama-3.1-8B's on 2 H100s at chunk 2,048; before, 256 estimated 69.4
    req/s against 77.0 for 128 on 4 instances, and both simulated at 73.2)."""
    from g5core.inputs.serving import parse_slo
    from g5core.study.serving.estimate import Estimator
    from g5core.study.serving.space import check_workload, run_requests

    table = {"isl": 2000, "osl": 200,
             "prefill": [[0, 0.02841, 1.0, 0.02841, 0.02841, 1.0], [32, 0.03002, 1.0, 0.03002, 0.03002, 1.0],
                         [1024, 0.15156, 1.953125, 0.15551, 0.15551, 2.0]],
             "decode_mid_s": [[1, 0.00486], [8, 0.00510], [16, 0.00553], [32, 0.00636], [64, 0.00802],
                              [128, 0.01146], [256, 0.01828], [512, 0.03360], [1024, 0.06466]]}
    wl = check_workload({"requests": 300, "arrival": {"kind": "poisson"}, "input_tokens": 2000,
                         "output_tokens": 200, "seed": 0})
    est = Estimator(parse_slo("ttft_p90=0.5s,tpot_p90=15ms"), wl, lambda r: run_requests(wl, r, 3.5), 1e4, 4000)
    at = {seqs: est.aggregated(table, 4, seqs, 1e6) for seqs in (64, 128, 256, 1024)}
    assert at[256] == pytest.approx(at[128], rel=0.02) and at[1024] == pytest.approx(at[128], rel=0.02)
    assert 70 < at[128] < 85 and at[64] <= at[128]


def test_under_a_framework_that_runs_uncaptured_batches_eagerly_the_decode_table_has_the_midpoints():
    """TensorRT-LLM runs a decode batch between its captured CUDA-graph sizes eagerly (no
    padding), and its step is no line between the powers of two it captures: the table
    samples ``3 b / 2`` too, below the largest batch. vLLM and SGLang pad to the next size,
    and without a profile every batch is captured: their tables are as before."""
    import types

    from g5core.inputs.framework import Framework, graph_islands, load_profile

    system = lambda name: types.SimpleNamespace(  # noqa: E731
        framework=Framework.from_mapping(load_profile(name)["framework"], name))
    assert graph_islands(system("trtllm")) == {*range(1, 33), 64, 128}
    assert not any(graph_islands(system(n)) for n in ("vllm", "sglang")) and not graph_islands(object())
    plain = step_table(_LinearCost(), 1000, 16, 2048, [1, 2, 4, 8, 16])
    eager = step_table(_LinearCost(), 1000, 16, 2048, [1, 2, 4, 8, 16], eager=True)
    assert [b for b, _ in plain["decode_mid_s"]] == [1, 2, 4, 8, 16]
    assert [b for b, _ in eager["decode_mid_s"]] == [1, 2, 3, 4, 6, 8, 12, 16]
    assert eager["decode_mid_s"][4][1] == pytest.approx(1e-3 + 6 * 2e-5)
    assert eager["prefill"] == plain["prefill"]
