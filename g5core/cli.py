"""The ``g5`` command line. Errors print one line to stderr and exit with status 2."""
from __future__ import annotations

import json
import sys
import time
from typing import Any

import click

from .errors import ConfigError, G5Error
from .memory import GIB



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


def _fmt_s(seconds: float) -> str:
    """Four significant digits at any magnitude: 1.244 s, 83.72 s, 41.53 ms, 4.888e+09 s."""
    if seconds >= 1 or seconds == 0:
        return f"{seconds:.4g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.4g} ms"
    return f"{seconds * 1e6:.4g} us"


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2.0 ** 20), ("KiB", 1024.0)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


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
    help="Refuse runs estimated above N ops and flows together (default 4,000,000).")


def _check_max_ops(max_ops) -> None:
    if max_ops is not None and max_ops < 1:
        raise ConfigError("--max-ops", f"must be a positive whole number, got {max_ops}")


@main.command("run")
@config_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the summary.")
@click.option("--trace", "trace_path", help="Write a Perfetto/Chrome trace here.")
@click.option("--timeline", "timeline_path",
              help="Write every op's start and end (and chips, owner, reason, bytes) as CSV here.")
@click.option("--compare-math", is_flag=True, help="Also compute the closed-form Math path and show both.")
@_max_ops_option
def run_cmd(config, overrides, disabled, as_json, trace_path, timeline_path, compare_math, max_ops):
    """Simulate one configuration (prefill: TTFT; decode: TPOT)."""
    from .caveats import deployment_warnings
    from .outputs import check_outputs
    from .run import input_files, load_raw, run
    from .trace import dump_timeline, dump_trace

    _check_max_ops(max_ops)
    raw = load_raw(config, overrides)
    targets = check_outputs({"--trace": trace_path, "--timeline": timeline_path}, input_files(config, raw))
    if targets and raw.get("path") == "math":
        raise G5Error("--trace and --timeline need the G5 path (path: g5); the Math path has no timeline")
    out = run(raw, disabled=disabled, compare_math=compare_math, progress=_progress(),
              record_port_rates=bool(trace_path), max_ops=max_ops)
    for line in deployment_warnings(out.plan.ctx, out.memory):
        click.echo(f"g5: warning: {line}", err=True)
    write_error = None
    if targets:
        try:
            targets.write({"--trace": lambda fh: dump_trace(out.sim, out.plan.ctx.topology, fh),
                           "--timeline": lambda fh: dump_timeline(out.sim, fh)})
        except G5Error as exc:  # the run is done: show its result, then the failed write
            write_error, trace_path, timeline_path = exc, None, None
    if as_json:
        click.echo(json.dumps(out.to_json_dict(), indent=2, sort_keys=True, allow_nan=False))
    else:
        click.echo(render_summary(out, trace_path, timeline_path))
    if write_error is not None:
        _fail(G5Error(f"{write_error}; nothing was written"))


def render_summary(out, trace_path=None, timeline_path=None) -> str:
    dep = out.deployment
    lines = []
    par = " ".join(f"{k}={v}" for k, v in dep.parallel)
    model, system = out.plan.ctx.model.name, out.plan.ctx.system.name
    lines.append(f"{model} on {dep.chips} x {system}  [{par}{' tp_sp' if dep.tp_sp else ''}]  "
                 f"{dep.phase}, batch {dep.batch}, seq_len {dep.seq_len}, path {dep.path}")
    metric = "TTFT" if dep.phase == "prefill" else "TPOT"
    lines.append(f"{metric}: {_fmt_s(out.latency_s)}")
    if out.sim is None:
        lines.append(f"closed form: compute {_fmt_s(out.math.compute_s)} + communication {_fmt_s(out.math.comm_s)} "
                     "(alpha-beta), no overlap, no contention")
    if out.sim is not None:
        sim = out.sim
        if out.math is not None:
            ratio = out.math.latency_s / sim.latency_s if sim.latency_s else float("nan")
            lines.append(f"{metric} (Math path): {_fmt_s(out.math.latency_s)}  (math / g5 = {ratio:.3f})")
        ov = sim.overlap
        lines.append(f"simulated {sim.ops} ops, {sim.flows} flows, {sim.events} events in {sim.sim_wall_s:.2f} s; "
                     f"conservation KPIs all 0")
        lines.append("")
        lines.append("communication by reason (times on the chip where it is most exposed)")
        rows = []
        for reason in sorted(sim.comm_bytes["by_reason"]):
            o = ov["by_reason"].get(reason, {})
            rows.append([reason, _fmt_bytes(sim.comm_bytes["by_reason"][reason]),
                         _fmt_bytes(sim.comm_bytes["per_rank_by_reason"][reason]),
                         _fmt_s(o.get("comm_time_s", 0.0)), _fmt_s(o.get("exposed_comm_s", 0.0)),
                         f"{100 * o.get('hidden_fraction', 1.0):.1f}%"])
        if rows:
            rows.append(["(all)", _fmt_bytes(sim.comm_bytes["total_bytes"]), "", _fmt_s(ov["comm_time_s"]),
                         _fmt_s(ov["exposed_comm_s"]), f"{100 * ov['hidden_fraction']:.1f}%"])
            lines.append(_table(rows, ["reason", "total bytes", "busiest rank sent", "comm time", "exposed",
                                       "hidden"]))
        else:
            lines.append("  none")
    mem = out.memory
    lines.append("")
    worst = max(mem.per_chip, key=lambda c: (c.total_bytes, -c.chip))
    lines.append(f"memory per chip (largest: chip {worst.chip})")
    lines.append(_table([[
        _fmt_bytes(worst.weights_bytes), _fmt_bytes(worst.kv_cache_bytes), _fmt_bytes(worst.activation_bytes),
        _fmt_bytes(worst.workspace_bytes), _fmt_bytes(worst.total_bytes), _fmt_bytes(worst.capacity_bytes)]],
        ["weights", "kv cache", "activations", "workspace", "total", "capacity"]))
    short = mem.shortfall_summary()
    lines.append(f"DOES NOT FIT: {short}" if short else "fits on every chip")
    if trace_path:
        lines.append(f"trace written to {trace_path} (open in https://ui.perfetto.dev)")
    if timeline_path:
        lines.append(f"per-op timeline written to {timeline_path} (CSV)")
    return "\n".join(lines)


@main.command("explain")
@config_options
@_max_ops_option
def explain_cmd(config, overrides, disabled, max_ops):
    """Validate a configuration and explain its layout: groups, nodes, model, system."""
    from .run import load_raw, make_plan

    from .caveats import deployment_warnings

    _check_max_ops(max_ops)
    raw = load_raw(config, overrides)
    plan = make_plan(raw, disabled, max_ops=max_ops)
    for line in deployment_warnings(plan.ctx):
        click.echo(f"g5: warning: {line}", err=True)
    given = raw.get("parallel") if isinstance(raw.get("parallel"), dict) else {}
    click.echo(render_explain(plan, given_dims=tuple(given)))


def render_explain(plan, given_dims: tuple[str, ...] = ()) -> str:
    """The layout of a prepared run; ``given_dims`` are the parallel keys the configuration
    set (the others are reported as defaults)."""
    from .caveats import plural

    ctx = plan.ctx
    dep, m, sysm, rm = ctx.deployment, ctx.model, ctx.system, ctx.rankmap
    counts = m.param_counts()
    a = m.attention
    kv_desc = (f"latent {a.kv_lora_rank}+{a.qk_rope_head_dim}" if a.kind == "mla" else f"{a.n_kv_heads} KV heads")
    lines = [f"model   {m.name}: {m.n_layers} layers, hidden {m.hidden_size}, {a.kind.upper()} "
             f"({a.n_heads} heads, {kv_desc}), "
             f"{counts.total / 1e9:.1f}B params ({counts.active / 1e9:.1f}B active), "
             f"c_kv {m.kv_bytes_per_token_per_layer(dep.dtypes.kv_cache_element_bytes)} B/token/layer ({dep.dtypes.kv_cache})",
             f"system  {sysm.name}: {sysm.chips_per_node} chips/node, {sysm.hbm_capacity_bytes / GIB:.0f} GiB HBM, "
             f"link {sysm.intra_node_bw_bytes_per_s / 1e9:.0f} GB/s, network {sysm.network_bw_bytes_per_s / 1e9:.0f} GB/s "
             f"per chip per direction",
             f"layout  {plural(dep.chips, 'chip')} on {plural(rm.nodes, 'node')}; rank order (outer to inner): "
             + ", ".join(f"{n}={s}" for n, s in zip(rm.factor_names, rm.factor_sizes)),
             f"phase   {dep.phase}, batch {dep.batch} per replica, seq_len {dep.seq_len}, path {dep.path}, "
             f"tp_sp {str(dep.tp_sp).lower()}",
             f"dtypes  {_describe_dtypes(dep.dtypes)}"]
    defaults = [d for d in ctx.dims.dims if d.default is not None and d.name not in given_dims]
    if defaults:
        lines.append("defaults: " + ", ".join(f"parallel.{d.name} is {d.default} when omitted" for d in defaults))
    s = ctx.shape
    kv_local = "the whole MLA latent" if a.kind == "mla" else f"{s.kv_heads:g} KV heads"
    lines.append(f"per chip: {s.tokens:g} tokens in non-attention ops, {s.q_heads:g} query heads, {kv_local}, "
                 f"KV of {s.kv_len:g} tokens per sequence")
    for dim in rm.dims:
        groups = rm.groups(dim)
        size = len(groups[0])
        crossing = [g for g in groups if rm.crosses_nodes(g)]
        lines.append("")
        lines.append(f"{dim} groups: {len(groups)} of {size}"
                     + (f"; {len(crossing)} cross node boundaries" if crossing else "; all inside one node"))
        for g in groups[:16]:
            mark = "  (crosses nodes)" if rm.crosses_nodes(g) else ""
            lines.append(f"  {list(g)}{mark}")
        if len(groups) > 16:
            lines.append(f"  ... {len(groups) - 16} more")
    return "\n".join(lines)


def _describe_dtypes(dtypes) -> str:
    weights = dict(dtypes.weights)
    others = ", ".join(f"{k} {v}" for k, v in weights.items() if k != "default")
    return (f"weights {weights['default']}" + (f" ({others})" if others else "")
            + f", activations {dtypes.activations}, kv_cache {dtypes.kv_cache}")


def _int_list(ctx, param, value):
    if value is None:
        return None
    try:
        return tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated whole numbers, got {value!r}") from None


@main.command("scan")
@config_options
@click.option("--db", "db_path", required=True, type=click.Path(dir_okay=False),
              help="SQLite database; each cell is committed as soon as it is computed.")
@click.option("--cp", "cp_values", callback=_int_list, default="1,2,4,8,16", show_default=True,
              help="Comma-separated cp values.")
@click.option("--seq-len", "seq_lens", callback=_int_list,
              default="32768,65536,131072,262144,524288,1048576", show_default=True,
              help="Comma-separated sequence lengths.")
@click.option("--hidden-threshold", default=0.9, show_default=True, type=float,
              help="Ring traffic counts as hidden when at least this fraction of it overlaps compute.")
def scan_cmd(config, overrides, disabled, db_path, cp_values, seq_lens, hidden_threshold):
    """CP validation scan: a cp x seq_len grid with chips fixed (dp absorbs cp); checks that
    TTFT does not rise with cp where the ring traffic is hidden. Exit 1 if it does."""
    from .run import load_raw
    from .scan import run_scan

    raw = load_raw(config, overrides)
    report = run_scan(raw, db_path, cp_values, seq_lens, disabled, hidden_threshold,
                      progress=lambda line: click.echo(line, err=True))
    ok = [c for c in report.cells if c.status == "ok"]
    click.echo(f"scan {report.scan_id}: {len(ok)} of {len(report.cells)} cells ran; results in {db_path}")
    if report.phase != "prefill":
        click.echo("the TTFT trend check applies to prefill only; nothing checked")
        return
    if report.violations:
        click.echo("TTFT rises with cp where the ring traffic is hidden:")
        for v in report.violations:
            click.echo(f"  {v}")
        sys.exit(1)
    click.echo("TTFT is non-increasing in cp wherever the ring traffic is hidden")


@main.command("models")
def models_cmd():
    """List the model catalog."""
    from .models import CATALOG

    rows = []
    for name, m in CATALOG.items():
        c = m.param_counts()
        rows.append([name, m.attention.kind, m.n_layers, m.hidden_size, f"{c.total / 1e9:.1f}B",
                     f"{c.active / 1e9:.1f}B", m.moe.n_routed_experts if m.moe else "-",
                     m.kv_bytes_per_token_per_layer(2)])
    click.echo(_table(rows, ["model", "attention", "layers", "hidden", "params", "active", "experts",
                             "c_kv bf16 (B)"]))
    click.echo("\nA model can also be a path to a Hugging Face config.json.")


@main.group("systems", invoke_without_command=True)
@click.pass_context
def systems_cmd(ctx):
    """List the system catalog (`g5 systems show NAME` for one system)."""
    if ctx.invoked_subcommand is not None:
        return
    from .systems import CATALOG_NAMES, get_system

    rows = []
    for name in CATALOG_NAMES:
        s = get_system(name)
        rows.append([name, s.chips_per_node, f"{s.hbm_capacity_bytes / GIB:.0f}", f"{s.hbm_bw_bytes_per_s / 1e12:.2f}",
                     f"{s.peak_flops_per_s['bf16'] / 1e12:.0f}", f"{s.intra_node_bw_bytes_per_s / 1e9:.0f}",
                     f"{s.network_bw_bytes_per_s / 1e9:.0f}"])
    click.echo(_table(rows, ["system", "chips/node", "HBM GiB", "HBM TB/s", "bf16 TFLOP/s", "link GB/s",
                             "network GB/s"]))
    click.echo("\nA system can also be a path to a YAML file with the same fields (docs/system-file.md); "
               "`g5 systems show NAME` prints one.")


@systems_cmd.command("show")
@click.argument("name")
def systems_show_cmd(name):
    """Print one system (a catalog name or a system file) with its sources, after checking it."""
    from .systems import system_source

    click.echo(system_source(name).rstrip("\n"))


@main.command("plugins")
@click.option("--disable", "disabled", multiple=True, metavar="NAME", help="Show the set with NAME disabled.")
def plugins_cmd(disabled):
    """List every plugin, enabled or disabled, with the hooks it implements."""
    from .plugins import describe_plugins, make_plugin_manager

    pm = make_plugin_manager(disabled=disabled)
    rows = [[p.name, "enabled" if p.enabled else "disabled",
             (", ".join(p.hooks) or "-") if p.enabled else "(not loaded while disabled)"]
            for p in describe_plugins(pm)]
    click.echo(_table(rows, ["plugin", "state", "hooks"]))


if __name__ == "__main__":  # pragma: no cover
    main()
