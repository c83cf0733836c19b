"""The block cache per attention-DP rank (``parallel.dp > 1`` with ``serving.prefix_cache``
or ``serving.kv_tiers``): each rank owns a cache over its own share of the KV pool and its
own tiers; a request hits only what its own rank cached; the figures are summed over ranks."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from g5core.inputs.kv_tiers import TierSpec
from g5core.serve.api import simulate_serving
from g5core.serve.cost import DpCost, PlanCost
from g5core.serve.kvcache import CacheConfig, CachingScheduler
from g5core.serve.loop import Fleet, Pool, check_invariants, serve_requests
from g5core.serve.metrics import kv_cache
from g5core.serve.router import RoundRobin
from g5core.serve.scheduler import DpScheduler, SchedulerSettings
from g5core.serve.workload import Request, Workload, synthetic

MOE = {"model": "qwen3-30b-a3b", "system": "h200"}


def moe(dp: int, **serving) -> dict:
    return {**MOE, "chips": dp, "parallel": {"dp": dp, "tp": 1, "pp": 1, "cp": 1, "ep": dp},
            "serving": {"scheduler": {"max_num_batched_tokens": 2048, "max_num_seqs": 16}, **serving}}


def runner(groups):
    """A stand-in for one rank's engine step: 5 ms, 20 us a prefill token, 50 us a decode."""
    return 5e-3 + sum(k * (5e-5 if n == 1 else 2e-5 * n) for n, c, k in groups)


def prefixed(names):
    """One request a second, each a 65-token prompt whose first 64 tokens (4 blocks of 16)
    are the shared prefix ``name``, and one output token."""
    return Workload(tuple(Request(k, float(k), 65, 1, 0, ((n, 64),)) for k, n in enumerate(names)))


def hbm_hits(sched, n):
    """Request ``k``'s HBM hit blocks, from the rank that served it."""
    rows = {}
    for r in sched.ranks:
        rows.update(r.per_request)
    return [rows[k][0] for k in range(n)]


def test_the_block_cache_runs_per_rank_and_each_rank_hits_its_own_repeats():
    """Round robin over 2 ranks: A and C go to rank 0, B and D to rank 1; each repeat lands
    on the rank that cached it and hits its 4 blocks (the refusal of a cache with dp > 1 is
    gone)."""
    res = simulate_serving(moe(2, prefix_cache={}), prefixed("ABCDABCD"), runner=runner, check_predictor=0,
                           exact=True)
    sched = res.loop.instances[0].scheduler
    assert isinstance(sched, DpScheduler) and all(isinstance(r, CachingScheduler) for r in sched.ranks)
    assert hbm_hits(sched, 8) == [0, 0, 0, 0, 4, 4, 4, 4]
    # each rank saw its own 4 requests; its pool is its share of the instance's
    assert [r.lookup_blocks for r in sched.ranks] == [16, 16]
    assert [r.total_blocks * 2 for r in sched.ranks] == [sched.total_blocks] * 2
    kv = res.summary["kv_cache"]
    assert kv["lookup_blocks"] == 32 and kv["tiers"][0]["hit_blocks"] == 16
    assert [(r["rank"], r["lookup_blocks"], r["hbm_hit_blocks"]) for r in kv["ranks"]] == [(0, 16, 8), (1, 16, 8)]
    # a block's bytes are one rank's chips' (one chip here), not the instance's two
    assert kv["tiers"][0]["block_bytes"] == res.pools[0]["kv_bytes_per_token_per_chip"] * 16
    assert not any(res.conservation.values()) and "kv_cache_blocks_in_two_places" in res.conservation


def test_a_repeat_that_round_robin_sends_to_another_rank_misses():
    """A, A, A over 2 ranks: the second A goes to rank 1, which never saw A, and misses; the
    third is back on rank 0 and hits. With one rank every repeat hits."""
    res = simulate_serving(moe(2, prefix_cache={}), prefixed("AAA"), runner=runner, check_predictor=0, exact=True)
    sched = res.loop.instances[0].scheduler
    assert list(sched.added) == [2, 1]
    assert hbm_hits(sched, 3) == [0, 0, 4]
    assert res.summary["kv_cache"]["hit_rate"] == pytest.approx(4 / 12)
    # shortest_queue: each request arrives to an empty instance and picks rank 0: all hit
    res = simulate_serving(moe(2, prefix_cache={}, dp_balance="shortest_queue"), prefixed("AAA"), runner=runner,
                           check_predictor=0, exact=True)
    assert hbm_hits(res.loop.instances[0].scheduler, 3) == [0, 4, 4]


def test_conservation_holds_per_rank_with_tiers_and_evictions():
    """4 caching ranks of 250 blocks each with a host and a disk tier, under conversations
    that overflow them: every rank's cache keeps its invariants, its bytes moved are its blocks
    moved times the block bytes, no rank's HBM holds more than its share, and the instance's
    figures are the ranks' sums."""
    w = synthetic({"requests": 80, "arrival": {"kind": "poisson", "rate_per_s": 4}, "input_tokens": 300,
                   "output_tokens": 20, "conversation": {"turns": 5, "think_s": 4}, "seed": 3})
    tiers = (TierSpec("host", 300 * 16 * 2.0, 10.0, 5.0, 1e-5), TierSpec("disk", 1000 * 16 * 2.0, 1.0, 0.5, 1e-4))
    cache = CacheConfig(tiers=tiers, miss="fetch", kv_bytes_per_token_per_chip=2.0, kv_bytes_per_token=2.0)
    factory = functools.partial(DpScheduler, dp=4, factory=functools.partial(CachingScheduler, cache=cache))
    pool = Pool("serve", 1, DpCost(PlanCost(runner, exact=True), 4), SchedulerSettings(max_num_batched_tokens=1024),
                1000, RoundRobin(), factory)
    res = serve_requests(Fleet((pool,)), w)
    out = check_invariants(res)
    assert not any(out.values()), out
    assert {"kv_cache_blocks_in_two_places", "kv_cache_bytes_moved_mismatch", "requests_not_on_one_rank"} <= set(out)
    sched = res.instances[0].scheduler
    block_bytes = 2.0 * 16
    for r in sched.ranks:
        assert not any(r.check().values()), r.check()
        assert r.total_blocks == 250
        c = r.counts
        assert c["evicted_blocks"][0] > 0 and c["stored_blocks"][1] > 0
        for t in (1, 2):
            assert c["bytes_written"][t] == c["stored_blocks"][t] * block_bytes
            assert c["bytes_read"][t] == c["fetched_blocks"][t] * block_bytes
        occ = np.frombuffer(r.occupancy, dtype=float).reshape(-1, 4)
        assert occ[:, 1].max() <= 250 and occ[:, 2].max() <= 300 and occ[:, 3].max() <= 1000
        assert r.empty + len(r.evictable) == 250 and not r.ref
    kv = kv_cache(res)
    for level, name in enumerate(("hbm", "host", "disk")):
        row = kv["tiers"][level]
        assert row["tier"] == name
        for key in ("hit_blocks", "fetched_blocks", "evicted_blocks", "stored_blocks", "bytes_read"):
            assert row[key] == sum(r.counts[key][level] for r in sched.ranks)
    assert sum(r["lookup_blocks"] for r in kv["ranks"]) == kv["lookup_blocks"]
    assert [r["hbm_evicted_blocks"] for r in kv["ranks"]] == [r.counts["evicted_blocks"][0] for r in sched.ranks]


def test_the_step_waits_for_the_slowest_ranks_loads():
    """Two ranks fetch in the same step: the instance's step is the formula at the longer
    load, and both requests' fetch wait is that step's excess over its compute."""
    from g5core.serve.kvcache import loaded_step_s
    tiers = (TierSpec("host", 1e12, 1.0, 1.0, 1e-3),)
    cache = CacheConfig(tiers=tiers, miss="fetch", overlap=True, layers=4)
    sched = DpScheduler(SchedulerSettings(max_num_batched_tokens=8192), 2 * 600, 2,
                        factory=functools.partial(CachingScheduler, cache=cache))
    # rank 0 will fetch 10 blocks, rank 1 30: put them in the host tier by hand
    for rank, name, n in ((0, "x", 10), (1, "y", 30)):
        r = sched.ranks[rank]
        for j in range(n):
            r._store((name, j), 0, traffic=False)
    from g5core.api.serving import Seq
    sched.add(Seq(Request(0, 0.0, 10 * 16 + 1, 1, 0, ((("x"), 10 * 16),))))
    sched.add(Seq(Request(1, 0.0, 30 * 16 + 1, 1, 0, ((("y"), 30 * 16),))))
    sched.now = 0.0
    picked = sched.schedule()
    assert len(picked) == 2
    latency = sched.step_latency_s(0.0, 0.02, picked)
    load = 30 * 16 / 1e9 + 1e-3
    assert latency == loaded_step_s(0.02, load, True, 4)
    assert sched.ranks[0].per_request[0][3] == sched.ranks[1].per_request[1][3] == latency - 0.02


def test_text_csv_and_trace_show_each_ranks_cache():
    import io
    import json

    from g5core.serve.present import dump_trace, render_summary, write_requests_csv
    res = simulate_serving(moe(2, prefix_cache={}), prefixed("ABCDABCD"), runner=runner, check_predictor=0,
                           exact=True)
    assert "per rank   0: 50.0% of 16, 1: 50.0% of 16" in render_summary(res.to_json_dict())
    fh = io.StringIO()
    write_requests_csv(res.loop, fh)
    rows = fh.getvalue().splitlines()
    head = rows[0].split(",")
    assert [int(r.split(",")[head.index("hbm_hit_blocks")]) for r in rows[1:]] == [0, 0, 0, 0, 4, 4, 4, 4]
    fh = io.StringIO()
    dump_trace(res.loop, fh)
    names = {e["name"] for e in json.loads(fh.getvalue())["traceEvents"] if e["ph"] == "C"}
    assert {"KV cache blocks, rank 0", "KV cache blocks, rank 1"} <= names
