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

With speculative decoding (:class:`SpeculativeScheduler`, a pool whose configuration has a
``speculative:`` block) each decoding sequence takes ``k + 1`` tokens of the budget and KV
blocks for ``k + 1`` more tokens; after the step it keeps ``1 .. k + 1`` tokens, drawn per
sequence and step from a seeded generator (vLLM's rejection sampler accepts the drafts up to
the first rejection and adds one token of the target), and its blocks shrink back to those
its computed tokens fill.

Where G5 differs from vLLM: no encoder inputs, priorities or asynchronous scheduling; the
prefix cache is per scheduler (an instance, or an attention-DP rank of one) and never evicts
(a prefix a scheduler has computed stays reusable; its blocks are counted per sequence, not
shared); a preempted sequence recomputes its cached prefix too. The block-level cache that
fills and evicts, with tiers below HBM, is :class:`g5core.serve.kvcache.CachingScheduler`
(``serving.prefix_cache``, ``serving.kv_tiers``), one per instance or per attention-DP rank.
"""
from __future__ import annotations

import collections

import numpy as np

from g5core.api.serving import Request, Seq, StepWork
from g5core.inputs.serving import SchedulerSettings
from g5core.serve.cost import RankedWork


class VllmScheduler:
    """Continuous batching over ``total_blocks`` KV blocks (see the module doc)."""

    io = False   # a step waits for no KV loads (:class:`g5core.serve.kvcache.CachingScheduler` does)

    def __init__(self, settings: SchedulerSettings, total_blocks: int):
        self.s = settings
        self.total_blocks = total_blocks
        self.free_blocks = total_blocks
        self.waiting: collections.deque[Seq] = collections.deque()
        self.running: list[Seq] = []
        self.preemptions = 0
        self.prefixes: set = set()   # prefix keys this instance has computed
        # the most sequences running at once after admissions (the serving search: while it
        # stays below max_num_seqs the limit never stopped an admission, so a larger limit
        # makes the same steps)
        self.peak_running = 0

    #: draft tokens each decode verifies (0: plain decode; SpeculativeScheduler sets it)
    draft_tokens = 0

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

    def lookup(self, seq: Seq) -> int:
        """The prompt tokens a newly admitted sequence finds cached (a caching scheduler
        also takes their blocks)."""
        return self.cached_prefix(seq.req)

    def _preempt(self, victim: Seq) -> None:
        self.free_blocks += victim.blocks
        victim.blocks = 0
        victim.computed = 0
        victim.scheduled = 0
        self.preemptions += 1
        self.waiting.appendleft(victim)

    # -- one step ------------------------------------------------------------------------

    def schedule(self) -> list[Seq]:
        """The sequences of the next step, each with ``scheduled`` tokens (empty: nothing fits).
        Without ``mixed_prefill`` (SGLang's default) a step takes prefills only -- the running
        prompts' next chunks and the prompts the whole budget admits -- where it finds one, and
        the decodes wait; otherwise it is the decodes' step, which admits only sequences whose
        next token is a decode (a decode pool's arrivals, their prompts computed elsewhere), as
        SGLang's ``Scheduler.get_next_batch_to_run`` runs a new prefill batch when
        ``get_new_batch_prefill`` forms one, the running decode batch otherwise, and its decode
        servers merge their transferred requests into the running batch
        (``get_next_disagg_decode_batch_to_run``: the prebuilt batch, no prefill forward)."""
        if self.s.mixed_prefill:
            return self._pick(decodes=True, decoding=None)
        picked = self._pick(decodes=False, decoding=False)
        if picked:
            return picked
        self._unadmitted()
        return self._pick(decodes=True, decoding=True)

    def _unadmitted(self) -> None:
        """A prefill step found nothing to take: what its admission looked up is undone
        before the decodes' step (:class:`g5core.serve.kvcache.CachingScheduler` gives back
        the blocks a lookup held); nothing here."""

    def _pick(self, decodes: bool, decoding: bool | None) -> list[Seq]:
        """The running sequences' tokens (``decodes``: their decodes too, else only the
        prompts' chunks), preempting the newest where KV blocks run out, then, where nothing
        was preempted, the admissions the budget left allows (:meth:`admit`, ``decoding``)."""
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
            if n == 1 and seq.emitted:      # (_decoding)
                if not decodes:
                    i += 1
                    continue
                n += self.draft_tokens     # a decode verifies its drafts (SpeculativeScheduler)
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
            self.admit(budget, picked, decoding)
        return picked

    @staticmethod
    def _decoding(q: Seq) -> bool:
        """Whether ``q``'s next token is a decode: its prompt computed (here, or elsewhere and
        its KV moved in) and a token emitted."""
        return bool(q.emitted) and q.computed == q.num_tokens - 1

    def admission_budget(self, decodes: int) -> int:
        """The budget the queue's head is admitted with in a step whose running sequences take
        ``decodes`` tokens (:meth:`schedule`): what they leave, or, without ``mixed_prefill``, a
        prompt's whole budget (a prefill step of its own)."""
        s = self.s
        if s.mixed_prefill or self._decoding(self.waiting[0]):
            return s.max_num_batched_tokens - decodes
        return s.max_num_batched_tokens

    def _admission(self, q: Seq, computed: int, left: int) -> tuple[int, int] | None:
        """The tokens and new KV blocks :meth:`admit` gives the waiting sequence ``q``, with
        ``computed`` of its tokens cached, in a step that leaves it ``left`` tokens of the
        budget; None where it cannot take it (FCFS admission stops there)."""
        s = self.s
        n = q.num_tokens - computed
        if not s.chunked_prefill and n > left:
            return None
        if s.chunked_prefill and 0 < s.long_prefill_token_threshold < n:
            n = s.long_prefill_token_threshold
        n = min(n, left)
        need = self._blocks_for(computed + n) - q.blocks
        return None if need > self.free_blocks else (n, need)

    def may_admit(self, left: int) -> bool:
        """Whether :meth:`admit` could take the first waiting sequence into a step whose running
        sequences leave it ``left`` tokens of the budget, at the free KV blocks now (no side
        effect: the prefix it would find cached is :meth:`cached_prefix`'s)."""
        if left <= 0:
            return False
        q = self.waiting[0]
        c = q.computed
        if q.admitted_s is None and c == 0:
            c = self.cached_prefix(q.req)
        return self._admission(q, c, left) is not None

    def admit(self, budget: int, picked: list[Seq], decoding: bool | None = None) -> None:
        """The waiting sequences admitted into the step (after the running ones, which left
        ``budget`` tokens of it), appended to ``picked`` (:meth:`schedule`'s second part), first
        come first served; ``decoding`` True (False) admits only sequences whose next token is
        (is not) a decode, stopping at the first other one."""
        s = self.s
        while self.waiting and budget > 0 and len(self.running) < s.max_num_seqs:
            seq = self.waiting[0]
            if decoding is not None and self._decoding(seq) is not decoding:
                break
            if seq.admitted_s is None and seq.computed == 0:
                seq.computed = self.lookup(seq)
            chunk = self._admission(seq, seq.computed, budget)
            if chunk is None:
                break
            n, need = chunk
            self.waiting.popleft()
            self.free_blocks -= need
            seq.blocks += need
            seq.scheduled = n
            budget -= n
            self.running.append(seq)
            picked.append(seq)
        if len(self.running) > self.peak_running:
            self.peak_running = len(self.running)

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
                if q.emitted == q.req.output_tokens:
                    self.last_token(q)
        return emitted

    def last_token(self, q: Seq) -> None:
        """``q`` emitted its last token (in a step, or at the end of the serving loop's run of
        decode steps): a conversation's turn is cached under its key for the next turn."""
        if q.req.cache_key is not None:
            self.prefixes.add(q.req.cache_key)

    def release(self, seq: Seq) -> None:
        """A sequence leaves the instance (finished, or its KV moved away)."""
        self.running.remove(seq)
        self.free_blocks += seq.blocks
        seq.blocks = 0


# ------------------------------------------------------------------------------ attention DP
#: How an instance of attention-DP ranks hands a request to a rank: the rules of SGLang's
#: DP-attention controller (``python/sglang/srt/managers/data_parallel_controller.py``,
#: ``DataParallelController``, ``--load-balance-method``, sgl-project/sglang at commit
#: 000a3db): ``round_robin`` (its default: ``round_robin_scheduler``, the ranks in turn) and
#: ``shortest_queue`` (``shortest_queue_scheduler``: its ``DPBudget`` sends requests to the
#: ranks with the fewest requests, lowest rank first; G5 reads the ranks' request counts at
#: the moment of the arrival, where SGLang reads them from the ranks' periodic load reports).


class DpScheduler:
    """The schedulers of an instance of ``dp`` attention-DP ranks, as one scheduler to the
    serving loop: a request goes to one rank (:data:`g5core.inputs.serving.DP_BALANCE`) and stays there; each rank
    schedules its own batch from its own KV pool (``total_blocks // dp`` blocks, the
    pool's ``max_num_seqs`` and ``max_num_batched_tokens`` per rank, as each SGLang DP rank
    runs its own scheduler); a step of the instance is every rank's step at once
    (:class:`~g5core.serve.cost.RankedWork`): a rank with nothing to run is idle in it but
    still steps (it joins the MoE all-to-all; ``idle_steps`` counts them).

    With a block cache (``factory`` making :class:`~g5core.serve.kvcache.CachingScheduler`
    ranks) each rank owns its cache over its own share of the pool and its own tiers, as each
    SGLang DP-attention rank is a scheduler process with its own radix cache
    (``python/sglang/srt/managers/scheduler.py``, ``Scheduler.init_cache_with_memory_pool``
    builds ``self.tree_cache`` per process; ``DataParallelController.launch_tensor_parallel_group``
    starts one per ``dp_rank``): a request hits only what its own rank cached, so a repeat
    the balance sends to another rank misses. The instance's step waits for the slowest
    rank's loads (:meth:`step_latency_s`)."""

    io = False   # True when the ranks are caching schedulers (set per instance)

    def __init__(self, settings: SchedulerSettings, total_blocks: int, dp: int, balance: str = "round_robin",
                 factory=VllmScheduler):
        if total_blocks % dp:
            raise ValueError(f"{total_blocks} KV blocks do not split over {dp} attention-DP ranks")
        self.s = settings
        self.dp, self.balance = dp, balance
        self.ranks = [factory(settings, total_blocks // dp) for _ in range(dp)]
        self.rank_of: dict[int, int] = {}          # request id -> its rank, while it is here
        self.added = [0] * dp                       # requests each rank was given
        self.twice = 0                              # requests given to this instance while still on it
        self.idle_steps = [0] * dp
        self.steps_over_pool = [0] * dp
        self._next = 0
        self._picks: list[list[Seq]] = [[] for _ in range(dp)]
        self.io = getattr(self.ranks[0], "io", False)
        self._now = 0.0

    # -- the ranks seen as one -------------------------------------------------------------
    @property
    def total_blocks(self) -> int:
        return sum(r.total_blocks for r in self.ranks)

    @property
    def free_blocks(self) -> int:
        return sum(r.free_blocks for r in self.ranks)

    @property
    def used_blocks(self) -> int:
        return sum(r.used_blocks for r in self.ranks)

    @property
    def waiting(self) -> "_Ranks":
        return _Ranks(self.ranks, "waiting")

    @property
    def peak_running(self) -> int:
        """The most sequences running at once on one rank (``max_num_seqs`` is per rank)."""
        return max(r.peak_running for r in self.ranks)

    @property
    def running(self) -> "_Ranks":
        return _Ranks(self.ranks, "running")

    @property
    def has_work(self) -> bool:
        return any(r.has_work for r in self.ranks)

    @property
    def preemptions(self) -> int:
        return sum(r.preemptions for r in self.ranks)

    def outstanding_tokens(self) -> int:
        return sum(r.outstanding_tokens() for r in self.ranks)

    # -- requests ----------------------------------------------------------------------------
    def choose_rank(self) -> int:
        if self.balance == "shortest_queue":
            return min(range(self.dp), key=lambda i: (len(self.ranks[i].running) + len(self.ranks[i].waiting), i))
        i = self._next
        self._next = (i + 1) % self.dp
        return i

    def add(self, seq: Seq) -> None:
        k = seq.req.id
        if k in self.rank_of:
            self.twice += 1
        i = self.rank_of[k] = self.choose_rank()
        self.added[i] += 1
        self.ranks[i].add(seq)

    def release(self, seq: Seq) -> None:
        self.ranks[self.rank_of.pop(seq.req.id)].release(seq)

    def last_token(self, q: Seq) -> None:
        """``q`` emitted its last token at the end of a run of decode steps (its rank's
        :meth:`VllmScheduler.last_token`)."""
        self.ranks[self.rank_of[q.req.id]].last_token(q)

    # -- one step of every rank --------------------------------------------------------------
    def schedule(self) -> list[Seq]:
        picks = self._picks = [r.schedule() for r in self.ranks]
        busy = any(picks)
        for i, (r, p) in enumerate(zip(self.ranks, picks)):
            if busy and not p:
                self.idle_steps[i] += 1
            if r.used_blocks > r.total_blocks:
                self.steps_over_pool[i] += 1
        return [q for p in picks for q in p]

    def work(self, picked: list[Seq]):
        return RankedWork(tuple(r.work(p) for r, p in zip(self.ranks, self._picks)))

    def finish_step(self, picked: list[Seq]) -> list[Seq]:
        return [q for r, p in zip(self.ranks, self._picks) for q in r.finish_step(p)]

    # -- the ranks' block caches -------------------------------------------------------------
    @property
    def now(self) -> float:
        return self._now

    @now.setter
    def now(self, now: float) -> None:
        """The serving loop's clock before a step (a caching rank's offloads start then)."""
        self._now = now
        for r in self.ranks:
            r.now = now

    def step_latency_s(self, now: float, compute_s: float, picked: list[Seq]) -> float:
        """The instance's step with the KV loads of every caching rank: the ranks step
        together, so the step waits for the slowest rank's loads (each rank's on its own
        links); every fetching sequence waits that long."""
        loads = [r.start_loads(now, p) for r, p in zip(self.ranks, self._picks)]
        if not any(fetching for _, fetching in loads):
            return compute_s
        load_s = max(load for load, _ in loads)
        latency = compute_s
        for r, (_, fetching) in zip(self.ranks, loads):
            latency = r.with_loads_s(compute_s, load_s, fetching)
        return latency

    def check(self) -> dict:
        """Per rank: blocks still held, steps over the rank's pool, requests given twice;
        with caching ranks, their caches' invariants (``kv_cache_...``, summed over ranks)."""
        out = {"kv_blocks_left_at_end": sum(abs(r.used_blocks) for r in self.ranks),
               "steps_over_kv_pool": sum(self.steps_over_pool), "requests_given_twice": self.twice}
        if self.io:
            for r in self.ranks:
                for key, value in r.check().items():
                    out[f"kv_cache_{key}"] = out.get(f"kv_cache_{key}", 0) + value
        return out


class _Ranks:
    """The ranks' ``running`` (or ``waiting``) sequences seen as one sequence, rank by rank:
    its length and truth from the ranks' own (the serving loop's step log reads them each
    step), its items built only where they are read."""

    __slots__ = ("ranks", "name")

    def __init__(self, ranks: list, name: str):
        self.ranks, self.name = ranks, name

    def __len__(self) -> int:
        return sum(len(getattr(r, self.name)) for r in self.ranks)

    def __bool__(self) -> bool:
        return any(getattr(r, self.name) for r in self.ranks)

    def __iter__(self):
        for r in self.ranks:
            yield from getattr(r, self.name)

    def __getitem__(self, i):
        return list(self)[i]


class SpeculativeScheduler(VllmScheduler):
    """:class:`VllmScheduler` with speculative decoding: each decode runs ``k + 1`` tokens and
    keeps ``spec.draw`` of them (the module doc); ``seed`` makes the draws (one generator per
    instance). ``verify_steps`` / ``verify_tokens``: decodes verified and tokens they kept.
    A decode the token budget cuts short verifies fewer drafts (its draw capped there); the
    step's cost counts it at ``k + 1``."""

    def __init__(self, settings: SchedulerSettings, total_blocks: int, spec, seed: int = 0):
        super().__init__(settings, total_blocks)
        self.spec = spec
        self.draft_tokens = spec.tokens
        self.rng = np.random.default_rng(seed)
        self.verify_steps = 0
        self.verify_tokens = 0

    def work(self, picked: list[Seq]) -> StepWork:
        chunks, contexts = [], []
        for q in picked:
            if self._decoding(q):
                contexts.append(q.computed)
            else:
                chunks.append((q.scheduled, q.computed))
        contexts.sort()
        return StepWork(tuple(chunks), tuple(contexts), self.draft_tokens)

    def finish_step(self, picked: list[Seq]) -> list[Seq]:
        bs = self.s.block_size
        decodes = [q for q in picked if self._decoding(q)]
        kept = iter(self.spec.draw(len(decodes), self.rng).tolist()) if decodes else iter(())
        emitted = []
        for q in picked:
            if not self._decoding(q):
                emitted.extend(super().finish_step([q]))
                continue
            # drafts accepted up to the first rejection, plus the target's token; a request
            # stops at its last token
            n = min(next(kept), q.scheduled, q.req.output_tokens - q.emitted)
            q.computed += n
            q.scheduled = 0
            q.emitted += n
            q.num_tokens += n
            self.verify_steps += 1
            self.verify_tokens += n
            keep = -(-q.computed // bs)      # the blocks follow the kept tokens
            self.free_blocks += q.blocks - keep
            q.blocks = keep
            if q.emitted == q.req.output_tokens and q.req.cache_key is not None:
                self.prefixes.add(q.req.cache_key)
            emitted.append(q)
        return emitted


def speculative_factory(spec, instances: int, seed: int = 0):
    """A scheduler factory ``(settings, total_blocks) -> SpeculativeScheduler`` for a pool of
    ``instances``; instance ``i`` draws from ``seed + i``. Every run of the pool makes its
    ``instances`` schedulers anew, in index order (:class:`g5core.serve.loop.Instance`), so the
    factory counts the schedulers it made modulo ``instances``: each run of a session draws
    the same (a count over the factory's life gave a session's second run other seeds)."""
    made = [0]

    def make(settings: SchedulerSettings, total_blocks: int) -> SpeculativeScheduler:
        index = made[0] % instances
        made[0] += 1
        return SpeculativeScheduler(settings, total_blocks, spec, seed + index)

    return make
