"""``g5 best --serve`` with reused prefixes and long prompts: the host KV tier's size is a
candidate attribute (tried over shares of the system's default when the workload reuses
prefixes), and cp > 1 candidates run CP prefill with ``auto`` when the p90 prompt is long."""
from __future__ import annotations

import pytest

from g5core.api.errors import G5Error
from g5core.present.render import render_serve_best
from g5core.present.report import load_search, render_search
from g5core.study.serving import Candidate, PoolChoice, SearchSettings, candidate_config, serve_search
from g5core.study.serving.space import (HOST_TIER_SHARES, LONG_PROMPT_TOKENS, cp_prefill_choice,
                                        host_tier_variants, reuses_prefixes, vary_cache)

GIB = 2 ** 30
#: the system default host tier of h100-sxm (g5core/data/kv_tiers.yaml)
H100_HOST_BYTES = 256 * GIB
RAW = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 1, "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1},
       # 256-token blocks: the same cache behaviour at a sixteenth of the blocks to move
       "serving": {"scheduler": {"max_num_batched_tokens": 8192, "block_size": 256}}}
#: 12 conversations of 10 turns over a 96K-token history each: some 1.2M tokens of
#: histories against an HBM pool of about 0.53M (llama-3.1-8b on an H100)
CONVERSATIONS = {"requests": 120, "arrival": {"kind": "poisson", "rate_per_s": 1.0}, "input_tokens": 1024,
                 "output_tokens": 32, "conversation": {"turns": 10, "think_s": 30, "history_tokens": 98304},
                 "seed": 0}
SETTINGS = SearchSettings(slo="ttft_p90=1.5s", chunks=(8192,), seqs=(8,), confirm=0, settle=2, tolerance=0.25,
                          disagg="off", max_rate=2.0)


def runner_for(praw, prepared=None):
    """A stand-in step: 5 ms, 10 us a new token, 0.1 ns per (new x context) token."""
    def go(groups):
        tokens = sum(n * k for n, c, k in groups)
        attn = sum(k * n * (c + n / 2) for n, c, k in groups)
        return 5e-3 + 1e-5 * tokens + 1e-10 * attn
    return go


def test_the_search_tries_host_tier_sizes_and_capacity_grows_until_the_histories_fit(tmp_path):
    db = tmp_path / "s.db"
    r = serve_search(RAW, CONVERSATIONS, SETTINGS, runner_for=runner_for, db_path=db)
    caps = {s.candidate.host_tier_bytes_per_chip: s.capacity for s in r.ranked}
    assert sorted(caps) == [share * H100_HOST_BYTES for share in HOST_TIER_SHARES]
    none, gib32, gib64, gib128, gib256 = (caps[share * H100_HOST_BYTES] for share in HOST_TIER_SHARES)
    # a bigger host tier keeps more histories (HBM + 32 GiB < HBM + 64 GiB < all of them <
    # HBM + 128 GiB): the later turns fetch instead of recomputing, and the capacity rises
    # until they fit
    assert none <= gib32 < gib64 < gib128 == gib256
    assert gib128 > 3 * none
    win = r.ranked[0]
    assert win.candidate.host_tier_bytes_per_chip >= 128 * GIB
    # carried into the configuration, --json, the text and g5 report
    serving = win.config["serving"]
    assert serving["kv_tiers"] == [{"kind": "host", "bytes_per_chip": win.candidate.host_tier_bytes_per_chip}]
    assert serving["prefix_cache"] == {}
    assert win.to_json_dict()["host_tier_bytes_per_chip"] == win.candidate.host_tier_bytes_per_chip
    none_cfg = next(s for s in r.ranked if s.candidate.host_tier_bytes_per_chip == 0.0).config["serving"]
    assert "kv_tiers" not in none_cfg and none_cfg["prefix_cache"] == {}
    text = render_serve_best(r, 5)
    assert "host tier none" in text and "host tier 32 GiB" in text and "host tier 256 GiB" in text
    report = render_search(load_search(db), "markdown")
    assert "host tier 64 GiB" in report
    # the lone request (a cold 99K-token prompt, 1.55 s to its first token) misses the 1.5 s
    # TTFT limit, yet was not pruned: a cache hit beats it. Without reuse it prunes the layout
    assert not r.pruned
    cold = {**CONVERSATIONS, "input_tokens": 98304 + 1024}
    cold.pop("conversation")
    with pytest.raises(G5Error, match="lone prefill misses TTFT"):
        serve_search(RAW, cold, SETTINGS, runner_for=runner_for)


def test_the_tier_varies_only_with_reused_prefixes_and_no_tiers_of_the_configurations_own():
    assert reuses_prefixes(CONVERSATIONS)
    assert host_tier_variants(RAW, CONVERSATIONS) == tuple(s * H100_HOST_BYTES for s in HOST_TIER_SHARES)
    plain = {k: v for k, v in CONVERSATIONS.items() if k != "conversation"}
    assert not reuses_prefixes(plain) and host_tier_variants(RAW, plain) == (None,)
    shared = {**plain, "prefix": {"groups": 4, "tokens": 512}}
    assert reuses_prefixes(shared) and len(host_tier_variants(RAW, shared)) == len(HOST_TIER_SHARES)
    own = {**RAW, "serving": {**RAW["serving"], "kv_tiers": [{"kind": "host", "bytes_per_chip": GIB}]}}
    assert host_tier_variants(own, CONVERSATIONS) == (None,)
    # the configuration's own tiers stay in its candidates' configurations
    cand = Candidate((PoolChoice(1, (("cp", 1), ("dp", 1), ("pp", 1), ("tp", 1)), 1),), 8, 8192)
    assert candidate_config(own, cand, plain, "ttft_p90=1s", 1.0)["serving"]["kv_tiers"] == own["serving"]["kv_tiers"]


def test_long_prompts_run_cp_prefill_auto_on_the_cp_candidates():
    short = {"requests": 20, "arrival": {"kind": "poisson", "rate_per_s": 1.0}, "input_tokens": LONG_PROMPT_TOKENS,
             "output_tokens": 8, "seed": 0}
    long = {**short, "input_tokens": LONG_PROMPT_TOKENS + 2}
    assert cp_prefill_choice(RAW, short) is None and cp_prefill_choice(RAW, long) == "auto"
    # the configuration's own choice wins
    assert cp_prefill_choice({**RAW, "plugins": {"cp": {"prefill": "pass_kv"}}}, long) is None
    cp1 = Candidate((PoolChoice(1, (("cp", 1), ("tp", 1)), 2),), 8, 8192)
    cp2 = Candidate((PoolChoice(2, (("cp", 2), ("tp", 1)), 1),), 8, 8192)
    bound, screens = {0: "b1", 1: "b2"}, {0: "s1", 1: "s2"}
    out = vary_cache([(cp1, 1.0), (cp2, 2.0)], bound, screens, (None,), "auto")
    assert [c.cp_prefill for c, _ in out] == [None, "auto"] and bound == {0: "b1", 1: "b2"}
    raw = {**RAW, "plugins": {"disable": ["x"]}}
    cfg = candidate_config(raw, out[1][0], long, "ttft_p90=1s", 1.0)
    assert cfg["plugins"] == {"disable": ["x"], "cp": {"prefill": "auto"}} and raw["plugins"] == {"disable": ["x"]}
    assert "cp prefill auto" in out[1][0].label() and "plugins" not in candidate_config(RAW, cp1, long, "x", 1.0)
    # with tiers: each candidate once per size, its bound and screens following it
    out = vary_cache([(cp1, 1.0), (cp2, 2.0)], bound, screens, (0.0, 5.0), None)
    assert [(c.pools[0].chips, c.host_tier_bytes_per_chip) for c, _ in out] == [(1, 0.0), (1, 5.0), (2, 0.0), (2, 5.0)]
    assert bound == {0: "b1", 1: "b1", 2: "b2", 3: "b2"} and screens[3] == "s2"
