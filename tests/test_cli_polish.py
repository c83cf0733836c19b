"""`g5 explain` dtypes and defaults, `g5 systems show`, and number formatting (issue 10)."""
from __future__ import annotations

from pathlib import Path

import pytest

from g5core.present.render import fmt_s

from test_cli import error_line, ok

REPO = Path(__file__).resolve().parent.parent
EX = REPO / "examples"


def test_explain_shows_the_dtypes():
    text = ok("explain", EX / "deepseek-v3-1m-prefill-cp8.yaml")
    assert "dtypes  weights bf16 (experts fp8), activations bf16, kv_cache bf16" in text
    text = ok("explain", EX / "llama-3.1-8b-prefill.yaml", "--set", "dtypes.kv_cache=fp8")
    assert "dtypes  weights bf16, activations bf16, kv_cache fp8" in text


def test_explain_names_a_default_only_when_it_was_used():
    assert "parallel.ep is 1 when omitted" in ok("explain", EX / "llama-3.1-8b-prefill.yaml")
    text = ok("explain", EX / "deepseek-v3-1m-prefill-cp8.yaml")  # sets ep: 8
    assert "ep is 1 when omitted" not in text
    text = ok("explain", EX / "llama-3.1-8b-prefill.yaml", "--set", "parallel.ep=1")
    assert "parallel.ep is" not in text


def test_explain_uses_singular_and_plural():
    assert "layout  1 chip on 1 node;" in ok("explain", EX / "llama-3.1-8b-prefill.yaml")
    assert "layout  8 chips on 1 node;" in ok("explain", EX / "llama-3.1-70b-prefill.yaml")


def test_systems_show_prints_the_file_with_its_sources():
    text = ok("systems", "show", "h100-sxm")
    assert text == (REPO / "g5core" / "data" / "systems" / "h100-sxm.yaml").read_text()
    assert "Sources:" in text


def test_systems_show_a_file_names_the_system_inside(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text((REPO / "g5core" / "data" / "systems" / "h200.yaml").read_text().replace("name: h200", "name: lab"))
    assert ok("systems", "show", p).startswith(f"# lab, from {p}\n")


def test_systems_show_unknown_suggests():
    assert "did you mean 'h100-sxm'?" in error_line("systems", "show", "h100")


def test_systems_without_subcommand_still_lists():
    assert "h100-sxm" in ok("systems") and "systems show NAME" in ok("systems")


def test_a_custom_system_file_shows_its_internal_name(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text((REPO / "g5core" / "data" / "systems" / "h100-sxm.yaml").read_text()
                 .replace("name: h100-sxm", "name: my-cluster"))
    cfg = tmp_path / "c.yaml"
    cfg.write_text((EX / "llama-3.1-8b-prefill.yaml").read_text().replace("system: h100-sxm", f"system: {p}")
                   .replace("seq_len: 32768", "seq_len: 1024"))
    assert ok("run", cfg).startswith("llama-3.1-8b on 1 x my-cluster ")


@pytest.mark.parametrize("seconds,text", [
    (1.2441, "1.244 s"), (83.7214, "83.72 s"), (4887560886.2, "4.888e+09 s"), (0.041531, "41.53 ms"),
    (4.0e-6, "4 us"), (0.0, "0 s"),
])
def test_times_have_four_significant_digits(seconds, text):
    assert fmt_s(seconds) == text
