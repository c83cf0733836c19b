"""A step: the work one iteration of an inference engine runs, as groups of sequences.

Every iteration of vLLM, SGLang or TensorRT-LLM mixes prefill chunks (each with some tokens
already in the KV cache) and decode tokens of many sequences at their own context lengths.
G5 describes such an iteration as a :class:`Step`, a tuple of :class:`StepGroup` records:
``count`` sequences (per data-parallel replica, like ``batch``) that each bring
``new_tokens`` new tokens after ``cached_tokens`` tokens already in the KV cache.

The shorthand of a configuration maps onto one group:

- ``phase: prefill, batch: b, seq_len: S`` is ``[{new_tokens: S, cached_tokens: 0, count: b}]``;
- ``phase: decode, batch: b, seq_len: S`` is ``[{new_tokens: 1, cached_tokens: S - 1, count: b}]``:
  today's decode convention, ``seq_len`` is the context length *including* the new token
  (the attention of the new token reads ``S`` keys, and the KV cache holds ``S`` tokens).

A group with ``new_tokens == 1`` is a decode group (the single-query decode kernel runs it);
a group with ``verify: true`` is a speculative verification group, also decode (``new_tokens =
k + 1``: the last sampled token and ``k`` draft tokens, checked against the context in one
pass; :mod:`g5core.inputs.speculative`); any other group is a prefill group (a prompt, or a chunk of one after ``cached_tokens``).
A step's :attr:`Step.phase` is ``prefill`` or ``decode`` when every group is of that kind,
else ``mixed``. Groups are kept in a canonical order (equal shapes merged, then sorted), so a
step's result never depends on the order its groups were written in.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import attrs

from g5core.api.errors import ConfigError
from g5core.inputs.reading import check_keys

GROUP_KEYS = ("new_tokens", "cached_tokens", "count", "verify")
STEP_PHASES = ("prefill", "decode", "mixed")


def _whole(value: Any, field: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(field, f"must be a whole number, got {value!r}")
    if value < minimum:
        what = "a positive whole number" if minimum > 0 else "a whole number >= 0"
        raise ConfigError(field, f"must be {what}, got {value}")
    return value


def _verify_flag(value: Any, new_tokens: int, field: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(field, f"must be true or false, got {value!r}")
    if value and new_tokens < 2:
        raise ConfigError(field, f"a verification group runs k + 1 >= 2 new tokens, got new_tokens {new_tokens}; "
                                 "drop verify for plain decode")
    return value


@attrs.frozen(kw_only=True, order=True)
class StepGroup:
    """``count`` sequences, each running ``new_tokens`` new tokens after ``cached_tokens``
    tokens already in its KV cache. ``count`` is per data-parallel replica."""

    new_tokens: int
    cached_tokens: int = 0
    count: int = 1
    #: a speculative verification group: ``new_tokens - 1`` draft tokens after the last sampled one
    verify: bool = False

    def __attrs_post_init__(self) -> None:
        _whole(self.new_tokens, "new_tokens", 1)
        _whole(self.cached_tokens, "cached_tokens", 0)
        _whole(self.count, "count", 1)
        _verify_flag(self.verify, self.new_tokens, "verify")

    @property
    def context_tokens(self) -> int:
        """Tokens of each sequence in the KV cache after the step: ``cached + new``."""
        return self.cached_tokens + self.new_tokens

    @property
    def is_decode(self) -> bool:
        """One new token per sequence, or a verification group: the decode kernel runs it."""
        return self.new_tokens == 1 or self.verify

    @property
    def kind(self) -> str:
        return "decode" if self.is_decode else "prefill"

    def to_dict(self) -> dict:
        out = {"new_tokens": self.new_tokens, "cached_tokens": self.cached_tokens, "count": self.count}
        if self.verify:
            out["verify"] = True
        return out

    @classmethod
    def from_dict(cls, data: Any, field: str = "step.0") -> "StepGroup":
        if not isinstance(data, Mapping):
            raise ConfigError(field, f"must be a mapping like {{new_tokens: 2048, cached_tokens: 0, count: 1}}, "
                                     f"got {data!r}")
        check_keys(data, field, GROUP_KEYS)
        if "new_tokens" not in data:
            raise ConfigError(f"{field}.new_tokens", "is required (tokens each sequence runs in this step)")
        if "count" not in data:
            raise ConfigError(f"{field}.count", "is required (sequences in this group, per data-parallel replica)")
        new = _whole(data["new_tokens"], f"{field}.new_tokens", 1)
        cached = _whole(data.get("cached_tokens", 0), f"{field}.cached_tokens", 0)
        count = _whole(data["count"], f"{field}.count", 1)
        verify = _verify_flag(data.get("verify", False), new, f"{field}.verify")
        return cls(new_tokens=new, cached_tokens=cached, count=count, verify=verify)


class Step(tuple):
    """A step: a tuple of :class:`StepGroup`, canonical (equal shapes merged, sorted by
    ``(new_tokens, cached_tokens)``). Hashable; equal steps are the same step shape."""

    __slots__ = ()

    def __new__(cls, groups: Iterable[StepGroup] = ()) -> "Step":
        merged: dict[tuple[int, int, bool], int] = {}
        for g in groups:
            if not isinstance(g, StepGroup):
                raise TypeError(f"a Step holds StepGroup records, got {g!r}")
            key = (g.new_tokens, g.cached_tokens, g.verify)
            merged[key] = merged.get(key, 0) + g.count
        if not merged:
            raise ConfigError("step", "must list at least one group, e.g. [{new_tokens: 2048, cached_tokens: 0, "
                                      "count: 1}]")
        return super().__new__(cls, (StepGroup(new_tokens=n, cached_tokens=c, count=k, verify=v)
                                     for (n, c, v), k in sorted(merged.items())))

    # -- shorthand -------------------------------------------------------------------------

    @classmethod
    def prefill(cls, batch: int, seq_len: int, cached_tokens: int = 0) -> "Step":
        """``batch`` prompts of ``seq_len`` new tokens (after ``cached_tokens``)."""
        return cls((StepGroup(new_tokens=seq_len, cached_tokens=cached_tokens, count=batch),))

    @classmethod
    def decode(cls, batch: int, seq_len: int) -> "Step":
        """``batch`` decode tokens at context ``seq_len`` (the new token included)."""
        return cls((StepGroup(new_tokens=1, cached_tokens=seq_len - 1, count=batch),))

    @classmethod
    def verify(cls, batch: int, seq_len: int, draft_tokens: int) -> "Step":
        """The verification step of a speculative decode at context ``seq_len`` (the decode
        shorthand's: the last sampled token included): ``batch`` sequences each running the
        last sampled token and ``draft_tokens`` drafts (``k + 1`` queries) after ``seq_len - 1``
        cached tokens. ``draft_tokens == 0`` is :meth:`decode`."""
        if draft_tokens == 0:
            return cls.decode(batch, seq_len)
        return cls((StepGroup(new_tokens=draft_tokens + 1, cached_tokens=seq_len - 1, count=batch, verify=True),))

    @classmethod
    def from_shorthand(cls, phase: str, batch: int, seq_len: int) -> "Step":
        return cls.prefill(batch, seq_len) if phase == "prefill" else cls.decode(batch, seq_len)

    @classmethod
    def from_list(cls, data: Any, field: str = "step") -> "Step":
        if not isinstance(data, (list, tuple)):
            raise ConfigError(field, f"must be a list of groups like [{{new_tokens: 1, cached_tokens: 8191, "
                                     f"count: 64}}], got {data!r}")
        if not data:
            raise ConfigError(field, "must list at least one group, e.g. [{new_tokens: 2048, cached_tokens: 0, "
                                     "count: 1}]")
        return cls(StepGroup.from_dict(g, f"{field}.{i}") for i, g in enumerate(data))

    def to_list(self) -> list[dict]:
        return [g.to_dict() for g in self]

    # -- what it holds ---------------------------------------------------------------------

    @property
    def phase(self) -> str:
        """``prefill`` or ``decode`` when every group is of that kind, else ``mixed``."""
        kinds = {g.kind for g in self}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    @property
    def sequences(self) -> int:
        """Sequences in the step (per replica)."""
        return sum(g.count for g in self)

    @property
    def new_tokens(self) -> int:
        """New tokens of the step (per replica): what the GEMMs run on."""
        return sum(g.count * g.new_tokens for g in self)

    @property
    def cached_tokens(self) -> int:
        return sum(g.count * g.cached_tokens for g in self)

    @property
    def context_tokens(self) -> int:
        """Tokens in the KV cache after the step (per replica): every sequence's cached + new."""
        return sum(g.count * g.context_tokens for g in self)

    @property
    def max_context_tokens(self) -> int:
        return max(g.context_tokens for g in self)

    @property
    def uniform(self) -> bool:
        """One group: every sequence alike."""
        return len(self) == 1

    @property
    def prefill_groups(self) -> tuple[StepGroup, ...]:
        return tuple(g for g in self if not g.is_decode)

    @property
    def decode_groups(self) -> tuple[StepGroup, ...]:
        return tuple(g for g in self if g.is_decode)

    def shorthand(self) -> tuple[str, int, int] | None:
        """``(phase, batch, seq_len)`` when the shorthand says exactly this step, else None."""
        if not self.uniform:
            return None
        g = self[0]
        if g.verify:
            return None
        if g.is_decode:
            return "decode", g.count, g.context_tokens
        if g.cached_tokens == 0:
            return "prefill", g.count, g.new_tokens
        return None

    def describe(self) -> str:
        """``1 x (2048 new after 30000 cached) + 64 x (1 new after 8191 cached)``."""
        return " + ".join(f"{g.count} x ({g.new_tokens} {'verified' if g.verify else 'new'} after {g.cached_tokens} "
                          "cached)" for g in self)

    def __repr__(self) -> str:
        return f"Step({list(self)!r})"


#: the per-phase name of a step's latency: a pure prefill step's is its TTFT, a pure decode
#: step's its TPOT; a mixed step has only its latency
PHASE_METRIC = {"prefill": "ttft_s", "decode": "tpot_s"}


def phase_metrics(phase: str, latency_s: float) -> dict:
    """``{"ttft_s": latency}`` (prefill), ``{"tpot_s": latency}`` (decode), ``{}`` (mixed)."""
    key = PHASE_METRIC.get(phase)
    return {key: latency_s} if key else {}


def as_step(value: Any, field: str = "step") -> Step:
    """A :class:`Step` from a Step, an iterable of StepGroup, or a configuration list."""
    if isinstance(value, Step):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(g, StepGroup) for g in value):
        return Step(value)
    if isinstance(value, StepGroup):
        return Step((value,))
    return Step.from_list(value, field)
