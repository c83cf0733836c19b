"""Issue 35 item 7: `g5 report` exports a serving search's rows (with or without --serving),
says when a file holds none, and the markdown serving report names each run's workload."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from g5core.present.cli import main

REPO = Path(__file__).resolve().parent.parent
SEARCH = ["--serve", "--isl", "1000", "--osl", "16", "--requests", "40", "--slo", "ttft_p90=1s,tpot_p90=30ms",
          "--chunks", "1024", "--seqs", "8", "--settle", "4", "--confirm", "0", "--workers", "1"]


@pytest.fixture(scope="module")
def search_db(tmp_path_factory):
    d = tmp_path_factory.mktemp("search")
    cfg = d / "c.yaml"
    cfg.write_text("model: llama-3.1-8b\nsystem: h100-sxm\nchips: 1\n")
    db = d / "search.db"
    r = CliRunner().invoke(main, ["best", str(cfg), *SEARCH, "--db", str(db)])
    assert r.exit_code == 0, r.output
    return db


def report(*args):
    return CliRunner().invoke(main, ["report", *map(str, args)])


@pytest.mark.parametrize("serving", [False, True])
def test_report_of_a_search_db_exports_its_cells(search_db, serving):
    extra = ("--serving",) if serving else ()
    md = report(search_db, *extra)
    assert md.exit_code == 0, md.output
    lines = md.stdout.strip().splitlines()
    assert len(lines) == 3 and "capacity (req/s)" in lines[0] and "max_num_seqs=8, chunk=1024 | agg | ok" in lines[2]
    assert "holds a serving search's cells (1 candidates, 1 screens)" in md.stderr
    js = json.loads(report(search_db, *extra, "--format", "json").stdout)
    assert [r["kind"] for r in js] == ["screen", "candidate"]
    cand = js[1]
    assert cand["capacity_requests_per_s"] > 0 and cand["ttft_p90_s"] <= 1.0 and cand["payload"]["held"]
    rows = list(csv.DictReader(io.StringIO(report(search_db, *extra, "--format", "csv").stdout)))
    assert float(rows[1]["capacity_requests_per_s"]) == cand["capacity_requests_per_s"]   # bit for bit
    assert json.loads(rows[1]["payload"]) == cand["payload"]


def test_report_of_an_empty_db_says_so(tmp_path):
    from g5core.study.resultsdb import ResultsDB

    db = tmp_path / "e.db"
    ResultsDB.open(db).close()
    r = report(db, "--serving")
    assert r.exit_code == 0 and "holds no serving runs" in r.stderr


def test_markdown_serving_report_has_a_workload_column(tmp_path):
    cfg = tmp_path / "s.yaml"
    cfg.write_text("model: llama-3.1-8b\nsystem: h100-sxm\nchips: 1\nparallel: {dp: 1, tp: 1, pp: 1, cp: 1}\n"
                   "serving: {instances: 1}\n")
    db = tmp_path / "s.db"
    for trace in ("sample-azure.csv", "sample-mooncake.jsonl"):
        r = CliRunner().invoke(main, ["serve", str(cfg), "--workload", str(REPO / "examples" / "traces" / trace),
                                      "--requests", "8", "--db", str(db)])
        assert r.exit_code == 0, r.output
    lines = report(db, "--serving").stdout.strip().splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    col = head.index("workload")
    assert sorted(ln.strip("|").split("|")[col].strip() for ln in lines[2:]) == [
        "sample-azure.csv (first 8)", "sample-mooncake.jsonl (first 8)"]
