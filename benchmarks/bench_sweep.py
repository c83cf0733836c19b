"""Sweep benchmark: a 100-point grid (cp x S x batch) of llama-3.1-8b on 8 chips, end to end.

Not a test: it reports a figure. It runs the real command in a fresh process, into a new
database in a temporary folder, and times it (process start and imports included)::

    python benchmarks/bench_sweep.py [--workers 2] [--executor local]

Target (issue 11): at most 60 s on 2 cores with ``--workers 2``.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sqlite3
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
BASE = ROOT / "benchmarks" / "sweep-llama-3.1-8b-8chips.yaml"
GRID = ["parallel.cp=1,2,4,8", "seq_len=8192,16384,32768,65536,131072", "batch=1,2,4,8,16"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--executor", default="local")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="g5-bench-sweep-") as tmp:
        db = pathlib.Path(tmp) / "bench.db"
        cmd = [sys.executable, "-m", "g5core", "sweep", str(BASE), "--db", str(db), "--workers", str(args.workers),
               "--executor", args.executor]
        for g in GRID:
            cmd += ["--grid", g]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall_s = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.exit(f"sweep failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
        con = sqlite3.connect(str(db))
        ok, total = con.execute("SELECT SUM(status = 'ok'), COUNT(*) FROM results").fetchone()
        cell_s = con.execute("SELECT SUM(wall_s) FROM results").fetchone()[0]
        con.close()
    print(json.dumps({"points": total, "ok": ok, "workers": args.workers, "executor": args.executor,
                      "wall_s": round(wall_s, 2), "sum_cell_wall_s": round(cell_s, 2)}))


if __name__ == "__main__":
    main()
