"""The KV cache's settings: ``serving.prefix_cache`` and ``serving.kv_tiers``.

    serving:
      prefix_cache: {policy: lru, miss: faster, overlap: true}
      kv_tiers:
        - {kind: host}                           # the system's defaults (g5core/data/kv_tiers.yaml)
        - {kind: disk, bytes_per_chip: 1.0e12}   # any field replaced
        - {kind: remote, bytes_per_chip: 1.0e13} # the chip's NIC; no default size

Without either key the prefix cache is the one G5 had before it (per instance, never
evicts, its blocks counted per sequence), bit for bit. With ``prefix_cache`` (or
``kv_tiers``) it is a block cache bounded by the KV pool (:mod:`g5core.serve.kvcache`).
``policy``: which cached block leaves HBM first (``lru``, or a name a plugin registers);
``miss``: a block found in a lower tier is fetched (``fetch``), recomputed (``recompute``)
or whichever the step cost and the link say is ``faster``; ``overlap``: the fetch runs
layer by layer under the step's compute (vLLM's KV connector: ``start_load_kv`` then
``wait_for_layer_load`` before each layer's attention) instead of before it.
"""
from __future__ import annotations

import math
from importlib.resources import files
from typing import Mapping, Optional

import attrs

from g5core.api.errors import ConfigError
from g5core.inputs.reading import check_keys, load_yaml

TIER_KINDS = ("host", "disk", "remote")
TIER_KEYS = ("kind", "bytes_per_chip", "read_gbytes_per_s", "write_gbytes_per_s", "latency_s")
CACHE_KEYS = ("policy", "miss", "overlap")
MISS_POLICIES = ("faster", "fetch", "recompute")


@attrs.frozen
class TierSpec:
    """One tier below HBM, per chip: its size and the link to it (per direction)."""

    kind: str
    bytes_per_chip: float
    read_gbytes_per_s: float
    write_gbytes_per_s: float
    latency_s: float


@attrs.frozen
class CacheSpec:
    """``serving.prefix_cache`` and ``serving.kv_tiers`` as given (tiers not yet resolved
    against the system: :func:`resolve_tiers`)."""

    policy: str = "lru"
    miss: str = "faster"
    overlap: bool = True
    tiers: tuple = ()        # the given mappings, checked


def parse_cache(block: Mapping) -> Optional[CacheSpec]:
    """The cache settings of a ``serving:`` block; ``None`` when it has neither key."""
    cache, tiers = block.get("prefix_cache"), block.get("kv_tiers")
    if cache is None and tiers is None:
        return None
    cache = {} if cache is None else cache
    if not isinstance(cache, Mapping):
        raise ConfigError("serving.prefix_cache", f"must be a mapping such as {{policy: lru}}, got {cache!r}")
    check_keys(cache, "serving.prefix_cache", CACHE_KEYS)
    policy = cache.get("policy", "lru")
    if not isinstance(policy, str) or not policy:
        raise ConfigError("serving.prefix_cache.policy", f"must be a policy name such as lru, got {policy!r}")
    miss = cache.get("miss", "faster")
    if miss not in MISS_POLICIES:
        raise ConfigError("serving.prefix_cache.miss", f"must be one of {', '.join(MISS_POLICIES)}, got {miss!r}")
    overlap = cache.get("overlap", True)
    if not isinstance(overlap, bool):
        raise ConfigError("serving.prefix_cache.overlap", f"must be true or false, got {overlap!r}")
    tiers = [] if tiers is None else tiers
    if not isinstance(tiers, list):
        raise ConfigError("serving.kv_tiers", "must be a list of tiers such as [{kind: host}]")
    seen = []
    for i, tier in enumerate(tiers):
        field = f"serving.kv_tiers.{i}"
        if not isinstance(tier, Mapping):
            raise ConfigError(field, f"must be a mapping such as {{kind: host}}, got {tier!r}")
        check_keys(tier, field, TIER_KEYS, ("kind",), missing="is required")
        kind = tier["kind"]
        if kind not in TIER_KINDS:
            raise ConfigError(f"{field}.kind", f"must be one of {', '.join(TIER_KINDS)}, got {kind!r}")
        if kind in seen:
            raise ConfigError(f"{field}.kind", f"tier {kind} is given twice")
        if seen and TIER_KINDS.index(kind) < TIER_KINDS.index(seen[-1]):
            raise ConfigError(f"{field}.kind", f"tiers go down from HBM: host, disk, remote; {kind} after {seen[-1]}")
        seen.append(kind)
        for key in TIER_KEYS[1:]:
            if key in tier:
                _number(tier[key], f"{field}.{key}", zero=key == "latency_s")
    return CacheSpec(policy, miss, overlap, tuple(dict(t) for t in tiers))


def _number(value, field: str, zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (value == 0 and not zero):
        raise ConfigError(field, f"must be a {'non-negative' if zero else 'positive'} number, got {value!r}")
    return float(value)


def tier_defaults() -> dict:
    """``g5core/data/kv_tiers.yaml``: ``{links: {...}, systems: {name: {kind: {...}}}}``."""
    return load_yaml((files("g5core") / "data" / "kv_tiers.yaml").read_text())


def resolve_tiers(spec: CacheSpec, system) -> tuple[TierSpec, ...]:
    """Each configured tier with the system's defaults for the fields it leaves out
    (``system``: a :class:`g5core.inputs.systems.SystemSpec`)."""
    data = tier_defaults()
    own = data["systems"].get(system.name, {})
    out = []
    for i, given in enumerate(spec.tiers):
        kind = given["kind"]
        if kind == "remote":
            base = {"read_gbytes_per_s": system.network_bw_bytes_per_s / 1e9,
                    "write_gbytes_per_s": system.network_bw_bytes_per_s / 1e9,
                    "latency_s": system.network_latency_s}
        elif kind in own:
            entry = own[kind]
            base = {**data["links"][entry["link"]], "bytes_per_chip": entry["bytes_per_chip"]}
        else:
            base = {}
        values = {**base, **{k: v for k, v in given.items() if k != "kind"}}
        for key in TIER_KEYS[1:]:
            if key not in values:
                raise ConfigError(f"serving.kv_tiers.{i}.{key}",
                                  f"is required: system {system.name!r} has no default {kind} tier"
                                  + (" size (a remote store's size is what you deploy)" if kind == "remote" else ""))
        out.append(TierSpec(kind, float(values["bytes_per_chip"]), float(values["read_gbytes_per_s"]),
                            float(values["write_gbytes_per_s"]), float(values["latency_s"])))
    return tuple(out)
