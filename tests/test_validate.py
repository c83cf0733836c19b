"""`g5 validate` and `g5 calibrate`: round trip, bad rows, parameter recovery."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from g5core.present.cli import main
from g5core.api.errors import ConfigError
from g5core.inputs.systems import get_system
from g5core.study.validate import calibrate, predict_ms, read_rows, validate

MODEL = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 8192, "num_attention_heads": 32,
         "num_key_value_heads": 8, "num_hidden_layers": 2, "vocab_size": 1000}
HEADER = "config,set,metric,measured_ms,source\n"


@pytest.fixture()
def setup(tmp_path):
    (tmp_path / "model.json").write_text(json.dumps(MODEL))
    start = get_system("h100-sxm").to_dict()
    (tmp_path / "start.yaml").write_text(yaml.safe_dump(dict(start, name="start")))
    truth = yaml.safe_load(yaml.safe_dump(start))
    truth["name"] = "truth"
    truth["compute_model"]["gemm_peak_fraction"]["bf16"] = 0.6
    truth["compute_model"]["hbm_fraction"] = 0.7
    (tmp_path / "truth.yaml").write_text(yaml.safe_dump(truth))
    for phase in ("prefill", "decode"):
        (tmp_path / f"{phase}.yaml").write_text(yaml.safe_dump({
            "model": "model.json", "system": "start.yaml", "chips": 1,
            "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1}, "phase": phase, "batch": 1, "seq_len": 1024}))
    return tmp_path


ROWS = [("prefill", "seq_len=2048"), ("prefill", "seq_len=4096"), ("prefill", "seq_len=8192"),
        ("decode", "batch=1"), ("decode", "batch=8"), ("decode", "batch=32")]


def _write_csv(d, values, name="m.csv"):
    lines = [HEADER] + [f"{ph}.yaml,{st},{'ttft' if ph == 'prefill' else 'tpot'},{v!r},synthetic\n"
                        for (ph, st), v in zip(ROWS, values)]
    p = d / name
    p.write_text("".join(lines))
    return p


def test_validate_round_trip_on_a_small_csv(setup):
    # measurements that are G5's own predictions (+10% and -5%) come back with those errors
    exact = _write_csv(setup, [1.0] * len(ROWS), "probe.csv")
    pred = [predict_ms(r, exact) for r in read_rows(exact)]
    csv = _write_csv(setup, [p / 1.1 if i % 2 == 0 else p / 0.95 for i, p in enumerate(pred)])
    report = validate(csv)
    errors = [r["error_pct"] for r in report["rows"]]
    assert errors == pytest.approx([10.0 if i % 2 == 0 else -5.0 for i in range(len(ROWS))], rel=1e-9)
    assert report["mape_pct"] == pytest.approx(7.5, rel=1e-9)
    # rows 1, 3 and 5 are +10% up to the last bits of their division: any of them is the worst
    assert report["worst_row"] in (1, 3, 5)
    assert report["worst_error_pct"] == pytest.approx(10.0, rel=1e-9)
    result = CliRunner().invoke(main, ["validate", str(csv), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["mape_pct"] == pytest.approx(7.5, rel=1e-9)
    text = CliRunner().invoke(main, ["validate", str(csv)]).output
    assert f"MAPE 7.5% over 6 rows; worst: row {report['worst_row']} (+10.0%)" in text


def test_rows_equal_but_for_their_tp_degree_report_the_error_against_it(setup):
    """A TP series: rows of one configuration file, framework and metric whose overrides differ
    only in chips and parallel.tp; the trend is the highest degree's error less the lowest's.
    A row at another seq_len is a series of its own (of one degree: no trend)."""
    sets = ["", "chips=2 parallel.tp=2", "chips=4 parallel.tp=4", "seq_len=2048"]
    probe = setup / "probe.csv"
    probe.write_text(HEADER + "".join(f"decode.yaml,{st},tpot,1.0,synthetic\n" for st in sets))
    pred = [predict_ms(r, probe) for r in read_rows(probe)]
    wanted = [0.0, -10.0, -30.0, 5.0]   # G5 at 1, 0.9 and 0.7 times the "measured" step
    csv = setup / "tp.csv"
    csv.write_text(HEADER + "".join(f"decode.yaml,{st},tpot,{p / (1 + w / 100)!r},synthetic\n"
                                    for st, p, w in zip(sets, pred, wanted)))
    report = validate(csv)
    assert [r["tp"] for r in report["rows"]] == [1, 2, 4, 1]
    (trend,) = report["tp_trends"]
    assert trend["rows"] == [1, 2, 3] and trend["framework"] == "-" and trend["metric"] == "tpot"
    assert [tp for tp, _ in trend["errors_by_tp"]] == [1, 2, 4]
    assert [e for _, e in trend["errors_by_tp"]] == pytest.approx([0.0, -10.0, -30.0], abs=1e-9)
    assert trend["trend_pts"] == pytest.approx(-30.0, abs=1e-9)
    text = CliRunner().invoke(main, ["validate", str(csv)]).output
    assert "- tpot decode.yaml: TP1 +0.0%, TP2 -10.0%, TP4 -30.0%; trend -30.0 points" in text
    # one TP degree only: no series, no section
    single = setup / "single.csv"
    single.write_text(HEADER + f"decode.yaml,,tpot,{pred[0]!r},synthetic\n")
    assert "tp_trends" not in validate(single)


def test_a_serving_row_runs_g5_serve_on_its_workload_and_takes_the_statistic(setup):
    """metric ttft_mean / tpot_p50 / ...: g5 serve on the configuration's serving block and
    workload (seeded), the statistic over its requests; the same as simulate_serving gives."""
    from g5core.serve.api import simulate_serving

    cfg = yaml.safe_load((setup / "decode.yaml").read_text())
    cfg["serving"] = {"scheduler": {"max_num_batched_tokens": 2048},
                      "workload": {"requests": 40, "arrival": {"kind": "poisson", "rate_per_s": 20},
                                   "input_tokens": 256, "output_tokens": 16, "seed": 3}}
    (setup / "serve.yaml").write_text(yaml.safe_dump(cfg))
    raw = dict(cfg, model=str(setup / "model.json"), system=str(setup / "start.yaml"))
    summary = simulate_serving(raw).summary
    want = {"ttft_mean": summary["ttft_s"]["mean"], "tpot_p50": summary["tpot_s"]["p50"],
            "itl_mean": summary["itl_s"]["mean"]}
    csv = setup / "serve.csv"
    csv.write_text(HEADER + "".join(f"serve.yaml,,{m},{v * 1e3 / 1.1!r},synthetic\n" for m, v in want.items()))
    report = validate(csv)
    assert [r["error_pct"] for r in report["rows"]] == pytest.approx([10.0] * 3, rel=1e-9)
    # a heavier load queues: the same rows at a higher rate come out slower
    busier = validate(csv, ["serving.workload.arrival.rate_per_s=200"])
    assert busier["rows"][0]["predicted_ms"] > report["rows"][0]["predicted_ms"]
    # a serving metric on a configuration without a serving block: a one-line error naming the row
    bare = setup / "bare.csv"
    bare.write_text(HEADER + "decode.yaml,,tpot_mean,5,synthetic\n")
    with pytest.raises(ConfigError, match=r"bare.csv row 1: metric tpot_mean runs g5 serve: the configuration needs"):
        validate(bare)
    # calibrate fits one-step rows only
    with pytest.raises(ConfigError, match=r"serve.csv row 1: a serving row \(ttft_mean\)"):
        calibrate(csv, ["launch_overhead_s"], setup / "fit.yaml")
    assert not (setup / "fit.yaml").exists()


@pytest.mark.parametrize("row, message", [
    ("nowhere.yaml,,ttft,5,src", "row 1: unknown config 'nowhere.yaml'"),
    ("prefill.yaml,,ttft,,src", "row 1: measured_ms is missing"),
    ("prefill.yaml,,ttft,-3,src", "row 1: measured_ms must be a time > 0 ms, got -3"),
    ("prefill.yaml,,speed,3,src", "row 1: metric must be ttft or tpot (one step), or a serving metric"),
    ("prefill.yaml,,ttft,3,", "row 1: source is empty"),
])
def test_bad_rows_are_one_line_errors_naming_the_row(setup, row, message):
    p = setup / "bad.csv"
    p.write_text(HEADER + row + "\n")
    with pytest.raises(ConfigError) as exc:
        validate(p)
    assert message in str(exc.value) and "\n" not in str(exc.value)
    result = CliRunner().invoke(main, ["validate", str(p)])
    assert result.exit_code == 2 and message in result.output


def test_a_row_whose_metric_does_not_match_the_phase_is_refused(setup):
    p = setup / "bad.csv"
    p.write_text(HEADER + "decode.yaml,,ttft,3,src\n")
    with pytest.raises(ConfigError, match="row 1: metric ttft needs phase prefill"):
        validate(p)


@pytest.mark.bench   # 10-20 s on 2 cores: a benchmark-sized check (python3 -m pytest -q -m bench)
def test_calibrate_recovers_known_parameters_and_reports_the_unidentifiable(setup):
    probe = _write_csv(setup, [1.0] * len(ROWS), "probe.csv")
    truth = str(setup / "truth.yaml")
    noise = 1.0 + 0.002 * np.random.default_rng(7).standard_normal(len(ROWS))   # ~0.2% noise
    measured = [predict_ms(r, probe, truth) * float(n) for r, n in zip(read_rows(probe), noise)]
    csv = _write_csv(setup, measured)
    out = setup / "calibrated.yaml"
    keys = ["compute_model.gemm_peak_fraction.bf16", "compute_model.hbm_fraction", "network_bw_bytes_per_s"]
    report = calibrate(csv, keys, out)
    assert report["fitted"]["compute_model.gemm_peak_fraction.bf16"] == pytest.approx(0.6, rel=0.02)
    assert report["fitted"]["compute_model.hbm_fraction"] == pytest.approx(0.7, rel=0.02)
    assert report["unidentifiable"] == ["network_bw_bytes_per_s"]     # one chip: no row uses the network
    assert len(report["rows"]) == len(ROWS) and all("loo_error_pct" in r for r in report["rows"])
    assert all(abs(r["loo_error_pct"]) < 3 for r in report["rows"])
    # a normal system file, with a comment on what it was fitted on
    text = out.read_text()
    assert text.startswith("# Calibrated by `g5 calibrate` from system 'start' on 6 measured rows")
    assert "NOT identifiable from these rows (left at start): network_bw_bytes_per_s" in text
    fitted = get_system(str(out))
    assert fitted.compute_model.hbm_fraction == pytest.approx(0.7, rel=0.02)
    assert fitted.network_bw_bytes_per_s == get_system(str(setup / "start.yaml")).network_bw_bytes_per_s
    # never clobbered: a second run refuses before any work
    with pytest.raises(ConfigError, match="exists; choose another output file"):
        calibrate(csv, keys, out)


def test_calibrate_command_line_and_bad_key(setup):
    probe = _write_csv(setup, [1.0] * len(ROWS), "probe.csv")
    measured = [predict_ms(r, probe) for r in read_rows(probe)]
    csv = _write_csv(setup, measured)
    out = setup / "c.yaml"
    result = CliRunner().invoke(main, ["calibrate", str(csv), "--fit", "launch_overhead_s", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "leave-one-out" in result.output and out.exists()
    assert math.isclose(get_system(str(out)).launch_overhead_s, get_system("h100-sxm").launch_overhead_s,
                        rel_tol=0.02)
    bad = CliRunner().invoke(main, ["calibrate", str(csv), "--fit", "compute_model.nope", "-o", str(setup / "d.yaml")])
    assert bad.exit_code == 2 and "system has no parameter 'compute_model.nope'" in bad.output
    assert not (setup / "d.yaml").exists()


def _framework_csv(d, values, framework="vllm", name="fw.csv"):
    """Prefill rows of the setup's model under ``framework`` (its column; "" leaves it empty)."""
    rows = ("seq_len=512", "seq_len=1024", "seq_len=2048")
    p = d / name
    p.write_text("config,set,metric,measured_ms,source,framework\n"
                 + "".join(f"prefill.yaml,{r},ttft,{v!r},synthetic,{framework}\n" for r, v in zip(rows, values)))
    return p


def test_calibrate_fits_a_framework_profile_value_the_system_file_does_not_set(setup):
    # the rows ran under vllm (their framework column); the system file has no framework block:
    # the fit starts from the profile's kernel launch (5 us), recovers the truth's 8 us, and the
    # fitted file carries it in a framework block, which prices the rows as the truth does
    truth = dict(yaml.safe_load(yaml.safe_dump(get_system("h100-sxm").to_dict())), name="truth-fw",
                 framework={"kernel_launch_s": 8e-6})
    (setup / "truth-fw.yaml").write_text(yaml.safe_dump(truth))
    probe = _framework_csv(setup, [1.0] * 3, name="probe.csv")
    measured = [predict_ms(r, probe, str(setup / "truth-fw.yaml")) for r in read_rows(probe)]
    before = [predict_ms(r, probe) for r in read_rows(probe)]
    assert all(m > b for m, b in zip(measured, before))     # the prefill runs eagerly: launches show
    csv = _framework_csv(setup, measured)
    out = setup / "fw-fit.yaml"
    report = calibrate(csv, ["framework.kernel_launch_s"], out)
    assert report["start"] == {"framework.kernel_launch_s": 5e-6}
    assert report["fitted"]["framework.kernel_launch_s"] == pytest.approx(8e-6, rel=1e-3)
    text = out.read_text()
    assert "# framework kernel_launch_s from the vllm profile (the rows' framework)" in text
    assert get_system(str(out)).framework.kernel_launch_s == pytest.approx(8e-6, rel=1e-3)
    again = [predict_ms(r, csv, str(out)) for r in read_rows(csv)]
    assert again == pytest.approx(measured, rel=1e-3)


def test_a_framework_block_is_taken_whole_from_the_profile_and_the_rows_must_name_one(setup):
    from g5core.inputs.framework import load_profile
    from g5core.study.validate import _profile_blocks

    start = get_system("h100-sxm").to_dict()
    rows = read_rows(_framework_csv(setup, [1.0] * 3))
    got, note = _profile_blocks(start, ["framework.host.fixed_s"], rows)
    assert got["framework"] == {"host": load_profile("vllm")["framework"]["host"]}   # the whole block
    assert "framework" not in start and "vllm profile" in note
    assert _profile_blocks(start, ["launch_overhead_s"], rows) == (start, "")
    # a system file with a framework block of its own: the keys it leaves at the defaults
    # (graph_kernel_s None) are the profile's, as the rows price them; its own keys stay
    framed = dict(start, framework={**get_system("validation/systems/b200-vllm-2025-07.yaml").to_dict()["framework"]})
    got, note = _profile_blocks(framed, ["framework.graph_kernel_s", "framework.host.fixed_s"], rows)
    assert got["framework"]["graph_kernel_s"] == 5e-7 and note.startswith("framework graph_kernel_s from")
    assert got["framework"]["host"]["overlap"] is False           # the file's host block, not the profile's
    # a per-world-size table's entry by its number: the YAML key is the integer
    from g5core.study.validate import _get, _set
    key = "framework.all_reduce.one_shot_latency_s.8"
    got, _ = _profile_blocks(start, [key], rows)
    assert _get(got, key) == 5.9e-6
    _set(got, key, 4e-6)
    assert got["framework"]["all_reduce"]["one_shot_latency_s"][8] == 4e-6
    assert got["framework"]["all_reduce"]["one_shot_latency_s"][4] == 4.8e-6
    # rows without a framework, or under two: the key's starting value is no one profile's
    bare = _framework_csv(setup, [1.0] * 3, framework="", name="none.csv")
    with pytest.raises(ConfigError, match="framework.host.fixed_s: the system file sets no framework.host") as err:
        calibrate(bare, ["framework.host.fixed_s"], setup / "never.yaml")
    assert "none (row 1)" in str(err.value) and "framework column" in str(err.value)
    mixed = setup / "mixed.csv"
    mixed.write_text("config,set,metric,measured_ms,source,framework\n"
                     "prefill.yaml,seq_len=512,ttft,1.0,synthetic,vllm\n"
                     "prefill.yaml,seq_len=1024,ttft,1.0,synthetic,sglang\n")
    with pytest.raises(ConfigError, match=r"vllm \(row 1\), sglang \(row 2\)"):
        calibrate(mixed, ["framework.kernel_launch_s"], setup / "never.yaml")
    with pytest.raises(ConfigError, match="neither the system file nor the vllm profile sets it"):
        calibrate(_framework_csv(setup, [1.0] * 3, name="v.csv"), ["framework.nope"], setup / "never.yaml")
    assert not (setup / "never.yaml").exists()
