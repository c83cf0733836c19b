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
    Attention, Fragment, MemoryTerm, Work, attention_block_bytes, attention_dims, attention_kernel_of, hookimpl,
    merge_kernel, prefix_attention_flops,
)
from g5plugins.cp import prefill_mode


def passkv_bytes_per_rank_per_layer(seq_len: int, cp: int, kv_bytes_per_token: float, batch: int = 1) -> float:
    """``M_passkv = (cp - 1) * (S / cp) * c_kv`` per sequence (times the batch); with a cached
    prefix ``S`` is every token whose KV rotates, ``P + T``."""
    return (cp - 1) * block_bytes(seq_len, cp, kv_bytes_per_token, batch)


def block_bytes(seq_len: int, cp: int, kv_bytes_per_token: float, batch: int = 1) -> float:
    """One KV block: ``b * (S / cp) * c_kv``."""
    return batch * seq_len * kv_bytes_per_token / cp


def step_block_bytes(ctx) -> float:
    """One KV block of the step: every prefill group's ``count * (P + T) / cp`` tokens' KV."""
    cp = ctx.size("cp")
    return sum(block_bytes(g.cached_tokens + g.new_tokens, cp, ctx.kv_bytes_per_token_local, g.count)
               for g in ctx.shape.groups)


def group_ring_step(ctx, g) -> tuple[float, float, Attention, Attention]:
    """(FLOPs, HBM bytes, step-0 kernel, later-step kernel) of one ring step of one group on
    one rank, under the balanced (zig-zag) split of the new tokens and of the cached prefix:
    each rank holds ``T/cp`` new queries and ``(P+T)/cp`` keys. Every step does
    ``F(P, T) / cp^2`` FLOPs (``F``: causal attention of ``T`` queries after ``P`` cached
    keys). Step 0 is the rank's own queries over its own keys, causal on the new tokens
    (``T/cp`` of ``(P+T)/cp`` keys); every later step an unmasked rectangle of ``T/cp``
    queries against the keys that do the same FLOPs, ``(T/2 + P)/cp``: half a block of new
    tokens, as without a prefix, and the visiting prefix whole."""
    dep, s = ctx.deployment, ctx.shape
    cp = ctx.size("cp")
    d_qk, d_v = attention_dims(ctx.model, "prefill")
    t, p = g.new_tokens, g.cached_tokens
    f_attn = prefix_attention_flops(g.count, t, p, s.q_heads, d_qk, d_v)
    q_block, kv_block = t / cp, (p + t) / cp
    hbm = attention_block_bytes(g.count, q_block, kv_block, s.q_heads, d_qk, d_v, ctx.kv_bytes_per_token_local,
                                dep.dtypes.activation_element_bytes)
    off_keys = q_block / 2 if p == 0 else (t / 2 + p) / cp
    diagonal = attention_kernel_of(ctx.model, dep, s, g.count, q_block, kv_block, "causal", "prefill")
    off = attention_kernel_of(ctx.model, dep, s, g.count, q_block, off_keys, "full", "prefill")
    return f_attn / (cp * cp), hbm, diagonal, off


def ring_merge_kernels(ctx) -> tuple:
    """The last ring step's side kernels: per prefill group, the merge of the cp partial
    outputs by their log-sum-exp, ``T/cp`` queries per sequence and head (the partials are
    kept and merged once after the ring)."""
    dep, s = ctx.deployment, ctx.shape
    _, d_v = attention_dims(ctx.model, "prefill")
    cp = ctx.size("cp")
    return tuple(merge_kernel(g.count * g.new_tokens / cp * s.q_heads, d_v, cp, dep) for g in s.groups)


def ring_parts(ctx) -> tuple[list[Work], float]:
    """The work of ring step 0, of every middle step and of the last step (every prefill
    group's kernels; the last step also merges the cp partial outputs,
    :func:`ring_merge_kernels`), and the bytes of one KV block: made once per logical op, so
    that its ops share them (one spec each in the op DAG)."""
    parts = [group_ring_step(ctx, g) for g in ctx.shape.groups]
    flops = sum(p[0] for p in parts)
    hbm = sum(p[1] for p in parts)
    work = [Work(op_class="attention", flops=flops, hbm_bytes=hbm, weight_class="", weight_elements=0.0,
                 kernels=tuple(p[k] for p in parts) + extra)
            for k, extra in ((2, ()), (3, ()), (3, ring_merge_kernels(ctx)))]
    return work, step_block_bytes(ctx)


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
    ops, edges, heads, tails = ring_fragment_parts(ctx, lop, ring, work, nbytes, "cp_passkv", "cp_passkv")
    return Fragment(ops=ops, edges=edges, heads=heads, tails=tails)


def ring_fragment_parts(ctx, lop, ring, work: list[Work], nbytes: float, owner: str, reason: str):
    """:func:`ring_fragment`'s ops, edges, heads and tails; its sends carry ``nbytes`` each
    (one KV block, or for pass-Q prefill one query block) for ``reason``."""
    cp = len(ring)
    ops, edges, heads, tails = [], [], {}, {}
    compute = [[None] * cp for _ in ring]
    p2p = [[None] * (cp - 1) for _ in ring]
    for r, chip in enumerate(ring):
        for i in range(cp):
            compute[r][i] = ctx.compute_op(lop, chip, work[_step_work(i, cp, len(work))], owner=owner,
                                           part=f"step{i:02d}")
            ops.append(compute[r][i])
        for i in range(cp - 1):
            p2p[r][i] = ctx.comm_op(lop, "p2p", (chip, ring[(r + 1) % cp]), nbytes, reason, owner=owner,
                                    part=f"p2p{i:02d}")
            ops.append(p2p[r][i])
        heads[chip] = (compute[r][0].key, p2p[r][0].key)
        tails[chip] = tuple(c.key for c in compute[r])
    edges += Fragment.ring_edges(p2p, compute)
    return ops, edges, heads, tails


@hookimpl
def g5_expand_op(ctx, lop):
    cp = ctx.size("cp")
    if lop.kind != "attention" or ctx.phase != "prefill" or cp == 1 or prefill_mode(ctx)[0] != "pass_kv":
        return None
    rings = placed_rings(ctx, lop)
    if not rings:
        return Fragment(ops=())
    # one ring on slot chips 0 .. cp-1 (slot r = cp rank r), tiled over every ring
    return Fragment.tiled(ring_fragment(ctx, lop, tuple(range(cp)), *ring_parts(ctx)), rings)


@hookimpl
def g5_memory_terms(ctx):
    cp = ctx.size("cp")
    if cp == 1 or ctx.phase != "prefill" or prefill_mode(ctx)[0] != "pass_kv":
        return None
    # The contract lets the ring run ahead of compute (a P2P never waits for a step), so all
    # cp - 1 received blocks of a layer may be resident at once: M_passkv bytes per chip,
    # reused layer after layer. The rank's own block is already in its KV cache.
    per_chip = (cp - 1) * step_block_bytes(ctx)
    return [MemoryTerm(name="cp_ring_buffers", category="workspace",
                       bytes_per_chip={c: per_chip for c in ctx.all_chips})]
