"""Attention DP with EP inside a serving instance (``parallel.dp > 1``): each rank its own
batch and KV pool, a step as long as the slowest rank's, idle ranks joining the MoE
all-to-all, every request on one rank, and the step cost equal to ``g5 run``'s on the same
layout."""
from __future__ import annotations

import pytest

from g5core.api.errors import ConfigError
from g5core.serve.api import simulate_serving
from g5core.serve.cost import IDLE_WORK, DpCost, PlanCost, RankedWork, StepWork
from g5core.serve.workload import Request, Workload

MOE = {"model": "qwen3-30b-a3b", "system": "h200"}


def moe(dp: int, tp: int = 1, ep: int | None = None, **serving) -> dict:
    return {**MOE, "chips": dp * tp, "parallel": {"dp": dp, "tp": tp, "pp": 1, "cp": 1, "ep": ep or dp * tp},
            "serving": {"scheduler": {"max_num_batched_tokens": 2048, "max_num_seqs": 16}, **serving}}


def runner(groups):
    """A stand-in for one rank's engine step: 5 ms, 20 us a prefill token, 50 us a decode."""
    return 5e-3 + sum(k * (5e-5 if n == 1 else 2e-5 * n) for n, c, k in groups)


def test_two_ranks_with_unequal_batches_step_at_the_slower_ones_time():
    cost = DpCost(PlanCost(runner, exact=True), 2)
    long = StepWork(((1500, 0),), ())
    short = StepWork((), (100, 200, 300))
    slow, fast = runner(((1500, 0, 1),)), runner(((1, 100, 1), (1, 200, 1), (1, 300, 1)))
    assert slow > fast
    assert cost.latency_s(RankedWork((long, short))) == slow
    assert cost.latency_s(RankedWork((short, long))) == slow
    # in the loop: a busy first step, then a long prompt (rank 1) and a short one (rank 0)
    # arrive and share the next step: both first tokens come at the slower rank's end
    w = Workload((Request(0, 0.0, 10, 1), Request(1, 0.001, 1500, 2), Request(2, 0.002, 20, 2)))
    res = simulate_serving(moe(2), w, runner=runner, check_predictor=0, exact=True)
    log = res.loop.requests
    first_end = runner(((10, 0, 1),))
    assert log.first_token_s[1] == log.first_token_s[2] == pytest.approx(first_end + slow, rel=1e-12)
    assert list(res.loop.instances[0].scheduler.added) == [2, 1]


def test_an_idle_rank_still_joins_the_all_to_all():
    seen = []

    def recording(groups):
        seen.append(groups)
        return runner(groups)
    w = Workload((Request(0, 0.0, 300, 3),))
    res = simulate_serving(moe(2), w, runner=recording, check_predictor=0, exact=True)
    sched = res.loop.instances[0].scheduler
    steps = res.loop.steps
    # rank 1 had nothing in any step, yet it stepped every time (its dummy token costed too)
    assert steps == 3 and sched.idle_steps == [0, steps]
    assert ((1, 0, 1),) in seen
    assert IDLE_WORK.groups() == ((1, 0, 1),)
    # a lone request's step is the slower of its rank's and the idle rank's dummy step
    slow_idle = DpCost(PlanCost(lambda g: 1.0 if g == ((1, 0, 1),) else runner(g), exact=True), 2)
    assert slow_idle.latency_s(StepWork(((300, 0),), ())) == 1.0
    # the dummy step of the engine runs the MoE layers' dispatch and combine on every rank
    from g5core.session.prepared import prepare
    plan = prepare({**{k: v for k, v in moe(2).items() if k != "serving"}, "phase": "decode", "batch": 1,
                    "seq_len": 1})
    (n, c, k), = IDLE_WORK.groups()
    by_reason = plan.simulate([{"new_tokens": n, "cached_tokens": c, "count": k}],
                              detail=True).sim.comm_bytes["per_rank_by_reason"]
    assert by_reason["ep_dispatch"] > 0 and by_reason["ep_combine"] > 0


@pytest.mark.parametrize("balance", ["round_robin", "shortest_queue"])
def test_conservation_holds_per_rank(balance):
    w = Workload(tuple(Request(k, 0.01 * k, 200 + 37 * (k % 5), 3 + k % 7) for k in range(60)))
    res = simulate_serving(moe(4, dp_balance=balance), w, runner=runner, check_predictor=0)
    assert not any(res.conservation.values())
    assert set(res.conservation) >= {"requests_not_on_one_rank", "requests_given_twice", "kv_blocks_left_at_end"}
    sched = res.loop.instances[0].scheduler
    assert sum(sched.added) == 60 and not sched.rank_of
    assert [r.used_blocks for r in sched.ranks] == [0, 0, 0, 0]
    assert all(r.total_blocks * 4 == sched.total_blocks for r in sched.ranks)
    if balance == "round_robin":
        assert sched.added == [15, 15, 15, 15]
    info = res.pools[0]
    assert info["attention_dp_ranks"] == 4 and info["kv_capacity_tokens"] == 4 * info["kv_capacity_tokens_per_rank"]


def test_disaggregated_pools_of_attention_dp_ranks_move_one_ranks_kv():
    raw = {**MOE, "chips": 2, "parallel": {"dp": 2, "tp": 1, "pp": 1, "cp": 1, "ep": 2},
           "serving": {"disaggregation": {"prefill": {"instances": 1}, "decode": {"instances": 1}}}}
    w = Workload(tuple(Request(k, 0.0, 500, 4) for k in range(6)))
    res = simulate_serving(raw, w, runner=runner, check_predictor=0)
    assert not any(res.conservation.values())
    fleet = res.loop.fleet
    per_chip = res.pools[0]["kv_bytes_per_token_per_chip"]
    assert fleet.transfer_bytes(1000) == pytest.approx(1000 * per_chip)   # one rank's one chip, not two


@pytest.mark.parametrize("raw, field", [
    ({"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 2,
      "parallel": {"dp": 2, "tp": 1, "pp": 1, "cp": 1}}, "parallel.dp"),
    ({**MOE, "chips": 8, "parallel": {"dp": 4, "tp": 2, "pp": 1, "cp": 1, "ep": 4}}, "parallel.dp"),
    ({**MOE, "chips": 2, "parallel": {"dp": 2, "tp": 1, "pp": 1, "cp": 1, "ep": 2},
      "serving": {"dp_balance": "fastest"}}, "serving.dp_balance"),
])
def test_layouts_whose_ranks_would_not_step_together_are_refused(raw, field):
    with pytest.raises(ConfigError) as err:
        simulate_serving(raw, Workload((Request(0, 0.0, 100, 2),)), runner=runner, check_predictor=0)
    assert err.value.field == field


def decode_step_matches_g5_run(raw: dict, per_rank: int, context: int) -> None:
    """The serving cost path's step of every rank decoding ``per_rank`` sequences at
    ``context`` cached tokens (exact and predicted) is ``g5 run``'s decode step of that batch."""
    from g5core.session.run import run

    dp = raw["parallel"]["dp"]
    alone = run({**raw, "phase": "decode", "batch": per_rank, "seq_len": context + 1}).latency_s
    res = simulate_serving({**raw, "serving": {"scheduler": {"max_num_batched_tokens": per_rank}}},
                           Workload((Request(0, 0.0, context, 2),)), check_predictor=0, exact=True)
    cost = res.costs[0]
    work = RankedWork((StepWork((), (context,) * per_rank),) * dp)
    assert cost.latency_s(work, True) == alone
    # the predictor interpolates the decode attention between batches 4^k (64 and 256 here)
    assert cost.latency_s(work, False) == pytest.approx(alone, rel=0.01)


def test_a_decode_step_of_128_sequences_per_rank_is_g5_runs_step():
    """The same shape as the DeepSeek-V3 check below, on 2 chips of a smaller MoE."""
    decode_step_matches_g5_run({**MOE, "chips": 2, "parallel": {"dp": 2, "tp": 1, "pp": 1, "cp": 1, "ep": 2}},
                               128, 4096)


@pytest.mark.bench   # 6 s CPU, 20+ s wall on a loaded 2-core machine (python3 -m pytest -q -m bench)
def test_deepseek_v3_decode_on_32_chips_with_128_sequences_per_rank_is_g5_runs_step():
    decode_step_matches_g5_run({"model": "deepseek-v3", "system": "h200", "chips": 32,
                                "parallel": {"dp": 32, "tp": 1, "pp": 1, "cp": 1, "ep": 32},
                                "dtypes": {"weights": {"default": "bf16", "experts": "fp8"},
                                           "activations": "bf16", "kv_cache": "bf16"}}, 128, 4096)
