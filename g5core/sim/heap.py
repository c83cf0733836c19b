"""Python's cyclic garbage collector around G5's long work: a run makes millions of objects
that form few cycles, and a search keeps large caches; the collector would traverse both
again and again. Results never depend on it (only time and memory do).

- :func:`gc_paused`: the collector off for the length of one run (an engine run, a serving
  run); what the run left in cycles is collected after it, as usual.
- :func:`long_lived_heap` (a search in this process) and :func:`freeze_long_lived` (a worker
  process of G5's own executor, for its life): after each full collection, what survived it
  is moved to the permanent generation (``gc.freeze``), so the next full collection
  traverses only what is new since (the caches that survived one are the search's, kept to
  its end). Measured on the Qwen3-235B search under trtllm in one process
  (``benchmarks/bench_serve_search.py ... --workers 1``): full collections 9.97 s -> 0.92 s of
  a ~115 s search, the same peak memory (784 MB).
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator

#: the generation ``gc`` reports for a full collection
FULL_COLLECTION = 2


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a run makes millions of objects that form no
    cycles (it would otherwise traverse them again and again: about 15% of a large run)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _freeze_after_full(phase: str, info: dict) -> None:
    if phase == "stop" and info.get("generation") == FULL_COLLECTION:
        gc.freeze()


def freeze_long_lived() -> None:
    """For a process of G5's own (an executor's worker): from now on, freeze what survives
    each full collection (the process's caches), for the process's life."""
    if _freeze_after_full not in gc.callbacks:
        gc.callbacks.append(_freeze_after_full)


@contextlib.contextmanager
def long_lived_heap() -> Iterator[None]:
    """:func:`freeze_long_lived` for the length of the block, in a process that may be
    someone else's (an application calling G5): the frozen objects go back to the collector
    at its end (``gc.unfreeze``). Nothing is done where objects were frozen before (the
    application freezes its own) or where the policy is already on."""
    if gc.get_freeze_count() or _freeze_after_full in gc.callbacks:
        yield
        return
    gc.callbacks.append(_freeze_after_full)
    try:
        yield
    finally:
        gc.callbacks.remove(_freeze_after_full)
        gc.unfreeze()
