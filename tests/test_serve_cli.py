"""``g5 serve``: the --json object, the summary, output files, bad input."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from g5core.present.cli import main

REPO = Path(__file__).resolve().parent.parent
CONFIG = """model: llama-3.1-8b
system: h100-sxm
chips: 1
parallel: {dp: 1, tp: 1, pp: 1, cp: 1}
serving:
  instances: 2
  router: least_outstanding_tokens
  scheduler: {max_num_batched_tokens: 2048}
"""
FLAGS = ["--rate", "20", "--requests", "40", "--isl", "uniform:200:1500", "--osl", "32", "--seed", "3"]


@pytest.fixture
def config(tmp_path):
    p = tmp_path / "serve.yaml"
    p.write_text(CONFIG)
    return p


def invoke(*args):
    return CliRunner().invoke(main, ["serve", *map(str, args)])


def test_json_has_the_issues_keys_and_is_deterministic(config):
    a = invoke(config, *FLAGS, "--json", "--slo", "ttft=100ms,tpot=15ms")
    assert a.exit_code == 0, a.output
    out = json.loads(a.output)
    for key in ("requests", "completed", "ttft_s", "tpot_s", "e2e_s", "throughput", "goodput", "preemptions",
                "kv_pool_bytes_per_chip", "sim_wall_s"):
        assert key in out
    assert set(out["ttft_s"]) == {"mean", "p50", "p90", "p99"}
    assert set(out["throughput"]) >= {"input_tokens_per_s", "output_tokens_per_s", "output_tokens_per_s_per_chip",
                                      "requests_per_s"}
    assert out["requests"] == out["completed"] == 40 and out["chips"] == 2
    assert out["conservation"] == {"requests_with_wrong_token_count": 0, "requests_out_of_order": 0,
                                   "requests_without_positive_ttft": 0, "requests_not_fcfs": 0,
                                   "steps_over_kv_pool": 0, "kv_blocks_left_at_end": 0}
    b = json.loads(invoke(config, *FLAGS, "--json", "--slo", "ttft=100ms,tpot=15ms").output)
    for d in (out, b):
        d.pop("sim_wall_s")
    assert out == b


def test_summary_and_files(config, tmp_path):
    csv_path, trace_path = tmp_path / "req.csv", tmp_path / "t.json"
    r = invoke(config, *FLAGS, "--requests-csv", csv_path, "--trace", trace_path, "--slo", "ttft=1s")
    assert r.exit_code == 0, r.output
    assert "TTFT" in r.output and "goodput" in r.output and f"wrote        --trace {trace_path}" in r.output
    lines = csv_path.read_text().splitlines()
    assert lines[0].startswith("id,arrival_s,input_tokens") and len(lines) == 41
    trace = json.loads(trace_path.read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert {"serve instance 0", "serve instance 1", "requests"} <= names
    spans = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 2}
    assert {"prefill", "decode"} <= spans


def test_trace_workload_file(config):
    r = invoke(config, "--workload", REPO / "examples" / "traces" / "sample-azure.csv", "--requests", "10", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["requests"] == 10


@pytest.mark.parametrize("args,message", [
    (["--rate", "5", "--requests", "10", "--isl", "100"], "--osl"),
    (["--rate", "5", "--concurrency", "3", "--requests", "10", "--isl", "100", "--osl", "4"], "not both"),
    (["--rate", "5", "--requests", "10", "--isl", "lognormal:1", "--osl", "4"], "two numbers"),
    (["--rate", "5", "--requests", "10", "--isl", "100", "--osl", "4", "--slo", "ttft=2"], "--slo"),
    (["--workload", "nope.csv"], "does not exist"),
    (["--workload", "uniform", "--requests", "3"], "neither a trace file"),
    (["--rate", "5", "--requests", "10", "--isl", "3000000", "--osl", "4"], "KV pool"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(config, tmp_path, args, message):
    out = tmp_path / "req.csv"
    r = invoke(config, *args, "--requests-csv", out)
    assert r.exit_code == 2, r.output
    err = r.stderr if hasattr(r, "stderr") else r.output
    assert message in err and err.count("\n") == 1
    assert not out.exists()


def test_unknown_serving_key(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(CONFIG.replace("  instances: 2", "  instance: 2"))
    r = invoke(p, *FLAGS)
    assert r.exit_code == 2 and "serving.instance" in r.output


def test_disaggregated_config(tmp_path):
    p = tmp_path / "d.yaml"
    p.write_text(CONFIG.replace("  instances: 2\n", "  disaggregation: {prefill: {instances: 1}, decode: {instances: 1}}\n"))
    trace = tmp_path / "t.json"
    r = invoke(p, *FLAGS, "--json", "--trace", trace)
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert [q["role"] for q in out["pools"]] == ["prefill", "decode"] and out["kv_transfer_s"]["mean"] > 0
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert {"prefill instance 0", "decode instance 0", "requests"} <= names
    assert sum(e["name"] == "KV transfer" for e in events if e["ph"] == "X") == 40


def test_db_row_and_a_db_that_is_another_output(config, tmp_path):
    from g5core.study.serve_db import load_serving_rows

    db = tmp_path / "s.db"
    r = invoke(config, *FLAGS, "--db", db)
    assert r.exit_code == 0, r.output
    rows = load_serving_rows(db)
    assert len(rows) == 1 and rows[0]["requests"] == 40 and rows[0]["rate_per_s"] == 20
    clash = invoke(config, *FLAGS, "--db", tmp_path / "x.csv", "--requests-csv", tmp_path / "x.csv")
    assert clash.exit_code == 2 and "--db" in clash.output


def test_g5_run_and_explain_time_one_representative_step_of_each_pool_and_say_which(config, tmp_path):
    """Issue 35 item 7: a file `g5 best --serve` wrote (with its `serving:` block) through the
    one-step commands: each pool's representative step, timed or explained, named."""
    r = CliRunner().invoke(main, ["run", str(config)])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("serving step  the aggregated pool: a decode-only step, ") and "TPOT:" in r.output
    p = tmp_path / "d.yaml"
    p.write_text(CONFIG.replace("  instances: 2\n", "  disaggregation: {prefill: {instances: 1}, decode: {instances: 1}}\n"
                                ) + "  workload: {requests: 20, arrival: {kind: poisson, rate_per_s: 2}, "
                                    "input_tokens: 1000, output_tokens: 100}\n")
    js = json.loads(CliRunner().invoke(main, ["run", str(p), "--json"]).output)["serving_steps"]
    assert [s["pool"] for s in js] == ["prefill", "decode"]
    assert js[0]["step"].startswith("the prefill pool: a full prefill chunk, 2 prompts of 1,000 tokens")
    assert "1,050 tokens of context" in js[1]["step"] and js[1]["deployment"]["batch"] == 256
    ex = CliRunner().invoke(main, ["explain", str(p)])
    assert ex.exit_code == 0 and ex.output.count("serving step  the ") == 2 and "tp groups" in ex.output
    # the configuration's own step wins over the representative one
    own = tmp_path / "own.yaml"
    own.write_text(CONFIG + "phase: prefill\nbatch: 1\nseq_len: 512\n")
    assert "the configuration's own step" in CliRunner().invoke(main, ["run", str(own)]).output


def test_g5_report_shows_serving_rows_in_each_format(config, tmp_path):
    import csv
    import io

    db = tmp_path / "s.db"
    assert invoke(config, *FLAGS, "--db", db).exit_code == 0
    assert invoke(config, *FLAGS[:1], "40", *FLAGS[2:], "--db", db).exit_code == 0   # a second rate
    report = lambda *a: CliRunner().invoke(main, ["report", str(db), *a])  # noqa: E731
    md = report("--serving")
    assert md.exit_code == 0, md.output
    lines = md.output.strip().splitlines()
    assert len(lines) == 4 and "TTFT p99 (s)" in lines[0] and "2x cp=1 dp=1 pp=1 tp=1" in lines[2]
    assert [ln.split(" | ")[5] for ln in lines[2:]] == ["20", "40"]        # ordered by rate (after the workload)
    js = json.loads(report("--serving", "--format", "json").output)
    assert [r["rate_per_s"] for r in js] == [20, 40] and js[0]["summary"]["requests"] == 40
    assert js[0]["config"]["serving"]["instances"] == 2
    rows = list(csv.DictReader(io.StringIO(report("--serving", "--format", "csv").output)))
    assert float(rows[1]["ttft_p99_s"]) == js[1]["ttft_p99_s"]              # bit for bit through repr
    assert json.loads(rows[0]["summary"]) == js[0]["summary"]
    plain = report()
    assert plain.exit_code == 2 and "--serving" in plain.output and "\n" not in plain.output.strip()
    assert report("--serving", "--sweep", "1").exit_code == 2


def test_a_trace_runs_span_and_makespan_are_both_reported_and_named(config):
    """Issue 35 item 8: the trace's arrival span and the simulated makespan, each with the
    req/s over it, named (not the makespan called the trace's duration)."""
    trace = REPO / "examples" / "traces" / "sample-azure.csv"
    r = invoke(config, "--workload", trace, "--requests", "10", "--json")
    out = json.loads(r.output)
    assert out["arrival_span_s"] > 0 and out["makespan_s"] >= out["arrival_span_s"]
    assert out["throughput"]["offered_requests_per_s"] == pytest.approx(10 / out["arrival_span_s"])
    assert out["throughput"]["requests_per_s"] == pytest.approx(10 / out["makespan_s"])
    text = invoke(config, "--workload", trace, "--requests", "10").output
    assert "\narrivals     over " in text and "requests/s offered" in text
    assert "\nmakespan     " in text and "simulated, first arrival to last token" in text and "requests/s served" in text
