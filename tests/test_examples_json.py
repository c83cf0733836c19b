"""Every shipped example gives, key for key, the JSON it gave before the compile, engine and
storage rewrite of issue 13 (``sim_wall_s`` aside): the reference files in
tests/data/examples_json were written by ``g5 run EXAMPLE --json`` at commit 5a1d29e (after
the symmetry change, before the rewrite). The llama-3.1-405b example runs at a 128K context
(``@seq_len=131072``): the same DAG (one of its two dp replicas), with smaller blocks; the
1M-token run is compared by hand (README, benchmarks).

A deliberate change of a model, system or formula changes these files: regenerate them with
``python tests/test_examples_json.py`` and say why in the commit.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from g5core.session.run import load_raw, run

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data" / "examples_json"
CASES = sorted(p.stem for p in DATA.glob("*.json"))


def current_json(case: str) -> dict:
    name, _, override = case.partition("@")
    out = run(load_raw(REPO / "examples" / f"{name}.yaml", [override] if override else []))
    # the same text `g5 run --json` prints, read back
    data = json.loads(json.dumps(out.to_json_dict(), sort_keys=True, allow_nan=False))
    data.pop("sim_wall_s")
    return data


def test_every_shipped_example_has_a_reference():
    examples = {p.stem for p in (REPO / "examples").glob("*.yaml")}
    assert examples == {c.partition("@")[0] for c in CASES}


@pytest.mark.parametrize("case", CASES)
def test_example_json_is_unchanged(case):
    want = json.loads((DATA / f"{case}.json").read_text())
    got = current_json(case)
    assert sorted(got) == sorted(want)
    for key in sorted(want):
        assert got[key] == want[key], key


if __name__ == "__main__":  # regenerate the reference files
    for case in CASES if len(sys.argv) < 2 else sys.argv[1:]:
        (DATA / f"{case}.json").write_text(json.dumps(current_json(case), sort_keys=True, separators=(",", ":")) + "\n")
        print(f"wrote {case}")
