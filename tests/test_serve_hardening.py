"""Issue 36: every signature the serving fuzz found is a one-line error naming the field
where it was given (the configuration key or the flag; the file, line and field for a
trace), exit 2; an output may not be an input however the input was named."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from g5core.api.errors import ConfigError, G5Error
from g5core.inputs.serving import parse_serving, workload_spec
from g5core.present.cli import main
from g5core.serve.traces import read_trace
from g5core.serve.workload import synthetic


class Names:
    schedulers = {"vllm": None}
    routers = {"round_robin": None}


W = {"requests": 4, "arrival": {"kind": "poisson", "rate_per_s": 2}, "input_tokens": 10, "output_tokens": 4}


def one_line(exc_info, field):
    text = str(exc_info.value)
    assert "\n" not in text and text.startswith(field), text
    return text


@pytest.mark.parametrize("block, field", [
    ({"scheduler": {"name": []}}, "serving.scheduler.name"),       # TypeError in pool
    ({"router": {"a": 1}}, "serving.router"),                      # TypeError in pool
    ({"routing_s": 10 ** 400}, "serving.routing_s"),               # OverflowError in parse_serving
    ({"instances": 2 ** 63}, "serving.instances"),
    ({"scheduler": {"max_num_seqs": 10 ** 30}}, "serving.scheduler.max_num_seqs"),
])
def test_bad_serving_fields(block, field):
    with pytest.raises(ConfigError) as e:
        parse_serving(block, Names)
    one_line(e, field)


@pytest.mark.parametrize("change, field", [
    ({"arrival": {"kind": "gamma", "rate_per_s": 1, "cv": 1e-200}}, "serving.workload.arrival.cv"),  # ZeroDivision
    ({"arrival": {"kind": "gamma", "rate_per_s": 1, "cv": 1e9}}, "serving.workload.arrival.cv"),
    ({"arrival": {"kind": "poisson", "rate_per_s": 1e-300}}, "serving.workload.arrival.rate_per_s"),
    ({"input_tokens": 2 ** 70}, "serving.workload.input_tokens.tokens"),                   # ZeroDivision
    ({"input_tokens": {"kind": "hist", "bins": {10: 1e308, 20: 1e308}}},                  # ValueError
     "serving.workload.input_tokens.bins"),
    ({"input_tokens": {"kind": "uniform", "low": 1, "high": 2 ** 70}}, "serving.workload.input_tokens.high"),
    ({"requests": 10 ** 400}, "serving.workload.requests"),                                # OverflowError in _num
    ({"prefix": {"groups": 2 ** 70, "tokens": 4}}, "serving.workload.prefix.groups"),
])
def test_bad_workload_fields(change, field):
    with pytest.raises(ConfigError) as e:
        synthetic({**W, **change})
    one_line(e, field)


@pytest.mark.parametrize("base, field", [({"arrival": 5}, "serving.workload.arrival"),      # ValueError/TypeError
                                         ({"arrival": "x"}, "serving.workload.arrival"),
                                         ("8", "serving.workload")])
def test_bad_workload_spec(base, field):
    with pytest.raises(ConfigError) as e:
        workload_spec(base, "poisson", 5, 3.0, None, 10, 5)
    one_line(e, field)


@pytest.mark.parametrize("text, where", [
    ("arrival_s,input_tokens,output_tokens\n0,\"" + "1" * 200_000 + "\",2\n", "line 2, field csv"),   # _csv.Error
    ('{"timestamp": 1' + "0" * 400 + ', "input_length": 5, "output_length": 2}\n', "line 1, field timestamp"),
    ('{"arrival_s": 1e20, "input_tokens": 5, "output_tokens": 3}\n', "line 1, field arrival_s"),
    ("arrival_s,input_tokens,output_tokens\n0,5,3\n1,nan,3\n", "line 3, field input_tokens"),
    ("arrival_s,input_tokens,output_tokens\n0,5\n", "line 2, field columns"),
    ("arrival_s,input_tokens,output_tokens\n", "field requests"),
    ("arrival_s,input_tokens,output_tokens\n-1,5,3\n", "line 2, field arrival_s"),
])
def test_bad_trace_lines_name_file_line_and_field(tmp_path, text, where):
    p = tmp_path / ("t.jsonl" if text.startswith("{") else "t.csv")
    p.write_text(text)
    with pytest.raises(G5Error) as e:
        read_trace(str(p))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(p)) and where in msg, msg


@pytest.mark.parametrize("path", [5, ["a"], ""])
def test_a_trace_that_is_not_a_file_name(path):                                              # TypeError in read_trace
    with pytest.raises(ConfigError) as e:
        read_trace(path, field="serving.workload.trace")
    one_line(e, "serving.workload.trace")


CONFIG = """model: llama-3.1-8b
system: h100-sxm
chips: 1
parallel: {dp: 1, tp: 1, pp: 1, cp: 1}
serving:
  workload: WORKLOAD
"""


def serve(tmp_path, workload, *args):
    (tmp_path / "cfg.yaml").write_text(CONFIG.replace("WORKLOAD", workload))
    return CliRunner().invoke(main, ["serve", str(tmp_path / "cfg.yaml"), *map(str, args)])


@pytest.mark.parametrize("option", ["--requests-csv", "--trace"])
def test_an_output_may_not_be_the_configurations_trace(tmp_path, monkeypatch, option):
    monkeypatch.chdir(tmp_path)
    text = "arrival_s,input_tokens,output_tokens\n0,100,4\n"
    (tmp_path / "trace.csv").write_text(text)
    res = serve(tmp_path, "{trace: trace.csv}", option, "trace.csv")
    assert res.exit_code == 2 and "serving.workload.trace" in res.output and option in res.output, res.output
    assert (tmp_path / "trace.csv").read_text() == text


def test_a_bad_key_of_the_configuration_is_named_there_not_as_a_flag(tmp_path):
    res = serve(tmp_path, "{Requests: 5, requests: 4, arrival: {kind: poisson, rate_per_s: 2}, input_tokens: 100, "
                          "output_tokens: 4}", "--rate", "3")
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and "serving.workload.Requests" in lines[0], res.output


def test_a_bad_flag_is_named_as_the_flag(tmp_path):
    res = serve(tmp_path, "{requests: 4, arrival: {kind: poisson, rate_per_s: 2}, input_tokens: 100, "
                          "output_tokens: 4}", "--osl", "0")
    assert res.exit_code == 2 and res.output.startswith("g5: error: --osl"), res.output


@pytest.mark.parametrize("workload, args, start", [
    # --workload gave cv, --rate the rate: a bad cv was named --rate
    ("{requests: 4, input_tokens: 100, output_tokens: 4}", ("--workload", "gamma:cv=0", "--rate", 2),
     "g5: error: --workload: cv must be positive, got 0.0"),
    ("{requests: 4, input_tokens: 100, output_tokens: 4}", ("--workload", "gamma:cv=2,rate=0"),
     "g5: error: --workload: rate must be positive"),
    ("{requests: 4, input_tokens: 100, output_tokens: 4}", ("--workload", "gamma:cv=2"),
     "g5: error: --rate: an open-loop workload needs its arrival rate: give --rate R"),
    # the file's cv with --rate over the file's rate: the file's key, not --rate
    ("{requests: 4, arrival: {kind: gamma, cv: 0.0001, rate_per_s: 2}, input_tokens: 100, output_tokens: 4}",
     ("--rate", 3), "g5: error: serving.workload.arrival.cv: is 0.0001, below 0.001"),
    ("{requests: 4, arrival: {kind: gamma, cv: 2, rate_per_s: 2}, input_tokens: 100, output_tokens: 4}",
     ("--rate", 0), "g5: error: --rate: must be positive"),
])
def test_a_bad_arrival_setting_is_named_where_it_was_given(tmp_path, workload, args, start):
    res = serve(tmp_path, workload, *args)
    assert res.exit_code == 2 and res.output.startswith(start) and len(res.output.strip().splitlines()) == 1, \
        res.output


def test_a_run_above_the_work_limit_is_refused_with_its_estimate_and_runs_with_the_limit_raised():
    from g5core.serve.api import simulate_serving

    raw = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 1, "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1}}
    wl = {"requests": 6, "arrival": {"kind": "poisson", "rate_per_s": 10}, "input_tokens": 100, "output_tokens": 20}
    # 6 requests x (20 + 1) = 126 sequence-steps; at least 21 steps, 9 each: 315
    with pytest.raises(ConfigError) as e:
        simulate_serving(raw, wl, runner=lambda groups: 0.01, max_work=300)
    msg = one_line(e, "--max-steps")
    assert "315" in msg and "126" in msg
    res = simulate_serving(raw, wl, runner=lambda groups: 0.01, max_work=315)
    assert res.summary["completed"] == 6


def test_the_default_work_limit_refuses_a_huge_run_before_it_starts(tmp_path):
    res = serve(tmp_path, "{requests: 200000, arrival: {kind: poisson, rate_per_s: 2}, input_tokens: 100, "
                          "output_tokens: 1000}")
    assert res.exit_code == 2 and res.output.startswith("g5: error: --max-steps: this serving run is at least"), \
        res.output


def test_a_search_above_the_work_limit_is_refused():
    from g5core.serve.api import check_search_work

    wl = {"requests": 300, "arrival": {"kind": "poisson", "rate_per_s": 1}, "input_tokens": 100, "output_tokens": 9}
    assert check_search_work(5, wl, 30_000) == 5 * 2 * 300 * 10
    with pytest.raises(ConfigError) as e:
        check_search_work(6, wl, 30_000)
    assert "6 candidates x 2 runs x 300 requests" in one_line(e, "--max-steps")


def test_extreme_legal_workloads_are_refused_or_bounded():
    """A gamma cv of 100 samples in an instant; an osl of 10^6 is one request's million steps."""
    w = synthetic({**W, "requests": 1000, "arrival": {"kind": "gamma", "rate_per_s": 10, "cv": 100}})
    assert len(w.requests) == 1000
    from g5core.inputs.serving import PoolSpec, SchedulerSettings, ServingSpec
    from g5core.serve.api import check_work
    spec = ServingSpec((PoolSpec("serve", 1, (), SchedulerSettings(), "vllm", "round_robin"),), 0.0, (), None)
    # three of 10^6 output tokens: 3,000,003 sequence-steps in 1,000,001 steps: within the limit
    assert check_work(synthetic({**W, "requests": 3, "output_tokens": 10 ** 6}), spec) == 3_000_003 + 9 * 1_000_001
    with pytest.raises(ConfigError):
        check_work(synthetic({**W, "requests": 20, "output_tokens": 10 ** 6}), spec)
