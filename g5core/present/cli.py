"""The ``g5`` command line. Errors print one line to stderr and exit with status 2."""
from __future__ import annotations

import functools
import json
import os
import sys
import time
import warnings

import click

from g5core.lower.builder import DEFAULT_MAX_OPS
from g5core.api.errors import ConfigError, G5Error, suggest
from g5core.sim.memory import GIB
from g5core.present.render import render_calibrate, render_explain, render_summary, render_validate, table
from g5core.api.plugins import describe_plugins, make_plugin_manager
from g5core.inputs.framework import FRAMEWORK_NAMES
from g5core.inputs.models import CATALOG, get_model
from g5core.inputs.outputs import check_output_path, check_outputs, write_atomically
from g5core.inputs.systems import CATALOG_NAMES, get_system, system_source
from g5core.present.caveats import deployment_warnings
from g5core.present.plots import figure_bytes, image_format, make_figure, parse_where
from g5core.present.render import render_bench_rows, render_best, render_collective, render_serve_best
from g5core.present.emit import FRAMEWORKS, check_emit_dir, check_scheduling, emit_files, write_emit
from g5core.present.report import (auto_dims, load_rows, load_search, load_serving, render, render_search,
                                   render_serving)
from g5core.present.serve_plots import load_search_rows, serve_figure
from g5core.present.trace import dump_timeline, dump_trace, parse_layers
from g5core.session.collbench import bench_rows, collective_rows, size_range
from g5core.session.run import input_files, load_raw, make_plan, run
from g5core.study.search import best_layouts
from g5core.study.serve_command import serve_command
from g5core.serve.api import representative_steps
from g5core.inputs.serving import TRACE_SUFFIXES, split_config, workload_spec
from g5core.study.resultsdb import newest_of_each, result_free_key
from g5core.study.serve_db import load_serving_rows, record_search_context, serving_free_key
from g5core.study.serving import DEFAULT_TOP as DEFAULT_SERVE_TOP, best_serve_command
from g5core.study.serve_sweep import is_serving_sweep, render_rows, run_serving_sweep
from g5core.study.sweep import default_progress, parse_grid, run_preset, run_sweep
from g5core.study.validate import DEFAULT_MAX_EVALS, calibrate, validate


def _fail(exc: Exception) -> None:
    click.echo(f"g5: error: {exc}", err=True)
    sys.exit(2)


class _G5Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except G5Error as exc:  # configuration, plugin, DAG and conservation errors alike
            _fail(exc)


@click.group(cls=_G5Group)
@click.version_option(package_name="g5")
def main() -> None:
    """G5: simulate LLM inference on multi-chip clusters (TTFT, TPOT, memory, communication)."""
    # a plugin's warning (e.g. the measured tables' missing extra) is one line, like G5's own
    def show(message, category, filename, lineno, file=None, line=None):
        click.echo(f"g5: warning: {message}", err=True)

    warnings.showwarning = show


def _progress():
    """Phase lines on stderr when a person watches it; nothing when stderr is a file or pipe."""
    if not sys.stderr.isatty():
        return None
    t0 = time.perf_counter()
    return lambda line: click.echo(f"[{time.perf_counter() - t0:6.1f} s] {line}", err=True)


_config_options = [
    click.argument("config", type=click.Path(dir_okay=False)),
    click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                 help="Override a configuration value, e.g. --set parallel.cp=8 (repeatable)."),
    click.option("--disable", "disabled", multiple=True, metavar="NAME",
                 help="Disable a plugin for this run, like pytest -p no:NAME (repeatable)."),
]


def config_options(f):
    for opt in reversed(_config_options):
        f = opt(f)
    return f


_max_ops_option = click.option(
    "--max-ops", type=int, default=None, metavar="N",
    help=f"Refuse runs estimated above N ops and flows together (default {DEFAULT_MAX_OPS:,}).")


def _check_max_ops(max_ops) -> None:
    if max_ops is not None and max_ops < 1:
        raise ConfigError("--max-ops", f"must be a positive whole number, got {max_ops}")


_framework_option = click.option(
    "--framework", "framework", default=None, metavar="NAME",
    help="The serving framework's profile: vllm, sglang, trtllm or generic (the configuration's framework key; "
         "the system file's framework block keeps its other keys).")


def _with_framework(raw: dict, framework) -> dict:
    """The configuration with ``--framework NAME`` as its ``framework`` key."""
    if framework is None:
        return raw
    if framework not in FRAMEWORK_NAMES:
        raise ConfigError("--framework", f"unknown framework {framework!r}{suggest(framework, FRAMEWORK_NAMES)}; "
                                         f"choose one of {', '.join(FRAMEWORK_NAMES)}")
    return {**raw, "framework": framework}


@main.command("run")
@config_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the summary.")
@click.option("--trace", "trace_path", help="Write a Perfetto/Chrome trace here.")
@click.option("--trace-layers", "trace_layers",
              help="Draw only these layers in the trace, e.g. 0-3 or 0-1,80 (a 100-layer trace of many chips is "
                   "too big for Perfetto's UI).")
@click.option("--timeline", "timeline_path",
              help="Write every op's start and end (and chips, owner, reason, bytes) as CSV here.")
@click.option("--compare-math", is_flag=True, help="Also compute the closed-form Math path and show both.")
@click.option("--no-symmetry", is_flag=True,
              help="Simulate every chip, even where identical replicas could be simulated once.")
@_max_ops_option
@_framework_option
def run_cmd(config, overrides, disabled, as_json, trace_path, trace_layers, timeline_path, compare_math, no_symmetry,
            max_ops, framework):
    """Simulate one configuration (prefill: TTFT; decode: TPOT)."""
    _check_max_ops(max_ops)
    if trace_layers is not None and not trace_path:
        raise ConfigError("--trace-layers", "selects the layers of the trace; give --trace FILE too")
    layers = None if trace_layers is None else parse_layers(trace_layers)
    raw = _with_framework(load_raw(config, overrides), framework)
    if "serving" in raw:
        _run_serving_steps(raw, disabled, as_json, bool(trace_path or timeline_path), compare_math, max_ops,
                           no_symmetry)
        return
    if layers is not None and isinstance(raw.get("model"), str):
        model = get_model(raw["model"])     # a layer past the model's would leave the trace empty of it
        past = sorted(layer for layer in layers if layer > model.n_layers)
        if past:
            raise ConfigError("--trace-layers", f"layer {past[0]} is past {model.name}'s layers: 0-{model.n_layers - 1}"
                                                f" (and {model.n_layers}, the LM head)")
    targets = check_outputs({"--trace": trace_path, "--timeline": timeline_path}, input_files(config, raw))
    if targets and raw.get("path") == "math":
        raise G5Error("--trace and --timeline need the G5 path (path: g5); the Math path has no timeline")
    symmetry = ("turned off (--no-symmetry)" if no_symmetry
                else "--trace and --timeline draw every chip" if targets else True)
    out = run(raw, disabled=disabled, compare_math=compare_math, progress=_progress(),
              record_port_rates=bool(trace_path), max_ops=max_ops, symmetry=symmetry)
    for line in deployment_warnings(out.plan.ctx, out.memory):
        click.echo(f"g5: warning: {line}", err=True)
    write_error = None
    if targets:
        # each file on its own: a trace too large for the disk leaves the timeline written
        written, write_error = targets.write_each({
            "--trace": lambda fh: dump_trace(out.sim, out.plan.ctx.topology, fh, layers),
            "--timeline": lambda fh: dump_timeline(out.sim, fh, out.plan.ctx.system, out.deployment.phase)})
        trace_path = trace_path if "--trace" in written else None
        timeline_path = timeline_path if "--timeline" in written else None
    if as_json:
        click.echo(json.dumps(out.to_json_dict(), indent=2, sort_keys=True, allow_nan=False))
    else:
        click.echo(render_summary(out, trace_path, timeline_path))
    if write_error is not None:
        _fail(write_error)


def _run_serving_steps(raw, disabled, as_json, files, compare_math, max_ops, no_symmetry) -> None:
    """``g5 run`` on a serving configuration: one representative step of each pool, each
    said which (:func:`g5core.serve.api.representative_steps`)."""
    if files:
        raise ConfigError("--trace", "a serving configuration's representative steps have no trace here; write the "
                                     "step as phase/batch/seq_len without serving: (or use g5 serve --trace)")
    outs = []
    for step in representative_steps(raw, disabled):
        out = run(step.raw, disabled=disabled, compare_math=compare_math, max_ops=max_ops,
                  symmetry="turned off (--no-symmetry)" if no_symmetry else True)
        for line in deployment_warnings(out.plan.ctx, out.memory):
            click.echo(f"g5: warning: {line}", err=True)
        outs.append((step, out))
    if as_json:
        click.echo(json.dumps({"serving_steps": [{"pool": st.role, "step": st.what, **out.to_json_dict()}
                                                 for st, out in outs]}, indent=2, sort_keys=True, allow_nan=False))
        return
    click.echo("\n\n".join(f"serving step  {st.what}\n{render_summary(out, None, None)}" for st, out in outs))


@main.command("explain")
@config_options
@_max_ops_option
def explain_cmd(config, overrides, disabled, max_ops):
    """Validate a configuration and explain its layout: groups, nodes, model, system."""
    _check_max_ops(max_ops)
    raw = load_raw(config, overrides)
    if "serving" in raw:   # one representative step of each pool, each said which
        steps = [(st.what, st.raw) for st in representative_steps(raw, disabled)]
    else:
        steps = [(None, raw)]
    texts = []
    for what, step_raw in steps:
        plan = make_plan(step_raw, disabled, max_ops=max_ops)
        for line in deployment_warnings(plan.ctx):
            click.echo(f"g5: warning: {line}", err=True)
        given = step_raw.get("parallel") if isinstance(step_raw.get("parallel"), dict) else {}
        texts.append((f"serving step  {what}\n" if what else "") + render_explain(plan, given_dims=tuple(given)))
    click.echo("\n\n".join(texts))


def _int_list(ctx, param, value):
    if value is None:
        return None
    try:
        values = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or any(v <= 0 for v in values):
        raise click.BadParameter(f"expected comma-separated positive whole numbers, got {value!r}")
    return values


_sweep_options = [
    click.option("--workers", default=None, type=click.IntRange(min=1),
                 help="Cells simulated at once (worker processes, or Dask workers) [default: 1; with --serve "
                      "the CPUs G5 may use, at most 4: the search's answer does not depend on it]."),
    click.option("--executor", default="local", show_default=True, metavar="local|dask|dask:ADDRESS",
                 help="local worker processes; dask starts a local Dask cluster; dask:tcp://HOST:PORT uses a "
                      "running scheduler's workers (needs g5[distributed])."),
]


def sweep_options(f):
    for opt in reversed(_sweep_options):
        f = opt(f)
    return f


@main.command("scan")
@config_options
@click.option("--db", "db_path", required=True, type=click.Path(dir_okay=False),
              help="SQLite database; each cell is committed as soon as it is computed.")
@click.option("--cp", "cp_values", callback=_int_list, default=None,
              help="Comma-separated cp values [default: 1,2,4,8,16].")
@click.option("--seq-len", "seq_lens", callback=_int_list, default=None,
              help="Comma-separated sequence lengths [default: 32768,...,1048576].")
@click.option("--hidden-threshold", default=None, type=click.FloatRange(0.0, 1.0, min_open=True),
              help="Ring traffic counts as hidden when at least this fraction of it overlaps compute [default: 0.9].")
@sweep_options
def scan_cmd(config, overrides, disabled, db_path, cp_values, seq_lens, hidden_threshold, workers, executor):
    """CP validation scan (the cp plugin's sweep preset): a cp x seq_len grid with chips fixed (dp
    auto); checks that TTFT does not rise with cp where the ring traffic is hidden. Exit 1 if it
    does, or if no cell ran."""
    raw = load_raw(config, overrides)
    report = run_preset("cp", raw, db_path, axes={"parallel.cp": cp_values, "seq_len": seq_lens},
                        options={"hidden_threshold": hidden_threshold}, disabled=disabled, workers=workers or 1,
                        executor=executor, progress=default_progress(), inputs=[config])
    _finish_sweep_output(report.sweep)
    if not report.preset.check_phases or raw.get("phase") in report.preset.check_phases:
        if report.violations:
            click.echo("TTFT rises with cp where the ring traffic is hidden:")
            for v in report.violations:
                click.echo(f"  {v}")
            sys.exit(1)
        click.echo("TTFT is non-increasing in cp wherever the ring traffic is hidden")
    else:
        click.echo("the TTFT trend check applies to prefill only; nothing checked")


def _finish_sweep_output(sweep) -> None:
    """The summary line; exit 1 when no cell ran (a sweep of failures never reports success)."""
    click.echo(sweep.summary())
    if not sweep.ok_rows:
        click.echo(f"g5: error: no cell ran; every grid point is invalid (the reasons are in {sweep.db_path}; "
                   f"first: {sweep.failed_rows[0]['error']})", err=True)
        sys.exit(1)


_emit_option = click.option(
    "--emit", nargs=2, type=(click.Choice(FRAMEWORKS), click.Path(file_okay=False)),
    default=None, metavar="FRAMEWORK DIR",
    help="Write the framework's launch files for the deployment (vllm serve / sglang launch_server command lines, "
         "TensorRT-LLM extra-llm-api-config YAML, a Dynamo deployment) and a benchmark at its rate to DIR.")


def _prepare_emit(emit, config, inputs):
    """The launch files of ``config`` and their checked folder, before any work."""
    framework, directory = emit
    folder = check_emit_dir(directory, framework, inputs)
    return framework, folder, emit_files(config, framework), inputs


def _write_emit(framework, folder, files, inputs) -> None:
    for path in write_emit(folder, files, inputs):
        click.echo(f"wrote        --emit {framework} {path}", err=True)


@main.command("serve")
@config_options
@click.option("--workload", "workload", metavar="FILE|SPEC",
              help="A trace file (.csv, .jsonl: g5, Azure or Mooncake format) or an arrival process: poisson, "
                   "gamma:cv=C, closed (with --rate or --concurrency).")
@click.option("--requests", type=int, default=None, metavar="N",
              help="Requests of a synthetic workload (the first N of a trace).")
@click.option("--rate", type=float, default=None, metavar="R", help="Arrivals per second (open loop).")
@click.option("--concurrency", type=int, default=None, metavar="C", help="Requests in flight at once (closed loop).")
@click.option("--isl", default=None, metavar="DIST",
              help="Input lengths: N, uniform:LO:HI, normal:MEAN:STD, lognormal:MEDIAN:SIGMA or hist:LEN=W,... "
                   "(append @MIN:MAX to clip).")
@click.option("--osl", default=None, metavar="DIST", help="Output lengths, as --isl.")
@click.option("--slo", default=None, metavar="LIMITS", help="Goodput limits, e.g. ttft=2s,tpot=50ms or ttft_p90=2s.")
@click.option("--seed", type=int, default=None, help="Seed of a synthetic workload (default 0).")
@click.option("--exact", is_flag=True, help="Run every distinct step through the engine (no predictor).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the summary.")
@click.option("--requests-csv", "requests_csv", help="Write one row per request here.")
@click.option("--trace", "trace_path", help="Write a Perfetto trace (instances' steps, requests' spans) here.")
@click.option("--db", "db_path", help="Add the run's summary to this results database (serving_results).")
@_framework_option
@_emit_option
@click.option("--max-steps", "max_steps", type=int, default=None, metavar="N",
              help="Refuse runs estimated above N sequence-steps (a sequence's share of one step; default "
                   "20,000,000, about 46 s).")
def serve_cmd(config, overrides, disabled, workload, requests, rate, concurrency, isl, osl, slo, seed, exact, as_json,
              requests_csv, trace_path, db_path, framework, emit, max_steps):
    """Simulate a service: requests through routers and continuous-batching instances."""
    if max_steps is not None and max_steps < 1:
        raise ConfigError("--max-steps", f"must be a positive whole number, got {max_steps}")
    raw = _with_framework(load_raw(config, overrides), framework)
    inputs = input_files(config, raw)
    if workload and workload.lower().endswith(TRACE_SUFFIXES):
        inputs.append(("--workload", workload))
    targets = check_outputs({"--requests-csv": requests_csv, "--trace": trace_path}, inputs)
    emitted = None
    if emit:   # the launch files are made (and refused) before the run, written after it
        spec = workload_spec(split_config(raw)[1].get("workload"), workload, requests, rate, concurrency, isl, osl,
                             seed)
        emitted = _prepare_emit(emit, {**raw, "serving": {**dict(raw.get("serving") or {}),
                                                          **({"workload": spec} if spec else {})}}, inputs)
    text = serve_command(raw, disabled, targets, db_path, inputs, as_json=as_json, progress=sys.stderr.isatty(),
                         workload=workload, requests=requests, rate=rate, concurrency=concurrency, isl=isl, osl=osl,
                         slo=slo, seed=seed, exact=exact, max_work=max_steps)
    click.echo(text)
    if emitted:
        _write_emit(*emitted)


@main.command("sweep")
@config_options
@click.option("--grid", "grid", multiple=True, required=True, metavar="KEY=V1,V2,...",
              help="One axis of the grid, e.g. --grid parallel.cp=1,2,4 (repeatable; the first is outermost).")
@click.option("--db", "db_path", default="g5-sweep.db", show_default=True, type=click.Path(dir_okay=False),
              help="SQLite results database; finished configurations in it are skipped (resume).")
@sweep_options
def sweep_cmd(config, overrides, disabled, grid, db_path, workers, executor):
    """Run a cartesian grid over any configuration keys; one database row per configuration.

    Use --set parallel.dp=auto to keep the chip count fixed while other dimensions change.
    Invalid points are recorded with their error and skipped. Exit 1 when no cell ran."""
    raw = load_raw(config, overrides)
    axes = parse_grid(grid)

    if is_serving_sweep(raw, axes):  # a configuration with a serving block: g5 serve at every point
        rows = run_serving_sweep(raw, axes, db_path, disabled, inputs=[config],
                                 progress=(lambda line: click.echo(line, err=True)) if sys.stderr.isatty() else None)
        click.echo(render_rows(rows))
        return
    report = run_sweep(raw, axes, db_path, disabled=disabled, workers=workers or 1, executor=executor,
                       progress=default_progress(), inputs=[config])
    _finish_sweep_output(report)


@main.command("best")
@config_options
@click.option("--objective", type=click.Choice(["ttft", "tpot", "tokens_per_s_per_chip", "latency", "goodput_per_chip",
                                                "throughput_per_chip", "min_chips"]), default=None,
              help="What to rank by [default: ttft for prefill, tpot for decode, latency for a mixed step; with "
                   "--serve: goodput_per_chip (or throughput_per_chip, min_chips with --rate)].")
@click.option("--top", "top", default=None, type=click.IntRange(min=1),
              help="How many to show [default: 10] (--serve: the ranking is exact down to this place, the first "
                   "exactly and the others up to --tolerance, where ties are not told apart; the rest may be "
                   "bounded out) [--serve default: 5].")
@click.option("--json", "as_json", is_flag=True,
              help="Print a JSON list of the candidates, best first: parallel, latency_s, fits, max_total_bytes, "
                   "tokens_per_s_per_chip, objective_value and the full configuration (with --serve: config, "
                   "capacity_requests_per_s, goodput_per_chip, ...; an object with the ranked list, both answers "
                   "(sides: the best aggregated and disaggregated, their ratio) and the counts).")
@click.option("--db", "db_path", default=None, type=click.Path(dir_okay=False),
              help="Keep the simulated layouts in this results database (and reuse what it holds).")
@sweep_options
@click.option("--serve", "serve", is_flag=True,
              help="Serving search: the deployment (layout, instances, scheduler limits, aggregated or "
                   "disaggregated) with the highest capacity within --slo.")
@click.option("--workload", "workload", metavar="SPEC", help="--serve: the arrival process, poisson or gamma:cv=C.")
@click.option("--requests", type=int, default=None, metavar="N",
              help="--serve: requests of each run at one rate [default: 300].")
@click.option("--isl", default=None, metavar="DIST", help="--serve: input lengths (as g5 serve's --isl).")
@click.option("--osl", default=None, metavar="DIST", help="--serve: output lengths (as g5 serve's --osl).")
@click.option("--slo", default=None, metavar="LIMITS", help="--serve: the limits, e.g. ttft_p90=2s,tpot_p90=50ms.")
@click.option("--seed", type=int, default=None, help="--serve: the workload's seed (default 0).")
@click.option("--rate", type=float, default=None, metavar="R", help="--serve, min_chips: the rate to serve (req/s).")
@click.option("--disagg", type=click.Choice(["off", "on", "auto"]), default="auto", show_default=True,
              help="--serve: aggregated only, disaggregated only, or both.")
@click.option("--decode-system", "decode_system", default=None, metavar="NAME",
              help="--serve, --disagg on|auto: the disaggregated candidates' decode pools run on this system (a "
                   "catalogue name, e.g. h200, or a system file) while prefill and aggregated pools stay on the "
                   "configuration's (heterogeneous disaggregation, as aiconfigurator's --decode-system). The chips "
                   "stay one budget: prefill plus decode chips = chips, each chip counted alike in the per-chip "
                   "objectives, as aiconfigurator's --total-gpus [default: the configuration's system].")
@click.option("--speculative", "speculative", default=None, metavar="LIST",
              help="--serve: speculative decoding as a dimension, e.g. off,eagle:1,eagle:3 (METHOD:K; K alone: the "
                   "configuration's method); each a candidate of its own, its acceptance the configuration's "
                   "speculative block's (same method) or the method's published default [default: the "
                   "configuration's block, or plain decode].")
@click.option("--chunks", callback=_int_list, default=None,
              help="--serve: chunk sizes (max_num_batched_tokens) to try [default: 2048,8192].")
@click.option("--seqs", callback=_int_list, default=None,
              help="--serve: max_num_seqs values [default: powers of two from 8 to what the KV pool holds].")
@click.option("--tolerance", type=float, default=None,
              help="--serve: the bisection stops at hi/lo <= 1 + this [default: 0.05].")
@click.option("--max-rate", "max_rate", type=float, default=None, help="--serve: the rate ceiling [default: 1000].")
@click.option("--beam", type=int, default=None,
              help="--serve: disaggregated pairs only from this many best layouts per role (a heuristic cut) "
                   "[default: every pair; the branch and bound bounds them].")
@click.option("--vary", default=None, metavar="DIMS",
              help="--serve: only these dimensions vary, e.g. tp,cp (the others stay 1) [default: all].")
@click.option("--settle", type=float, default=None,
              help="--serve: each run holds this many times the requests in the system [default: 16].")
@click.option("--confirm", type=int, default=None,
              help="--serve: further seeds the capacity must hold on [default: 2].")
@click.option("--framework", "framework", default=None, metavar="NAME",
              help="The serving framework's profile (vllm, sglang, trtllm, generic); with --serve, auto: the search "
                   "under each of vllm, sglang and trtllm, ranked together with the framework as a column.")
@_emit_option
@click.option("--max-steps", "max_steps", type=int, default=None, metavar="N",
              help="--serve: refuse a search estimated above N sequence-steps [default: 20,000,000 a candidate].")
def best_cmd(config, overrides, disabled, objective, top, as_json, db_path, workers, executor, serve, workload,
             requests, isl, osl, slo, seed, rate, disagg, decode_system, speculative, chunks, seqs, tolerance, max_rate,
             beam, vary, settle, confirm, framework, emit, max_steps):
    """Layout search: every split of chips over the registered dimensions; those that are invalid or
    do not fit (memory ledger) are excluded with their reason, the rest simulated and ranked.

    With --serve: the serving search (see g5core/study/serving/)."""
    raw = load_raw(config, overrides)
    if framework == "auto" and not serve:
        raise ConfigError("--framework", "auto compares the frameworks in the serving search; add --serve or name "
                                         "one framework")
    if framework != "auto":
        raw = _with_framework(raw, framework)
    serve_only = {"--workload": workload, "--requests": requests, "--isl": isl, "--osl": osl, "--slo": slo,
                  "--seed": seed, "--rate": rate, "--chunks": chunks, "--seqs": seqs, "--tolerance": tolerance,
                  "--max-rate": max_rate, "--beam": beam, "--vary": vary, "--settle": settle, "--confirm": confirm,
                  "--max-steps": max_steps, "--decode-system": decode_system, "--speculative": speculative}
    if emit and not serve:
        raise ConfigError("--emit", "writes the launch files of the serving search's winner; add --serve")
    if serve:
        top = DEFAULT_SERVE_TOP if top is None else top
        folder = None
        if emit:   # checked before the search; the files are the winner's, made after it
            if framework == "auto":
                raise ConfigError("--emit", "writes one winner's launch files; name one framework instead of auto")
            folder = check_emit_dir(emit[1], emit[0], [config])
            check_scheduling(raw, emit[0])
        search = functools.partial(best_serve_command, config_path=config, disabled=disabled, objective=objective,
                                   db_path=db_path, workers=workers, executor=executor, disagg=disagg, top=top,
                                   **{k[2:].replace("-", "_"): v for k, v in serve_only.items()})
        if framework == "auto":
            click.echo(_best_serve_by_framework(raw, search, top, as_json))
            return
        found = search(raw)
        if db_path:   # what the search was asked, for g5 plot's titles
            record_search_context(db_path, raw, _search_workload_text(raw, workload, isl, osl),
                                  slo if slo is not None else (raw.get("serving") or {}).get("slo"))
        if as_json:
            click.echo(json.dumps(found.to_json_dict(top), indent=2, sort_keys=True, allow_nan=False))
        else:
            click.echo(render_serve_best(found, top))
        if emit:
            if not found.ranked or not found.ranked[0].capacity:
                raise ConfigError("--emit", "the search found no deployment meeting the SLO; nothing to launch")
            _write_emit(emit[0], folder, emit_files(found.ranked[0].to_json_dict()["config"], emit[0]), [config])
        return
    given = [k for k, v in serve_only.items() if v is not None]
    if given:
        raise ConfigError(given[0], "applies to the serving search; add --serve")
    top = 10 if top is None else top
    result = best_layouts(raw, objective, db_path, disabled, workers or 1, executor,
                          progress=default_progress(), inputs=[config])
    if as_json:
        click.echo(json.dumps([c.to_json_dict() for c in result.ranked[:top]], indent=2))
        return
    click.echo(render_best(result, top))


def _best_serve_by_framework(raw: dict, search, top: int, as_json: bool) -> str:
    """``g5 best --serve --framework auto``: the serving search under each framework profile
    (vllm, sglang, trtllm), the candidates of all three ranked together by the search's own
    objective, the framework a column. (The search itself is g5core.study.serving.)"""
    results = [(name, search(_with_framework(raw, name))) for name in ("vllm", "sglang", "trtllm")]
    objective = results[0][1].objective
    ranked = sorted(((name, s) for name, found in results for s in found.ranked),
                    key=lambda fs: (fs[1].value(objective), fs[0]))[:top]
    if as_json:
        return json.dumps([{"framework": name, **s.to_json_dict()} for name, s in ranked], indent=2, sort_keys=True,
                          allow_nan=False)
    lines = [f"# serving search under each framework profile, ranked by {objective}",
             f"{'#':>3} {'framework':<9} {'capacity req/s':>14} {'goodput/chip':>12} {'tok/s/chip':>10}  deployment"]
    for i, (name, s) in enumerate(ranked, 1):
        goodput, tokens = s.rates()
        lines.append(f"{i:>3} {name:<9} {s.capacity:>14.4g} {goodput:>12.4g} {tokens:>10.4g}  {s.candidate.label()}")
    return "\n".join(lines)


def _search_workload_text(raw, workload, isl, osl) -> str:
    """A serving search's workload in words: its trace file, or its prompt and output lengths."""
    w = dict((raw.get("serving") or {}).get("workload") or {})
    if workload and workload.lower().endswith(TRACE_SUFFIXES):
        return "trace " + os.path.basename(workload)
    if "trace" in w and isl is None:
        return "trace " + os.path.basename(str(w["trace"]))
    return f"isl {isl if isl is not None else w.get('input_tokens', '?')}, osl {osl if osl is not None else w.get('output_tokens', '?')}"


@main.command("plot")
@click.argument("db", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "output", default=None, type=click.Path(dir_okay=False),
              help="Image file, .png or .svg [default: g5-KIND.png].")
@click.option("--kind", type=click.Choice(["latency", "memory", "pareto", "timeline", "serve-cdf", "serve-occupancy",
                                          "serve-cache", "serve-throughput", "serve-pareto"]), default="latency",
              show_default=True, help="latency: TTFT/TPOT against --x, one line per S; memory: stacked per-chip "
                                      "memory against capacity; pareto: latency against memory; timeline: one layer "
                                      "across the chips of a group, compute against communication; serve-cdf: "
                                      "TTFT/TPOT CDFs of serving runs; serve-occupancy: KV use and waiting requests "
                                      "over time; serve-cache: the block cache's cached blocks per tier over time; "
                                      "serve-throughput: tokens/s per chip against per-user speed across "
                                      "a rate sweep; serve-pareto: output tokens/s per chip against per user of a g5 best --serve search's "
                                      "candidates at their capacity.")
@click.option("--sweep", "sweep_id", type=int, default=None, help="Only this sweep's rows [default: every row].")
@click.option("--x", "x_dim", default="cp", show_default=True,
              help="The parallel dimension on the x axis (latency) or whose group the timeline shows.")
@click.option("--layer", type=int, default=None, help="Timeline: the layer to show [default: the middle one].")
@click.option("--row", "row_key", default=None, help="Timeline: the row (a prefix of its config_hash) to re-simulate.")
@click.option("--where", "where", default=None, metavar="KEY=VALUE,..",
              help="Only the rows whose inputs match, e.g. --where seq_len=131072,parallel.cp=8 "
                   "(the timeline draws the one row it leaves).")
def plot_cmd(db, output, kind, sweep_id, x_dim, layer, row_key, where):
    """Plot a results database (PNG or SVG)."""
    output = output or f"g5-{kind}.png"
    fmt = image_format(output)
    conditions = parse_where(where)
    target = check_output_path(output, "-o", inputs=[db])
    if kind == "serve-pareto":
        fig = serve_figure(kind, load_search_rows(db))
    elif kind.startswith("serve-"):
        fig = serve_figure(kind, _newest(load_serving_rows(db), serving_free_key))
    else:
        rows = load_rows(db, sweep_id)
        fig = make_figure(kind, rows if sweep_id is not None else _newest(rows, result_free_key), x_dim=x_dim,
                          layer=layer, config_hash=row_key, where=conditions, auto_dims=auto_dims(db, sweep_id))
    write_atomically(target, lambda fh: fh.write(figure_bytes(fig, fmt)), "-o", binary=True)
    click.echo(f"{kind} plot written to {output}")


def _newest(rows: list, free_key) -> list:
    """Each configuration's newest row (``newest_of_each``), saying on stderr how many rows of
    other G5 builds were left out."""
    rows, older = newest_of_each(rows, free_key)
    if older:
        rows_of = "1 row" if older == 1 else f"{older} rows"
        click.echo(f"note: {rows_of} of the same configurations computed by other G5 builds left out "
                   "(each configuration's newest is drawn; `g5 report DB` lists every row)", err=True)
    return rows


@main.command("report")
@click.argument("db", type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["csv", "json", "markdown"]), default="markdown",
              show_default=True, help="csv and json hold every column; markdown the ones a person reads.")
@click.option("--sweep", "sweep_id", type=int, default=None, help="Only this sweep's rows [default: every row].")
@click.option("--serving", is_flag=True, default=False,
              help="The serving runs (g5 serve --db, serving sweeps) instead of the one-step rows.")
@click.option("-o", "--output", "output", default=None, type=click.Path(dir_okay=False),
              help="Write to this file instead of standard output.")
def report_cmd(db, fmt, sweep_id, serving, output):
    """The rows of a results database as a table."""
    target = check_output_path(output, "-o", inputs=[db]) if output else None
    rows = load_serving(db, sweep_id) if serving else load_rows(db, sweep_id)
    search = load_search(db) if not rows and sweep_id is None else []
    if search:   # a `g5 best --serve --db` file: its cells (the candidates in markdown)
        click.echo(f"g5: note: {db} holds a serving search's cells ({sum(r['kind'] == 'candidate' for r in search)} "
                   f"candidates, {sum(r['kind'] == 'screen' for r in search)} screens)"
                   + ("; markdown shows the candidates, --format csv or json every cell" if fmt == "markdown" else ""),
                   err=True)
        text = render_search(search, fmt)
    elif serving:
        text = render_serving(rows, fmt)
    else:
        if not rows and sweep_id is None and load_serving(db):
            raise ConfigError("DB", f"{db} holds serving runs only; `g5 report {db} --serving` shows them")
        text = render(rows, fmt)
    if not rows and not search:
        click.echo(f"g5: note: {db} holds no {'serving runs' if serving else 'rows'}", err=True)
    if target is None:
        click.echo(text, nl=False)
    else:
        write_atomically(target, lambda fh: fh.write(text), "-o")


@main.command("models")
def models_cmd():
    """List the model catalog."""
    rows = []
    for name, m in CATALOG.items():
        c = m.param_counts()
        rows.append([name, m.attention.kind, m.n_layers, m.hidden_size, f"{c.total / 1e9:.1f}B",
                     f"{c.active / 1e9:.2f}B", f"{c.active_less_embedding / 1e9:.2f}B",
                     m.moe.n_routed_experts if m.moe else "-", m.kv_bytes_per_token_per_layer(2),
                     m.attention_pattern()])
    click.echo(table(rows, ["model", "attention", "layers", "hidden", "params", "active", "active less embedding",
                            "experts", "c_kv bf16 (B)", "attention by layer"]))
    click.echo("\nactive: the weights one token runs through, embedding and lm_head included (as Qwen and DeepSeek "
               "count: qwen3-30b-a3b 3.3B); less embedding: without the input embedding table (as OpenAI counts: "
               "gpt-oss-120b 5.1B).\nA model can also be a path to a Hugging Face config.json.")


@main.group("systems", invoke_without_command=True)
@click.pass_context
def systems_cmd(ctx):
    """List the system catalog (`g5 systems show NAME` for one system)."""
    if ctx.invoked_subcommand is not None:
        return

    rows = []
    for name in CATALOG_NAMES:
        s = get_system(name)
        rows.append([name, s.chips_per_node, f"{s.hbm_capacity_bytes / GIB:.0f}", f"{s.hbm_bw_bytes_per_s / 1e12:.2f}",
                     f"{s.peak_flops_per_s['bf16'] / 1e12:.0f}", f"{s.intra_node_bw_bytes_per_s / 1e9:.1f}",
                     f"{s.nics} x {s.network_bw_bytes_per_s / 1e9:.0f}", "yes" if s.nvls else "no"])
    click.echo(table(rows, ["system", "chips/node", "HBM GiB", "HBM TB/s", "bf16 TFLOP/s", "link GB/s",
                             "NICs x GB/s", "NVLS"]))
    click.echo("\nA system can also be a path to a YAML file with the same fields (docs/system-file.md); "
               "`g5 systems show NAME` prints one.")


@systems_cmd.command("show")
@click.argument("name")
def systems_show_cmd(name):
    """Print one system (a catalog name or a system file) with its sources, after checking it."""
    click.echo(system_source(name).rstrip("\n"))


@main.command("collective")
@click.argument("op")
@click.option("--system", "system_name", required=True, help="Catalog name or system YAML file.")
@click.option("--chips", type=int, required=True, help="Chips in the group (chips 0..N-1; a node fills first).")
@click.option("--sizes", default="8B:8GiB", show_default=True, help="MIN:MAX bytes, e.g. 1K:1G.")
@click.option("--factor", type=int, default=2, show_default=True, help="Each size is FACTOR times the last.")
@click.option("--disable", "disabled", multiple=True, metavar="NAME", help="Disable a plugin (repeatable).")
@click.option("--dtype", "dtype", default="float", show_default=True,
              help="nccl-tests' -d: the element type that sets the count column (float, half, bfloat16, int8, ...).")
@click.option("--redop", default="sum", show_default=True,
              help="nccl-tests' -o: the reduction of all_reduce and reduce_scatter (sum, prod, max, min, avg).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of rows instead of the table.")
@click.option("--framework", default=None, metavar="NAME",
              help="A serving framework's profile (vllm, sglang, trtllm, generic): its own all-reduce kernels "
                   "replace NCCL's where its code chooses them.")
@click.option("--tokens", default=None, callback=_int_list, metavar="N[,N...]",
              help="ep_dispatch/ep_combine: tokens per rank (4096).")
@click.option("--topk", type=int, default=None, help="ep_dispatch/ep_combine: experts per token (8).")
@click.option("--hidden", type=int, default=None, help="ep_dispatch/ep_combine: hidden size (7168).")
@click.option("--experts", type=int, default=None, help="ep_dispatch/ep_combine: routed experts (256).")
@click.option("--groups", type=int, default=None, help="ep_dispatch/ep_combine: routing groups (the nodes).")
@click.option("--topk-groups", type=int, default=None,
              help="ep_dispatch/ep_combine: groups per token (min(groups, 4)).")
@click.option("--kernel", default=None, help="ep_dispatch/ep_combine: normal or low_latency (normal).")
@click.option("--copy-dtype", default=None,
              help="ep_dispatch/ep_combine: a token copy's dtype, fp8 or bf16 (fp8 dispatch, bf16 combine).")
def collective_cmd(op, system_name, chips, sizes, factor, disabled, dtype, redop, as_json, framework, tokens, topk,
                   hidden, experts, groups, topk_groups, kernel, copy_dtype):
    """One collective alone on SYSTEM, size by size, shaped like nccl-tests output.

    OP is all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, gather, p2p (2 chips)
    or sendrecv (nccl-tests' sendrecv_perf: each chip sends to the next, receives from the
    previous); nccl-tests names such as allreduce and alltoall work too. ep_dispatch /
    ep_combine: one MoE dispatch or combine over the chips, token count by token count,
    shaped like DeepEP's tests (time per call, logical RDMA and NVLink bandwidth)."""
    ep_params = {"topk": topk, "hidden": hidden, "experts": experts, "groups": groups, "topk_groups": topk_groups,
                 "kernel": kernel, "dtype": copy_dtype}
    ep_flags = {"topk": "--topk", "hidden": "--hidden", "experts": "--experts", "groups": "--groups",
                "topk_groups": "--topk-groups", "kernel": "--kernel", "dtype": "--copy-dtype"}
    if op in ("ep_dispatch", "ep_combine"):
        counts = list(tokens) if tokens is not None else [4096]
        rows = bench_rows(op, system_name, chips, counts, ep_params, disabled)
        if as_json:
            click.echo(json.dumps(rows, indent=1, allow_nan=False))
            return
        system = get_system(system_name)
        click.echo(render_bench_rows(op, system.name, chips, -(-chips // system.chips_per_node), ep_params, rows))
        return
    given = [name for name, v in (("--tokens", tokens), *((ep_flags[k], v) for k, v in ep_params.items()))
             if v is not None]
    if given:
        raise ConfigError(given[0], f"applies to ep_dispatch and ep_combine only, not {op}")
    sizes_list = size_range(sizes, factor)
    rows = collective_rows(op, system_name, chips, sizes_list, disabled, dtype=dtype, redop=redop, framework=framework)
    if as_json:
        click.echo(json.dumps(rows, indent=1, allow_nan=False))
        return
    system = get_system(system_name)
    click.echo(render_collective(op, system.name, chips, -(-chips // system.chips_per_node), rows))


@main.command("plugins")
@click.option("--disable", "disabled", multiple=True, metavar="NAME", help="Show the set with NAME disabled.")
def plugins_cmd(disabled):
    """List every plugin, enabled or disabled, with the hooks it implements."""
    pm = make_plugin_manager(disabled=disabled)
    rows = [[p.name, "enabled" if p.enabled else "disabled",
             (", ".join(p.hooks) or "-") if p.enabled else "(not loaded while disabled)"]
            for p in describe_plugins(pm)]
    click.echo(table(rows, ["plugin", "state", "hooks"]))


@main.command("validate")
@click.argument("measured", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a configuration value in every row, e.g. --set system=h100-sxm (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def validate_cmd(measured, overrides, as_json):
    """Compare G5 with measured TTFT/TPOT rows of MEASURED.csv (config, set, metric, measured_ms, source).

    A metric ttft or tpot prices one step of the row's configuration; a serving metric
    (ttft_mean, ttft_p50, tpot_mean, tpot_p50, itl_mean, itl_p50) runs g5 serve on its serving
    block and workload. Rows that differ only in chips and parallel.tp also report the error
    against the TP degree.

    A collectives file (op, system, chips, size_bytes, framework, kernel, measured_us, source)
    is priced row by row as g5 collective prices it, e.g. validation/measured-collectives.csv."""
    report = validate(measured, overrides)
    click.echo(json.dumps(report, indent=2, sort_keys=True) if as_json else render_validate(report))


@main.command("calibrate")
@click.argument("measured", type=click.Path(dir_okay=False))
@click.option("--fit", "fit", required=True, metavar="KEY[,KEY...]",
              help="System parameters to fit (dotted keys), e.g. compute_model.hbm_fraction,launch_overhead_s; "
                   "a framework value (framework.kernel_launch_s, framework.host.fixed_s) starts from the "
                   "rows' framework profile where the system file does not set it.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="System file to write (never overwritten).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the report.")
@click.option("--force", is_flag=True,
              help="Write the file even when its leave-one-out error is worse than the prior's.")
@click.option("--max-evals", "max_evals", type=int, default=None, metavar="N",
              help="Stop (writing nothing) after N evaluations, each running every row once [default: 500].")
@click.option("--workers", type=int, default=1, show_default=True, help="Processes running the rows in parallel.")
def calibrate_cmd(measured, fit, output, as_json, force, max_evals, workers):
    """Fit system parameters to MEASURED.csv by bounded least squares on log error."""
    def show(report):  # the fit, printed before the file is written (a failed write keeps it)
        click.echo(json.dumps(report, indent=2, sort_keys=True) if as_json else render_calibrate(report))
    # the estimate and one line per evaluation on stderr (tens to hundreds of lines, a terminal or not)
    calibrate(measured, fit.split(","), output, say=lambda line: click.echo(line, err=True), force=force, show=show,
              max_evals=DEFAULT_MAX_EVALS if max_evals is None else max_evals, workers=workers)


if __name__ == "__main__":  # pragma: no cover
    main()
