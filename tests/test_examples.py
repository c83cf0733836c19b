"""Every shipped example, and every command quoted in an example's comment or in the README,
runs; and what the text claims about it (it fits, a latency rises or falls) holds.

Each example's comment states "It fits in memory." or "It does not fit in memory"; the
trend claims are quoted below from the text (the test fails if the text changes) and
checked on the runs the text names.

The llama-3.1-405b example is the one slow case (a 1M-token run simulates one of its two
replicas, 0.9 M ops and flows, in about 6 s; test_examples_json.py runs it at 128K): its claims here are about memory
and the layout, so it is checked without the simulation (validation, the memory ledger and
the size estimate). Its TTFT figures in the README come from `g5 run` (see README).
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from g5core.lower.builder import check_size
from g5core.sim.memory import memory_report
from g5core.session.run import load_raw, make_plan

from test_cli import invoke

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
SLOW = {"llama-3.1-405b-1m-prefill-cp16.yaml"}
# a command ends at a space or at the backtick that closes its quote
COMMAND = re.compile(r"(?:\bg5|python3 -m g5core) run (examples/[^\s`]+\.yaml)((?: --set [^\s`]+)*)")


def comment_text(path: Path) -> str:
    """The example's comment lines as one paragraph."""
    lines = [l[1:].strip() for l in path.read_text().splitlines() if l.startswith("#")]
    return " ".join(lines)


def quoted_commands() -> list[tuple[str, str, tuple[str, ...]]]:
    """(where it is quoted, example file name, --set overrides) for every quoted command."""
    out = []
    sources = [(p.name, p.read_text()) for p in EXAMPLES] + [("README.md", (REPO / "README.md").read_text())]
    for where, text in sources:
        for line in text.splitlines():
            for m in COMMAND.finditer(line):
                args = shlex.split(m.group(2))
                # the example's path under examples/ (a file in a subfolder keeps its folder)
                out.append((where, Path(m.group(1)).relative_to("examples").as_posix(), tuple(args[1::2])))
    return out


def run_json(example: str, overrides: tuple[str, ...] = ()) -> dict:
    """`g5 run EXAMPLE --set ... --json`, through the command line, once per distinct
    configuration (the cp8 example's cp=16 command is the cp16 example but for its name)."""
    raw = load_raw(REPO / "examples" / example, overrides)
    raw.pop("name", None)
    key = json.dumps(raw, sort_keys=True)
    if key not in _RUNS:
        args = ["run", REPO / "examples" / example, "--json"]
        for o in overrides:
            args += ["--set", o]
        result = invoke(*args)
        assert result.exit_code == 0, (example, overrides, result.output)
        _RUNS[key] = json.loads(result.stdout)
    return _RUNS[key]


_RUNS: dict[str, dict] = {}


def check_without_simulating(example: str, overrides: tuple[str, ...] = ()) -> bool:
    """Validate, estimate the size and build the memory ledger; True when it fits."""
    plan = make_plan(load_raw(REPO / "examples" / example, overrides))
    check_size(plan)
    return memory_report(plan.ctx).fits


def fits(example: str, overrides: tuple[str, ...] = ()) -> bool:
    if example in SLOW:
        return check_without_simulating(example, overrides)
    return run_json(example, overrides)["memory"]["fits"]


def latency(example: str, overrides: tuple[str, ...] = ()) -> float:
    return run_json(example, overrides)["latency_s"]


def max_kv_bytes(example: str, overrides: tuple[str, ...] = ()) -> float:
    return max(c["kv_cache_bytes"] for c in run_json(example, overrides)["memory"]["per_chip"])


def test_the_commands_are_found():
    found = quoted_commands()
    assert ("README.md", "deepseek-v3-1m-prefill-cp8.yaml", ()) in found
    assert len(found) >= 6


@pytest.mark.parametrize("where,example,overrides", quoted_commands(),
                         ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_every_quoted_command_runs(where, example, overrides):
    assert (REPO / "examples" / example).is_file(), f"{where} quotes a missing example {example}"
    if example in SLOW:
        check_without_simulating(example, overrides)
    else:
        # a serving configuration's `g5 run` times one representative step of each pool
        result = run_json(example, overrides)
        for step in result.get("serving_steps", [result]):
            assert step["conservation"] == dict.fromkeys(step["conservation"], 0)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_says_whether_it_fits_and_is_right(path):
    text = comment_text(path)
    says_fits = "It fits in memory." in text
    says_not = "It does not fit in memory" in text
    assert says_fits != says_not, f"{path.name} must say exactly one of 'It fits in memory.' / 'It does not fit'"
    assert fits(path.name) == says_fits


def test_cp8_prefill_claims():
    name = "deepseek-v3-1m-prefill-cp8.yaml"
    text = comment_text(REPO / "examples" / name)
    assert "to see TTFT fall and the KV cache per chip halve; that layout does not fit" in text
    cp16 = ("parallel.cp=16", "parallel.dp=2", "parallel.ep=4")
    assert ("deepseek-v3-1m-prefill-cp8.yaml", name, cp16) in [(n, e, o) for n, e, o in quoted_commands()]
    assert latency(name, cp16) < latency(name)
    assert max_kv_bytes(name, cp16) == max_kv_bytes(name) / 2
    assert not fits(name, cp16)


def test_cp16_prefill_claims():
    name, base = "deepseek-v3-1m-prefill-cp16.yaml", "deepseek-v3-1m-prefill-cp8.yaml"
    text = comment_text(REPO / "examples" / name)
    assert "TTFT halves and the KV cache per chip halves" in text
    assert latency(name) / latency(base) == pytest.approx(0.5, abs=0.05)
    assert max_kv_bytes(name) == max_kv_bytes(base) / 2


def test_decode_claims():
    name = "deepseek-v3-1m-decode-cp8.yaml"
    text = comment_text(REPO / "examples" / name)
    assert "TPOT falls as cp rises: with cp=4 it is higher (and does not fit)" in text
    cp4 = ("parallel.cp=4", "parallel.dp=8")
    assert latency(name, cp4) > latency(name)
    assert not fits(name, cp4)
    assert "At a short context the weights dominate and TPOT rises with cp" in text
    short = ("seq_len=32768",)
    rising = latency(name, short) / latency(name, ("seq_len=32768",) + cp4)
    # rises: cp=8's pass-Q dispatch and reduce cross nodes at the measured floors (4.5 ms exposed
    # against 0.8 ms at cp=4, measured 2026-12-01), more than the KV read cp=8 halves at 32K
    # tokens; with the side kernels at their measured 1.27 us floor the compute is smaller and
    # the rise larger (about 16%), so 1.1 no longer holds: the bound is the network's, not tuned
    assert 1.0 < rising < 1.2


def test_405b_example_uses_fp8_ffn_weights_as_the_readme_says():
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "with fp8 FFN weights as in the paper, so that it fits in 80 GB" in readme
    raw = load_raw(REPO / "examples" / "llama-3.1-405b-1m-prefill-cp16.yaml")
    assert raw["dtypes"]["weights"] == {"default": "bf16", "ffn": "fp8"}
    assert not check_without_simulating("llama-3.1-405b-1m-prefill-cp16.yaml", ("dtypes.weights=bf16",))
