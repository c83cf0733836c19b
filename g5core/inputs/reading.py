"""Reading input files, and the limits on input magnitudes, in one place.

Every file G5 reads (configuration, system file, Hugging Face config.json) goes through
:func:`read_text` (a binary or non-UTF-8 file is a one-line error, not a traceback) and,
for YAML and JSON, a loader that refuses duplicate keys, naming the key.

Every size and rate a user can give is checked once, where it enters (the configuration,
the model file, the system file), against the ranges in :data:`LIMITS`. Inside those
ranges every derived quantity (FLOPs, bytes, seconds) is a finite double far from overflow,
so a result is always finite; outside them the input is refused with the range. The
ranges are wide on purpose: they refuse what no cluster or model could be (a 401-digit
link bandwidth, a 10^300-token sequence), not what is merely unusual.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from g5core.api.errors import ConfigError, suggest

# (lowest, highest) accepted value of each kind of quantity. Sizes are whole numbers.
#: tokens of one sequence (S): 2^40 is about a million times a 1M-token context
MAX_SEQ_LEN = 2 ** 40
#: latest arrival time of a serving workload, in seconds from its first request (about 3 years):
#: beyond it a float's resolution (1.5e-8 s at 1e8 s) would swallow short steps and TTFTs
MAX_ARRIVAL_S = 1e8
#: sequences per data-parallel replica
MAX_BATCH = 2 ** 30
#: tokens one replica holds (batch x seq_len)
MAX_TOKENS = 2 ** 48
#: chips in one deployment (the op-count guard refuses far fewer in practice)
MAX_CHIPS = 2 ** 24
#: any one size in a model file (hidden size, layers, heads, experts, vocabulary, ...)
MAX_MODEL_DIM = 2 ** 24
#: mappings and lists nested inside one another in an input file (G5's deepest file, a
#: system file's ``nccl`` block, nests 3 deep; PyYAML and ``json`` recurse per level and
#: would run out of stack near 1000)
MAX_NESTING = 64

LIMITS: dict[str, tuple[float, float, str]] = {
    # kind: (lowest, highest, how to say it)
    "bytes_per_s": (1e3, 1e16, "bytes per second"),        # 1 kB/s .. 10 PB/s per chip
    "flops_per_s": (1e6, 1e19, "FLOP/s"),                  # 1 MFLOP/s .. 10 EFLOP/s per chip
    "seconds": (0.0, 1.0, "seconds"),                      # a latency or overhead, 0 .. 1 s
    "bytes": (2 ** 20, 2 ** 50, "bytes"),                  # memory of one chip, 1 MiB .. 1 PiB
    "chips_per_node": (1, 2 ** 16, "chips"),
    "fraction": (1e-3, 1.0, "a fraction"),                 # an efficiency
    # the size-aware roofline (a system file's compute_model block)
    "tile": (1, 2 ** 12, "elements of a GEMM tile side"),  # CUTLASS tiles are 16 .. 256
    "sm_count": (1, 2 ** 16, "streaming multiprocessors"), # an H100 has 132, a B200 148
    "tokens": (1, MAX_SEQ_LEN, "tokens"),                  # a length in tokens, as seq_len
}


def check_range(field: str, value: Any, kind: str) -> None:
    """ConfigError unless ``value`` (already known to be a number) lies in LIMITS[kind]."""
    lo, hi, unit = LIMITS[kind]
    try:
        v = float(value)
    except OverflowError:
        v = math.inf
    if not (lo <= v <= hi):
        raise ConfigError(field, f"{short_repr(value)} is outside the range G5 accepts for {unit}, "
                                 f"{lo:g} to {hi:g}; check the units and the number of digits")


def check_size(field: str, value: int, highest: int, what: str = "") -> None:
    """ConfigError if a whole-number size exceeds ``highest``."""
    if value > highest:
        raise ConfigError(field, f"{short_repr(value)} is larger than G5 accepts{what} (at most {highest:,}); "
                                 "no deployment is that large, check the number")


def short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:10]}...({len(text)} digits)"


def safe_float(value: Any) -> Any:
    """``float(value)`` for a number; anything else, or an integer too large for a double,
    passes through unchanged (its validator names the problem)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    try:
        return float(value)
    except OverflowError:
        return value  # too large for a double: stays an int, and the range check refuses it


# ----------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------


def read_text(path, field: str, what: str) -> str:
    """The text of a UTF-8 file; a one-line ConfigError if it is missing, unreadable,
    binary or not UTF-8."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigError(field, f"cannot read {what} '{p}': {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(field, f"{what} '{p}' is not UTF-8 text (byte {exc.start} is 0x{data[exc.start]:02x}); "
                                 "is it a binary file?") from None
    if "\x00" in text:
        raise ConfigError(field, f"{what} '{p}' holds NUL bytes; is it a binary file?")
    return text


class NestingError(yaml.YAMLError):
    """A YAML document nested deeper than MAX_NESTING."""

    def __init__(self, mark):
        self.problem_mark = mark
        self.problem = (f"mappings and lists nested more than {MAX_NESTING} deep; "
                        "G5's files nest a few levels, check the file")
        super().__init__(self.problem)


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, except that a key given twice in one mapping is an error
    (PyYAML would silently keep the last one), and a document nested deeper than
    MAX_NESTING is an error (PyYAML composes nodes recursively: it would exhaust the stack)."""

    _depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_NESTING:
                raise NestingError(self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:
                    continue  # an unhashable key: SafeLoader reports it
                if first is not key_node:
                    raise DuplicateKeyError(key, key_node.start_mark)
        return super().construct_mapping(node, deep)


class DuplicateKeyError(yaml.constructor.ConstructorError):
    def __init__(self, key, mark):
        self.key = key
        super().__init__(None, None, f"the key {key!r} is given twice; keep one", mark)


def duplicate_key_error(field: str, source: str, exc: DuplicateKeyError) -> ConfigError:
    mark = exc.problem_mark
    at = f" (line {mark.line + 1})" if mark is not None else ""
    return ConfigError(field, f"{source}: the key {exc.key!r} is given twice{at}; keep one")


def load_yaml(text: str, loader=UniqueKeyLoader):
    return yaml.load(text, Loader=loader)  # noqa: S506 - a SafeLoader subclass


def _no_duplicate_pairs(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} is given twice; keep one")
        out[key] = value
    return out


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_JSON_BRACKET = re.compile(r"[\[\]{}]")


def check_json_nesting(text: str) -> None:
    """ValueError if the JSON text nests arrays and objects deeper than MAX_NESTING
    (``json`` recurses per level; one pass over the brackets outside strings)."""
    depth = 0
    for m in _JSON_BRACKET.finditer(_JSON_STRING.sub("", text)):
        depth += 1 if m.group() in "[{" else -1
        if depth > MAX_NESTING:
            raise ValueError(f"arrays and objects nested more than {MAX_NESTING} deep; "
                             "G5's files nest a few levels, check the file")


def load_json(text: str):
    """``json.loads`` that refuses duplicate keys, the non-standard NaN/Infinity and nesting
    deeper than MAX_NESTING."""
    def bad_constant(name):
        raise ValueError(f"{name} is not a JSON number")
    check_json_nesting(text)
    return json.loads(text, object_pairs_hook=_no_duplicate_pairs, parse_constant=bad_constant)


def check_keys(data: Mapping, field: str, valid: Sequence[str], required: Sequence[str] = (),
               missing: str = "missing", where: str = "") -> None:
    """The one check of a mapping's keys: each key one of ``valid`` (else "unknown key", with
    the nearest valid one and the list), each of ``required`` present (else ``missing``, which
    says what to give). ``field`` is the mapping's dotted name ("" at the top of a file);
    ``where`` (which file) is added to the unknown-key message."""
    prefix = f"{field}." if field else ""
    for key in data:
        if key not in valid:
            raise ConfigError(f"{prefix}{key}", f"unknown key{suggest(str(key), valid)}{where}; "
                                                f"valid keys: {', '.join(valid)}")
    for key in required:
        if key not in data:
            raise ConfigError(f"{prefix}{key}", missing)
