"""A small fixed sample of the serving fuzzer (tests/fuzz/serve_fuzzer.py; the long run is its
script): every case ends in a result whose invariants hold or a one-line error, exit 2,
and no input changes."""
from __future__ import annotations

import io

from fuzz.serve_fuzzer import fuzz


def test_a_serving_fuzz_sample_has_no_failure():
    out = io.StringIO()
    summary = fuzz(cases=30, seed=3, slow_s=120.0, out=out)
    assert summary["FAIL"] == 0, out.getvalue()
    assert summary["ok"] >= 3 and summary["ok"] + summary["error"] == 30
