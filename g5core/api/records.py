"""Values plugins return to the core: memory terms, collective lowerings, sweep presets."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import attrs
import numpy as np

CATEGORIES = ("weights", "kv_cache", "activations", "workspace")


class _ChipItems(tuple):
    """``(chip, bytes)`` pairs already in MemoryTerm's form (sorted, int and float)."""


def _chip_items(value) -> tuple[tuple[int, float], ...]:
    if type(value) is _ChipItems:
        return value
    if isinstance(value, Mapping):
        value = value.items()
    return tuple(sorted((int(c), float(b)) for c, b in value))


@attrs.frozen(kw_only=True)
class MemoryTerm:
    """A named per-chip memory term. ``bytes_per_chip`` maps chip -> bytes (absent = 0).

    ``part_of``: the name of another term this one breaks down (e.g. the attention weights a
    strategy replicates, within ``weights``): shown in the ledger, not added to the totals
    again; it may not exceed that term on any chip."""

    name: str
    category: str = attrs.field(validator=attrs.validators.in_(CATEGORIES))
    bytes_per_chip: tuple[tuple[int, float], ...] = attrs.field(converter=_chip_items)
    part_of: str = ""
    _lookup: dict = attrs.field(init=False, repr=False, eq=False, factory=dict)  # "on": chip -> bytes; "vector"

    def on(self, chip: int) -> float:
        table = self._lookup.get("on")
        if table is None:
            table = self._lookup["on"] = dict(self.bytes_per_chip)
        return table.get(chip, 0.0)

    def vector(self, chips: int):
        """Bytes on every chip ``0 .. chips - 1`` (0 where absent) as one numpy array."""
        if "vector" in self._lookup and len(self._lookup["vector"]) == chips:
            return self._lookup["vector"]
        out = np.zeros(chips)
        if self.bytes_per_chip:
            ids, values = zip(*self.bytes_per_chip)
            out[np.asarray(ids, dtype=np.int64)] = values
        return out

    @classmethod
    def from_vector(cls, name: str, category: str, values, part_of: str = "") -> "MemoryTerm":
        """A term holding ``values[c]`` bytes on every chip ``c`` (made without a Python step
        per chip but the pairs themselves)."""
        values = np.asarray(values, dtype=float)
        term = cls(name=name, category=category, bytes_per_chip=_ChipItems(zip(range(len(values)), values.tolist())),
                   part_of=part_of)
        term._lookup["vector"] = values
        return term


def _flows(fs) -> tuple:
    return tuple(tuple(f) for f in fs)


@attrs.frozen(kw_only=True)
class Lowering:
    """A communication op as the engine runs it: after ``latency_s`` all ``flows`` start
    together and share the resources they cross; the op ends when the last flow ends.

    A flow is ``(src_chip, dst_chip, bytes)``, routed by :meth:`Topology.route`, or
    ``(src_chip, dst_chip, bytes, route)`` with an explicit tuple of resource ids (a ring
    channel's NIC, or a chip's traffic to an in-switch reduction, where ``src == dst``).
    ``algorithm``, ``protocol`` and ``channels`` say how the op runs (shown in the
    timeline, the trace and the JSON)."""

    flows: tuple = attrs.field(converter=_flows)
    latency_s: float = attrs.field(validator=attrs.validators.ge(0))
    algorithm: str = "direct"
    protocol: str = ""
    channels: int = 1
    #: wire bytes per payload byte: a protocol that reaches only a fraction f of a link's
    #: bandwidth (NCCL's LL, LL128) is modelled as occupying its links for 1/f of the time
    #: the payload alone needs, so its flows carry payload / f bytes; the run reports payload.
    wire_bytes_per_payload_byte: float = attrs.field(default=1.0, validator=attrs.validators.ge(1.0))


CheckFn = Callable[[Sequence[Mapping], Mapping], Sequence[str]]


@attrs.frozen(kw_only=True)
class SweepPreset:
    """A named sweep a plugin registers: default grid, fixed overrides and a check over the rows.

    ``check(rows, options)`` receives the sweep's rows in grid order (each a results row
    with its ``point``) and the preset options, and returns the violations (``()`` when it
    holds). It runs only for the phases in ``check_phases`` (every phase when empty).
    """

    name: str
    doc: str
    grid: tuple[tuple[str, tuple], ...] = attrs.field(converter=lambda g: tuple((k, tuple(v)) for k, v in g))
    fixed: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    check: Optional[CheckFn] = None
    check_phases: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    options: tuple[tuple[str, Any], ...] = attrs.field(default=(), converter=lambda o: tuple(dict(o).items()))
    owner: str = ""


@attrs.frozen
class ComputeTime:
    """A latency plugin's answer with its provenance: ``measured_s`` of ``seconds`` came
    from measurements (a profile table), the rest from a model."""

    seconds: float
    measured_s: float = 0.0


def _positive_whole(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be a whole number >= 1, got {value!r}")


@attrs.frozen(kw_only=True)
class StepRules:
    """What a plugin's dimension requires of every step a layout runs (``g5_step_rules``).

    - ``token_multiple``: each sequence's token counts are padded up to a multiple of this
      (a prefill chunk's new and its cached tokens, a decode's context with its new token),
      as an implementation pads a sequence it splits;
    - ``mixed``: whether prefill and decode groups may share one step;
    - ``split``: when they may not, ``split(step) -> (step, ...)`` (:class:`g5core.Step` in
      and out): the steps it runs instead, one after the other, none of them mixed, holding
      the step's groups between them.

    The core merges every plugin's answer (:func:`g5core.lower.steprules.step_rules`): the
    least common multiple of the token multiples; mixed only if every plugin allows it; the
    splits applied in turn. ``owner``: filled in by the core.
    """

    token_multiple: int = attrs.field(default=1, validator=_positive_whole)
    mixed: bool = True
    split: Optional[Callable[[Any], tuple]] = None
    owner: str = ""

    def __attrs_post_init__(self) -> None:
        if not self.mixed and not callable(self.split):
            raise ValueError("StepRules(mixed=False) needs split: how a step mixing prefill and decode runs instead")

    def round_up(self, tokens: int) -> int:
        """``tokens`` padded up to a multiple of ``token_multiple``."""
        return -(-tokens // self.token_multiple) * self.token_multiple
