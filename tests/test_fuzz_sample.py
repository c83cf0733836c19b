"""A small fixed sample of the seeded fuzzer (tests/fuzz/fuzzer.py; the long run is its
script): every case ends in a result or a one-line G5 error."""
from __future__ import annotations

import io

import pytest

from fuzz.fuzzer import fuzz


@pytest.mark.parametrize("seed", [11])
def test_a_fuzz_sample_has_no_failure(seed):
    out = io.StringIO()
    summary = fuzz(cases=25, seed=seed, slow_s=60.0, out=out)
    assert summary["FAIL"] == 0, out.getvalue()
    assert summary["ok"] + summary["error"] == 25
