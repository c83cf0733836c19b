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

import re
from typing import Mapping, Optional

import attrs
import numpy as np

from g5core.api.errors import ConfigError

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2e", "itl", "queue")
_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


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


@attrs.frozen
class SloLimit:
    metric: str             # ttft, tpot, e2e, itl (a request's worst gap), queue
    limit_s: float
    percentile: Optional[int] = None   # a run-level limit on that percentile; None: every request

    @property
    def key(self) -> str:
        return self.metric + (f"_p{self.percentile}" if self.percentile is not None else "")


def parse_slo(text, field: str = "--slo") -> tuple[SloLimit, ...]:
    """``ttft=2s,tpot=50ms`` or ``ttft_p90=2s`` (a mapping from the configuration works too)."""
    if text is None or text == "":
        return ()
    items = text.items() if isinstance(text, Mapping) else (p.partition("=")[::2] for p in str(text).split(","))
    out = []
    for key, value in items:
        key = str(key).strip()
        m = re.fullmatch(r"([a-z0-9]+)(?:_p(\d{1,2}(?:\.\d+)?))?", key)
        if not m or m.group(1) not in SLO_METRICS:
            raise ConfigError(field, f"unknown limit {key!r}; use {', '.join(SLO_METRICS)}, optionally with a "
                                     "percentile (ttft_p90=2s)")
        vm = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(s|ms|us)\s*", str(value))
        if not vm:
            raise ConfigError(field, f"{key}={value!r}: give a time with its unit, e.g. {key}=2s or {key}=50ms")
        try:
            limit = float(vm.group(1)) * _UNITS[vm.group(2)]
        except ValueError:
            raise ConfigError(field, f"{key}={value!r} is not a number") from None
        if not limit > 0 or limit == float("inf"):
            raise ConfigError(field, f"{key}: the limit must be positive, got {value!r}")
        pct = float(m.group(2)) if m.group(2) else None
        if pct is not None and not 0 < pct < 100:
            raise ConfigError(field, f"{key}: the percentile must lie between 0 and 100")
        if any(o.key == key for o in out):
            raise ConfigError(field, f"{key} is given twice")
        out.append(SloLimit(m.group(1), limit, int(pct) if pct is not None and pct.is_integer() else pct))
    return tuple(out)


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


def summary(result, limits: tuple[SloLimit, ...] = ()) -> dict:
    """The run's summary (the keys of ``g5 serve --json``, less the deployment echo)."""
    reqs = result.workload.requests
    arrays = per_request(result)
    itl = np.frombuffer(result.requests.itl_s, dtype=float)
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
    return {
        "requests": n,
        "completed": int(np.count_nonzero(~np.isnan(e2e))),
        "duration_s": span,
        "makespan_s": span,
        "arrival_span_s": arrival_span_s,
        "queue_s": stats(arrays["queue_s"]),
        "ttft_s": stats(arrays["ttft_s"]),
        "tpot_s": stats(arrays["tpot_s"]),
        "itl_s": stats(itl),
        "e2e_s": stats(e2e),
        "throughput": {
            "input_tokens_per_s": per_s(in_tokens),
            "output_tokens_per_s": per_s(out_tokens),
            "total_tokens_per_s": per_s(in_tokens + out_tokens),
            "output_tokens_per_s_per_chip": per_s(out_tokens) / chips,
            "total_tokens_per_s_per_chip": per_s(in_tokens + out_tokens) / chips,
            "requests_per_s": per_s(n),
            "offered_requests_per_s": n / arrival_span_s if arrival_span_s > 0 else 0.0,
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
    }


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
    return {"quantiles": q.tolist(), "ttft_s": cdf(arrays["ttft_s"]), "tpot_s": cdf(arrays["tpot_s"]),
            "time_s": times.tolist(), "kv_pool_use": (used / total).tolist() if total else [],
            "running": running.tolist(), "waiting": waiting.tolist()}
