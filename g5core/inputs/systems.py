"""Systems: what one chip, its node and its network can do.

A system is read from a YAML file. The shipped catalogue (``g5core/data/systems/*.yaml``)
and a file a user writes go through the same loader and the same checks, so a user file
is as good as a shipped one. Every figure is per chip; bandwidths are per direction.

    spec = get_system("h100-sxm")             # catalogue name
    spec = get_system("./my-cluster.yaml")    # or a path to a system YAML file
    spec.peak_flops("bf16"), spec.op_efficiency("gemm")
"""
from __future__ import annotations

import contextvars
import math
import os
import re
from functools import lru_cache
from importlib.resources import files
from pathlib import Path
from typing import Any, Iterator, Mapping

import attrs
import yaml

from g5core.inputs.dtypes import PEAK_DTYPES
from g5core.inputs.framework import Framework
from g5core.api.errors import ConfigError, suggest
from g5core.inputs.reading import (
    DuplicateKeyError, UniqueKeyLoader, check_keys, check_range, duplicate_key_error, read_text, safe_float,
)

__all__ = [
    "OP_CLASSES",
    "EFFICIENCY_KEYS",
    "FrozenMap",
    "SystemSpec",
    "CATALOG_NAMES",
    "get_system",
]

#: Compute op classes; each has its own efficiency in a system file.
OP_CLASSES: tuple[str, ...] = ("gemm", "attention", "elementwise")
#: Keys of ``efficiency``: the op classes plus the HBM-bandwidth efficiency.
EFFICIENCY_KEYS: tuple[str, ...] = OP_CLASSES + ("hbm",)


class FrozenMap(Mapping):
    """A read-only, hashable mapping (equal to a dict with the same items)."""

    __slots__ = ("_data", "_hash")

    def __init__(self, items: Mapping | None = None):
        self._data = dict(sorted(dict(items or {}).items()))
        self._hash = None

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self) -> Iterator:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(tuple(self._data.items()))
        return self._hash

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"


# ---------------------------------------------------------------------------------------
# Converters and validators (shared by direct construction and the file loader)
# ---------------------------------------------------------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _describe(value: Any) -> str:
    return f"{value!r} (a {type(value).__name__})"


def _to_float(value: Any) -> Any:
    return safe_float(value)


def _to_int(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _to_frozen_float_map(value: Any) -> Any:
    if isinstance(value, Mapping) and not isinstance(value, FrozenMap):
        return FrozenMap({k: _to_float(v) for k, v in value.items()})
    return value


def _field(attribute: attrs.Attribute) -> str:
    return f"system.{attribute.name}"


def _unit_kind(field: str) -> str | None:
    """The LIMITS kind of a field, from the unit its name ends with."""
    for suffix in ("bytes_per_s", "flops_per_s", "bytes", "s"):
        if field.endswith("_" + suffix) or field.split(".")[-1] == suffix:
            return "seconds" if suffix == "s" else suffix
    return None


def _in_range(field: str, value: Any, kind: str | None = None) -> None:
    """Refuse a magnitude no chip could have (inputs.LIMITS, by the unit the name ends with)."""
    kind = kind or _unit_kind(field.split(".")[1])  # system.<name>[.<key>]
    if kind is not None:
        check_range(field, value, kind)


def _finite_number(value: Any) -> bool:
    """A number that is not inf or NaN (an int too large for a double counts: the range
    check refuses it with its digits)."""
    return _is_number(value) and (isinstance(value, int) or math.isfinite(value))


def _check_positive_number(field: str, value: Any) -> None:
    if not _finite_number(value):
        raise ConfigError(field, f"expected a positive number, got {_describe(value)}")
    if value <= 0:
        raise ConfigError(field, f"expected a positive number (> 0), got {value!r}")
    _in_range(field, value)


def _positive_int(instance, attribute, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(_field(attribute), f"expected a positive integer, got {_describe(value)}")
    if value <= 0:
        raise ConfigError(_field(attribute), f"expected a positive integer (> 0), got {value!r}")
    _in_range(_field(attribute), value, "chips_per_node" if attribute.name == "chips_per_node" else None)


def _positive(instance, attribute, value) -> None:
    _check_positive_number(_field(attribute), value)


def _non_negative(instance, attribute, value) -> None:
    field = _field(attribute)
    if not _finite_number(value):
        raise ConfigError(field, f"expected a number of seconds >= 0, got {_describe(value)}")
    if value < 0:
        raise ConfigError(field, f"expected a number of seconds >= 0, got {value!r}")
    _in_range(field, value, "seconds")


def _non_empty_name(instance, attribute, value) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(_field(attribute), f"expected a non-empty string, got {_describe(value)}")


def _peak_flops_map(instance, attribute, value) -> None:
    field = _field(attribute)
    if not isinstance(value, Mapping):
        raise ConfigError(
            field,
            f"expected a mapping of dtype to peak FLOP/s (e.g. {{bf16: 989.4e12}}), "
            f"got {_describe(value)}",
        )
    if not value:
        raise ConfigError(field, f"give the dense peak FLOP/s of at least one dtype of "
                                 f"{', '.join(PEAK_DTYPES)}")
    for key in value:
        if key not in PEAK_DTYPES:
            raise ConfigError(
                f"{field}.{key}",
                f"unknown dtype {key!r}{suggest(str(key), PEAK_DTYPES)}; "
                f"use any of {', '.join(PEAK_DTYPES)}",
            )
        _check_positive_number(f"{field}.{key}", value[key])


def _efficiency_map(instance, attribute, value) -> None:
    field = _field(attribute)
    if not isinstance(value, Mapping):
        raise ConfigError(
            field,
            f"expected a mapping with keys {', '.join(EFFICIENCY_KEYS)}, got {_describe(value)}",
        )
    check_keys(value, field, EFFICIENCY_KEYS, EFFICIENCY_KEYS,
               missing=f"missing; efficiency needs all of {', '.join(EFFICIENCY_KEYS)} (each a fraction in (0, 1])")
    for key in EFFICIENCY_KEYS:
        v = value[key]
        if not _finite_number(v) or not (0 < v <= 1):
            raise ConfigError(f"{field}.{key}", f"expected a fraction in (0, 1], got {_describe(v)}")
        check_range(f"{field}.{key}", v, "fraction")


def _optional_nics(instance, attribute, value) -> None:
    if value is not None:
        _positive_int(instance, attribute, value)


def _compute_capability(instance, attribute, value) -> None:
    if value is not None and (not _is_number(value) or not 1.0 <= value <= 100.0):
        raise ConfigError(_field(attribute), f"expected a CUDA compute capability such as 9.0, got {_describe(value)}")


def _to_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _int_list(instance, attribute, value) -> None:
    if not isinstance(value, tuple) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(_field(attribute), f"expected a list of NIC indices, one per chip of a node, "
                                             f"got {_describe(value)}")


def _boolean(instance, attribute, value) -> None:
    if not isinstance(value, bool):
        raise ConfigError(_field(attribute), f"expected true or false, got {_describe(value)}")


FABRIC_KEYS = ("nodes_per_leaf", "oversubscription")
#: no real fabric is oversubscribed more than this; beyond it a run's times lose meaning
MAX_OVERSUBSCRIPTION = 1000.0


def _fabric_map(instance, attribute, value) -> None:
    field = _field(attribute)
    if not isinstance(value, Mapping):
        raise ConfigError(field, f"expected a mapping {{nodes_per_leaf: N, oversubscription: X}}, got {_describe(value)}")
    if not value:
        return
    check_keys(value, field, FABRIC_KEYS, FABRIC_KEYS, missing=f"missing; a fabric tier needs both {' and '.join(FABRIC_KEYS)}")
    n = value["nodes_per_leaf"]
    if not _finite_number(n) or n != int(n) or not 1 <= n <= 2 ** 24:
        raise ConfigError(f"{field}.nodes_per_leaf", f"expected a whole number of nodes in 1 .. 2^24, got {_describe(n)}")
    o = value["oversubscription"]
    if not _finite_number(o) or not 1 <= o <= MAX_OVERSUBSCRIPTION:
        raise ConfigError(f"{field}.oversubscription",
                          f"expected a number in 1 .. {MAX_OVERSUBSCRIPTION:g} (1: full bisection, 2: 2:1 "
                          f"oversubscribed), got {_describe(o)}")


#: the first CUDA compute capability whose NVSwitch reduces in place (NVLS: Hopper, 9.0;
#: NCCL enables NVLS only from sm90, and its NVLS efficiency table is zero below it)
NVLS_COMPUTE_CAPABILITY = 9.0


def _to_frozen_nested_map(value: Any) -> Any:
    if isinstance(value, Mapping) and not isinstance(value, FrozenMap):
        return FrozenMap({k: FrozenMap(v) if isinstance(v, Mapping) else v for k, v in value.items()})
    return value


def _nested_map(instance, attribute, value) -> None:
    """A block a plugin reads (``nccl``): a mapping of mappings; the plugin checks its keys."""
    field = _field(attribute)
    if not isinstance(value, Mapping):
        raise ConfigError(field, f"expected a mapping like {{all_reduce: {{algorithm: ring, protocol: simple}}}}, "
                                 f"got {_describe(value)}")
    for key, inner in value.items():
        if not isinstance(inner, Mapping) or not inner:
            raise ConfigError(f"{field}.{key}", f"expected a mapping with algorithm and/or protocol, got {_describe(inner)}")


#: the algorithms whose node-crossing steps ``network_hop_latency_s`` may time
HOP_ALGORITHMS = ("ring", "tree", "nvls_tree")


def _hop_map(instance, attribute, value) -> None:
    field = _field(attribute)
    if not isinstance(value, Mapping):
        raise ConfigError(field, f"expected a mapping like {{ring: 10e-6, tree: 20e-6}}, got {_describe(value)}")
    check_keys(value, field, HOP_ALGORITHMS)
    for key, v in value.items():
        _in_range(f"{field}.{key}", v, "seconds")


# ----------------------------------------------------------------------------------------
# The size-aware roofline's parameters (the ``compute_model`` block of a system file)
# ----------------------------------------------------------------------------------------

FLOOR_KEYS = ("gemm", "attention", "decode_attention", "elementwise")


def _cm_fraction(field: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (isinstance(v, int) or math.isfinite(v)) \
            or not 0 < v <= 1:
        raise ConfigError(field, f"expected a fraction in (0, 1], got {v!r}")
    check_range(field, v, "fraction")
    return float(v)


def _cm_seconds(field: str, v) -> float:
    """A time of the compute_model block: seconds >= 0, inside the seconds range."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (isinstance(v, int) or math.isfinite(v)) \
            or v < 0:
        raise ConfigError(field, f"expected seconds >= 0, got {v!r}")
    check_range(field, v, "seconds")
    return float(v)


def _cm_positive(field: str, v, kind: str, integer: bool = False) -> float:
    """A positive number of the compute_model block, inside its range (``LIMITS[kind]``)."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (isinstance(v, int) or math.isfinite(v)) and v > 0
    if ok and integer and not isinstance(v, int) and not float(v).is_integer():
        ok = False
    if not ok:
        raise ConfigError(field, f"expected a positive {'integer' if integer else 'number'}, got {v!r}")
    check_range(field, v, kind)
    return int(v) if integer else float(v)


@attrs.frozen(kw_only=True)
class ComputeModel:
    """Parameters of the size-aware roofline (:mod:`g5core.sim.roofline` documents the formulas).

    All required when the block is given; a system file without the block runs the flat
    roofline (``efficiency`` per op class) and the run output says so.
    """

    gemm_peak_fraction: tuple        # ((dtype, fraction), ...): large-GEMM fraction of dense peak
    gemm_tile_m: int
    gemm_tile_n: int
    gemm_tile_k: int
    sm_count: int                    # streaming multiprocessors: one GEMM tile per SM per wave
    attention_peak_fraction: float   # flash attention's asymptotic fraction of peak (long blocks)
    attention_half_length_tokens: float  # block length at which it reaches half that fraction
    hbm_fraction: float              # achieved fraction of HBM bandwidth of a streaming kernel
    kernel_floor_s: tuple            # ((kernel kind, seconds), ...) for FLOOR_KEYS
    #: optional other attention kernel families: ((name, (peak_fraction, half_length_tokens)), ...),
    #: chosen by the system file's ``framework: {attention: NAME}``
    attention_curves: tuple = ()
    #: optional, given together: a weight-streaming GEMM's memory time is
    #: ``gemm_hbm_latency_s + bytes / (hbm_bw * gemm_hbm_fraction)`` (a fixed time plus its bytes at
    #: the achieved bandwidth, fitted to measured GEMMs); without them ``bytes / (hbm_bw * hbm_fraction)``
    gemm_hbm_latency_s: float | None = None
    gemm_hbm_fraction: float | None = None

    KEYS = ("gemm_peak_fraction", "gemm_tile_m", "gemm_tile_n", "gemm_tile_k", "sm_count",
            "attention_peak_fraction", "attention_half_length_tokens", "hbm_fraction", "kernel_floor_s")
    GEMM_HBM_KEYS = ("gemm_hbm_latency_s", "gemm_hbm_fraction")
    OPTIONAL = ("attention_curves",) + GEMM_HBM_KEYS

    @classmethod
    def from_mapping(cls, data, field: str = "system.compute_model") -> "ComputeModel":
        if not hasattr(data, "items"):
            raise ConfigError(field, f"expected a mapping with keys {', '.join(cls.KEYS)}, got {data!r}")
        check_keys(data, field, cls.KEYS + cls.OPTIONAL, cls.KEYS,
                   missing=f"missing; the compute_model block needs all of {', '.join(cls.KEYS)} "
                           "(see the shipped system files)")
        curves = data.get("attention_curves", {})
        if not hasattr(curves, "items"):
            raise ConfigError(f"{field}.attention_curves", "expected a mapping such as "
                                                           "{fa3: {peak_fraction: 0.645, half_length_tokens: 614}}")
        parsed_curves = []
        for name, curve in sorted(curves.items()):
            where = f"{field}.attention_curves.{name}"
            if not hasattr(curve, "items"):
                raise ConfigError(where, "expected {peak_fraction: F, half_length_tokens: N}")
            check_keys(curve, where, ("peak_fraction", "half_length_tokens"), ("peak_fraction", "half_length_tokens"))
            parsed_curves.append((str(name), (_cm_fraction(f"{where}.peak_fraction", curve["peak_fraction"]),
                                              _cm_positive(f"{where}.half_length_tokens",
                                                           curve["half_length_tokens"], "tokens"))))
        peaks = data["gemm_peak_fraction"]
        if not hasattr(peaks, "items") or not peaks:
            raise ConfigError(f"{field}.gemm_peak_fraction", f"expected a mapping of dtype to fraction, got {peaks!r}")
        floors = data["kernel_floor_s"]
        if not hasattr(floors, "items"):
            raise ConfigError(f"{field}.kernel_floor_s", f"expected a mapping with keys {', '.join(FLOOR_KEYS)}")
        for key in floors:
            if key not in FLOOR_KEYS:
                raise ConfigError(f"{field}.kernel_floor_s.{key}", f"unknown kernel kind; valid: {', '.join(FLOOR_KEYS)}")
        out = {}
        for key in FLOOR_KEYS:
            if key not in floors:
                raise ConfigError(f"{field}.kernel_floor_s.{key}", f"missing; give all of {', '.join(FLOOR_KEYS)}")
            out[key] = _cm_seconds(f"{field}.kernel_floor_s.{key}", floors[key])
        gemm_hbm = [k for k in cls.GEMM_HBM_KEYS if k in data]
        if len(gemm_hbm) == 1:
            other = next(k for k in cls.GEMM_HBM_KEYS if k not in data)
            raise ConfigError(f"{field}.{other}", f"missing; {gemm_hbm[0]} and {other} go together (a GEMM's "
                                                  "memory time is latency + bytes / (hbm_bw x fraction)): give both "
                                                  "or neither")
        gemm_hbm_values = {"gemm_hbm_latency_s": _cm_seconds(f"{field}.gemm_hbm_latency_s", data["gemm_hbm_latency_s"]),
                           "gemm_hbm_fraction": _cm_fraction(f"{field}.gemm_hbm_fraction", data["gemm_hbm_fraction"])
                           } if gemm_hbm else {}
        return cls(
            gemm_peak_fraction=tuple(sorted((str(k), _cm_fraction(f"{field}.gemm_peak_fraction.{k}", v))
                                            for k, v in peaks.items())),
            gemm_tile_m=_cm_positive(f"{field}.gemm_tile_m", data["gemm_tile_m"], "tile", True),
            gemm_tile_n=_cm_positive(f"{field}.gemm_tile_n", data["gemm_tile_n"], "tile", True),
            gemm_tile_k=_cm_positive(f"{field}.gemm_tile_k", data["gemm_tile_k"], "tile", True),
            sm_count=_cm_positive(f"{field}.sm_count", data["sm_count"], "sm_count", True),
            attention_peak_fraction=_cm_fraction(f"{field}.attention_peak_fraction", data["attention_peak_fraction"]),
            attention_half_length_tokens=_cm_positive(f"{field}.attention_half_length_tokens",
                                                      data["attention_half_length_tokens"], "tokens"),
            hbm_fraction=_cm_fraction(f"{field}.hbm_fraction", data["hbm_fraction"]),
            kernel_floor_s=tuple((k, out[k]) for k in FLOOR_KEYS),
            attention_curves=tuple(parsed_curves),
            **gemm_hbm_values,
        )

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self.KEYS}
        if self.gemm_hbm_fraction is not None:
            out.update({k: getattr(self, k) for k in self.GEMM_HBM_KEYS})
        out["gemm_peak_fraction"] = dict(self.gemm_peak_fraction)
        out["kernel_floor_s"] = dict(self.kernel_floor_s)
        if self.attention_curves:
            out["attention_curves"] = {n: {"peak_fraction": p, "half_length_tokens": h}
                                       for n, (p, h) in self.attention_curves}
        return out

    def attention_curve(self, name: str = "default") -> tuple[float, float]:
        """(peak fraction, half length in tokens) of the attention kernel family ``name``."""
        if name == "default":
            return self.attention_peak_fraction, self.attention_half_length_tokens
        table = dict(self.attention_curves)
        if name not in table:
            raise ConfigError("system.framework.attention",
                              f"no attention curve {name!r} in compute_model.attention_curves (it lists "
                              f"{', '.join(['default', *table])}); add it or choose one of those")
        return table[name]

    def gemm_fraction(self, dtype: str) -> float:
        table = dict(self.gemm_peak_fraction)
        if dtype not in table:
            raise ConfigError("system.compute_model.gemm_peak_fraction",
                              f"no GEMM peak fraction for dtype '{dtype}' (it lists {', '.join(table)}); add it")
        return table[dtype]

    def floor_s(self, kind: str) -> float:
        return dict(self.kernel_floor_s)[kind]


PROFILE_SOURCES = ("aiconfigurator",)
PROFILE_KEYS = ("source", "gpu", "framework", "version")


@attrs.frozen(kw_only=True)
class Profile:
    """A measured per-op table set chosen in the system file (``profile:``)."""

    source: str
    gpu: str
    framework: str
    version: str = ""   # "" = the newest version the tables hold for each op

    @classmethod
    def from_mapping(cls, data, field: str = "system.profile") -> "Profile":
        if not hasattr(data, "items"):
            raise ConfigError(field, "expected a mapping such as {source: aiconfigurator, gpu: h100_sxm, "
                                     f"framework: trtllm}}, got {data!r}")
        check_keys(data, field, PROFILE_KEYS)
        for key in PROFILE_KEYS[:3]:
            v = data.get(key)
            if not isinstance(v, str) or not v.strip():
                raise ConfigError(f"{field}.{key}", "missing or empty; give e.g. source: aiconfigurator, "
                                                    "gpu: h100_sxm, framework: trtllm")
        if data["source"] not in PROFILE_SOURCES:
            raise ConfigError(f"{field}.source", f"unknown source {data['source']!r}; known: "
                                                 f"{', '.join(PROFILE_SOURCES)}")
        version = data.get("version", "")
        if not isinstance(version, str):
            raise ConfigError(f"{field}.version", f"expected a version string such as '1.3.0rc20', got {version!r}")
        return cls(source=data["source"], gpu=data["gpu"], framework=data["framework"], version=version)

    def to_dict(self) -> dict:
        out = {"source": self.source, "gpu": self.gpu, "framework": self.framework}
        if self.version:
            out["version"] = self.version
        return out


def _to_compute_model(value: Any) -> Any:
    return value if value is None or isinstance(value, ComputeModel) else ComputeModel.from_mapping(value)


def _to_framework(value: Any) -> Any:
    return value if value is None or isinstance(value, Framework) else Framework.from_mapping(value)


def _to_profile(value: Any) -> Any:
    return value if value is None or isinstance(value, Profile) else Profile.from_mapping(value)


#: Fields a system file may leave out (each documented on SystemSpec).
OPTIONAL_KEYS: tuple[str, ...] = ("compute_model", "profile", "framework")


# ---------------------------------------------------------------------------------------
# The spec
# ---------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SystemSpec:
    """One chip of a cluster, its node and its network. All figures per chip."""

    name: str = attrs.field(validator=_non_empty_name)
    #: chips that share one intra-node fabric (NVLink/NVSwitch domain)
    chips_per_node: int = attrs.field(converter=_to_int, validator=_positive_int)
    hbm_capacity_bytes: int = attrs.field(converter=_to_int, validator=_positive_int)
    hbm_bw_bytes_per_s: float = attrs.field(converter=_to_float, validator=_positive)
    #: dense (non-sparse) peak per dtype; fp32 is the non-tensor FP32 peak
    peak_flops_per_s: Mapping[str, float] = attrs.field(
        converter=_to_frozen_float_map, validator=_peak_flops_map
    )
    #: per chip, per direction
    intra_node_bw_bytes_per_s: float = attrs.field(converter=_to_float, validator=_positive)
    intra_node_latency_s: float = attrs.field(converter=_to_float, validator=_non_negative)
    #: per chip, per direction
    network_bw_bytes_per_s: float = attrs.field(converter=_to_float, validator=_positive)
    network_latency_s: float = attrs.field(converter=_to_float, validator=_non_negative)
    launch_overhead_s: float = attrs.field(converter=_to_float, validator=_non_negative)
    #: keys exactly OP_CLASSES + ("hbm",), each in (0, 1]
    efficiency: Mapping[str, float] = attrs.field(
        converter=_to_frozen_float_map, validator=_efficiency_map
    )
    #: optional: the size-aware roofline's parameters (without it: the flat roofline)
    compute_model: ComputeModel | None = attrs.field(default=None, converter=_to_compute_model)
    #: optional: a measured per-op table set, e.g. {source: aiconfigurator, gpu: h100_sxm, framework: trtllm}
    profile: Profile | None = attrs.field(default=None, converter=_to_profile)
    # -- network topology (optional; see docs/design-notes.md, "Network") ----------------
    #: NICs per node (scale-up domain); None: one per chip. Must divide chips_per_node.
    #: ``network_bw_bytes_per_s`` is per NIC.
    nics_per_node: int | None = attrs.field(default=None, converter=_to_int, validator=_optional_nics)
    #: which NIC (0 .. nics-1) each chip of a node uses, by its index in the node; empty:
    #: rail-optimised, chip i on NIC i * nics / chips_per_node
    nic_of_chip: tuple = attrs.field(factory=tuple, converter=_to_tuple, validator=_int_list)
    #: the scale-up switch reduces in place (NVLink SHARP, "NVLS")
    nvls: bool = attrs.field(default=False, validator=_boolean)
    #: the tier above the NICs: {nodes_per_leaf: int, oversubscription: number >= 1};
    #: empty: full bisection
    fabric: Mapping[str, float] = attrs.field(factory=FrozenMap, converter=_to_frozen_float_map,
                                              validator=_fabric_map)
    #: the GPU's CUDA compute capability (9.0 Hopper, 10.0 Blackwell, 8.0 Ampere): NCCL's
    #: tables depend on it; the collectives plugin asks for it
    compute_capability: float | None = attrs.field(default=None, converter=_to_float, validator=_compute_capability)
    #: forced NCCL choices per collective, e.g. {all_reduce: {algorithm: ring, protocol: simple}};
    #: the collectives plugin owns its schema and checks it (g5plugins.collectives.forced_choices)
    nccl: Mapping[str, Mapping[str, str]] = attrs.field(factory=FrozenMap, converter=_to_frozen_nested_map,
                                                        validator=_nested_map)
    #: measured latency of one node-crossing step per algorithm (ring, tree, nvls_tree), which
    #: replaces NCCL's network latency in the time of the algorithm NCCL chose (not in its choice)
    network_hop_latency_s: Mapping[str, float] = attrs.field(factory=FrozenMap, converter=_to_frozen_float_map,
                                                             validator=_hop_map)
    #: optional: how the serving framework launches kernels (g5core/inputs/framework.py)
    framework: Framework | None = attrs.field(default=None, converter=_to_framework)

    def __attrs_post_init__(self) -> None:
        if self.chips_per_node % self.nics > 0:
            raise ConfigError("system.nics_per_node",
                              f"{self.nics} NICs do not divide the {self.chips_per_node} chips of a node; "
                              f"give a divisor of chips_per_node (e.g. {self.chips_per_node})")
        if self.nic_of_chip:
            if len(self.nic_of_chip) != self.chips_per_node:
                raise ConfigError("system.nic_of_chip", f"lists {len(self.nic_of_chip)} chips, but a node has "
                                                        f"{self.chips_per_node}; give one NIC index per chip")
            bad = [v for v in self.nic_of_chip if not 0 <= v < self.nics]
            if bad:
                raise ConfigError("system.nic_of_chip", f"NIC index {bad[0]} is outside 0 .. {self.nics - 1} "
                                                        f"(nics_per_node is {self.nics})")
            unused = sorted(set(range(self.nics)) - set(self.nic_of_chip))
            if unused:
                raise ConfigError("system.nic_of_chip", f"no chip uses NIC {unused[0]}; every NIC of nics_per_node "
                                                        "needs at least one chip (or lower nics_per_node)")
        if self.nvls and self.compute_capability is not None and self.compute_capability < NVLS_COMPUTE_CAPABILITY:
            raise ConfigError("system.nvls", f"NVLS (NVLink SHARP) needs compute capability "
                                             f"{NVLS_COMPUTE_CAPABILITY:.1f} or newer (Hopper), and compute_capability is "
                                             f"{self.compute_capability:.1f}; set nvls: false")

    @property
    def nics(self) -> int:
        """NICs per node (one per chip when the file does not say)."""
        return self.chips_per_node if self.nics_per_node is None else self.nics_per_node

    # -- lookups ---------------------------------------------------------------------

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``; ConfigError if this system does not list it."""
        try:
            return self.peak_flops_per_s[dtype]
        except (KeyError, TypeError):
            pass
        known = ", ".join(self.peak_flops_per_s)
        if dtype == "fp4":
            msg = (f"system '{self.name}' has no FP4 tensor-core peak (it lists {known}): nvfp4/mxfp4 weights "
                   f"run their GEMMs in FP4; use int4 (weight-only) or fp8 weights here, or a chip with "
                   f"FP4 (b200, gb200-nvl72, gb300-nvl72)")
        elif dtype in PEAK_DTYPES:
            msg = (f"system '{self.name}' has no peak FLOP/s for dtype '{dtype}' "
                   f"(it lists {known}); choose one of those or add it to the system file")
        else:
            msg = (f"system '{self.name}': unknown dtype {dtype!r}"
                   f"{suggest(str(dtype), self.peak_flops_per_s)}; it lists {known}")
        raise ConfigError("system.peak_flops_per_s", msg)

    def op_efficiency(self, op_class: str) -> float:
        """Compute efficiency of an op class (or ``"hbm"`` for HBM-bandwidth efficiency)."""
        try:
            return self.efficiency[op_class]
        except (KeyError, TypeError):
            raise ConfigError(
                "system.efficiency",
                f"system '{self.name}': unknown op class {op_class!r}"
                f"{suggest(str(op_class), EFFICIENCY_KEYS)}; known: {', '.join(EFFICIENCY_KEYS)}",
            ) from None

    def to_dict(self) -> dict:
        """Plain-data form; ``SystemSpec.from_dict(spec.to_dict()) == spec``."""
        out = attrs.asdict(self, recurse=False)
        out["peak_flops_per_s"] = dict(self.peak_flops_per_s)
        out["efficiency"] = dict(self.efficiency)
        for key in OPTIONAL_KEYS:
            value = out.pop(key)
            if value is not None:
                out[key] = value.to_dict()
        out["fabric"] = dict(self.fabric)
        if out["fabric"]:
            out["fabric"]["nodes_per_leaf"] = int(out["fabric"]["nodes_per_leaf"])
        out["nccl"] = {k: dict(v) for k, v in self.nccl.items()}
        out["network_hop_latency_s"] = dict(self.network_hop_latency_s)
        out["nic_of_chip"] = list(self.nic_of_chip)
        return out

    # -- loading ---------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping, source: str = "<dict>") -> SystemSpec:
        """Build from plain data, checking every key; errors name the field and the fix."""
        where = "" if source == "<dict>" else f" (in {source})"
        if not isinstance(data, Mapping):
            raise ConfigError(
                "system", f"expected a mapping of system fields, got {_describe(data)}{where}"
            )
        valid = [f.name for f in attrs.fields(cls)]
        check_keys(data, "system", valid, where=where)
        required = [f.name for f in attrs.fields(cls) if f.default is attrs.NOTHING]
        missing = [k for k in required if k not in data]
        if missing:
            raise ConfigError(
                f"system.{missing[0]}",
                f"missing{where}; add it to the system file"
                + (f" (also missing: {', '.join(missing[1:])})" if len(missing) > 1 else ""),
            )
        try:
            return cls(**{k: data[k] for k in valid if k in data})
        except ConfigError as exc:
            if not where:
                raise
            raise ConfigError(exc.field, f"{str(exc)[len(exc.field) + 2:]}{where}") from None

    @classmethod
    def from_yaml(cls, path) -> SystemSpec:
        """Load one system from a YAML file (shipped or user-written: same checks)."""
        path = Path(path)
        real = os.path.realpath(path)
        chain = _BASE_CHAIN.get()
        if real in (r for r, _ in chain):
            names = [given for _, given in chain] + [str(path)]
            raise ConfigError("system.base", f"the base: chain loops back to a file it started from: "
                                             f"{' -> '.join(names)}; end the chain at a file without base:")
        token = _BASE_CHAIN.set(chain + ((real, str(path)),))
        try:
            return cls._from_text(read_text(path, "system", "system file"), str(path))
        finally:
            _BASE_CHAIN.reset(token)

    @classmethod
    def _from_text(cls, text: str, source: str) -> SystemSpec:
        try:
            data = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
        except DuplicateKeyError as exc:
            raise duplicate_key_error("system", f"'{source}'", exc) from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or str(exc)
            raise ConfigError("system", f"invalid YAML in '{source}'{at}: {problem}") from None
        if not isinstance(data, Mapping):
            raise ConfigError(
                "system",
                f"'{source}' must hold one system as a mapping of fields "
                f"(name, chips_per_node, ...), got {_describe(data)}",
            )
        if "base" in data:
            data = _with_base(data, source)
        return cls.from_dict(data, source=source)


#: the system files being read through ``base:`` (real path, path as given), outermost first
_BASE_CHAIN: contextvars.ContextVar = contextvars.ContextVar("g5_system_base_chain", default=())


def _with_base(data: Mapping, source: str) -> dict:
    """``base: NAME-OR-PATH``: every field of that system, then this file's own keys over
    it (a path is relative to this file). Lets a file add a ``profile`` or change a few
    figures of a shipped system without copying the rest."""
    base = data["base"]
    if not isinstance(base, str) or not base.strip():
        raise ConfigError("system.base", f"expected a system name or a path to a system file, got "
                                         f"{_describe(base)} (in {source})")
    if base not in CATALOG_NAMES and not os.path.isabs(base) and not source.startswith("<"):
        base = str(Path(source).parent / base)
    merged = get_system(base).to_dict()
    merged.update({k: v for k, v in data.items() if k != "base"})
    return merged


class _Loader(UniqueKeyLoader):
    """SafeLoader (refusing duplicate keys) that also reads YAML 1.2 floats such as ``450e9`` and ``3.35e12``.

    PyYAML follows YAML 1.1, where an exponent needs a dot and a sign (``4.5e+11``);
    without this, ``450e9`` would be read as a string.
    """


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+
            |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?)$""",
        re.X,
    ),
    list("-+0123456789."),
)


# ---------------------------------------------------------------------------------------
# The catalogue
# ---------------------------------------------------------------------------------------


def _catalog_dir():
    try:
        root = files("g5core") / "data" / "systems"
        if root.is_dir():
            return root
    except Exception:  # e.g. a namespace package on an old Python: use the file system
        pass
    return Path(__file__).resolve().parent.parent / "data" / "systems"


def _catalog_names() -> tuple[str, ...]:
    try:
        entries = list(_catalog_dir().iterdir())
    except OSError:
        return ()
    return tuple(sorted(e.name[: -len(".yaml")] for e in entries if e.name.endswith(".yaml")))


#: Names of the shipped systems (``g5core/data/systems/<name>.yaml``).
CATALOG_NAMES: tuple[str, ...] = _catalog_names()


@lru_cache(maxsize=None)
def _load_catalog(name: str) -> SystemSpec:
    resource = _catalog_dir() / f"{name}.yaml"
    spec = SystemSpec._from_text(resource.read_text(encoding="utf-8"), f"<catalog>/{name}.yaml")
    if spec.name != name:
        raise ConfigError(
            "system.name",
            f"catalog file {name}.yaml names its system '{spec.name}'; they must match",
        )
    return spec


def _looks_like_path(text: str) -> bool:
    return (
        text.endswith((".yaml", ".yml"))
        or os.sep in text
        or (os.altsep is not None and os.altsep in text)
        or text.startswith((".", "~"))
    )


def get_system(name_or_path: str) -> SystemSpec:
    """A catalogue system by name, or a system read from a YAML file path."""
    if isinstance(name_or_path, SystemSpec):
        return name_or_path
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ConfigError(
            "system",
            f"expected a system name or a path to a system YAML file, got {_describe(name_or_path)}",
        )
    text = os.fspath(name_or_path)
    if text in CATALOG_NAMES:
        return _load_catalog(text)
    path = Path(text).expanduser()
    if path.is_file() or isinstance(name_or_path, os.PathLike) or _looks_like_path(text):
        if not path.is_file():
            raise ConfigError("system", f"no system file at '{text}'")
        return SystemSpec.from_yaml(path)
    raise ConfigError(
        "system",
        f"unknown system {text!r}{suggest(text, CATALOG_NAMES)}; "
        f"known: {', '.join(CATALOG_NAMES)}; or give a path to a system YAML file",
    )


def system_source(name_or_path: str) -> str:
    """The YAML text of a catalogue system or a system file (with its comments and cited
    sources), after it passed every check; ConfigError otherwise."""
    spec = get_system(name_or_path)
    if name_or_path in CATALOG_NAMES:
        return (_catalog_dir() / f"{name_or_path}.yaml").read_text(encoding="utf-8")
    text = read_text(Path(os.fspath(name_or_path)).expanduser(), "system", "system file")
    out = f"# {spec.name}, from {os.fspath(name_or_path)}\n{text}"
    own = yaml.load(text, Loader=_Loader)
    if isinstance(own, Mapping) and "base" in own:
        out = out.rstrip("\n") + "\n\n" + resolved_listing(spec, own)
    return out


def resolved_listing(spec: "SystemSpec", own: Mapping) -> str:
    """Every field of a system with ``base:`` as it resolves: this file's keys marked, the
    rest taken from the base."""
    lines = [f"# resolved: every field of '{spec.name}' (base {own['base']}, then this file's keys over it)"]
    for key, value in spec.to_dict().items():
        where = "this file" if key in own else f"base {own['base']}"
        lines.append(f"{key}: {_yaml_value(value)}  # {where}")
    return "\n".join(lines)


def _yaml_value(value: Any) -> str:
    """A value in YAML flow style, floats short (4.8e+12, 6.4e-06)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if value and not 1e-3 <= abs(value) < 1e6:
            mantissa, exponent = f"{value:.12e}".split("e")
            return f"{mantissa.rstrip('0').rstrip('.')}e{exponent}"
        return format(value, ".12g")
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_yaml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml_value(v) for v in value) + "]"
    return str(value)
