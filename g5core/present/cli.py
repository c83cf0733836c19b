"""The ``g5`` command line. Errors print one line to stderr and exit with status 2."""
from __future__ import annotations

import json
import sys
import time

import click

from g5core.lower.builder import DEFAULT_MAX_OPS
from g5core.api.errors import ConfigError, G5Error
from g5core.sim.memory import GIB
from g5core.present.render import render_calibrate, render_explain, render_summary, render_validate, table


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
    import warnings

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
def run_cmd(config, overrides, disabled, as_json, trace_path, trace_layers, timeline_path, compare_math, no_symmetry,
            max_ops):
    """Simulate one configuration (prefill: TTFT; decode: TPOT)."""
    from g5core.present.caveats import deployment_warnings
    from g5core.inputs.outputs import check_outputs
    from g5core.session.run import input_files, load_raw, run
    from g5core.present.trace import dump_timeline, dump_trace, parse_layers

    _check_max_ops(max_ops)
    if trace_layers is not None and not trace_path:
        raise ConfigError("--trace-layers", "selects the layers of the trace; give --trace FILE too")
    layers = None if trace_layers is None else parse_layers(trace_layers)
    raw = load_raw(config, overrides)
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


@main.command("explain")
@config_options
@_max_ops_option
def explain_cmd(config, overrides, disabled, max_ops):
    """Validate a configuration and explain its layout: groups, nodes, model, system."""
    from g5core.session.run import load_raw, make_plan

    from g5core.present.caveats import deployment_warnings

    _check_max_ops(max_ops)
    raw = load_raw(config, overrides)
    plan = make_plan(raw, disabled, max_ops=max_ops)
    for line in deployment_warnings(plan.ctx):
        click.echo(f"g5: warning: {line}", err=True)
    given = raw.get("parallel") if isinstance(raw.get("parallel"), dict) else {}
    click.echo(render_explain(plan, given_dims=tuple(given)))


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
    click.option("--workers", default=1, show_default=True, type=click.IntRange(min=1),
                 help="Cells simulated at once (worker processes, or Dask workers)."),
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
    from g5core.session.run import load_raw
    from g5core.study.sweep import default_progress, run_preset

    raw = load_raw(config, overrides)
    report = run_preset("cp", raw, db_path, axes={"parallel.cp": cp_values, "seq_len": seq_lens},
                        options={"hidden_threshold": hidden_threshold}, disabled=disabled, workers=workers,
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
@click.option("--max-steps", "max_steps", type=int, default=None, metavar="N",
              help="Refuse runs estimated above N sequence-steps (a sequence's share of one step; default "
                   "20,000,000, about 46 s).")
def serve_cmd(config, overrides, disabled, workload, requests, rate, concurrency, isl, osl, slo, seed, exact, as_json,
              requests_csv, trace_path, db_path, max_steps):
    """Simulate a service: requests through routers and continuous-batching instances."""
    from g5core.inputs.outputs import check_outputs
    from g5core.serve.command import serve_command

    from g5core.session.run import input_files, load_raw

    if max_steps is not None and max_steps < 1:
        raise ConfigError("--max-steps", f"must be a positive whole number, got {max_steps}")
    raw = load_raw(config, overrides)
    inputs = input_files(config, raw)
    if workload and workload.lower().endswith((".csv", ".jsonl", ".json", ".ndjson")):
        inputs.append(("--workload", workload))
    targets = check_outputs({"--requests-csv": requests_csv, "--trace": trace_path}, inputs)
    text = serve_command(raw, disabled, targets, db_path, inputs, as_json=as_json, progress=sys.stderr.isatty(),
                         workload=workload, requests=requests, rate=rate, concurrency=concurrency, isl=isl, osl=osl,
                         slo=slo, seed=seed, exact=exact, max_work=max_steps)
    click.echo(text)


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
    from g5core.session.run import load_raw
    from g5core.study.sweep import default_progress, parse_grid, run_sweep

    raw = load_raw(config, overrides)
    axes = parse_grid(grid)
    from g5core.study.serve_sweep import is_serving_sweep, render_rows, run_serving_sweep

    if is_serving_sweep(raw, axes):  # a configuration with a serving block: g5 serve at every point
        rows = run_serving_sweep(raw, axes, db_path, disabled, inputs=[config],
                                 progress=(lambda line: click.echo(line, err=True)) if sys.stderr.isatty() else None)
        click.echo(render_rows(rows))
        return
    report = run_sweep(raw, axes, db_path, disabled=disabled, workers=workers, executor=executor,
                       progress=default_progress(), inputs=[config])
    _finish_sweep_output(report)


@main.command("best")
@config_options
@click.option("--objective", type=click.Choice(["ttft", "tpot", "tokens_per_s_per_chip", "latency", "goodput_per_chip",
                                                "throughput_per_chip", "min_chips"]), default=None,
              help="What to rank by [default: ttft for prefill, tpot for decode, latency for a mixed step; with "
                   "--serve: goodput_per_chip (or throughput_per_chip, min_chips with --rate)].")
@click.option("--top", "top", default=10, show_default=True, type=click.IntRange(min=1),
              help="How many to show (--serve: the ranking is exact down to this place; the rest may be bounded out).")
@click.option("--json", "as_json", is_flag=True,
              help="Print a JSON list of the candidates, best first: parallel, latency_s, fits, max_total_bytes, "
                   "tokens_per_s_per_chip, objective_value and the full configuration (with --serve: config, "
                   "capacity_requests_per_s, goodput_per_chip, ...).")
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
@click.option("--max-steps", "max_steps", type=int, default=None, metavar="N",
              help="--serve: refuse a search estimated above N sequence-steps [default: 20,000,000 a candidate].")
def best_cmd(config, overrides, disabled, objective, top, as_json, db_path, workers, executor, serve, workload,
             requests, isl, osl, slo, seed, rate, disagg, chunks, seqs, tolerance, max_rate, beam, vary, settle,
             confirm, max_steps):
    """Layout search: every split of chips over the registered dimensions; those that are invalid or
    do not fit (memory ledger) are excluded with their reason, the rest simulated and ranked.

    With --serve: the serving search (see g5core/study/serve_search.py)."""
    from g5core.session.run import load_raw
    from g5core.study.search import best_layouts
    from g5core.present.render import render_best
    from g5core.study.sweep import default_progress

    raw = load_raw(config, overrides)
    serve_only = {"--workload": workload, "--requests": requests, "--isl": isl, "--osl": osl, "--slo": slo,
                  "--seed": seed, "--rate": rate, "--chunks": chunks, "--seqs": seqs, "--tolerance": tolerance,
                  "--max-rate": max_rate, "--beam": beam, "--vary": vary, "--settle": settle, "--confirm": confirm,
                  "--max-steps": max_steps}
    if serve:
        from g5core.present.render import render_serve_best
        from g5core.study.serve_search import best_serve_command

        found = best_serve_command(raw, config, disabled, objective, db_path, workers, executor, disagg=disagg, top=top,
                                   **{k[2:].replace("-", "_"): v for k, v in serve_only.items()})
        if as_json:
            click.echo(json.dumps([s.to_json_dict() for s in found.ranked[:top]], indent=2, sort_keys=True,
                                  allow_nan=False))
        else:
            click.echo(render_serve_best(found, top))
        return
    given = [k for k, v in serve_only.items() if v is not None]
    if given:
        raise ConfigError(given[0], "applies to the serving search; add --serve")
    result = best_layouts(raw, objective, db_path, disabled, workers, executor,
                          progress=default_progress(), inputs=[config])
    if as_json:
        click.echo(json.dumps([c.to_json_dict() for c in result.ranked[:top]], indent=2))
        return
    click.echo(render_best(result, top))


@main.command("plot")
@click.argument("db", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "output", default=None, type=click.Path(dir_okay=False),
              help="Image file, .png or .svg [default: g5-KIND.png].")
@click.option("--kind", type=click.Choice(["latency", "memory", "pareto", "timeline", "serve-cdf", "serve-occupancy",
                                          "serve-throughput", "serve-pareto"]), default="latency",
              show_default=True, help="latency: TTFT/TPOT against --x, one line per S; memory: stacked per-chip "
                                      "memory against capacity; pareto: latency against memory; timeline: one layer "
                                      "across the chips of a group, compute against communication; serve-cdf: "
                                      "TTFT/TPOT CDFs of serving runs; serve-occupancy: KV use and waiting requests "
                                      "over time; serve-throughput: tokens/s per chip against per-user speed across "
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
    from g5core.present.plots import figure_bytes, image_format, make_figure, parse_where
    from g5core.present.report import auto_dims, load_rows
    from g5core.inputs.outputs import check_output_path, write_atomically

    output = output or f"g5-{kind}.png"
    fmt = image_format(output)
    conditions = parse_where(where)
    target = check_output_path(output, "-o", inputs=[db])
    if kind.startswith("serve-"):
        from g5core.study.serve_db import load_serving_rows
        from g5core.present.serve_plots import load_search_rows, serve_figure

        fig = serve_figure(kind, load_search_rows(db) if kind == "serve-pareto" else load_serving_rows(db))
    else:
        fig = make_figure(kind, load_rows(db, sweep_id), x_dim=x_dim, layer=layer, config_hash=row_key,
                          where=conditions, auto_dims=auto_dims(db, sweep_id))
    write_atomically(target, lambda fh: fh.write(figure_bytes(fig, fmt)), "-o", binary=True)
    click.echo(f"{kind} plot written to {output}")


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
    from g5core.present.report import load_rows, load_serving, render, render_serving
    from g5core.inputs.outputs import check_output_path, write_atomically

    target = check_output_path(output, "-o", inputs=[db]) if output else None
    if serving:
        text = render_serving(load_serving(db, sweep_id), fmt)
    else:
        rows = load_rows(db, sweep_id)
        if not rows and sweep_id is None and load_serving(db):
            raise ConfigError("DB", f"{db} holds serving runs only; `g5 report {db} --serving` shows them")
        text = render(rows, fmt)
    if target is None:
        click.echo(text, nl=False)
    else:
        write_atomically(target, lambda fh: fh.write(text), "-o")


@main.command("models")
def models_cmd():
    """List the model catalog."""
    from g5core.inputs.models import CATALOG

    rows = []
    for name, m in CATALOG.items():
        c = m.param_counts()
        rows.append([name, m.attention.kind, m.n_layers, m.hidden_size, f"{c.total / 1e9:.1f}B",
                     f"{c.active / 1e9:.1f}B", m.moe.n_routed_experts if m.moe else "-",
                     m.kv_bytes_per_token_per_layer(2), m.attention_pattern()])
    click.echo(table(rows, ["model", "attention", "layers", "hidden", "params", "active", "experts",
                            "c_kv bf16 (B)", "attention by layer"]))
    click.echo("\nA model can also be a path to a Hugging Face config.json.")


@main.group("systems", invoke_without_command=True)
@click.pass_context
def systems_cmd(ctx):
    """List the system catalog (`g5 systems show NAME` for one system)."""
    if ctx.invoked_subcommand is not None:
        return
    from g5core.inputs.systems import CATALOG_NAMES, get_system

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
    from g5core.inputs.systems import system_source

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
def collective_cmd(op, system_name, chips, sizes, factor, disabled, dtype, redop, as_json, tokens, topk, hidden,
                   experts, groups, topk_groups, kernel, copy_dtype):
    """One collective alone on SYSTEM, size by size, shaped like nccl-tests output.

    OP is all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, gather, p2p (2 chips)
    or sendrecv (nccl-tests' sendrecv_perf: each chip sends to the next, receives from the
    previous); nccl-tests names such as allreduce and alltoall work too. ep_dispatch /
    ep_combine: one MoE dispatch or combine over the chips, token count by token count,
    shaped like DeepEP's tests (time per call, logical RDMA and NVLink bandwidth)."""
    from g5core.session.collbench import bench_rows, collective_rows, size_range
    from g5core.present.render import render_bench_rows, render_collective
    from g5core.inputs.systems import get_system

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
    rows = collective_rows(op, system_name, chips, sizes_list, disabled, dtype=dtype, redop=redop)
    if as_json:
        click.echo(json.dumps(rows, indent=1, allow_nan=False))
        return
    system = get_system(system_name)
    click.echo(render_collective(op, system.name, chips, -(-chips // system.chips_per_node), rows))


@main.command("plugins")
@click.option("--disable", "disabled", multiple=True, metavar="NAME", help="Show the set with NAME disabled.")
def plugins_cmd(disabled):
    """List every plugin, enabled or disabled, with the hooks it implements."""
    from g5core.api.plugins import describe_plugins, make_plugin_manager

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
    """Compare G5 with measured TTFT/TPOT rows of MEASURED.csv (config, set, metric, measured_ms, source)."""
    from g5core.study.validate import validate
    report = validate(measured, overrides)
    click.echo(json.dumps(report, indent=2, sort_keys=True) if as_json else render_validate(report))


@main.command("calibrate")
@click.argument("measured", type=click.Path(dir_okay=False))
@click.option("--fit", "fit", required=True, metavar="KEY[,KEY...]",
              help="System parameters to fit (dotted keys), e.g. compute_model.hbm_fraction,launch_overhead_s.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="System file to write (never overwritten).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the report.")
@click.option("--force", is_flag=True,
              help="Write the file even when its leave-one-out error is worse than the prior's.")
def calibrate_cmd(measured, fit, output, as_json, force):
    """Fit system parameters to MEASURED.csv by bounded least squares on log error."""
    from g5core.study.validate import calibrate

    def show(report):  # the fit, printed before the file is written (a failed write keeps it)
        click.echo(json.dumps(report, indent=2, sort_keys=True) if as_json else render_calibrate(report))
    calibrate(measured, fit.split(","), output, say=lambda line: click.echo(line, err=True)
              if sys.stderr.isatty() else None, force=force, show=show)


if __name__ == "__main__":  # pragma: no cover
    main()
