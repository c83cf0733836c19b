"""The per-instance scheduler: vLLM-style continuous batching over a paged KV pool.

The reference is vLLM's v1 scheduler (``vllm/v1/core/sched/scheduler.py``,
``Scheduler.schedule``). As there, there is no prefill phase and no decode phase: each
sequence has ``num_tokens`` (prompt plus the tokens emitted so far) and ``computed`` (tokens
whose KV is in the cache), and each step gives every sequence some tokens to catch up:

1. the running sequences first, in the order they were admitted: each gets
   ``num_tokens - computed`` tokens (1 for a decode; a prefill's remaining chunk), capped
   by ``long_prefill_token_threshold`` (when set) and by what is left of the step's token
   budget ``max_num_batched_tokens``. When its new KV blocks do not fit, the newest running
   sequence is preempted by recompute (its blocks are freed, its ``computed`` returns to 0
   and it goes back to the front of the waiting queue), until the blocks fit or the
   sequence preempted itself;
2. then, only if nothing was preempted in this step, the waiting sequences in arrival
   order (FCFS) while the token budget lasts and fewer than ``max_num_seqs`` run: a
   waiting sequence gets its whole remaining prompt, or, with chunked prefill, as much of it
   as the budget leaves (Sarathi-style: decodes first, chunks fill the rest). Without
   chunked prefill a prompt that does not fit the budget waits for the next step. The first
   waiting sequence whose blocks do not fit stops the admissions.

A step emits one token for every sequence whose ``computed`` reaches ``num_tokens``.

Where G5 differs from vLLM: no speculative decoding, encoder inputs, priorities or
asynchronous scheduling; the prefix cache is per instance and never evicts (a prefix an
instance has computed stays reusable; its blocks are counted per sequence, not shared); a
preempted sequence recomputes its cached prefix too.
"""
from __future__ import annotations

import collections

import attrs

from g5core.api.errors import ConfigError
from g5core.api.serving import Request, Seq, StepWork
from g5core.inputs.reading import check_keys


@attrs.frozen
class SchedulerSettings:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0   # 0: no cap beyond the budget (vLLM's default)
    block_size: int = 16

    FIELDS = ("name", "max_num_seqs", "max_num_batched_tokens", "chunked_prefill", "long_prefill_token_threshold",
              "block_size")

    @classmethod
    def from_dict(cls, data, field: str = "serving.scheduler") -> "SchedulerSettings":
        check_keys(data, field, cls.FIELDS)
        values = {}
        for key, value in data.items():
            if key == "name":
                continue
            if key == "chunked_prefill":
                if not isinstance(value, bool):
                    raise ConfigError(f"{field}.{key}", f"must be true or false, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < (0 if key.startswith("long") else 1):
                raise ConfigError(f"{field}.{key}", f"must be a positive whole number, got {value!r}")
            values[key] = value
        return cls(**values)


class VllmScheduler:
    """Continuous batching over ``total_blocks`` KV blocks (see the module doc)."""

    def __init__(self, settings: SchedulerSettings, total_blocks: int):
        self.s = settings
        self.total_blocks = total_blocks
        self.free_blocks = total_blocks
        self.waiting: collections.deque[Seq] = collections.deque()
        self.running: list[Seq] = []
        self.preemptions = 0
        self.prefixes: set = set()   # prefix keys this instance has computed

    # -- queue ---------------------------------------------------------------------------

    def add(self, seq: Seq) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    def outstanding_tokens(self) -> int:
        """Tokens still to compute for the sequences here (prefill left plus outputs left)."""
        return sum(q.num_tokens - q.computed + q.req.output_tokens - q.emitted - 1
                   for q in (*self.running, *self.waiting))

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.s.block_size)

    def cached_prefix(self, req: Request) -> int:
        """Prompt tokens this instance can serve from its prefix cache (at least one is computed)."""
        hit = req.cached_tokens
        for key, tokens in req.prefix:
            if key not in self.prefixes:
                break
            hit = max(hit, tokens)
        return min(hit, req.input_tokens - 1)

    def _preempt(self, victim: Seq) -> None:
        self.free_blocks += victim.blocks
        victim.blocks = 0
        victim.computed = 0
        victim.scheduled = 0
        self.preemptions += 1
        self.waiting.appendleft(victim)

    # -- one step ------------------------------------------------------------------------

    def schedule(self) -> list[Seq]:
        """The sequences of the next step, each with ``scheduled`` tokens (empty: nothing fits)."""
        s = self.s
        budget = s.max_num_batched_tokens
        bs = s.block_size
        cap = s.long_prefill_token_threshold
        picked: list[Seq] = []
        preempted = False
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = seq.num_tokens - seq.computed
            if 0 < cap < n:
                n = cap
            if n > budget:
                n = budget
            need = -(-(seq.computed + n) // bs) - seq.blocks
            if need > self.free_blocks:
                while need > self.free_blocks:
                    victim = running.pop()
                    preempted = True
                    if victim.scheduled:
                        budget += victim.scheduled
                        picked.remove(victim)
                    self._preempt(victim)
                    if victim is seq:
                        break
                if victim is seq:
                    break
            self.free_blocks -= need
            seq.blocks += need
            seq.scheduled = n
            budget -= n
            picked.append(seq)
            i += 1
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < s.max_num_seqs:
                seq = self.waiting[0]
                if seq.admitted_s is None and seq.computed == 0:
                    seq.computed = self.cached_prefix(seq.req)
                n = seq.num_tokens - seq.computed
                if not s.chunked_prefill and n > budget:
                    break
                if s.chunked_prefill and 0 < s.long_prefill_token_threshold < n:
                    n = s.long_prefill_token_threshold
                n = min(n, budget)
                need = self._blocks_for(seq.computed + n) - seq.blocks
                if need > self.free_blocks:
                    break
                self.waiting.popleft()
                self.free_blocks -= need
                seq.blocks += need
                seq.scheduled = n
                budget -= n
                self.running.append(seq)
                picked.append(seq)
        return picked

    @staticmethod
    def work(picked: list[Seq]) -> StepWork:
        chunks, contexts = [], []
        for q in picked:
            if q.scheduled == 1 and q.computed > 0:
                contexts.append(q.computed)
            else:
                chunks.append((q.scheduled, q.computed))
        contexts.sort()
        return StepWork(tuple(chunks), tuple(contexts))

    def finish_step(self, picked: list[Seq]) -> list[Seq]:
        """Apply a finished step: the sequences that emitted a token (each emits one)."""
        emitted = []
        for q in picked:
            q.computed += q.scheduled
            q.scheduled = 0
            if q.computed == q.num_tokens:
                if q.emitted == 0 and q.req.prefix:
                    for key, _ in q.req.prefix:
                        self.prefixes.add(key)
                q.emitted += 1
                q.num_tokens += 1
                emitted.append(q)
                if q.emitted == q.req.output_tokens and q.req.cache_key is not None:
                    self.prefixes.add(q.req.cache_key)
        return emitted

    def release(self, seq: Seq) -> None:
        """A sequence leaves the instance (finished, or its KV moved away)."""
        self.running.remove(seq)
        self.free_blocks += seq.blocks
        seq.blocks = 0
