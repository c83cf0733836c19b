"""The garbage collector's policy around G5's long work (g5core/sim/heap.py): paused for a run,
what survives a full collection frozen for a search, and everything given back after it."""
from __future__ import annotations

import concurrent.futures
import gc
import weakref

import pytest

from g5core.sim import heap
from g5core.study.sweep import LocalExecutor


class Node:
    """An object in a reference cycle (only the cyclic collector frees it)."""

    def __init__(self):
        self.me = self


@pytest.fixture
def clean_gc():
    """The collector as the test found it (enabled, nothing frozen, no callback of ours)."""
    assert heap._freeze_after_full not in gc.callbacks
    gc.unfreeze()
    was = gc.isenabled()
    gc.enable()
    yield
    if heap._freeze_after_full in gc.callbacks:
        gc.callbacks.remove(heap._freeze_after_full)
    gc.unfreeze()
    if not was:
        gc.disable()


def test_gc_paused_turns_the_collector_off_and_back_as_it_was(clean_gc):
    with heap.gc_paused():
        assert not gc.isenabled()
        with heap.gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()       # nested: the outer pause still holds
    assert gc.isenabled()
    gc.disable()
    with heap.gc_paused():
        pass
    assert not gc.isenabled()           # off before: left off


def test_a_search_freezes_what_survives_a_full_collection_and_gives_it_back(clean_gc):
    with heap.long_lived_heap():
        assert gc.get_freeze_count() == 0
        kept = Node()
        ref = weakref.ref(kept)
        gc.collect()                    # a full collection: its survivors are frozen
        frozen = gc.get_freeze_count()
        assert frozen > 0
        gc.collect(0)                   # a young collection freezes nothing more
        assert gc.get_freeze_count() == frozen
        del kept
        gc.collect()
        assert ref() is not None        # frozen: a cycle that became garbage waits
    assert gc.get_freeze_count() == 0 and heap._freeze_after_full not in gc.callbacks
    gc.collect()
    assert ref() is None                # given back to the collector, and collected


def test_an_application_that_froze_its_own_objects_is_left_alone(clean_gc):
    gc.collect()
    gc.freeze()
    before = gc.get_freeze_count()
    assert before > 0
    with heap.long_lived_heap():
        assert heap._freeze_after_full not in gc.callbacks
        gc.collect()
        assert gc.get_freeze_count() == before
    assert gc.get_freeze_count() == before     # not unfrozen: not ours


def _worker_policy() -> tuple[bool, bool]:
    return heap._freeze_after_full in gc.callbacks, gc.isenabled()


def test_the_local_executors_workers_freeze_their_caches_and_the_driver_does_not(clean_gc):
    with LocalExecutor(workers=2) as exe:
        futs = [exe.submit(_worker_policy) for _ in range(2)]
        got = [f.result() for f in concurrent.futures.as_completed(futs)]
    assert got == [(True, True), (True, True)]
    assert heap._freeze_after_full not in gc.callbacks
