"""Warnings (issue 10): stderr, one line each, never a change to the results."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from g5core.present.caveats import deployment_warnings, plural
from g5core.session.run import load_raw, run

from test_cli import invoke

EX = Path(__file__).resolve().parent.parent / "examples"
CFG_8B = EX / "llama-3.1-8b-prefill.yaml"


def _warnings(*sets: str) -> list[str]:
    args = ["run", CFG_8B, "--json"]
    for s in sets:
        args += ["--set", s]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    lines = result.stderr.strip().splitlines()
    assert all(l.startswith("g5: warning: ") for l in lines)
    return [l[len("g5: warning: "):] for l in lines]


def test_a_plain_run_has_no_warning():
    assert _warnings("seq_len=1024") == []


def test_tp_across_nodes_and_beyond_kv_heads_warn():
    ws = _warnings("chips=16", "parallel.tp=16", "seq_len=1024", "model=llama-3.1-405b", "dtypes.weights=fp8")
    assert len(ws) == 2
    assert ws[0].startswith("tp=16 spans nodes (8 chips per node): 1 of 1 TP group cross node boundaries")
    assert ws[1].startswith("heads are split 16 ways but llama-3.1-405b has 8 KV heads: each KV head is "
                            "replicated on 2 chips")
    # inside a node and within the KV heads: neither
    assert _warnings("chips=8", "parallel.tp=8", "seq_len=1024", "model=llama-3.1-70b") == []


def test_sequence_beyond_context_warns():
    (w,) = _warnings("seq_len=131073", "dtypes.kv_cache=fp8", "system=b200")
    assert w.startswith("seq_len 131,073 is beyond the 131,072-token context llama-3.1-8b was trained for")
    assert _warnings("seq_len=131072", "dtypes.kv_cache=fp8", "system=b200") == []


def test_not_fitting_warns_even_with_json():
    (w,) = _warnings("seq_len=65536", "batch=16")
    assert w.startswith("the layout does not fit by ") and "on chip 0 (of 80.0 GiB each)" in w


def test_warnings_do_not_change_results():
    sets = ["chips=16", "parallel.tp=16", "seq_len=200000", "batch=16", "model=llama-3.1-70b"]
    out = run(load_raw(CFG_8B, sets))
    assert len(deployment_warnings(out.plan.ctx, out.memory)) == 4
    result = invoke("run", CFG_8B, "--json", *[a for s in sets for a in ("--set", s)])
    cli = json.loads(result.stdout)
    api = out.to_json_dict()
    for d in (cli, api):
        d.pop("sim_wall_s")
    assert cli == json.loads(json.dumps(api))


@pytest.mark.parametrize("n,text", [(1, "1 chip"), (2, "2 chips"), (0, "0 chips")])
def test_plural(n, text):
    assert plural(n, "chip") == text
