"""A prefix cache that fills and evicts, and the KV tiers below HBM.

:class:`CachingScheduler` is the vLLM scheduler (:class:`~g5core.serve.scheduler.VllmScheduler`)
over a block-level prefix cache, after vLLM v1's ``BlockPool`` and ``KVCacheManager``
(``vllm/v1/core/block_pool.py``, ``vllm/v1/core/kv_cache_manager.py``):

- every full block of computed KV gets a hash (:func:`block_hashes`): block ``j`` of a
  request is named by the shared segment that holds all of its tokens (a ``prefix`` chain:
  G5's ``prefix_id``, Mooncake's ``hash_ids``, a synthetic shared prefix) or by the
  conversation it continues (``history``: block ``j`` of every turn holds the same tokens);
  other blocks are the request's own (they are cached too, and never hit);
- a block's hash lives in at most one place: in HBM (held by one or more sequences, counted
  once, or free and evictable), in one tier below it, or nowhere;
- a new sequence looks its prompt's blocks up in order (at most ``input_tokens - 1`` tokens,
  whole blocks; ``get_computed_blocks``) and stops at the first miss; a block hit in HBM is
  held (``BlockPool.touch``: it leaves the free queue); a block found in a lower tier is
  fetched into a new HBM block or recomputed (``miss``: ``fetch``, ``recompute`` or the
  ``faster`` of the link's time and the step cost's time for those tokens), and the lookup
  stops at the first block it recomputes;
- a new block comes from the free blocks, the empty ones first, then the cached one the
  eviction policy names (``lru``: the least recently freed, vLLM's free-block queue;
  ``BlockPool.get_new_blocks`` / ``_maybe_evict_cached_block``); a finished or preempted
  sequence frees its blocks last block first (``KVCacheManager.free`` frees them in
  reverse order, so a sequence's tail is evicted before its head);
- a block evicted from HBM moves down to the first tier (exclusive tiers: it leaves HBM), a
  block evicted from a tier to the next one, and from the last one it is dropped.

Each tier has its own link per chip (``read_gbytes_per_s`` and ``write_gbytes_per_s``,
``latency_s``) that carries offloads (writes) and fetches (reads) one after another
(:class:`Link`), so they contend: a fetch behind an offload waits for it. A step whose
sequences fetch waits for the loads: ``compute + load`` or, with ``overlap`` (vLLM's KV
connector loads layer by layer, ``wait_for_layer_load`` before each layer's attention),
``max(compute, load) + min(compute, load) / layers``.

Bytes: a block is ``block_size`` tokens of the ledger's KV bytes per token; a transfer's time
is the busiest chip's bytes (``kv_bytes_per_token_per_chip``) over its link, the bytes moved
the instance's (``kv_bytes_per_token``, summed over its chips).
"""
from __future__ import annotations

import collections
from array import array
from typing import Callable, Optional

import attrs

from g5core.api.errors import G5Error
from g5core.api.serving import Seq
from g5core.inputs.kv_tiers import TierSpec
from g5core.serve.scheduler import SchedulerSettings, VllmScheduler


def block_hashes(req, lo: int, hi: int, block_size: int) -> list:
    """The hashes of blocks ``lo .. hi - 1`` of ``req``'s context (see the module doc)."""
    if req.history is not None:
        return [(req.history, j) for j in range(lo, hi)]
    out = []
    segs = req.prefix
    i = 0
    for j in range(lo, hi):
        end = (j + 1) * block_size
        while i < len(segs) and segs[i][1] < end:
            i += 1
        out.append((segs[i][0], j) if i < len(segs) else (req.id, j))
    return out


class LruPolicy:
    """The cached blocks no sequence holds, least recently freed first (vLLM's free-block
    queue). A policy has ``add(hash)`` (just freed), ``remove(hash)`` (held again),
    ``victim()`` (the block to evict, removed), ``len()``, ``in`` and iteration."""

    __slots__ = ("order",)

    def __init__(self):
        # an OrderedDict: popping its oldest entry is O(1) (a dict's first key after many
        # deletions at its front is not)
        self.order: collections.OrderedDict = collections.OrderedDict()

    def add(self, h) -> None:
        self.order[h] = None

    def remove(self, h) -> None:
        del self.order[h]

    def victim(self):
        return self.order.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, h) -> bool:
        return h in self.order

    def __iter__(self):
        return iter(self.order)


BUILTIN_POLICIES = {"lru": LruPolicy}


class Link:
    """One tier's link on one chip: transfers go one after another (first come, first
    served), each busy ``bytes / bandwidth``; one ends that long after the link is free plus
    the tier's ``latency_s``. Two fetches issued at once on an idle link end at
    ``B1 / bw + latency`` and ``(B1 + B2) / bw + latency``."""

    __slots__ = ("free_s", "busy_s")

    def __init__(self):
        self.free_s = 0.0
        self.busy_s = 0.0

    def end_s(self, now: float, nbytes: float, gbytes_per_s: float, latency_s: float) -> float:
        """When a transfer issued at ``now`` would end (nothing reserved)."""
        return max(now, self.free_s) + nbytes / (gbytes_per_s * 1e9) + latency_s

    def reserve(self, now: float, nbytes: float, gbytes_per_s: float, latency_s: float) -> float:
        busy = nbytes / (gbytes_per_s * 1e9)
        start = max(now, self.free_s)
        self.free_s = start + busy
        self.busy_s += busy
        return self.free_s + latency_s


class Tier:
    """One tier below HBM on one instance: the blocks it holds (its own policy's order) and
    its link."""

    __slots__ = ("spec", "capacity_blocks", "store", "link")

    def __init__(self, spec: TierSpec, capacity_blocks: int, policy: Callable):
        self.spec, self.capacity_blocks = spec, capacity_blocks
        self.store = policy()
        self.link = Link()


@attrs.frozen
class CacheConfig:
    """What a :class:`CachingScheduler` needs beyond the scheduler settings."""

    policy: Callable = LruPolicy
    tiers: tuple = ()                      # TierSpec, top down
    miss: str = "faster"
    overlap: bool = True
    layers: int = 1                        # the layers a fetch overlaps with (layer by layer)
    kv_bytes_per_token_per_chip: float = 1.0   # the busiest chip's (a transfer's time)
    kv_bytes_per_token: float = 1.0            # the instance's (bytes moved)
    recompute_s: Optional[Callable[[int, int], float]] = None   # (tokens, cached) -> seconds
    policy_name: str = "lru"


def loaded_step_s(compute_s: float, load_s: float, overlap: bool, layers: int) -> float:
    """A step of ``compute_s`` that waits ``load_s`` for KV loads: ``compute + load``, or with
    ``overlap`` (vLLM's KV connector loads layer by layer, ``wait_for_layer_load`` before each
    layer's attention) ``max(compute, load) + min(compute, load) / layers``."""
    if overlap:
        return max(compute_s, load_s) + min(compute_s, load_s) / layers
    return compute_s + load_s


def caches_of(scheduler) -> list:
    """The block caches of an instance's scheduler: none, its own, or one per attention-DP
    rank (a :class:`~g5core.serve.scheduler.DpScheduler` of caching ranks)."""
    if not getattr(scheduler, "io", False):
        return []
    return list(getattr(scheduler, "ranks", (scheduler,)))


#: the names of the cache's per-tier counters (index 0: HBM, then the tiers top down)
COUNTERS = ("hit_blocks", "fetched_blocks", "recomputed_blocks", "evicted_blocks", "stored_blocks",
            "bytes_written", "bytes_read")


class CachingScheduler(VllmScheduler):
    """The vLLM scheduler over a block-level prefix cache and its tiers (module doc)."""

    io = True

    def __init__(self, settings: SchedulerSettings, total_blocks: int, cache: CacheConfig = CacheConfig()):
        super().__init__(settings, total_blocks)
        self.cache = cache
        bs = settings.block_size
        self.block_bytes_per_chip = cache.kv_bytes_per_token_per_chip * bs
        self.block_bytes = cache.kv_bytes_per_token * bs
        self.held: dict = {}        # seq -> its blocks' hashes in order (None: not shared, or not full)
        self.hashed: dict = {}      # seq -> how many of its leading blocks carry their hash
        self.fetches: dict = {}     # seq -> [(tier index, blocks)] its first step loads
        self.pending: dict = {}     # seq -> this step's lookup, until it is admitted or not
        self.ref: dict = {}         # hash -> sequences holding it in HBM
        self.evictable = cache.policy()
        self.empty = total_blocks   # free HBM blocks without a hash
        self.tiers = [Tier(t, int(t.bytes_per_chip // self.block_bytes_per_chip), cache.policy) for t in cache.tiers]
        self.where: dict = {}       # hash -> tier index (lower tiers only)
        levels = 1 + len(self.tiers)
        self.counts = {name: [0] * levels for name in COUNTERS}
        self.lookup_blocks = 0
        self.now = 0.0
        # per request id: (HBM hit blocks, fetched blocks, recomputed blocks, fetch wait s)
        self.per_request: dict = {}
        # one row per schedule: time, cached blocks in HBM, blocks in each tier
        self.occupancy = array("d")

    # -- the cache ---------------------------------------------------------------------------
    def in_hbm(self, h) -> bool:
        return h in self.ref or h in self.evictable

    def cached_blocks(self) -> int:
        """Distinct cached blocks in HBM (held or free): a shared block counts once."""
        return len(self.ref) + len(self.evictable)

    def _hold(self, h) -> None:
        """A sequence holds HBM block ``h`` (free and cached: it leaves the free blocks)."""
        n = self.ref.get(h, 0)
        if n == 0 and h in self.evictable:
            self.evictable.remove(h)
            self.free_blocks -= 1
        self.ref[h] = n + 1

    def _unhold(self, h) -> int:
        """A sequence lets HBM block ``h`` go: 1 when no sequence holds it any more (it joins
        the free, evictable blocks), else 0."""
        n = self.ref[h] - 1
        if n:
            self.ref[h] = n
            return 0
        del self.ref[h]
        self.evictable.add(h)
        return 1

    def _take(self) -> None:
        """A free block for new KV (already counted out of ``free_blocks``): an empty one,
        else the policy's victim, which moves down."""
        if self.empty:
            self.empty -= 1
            return
        if not len(self.evictable):
            raise G5Error("KV cache: no free block to take (a G5 bug)")
        self.counts["evicted_blocks"][0] += 1
        self._store(self.evictable.victim(), 0)

    def _store(self, h, t: int, traffic: bool = True) -> None:
        """Block ``h`` moves into tier ``t`` (over that tier's link), making room as it goes;
        past the last tier it is dropped. ``traffic``: False puts back a block a rolled-back
        lookup took (nothing moved)."""
        while t < len(self.tiers) and self.tiers[t].capacity_blocks == 0:
            t += 1
        if t >= len(self.tiers):
            return
        tier = self.tiers[t]
        if len(tier.store) >= tier.capacity_blocks:
            v = tier.store.victim()
            del self.where[v]
            self.counts["evicted_blocks"][t + 1] += 1
            self._store(v, t + 1)
        tier.store.add(h)
        self.where[h] = t
        if not traffic:
            return
        self.counts["stored_blocks"][t + 1] += 1
        self.counts["bytes_written"][t + 1] += self.block_bytes
        spec = tier.spec
        tier.link.reserve(self.now, self.block_bytes_per_chip, spec.write_gbytes_per_s, spec.latency_s)

    def _unstore(self, h) -> int:
        t = self.where.pop(h)
        self.tiers[t].store.remove(h)
        return t

    def _fetch_s(self, t: int, blocks: int) -> float:
        spec = self.tiers[t].spec
        return self.tiers[t].link.end_s(self.now, blocks * self.block_bytes_per_chip, spec.read_gbytes_per_s,
                                        spec.latency_s) - self.now

    def lookup(self, seq: Seq) -> int:
        """The prompt's cached prefix: held HBM blocks, fetched or recomputed lower ones.
        Taken for good only if the sequence is admitted in this step (:meth:`schedule`
        rolls a lookup back otherwise, as vLLM allocates a hit's blocks with the rest)."""
        if seq in self.held:
            return max(len(self.held[seq]) * self.s.block_size, seq.req.cached_tokens)
        req, bs = seq.req, self.s.block_size
        n = (req.input_tokens - 1) // bs
        hashes = block_hashes(req, 0, n, bs)
        held = []
        j = 0
        while j < n and self.in_hbm(hashes[j]):
            self._hold(hashes[j])
            held.append(hashes[j])
            j += 1
        hbm = j
        deltas = [("hit_blocks", 0, hbm)]
        plan, moved = [], []
        fetched = recomputed = 0
        cache = self.cache
        while j < n and hashes[j] in self.where:
            t = self.where[hashes[j]]
            k = j
            while k < n and self.where.get(hashes[k]) == t:
                k += 1
            fetch = cache.miss == "fetch" or (cache.miss == "faster" and (
                cache.recompute_s is None
                or self._fetch_s(t, k - j) <= cache.recompute_s((k - j) * bs, j * bs)))
            blocks = min(k - j, self.free_blocks) if fetch else 0
            deltas += [("hit_blocks", t + 1, k - j), ("recomputed_blocks", t + 1, k - j - blocks),
                       ("fetched_blocks", t + 1, blocks)]
            recomputed += k - j - blocks
            for h in hashes[j:j + blocks]:
                self._unstore(h)
                self.free_blocks -= 1
                self._take()
                self.ref[h] = 1
                held.append(h)
            if blocks:
                plan.append((t, blocks))
                moved.append((t, hashes[j:j + blocks]))
                fetched += blocks
            if blocks < k - j:
                break
            j = k
        self.held[seq] = held
        self.hashed[seq] = len(held)
        if plan:
            self.fetches[seq] = plan
        self.pending[seq] = (n, hbm, moved, deltas, [hbm, fetched, recomputed, 0.0])
        seq.blocks = len(held)
        return min(max(len(held) * bs, req.cached_tokens), req.input_tokens - 1)

    def _settle(self, picked: list[Seq]) -> None:
        """This step's lookups: those of admitted sequences counted, the others undone
        (their held blocks freed, their fetched blocks back in their tier)."""
        admitted = set(map(id, picked))
        for seq, (n, hbm, moved, deltas, row) in self.pending.items():
            if id(seq) in admitted:
                self.lookup_blocks += n
                for name, level, amount in deltas:
                    self.counts[name][level] += amount
                self.per_request[seq.req.id] = row
                continue
            held = self.held.pop(seq)
            self.hashed.pop(seq)
            self.fetches.pop(seq, None)
            for h in reversed(held[:hbm]):
                self.free_blocks += self._unhold(h)
            for t, hs in moved:
                for h in hs:
                    del self.ref[h]
                    self.empty += 1
                    self.free_blocks += 1
                    self._store(h, t, traffic=False)
            seq.blocks = 0
            seq.computed = 0
        self.pending.clear()

    def _free(self, seq: Seq) -> None:
        """The sequence's blocks go back, its last block first; its blocks counted by the
        scheduler this step but not yet taken return as they are."""
        held = self.held.pop(seq, [])
        self.hashed.pop(seq, None)
        self.fetches.pop(seq, None)
        freed = seq.blocks - len(held)
        for h in reversed(held):
            if h is None:
                self.empty += 1
                freed += 1
                continue
            freed += self._unhold(h)
        self.free_blocks += freed
        seq.blocks = 0

    # -- the scheduler's hooks ---------------------------------------------------------------
    def schedule(self) -> list[Seq]:
        picked = super().schedule()
        self._settle(picked)
        for q in picked:
            held = self.held.setdefault(q, [])
            self.hashed.setdefault(q, 0)
            for _ in range(q.blocks - len(held)):
                self._take()
                held.append(None)
        self.occupancy.append(self.now)
        self.occupancy.append(self.cached_blocks())
        for tier in self.tiers:
            self.occupancy.append(len(tier.store))
        return picked

    def _unadmitted(self) -> None:
        self._settle([])

    def _preempt(self, victim: Seq) -> None:
        self._free(victim)
        victim.computed = 0
        victim.scheduled = 0
        self.preemptions += 1
        self.waiting.appendleft(victim)

    def finish_step(self, picked: list[Seq]) -> list[Seq]:
        emitted = super().finish_step(picked)
        bs = self.s.block_size
        for q in picked:
            held = self.held[q]
            lo, hi = self.hashed[q], min(q.computed // bs, len(held))
            if hi <= lo:
                continue
            for j, h in zip(range(lo, hi), block_hashes(q.req, lo, hi, bs)):
                if self.in_hbm(h):      # the same block is in HBM: share it, give this one back
                    self._hold(h)
                    self.empty += 1
                    self.free_blocks += 1
                else:
                    if h in self.where:     # recomputed: the copy below is superseded
                        self._unstore(h)
                    self.ref[h] = 1
                held[j] = h
            self.hashed[q] = hi
        return emitted

    def release(self, seq: Seq) -> None:
        self.running.remove(seq)
        self._free(seq)

    def start_loads(self, now: float, picked: list[Seq]) -> tuple[float, list[Seq]]:
        """The reads of the step's fetches, reserved on their links at ``now``: how long the
        step waits for the last of them (0 without any) and the sequences that fetch."""
        load_end = now
        fetching = []
        for q in picked:
            plan = self.fetches.pop(q, None)
            if not plan:
                continue
            fetching.append(q)
            for t, blocks in plan:
                spec = self.tiers[t].spec
                end = self.tiers[t].link.reserve(now, blocks * self.block_bytes_per_chip, spec.read_gbytes_per_s,
                                                 spec.latency_s)
                self.counts["bytes_read"][t + 1] += blocks * self.block_bytes
                load_end = max(load_end, end)
        return load_end - now, fetching

    def with_loads_s(self, compute_s: float, load_s: float, fetching: list[Seq]) -> float:
        """The step's latency when it waits ``load_s`` for its loads (:func:`loaded_step_s`);
        the wait is each fetching sequence's ``fetch_s``."""
        latency = loaded_step_s(compute_s, load_s, self.cache.overlap, self.cache.layers)
        for q in fetching:
            self.per_request[q.req.id][3] = latency - compute_s
        return latency

    def step_latency_s(self, now: float, compute_s: float, picked: list[Seq]) -> float:
        """The step's latency with the loads its sequences wait for (module doc)."""
        load_s, fetching = self.start_loads(now, picked)
        return self.with_loads_s(compute_s, load_s, fetching) if fetching else compute_s

    # -- checks ------------------------------------------------------------------------------
    def check(self) -> dict:
        """The cache's invariants (each 0): a hash in one place at most, the HBM blocks add
        up (held + free = the pool), no tier over its size, and the bytes written and read
        are the blocks moved times the bytes of a block."""
        hbm = set(self.ref) | set(self.evictable)
        below = set(self.where)
        in_tiers = sum(len(t.store) for t in self.tiers)
        held_unshared = sum(1 for held in self.held.values() for h in held if h is None)
        limbo = sum(q.blocks - len(self.held.get(q, ())) for q in (*self.running, *self.waiting) if q in self.held)
        c = self.counts
        moved_bytes = sum(abs(c["bytes_written"][t] - c["stored_blocks"][t] * self.block_bytes)
                          + abs(c["bytes_read"][t] - c["fetched_blocks"][t] * self.block_bytes)
                          for t in range(len(self.tiers) + 1))
        return {"blocks_in_two_places": len(hbm & below) + (len(self.ref) + len(self.evictable) - len(hbm))
                + (in_tiers - len(below)),
                "hbm_blocks_unaccounted": abs(len(self.ref) + held_unshared + limbo + self.empty + len(self.evictable)
                                              - self.total_blocks)
                + abs(self.free_blocks - self.empty - len(self.evictable)),
                "tier_over_size": sum(len(t.store) > t.capacity_blocks for t in self.tiers),
                "bytes_moved_mismatch": moved_bytes}
