"""Serving metrics: per request (queueing, TTFT, TPOT, inter-token latencies, end to end),
their summary (mean, p50, p90, p99), throughput, goodput under SLO limits, KV-pool use.

Definitions (times in seconds, counted from the request's arrival):

- queueing delay: until the request's first step starts;
- TTFT: until its first token (with disaggregation: after its KV reached the decode pool);
- TPOT: ``(last token - first token) / (output tokens - 1)``, for requests of two tokens or more;
- inter-token latency: every gap between two consecutive tokens of a request;
- end to end: until its last token.

Percentiles are numpy's ``linear`` method (p50 is the median).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from g5core.inputs.serving import SloLimit
from g5core.serve.kvcache import caches_of

PERCENTILES = (50, 90, 99)


def stats(values: np.ndarray) -> dict:
    """``{mean, p50, p90, p99}`` (``None`` each when there is no value)."""
    v = np.asarray(values, dtype=float)
    v = v[~np.isnan(v)]
    if not len(v):
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    out = {"mean": float(np.mean(v))}
    for p, q in zip(PERCENTILES, np.percentile(v, PERCENTILES)):
        out[f"p{p}"] = float(q)
    return out


def per_request(result) -> dict[str, np.ndarray]:
    """The per-request metric arrays of a loop result."""
    log = result.requests
    arrival = np.frombuffer(log.arrival_s, dtype=float)
    first = np.frombuffer(log.first_token_s, dtype=float)
    last = np.frombuffer(log.last_token_s, dtype=float)
    emitted = np.frombuffer(log.emitted, dtype=np.int64)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(emitted > 1, (last - first) / np.maximum(emitted - 1, 1), np.nan)
    return {
        "arrival_s": arrival,
        "queue_s": np.frombuffer(log.scheduled_s, dtype=float) - arrival,
        "ttft_s": first - arrival,
        "tpot_s": tpot,
        "max_itl_s": np.frombuffer(log.max_itl_s, dtype=float),
        "e2e_s": np.frombuffer(log.finish_s, dtype=float) - arrival,
        "kv_transfer_s": np.frombuffer(log.transfer_s, dtype=float),
    }


def _metric(arrays: dict, metric: str) -> np.ndarray:
    return arrays[{"ttft": "ttft_s", "tpot": "tpot_s", "e2e": "e2e_s", "itl": "max_itl_s", "queue": "queue_s"}[metric]]


def goodput(arrays: dict, limits: tuple[SloLimit, ...], span_s: float, itl: np.ndarray) -> Optional[dict]:
    """Goodput under ``limits``, in two statements that cannot contradict each other:

    - per request: the requests meeting every limit's threshold as a request (``ttft_p99 <= 2 s``
      counts the requests whose TTFT is at most 2 s), their share and their rate over the run;
    - the run's verdict: each percentile limit checked on the run's percentile, each per-request
      limit on every request; ``all_met`` (``verdict`` ``met``) when all hold.
    """
    if not limits:
        return None
    n = len(arrays["ttft_s"])
    ok = np.ones(n, dtype=bool)
    checks = {}
    for lim in limits:
        values = _metric(arrays, lim.metric)
        # a request without the metric (one output token has no TPOT) meets its limit
        ok &= ~(values > lim.limit_s)
        if lim.percentile is None:
            continue
        source = itl if lim.metric == "itl" else values[~np.isnan(values)]
        value = float(np.percentile(source, lim.percentile)) if len(source) else 0.0
        checks[lim.key] = {"limit_s": lim.limit_s, "value_s": value, "met": value <= lim.limit_s}
    met = int(np.count_nonzero(ok))
    every = [lim for lim in limits if lim.percentile is None]
    if every:
        every_ok = np.ones(n, dtype=bool)
        for lim in every:
            every_ok &= ~(_metric(arrays, lim.metric) > lim.limit_s)
        missing = n - int(np.count_nonzero(every_ok))
    else:
        missing = 0
    all_met = all(c["met"] for c in checks.values()) and missing == 0
    return {
        "limits": {lim.key: lim.limit_s for lim in limits},
        "requests_meeting": met,
        "share": met / n if n else 0.0,
        "requests_per_s": met / span_s if span_s > 0 else 0.0,
        "percentile_limits": checks,
        "requests_missing_per_request_limits": missing,
        "all_met": all_met,
        "verdict": "met" if all_met else "missed",
    }


def summary(result, limits: tuple[SloLimit, ...] = (), itl_stats: bool = True) -> dict:
    """The run's summary (the keys of ``g5 serve --json``, less the deployment echo).
    ``itl_stats=False``: ``itl_s`` is ``None`` (every inter-token gap of a long run is
    millions of values; the serving search reads none of their statistics), unless a limit
    is on the inter-token latency."""
    reqs = result.workload.requests
    arrays = per_request(result)
    itl = np.frombuffer(result.requests.itl_s, dtype=float)
    itl_stats = itl_stats or any(lim.metric == "itl" for lim in limits)
    n = len(reqs)
    first_arrival_s = float(np.min(arrays["arrival_s"])) if n else 0.0
    span = result.makespan_s - first_arrival_s
    # the trace's (or workload's) own span: first to last arrival; the rate offered over it
    arrival_span_s = float(np.max(arrays["arrival_s"])) - first_arrival_s if n else 0.0
    in_tokens = sum(r.input_tokens for r in reqs)
    out_tokens = sum(r.output_tokens for r in reqs)
    chips = result.fleet.chips
    per_s = (lambda x: x / span) if span > 0 else (lambda x: 0.0)
    e2e = arrays["e2e_s"]
    kv_share, running, waiting = _occupancy(result)
    out = {
        "requests": n,
        "completed": int(np.count_nonzero(~np.isnan(e2e))),
        "duration_s": span,
        "makespan_s": span,
        "arrival_span_s": arrival_span_s,
        "queue_s": stats(arrays["queue_s"]),
        "ttft_s": stats(arrays["ttft_s"]),
        "tpot_s": stats(arrays["tpot_s"]),
        "itl_s": stats(itl) if itl_stats else None,
        "e2e_s": stats(e2e),
        "throughput": {
            "input_tokens_per_s": per_s(in_tokens),
            "output_tokens_per_s": per_s(out_tokens),
            "total_tokens_per_s": per_s(in_tokens + out_tokens),
            "output_tokens_per_s_per_chip": per_s(out_tokens) / chips,
            "total_tokens_per_s_per_chip": per_s(in_tokens + out_tokens) / chips,
            "requests_per_s": per_s(n),
            # None where the arrivals' span is too short for the rate to be a finite number
            "offered_requests_per_s": (n / arrival_span_s if n / arrival_span_s < math.inf else None)
            if arrival_span_s > 0 else 0.0,
        },
        "tokens": {"input": in_tokens, "output": out_tokens},
        "goodput": goodput(arrays, limits, span, itl),
        "preemptions": result.preemptions,
        "steps": result.steps,
        "mean_in_system": result.requests_time_s / span if span > 0 else 0.0,
        "kv_pool_use": kv_share,
        "running_seqs": running,
        "waiting_seqs": waiting,
        "kv_transfer_s": stats(arrays["kv_transfer_s"]) if result.fleet.disaggregated else None,
        **({"kv_cache": cache} if (cache := kv_cache(result, arrays)) is not None else {}),
    }
    spec = speculative_summary(result)
    if spec is not None:   # only then: a plain run's summary keeps its keys
        tpot = arrays["tpot_s"]
        with np.errstate(divide="ignore", invalid="ignore"):
            out["per_user_tokens_per_s"] = stats(np.where(tpot > 0, 1.0 / tpot, np.nan))
        out["speculative"] = spec
    return out


def speculative_summary(result) -> Optional[dict]:
    """Over the instances that decode speculatively: the verification steps of sequences, the
    tokens they kept and their mean (tokens per verification, the bonus token included); None
    without speculation."""
    scheds = [i.scheduler for i in result.instances if getattr(i.scheduler, "draft_tokens", 0)]
    if not scheds:
        return None
    steps = sum(s.verify_steps for s in scheds)
    tokens = sum(s.verify_tokens for s in scheds)
    spec = scheds[0].spec
    return {"method": spec.method, "draft_tokens": spec.tokens, "expected_tokens_per_step": spec.tokens_per_step,
            "verifications": steps, "kept_tokens": tokens, "mean_accepted_length": tokens / steps if steps else None}


def _caches(result) -> list:
    """Every block cache of the run: one per instance, or one per attention-DP rank."""
    return [c for i in result.instances for c in caches_of(i.scheduler)]


def kv_cache(result, arrays: Optional[dict] = None) -> Optional[dict]:
    """The block cache's figures (``None`` without one), summed over the instances: per tier
    (HBM first) its size, the blocks looked up that it held (``hit_rate``: of all the
    blocks looked up), fetched from it or recomputed, evicted from it and stored into it, the
    bytes written into it and read from it, its cached blocks over time (mean and max); and
    TTFT split into queueing, waiting for fetched KV, and the rest (compute; with
    disaggregation it includes the KV transfer)."""
    caches = _caches(result)
    if not caches:
        return None
    arrays = arrays if arrays is not None else per_request(result)
    first = caches[0]
    looked = sum(c.lookup_blocks for c in caches)
    names = ["hbm"] + [t.spec.kind for t in first.tiers]
    tiers = []
    for level, name in enumerate(names):
        sizes = [c.total_blocks if level == 0 else c.tiers[level - 1].capacity_blocks for c in caches]
        row = {"tier": name, "capacity_blocks": sum(sizes),
               "block_bytes": first.block_bytes}
        for key, values in first.counts.items():
            row[key] = sum(c.counts[key][level] for c in caches)
        row["hit_rate"] = row["hit_blocks"] / looked if looked else 0.0
        means, tops = [], []
        for c in caches:
            occ = np.frombuffer(c.occupancy, dtype=float).reshape(-1, 2 + len(c.tiers))
            if len(occ):
                means.append(float(occ[:, 1 + level].mean()))
                tops.append(float(occ[:, 1 + level].max()))
        row["cached_blocks"] = {"mean": float(np.sum(means)) if means else 0.0, "max": float(np.sum(tops))}
        tiers.append(row)
    fetch = np.zeros(len(arrays["ttft_s"]))
    for c in caches:
        for k, row in c.per_request.items():
            fetch[k] += row[3]
    queue, ttft = arrays["queue_s"], arrays["ttft_s"]
    hit = sum(t["fetched_blocks"] for t in tiers) + tiers[0]["hit_blocks"]
    out = {"policy": first.cache.policy_name, "lookup_blocks": looked,
           "hit_rate": hit / looked if looked else 0.0, "tiers": tiers,
           "ttft_split_s": {"queue": stats(queue), "fetch": stats(fetch), "compute": stats(ttft - queue - fetch)}}
    ranked = [caches_of(i.scheduler) for i in result.instances if hasattr(i.scheduler, "ranks")]
    if ranked:
        out["ranks"] = _per_rank(ranked)
    return out


def _per_rank(ranked: list[list]) -> list[dict]:
    """Attention DP: each rank's cache figures (rank ``r`` summed over the instances), HBM's
    hits and evictions and the blocks found in any tier; the totals above are their sums."""
    rows = []
    for r in range(max(len(caches) for caches in ranked)):
        caches = [cs[r] for cs in ranked if r < len(cs)]
        looked = sum(c.lookup_blocks for c in caches)
        found = sum(c.counts["hit_blocks"][0] + sum(c.counts["fetched_blocks"][1:]) for c in caches)
        rows.append({"rank": r, "lookup_blocks": looked, "hit_rate": found / looked if looked else 0.0,
                     "hbm_hit_blocks": sum(c.counts["hit_blocks"][0] for c in caches),
                     "hbm_evicted_blocks": sum(c.counts["evicted_blocks"][0] for c in caches)})
    return rows


def _occupancy(result) -> tuple[dict, dict, dict]:
    """Time-weighted mean and the maximum of KV-pool use (share of blocks), running and
    waiting sequences, per instance and then over instances (mean of means, max of maxes)."""
    use, run, wait = [], [], []
    for inst in result.instances:
        rows = np.frombuffer(inst.steps, dtype=float).reshape(-1, 7)
        if not len(rows):
            continue
        dt = rows[:, 1] - rows[:, 0]
        w = dt / dt.sum() if dt.sum() > 0 else np.full(len(dt), 1.0 / len(dt))
        use.append((float(np.dot(w, rows[:, 4])) / inst.scheduler.total_blocks,
                    float(rows[:, 4].max()) / inst.scheduler.total_blocks))
        run.append((float(np.dot(w, rows[:, 5])), float(rows[:, 5].max())))
        wait.append((float(np.dot(w, rows[:, 6])), float(rows[:, 6].max())))

    def fold(pairs):
        return {"mean": float(np.mean([p[0] for p in pairs])) if pairs else 0.0,
                "max": float(max((p[1] for p in pairs), default=0.0))}
    return fold(use), fold(run), fold(wait)


#: points of each latency CDF and time series a database row keeps (for ``g5 plot``)
SERIES_POINTS = 101


def series(result) -> dict:
    """Compact series for plots: TTFT and TPOT quantiles (0, 1, ..., 100 %), and KV-pool use,
    running and waiting sequences over time (summed over instances, sampled at
    ``SERIES_POINTS`` times through the run, each instance at its last step ending by then)."""
    arrays = per_request(result)
    q = np.linspace(0, 100, SERIES_POINTS)

    def cdf(values):
        v = values[~np.isnan(values)]
        return np.percentile(v, q).tolist() if len(v) else []
    times = np.linspace(0.0, result.makespan_s, SERIES_POINTS)
    used = np.zeros(SERIES_POINTS)
    running = np.zeros(SERIES_POINTS)
    waiting = np.zeros(SERIES_POINTS)
    total = 0
    for inst in result.instances:
        rows = np.frombuffer(inst.steps, dtype=float).reshape(-1, 7)
        total += inst.scheduler.total_blocks
        if not len(rows):
            continue
        idx = np.searchsorted(rows[:, 1], times, side="right") - 1
        have = idx >= 0
        used[have] += rows[idx[have], 4]
        running[have] += rows[idx[have], 5]
        waiting[have] += rows[idx[have], 6]
    out = {"quantiles": q.tolist(), "ttft_s": cdf(arrays["ttft_s"]), "tpot_s": cdf(arrays["tpot_s"]),
           "time_s": times.tolist(), "kv_pool_use": (used / total).tolist() if total else [],
           "running": running.tolist(), "waiting": waiting.tolist()}
    caches = _caches(result)
    if caches:     # the block cache's cached blocks per tier, summed over instances
        levels = 1 + len(caches[0].tiers)
        cached = np.zeros((levels, SERIES_POINTS))
        for c in caches:
            occ = np.frombuffer(c.occupancy, dtype=float).reshape(-1, 1 + levels)
            if not len(occ):
                continue
            idx = np.searchsorted(occ[:, 0], times, side="right") - 1
            have = idx >= 0
            cached[:, have] += occ[idx[have], 1:].T
        out["kv_cache_blocks"] = {name: row.tolist() for name, row in
                                  zip(["hbm"] + [t.spec.kind for t in caches[0].tiers], cached)}
    return out
