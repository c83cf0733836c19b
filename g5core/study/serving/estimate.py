"""A serving candidate's capacity, estimated from its layouts' step costs without a serving
run: what ``g5 best --serve`` orders and bounds its candidates by before simulating them.

The model is the steady state of the vLLM-style scheduler (:mod:`g5core.serve.scheduler`)
on one instance, from a few step latencies its screen measured on the engine
(:func:`step_table`), per instance at an arrival rate ``lam``:

- **Decode** (a decode pool, or the decodes of an aggregated instance): ``b`` sequences
  decode together, each step ``D(b)`` at the mean context (prompt plus half the output).
  While any sequence runs the instance never idles, so a request's TPOT is the mean step
  time, and by Little's law ``b = lam x (osl - 1) x TPOT``.
- **Prefill** (a prefill pool, or the chunks of an aggregated instance): a prompt is
  served in ``k(b)`` steps of ``max_num_batched_tokens - b`` prompt tokens (the decodes
  take their share of the budget first), costing ``P(b)`` in all per prompt; several short
  prompts share a step, and an attention-DP instance's ranks each fill a budget of their
  own. The prompts queue first come, first served: TTFT is the prompt's sojourn in that
  queue (:func:`sojourn_percentile`, the run's own number of requests and arrival process,
  started empty, as the search's runs are).
- **Aggregated**: per request the instance spends ``f(b) = P(b) + ((osl - 1) / b - k(b))
  D(b)`` (its prompt's steps, which also emit a token for each of the ``b`` decodes, and
  its share of the decode-only steps), so ``lam f(b) = 1`` fixes ``b``; the steps per
  second are ``lam (osl - 1) / b``, the TPOT their inverse. ``P`` and ``k`` are those of
  the prompts a step holds as they arrive (:func:`shared`): between the lone prompt's and
  a full budget's.
- **Disaggregated**: the prefill pool's capacity under the TTFT limits and the decode
  pool's under the TPOT ones, the lower of the two (the loop couples the pools only by the
  KV transfer, which the estimate leaves out: an idle transfer adds to TTFT).

The capacity is the highest rate meeting every limit, by bisection over the rate. It is an
estimate, not a bound: ``g5 best --serve`` simulates every candidate whose estimate, times
``1 + ESTIMATE_MARGIN``, could reach the top ones, and ``tests/test_serve_search.py``
checks the estimate against simulated capacities. What it leaves out: the batch's
fluctuation around its mean (p90 TPOT is taken as the mean step time), preemption, the
transfer, and the percentile of a request's TPOT mixing prefill steps unevenly.
"""
from __future__ import annotations

import bisect
import math
import operator
from typing import Mapping, Optional, Sequence

import numpy as np

from g5core.serve.cost import StepWork
from g5core.serve.workload import synthetic
from g5core.study.resultsdb import canonical_json

#: the simulated capacity may exceed the estimate by this share; a candidate whose estimate
#: times ``1 + ESTIMATE_MARGIN`` cannot pass the top ones is bounded out. Surveyed with
#: ``benchmarks/estimate_survey.py``: 2026-12-05, 253 candidates of six cases (Qwen3-235B on
#: 16 H200 at two workloads and SLOs, Llama-3.1-70B on 16 H100 at 4K and 8K prompts,
#: Llama-3.1-8B on 8 and 4 H100), simulated with every confirming seed, the highest failing
#: rate was 1.100 times its estimate (a Qwen3 attention-DP prefill pool; margin 0.15 then).
#: Once the estimate counted every attention-DP rank's prompts (step_table's ranks), the
#: survey again (the four cases it moves or that came closest, and Qwen3 under the sglang
#: profile) gave at most 1.047 (Llama-3.1-8B on 4 H100, unmoved), Qwen3 0.998 (sglang 1.008):
#: 0.10 keeps the same headroom above the highest. At ebe8d45 (the aggregated step's
#: prompts as they arrive, the batch below the least time per request) the six cases again
#: gave at most 1.047 (the same candidate), and ``--disagg off`` (the aggregated candidates
#: alone, 119 of them) at most 1.049 (Llama-3.1-8B 2 x [cp=2 tp=2]; 1.108 before ebe8d45).
#: Also checked on the engine in tests/test_serve_search.py
ESTIMATE_MARGIN = 0.10
#: the rates tried go up to this many times the saturated throughput (a finite run started
#: empty can hold the TTFT limit for a while above it)
OVERLOAD = 4
#: the bisection over the rate stops at this relative width
ESTIMATE_TOLERANCE = 0.01
#: points of the geometric grid over the batch on which an aggregated instance's least time
#: per request is found (:meth:`Estimator.aggregated`)
LEAST_GRID = 64


# ----------------------------------------------------------------------------------------
# The step table (in the screen cell, on the layout's step cost)
# ----------------------------------------------------------------------------------------


def step_table(cost, isl: int, osl: int, chunk: int, batches: Sequence[int], ranks: int = 1,
               eager: bool = False) -> dict:
    """The step latencies the estimate needs, from ``cost.latency_s`` (a
    :class:`~g5core.serve.cost.StepCost`): ``decode_mid_s`` ``[[b, D(b)]]`` at the mean
    context ``isl + osl // 2``, and ``prefill`` ``[[b, P(b), k(b), first_s(b), P1(b), k1(b)]]`` for
    ``b`` running decodes (0, and the middle and largest of ``batches`` below ``chunk``): a
    prompt's time in steps
    (``P``), its steps (``k``, a share of one when prompts share a step; a prompt longer than
    the budget left by the decodes, ``isl / budget`` steps at the mean full step's time, as
    queued prompts' chunks fill the budget) and the time from its first step's start to its
    first token (``first_s``, the lone prompt's whole steps), all when the prompts fill every
    step's budget; then ``P1(b)``, ``k1(b)``: the lone prompt's time in steps and its steps
    (one step, or its chunks), the other end of :func:`shared`. ``ranks``: an attention-DP
    instance's ranks (``cost`` spreads a step's work over them), each with its own budget of
    ``chunk`` tokens: under load every rank runs prompts of its own, so a step serves
    ``ranks`` times the prompts (the decodes, ``b`` in all, take ``ceil(b / ranks)`` of the
    busiest rank's budget). ``eager``: a decode batch between captured CUDA-graph sizes runs
    eagerly (:func:`g5core.inputs.framework.graph_islands`); the step is then no line between the batches (the powers
    of two, which such a framework captures), and the decode table has the midpoints ``3 b /
    2`` too: Qwen3-235B's [dp=4 ep=8 tp=2] decode under trtllm takes 40.3 ms at 256
    sequences, 47.0 at 288, 51.8 at 384 and 52.7 at 512, where the line from 256 to 512
    crosses a 50 ms limit at 458 sequences, the line through 384 at 364."""
    isl, osl = max(int(isl), 1), max(int(osl), 1)
    mid = isl + osl // 2
    points = sorted({*batches, *(3 * b // 2 for b in batches[1:] if 3 * b // 2 < batches[-1])}) if eager \
        else batches
    decode = [[b, cost.latency_s(StepWork((), (mid,) * b))] for b in points]
    prefill = []
    # the prompt's steps at 0 running decodes, the middle batch and the largest (P(b) is
    # nearly linear in b: the step's tokens stay the budget, the decodes' attention grows)
    below = [b for b in batches if -(-b // ranks) < chunk]
    for b in sorted({0, *below[len(below) // 2:len(below) // 2 + 1], *below[-1:]}):
        budget = chunk - -(-b // ranks)
        decodes = (mid,) * b
        if isl <= budget:
            q = budget // isl * ranks   # prompts per step under load
            full = cost.latency_s(StepWork(((isl, 0),) * q, decodes))
            lone = full if q == 1 else cost.latency_s(StepWork(((isl, 0),), decodes))
            prefill.append([b, full / q, 1.0 / q, full, lone, 1.0])
            continue
        total, done, steps, last = 0.0, 0, 0, 0.0
        every, last_every = 0.0, 0.0    # the same chunks on every rank at once (one rank: the lone prompt's)
        while done < isl:
            n = min(budget, isl - done)
            last = cost.latency_s(StepWork(((n, done),), decodes))
            last_every = last if ranks == 1 else cost.latency_s(StepWork(((n, done),) * ranks, decodes))
            total += last
            every += last_every
            done += n
            steps += 1
        # under a queue the prompts' chunks fill every step's budget (the next prompt's first
        # chunk takes what the last chunk leaves): isl / budget full steps per prompt, not
        # ``steps``, ``ranks`` prompts at once; the lone prompt's first token still comes
        # after its ``steps``
        k = isl / budget
        prefill.append([b, k * (every - last_every) / (steps - 1) / ranks, k / ranks, total, total, float(steps)])
    return {"isl": isl, "osl": osl, "decode_mid_s": decode, "prefill": prefill}


# ----------------------------------------------------------------------------------------
# The queue of prompts
# ----------------------------------------------------------------------------------------

_UNIT: dict = {}


def _unit_arrivals(workload: Mapping, n: int, stream: int) -> np.ndarray:
    """The first ``n`` arrival times of the workload's own stream of ``stream`` requests (its
    seed, kind and cv) at 1 request/s; at rate ``r`` they are these over ``r`` (both
    processes scale so), and with fixed lengths they are a run's arrivals (a run of ``n``
    requests draws the same stream's first ``n``)."""
    arrival = {**dict(workload.get("arrival") or {}), "rate_per_s": 1.0}
    arrival.setdefault("kind", "poisson")
    spec = {**dict(workload), "arrival": arrival, "requests": max(n, stream)}
    key = canonical_json(spec)
    hit = _UNIT.get(key)
    if hit is None:
        if len(_UNIT) > 16:
            _UNIT.clear()
        hit = _UNIT[key] = np.array([r.arrival_s for r in synthetic(spec).requests])
    return hit[:n]


def sojourn_percentile(workload: Mapping, rate: float, n: int, servers: int, service_s: float, first_s: float,
                       share: float, wait_only: bool = False, stream: int = 0) -> float:
    """The ``share`` quantile (0-1) of a prompt's time from arrival to its first token in
    ``servers`` first-come-first-served queues fed in turn (round robin) by ``n`` arrivals at
    ``rate``, each prompt holding its server ``service_s`` and getting its first token
    ``first_s`` after its service starts (``wait_only``: the wait alone, the ``queue``
    metric). A queue of constant service ``s`` departs the k-th arrival at ``(k + 1) s +
    max over j <= k of (A_j - j s)`` (started empty). ``stream``: the arrivals are the first
    ``n`` of a stream of that many (at least ``n``)."""
    times = _unit_arrivals(workload, n, stream) / rate
    # the arrivals in rows of ``servers``: column i is server i's queue, row j its j-th
    # arrival (the last row padded; a pad comes after every real arrival of its column, so
    # the running maximum down a column never reads it)
    rows = -(-len(times) // servers)
    a = np.zeros(rows * servers)
    a[:len(times)] = times
    a = a.reshape(rows, servers)
    j = np.arange(rows)[:, None]
    start = j * service_s + np.maximum.accumulate(a - j * service_s, axis=0)   # the j-th service starts here
    waits = (start - a + (0.0 if wait_only else first_s)).ravel()[:len(times)]
    return _percentile(waits, share)


def _percentile(values: np.ndarray, share: float) -> float:
    """``np.percentile(values, 100 * share)`` (its linear method), the same double, from the
    two order statistics around the quantile's place (``np.partition``: no sort), by
    numpy's own arithmetic (``numpy/lib/_function_base_impl.py``: ``_quantile``'s virtual
    index ``(n - 1) q``, ``_lerp``); ``values`` finite."""
    n = len(values)
    v = (n - 1) * ((100 * share) / 100)
    if v >= n - 1:
        return float(values.max())
    if v < 0:
        return float(values.min())
    lo = math.floor(v)
    part = np.partition(values, (lo, lo + 1))
    a, b = float(part[lo]), float(part[lo + 1])
    t = v - lo
    diff = b - a
    return b - diff * (1 - t) if t >= 0.5 else a + diff * t


# ----------------------------------------------------------------------------------------
# Capacity
# ----------------------------------------------------------------------------------------


_first = operator.itemgetter(0)


def _lin(points: Sequence[Sequence[float]], x: float, col: int = 1) -> float:
    """Column ``col`` of ``points`` (sorted by their first column) at ``x``, linear between
    points and beyond the last two."""
    if len(points) == 1:
        return points[0][col]
    i = max(1, min(bisect.bisect_left(points, x, key=_first), len(points) - 1))
    x0, x1 = points[i - 1][0], points[i][0]
    w = (x - x0) / (x1 - x0)
    return points[i - 1][col] + w * (points[i][col] - points[i - 1][col])


def shared(pre: Sequence[Sequence[float]], b: float, decodes: int) -> tuple[float, float]:
    """``(P, k)``: a prompt's time in steps and its steps at ``b`` running decodes of an
    aggregated instance (``pre``: :func:`step_table`'s prefill rows), its prompts sharing a
    step as their arrivals let them. A step admits the prompts that arrived since the last
    (each attention-DP rank its own), and steps come ``b / decodes`` request arrivals apart
    (Little's law: ``b`` sequences each decoding ``decodes`` tokens, a token a step), so a
    step holding a prompt holds ``x / (1 - exp(-x))`` of them (a Poisson count given at
    least one; over a lone prompt's ``k1`` steps for a chunked one), at least the lone
    prompt's share and at most what fills every budget. The step's time runs linearly in
    the prompts between the lone prompt's step and the full one. Without this, a candidate
    whose budget holds many prompts (an attention-DP instance: every rank's) was priced as if
    every step filled it: at a TPOT limit the arrivals between two steps are a fraction of a
    prompt, and an attention-DP step holding one prompt lasts as long as that rank's."""
    p_full, k_full = _lin(pre, b, 1), _lin(pre, b, 2)
    p_one, k_one = _lin(pre, b, 4), _lin(pre, b, 5)
    q_full, q_one = 1.0 / k_full, 1.0 / k_one
    if q_full <= q_one:
        return p_full, k_full
    x = b / decodes * k_one
    held = x / -math.expm1(-x) if x > 0 else 1.0
    q = min(max(held / k_one, q_one), q_full)
    t_one, t_full = p_one / k_one, p_full / k_full
    t = t_one + (q - q_one) / (q_full - q_one) * (t_full - t_one)
    return t / q, 1.0 / q


def _limits(limits) -> tuple[list, list]:
    first = [l for l in limits if l.metric in ("ttft", "e2e", "queue")]
    token = [l for l in limits if l.metric in ("tpot", "itl")]
    return first, token


def _share(lim) -> float:
    return (lim.percentile if lim.percentile is not None else 100) / 100


def _bisect(ok, hi: float) -> float:
    """The highest rate in ``(0, hi]`` with ``ok(rate)`` (monotone), within the tolerance;
    0 when even ``hi * 1e-6`` fails."""
    if ok(hi):
        return hi
    lo = hi * 1e-6
    if not ok(lo):
        return 0.0
    return narrow(ok, lo, hi, ESTIMATE_TOLERANCE)[0]


def narrow(ok, lo: float, hi: float, tolerance: float) -> tuple[float, float]:
    """``[lo, hi]`` (``ok(lo)``, not ``ok(hi)``) bisected geometrically until ``hi / lo <= 1 +
    tolerance``."""
    while hi > lo * (1 + tolerance):
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


class Estimator:
    """Capacities of a search's candidates from their layouts' step tables; ``run_requests``:
    ``rate -> requests`` of the search's run at that rate (the estimate's queue has as many,
    the first of one stream of ``stream`` arrivals)."""

    def __init__(self, limits, workload: Mapping, run_requests, max_rate: float, stream: int):
        self.first, self.token = _limits(limits)
        self.stream = stream
        self.workload = dict(workload)
        self.run_requests = run_requests
        self.max_rate = max_rate
        self._cache: dict = {}

    # -- the pieces -----------------------------------------------------------------------

    def _first_ok(self, rate: float, servers: int, service_s: float, first_s: float,
                  tail_s: float) -> bool:
        """The TTFT-like limits at ``rate`` over ``servers`` instances (``tail_s``: a
        request's time after its first token, for e2e)."""
        n = self.run_requests(rate)
        for lim in self.first:
            value = sojourn_percentile(self.workload, rate, n, servers, service_s, first_s, _share(lim),
                                       wait_only=lim.metric == "queue", stream=self.stream)
            if lim.metric == "e2e":
                value += tail_s
            if value > lim.limit_s:
                return False
        return True

    def _decode_b(self, table, max_b: float) -> float:
        """The largest mean batch of a decode pool instance within the TPOT-like limits (and
        ``max_b``); 0 when not even one sequence meets them."""
        pts = table["decode_mid_s"]
        limit = min((l.limit_s for l in self.token if l.metric in ("tpot", "itl")), default=math.inf)
        if _lin(pts, 1.0) > limit:
            return 0.0
        if _lin(pts, max_b) <= limit:
            return max_b
        lo, hi = 1.0, max_b
        while hi - lo > 1e-3 * hi:
            mid = 0.5 * (lo + hi)
            if _lin(pts, mid) <= limit:
                lo = mid
            else:
                hi = mid
        return lo

    def prefill_pool(self, table, instances: int) -> float:
        """Requests/s a pool of ``instances`` prefill instances serves within the TTFT-like
        limits (prefill-only steps)."""
        _, service, _, first = table["prefill"][0][:4]
        hi = min(self.max_rate, OVERLOAD * instances / service)
        return _bisect(lambda r: self._first_ok(r, instances, service, first, 0.0), hi)

    def decode_pool(self, table, instances: int, max_num_seqs: int, holds: float) -> float:
        """Requests/s a pool of ``instances`` decode instances serves within the TPOT-like
        limits: ``b / ((osl - 1) D(b))`` per instance at the largest mean batch ``b`` the
        limits, ``max_num_seqs`` and the KV pool allow."""
        decodes = max(table["osl"] - 1, 1)
        top = float(min(max_num_seqs, holds))
        b = self._decode_b(table, top)
        out = min(self.max_rate, instances * b / (decodes * _lin(table["decode_mid_s"], b))) if b > 0 else 0.0
        if b >= top and top >= 1:
            # the batch full within the limits: past it requests wait for a slot, their wait in
            # their TPOT (a finite run holds the limit for a while): the slots as first-come-
            # first-served servers, each request holding one for its decodes at the full batch
            slots = instances * int(top)
            service = decodes * _lin(table["decode_mid_s"], top)
            limits = [l for l in self.token if l.metric == "tpot"]

            def ok(rate):
                n = self.run_requests(rate)
                return all(sojourn_percentile(self.workload, rate, n, slots, service, service, _share(l),
                                              stream=self.stream) / decodes <= l.limit_s for l in limits)
            if limits:
                out = max(out, _bisect(ok, min(self.max_rate, OVERLOAD * slots / service)))
        return out

    def aggregated(self, table, instances: int, max_num_seqs: int, holds: float) -> float:
        """Requests/s of ``instances`` aggregated instances (see the module doc)."""
        decodes = max(table["osl"] - 1, 1)
        pre = table["prefill"]
        dec = table["decode_mid_s"]
        top_b = float(min(max_num_seqs, holds, pre[-1][0] if pre[-1][0] > 0 else 1))
        top_b = max(top_b, 1.0)

        def request(b):
            """``(f(b), P, k)``: a request's share of the instance's time, and its prompt's
            time in steps and steps (:func:`shared`)."""
            p, k = shared(pre, b, decodes)
            return p + max(decodes / b - k, 0.0) * _lin(dec, b), p, k

        def per_request_s(b):
            return request(b)[0]

        # f(b) falls as the decodes share more steps, and can rise again where a larger batch
        # leaves a prompt less of the budget (more, slower steps a prompt): the batch grows
        # from empty until the instance keeps up, at the smallest b with lam f(b) <= 1, below
        # the b of least f (on a geometric grid), and the instance is saturated only past
        # that least f. (Taking f as falling up to max_num_seqs once made a larger
        # max_num_seqs estimate less: 69.4 against 77.0 req/s, Llama-3.1-8B 4 x [tp=2] at
        # 256 and 128, which simulate alike at 73.2.)
        least_b = min((top_b ** (i / (LEAST_GRID - 1)) for i in range(LEAST_GRID)), key=per_request_s)
        least_s = per_request_s(least_b)

        def batch_at(lam):
            """The mean batch at ``lam`` per instance (the least ``b`` with ``lam f(b) <= 1``),
            or None: saturated."""
            if least_s * lam > 1:
                return None
            if per_request_s(1.0) * lam <= 1:
                return 1.0
            lo, hi = 1.0, least_b
            while hi - lo > 1e-3 * hi:
                mid = 0.5 * (lo + hi)
                if per_request_s(mid) * lam > 1:
                    lo = mid
                else:
                    hi = mid
            return hi

        tpot_limit = min((l.limit_s for l in self.token if l.metric == "tpot"), default=math.inf)
        itl_limits = [l for l in self.token if l.metric == "itl"]

        def ok(rate):
            lam = rate / instances
            b = batch_at(lam)
            saturated = b is None
            if saturated:   # prompts are admitted as requests finish, 1 / f(b) per second
                b = top_b
            f, p, k = request(b)
            if saturated:
                lam = 1.0 / f
            steps_per_s = lam * decodes / b
            # the mean step: a request's share of the instance's time over its share of the
            # steps (at least its prompt's; b = 1: light load, idle between requests)
            tpot = f / max(k, decodes / b)
            if tpot > tpot_limit:
                return False
            prefill_share = min(lam * k / steps_per_s, 1.0)   # of the steps, those holding a prompt
            for lim in itl_limits:
                slow = p / max(k, 1.0)
                gap = slow if prefill_share > 1 - _share(lim) else _lin(dec, b)
                if gap > lim.limit_s:
                    return False
            return self._first_ok(rate, instances, f if saturated else _lin(pre, b), _lin(pre, b, 3), decodes * tpot)

        return _bisect(ok, min(self.max_rate, OVERLOAD * instances / least_s))

    def memo(self, key, fn):
        """``fn()`` once per ``key`` (a pool's layout and settings: many candidates share it)."""
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]


def holds_mean(kv_capacity_tokens: int, table: Mapping) -> float:
    """Sequences an instance's KV pool holds at the mean length (prompt plus half the output)."""
    return kv_capacity_tokens / max(table["isl"] + table["osl"] // 2, 1)


def estimate_for(estimator: Estimator, cand, screens: Sequence[Mapping], keys: Sequence) -> Optional[float]:
    """The candidate's estimated capacity (requests/s); ``screens``: its pools' screen
    results (aggregated: one), each with its ``estimate`` table; ``keys``: their layouts'
    keys (a pool's estimate is reused by every candidate with that pool); ``None`` without
    tables."""
    tables = [s.get("estimate") for s in screens]
    if any(t is None for t in tables):
        return None
    if len(cand.pools) == 1:
        pool = cand.pools[0]
        holds = holds_mean(screens[0]["kv_capacity_tokens"], tables[0])
        seqs = cand.max_num_seqs * pool.layout.get("dp", 1)   # max_num_seqs is per attention-DP rank
        return estimator.memo(("a", keys[0], pool.instances, seqs),
                              lambda: estimator.aggregated(tables[0], pool.instances, seqs, holds))
    p, d = cand.pools
    holds = holds_mean(screens[1]["kv_capacity_tokens"], tables[1])
    return min(estimator.memo(("p", keys[0], p.instances), lambda: estimator.prefill_pool(tables[0], p.instances)),
               estimator.memo(("d", keys[1], d.instances, cand.max_num_seqs * d.layout.get("dp", 1)),
                              lambda: estimator.decode_pool(tables[1], d.instances,
                                                            cand.max_num_seqs * d.layout.get("dp", 1), holds)))
