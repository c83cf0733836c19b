"""Where a token's routed experts land: group-limited routing, expert load, EPLB.

**Uniform routing under a group limit.** The ``E`` routed experts form ``G`` equal contiguous
groups (DeepSeek-V3's ``n_group``); a token picks ``g`` of them (``topk_group``), every
``g``-subset equally likely, then ``k`` distinct experts (``num_experts_per_tok``) among the
``g E / G`` experts of those groups, every ``k``-subset equally likely. ``G = g = 1`` is plain
top-k routing. EP ranks hold contiguous equal blocks of experts, and so do the nodes of an
EP group; a *unit* below is such a block (a rank, or a node's ranks together).

:func:`expected_units_hit` is the one formula for the expected number of distinct units a
token reaches: unit ``j`` with ``a_j(S)`` of its experts among the candidates of the chosen
groups ``S`` is missed with probability ``C(gE/G - a_j(S), k) / C(gE/G, k)``, averaged over
the ``C(G, g)`` equally likely ``S``; the expectation is the sum over units of one minus
that. It gives the distinct destination nodes per token (DeepEP's normal kernels send one
RDMA copy per (token, node)) and the distinct destination ranks.

**Expert load.** :func:`routing_imbalance` draws, with a fixed seed, the (token, expert)
slots of one EP group's step as a multinomial over the experts (uniform routing), sums them
per rank and returns the busiest rank's load over the mean: sampling noise that is large
when each expert sees few tokens and fades as the batch grows. :func:`eplb_placement` is
DeepSeek's EPLB (github.com/deepseek-ai/EPLB, ``eplb.py``: ``replicate_experts`` then
``balanced_packing``) on one level: the heaviest expert (load per replica) gets the next
redundant replica, then the physical experts, heaviest first, go to the least-loaded rank
that still has room (every rank holds the same count).
"""
from __future__ import annotations

import heapq
from functools import lru_cache
from math import comb

import numpy as np

#: seed of the routing draw (same input, same output)
ROUTING_SEED = 0


def _overlaps(unit_sizes: tuple[int, ...], n_experts: int, n_groups: int) -> list[list[int]]:
    """``[unit][group]``: experts of each unit in each group (both contiguous partitions)."""
    per_group = n_experts // n_groups
    out, start = [], 0
    for size in unit_sizes:
        row = [0] * n_groups
        for e in range(start, start + size):
            row[e // per_group] += 1
        out.append(row)
        start += size
    return out


@lru_cache(maxsize=256)
def expected_units_hit(unit_sizes: tuple[int, ...], n_experts: int, topk: int, n_groups: int = 1,
                       topk_groups: int = 1) -> float:
    """Expected distinct units (contiguous expert blocks of ``unit_sizes``) one token's ``topk``
    experts reach under uniform routing with the group limit (module docstring)."""
    if sum(unit_sizes) != n_experts:
        raise ValueError(f"units of {sum(unit_sizes)} experts do not cover {n_experts}")
    if n_groups == 1:
        topk_groups = 1
    candidates = topk_groups * (n_experts // n_groups)
    subsets = comb(n_groups, topk_groups)
    total_ways = comb(candidates, topk)
    expected = 0.0
    for row in _overlaps(tuple(unit_sizes), n_experts, n_groups):
        touched = [a for a in row if a]
        zero = n_groups - len(touched)
        # ways[t][s]: subsets of t touched groups whose overlaps sum to s
        ways = [dict() for _ in range(len(touched) + 1)]
        ways[0][0] = 1
        for a in touched:
            for t in range(len(touched) - 1, -1, -1):
                for s, w in ways[t].items():
                    ways[t + 1][s + a] = ways[t + 1].get(s + a, 0) + w
        missed = 0
        for t, by_sum in enumerate(ways[:topk_groups + 1]):
            rest = comb(zero, topk_groups - t)
            for s, w in by_sum.items():
                missed += w * rest * comb(candidates - s, topk)
        expected += 1.0 - missed / (subsets * total_ways)
    return expected


def route_tokens(n_tokens: int, n_experts: int, topk: int, n_groups: int = 1, topk_groups: int = 1,
                 seed: int = ROUTING_SEED) -> np.ndarray:
    """A seeded draw of the uniform group-limited router: ``(n_tokens, topk)`` expert ids
    (random group scores pick the groups, random expert scores the experts among them)."""
    rng = np.random.default_rng(seed)
    per_group = n_experts // n_groups
    out = np.empty((n_tokens, topk), dtype=np.int64)
    step = 8192
    for lo in range(0, n_tokens, step):
        n = min(step, n_tokens - lo)
        groups = np.argpartition(rng.random((n, n_groups)), n_groups - topk_groups, axis=1)[:, n_groups - topk_groups:]
        allowed = np.zeros((n, n_groups), dtype=bool)
        np.put_along_axis(allowed, groups, True, axis=1)
        scores = rng.random((n, n_experts))
        scores[~np.repeat(allowed, per_group, axis=1)] = -1.0
        out[lo:lo + n] = np.argpartition(scores, n_experts - topk, axis=1)[:, n_experts - topk:]
    return out


@lru_cache(maxsize=256)
def expert_loads(slots: int, n_experts: int, seed: int = ROUTING_SEED) -> tuple[int, ...]:
    """Slots per expert of one seeded multinomial draw of ``slots`` (token, expert) pairs."""
    rng = np.random.default_rng(seed)
    return tuple(int(x) for x in rng.multinomial(slots, np.full(n_experts, 1.0 / n_experts)))


def eplb_placement(loads: tuple[float, ...], ranks: int, redundant: int) -> list[float]:
    """Load per rank after EPLB places ``len(loads) + redundant`` physical experts (module
    docstring); ``(experts + redundant)`` must divide by ``ranks``."""
    n = len(loads)
    physical = n + redundant
    if physical % ranks:
        raise ValueError(f"{physical} physical experts do not split over {ranks} ranks")
    replicas = [1] * n
    heap = [(-float(load), e) for e, load in enumerate(loads)]
    heapq.heapify(heap)
    for _ in range(redundant):
        _, e = heapq.heappop(heap)
        replicas[e] += 1
        heapq.heappush(heap, (-float(loads[e]) / replicas[e], e))
    items = sorted(((loads[e] / replicas[e], e) for e in range(n) for _ in range(replicas[e])),
                   key=lambda x: (-x[0], x[1]))
    per_rank, room = [0.0] * ranks, [physical // ranks] * ranks
    for load, _ in items:
        r = min((r for r in range(ranks) if room[r]), key=lambda r: (per_rank[r], r))
        per_rank[r] += load
        room[r] -= 1
    return per_rank


@lru_cache(maxsize=256)
def routing_imbalance(slots: int, n_experts: int, ranks: int, redundant: int = 0) -> float:
    """Busiest rank's slots over the mean, for one seeded draw of ``slots`` (token, expert)
    pairs of an EP group of ``ranks`` (with ``redundant`` EPLB experts placed on it)."""
    loads = expert_loads(slots, n_experts)
    if redundant:
        per_rank = eplb_placement(loads, ranks, redundant)
    else:
        per = n_experts // ranks
        per_rank = [float(sum(loads[r * per:(r + 1) * per])) for r in range(ranks)]
    mean = sum(per_rank) / ranks
    return max(per_rank) / mean if mean > 0 else 1.0
