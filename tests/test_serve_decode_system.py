"""Heterogeneous disaggregation: a disaggregated pool on its own system (``system:`` in
``serving.disaggregation.<role>``) and ``g5 best --serve --decode-system NAME``."""
from __future__ import annotations

import copy

import pytest

from g5core.api.errors import ConfigError
from g5core.inputs.systems import get_system
from g5core.serve.api import simulate_serving
from g5core.serve.cost import StepWork
from g5core.study.serving import SearchSettings, serve_search

from tests.test_serve_search import layout_runner

DISAGG = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 1,
          "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1},
          "serving": {"scheduler": {"max_num_batched_tokens": 2048},
                      "disaggregation": {"prefill": {"instances": 1}, "decode": {"instances": 1}}}}
WL = {"requests": 20, "arrival": {"kind": "poisson", "rate_per_s": 4.0}, "input_tokens": 1000, "output_tokens": 32,
      "seed": 0}


def _with_decode_system(name):
    raw = copy.deepcopy(DISAGG)
    raw["serving"]["disaggregation"]["decode"]["system"] = name
    return raw


def test_a_decode_pool_on_another_system_has_that_systems_step_latencies_and_a_network_kv_move():
    same = simulate_serving(DISAGG, WL, check_predictor=0)
    other = simulate_serving(_with_decode_system("h200"), WL, check_predictor=0)
    assert [p["system"] for p in same.pools] == ["h100-sxm", "h100-sxm"]
    assert [p["system"] for p in other.pools] == ["h100-sxm", "h200"]
    # the decode pool's steps come from the H200 file (faster HBM: every decode step is
    # shorter), its KV pool from the H200's HBM; the prefill pool is unchanged
    decode = StepWork((), (1000,) * 8)
    prefill = StepWork(((1000, 0),), ())
    assert other.costs[1].latency_s(decode) < 0.9 * same.costs[1].latency_s(decode)
    assert other.costs[0].latency_s(prefill) == same.costs[0].latency_s(prefill)
    assert other.pools[1]["kv_capacity_tokens"] > 1.5 * same.pools[1]["kv_capacity_tokens"]
    assert other.summary["tpot_s"]["p50"] < 0.9 * same.summary["tpot_s"]["p50"]
    # two systems are two clusters: the prompt's KV leaves the H100 through its NIC and enters
    # the H200 through its NIC (48 GB/s each, one flow), plus one inter-node start latency;
    # on one system the two chips share a node and the move is over NVLink
    h100, h200 = get_system("h100-sxm"), get_system("h200")
    nbytes = 1000 * other.pools[0]["kv_bytes_per_token_per_chip"]
    want = nbytes / min(h100.network_bw_bytes_per_s, h200.network_bw_bytes_per_s) + max(
        h100.network_latency_s, h200.network_latency_s)
    assert other.summary["kv_transfer_s"]["p50"] == pytest.approx(want, rel=1e-9)
    assert same.summary["kv_transfer_s"]["p50"] == pytest.approx(
        nbytes / h100.intra_node_bw_bytes_per_s + h100.intra_node_latency_s, rel=1e-9)
    # naming the configuration's own system is the same deployment
    named = simulate_serving(_with_decode_system("h100-sxm"), WL, check_predictor=0)
    assert named.summary["tpot_s"] == same.summary["tpot_s"]
    assert named.summary["kv_transfer_s"] == same.summary["kv_transfer_s"]


#: the stand-in chip of the search tests, 30 % faster on an H200 (its step costs differ by
#: system, as the engine's do)
SPEED = {"h100-sxm": 1.0, "h200": 0.7}


def _runner_by_system(seen):
    def runner_for(praw, prepared=None):
        seen.append(praw["system"])
        go, f = layout_runner(praw, prepared), SPEED[praw["system"]]
        return lambda groups: f * go(groups)
    return runner_for


SEARCH_WL = {"requests": 40, "arrival": {"kind": "poisson"}, "input_tokens": 1000, "output_tokens": 16, "seed": 0}
SEARCH = dict(slo="ttft_p90=1s,tpot_p90=30ms", chunks=(1024,), seqs=(4,), vary=("tp",), settle=4, confirm=0)


def test_search_with_decode_system_puts_the_disaggregated_decode_pools_on_it():
    raw = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 2}
    seen: list = []
    r = serve_search(raw, SEARCH_WL, SearchSettings(disagg="auto", decode_system="h200", bound=False, **SEARCH),
                     runner_for=_runner_by_system(seen))
    disagg = [s for s in r.ranked if s.candidate.disaggregated]
    agg = [s for s in r.ranked if not s.candidate.disaggregated]
    assert disagg and agg
    for s in disagg:
        prefill, decode = s.candidate.pools
        assert (prefill.system, decode.system) == (None, "h200")
        assert "decode 1 x [tp=1] on h200" in s.candidate.label()
        pools = s.config["serving"]["disaggregation"]
        assert pools["decode"]["system"] == "h200" and "system" not in pools["prefill"]
        assert s.config["system"] == "h100-sxm"
        assert s.candidate.chips == 2        # one chip budget: prefill plus decode chips
    for s in agg:
        assert all(p.system is None for p in s.candidate.pools) and s.config["system"] == "h100-sxm"
    # the decode layouts were screened (and their candidates' decode pools built) on h200
    assert "h200" in seen and "h100-sxm" in seen
    assert r.layouts == 2 * 2               # tp=1 and tp=2, each screened on both systems
    # the same search without --decode-system: its decode pools on the configuration's system
    # run slower steps, so its disaggregated capacity is lower
    base = serve_search(raw, SEARCH_WL, SearchSettings(disagg="auto", bound=False, **SEARCH),
                        runner_for=_runner_by_system([]))
    here = [s for s in base.ranked if s.candidate.disaggregated]
    assert all(s.candidate.pools[1].system is None for s in here)
    assert max(s.capacity for s in disagg) > max(s.capacity for s in here)


def test_a_bad_system_name_is_a_one_line_error_naming_the_field():
    with pytest.raises(ConfigError) as exc:
        simulate_serving(_with_decode_system("h900"), WL, check_predictor=0)
    text = str(exc.value)
    assert exc.value.field == "serving.disaggregation.decode.system"
    assert "\n" not in text and "h900" in text and "h200" in text and "h100-sxm" in text
    with pytest.raises(ConfigError) as exc:
        SearchSettings(slo="ttft=1s", disagg="on", decode_system="h900").check()
    assert exc.value.field == "--decode-system" and "\n" not in str(exc.value) and "h200" in str(exc.value)
    with pytest.raises(ConfigError, match="--disagg on or auto"):
        SearchSettings(slo="ttft=1s", disagg="off", decode_system="h200").check()


def test_cli_decode_system_flag(tmp_path):
    from click.testing import CliRunner

    from g5core.present.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: llama-3.1-8b\nsystem: h100-sxm\nchips: 2\n")
    args = ["best", str(cfg), "--serve", "--isl", "1000", "--osl", "16", "--slo", "ttft_p90=1s"]
    bad = CliRunner().invoke(main, args + ["--decode-system", "h900"])
    assert bad.exit_code == 2 and "--decode-system" in bad.output and "h200" in bad.output
    assert len(bad.output.strip().splitlines()) == 1, bad.output
    off = CliRunner().invoke(main, args + ["--disagg", "off", "--decode-system", "h200"])
    assert off.exit_code == 2 and "--disagg on or auto" in off.output
    alone = CliRunner().invoke(main, ["best", str(cfg), "--decode-system", "h200"])
    assert alone.exit_code == 2 and "--decode-system" in alone.output and "--serve" in alone.output
    assert "--decode-system NAME" in CliRunner().invoke(main, ["best", "--help"]).output
