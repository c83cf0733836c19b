"""Every text G5 prints for a person: run summaries, layouts, tables, reports.

Commands (g5core.present.cli) compute and call these; nothing here simulates.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

import yaml

from g5core.inputs.serving import parse_slo
from g5core.session.collbench import ALIASES
from g5core.sim.compute import MEASURED
from g5core.sim.memory import GIB
from g5core.sim.results import network_load, step_choices
from g5core.study.search import SearchResult, layout_label
from g5core.study.serving.space import short_label, speculative_label
from g5core.lower.symmetry import plan_symmetry
from g5core.present.caveats import plural
from g5core.study.validate import describe_suspect


def fmt_s(seconds: float) -> str:
    """Four significant digits at any magnitude: 1.244 s, 83.72 s, 41.53 ms, 4.888e+09 s."""
    if seconds >= 1 or seconds == 0:
        return f"{seconds:.4g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.4g} ms"
    return f"{seconds * 1e6:.4g} us"


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2.0 ** 20), ("KiB", 1024.0)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _option_items(dep, given: bool) -> list[str]:
    """``plugin.option=value`` for the plugin options a deployment sets (``given``) or defaults."""
    return [f"{plugin}.{name}={json.dumps(value)}" for plugin, values in dep.options for name, value in values
            if (f"{plugin}.{name}" not in dep.implicit) == given]


def _unused(dep, dim: str) -> bool:
    """A dimension the configuration left out and that has size 1: not shown."""
    return dim in dep.implicit and dep.size(dim) == 1


def _options_note(dep) -> str:
    """Plugin options switched on (boolean true), for the one-line header: `` tp.sp``."""
    return "".join(f" {plugin}.{name}" for plugin, values in dep.options for name, value in values if value is True)


def _pipeline_line(p: dict, pp: int, tokens_per_s_per_chip: float) -> str:
    """What a micro-batched run measured (g5core.lower.microbatch)."""
    if "chunk_tokens" in p:
        sizes = sorted(set(p["chunk_tokens"]))
        return (f"pipeline: every prompt in {p['microbatches']} chunks of {' or '.join(map(str, sizes))} tokens "
                f"through {pp} stages; {tokens_per_s_per_chip:.4g} tokens/s/chip")
    steady = "steady" if p["steady"] else "NOT steady"
    return (f"pipeline: {p['microbatches']} micro-batches of {p['batch_sequences'][0]} sequences cycling through {pp} "
            f"stages; step interval {fmt_s(p['step_interval_s'])}, cycle {fmt_s(p['cycle_s'])} (TPOT), "
            f"{steady} after {p['cycles_simulated']} cycles; {tokens_per_s_per_chip:.4g} tokens/s/chip")


def _source_note(source: str) -> str:
    """Where a speculative acceptance came from, shortened to its citation's title."""
    return "from the configuration" if source == "configuration" else "published: " + source.split(",")[0]


def render_summary(out, trace_path=None, timeline_path=None) -> str:
    dep = out.deployment
    lines = []
    par = " ".join(f"{k}={v}" for k, v in dep.parallel if not _unused(dep, k))
    model, system = out.plan.ctx.model.name, out.plan.ctx.system.name
    work = (f"{dep.phase} step {dep.step.describe()}" if dep.step_form
            else f"{dep.phase}, batch {dep.batch}, seq_len {dep.seq_len}")
    lines.append(f"{model} on {dep.chips} x {system}  [{par}{_options_note(dep)}]  {work}, path {dep.path}")
    metric = {"prefill": "TTFT", "decode": "TPOT"}.get(dep.phase, "step latency")
    spec = getattr(out, "speculative", None)
    if spec is not None:
        sp = spec.spec
        lines.append(f"TPOT per output token: {fmt_s(spec.tpot_s)}  (speculative {sp.method}, {sp.tokens} draft "
                     f"token{'s' if sp.tokens != 1 else ''}; plain decode {fmt_s(spec.plain_decode_s)}, "
                     f"x{spec.speedup:.3g})")
        lines.append(f"tokens per step: {spec.tokens_per_step:.4g} (acceptance "
                     f"{', '.join(f'{a:.3g}' for a in sp.acceptance)}; {_source_note(sp.source)}); step "
                     f"{fmt_s(spec.step_s)} = verification {fmt_s(spec.verify_s)} + proposer {sp.tokens} x "
                     f"{fmt_s(spec.proposer_pass_s)} ({100 * spec.proposer_share:.1f}% of the step)")
    else:
        lines.append(f"{metric}: {fmt_s(out.latency_s)}")
    if out.sim is not None and out.sim.pipeline is not None:
        lines.append(_pipeline_line(out.sim.pipeline, dep.size("pp"), out.tokens_per_s_per_chip))
    for plugin, choice in step_choices(out.plan.ctx).items():
        lines.append(f"{plugin} chose " + ", ".join(f"{k} {v}" for k, v in choice.items()))
    for _plugin, notes in out.plan.hooks.call_each("g5_run_notes", ctx=out.plan.ctx):
        lines.extend(str(n) for n in notes)
    if out.sim is None:
        lines.append(f"closed form: compute {fmt_s(out.math.compute_s)} + communication {fmt_s(out.math.comm_s)} "
                     "(alpha-beta), no overlap, no contention")
    if out.sim is not None:
        sim = out.sim
        if out.math is not None:
            ratio = out.math.latency_s / sim.latency_s if sim.latency_s else float("nan")
            lines.append(f"{metric} (Math path): {fmt_s(out.math.latency_s)}  (math / g5 = {ratio:.3f})")
        ov = sim.overlap
        sym = sim.symmetry
        of = f" (one of {sym.replicas} identical {sym.dimension} replicas)" if sym.applied else ""
        lines.append(f"simulated {sim.ops} ops, {sim.flows} flows, {sim.events} events{of} in {sim.sim_wall_s:.2f} s; "
                     f"conservation KPIs all 0")
        if not sym.applied and sym.dimension is not None:
            lines.append(f"every chip simulated: {sym.reason}")
        lines.append("")
        lines.append("communication by reason (times on the chip where it is most exposed)")
        rows = []
        for reason in sorted(sim.comm_bytes["by_reason"]):
            o = ov["by_reason"].get(reason, {})
            rows.append([reason, fmt_bytes(sim.comm_bytes["by_reason"][reason]),
                         fmt_bytes(sim.comm_bytes["per_rank_by_reason"][reason]),
                         fmt_s(o.get("comm_time_s", 0.0)), fmt_s(o.get("exposed_comm_s", 0.0)),
                         f"{100 * o.get('hidden_fraction', 1.0):.1f}%"])
        if rows:
            rows.append(["(all)", fmt_bytes(sim.comm_bytes["total_bytes"]), "", fmt_s(ov["comm_time_s"]),
                         fmt_s(ov["exposed_comm_s"]), f"{100 * ov['hidden_fraction']:.1f}%"])
            lines.append(table(rows, ["reason", "total bytes", "busiest rank sent", "comm time", "exposed",
                                       "hidden"]))
        else:
            lines.append("  none")
        tiers = network_load(sim, out.plan.ctx.topology)
        if tiers:
            lines.append("network load by tier (the busiest port of each; wire bytes)")
            lines.append(table([[t["tier"], t["ports"], fmt_bytes(t["bytes"]), t["busiest_port"],
                                 fmt_bytes(t["busiest_bytes"]), f"{100 * t['utilization']:.1f}%",
                                 f"{100 * t['busy_fraction']:.1f}%"] for t in tiers],
                               ["tier", "ports used", "bytes sent", "busiest port", "its bytes",
                                "its utilization", "its busy time"]))
        how: dict = {}
        for c in sim.collectives:
            label = f"{c['algorithm']}/{c['protocol']}" if c["protocol"] else c["algorithm"]
            per = how.setdefault(c["reason"], {})
            per[label] = per.get(label, 0) + c["ops"]
        if how:
            lines.append("how they ran (ops by algorithm/protocol): " + "; ".join(
                f"{reason} " + ", ".join(f"{n} {label}" for label, n in sorted(per.items())) for reason, per in sorted(how.items())))
    report = out.sim.compute if out.sim is not None else out.math.compute
    if report:
        lines.append("")
        lines.extend(render_compute(report))
    mem = out.memory
    lines.append("")
    worst = mem.worst()
    lines.append(f"memory per chip (largest: chip {worst.chip})")
    lines.append(table([[
        fmt_bytes(worst.weights_bytes), fmt_bytes(worst.kv_cache_bytes), fmt_bytes(worst.activation_bytes),
        fmt_bytes(worst.workspace_bytes), fmt_bytes(worst.total_bytes), fmt_bytes(worst.capacity_bytes)]],
        ["weights", "kv cache", "activations", "workspace", "total", "capacity"]))
    for term in mem.terms:
        if term.part_of:
            lines.append(f"  of the {term.part_of}: {term.name.replace('_', ' ')} {fmt_bytes(term.on(worst.chip))}")
    short = mem.shortfall_summary()
    lines.append(f"DOES NOT FIT: {short}" if short else "fits on every chip")
    if trace_path:
        lines.append(f"trace written to {trace_path} (open in https://ui.perfetto.dev)")
    if timeline_path:
        lines.append(f"per-op timeline written to {timeline_path} (CSV)")
    return "\n".join(lines)


def render_explain(plan, given_dims: tuple[str, ...] = ()) -> str:
    """The layout of a prepared run; ``given_dims`` are the parallel keys the configuration
    set (the others are reported as defaults)."""
    ctx = plan.ctx
    dep, m, sysm, rm = ctx.deployment, ctx.model, ctx.system, ctx.rankmap
    counts = m.param_counts()
    a = m.attention
    kv_desc = (f"latent {a.kv_lora_rank}+{a.qk_rope_head_dim}" if a.kind == "mla" else f"{a.n_kv_heads} KV heads")
    lines = [f"model   {m.name}: {m.n_layers} layers, hidden {m.hidden_size}, {a.kind.upper()} "
             f"({a.n_heads} heads, {kv_desc}), "
             f"{counts.total / 1e9:.1f}B params ({counts.active / 1e9:.1f}B active), "
             f"c_kv {m.kv_bytes_per_token_per_layer(dep.dtypes.kv_cache_element_bytes)} B/token/layer ({dep.dtypes.kv_cache})"
             + (f"; attention {m.attention_pattern()}" if m.has_windows else ""),
             f"system  {sysm.name}: {sysm.chips_per_node} chips/node, {sysm.hbm_capacity_bytes / GIB:.0f} GiB HBM, "
             f"link {sysm.intra_node_bw_bytes_per_s / 1e9:.1f} GB/s per chip, {sysm.nics} NICs of "
             f"{sysm.network_bw_bytes_per_s / 1e9:.0f} GB/s per node (per direction), "
             f"NVLS {'yes' if sysm.nvls else 'no'}, "
             + (f"fabric {sysm.fabric['oversubscription']:g}:1 oversubscribed above every "
                f"{plural(int(sysm.fabric['nodes_per_leaf']), 'node')}" if sysm.fabric and sysm.fabric['oversubscription'] > 1
                else "full-bisection fabric"),
             f"layout  {plural(dep.chips, 'chip')} on {plural(rm.nodes, 'node')}; rank order (outer to inner): "
             + ", ".join(f"{n}={s}" for n, s in zip(rm.factor_names, rm.factor_sizes) if not _unused(dep, n)),
             (f"step    {dep.phase}: {dep.step.describe()} per replica, path {dep.path}" if dep.step_form else
              f"phase   {dep.phase}, batch {dep.batch} per replica, seq_len {dep.seq_len}, path {dep.path}")
             + "".join(f", {item}" for item in _option_items(dep, given=True)),
             f"dtypes  {_describe_dtypes(dep.dtypes)}"]
    # the defaults this run used: dimensions the configuration left out (those of every
    # installed plugin), plugin options it left unset
    defaults = [f"parallel.{d.name} is {d.default} when omitted" for d in ctx.dims.dims
                if d.default is not None and d.name not in given_dims]
    defaults += [f"plugins.{item.replace('=', ' is ', 1)} when omitted" for item in _option_items(dep, given=False)]
    if defaults:
        lines.append("defaults: " + ", ".join(defaults))
    s = ctx.shape
    kv_local = "the whole MLA latent" if a.kind == "mla" else f"{s.kv_heads:g} KV heads"
    if s.kv_cache_shard > 1:
        kv_local += f" ({s.kv_heads / s.kv_cache_shard:g} of them in its KV cache)"
    if dep.path != "math":
        lines.append(plan_symmetry(ctx).describe())
    lines.append(f"per chip: {s.tokens:g} tokens in non-attention ops, {s.q_heads:g} query heads, {kv_local}, "
                 f"KV of {s.kv_len:g} tokens per sequence")
    for dim in rm.dims:
        if _unused(dep, dim):
            continue
        groups = rm.groups(dim)
        size = len(groups[0])
        crossing = [g for g in groups if rm.crosses_nodes(g)]
        lines.append("")
        lines.append(f"{dim} groups: {len(groups)} of {size}"
                     + (f"; {len(crossing)} cross node boundaries" if crossing else "; all inside one node"))
        # up to four groups in full; more as the first, a count, and the last
        shown = groups if len(groups) <= 4 else (groups[0], None, groups[-1])
        for g in shown:
            if g is None:
                lines.append(f"  ... {len(groups) - 2} more groups"
                             + (f" ({len(crossing)} of all {len(groups)} cross nodes)" if crossing else ""))
                continue
            mark = "  (crosses nodes)" if rm.crosses_nodes(g) else ""
            lines.append(f"  {list(g)}{mark}")
    return "\n".join(lines)


def _describe_dtypes(dtypes) -> str:
    weights = dict(dtypes.weights)
    others = ", ".join(f"{k} {v}" for k, v in weights.items() if k != "default")
    return (f"weights {weights['default']}" + (f" ({others})" if others else "")
            + f", activations {dtypes.activations}, kv_cache {dtypes.kv_cache}")


def render_validate(report: dict) -> str:
    rows = [[r["row"], r["config"], r["metric"], f"{r['measured_ms']:.3f}", f"{r['predicted_ms']:.3f}",
             f"{r['error_pct']:+.1f}%", r["source"][:60]] for r in report["rows"]]
    lines = [table(rows, ["row", "config", "metric", "measured ms", "predicted ms", "error", "source"]), "",
             f"MAPE {report['mape_pct']:.1f}% over {len(rows)} rows; worst: row {report['worst_row']} "
             f"({report['worst_error_pct']:+.1f}%)"]
    for g in report.get("by_framework", ()):
        lines.append(f"  {g['framework']} {g['metric']}: MAPE {g['mape_pct']:.1f}% over {g['rows']} row"
                     f"{'s' if g['rows'] != 1 else ''}; worst: row {g['worst_row']} ({g['worst_error_pct']:+.1f}%)")
    trends = report.get("tp_trends", ())
    if trends:
        lines.append("error against the TP degree (rows equal but for it; trend: the highest TP's error less the "
                     "lowest's)")
        for t in trends:
            errors = ", ".join(f"TP{tp} {e:+.1f}%" for tp, e in t["errors_by_tp"])
            lines.append(f"  {t['framework']} {t['metric']} {t['config']}: {errors}; "
                         f"trend {t['trend_pts']:+.1f} points")
    return "\n".join(lines)


def render_calibrate(report: dict) -> str:
    lines = [f"fitted on system {report['system']} (bounded least squares on log error):"]
    for k, v in report["fitted"].items():
        note = "  NOT identifiable from these rows (no row depends on it)" if k in report["unidentifiable"] else ""
        lines.append(f"  {k}: {report['start'][k]:.6g} -> {v:.6g}{note}")
    has_loo = report["loo_mape_pct"] is not None
    rows = [[r["row"], r["config"], f"{r['measured_ms']:.3f}", f"{r['predicted_ms']:.3f}", f"{r['error_pct']:+.2f}%"]
            + ([f"{r['loo_error_pct']:+.2f}%"] if has_loo else []) for r in report["rows"]]
    lines += ["", table(rows, ["row", "config", "measured ms", "fitted ms", "residual"]
                         + (["leave-one-out"] if has_loo else [])), ""]
    lines.append(f"rms log error {report['rms_log_error']:.4f}; MAPE {report['mape_pct']:.2f}% in sample "
                 f"(prior {report['prior_mape_pct']:.2f}%)"
                 + (f", leave-one-out {report['loo_mape_pct']:.2f}%" if has_loo else ""))
    for s in report["suspect"]:
        lines.append(f"suspect: {describe_suspect(s)}")
    lines.append(f"writing {report['output']}" if report["written"] else f"not written: {report['refused']}")
    return "\n".join(lines)


def render_compute(report: dict) -> list[str]:
    """Summary lines of a :func:`coverage_report`."""
    cov = report["coverage"]
    prof = report["profile"]
    where = f"profile {prof['source']}/{prof['gpu']}/{prof['framework']}" if prof else "no measured profile"
    parts = ", ".join(f"{k} {100 * v[MEASURED]:.0f}%" for k, v in cov.items() if k != "all")
    lines = [f"compute time: {100 * cov['all'][MEASURED]:.1f}% measured ({where}), "
             f"{100 * (1 - cov['all'][MEASURED]):.1f}% {report['model']}; measured by class: {parts or 'none'}"]
    launch = report.get("launch") or {}
    if launch.get("framework"):
        fw = launch["framework"]
        graph = fw.get("graph_kernel_s")
        inside = "" if graph is None else f", {graph * 1e6:g} us per kernel inside a graph instead of launch_overhead_s"
        name = f"framework {fw['name']} {fw.get('version', '')}: " if fw.get("name") else ""
        lines.append(f"kernel launches: {launch['added_s'] * 1e3:.3f} ms added on the busiest chip "
                     f"({name}cuda_graphs: {fw['cuda_graphs']}, {fw['kernel_launch_s'] * 1e6:g} us per kernel not "
                     f"captured{inside})")
        fused = [name for name, on in (fw.get("fusions") or {}).items() if on]
        lines.append(f"kernel fusions: stack {fw.get('stack', 'generic')} ({', '.join(fused) or 'none'}; a fused kernel "
                     f"is neither timed nor launched on its own)")
    chips = report["per_chip"]
    if chips:
        best = max(chips, key=lambda c: (c["mfu"], -c["chip"]))
        low = min(chips, key=lambda c: (c["mfu"], c["chip"]))
        lines.append(f"achieved per chip: {best['achieved_tflops']:.1f} TFLOP/s, MFU {100 * best['mfu']:.1f}% "
                     f"(chip {best['chip']}; lowest: chip {low['chip']}, {low['achieved_tflops']:.1f} TFLOP/s, "
                     f"MFU {100 * low['mfu']:.1f}%)")
    return lines


def render_best(result: SearchResult, top: int) -> str:
    """The text of ``g5 best``: top K, the Pareto front, and why the others were excluded.
    One column per dimension the candidates use and vary (a dense model's search has no ep;
    a dimension at 1 in every candidate says nothing and is left out)."""
    obj_col = {"ttft": "TTFT", "tpot": "TPOT", "tokens_per_s_per_chip": "tokens/s/chip",
               "latency": "latency"}[result.objective]
    cands = (*result.ranked, *result.pareto)
    dims = sorted({d for c in cands for d in c.parallel})
    dims = [d for d in dims if any(c.parallel.get(d, 1) != 1 for c in cands)] or dims

    def rows(cands, rank=True):
        return [([i + 1] if rank else []) + [c.parallel.get(d, 1) for d in dims]
                + [fmt_s(c.latency_s), f"{c.tokens_per_s_per_chip:.4g}", fmt_bytes(c.max_total_bytes)]
                for i, c in enumerate(cands)]

    head = dims + ["latency", "tokens/s/chip", "max memory per chip"]
    simulated = len(result.ranked)
    lines = [f"{result.layouts} layouts: {simulated} simulated, {len(result.excluded)} excluded; "
             f"ranked by {obj_col} (best first)", table(rows(result.ranked[:top]), ["rank"] + head)]
    lines += ["", "Pareto front (no other layout is both faster and lighter per chip):",
              table(rows(result.pareto, rank=False), head)]
    if result.excluded:
        lines += ["", "excluded:"]
        for family, members in result.families():
            examples = ", ".join(f"[{layout_label(e.parallel)}]" for e in members[:3])
            more = f" and {len(members) - 3} more" if len(members) > 3 else ""
            if family == "memory":
                lo = min(e.shortfall_bytes for e in members) / GIB
                hi = max(e.shortfall_bytes for e in members) / GIB
                by = f"{lo:.2f} GiB" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f} to {hi:.2f} GiB"
                lines.append(f"  does not fit: {len(members)} layout(s), short by {by}: {examples}{more}")
            else:
                lines.append(f"  {family}: {len(members)} layout(s) ({examples}{more}); e.g. {members[0].reason}")
    return "\n".join(lines)


def render_serve_best(result, top: int) -> str:
    """The text of ``g5 best --serve`` (a :class:`g5core.study.serving.ServeSearchResult`):
    top K, the Pareto front, why the winner, what was pruned."""
    cols = _slo_columns(result.settings.slo)

    def rows(items, rank=True):
        out = []
        for i, s in enumerate(items):
            j = s.to_json_dict()
            spec = j["speculative"]
            out.append(([i + 1] if rank else []) + [
                "disagg" if j["disaggregated"] else "agg", s.candidate.label(speculative=False),
                "off" if spec is None else f"{spec['method']}:{spec['tokens']} ({spec['tokens_per_step']:.3g} tok/step)",
                f"{s.capacity:.4g}",
                f"{j['goodput_per_chip']:.4g}", f"{j['output_tokens_per_s_per_chip']:.4g}",
                f"{j['output_tokens_per_s_per_user']:.4g}"]
                + [_slo_cell(s.cell.get("held") or {}, metric, key) for _, metric, key in cols]
                + [fmt_bytes(j["max_total_bytes"])])
        return out

    head = ["kind", "deployment", "speculative", "capacity req/s", "goodput req/s/chip", "out tok/s/chip", "out tok/s/user",
            *(name for name, _, _ in cols), "memory per chip"]
    st = result.settings
    lines = [f"serving search, SLO {st.slo}: {result.layouts} layout x chunk cells screened, {len(result.pruned)} "
             f"pruned; {result.candidates} candidates simulated ({result.runs} serving runs"
             + (f"; {result.same_runs} more took a max_num_seqs variant's capacity search, its runs holding or "
                "failing alike" if result.same_runs else "")
             + (f"; {len(result.bounded)} bounded out, {_bounded_by(result.bounded)}, as they cannot reach the top "
                f"{st.top}" if result.bounded else "")
             + (f"; {result.skipped_by_beam} disaggregated layout pairs beyond --beam {st.beam} not tried"
                if result.skipped_by_beam else "") + f"); ranked by {result.objective}"
             + (f" at {st.rate:g} req/s" if st.rate is not None else "") + " (best first)",
             f"capacity: the highest Poisson rate at which the SLO holds, bisected to within {st.tolerance:.0%}",
             table(rows(result.ranked[:top]), ["rank"] + head)]
    lines += ["", "Pareto front (output tokens/s per chip against per user, at capacity):",
              table(rows(result.pareto(), rank=False), head)]
    lines += ["", "aggregated against disaggregated (the best of each):"] + _sides(result.sides())
    lines += ["", "why: " + result.why()]
    if result.ranked:
        lines += ["", "the winner, as g5 serve takes it (g5 serve FILE reproduces its capacity):",
                  yaml.safe_dump(result.ranked[0].config, sort_keys=False).rstrip()]
    if result.pruned:
        lines += ["", "pruned:"]
        for family, members in result.families():
            examples = ", ".join(f"[{short_label(p.parallel)} chunk={p.chunk}"
                                 + (f" {speculative_label(p.speculative)}" if p.speculative else "") + "]"
                                 for p in members[:3])
            more = f" and {len(members) - 3} more" if len(members) > 3 else ""
            lines.append(f"  {family}: {len(members)} ({examples}{more}); e.g. {members[0].reason}")
    return "\n".join(lines)


def _sides(sides: Mapping) -> list[str]:
    """The best aggregated and disaggregated answers, one line each, and their ratio."""
    unit = "goodput req/s/chip" if sides["value"] == "goodput_per_chip" else "output tokens/s/chip"
    out = []
    for name in ("aggregated", "disaggregated"):
        side = sides[name]
        if side is None:
            out.append(f"  {name}: not searched (--disagg)")
        elif side["simulated"]:
            note = "" if side["exact"] else (
                f" (the best simulated; {side['bounded_above']} candidate{'s' if side['bounded_above'] != 1 else ''} "
                f"of this side bounded out by the ranking's bar could reach at most {side['at_most_value']:.4g} by "
                "their bounds)")
            out.append(f"  {name}: {side['deployment']}: {side['capacity_requests_per_s']:.4g} req/s, "
                       f"{side['value']:.4g} {unit}{note}")
        else:
            out.append(f"  {name}: not simulated, bounded out: {side['deployment']}: at most "
                       f"{side['at_most_capacity_requests_per_s']:.4g} req/s, {side['at_most_value']:.4g} {unit} "
                       "(a bound)")
    ratio = sides["disaggregated_over_aggregated"]
    if ratio is not None:
        out.append(f"  disaggregated / aggregated: {ratio:.3g}x")
    return out


def _slo_columns(slo) -> list[tuple[str, str, str]]:
    """The ranking table's latency columns: ``(heading, metric, key)`` for each limit the SLO
    names, at its percentile (``TTFT p99`` when it says ttft_p99), and TTFT and TPOT p90 when
    it names no limit on them."""
    limits = parse_slo(slo)
    out = [(f"{lim.metric.upper()} p{lim.percentile:g}", lim.metric, lim.key) if lim.percentile is not None
           else (f"{lim.metric.upper()} p99", lim.metric, f"{lim.metric}_p99") for lim in limits]
    for metric in ("ttft", "tpot"):
        if not any(lim.metric == metric for lim in limits):
            out.append((f"{metric.upper()} p90", metric, f"{metric}_p90"))
    order = {"ttft": 0, "tpot": 1, "itl": 2, "e2e": 3, "queue": 4}
    return sorted(out, key=lambda c: order.get(c[1], 9))


def _slo_cell(held: Mapping, metric: str, key: str) -> str:
    """A run's figure for one latency column: the SLO check's own value where the SLO names
    the limit, else the percentile of the run's statistics (ms for per-token metrics)."""
    value = ((held.get("percentile_limits") or {}).get(key) or {}).get("value_s")
    if value is None:
        pct = key.rpartition("_")[2]
        value = (held.get(f"{metric}_s") or {}).get(pct)
    if value is None:
        return "-"
    return f"{value * 1e3:.3g} ms" if metric in ("tpot", "itl") else f"{value:.3g} s"


def _bounded_by(bounded) -> str:
    """``2171 by their estimates, 48 by a failing run at the last ranked place's rate``."""
    what = {"estimate": "by their estimates", "simulated": "by their runs (a failing run at the last ranked place's rate, or a tie with it within "
                                          "the tolerance)",
            "saturated run": "by their saturated runs", "roles": "by their roles' bounds",
            "same runs": "by a max_num_seqs variant's failing run (the same runs)",
            "decode pool": "by their decode pool's TPOT miss with another prefill pool"}
    counts: dict = {}
    for b in bounded:
        counts[b.source] = counts.get(b.source, 0) + 1
    return ", ".join(f"{n} {what.get(src, src)}" for src, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def render_collective(primitive: str, system_name: str, chips: int, nodes: int, rows: list[dict]) -> str:
    """The table nccl-tests prints (size, count, type, redop, root; time in us, algbw and
    busbw in GB/s and #wrong, out-of-place then in-place), plus the algorithm, protocol and
    channels G5's NCCL model chose."""
    lines = [f"# {ALIASES.get(primitive, primitive)} on {chips} chips of {system_name} ({nodes} node"
             f"{'s' if nodes != 1 else ''}); time of the op alone, GB/s = 1e9 bytes/s; in-place = out-of-place "
             f"in G5 (same bytes moved), #wrong not checked",
             f"#{'':>51}{'out-of-place':>30}   {'in-place':>29}",
             f"#{'size':>12} {'count':>12} {'type':>8} {'redop':>6} {'root':>6} "
             f"{'time':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6} {'time':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
             f"  {'algorithm':<9} {'protocol':<8} channels",
             f"#{'(B)':>12} {'(elements)':>12} {'':>8} {'':>6} {'':>6} "
             f"{'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6} {'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7}"]
    for r in rows:
        half = (f"{r['time_s'] * 1e6:>9.2f} {r['algbw_bytes_per_s'] / 1e9:>7.2f} "
                f"{r['busbw_bytes_per_s'] / 1e9:>7.2f} {'-':>6}")
        lines.append(f" {r['size_bytes']:>12} {r['count']:>12} {r['type']:>8} {r['redop']:>6} {r['root']:>6} "
                     f"{half} {half}  {r['algorithm']:<9} {r['protocol']:<8} {r['channels']}")
    return "\n".join(lines)


def render_bench_rows(name: str, system_name: str, chips: int, nodes: int, params: dict, rows: list[dict]) -> str:
    """The table DeepEP's tests print for ``g5 collective ep_dispatch|ep_combine``: time per
    call and each logical bandwidth in GB/s."""
    columns = [k for k in rows[0] if k.endswith("_bytes_per_s")] if rows else []
    given = ", ".join(f"{k} {v}" for k, v in sorted(params.items()) if v is not None)
    lines = [f"# {name} on {chips} chips of {system_name} ({nodes} node{'s' if nodes != 1 else ''}); {given}; "
             "time of the call alone, GB/s = 1e9 bytes/s of the logical bytes per rank",
             f"#{'tokens':>9} {'time(us)':>11} " + " ".join(f"{c[:-len('_bytes_per_s')] + ' GB/s':>10}" for c in columns)
             + "  algorithm"]
    for r in rows:
        lines.append(f" {r['tokens']:>9} {r['time_s'] * 1e6:>11.2f} "
                     + " ".join(f"{r[c] / 1e9:>10.2f}" for c in columns) + f"  {r['algorithm']}")
    return "\n".join(lines)
