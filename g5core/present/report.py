"""``g5 report``: the rows of a results database as CSV, JSON or a Markdown table.

- JSON: every column of every row, JSON columns decoded (the database's values exactly).
- CSV: every column; numbers written with ``repr`` (they read back bit for bit), JSON
  columns as canonical JSON text, an absent value as an empty field.
- Markdown: the columns a person reads, with units in the headers.
"""
from __future__ import annotations

import csv
import io
import json
import os
from typing import Mapping, Optional, Sequence

from g5core.api.errors import ConfigError
from g5core.sim.memory import GIB
from g5core.study.resultsdb import JSON_COLUMNS, RESULT_COLUMNS, ResultsDB, canonical_json
from g5core.study.serve_db import load_search_cells, load_serving_rows

FORMATS = ("csv", "json", "markdown")


def load_rows(db_path, sweep_id: Optional[int] = None) -> list[dict]:
    with ResultsDB.open_existing(db_path) as db:
        if sweep_id is not None and sweep_id not in {s["sweep_id"] for s in db.sweeps()}:
            raise ConfigError("--sweep", f"{db_path} has no sweep {sweep_id}; `g5 report {db_path}` lists all rows")
        return db.results(sweep_id)


def auto_dims(db_path, sweep_id: Optional[int] = None) -> tuple[str, ...]:
    """The parallel dimensions the database's sweeps (or sweep ``sweep_id``) left ``auto``
    (``dp: auto``: it follows the chip count); a `g5 best` search leaves none."""
    out: set[str] = set()
    with ResultsDB.open_existing(db_path) as db:
        for sweep in db.sweeps():
            if sweep_id is not None and sweep["sweep_id"] != sweep_id:
                continue
            base = json.loads(sweep["base_config"])
            out |= {k for k, v in (base.get("parallel") or {}).items() if v == "auto"}
            for key, values in json.loads(sweep["grid"]):
                if key.startswith("parallel.") and "auto" in values:
                    out.add(key.removeprefix("parallel."))
    return tuple(sorted(out))


def _csv_cell(column: str, value, json_columns: Sequence[str] = JSON_COLUMNS) -> str:
    if value is None:
        return ""
    if column in json_columns:
        return canonical_json(value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _csv(rows: Sequence[Mapping], columns: Sequence[str], json_columns: Sequence[str]) -> str:
    """Every column; numbers by ``repr`` (they read back bit for bit), JSON columns as
    canonical JSON text, an absent value as an empty field."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for r in rows:
        w.writerow([_csv_cell(c, r.get(c), json_columns) for c in columns])
    return buf.getvalue()


def to_csv(rows: Sequence[Mapping]) -> str:
    return _csv(rows, RESULT_COLUMNS, JSON_COLUMNS)


def to_json(rows: Sequence[Mapping]) -> str:
    return json.dumps([{c: r.get(c) for c in RESULT_COLUMNS} for r in rows], indent=2, sort_keys=True,
                      allow_nan=False) + "\n"


def _layout(r: Mapping) -> str:
    par = r.get("parallel") or {}
    return " ".join(f"{k}={v}" for k, v in sorted(par.items()))


def _num(value, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


MARKDOWN_COLUMNS = ("model", "system", "phase", "chips", "parallel", "batch", "seq_len", "status", "TTFT (s)",
                    "TPOT (s)", "tokens/s/chip", "max memory per chip (GiB)", "fits", "error")


def to_markdown(rows: Sequence[Mapping]) -> str:
    lines = ["| " + " | ".join(MARKDOWN_COLUMNS) + " |", "|" + "---|" * len(MARKDOWN_COLUMNS)]
    for r in rows:
        mem = r.get("max_total_bytes")
        cells = [r.get("model") or "", r.get("system") or "", r.get("phase") or "", _num(r.get("chips"), "d"),
                 _layout(r), _num(r.get("batch"), "d"), _num(r.get("seq_len"), "d"), r["status"],
                 _num(r.get("ttft_s"), ".6g"), _num(r.get("tpot_s"), ".6g"), _num(r.get("tokens_per_s_per_chip"), ".6g"),
                 "" if mem is None else f"{mem / GIB:.2f}", "" if r.get("fits") is None else ("yes" if r["fits"] else "no"),
                 (r.get("error") or "").replace("|", "\\|")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def render(rows: Sequence[Mapping], fmt: str) -> str:
    if fmt == "csv":
        return to_csv(rows)
    if fmt == "json":
        return to_json(rows)
    if fmt == "markdown":
        return to_markdown(rows)
    raise ConfigError("--format", f"unknown format {fmt!r}; use {', '.join(FORMATS)}")


# -- serving runs (``g5 serve --db``, ``g5 sweep`` over a serving configuration) ---------------

SERVING_JSON_COLUMNS = ("config", "workload", "disabled", "summary", "series")
SERVING_MARKDOWN_COLUMNS = ("model", "system", "chips", "deployment", "workload", "rate (req/s)", "requests", "TTFT p50 (s)",
                            "TTFT p99 (s)", "TPOT p50 (s)", "TPOT p99 (s)", "output tokens/s/chip", "requests/s",
                            "goodput share")


def load_serving(db_path, sweep_id: Optional[int] = None) -> list[dict]:
    """The serving rows of ``db_path``, JSON columns decoded (``--sweep`` selects sweep rows only)."""
    if sweep_id is not None:
        raise ConfigError("--sweep", "selects a sweep's rows; serving rows are not grouped by sweep: drop --sweep")
    return [{c: (json.loads(v) if c in SERVING_JSON_COLUMNS and v is not None else v) for c, v in r.items()}
            for r in load_serving_rows(db_path)]


def _deployment(config: Mapping) -> str:
    serving = config.get("serving") or {}
    dis = serving.get("disaggregation")
    if dis:
        return " + ".join(f"{role} {(dis[role] or {}).get('instances', 1)}x "
                          f"{_layout({'parallel': (dis[role] or {}).get('parallel') or config.get('parallel')})}"
                          + (f" on {dis[role]['system']}" if (dis[role] or {}).get("system") else "")
                          for role in ("prefill", "decode") if role in dis)
    return f"{serving.get('instances', 1)}x {_layout(config)}"


def render_serving(rows: Sequence[Mapping], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(list(rows), indent=2, sort_keys=True, allow_nan=False) + "\n"
    if fmt == "csv":
        return _csv(rows, list(rows[0]) if rows else [], SERVING_JSON_COLUMNS)
    if fmt != "markdown":
        raise ConfigError("--format", f"unknown format {fmt!r}; use {', '.join(FORMATS)}")
    lines = ["| " + " | ".join(SERVING_MARKDOWN_COLUMNS) + " |", "|" + "---|" * len(SERVING_MARKDOWN_COLUMNS)]
    for r in rows:
        cfg = r["config"]
        cells = [cfg.get("model", ""), cfg.get("system", ""), _num(r.get("chips"), "d"), _deployment(cfg),
                 workload_label(r.get("workload")).replace("|", "/"), _num(r.get("rate_per_s"), ".6g"), _num(r.get("requests"), "d"), _num(r.get("ttft_p50_s"), ".6g"),
                 _num(r.get("ttft_p99_s"), ".6g"), _num(r.get("tpot_p50_s"), ".6g"), _num(r.get("tpot_p99_s"), ".6g"),
                 _num(r.get("output_tokens_per_s_per_chip"), ".6g"), _num(r.get("requests_per_s"), ".6g"),
                 _num(r.get("goodput_share"), ".4g")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


# -- a serving search's cells (``g5 best --serve --db``) -----------------------------------------

SEARCH_COLUMNS = ("key", "kind", "label", "status", "disaggregated", "chips", "capacity_requests_per_s",
                  "failed_rate_per_s", "ceiling", "output_tokens_per_s_per_chip", "output_tokens_per_s_per_user",
                  "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "tpot_p90_s", "tpot_p99_s", "goodput_share",
                  "lone_ttft_s", "lone_tpot_s", "kv_capacity_tokens", "reason", "finished_at", "payload")
SEARCH_MARKDOWN_COLUMNS = ("deployment", "kind", "status", "chips", "capacity (req/s)", "output tokens/s/chip",
                           "output tokens/s/user", "TTFT p90 (s)", "TTFT p99 (s)", "TPOT p90 (s)", "TPOT p99 (s)",
                           "reason")


def load_search(db_path) -> list[dict]:
    """The cells of the ``g5 best --serve`` searches in ``db_path``, one flat row each
    (:data:`SEARCH_COLUMNS`; ``payload``: the cell's whole result). A candidate's per-chip and
    per-user rates are at its capacity (the capacity times the mean output tokens, over the
    chips; 1 / TPOT p50 of the run held there)."""
    out = []
    for cell in load_search_cells(db_path):
        if cell["kind"] == "whole":     # a shown candidate's failing run made whole: in its candidate's row
            continue
        p = cell["payload"]
        held = p.get("held") or {}
        row = {"key": cell["key"], "kind": cell["kind"], "label": cell["label"], "status": p.get("status"),
               "disaggregated": p.get("disaggregated"), "chips": p.get("chips"),
               "capacity_requests_per_s": p.get("capacity_requests_per_s"),
               "failed_rate_per_s": p.get("failed_rate_per_s"), "ceiling": p.get("ceiling"),
               "lone_ttft_s": p.get("lone_ttft_s"), "lone_tpot_s": p.get("lone_tpot_s"),
               "kv_capacity_tokens": p.get("kv_capacity_tokens"), "reason": p.get("reason"),
               "goodput_share": held.get("goodput_share"), "finished_at": cell["finished_at"], "payload": p}
        for metric in ("ttft", "tpot"):
            for q in ("p50", "p90", "p99"):
                row[f"{metric}_{q}_s"] = (held.get(f"{metric}_s") or {}).get(q)
        cap, mean_out, chips = p.get("capacity_requests_per_s"), held.get("mean_output_tokens"), p.get("chips")
        row["output_tokens_per_s_per_chip"] = (cap * mean_out / chips if None not in (cap, mean_out, chips)
                                               and chips else None)
        row["output_tokens_per_s_per_user"] = 1.0 / row["tpot_p50_s"] if row["tpot_p50_s"] else None
        out.append(row)
    return out


def render_search(rows: Sequence[Mapping], fmt: str) -> str:
    """``g5 report`` of a search: JSON and CSV every cell and column, Markdown the candidates
    (the simulated first, most output tokens/s per chip first)."""
    if fmt == "json":
        return json.dumps(list(rows), indent=2, sort_keys=True, allow_nan=False) + "\n"
    if fmt == "csv":
        return _csv(rows, SEARCH_COLUMNS, ("payload",))
    if fmt != "markdown":
        raise ConfigError("--format", f"unknown format {fmt!r}; use {', '.join(FORMATS)}")
    cands = sorted((r for r in rows if r["kind"] == "candidate"),
                   key=lambda r: (r["output_tokens_per_s_per_chip"] is None, -(r["output_tokens_per_s_per_chip"] or 0),
                                  r["label"]))
    lines = ["| " + " | ".join(SEARCH_MARKDOWN_COLUMNS) + " |", "|" + "---|" * len(SEARCH_MARKDOWN_COLUMNS)]
    for r in cands:
        cells = [r["label"], "disagg" if r["disaggregated"] else "agg", r["status"] or "", _num(r["chips"], "d"),
                 _num(r["capacity_requests_per_s"], ".6g"), _num(r["output_tokens_per_s_per_chip"], ".6g"),
                 _num(r["output_tokens_per_s_per_user"], ".6g"), _num(r["ttft_p90_s"], ".6g"),
                 _num(r["ttft_p99_s"], ".6g"), _num(r["tpot_p90_s"], ".6g"), _num(r["tpot_p99_s"], ".6g"),
                 (r["reason"] or "").replace("|", "/")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def workload_label(workload: Optional[Mapping]) -> str:
    """A serving run's workload in a few words: a trace's file name (and its first N), or the
    arrival process and the lengths of a synthetic one."""
    w = workload or {}
    if "trace" in w:
        return os.path.basename(str(w["trace"])) + (f" (first {w['requests']:,})" if "requests" in w else "")
    arrival = w.get("arrival") or {}
    kind = arrival.get("kind", "poisson")
    head = (f"closed {arrival.get('concurrency')}" if kind == "closed"
            else f"{kind}{' cv=' + format(arrival['cv'], 'g') if 'cv' in arrival else ''} "
                 f"{format(arrival['rate_per_s'], 'g') if 'rate_per_s' in arrival else '?'} req/s")
    return f"{head}, isl {w.get('input_tokens', '?')}, osl {w.get('output_tokens', '?')}"
