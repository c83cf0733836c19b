"""The serving contract: the records and protocols a scheduler, router or trace-format plugin
works with (``g5_register_schedulers``, ``g5_register_routers``,
``g5_register_workload_formats``), exported from ``g5core``.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

import attrs


@attrs.frozen(slots=True)
class Request:
    """One request: when it arrives, its prompt and output lengths, and what of the prompt a
    cache may already hold.

    ``cached_tokens``: prompt tokens already in the KV cache wherever the request runs
    (a trace's ``cached_tokens`` column). ``prefix``: ``((key, tokens), ...)``, a chain of
    shared-prefix segments with the prompt tokens each one covers (cumulative); the
    instance serving the request reuses the longest chain it has already computed."""

    id: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    prefix: tuple = ()
    cache_key: Optional[str] = None   # what the instance caches when the request finishes (its whole context)


@attrs.frozen(slots=True)
class StepWork:
    """What one step of one instance computes: its prefill chunks as ``(new_tokens,
    cached_tokens)`` pairs, and one decode token for each sequence whose cached tokens are
    in ``decode_contexts`` (sorted)."""

    chunks: tuple[tuple[int, int], ...]
    decode_contexts: tuple[int, ...]

    @property
    def decodes(self) -> int:
        return len(self.decode_contexts)

    @property
    def decode_context_tokens(self) -> int:
        return sum(self.decode_contexts)

    @property
    def new_tokens(self) -> int:
        return sum(n for n, _ in self.chunks) + len(self.decode_contexts)

    def groups(self) -> tuple[tuple[int, int, int], ...]:
        """The step as ``(new_tokens, cached_tokens, count)`` groups, every sequence as it is."""
        out = [(n, c, 1) for n, c in self.chunks]
        out.extend((1, c, 1) for c in self.decode_contexts)
        return tuple(out)


class Seq:
    """One request's state on one instance."""

    __slots__ = ("req", "computed", "num_tokens", "emitted", "blocks", "admitted_s", "scheduled", "last_s",
                 "max_itl_s")

    def __init__(self, req: Request, computed: int = 0, emitted: int = 0):
        self.req = req
        self.computed = computed
        self.emitted = emitted
        self.num_tokens = req.input_tokens + emitted
        self.blocks = 0
        self.admitted_s: Optional[float] = None
        self.scheduled = 0
        self.last_s: Optional[float] = None   # when its last token was emitted (the loop keeps it)
        self.max_itl_s = 0.0


class _Bad(Exception):
    def __init__(self, field: str, message: str):
        self.field, self.message = field, message
        super().__init__(message)


@attrs.frozen
class TraceFormat:
    """``row(record) -> (time_s, input_tokens, output_tokens, cached_tokens, prefix)``;
    raise ``bad(field, message)`` on a bad field. ``relative``: times are counted from the
    first request (``False``: kept as the file gives them)."""

    name: str
    container: str                       # "csv" or "jsonl"
    columns: tuple[str, ...]             # the columns (or keys) that identify the format
    row: Callable[[Mapping], tuple]
    relative: bool = True
    doc: str = ""
