"""Systems: what one chip, its node and its network can do.

A system is read from a YAML file. The shipped catalogue (``g5core/data/systems/*.yaml``)
and a file a user writes go through the same loader and the same checks, so a user file
is as good as a shipped one. Every figure is per chip; bandwidths are per direction.

    spec = get_system("h100-sxm")             # catalogue name
    spec = get_system("./my-cluster.yaml")    # or a path to a system YAML file
    spec.peak_flops("bf16"), spec.op_efficiency("gemm")
"""
from __future__ import annotations

import math
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Mapping

import attrs
import yaml

from .dtypes import BYTES_PER_ELEMENT
from .errors import ConfigError, suggest
from .inputs import DuplicateKeyError, UniqueKeyLoader, check_range, duplicate_key_error, read_text, safe_float

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
                                 f"{', '.join(BYTES_PER_ELEMENT)}")
    for key in value:
        if key not in BYTES_PER_ELEMENT:
            raise ConfigError(
                f"{field}.{key}",
                f"unknown dtype {key!r}{suggest(str(key), BYTES_PER_ELEMENT)}; "
                f"use any of {', '.join(BYTES_PER_ELEMENT)}",
            )
        _check_positive_number(f"{field}.{key}", value[key])


def _efficiency_map(instance, attribute, value) -> None:
    field = _field(attribute)
    if not isinstance(value, Mapping):
        raise ConfigError(
            field,
            f"expected a mapping with keys {', '.join(EFFICIENCY_KEYS)}, got {_describe(value)}",
        )
    for key in value:
        if key not in EFFICIENCY_KEYS:
            raise ConfigError(
                f"{field}.{key}",
                f"unknown key{suggest(str(key), EFFICIENCY_KEYS)}; "
                f"valid keys: {', '.join(EFFICIENCY_KEYS)}",
            )
    for key in EFFICIENCY_KEYS:
        if key not in value:
            raise ConfigError(
                f"{field}.{key}",
                f"missing; efficiency needs all of {', '.join(EFFICIENCY_KEYS)} "
                f"(each a fraction in (0, 1])",
            )
        v = value[key]
        if not _is_number(v) or not math.isfinite(v) or not (0 < v <= 1):
            raise ConfigError(f"{field}.{key}", f"expected a fraction in (0, 1], got {_describe(v)}")
        check_range(f"{field}.{key}", v, "fraction")


# ---------------------------------------------------------------------------------------
# The spec
# ---------------------------------------------------------------------------------------


@attrs.frozen
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

    # -- lookups ---------------------------------------------------------------------

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``; ConfigError if this system does not list it."""
        try:
            return self.peak_flops_per_s[dtype]
        except (KeyError, TypeError):
            pass
        known = ", ".join(self.peak_flops_per_s)
        if dtype in BYTES_PER_ELEMENT:
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
        for key in data:
            if key not in valid:
                raise ConfigError(
                    f"system.{key}",
                    f"unknown key{suggest(str(key), valid)}{where}; valid keys: {', '.join(valid)}",
                )
        missing = [k for k in valid if k not in data]
        if missing:
            raise ConfigError(
                f"system.{missing[0]}",
                f"missing{where}; add it to the system file"
                + (f" (also missing: {', '.join(missing[1:])})" if len(missing) > 1 else ""),
            )
        try:
            return cls(**{k: data[k] for k in valid})
        except ConfigError as exc:
            if not where:
                raise
            raise ConfigError(exc.field, f"{str(exc)[len(exc.field) + 2:]}{where}") from None

    @classmethod
    def from_yaml(cls, path) -> SystemSpec:
        """Load one system from a YAML file (shipped or user-written: same checks)."""
        path = Path(path)
        return cls._from_text(read_text(path, "system", "system file"), str(path))

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
        return cls.from_dict(data, source=source)


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
        from importlib.resources import files

        root = files(__package__ or "g5core") / "data" / "systems"
        if root.is_dir():
            return root
    except Exception:  # e.g. a namespace package on an old Python: use the file system
        pass
    return Path(__file__).resolve().parent / "data" / "systems"


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
    return f"# {spec.name}, from {os.fspath(name_or_path)}\n{text}"
