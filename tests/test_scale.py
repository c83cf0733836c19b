"""Clusters of 10^5 chips (issue 25, item 2): what runs outside the engine is proportional
to the distinct work. Checked here for exactness (the speed is benchmarks/bench_scale.py's):

- the rank map made with numpy has the groups the per-chip loop of commit 8e0ef11 made
  (``rankmap_reference.py``, that code kept as the oracle);
- the memory ledger worked out per group of alike chips equals the chip-by-chip ledger of
  that commit (``memory_reference.py``) bit for bit;
- the 131,072-chip run's ledger and result equal those of its one replica;
- where symmetry cannot apply, the size guard refuses a 131,072-chip run from a floor on
  the op count, before any op is made.
"""
from __future__ import annotations

import json
import math
from itertools import chain, repeat
from pathlib import Path

import attrs
import numpy as np
import pytest

import memory_reference
import rankmap_reference
from g5core.api.errors import ResourceError
from g5core.lower import builder
from g5core.sim import memory
from g5core.sim.compute import exact_sum_repeated
from g5core.session.run import load_raw, make_plan, run

ROOT = Path(__file__).resolve().parent.parent
EX = ROOT / "examples"


def _deepseek(tmp_path) -> str:
    hf = json.loads((ROOT / "tests" / "data" / "hf" / "deepseek-v3.json").read_text())
    hf.update(num_hidden_layers=3, first_k_dense_replace=1)
    p = tmp_path / "deepseek-3.json"
    p.write_text(json.dumps(hf))
    return str(p)


LAYOUTS = [
    ("llama-3.1-70b-prefill.yaml", ["chips=128", "parallel.dp=16", "parallel.tp=8"]),
    ("llama-3.1-70b-prefill.yaml", ["chips=64", "parallel.dp=4", "parallel.tp=4", "parallel.pp=4"]),
    ("llama-3.1-70b-decode.yaml", ["chips=64", "parallel.dp=2", "parallel.tp=4", "parallel.cp=4",
                                   "parallel.pp=2"]),
    ("deepseek-v3-1m-prefill-cp8.yaml", ["seq_len=16384", "model=DEEPSEEK"]),
    ("deepseek-v3-1m-decode-cp8.yaml", ["seq_len=16384", "model=DEEPSEEK", "chips=32", "parallel.dp=4",
                                        "parallel.cp=4", "parallel.ep=4"]),
]


@pytest.fixture(params=LAYOUTS, ids=[" ".join([c] + o) for c, o in LAYOUTS])
def plan(request, tmp_path):
    config, overrides = request.param
    overrides = [o.replace("DEEPSEEK", _deepseek(tmp_path)) for o in overrides]
    return make_plan(load_raw(str(EX / config), overrides))


def test_the_rank_map_has_the_groups_of_the_per_chip_build(plan):
    ctx = plan.ctx
    ref = rankmap_reference.RankMap.build(dict(ctx.deployment.parallel), ctx.dims, ctx.rankmap.chips_per_node)
    rm = ctx.rankmap
    assert rm.dims == ref.dims and rm.factor_names == ref.factor_names
    for dim in rm.dims:
        assert rm.groups(dim) == ref.groups(dim), dim
        assert rm.size(dim) == ref.size(dim)
        assert [rm.group_of(dim, c) for c in range(rm.chips)] == [ref.group_of(dim, c) for c in range(ref.chips)]
    for name, size in zip(rm.factor_names, rm.factor_sizes):
        for v in range(size):
            assert rm.chips_at(name, v) == tuple(c for c in range(rm.chips) if ref.coords(c)[name] == v)


def test_the_ledger_equals_the_chip_by_chip_ledger_bit_for_bit(plan, monkeypatch):
    monkeypatch.setattr(memory_reference, "MemoryTerm", memory.MemoryTerm)  # plugins make the current class
    new = memory.memory_report(plan.ctx)
    old = memory_reference.memory_report(plan.ctx)
    assert len(new.per_chip) == len(old.per_chip) == plan.ctx.rankmap.chips
    for a, b in zip(new.per_chip, old.per_chip):
        assert (a.chip, a.weights_bytes, a.kv_cache_bytes, a.activation_bytes, a.workspace_bytes, a.total_bytes,
                a.capacity_bytes, a.fits) == (b.chip, b.weights_bytes, b.kv_cache_bytes, b.activation_bytes,
                                              b.workspace_bytes, b.total_bytes, b.capacity_bytes, b.fits)
    assert [(t.name, t.category, t.bytes_per_chip) for t in new.terms] == \
        [(t.name, t.category, t.bytes_per_chip) for t in old.terms]
    assert new.to_json_dict() == old.to_json_dict()
    assert new.shortfall_summary() == old.shortfall_summary()
    worst = max(old.per_chip, key=lambda c: (c.total_bytes, -c.chip))
    assert attrs.astuple(new.worst()) == attrs.astuple(worst)


def test_exact_sums_over_repeats_equal_fsum_of_the_repeated_list():
    rng = np.random.default_rng(25)
    for _ in range(300):
        values = (rng.random(rng.integers(0, 6)) * 10.0 ** rng.integers(-20, 20)).tolist() + [0.1, 1e-300]
        counts = rng.integers(0, 40, len(values)).tolist()
        pairs = list(zip(values, counts))
        assert exact_sum_repeated(pairs) == math.fsum(chain.from_iterable(repeat(v, n) for v, n in pairs))


def test_a_131072_chip_run_equals_its_one_replica():
    big = run(load_raw(str(EX / "llama-3.1-70b-prefill.yaml"), ["chips=131072", "parallel.dp=16384", "parallel.tp=8"]))
    one = run(load_raw(str(EX / "llama-3.1-70b-prefill.yaml"), []))
    assert big.sim.symmetry.replicas == 16384 and big.sim.symmetry.slice_chips == 8
    assert big.latency_s == one.latency_s
    assert big.sim.kpis == one.sim.kpis
    cols, ref = big.memory.columns, one.memory.columns
    assert big.memory.chips == 131072
    for k in big.memory.COLUMNS:
        assert np.array_equal(cols[k], np.tile(ref[k], 16384)), k
    assert big.memory.fits == one.memory.fits and big.memory.max_total_bytes == one.memory.max_total_bytes
    assert big.sim.comm_bytes["total_bytes"] == pytest.approx(16384 * one.sim.comm_bytes["total_bytes"], rel=1e-12)


def test_where_symmetry_cannot_apply_the_guard_refuses_before_any_op_is_made(monkeypatch):
    def no_expansion(*args, **kwargs):
        raise AssertionError("the guard expanded ops")
    monkeypatch.setattr(builder, "estimate_size", no_expansion)
    monkeypatch.setattr(builder, "expand", no_expansion)
    raw = load_raw(str(EX / "llama-3.1-70b-prefill.yaml"), ["chips=131072", "parallel.dp=16384", "parallel.tp=8"])
    with pytest.raises(ResourceError, match=rf"at least [\d,]+ ops .* above the limit of {builder.DEFAULT_MAX_OPS:,}"):
        run(raw, symmetry=False)


def test_the_size_guard_estimates_one_replica_from_the_reduced_plan():
    raw = load_raw(str(EX / "llama-3.1-70b-prefill.yaml"), ["chips=1024", "parallel.dp=128", "parallel.tp=8"])
    plan = make_plan(raw)
    est = builder.check_size(plan, replicas=128)
    one = builder.check_size(make_plan(load_raw(str(EX / "llama-3.1-70b-prefill.yaml"), [])))
    assert (est.ops, est.flows, est.replicas) == (one.ops, one.flows, 128)
    full = builder.estimate_size(plan)
    assert (full.ops, full.flows) == (128 * est.ops, 128 * est.flows)
