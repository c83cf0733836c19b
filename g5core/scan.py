"""The CP validation scan: a cp x S grid, one SQLite row per cell, written as it finishes.

For a base configuration, every cell sets ``parallel.cp`` and ``seq_len``; the chip count
stays fixed and ``dp`` absorbs the change (``dp = chips / (tp * pp * cp)``). A cell whose
layout is invalid (dp not whole, ep not dividing dp x tp, seq_len not divisible by 2 cp...)
is recorded with its error, not silently adjusted. Each row is committed as soon as its
run ends, so a crash loses at most the run in flight; the scan's row in ``scans`` says
``running`` until its last cell is written and ``complete`` after, so an interrupted scan
is never mistaken for a finished one.

The check (spec: "TTFT does not increase with cp where communication is hidden"): for each
S, over the successful cells in increasing cp, TTFT must not increase between two cells
whose ring traffic is hidden (``cp_passkv`` hidden fraction >= ``hidden_threshold``;
cp = 1 has no ring traffic and counts as hidden). Cells where it increases are named.
"""
from __future__ import annotations

import json
import sqlite3
from typing import Callable, Iterable, Optional, Sequence

import attrs

from .config import apply_overrides
from .errors import ConfigError, G5Error

SCHEMA = """
CREATE TABLE IF NOT EXISTS scans (
    scan_id INTEGER PRIMARY KEY,
    base_config TEXT NOT NULL,
    cp_values TEXT NOT NULL,
    seq_lens TEXT NOT NULL,
    hidden_threshold REAL NOT NULL,
    cells_planned INTEGER NOT NULL,
    status TEXT NOT NULL             -- 'running' until the last cell is written, then 'complete'
);
CREATE TABLE IF NOT EXISTS cells (
    scan_id INTEGER NOT NULL REFERENCES scans(scan_id),
    cell INTEGER NOT NULL,
    cp INTEGER NOT NULL,
    seq_len INTEGER NOT NULL,
    dp INTEGER,
    status TEXT NOT NULL,            -- 'ok' or 'error'
    error TEXT,
    latency_s REAL,                  -- TTFT (prefill) or TPOT (decode)
    passkv_bytes_per_rank REAL,      -- busiest rank, whole run
    passkv_comm_s REAL,
    passkv_exposed_s REAL,
    passkv_hidden_fraction REAL,
    max_memory_bytes REAL,
    kv_cache_bytes_per_chip REAL,
    fits INTEGER,
    ops INTEGER,
    events INTEGER,
    result_json TEXT,
    PRIMARY KEY (scan_id, cell)
);
"""

DEFAULT_CP_VALUES = (1, 2, 4, 8, 16)
DEFAULT_SEQ_LENS = (32768, 65536, 131072, 262144, 524288, 1048576)


@attrs.frozen
class Cell:
    cp: int
    seq_len: int
    status: str
    error: str = ""
    dp: Optional[int] = None
    latency_s: Optional[float] = None
    hidden_fraction: Optional[float] = None


@attrs.frozen
class ScanReport:
    scan_id: int
    cells: tuple[Cell, ...]
    violations: tuple[str, ...]
    phase: str

    @property
    def ok(self) -> bool:
        return not self.violations


def _parse_ints(values: Iterable, field: str) -> tuple[int, ...]:
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(field, f"must be positive whole numbers, got {v!r}")
        out.append(v)
    if not out:
        raise ConfigError(field, "needs at least one value")
    return tuple(sorted(set(out)))


def run_scan(raw: dict, db_path, cp_values: Sequence[int] = DEFAULT_CP_VALUES,
             seq_lens: Sequence[int] = DEFAULT_SEQ_LENS, disabled: Sequence[str] = (),
             hidden_threshold: float = 0.9, progress: Callable[[str], None] | None = None,
             runner: Callable | None = None) -> ScanReport:
    """Run the grid, writing each cell to ``db_path`` as it finishes; return the check."""
    from .run import run as run_one

    runner = runner or run_one
    cp_values = _parse_ints(cp_values, "--cp")
    seq_lens = _parse_ints(seq_lens, "--seq-len")
    if not 0.0 < hidden_threshold <= 1.0:
        raise ConfigError("--hidden-threshold", f"must be in (0, 1], got {hidden_threshold}")
    par = dict(raw.get("parallel") or {})
    chips = raw.get("chips")
    # a non-integer size fails each cell's own validation with its clear message
    per_replica = 1
    for dim in ("tp", "pp"):
        size = par.get(dim, 1)
        per_replica *= size if isinstance(size, int) else 1
    total = len(cp_values) * len(seq_lens)
    con = sqlite3.connect(str(db_path))
    try:
        con.executescript(SCHEMA)
        cur = con.execute(
            "INSERT INTO scans (base_config, cp_values, seq_lens, hidden_threshold, cells_planned, status) "
            "VALUES (?, ?, ?, ?, ?, 'running')",
            (json.dumps(raw, sort_keys=True), json.dumps(cp_values), json.dumps(seq_lens), hidden_threshold, total))
        scan_id = cur.lastrowid
        con.commit()
        cells = []
        n = 0
        for seq_len in seq_lens:
            for cp in cp_values:
                n += 1
                row = _run_cell(raw, chips, per_replica, cp, seq_len, disabled, runner)
                con.execute(
                    "INSERT INTO cells VALUES (:scan_id, :cell, :cp, :seq_len, :dp, :status, :error, :latency_s, "
                    ":passkv_bytes_per_rank, :passkv_comm_s, :passkv_exposed_s, :passkv_hidden_fraction, "
                    ":max_memory_bytes, :kv_cache_bytes_per_chip, :fits, :ops, :events, :result_json)",
                    {"scan_id": scan_id, "cell": n, **row})
                con.commit()
                cells.append(Cell(cp=cp, seq_len=seq_len, status=row["status"], error=row["error"] or "",
                                  dp=row["dp"], latency_s=row["latency_s"], hidden_fraction=row["passkv_hidden_fraction"]))
                if progress:
                    if row["status"] == "ok":
                        hid = row["passkv_hidden_fraction"]
                        progress(f"[{n}/{total}] cp={cp} seq_len={seq_len}: latency {row['latency_s']:.6g} s, "
                                 f"ring hidden {'-' if hid is None else f'{100 * hid:.1f}%'}")
                    else:
                        progress(f"[{n}/{total}] cp={cp} seq_len={seq_len}: skipped: {row['error']}")
        con.execute("UPDATE scans SET status = 'complete' WHERE scan_id = ?", (scan_id,))
        con.commit()
    finally:
        con.close()
    phase = raw.get("phase", "")
    return ScanReport(scan_id=scan_id, cells=tuple(cells), phase=phase,
                      violations=check_monotone(cells, hidden_threshold) if phase == "prefill" else ())


def _run_cell(raw, chips, per_replica, cp, seq_len, disabled, runner) -> dict:
    """One grid cell as a database row (status 'ok', or 'error' with the reason)."""
    row = {"cp": cp, "seq_len": seq_len, "dp": None, "status": "error", "error": None, "latency_s": None,
           "passkv_bytes_per_rank": None, "passkv_comm_s": None, "passkv_exposed_s": None,
           "passkv_hidden_fraction": None, "max_memory_bytes": None, "kv_cache_bytes_per_chip": None,
           "fits": None, "ops": None, "events": None, "result_json": None}
    if not isinstance(chips, int) or chips % (per_replica * cp):
        row["error"] = f"chips={chips} is not divisible by tp x pp x cp = {per_replica * cp}"
        return row
    dp = chips // (per_replica * cp)
    row["dp"] = dp
    cell_raw = apply_overrides(raw, [f"parallel.cp={cp}", f"parallel.dp={dp}", f"seq_len={seq_len}"])
    try:
        out = runner(cell_raw, disabled=disabled)
    except G5Error as exc:
        row["error"] = str(exc)
        return row
    data = out.to_json_dict()
    data.pop("sim_wall_s", None)
    row.update(status="ok", latency_s=out.latency_s, max_memory_bytes=out.memory.max_total_bytes,
               kv_cache_bytes_per_chip=max(c.kv_cache_bytes for c in out.memory.per_chip),
               fits=int(out.memory.fits), result_json=json.dumps(data, sort_keys=True))
    if out.sim is not None:
        row.update(ops=out.sim.ops, events=out.sim.events,
                   passkv_bytes_per_rank=out.sim.comm_bytes["per_rank_by_reason"].get("cp_passkv", 0.0))
        ring = out.sim.overlap["by_reason"].get("cp_passkv")
        if ring is not None:
            row.update(passkv_comm_s=ring["comm_time_s"], passkv_exposed_s=ring["exposed_comm_s"],
                       passkv_hidden_fraction=ring["hidden_fraction"])
    return row


def check_monotone(cells: Sequence[Cell], hidden_threshold: float) -> tuple[str, ...]:
    """Cells where TTFT rises with cp although the ring traffic is hidden on both sides."""
    violations = []
    by_seq: dict[int, list[Cell]] = {}
    for c in cells:
        if c.status == "ok":
            by_seq.setdefault(c.seq_len, []).append(c)
    for seq_len, row in sorted(by_seq.items()):
        row.sort(key=lambda c: c.cp)
        hidden = [c for c in row if c.cp == 1 or (c.hidden_fraction is not None and c.hidden_fraction >= hidden_threshold)]
        for a, b in zip(hidden, hidden[1:]):
            if b.latency_s > a.latency_s:
                violations.append(f"seq_len={seq_len}: TTFT rises from cp={a.cp} ({a.latency_s:.6g} s) "
                                  f"to cp={b.cp} ({b.latency_s:.6g} s) with the ring traffic hidden")
    return tuple(violations)
