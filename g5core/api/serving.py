"""The serving contract: the records and protocols a scheduler, router or trace-format plugin
works with (``g5_register_schedulers``, ``g5_register_routers``,
``g5_register_workload_formats``), exported from ``g5core``.

- :class:`Request`: one request of a workload (arrival, prompt and output lengths, cache);
- :class:`Seq`: one request's state on one instance, made by the serving loop and handed
  to the instance's scheduler;
- :class:`StepWork`: what one step of an instance computes (prefill chunks and decodes),
  which the scheduler makes and the step cost prices; :class:`GroupShape`: one group of
  sequences of a step by value (the form the step cost's caches and step runners key on);
- :class:`Scheduler` (made by a factory ``(settings, total_blocks)``, ``settings`` a
  :class:`g5core.SchedulerSettings`) and :class:`Router`: the protocols the serving loop
  calls; :class:`RoutedInstance`: what a router sees of an instance;
- :class:`TraceFormat`: a request-trace format; its ``row`` raises
  :class:`TraceFieldError` on a bad field.

The serving loop (:mod:`g5core.serve.loop`) is the only caller; the built-in scheduler
(``vllm``, :class:`g5core.serve.scheduler.VllmScheduler`) and routers
(:mod:`g5core.serve.router`) implement the same protocols a plugin does.
"""
from __future__ import annotations

from typing import Callable, Iterable, Mapping, NamedTuple, Optional, Protocol, Sequence, Sized

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
    # the conversation this request continues: block j of every request with the same
    # history holds the same tokens (the block cache's key; g5core.serve.kvcache)
    history: Optional[str] = None


class GroupShape(NamedTuple):
    """``count`` sequences of a step, each running ``new_tokens`` after ``cached_tokens``: a
    :class:`g5core.StepGroup` by value, hashable and cheap to make (the step cost's caches
    and step runners key on tuples of them; ``g5core.serve.cost.to_step`` makes the Step)."""

    new_tokens: int
    cached_tokens: int
    count: int


@attrs.frozen(slots=True)
class StepWork:
    """What one step of one instance computes: its prefill chunks as ``(new_tokens,
    cached_tokens)`` pairs, and one decode token for each sequence whose cached tokens are
    in ``decode_contexts`` (sorted). ``draft_tokens``: with speculative decoding, each decode
    also verifies ``draft_tokens`` drafts (``k + 1`` query tokens; ``new_tokens`` and
    :meth:`groups` count the one token of plain decode, the cost adds the rest)."""

    chunks: tuple[tuple[int, int], ...]
    decode_contexts: tuple[int, ...]
    draft_tokens: int = 0
    #: the step's new tokens: its chunks' and one per decode (worked out once: the serving
    #: loop and the step costs read it many times per step)
    new_tokens: int = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "new_tokens", sum(n for n, _ in self.chunks) + len(self.decode_contexts))

    @property
    def decodes(self) -> int:
        return len(self.decode_contexts)

    @property
    def decode_context_tokens(self) -> int:
        return sum(self.decode_contexts)

    def groups(self) -> tuple[GroupShape, ...]:
        """The step as groups, every sequence as it is (a group of one)."""
        out = [GroupShape(n, c, 1) for n, c in self.chunks]
        out.extend(GroupShape(1, c, 1) for c in self.decode_contexts)
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


class TraceFieldError(Exception):
    """A bad field of one trace record (a format's ``row`` raises it): the reader adds the
    file and the line."""

    def __init__(self, field: str, message: str):
        self.field, self.message = field, message
        super().__init__(message)


@attrs.frozen
class TraceFormat:
    """``row(record) -> (time_s, input_tokens, output_tokens, cached_tokens, prefix)``;
    raise :class:`TraceFieldError` ``(field, message)`` on a bad field. ``relative``: times are counted from the
    first request (``False``: kept as the file gives them)."""

    name: str
    container: str                       # "csv" or "jsonl"
    columns: tuple[str, ...]             # the columns (or keys) that identify the format
    row: Callable[[Mapping], tuple]
    relative: bool = True
    doc: str = ""


class Scheduler(Protocol):
    """One instance's scheduler, made by a registered factory ``(settings, total_blocks)``.

    The serving loop calls ``add`` when a request reaches the instance; ``schedule`` when
    the instance is idle (the sequences of the next step, each with ``scheduled`` tokens;
    empty: nothing fits); ``work(picked)`` for the step's :class:`StepWork`;
    ``finish_step(picked)`` when the step ends (the sequences that emitted a token);
    ``release(seq)`` when a sequence leaves (finished, or its KV moved to a decode pool).
    It reads ``running``, ``waiting``, ``used_blocks``, ``total_blocks``, ``has_work`` and
    ``preemptions`` for its step log and invariants; routers read ``outstanding_tokens()``.
    """

    total_blocks: int
    preemptions: int
    running: list

    @property
    def waiting(self) -> Sized: ...

    @property
    def used_blocks(self) -> int: ...

    @property
    def has_work(self) -> bool: ...

    def add(self, seq: Seq) -> None: ...

    def schedule(self) -> list[Seq]: ...

    def work(self, picked: list[Seq]) -> StepWork: ...

    def finish_step(self, picked: list[Seq]) -> Iterable[Seq]: ...

    def release(self, seq: Seq) -> None: ...

    def outstanding_tokens(self) -> int: ...


class RoutedInstance(Protocol):
    """What a router sees of an instance: its scheduler."""

    scheduler: Scheduler


class Router(Protocol):
    """Which instance of a pool a request goes to (a registered factory ``()`` makes one per
    pool): the index into ``instances``; deterministic for the same calls."""

    def choose(self, request: Request, instances: Sequence[RoutedInstance]) -> int: ...
