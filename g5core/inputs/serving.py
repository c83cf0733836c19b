"""The ``serving:`` block of a configuration, parsed and checked in one place: the pools it
describes (instances, scheduler settings, routers, disaggregation), the SLO limits
(``serving.slo`` or ``--slo``), and the workload mapping ``g5 serve``'s flags describe over
``serving.workload``. ``g5core/serve/`` runs what this module returns; nothing here builds a
plan or simulates.

The ``serving:`` block (every key optional)::

    serving:
      instances: 8                    # copies of the configuration's layout
      router: round_robin             # or least_outstanding_tokens, least_kv, a plugin's
      routing_s: 0.0                  # delay from arrival to the instance's queue
      dp_balance: round_robin         # attention DP (parallel.dp > 1): or shortest_queue
      scheduler: {name: vllm, max_num_seqs: 256, max_num_batched_tokens: 8192,
                  chunked_prefill: true, long_prefill_token_threshold: 0, block_size: 16}
      slo: {ttft: 2s, tpot: 50ms}     # like --slo
      workload: {requests: 1000, arrival: {kind: poisson, rate_per_s: 8},
                 input_tokens: 2048, output_tokens: 256, seed: 0}   # or {trace: FILE}
      prefix_cache: {policy: lru, miss: faster, overlap: true}   # the block cache (README, "KV cache")
      kv_tiers: [{kind: host}, {kind: disk, bytes_per_chip: 1.0e12}]  # tiers below HBM (inputs/kv_tiers.py)
      disaggregation:                 # instead of instances: a prefill and a decode pool
        prefill: {instances: 2, chips: 8, parallel: {tp: 8}, scheduler: {...}}
        decode:  {instances: 1, chips: 16, parallel: {tp: 8, pp: 2}, system: h200}

A pool's ``chips`` and ``parallel`` replace the configuration's (the layout of one of its
instances); the pools sit on disjoint chips, prefill first, on one network of
``prefill chips + decode chips`` chips of the system.

A disaggregated pool's ``system`` (a catalogue name or a system file, as the configuration's
``system``) replaces the configuration's for that pool: its step costs, its memory ledger and
its KV pool come from that system's file (heterogeneous disaggregation, as aiconfigurator's
``--decode-system``). Pools on two different systems are two clusters: a prompt's KV moves
between them over the inter-node network (``g5core.serve.api.kv_transfer``), never over a
scale-up link.

Attention DP: an instance's layout with ``dp > 1`` (e.g. ``chips: 16, parallel: {dp: 8, tp: 2,
pp: 1, cp: 1, ep: 16}``) is one instance of ``dp`` attention-DP ranks (each ``tp`` chips for
attention and the dense layers) with the experts over ``ep`` across them, as SGLang's
``--enable-dp-attention`` runs it: each rank has its own scheduler (the pool's settings, per
rank) and its own KV pool (the ledger's per-replica capacity), ``dp_balance`` picks a
request's rank (:data:`DP_BALANCE`), and a step is every rank's step at once, as long as the
slowest (``g5core.serve.cost.DpCost``). Every EP group must span every rank (the all-to-all is
what joins them): in practice ``ep = dp x sp x tp``.

``parse_serving``'s ``registry`` is anything with ``schedulers``, ``routers`` and
``cache_policies`` mappings keyed by name (``g5core.serve.registry.ServingRegistry``).
"""
from __future__ import annotations

import re
from typing import Mapping, Optional

import attrs

from g5core.api.errors import ConfigError
from g5core.inputs.framework import framework_of
from g5core.inputs.kv_tiers import CacheSpec, parse_cache
from g5core.inputs.reading import MAX_ARRIVAL_S, MAX_SEQ_LEN, check_keys
from g5core.inputs.systems import get_system

SERVING_KEYS = ("instances", "router", "routing_s", "scheduler", "slo", "workload", "disaggregation", "prefix_cache",
                "kv_tiers", "dp_balance")
POOL_KEYS = ("instances", "chips", "parallel", "scheduler", "router", "dp_balance", "system")
#: keys of a disaggregated pool that replace the configuration's own
POOL_OVERRIDES = ("chips", "parallel", "system")
# how a request picks its attention-DP rank (SGLang's DataParallelController's rules:
# g5core.serve.scheduler.DpScheduler runs them)
DP_BALANCE = ("round_robin", "shortest_queue")
# phase, batch and seq_len of a configuration are not used by serving (each step sets its
# own); a configuration written for serving may leave them out
PLACEHOLDERS = {"phase": "decode", "batch": 1, "seq_len": 4096}
#: instances of one pool (each is simulated step by step; the work limit bounds the rest)
MAX_INSTANCES = 2 ** 20
SLO_METRICS = ("ttft", "tpot", "e2e", "itl", "queue")
_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


@attrs.frozen
class SchedulerSettings:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0   # 0: no cap beyond the budget (vLLM's default)
    block_size: int = 16
    #: decodes and prefill chunks share a step (vLLM); false: a step that can take a prefill
    #: takes only prefills and the decodes wait (SGLang's default, ``enable_mixed_chunk`` False)
    mixed_prefill: bool = True

    FIELDS = ("name", "max_num_seqs", "max_num_batched_tokens", "chunked_prefill", "long_prefill_token_threshold",
              "block_size", "mixed_prefill")

    @classmethod
    def from_dict(cls, data, field: str = "serving.scheduler") -> "SchedulerSettings":
        check_keys(data, field, cls.FIELDS)
        values = {}
        for key, value in data.items():
            if key == "name":
                continue
            if key in ("chunked_prefill", "mixed_prefill"):
                if not isinstance(value, bool):
                    raise ConfigError(f"{field}.{key}", f"must be true or false, got {value!r}")
            elif (isinstance(value, bool) or not isinstance(value, int)
                  or not (0 if key.startswith("long") else 1) <= value <= MAX_SEQ_LEN):
                raise ConfigError(f"{field}.{key}", f"must be a whole number from {0 if key.startswith('long') else 1} "
                                                    f"to {MAX_SEQ_LEN:,}, got {value!r}")
            values[key] = value
        return cls(**values)


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


@attrs.frozen
class PoolSpec:
    role: str
    instances: int
    overrides: tuple        # (key, value) pairs replacing the configuration's chips/parallel/system
    scheduler: SchedulerSettings
    scheduler_name: str
    router: str
    dp_balance: str = "round_robin"
    #: the scheduler keys the configuration gave (a framework profile's scheduling sets the
    #: others: :func:`scheduler_under`)
    given: frozenset = frozenset()


def scheduler_under(settings: SchedulerSettings, given, system) -> SchedulerSettings:
    """``settings`` on ``system``: its framework profile's scheduling (``framework.mixed_prefill``)
    where the configuration's scheduler keys ``given`` do not hold that key."""
    mixed = framework_of(system).mixed_prefill
    if mixed is None or "mixed_prefill" in given:
        return settings
    return attrs.evolve(settings, mixed_prefill=mixed)


@attrs.frozen
class ServingSpec:
    pools: tuple[PoolSpec, ...]
    routing_s: float
    slo: tuple[SloLimit, ...]
    workload: Optional[Mapping]
    cache: Optional[CacheSpec] = None   # serving.prefix_cache / kv_tiers (None: the never-evicting cache)


def _positive_int(value, field, most: int = MAX_SEQ_LEN) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        raise ConfigError(field, f"must be a whole number from 1 to {most:,}, got {value!r}")
    return value


def _mapping(value, field) -> Mapping:
    if not isinstance(value, Mapping):
        raise ConfigError(field, f"must be a mapping, got {value!r}")
    return value


def check_pool_system(value, field: str) -> None:
    """A pool's ``system``: a catalogue name or a system file (:func:`get_system`'s), else a
    one-line ConfigError naming ``field`` and the known systems."""
    if not isinstance(value, str) or not value:
        raise ConfigError(field, f"must be a system name or a system file path, got {value!r}")
    try:
        get_system(value)
    except ConfigError as exc:
        # the system's own field (a bad figure in a system file) stays in the message
        raise ConfigError(field, str(exc)[len("system: "):] if exc.field == "system" else str(exc)) from None


def split_config(raw: Mapping) -> tuple[dict, Mapping]:
    """The deployment part of a configuration and its ``serving:`` block."""
    raw = dict(raw)
    block = raw.pop("serving", None) or {}
    for key, value in PLACEHOLDERS.items():
        raw.setdefault(key, value)
    return raw, _mapping(block, "serving")


def serving_input_files(raw: Mapping) -> list[tuple[str, str]]:
    """The files the ``serving:`` block makes a run read (its workload's trace), as
    ``(label, path)`` pairs for the output checks: no output may overwrite one of them."""
    block = raw.get("serving") if isinstance(raw, Mapping) else None
    workload = block.get("workload") if isinstance(block, Mapping) else None
    trace = workload.get("trace") if isinstance(workload, Mapping) else None
    return [("serving.workload.trace", trace)] if isinstance(trace, str) and trace else []


def parse_serving(block: Mapping, registry, slo_text=None) -> ServingSpec:
    check_keys(block, "serving", SERVING_KEYS)
    routing_s = block.get("routing_s", 0.0)
    if (isinstance(routing_s, bool) or not isinstance(routing_s, (int, float))
            or not 0 <= routing_s <= MAX_ARRIVAL_S):
        raise ConfigError("serving.routing_s", f"must be a number of seconds from 0 to {MAX_ARRIVAL_S:g}, "
                                               f"got {routing_s!r}")
    sched = _mapping(block.get("scheduler", {}), "serving.scheduler")
    router = block.get("router", "round_robin")
    balance = block.get("dp_balance", "round_robin")

    def pool(role: str, data: Mapping, field: str, instances_default: int) -> PoolSpec:
        s = {**sched, **_mapping(data.get("scheduler", {}), f"{field}.scheduler")}
        name = s.get("name", "vllm")
        if not isinstance(name, str) or name not in registry.schedulers:
            raise ConfigError(f"{field}.scheduler.name", f"unknown scheduler {name!r}; known: "
                                                         f"{', '.join(sorted(registry.schedulers))}")
        r = data.get("router", router)
        if not isinstance(r, str) or r not in registry.routers:
            raise ConfigError(f"{field}.router", f"unknown router {r!r}; known: {', '.join(sorted(registry.routers))}")
        b = data.get("dp_balance", balance)
        if b not in DP_BALANCE:
            raise ConfigError(f"{field}.dp_balance", f"unknown attention-DP balance {b!r}; known: "
                                                     f"{', '.join(DP_BALANCE)}")
        if "system" in data:
            check_pool_system(data["system"], f"{field}.system")
        over = tuple((k, data[k]) for k in POOL_OVERRIDES if k in data)
        return PoolSpec(role, _positive_int(data.get("instances", instances_default), f"{field}.instances",
                                            MAX_INSTANCES), over,
                        SchedulerSettings.from_dict(s, f"{field}.scheduler"), name, r, b,
                        frozenset(k for k in s if k != "name"))

    disagg = block.get("disaggregation")
    if disagg is not None:
        disagg = _mapping(disagg, "serving.disaggregation")
        for key in disagg:
            if key not in ("prefill", "decode"):
                raise ConfigError(f"serving.disaggregation.{key}", "unknown key; give prefill and decode")
        if "instances" in block:
            raise ConfigError("serving.instances", "give the instances of each pool under serving.disaggregation "
                                                   "instead")
        pools = []
        for role in ("prefill", "decode"):
            if role not in disagg:
                raise ConfigError(f"serving.disaggregation.{role}", "is required")
            data = _mapping(disagg[role], f"serving.disaggregation.{role}")
            check_keys(data, f"serving.disaggregation.{role}", POOL_KEYS)
            pools.append(pool(role, data, f"serving.disaggregation.{role}", 1))
        pools = tuple(pools)
    else:
        pools = (pool("serve", {"instances": block.get("instances", 1)}, "serving", 1),)
    slo = parse_slo(slo_text if slo_text is not None else block.get("slo"),
                    "--slo" if slo_text is not None else "serving.slo")
    workload = block.get("workload")
    cache = parse_cache(block)
    if cache is not None:
        if cache.policy not in registry.cache_policies:
            raise ConfigError("serving.prefix_cache.policy", f"unknown policy {cache.policy!r}; known: "
                                                             f"{', '.join(sorted(registry.cache_policies))}")
        for p in pools:
            if p.scheduler_name != "vllm":
                raise ConfigError("serving.prefix_cache", f"the block cache runs with the vllm scheduler, not "
                                                          f"{p.scheduler_name!r}")
    return ServingSpec(pools, float(routing_s), slo, _mapping(workload, "serving.workload") if workload else None,
                       cache)


ARRIVAL_SPECS = {"poisson": ("rate",), "gamma": ("rate", "cv"), "closed": ("concurrency",)}
#: a ``--workload`` ending so names a trace file (else an arrival process)
TRACE_SUFFIXES = (".csv", ".jsonl", ".json", ".ndjson")


def workload_spec(base: Optional[Mapping], workload: Optional[str] = None, requests: Optional[int] = None,
                  rate: Optional[float] = None, concurrency: Optional[int] = None, isl=None, osl=None,
                  seed: Optional[int] = None) -> Optional[dict]:
    """The workload mapping that ``g5 serve``'s flags describe, over the configuration's
    ``serving.workload`` (``base``). ``workload``: a trace file (``.csv``/``.jsonl``) or an
    arrival process ``poisson``, ``gamma:cv=2`` or ``closed`` (with ``key=value`` settings:
    ``rate``, ``cv``, ``concurrency``). ``None`` when nothing describes one."""
    flags = {"--requests": requests, "--rate": rate, "--concurrency": concurrency, "--isl": isl, "--osl": osl,
             "--seed": seed}
    if rate is not None and concurrency is not None:
        raise ConfigError("--rate", "give --rate (open loop) or --concurrency (closed loop), not both")
    if workload is not None and workload.lower().endswith(TRACE_SUFFIXES):
        given = [k for k, v in flags.items() if v is not None and k != "--requests"]
        if given:
            raise ConfigError(given[0], "applies to a synthetic workload, not to a trace file")
        return WorkloadSpec({"trace": workload, **({"requests": requests} if requests is not None else {})},
                            {"trace": "--workload", "requests": "--requests"})
    spec = dict(_mapping(base, "serving.workload")) if base else {}
    if "trace" in spec:
        if any(v is not None for v in flags.values()) or workload is not None:
            raise ConfigError("--workload", "the configuration's serving.workload is a trace; give a synthetic "
                                            "workload in full (--workload, --rate, --isl, --osl) or none")
        return WorkloadSpec(spec)
    if not spec and workload is None and all(v is None for v in flags.values()):
        return None
    arrival = dict(_mapping(spec.get("arrival", {}), "serving.workload.arrival"))
    if workload is not None:
        kind, _, rest = workload.partition(":")
        if kind not in ARRIVAL_SPECS:
            raise ConfigError("--workload", f"{workload!r} is neither a trace file (.csv, .jsonl) nor an arrival "
                                            "process (poisson, gamma:cv=C, closed)")
        arrival = {"kind": kind}
        for part in filter(None, rest.split(",")):
            key, eq, value = part.partition("=")
            if not eq or key not in ARRIVAL_SPECS[kind]:
                raise ConfigError("--workload", f"{kind} takes {', '.join(k + '=N' for k in ARRIVAL_SPECS[kind])}; "
                                                f"got {part!r}")
            try:
                number = float(value) if key != "concurrency" else int(value)
            except ValueError:
                raise ConfigError("--workload", f"{key}={value!r} is not a number") from None
            arrival[{"rate": "rate_per_s"}.get(key, key)] = number
    if rate is not None:
        if arrival.get("kind") == "closed":
            raise ConfigError("--rate", "a closed loop has no arrival rate; give --concurrency")
        arrival = {**arrival, "kind": arrival.get("kind", "poisson"), "rate_per_s": rate}
        arrival.pop("concurrency", None)
    if concurrency is not None:
        arrival = {"kind": "closed", "concurrency": concurrency}
    flagged = {}
    if arrival:
        spec["arrival"] = arrival
        given = [f for f, v in (("--workload", workload), ("--rate", rate), ("--concurrency", concurrency))
                 if v is not None]
        if given:
            flagged["arrival"] = given[-1]
        # each arrival setting as the flag that gave it (--workload gamma:cv=0 --rate 2: a bad cv
        # is --workload's, not --rate's)
        if workload is not None:
            flagged.update((f"arrival.{key}", "--workload") for key in arrival)
        if rate is not None:
            flagged["arrival.rate_per_s"] = "--rate"
        if concurrency is not None:
            flagged.update({"arrival.kind": "--concurrency", "arrival.concurrency": "--concurrency"})
    for key, flag, value in (("requests", "--requests", requests), ("input_tokens", "--isl", isl),
                             ("output_tokens", "--osl", osl), ("seed", "--seed", seed)):
        if value is not None:
            spec[key] = value
            flagged[key] = flag
    for key, flag in (("arrival", "--rate or --concurrency"), ("input_tokens", "--isl"), ("output_tokens", "--osl"),
                      ("requests", "--requests")):
        if key not in spec or (key == "arrival" and not spec["arrival"]):
            raise ConfigError(flag, f"a synthetic workload needs {flag} (or serving.workload.{key})")
    if spec["arrival"].get("kind", "poisson") in ("poisson", "gamma") and "rate_per_s" not in spec["arrival"]:
        raise ConfigError("--rate", "an open-loop workload needs its arrival rate: give --rate R (or rate=R in "
                                    "--workload, or serving.workload.arrival.rate_per_s)")
    return WorkloadSpec(spec, flagged)


class WorkloadSpec(dict):
    """A workload mapping that knows which of its keys a flag gave (``flags``: key -> the
    flag) and which came from the configuration's ``serving.workload``, so that an error
    names the place the bad value was given (:meth:`field_of`)."""

    def __init__(self, data: Mapping, flags: Optional[Mapping] = None):
        super().__init__(data)
        self.flags = dict(flags or {})

    def field_of(self, field: str) -> str:
        """``serving.workload.<key>...`` as the flag that gave ``<key>`` (an arrival setting,
        ``arrival.cv``, the flag that gave it), else unchanged."""
        key = self._key(field)
        if key is None:
            return field
        parts = key.split(".")
        if parts[0] == "arrival" and len(parts) > 1:    # a setting no flag gave is the file's
            return self.flags.get(f"arrival.{parts[1]}", field)
        return self.flags.get(parts[0], field)

    def setting_of(self, field: str) -> Optional[str]:
        """The arrival setting a bad ``field`` names where its flag gives several (``cv`` of
        ``--workload gamma:cv=C,rate=R``), for the message; None otherwise."""
        key = self._key(field)
        parts = key.split(".") if key is not None else []
        if len(parts) < 2 or parts[0] != "arrival" or self.flags.get(f"arrival.{parts[1]}") != "--workload":
            return None
        return {"rate_per_s": "rate"}.get(parts[1], parts[1])

    def named(self, exc: ConfigError) -> ConfigError:
        """``exc`` (a bad value of this workload) named as the flag that gave the value
        (:meth:`field_of`, :meth:`setting_of`), or itself where no flag did."""
        field = self.field_of(exc.field)
        if field == exc.field:
            return exc
        message = str(exc)[len(exc.field) + 2:]
        setting = self.setting_of(exc.field)
        return ConfigError(field, f"{setting} {message}" if setting else message)

    @staticmethod
    def _key(field: str) -> Optional[str]:
        head = "serving.workload."
        return field[len(head):] if field.startswith(head) else None
