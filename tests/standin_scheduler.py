"""A stand-in third-party serving plugin: a scheduler that reserves a request's whole KV
(prompt and output) when it admits it, so it never preempts, and a router that sends each
request to the instance with the fewest sequences. It imports only ``g5core``, as a plugin
of another distribution would (``tests/test_serving_contract.py`` installs it as one)."""
from __future__ import annotations

import collections

import g5core
from g5core import Request, RoutedInstance, SchedulerSettings, Seq, StepWork, hookimpl


class ReserveScheduler:
    """FCFS; a request is admitted only when the blocks of its whole context fit."""

    #: requests admitted by every instance made (the contract test reads it)
    admissions = 0

    def __init__(self, settings: SchedulerSettings, total_blocks: int):
        self.s = settings
        self.total_blocks = total_blocks
        self.free_blocks = total_blocks
        self.waiting: collections.deque[Seq] = collections.deque()
        self.running: list[Seq] = []
        self.preemptions = 0   # it never preempts

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def outstanding_tokens(self) -> int:
        return sum(q.num_tokens - q.computed + q.req.output_tokens - q.emitted - 1
                   for q in (*self.running, *self.waiting))

    def add(self, seq: Seq) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[Seq]:
        budget = self.s.max_num_batched_tokens
        picked = []
        for q in self.running:
            if budget == 0:
                break
            q.scheduled = min(q.num_tokens - q.computed, budget)
            budget -= q.scheduled
            picked.append(q)
        while self.waiting and budget > 0 and len(self.running) < self.s.max_num_seqs:
            q = self.waiting[0]
            need = -(-(q.req.input_tokens + q.req.output_tokens) // self.s.block_size)
            if need > self.free_blocks:
                break
            self.waiting.popleft()
            self.free_blocks -= need
            q.blocks = need
            q.scheduled = min(q.num_tokens - q.computed, budget)
            budget -= q.scheduled
            self.running.append(q)
            picked.append(q)
            ReserveScheduler.admissions += 1
        return picked

    @staticmethod
    def work(picked: list[Seq]) -> StepWork:
        chunks = tuple((q.scheduled, q.computed) for q in picked if not (q.scheduled == 1 and q.computed > 0))
        contexts = tuple(sorted(q.computed for q in picked if q.scheduled == 1 and q.computed > 0))
        return StepWork(chunks, contexts)

    def finish_step(self, picked: list[Seq]) -> list[Seq]:
        emitted = []
        for q in picked:
            q.computed += q.scheduled
            q.scheduled = 0
            if q.computed == q.num_tokens:
                q.emitted += 1
                q.num_tokens += 1
                emitted.append(q)
        return emitted

    def release(self, seq: Seq) -> None:
        self.running.remove(seq)
        self.free_blocks += seq.blocks
        seq.blocks = 0


class FewestSequences:
    def choose(self, request: Request, instances: list[RoutedInstance]) -> int:
        return min(range(len(instances)),
                   key=lambda i: (len(instances[i].scheduler.running) + len(instances[i].scheduler.waiting), i))


@hookimpl
def g5_register_schedulers(register):
    register("reserve", ReserveScheduler)


@hookimpl
def g5_register_routers(register):
    register("fewest_sequences", FewestSequences)


# the protocols a plugin meets (checked by the contract test, statically by a type checker)
_CONTRACT = (g5core.Scheduler, g5core.Router)
