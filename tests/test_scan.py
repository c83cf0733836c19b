"""The CP validation scan: rows land in SQLite one by one; the TTFT trend check can fail."""
from __future__ import annotations

import re

import json
import sqlite3

import pytest
from click.testing import CliRunner

from g5core.present.cli import main
from g5core.session.run import run as run_one
from g5core.study.sweep import run_preset
from g5plugins.cp.scan import Cell, check_monotone

BASE = {
    "model": "llama-3.1-8b",
    "system": "h100-sxm",
    "chips": 4,
    "parallel": {"dp": 4, "tp": 1, "pp": 1, "cp": 1},
    "phase": "prefill",
    "batch": 1,
    "seq_len": 8192,
}


def run_scan(raw, db, cp_values, seq_lens, runner=None):
    """The cp plugin's preset, run as ``g5 scan`` runs it."""
    return run_preset("cp", raw, db, axes={"parallel.cp": cp_values, "seq_len": seq_lens}, runner=runner)


def _ok(report) -> bool:
    return bool(report.sweep.ok_rows) and not report.violations


def _rows(db):
    """(cp, seq_len, dp, status, latency_s, ring hidden fraction) of every stored cell, in scan order."""
    con = sqlite3.connect(str(db))
    try:
        rows = con.execute("SELECT c.point, r.parallel, r.status, r.latency_s, r.overlap FROM sweep_cells c "
                           "JOIN results r USING (config_hash) ORDER BY c.sweep_id, c.cell").fetchall()
    except sqlite3.OperationalError:
        return []
    finally:
        con.close()
    out = []
    for point, parallel, status, latency, overlap in rows:
        point = json.loads(point)
        ring = json.loads(overlap)["by_reason"].get("cp_passkv") if overlap else None
        out.append((point["parallel.cp"], point["seq_len"], json.loads(parallel)["dp"], status, latency,
                    ring["hidden_fraction"] if ring else None))
    return out


def test_rows_appear_one_by_one_and_trend_holds(tmp_path):
    db = tmp_path / "scan.db"
    seen_before_each_run = []

    def runner(raw, disabled=()):
        seen_before_each_run.append(len(_rows(db)))
        return run_one(raw, disabled=disabled)

    report = run_scan(BASE, db, cp_values=(1, 2, 4), seq_lens=(8192, 16384), runner=runner)
    # before the n-th run, the n-1 earlier cells are already committed
    assert seen_before_each_run == [0, 1, 2, 3, 4, 5]
    rows = _rows(db)
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        (1, 8192, 4, "ok"), (2, 8192, 2, "ok"), (4, 8192, 1, "ok"),
        (1, 16384, 4, "ok"), (2, 16384, 2, "ok"), (4, 16384, 1, "ok"),
    ]
    assert _ok(report), report.violations
    for seq in (8192, 16384):
        lat = [r[4] for r in rows if r[1] == seq]
        assert lat == sorted(lat, reverse=True)
    # ring traffic is reported for cp > 1 only
    assert all((r[5] is None) == (r[0] == 1) for r in rows)


def _scan_status(db):
    con = sqlite3.connect(str(db))
    try:
        return con.execute("SELECT sweep_id, status, cells_planned FROM sweeps ORDER BY sweep_id").fetchall()
    finally:
        con.close()


def test_a_finished_scan_is_marked_complete_and_an_interrupted_one_is_not(tmp_path):
    db = tmp_path / "scan.db"
    run_scan(BASE, db, cp_values=(1, 2), seq_lens=(8192,))
    assert _scan_status(db) == [(1, "complete", 2)]

    calls = []

    def dies_on_the_second_cell(raw, disabled=()):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return run_one(raw, disabled=disabled)

    # new cells (another seq_len): cells already in the database would be reused, not run
    with pytest.raises(KeyboardInterrupt):
        run_scan(BASE, db, cp_values=(1, 2), seq_lens=(16384,), runner=dies_on_the_second_cell)
    assert _scan_status(db) == [(1, "complete", 2), (2, "interrupted", 2)]   # issue 25: it says so
    # the cell that finished before the interruption is kept
    assert len(_rows(db)) == 3


def test_invalid_cells_are_recorded_not_adjusted(tmp_path):
    db = tmp_path / "scan.db"
    report = run_scan(BASE, db, cp_values=(1, 8), seq_lens=(8192,))
    rows = _rows(db)
    assert rows[1][3] == "error"
    # (an installed third-party factor dimension, such as Ulysses' sp, is named too)
    assert re.search(r"parallel\.dp: auto: chips=4 is not divisible by pp x cp x (sp x )?tp = 8", report.sweep.rows[1]["error"])
    assert _ok(report)


def test_scan_appends_a_new_scan_to_an_existing_database_and_reuses_its_rows(tmp_path):
    db = tmp_path / "scan.db"
    first = run_scan(BASE, db, cp_values=(1,), seq_lens=(8192,))

    def must_not_run(raw, disabled=()):
        raise AssertionError("a configuration already in the database was simulated again")

    second = run_scan(BASE, db, cp_values=(1,), seq_lens=(8192,), runner=must_not_run)
    assert second.sweep.sweep_id == first.sweep.sweep_id + 1
    assert [Cell.from_row(r) for r in second.sweep.rows] == [Cell.from_row(r) for r in first.sweep.rows]
    assert len(_rows(db)) == 2  # one cell per scan, both the same stored row
    con = sqlite3.connect(str(db))
    assert con.execute("SELECT COUNT(*) FROM results").fetchone() == (1,)
    con.close()


def test_monotone_check_names_the_offending_cell():
    cells = [
        Cell(cp=1, seq_len=1024, status="ok", latency_s=4.0),
        Cell(cp=2, seq_len=1024, status="ok", latency_s=2.0, hidden_fraction=0.99),
        Cell(cp=4, seq_len=1024, status="ok", latency_s=3.0, hidden_fraction=0.95),
        # exposed ring: allowed to rise, not a violation
        Cell(cp=8, seq_len=1024, status="ok", latency_s=9.0, hidden_fraction=0.2),
    ]
    violations = check_monotone(cells, hidden_threshold=0.9)
    assert len(violations) == 1
    assert "cp=2" in violations[0] and "cp=4" in violations[0] and "seq_len=1024" in violations[0]


def test_cli_scan_reports_and_exits_nonzero_on_a_violation(tmp_path, monkeypatch):
    import yaml

    cfg = tmp_path / "base.yaml"
    cfg.write_text(yaml.safe_dump(BASE))
    db = tmp_path / "scan.db"
    runner = CliRunner()
    res = runner.invoke(main, ["scan", str(cfg), "--db", str(db), "--cp", "1,2", "--seq-len", "8192"])
    assert res.exit_code == 0, res.output
    assert "non-increasing" in res.output
    assert "[2/2] cp=2 seq_len=8192" in res.stderr

    import g5plugins.cp.scan as scan_mod

    monkeypatch.setattr(scan_mod, "check_monotone", lambda cells, thr: ("seq_len=8192: TTFT rises (forced)",))
    res = runner.invoke(main, ["scan", str(cfg), "--db", str(db), "--cp", "1,2", "--seq-len", "8192"])
    assert res.exit_code == 1
    assert "TTFT rises (forced)" in res.output


def test_bad_grid_values_are_errors(tmp_path):
    import yaml

    cfg = tmp_path / "base.yaml"
    cfg.write_text(yaml.safe_dump(BASE))
    res = CliRunner().invoke(main, ["scan", str(cfg), "--db", str(tmp_path / "x.db"), "--cp", "0", "--seq-len", "8192"])
    assert res.exit_code == 2 and "--cp" in res.stderr
    assert not (tmp_path / "x.db").exists()


def test_an_invalid_base_configuration_is_an_error_before_anything_is_written(tmp_path):
    db = tmp_path / "scan.db"
    with pytest.raises(Exception, match="batch"):
        run_scan(dict(BASE, batch=0), db, cp_values=(1, 2), seq_lens=(8192,))
    assert not db.exists()
    import yaml

    cfg = tmp_path / "base.yaml"
    cfg.write_text(yaml.safe_dump(dict(BASE, batch=0)))
    res = CliRunner().invoke(main, ["scan", str(cfg), "--db", str(db), "--cp", "1,2", "--seq-len", "8192"])
    assert res.exit_code == 2
    assert res.stderr.strip().count("\n") == 0 and "batch" in res.stderr
    assert "non-increasing" not in res.output
    assert not db.exists()


def test_a_scan_where_every_cell_failed_never_reports_success(tmp_path):
    import yaml

    cfg = tmp_path / "base.yaml"
    cfg.write_text(yaml.safe_dump(BASE))
    db = tmp_path / "scan.db"
    # 4 chips: cp 8 and 16 leave no whole dp
    res = CliRunner().invoke(main, ["scan", str(cfg), "--db", str(db), "--cp", "8,16", "--seq-len", "8192"])
    assert res.exit_code == 1
    assert "0 of 2 cells ran" in res.output
    assert "no cell ran" in res.stderr
    assert "non-increasing" not in res.output
    report = run_scan(BASE, db, cp_values=(8, 16), seq_lens=(8192,))
    assert not _ok(report) and not report.violations
