"""Deployment configuration: loading (YAML, TOML, JSON), ``--set`` overrides, validation.

A configuration names the model, the system, the chip count, one size per registered
parallel dimension, the step (a ``step:`` list of sequence groups, or its shorthand
``phase``, ``batch`` and ``seq_len``: :mod:`g5core.inputs.step`), dtypes and the path. The
``parallel`` keys are whatever the enabled plugins register; those without a default are
required (the plugin says what to add). Plugin options live under ``plugins: {NAME: {option: value}}`` (:mod:`g5core.api.options`).
"""
from __future__ import annotations

import copy
import pathlib
import sys
from typing import Any, Iterable, Mapping, Optional

import attrs
import yaml

from g5core.api.dimensions import DimensionRegistry
from g5core.api.options import OptionRegistry, option_value
from g5core.inputs.dtypes import dtype_bytes, number_format
from g5core.inputs.models import CATALOG, get_model
from g5core.api.errors import ConfigError, suggest
from g5core.inputs.framework import FRAMEWORK_NAMES
from g5core.inputs.speculative import Speculative, parse_speculative
from g5core.inputs.step import Step, as_step
from g5core.inputs.reading import (
    MAX_BATCH, MAX_CHIPS, MAX_SEQ_LEN, MAX_TOKENS, DuplicateKeyError, check_keys, check_size, duplicate_key_error,
    load_json, load_yaml, read_text,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

PHASES = ("prefill", "decode")
PATHS = ("g5", "math")
# Weight classes a `dtypes.weights` mapping may name; `default` is required in a mapping.
WEIGHT_CLASSES = ("default", "attention", "ffn", "experts", "embedding")
TOP_LEVEL_KEYS = (
    "name", "model", "system", "chips", "parallel", "phase", "batch", "seq_len", "step",
    "dtypes", "path", "plugins", "framework", "speculative",
)
NO_OPTIONS = OptionRegistry()
REQUIRED_KEYS = ("model", "system", "chips", "parallel")
#: the shorthand of a step (g5core.inputs.step): all three, or a ``step:`` list instead
SHORTHAND_KEYS = ("phase", "batch", "seq_len")
DEFAULT_DTYPE = "bf16"


def _positive_int(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(field, f"must be a positive whole number, got {value!r}")
    if value <= 0:
        raise ConfigError(field, f"must be a positive whole number, got {value}")
    return value


@attrs.frozen
class Dtypes:
    weights: tuple[tuple[str, str], ...]  # sorted (class, dtype) pairs; always has "default"
    activations: str
    kv_cache: str

    def weight_dtype(self, weight_class: str) -> str:
        table = dict(self.weights)
        return table.get(weight_class, table["default"])

    def weight_element_bytes(self, weight_class: str) -> float:
        """Bytes per weight element of ``weight_class``, block scales included (int4: 0.52)."""
        return dtype_bytes(self.weight_dtype(weight_class), weights=True)

    def gemm_dtype(self, weight_class: str) -> str:
        """The peak rate the GEMMs of ``weight_class`` run at: the weights' format (fp8,
        bf16, FP4 for nvfp4/mxfp4), or the activations' for weight-only int4."""
        return number_format(self.weight_dtype(weight_class), weights=True).peak or self.activations

    @property
    def activation_element_bytes(self) -> int:
        return dtype_bytes(self.activations)

    @property
    def kv_cache_element_bytes(self) -> int:
        return dtype_bytes(self.kv_cache)

    @classmethod
    def from_dict(cls, data: Any, published: tuple[tuple[str, str], ...] = ()) -> "Dtypes":
        """``published``: the model's own weight dtypes (its hub config's quantization_config),
        run when ``dtypes.weights`` is not given."""
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError("dtypes", "must be a mapping with keys weights, activations, kv_cache")
        check_keys(data, "dtypes", ("weights", "activations", "kv_cache"))
        weights = data.get("weights", dict(published) if published else DEFAULT_DTYPE)
        if isinstance(weights, Mapping):
            table = {}
            for cls_name, dt in weights.items():
                if cls_name not in WEIGHT_CLASSES:
                    raise ConfigError(
                        f"dtypes.weights.{cls_name}",
                        f"unknown weight class{suggest(cls_name, WEIGHT_CLASSES)}; "
                        f"valid: {', '.join(WEIGHT_CLASSES)}",
                    )
                dtype_bytes(dt, f"dtypes.weights.{cls_name}", weights=True)
                table[cls_name] = dt
            if "default" not in table:
                raise ConfigError("dtypes.weights", "a per-class mapping needs a 'default' entry, e.g. {default: bf16, ffn: fp8}")
            weight_items = tuple(sorted(table.items()))
        else:
            dtype_bytes(weights, "dtypes.weights", weights=True)
            weight_items = (("default", weights),)
        acts = data.get("activations", DEFAULT_DTYPE)
        kv = data.get("kv_cache", DEFAULT_DTYPE)
        dtype_bytes(acts, "dtypes.activations")
        dtype_bytes(kv, "dtypes.kv_cache")
        return cls(weights=weight_items, activations=acts, kv_cache=kv)

    def to_dict(self) -> dict:
        weights: Any = dict(self.weights)
        if list(weights) == ["default"]:
            weights = weights["default"]
        return {"weights": weights, "activations": self.activations, "kv_cache": self.kv_cache}


@attrs.frozen(kw_only=True)
class Deployment:
    """One validated deployment. Build it with :meth:`from_dict`, never ``Deployment(**data)``."""

    model: str
    system: str
    chips: int
    parallel: tuple[tuple[str, int], ...]  # every registered dimension, sorted by name
    options: tuple[tuple[str, tuple[tuple[str, object], ...]], ...]  # (plugin, ((option, value), ...)), sorted
    # The step's shorthand: phase (prefill | decode | mixed), sequences per replica, and the
    # longest context. Where ``uniform`` (the shorthand says exactly the step), they describe
    # the step completely and every consumer may read them alone.
    phase: str
    batch: int
    seq_len: int
    dtypes: Dtypes
    path: str
    name: str = ""
    #: the serving framework profile the run uses (``framework: vllm``, g5core/inputs/framework.py);
    #: "" for the system file's own framework block (or none)
    framework: str = ""
    disabled_plugins: tuple[str, ...] = ()
    # Parallel dimensions (``"sp"``) and plugin options (``"tp.sp"``) the configuration left out,
    # filled from their registered defaults. Not part of equality; ``to_dict`` leaves them out,
    # so installing a plugin whose dimension defaults to 1 does not change the echo of a run.
    implicit: tuple[str, ...] = attrs.field(default=(), eq=False)
    #: the step (g5core.inputs.step.Step) this deployment runs, groups of sequences
    step: Step = attrs.field(default=None, kw_only=True)
    #: whether the configuration gave a ``step:`` list (echoed as such) rather than the shorthand
    step_form: bool = attrs.field(default=False, eq=False, kw_only=True)
    #: speculative decoding (g5core.inputs.speculative.Speculative), or None: plain decode
    speculative: Optional[Speculative] = attrs.field(default=None, kw_only=True)

    @property
    def uniform(self) -> bool:
        """Whether ``phase``, ``batch`` and ``seq_len`` say exactly the step (one group: a
        prompt with nothing cached, or decode tokens at one context length)."""
        return self.step.shorthand() is not None or not self.step_form and self.step.uniform

    def with_step(self, step) -> "Deployment":
        """The same deployment running ``step`` (a Step, StepGroups, or a configuration list)."""
        step = check_step_limits(as_step(step))
        phase, batch, seq_len = shorthand_of(step)
        return attrs.evolve(self, phase=phase, batch=batch, seq_len=seq_len, step=step, step_form=True)

    def size(self, dim: str) -> int:
        """Size of a parallel dimension; 1 for a dimension no enabled plugin registers."""
        return dict(self.parallel).get(dim, 1)

    def option(self, plugin: str, name: str, default: Any = None) -> Any:
        """Value of ``plugins.<plugin>.<name>`` (set or the plugin's default); ``default``
        when ``plugin`` is not enabled."""
        return option_value(self.options, plugin, name, default)

    @classmethod
    def from_dict(cls, data: Any, dims: DimensionRegistry, source: str = "configuration",
                  options: OptionRegistry = NO_OPTIONS) -> "Deployment":
        if not isinstance(data, Mapping):
            raise ConfigError("", f"{source}: the top level must be a mapping of keys to values")
        keys = TOP_LEVEL_KEYS + tuple(options.legacy_keys)
        if "serving" in data:   # a `g5 serve` file (e.g. one `g5 best --serve` wrote) given to a one-step command
            raise ConfigError("serving", "is read by `g5 serve` (this is a serving configuration): run the file "
                                         "with `g5 serve`, or remove its `serving:` block to simulate one step")
        check_keys(data, "", keys, REQUIRED_KEYS, missing="is required")
        for key in ("model", "system"):
            if not isinstance(data[key], str) or not data[key]:
                raise ConfigError(key, f"must be a name or a file path, got {data[key]!r}")
        chips = _positive_int(data["chips"], "chips")
        check_size("chips", chips, MAX_CHIPS)
        parallel, implicit_dims = _parse_parallel(data["parallel"], dims)
        product = dims.chips(parallel)
        if product != chips:
            expr = " x ".join(f"{d.name}={parallel[d.name]}" for d in dims.factors
                              if d.name not in implicit_dims or parallel[d.name] != 1)
            hint = ""
            outer = dims.factors[0].name if dims.factors else ""
            rest = product // parallel.get(outer, 1) if outer else product
            if outer and chips % rest == 0:
                hint = f" (e.g. {outer}={chips // rest})"
            raise ConfigError(
                "parallel",
                f"{expr} = {product}, but chips = {chips}; the product of the parallel sizes must equal chips{hint}",
            )
        path = data.get("path", "g5")
        if path not in PATHS:
            raise ConfigError("path", f"unknown path {path!r}{suggest(str(path), PATHS)}; use g5 or math")
        disabled = disabled_from_config(data)
        resolved, implicit_options = options.resolve(data, disabled)
        phase, batch, seq_len, step = _parse_step(data)
        name = data.get("name", "")
        if not isinstance(name, str):
            raise ConfigError("name", f"must be a string, got {name!r}")
        framework = data.get("framework", "")
        if framework != "" and framework not in FRAMEWORK_NAMES:
            raise ConfigError("framework", f"unknown framework {framework!r}{suggest(str(framework), FRAMEWORK_NAMES)}; "
                                           f"choose one of {', '.join(FRAMEWORK_NAMES)}")
        return cls(
            model=data["model"],
            system=data["system"],
            chips=chips,
            parallel=tuple(sorted(parallel.items())),
            options=resolved,
            phase=phase,
            batch=batch,
            seq_len=seq_len,
            dtypes=Dtypes.from_dict(data.get("dtypes"), _published_weights(data["model"])),
            path=path,
            name=name,
            framework=framework,
            disabled_plugins=disabled,
            implicit=implicit_dims + implicit_options,
            step=step,
            step_form="step" in data,
            speculative=_parse_speculative(data, phase),
        )

    def to_dict(self) -> dict:
        out = {
            "model": self.model,
            "system": self.system,
            "chips": self.chips,
            "parallel": {k: v for k, v in self.parallel if k not in self.implicit},
        }
        if self.step_form:
            out["step"] = self.step.to_list()
        else:
            out.update(phase=self.phase, batch=self.batch, seq_len=self.seq_len)
        out.update(dtypes=self.dtypes.to_dict(), path=self.path)
        if self.speculative is not None:
            out["speculative"] = self.speculative.to_dict()
        if self.name:
            out["name"] = self.name
        if self.framework:
            out["framework"] = self.framework
        plugins: dict[str, Any] = {}
        for plugin, values in self.options:
            given = {k: v for k, v in values if f"{plugin}.{k}" not in self.implicit}
            if given:
                plugins[plugin] = given
        if self.disabled_plugins:
            plugins["disable"] = list(self.disabled_plugins)
        if plugins:
            out["plugins"] = plugins
        return out


def _parse_speculative(data: Mapping, phase: str) -> Optional[Speculative]:
    """The ``speculative:`` block, validated (None where absent); it applies to a decode step."""
    spec = parse_speculative(data)
    if spec is not None and spec.enabled and phase != "decode":
        raise ConfigError("speculative", f"applies to a decode step (this step is {phase}); remove the block or "
                                         "use phase: decode")
    return spec


def _published_weights(model: str) -> tuple[tuple[str, str], ...]:
    """The weight dtypes a hub config file's quantization_config publishes (() for a catalog
    name or a path that is not there: the model's own errors come where it is read)."""
    if model in CATALOG or not pathlib.Path(model).exists():
        return ()
    return get_model(model).published_weights


def shorthand_of(step: Step) -> tuple[str, int, int]:
    """``(phase, batch, seq_len)`` of a step: its shorthand where it has one, else its
    phase (prefill | mixed), its sequences and its longest context."""
    short = step.shorthand()
    if short is not None:
        return short
    return step.phase, step.sequences, step.max_context_tokens


def check_step_limits(step: Step, given=None) -> Step:
    """``step`` if its sizes are within G5's input limits, else a ConfigError naming the
    group (``step.<i>`` of ``given``, the list as written, or of the canonical step)."""
    for i, g in enumerate(given if given is not None else step.to_list()):
        check_size(f"step.{i}.count", g["count"], MAX_BATCH)
        check_size(f"step.{i}.new_tokens", g["new_tokens"], MAX_SEQ_LEN, " for a sequence length")
        check_size(f"step.{i}.cached_tokens", g.get("cached_tokens", 0), MAX_SEQ_LEN, " for a sequence length")
    if step.context_tokens > MAX_TOKENS:
        raise ConfigError("step", f"the step holds {step.context_tokens:,} tokens per replica in the KV cache, "
                                  f"more than G5 accepts (at most {MAX_TOKENS:,}); lower the counts or the tokens")
    return step


def _parse_step(data: Mapping) -> tuple[str, int, int, Step]:
    """The step of a configuration: a ``step:`` list, or the shorthand (all three keys)."""
    given = [k for k in SHORTHAND_KEYS if k in data]
    if "step" in data:
        if given:
            raise ConfigError(given[0], f"cannot be given together with step: (the step's shorthand is "
                                        f"{'/'.join(SHORTHAND_KEYS)}); remove {', '.join(given)} or the step list")
        step = check_step_limits(Step.from_list(data["step"]), data["step"])
        phase, batch, seq_len = shorthand_of(step)
        return phase, batch, seq_len, step
    for key in SHORTHAND_KEYS:
        if key not in data:
            raise ConfigError(key, "is required (or give a step: list of {new_tokens, cached_tokens, count} "
                                   "groups instead of phase/batch/seq_len)")
    phase = data["phase"]
    if phase not in PHASES:
        raise ConfigError("phase", f"unknown phase {phase!r}{suggest(str(phase), PHASES)}; use prefill or decode")
    batch = _positive_int(data["batch"], "batch")
    check_size("batch", batch, MAX_BATCH)
    seq_len = _positive_int(data["seq_len"], "seq_len")
    check_size("seq_len", seq_len, MAX_SEQ_LEN, " for a sequence length")
    if batch * seq_len > MAX_TOKENS:
        raise ConfigError("batch", f"batch x seq_len = {batch * seq_len:,} tokens per replica is larger than G5 "
                                   f"accepts (at most {MAX_TOKENS:,}); lower batch or seq_len")
    return phase, batch, seq_len, Step.from_shorthand(phase, batch, seq_len)


def _parse_parallel(data: Any, dims: DimensionRegistry) -> tuple[dict[str, int], tuple[str, ...]]:
    """Sizes of every registered dimension, and the names filled from a default."""
    if not isinstance(data, Mapping):
        raise ConfigError("parallel", f"must be a mapping like {{dp: 1, tp: 8, pp: 1, cp: 1}}, got {data!r}")
    known = dims.names
    for key in data:
        if key not in known:
            raise ConfigError(
                f"parallel.{key}",
                f"no enabled plugin registers the dimension '{key}'{suggest(str(key), known)}; "
                f"is the plugin that provides it installed and enabled? registered: {', '.join(known)}",
            )
    out: dict[str, int] = {}
    implicit = []
    for d in dims.dims:
        if d.name in data:
            out[d.name] = _positive_int(data[d.name], f"parallel.{d.name}")
            check_size(f"parallel.{d.name}", out[d.name], MAX_CHIPS)
        elif d.default is None:
            raise ConfigError(f"parallel.{d.name}", f"is required: {d.missing_hint}" if d.missing_hint else
                              f"is required (registered by plugin '{d.owner}'); add `{d.name}: 1` for none")
        else:
            out[d.name] = d.default
            implicit.append(d.name)
    return out, tuple(implicit)


def disabled_from_config(data: Mapping) -> tuple[str, ...]:
    """The ``plugins: {disable: [...]}`` list of a raw configuration mapping.

    The other keys of ``plugins`` are plugin names with their options, validated by
    :meth:`OptionRegistry.resolve` once the enabled plugins are known."""
    plugins = data.get("plugins") if isinstance(data, Mapping) else None
    if plugins is None:
        return ()
    if not isinstance(plugins, Mapping):
        raise ConfigError("plugins", "must be a mapping like {disable: [name, ...], PLUGIN: {option: value}}")
    names = plugins.get("disable", [])
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ConfigError("plugins.disable", "must be a list of plugin names")
    return tuple(names)


def all_disabled(raw: Mapping | Deployment | None, disabled: Iterable[str] = ()) -> tuple[str, ...]:
    """The plugins a run disables: ``disabled`` (the command line's), then the configuration's
    ``plugins.disable`` (a Deployment's ``disabled_plugins``), each name once, in that order."""
    from_config = () if raw is None else (raw.disabled_plugins if isinstance(raw, Deployment)
                                          else disabled_from_config(raw))
    return tuple(dict.fromkeys(tuple(disabled) + tuple(from_config)))


# ----------------------------------------------------------------------------------------
# Files and overrides
# ----------------------------------------------------------------------------------------


def load_config_file(path: str | pathlib.Path) -> dict:
    """Read a YAML, TOML or JSON file into a mapping (by extension; YAML otherwise)."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise ConfigError("", f"configuration file not found: {p}")
    text = read_text(p, "", "configuration file")
    suffix = p.suffix.lower()
    try:
        if suffix == ".json":
            data = load_json(text)
        elif suffix == ".toml":
            data = tomllib.loads(text)
        else:
            data = load_yaml(text)
    except DuplicateKeyError as exc:
        raise duplicate_key_error("", str(p), exc) from None
    except (ValueError, tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError("", f"{p}: not valid {suffix.lstrip('.') or 'YAML'}: {exc}".replace("\n", " ")) from None
    except RecursionError:  # tomllib recurses per level of nesting (YAML and JSON are bounded first)
        raise ConfigError("", f"{p}: nested too deep to read; G5's files nest a few levels, check the file") from None
    if not isinstance(data, dict):
        raise ConfigError("", f"{p}: the top level must be a mapping of keys to values")
    return data


#: the configuration keys that name a file G5 reads (dotted): a relative path among them is the
#: file beside the configuration when one is there (:func:`resolve_config_paths`)
FILE_KEYS = ("model", "system", "speculative.draft_model", "serving.workload.trace")


def resolve_config_paths(data: Mapping, base: str | pathlib.Path) -> dict:
    """Return a copy of ``data`` whose relative file paths (:data:`FILE_KEYS`) name the file
    beside the configuration file in folder ``base`` where one is there: a configuration file's
    ``model: ../models/x.json`` reads the same file from any working directory, as ``g5 validate``
    reads it. A value that is not a path (a catalog name: no folder separator, no file suffix),
    an absolute one, or one with no file beside the configuration is kept as given (read from the
    working directory, with its own error when missing)."""
    out = copy.deepcopy(dict(data))
    base = pathlib.Path(base)
    for dotted in FILE_KEYS:
        *parents, key = dotted.split(".")
        node = out
        for name in parents:
            node = node.get(name) if isinstance(node, dict) else None
        value = node.get(key) if isinstance(node, dict) else None
        if not isinstance(value, str) or not _is_relative_path(value):
            continue
        beside = base / value
        if beside.is_file():
            node[key] = str(beside)
    return out


def _is_relative_path(text: str) -> bool:
    path = pathlib.PurePath(text)
    looks_like_path = len(path.parts) > 1 or path.suffix.lower() in (".json", ".yaml", ".yml", ".csv", ".jsonl")
    return looks_like_path and not path.is_absolute() and not text.startswith("~")


def apply_overrides(data: Mapping, overrides: Iterable[str]) -> dict:
    """Return a copy of ``data`` with ``dotted.key=value`` overrides applied.

    Values are parsed as YAML scalars (``8`` is a number, ``true`` a boolean, ``bf16`` a
    string). The input mapping is not changed.
    """
    out = copy.deepcopy(dict(data))
    for item in overrides:
        if "=" not in item:
            raise ConfigError("--set", f"expected dotted.key=value, got {item!r}")
        dotted, raw = item.split("=", 1)
        keys = dotted.strip().split(".")
        if not all(keys):
            raise ConfigError("--set", f"bad key {dotted!r}; use e.g. parallel.cp=8")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = out
        for i, key in enumerate(keys[:-1]):
            child = _child(node, key, dotted, keys[:i])
            if child is None:
                child = node[key] = {}
            elif not isinstance(child, (dict, list)):
                raise ConfigError("--set", f"cannot set {dotted}: {'.'.join(keys[:i + 1])} is not a mapping")
            node = child
        if isinstance(node, list):
            node[_list_index(node, keys[-1], dotted, keys[:-1])] = value
        else:
            node[keys[-1]] = value
    return out


def _child(node, key: str, dotted: str, above: list[str]):
    """``node[key]`` of a mapping, or entry ``int(key)`` of a list (``step.0.count``)."""
    if isinstance(node, list):
        return node[_list_index(node, key, dotted, above)]
    return node.get(key)


def _list_index(node: list, key: str, dotted: str, above: list[str]) -> int:
    where = ".".join(above)
    if not key.isdigit() or int(key) >= len(node):
        raise ConfigError("--set", f"cannot set {dotted}: {where} is a list of {len(node)} entries; "
                                   f"use an index 0..{len(node) - 1} after {where}.")
    return int(key)
