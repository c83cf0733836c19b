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
from typing import Mapping, Optional, Sequence

from g5core.api.errors import ConfigError
from g5core.sim.memory import GIB
from g5core.study.resultsdb import JSON_COLUMNS, RESULT_COLUMNS, ResultsDB, canonical_json

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


def _csv_cell(column: str, value) -> str:
    if value is None:
        return ""
    if column in JSON_COLUMNS:
        return canonical_json(value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def to_csv(rows: Sequence[Mapping]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(RESULT_COLUMNS)
    for r in rows:
        w.writerow([_csv_cell(c, r.get(c)) for c in RESULT_COLUMNS])
    return buf.getvalue()


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
