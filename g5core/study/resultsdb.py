"""The results database: one SQLite row per configuration, committed the moment it finishes.

- ``results`` holds one row per resolved configuration, keyed by :func:`config_hash`; the
  key is the primary key and rows are added with ``INSERT OR IGNORE``, so a configuration
  is never stored twice, whoever computes it (worker processes, two sweeps on one file).
- Each insert is its own transaction (autocommit): a crash, ``kill -9`` included, loses at
  most the rows still being computed. The file is in WAL mode, so readers never block the
  writer and a killed writer leaves a consistent file.
- ``sweeps`` and ``sweep_cells`` record what each sweep planned (every grid point with its
  key, in grid order) and whether it finished (``running`` until its last cell is in).
- A sweep that stops before its last cell (an error, Ctrl-C) marks itself ``interrupted``;
  one killed outright (``kill -9``) is found ``running`` with no live process on this host
  (``pid``, ``host``) and reported, and marked when the file is next opened for writing,
  as ``interrupted``.
- A writer that finds the file locked waits up to ``BUSY_TIMEOUT_S`` and then fails with a
  one-line :class:`G5Error` naming the lock and, where the system says (Linux
  ``/proc/locks``), the process that holds it; any other SQLite failure is one line too.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import socket
import sqlite3
import time
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

from g5core.api.errors import ConfigError, G5Error
from g5core.api.plugins import plugin_modules
from g5core.inputs.outputs import check_output_path
from g5core.version import __version__

SCHEMA_VERSION = "1"
# sqlite3's default is 5 s; a sweep shares its file with other sweeps and readers, so it
# waits longer for the write lock before giving up.
BUSY_TIMEOUT_S = 60.0
SQLITE_MAGIC = b"SQLite format 3\x00"

SCHEMA = """
CREATE TABLE IF NOT EXISTS g5_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sweeps (
    sweep_id INTEGER PRIMARY KEY,
    kind TEXT NOT NULL,              -- 'sweep', 'best' or a preset name
    base_config TEXT NOT NULL,       -- JSON
    grid TEXT NOT NULL,              -- JSON [[key, [values...]], ...]
    options TEXT NOT NULL,           -- JSON
    cells_planned INTEGER NOT NULL,
    status TEXT NOT NULL,            -- 'running' until the last cell is in, then 'complete',
                                     -- 'interrupted' when its process stopped first
    g5_version TEXT NOT NULL,
    started_at TEXT NOT NULL,
    pid INTEGER, host TEXT           -- the process running it (to tell a killed one)
);
CREATE TABLE IF NOT EXISTS sweep_cells (
    sweep_id INTEGER NOT NULL REFERENCES sweeps(sweep_id),
    cell INTEGER NOT NULL,           -- 1-based, in grid order
    point TEXT NOT NULL,             -- JSON {key: value} of the grid point
    config_hash TEXT NOT NULL,
    PRIMARY KEY (sweep_id, cell)
);
CREATE TABLE IF NOT EXISTS results (
    config_hash TEXT PRIMARY KEY,
    config TEXT NOT NULL,            -- JSON, the resolved configuration
    disabled TEXT NOT NULL,          -- JSON list of disabled plugins
    status TEXT NOT NULL,            -- 'ok' or 'error'
    error TEXT,
    model TEXT, system TEXT, phase TEXT, chips INTEGER, batch INTEGER, seq_len INTEGER,
    parallel TEXT,                   -- JSON {dimension: size}
    latency_s REAL, ttft_s REAL, tpot_s REAL, tokens_per_s_per_chip REAL,
    max_total_bytes REAL, capacity_bytes REAL, fits INTEGER,
    weights_bytes REAL, kv_cache_bytes REAL, activation_bytes REAL, workspace_bytes REAL,  -- fullest chip
    comm_bytes TEXT, overlap TEXT, conservation TEXT, memory TEXT,                        -- JSON
    ops INTEGER, flows INTEGER, events INTEGER,
    g5_version TEXT NOT NULL,
    wall_s REAL NOT NULL,
    finished_at TEXT NOT NULL
);
"""

#: Columns of ``results`` in table order; those holding JSON are decoded when read.
RESULT_COLUMNS = (
    "config_hash", "config", "disabled", "status", "error", "model", "system", "phase", "chips", "batch", "seq_len",
    "parallel", "latency_s", "ttft_s", "tpot_s", "tokens_per_s_per_chip", "max_total_bytes", "capacity_bytes", "fits",
    "weights_bytes", "kv_cache_bytes", "activation_bytes", "workspace_bytes", "comm_bytes", "overlap", "conservation",
    "memory", "ops", "flows", "events", "g5_version", "wall_s", "finished_at",
)
JSON_COLUMNS = frozenset({"config", "disabled", "parallel", "comm_bytes", "overlap", "conservation", "memory"})
#: Columns that describe how and when a row was computed rather than what it computed.
RUN_COLUMNS = frozenset({"g5_version", "wall_s", "finished_at"})


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def config_hash(resolved: Mapping, disabled: Iterable[str] = (), *, build: bool = True) -> str:
    """Stable key of a result: SHA-256 of the resolved configuration's canonical JSON, the
    disabled plugins and (``build``) the G5 build that computes it (:func:`build_id`), so a
    database's rows are reused only by the code that computed them. ``build=False`` keys a
    record that is not a result (what a search was asked)."""
    key = {"config": resolved, "disabled": sorted(disabled)}
    if build:
        key["build"] = build_id()
    return hashlib.sha256(canonical_json(key).encode("utf-8")).hexdigest()


def newest_of_each(rows: Sequence[Mapping], free_key) -> tuple[list, int]:
    """``rows`` with one row per configuration whatever build computed it (``free_key(row)``:
    its key without the build): the one finished last (``finished_at``, then the later in
    ``rows``), in ``rows``' order; and how many were left out (rows of other builds)."""
    newest: dict = {}
    for i, row in enumerate(rows):
        k = free_key(row)
        if k not in newest or (row["finished_at"], i) >= (rows[newest[k]]["finished_at"], newest[k]):
            newest[k] = i
    keep = sorted(newest.values())
    return [rows[i] for i in keep], len(rows) - len(keep)


def result_free_key(row: Mapping) -> str:
    """A ``results`` row's key without the build (:func:`newest_of_each`)."""
    return config_hash(row["config"], row["disabled"], build=False)


#: the files whose content is G5's model: code, and the shipped data (systems, models,
#: framework profiles, kernel tables)
BUILD_SUFFIXES = (".py", ".yaml", ".json", ".csv")


def _package_files(root: pathlib.Path) -> Iterator[tuple[str, pathlib.Path]]:
    """``(path relative to root, path)`` of the model files under a package folder, sorted."""
    for path in sorted(root.rglob("*")):
        if path.suffix in BUILD_SUFFIXES and path.is_file() and "__pycache__" not in path.parts:
            yield path.relative_to(root).as_posix(), path


def _plugin_roots() -> list[tuple[str, Optional[pathlib.Path]]]:
    """Each installed plugin's top-level package (or module file), found without importing it;
    ``None`` where the import system cannot say where it lives."""
    out = {}
    for _, module in plugin_modules():
        top = module.split(":")[0].split(".")[0]
        if top in out:
            continue
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            out[top] = None
        elif spec.submodule_search_locations:
            out[top] = pathlib.Path(list(spec.submodule_search_locations)[0])
        else:
            out[top] = pathlib.Path(spec.origin) if spec.origin else None
    return sorted(out.items())


#: installed distributions whose data G5's figures read (``plugins/measured`` reads its kernel
#: tables from ``aiconfigurator_core/systems/data``): their versions are part of the build
DATA_DISTRIBUTIONS = ("aiconfigurator-core",)

_BUILD: dict = {}


def build_id() -> str:
    """SHA-256 of the G5 build that runs: every model file of the ``g5core`` package and of
    each installed plugin's package (names and contents: about 150 files, 1.7 MB, a few ms, once
    per process), and the versions of the :data:`DATA_DISTRIBUTIONS`. Any change to the code or the shipped data makes a new build: rows a
    database holds from another build stay in it and are not reused (a result is never taken
    from code that might have computed it otherwise)."""
    if "id" not in _BUILD:
        digest = hashlib.sha256()
        roots = [("g5core", pathlib.Path(__file__).resolve().parents[1])] + _plugin_roots()
        for name, root in roots:
            digest.update(f"\0package {name}\0".encode("utf-8"))
            if root is None:
                continue
            files = _package_files(root) if root.is_dir() else [(root.name, root)]
            for rel, path in files:
                data = path.read_bytes()
                digest.update(f"\0{rel}\0{len(data)}\0".encode("utf-8"))
                digest.update(data)
        for dist in DATA_DISTRIBUTIONS:
            try:
                version = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                version = "absent"
            digest.update(f"\0distribution {dist} {version}\0".encode("utf-8"))
        _BUILD["id"] = digest.hexdigest()
    return _BUILD["id"]


def build_version() -> str:
    """The version written beside a result: G5's release and its build (``0.1.0+1a2b3c4d5e6f``)."""
    return f"{__version__}+{build_id()[:12]}"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


@contextlib.contextmanager
def sqlite_errors(path, busy_timeout_s: float = BUSY_TIMEOUT_S) -> Iterator[None]:
    """Turn SQLite failures into one-line G5 errors naming the file."""
    try:
        yield
    except sqlite3.OperationalError as exc:
        text = str(exc)
        if "locked" in text or "busy" in text:
            raise G5Error(f"--db {path}: the database stayed locked by another writer for more than "
                          f"{busy_timeout_s:g} s ({lock_holder(path)}); try again when it finishes, "
                          "or use another file") from None
        raise G5Error(f"--db {path}: SQLite error: {text}") from None
    except sqlite3.DatabaseError as exc:
        raise G5Error(f"--db {path}: not a usable SQLite database ({exc}); choose another file") from None


def lock_holder(path) -> str:
    """Which lock, and which process holds it, as far as the system tells: SQLite's locks are
    POSIX record locks on the file (and, in WAL mode, on its ``-shm`` and ``-wal`` files),
    which Linux lists in ``/proc/locks`` with the holder's pid."""
    files = {}
    for suffix in ("", "-shm", "-wal"):
        f = f"{path}{suffix}"
        try:
            st = os.stat(f)
        except OSError:
            continue
        files[(os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)] = f
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return "the write lock of the file; this system does not say which process holds it"
    for line in lines:
        parts = line.split()
        # "1: POSIX  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (a blocked waiter's line has "->")
        if len(parts) < 6 or "->" in parts or parts[1] not in ("POSIX", "OFDLCK"):
            continue
        try:
            pid = int(parts[4])
            major, minor, inode = parts[5].split(":")
            key = (int(major, 16), int(minor, 16), int(inode))
        except ValueError:
            continue
        if key in files and pid != os.getpid():
            return f"the {parts[3].lower()} lock on {files[key]}, held by process {pid} ({_command(pid)})"
    return "the write lock of the file, held by another connection; the system names no other process"


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            text = " ".join(fh.read().replace(b"\0", b" ").decode("utf-8", "replace").split())
    except OSError:
        return "its command is not readable"
    return (text[:77] + "...") if len(text) > 80 else text or "no command line"


def _alive(pid: Optional[int], host: Optional[str]) -> bool:
    """Whether the process that ran a sweep may still be running (unknown: assume so)."""
    if pid is None or host != socket.gethostname():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


class ResultsDB:
    """A connection to one results file. Use :meth:`open` (creates it) or :meth:`open_existing`."""

    def __init__(self, con: sqlite3.Connection, path: pathlib.Path, busy_timeout_s: float = BUSY_TIMEOUT_S):
        self.con = con
        self.path = path
        self.busy_timeout_s = busy_timeout_s

    # -- opening ---------------------------------------------------------------------

    @classmethod
    def open(cls, path, busy_timeout_s: float = BUSY_TIMEOUT_S, inputs: Sequence = ()) -> "ResultsDB":
        """Open ``path`` for writing, creating the file and its tables if needed."""
        target = check_output_path(path, "--db", inputs)
        _check_header(target, path)
        return cls._connect(target, path, busy_timeout_s, create=True)

    @classmethod
    def open_existing(cls, path, busy_timeout_s: float = BUSY_TIMEOUT_S) -> "ResultsDB":
        """Open an existing results file (for reading)."""
        p = pathlib.Path(path)
        if not p.is_file():
            raise ConfigError("DB", f"no results database at {p}; run `g5 sweep ... --db {p}` first")
        _check_header(p, path)
        return cls._connect(p, path, busy_timeout_s, create=False)

    @classmethod
    def _connect(cls, target: pathlib.Path, shown, busy_timeout_s: float, create: bool) -> "ResultsDB":
        with sqlite_errors(shown, busy_timeout_s):
            con = sqlite3.connect(str(target), timeout=busy_timeout_s, isolation_level=None)
            try:
                tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
                if tables and "g5_meta" not in tables:
                    raise ConfigError("--db", f"{shown} is a SQLite database of another program (or of a G5 "
                                              "before the results database); choose another file")
                if create:
                    _wal(con, shown, busy_timeout_s)
                    con.execute("BEGIN IMMEDIATE")
                    for statement in SCHEMA.split(";"):
                        if statement.strip():
                            con.execute(statement)
                    con.execute("INSERT OR IGNORE INTO g5_meta VALUES ('schema_version', ?)", (SCHEMA_VERSION,))
                    have = {r[1] for r in con.execute("PRAGMA table_info(sweeps)")}
                    for column, kind in (("pid", "INTEGER"), ("host", "TEXT")):   # files of before: added
                        if column not in have:
                            con.execute(f"ALTER TABLE sweeps ADD COLUMN {column} {kind}")
                    for sweep_id, pid, host in con.execute(
                            "SELECT sweep_id, pid, host FROM sweeps WHERE status = 'running'").fetchall():
                        if not _alive(pid, host):
                            con.execute("UPDATE sweeps SET status = 'interrupted' WHERE sweep_id = ?", (sweep_id,))
                    con.execute("COMMIT")
                elif not tables:
                    raise ConfigError("DB", f"{shown} holds no G5 results")
                # fetchall, not fetchone: a statement stepped but not to its end keeps a read open
                version = next(iter(con.execute("SELECT value FROM g5_meta WHERE key = 'schema_version'")
                                    .fetchall()), None)
                if version is None or version[0] != SCHEMA_VERSION:
                    raise ConfigError("--db", f"{shown} was written by another G5 version (schema "
                                              f"{version[0] if version else '?'}, this one writes {SCHEMA_VERSION}); "
                                              "choose another file")
            except BaseException:
                con.close()
                raise
        return cls(con, pathlib.Path(shown), busy_timeout_s)

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> "ResultsDB":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- writing ---------------------------------------------------------------------

    def start_sweep(self, kind: str, base: Mapping, grid: Sequence, options: Mapping,
                    cells: Sequence[tuple[Mapping, str]], g5_version: str) -> int:
        """Record a sweep and its planned cells ``(point, config_hash)`` in one transaction."""
        with sqlite_errors(self.path, self.busy_timeout_s):
            self.con.execute("BEGIN IMMEDIATE")
            try:
                cur = self.con.execute(
                    "INSERT INTO sweeps (kind, base_config, grid, options, cells_planned, status, g5_version, "
                    "started_at, pid, host) VALUES (?, ?, ?, ?, ?, 'running', ?, ?, ?, ?)",
                    (kind, canonical_json(base), canonical_json(grid), canonical_json(options), len(cells),
                     g5_version, utc_now(), os.getpid(), socket.gethostname()))
                sweep_id = cur.lastrowid
                self.con.executemany("INSERT INTO sweep_cells VALUES (?, ?, ?, ?)",
                                     [(sweep_id, i + 1, canonical_json(point), h) for i, (point, h) in enumerate(cells)])
                self.con.execute("COMMIT")
            except BaseException:
                if self.con.in_transaction:
                    self.con.execute("ROLLBACK")
                raise
        return sweep_id

    def finish_sweep(self, sweep_id: int, status: str = "complete") -> None:
        with sqlite_errors(self.path, self.busy_timeout_s):
            self.con.execute("UPDATE sweeps SET status = ? WHERE sweep_id = ?", (status, sweep_id))

    def insert(self, row: Mapping) -> bool:
        """Store one finished configuration; False when its key was already stored."""
        values = [canonical_json(row[c]) if c in JSON_COLUMNS and row.get(c) is not None else row.get(c)
                  for c in RESULT_COLUMNS]
        with sqlite_errors(self.path, self.busy_timeout_s):
            cur = self.con.execute(
                f"INSERT OR IGNORE INTO results ({', '.join(RESULT_COLUMNS)}) "
                f"VALUES ({', '.join('?' for _ in RESULT_COLUMNS)})", values)
        return cur.rowcount == 1

    # -- reading ---------------------------------------------------------------------

    def has(self, key: str) -> bool:
        with sqlite_errors(self.path, self.busy_timeout_s):
            return bool(self.con.execute("SELECT 1 FROM results WHERE config_hash = ? LIMIT 1", (key,)).fetchall())

    def other_builds(self, keys: Mapping[str, str]) -> dict[str, str]:
        """Of ``keys`` (a configuration's key without the build, :func:`config_hash` with
        ``build=False`` -> its key), those the file holds a row of from another G5 build:
        ``{key: that row's g5_version}`` (why a sweep computes them anew)."""
        mine = build_version()
        with sqlite_errors(self.path, self.busy_timeout_s):
            rows = self.con.execute("SELECT config, disabled, g5_version FROM results WHERE g5_version != ?",
                                    (mine,)).fetchall()
        out = {}
        for config, disabled, version in rows:
            free = config_hash(json.loads(config), json.loads(disabled), build=False)
            if free in keys:
                out[keys[free]] = version
        return out

    def get(self, key: str) -> Optional[dict]:
        rows = self._select("WHERE config_hash = ?", (key,))
        return rows[0] if rows else None

    def results(self, sweep_id: Optional[int] = None) -> list[dict]:
        """Result rows, in the order their sweeps planned them (first sweep first, then grid order)."""
        if sweep_id is None:
            return self._select(
                "LEFT JOIN (SELECT config_hash AS h, MIN(sweep_id) AS s, MIN(cell) AS c FROM sweep_cells "
                "GROUP BY config_hash) ON h = config_hash ORDER BY s, c, config_hash", ())
        return self._select("JOIN sweep_cells USING (config_hash) WHERE sweep_id = ? ORDER BY cell", (sweep_id,))

    def sweeps(self) -> list[dict]:
        """Every sweep; one still ``running`` whose process is gone reads ``interrupted``."""
        with sqlite_errors(self.path, self.busy_timeout_s):
            cur = self.con.execute("SELECT * FROM sweeps ORDER BY sweep_id")
            names = [d[0] for d in cur.description]
            out = [dict(zip(names, r)) for r in cur.fetchall()]
        for row in out:
            if row["status"] == "running" and not _alive(row.get("pid"), row.get("host")):
                row["status"] = "interrupted"
        return out

    def sweep_keys(self, sweep_id: int) -> list[str]:
        with sqlite_errors(self.path, self.busy_timeout_s):
            return [r[0] for r in self.con.execute(
                "SELECT config_hash FROM sweep_cells WHERE sweep_id = ? ORDER BY cell", (sweep_id,))]

    def _select(self, tail: str, params: tuple) -> list[dict]:
        cols = ", ".join(f"results.{c}" for c in RESULT_COLUMNS)
        with sqlite_errors(self.path, self.busy_timeout_s):
            rows = self.con.execute(f"SELECT {cols} FROM results {tail}", params).fetchall()
        return [decode_row(r) for r in rows]


def _wal(con: sqlite3.Connection, shown, busy_timeout_s: float) -> None:
    """Put the file in WAL mode (readers never block the writer) and check that it took.

    ``PRAGMA journal_mode=WAL`` answers the mode the file is in afterwards: when another
    connection holds the file at that moment SQLite may leave the old mode and say so rather
    than wait, and a file left in rollback mode lets one process's reads stall the other's
    writes. So the answer is checked and the switch retried until the busy timeout."""
    deadline = time.monotonic() + busy_timeout_s
    delay_s = 0.01
    while True:
        mode = con.execute("PRAGMA journal_mode=WAL").fetchall()[0][0]
        if str(mode).lower() == "wal":
            return
        if time.monotonic() + delay_s > deadline:
            raise G5Error(f"--db {shown}: SQLite kept the file in {mode!r} journal mode for {busy_timeout_s:g} s "
                          f"(G5 needs WAL so that concurrent sweeps do not block each other; {lock_holder(shown)}); "
                          "try again when the other writer finishes, or use a file on a local file system")
        time.sleep(delay_s)
        delay_s = min(2 * delay_s, 0.5)


def decode_row(values: Sequence) -> dict:
    return {c: (json.loads(v) if c in JSON_COLUMNS and v is not None else v) for c, v in zip(RESULT_COLUMNS, values)}


def _check_header(target: pathlib.Path, shown) -> None:
    """A file that exists and is not SQLite is refused (and left untouched)."""
    try:
        if target.is_file() and os.path.getsize(target) > 0:
            with open(target, "rb") as fh:
                head = fh.read(len(SQLITE_MAGIC))
            if head != SQLITE_MAGIC:
                raise ConfigError("--db", f"{shown} exists and is not a SQLite database; choose another file")
    except OSError as exc:
        raise ConfigError("--db", f"cannot read {shown}: {exc.strerror}") from None
