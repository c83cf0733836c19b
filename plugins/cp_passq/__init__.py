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
"""
from __future__ import annotations

import attrs

from g5core import Fragment, hookimpl
from g5core.build.flops import activation_tensor_bytes
from g5core.build.layers import Work, attention_kernel, attention_side_kernels, attention_work, merge_kernel
from g5core.sim.reference import passq_reduce_elements


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


@hookimpl
def g5_expand_op(ctx, lop):
    cp = ctx.size("cp")
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
    # the side kernels of a decode attention (layers.attention_side_kernels): every partial's
    # split-KV combine over its shard; on the root also the merge of the cp partials
    # (layers.merge_kernel). The merge follows the reduce; it is counted in the root's
    # partial, which the reduce waits for: the same critical path, and the spec's DAG unchanged
    work = attrs.evolve(work, kernels=work.kernels + attention_side_kernels(ctx.model, dep, s))
    merge = merge_kernel(dep.batch * s.q_heads, partial_value_dim(ctx.model), cp, dep)
    root_work = attrs.evolve(work, kernels=work.kernels + (merge,))
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
            partial = ctx.compute_op(lop, chip, root_work if chip == root else work, owner="cp_passq",
                                     part="partial")
            ops.append(partial)
            if chip == root:
                heads[chip] = (dispatch.key, partial.key)
            else:
                edges.append((dispatch.key, partial.key))
            edges.append((partial.key, reduce.key))
        tails[root] = (reduce.key,)
    return Fragment(ops=ops, edges=edges, heads=heads, tails=tails)
