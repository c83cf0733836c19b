"""Suggestions in error messages match prefixes and families, not only spelling (issue 10)."""
from __future__ import annotations

from pathlib import Path

import pytest

from g5core.api.errors import closest, suggest
from g5core.inputs.models import CATALOG
from g5core.inputs.systems import CATALOG_NAMES

from test_cli import error_line

EX_70B = Path(__file__).resolve().parent.parent / "examples" / "llama-3.1-70b-prefill.yaml"


@pytest.mark.parametrize("typed,meant", [
    ("h100", "h100-sxm"),          # a prefix, not the nearer spelling h800
    ("H200", "h200"),              # case
    ("a100", "a100-80gb"),
    ("llama3.1-8b", "llama-3.1-8b"),  # punctuation
    ("llama-70b", "llama-3.1-70b"),   # a family: every part of the name appears
    ("deepseek", "deepseek-v3"),
    ("qwen3-235", "qwen3-235b-a22b"),
    ("gpt-oss-12", "gpt-oss-120b"),
])
def test_closest_prefers_prefix_and_family(typed, meant):
    assert closest(typed, list(CATALOG_NAMES) + list(CATALOG)) == [meant]


def test_an_ambiguous_prefix_lists_the_candidates_and_a_typo_still_gets_one():
    assert suggest("llama-3", CATALOG) == " (did you mean one of 'llama-3.1-405b', 'llama-3.1-70b', 'llama-3.1-8b'?)"
    assert suggest("qwen3", CATALOG) == " (did you mean one of 'qwen3-235b-a22b', 'qwen3-30b-a3b', 'qwen3-8b'?)"
    assert suggest("tpp", ["tp", "pp", "dp"]) == " (did you mean 'tp'?)"
    assert suggest("zzz", ["tp", "pp"]) == ""


def test_unknown_system_h100_suggests_h100_sxm():
    line = error_line("run", EX_70B, "--set", "system=h100")
    assert "did you mean 'h100-sxm'?" in line


def test_disabling_the_plugin_of_a_configured_dimension_names_that_plugin():
    line = error_line("run", EX_70B, "--disable", "tp")
    assert "the plugin 'tp' is disabled" in line and "'pp'" not in line
