"""The block-level prefix cache, its tiers and their links (g5core.serve.kvcache)."""
from __future__ import annotations

import functools
import json
import pathlib

import numpy as np
import pytest

from g5core.inputs.kv_tiers import TierSpec
from g5core.serve.cost import SyntheticCost
from g5core.serve.kvcache import CacheConfig, CachingScheduler, Link, block_hashes
from g5core.serve.loop import Fleet, Pool, check_invariants, serve_requests
from g5core.serve.router import RoundRobin
from g5core.serve.scheduler import SchedulerSettings
from g5core.serve.traces import read_trace
from g5core.serve.workload import Request, Workload, synthetic

ROOT = pathlib.Path(__file__).resolve().parents[1]


def caching(cost, blocks, cache=CacheConfig(), **sched):
    return Pool("serve", 1, cost, SchedulerSettings(**sched), blocks, RoundRobin(),
                functools.partial(CachingScheduler, cache=cache))


def run(workload, pool):
    res = serve_requests(Fleet((pool,)), workload)
    assert not any(check_invariants(res).values())
    sched = res.instances[0].scheduler
    assert not any(sched.check().values()), sched.check()
    return res, sched


def cycle(names, repeats):
    """One request a second, each a 65-token prompt whose first 64 tokens (4 blocks of 16)
    are the shared prefix ``name``, and one output token: each leaves exactly its prefix's
    4 blocks cached."""
    seq = [n for _ in range(repeats) for n in names]
    return Workload(tuple(Request(k, float(k), 65, 1, 0, ((n, 64),)) for k, n in enumerate(seq)))


def hits(sched, n):
    return [sched.per_request[k][0] for k in range(n)]


def test_a_cache_larger_than_the_working_set_hits_every_repeat():
    w = cycle("ABC", 3)
    # 3 prefixes x 4 blocks + the running request's partial block: 13 blocks hold it all
    for blocks in (13, 10_000):
        _, s = run(w, caching(SyntheticCost(0.01), blocks))
        assert hits(s, 9) == [0, 0, 0, 4, 4, 4, 4, 4, 4]
        assert s.counts["evicted_blocks"][0] == 0


def test_one_block_less_evicts_in_lru_order():
    """12 blocks. Pass 1: A, B take 5 empty blocks each and leave their prefix cached (freed
    last block first: A3 A2 A1 A0, then B's); C takes the last 2 empty blocks and evicts the
    least recently freed, A3. A again: A0-A2 hit, A3 missed; its 2 new blocks are the empty
    one and B3 (the oldest free). B: B0-B2 hit, evicts C3; C: C0-C2 hit, evicts A3; and so
    on: 3 hits a request from then on."""
    _, s = run(cycle("ABC", 3), caching(SyntheticCost(0.01), 12))
    assert hits(s, 9) == [0, 0, 0, 3, 3, 3, 3, 3, 3]
    # evictions: A3 in pass 1, then one per request
    assert s.counts["evicted_blocks"][0] == 1 + 6
    assert s.lookup_blocks == 9 * 4


def test_shared_blocks_count_once_and_the_pool_never_exceeds_its_size():
    # 8 requests at once on one prefix of 64 blocks: the prefix is held once
    w = Workload(tuple(Request(k, 0.0 if k else 0.0, 1025 + 16 * k, 50, 0, (("P", 1024),)) for k in range(8)))
    _, s = run(Workload(w.requests[:1]), caching(SyntheticCost(0.01), 400))
    res, s = run(Workload(tuple(Request(k, 1.0 * (k > 0), r.input_tokens, 50, 0, r.prefix)
                                for k, r in enumerate(w.requests))), caching(SyntheticCost(0.01), 400))
    assert [s.per_request[k][0] for k in range(8)] == [0] + [64] * 7
    used = np.frombuffer(res.instances[0].steps, dtype=float).reshape(-1, 7)[:, 4]
    # 7 requests at once: 64 shared blocks + each its own ~ (16 k + 51 tokens) blocks, not 7 x 64
    assert used.max() <= 400 and used.max() < 7 * 64
    occ = np.frombuffer(s.occupancy, dtype=float).reshape(-1, 2)
    assert occ[:, 1].max() <= 400


def test_conservation_with_tiers_bytes_moved_are_blocks_times_block_bytes():
    w = synthetic({"requests": 60, "arrival": {"kind": "poisson", "rate_per_s": 3}, "input_tokens": 2000,
                   "output_tokens": 40, "conversation": {"turns": 5, "think_s": 4}, "seed": 1})
    tiers = (TierSpec("host", 2000 * 16 * 2.0, 10.0, 5.0, 1e-5), TierSpec("disk", 8000 * 16 * 2.0, 1.0, 0.5, 1e-4))
    cache = CacheConfig(tiers=tiers, miss="fetch", kv_bytes_per_token_per_chip=2.0, kv_bytes_per_token=16.0)
    res, s = run(w, caching(SyntheticCost(0.01, 1e-5, 1e-8), 1000, cache, max_num_batched_tokens=1024))
    c = s.counts
    assert c["fetched_blocks"][1] > 0 and c["stored_blocks"][2] > 0 and c["evicted_blocks"][1] > 0
    block_bytes = 16.0 * 16
    for t in (1, 2):
        assert c["bytes_written"][t] == c["stored_blocks"][t] * block_bytes
        assert c["bytes_read"][t] == c["fetched_blocks"][t] * block_bytes
    occ = np.frombuffer(s.occupancy, dtype=float).reshape(-1, 4)
    assert occ[:, 1].max() <= 1000
    assert occ[:, 2].max() <= s.tiers[0].capacity_blocks == 2000
    assert occ[:, 3].max() <= s.tiers[1].capacity_blocks == 8000
    # at the end every block is in one place: HBM's cached blocks are all free
    assert s.empty + len(s.evictable) == 1000 and not s.ref


def test_fetch_time_on_an_idle_link_and_two_fetches_share_it():
    link = Link()
    b, bw, lat = 3.0e9, 25.0, 2e-5
    assert link.end_s(1.0, b, bw, lat) == pytest.approx(1.0 + b / 25e9 + lat, rel=1e-15)
    first = link.reserve(1.0, b, bw, lat)
    second = link.reserve(1.0, b, bw, lat)
    assert first == pytest.approx(1.0 + b / 25e9 + lat, rel=1e-15)
    assert second == pytest.approx(1.0 + 2 * b / 25e9 + lat, rel=1e-15)
    # an idle link again later
    assert link.reserve(5.0, b, bw, lat) == pytest.approx(5.0 + b / 25e9 + lat, rel=1e-15)


def test_a_step_waits_for_its_load_overlapped_layer_by_layer():
    """A turn whose history is on the host: with overlap its prefill step takes max(compute,
    load) + min / layers; without, compute + load."""
    tiers = (TierSpec("host", 1e12, 1.0, 1.0, 1e-3),)
    # history c (256 blocks) cached; history d (513 blocks) evicts c's last 169 to the host;
    # c again: 87 blocks hit in HBM, 169 fetched, the rest computed
    reqs = (Request(0, 0.0, 4097, 1, 0, (), None, "c"), Request(1, 10.0, 8193, 1, 0, (), None, "d"),
            Request(2, 20.0, 8193, 1, 0, (), None, "c"))
    results = {}
    for overlap in (True, False):
        cache = CacheConfig(tiers=tiers, miss="fetch", overlap=overlap, layers=4)
        res, s = run(Workload(reqs), caching(SyntheticCost(0.01, 1e-6), 600, cache, max_num_batched_tokens=8192))
        results[overlap] = (res, s)
    res, s = results[True]
    assert s.per_request[2][:3] == [87, 169, 0]
    # on the link, ahead of the fetch: the offloads its own new blocks caused (request 1's
    # 169, at 10 s, are long done): the link carries both, one after the other
    offloaded_now = s.counts["stored_blocks"][1] - 169
    assert offloaded_now > 0
    load = (offloaded_now + 169) * 16 / 1e9 + 1e-3
    compute = 0.01 + 1e-6 * (8193 - 256 * 16)
    assert s.per_request[2][3] == pytest.approx(max(compute, load) + min(compute, load) / 4 - compute, rel=1e-9)
    _, s2 = results[False]
    assert s2.per_request[2][3] == pytest.approx(load, rel=1e-9)


def test_block_hashes_follow_the_prefix_chain_and_the_history():
    r = Request(7, 0.0, 100, 1, 0, (("a", 32), ("b", 50)))
    assert block_hashes(r, 0, 5, 16) == [("a", 0), ("a", 1), ("b", 2), (7, 3), (7, 4)]
    h = Request(8, 0.0, 100, 1, 0, (), None, "c3")
    assert block_hashes(h, 2, 4, 16) == [("c3", 2), ("c3", 3)]


def test_mooncake_hit_rate_unbounded_is_the_share_of_repeated_hash_ids():
    """Every request of the sample runs alone (a 0.1 us step), in 512-token blocks, the
    trace's own: the hit rate is the share of the hash ids that cover a whole block of the
    prompt before its last token (what a cache can hit) and did so in an earlier request (a
    partial block is never cached: the sample's id 1 first covers a 127-token prompt, so its
    next use is a miss)."""
    path = ROOT / "examples" / "traces" / "sample-mooncake.jsonl"
    seen, repeated, total = set(), 0, 0
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        full = (rec["input_length"] - 1) // 512
        for h in rec["hash_ids"][:full]:
            repeated += h in seen
            total += 1
        seen.update(rec["hash_ids"][:full])
    w = read_trace(path)
    _, s = run(w, caching(SyntheticCost(1e-7, kv_pool_bytes_per_chip=1e12), 10 ** 6, block_size=512))
    assert s.lookup_blocks == total
    assert s.counts["hit_blocks"][0] == repeated
    assert s.counts["evicted_blocks"][0] == 0


def test_an_unbounded_block_cache_without_tiers_gives_todays_results_bit_for_bit():
    """Shared prefixes of whole blocks, requests one after another: the block cache and the
    never-evicting one hit the same tokens, so every time is the same."""
    from g5core.serve.loop import Pool as P
    w = synthetic({"requests": 40, "arrival": {"kind": "poisson", "rate_per_s": 1}, "input_tokens": "uniform:100:900",
                   "output_tokens": "uniform:1:30", "prefix": {"groups": 3, "tokens": 1024}, "seed": 2})
    cost = SyntheticCost(0.01, 1e-5, 1e-8)
    old = serve_requests(Fleet((P("serve", 1, cost, SchedulerSettings(), 10 ** 6, RoundRobin()),)), w)
    new, s = run(w, caching(cost, 10 ** 6))
    assert sum(row[0] for row in s.per_request.values()) > 0
    for name in ("arrival_s", "scheduled_s", "first_token_s", "finish_s", "max_itl_s"):
        assert np.array_equal(np.array(getattr(old.requests, name)), np.array(getattr(new.requests, name)),
                              equal_nan=True), name
    assert np.array_equal(np.array(old.requests.itl_s), np.array(new.requests.itl_s))


# -- configuration, outputs --------------------------------------------------------------

from g5core.api.errors import ConfigError  # noqa: E402
from g5core.inputs.kv_tiers import parse_cache, resolve_tiers  # noqa: E402
from g5core.serve.api import simulate_serving  # noqa: E402

LLAMA8 = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 1, "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1}}
CONVERSATIONS = {"requests": 12, "arrival": {"kind": "poisson", "rate_per_s": 0.5}, "input_tokens": 2000,
                 "output_tokens": 20, "conversation": {"turns": 3, "think_s": 20}, "seed": 4}


def engine_like(groups):
    return 2e-3 + sum(k * (2e-5 * n + 1e-9 * n * c) for n, c, k in groups)


@pytest.mark.parametrize("block, field", [
    ({"prefix_cache": {"policy": 3}}, "serving.prefix_cache.policy"),
    ({"prefix_cache": {"miss": "guess"}}, "serving.prefix_cache.miss"),
    ({"prefix_cache": {"overlap": "yes"}}, "serving.prefix_cache.overlap"),
    ({"prefix_cache": {"size": 1}}, "serving.prefix_cache.size"),
    ({"kv_tiers": {"kind": "host"}}, "serving.kv_tiers"),
    ({"kv_tiers": [{"kind": "ssd"}]}, "serving.kv_tiers.0.kind"),
    ({"kv_tiers": [{"bytes_per_chip": 1}]}, "serving.kv_tiers.0.kind"),
    ({"kv_tiers": [{"kind": "disk"}, {"kind": "host"}]}, "serving.kv_tiers.1.kind"),
    ({"kv_tiers": [{"kind": "host", "read_gbytes_per_s": 0}]}, "serving.kv_tiers.0.read_gbytes_per_s"),
    ({"kv_tiers": [{"kind": "host", "latency_s": -1}]}, "serving.kv_tiers.0.latency_s"),
])
def test_bad_cache_settings_name_the_field(block, field):
    with pytest.raises(ConfigError) as err:
        parse_cache(block)
    assert err.value.field == field


def test_tiers_take_the_systems_defaults_and_a_remote_store_needs_its_size():
    from g5core.inputs.systems import get_system

    h100, gh200 = get_system("h100-sxm"), get_system("gh200-nvl32")
    spec = parse_cache({"kv_tiers": [{"kind": "host"}, {"kind": "disk", "bytes_per_chip": 1e12}]})
    host, disk = resolve_tiers(spec, h100)
    assert (host.read_gbytes_per_s, host.bytes_per_chip) == (63.0, 256 * 2 ** 30)
    assert (disk.read_gbytes_per_s, disk.write_gbytes_per_s, disk.bytes_per_chip) == (7.0, 3.8, 1e12)
    assert resolve_tiers(spec, gh200)[0].read_gbytes_per_s == 450.0
    remote = parse_cache({"kv_tiers": [{"kind": "remote", "bytes_per_chip": 1e13}]})
    (r,) = resolve_tiers(remote, h100)
    assert r.read_gbytes_per_s == h100.network_bw_bytes_per_s / 1e9 and r.latency_s == h100.network_latency_s
    with pytest.raises(ConfigError) as err:
        resolve_tiers(parse_cache({"kv_tiers": [{"kind": "remote"}]}), h100)
    assert err.value.field == "serving.kv_tiers.0.bytes_per_chip"


def test_without_cache_settings_the_summary_is_todays_and_with_them_it_reports_the_cache():
    plain = simulate_serving({**LLAMA8, "serving": {"workload": CONVERSATIONS}}, runner=engine_like,
                             check_predictor=0)
    assert "kv_cache" not in plain.summary and "kv_cache_blocks" not in __import__(
        "g5core.serve.metrics", fromlist=["series"]).series(plain.loop)
    cached = simulate_serving({**LLAMA8, "serving": {"workload": CONVERSATIONS, "kv_tiers": [{"kind": "host"}]}},
                              runner=engine_like, check_predictor=0)
    kv = cached.summary["kv_cache"]
    assert [t["tier"] for t in kv["tiers"]] == ["hbm", "host"]
    assert kv["tiers"][0]["hit_blocks"] > 0 and kv["lookup_blocks"] > 0
    split = kv["ttft_split_s"]
    ttft = cached.summary["ttft_s"]["mean"]
    assert split["queue"]["mean"] + split["fetch"]["mean"] + split["compute"]["mean"] == pytest.approx(ttft)
    # the block bytes are the ledger's
    assert kv["tiers"][1]["block_bytes"] == cached.pools[0]["kv_bytes_per_token_per_chip"] * 16


def test_a_plugin_registers_an_eviction_policy(tmp_path):
    from g5core.api.plugins import Hooks, hookimpl, make_plugin_manager
    from g5core.serve.kvcache import LruPolicy
    from g5core.serve.registry import serving_registry

    class Mru(LruPolicy):
        def victim(self):
            return self.order.popitem(last=True)[0]

    class Plugin:
        @hookimpl
        def g5_register_kv_cache_policies(self, register):
            register("mru", Mru)
    pm = make_plugin_manager()
    pm.register(Plugin(), name="mru_policy")
    reg = serving_registry(Hooks(pm))
    assert reg.cache_policies["mru"] == ("mru_policy", Mru) and reg.cache_policies["lru"][0] == "g5core"
    # most recently freed first: in the ABC cycle with one block short, A's tail goes at once
    _, s = run(cycle("ABC", 2), caching(SyntheticCost(0.01), 12, CacheConfig(policy=Mru)))
    assert hits(s, 6) != [0, 0, 0, 3, 3, 3]
    with pytest.raises(ConfigError) as err:
        simulate_serving({**LLAMA8, "serving": {"workload": CONVERSATIONS, "prefix_cache": {"policy": "mru"}}},
                         runner=engine_like, check_predictor=0)
    assert err.value.field == "serving.prefix_cache.policy"


def test_text_trace_and_plot_show_the_cache(tmp_path):
    from g5core.serve.present import dump_trace, render_summary

    res = simulate_serving({**LLAMA8, "serving": {"workload": CONVERSATIONS, "kv_tiers": [
        {"kind": "host", "bytes_per_chip": 2e9}]}}, runner=engine_like, check_predictor=0)
    text = render_summary(res.to_json_dict())
    assert "KV cache     lru:" in text and "  host " in text and "TTFT mean   queue" in text
    from g5core.serve.present import write_requests_csv
    import io
    buf = io.StringIO()
    write_requests_csv(res.loop, buf)
    lines = buf.getvalue().splitlines()
    assert lines[0].endswith(",hbm_hit_blocks,fetched_blocks,recomputed_blocks,fetch_s") and len(lines) == 13
    assert sum(int(line.split(",")[-4]) for line in lines[1:]) == res.summary["kv_cache"]["tiers"][0]["hit_blocks"]
    path = tmp_path / "t.json"
    with open(path, "w") as fh:
        dump_trace(res.loop, fh)
    events = json.loads(path.read_text())["traceEvents"]
    assert any(e.get("name") == "KV cache blocks" and "host" in e["args"] for e in events)
    pytest.importorskip("matplotlib")
    from g5core.present.plots import figure_bytes
    from g5core.present.serve_plots import serve_figure
    from g5core.serve.metrics import series

    # a serving row as the results database holds it (g5 plot titles it from its config, workload and SLO)
    row = {"key": "abc", "rate_per_s": 0.5, "series": json.dumps(series(res.loop)), "chips": 1,
           "config": json.dumps({"model": "llama-3.1-8b", "system": "h100-sxm"}),
           "workload": json.dumps({"requests": 12, "arrival": {"kind": "poisson", "rate_per_s": 0.5}}),
           "summary": json.dumps(res.summary)}
    assert figure_bytes(serve_figure("serve-cache", [row]), "png")[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.bench   # 30-40 s on 2 cores: the shipped multi-turn example's claims (python3 -m pytest -q -m bench)
def test_the_multiturn_example_answer_changes_with_the_tier():
    from g5core.session.run import load_raw

    path = ROOT / "examples" / "serving" / "llama-3.1-8b-multiturn-128k.yaml"
    text = path.read_text()
    assert "--set 'serving.kv_tiers=[{kind: host}]'" in text and "--set chips=2 --set parallel.cp=2" in text

    def go(*sets):
        return simulate_serving(load_raw(path, sets), check_predictor=0).summary
    hbm, host, cp2 = go(), go("serving.kv_tiers=[{kind: host}]"), go("chips=2", "parallel.cp=2")
    # HBM only: TTFT is recompute (compute 90%+ of it); with the host tier most turns fetch
    split = hbm["kv_cache"]["ttft_split_s"]
    assert split["compute"]["mean"] > 0.9 * hbm["ttft_s"]["mean"]
    assert host["kv_cache"]["tiers"][1]["fetched_blocks"] > 0
    assert host["ttft_s"]["p50"] < hbm["ttft_s"]["p50"] / 5
    assert host["kv_cache"]["ttft_split_s"]["fetch"]["mean"] > 0
    # cp=2 halves the misses (the first turns: the p90)
    assert cp2["ttft_s"]["p90"] < 0.6 * hbm["ttft_s"]["p90"]
