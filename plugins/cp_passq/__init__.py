"""Pass-Q for context-parallel decode (spec v1.1.1).

Per layer and CP group (root = cp rank 0, which holds the batch's new tokens):

- ``cp_passq_dispatch``: the root sends the queries, ``b * d * s_dtype`` bytes, to every
  other rank (``d`` is the hidden size on one TP rank, ``hidden / tp``);
- ``cp`` partial attentions, one per rank over its ``S/cp`` KV shard; the root's needs
  its own Q/K/V, the others' need the dispatch;
- ``cp_passq_reduce``: every other rank sends ``b * (n_h * d_v + 2 n_h) * s_dtype`` bytes
  (its partial output per head plus the per-head running max and denominator of the online
  softmax) to the root; the reduction depends on every partial. ``d_v`` is the value head
  dim for GQA and ``v_head_dim`` for MLA: a rank up-projects its latent partial with the
  per-head ``W_UV`` before sending (linear, so it commutes with the merge; checked by
  :mod:`g5core.sim.reference`). The spec's ``d + 2 n_h`` is the GQA case where
  ``n_h * d_v = d``; for MLA it undercounts (DeepSeek-V3: ``128 * 128 = 16384`` against
  ``d = 7168``).

Neither message depends on ``S``.

Pass-Q prefill (``plugins: {cp: {prefill: pass_q}}``, or ``auto`` where the rule of
arXiv:2411.01783 picks it: a prefill after a long cached prefix), per layer and CP ring:
the KV of the cached and new tokens stays where it is (sharded like the new tokens, in
balanced chunks); each rank's ``T/cp`` new queries rotate around the ring instead, in
``cp - 1`` P2P sends of ``count * (T/cp) * n_h * d_qk * s_dtype`` bytes
(``cp_passq_prefill``), with the ring-step compute of pass-KV (the same ``F(P, T)/cp^2``
per step); then an all-to-all (``cp_passq_prefill_return``) returns every partial output
with its online-softmax statistics to the rank that owns the queries, a buffer of
``count * T * (n_h * d_v + 2 n_h) * s_dtype`` per rank of which ``(cp-1)/cp`` crosses the
links. Bytes per rank and layer: :func:`passq_prefill_bytes_per_rank_per_layer`.
"""
from __future__ import annotations

from g5core import (
    Fragment, Work, activation_tensor_bytes, attention_dims, attention_kernel, attention_work, hookimpl,
    passq_reduce_elements,
)
from g5plugins.cp import prefill_mode
from g5plugins.cp_passkv import placed_rings, ring_fragment_parts, ring_parts


def dispatch_bytes_per_rank(batch: int, hidden: float, act_bytes: int) -> float:
    """``b * d * s_dtype``."""
    return activation_tensor_bytes(batch, hidden, act_bytes)


def reduce_bytes_per_rank(batch: int, n_heads: float, d_v: float, act_bytes: int) -> float:
    """``b * (n_h * d_v + 2 n_h) * s_dtype``."""
    return activation_tensor_bytes(batch, passq_reduce_elements(n_heads, d_v), act_bytes)


def partial_value_dim(model) -> int:
    """Value width per head a pass-Q partial carries: head_dim (GQA), v_head_dim (MLA)."""
    a = model.attention
    return a.v_head_dim if a.kind == "mla" else a.head_dim


def query_block_bytes(ctx) -> float:
    """One rank's new queries of the step, ``sum(count * T/cp) * n_h * d_qk * s_dtype``."""
    s, cp = ctx.shape, ctx.size("cp")
    d_qk = attention_dims(ctx.model, "prefill")[0]
    return sum(activation_tensor_bytes(g.count * g.new_tokens / cp, s.q_heads * d_qk,
                                       ctx.deployment.dtypes.activation_element_bytes) for g in s.groups)


def return_buffer_bytes(ctx) -> float:
    """The all-to-all buffer of partial outputs and statistics per rank: every rank's
    queries' partials over this rank's KV, ``sum(count * T) * (n_h * d_v + 2 n_h) * s_dtype``."""
    s = ctx.shape
    d_v = attention_dims(ctx.model, "prefill")[1]
    return sum(reduce_bytes_per_rank(g.count * g.new_tokens, s.q_heads, d_v,
                                     ctx.deployment.dtypes.activation_element_bytes) for g in s.groups)


def passq_prefill_bytes_per_rank_per_layer(ctx) -> float:
    """Bytes one rank sends per layer in pass-Q prefill: ``(cp - 1) / cp * T * (n_h d_qk +
    n_h d_v + 2 n_h) * s_dtype`` per sequence (the query sends and the share of the return
    all-to-all bound for the other ranks)."""
    cp = ctx.size("cp")
    return (cp - 1) * query_block_bytes(ctx) + (cp - 1) / cp * return_buffer_bytes(ctx)


def prefill_ring_fragment(ctx, lop, ring) -> Fragment:
    """Pass-Q prefill on one ring: the ring of pass-KV with query blocks as its messages,
    then the return all-to-all, which waits for every rank's steps (the fragment's tails)."""
    work, _ = ring_parts(ctx)
    ops, edges, heads, tails = ring_fragment_parts(ctx, lop, ring, work, query_block_bytes(ctx), "cp_passq",
                                                   "cp_passq_prefill")
    back = ctx.comm_op(lop, "all_to_all", ring, return_buffer_bytes(ctx), "cp_passq_prefill_return",
                       owner="cp_passq", part="return")
    for chip in ring:
        edges.extend((key, back.key) for key in tails[chip])
    return Fragment(ops=ops + [back], edges=edges, heads=heads, tails={chip: (back.key,) for chip in ring})


@hookimpl
def g5_expand_op(ctx, lop):
    cp = ctx.size("cp")
    if lop.kind == "attention" and ctx.phase == "prefill" and cp > 1 and prefill_mode(ctx)[0] == "pass_q":
        rings = placed_rings(ctx, lop)
        if not rings:
            return Fragment(ops=())
        return Fragment.tiled(prefill_ring_fragment(ctx, lop, tuple(range(cp))), rings)
    if lop.kind != "attention" or ctx.phase != "decode" or cp == 1:
        return None
    dep, s = ctx.deployment, ctx.shape
    act = dep.dtypes.activation_element_bytes
    hidden_local = ctx.model.hidden_size / s.factor("q_heads")
    q_bytes = dispatch_bytes_per_rank(dep.batch, hidden_local, act)
    r_bytes = reduce_bytes_per_rank(dep.batch, s.q_heads, partial_value_dim(ctx.model), act)
    flops, hbm = attention_work(ctx.model, dep, s, 1, s.kv_len)
    work = Work(op_class="attention", flops=flops, hbm_bytes=hbm, weight_class="", weight_elements=0.0,
                kernels=(attention_kernel(ctx.model, dep, s, 1, s.kv_len, "decode"),))
    placed = set(ctx.place(lop))
    ops, edges, heads, tails = [], [], {}, {}
    for group in ctx.rankmap.groups("cp"):
        if not placed.issuperset(group):
            continue
        root = group[0]
        dispatch = ctx.comm_op(lop, "broadcast", group, q_bytes, "cp_passq_dispatch", owner="cp_passq", part="dispatch")
        reduce = ctx.comm_op(lop, "gather", group, r_bytes, "cp_passq_reduce", owner="cp_passq", part="reduce")
        ops += [dispatch, reduce]
        for chip in group:
            partial = ctx.compute_op(lop, chip, work, owner="cp_passq", part="partial")
            ops.append(partial)
            if chip == root:
                heads[chip] = (dispatch.key, partial.key)
            else:
                edges.append((dispatch.key, partial.key))
            edges.append((partial.key, reduce.key))
        tails[root] = (reduce.key,)
    return Fragment(ops=ops, edges=edges, heads=heads, tails=tails)
