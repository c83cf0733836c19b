"""Sweeps and the results database: grid, dp=auto, resume after kill -9, concurrent writers,
the Dask executor, and clear one-line errors for unusable database files."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import types

import pytest
import yaml
from click.testing import CliRunner

from g5core import Dimension, hookimpl
from g5core.present.cli import main
from g5core.api.errors import ConfigError, G5Error
from g5core.api.dimensions import collect_dimensions
from plugin_sets import builtin_plugin_manager
from g5core.api.plugins import Hooks
from g5core.study import resultsdb
from g5core.study.resultsdb import RUN_COLUMNS, ResultsDB
from g5core.study.sweep import grid_points, parse_grid, resolve_auto, run_sweep

BASE = {
    "model": "llama-3.1-8b",
    "system": "h100-sxm",
    "chips": 8,
    "parallel": {"dp": "auto", "tp": 1, "pp": 1, "cp": 1},
    "phase": "prefill",
    "batch": 1,
    "seq_len": 4096,
}
GRID = ["parallel.cp=1,2,4,8", "seq_len=4096,8192"]


def _values(rows):
    """Rows without the columns that say how and when they were computed."""
    return {r["config_hash"]: {k: v for k, v in r.items() if k not in RUN_COLUMNS and k != "point"} for r in rows}


def _all_rows(db):
    with ResultsDB.open_existing(db) as con:
        return con.results()


def _write_base(tmp_path, base=BASE):
    cfg = tmp_path / "base.yaml"
    cfg.write_text(yaml.safe_dump(base))
    return cfg


# ---------------------------------------------------------------------------------------
# grid and auto
# ---------------------------------------------------------------------------------------


def test_grid_is_the_cartesian_product_first_axis_outermost():
    grid = parse_grid(["parallel.cp=1,2", "seq_len=8192,16384,32768", "dtypes.kv_cache=bf16,fp8"])
    points = grid_points(grid)
    assert len(points) == 12
    assert points[0] == {"parallel.cp": 1, "seq_len": 8192, "dtypes.kv_cache": "bf16"}
    assert points[1] == {"parallel.cp": 1, "seq_len": 8192, "dtypes.kv_cache": "fp8"}
    assert points[-1] == {"parallel.cp": 2, "seq_len": 32768, "dtypes.kv_cache": "fp8"}


@pytest.mark.parametrize("items, match", [
    (["parallel.cp"], "KEY=V1,V2"),
    (["parallel.cp=1,,2"], "empty value"),
    (["parallel.cp=1,2", "parallel.cp=4"], "given twice"),
    (["parallel.cp=1,1"], "given twice"),
    ([], "at least one"),
])
def test_bad_grids_are_clear_errors(items, match):
    with pytest.raises(ConfigError, match=match):
        parse_grid(items)


def _dims(extra=()):
    # the built-in dimensions only: an installed third-party plugin (contrib/g5-ulysses) adds its own
    return collect_dimensions(Hooks(builtin_plugin_manager(extra_plugins=extra)))


def test_auto_derives_dp_from_chips_and_refuses_a_remainder():
    raw = dict(BASE, parallel={"dp": "auto", "tp": 2, "pp": 1, "cp": 2})
    assert resolve_auto(raw, _dims())["parallel"]["dp"] == 2
    with pytest.raises(ConfigError, match=r"parallel.dp: auto: chips=8 is not divisible by pp x cp x tp = 16"):
        resolve_auto(dict(raw, parallel={"dp": "auto", "tp": 4, "pp": 1, "cp": 4}), _dims())
    with pytest.raises(ConfigError, match="only one dimension may be auto"):
        resolve_auto(dict(raw, parallel={"dp": "auto", "tp": "auto", "pp": 1, "cp": 1}), _dims())
    with pytest.raises(ConfigError, match="factor of the chip count"):
        resolve_auto(dict(raw, parallel={"dp": 8, "tp": 1, "pp": 1, "cp": 1, "ep": "auto"}), _dims())


def test_auto_counts_a_third_party_dimension():
    plugin = types.SimpleNamespace(g5_register_dimensions=hookimpl(
        lambda register: register(Dimension(name="sp", factor=True, rank_order=25, doc="test"))))
    dims = _dims([("sp_test", plugin)])
    raw = dict(BASE, parallel={"dp": "auto", "tp": 2, "pp": 1, "cp": 1, "sp": 2})
    assert resolve_auto(raw, dims)["parallel"]["dp"] == 2


def test_sweep_keeps_chips_fixed_and_records_invalid_points(tmp_path):
    db = tmp_path / "s.db"
    report = run_sweep(BASE, parse_grid(["parallel.cp=1,2,16", "seq_len=4096"]), db)
    rows = report.rows
    assert [r["point"]["parallel.cp"] for r in rows] == [1, 2, 16]
    assert [r["status"] for r in rows] == ["ok", "ok", "error"]
    assert [r["parallel"]["dp"] * r["parallel"]["cp"] for r in rows[:2]] == [8, 8]
    assert "auto: chips=8 is not divisible" in rows[2]["error"]
    # a row holds inputs, latency, the memory ledger, comm bytes, overlap, KPIs, version and wall time
    ok = rows[1]
    assert ok["ttft_s"] == ok["latency_s"] > 0 and ok["tpot_s"] is None
    assert ok["comm_bytes"]["by_reason"]["cp_passkv"] > 0
    assert "cp_passkv" in ok["overlap"]["by_reason"]
    assert set(ok["conservation"].values()) == {0}
    assert ok["memory"]["max_total_bytes"] == ok["max_total_bytes"]
    assert ok["weights_bytes"] + ok["kv_cache_bytes"] + ok["activation_bytes"] + ok["workspace_bytes"] == \
        pytest.approx(ok["max_total_bytes"])
    assert ok["g5_version"] and ok["wall_s"] > 0
    assert ok["tokens_per_s_per_chip"] == pytest.approx(4 * 1 * 4096 / ok["ttft_s"] / 8)


def test_rows_of_another_build_are_kept_and_not_reused(tmp_path, monkeypatch):
    """A database's rows are reused only by the build that computed them: after a model change
    (here a stand-in build id) the same grid computes anew and the old rows stay in the file."""
    db = tmp_path / "s.db"
    grid = parse_grid(["parallel.cp=1,2", "seq_len=4096"])
    first = run_sweep(BASE, grid, db)
    again = run_sweep(BASE, grid, db)
    assert (again.computed, again.reused) == (0, 2)
    monkeypatch.setitem(resultsdb._BUILD, "id", "0" * 64)
    other = run_sweep(BASE, grid, db)
    assert (other.computed, other.reused) == (2, 0)
    # the summary says why: the database held these cells from another build
    assert other.other_builds == {r["config_hash"]: first.rows[0]["g5_version"] for r in other.rows}
    assert "2 cells computed anew: the database holds them from another G5 build" in other.summary()
    assert not first.other_builds and "computed anew" not in again.summary()
    assert {r["config_hash"] for r in other.rows}.isdisjoint({r["config_hash"] for r in first.rows})
    assert {r["g5_version"].split("+")[1] for r in other.rows} == {"0" * 12}
    assert len(_all_rows(db)) == 4
    assert [r["ttft_s"] for r in other.rows] == [r["ttft_s"] for r in first.rows]


def test_the_build_id_follows_the_model_files_and_nothing_else(tmp_path, monkeypatch):
    pkg = tmp_path / "plug"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("X = 1\n")
    (pkg / "data" / "t.yaml").write_text("a: 1\n")
    monkeypatch.setattr(resultsdb, "_plugin_roots", lambda: [("plug", pkg)])

    def build():
        resultsdb._BUILD.clear()
        return resultsdb.build_id()

    monkeypatch.setattr(resultsdb, "_BUILD", {})
    base = build()
    assert build() == base and len(base) == 64
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "x.cpython-312.pyc").write_bytes(b"compiled")
    (pkg / "notes.txt").write_text("not a model file")
    assert build() == base
    (pkg / "data" / "t.yaml").write_text("a: 2\n")
    assert build() != base
    (pkg / "data" / "t.yaml").write_text("a: 1\n")
    assert build() == base
    (pkg / "__init__.py").rename(pkg / "other.py")
    assert build() != base
    renamed = build()
    # the version of an installed distribution whose data the figures read (the measured tables')
    real = resultsdb.importlib.metadata.version
    monkeypatch.setattr(resultsdb.importlib.metadata, "version",
                        lambda dist: "9.9.9" if dist == "aiconfigurator-core" else real(dist))
    assert build() != renamed


def test_cli_sweep_where_every_point_is_invalid_exits_1(tmp_path):
    cfg = _write_base(tmp_path)
    db = tmp_path / "s.db"
    res = CliRunner().invoke(main, ["sweep", str(cfg), "--grid", "parallel.cp=16,32", "--db", str(db)])
    assert res.exit_code == 1
    assert "0 of 2 cells ran" in res.output and "no cell ran" in res.stderr


def test_cli_sweep_with_an_invalid_base_writes_nothing(tmp_path):
    cfg = _write_base(tmp_path, dict(BASE, seq_len=-1))
    db = tmp_path / "s.db"
    res = CliRunner().invoke(main, ["sweep", str(cfg), "--grid", "parallel.cp=1,2", "--db", str(db)])
    assert res.exit_code == 2 and "seq_len" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not db.exists()


# ---------------------------------------------------------------------------------------
# crash safety and concurrency
# ---------------------------------------------------------------------------------------


def _count(db) -> int:
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)  # never creates the file
        try:
            return con.execute("SELECT COUNT(*) FROM results").fetchone()[0]
        finally:
            con.close()
    except sqlite3.OperationalError:
        return 0


KILL_GRID = ["parallel.cp=1,2,4,8", "seq_len=4096,8192,16384", "batch=1,2,3"]  # 36 points


@pytest.mark.bench   # 10-20 s on 2 cores: a benchmark-sized check (python3 -m pytest -q -m bench)
def test_resume_after_kill_9_stores_every_point_once_with_the_uninterrupted_values(tmp_path):
    cfg = _write_base(tmp_path)
    db = tmp_path / "killed.db"
    args = [sys.executable, "-m", "g5core", "sweep", str(cfg), "--db", str(db)]
    for g in KILL_GRID:
        args += ["--grid", g]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while _count(db) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL  # killed, not finished
    done_before = _count(db)
    assert 3 <= done_before < 36
    with ResultsDB.open_existing(db) as con:   # its process is gone: the sweep reads interrupted
        assert [s["status"] for s in con.sweeps()] == ["interrupted"]
    raw = sqlite3.connect(str(db)).execute("SELECT status, pid FROM sweeps").fetchall()
    assert raw == [("running", proc.pid)]      # (reading changes nothing in the file)

    resumed = run_sweep(BASE, parse_grid(KILL_GRID), db)
    assert resumed.reused == done_before and resumed.computed == 36 - done_before
    reference = run_sweep(BASE, parse_grid(KILL_GRID), tmp_path / "reference.db")
    rows = _all_rows(db)
    assert len(rows) == 36 == len({r["config_hash"] for r in rows})
    assert _values(rows) == _values(reference.rows)
    with ResultsDB.open_existing(db) as con:
        assert [s["status"] for s in con.sweeps()] == ["interrupted", "complete"]
        integrity = con.con.execute("PRAGMA integrity_check").fetchone()[0]
    assert integrity == "ok"


def test_two_concurrent_sweeps_on_one_database_lose_and_duplicate_nothing(tmp_path):
    db = tmp_path / "shared.db"
    cfg = _write_base(tmp_path)
    grids = [["parallel.cp=1,2,4,8", "seq_len=4096,8192", "batch=1,2"],
             ["parallel.cp=8,4,2,1", "seq_len=8192,4096", "batch=2,3"]]  # overlap: batch 2
    procs = []
    for grid, workers in zip(grids, ("1", "2")):
        args = [sys.executable, "-m", "g5core", "sweep", str(cfg), "--db", str(db), "--workers", workers]
        for g in grid:
            args += ["--grid", g]
        procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    rows = _all_rows(db)
    assert len(rows) == 24 == len({r["config_hash"] for r in rows})  # 16 + 16 - 8 shared
    with ResultsDB.open_existing(db) as con:
        sweeps = con.sweeps()
        assert [s["status"] for s in sweeps] == ["complete", "complete"]
        for s in sweeps:
            keys = con.sweep_keys(s["sweep_id"])
            assert len(keys) == 16 and all(con.has(k) for k in keys)
    reference = run_sweep(BASE, parse_grid(["parallel.cp=1,2,4,8", "seq_len=4096,8192", "batch=1,2,3"]),
                          tmp_path / "reference.db")
    assert _values(rows) == _values(reference.rows)


def test_worker_processes_give_the_in_process_values(tmp_path):
    grid = parse_grid(GRID)
    one = run_sweep(BASE, grid, tmp_path / "one.db")
    two = run_sweep(BASE, grid, tmp_path / "two.db", workers=2)
    assert _values(one.rows) == _values(two.rows)
    assert [r["point"] for r in one.rows] == [r["point"] for r in two.rows]


@pytest.mark.bench   # 10-20 s on 2 cores: a benchmark-sized check (python3 -m pytest -q -m bench)
def test_the_dask_executor_gives_the_local_executor_values(tmp_path):
    distributed = pytest.importorskip("distributed", reason="the distributed extra (g5[distributed]) is part of "
                                                            "the test install")
    grid = parse_grid(["parallel.cp=1,2", "seq_len=4096,8192", "batch=1,2"])
    local = run_sweep(BASE, grid, tmp_path / "local.db")
    # an existing cluster, reached by its scheduler's address
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=":0") as cluster:
        dask = run_sweep(BASE, grid, tmp_path / "dask.db", executor=f"dask:{cluster.scheduler_address}")
    assert dask.computed == 8
    assert _values(dask.rows) == _values(local.rows)
    assert [r["point"] for r in dask.rows] == [r["point"] for r in local.rows]
    # a local cluster that the executor starts itself
    own = run_sweep(BASE, parse_grid(["parallel.cp=1,2"]), tmp_path / "own.db", executor="dask", workers=1)
    assert len(own.ok_rows) == 2 and set(_values(own.rows)) <= set(_values(local.rows))
    assert _values(own.rows) == {k: v for k, v in _values(local.rows).items() if k in _values(own.rows)}


# ---------------------------------------------------------------------------------------
# database files
# ---------------------------------------------------------------------------------------


def _sweep_cli(tmp_path, db):
    cfg = _write_base(tmp_path)
    return CliRunner().invoke(main, ["sweep", str(cfg), "--grid", "parallel.cp=1", "--db", str(db)])


def test_db_in_a_missing_folder_is_a_one_line_error(tmp_path):
    res = _sweep_cli(tmp_path, tmp_path / "missing" / "s.db")
    assert res.exit_code == 2
    assert res.stderr.count("\n") == 1 and "does not exist" in res.stderr
    assert not (tmp_path / "missing").exists()


def test_db_onto_a_file_that_is_not_sqlite_is_a_one_line_error_and_the_file_is_kept(tmp_path):
    db = tmp_path / "notes.txt"
    db.write_text("my notes\n")
    res = _sweep_cli(tmp_path, db)
    assert res.exit_code == 2
    assert res.stderr.count("\n") == 1 and "not a SQLite database" in res.stderr
    assert db.read_text() == "my notes\n"


def test_db_of_another_program_is_refused(tmp_path):
    db = tmp_path / "other.db"
    con = sqlite3.connect(str(db))
    con.execute("CREATE TABLE mine (x)")
    con.commit()
    con.close()
    res = _sweep_cli(tmp_path, db)
    assert res.exit_code == 2 and "another program" in res.stderr and res.stderr.count("\n") == 1


def test_db_that_is_a_folder_or_a_device_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="is a folder"):
        run_sweep(BASE, parse_grid(["parallel.cp=1"]), tmp_path)
    res = _sweep_cli(tmp_path, "/dev/null")
    assert res.exit_code == 2 and ("not a regular file" in res.stderr or "is a device" in res.stderr)


def _hold_write_lock(db, seconds):
    con = sqlite3.connect(str(db), isolation_level=None, check_same_thread=False)
    con.execute("BEGIN IMMEDIATE")
    con.execute("INSERT INTO g5_meta VALUES ('lock', 'held')")

    def release():
        time.sleep(seconds)
        con.execute("ROLLBACK")
        con.close()

    t = threading.Thread(target=release)
    t.start()
    return t


def test_a_locked_database_is_waited_for_then_a_one_line_error(tmp_path):
    db = tmp_path / "locked.db"
    ResultsDB.open(db).close()
    grid = parse_grid(["parallel.cp=1"])
    holder = _hold_write_lock(db, 1.0)
    try:
        with pytest.raises(G5Error, match="locked by another writer for more than 0.1 s") as err:
            run_sweep(BASE, grid, db, busy_timeout_s=0.1)
        assert "\n" not in str(err.value)
    finally:
        holder.join()
    # a lock released within the busy timeout is simply waited for
    holder = _hold_write_lock(db, 0.3)
    report = run_sweep(BASE, grid, db, busy_timeout_s=10)
    holder.join()
    assert len(report.ok_rows) == 1


def test_a_relative_db_path_is_fine(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    report = run_sweep(BASE, parse_grid(["parallel.cp=1"]), "plain.db")
    assert os.path.isfile(tmp_path / "plain.db") and len(report.ok_rows) == 1


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_otherwise(tmp_path):
    import io

    from g5core.study.sweep import BarProgress, LineProgress, default_progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    bar = default_progress(term)
    assert isinstance(bar, BarProgress)
    run_sweep(BASE, parse_grid(["parallel.cp=1,16"]), tmp_path / "bar.db", progress=bar)
    text = term.getvalue()
    assert "2/2" in text and "failed=1" in text and "cell" in text

    pipe = io.StringIO()
    lines = default_progress(pipe)
    assert isinstance(lines, LineProgress)
    run_sweep(BASE, parse_grid(["parallel.cp=1,16"]), tmp_path / "lines.db", progress=lines)
    out = pipe.getvalue().splitlines()
    assert out[0].startswith("[1/2] cp=1: latency ") and out[1].startswith("[2/2] cp=16: skipped: ")
