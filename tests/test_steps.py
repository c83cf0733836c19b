"""Steps: the step configuration, its shorthand, and the prepared plan that simulates steps."""
from __future__ import annotations

import pytest

import g5core
from g5core import ConfigError, Step, StepGroup
from g5core.sim.run import load_raw, run

DECODE = "examples/llama-3.1-70b-decode.yaml"
TP8 = ["parallel.pp=1", "chips=8"]


def as_step_config(raw: dict) -> dict:
    """The shorthand of ``raw`` written as the equivalent ``step:`` list."""
    out = {k: v for k, v in raw.items() if k not in ("phase", "batch", "seq_len")}
    b, s = raw["batch"], raw["seq_len"]
    if raw["phase"] == "prefill":
        out["step"] = [{"new_tokens": s, "cached_tokens": 0, "count": b}]
    else:
        out["step"] = [{"new_tokens": 1, "cached_tokens": s - 1, "count": b}]
    return out


def test_step_is_canonical():
    a = Step([StepGroup(new_tokens=1, cached_tokens=10, count=2), StepGroup(new_tokens=5, count=1),
              StepGroup(new_tokens=1, cached_tokens=10, count=3)])
    b = Step([StepGroup(new_tokens=5, cached_tokens=0, count=1), StepGroup(new_tokens=1, cached_tokens=10, count=5)])
    assert a == b and hash(a) == hash(b)
    assert a.phase == "mixed" and a.new_tokens == 10 and a.context_tokens == 5 + 55 and a.sequences == 6
    assert Step.decode(64, 8192) == Step([StepGroup(new_tokens=1, cached_tokens=8191, count=64)])
    assert Step.decode(64, 8192).shorthand() == ("decode", 64, 8192)
    assert Step.prefill(2, 4096).shorthand() == ("prefill", 2, 4096)
    assert Step.prefill(1, 2048, cached_tokens=30000).shorthand() is None


def test_prepared_plan_matches_run_and_caches():
    raw = load_raw(DECODE, TP8)
    plan = g5core.prepare(DECODE, overrides=TP8)
    step = Step.decode(raw["batch"], raw["seq_len"])
    first = plan.simulate(step)
    assert first.latency_s == run(raw).latency_s
    assert first.tpot_s == first.latency_s and first.ttft_s is None and first.phase == "decode"
    again = plan.simulate([StepGroup(new_tokens=1, cached_tokens=raw["seq_len"] - 1, count=raw["batch"])])
    assert again is first
    assert plan.cache_info()["hits"] == 1 and plan.cache_info()["misses"] == 1


def test_prepared_plan_memory_figures_size_a_kv_pool():
    plan = g5core.prepare(DECODE, overrides=TP8)
    step = Step([StepGroup(new_tokens=1, cached_tokens=4095, count=32), StepGroup(new_tokens=512, cached_tokens=0,
                                                                                    count=1)])
    res = plan.simulate(step)
    mem = res.memory
    assert mem.kv_cache_bytes == pytest.approx(mem.kv_bytes_per_token * step.context_tokens, rel=1e-12)
    room = plan.kv_capacity_tokens(step)
    free = mem.capacity_bytes - mem.weights_bytes - mem.activation_bytes - mem.workspace_bytes
    assert room == pytest.approx(free / mem.kv_bytes_per_token, rel=1e-12)
    assert res.phase == "mixed" and res.ttft_s is None and res.tpot_s is None


def test_step_with_shorthand_is_refused():
    raw = load_raw(DECODE)
    raw["step"] = [{"new_tokens": 1, "cached_tokens": 10, "count": 1}]
    with pytest.raises(ConfigError, match="phase"):
        run(raw)
