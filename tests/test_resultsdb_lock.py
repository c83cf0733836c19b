"""The results database under a lock held by another process (issue 25, item 6): a one-line
error naming the lock and the process, never a traceback; the sweep resumes cleanly; and a
sweep stopped by an error says so in the ``sweeps`` table."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from g5core.api.errors import G5Error
from g5core.study.resultsdb import ResultsDB
from g5core.study.sweep import parse_grid, run_sweep

from test_sweep import BASE

HOLD = """
import sqlite3, sys, time
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("BEGIN IMMEDIATE")
con.execute("INSERT INTO g5_meta VALUES ('lock', 'held')")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
con.execute("ROLLBACK")
"""


def _hold(db, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(db), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_lock_held_by_another_process_names_it_and_the_sweep_resumes_afterwards(tmp_path):
    db = tmp_path / "locked.db"
    ResultsDB.open(db).close()
    grid = parse_grid(["parallel.cp=1,2"])
    holder = _hold(db, 30)
    try:
        t0 = time.monotonic()
        with pytest.raises(G5Error) as err:
            run_sweep(BASE, grid, db, busy_timeout_s=0.5)
        assert time.monotonic() - t0 < 20
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith(f"--db {db}: the database stayed locked")
        if os.path.exists("/proc/locks"):
            assert f"held by process {holder.pid}" in msg and "sqlite3" in msg and "lock on" in msg
    finally:
        holder.kill()
        holder.wait()
    report = run_sweep(BASE, grid, db, busy_timeout_s=5)
    assert len(report.ok_rows) == 2 and report.computed == 2
    with ResultsDB.open_existing(db) as con:
        assert [s["status"] for s in con.sweeps()] == ["complete"]   # the refused one never started
        assert con.con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_a_sweep_stopped_by_an_error_is_interrupted_in_the_sweeps_table(tmp_path):
    db = tmp_path / "stopped.db"
    calls = []

    def runner(raw, **kwargs):
        calls.append(raw)
        if len(calls) == 2:
            raise KeyboardInterrupt
        from g5core.session.run import run
        return run(raw, **kwargs)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(BASE, parse_grid(["parallel.cp=1,2,4"]), db, runner=runner)
    with ResultsDB.open_existing(db) as con:
        assert [s["status"] for s in con.sweeps()] == ["interrupted"]
    resumed = run_sweep(BASE, parse_grid(["parallel.cp=1,2,4"]), db)
    assert resumed.reused == 1 and resumed.computed == 2
    with ResultsDB.open_existing(db) as con:
        assert [s["status"] for s in con.sweeps()] == ["interrupted", "complete"]


def test_a_results_file_left_in_rollback_mode_is_switched_to_wal_on_open(tmp_path):
    """Concurrent sweeps rely on WAL (a reader never stalls the other process's writes): a
    file in another journal mode is switched, and the mode is checked, not assumed."""
    db = tmp_path / "rollback.db"
    ResultsDB.open(db).close()
    import sqlite3
    con = sqlite3.connect(db, isolation_level=None)
    assert con.execute("PRAGMA journal_mode=DELETE").fetchone()[0] == "delete"
    con.close()
    with ResultsDB.open(db) as opened:
        assert opened.con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_file_that_will_not_take_wal_is_a_one_line_error_naming_it(tmp_path):
    from g5core.study import resultsdb

    class Stuck:   # a connection whose PRAGMA keeps answering the old mode
        def execute(self, sql):
            assert sql == "PRAGMA journal_mode=WAL"
            return self

        def fetchall(self):
            return [("delete",)]

    t0 = time.monotonic()
    with pytest.raises(G5Error) as err:
        resultsdb._wal(Stuck(), tmp_path / "x.db", 0.2)
    assert time.monotonic() - t0 < 5
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"--db {tmp_path / 'x.db'}: SQLite kept the file in 'delete' journal mode")
