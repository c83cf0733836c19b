"""What ``g5 serve`` shows and writes: the readable summary, the per-request CSV and the
Perfetto trace (one track per instance with its steps, one per request with its spans)."""
from __future__ import annotations

import json
import math

import numpy as np

from g5core.serve.kvcache import caches_of
from g5core.serve.metrics import per_request

GIB = float(2 ** 30)
REQUEST_COLUMNS = ("id", "arrival_s", "input_tokens", "output_tokens", "cached_tokens", "instance", "decode_instance",
                   "queue_s", "ttft_s", "tpot_s", "max_itl_s", "e2e_s", "kv_transfer_s")
#: with a block cache, after those: the prompt blocks found in HBM, fetched from a lower tier
#: or found there and recomputed, and what waiting for the fetch added to the first step
CACHE_COLUMNS = ("hbm_hit_blocks", "fetched_blocks", "recomputed_blocks", "fetch_s")


def _s(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if x >= 1 or x == 0:
        return f"{x:.4g} s"
    if x >= 1e-3:
        return f"{x * 1e3:.4g} ms"
    return f"{x * 1e6:.4g} us"


def render_goodput(g: dict) -> list[str]:
    """Two lines: the per-request share (every limit's threshold applied to each request) and
    the run's verdict (percentile limits on the run's percentiles, the others on every request)."""
    thresholds = {}
    for key, limit in g["limits"].items():
        metric = key.split("_p")[0]
        thresholds[metric] = min(limit, thresholds.get(metric, limit))
    each = ", ".join(f"{k} <= {_s(v)}" for k, v in thresholds.items())
    lines = [f"goodput      {g['share']:.1%} of requests each have {each}: {g['requests_per_s']:.3g} requests/s"]
    parts = [f"{key} = {_s(c['value_s'])} {'<=' if c['met'] else '>'} {_s(c['limit_s'])}"
             for key, c in g["percentile_limits"].items()]
    every = [k for k in g["limits"] if k not in g["percentile_limits"]]
    if every:
        missing = g.get("requests_missing_per_request_limits", 0)
        parts.append(f"{missing:,} request{'s' if missing != 1 else ''} miss{'' if missing != 1 else 'es'} "
                     f"{', '.join(every)} (a limit on every request)" if missing else
                     f"every request meets {', '.join(every)}")
    lines.append(f"SLO          {g.get('verdict', 'met' if g['all_met'] else 'missed')}: {'; '.join(parts)}")
    return lines


def render_summary(out: dict, outputs: dict | None = None) -> str:
    """The summary of ``g5 serve`` (``out``: the ``--json`` object)."""
    t = out["throughput"]
    pools = out["pools"]
    lines = []
    systems = list(dict.fromkeys(p.get("system") for p in pools))
    mixed = len(systems) > 1    # heterogeneous disaggregation: each pool on its own system
    layout = "; ".join(
        f"{p['role']}: {p['instances']} instance{'s' if p['instances'] > 1 else ''} of {p['chips_per_instance']} "
        f"{p['system'] + ' ' if mixed else ''}chip{'s' if p['chips_per_instance'] > 1 else ''} "
        f"({', '.join(f'{k}={v}' for k, v in p['layout'].items() if v != 1) or 'one chip'}), KV pool "
        f"{p['kv_pool_bytes_per_chip'] / GIB:.2f} GiB per chip = {p['kv_capacity_tokens']:,} tokens per instance"
        + ("" if p.get("mixed_prefill", True) else ", prefill steps apart from decode")
        for p in pools)
    split = (" (" + ", ".join(f"{sum(p['instances'] * p['chips_per_instance'] for p in pools if p['system'] == name)} "
                              f"{name}" for name in systems) + ")") if mixed else ""
    lines.append(f"deployment   {out['chips']} chips{split}; {layout}")
    lines.append(f"workload     {out['workload']}: {out['requests']:,} requests, {out['tokens']['input']:,} input and "
                 f"{out['tokens']['output']:,} output tokens")
    offered = t["offered_requests_per_s"]
    offered = "too many to count" if offered is None else f"{offered:.3g}"
    lines.append(f"arrivals     over {_s(out['arrival_span_s'])}, first to last ({offered} requests/s offered)")
    lines.append(f"makespan     {_s(out['makespan_s'])} simulated, first arrival to last token "
                 f"({t['requests_per_s']:.3g} requests/s served)")
    lines.append(f"completed    {out['completed']:,} of {out['requests']:,}; {out['steps']:,} steps; "
                 f"{out['preemptions']:,} preemptions")
    lines.append("")
    lines.append(f"{'latency':<13}{'mean':>11}{'p50':>11}{'p90':>11}{'p99':>11}")
    for key, label in (("queue_s", "queueing"), ("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "inter-token"),
                       ("e2e_s", "end to end"), ("kv_transfer_s", "KV transfer")):
        st = out.get(key)
        if st is None:
            continue
        lines.append(f"{label:<13}" + "".join(f"{_s(st[q]):>11}" for q in ("mean", "p50", "p90", "p99")))
    lines.append("")
    lines.append(f"throughput   {t['output_tokens_per_s']:,.0f} output tokens/s ({t['output_tokens_per_s_per_chip']:,.1f} "
                 f"per chip), {t['input_tokens_per_s']:,.0f} input tokens/s, {t['requests_per_s']:.3g} requests/s "
                 "(over the makespan)")
    lines.append(f"occupancy    KV pool {out['kv_pool_use']['mean']:.1%} mean, {out['kv_pool_use']['max']:.1%} max; "
                 f"running {out['running_seqs']['mean']:.1f} mean, {out['running_seqs']['max']:.0f} max; "
                 f"waiting {out['waiting_seqs']['mean']:.1f} mean, {out['waiting_seqs']['max']:.0f} max")
    cache = out.get("kv_cache")
    if cache:
        lines.append(f"KV cache     {cache['policy']}: {cache['hit_rate']:.1%} of {cache['lookup_blocks']:,} prompt blocks "
                     "looked up were cached")
        for t in cache["tiers"]:
            moved = (f"; {t['bytes_written'] / GIB:,.2f} GiB in, {t['bytes_read'] / GIB:,.2f} GiB fetched"
                     if t["tier"] != "hbm" else "")
            recomputed = f", {t['recomputed_blocks']:,} recomputed" if t["recomputed_blocks"] else ""
            lines.append(f"  {t['tier']:<11}{t['hit_rate']:.1%} hit ({t['hit_blocks']:,} blocks{recomputed}), "
                         f"{t['evicted_blocks']:,} evicted; {t['cached_blocks']['mean']:,.0f} mean / "
                         f"{t['cached_blocks']['max']:,.0f} max of {t['capacity_blocks']:,} blocks{moved}")
        if "ranks" in cache:    # attention DP: each rank's own cache
            lines.append("  per rank   " + ", ".join(f"{r['rank']}: {r['hit_rate']:.1%} of {r['lookup_blocks']:,}"
                                                      for r in cache["ranks"]))
        split = cache["ttft_split_s"]
        lines.append("  TTFT mean   " + ", ".join(f"{k} {_s(split[k]['mean'])}" for k in ("queue", "fetch", "compute")))
    spec = out.get("speculative")
    if spec:
        mean, user = spec["mean_accepted_length"], out["per_user_tokens_per_s"]["p50"]
        mean_text = "-" if mean is None else f"{mean:.3g}"
        user_text = "-" if user is None else f"{user:,.1f}"
        lines.append(f"speculative  {spec['method']}, {spec['draft_tokens']} drafts: {mean_text} tokens per "
                     f"verification (expected {spec['expected_tokens_per_step']:.3g}) over "
                     f"{spec['verifications']:,}; per user {user_text} tokens/s p50")
    g = out.get("goodput")
    if g:
        lines.extend(render_goodput(g))
    p = out.get("step_predictor")
    if p:
        parts = [f"{role}: median {e['median_rel']:.2%}, max {e['max_rel']:.2%} on {e['steps_checked']} steps"
                 + _worst_text(e.get("worst")) for role, e in p.items() if e.get("steps_checked")]
        if parts:
            lines.append(f"predictor    error against the engine: {'; '.join(parts)} (--exact runs every step)")
    lines.append(f"simulated    {out['engine_runs']} distinct steps through the engine; {out['sim_wall_s']:.2f} s")
    for option, path in (outputs or {}).items():
        if path:
            lines.append(f"wrote        {option} {path}")
    return "\n".join(lines)


def _worst_text(worst) -> str:
    """`` (worst: a 4,000-token chunk, 231.0 ms predicted, 214.4 ms by the engine)``: the step
    the predictor is furthest from the engine on, where it is off by a percent or more."""
    if not worst or abs(worst["predicted_s"] / worst["engine_s"] - 1.0) < 0.01:
        return ""
    chunks = worst["chunks"]
    what = []
    if chunks:
        tokens = sum(n for n, _ in chunks)
        cached = sum(c for _, c in chunks)
        what.append((f"a {tokens:,}-token chunk" if len(chunks) == 1 else f"{len(chunks)} chunks of {tokens:,} "
                     "tokens") + (f" after {cached:,} cached" if cached else ""))
    if worst["decodes"]:
        n = worst["decodes"]
        what.append(f"{n:,} decode{'s' if n != 1 else ''} at {worst['decode_context_tokens'] / n:,.0f} tokens "
                    "of context")
    return (f" (worst: {' beside '.join(what)}, {worst['predicted_s'] * 1e3:.4g} ms predicted, "
            f"{worst['engine_s'] * 1e3:.4g} ms by the engine)")


def write_requests_csv(result, fh) -> None:
    """One row per request (the workload's order), the columns of :data:`REQUEST_COLUMNS`
    (and :data:`CACHE_COLUMNS` with a block cache)."""
    a = per_request(result)
    log = result.requests
    cache = {}
    caches = [c for inst in result.instances for c in caches_of(inst.scheduler)]
    for c in caches:
        cache.update(c.per_request)
    caching = bool(caches)
    fh.write(",".join(REQUEST_COLUMNS + (CACHE_COLUMNS if caching else ())) + "\n")

    def cell(x):
        return "" if isinstance(x, float) and math.isnan(x) else repr(float(x)) if isinstance(x, float) else str(x)
    for k, r in enumerate(result.workload.requests):
        row = (r.id, float(a["arrival_s"][k]), r.input_tokens, r.output_tokens, r.cached_tokens, log.instance[k],
               log.decode_instance[k] if log.decode_instance[k] >= 0 else "", float(a["queue_s"][k]),
               float(a["ttft_s"][k]), float(a["tpot_s"][k]), float(a["max_itl_s"][k]), float(a["e2e_s"][k]),
               float(a["kv_transfer_s"][k]))
        if caching:
            row += tuple(cache.get(r.id, (0, 0, 0, 0.0)))
        fh.write(",".join(cell(x) for x in row) + "\n")


def dump_trace(result, fh) -> None:
    """Perfetto / Chrome JSON: a process per instance (its steps: prefill tokens, decodes,
    KV blocks in use), and a process of requests with a thread each (queued, prefill, KV
    transfer, decode spans). Times in microseconds."""
    us = 1e6
    events = []
    for pid, inst in enumerate(result.instances):
        name = f"{inst.pool.role} instance {inst.index}"
        events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}})
        events.append({"ph": "M", "pid": pid, "tid": 0, "name": "thread_name", "args": {"name": "steps"}})
        rows = np.frombuffer(inst.steps, dtype=float).reshape(-1, 7)
        for start, end, prefill, decodes, blocks, running, waiting in rows.tolist():
            events.append({"ph": "X", "pid": pid, "tid": 0, "ts": start * us, "dur": (end - start) * us,
                           "name": f"step: {int(prefill)} prefill tokens + {int(decodes)} decodes",
                           "args": {"prefill_tokens": int(prefill), "decodes": int(decodes),
                                    "kv_blocks_used": int(blocks), "running": int(running), "waiting": int(waiting)}})
            events.append({"ph": "C", "pid": pid, "ts": end * us, "name": "sequences",
                           "args": {"running": int(running), "waiting": int(waiting)}})
            events.append({"ph": "C", "pid": pid, "ts": end * us, "name": "KV blocks used",
                           "args": {"blocks": int(blocks)}})
        caches = caches_of(inst.scheduler)
        for rank, cache in enumerate(caches):   # the block cache (one per attention-DP rank): blocks per tier
            names = ["HBM"] + [t.spec.kind for t in cache.tiers]
            occ = np.frombuffer(cache.occupancy, dtype=float).reshape(-1, 1 + len(names))
            counter = "KV cache blocks" if len(caches) == 1 else f"KV cache blocks, rank {rank}"
            last = None
            for row in occ.tolist():
                if row[1:] != last:
                    events.append({"ph": "C", "pid": pid, "ts": row[0] * us, "name": counter,
                                   "args": {n: int(v) for n, v in zip(names, row[1:])}})
                    last = row[1:]
    fetch_s = {}
    for inst in result.instances:
        for cache in caches_of(inst.scheduler):
            for k, row in cache.per_request.items():
                if row[3] > 0:
                    fetch_s[k] = row[3]
    rpid = len(result.instances)
    events.append({"ph": "M", "pid": rpid, "name": "process_name", "args": {"name": "requests"}})
    a = per_request(result)
    log = result.requests
    for k, r in enumerate(result.workload.requests):
        events.append({"ph": "M", "pid": rpid, "tid": k, "name": "thread_name", "args": {"name": f"request {r.id}"}})
        arrival, sched = float(a["arrival_s"][k]), float(log.scheduled_s[k])
        first, finish = float(log.first_token_s[k]), float(log.finish_s[k])
        move = float(a["kv_transfer_s"][k])
        prefill_end = first - move if move == move else first
        fetch = fetch_s.get(k, 0.0)
        spans = [("queued", arrival, sched)]
        if fetch:
            spans.append(("KV fetch", sched, sched + fetch))
        spans.append(("prefill", sched + fetch, prefill_end))
        if move == move:
            spans.append(("KV transfer", prefill_end, first))
        spans.append(("decode", first, finish))
        for name, t0, t1 in spans:
            if t1 > t0:
                events.append({"ph": "X", "pid": rpid, "tid": k, "ts": t0 * us, "dur": (t1 - t0) * us, "name": name,
                               "args": {"input_tokens": r.input_tokens, "output_tokens": r.output_tokens,
                                        "instance": int(log.instance[k])}})
    json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, fh, allow_nan=False)
