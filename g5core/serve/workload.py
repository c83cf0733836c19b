"""Workloads: the requests a service receives, generated (seeded) or read from a trace file.

A :class:`Workload` is a tuple of :class:`g5core.Request` records sorted by arrival, or, for a
closed loop, the request lengths plus a concurrency (each finished request is replaced by
the next one at once, so arrivals are decided by the simulation).

Synthetic workloads (:func:`synthetic`) take an arrival process and two length
distributions, written as mappings (the ``serving.workload`` block) or as the CLI's compact
strings (:func:`parse_lengths`):

- arrivals ``{kind: poisson, rate_per_s: R}``, ``{kind: gamma, rate_per_s: R, cv: C}``
  (inter-arrival times gamma-distributed with coefficient of variation ``C``; ``C = 1`` is
  Poisson, larger is burstier) or ``{kind: closed, concurrency: N}``;
- lengths ``N`` (fixed), ``uniform:LO:HI``, ``normal:MEAN:STD``, ``lognormal:MEDIAN:SIGMA``
  (each optionally ``...@MIN:MAX`` to clip; the default clip is ``[1, 2^40]``) or
  ``hist:LEN=WEIGHT,LEN=WEIGHT...``;
- shared prefixes ``{groups: G, tokens: P}``: each request starts with one of ``G``
  prompt prefixes of ``P`` tokens, drawn uniformly; an instance that has already computed
  a prefix serves it from its prefix cache;
- multi-turn conversations ``{turns: K, think_s: T[, history_tokens: H]}``: each arrival
  starts a conversation of ``K`` turns ``T`` seconds apart, each turn's prompt holding the
  earlier turns (prompts and outputs), which are cached where the previous turn finished
  (the first turn's prompt starts with ``H`` tokens of history, e.g. a long document).

Trace files are read by the formats registered through ``g5_register_workload_formats``
(:mod:`g5core.serve.registry`; the built-in ones are in :mod:`g5core.serve.traces`).
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import attrs
import numpy as np

from g5core.api.errors import ConfigError
from g5core.api.serving import Request
from g5core.inputs.reading import MAX_ARRIVAL_S, MAX_SEQ_LEN, check_keys

#: most requests one workload may hold (a 10^7-request run already takes minutes)
MAX_REQUESTS = 10 ** 7
#: an arrival rate, requests per second: far above any deployment's (the serving search's
#: saturated run offers 10^6), so that arrival times and rates stay finite
MAX_RATE_PER_S = 1e9
ARRIVALS = ("poisson", "gamma", "closed")
LENGTH_KINDS = ("fixed", "uniform", "normal", "lognormal", "hist")
#: a gamma arrival's coefficient of variation (its shape is 1 / cv^2: 10^6 .. 10^-6)
MIN_CV, MAX_CV = 1e-3, 1e3
#: a lognormal's sigma (exp(40) is 2e17: every draw beyond it is clipped to max anyway)
MAX_SIGMA = 40.0
#: a histogram bin's weight (the weights' sum must stay finite)
MAX_WEIGHT = 1e300


@attrs.frozen
class Workload:
    requests: tuple[Request, ...]
    concurrency: Optional[int] = None   # closed loop: requests in flight at once
    source: str = "synthetic"

    @property
    def closed(self) -> bool:
        return self.concurrency is not None


def _num(value: Any, field: str, positive: bool = True, integer: bool = False, most: float = math.inf) -> float:
    """A finite number (``most``: the largest accepted, e.g. :data:`MAX_SEQ_LEN` tokens)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not -math.inf < value < math.inf:
        raise ConfigError(field, f"must be a number, got {value!r}")
    if value > most:
        raise ConfigError(field, f"is {value:,}, more than G5 accepts (at most {most:,})")
    if integer and (not isinstance(value, int)):
        raise ConfigError(field, f"must be a whole number, got {value!r}")
    if positive and value <= 0:
        raise ConfigError(field, f"must be positive, got {value!r}")
    if value < 0:
        raise ConfigError(field, f"must not be negative, got {value!r}")
    return value


def _keys(spec: Mapping, field: str, allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> None:
    check_keys(spec, field, allowed, required, missing="is required")


# --------------------------------------------------------------------------------------
# Length distributions
# --------------------------------------------------------------------------------------


def parse_lengths(text: Any, field: str) -> dict:
    """The compact CLI form of a length distribution as its mapping form (see module doc)."""
    if isinstance(text, Mapping):
        return dict(text)
    if isinstance(text, int) and not isinstance(text, bool):
        return {"kind": "fixed", "tokens": text}
    s = str(text).strip()
    clip = {}
    if "@" in s:
        s, _, bounds = s.partition("@")
        lo, _, hi = bounds.partition(":")
        clip = {"min": _int_text(lo, field), "max": _int_text(hi, field)}
    kind, _, rest = s.partition(":")
    if not rest:
        return {"kind": "fixed", "tokens": _int_text(kind, field)}
    if kind == "hist":
        bins = {}
        for part in rest.split(","):
            length, eq, weight = part.partition("=")
            if not eq:
                raise ConfigError(field, f"histogram entry {part!r} must be LEN=WEIGHT, e.g. hist:1024=0.5,4096=0.5")
            bins[_int_text(length, field)] = _float_text(weight, field)
        return {"kind": "hist", "bins": bins, **clip}
    names = {"uniform": ("min", "max"), "normal": ("mean", "std"), "lognormal": ("median", "sigma")}
    if kind not in names:
        raise ConfigError(field, f"unknown length distribution {kind!r}; use N, uniform:LO:HI, normal:MEAN:STD, "
                                 "lognormal:MEDIAN:SIGMA or hist:LEN=W,...")
    args = rest.split(":")
    if len(args) != 2:
        raise ConfigError(field, f"{kind} takes two numbers, e.g. {kind}:{'1024:4096' if kind == 'uniform' else '2048:0.5'}")
    a, b = (_float_text(x, field) for x in args)
    spec = {"kind": kind, names[kind][0]: a, names[kind][1]: b}
    if kind == "uniform":
        spec = {"kind": "uniform", "low": int(a), "high": int(b)}
    return {**spec, **clip}


def _int_text(text: str, field: str) -> int:
    try:
        return int(text.replace("_", ""))
    except ValueError:
        raise ConfigError(field, f"{text!r} is not a whole number of tokens") from None


def _float_text(text: str, field: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(field, f"{text!r} is not a number") from None


def sample_lengths(spec: Mapping, n: int, rng: np.random.Generator, field: str) -> np.ndarray:
    """``n`` token counts drawn from the distribution ``spec``, whole numbers >= 1."""
    spec = dict(spec)
    kind = spec.get("kind", "fixed")
    common = ("kind", "min", "max")
    lo = int(_num(spec.get("min", 1), f"{field}.min", integer=True, most=MAX_SEQ_LEN))
    hi = int(_num(spec.get("max", MAX_SEQ_LEN), f"{field}.max", integer=True, most=MAX_SEQ_LEN))
    if lo > hi:
        raise ConfigError(f"{field}.min", f"is {lo:,}, above max {hi:,}")
    if kind == "fixed":
        _keys(spec, field, common + ("tokens",), ("tokens",))
        values = np.full(n, _num(spec["tokens"], f"{field}.tokens", integer=True, most=MAX_SEQ_LEN), dtype=float)
    elif kind == "uniform":
        _keys(spec, field, common + ("low", "high"), ("low", "high"))
        a = int(_num(spec["low"], f"{field}.low", integer=True, most=MAX_SEQ_LEN))
        b = int(_num(spec["high"], f"{field}.high", integer=True, most=MAX_SEQ_LEN))
        if a > b:
            raise ConfigError(f"{field}.low", f"is {a:,}, above high {b:,}")
        values = rng.integers(a, b + 1, size=n).astype(float)
    elif kind == "normal":
        _keys(spec, field, common + ("mean", "std"), ("mean", "std"))
        values = rng.normal(_num(spec["mean"], f"{field}.mean", most=MAX_SEQ_LEN),
                            _num(spec["std"], f"{field}.std", positive=False, most=MAX_SEQ_LEN), n)
    elif kind == "lognormal":
        _keys(spec, field, common + ("median", "sigma"), ("median", "sigma"))
        median = _num(spec["median"], f"{field}.median", most=MAX_SEQ_LEN)
        sigma = _num(spec["sigma"], f"{field}.sigma", positive=False, most=MAX_SIGMA)
        values = median * np.exp(sigma * rng.standard_normal(n))
    elif kind == "hist":
        _keys(spec, field, common + ("bins",), ("bins",))
        bins = spec["bins"]
        if not isinstance(bins, Mapping) or not bins:
            raise ConfigError(f"{field}.bins", "must map token counts to weights, e.g. {1024: 0.5, 4096: 0.5}")
        lengths = [int(_num(int(k) if str(k).isdigit() else k, f"{field}.bins", integer=True, most=MAX_SEQ_LEN))
                   for k in bins]
        weights = np.array([_num(w, f"{field}.bins.{k}", most=MAX_WEIGHT) for k, w in bins.items()], dtype=float)
        values = np.asarray(lengths, dtype=float)[rng.choice(len(lengths), size=n, p=weights / weights.sum())]
    else:
        raise ConfigError(f"{field}.kind", f"unknown length distribution {kind!r}; use one of {', '.join(LENGTH_KINDS)}")
    return np.clip(np.rint(values), lo, hi).astype(np.int64)


# --------------------------------------------------------------------------------------
# Arrivals
# --------------------------------------------------------------------------------------


def arrival_times(spec: Mapping, n: int, rng: np.random.Generator, field: str = "serving.workload.arrival") -> np.ndarray:
    """Arrival times of ``n`` requests, the first at 0 (open loop only)."""
    kind = spec.get("kind", "poisson")
    if kind == "poisson":
        _keys(spec, field, ("kind", "rate_per_s"), ("rate_per_s",))
        gaps = rng.exponential(1.0 / _num(spec["rate_per_s"], f"{field}.rate_per_s", most=MAX_RATE_PER_S), n)
    elif kind == "gamma":
        _keys(spec, field, ("kind", "rate_per_s", "cv"), ("rate_per_s", "cv"))
        rate = _num(spec["rate_per_s"], f"{field}.rate_per_s", most=MAX_RATE_PER_S)
        cv = _num(spec["cv"], f"{field}.cv", most=MAX_CV)
        if cv < MIN_CV:
            raise ConfigError(f"{field}.cv", f"is {cv!r}, below {MIN_CV} (give a poisson or a gamma with a cv "
                                             f"from {MIN_CV} to {MAX_CV:g})")
        shape = 1.0 / (cv * cv)
        gaps = rng.gamma(shape, 1.0 / (rate * shape), n)
    else:
        raise ConfigError(f"{field}.kind", f"unknown arrival process {kind!r}; use poisson, gamma or closed")
    gaps[0] = 0.0
    times = np.cumsum(gaps)
    if not times[-1] <= MAX_ARRIVAL_S:
        raise ConfigError(f"{field}.rate_per_s", f"{n:,} requests at this rate arrive over {times[-1]:.3g} s, more "
                                                 f"than G5 simulates ({MAX_ARRIVAL_S:g} s); raise the rate or give "
                                                 "fewer requests")
    return times


def requests_of(spec: Mapping, field: str = "serving.workload") -> int:
    """A synthetic workload's ``requests``, checked (a positive whole number up to
    ``MAX_REQUESTS``)."""
    return int(_num(spec["requests"], f"{field}.requests", integer=True, most=MAX_REQUESTS))


def synthetic(spec: Mapping, field: str = "serving.workload") -> Workload:
    """A seeded synthetic workload from its mapping form (see the module doc)."""
    _keys(spec, field, ("requests", "arrival", "input_tokens", "output_tokens", "prefix", "conversation", "seed"),
          ("requests", "arrival", "input_tokens", "output_tokens"))
    n = requests_of(spec, field)
    seed = int(_num(spec.get("seed", 0), f"{field}.seed", positive=False, integer=True, most=2 ** 63 - 1))
    arrival = spec["arrival"]
    if not isinstance(arrival, Mapping):
        raise ConfigError(f"{field}.arrival", "must be a mapping, e.g. {kind: poisson, rate_per_s: 4}")
    rng = np.random.default_rng(seed)
    isl = sample_lengths(parse_lengths(spec["input_tokens"], f"{field}.input_tokens"), n, rng, f"{field}.input_tokens")
    osl = sample_lengths(parse_lengths(spec["output_tokens"], f"{field}.output_tokens"), n, rng, f"{field}.output_tokens")
    concurrency = None
    if arrival.get("kind") == "closed":
        _keys(arrival, f"{field}.arrival", ("kind", "concurrency"), ("concurrency",))
        concurrency = int(_num(arrival["concurrency"], f"{field}.arrival.concurrency", integer=True,
                               most=MAX_REQUESTS))
        times = np.zeros(n)
    else:
        times = arrival_times(arrival, n, rng, f"{field}.arrival")
    prefixes = [()] * n
    prefix = spec.get("prefix")
    if prefix is not None:
        if not isinstance(prefix, Mapping):
            raise ConfigError(f"{field}.prefix", "must be a mapping {groups: G, tokens: P}")
        _keys(prefix, f"{field}.prefix", ("groups", "tokens"), ("groups", "tokens"))
        groups = int(_num(prefix["groups"], f"{field}.prefix.groups", integer=True, most=MAX_REQUESTS))
        tokens = int(_num(prefix["tokens"], f"{field}.prefix.tokens", integer=True, most=MAX_SEQ_LEN))
        picks = rng.integers(0, groups, size=n)
        isl = isl + tokens  # the shared prefix comes before each request's own prompt
        prefixes = [((f"p{int(g)}", tokens),) for g in picks]
    conv = spec.get("conversation")
    if conv is not None:
        if prefix is not None or concurrency is not None:
            raise ConfigError(f"{field}.conversation", "conversations take an open-loop arrival and no prefix")
        return Workload(_conversations(conv, f"{field}.conversation", times, isl, osl), None,
                        f"synthetic conversations (seed {seed})")
    reqs = tuple(Request(i, float(times[i]), int(isl[i]), int(osl[i]), 0, prefixes[i]) for i in range(n))
    return Workload(reqs, concurrency, f"synthetic (seed {seed})")


def _conversations(conv, field: str, times, isl, osl) -> tuple[Request, ...]:
    """Multi-turn conversations: requests ``k * turns .. k * turns + turns - 1`` are the turns
    of conversation ``k``, which starts at the ``k``-th arrival; turn ``t`` arrives ``t *
    think_s`` later, its prompt is the conversation so far (earlier prompts and outputs) plus
    its own new tokens, and the conversation so far is cached on the instance that finished
    the previous turn (if it has finished by then). ``history_tokens``: the first turn's
    prompt starts with that many tokens already (a document the conversation is about)."""
    if not isinstance(conv, Mapping):
        raise ConfigError(field, "must be a mapping {turns: K, think_s: T}")
    _keys(conv, field, ("turns", "think_s", "history_tokens"), ("turns", "think_s"))
    turns = int(_num(conv["turns"], f"{field}.turns", integer=True, most=MAX_REQUESTS))
    history = int(_num(conv.get("history_tokens", 0), f"{field}.history_tokens", positive=False, integer=True,
                       most=MAX_SEQ_LEN))
    think = float(_num(conv["think_s"], f"{field}.think_s", positive=False, most=MAX_ARRIVAL_S / turns))
    rows = []
    for i in range(len(isl)):
        c, t = divmod(i, turns)
        context = history if t == 0 else rows[-1][5]
        prompt = context + int(isl[i])
        prefix = ((f"c{c}t{t - 1}", context),) if t else ()
        rows.append((float(times[c * turns]) + t * think, i, prompt, int(osl[i]), prefix, prompt + int(osl[i]),
                     f"c{c}t{t}", f"c{c}"))
    rows.sort(key=lambda r: (r[0], r[1]))
    return tuple(Request(k, r[0], r[2], r[3], 0, r[4], r[6], r[7]) for k, r in enumerate(rows))
