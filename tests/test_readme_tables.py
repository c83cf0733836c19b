"""The README's tables that quote G5's own output (validation, NCCL agreement, DeepEP) match a
fresh run to their rounding: docs/readme_tables.py generates them; this runs it again."""
from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
NUMBER = re.compile(r"[-+]?\d+(?:\.(\d+))?")


def _tables():
    spec = importlib.util.spec_from_file_location("readme_tables", REPO / "docs" / "readme_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def differences(readme: str, fresh: str) -> list[str]:
    """Cells where ``readme`` and ``fresh`` differ by more than the README's rounding (half a
    unit of its last digit), or in their words."""
    out = []
    a, b = readme.splitlines(), fresh.splitlines()
    if len(a) != len(b):
        return [f"{len(a)} lines in the README, {len(b)} in a fresh run"]
    for i, (la, lb) in enumerate(zip(a, b)):
        if NUMBER.sub("#", la) != NUMBER.sub("#", lb):
            out.append(f"line {i + 1}: {la!r} against {lb!r}")
            continue
        for ma, mb in zip(NUMBER.finditer(la), NUMBER.finditer(lb)):
            decimals = len(ma.group(1) or "")
            if abs(float(ma.group()) - float(mb.group())) > 0.5 * 10 ** -decimals + 1e-9:
                out.append(f"line {i + 1}: README {ma.group()}, fresh run {mb.group()}: {la}")
    return out


def test_the_comparison_catches_a_drift_and_allows_rounding():
    assert differences("| x | 401.91 (-1.2%) |", "| x | 401.914 (-1.2%) |") == []
    assert differences("| x | 401.91 (-1.2%) |", "| x | 360.24 (-11.4%) |")
    assert differences("| x | a |", "| y | a |")


@pytest.mark.bench   # 9-47 s each on 2 cores: a benchmark-sized check (python3 -m pytest -q -m bench)
@pytest.mark.parametrize("name", ["validation", "validation-meta", "validation-frameworks", "validation-tp-trend",
                                  "framework-changes", "nccl", "deepep"])
def test_readme_table_matches_a_fresh_run(name):
    tables = _tables()
    fresh = tables.TABLES[name]()
    assert differences(tables.readme_table(name), fresh) == [], \
        f"README.md's {name} table is stale: run python docs/readme_tables.py --write"
