"""g5 serve: the request-level loop, its scheduler, routers, metrics and workloads."""
from __future__ import annotations

import math

import attrs
import numpy as np
import pytest

from g5core import GroupShape, Step, StepGroup
from g5core.api.errors import ConfigError, G5Error
from g5core.serve.api import simulate_serving
from g5core.serve.cost import PlanCost, StepWork, SyntheticCost, to_step
from g5core.serve.loop import Event, Fleet, Pool, ServingLoop, check_invariants, serve_requests
from g5core.inputs.serving import parse_slo
from g5core.serve.metrics import per_request, summary
from g5core.serve.router import LeastKvUse, LeastOutstandingTokens, RoundRobin
from g5core.serve.scheduler import SchedulerSettings
from g5core.serve.workload import Request, Workload, synthetic
from serve_helpers import count_kept
from g5core.serve import loop as serve_loop

LLAMA8 = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 1, "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1}}


def pool(cost, instances=1, blocks=None, router=None, **sched):
    s = SchedulerSettings(**sched)
    total = blocks if blocks is not None else cost.kv_tokens() // s.block_size
    return Pool("serve", instances, cost, s, total, router or RoundRobin())


def run(workload, *pools, **kw):
    return serve_requests(Fleet(tuple(pools), **kw), workload)


def fixed(n, rate, isl, osl, seed=0, **extra):
    return synthetic({"requests": n, "arrival": {"kind": "poisson", "rate_per_s": rate}, "input_tokens": isl,
                      "output_tokens": osl, "seed": seed, **extra})


# -- conservation --------------------------------------------------------------------------


@pytest.mark.parametrize("router", [RoundRobin, LeastOutstandingTokens, LeastKvUse])
def test_conservation_every_request_once_all_tokens_blocks_return(router):
    w = synthetic({"requests": 400, "arrival": {"kind": "gamma", "rate_per_s": 30, "cv": 2},
                   "input_tokens": "lognormal:1024:0.8@8:6000", "output_tokens": "uniform:1:300", "seed": 3})
    cost = SyntheticCost(0.01, 2e-6, 1e-8, kv_pool_bytes_per_chip=60_000)
    res = run(w, pool(cost, instances=3, router=router(), max_num_batched_tokens=2048))
    assert check_invariants(res) == {"requests_with_wrong_token_count": 0, "requests_out_of_order": 0,
                                       "requests_without_positive_ttft": 0, "requests_not_fcfs": 0,
                                       "steps_over_kv_pool": 0, "kv_blocks_left_at_end": 0}
    assert sum(res.requests.emitted) == sum(r.output_tokens for r in w.requests)
    arrays = per_request(res)
    assert np.all(arrays["queue_s"] >= 0) and np.all(arrays["ttft_s"] > 0)
    # no instance ever holds more blocks than its pool
    for inst in res.instances:
        used = np.frombuffer(inst.steps, dtype=float).reshape(-1, 7)[:, 4]
        assert used.max() <= inst.scheduler.total_blocks


def test_the_loop_steps_event_by_event_and_runs_until_a_time():
    """SimPy's shape: step() one event at a time, run(until) up to a time; either way the
    same result as one run to the end, bit for bit."""
    w = fixed(120, 40, 300, 40, seed=5)
    cost = SyntheticCost(0.01, 2e-6, 1e-8, kv_pool_bytes_per_chip=60_000)
    fleet = lambda: Fleet((pool(cost, instances=2, max_num_batched_tokens=1024),))
    whole = serve_requests(fleet(), w)
    loop = ServingLoop(fleet(), w)
    kinds = []
    while loop.peek() < 1.0:
        t, kind = loop.step()
        assert t <= 1.0
        kinds.append(kind.name)
    assert {"ARRIVAL", "STEP_END"} <= set(kinds)
    assert loop.run(until=2.0) is None and loop.peek() > 2.0     # events left after 2 s
    with pytest.raises(G5Error, match="run it to the end"):
        loop.result()
    res = loop.run()
    assert res is loop.result()
    assert res.steps == whole.steps and res.makespan_s == whole.makespan_s
    assert res.requests.finish_s == whole.requests.finish_s and res.requests.itl_s == whole.requests.itl_s
    assert check_invariants(res)["kv_blocks_left_at_end"] == 0


def test_closed_loop_keeps_concurrency():
    w = synthetic({"requests": 50, "arrival": {"kind": "closed", "concurrency": 4}, "input_tokens": 100,
                   "output_tokens": 10})
    res = run(w, pool(SyntheticCost(0.01)))
    rows = np.frombuffer(res.instances[0].steps, dtype=float).reshape(-1, 7)
    assert rows[:, 5].max() == 4          # never more than the concurrency in flight
    assert check_invariants(res)["requests_with_wrong_token_count"] == 0


# -- low load: exact -------------------------------------------------------------------------


def test_low_load_ttft_and_tpot_are_the_step_latencies():
    isl, osl = 500, 20
    cost = SyntheticCost(fixed_s=0.01, per_token_s=1e-5, per_context_token_s=1e-7)
    reqs = tuple(Request(k, 100.0 * k, isl, osl) for k in range(3))
    res = run(Workload(reqs), pool(cost), routing_s=0.002)
    a = per_request(res)
    prefill = cost.latency_s(StepWork(((isl, 0),), ()))
    decodes = [cost.latency_s(StepWork((), (isl + j,))) for j in range(osl - 1)]
    # exact up to the rounding of absolute times (arrivals at 0, 100, 200 s)
    np.testing.assert_allclose(a["ttft_s"], prefill + 0.002, rtol=0, atol=1e-12)
    assert a["ttft_s"][0] == prefill + 0.002
    np.testing.assert_allclose(a["tpot_s"], sum(decodes) / (osl - 1), rtol=1e-9)
    np.testing.assert_allclose(a["queue_s"], 0.002, rtol=0, atol=1e-12)


def test_low_load_with_the_engine_is_the_engine_prefill():
    import g5core
    from g5core import Step, StepGroup

    raw = {**LLAMA8, "serving": {"scheduler": {"max_num_batched_tokens": 4096}}}
    w = Workload((Request(0, 0.0, 1000, 3),))
    plan = g5core.prepare({**LLAMA8, "phase": "prefill", "batch": 1, "seq_len": 1000})
    # the serving step runner's engine figure: layer-periodic runs, the full run's to 1e-9
    prefill = plan.periodic_latency_s(Step.prefill(1, 1000))
    assert prefill == pytest.approx(plan.simulate(Step.prefill(1, 1000)).latency_s, rel=1e-9)
    d1, d2 = (plan.periodic_latency_s(Step([StepGroup(new_tokens=1, cached_tokens=c)])) for c in (1000, 1001))
    s = simulate_serving(raw, w, exact=True, check_predictor=0).summary
    assert s["ttft_s"]["mean"] == prefill
    assert s["tpot_s"]["mean"] == pytest.approx((d1 + d2) / 2, rel=1e-12)
    # the predictor interpolates between grid points (768 and 1,024 tokens here)
    s = simulate_serving(raw, w, exact=False, check_predictor=0).summary
    assert s["ttft_s"]["mean"] == pytest.approx(prefill, rel=0.02)
    assert s["tpot_s"]["mean"] == pytest.approx((d1 + d2) / 2, rel=0.02)
    assert simulate_serving(raw, w, exact=True).to_json_dict()["engine_runs"] == 3


# -- queueing ------------------------------------------------------------------------------


def test_md1_waiting_and_littles_law():
    service = 0.01
    rate = 0.5 / service               # 50% load
    w = fixed(60_000, rate, 1, 1, seed=11)
    res = run(w, pool(SyntheticCost(fixed_s=service), max_num_seqs=1))
    a = per_request(res)
    rho = rate * service
    md1 = rho * service / (2 * (1 - rho))
    assert np.mean(a["queue_s"]) == pytest.approx(md1, rel=0.05)
    s = summary(res)
    little = s["throughput"]["requests_per_s"] * s["e2e_s"]["mean"]
    assert s["mean_in_system"] == pytest.approx(little, rel=0.02)


def test_saturation_throughput_flattens_and_ttft_grows():
    cost = SyntheticCost(fixed_s=0.02, per_token_s=2e-5)
    out, p99 = [], []
    for rate in (2, 4, 8, 16, 32, 64):
        res = run(fixed(600, rate, 512, 64, seed=5), pool(cost, max_num_seqs=16))
        s = summary(res)
        out.append(s["throughput"]["requests_per_s"])
        p99.append(s["ttft_s"]["p99"])
        for key in ("ttft_s", "tpot_s", "e2e_s", "queue_s"):
            assert s[key]["p50"] <= s[key]["p90"] <= s[key]["p99"]
    assert out[0] < out[1] < out[2]                   # below saturation it follows the rate
    assert out[-1] == pytest.approx(out[-2], rel=0.1)  # past it, flat
    assert p99[-1] > 3 * p99[2]                        # TTFT p99 keeps growing past saturation


# -- chunked prefill, preemption -----------------------------------------------------------------


def test_chunked_prefill_lowers_the_worst_tpot_of_running_decodes():
    reqs = [Request(k, 0.001 * k, 100, 200) for k in range(8)] + [Request(8, 0.5, 30_000, 2)]
    cost = SyntheticCost(fixed_s=0.005, per_token_s=1e-5)
    worst = {}
    for chunked in (False, True):
        res = run(Workload(tuple(reqs)), pool(cost, chunked_prefill=chunked, max_num_batched_tokens=32_768
                                              if not chunked else 2048))
        worst[chunked] = float(np.max(per_request(res)["max_itl_s"][:8]))
    assert worst[True] < 0.5 * worst[False]


def test_preemption_when_the_pool_is_small_and_outputs_still_complete():
    w = fixed(60, 50, 300, 200, seed=2)
    cost = SyntheticCost(0.01, 1e-5)
    res = run(w, pool(cost, blocks=120, block_size=16))   # 1,920 tokens: a few requests at once
    assert res.preemptions > 0
    assert check_invariants(res) == {"requests_with_wrong_token_count": 0, "requests_out_of_order": 0,
                                       "requests_without_positive_ttft": 0, "requests_not_fcfs": 0,
                                       "steps_over_kv_pool": 0, "kv_blocks_left_at_end": 0}
    assert summary(res)["preemptions"] == res.preemptions


def test_shared_prefix_is_computed_once_per_instance():
    w = synthetic({"requests": 20, "arrival": {"kind": "poisson", "rate_per_s": 0.1}, "input_tokens": 100,
                   "output_tokens": 2, "prefix": {"groups": 2, "tokens": 1000}, "seed": 4})
    groups = [r.prefix[0][0] for r in w.requests]
    cost = SyntheticCost(0.0, 1e-3)
    ttft = per_request(run(w, pool(cost)))["ttft_s"]
    for k, g in enumerate(groups):   # at this low load every request runs alone
        assert ttft[k] == pytest.approx((1100 if g not in groups[:k] else 100) * 1e-3)
    assert len(set(groups)) == 2
    # on two instances, each computes a prefix once
    ttft2 = per_request(run(w, pool(cost, instances=2)))["ttft_s"]
    assert np.count_nonzero(ttft2 > 1.0) == 4


# -- determinism ------------------------------------------------------------------------------------


def test_same_seed_same_output_bit_for_bit():
    def once(seed):
        w = synthetic({"requests": 300, "arrival": {"kind": "gamma", "rate_per_s": 20, "cv": 3},
                       "input_tokens": "normal:800:300@1:4000", "output_tokens": "hist:10=1,100=2", "seed": seed})
        res = run(w, pool(SyntheticCost(0.01, 1e-5, 1e-8, kv_pool_bytes_per_chip=50_000), instances=2,
                          router=LeastOutstandingTokens()))
        return repr(summary(res, parse_slo("ttft=0.5s,tpot=20ms")))
    assert once(1) == once(1)
    assert once(1) != once(2)


# -- errors ------------------------------------------------------------------------------------


def test_pool_too_small_for_one_request_is_a_clear_error():
    raw = {**LLAMA8, "serving": {"scheduler": {"max_num_batched_tokens": 8192}}}
    w = Workload((Request(0, 0.0, 2_000_000, 10),))
    with pytest.raises(ConfigError, match=r"KV pool .* GiB per chip holds [\d,]+ tokens; the longest request "
                                          r"needs 2,000,009"):
        simulate_serving(raw, w, runner=lambda r: 1.0)


def test_slo_parsing():
    limits = parse_slo("ttft=2s,tpot=50ms,ttft_p90=1.5s")
    assert [(x.key, x.limit_s) for x in limits] == [("ttft", 2.0), ("tpot", 0.05), ("ttft_p90", 1.5)]
    for bad in ("ttft=2", "ttfx=2s", "ttft=-1s", "ttft_p100=1s"):
        with pytest.raises(ConfigError, match="--slo"):
            parse_slo(bad)


def test_goodput_counts_requests_meeting_every_limit():
    reqs = tuple(Request(k, 10.0 * k, 100 * (k + 1), 5) for k in range(4))
    res = run(Workload(reqs), pool(SyntheticCost(0.0, 1e-3)))
    s = summary(res, parse_slo("ttft=0.25s"))
    # TTFTs are 0.1, 0.2, 0.3, 0.4 s
    assert s["goodput"]["requests_meeting"] == 2 and s["goodput"]["share"] == 0.5
    assert math.isclose(s["goodput"]["requests_per_s"], 2 / s["duration_s"])


# -- plugins -----------------------------------------------------------------------------------


class _Shortest:
    """A router a plugin registers: the instance with the fewest running sequences."""

    def choose(self, request, instances):
        return min(range(len(instances)), key=lambda i: (len(instances[i].scheduler.running), i))


class ServingPlugin:
    from g5core import hookimpl

    @hookimpl
    def g5_register_routers(self, register):
        register("fewest_running", _Shortest)

    @hookimpl
    def g5_register_schedulers(self, register):
        from g5core.serve.scheduler import VllmScheduler

        register("vllm_copy", VllmScheduler)


def test_a_plugin_registers_a_router_and_a_scheduler_and_passes_the_contract():
    from g5core.api.plugins import Hooks, make_plugin_manager
    from g5core.testing import check_plugin
    from g5core.serve.registry import serving_registry

    reg = serving_registry(Hooks(make_plugin_manager(extra_plugins=[("myserve", ServingPlugin())])))
    assert reg.routers["fewest_running"][0] == "myserve" and reg.schedulers["vllm_copy"][0] == "myserve"
    assert "serving_registrations" in " ".join(check_plugin("myserve", [LLAMA8 | {"phase": "decode", "batch": 1,
                                                                                   "seq_len": 8}],
                                                            [("myserve", ServingPlugin())]))


def test_registering_a_builtin_name_is_an_error():
    from g5core import hookimpl
    from g5core.api.errors import PluginError
    from g5core.api.plugins import Hooks, make_plugin_manager
    from g5core.serve.registry import serving_registry

    class Bad:
        @hookimpl
        def g5_register_routers(self, register):
            register("round_robin", RoundRobin)
    with pytest.raises(PluginError, match="round_robin.*already registered by g5core"):
        serving_registry(Hooks(make_plugin_manager(extra_plugins=[("bad", Bad())])))


def test_cp_shrinks_each_sequences_footprint_as_the_ledger_says():
    """cp=2 stores half of each sequence's KV per chip: the pool of two chips holds twice the
    tokens of one; at cp > 1 the engine sees groups padded to the balanced split and no mixed step."""
    def runner(groups):
        return 1e-3 * len(groups)
    w = Workload(tuple(Request(k, 0.01 * k, 3001, 5) for k in range(4)))
    one = simulate_serving(LLAMA8, w, runner=runner, check_predictor=0)
    two = simulate_serving({**LLAMA8, "chips": 2, "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 2}}, w,
                           runner=runner, exact=True)
    p1, p2 = one.pools[0], two.pools[0]
    assert p2["kv_bytes_per_token_per_chip"] == p1["kv_bytes_per_token_per_chip"] / 2
    # (not exactly twice: cp=2 also halves each chip's activations)
    assert p2["kv_capacity_tokens"] == pytest.approx(2 * p1["kv_capacity_tokens"], rel=1e-2)
    for groups in two.costs[0]._groups:
        assert all((g.new_tokens if g.new_tokens > 1 else g.cached_tokens + 1) % 4 == 0
                   and (g.new_tokens == 1 or g.cached_tokens % 4 == 0) for g in groups)
        assert len({g.new_tokens == 1 for g in groups}) == 1      # never prefill and decode together
    # a token budget off the balanced split is sized at the next multiple of 2 cp
    odd = {**LLAMA8, "chips": 2, "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 2},
           "serving": {"scheduler": {"max_num_batched_tokens": 1001}}}
    assert simulate_serving(odd, w, runner=runner, check_predictor=0).summary["completed"] == 4


def test_a_step_runner_sees_each_group_by_name():
    """The step cost hands a runner its step as g5core.GroupShape records (one form: equal
    shapes merged and sorted), which read by name and make the g5core.Step they stand for."""
    seen = []

    def runner(groups):
        seen.append(groups)
        return 1e-3 * sum(g.new_tokens * g.count for g in groups)

    cost = PlanCost(runner, exact=True)
    work = StepWork(((64, 0),), (10, 10, 30))
    assert work.groups() == (GroupShape(64, 0, 1), GroupShape(1, 10, 1), GroupShape(1, 10, 1), GroupShape(1, 30, 1))
    assert cost.latency_s(work) == pytest.approx(1e-3 * 67, rel=1e-12)
    (groups,) = seen
    assert groups == (GroupShape(1, 10, 2), GroupShape(1, 30, 1), GroupShape(64, 0, 1))
    assert all(type(g) is GroupShape for g in groups)
    assert to_step(groups) == Step([StepGroup(new_tokens=64), StepGroup(new_tokens=1, cached_tokens=10, count=2),
                                    StepGroup(new_tokens=1, cached_tokens=30, count=1)])


def test_conversations_reuse_their_earlier_turns():
    w = synthetic({"requests": 12, "arrival": {"kind": "poisson", "rate_per_s": 0.01}, "input_tokens": 100,
                   "output_tokens": 50, "conversation": {"turns": 3, "think_s": 10.0}, "seed": 1})
    reqs = w.requests
    assert [r.input_tokens for r in reqs[:3]] == [100, 250, 400]    # the conversation so far + 100 new
    cost = SyntheticCost(0.0, 1e-3)
    ttft = per_request(run(w, pool(cost)))["ttft_s"]
    # every turn computes only its own 100 new tokens: the earlier turns are cached
    np.testing.assert_allclose(ttft, 0.1, rtol=1e-9)
    assert check_invariants(run(w, pool(cost, instances=2)))["requests_with_wrong_token_count"] == 0


# -- runs of decode steps at once ------------------------------------------------------------


def _same_runs(dep, w):
    slow = serve_requests(dep, w, fast=False)
    fast = serve_requests(dep, w)
    assert fast.steps == slow.steps
    assert [i.steps for i in fast.instances] == [i.steps for i in slow.instances]   # every step, bit for bit
    for name in ("scheduled_s", "first_token_s", "finish_s", "max_itl_s", "emitted", "itl_s", "decode_instance"):
        assert getattr(fast.requests, name) == getattr(slow.requests, name), name
    assert summary(fast) == summary(slow)
    return fast


@pytest.mark.parametrize("router", [RoundRobin, LeastOutstandingTokens, LeastKvUse])
def test_decode_runs_give_the_step_by_step_result(router):
    """The loop's runs of decode-only steps (one call for many steps) give every step, token
    time and KV-block count of the one-event-per-step loop: a small pool (preemptions), a
    full batch with a queue, prompts ending on a block boundary, several instances."""
    w = synthetic({"requests": 300, "arrival": {"kind": "gamma", "rate_per_s": 12, "cv": 2},
                   "input_tokens": "uniform:16:900", "output_tokens": "uniform:2:400", "seed": 5})
    for blocks, seqs, instances in ((None, 256, 2), (None, 8, 2), (None, 16, 4), (180, 64, 2)):
        cost = SyntheticCost(0.01, 2e-6, 1e-8, kv_pool_bytes_per_chip=2e6)
        res = _same_runs(Fleet((pool(cost, instances=instances, blocks=blocks, router=router(), max_num_seqs=seqs,
                                          max_num_batched_tokens=512),)), w)
        assert check_invariants(res)["kv_blocks_left_at_end"] == 0
    assert res.preemptions > 0  # the small pool preempted


def test_runs_keep_the_decoding_sequences_state_between_runs(monkeypatch):
    """Runs of decode steps ended by finishes follow one another with the sequences' state
    kept (loop._DecodeState: no sequence updated run by run, the finished ones brought up to
    date as they leave), and so do the steps that admit beside them (ServingLoop._lazy_step;
    a sequence whose first token comes joins the state), and the runs of a prompt's chunks
    beside them: every step, token time and KV block of one event per step, aggregated (a
    pool small enough to stop runs on its blocks too, prompts in several chunks) and
    disaggregated; a router that reads the instances keeps no state."""
    kept = count_kept(monkeypatch)
    w = synthetic({"requests": 200, "arrival": {"kind": "poisson", "rate_per_s": 3},
                   "input_tokens": "uniform:100:400", "output_tokens": "uniform:100:600", "seed": 11})
    cost = SyntheticCost(0.01, 2e-6, 1e-8, kv_pool_bytes_per_chip=2e6)
    for blocks in (None, 150):
        _same_runs(Fleet((pool(cost, instances=2, blocks=blocks, max_num_seqs=64, max_num_batched_tokens=512),)), w)
        assert kept["runs"] > (150 if blocks is None else 20)
        kept["runs"] = 0
    prefill = attrs.evolve(pool(cost, max_num_batched_tokens=512), role="prefill")
    decode = attrs.evolve(pool(cost, instances=2, max_num_seqs=32), role="decode")
    _same_runs(Fleet((prefill, decode), transfer_s=lambda tokens, i, j: 1e-3 + 1e-7 * tokens), w)
    assert kept["runs"] > 300 and kept["steps"] > 100      # a KV's arrival is admitted beside the state's decodes
    kept["runs"] = 0
    _same_runs(Fleet((pool(cost, instances=2, router=LeastOutstandingTokens(), max_num_seqs=64,
                           max_num_batched_tokens=512),)), w)
    assert kept["runs"] == 0
    # prompts in several chunks: the runs of a prompt's chunks beside the state's decodes too
    long = synthetic({"requests": 150, "arrival": {"kind": "poisson", "rate_per_s": 3},
                      "input_tokens": "uniform:1500:4000", "output_tokens": "uniform:50:300", "seed": 7})
    _same_runs(Fleet((pool(cost, instances=2, max_num_seqs=64, max_num_batched_tokens=512),)), long)
    assert kept["chunks"] > 100 and kept["steps"] > 100


def test_a_decode_pool_whose_kv_is_full_runs_its_steps_at_once_while_its_queue_waits(monkeypatch):
    """A decode pool whose KV pool is full holds its queue below ``max_num_seqs`` (the
    first waiting sequence's blocks do not fit until a sequence finishes): nothing can be
    admitted in a run of decode steps, which only takes blocks, so the runs go on beside the
    queue (loop._may_admit), with every step, token time and KV block of one event per step;
    a queue whose first sequence fits still stops them."""
    kept = count_kept(monkeypatch)
    w = synthetic({"requests": 200, "arrival": {"kind": "poisson", "rate_per_s": 10}, "input_tokens": "uniform:200:400",
                   "output_tokens": "uniform:100:300", "seed": 4})
    cost = SyntheticCost(0.01, 2e-6, 1e-8, kv_pool_bytes_per_chip=2e6)
    prefill = attrs.evolve(pool(cost, max_num_batched_tokens=2048), role="prefill")
    decode = attrs.evolve(pool(cost, instances=2, blocks=200, max_num_seqs=64), role="decode")
    fleet = Fleet((prefill, decode), transfer_s=lambda tokens, i, j: 1e-3 + 1e-7 * tokens)
    waited = []
    admit = serve_loop.VllmScheduler.admit

    def admitting(sched, budget, picked, decoding=None):     # the queue while the batch is below its limit
        if sched.waiting and len(sched.running) < sched.s.max_num_seqs:
            waited.append(len(sched.waiting))
        return admit(sched, budget, picked, decoding)
    monkeypatch.setattr(serve_loop.VllmScheduler, "admit", admitting)
    fast = _same_runs(fleet, w)
    assert max(waited) > 20     # the KV pool, not max_num_seqs, held the queue
    assert kept["runs"] > 300
    events, loop = 0, ServingLoop(fleet, w, fast=True)
    loop.run(until=0.0)
    while loop.heap:
        loop.step()
        events += 1
    assert events < 0.5 * fast.steps


def test_may_admit_is_what_admit_does():
    """VllmScheduler.may_admit says whether its admit takes the first waiting sequence (its
    blocks, its chunk of the budget left, chunked prefill on or off), without changing it."""
    from g5core.api.serving import Seq
    from g5core.serve.scheduler import VllmScheduler
    for chunked in (True, False):
        for free in (0, 5, 6, 7, 40):
            for left in (0, 30, 100, 600):
                s = VllmScheduler(SchedulerSettings(max_num_batched_tokens=600, chunked_prefill=chunked,
                                                    block_size=16), 64)
                s.free_blocks = free
                seq = Seq(Request(0, 0.0, 90, 4))
                s.add(seq)
                said = s.may_admit(left)
                assert (seq.computed, seq.blocks, list(s.waiting)) == (0, 0, [seq])
                picked: list = []
                s.admit(left, picked)
                assert said == bool(picked), (chunked, free, left)


def test_decode_runs_match_with_prompts_in_several_prefill_steps():
    """Disaggregated, with prompts in several chunks: the step-by-step result, also where a
    decode run takes the step a prefill step's end or a KV arrival falls in (round robin over
    the decode pool: nothing reads a decode instance's state)."""
    w = synthetic({"requests": 150, "arrival": {"kind": "poisson", "rate_per_s": 6}, "input_tokens": "uniform:500:3000",
                   "output_tokens": "uniform:20:200", "seed": 3})
    cost = SyntheticCost(0.01, 2e-6, 1e-8, kv_pool_bytes_per_chip=2e6)
    prefill = attrs.evolve(pool(cost, max_num_batched_tokens=512), role="prefill")
    decode = attrs.evolve(pool(cost, instances=2, max_num_seqs=32), role="decode")
    fleet = Fleet((prefill, decode), transfer_s=lambda tokens, i, j: 1e-3 + 1e-7 * tokens)
    res = _same_runs(fleet, w)
    assert check_invariants(res)["kv_blocks_left_at_end"] == 0
    assert len(res.instances[0].steps) // 7 > 2 * 150 * 0.8     # most prompts took several steps
    # the decode pool is round robin: a run takes the step the next event falls in, then resumes
    decode.router.next = 0
    loop = ServingLoop(fleet, w)
    kinds = [loop.step()[1] for _ in iter(lambda: bool(loop.heap), False)]
    assert loop.soft_decode and kinds.count(Event.RESUME) > 100
    assert [i.steps for i in loop.result().instances] == [i.steps for i in res.instances]


def test_a_disaggregated_run_serves_its_prompts_first_then_its_decodes():
    """A disaggregated fleet whose decode pool is round robin runs in two passes (the prompts,
    then the decodes with every KV arrival known): every step, token time, KV block and the
    requests-in-system integral of one pass in time order, bit for bit; a run whose TTFT
    limit is sure to be missed stops in the prompts' pass, before any decode step; stepping
    event by event (or to a time) keeps one pass."""
    from g5core.serve.loop import MissWatch

    w = synthetic({"requests": 200, "arrival": {"kind": "poisson", "rate_per_s": 5}, "input_tokens": "uniform:500:3000",
                   "output_tokens": "uniform:20:300", "seed": 9})
    cost = SyntheticCost(0.01, 2e-6, 1e-8, kv_pool_bytes_per_chip=2e6)

    def fleet():
        prefill = attrs.evolve(pool(cost, instances=2, max_num_batched_tokens=512), role="prefill")
        decode = attrs.evolve(pool(cost, instances=2, max_num_seqs=32), role="decode")
        return Fleet((prefill, decode), transfer_s=lambda tokens, i, j: 1e-3 + 1e-7 * tokens)
    two = ServingLoop(fleet(), w)
    res = two.run()
    assert two.two_pass and two.phase == 2
    one = ServingLoop(fleet(), w)
    one.two_pass = False
    ref = one.run()
    assert [i.steps for i in res.instances] == [i.steps for i in ref.instances]
    assert res.requests_time_s == ref.requests_time_s and res.makespan_s == ref.makespan_s
    assert res.requests.itl_s == ref.requests.itl_s and summary(res) == summary(ref)
    _same_runs(fleet(), w)
    # a TTFT limit no run can meet: the prompts' pass is sure of the miss, no decode step ran
    missing = ServingLoop(fleet(), w, miss=MissWatch(parse_slo("ttft_p90=0.01s"), w.requests))
    assert missing.run() is None and missing.missed and missing.phase == 1
    assert all(len(i.steps) == 0 for i in missing.pools[1])
    stepped = ServingLoop(fleet(), w)
    while stepped.heap:
        stepped.step()
    assert stepped.phase == 0 and [i.steps for i in stepped.result().instances] == [i.steps for i in res.instances]


def test_decode_runs_past_other_instances_arrivals_under_round_robin():
    """Under round robin an instance's runs of decode steps stop only at its own arrivals
    (the router reads no state), after the step such an arrival falls in: the same steps as
    one event per step, also when the router's turn does not start at instance 0; fewer
    loop events than stopping at all."""
    w = synthetic({"requests": 200, "arrival": {"kind": "poisson", "rate_per_s": 20}, "input_tokens": 300,
                   "output_tokens": "uniform:50:300", "seed": 7})
    cost = SyntheticCost(0.01, 2e-6, 1e-8, kv_pool_bytes_per_chip=2e6)

    def fleet(turn):
        router = RoundRobin()
        router.next = turn
        return Fleet((pool(cost, instances=3, router=router, max_num_seqs=64),))
    for turn in (0, 2):
        slow = serve_requests(fleet(turn), w, fast=False)
        loop = ServingLoop(fleet(turn), w)
        fast = loop.run()
        assert [i.steps for i in fast.instances] == [i.steps for i in slow.instances]
        assert fast.requests.itl_s == slow.requests.itl_s and summary(fast) == summary(slow)
        assert loop.rr == (turn, 3)
    events = 0
    other = ServingLoop(fleet(2), w)
    other.rr = None     # every arrival stops every instance's run: more events, the same steps
    while other.heap:
        other.step()
        events += 1
    assert [i.steps for i in other.result().instances] == [i.steps for i in fast.instances]
    ours = ServingLoop(fleet(2), w)
    mine = resumed = 0
    while ours.heap:
        resumed += ours.step()[1] == Event.RESUME
        mine += 1
    assert mine < events
    # a run takes the step its own next arrival falls in too (the arrival changes nothing of it)
    assert resumed > 50 and [i.steps for i in ours.result().instances] == [i.steps for i in fast.instances]


def test_decode_runs_match_with_the_engine_and_disaggregation():
    """The same with the engine's step costs (the predictor's decode steps) and a prefill
    and a decode pool (the KV arriving at the decode instances stops a run)."""
    from g5core.serve.session import ServingSession

    raw = {**LLAMA8, "serving": {"disaggregation": {"prefill": {"instances": 1}, "decode": {"instances": 2}},
                                 "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 1024}}}
    wl = {"requests": 120, "arrival": {"kind": "poisson", "rate_per_s": 6.0}, "input_tokens": 900,
          "output_tokens": 200, "seed": 2}
    session = ServingSession(raw, wl)
    loop = _same_runs(session.fleet, session._workload(wl))
    assert loop.fleet.disaggregated and loop.steps > 120


def _events(fleet, w) -> int:
    loop = ServingLoop(fleet, w)
    n = 0
    while loop.heap:
        loop.step()
        n += 1
    return n


def test_runs_take_the_chunks_that_fill_the_budget_of_a_prompt_in_several_steps():
    """A prompt in several chunks: the steps whose chunk takes the rest of the token budget
    (after the running decodes' tokens) admit nothing and complete no prompt, so a run takes
    them at once, decodes and all, aggregated and in a disaggregated prefill pool (round
    robin or a router that reads the instances): every step, token time and KV block as one
    event per step, in fewer loop events than runs of decode-only steps alone."""
    w = synthetic({"requests": 200, "arrival": {"kind": "poisson", "rate_per_s": 4},
                   "input_tokens": "uniform:1500:4000", "output_tokens": "uniform:50:300", "seed": 7})
    cost = SyntheticCost(0.01, 2e-6, 1e-8, kv_pool_bytes_per_chip=2e6)
    agg = Fleet((pool(cost, instances=2, max_num_seqs=64, max_num_batched_tokens=512),))
    res = _same_runs(agg, w)
    # a mixed step: a chunk beside running decodes (columns: prefill tokens, decodes)
    rows = np.frombuffer(res.instances[0].steps, dtype=float).reshape(-1, 7)
    assert ((rows[:, 2] > 0) & (rows[:, 3] > 0)).sum() > 400
    # runs of decode-only steps alone: about 1,760 events (a chunk's step was one each)
    assert res.steps > 10000 and _events(agg, w) < 1200
    for router in (RoundRobin, LeastOutstandingTokens):
        prefill = attrs.evolve(pool(cost, instances=2, max_num_batched_tokens=512, router=router()), role="prefill")
        decode = attrs.evolve(pool(cost, instances=2, max_num_seqs=32), role="decode")
        fleet = Fleet((prefill, decode), transfer_s=lambda tokens, i, j: 1e-3 + 1e-7 * tokens)
        res = _same_runs(fleet, w)
        assert res.steps > 11000 and _events(fleet, w) < 2500    # about 4,400 one run per chunk before
        assert check_invariants(res)["kv_blocks_left_at_end"] == 0


def test_runs_of_chunks_match_with_the_engine():
    """The same with the engine's step costs: a prompt's budget-filling chunks beside running
    decodes, predicted as the step-by-step loop asks for them."""
    from g5core.serve.session import ServingSession

    raw = {**LLAMA8, "serving": {"instances": 2, "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 1024}}}
    wl = {"requests": 80, "arrival": {"kind": "poisson", "rate_per_s": 3.0}, "input_tokens": 3000,
          "output_tokens": 150, "seed": 4}
    session = ServingSession(raw, wl)
    res = _same_runs(session.fleet, session._workload(wl))
    rows = np.frombuffer(res.instances[0].steps, dtype=float).reshape(-1, 7)
    assert ((rows[:, 2] > 0) & (rows[:, 3] > 0)).sum() > 40


def test_the_decode_stepper_gives_the_predictors_latency_bit_for_bit():
    """A run's stepper (its cells of the context grid kept along the run) gives every step
    the latency the predictor gives that step built whole, on a fresh cost each (nothing
    shared through a cache): batches on and between the batch grid's points, contexts
    crossing several grid cells."""
    from g5core.serve.cost import PlanCost

    def step_s(groups):     # a smooth, non-linear stand-in for the engine
        return sum(1e-5 * n * k + 3e-9 * (c + n) ** 1.1 * k + 1e-6 * math.sqrt(k) for n, c, k in groups)

    rng = np.random.default_rng(3)
    for b in (1, 4, 5, 16, 37, 100):
        contexts = tuple(sorted(int(c) for c in rng.integers(1, 3000, b)))
        run, whole = PlanCost(step_s), PlanCost(step_s)
        stepper = run.decode_stepper(contexts)
        total = sum(contexts)
        for j in range(0, 5000, 7):
            assert stepper(j, total + j * b) == whole.latency_s(StepWork((), tuple(c + j for c in contexts)))


def test_an_arrival_rate_past_any_deployment_is_refused_and_an_unbounded_offered_rate_is_none():
    """A fuzzer case (``--rate 1e+300``, gamma cv 100) printed a traceback: the offered rate
    ``requests / arrival span`` overflowed to inf, which JSON cannot hold. A rate above
    MAX_RATE_PER_S is refused, naming the field; a span too short for the rate to be a
    finite number gives ``None``."""
    from g5core.serve.workload import MAX_RATE_PER_S

    for kind in ("poisson", "gamma"):
        arrival = {"kind": kind, "rate_per_s": 1e300, **({"cv": 100} if kind == "gamma" else {})}
        with pytest.raises(ConfigError, match="rate_per_s"):
            synthetic({"requests": 20, "arrival": arrival, "input_tokens": 100, "output_tokens": 10})
    assert synthetic({"requests": 20, "arrival": {"kind": "poisson", "rate_per_s": MAX_RATE_PER_S},
                      "input_tokens": 100, "output_tokens": 10}).requests
    w = Workload((Request(0, 0.0, 100, 4), Request(1, 5e-324, 100, 4)))
    res = run(w, pool(SyntheticCost(0.01)))
    assert summary(res)["throughput"]["offered_requests_per_s"] is None


def test_a_synthetic_workload_is_made_once_per_process_and_a_trace_read_each_time(tmp_path):
    """The serving search sizes every candidate's session with the same synthetic workload:
    it is made once per process (a Workload is immutable); a trace file is read again each
    time (it may change)."""
    from g5core.serve.session import _synthetic_once

    spec = {"requests": 50, "arrival": {"kind": "poisson", "rate_per_s": 2.0}, "input_tokens": 100,
            "output_tokens": 10, "seed": 4}
    made = []

    def make():
        made.append(1)
        return synthetic(spec)
    first = _synthetic_once(spec, make)
    assert _synthetic_once(dict(spec), make) is first and len(made) == 1
    assert _synthetic_once({**spec, "seed": 5}, make) is not first and len(made) == 2
    trace = {"trace": str(tmp_path / "t.csv")}
    _synthetic_once(trace, make)
    _synthetic_once(trace, make)
    assert len(made) == 4


def test_the_chunk_stepper_gives_the_predictors_latency_bit_for_bit():
    """A run of a prompt's chunks (its token grid points and cached-token cells kept along
    the run) gives every step the latency the predictor gives that step built whole, on a
    fresh cost each: chunks on and off the token grid (below and past the grid's jumps),
    with no decodes and beside decodes, cached tokens crossing several grid cells."""
    from g5core.serve.cost import PlanCost

    def step_s(groups):     # a smooth, non-linear stand-in for the engine
        return sum(1e-5 * n * k + 3e-9 * (c + n) ** 1.1 * k + 1e-6 * math.sqrt(k) for n, c, k in groups)

    rng = np.random.default_rng(4)
    for per, b in ((64, 0), (96, 0), (1000, 0), (24, 8), (500, 12), (1536, 37), (2047, 1)):
        contexts = tuple(sorted(int(c) for c in rng.integers(1, 3000, b)))
        run, whole = PlanCost(step_s), PlanCost(step_s)
        stepper = run.chunk_stepper(per, contexts)
        for j in range(0, 300, 3):
            work = StepWork(((per, 17 * (j % 5) + j * per),), tuple(c + j for c in contexts))
            assert stepper(work.chunks[0][1], j) == whole.latency_s(work)
        assert run.predicted_steps()[-1] == work


def test_the_predictor_check_names_the_step_it_is_worst_on():
    """``g5 serve``'s predictor line names the step the predictor is furthest from the engine
    on (a Qwen3 prefill pool's 4,000-token prompts were 7.7% over the engine, the cell's line
    lifted by a step inside it), and its JSON carries it."""
    from g5core.serve.cost import PlanCost
    from g5core.serve.present import _worst_text

    def step_s(groups):     # smooth but for a step at 3,000 tokens inside the grid's cell (2,048, 3,072]
        return sum((2e-5 * n + (5e-3 if 3000 <= n else 0.0)) * k + 1e-8 * c * k for n, c, k in groups)

    cost = PlanCost(step_s)
    sample = [StepWork(((2100, 0),), ()), StepWork(((2900, 0),), ()), StepWork((), (500, 700))]
    got = cost.predictor_error(sample)
    worst = got["worst"]
    assert worst["chunks"] == [[2900, 0]] and worst["decodes"] == 0
    assert worst["predicted_s"] == cost.latency_s(sample[1], False) and worst["engine_s"] == step_s(((2900, 0, 1),))
    assert got["max_rel"] == abs(worst["predicted_s"] / worst["engine_s"] - 1)
    text = _worst_text(worst)
    assert text.startswith(" (worst: a 2,900-token chunk, ") and text.endswith("ms by the engine)")
    assert _worst_text({**worst, "chunks": [[500, 4096]], "decodes": 1, "decode_context_tokens": 900}).startswith(
        " (worst: a 500-token chunk after 4,096 cached beside 1 decode at 900 tokens of context")
    assert _worst_text({**worst, "predicted_s": worst["engine_s"]}) == ""      # within 1%: not named


def test_a_step_on_a_kept_state_is_priced_from_its_counts_bit_for_bit():
    """PlanCost.joined_step_s (the serving loop's step of a kept decode state with what its
    scheduler admits: prompt chunks, decodes joining at their own contexts) gives the
    latency the predictor gives the step built whole, keeps it under the same key, and
    the predictor check reads the step as built (PredictedSteps builds only what it reads)."""
    from g5core.serve.cost import JoinedStep, PlanCost

    def step_s(groups):     # a smooth, non-linear stand-in for the engine
        return sum(1e-5 * n * k + 3e-9 * (c + n) ** 1.1 * k + 1e-6 * math.sqrt(k) for n, c, k in groups)

    rng = np.random.default_rng(7)
    run, whole = PlanCost(step_s), PlanCost(step_s)
    for chunks, b, joined in ((((2000, 0),), 0, ()), (((900, 4096),), 17, ()), ((), 40, (3000, 11)),
                              (((128, 0), (64, 512)), 5, (700,)), ((), 1, (5,))):
        base = sorted(int(c) for c in rng.integers(1, 3000, b))
        for k in (0, 3, 250):
            work = StepWork(chunks, tuple(sorted([c + k for c in base] + list(joined))))
            got = run.joined_step_s(JoinedStep(chunks, base, k, sum(base) + k * b, joined))
            assert got == whole.latency_s(work)
            assert run.latency_s(work) == got                 # the same key: a hit
            assert run.predicted_steps()[-1] == work
    steps = run.predicted_steps()
    assert list(steps) == [steps[i] for i in range(len(steps))] == list(whole.predicted_steps())


def test_goodput_under_percentile_limits_counts_requests_and_states_the_verdict():
    """Issue 35: under ``ttft_p50=0.25s`` the share is per request (half the TTFTs are at
    most 0.25 s), never 100% beside a missed percentile, and the verdict is stated apart."""
    from g5core.serve.present import render_goodput

    reqs = tuple(Request(k, 10.0 * k, 100 * (k + 1), 5) for k in range(4))
    res = run(Workload(reqs), pool(SyntheticCost(0.0, 1e-3)))
    g = summary(res, parse_slo("ttft_p90=0.25s"))["goodput"]
    # TTFTs 0.1, 0.2, 0.3, 0.4 s: two requests meet 0.25 s; the p90 (0.37 s) misses it
    assert g["requests_meeting"] == 2 and g["share"] == 0.5
    assert g["verdict"] == "missed" and not g["all_met"] and not g["percentile_limits"]["ttft_p90"]["met"]
    text = "\n".join(render_goodput(g))
    assert "50.0% of requests each have ttft <= 250 ms" in text and "SLO          missed: ttft_p90 = " in text
    assert "100.0%" not in text
    ok = summary(res, parse_slo("ttft_p90=0.5s,tpot=1s"))["goodput"]
    assert ok["share"] == 1.0 and ok["verdict"] == "met"
    assert "every request meets tpot" in "\n".join(render_goodput(ok))


# -- prefill steps apart from decode (SGLang's default) --------------------------------------


def test_without_mixed_prefill_a_step_that_can_prefill_takes_only_prefills():
    """mixed_prefill: false (SGLang's enable_mixed_chunk False): while a prompt has tokens left
    or the queue's head can be admitted, a step takes prefills only and the decodes wait;
    otherwise it is the decodes' step. With mixed_prefill (the default) the same state mixes."""
    from g5core.api.serving import Seq
    from g5core.serve.scheduler import VllmScheduler

    def state(mixed):
        s = VllmScheduler(SchedulerSettings(max_num_batched_tokens=256, block_size=16, mixed_prefill=mixed), 1000)
        for i in range(3):                      # three decoding sequences (10 prompt tokens, one emitted)
            q = Seq(Request(i, 0.0, 10, 5))
            s.add(q)
        s.finish_step(s.schedule())
        return s

    for mixed in (True, False):
        s = state(mixed)
        assert [q.scheduled for q in s.schedule()] == [1, 1, 1]      # nothing waits: a decode step
        for q in s.running:
            q.scheduled = 0
        s.add(Seq(Request(9, 1.0, 600, 5)))                             # a long prompt arrives
        picked = s.schedule()
        if mixed:
            assert [q.req.id for q in picked] == [0, 1, 2, 9] and picked[-1].scheduled == 256 - 3
        else:
            assert [q.req.id for q in picked] == [9] and picked[0].scheduled == 256
            s.finish_step(picked)
            nxt = s.schedule()                                          # its next chunk: still prefill only
            assert [q.req.id for q in nxt] == [9] and nxt[0].scheduled == 256
    # a decode pool's arrival (its prompt computed elsewhere, its first token emitted) decodes:
    # it joins the running decodes, as SGLang's decode server merges its prebuilt batch
    s = state(False)
    s.add(Seq(Request(7, 1.0, 40, 5), computed=40, emitted=1))
    assert [(q.req.id, q.scheduled) for q in s.schedule()] == [(0, 1), (1, 1), (2, 1), (7, 1)]


def test_without_mixed_prefill_runs_give_the_step_by_step_result_and_decodes_wait():
    w = synthetic({"requests": 200, "arrival": {"kind": "poisson", "rate_per_s": 10},
                   "input_tokens": "uniform:16:900", "output_tokens": "uniform:2:300", "seed": 7})
    cost = SyntheticCost(0.01, 2e-6, 1e-8, kv_pool_bytes_per_chip=2e6)
    apart = _same_runs(Fleet((pool(cost, instances=2, max_num_batched_tokens=512, mixed_prefill=False),)), w)
    mixed = _same_runs(Fleet((pool(cost, instances=2, max_num_batched_tokens=512),)), w)
    assert check_invariants(apart)["kv_blocks_left_at_end"] == 0
    a, m = summary(apart), summary(mixed)
    # a prefill no longer waits behind the decodes' tokens, and the decodes wait for prefills
    assert a["ttft_s"]["p50"] < m["ttft_s"]["p50"]
    assert max(apart.requests.max_itl_s) > max(mixed.requests.max_itl_s)


@pytest.mark.parametrize("extra", [{"serving": {"prefix_cache": {"policy": "lru"}}},
                                   {"speculative": {"method": "eagle", "tokens": 3, "acceptance": 0.6}}],
                         ids=["block cache", "speculative"])
def test_without_mixed_prefill_no_step_mixes_under_the_block_cache_and_speculative_decoding(extra):
    """The caching and the speculative schedulers keep the policy: every step of the run
    holds prefill tokens or decodes, never both; with the default, steps mix."""
    wl = {"requests": 40, "arrival": {"kind": "poisson", "rate_per_s": 20}, "input_tokens": "uniform:200:3000",
          "output_tokens": "uniform:8:64", "seed": 3, "prefix": {"tokens": 512, "groups": 2}}

    def steps(mixed):
        raw = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 1,
               "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1}, **extra}
        raw["serving"] = {**raw.get("serving", {}), "workload": wl,
                          "scheduler": {"mixed_prefill": mixed, "max_num_batched_tokens": 1024}}
        res = simulate_serving(raw, check_predictor=0)
        assert check_invariants(res.loop)["kv_blocks_left_at_end"] == 0
        rows = np.asarray(res.loop.instances[0].steps).reshape(-1, 7)
        return rows[:, 2], rows[:, 3]      # prefill tokens, decodes

    prefill, decodes = steps(False)
    assert not np.any((prefill > 0) & (decodes > 0)) and np.any(prefill > 0) and np.any(decodes > 0)
    prefill, decodes = steps(True)
    assert np.any((prefill > 0) & (decodes > 0))


def test_mixed_prefill_must_be_a_boolean():
    with pytest.raises(ConfigError, match=r"^serving.scheduler.mixed_prefill: must be true or false"):
        SchedulerSettings.from_dict({"mixed_prefill": "no"})


def test_a_disaggregated_fleet_serves_alike_with_prefill_steps_apart_and_its_runs_hold(monkeypatch):
    """Without mixed_prefill a prefill pool has no decodes to hold back and a decode pool's
    arrivals decode (they join the running batch): the fleet serves as with mixed steps, every
    step the same, while nothing is preempted (a preempted sequence recomputes its prompt, in
    a prefill step of its own); the loop's runs and lazy steps give the step-by-step result, a
    full decode KV pool's queue and its preemptions included."""
    kept = count_kept(monkeypatch)
    w = synthetic({"requests": 200, "arrival": {"kind": "poisson", "rate_per_s": 10}, "input_tokens": "uniform:200:900",
                   "output_tokens": "uniform:50:300", "seed": 4})
    cost = SyntheticCost(0.01, 2e-6, 1e-8, kv_pool_bytes_per_chip=2e6)

    def fleet(mixed, blocks):
        prefill = attrs.evolve(pool(cost, max_num_batched_tokens=512, mixed_prefill=mixed), role="prefill")
        decode = attrs.evolve(pool(cost, instances=2, blocks=blocks, max_num_seqs=64, mixed_prefill=mixed),
                              role="decode")
        return Fleet((prefill, decode), transfer_s=lambda tokens, i, j: 1e-3 + 1e-7 * tokens)

    for blocks in (None, 200):
        apart = _same_runs(fleet(False, blocks), w)
        mixed = _same_runs(fleet(True, blocks), w)
        preempted = summary(apart)["preemptions"]
        assert (preempted > 0) is (blocks is not None)
        assert ([i.steps for i in apart.instances] == [i.steps for i in mixed.instances]) is (not preempted)
    assert kept["runs"] > 100 and kept["steps"] > 100
