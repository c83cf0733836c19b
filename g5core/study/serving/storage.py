"""The serving search's cells: each stored as its own row of the results database's
``serve_search`` table the moment it finishes (a killed search resumes), run through the sweep
machinery's executors, with their progress lines."""
from __future__ import annotations

import datetime
import json
from typing import Mapping, Optional, Sequence

from g5core.study.resultsdb import ResultsDB, canonical_json, sqlite_errors
from g5core.study.sweep import WAIT, run_windowed


# A cell's key (``config_hash``) holds the G5 build that computed it, so a database written by
# other code (another payload format, or a model that moved step latencies) keeps its cells
# and this search computes its own.


SCHEMA = """
CREATE TABLE IF NOT EXISTS serve_search (
    key TEXT PRIMARY KEY,     -- config_hash of the cell (kind, configuration, workload, SLO, search settings)
    kind TEXT NOT NULL,       -- screen (a layout and chunk size), candidate (a deployment's capacity),
                              -- confirm (its confirming seeds, when its capacity was found unconfirmed),
                              -- variant (a max_num_seqs variant's check) or whole (a shown failing run)
    label TEXT NOT NULL,
    payload TEXT NOT NULL,    -- JSON, the cell's result
    finished_at TEXT NOT NULL
)
"""


class _Table:
    def __init__(self, db: ResultsDB):
        self.db = db
        with sqlite_errors(db.path, db.busy_timeout_s):
            db.con.execute(SCHEMA)

    def get(self, key: str) -> Optional[dict]:
        with sqlite_errors(self.db.path, self.db.busy_timeout_s):
            row = self.db.con.execute("SELECT payload FROM serve_search WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def add(self, key: str, kind: str, label: str, payload: Mapping) -> None:
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        with sqlite_errors(self.db.path, self.db.busy_timeout_s):
            self.db.con.execute("INSERT OR IGNORE INTO serve_search VALUES (?, ?, ?, ?, ?)",
                                (key, kind, label, canonical_json(payload), now))


    def update(self, key: str, payload: Mapping) -> None:
        """A stored cell's result, completed (a candidate's failing run made whole)."""
        with sqlite_errors(self.db.path, self.db.busy_timeout_s):
            self.db.con.execute("UPDATE serve_search SET payload = ? WHERE key = ?", (canonical_json(payload), key))


def _drive(table: _Table, exe, cells: Sequence[tuple], reporter, workers: int, more=None,
           more_reporter=None) -> list:
    """Run ``(key, kind, label, fn, args)`` cells not in the table; every result in order.
    ``reporter`` hears of every cell but the ``whole`` ones (a failing run made whole).
    ``more``: ``(the results so far, None where pending) -> cells`` (``[]``: none yet, None:
    no more), asked once all of ``cells`` are submitted and again as results come in; its
    cells run too, their results after the others' (in the order given), reported to
    ``more_reporter``."""
    out: list = [None] * len(cells)
    if reporter is not None:
        reporter.start(sum(c[1] != "whole" for c in cells))
    done = 0

    def finish(i, kind, label, payload):
        nonlocal done
        out[i] = payload
        if i >= len(cells):
            if more_reporter is not None:
                more_reporter.cell(None, label, payload)
        elif reporter is not None and kind != "whole":
            done += 1
            reporter.cell(done, label, payload)

    def items():
        yield from enumerate(cells)
        while more is not None:
            extra = more(list(out))
            if extra is None:
                return
            if not extra:
                yield WAIT
            for cell in extra:
                out.append(None)
                yield len(out) - 1, cell

    def start(exe, item):
        i, (key, kind, label, fn, args) = item
        hit = table.get(key)
        if hit is not None:
            finish(i, kind, label, None)
            out[i] = hit
            return None
        return exe.submit(fn, *args)

    def stored(item, payload) -> None:
        i, (key, kind, label, _, _) = item
        table.add(key, kind, label, payload)
        finish(i, kind, label, payload)

    try:
        run_windowed(exe, items(), workers, start, stored)
    finally:
        if reporter is not None:
            reporter.close()
    return out


class _Progress:
    """Adapts the sweep's progress objects to the search's cells. On a terminal, a bar; in a
    log, a few lines: a tally at each tenth of the cells (kept, pruned, bounded out, already
    in the database) and one line per candidate whose capacity was simulated."""

    def __init__(self, inner, phase: str):
        self.inner, self.phase = inner, phase
        self.counts: dict = {}
        self.tenth = 0
        self.found_n = 0        # first-wave capacities found unconfirmed since the bar last moved

    def start(self, total):
        if hasattr(self.inner, "start"):
            self.inner.start(total)

    def cell(self, n, label, payload):
        if hasattr(self.inner, "bar"):
            if self.found_n:
                self.found_n = 0
                self.inner.bar.set_postfix_str("", refresh=False)
            self.inner.bar.update(1)
            return
        if not hasattr(self.inner, "emit"):
            return
        total = getattr(self.inner, "total", 0) or 0
        for one in (payload or {}).get("chunks") or [payload]:   # a layout's screen: one per chunk size
            status = "in the database" if one is None else {"ok": "kept"}.get(one.get("status"), one.get("status"))
            self.counts[status] = self.counts.get(status, 0) + 1
        if payload is not None and "capacity_requests_per_s" in payload and payload.get("status") == "ok":
            self.inner.emit(f"{self.phase} [{n}/{total}] {label}: capacity "
                            f"{payload['capacity_requests_per_s']:.4g} req/s ({payload.get('runs', 0)} runs)")
        tenth = 10 * n // total if total else 10
        if tenth > self.tenth:
            self.tenth = tenth
            self.inner.emit(f"{self.phase} [{n}/{total}]: " + self._tally())

    def found(self, label, payload):
        """A first-wave capacity found on the workload's seed, its confirming seeds not run
        yet (in a log, one line; a bar says how many so far, and counts the candidate once
        it is decided)."""
        if hasattr(self.inner, "bar"):
            self.found_n += 1
            found = f"{self.found_n} capacit{'y' if self.found_n == 1 else 'ies'}"
            self.inner.bar.set_postfix_str(f"first wave: {found} found, to confirm")
        elif hasattr(self.inner, "emit"):
            self.inner.emit(f"{self.phase}: {label}: {payload['capacity_requests_per_s']:.4g} req/s on the "
                            f"workload's seed ({payload.get('runs', 0)} runs), unconfirmed")

    def _tally(self) -> str:
        return ", ".join(f"{v} {k}" for k, v in sorted(self.counts.items()))

    def skip(self, n, status: str = "bounded"):
        """``n`` candidates bounded out before their wave (never run: one update, one line),
        or (``status`` "same runs") that took a max_num_seqs variant's capacity search."""
        if hasattr(self.inner, "bar"):
            self.inner.bar.update(n)
        elif hasattr(self.inner, "emit"):
            self.counts[status] = self.counts.get(status, 0) + n
            if status == "bounded":
                self.inner.emit(f"{self.phase}: {n} more candidates bounded out (their bound is not above the value at "
                                f"the last ranked place by more than the tolerance); " + self._tally())

    def close(self):
        if hasattr(self.inner, "close"):
            self.inner.close()


class _Kept:
    """An executor entered once for the whole search (its workers, and the step latencies
    they cache, serve every phase and wave): entering and leaving it do nothing."""

    def __init__(self, exe):
        self.exe = exe

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *args, **kwargs):
        return self.exe.submit(fn, *args, **kwargs)

    def wait(self, futures):
        return self.exe.wait(futures)


class _Waves:
    """One progress display over the capacity waves (and the candidates bounded out)."""

    def __init__(self, inner, total: int):
        self.inner, self.done = inner, 0
        inner.start(total)

    def start(self, total):
        pass

    def cell(self, n, label, payload):
        self.done += 1
        self.inner.cell(self.done, label, payload)

    def skip(self, n, status: str = "bounded"):
        self.done += n
        self.inner.skip(n, status)

    def found(self, label, payload):
        self.inner.found(label, payload)

    def close(self):
        pass

    def finish(self):
        self.inner.close()


class _Unconfirmed:
    """The progress of a wave whose capacities are found unconfirmed (the driver decides each
    candidate later): a line per capacity found, no candidate counted."""

    def __init__(self, waves: _Waves):
        self.waves = waves

    def start(self, total):
        pass

    def cell(self, n, label, payload):
        if payload is not None and payload.get("status") == "unconfirmed":
            self.waves.found(label, payload)

    def close(self):
        pass
