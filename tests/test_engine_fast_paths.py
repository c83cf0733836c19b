"""The engine's fast paths (issue 13) change no result: a flow alone on its route settled
without the re-share, max-min answers kept per set of routes, and a comm op's many flows
released in bulk, against an engine that releases flow by flow and re-shares every change
from scratch."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from g5core.build import build_dag
from g5core.engine import Engine, compile_dag
from g5core.run import load_raw, make_plan

EX = Path(__file__).resolve().parent.parent / "examples"


class FromScratch(Engine):
    """Flows are released one by one, every flow that starts or ends goes through the
    connected-set re-share, and every set's rates are worked out again (progressive
    filling) each time."""

    _settle_alone = False
    _keep_shares = False
    _release_in_bulk = False


def _log_by_time(log):
    """Port-rate log entries per time: equal sets (the order within a time may differ)."""
    out: dict = {}
    for t, port, rate in log:
        out.setdefault(t, []).append((port, rate))
    return {t: sorted(v) for t, v in out.items()}


@pytest.mark.parametrize("example,overrides,shared", [
    ("deepseek-v3-1m-prefill-cp8", ["seq_len=16384"], True),   # p2p rings, tp all-reduces, ep all-to-alls (bulk)
    ("deepseek-v3-1m-decode-cp8", ["seq_len=65536"], True),    # pass-Q broadcast/gather, LL rings
    ("llama-3.1-70b-prefill", ["seq_len=4096", "chips=16", "parallel.dp=2"], False),  # NVLS: every flow alone
])
def test_fast_paths_give_the_results_of_a_re_share_from_scratch(example, overrides, shared):
    plan = make_plan(load_raw(EX / f"{example}.yaml", overrides))
    compiled = compile_dag(build_dag(plan), plan)
    fast = Engine(compiled, record_port_rates=True).run()
    slow = FromScratch(compiled, record_port_rates=True).run()
    for name in ("start_s", "end_s", "executed", "executed_flops", "flow_start_s", "flow_end_s", "flow_injected",
                 "flow_delivered"):
        assert np.array_equal(np.asarray(getattr(fast, name)), np.asarray(getattr(slow, name)), equal_nan=True), name
    assert fast.makespan_s == slow.makespan_s and fast.port_excess_bytes == slow.port_excess_bytes == 0.0
    assert _log_by_time(fast.port_rate_log) == _log_by_time(slow.port_rate_log)
    assert not slow._shares  # it kept no answer
    assert bool(fast._shares) == shared  # flows that shared a port: their sets' answers were kept


def test_exact_sum_of_repeated_values_equals_the_sum_of_the_list():
    from g5core.compute import exact_sum, exact_sum_repeated

    pairs = [(0.1, 3), (1e16, 2), (-1e16, 2), (1.0 / 3.0, 7), (2.5, 0)]
    listed = [v for v, n in pairs for _ in range(n)]
    # exactly rounded: the large values cancel and leave no trace
    assert exact_sum_repeated(pairs) == exact_sum(listed) == math.fsum([0.1] * 3 + [1.0 / 3.0] * 7)
    assert exact_sum_repeated(iter(pairs)) == exact_sum(listed)
    assert exact_sum_repeated([(1e308, 2)]) == exact_sum([1e308, 1e308]) == float("inf")  # overflow: inf, as sum
