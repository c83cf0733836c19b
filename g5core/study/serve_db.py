"""Serving runs in the results database: a ``serving_results`` table beside ``results``,
one row per (configuration, workload, disabled plugins), added with ``INSERT OR IGNORE``
like a sweep's rows. ``g5 plot`` reads it for the serving kinds."""
from __future__ import annotations

import datetime
import json
from typing import Mapping, Sequence

from g5core.study.resultsdb import ResultsDB, canonical_json, config_hash, sqlite_errors

SERVING_SCHEMA = """
CREATE TABLE IF NOT EXISTS serving_results (
    key TEXT PRIMARY KEY,            -- config_hash of the configuration, the workload and disabled plugins
    config TEXT NOT NULL,            -- JSON, the configuration (with its serving block)
    workload TEXT NOT NULL,          -- JSON, the workload description
    disabled TEXT NOT NULL,          -- JSON list
    rate_per_s REAL,                 -- the workload's arrival rate (open loop), for rate sweeps
    requests INTEGER, chips INTEGER,
    ttft_p50_s REAL, ttft_p99_s REAL, tpot_p50_s REAL, tpot_p99_s REAL, e2e_p50_s REAL,
    output_tokens_per_s REAL, output_tokens_per_s_per_chip REAL, requests_per_s REAL, goodput_share REAL,
    summary TEXT NOT NULL,           -- JSON, g5 serve --json's object
    series TEXT NOT NULL,            -- JSON, g5core.serve.metrics.series (latency CDFs, occupancy over time)
    finished_at TEXT NOT NULL
)
"""


class ServingDB:
    def __init__(self, db: ResultsDB):
        self.db = db
        with sqlite_errors(db.path, db.busy_timeout_s):
            db.con.execute(SERVING_SCHEMA)

    def add(self, raw: Mapping, disabled: Sequence[str], workload: Mapping | None, out: Mapping,
            series: Mapping) -> bool:
        key = config_hash({"config": dict(raw), "workload": dict(workload or {})}, disabled)
        t, g = out["throughput"], out.get("goodput") or {}
        rate = (workload or {}).get("arrival", {}).get("rate_per_s") if workload else None
        row = (key, canonical_json(dict(raw)), canonical_json(dict(workload or {})), canonical_json(list(disabled)),
               rate, out["requests"], out["chips"], out["ttft_s"]["p50"], out["ttft_s"]["p99"], out["tpot_s"]["p50"],
               out["tpot_s"]["p99"], out["e2e_s"]["p50"], t["output_tokens_per_s"], t["output_tokens_per_s_per_chip"],
               t["requests_per_s"], g.get("share"), canonical_json(out), canonical_json(series),
               datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        with sqlite_errors(self.db.path, self.db.busy_timeout_s):
            cur = self.db.con.execute(f"INSERT OR IGNORE INTO serving_results VALUES ({', '.join('?' * len(row))})",
                                      row)
        return cur.rowcount == 1

    def rows(self) -> list[dict]:
        with sqlite_errors(self.db.path, self.db.busy_timeout_s):
            return _rows(self.db.con)

    def close(self) -> None:
        self.db.close()


def open_serving_db(path, inputs: Sequence = ()) -> ServingDB:
    return ServingDB(ResultsDB.open(path, inputs=inputs))


def _read(db_path, table: str, read) -> list:
    """``read(con)`` on an existing results file ([] when it has no ``table``), without
    writing to it."""
    db = ResultsDB.open_existing(db_path)
    try:
        with sqlite_errors(db.path, db.busy_timeout_s):
            tables = {r[0] for r in db.con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            return read(db.con) if table in tables else []
    finally:
        db.close()


def load_serving_rows(db_path) -> list[dict]:
    """The ``serving_results`` rows of an existing results file ([] when it has none), read
    without writing to it."""
    return _read(db_path, "serving_results", _rows)


def _rows(con) -> list[dict]:
    cur = con.execute("SELECT * FROM serving_results ORDER BY rate_per_s, key")
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r)) for r in cur.fetchall()]


def serving_free_key(row: Mapping) -> str:
    """A ``serving_results`` row's key without the build (``newest_of_each``)."""
    return config_hash({"config": json.loads(row["config"]), "workload": json.loads(row["workload"])},
                       json.loads(row["disabled"]), build=False)


def load_search_cells(db_path) -> list[dict]:
    """The ``serve_search`` cells (``g5 best --serve --db``) of an existing results file, each
    ``{key, kind, label, payload, finished_at}`` with its payload decoded, screens then
    candidates, each by key ([] when it has none); read without writing to it."""
    def read(con):
        cur = con.execute("SELECT key, kind, label, payload, finished_at FROM serve_search ORDER BY kind DESC, key")
        return [{"key": k, "kind": kind, "label": label, "payload": json.loads(payload), "finished_at": at}
                for k, kind, label, payload, at in cur.fetchall()]
    return _read(db_path, "serve_search", read)


SEARCH_CONTEXT_SCHEMA = """
CREATE TABLE IF NOT EXISTS serve_search_context (
    key TEXT PRIMARY KEY,     -- config_hash of the context
    context TEXT NOT NULL     -- JSON {model, system, chips, workload, slo}: what a search was asked
)
"""


def record_search_context(db_path, raw: Mapping, workload: str, slo) -> None:
    """Record beside a search's cells what it was asked (for the titles of ``g5 plot``):
    ``workload`` in words, ``slo`` as given (``--slo`` or ``serving.slo``)."""
    ctx = {"model": raw.get("model"), "system": raw.get("system"), "chips": raw.get("chips"),
           "workload": workload, "slo": slo if isinstance(slo, str) or slo is None else canonical_json(slo)}
    db = ResultsDB.open(db_path)
    try:
        with sqlite_errors(db.path, db.busy_timeout_s):
            db.con.execute(SEARCH_CONTEXT_SCHEMA)
            db.con.execute("INSERT OR IGNORE INTO serve_search_context VALUES (?, ?)",
                           (config_hash({"context": ctx}, (), build=False), canonical_json(ctx)))
    finally:
        db.close()


def load_search_context(db_path) -> list[dict]:
    """The contexts :func:`record_search_context` wrote ([] when none)."""
    return _read(db_path, "serve_search_context", lambda con: [
        json.loads(c) for (c,) in con.execute("SELECT context FROM serve_search_context ORDER BY key")])
