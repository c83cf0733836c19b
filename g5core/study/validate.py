"""``g5 validate`` and ``g5 calibrate``: G5 against measured end-to-end latencies.

A measurement file is a CSV with a header and these columns:

- ``config``: a configuration file, relative to the CSV's folder (its relative ``model``
  and ``system`` paths are relative to the configuration's folder, when they exist there);
- ``set``: ``--set`` style overrides, ``KEY=VALUE`` separated by spaces (may be empty);
- ``metric``: ``ttft`` (prefill) or ``tpot`` (decode): one step of the configuration; or a
  serving metric (:data:`SERVE_METRICS`: ``ttft_mean``, ``ttft_p50``, ``tpot_mean``,
  ``tpot_p50``, ``itl_mean``, ``itl_p50``): ``g5 serve`` on the configuration's ``serving``
  block and workload, the statistic over its requests;
- ``measured_ms``: the measured time in milliseconds (> 0);
- ``source``: free text, where the figure comes from (required, may not be empty);
- ``framework`` (optional): the serving framework the measurement ran (a shipped profile:
  vllm, sglang, trtllm, generic, g5core/data/frameworks), applied to the row as its
  configuration's ``framework`` key; ``validate`` then reports the error per framework too.

Other columns (``name``, notes, ...) are kept and ignored. ``validate`` prints predicted
beside measured, the error ``(predicted - measured) / measured``, the mean absolute
percentage error and the worst row, and, where rows of one configuration file, framework
and metric differ only in ``chips`` and ``parallel.tp`` (a TP series), the error at each TP
degree and its trend (:func:`tp_trends`).

``calibrate`` fits named system parameters (dotted keys of the system file, e.g.
``compute_model.hbm_fraction``, ``launch_overhead_s``) by bounded least squares on the log
error ``log(predicted / measured)`` (``scipy.optimize.least_squares``, the ``g5[measured]``
extra), prints the fit, each row's residual, the leave-one-out error of every row, and the
parameters the rows cannot identify (no row's prediction moves with them), and writes a
normal system file.
"""
from __future__ import annotations

import copy
import csv
import hashlib
import math
import os
import pathlib
import resource
import shlex
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Mapping, Sequence

import attrs
import yaml

from g5core.inputs.config import apply_overrides, load_config_file, resolve_config_paths
from g5core.inputs.framework import FRAMEWORK_NAMES, host_step_s, load_profile, own_keys
from g5core.api.errors import ConfigError, G5Error
from g5core.inputs.systems import CATALOG_NAMES, SystemSpec, get_system
from g5core.inputs.outputs import check_outputs
from g5core.serve.api import simulate_serving
from g5core.session.prepared import PreparedPlan
from g5core.session.run import make_plan, run
from g5core.study.validate_collectives import is_collectives_file, validate_collectives

COLUMNS = ("config", "set", "metric", "measured_ms", "source")
METRICS = {"ttft": "prefill", "tpot": "decode"}
#: serving metrics: a row that names one runs ``g5 serve`` on its configuration (which needs a
#: ``serving`` block with its ``workload``) and takes this statistic of the summary, the way
#: ``vllm bench serve`` and SGLang's ``bench_serving`` report them (mean or median over requests)
SERVE_METRICS = {"ttft_mean": ("ttft_s", "mean"), "ttft_p50": ("ttft_s", "p50"),
                 "tpot_mean": ("tpot_s", "mean"), "tpot_p50": ("tpot_s", "p50"),
                 "itl_mean": ("itl_s", "mean"), "itl_p50": ("itl_s", "p50")}


@attrs.frozen(kw_only=True)
class Row:
    number: int              # 1-based data row number (the header is row 0)
    config: str              # resolved path
    overrides: tuple
    metric: str
    measured_ms: float
    source: str
    label: str               # config file name plus overrides, for tables
    framework: str = ""      # the serving framework profile the row ran ("": the configuration's own)

    def where(self, csv_path) -> str:
        return f"{csv_path} row {self.number}"


def _reader(csv_path) -> tuple[pathlib.Path, csv.DictReader]:
    """The measurement file's rows (``#`` lines are comments)."""
    path = pathlib.Path(csv_path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("MEASURED.csv", f"cannot read '{path}': {exc.strerror or exc}") from None
    return path, csv.DictReader(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def read_rows(csv_path) -> list[Row]:
    """Parse and check the measurement file; a bad row is a one-line ConfigError naming it."""
    return _rows(*_reader(csv_path))


def _rows(path: pathlib.Path, reader: csv.DictReader) -> list[Row]:
    """:func:`read_rows` on a file already read (:func:`_reader`)."""
    header = reader.fieldnames or []
    if is_collectives_file(header):
        raise ConfigError(str(path), "a collectives file (its op column) has no configuration rows: g5 validate "
                                     "prices it; g5 calibrate fits system parameters to configuration rows only")
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise ConfigError(str(path), f"missing column(s) {', '.join(missing)}; the header needs {', '.join(COLUMNS)}")
    rows = []
    for number, rec in enumerate(reader, start=1):
        where = f"{path} row {number}"
        cfg = (rec.get("config") or "").strip()
        if not cfg:
            raise ConfigError(where, "config is empty; name a configuration file")
        cfg_path = (path.parent / cfg) if not os.path.isabs(cfg) else pathlib.Path(cfg)
        if not cfg_path.is_file():
            raise ConfigError(where, f"unknown config '{cfg}': no file at {cfg_path}")
        metric = (rec.get("metric") or "").strip().lower()
        if metric not in METRICS and metric not in SERVE_METRICS:
            raise ConfigError(where, f"metric must be ttft or tpot (one step), or a serving metric "
                                     f"({', '.join(SERVE_METRICS)}), got {rec.get('metric')!r}")
        raw_ms = (rec.get("measured_ms") or "").strip()
        if not raw_ms:
            raise ConfigError(where, "measured_ms is missing; give the measured time in milliseconds")
        try:
            ms = float(raw_ms)
        except ValueError:
            raise ConfigError(where, f"measured_ms must be a number of milliseconds, got {raw_ms!r}") from None
        if not math.isfinite(ms) or ms <= 0:
            raise ConfigError(where, f"measured_ms must be a time > 0 ms, got {raw_ms}")
        source = (rec.get("source") or "").strip()
        if not source:
            raise ConfigError(where, "source is empty; say where the measurement comes from")
        try:
            overrides = tuple(shlex.split(rec.get("set") or ""))
        except ValueError as exc:
            raise ConfigError(where, f"bad set column: {exc}") from None
        framework = (rec.get("framework") or "").strip()
        if framework and framework not in FRAMEWORK_NAMES:
            raise ConfigError(where, f"unknown framework {framework!r}; use one of {', '.join(FRAMEWORK_NAMES)} "
                                     "or leave it empty")
        if framework:
            overrides = (f"framework={framework}",) + overrides
        label = " ".join((cfg,) + overrides)
        rows.append(Row(number=number, config=str(cfg_path), overrides=overrides, metric=metric, measured_ms=ms,
                        source=source, label=label, framework=framework))
    if not rows:
        raise ConfigError(str(path), "no measurement rows")
    return rows


def row_config(row: Row, system_override: str | None = None) -> dict:
    """The row's configuration (overrides applied, relative paths resolved)."""
    # the row's own settings name files beside the configuration too (a CSV is not a command line)
    raw = resolve_config_paths(apply_overrides(load_config_file(row.config), row.overrides),
                               pathlib.Path(row.config).parent)
    if system_override is not None:
        raw["system"] = system_override
    return raw


#: per row (its configuration and overrides), the op-DAG templates of its prepared plan
#: (:meth:`g5core.session.prepared.PreparedPlan._from_template`): a system whose parameters
#: moved builds the same ops, edges and keys, so an evaluation of calibrate re-times the kept
#: DAG instead of building it again (cleared by :func:`calibrate` when it ends)
_TEMPLATES: dict = {}


def predict_ms(row: Row, csv_path, system_override: str | None = None) -> float:
    """The row's predicted time; through a prepared plan whose op-DAG templates are kept per
    row across systems (a configuration a prepared plan refuses, pp micro-batches, runs whole)."""
    raw = row_config(row, system_override)
    if row.metric in SERVE_METRICS:
        return _serve_ms(row, raw, csv_path)
    try:
        plan = make_plan(raw)
        phase = plan.ctx.deployment.phase
        if plan.pipeline is not None:
            out = run(raw)
            # a measured TTFT/TPOT includes the framework's host work per step (its profile's host
            # block), as a serving step pays it; PreparedPlan.simulate adds it on the other path
            latency_s = host_step_s(out.latency_s, out.deployment.step, out.plan.ctx.system)
        else:
            prepared = PreparedPlan(plan)
            key = (row.config, row.overrides)
            if key in _TEMPLATES:
                prepared._templates = _TEMPLATES[key]
            latency_s = prepared.simulate(prepared.deployment.step).latency_s
            _TEMPLATES[key] = prepared._templates
    except G5Error as exc:
        raise ConfigError(row.where(csv_path), str(exc)) from None
    if phase != METRICS[row.metric]:
        raise ConfigError(row.where(csv_path), f"metric {row.metric} needs phase {METRICS[row.metric]}, "
                                               f"but the config runs {phase}")
    return latency_s * 1e3


def _serve_ms(row: Row, raw: dict, csv_path) -> float:
    """A serving row's prediction: ``g5 serve`` on its configuration and workload (seeded: the
    same every time), the statistic :data:`SERVE_METRICS` names, in milliseconds."""
    serving = raw.get("serving")
    if not isinstance(serving, dict) or not isinstance(serving.get("workload"), dict):
        raise ConfigError(row.where(csv_path), f"metric {row.metric} runs g5 serve: the configuration needs a "
                                               "serving block with serving.workload (requests, arrival, lengths)")
    try:
        summary = simulate_serving(raw).summary
    except G5Error as exc:
        raise ConfigError(row.where(csv_path), str(exc)) from None
    key, stat = SERVE_METRICS[row.metric]
    value = (summary.get(key) or {}).get(stat)
    if value is None:
        raise ConfigError(row.where(csv_path), f"g5 serve gave no {key} {stat} (no request completed with it)")
    return value * 1e3


def _tp_of(row: Row) -> int:
    """The row's TP degree (its configuration's ``parallel.tp``, overrides applied; 1 if unset)."""
    parallel = row_config(row).get("parallel") or {}
    return int(parallel.get("tp", 1)) if isinstance(parallel, dict) else 1


def _predict_one(args) -> float:
    """A worker's prediction of one row (``--workers``); the templates stay in the worker."""
    row, csv_path, system = args
    return predict_ms(row, csv_path, system)


def error_pct(predicted_ms: float, measured_ms: float) -> float:
    return 100.0 * (predicted_ms - measured_ms) / measured_ms


def validate(csv_path, overrides: Sequence[str] = ()) -> dict:
    """Predict every row (``overrides`` are applied to every row after its own). A
    collectives file (an ``op`` column: :mod:`g5core.study.validate_collectives`) prices its
    rows with ``g5 collective``."""
    path, reader = _reader(csv_path)
    trends: list = []
    if is_collectives_file(reader.fieldnames):
        if overrides:
            raise ConfigError("--set", "a collectives file's rows name their system and group; --set applies to "
                                       "configuration rows only")
        out = validate_collectives(path, reader)
    else:
        out = []
        rows_read = [attrs.evolve(r, overrides=r.overrides + tuple(overrides)) for r in _rows(path, reader)]
        for row in rows_read:
            pred = predict_ms(row, csv_path)
            out.append({"row": row.number, "config": row.label, "metric": row.metric,
                        "measured_ms": row.measured_ms, "predicted_ms": pred,
                        "error_pct": error_pct(pred, row.measured_ms), "source": row.source,
                        "tp": _tp_of(row), **({"framework": row.framework} if row.framework else {})})
        trends = tp_trends(rows_read, out)
    report = {"rows": out, **_agreement(out)}
    if any(r.get("framework") for r in out):   # the error of each framework's rows (metric by metric)
        groups: dict = {}
        for r in out:
            groups.setdefault((r.get("framework") or "-", r["metric"]), []).append(r)
        report["by_framework"] = [{"framework": fw, "metric": metric, "rows": len(rs), **_agreement(rs)}
                                  for (fw, metric), rs in sorted(groups.items())]
    if trends:   # the error against the TP degree, where rows form a TP series
        report["tp_trends"] = trends
    return report


#: the overrides that set a row's TP degree (and the chips it needs): rows that differ only in
#: these form a TP series
TP_KEYS = ("chips=", "parallel.tp=")


def tp_trends(rows: Sequence[Row], out: Sequence[dict]) -> list[dict]:
    """The error against the TP degree: rows of one configuration file, framework and metric
    whose overrides differ only in ``chips`` and ``parallel.tp`` form a series; each series of
    at least two TP degrees reports the error at each and ``trend_pts``, the error at the
    highest degree less the error at the lowest (percentage points)."""
    series: dict = {}
    for row, r in zip(rows, out):
        tp = r["tp"]
        rest = tuple(o for o in row.overrides if not o.startswith(TP_KEYS))
        series.setdefault((row.framework, row.metric, row.config, rest), {}).setdefault(tp, []).append(r)
    trends = []
    for (framework, metric, config, rest), by_tp in series.items():
        if len(by_tp) < 2:
            continue
        errors = [(tp, math.fsum(r["error_pct"] for r in rs) / len(rs)) for tp, rs in sorted(by_tp.items())]
        label = " ".join((pathlib.Path(config).name,) + tuple(o for o in rest if not o.startswith("framework=")))
        trends.append({"framework": framework or "-", "metric": metric, "config": label,
                       "rows": sorted(r["row"] for rs in by_tp.values() for r in rs),
                       "errors_by_tp": [[tp, e] for tp, e in errors], "trend_pts": errors[-1][1] - errors[0][1]})
    return trends


def _agreement(rows: Sequence[dict]) -> dict:
    mape = math.fsum(abs(r["error_pct"]) for r in rows) / len(rows)
    worst = max(rows, key=lambda r: (abs(r["error_pct"]), -r["row"]))
    return {"mape_pct": mape, "worst_row": worst["row"], "worst_error_pct": worst["error_pct"]}


# ----------------------------------------------------------------------------------------
# calibrate
# ----------------------------------------------------------------------------------------

# A parameter is not identifiable from the rows when no row's log prediction moves by more
# than this when the parameter moves by 1% of itself; it is left out of the fit and reported.
UNIDENTIFIABLE_SENSITIVITY = 1e-6


def _child(node, part: str):
    """The key of ``node`` that a dotted key's ``part`` names: itself, or the whole number it
    spells (a per-world-size table, ``one_shot_latency_s.8``); None where ``node`` has neither."""
    if not isinstance(node, dict):
        return None
    if part in node:
        return part
    return int(part) if part.isdigit() and int(part) in node else None


def _get(data: dict, key: str):
    node = data
    for part in key.split("."):
        child = _child(node, part)
        if child is None:
            raise ConfigError("--fit", f"system has no parameter {key!r} (no '{part}'); give dotted keys of the "
                                       "system file, e.g. compute_model.hbm_fraction or launch_overhead_s")
        node = node[child]
    if isinstance(node, bool) or not isinstance(node, (int, float)):
        raise ConfigError("--fit", f"{key} is {node!r}, not a number; only numeric parameters can be fitted")
    return float(node)


def _set(data: dict, key: str, value: float) -> None:
    """Set a dotted key; an integer field (tile sizes, SM count) gets the nearest integer."""
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        node = node[_child(node, part)]
    last = _child(node, parts[-1])
    old = node[last]
    node[last] = int(round(value)) if isinstance(old, int) and not isinstance(old, bool) else float(value)


def bounds_of(key: str, value: float) -> tuple[float, float]:
    """Fractions (efficiency.*, *_fraction*) in (0, 1]; seconds in [0, 100 x]; any other
    positive figure within a factor 100 of its starting value."""
    last = key.split(".")
    if last[0] == "efficiency" or any("fraction" in p for p in last):
        return 1e-3, 1.0
    if key.endswith("_s") or "floor_s" in key:
        return 0.0, max(value, 1e-9) * 100.0
    return value / 100.0, value * 100.0


def _system_key(system) -> str:
    """What names one system: a catalogue name as written, a file by its resolved path (two
    relative paths from different folders can name the same file)."""
    text = str(system)
    if text in CATALOG_NAMES:
        return text
    path = pathlib.Path(text).expanduser()
    return os.path.realpath(path) if path.exists() else text


def _system_of(rows: Sequence[Row], csv_path) -> str:
    systems: dict[str, tuple[str, int]] = {}
    for row in rows:
        system = str(row_config(row)["system"])
        systems.setdefault(_system_key(system), (system, row.number))
    if len(systems) > 1:
        listed = ", ".join(f"{s} (row {n})" for s, n in systems.values())
        raise ConfigError(str(csv_path), f"rows use several systems ({listed}); calibrate one system at a time")
    return next(iter(systems.values()))[0]


def _profile_blocks(start: dict, keys: Sequence[str], rows: Sequence[Row]) -> tuple[dict, str]:
    """``(system, note)``: ``start`` (a system's mapping) with each framework block that a
    ``framework.*`` key of ``keys`` fits and the system file does not set, taken whole from
    the profile the rows run (their ``framework`` column or configuration: one for every
    row). A system file's framework keys override the profile's, each top-level key whole
    (``host``, ``all_reduce``: :func:`g5core.inputs.framework.with_framework`), so the fitted
    file carries the block the rows ran with the fitted value in it, and at the starting
    values every row is priced as before; ``note`` says which blocks came from which profile
    ("" where none did)."""
    blocks = sorted({k.split(".")[1] for k in keys if k.startswith("framework.")})
    own = start.get("framework") or {}
    if not own.get("name"):   # the keys that override a profile's (as with_framework reads them)
        own = own_keys(own)
    missing = [b for b in blocks if b not in own]
    if not missing:
        return start, ""
    key = next(k for k in keys if k.startswith(f"framework.{missing[0]}"))
    names: dict = {}
    for row in rows:
        fw = row_config(row).get("framework")
        name = fw.get("name") if isinstance(fw, Mapping) else fw
        names.setdefault(name or "none", row.number)
    if len(names) != 1 or next(iter(names)) in ("none", "generic"):
        listed = ", ".join(f"{n} (row {r})" for n, r in names.items())
        raise ConfigError("--fit", f"{key}: the system file sets no framework.{missing[0]}, so its value is the "
                                   f"rows' framework profile's, and the rows run under {listed}; give every row one "
                                   f"profile ({', '.join(n for n in FRAMEWORK_NAMES if n != 'generic')}: the "
                                   f"framework column) or set framework.{missing[0]} in the system file")
    name = next(iter(names))
    profile = load_profile(name)["framework"]
    absent = [b for b in missing if b not in profile]
    if absent:
        raise ConfigError("--fit", f"framework.{absent[0]}: neither the system file nor the {name} profile sets it "
                                   f"(the profile sets {', '.join(sorted(profile))})")
    out = copy.deepcopy(start)
    out["framework"] = {**(out.get("framework") or {}), **{b: copy.deepcopy(profile[b]) for b in missing}}
    return out, f"framework {', '.join(missing)} from the {name} profile (the rows' framework), fitted values in it"


#: how far (percentage points) the fit's leave-one-out error may exceed the prior's error
#: before calibrate refuses to write the file: the rounding of the fit's own tolerances
LOO_TOLERANCE_PCT = 0.01
#: a fitted parameter that moves more than this factor from its prior is suspect
SUSPECT_FACTOR = 3.0
#: ... or that ends within this fraction of its range from a bound
AT_BOUND_REL = 1e-6


#: least_squares' tolerances (relative): a fit stops when a step moves the parameters or
#: the cost by less than this; a parameter known to a millionth of itself is known well
#: enough (the Jacobian's finite differences are 1e-3 of it apart)
FIT_TOLERANCE = 1e-6
#: the default bound on evaluations (each runs every row once) of one calibrate
DEFAULT_MAX_EVALS = 500
#: iterations a fit typically takes (for the estimate printed before starting)
TYPICAL_ITERATIONS = 6


class EvalBudget(G5Error):
    """--max-evals reached."""


def calibrate(csv_path, keys: Sequence[str], output, say: Callable[[str], None] = lambda line: None,
              leave_one_out: bool = True, force: bool = False,
              show: Callable[[dict], None] = lambda report: None, max_evals: int = DEFAULT_MAX_EVALS,
              workers: int = 1) -> dict:
    """Fit ``keys`` of the rows' system; write the fitted system file to ``output``.

    Every evaluation runs every row once (``workers`` processes share the rows; each row's
    op-DAG is kept across evaluations, :data:`_TEMPLATES`); ``say`` gets the estimate before
    the first and a line per evaluation; more than ``max_evals`` evaluations stop the fit with
    a one-line error (nothing written). The leave-one-out refits start from the full fit.

    ``output`` is checked before the fit as every output is (:mod:`g5core.inputs.outputs`;
    an existing file is refused: calibrate never overwrites) and written atomically after
    ``show(report)`` had the report, so a failed write loses nothing but the file. The
    file is refused when the fit's leave-one-out error is worse than the prior's error,
    unless ``force``."""
    try:
        from scipy.optimize import least_squares  # optional (the measured extra)
    except ImportError:
        raise ConfigError("calibrate", "needs scipy: python3 -m pip install -e '.[measured]'") from None

    if isinstance(max_evals, bool) or not isinstance(max_evals, int) or max_evals < 1:
        raise ConfigError("--max-evals", f"must be a positive whole number, got {max_evals!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError("--workers", f"must be a positive whole number, got {workers!r}")
    keys = [k.strip() for k in keys if k.strip()]
    if not keys:
        raise ConfigError("--fit", "name at least one parameter, e.g. --fit compute_model.hbm_fraction")
    if len(set(keys)) != len(keys):
        raise ConfigError("--fit", "a parameter is named twice")
    rows = read_rows(csv_path)
    serving = next((r for r in rows if r.metric in SERVE_METRICS), None)
    if serving is not None:
        raise ConfigError(serving.where(csv_path), f"a serving row ({serving.metric}): calibrate fits one-step "
                                                   "rows (ttft, tpot) only")
    system_ref = _system_of(rows, csv_path)
    start, taken = _profile_blocks(get_system(system_ref).to_dict(), keys, rows)
    inputs = [("measured file", csv_path)] + [("config", r.config) for r in rows]
    if system_ref not in CATALOG_NAMES:
        inputs.append(("system file", system_ref))
    targets = check_outputs({"-o": output}, inputs=inputs)
    real = targets.targets[0].real
    if os.path.exists(real):
        raise ConfigError("-o", f"'{output}' exists; choose another output file or remove it")
    x0 = [_get(start, k) for k in keys]
    lo, hi = zip(*(bounds_of(k, v) for k, v in zip(keys, x0)))
    x0 = [min(max(v, l), h) for v, l, h in zip(x0, lo, hi)]
    scale = [max(abs(v), 1e-12) for v in x0]
    workdir = tempfile.mkdtemp(prefix="g5-calibrate-")
    cache: dict = {}

    def system_file(x) -> str:
        data = yaml.safe_load(yaml.safe_dump(start))
        for k, v in zip(keys, x):
            _set(data, k, v)
        try:
            SystemSpec.from_dict(data)
        except ConfigError as exc:
            raise ConfigError("--fit", f"the fitted values make an invalid system: {exc}") from None
        p = pathlib.Path(workdir) / f"s{len(cache)}.yaml"
        p.write_text(yaml.safe_dump(data), encoding="utf-8")
        return str(p)

    def cpu_s() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    pool = None
    if workers > 1:
        pool = ProcessPoolExecutor(max_workers=min(workers, len(rows)))
    phase = ["sensitivity"]
    t_start, cpu_start = time.perf_counter(), cpu_s()

    def predictions(x) -> list[float]:
        key = tuple(float(v) for v in x)
        if key not in cache:
            if len(cache) >= max_evals:
                raise EvalBudget(f"--max-evals: {max_evals} evaluations of the {len(rows)} rows reached during "
                                 f"the {phase[0]}; raise --max-evals or fit fewer parameters; nothing was written")
            path = system_file(x)
            if pool is not None:
                cache[key] = list(pool.map(_predict_one, [(r, csv_path, path) for r in rows]))
            else:
                cache[key] = [predict_ms(r, csv_path, path) for r in rows]
            n = len(cache)
            rms_now = math.sqrt(math.fsum(math.log(p / r.measured_ms) ** 2 for p, r in zip(cache[key], rows))
                                / len(rows))
            say(f"calibrate: evaluation {n} ({phase[0]}): "
                + ", ".join(f"{k}={v:.6g}" for k, v in zip(keys, x))
                + f"; rms log error of every row {rms_now:.4f}; {time.perf_counter() - t_start:.0f} s, "
                  f"{cpu_s() - cpu_start:.0f} s CPU so far" + (" (this process; the workers' when they end)"
                                                              if pool is not None else ""))
        return cache[key]

    def residuals(x, use) -> list[float]:  # log error of the rows in use
        pred = predictions(x)
        return [math.log(pred[i] / rows[i].measured_ms) for i in use]

    def with_free(free_x, free):
        x = list(x0)
        for j, v in zip(free, free_x):
            x[j] = v
        return x

    def fit(use, free, start=None):
        first = start if start is not None else x0
        res = least_squares(lambda fx: residuals(with_free(fx, free), use), [first[j] for j in free],
                            bounds=([lo[j] for j in free], [hi[j] for j in free]), x_scale=[scale[j] for j in free],
                            diff_step=1e-3, xtol=FIT_TOLERANCE, ftol=FIT_TOLERANCE, gtol=FIT_TOLERANCE,
                            max_nfev=max_evals)
        return with_free(res.x, free)

    sensitivity: dict[int, list[float]] = {}   # per parameter: d log(prediction) / d x, per row

    def moves(j) -> bool:
        """Does any row's prediction change when parameter j moves by 1% of itself?"""
        x = list(x0)
        x[j] = x0[j] * 0.99 if x0[j] * 0.99 >= lo[j] else x0[j] * 1.01
        if x[j] == x0[j]:
            x[j] = (lo[j] + hi[j]) / 2
        base, moved = predictions(x0), predictions(x)
        sensitivity[j] = [math.log(m / b) / (x[j] - x0[j]) for m, b in zip(moved, base)]
        return any(abs(math.log(m / b)) > UNIDENTIFIABLE_SENSITIVITY for m, b in zip(moved, base))

    refits = len(rows) if leave_one_out and len(rows) > 1 else 0
    per_fit = TYPICAL_ITERATIONS * (1 + len(keys))
    say(f"calibrate: {len(rows)} rows, {len(keys)} parameter{'s' if len(keys) > 1 else ''}; every evaluation runs "
        f"every row once{f' on {workers} workers' if workers > 1 else ''}: {1 + len(keys)} to test which parameters "
        f"move the rows, then the fit and {refits} leave-one-out refit{'s' if refits != 1 else ''} (started from the "
        f"fit), about {per_fit} evaluations each ({TYPICAL_ITERATIONS} iterations x {1 + len(keys)}); about "
        f"{1 + len(keys) + per_fit * (1 + refits // 2)} in all, at most {max_evals} (--max-evals)")
    try:
        everything = list(range(len(rows)))
        free = [j for j in range(len(keys)) if moves(j)]
        unidentifiable = [keys[j] for j in range(len(keys)) if j not in free]
        phase[0] = "fit"
        x_fit = fit(everything, free) if free else list(x0)
        pred = predictions(x_fit)
        loo = []
        if refits:
            for i in everything:
                phase[0] = f"leave-one-out refit without row {rows[i].number}"
                x_i = fit([j for j in everything if j != i], free, x_fit) if free else list(x0)
                loo.append(error_pct(predictions(x_i)[i], rows[i].measured_ms))
    finally:
        for f in pathlib.Path(workdir).glob("*.yaml"):
            f.unlink()
        os.rmdir(workdir)
        _TEMPLATES.clear()
        if pool is not None:
            pool.shutdown()
    say(f"calibrate: {len(cache)} evaluations, {time.perf_counter() - t_start:.0f} s, {cpu_s() - cpu_start:.0f} s CPU")
    fitted = {k: float(v) for k, v in zip(keys, x_fit)}
    prior_pred = predictions(x0)
    out_rows = [{"row": r.number, "config": r.label, "measured_ms": r.measured_ms, "predicted_ms": p,
                 "error_pct": error_pct(p, r.measured_ms), "log_residual": math.log(p / r.measured_ms),
                 "prior_error_pct": error_pct(q, r.measured_ms),
                 **({"loo_error_pct": loo[i]} if loo else {})}
                for i, (r, p, q) in enumerate(zip(rows, pred, prior_pred))]
    rms = math.sqrt(math.fsum(r["log_residual"] ** 2 for r in out_rows) / len(out_rows))
    mape = math.fsum(abs(r["error_pct"]) for r in out_rows) / len(out_rows)
    prior_mape = math.fsum(abs(r["prior_error_pct"]) for r in out_rows) / len(out_rows)
    loo_mape = (math.fsum(abs(e) for e in loo) / len(loo)) if loo else None
    suspect = _suspects(keys, x0, x_fit, lo, hi, rows, prior_pred, sensitivity)
    data = yaml.safe_load(yaml.safe_dump(start))
    for k, v in fitted.items():
        _set(data, k, v)
    data["name"] = f"{start['name']}-calibrated"
    digest = hashlib.sha256(pathlib.Path(csv_path).read_bytes()).hexdigest()[:16]
    header = (f"# Calibrated by `g5 calibrate` from system '{start['name']}' on {len(rows)} measured rows of\n"
              f"# {pathlib.Path(csv_path).name} (sha256 {digest}...): bounded least squares on log error.\n"
              + "".join(f"#   {k}: {x:.6g} -> {fitted[k]:.6g}\n" for k, x in zip(keys, x0))
              + (f"# {taken}\n" if taken else "")
              + f"# rms log error {rms:.4f}; MAPE {mape:.2f}% in sample (prior {prior_mape:.2f}%)"
              + (f"; leave-one-out MAPE {loo_mape:.2f}%" if loo else "")
              + (f"; NOT identifiable from these rows (left at start): {', '.join(unidentifiable)}"
                 if unidentifiable else "") + "\n"
              + "".join(f"# SUSPECT: {describe_suspect(x)}\n" for x in suspect))
    report = {"system": start["name"], "fitted": fitted, "start": dict(zip(keys, x0)), "rows": out_rows,
              "rms_log_error": rms, "unidentifiable": unidentifiable, "mape_pct": mape, "prior_mape_pct": prior_mape,
              "loo_mape_pct": loo_mape, "suspect": suspect, "output": str(output), "written": False}
    refuse = None
    if loo_mape is not None and loo_mape > prior_mape + LOO_TOLERANCE_PCT and not force:
        refuse = (f"the fit's leave-one-out MAPE {loo_mape:.2f}% is worse than the prior's {prior_mape:.2f}%: it "
                  f"would predict unseen rows worse than the file it started from; not written "
                  f"(--force writes it anyway)")
    report["refused"] = refuse
    report["written"] = refuse is None
    show(report)
    if refuse is not None:
        raise ConfigError("-o", refuse)

    def dump(fh):
        fh.write(header)
        yaml.safe_dump(data, fh, sort_keys=False, default_flow_style=None)
    if os.path.exists(real):  # appeared while fitting: still never clobbered
        raise ConfigError("-o", f"'{output}' exists; choose another output file or remove it")
    targets.write({"-o": dump})
    return report


def _suspects(keys, x0, x_fit, lo, hi, rows, prior_pred, sensitivity) -> list[dict]:
    """The fitted parameters to distrust: at a bound, or moved more than SUSPECT_FACTOR from
    the prior; with the rows that pulled them there (those whose prior error the move
    reduces, largest pull first: -residual x sensitivity x direction)."""
    out = []
    for j, key in enumerate(keys):
        a, b = x0[j], x_fit[j]
        span = hi[j] - lo[j]
        at = ("lower" if b - lo[j] <= AT_BOUND_REL * span else "upper" if hi[j] - b <= AT_BOUND_REL * span else None)
        ratio = (b / a if b > 0 else math.inf) if a > 0 else 1.0
        moved = ratio > SUSPECT_FACTOR or ratio < 1 / SUSPECT_FACTOR
        if at is None and not moved:
            continue
        direction = 1.0 if b > a else -1.0 if b < a else 0.0
        pulls = []
        for i, r in enumerate(rows):
            pull = -math.log(prior_pred[i] / r.measured_ms) * sensitivity[j][i] * direction
            if pull > 0:
                pulls.append((pull, r.number, r.label))
        pulls.sort(key=lambda t: (-t[0], t[1]))
        out.append({"parameter": key, "prior": a, "fitted": b, "bound": (lo[j] if at == "lower" else hi[j]) if at
                    else None, "at_bound": at, "factor": ratio,
                    "rows": [{"row": n, "config": label} for _, n, label in pulls[:3]]})
    return out


def describe_suspect(s: dict) -> str:
    """One line on a suspect fitted parameter."""
    why = (f"ends at its {s['at_bound']} bound {s['bound']:.6g}" if s["at_bound"]
           else f"moved {s['factor']:.3g}x from its prior")
    if s["at_bound"] and not (1 / SUSPECT_FACTOR <= s["factor"] <= SUSPECT_FACTOR):
        why += f" ({s['factor']:.3g}x its prior)"
    rows = ", ".join(f"row {r['row']} ({r['config']})" for r in s["rows"]) or "no single row"
    return f"{s['parameter']} {s['prior']:.6g} -> {s['fitted']:.6g} {why}; pulled there by {rows}"
