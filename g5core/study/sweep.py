"""Sweeps: a cartesian grid over any configuration keys, run by an executor, stored row by row.

The machinery knows no parallel strategy:

- :func:`parse_grid` reads ``KEY=V1,V2,...`` (values are YAML scalars, like ``--set``);
  the grid is the cartesian product, the first key outermost.
- ``parallel.<dim>: auto`` (one factor dimension at most) is derived from ``chips`` and
  the other factor dimensions of the dimension registry, so the chip count stays fixed
  while cp or tp changes (:func:`resolve_auto`).
- :func:`run_cell` is a picklable top-level function: configuration in, the database row
  out (a :class:`~g5core.session.run.RunOutput` holds the plugin manager and the DAG and does not
  cross processes). An invalid point becomes an ``error`` row with its message.
- Executors: ``local`` (in-process with one worker, else worker processes) and ``dask``
  (Dask distributed: a local cluster, or ``dask:ADDRESS`` for a running scheduler). The
  driver keeps a small window of cells in flight, checks the database right before it
  submits each one (another sweep may have finished it), and writes every result itself.
- Presets (``g5_register_sweep_presets``) are named grids with an optional check over the
  rows; ``g5 scan`` is the CP plugin's preset.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import json
import sqlite3
import sys
import time
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import attrs
import yaml
from tqdm import tqdm

from g5core.inputs.config import Deployment, all_disabled, apply_overrides, shorthand_of
from g5core.inputs.step import Step
from g5core.api.dimensions import DimensionRegistry, collect_dimensions
from g5core.api.errors import ConfigError, G5Error
from g5core.api.plugins import Hooks, make_plugin_manager
from g5core.api.records import SweepPreset
from g5core.sim.heap import freeze_long_lived
from g5core.study.resultsdb import ResultsDB, build_version, config_hash, utc_now
from g5core.api.errors import suggest
from g5core.session.run import make_plan, run

AUTO = "auto"
Grid = tuple[tuple[str, tuple], ...]


# ----------------------------------------------------------------------------------------
# Grid
# ----------------------------------------------------------------------------------------


def parse_grid(items: Iterable[str], option: str = "--grid") -> Grid:
    """``["parallel.cp=1,2,4", "seq_len=8192,16384"]`` -> ``(("parallel.cp", (1, 2, 4)), ...)``."""
    grid = []
    seen = set()
    for item in items:
        if "=" not in item:
            raise ConfigError(option, f"expected KEY=V1,V2,..., got {item!r}")
        key, text = item.split("=", 1)
        key = key.strip()
        if not key or not all(key.split(".")):
            raise ConfigError(option, f"bad key {key!r}; use e.g. parallel.cp=1,2,4")
        if key in seen:
            raise ConfigError(option, f"{key} is given twice; put all its values in one --grid {key}=V1,V2")
        seen.add(key)
        values = []
        for part in text.split(","):
            part = part.strip()
            if not part:
                raise ConfigError(option, f"{key}: empty value in {text!r}")
            try:
                values.append(yaml.safe_load(part))
            except yaml.YAMLError:
                values.append(part)
        grid.append((key, _unique(values, f"{option} {key}")))
    if not grid:
        raise ConfigError(option, "needs at least one KEY=V1,V2,... axis")
    return tuple(grid)


def _unique(values: Sequence, field: str) -> tuple:
    out = []
    for v in values:
        if v in out:
            raise ConfigError(field, f"value {v!r} is given twice")
        out.append(v)
    return tuple(out)


def grid_points(grid: Grid) -> list[dict]:
    """Every point of the grid as ``{key: value}``, the first axis outermost."""
    keys = [k for k, _ in grid]
    return [dict(zip(keys, combo)) for combo in itertools.product(*(vals for _, vals in grid))]


def point_label(point: Mapping) -> str:
    """``cp=2 seq_len=8192``: keys sorted, ``parallel.`` dropped, a mapping value spelled out."""
    parts = []
    for k, v in sorted(point.items()):
        if isinstance(v, Mapping):
            parts.extend(f"{kk}={vv}" for kk, vv in sorted(v.items()))
        else:
            parts.append(f"{k.removeprefix('parallel.')}={v}")
    return " ".join(parts)


def apply_point(base: Mapping, point: Mapping) -> dict:
    return apply_overrides(base, [f"{k}={json.dumps(v)}" for k, v in point.items()])


def resolve_auto(raw: Mapping, dims: DimensionRegistry) -> dict:
    """Replace ``parallel.<dim>: auto`` by ``chips`` over the product of the other factor dimensions."""
    par = raw.get("parallel")
    if not isinstance(par, Mapping):
        return dict(raw)
    autos = [k for k, v in par.items() if v == AUTO]
    if not autos:
        return dict(raw)
    if len(autos) > 1:
        raise ConfigError("parallel", f"only one dimension may be auto, got {', '.join(autos)}")
    name = autos[0]
    factor_names = [d.name for d in dims.factors]
    if name not in factor_names:
        raise ConfigError(f"parallel.{name}", f"auto works for a factor of the chip count ({', '.join(factor_names)})")
    chips = raw.get("chips")
    others = []
    for d in dims.factors:
        if d.name == name:
            continue
        size = par.get(d.name, d.default if d.default is not None else 1)
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ConfigError(f"parallel.{d.name}", f"must be a positive whole number, got {size!r}")
        others.append((d.name, size))
    product = 1
    for _, size in others:
        product *= size
    expr = " x ".join(n for n, _ in others) or "1"
    if isinstance(chips, bool) or not isinstance(chips, int) or chips <= 0 or chips % product:
        raise ConfigError(f"parallel.{name}", f"auto: chips={chips} is not divisible by {expr} = {product}")
    return apply_overrides(raw, [f"parallel.{name}={chips // product}"])


def resolved_config(raw: Mapping, dims: DimensionRegistry) -> dict:
    """The configuration as it will run, normalised (defaults filled) when it parses; used as the key."""
    try:
        out = Deployment.from_dict(raw, dims).to_dict()
    except G5Error:
        return json.loads(json.dumps(raw, default=str))
    out.pop("name", None)  # a label: two configurations differing only by name are the same run
    return out


# ----------------------------------------------------------------------------------------
# One cell
# ----------------------------------------------------------------------------------------


def output_columns(out) -> dict[str, Any]:
    """The result columns of a database row from one :class:`~g5core.session.run.RunOutput`."""
    data = out.to_json_dict()
    mem = out.memory
    worst = mem.worst()
    return {
        "status": "ok", "error": None, "latency_s": out.latency_s, "ttft_s": data.get("ttft_s"),
        "tpot_s": data.get("tpot_s"), "tokens_per_s_per_chip": out.tokens_per_s_per_chip,
        "max_total_bytes": mem.max_total_bytes, "capacity_bytes": worst.capacity_bytes, "fits": int(mem.fits),
        "weights_bytes": worst.weights_bytes, "kv_cache_bytes": worst.kv_cache_bytes,
        "activation_bytes": worst.activation_bytes, "workspace_bytes": worst.workspace_bytes,
        "comm_bytes": data.get("comm_bytes"), "overlap": data.get("overlap"), "conservation": data.get("conservation"),
        "memory": data["memory"], "ops": data.get("ops"), "flows": data.get("flows"), "events": data.get("events"),
    }


def run_cell(raw: Mapping, disabled: Sequence[str] = (), runner: Optional[Callable] = None,
             extra_plugins: Sequence = ()) -> dict:
    """Run one configuration and return its result columns (picklable in and out).

    A G5 error (invalid layout, refused configuration) is a row with ``status = 'error'``
    and the message; any other exception is a bug and propagates.
    """
    t0 = time.perf_counter()
    try:
        if runner is not None:
            out = runner(raw, disabled=disabled)
        else:
            out = run(raw, disabled=disabled, extra_plugins=extra_plugins)
        row = output_columns(out)
    except G5Error as exc:
        row = {"status": "error", "error": str(exc)}
    row.update(g5_version=build_version(), wall_s=time.perf_counter() - t0, finished_at=utc_now())
    return row


def _input_columns(resolved: Mapping) -> dict[str, Any]:
    def pick(key, kind):
        v = resolved.get(key)
        return v if isinstance(v, kind) and not isinstance(v, bool) else None

    par = resolved.get("parallel")
    out = {"model": pick("model", str), "system": pick("system", str), "phase": pick("phase", str),
           "chips": pick("chips", int), "batch": pick("batch", int), "seq_len": pick("seq_len", int),
           "parallel": dict(par) if isinstance(par, Mapping) else None}
    if "step" in resolved:  # a step list: its phase, sequences and longest context
        try:
            out["phase"], out["batch"], out["seq_len"] = shorthand_of(Step.from_list(resolved["step"]))
        except ConfigError:
            pass  # the cell's run reports the error
    return out


# ----------------------------------------------------------------------------------------
# Executors
# ----------------------------------------------------------------------------------------


class LocalExecutor:
    """In-process with one worker (cells run in the driver, in order); worker processes otherwise."""

    def __init__(self, workers: int = 1):
        self.workers = workers
        self.pool: Optional[concurrent.futures.ProcessPoolExecutor] = None

    def __enter__(self):
        if self.workers > 1:
            # the workers are G5's own processes: their caches frozen after each full collection
            self.pool = concurrent.futures.ProcessPoolExecutor(max_workers=self.workers, initializer=freeze_long_lived)
        return self

    def __exit__(self, *exc):
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, fn, *args, **kwargs):
        if self.pool is not None:
            return self.pool.submit(fn, *args, **kwargs)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(fn(*args, **kwargs))  # an exception (a bug) propagates at once
        return fut

    @staticmethod
    def wait(futures):
        return concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED)[0]


class DaskExecutor:
    """Dask distributed: a local cluster of ``workers`` processes, or a running scheduler's workers."""

    def __init__(self, workers: int = 1, address: Optional[str] = None):
        self.workers = workers
        self.address = address
        self.client = None
        self.cluster = None

    def __enter__(self):
        try:
            import distributed  # optional (the distributed extra, --executor dask)
        except ImportError:
            raise ConfigError("--executor", "dask needs the distributed extra: pip install 'g5[distributed]'") from None
        if self.address:
            try:
                self.client = distributed.Client(self.address, timeout="10s")
            except (OSError, TimeoutError) as exc:
                raise ConfigError("--executor", f"cannot reach the Dask scheduler at {self.address}: {exc}") from None
        else:
            self.cluster = distributed.LocalCluster(n_workers=self.workers, threads_per_worker=1, processes=True,
                                                    dashboard_address=":0")
            self.client = distributed.Client(self.cluster)
        return self

    def __exit__(self, *exc):
        if self.client is not None:
            self.client.close()
        if self.cluster is not None:
            self.cluster.close()

    def submit(self, fn, *args, **kwargs):
        return self.client.submit(fn, *args, pure=False, **kwargs)

    @staticmethod
    def wait(futures):
        import distributed  # optional (the distributed extra, --executor dask)

        return distributed.wait(futures, return_when="FIRST_COMPLETED").done


def make_executor(spec: str, workers: int):
    """``local``, ``dask`` (a local Dask cluster) or ``dask:ADDRESS`` (a running scheduler)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError("--workers", f"must be a positive whole number, got {workers!r}")
    name, _, address = spec.partition(":")
    if name == "local" and not address:
        return LocalExecutor(workers)
    if name == "dask":
        return DaskExecutor(workers, address or None)
    raise ConfigError("--executor", f"unknown executor {spec!r}; use local, dask or dask:tcp://HOST:PORT")


# ----------------------------------------------------------------------------------------
# Progress
# ----------------------------------------------------------------------------------------


class LineProgress:
    """One plain line per cell (for logs and pipes)."""

    def __init__(self, emit: Callable[[str], None]):
        self.emit = emit

    def start(self, total: int) -> None:
        self.total = total

    def cell(self, n: int, label: str, row: Optional[Mapping]) -> None:
        if row is None:
            self.emit(f"[{n}/{self.total}] {label}: already in the database")
        elif row["status"] == "ok":
            self.emit(f"[{n}/{self.total}] {label}: latency {row['latency_s']:.6g} s, "
                      f"max memory {row['max_total_bytes'] / 2 ** 30:.2f} GiB{'' if row['fits'] else ' (does not fit)'}")
        else:
            self.emit(f"[{n}/{self.total}] {label}: skipped: {row['error']}")

    def close(self) -> None:
        pass


class BarProgress:
    """A terminal progress bar: done/total, failures, rate and ETA (tqdm)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.failed = 0

    def start(self, total: int) -> None:
        self.bar = tqdm(total=total, unit="cell", file=self.stream, dynamic_ncols=True, desc="sweep")

    def cell(self, n: int, label: str, row: Optional[Mapping]) -> None:
        if row is not None and row["status"] != "ok":
            self.failed += 1
            self.bar.set_postfix(failed=self.failed, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def default_progress(stream=None):
    """A bar on a terminal, plain lines otherwise (both on stderr)."""
    stream = stream or sys.stderr
    if stream.isatty():
        return BarProgress(stream)
    return LineProgress(lambda line: print(line, file=stream, flush=True))


# ----------------------------------------------------------------------------------------
# Presets
# ----------------------------------------------------------------------------------------


def collect_presets(hooks: Hooks) -> dict[str, SweepPreset]:
    """Every preset the enabled plugins register; a name registered twice is an error."""
    return hooks.collect_named("g5_register_sweep_presets", SweepPreset, "sweep preset")


# ----------------------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SweepReport:
    sweep_id: int
    db_path: str
    rows: tuple[dict, ...]       # grid order; each results row plus its ``point``
    computed: int                # cells this run simulated
    reused: int                  # cells already in the database
    #: of the computed cells, those the database held from another G5 build: {key: its g5_version}
    other_builds: dict = attrs.field(factory=dict)

    @property
    def ok_rows(self) -> tuple[dict, ...]:
        return tuple(r for r in self.rows if r["status"] == "ok")

    @property
    def failed_rows(self) -> tuple[dict, ...]:
        return tuple(r for r in self.rows if r["status"] != "ok")

    def summary(self) -> str:
        text = (f"sweep {self.sweep_id}: {len(self.ok_rows)} of {len(self.rows)} cells ran "
                f"({len(self.failed_rows)} invalid, {self.reused} already in the database); results in {self.db_path}")
        if self.other_builds:
            versions = ", ".join(sorted(set(self.other_builds.values())))
            text += (f"\n{len(self.other_builds)} cells computed anew: the database holds them from another G5 build "
                     f"({versions}; this is {build_version()}); their rows are kept beside the new ones")
        return text


@attrs.frozen(kw_only=True)
class _Cell:
    n: int
    point: dict
    raw: Optional[dict]            # None when the point could not be resolved
    key: str
    resolved: dict
    disabled: tuple[str, ...]
    error: str = ""


class _Dims:
    """Dimension registries per set of disabled plugins (a grid may vary ``plugins.disable``)."""

    def __init__(self, extra_plugins: Sequence):
        self.extra_plugins = extra_plugins
        self.cache: dict[tuple, DimensionRegistry] = {}

    def __call__(self, disabled: tuple[str, ...]) -> DimensionRegistry:
        if disabled not in self.cache:
            pm = make_plugin_manager(disabled=disabled, extra_plugins=self.extra_plugins)
            self.cache[disabled] = collect_dimensions(Hooks(pm))
        return self.cache[disabled]


def _plan_cell(n: int, base: Mapping, point: Mapping, disabled: Sequence[str], dims: _Dims) -> _Cell:
    raw = apply_point(base, point)
    try:
        names = all_disabled(raw, disabled)
        registry = dims(names)
        raw = resolve_auto(raw, registry)
        resolved = resolved_config(raw, registry)
    except G5Error as exc:
        resolved = json.loads(json.dumps(raw, default=str))
        return _Cell(n=n, point=dict(point), raw=None, key=config_hash(resolved, disabled), resolved=resolved, disabled=tuple(disabled), error=str(exc))
    return _Cell(n=n, point=dict(point), raw=raw, key=config_hash(resolved, disabled), resolved=resolved, disabled=tuple(disabled))


def check_base(base: Mapping, disabled: Sequence[str] = (), extra_plugins: Sequence = ()) -> None:
    """The base configuration must be valid by itself (after ``auto``): an error before any file is written."""
    names = all_disabled(base, disabled)
    raw = resolve_auto(base, _Dims(extra_plugins)(names))
    make_plan(raw, disabled, extra_plugins, source="base configuration")


def run_sweep(base: Mapping, grid: Grid, db_path, *, disabled: Sequence[str] = (), executor: str = "local",
              workers: int = 1, kind: str = "sweep", options: Optional[Mapping] = None, progress=None,
              runner: Optional[Callable] = None, extra_plugins: Sequence = (), inputs: Sequence = (),
              busy_timeout_s: Optional[float] = None) -> SweepReport:
    """Run every grid point not yet in ``db_path``; write each row as it finishes.

    Checks happen before anything is written: the grid, the executor, the base
    configuration (valid by itself) and the database path. ``progress`` is a callable
    taking one line, a progress object (:func:`default_progress`), or ``None``.
    ``runner`` (in-process executor only) replaces :func:`g5core.session.run.run` for tests.
    """
    if not grid:
        raise ConfigError("--grid", "needs at least one KEY=V1,V2,... axis")
    exe = make_executor(executor, workers)
    if runner is not None and not (isinstance(exe, LocalExecutor) and workers == 1):
        raise ConfigError("runner", "a custom runner needs the in-process executor (local, one worker)")
    check_base(base, disabled, extra_plugins)
    dims = _Dims(extra_plugins)
    cells = [_plan_cell(n, base, p, disabled, dims) for n, p in enumerate(grid_points(grid), start=1)]
    if progress is None:
        reporter = None
    elif callable(progress) and not hasattr(progress, "cell"):
        reporter = LineProgress(progress)
    else:
        reporter = progress
    open_kwargs = {} if busy_timeout_s is None else {"busy_timeout_s": busy_timeout_s}
    db = ResultsDB.open(db_path, inputs=inputs, **open_kwargs)
    try:
        # cells the file holds from another build (and not from this one): computed anew
        stale = {key: version for key, version in db.other_builds(
            {config_hash(c.resolved, c.disabled, build=False): c.key for c in cells}).items() if not db.has(key)}
        sweep_id = db.start_sweep(kind, base, [[k, list(v)] for k, v in grid], dict(options or {}),
                                  [(c.point, c.key) for c in cells], build_version())
        try:
            computed, reused = _drive(db, exe, cells, disabled, runner, extra_plugins, reporter, workers)
        except BaseException:   # an error, Ctrl-C: the sweep's row says it stopped (if the file lets us)
            with contextlib.suppress(G5Error, sqlite3.Error):
                db.finish_sweep(sweep_id, "interrupted")
            raise
        db.finish_sweep(sweep_id)
        rows = db.results(sweep_id)
    finally:
        db.close()
    out = tuple({**row, "point": cell.point} for cell, row in zip(cells, rows) if row["config_hash"] == cell.key)
    if len(out) != len(cells):
        raise G5Error(f"--db {db_path}: the sweep's rows do not match its plan; the file was changed meanwhile")
    return SweepReport(sweep_id=sweep_id, db_path=str(db_path), rows=out, computed=computed, reused=reused,
                       other_builds=stale)


#: what an item source of :func:`run_windowed` yields for "nothing to run yet": it is asked
#: again once a running item has finished
WAIT = object()


def run_windowed(exe, items: Iterable, workers: int, start: Callable, done: Callable) -> None:
    """Run ``items`` on ``exe``: ``start(exe, item)`` submits one (a future, or ``None`` when
    there is nothing to run), a window of two per worker in flight (one in process, so each
    result is stored before the next item starts); ``done(item, result)`` for each finished
    one, in submission order among those that finish together. ``items`` may yield
    :data:`WAIT` while an item it has given runs (an item made from another's result)."""
    window = 1 if isinstance(exe, LocalExecutor) and workers == 1 else 2 * workers
    pending: dict = {}
    order = 0
    todo = iter(items)
    with exe:
        exhausted = False
        while True:
            while not exhausted and len(pending) < window:
                item = next(todo, _END)
                if item is _END:
                    exhausted = True
                    break
                if item is WAIT:
                    if not pending:
                        raise G5Error("an item source waits for a result while nothing runs (a G5 bug)")
                    break
                fut = start(exe, item)
                if fut is not None:
                    pending[fut] = (order, item)
                    order += 1
            if not pending:
                break
            for fut in sorted(exe.wait(list(pending)), key=lambda f: pending[f][0]):
                _, item = pending.pop(fut)
                done(item, fut.result())


_END = object()


def _drive(db: ResultsDB, exe, cells: Sequence[_Cell], disabled, runner, extra_plugins, reporter,
           workers: int) -> tuple[int, int]:
    """Submit cells (a window of ``2 x workers`` in flight), store each result, report progress."""
    if reporter is not None:
        reporter.start(len(cells))
    computed = reused = done_count = 0
    seen: set[str] = set()

    def finish(cell: _Cell, row: Optional[dict]) -> None:
        nonlocal done_count
        done_count += 1
        if reporter is not None:
            reporter.cell(done_count, point_label(cell.point), row)

    def store(cell: _Cell, result: dict) -> dict:
        row = {"config_hash": cell.key, "config": cell.resolved, "disabled": sorted(cell.disabled),
               **_input_columns(cell.resolved), **result}
        db.insert(row)
        return row

    kwargs = {"runner": runner} if runner is not None else {}
    if extra_plugins:
        kwargs["extra_plugins"] = extra_plugins

    def start(exe, cell: _Cell):
        nonlocal reused, computed
        if cell.key in seen or db.has(cell.key):
            reused += cell.key not in seen
            seen.add(cell.key)
            finish(cell, None)
            return None
        seen.add(cell.key)
        if cell.raw is None:
            finish(cell, store(cell, {"status": "error", "error": cell.error, "g5_version": build_version(),
                                      "wall_s": 0.0, "finished_at": utc_now()}))
            computed += 1
            return None
        return exe.submit(run_cell, cell.raw, cell.disabled, **kwargs)

    def done(cell: _Cell, result) -> None:
        nonlocal computed
        finish(cell, store(cell, result))
        computed += 1

    try:
        run_windowed(exe, cells, workers, start, done)
    finally:
        if reporter is not None:
            reporter.close()
    return computed, reused


# ----------------------------------------------------------------------------------------
# Presets run as sweeps
# ----------------------------------------------------------------------------------------


@attrs.frozen
class PresetReport:
    preset: SweepPreset
    sweep: SweepReport
    violations: tuple[str, ...]   # () when the check held, or did not apply (phase), or no cell ran


def get_preset(name: str, disabled: Sequence[str] = (), extra_plugins: Sequence = ()) -> SweepPreset:
    presets = collect_presets(Hooks(make_plugin_manager(disabled=disabled, extra_plugins=extra_plugins)))
    if name not in presets:
        known = ", ".join(sorted(presets)) or "none"
        raise ConfigError("preset", f"no enabled plugin registers the sweep preset '{name}'"
                                    f"{suggest(name, presets)}; registered: {known}")
    return presets[name]


def run_preset(name: str, base: Mapping, db_path, axes: Optional[Mapping[str, Sequence]] = None,
               options: Optional[Mapping] = None, disabled: Sequence[str] = (), **kwargs) -> PresetReport:
    """Run a registered preset: its grid (``axes`` replaces the values of named axes), its fixed
    overrides, then its check over the rows."""
    names = all_disabled(base, disabled)
    preset = get_preset(name, names, kwargs.get("extra_plugins", ()))
    axes = dict(axes or {})
    unknown = set(axes) - {k for k, _ in preset.grid}
    if unknown:
        raise ConfigError("preset", f"preset '{name}' has no axis {', '.join(sorted(unknown))}")
    grid = tuple((k, tuple(axes[k]) if axes.get(k) is not None else v) for k, v in preset.grid)
    for key, values in grid:
        if not values:
            raise ConfigError(key, "needs at least one value")
    opts = {**dict(preset.options), **{k: v for k, v in (options or {}).items() if v is not None}}
    sweep = run_sweep(apply_overrides(base, preset.fixed), grid, db_path, disabled=disabled, kind=name,
                      options=opts, **kwargs)
    phase = base.get("phase", "")
    applies = preset.check is not None and (not preset.check_phases or phase in preset.check_phases)
    violations = tuple(preset.check(sweep.rows, opts)) if applies and sweep.ok_rows else ()
    return PresetReport(preset=preset, sweep=sweep, violations=violations)
