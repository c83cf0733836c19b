"""One micro-batch mechanism (g5core.lower.microbatch): pipeline parts (plugins.pp.microbatches)
and two-batch overlap sides (plugins.ep.two_batch_overlap) are program copies of one
numbering with one schedule, so the two compose.

Mixtral-8x7B on H800 with EP over 8 chips a stage, the expert load uniform (``imbalance:
1.0``: equal FLOPs however the sequences are split).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from g5core import ConfigError
from g5core.lower.builder import check_size
from g5core.session.run import make_plan, run
from g5core.sim.memory import memory_report

# The latencies of PP alone and TBO alone before the two mechanisms became one (commit
# a290bab, its g5core.session.run.run): the same configurations give the same bits. Updated
# when the GEMMs' memory time gained its fixed latency (gemm_hbm_latency_s, h800.yaml) and when
# the LM head gained the sampler's kernels.
BEFORE_S = {("decode", 1, True): 0.05865302553357124, ("decode", 2, False): 0.06181971507070211,
            ("prefill", 1, True): 0.2479318990655352, ("prefill", 2, False): 0.23134914279462607}
BATCH = {"decode": 256, "prefill": 2}


def _raw(phase: str, pp: int, tbo: bool, batch: int | None = None) -> dict:
    """``pp`` stages of 8 EP chips, ``pp`` micro-batches through them (decode: cycling
    batches; prefill: chunks of each prompt), with or without two-batch overlap."""
    return {"model": "mixtral-8x7b", "system": "h800", "chips": 8 * pp,
            "parallel": {"dp": 8, "tp": 1, "pp": pp, "cp": 1, "ep": 8}, "phase": phase,
            "batch": BATCH[phase] if batch is None else batch, "seq_len": 4096,
            "dtypes": {"weights": "fp8", "activations": "bf16", "kv_cache": "bf16"},
            "plugins": {"ep": {"imbalance": 1.0, "two_batch_overlap": tbo}, "pp": {"microbatches": pp}}}


@pytest.fixture(scope="module")
def runs():
    """``(phase, pp, tbo) -> RunOutput``: the step whole, TBO alone, PP alone, both."""
    return {(phase, pp, tbo): run(_raw(phase, pp, tbo))
            for phase in ("decode", "prefill") for pp in (1, 2) for tbo in (False, True)}


def _compute_flops(out) -> float:
    d = out.sim.compiled
    return math.fsum(np.asarray(d.flops, dtype=float)[~np.asarray(d.is_comm)].tolist())


@pytest.mark.parametrize("key", sorted(BEFORE_S))
def test_pp_alone_and_tbo_alone_keep_their_figures_bit_for_bit(runs, key):
    assert runs[key].latency_s == BEFORE_S[key]


def test_copies_are_numbered_part_by_side_and_each_side_runs_its_share_of_the_part():
    plan = make_plan(_raw("decode", 2, True))
    copies = plan.micro_batches
    assert (copies.part_count, copies.side_count) == (2, 2)
    # copy (cycle * parts + part) * sides + side: cycle 1, part 0, side 1 is copy 5
    assert copies.copy(1, 0, 1) == 5
    contexts = copies.contexts(cycles=2)
    assert sorted(contexts) == list(range(8))
    assert {c.deployment.batch for c in contexts.values()} == {128}
    program = copies.program(plan.ctx, cycles=2)
    ids = {lop.id for lop in program}
    assert {"L003.m0.moe_experts", "L003.m1.moe_experts", "L003.m7.moe_experts"} <= ids
    # rule 2 per side: side 1 of part 0 in cycle 1 waits for its own tokens of cycle 0
    by_id = {lop.id: lop for lop in program}
    assert by_id["E.m5.token_return"].inputs == ("L032.m1.logits_gather",)
    # rule 1 per side: on the first stage, part 1's sides start after both sides of part 0
    assert by_id["E.m2.embedding"].inputs == by_id["E.m3.embedding"].inputs == ("L015.m0.ffn_out_reduce",
                                                                                 "L015.m1.ffn_out_reduce")


def test_pp_decode_with_tbo_composes_hiding_the_all_to_all_inside_the_pipeline(runs):
    plain, tbo = runs[("decode", 1, False)], runs[("decode", 1, True)]
    pp, both = runs[("decode", 2, False)], runs[("decode", 2, True)]
    # the overlap survives the pipeline: most of the EP exchange runs under the other side's compute
    assert pp.sim.overlap["hidden_fraction"] < 0.05
    assert both.sim.overlap["hidden_fraction"] > 0.5
    # m = pp micro-batches fill the stages: a cycle is about one whole-model step, so the
    # pipeline gains what the overlap gains on one stage (within 1%)
    assert both.sim.pipeline["steady"]
    assert both.latency_s / pp.latency_s == pytest.approx(tbo.latency_s / plain.latency_s, abs=0.01)
    assert both.latency_s < pp.latency_s
    # the same sequences resident: the memory ledger is the pipeline's
    assert both.plan.ctx.resident_batches == pp.plan.ctx.resident_batches == 2
    assert memory_report(both.plan.ctx).to_json_dict() == memory_report(pp.plan.ctx).to_json_dict()
    # each cycle simulated does each micro-batch's work once, split or not
    per_cycle = {k: _compute_flops(o) / o.sim.pipeline["cycles_simulated"] for k, o in (("pp", pp), ("both", both))}
    assert per_cycle["both"] == pytest.approx(per_cycle["pp"], rel=1e-12)


def test_chunked_prefill_with_tbo_composes_doing_the_same_work_sooner(runs):
    plain, tbo = runs[("prefill", 1, False)], runs[("prefill", 1, True)]
    pp, both = runs[("prefill", 2, False)], runs[("prefill", 2, True)]
    for out in (tbo, pp, both):
        assert _compute_flops(out) == pytest.approx(_compute_flops(plain), rel=1e-12)
    # each chunk split in two sides: faster than the chunks alone and than the overlap alone
    assert both.latency_s < pp.latency_s and both.latency_s < tbo.latency_s
    assert both.sim.overlap["hidden_fraction"] > 0.5


def test_the_size_guard_counts_every_side_of_every_part():
    pp = check_size(make_plan(_raw("decode", 2, False)))
    both = check_size(make_plan(_raw("decode", 2, True)))
    assert both.logical_ops == 2 * pp.logical_ops
    assert both.ops > pp.ops


def test_a_part_tbo_refuses_is_refused_by_the_ep_plugins_own_rule():
    # one sequence a chunk cannot be split in two: the EP plugin says so, naming its field
    with pytest.raises(ConfigError) as err:
        make_plan(_raw("prefill", 2, True, batch=1))
    assert err.value.field == "plugins.ep.two_batch_overlap" and "\n" not in str(err.value)
