"""The streamed trace and timeline (issue 25, item 1) write what the list-building ones of
commit 8e0ef11 wrote, byte for byte (``trace_reference.py`` is that code, kept as the
oracle), on the shipped examples made small enough to simulate every chip."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

import trace_reference as ref
from g5core.api.errors import ConfigError
from g5core.present import trace
from g5core.session.run import load_raw, run

CASES = [
    ("examples/llama-3.1-8b-prefill.yaml", ["seq_len=4096", "chips=4", "parallel.tp=4"]),
    ("examples/llama-3.1-70b-decode.yaml", []),
    ("examples/deepseek-v3-1m-prefill-cp8.yaml", ["seq_len=8192", "model=DEEPSEEK-3-LAYERS"]),
    # 4 of the 126 layers (the trace writes each layer alike; two nodes, cp and dp as shipped)
    ("examples/llama-3.1-405b-1m-prefill-cp16.yaml", ["seq_len=8192", "chips=32", "parallel.cp=2",
                                                      "parallel.dp=2", "model=LLAMA-405B-4-LAYERS"]),
]

#: a model of the shipped HF configuration with fewer layers: placeholder -> (file, changes)
FEW_LAYERS = {"DEEPSEEK-3-LAYERS": ("deepseek-v3.json", {"num_hidden_layers": 3, "first_k_dense_replace": 1}),
              "LLAMA-405B-4-LAYERS": ("llama-3.1-405b.json", {"num_hidden_layers": 4})}


def _run(path, overrides, folder):
    root = Path(__file__).resolve().parent.parent
    for name, (source, changes) in FEW_LAYERS.items():
        hf = json.loads((root / "tests" / "data" / "hf" / source).read_text())
        hf.update(changes)
        (folder / f"{name.lower()}.json").write_text(json.dumps(hf))
        overrides = [o.replace(name, str(folder / f"{name.lower()}.json")) for o in overrides]
    raw = load_raw(str(root / path), overrides)
    return run(raw, symmetry=False, record_port_rates=True, max_ops=3_000_000)


@pytest.fixture(scope="module", params=CASES, ids=[c[0].split("/")[-1] + (" " + " ".join(c[1]) if c[1] else "")
                                                   for c in CASES])
def case(request, tmp_path_factory):
    try:
        return _run(*request.param, tmp_path_factory.mktemp("hf"))
    except ConfigError as exc:   # an override the model does not take: the case is misstated
        pytest.fail(str(exc))


def test_the_trace_is_byte_for_byte_what_the_list_builder_wrote(case):
    old, new = io.StringIO(), io.StringIO()
    ref.dump_trace(case.sim, case.plan.ctx.topology, old)
    trace.dump_trace(case.sim, case.plan.ctx.topology, new)
    assert new.getvalue() == old.getvalue()
    assert len(json.loads(new.getvalue())["traceEvents"]) == len(ref.trace_events(case.sim, case.plan.ctx.topology))


def test_the_timeline_is_byte_for_byte_what_the_list_builder_wrote(case):
    old, new = io.StringIO(), io.StringIO()
    ref.dump_timeline(case.sim, old)
    trace.dump_timeline(case.sim, new)
    assert new.getvalue() == old.getvalue()
    assert new.getvalue().count("\n") == case.sim.compiled.n_ops + 1


def test_trace_layers_draws_only_those_layers_ops_and_flows(case):
    topo = case.plan.ctx.topology
    events = trace.trace_events(case.sim, topo, trace.parse_layers("0-1"))
    ops = case.sim.dag.ops
    keys = {op.key for op in ops if op.layer in (0, 1)}
    drawn = {e["name"] for e in events if e["ph"] == "X" and e.get("tid", 0) < trace.PORT_TID_BASE}
    assert drawn == keys
    flows = {e["args"]["op"] for e in events if e["ph"] == "X" and e["tid"] >= trace.PORT_TID_BASE}
    assert flows <= keys
    full = trace.trace_events(case.sim, topo)
    assert len(events) < len(full)


@pytest.mark.parametrize("text, layers", [("0-3", {0, 1, 2, 3}), ("5", {5}), ("0-1,80", {0, 1, 80})])
def test_parse_layers(text, layers):
    assert trace.parse_layers(text) == layers


@pytest.mark.parametrize("text", ["a", "3-1", "-2", "1-b", ""])
def test_parse_layers_refuses_what_is_not_a_range(text):
    with pytest.raises(ConfigError, match="--trace-layers"):
        trace.parse_layers(text)


def test_trace_layers_on_the_command_line(tmp_path):
    from test_cli import error_line, ok
    root = Path(__file__).resolve().parent.parent
    cfg = root / "examples" / "llama-3.1-8b-prefill.yaml"
    assert "give --trace FILE too" in error_line("run", cfg, "--trace-layers", "0-1")
    assert "--trace-layers" in error_line("run", cfg, "--trace", tmp_path / "t.json", "--trace-layers", "1-0")
    # a layer past the model's (llama-3.1-8b: 32 layers, the LM head 32) drew nothing of it, silently
    assert "layer 33 is past llama-3.1-8b's layers: 0-31 (and 32, the LM head)" in error_line(
        "run", cfg, "--trace", tmp_path / "t.json", "--trace-layers", "30-40")
    assert not (tmp_path / "t.json").exists()
    ok("run", cfg, "--set", "seq_len=1024", "--trace", tmp_path / "t.json", "--trace-layers", "0")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    names = {e["name"] for e in events if e["ph"] == "X" and e["tid"] < trace.PORT_TID_BASE}
    assert names and all(n.startswith("L000.") for n in names)
