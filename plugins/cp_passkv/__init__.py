"""Ring pass-KV for context-parallel prefill (spec v1.1.1).

Per layer and per rank ``r`` of a CP group (ring order = cp rank), attention becomes
``cp`` ring-step compute ops of ``F_attn / cp^2`` FLOPs each (balanced split: every rank
does the same work in every step) and ``cp - 1`` P2P ops, each carrying one KV block of
``b * (S/cp) * c_kv`` bytes to rank ``r+1`` (reason ``cp_passkv``).

Dependency contract (step ``i`` on rank ``r``; ``p2p[r][i]`` sends from ``r`` to ``r+1``):

- ``compute[r][0]`` and ``p2p[r][0]`` need the local Q/K/V (the fragment's heads);
- ``compute[r][i] <- p2p[r-1][i-1]``: step ``i`` uses the block that just arrived;
- ``p2p[r][i] <- p2p[r-1][i-1]``: step ``i`` forwards the block it received, and does
  NOT wait for ``compute[r][i]`` (that edge would serialise the ring);
- the attention output on ``r`` is ready when all its ``cp`` steps are done (tails).

Memory: because the ring may run ahead of compute, a rank can hold all ``cp - 1``
received blocks of a layer at once; the ``cp_ring_buffers`` workspace term is that worst
case, ``M_passkv`` bytes.
"""
from __future__ import annotations

from g5core import (
    Fragment, MemoryTerm, Work, attention_block_bytes, attention_dims, attention_kernel, causal_attention_flops,
    hookimpl, merge_kernel,
)


def passkv_bytes_per_rank_per_layer(seq_len: int, cp: int, kv_bytes_per_token: float, batch: int = 1) -> float:
    """``M_passkv = (cp - 1) * (S / cp) * c_kv`` per sequence (times the batch)."""
    return (cp - 1) * block_bytes(seq_len, cp, kv_bytes_per_token, batch)


def block_bytes(seq_len: int, cp: int, kv_bytes_per_token: float, batch: int = 1) -> float:
    """One KV block: ``b * (S / cp) * c_kv``."""
    return batch * seq_len * kv_bytes_per_token / cp


def ring_work(ctx):
    """(FLOPs, HBM bytes) of one ring step on one rank."""
    dep, s = ctx.deployment, ctx.shape
    cp = ctx.size("cp")
    d_qk, d_v = attention_dims(ctx.model, dep.phase)
    f_attn = causal_attention_flops(s.batch, s.seq_len, s.q_heads, d_qk, d_v)
    block = s.seq_len / cp
    hbm = attention_block_bytes(s.batch, block, block, s.q_heads, d_qk, d_v, ctx.kv_bytes_per_token_local,
                                dep.dtypes.activation_element_bytes)
    return f_attn / (cp * cp), hbm


def ring_step_kernels(ctx):
    """The kernels of ring step 0 and of every later step, under the balanced (zig-zag)
    split: each rank holds chunks ``r`` and ``2cp-1-r`` (``L = S/cp`` tokens). Step 0 is the
    causal block of the rank's own ``L`` tokens (the diagonal); every later step is an
    unmasked rectangle of ``L`` queries against half a block (``L/2`` keys) -- or, by
    symmetry, half the queries against the whole block; both do ``F_attn / cp^2`` FLOPs."""
    block = ctx.deployment.seq_len / ctx.size("cp")
    diagonal = attention_kernel(ctx.model, ctx.deployment, ctx.shape, block, block, "causal")
    off = attention_kernel(ctx.model, ctx.deployment, ctx.shape, block, block / 2, "full")
    return diagonal, off


def ring_side_kernels(ctx) -> tuple[tuple, tuple, tuple]:
    """The side kernels of step 0 and the middle steps (none) and of the last step: the merge
    of the cp partial outputs by their log-sum-exp, ``L`` queries per sequence and head (the
    partials are kept and merged once after the ring)."""
    dep, s = ctx.deployment, ctx.shape
    _, d_v = attention_dims(ctx.model, dep.phase)
    cp = ctx.size("cp")
    block = dep.seq_len / cp
    return (), (), (merge_kernel(s.batch * block * s.q_heads, d_v, cp, dep),)


def ring_parts(ctx) -> tuple[list[Work], float]:
    """The work of ring step 0 and of every later step, and the bytes of one KV block: made
    once per logical op, so that its ops share them (one spec each in the op DAG)."""
    step_flops, step_bytes = ring_work(ctx)
    diagonal, off = ring_step_kernels(ctx)
    work = [Work(op_class="attention", flops=step_flops, hbm_bytes=step_bytes, weight_class="", weight_elements=0.0,
                 kernels=(k,) + side) for k, side in zip((diagonal, off, off), ring_side_kernels(ctx))]
    cp = ctx.size("cp")
    return work, block_bytes(ctx.deployment.seq_len, cp, ctx.kv_bytes_per_token_local, ctx.deployment.batch)


def _step_work(i: int, cp: int, kinds: int) -> int:
    """Which of the works (step 0, a middle step, the last step) step ``i`` runs."""
    if i == 0:
        return 0
    return 2 if i == cp - 1 and kinds > 2 else 1


def placed_rings(ctx, lop) -> list[tuple[int, ...]]:
    """The cp rings (chips in cp rank order) whose every chip runs ``lop``."""
    placed = set(ctx.place(lop))
    return [ring for ring in ctx.rankmap.groups("cp") if placed.issuperset(ring)]


def ring_fragment(ctx, lop, ring, work: list[Work], nbytes: float) -> Fragment:
    """One ring's ops on ``ring`` (chips in cp rank order; ``range(cp)`` for the slots of
    a tiled template): per rank its ``cp`` steps, then its ``cp - 1`` sends; the
    dependency contract above as edges, heads and tails."""
    cp = len(ring)
    ops, edges, heads, tails = [], [], {}, {}
    compute = [[None] * cp for _ in ring]
    p2p = [[None] * (cp - 1) for _ in ring]
    for r, chip in enumerate(ring):
        for i in range(cp):
            compute[r][i] = ctx.compute_op(lop, chip, work[_step_work(i, cp, len(work))], owner="cp_passkv",
                                           part=f"step{i:02d}")
            ops.append(compute[r][i])
        for i in range(cp - 1):
            p2p[r][i] = ctx.comm_op(lop, "p2p", (chip, ring[(r + 1) % cp]), nbytes, "cp_passkv", owner="cp_passkv",
                                    part=f"p2p{i:02d}")
            ops.append(p2p[r][i])
        heads[chip] = (compute[r][0].key, p2p[r][0].key)
        tails[chip] = tuple(c.key for c in compute[r])
    edges += Fragment.ring_edges(p2p, compute)
    return Fragment(ops=ops, edges=edges, heads=heads, tails=tails)


@hookimpl
def g5_expand_op(ctx, lop):
    cp = ctx.size("cp")
    if lop.kind != "attention" or ctx.phase != "prefill" or cp == 1:
        return None
    rings = placed_rings(ctx, lop)
    if not rings:
        return Fragment(ops=())
    # one ring on slot chips 0 .. cp-1 (slot r = cp rank r), tiled over every ring
    return Fragment.tiled(ring_fragment(ctx, lop, tuple(range(cp)), *ring_parts(ctx)), rings)


@hookimpl
def g5_memory_terms(ctx):
    cp = ctx.size("cp")
    if cp == 1 or ctx.phase != "prefill":
        return None
    # The contract lets the ring run ahead of compute (a P2P never waits for a step), so all
    # cp - 1 received blocks of a layer may be resident at once: M_passkv bytes per chip,
    # reused layer after layer. The rank's own block is already in its KV cache.
    per_chip = passkv_bytes_per_rank_per_layer(ctx.deployment.seq_len, cp, ctx.kv_bytes_per_token_local,
                                               ctx.deployment.batch)
    return [MemoryTerm("cp_ring_buffers", "workspace", {c: per_chip for c in ctx.all_chips})]
