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
  :mod:`g5core.testing.reference`). The spec's ``d + 2 n_h`` is the GQA case where
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

**The ring form** (``plugins: {cp_passq: {form: ring}}``; ``gather``, the spec's form above,
is the default): the decode algorithm of the Meta paper (Yang et al., "Context Parallelism
for Scalable Million-Token Inference", pass-Q decode). The batch's queries are owned round
robin, ``q = ceil(b / cp)`` per rank (the batch padded to ``cp q``: batch 1 pads to cp, as the
paper does); they go around the ring in ``cp - 1`` send/receive steps (``q * d * s_dtype``
bytes each, ``cp_passq_ring``), each rank computing one partial attention per step, over its
local KV shard, for the queries it holds; then an all-to-all returns every partial output and
its log-sum-exp to the queries' owner (``cp q (n_h d_v + 2 n_h) s_dtype`` bytes per rank,
nccl-tests' send-buffer convention; ``cp_passq_a2a``), and each rank merges its ``cp``
partials (one ``attn_merge`` kernel). G5 keeps the rest of the layer on the root as in the
gather form: the non-root ranks' query slices are taken as present when the layer starts.
Dependencies as pass-KV's ring: step ``i`` on rank ``r`` and its forward wait for the send
of step ``i - 1`` from rank ``r - 1``; the all-to-all waits for every partial, each merge
for the all-to-all.

**The ring form of pass-Q prefill** (the same ``form: ring``, with ``plugins.cp.prefill``
``pass_q`` or an ``auto`` that picks it): the Meta paper's pass-Q partial prefill in its
order. The query blocks go around the ring as above (same messages, same per-step work), but
no ring step merges: the return all-to-all brings each rank the ``cp`` partials of its own
``T/cp`` queries and their log-sum-exp, and one merge per rank follows it
(:func:`g5plugins.cp.passkv.ring_merge_kernels`). The default (``gather``) keeps the merge in
the last ring step, as before. The balanced split already gives every rank the same ``T/cp``
queries per sequence (``T`` divides by ``2 cp``), so the prefill form pads nothing.

**Memory** (``cp_passq_buffers``, workspace, every chip of a CP group; ring decode and both
pass-Q prefills): the sends never wait for compute, so a rank may hold all ``cp - 1`` query
blocks it receives in a layer, plus the all-to-all's send and receive buffers of partial
outputs and statistics: :func:`ring_buffer_bytes`, reused layer after layer. The gather form
of decode declares none (its dispatch and reduce buffers are not in the ledger).
"""
from __future__ import annotations

import math

import attrs

from g5core import (
    Fragment, MemoryTerm, PluginOption, Work, activation_tensor_bytes, attention_dims, attention_side_kernels,
    decode_attention_kernel, decode_query_rows, hookimpl, merge_kernel, passq_reduce_elements,
)
from g5plugins.cp import prefill_mode
from g5plugins.cp.passkv import placed_rings, ring_fragment_parts, ring_merge_kernels, ring_parts


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


def prefill_ring_fragment(ctx, lop, ring, form: str = "gather") -> Fragment:
    """Pass-Q prefill on one ring: the ring of pass-KV with query blocks as its messages,
    then the return all-to-all, which waits for every rank's steps (the fragment's tails).
    ``form`` ``ring``: no step merges; one merge per rank follows the all-to-all."""
    work, _ = ring_parts(ctx)
    if form == "ring":
        work = work[:2]                  # step 0 and the later steps; the merge follows the return
    ops, edges, heads, tails = ring_fragment_parts(ctx, lop, ring, work, query_block_bytes(ctx), "cp_passq",
                                                   "cp_passq_prefill")
    back = ctx.comm_op(lop, "all_to_all", ring, return_buffer_bytes(ctx), "cp_passq_prefill_return",
                       owner="cp_passq", part="return")
    ops.append(back)
    for chip in ring:
        edges.extend((key, back.key) for key in tails[chip])
    if form != "ring":
        return Fragment(ops=ops, edges=edges, heads=heads, tails={chip: (back.key,) for chip in ring})
    merge = merge_work(ring_merge_kernels(ctx))
    tails = {}
    for chip in ring:
        merged = ctx.compute_op(lop, chip, merge, owner="cp_passq", part="merge")
        ops.append(merged)
        edges.append((back.key, merged.key))
        tails[chip] = (merged.key,)
    return Fragment(ops=ops, edges=edges, heads=heads, tails=tails)


def merge_work(kernels: tuple) -> Work:
    """The work of one rank's merge of its cp partials (the merge kernels, nothing else)."""
    return Work(op_class="elementwise", flops=sum(k.flops for k in kernels),
                hbm_bytes=sum(k.hbm_bytes for k in kernels), weight_class="", weight_elements=0.0, kernels=kernels)


def ring_buffer_bytes(query_block_bytes: float, cp: int, partial_buffer_bytes: float) -> float:
    """One rank's pass-Q ring buffers: the ``cp - 1`` query blocks it may hold at once (the ring
    runs ahead of compute) and the all-to-all's send and receive buffers of partial outputs and
    log-sum-exp, ``(cp - 1) * query_block + 2 * partial_buffer`` bytes."""
    return (cp - 1) * query_block_bytes + 2.0 * partial_buffer_bytes


FORMS = ("gather", "ring")


@hookimpl
def g5_register_options(register):
    register(PluginOption(name="form", default="gather",
                          doc="pass-Q decode: gather (the spec's dispatch, partials, reduce) or ring (queries around "
                              "the ring, all-to-all of partials, merge); pass-Q prefill: ring merges after the return "
                              "all-to-all, gather in the last ring step", kind="choice", choices=FORMS))


def queries_per_rank(batch: int, cp: int) -> int:
    """The ring form's queries per rank: the batch padded to a multiple of cp, split evenly."""
    return math.ceil(batch / cp)


def ring_step_bytes(queries: int, hidden: float, act_bytes: int) -> float:
    """One ring step's message: ``q * d * s_dtype`` (the queries a rank holds)."""
    return activation_tensor_bytes(queries, hidden, act_bytes)


def ring_a2a_bytes_per_rank(queries: int, cp: int, n_heads: float, d_v: float, act_bytes: int) -> float:
    """The ring form's all-to-all send buffer: ``cp * q * (n_h d_v + 2 n_h) * s_dtype``."""
    return cp * activation_tensor_bytes(queries, passq_reduce_elements(n_heads, d_v), act_bytes)


def ring_decode_bytes(ctx) -> tuple[int, float, float]:
    """The ring form of decode: (queries per rank, one ring step's bytes, the all-to-all's send
    buffer per rank)."""
    dep, s, cp = ctx.deployment, ctx.shape, ctx.size("cp")
    act = dep.dtypes.activation_element_bytes
    q = queries_per_rank(dep.batch, cp)
    rows = q * decode_query_rows(s) / s.batch   # k + 1 query rows per sequence in a verification step
    step_bytes = ring_step_bytes(rows, ctx.model.hidden_size / s.factor("q_heads"), act)
    return q, step_bytes, ring_a2a_bytes_per_rank(rows, cp, s.q_heads, partial_value_dim(ctx.model), act)


def _form(ctx) -> str:
    return ctx.deployment.option("cp_passq", "form", "gather")


def _passq_prefill(ctx) -> bool:
    return ctx.phase == "prefill" and ctx.size("cp") > 1 and prefill_mode(ctx)[0] == "pass_q"


@hookimpl
def g5_memory_terms(ctx):
    cp = ctx.size("cp")
    if _passq_prefill(ctx):
        per_chip = ring_buffer_bytes(query_block_bytes(ctx), cp, return_buffer_bytes(ctx))
    elif ctx.phase == "decode" and cp > 1 and _form(ctx) == "ring":
        _, step_bytes, a2a_bytes = ring_decode_bytes(ctx)
        per_chip = ring_buffer_bytes(step_bytes, cp, a2a_bytes)
    else:
        return None
    return [MemoryTerm(name="cp_passq_buffers", category="workspace",
                       bytes_per_chip={c: per_chip for c in ctx.all_chips})]


@hookimpl
def g5_expand_op(ctx, lop):
    cp = ctx.size("cp")
    if lop.kind == "attention" and _passq_prefill(ctx):
        rings = placed_rings(ctx, lop)
        if not rings:
            return Fragment(ops=())
        return Fragment.tiled(prefill_ring_fragment(ctx, lop, tuple(range(cp)), _form(ctx)), rings)
    if lop.kind != "attention" or ctx.phase != "decode" or cp == 1:
        return None
    if _form(ctx) == "ring":
        return ring_form(ctx, lop, cp)
    dep, s = ctx.deployment, ctx.shape
    act = dep.dtypes.activation_element_bytes
    hidden_local = ctx.model.hidden_size / s.factor("q_heads")
    # a speculative verification step sends k + 1 queries per sequence (decode_query_rows)
    rows = decode_query_rows(s)
    q_bytes = dispatch_bytes_per_rank(rows, hidden_local, act)
    r_bytes = reduce_bytes_per_rank(rows, s.q_heads, partial_value_dim(ctx.model), act)
    kernel = decode_attention_kernel(ctx.model, dep, s, s.batch, s.kv_len)
    work = Work(op_class="attention", flops=kernel.flops, hbm_bytes=kernel.hbm_bytes, weight_class="",
                weight_elements=0.0, kernels=(kernel,))
    # the side kernels of a decode attention (layers.attention_side_kernels): every partial's
    # split-KV combine over its shard; on the root also the merge of the cp partials
    # (layers.merge_kernel). The merge follows the reduce; it is counted in the root's
    # partial, which the reduce waits for: the same critical path, and the spec's DAG unchanged
    work = attrs.evolve(work, kernels=work.kernels + attention_side_kernels(ctx.model, dep, s))
    merge = merge_kernel(rows * s.q_heads, partial_value_dim(ctx.model), cp, dep)
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


def ring_form(ctx, lop, cp: int) -> Fragment:
    """The ring form's ops for every CP group (module docstring)."""
    dep, s = ctx.deployment, ctx.shape
    q, step_bytes, a2a_bytes = ring_decode_bytes(ctx)
    kernel = decode_attention_kernel(ctx.model, dep, s, q, s.kv_len)
    flops, hbm = kernel.flops, kernel.hbm_bytes
    side = tuple(attrs.evolve(k, tokens=k.tokens * q / s.batch) for k in attention_side_kernels(ctx.model, dep, s))
    step = Work(op_class="attention", flops=flops, hbm_bytes=hbm, weight_class="", weight_elements=0.0,
                kernels=(kernel,) + side)
    merged_work = merge_work((merge_kernel(q * decode_query_rows(s) / s.batch * s.q_heads, partial_value_dim(ctx.model),
                                           cp, dep),))
    placed = set(ctx.place(lop))
    ops, edges, heads, tails = [], [], {}, {}
    for group in ctx.rankmap.groups("cp"):
        if not placed.issuperset(group):
            continue
        a2a = ctx.comm_op(lop, "all_to_all", group, a2a_bytes, "cp_passq_a2a", owner="cp_passq", part="a2a")
        ops.append(a2a)
        compute = [[None] * cp for _ in group]
        sends = [[None] * (cp - 1) for _ in group]
        for r, chip in enumerate(group):
            for i in range(cp):
                compute[r][i] = ctx.compute_op(lop, chip, step, owner="cp_passq", part=f"step{i:02d}")
                ops.append(compute[r][i])
                edges.append((compute[r][i].key, a2a.key))
            for i in range(cp - 1):
                sends[r][i] = ctx.comm_op(lop, "p2p", (chip, group[(r + 1) % cp]), step_bytes, "cp_passq_ring",
                                          owner="cp_passq", part=f"p2p{i:02d}")
                ops.append(sends[r][i])
            merged = ctx.compute_op(lop, chip, merged_work, owner="cp_passq", part="merge")
            ops.append(merged)
            edges.append((a2a.key, merged.key))
            heads[chip] = (compute[r][0].key,) + ((sends[r][0].key,) if cp > 1 else ())
            tails[chip] = (merged.key,)
        edges += Fragment.ring_edges(sends, compute)
    return Fragment(ops=ops, edges=edges, heads=heads, tails=tails)
