"""`g5 calibrate` (issue 25, items 4 and 5; issue 23's calibrate bullets): the shipped file,
suspect fits, leave-one-out against the prior, and its output through the shared checks.

The fits here use a synthetic prediction (monkeypatched ``predict_ms``: a row's time as a
known function of the parameters), so they take no simulation; the parts that need G5's
own predictions are tests/test_validate.py's."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import yaml

from g5core.api.errors import ConfigError
from g5core.inputs.systems import get_system
from g5core.inputs import outputs
from g5core.study import validate
from g5core.study.validate import _system_of, calibrate, read_rows

from test_cli import invoke

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "validation" / "measured.csv"


def test_the_shipped_file_names_one_system_through_two_relative_paths():
    rows = read_rows(SHIPPED)
    raw = [validate.row_config(r)["system"] for r in rows]
    assert len(set(raw)) > 1                           # written differently ...
    assert len({os.path.realpath(s) for s in raw}) == 1  # ... one file
    system = _system_of(rows, SHIPPED)
    assert os.path.realpath(system) == str(ROOT / "validation" / "systems" / "h100-sxm-aiconfigurator.yaml")


def _synthetic(monkeypatch, model):
    """predict_ms(row) = model(row number, system parameters, measured ms). The system file of
    an evaluation is read once for all its rows (calibrate writes each evaluation's to a file
    of its own, never rewritten)."""
    specs: dict = {}

    def predict(row, csv_path, system=None):
        path = system if system else validate.row_config(row)["system"]
        if path not in specs:
            specs[path] = get_system(path)
        return model(row.number, specs[path], row.measured_ms)
    monkeypatch.setattr(validate, "predict_ms", predict)


def test_calibrate_runs_on_the_shipped_file_and_reports_loo_beside_in_sample(tmp_path, monkeypatch):
    prior = get_system(_system_of(read_rows(SHIPPED), SHIPPED)).compute_model.hbm_fraction
    # every row 10% slow at the prior, and proportional to 1 / hbm_fraction: the fit lowers it by 10%
    _synthetic(monkeypatch, lambda n, spec, ms: 1.1 * ms * prior / spec.compute_model.hbm_fraction)
    report = calibrate(SHIPPED, ["compute_model.hbm_fraction"], tmp_path / "fit.yaml")
    assert report["fitted"]["compute_model.hbm_fraction"] == pytest.approx(prior * 1.1, rel=1e-4)
    assert report["prior_mape_pct"] == pytest.approx(10.0, rel=1e-6)
    assert report["mape_pct"] < 1e-3 and report["loo_mape_pct"] < 1e-3
    assert all({"error_pct", "prior_error_pct", "loo_error_pct"} <= set(r) for r in report["rows"])
    assert report["suspect"] == [] and report["written"]
    assert get_system(str(tmp_path / "fit.yaml")).compute_model.hbm_fraction == pytest.approx(prior * 1.1, rel=1e-4)


def _csv(tmp_path, measured: list[float]) -> Path:
    (tmp_path / "model.json").write_text('{"model_type": "llama", "hidden_size": 512, "intermediate_size": 1024, '
                                         '"num_attention_heads": 8, "num_key_value_heads": 8, '
                                         '"num_hidden_layers": 1, "vocab_size": 1000}')
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({
        "model": "model.json", "system": "h100-sxm", "chips": 1, "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1},
        "phase": "prefill", "batch": 1, "seq_len": 1024}))
    p = tmp_path / "m.csv"
    p.write_text("config,set,metric,measured_ms,source\n"
                 + "".join(f"c.yaml,seq_len={1024 * (i + 1)},ttft,{v!r},synthetic\n" for i, v in enumerate(measured)))
    return p


def test_a_parameter_pushed_to_its_bound_is_reported_with_the_rows_that_pulled_it(tmp_path, monkeypatch, capsys):
    prior = get_system("h100-sxm").compute_model.hbm_fraction
    # rows 2 and 3 want a memory 20x faster than any fraction allows: hbm_fraction ends at 1.0
    slow = {2: 20.0, 3: 20.0}
    _synthetic(monkeypatch, lambda n, spec, ms: ms * slow.get(n, 1.0) * prior / spec.compute_model.hbm_fraction)
    csv = _csv(tmp_path, [1.0, 2.0, 3.0])
    result = invoke("calibrate", csv, "--fit", "compute_model.hbm_fraction", "-o", tmp_path / "fit.yaml", "--force")
    assert result.exit_code == 0, result.output
    report = calibrate(csv, ["compute_model.hbm_fraction"], tmp_path / "fit2.yaml", force=True)
    (s,) = report["suspect"]
    assert s["parameter"] == "compute_model.hbm_fraction" and s["at_bound"] == "upper" and s["bound"] == 1.0
    assert [r["row"] for r in s["rows"]] == [2, 3]
    line = [ln for ln in result.output.splitlines() if ln.startswith("suspect:")]
    assert line and "ends at its upper bound 1" in line[0] and "pulled there by row 2" in line[0]
    assert "row 3" in line[0] and "row 1 " not in line[0]
    assert "# SUSPECT: compute_model.hbm_fraction" in (tmp_path / "fit.yaml").read_text()


def test_a_move_of_more_than_3x_is_suspect(tmp_path, monkeypatch):
    prior = get_system("h100-sxm").launch_overhead_s
    _synthetic(monkeypatch, lambda n, spec, ms: ms * (spec.launch_overhead_s / (5 * prior)) ** 0.5)
    report = calibrate(_csv(tmp_path, [1.0, 2.0]), ["launch_overhead_s"], tmp_path / "fit.yaml")
    (s,) = report["suspect"]
    assert s["at_bound"] is None and s["factor"] == pytest.approx(5.0, rel=1e-3)
    assert "moved 5x from its prior" in validate.describe_suspect(s)


def test_a_fit_worse_than_the_prior_out_of_sample_is_not_written_unless_forced(tmp_path, monkeypatch):
    prior = get_system("h100-sxm").launch_overhead_s
    # the prior is right for rows 1-3; row 4 is off by 2x; the fit trades the others for it
    _synthetic(monkeypatch, lambda n, spec, ms: ms * (2.0 if n == 4 else 1.0) * spec.launch_overhead_s / prior)
    csv = _csv(tmp_path, [1.0, 2.0, 3.0, 4.0])
    out = tmp_path / "fit.yaml"
    result = invoke("calibrate", csv, "--fit", "launch_overhead_s", "-o", out)
    assert result.exit_code == 2 and not out.exists()
    assert "leave-one-out" in result.stdout and "not written" in result.stdout   # the fit is shown
    err = result.stderr.strip().splitlines()
    # the progress lines (issue 35), then the one-line error
    assert all(line.startswith("calibrate: ") for line in err[:-1])
    assert "worse than the prior's" in err[-1] and "--force" in err[-1] and err[-1].startswith("g5: error: ")
    forced = invoke("calibrate", csv, "--fit", "launch_overhead_s", "-o", out, "--force")
    assert forced.exit_code == 0 and out.exists()


def _fit_must_not_run(monkeypatch):
    monkeypatch.setattr(validate, "predict_ms", lambda *a: pytest.fail("the fit ran before the output check"))


def test_calibrate_into_a_read_only_folder_is_refused_before_the_fit(tmp_path, monkeypatch):
    csv = _csv(tmp_path, [1.0])
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    if os.geteuid() == 0:   # root writes anywhere: make the probe fail as a read-only mount would
        monkeypatch.setattr(outputs, "_can_create_in", lambda f: False)
    _fit_must_not_run(monkeypatch)
    try:
        result = invoke("calibrate", csv, "--fit", "launch_overhead_s", "-o", folder / "fit.yaml")
    finally:
        folder.chmod(0o755)
    assert result.exit_code == 2 and "Traceback" not in result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("g5: error: -o: cannot write") and "is not writable" in line
    assert os.listdir(folder) == []


def test_calibrate_onto_a_dangling_symlink_writes_its_target_and_keeps_the_link(tmp_path, monkeypatch):
    _synthetic(monkeypatch, lambda n, spec, ms: ms * spec.launch_overhead_s / get_system("h100-sxm").launch_overhead_s)
    csv = _csv(tmp_path, [1.0, 2.0])
    link, target = tmp_path / "link.yaml", tmp_path / "target.yaml"
    link.symlink_to(target)
    result = invoke("calibrate", csv, "--fit", "launch_overhead_s", "-o", link)
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert get_system(str(target)).name == "h100-sxm-calibrated"


def test_a_full_file_system_after_the_fit_is_one_line_and_the_fit_is_still_shown(tmp_path, monkeypatch):
    _synthetic(monkeypatch, lambda n, spec, ms: ms * spec.launch_overhead_s / get_system("h100-sxm").launch_overhead_s)
    csv = _csv(tmp_path, [1.0, 2.0])
    real_dump = yaml.safe_dump

    def full(data, stream=None, **kw):
        if stream is not None:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_dump(data, **kw)
    monkeypatch.setattr(validate.yaml, "safe_dump", full)
    out = tmp_path / "fit.yaml"
    result = invoke("calibrate", csv, "--fit", "launch_overhead_s", "-o", out)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "launch_overhead_s:" in result.stdout and "leave-one-out" in result.stdout   # printed before writing
    *progress, line = result.stderr.strip().splitlines()
    assert all(p.startswith("calibrate: ") for p in progress)   # issue 35: progress, then the one error line
    assert line == f"g5: error: -o: cannot write '{out}': No space left on device"
    assert sorted(os.listdir(tmp_path)) == ["c.yaml", "m.csv", "model.json"]   # no partial or temporary file


def test_an_existing_output_is_refused_before_the_fit(tmp_path, monkeypatch):
    csv = _csv(tmp_path, [1.0])
    out = tmp_path / "fit.yaml"
    out.write_text("mine")
    _fit_must_not_run(monkeypatch)
    with pytest.raises(ConfigError, match="exists; choose another output file"):
        calibrate(csv, ["launch_overhead_s"], out)
    assert out.read_text() == "mine"


def test_calibrate_estimates_reports_progress_and_stops_at_max_evals(tmp_path, monkeypatch):
    """Issue 35 item 3: an estimate before the first evaluation, a line per evaluation, and
    --max-evals a one-line stop that writes nothing."""
    prior = get_system("h100-sxm").launch_overhead_s
    # the rows disagree (1.3x, 1.4x, 1.5x slow), so each leave-one-out refit moves
    _synthetic(monkeypatch, lambda n, spec, ms: ms * (1.2 + 0.1 * n) * (spec.launch_overhead_s / prior) ** 0.5)
    csv = _csv(tmp_path, [1.0, 2.0, 3.0])
    lines = []
    report = calibrate(csv, ["launch_overhead_s"], tmp_path / "fit.yaml", say=lines.append)
    assert lines[0].startswith("calibrate: 3 rows, 1 parameter; every evaluation runs every row once")
    assert "at most 500 (--max-evals)" in lines[0]
    evals = [ln for ln in lines if ln.startswith("calibrate: evaluation ")]
    assert evals and "(sensitivity)" in evals[0] and any("(fit)" in ln for ln in evals)
    assert any("leave-one-out refit without row 2" in ln for ln in evals)
    assert lines[-1].startswith(f"calibrate: {len(evals)} evaluations")
    assert report["written"] or report["refused"]
    out = tmp_path / "fit2.yaml"
    stopped = invoke("calibrate", csv, "--fit", "launch_overhead_s", "-o", out, "--max-evals", "3")
    assert stopped.exit_code == 1 or stopped.exit_code == 2
    err = stopped.stderr.strip().splitlines()[-1]
    assert "--max-evals: 3 evaluations of the 3 rows reached" in err and "nothing was written" in err
    assert not out.exists()


def test_prepared_plans_reused_across_systems_predict_what_g5_run_does(tmp_path):
    """The kept op-DAG templates (one per row, across evaluations' systems) give the
    prediction g5 run gives on that system, bit for bit."""
    from g5core.session.run import run

    csv = _csv(tmp_path, [1.0])
    (row,) = read_rows(csv)
    validate._TEMPLATES.clear()
    first = validate.predict_ms(row, csv)
    assert validate._TEMPLATES                                          # kept
    data = get_system("h100-sxm").to_dict()
    data["compute_model"]["hbm_fraction"] *= 0.5
    moved = tmp_path / "moved.yaml"
    moved.write_text(yaml.safe_dump(data))
    again = validate.predict_ms(row, csv, str(moved))
    whole = run(validate.row_config(row, str(moved))).latency_s * 1e3
    validate._TEMPLATES.clear()
    assert again == whole and again != first


def test_workers_give_the_one_process_fit(tmp_path, monkeypatch):
    """--workers runs the rows in processes (forked: the synthetic prediction with them)."""
    prior = get_system("h100-sxm").launch_overhead_s
    _synthetic(monkeypatch, lambda n, spec, ms: ms * (1.2 + 0.1 * n) * (spec.launch_overhead_s / prior) ** 0.5)
    csv = _csv(tmp_path, [1.0, 2.0, 3.0])
    one = calibrate(csv, ["launch_overhead_s"], tmp_path / "a.yaml", leave_one_out=False)
    two = calibrate(csv, ["launch_overhead_s"], tmp_path / "b.yaml", leave_one_out=False, workers=2)
    assert one["fitted"] == two["fitted"] and [r["predicted_ms"] for r in one["rows"]] == [
        r["predicted_ms"] for r in two["rows"]]
