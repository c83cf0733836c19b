"""Resource guard (issue 10): the op and flow count is estimated from the deployment before
anything is built, and a run above the limit is refused with the estimate and its memory."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import g5core.lower.builder as build_mod
from g5core.lower.builder import BUILD_S_PER_LOGICAL_OP, DEFAULT_MAX_OPS, WALL_S_PER_OP, estimate_size
from g5core.api.errors import ResourceError
from g5core.session.run import load_raw, make_plan, run, simulate_plan

from test_cli import error_line, invoke

REPO = Path(__file__).resolve().parent.parent
EX = REPO / "examples"


@pytest.mark.parametrize("example,overrides", [
    ("llama-3.1-70b-prefill", ["seq_len=4096"]),                                     # tp
    # tp, cp pass-KV, ep: on 4 of the 61 layers (one dense, three alike MoE ones), and on all as a bench check
    ("deepseek-v3-1m-prefill-cp8", ["seq_len=16384", "model=DEEPSEEK-4-LAYERS"]),
    pytest.param("deepseek-v3-1m-prefill-cp8", ["seq_len=16384"], marks=pytest.mark.bench),
    ("deepseek-v3-1m-decode-cp8", ["seq_len=16384"]),                                # cp pass-Q
    ("llama-3.1-8b-prefill", ["chips=4", "parallel.dp=4", "batch=2", "seq_len=1024"]),  # dp
    ("llama-3.1-70b-decode", []),                                                    # pp=2
    ("llama-3.1-70b-decode", ["parallel.pp=4", "parallel.tp=4"]),                    # pp=4
])
def test_estimate_equals_what_the_build_makes(example, overrides, tmp_path):
    if "model=DEEPSEEK-4-LAYERS" in overrides:
        hf = json.loads((REPO / "tests" / "data" / "hf" / "deepseek-v3.json").read_text())
        (tmp_path / "deepseek-v3.json").write_text(json.dumps(dict(hf, num_hidden_layers=4, first_k_dense_replace=1)))
        overrides = [f"model={tmp_path / 'deepseek-v3.json'}" if o == "model=DEEPSEEK-4-LAYERS" else o
                     for o in overrides]
    plan = make_plan(load_raw(EX / f"{example}.yaml", overrides))
    est = estimate_size(plan)
    sim = simulate_plan(plan, symmetry=False)
    assert (est.ops, est.flows) == (sim.ops, sim.flows)
    reduced = simulate_plan(plan)  # one of k identical replicas, where symmetry holds: 1/k of the ops
    k = reduced.symmetry.replicas
    assert (est.ops, est.flows) == (reduced.ops * k, reduced.flows * k)


def test_a_million_chips_is_refused_before_the_rank_map_is_built(monkeypatch):
    monkeypatch.setattr(build_mod.RankMap, "build", lambda *a, **k: pytest.fail("built the rank map"))
    line = error_line("run", EX / "llama-3.1-8b-prefill.yaml", "--set", "chips=3000000", "--set",
                      "parallel.dp=3000000")
    assert "at least 18,000,000 ops" in line and "GiB of memory" in line
    assert f"limit of {DEFAULT_MAX_OPS:,}" in line and "--max-ops 18000000" in line


def test_a_million_layers_is_refused(tmp_path):
    hf = json.loads((REPO / "tests" / "data" / "hf" / "llama-3.1-8b.json").read_text())
    model = tmp_path / "config.json"
    model.write_text(json.dumps(dict(hf, num_hidden_layers=3 * 10 ** 6)))
    with pytest.raises(ResourceError, match="at least 18,000,000 ops"):
        run(load_raw(EX / "llama-3.1-8b-prefill.yaml", [f"model={model}", "seq_len=1024"]))


def test_the_refined_estimate_refuses_with_the_exact_count_and_max_ops_lifts_it():
    cfg = EX / "llama-3.1-70b-prefill.yaml"
    sim = run(load_raw(cfg, ["seq_len=1024"])).sim          # what the build really makes
    line = error_line("run", cfg, "--set", "seq_len=1024", "--max-ops", "5000")
    assert f"about {sim.ops:,} ops and {sim.flows:,} flows" in line
    # the limit charges the build too: each logical op as BUILD_S_PER_LOGICAL_OP / WALL_S_PER_OP ops
    plan = make_plan(load_raw(cfg, ["seq_len=1024"]))
    charged = sim.ops + sim.flows + math.ceil(len(plan.program()) * BUILD_S_PER_LOGICAL_OP / WALL_S_PER_OP)
    assert f"--max-ops {charged}" in line and charged > sim.ops + sim.flows
    assert invoke("run", cfg, "--set", "seq_len=1024", "--max-ops", str(charged - 1)).exit_code == 2
    result = invoke("run", cfg, "--set", "seq_len=1024", "--max-ops", str(charged))
    assert result.exit_code == 0, result.output


def _many_layer_llama(tmp_path, layers):
    """A llama-like config of hidden 1024 and ``layers`` layers on one chip, as a raw run config."""
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
          "intermediate_size": 4096, "num_attention_heads": 8, "num_key_value_heads": 8,
          "num_hidden_layers": layers, "vocab_size": 32000, "max_position_embeddings": 8192,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return {"model": str(tmp_path / "config.json"), "system": "h100-sxm", "chips": 1, "phase": "prefill",
            "batch": 1, "seq_len": 1024, "parallel": {"tp": 1, "cp": 1, "dp": 1, "pp": 1}}


def test_a_build_bound_model_of_many_layers_is_refused_by_its_build_time(tmp_path):
    """Ops that do not tile cost the build about 30 times the engine's time per op: a model of
    1,000 layers on one chip (6,003 ops, 11,005 logical ops) is refused for its build under a
    limit of a hundredth of the default, 20 times its ops (the default limit's own case,
    100,000 layers, is the bench check below)."""
    with pytest.raises(ResourceError, match=r"about 6,003 ops .*with its 11,005 logical ops' build, counted as"):
        run(_many_layer_llama(tmp_path, 1_000), max_ops=DEFAULT_MAX_OPS // 100)


@pytest.mark.bench   # 10-15 s on 2 cores: a benchmark-sized check (python3 -m pytest -q -m bench)
def test_a_build_bound_model_of_100000_layers_is_refused_by_its_build_time_at_the_default_limit(tmp_path):
    """600,003 ops, 1,100,005 logical ops: refused for its build at the default limit."""
    with pytest.raises(ResourceError, match=r"about 600,003 ops .*with its 1,100,005 logical ops' build, counted as"):
        run(_many_layer_llama(tmp_path, 100_000))


def test_the_math_path_is_guarded_too():
    with pytest.raises(ResourceError):
        run(load_raw(EX / "llama-3.1-70b-prefill.yaml", ["path=math", "seq_len=1024"]), max_ops=100)


def test_max_ops_must_be_positive():
    assert "--max-ops: must be a positive whole number" in error_line(
        "run", EX / "llama-3.1-8b-prefill.yaml", "--max-ops", "0")


def test_progress_reports_the_estimate_first():
    lines: list[str] = []
    run(load_raw(EX / "llama-3.1-8b-prefill.yaml", ["seq_len=1024"]), progress=lines.append)
    assert lines[0].startswith("estimated about 195 ops (under 1 MiB of memory")
    assert any(l.startswith("simulating 195 ops") for l in lines)


def test_explain_is_guarded_and_takes_max_ops():
    cfg = EX / "llama-3.1-8b-prefill.yaml"
    line = error_line("explain", cfg, "--max-ops", "10")
    assert "at least 192 ops (under 1 MiB of memory and under 1 s to simulate)" in line and "--max-ops 192" in line
    assert "layout  1 chip on 1 node" in invoke("explain", cfg, "--max-ops", "192").stdout


def test_progress_appears_on_a_terminal_and_not_in_a_pipe():
    import os
    import pty
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "g5core", "run", str(EX / "llama-3.1-8b-prefill.yaml"), "--set", "seq_len=1024"]
    leader, follower = pty.openpty()
    try:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=follower, timeout=60)
        os.close(follower)
        tty = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal closed
                break
            if not chunk:
                break
            tty += chunk
    finally:
        os.close(leader)
    assert done.returncode == 0
    text = tty.decode()
    assert "] estimated about 195 ops" in text and "] simulating 195 ops" in text
    piped = subprocess.run(cmd, capture_output=True, timeout=60)
    assert piped.returncode == 0 and piped.stderr == b""


def test_max_ops_beyond_32_bit_ids_is_refused():
    line = error_line("run", EX / "llama-3.1-8b-prefill.yaml", "--max-ops", str(2 ** 31))
    assert "--max-ops: must be at most 2,147,483,647 (op and flow ids are 32-bit)" in line
