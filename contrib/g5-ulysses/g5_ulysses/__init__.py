"""Ulysses (all-to-all) sequence parallelism for G5: the ``sp`` dimension.

Layout: ``sp`` is a factor of the chip count (``dp x pp x cp x sp x tp = chips``), placed
between cp and tp in the rank order, so an SP group is the ``sp`` chips sharing one
(dp, pp, cp, tp) coordinate, next to each other when ``tp * sp`` fits in a node.

Outside attention every chip runs on ``1/sp`` of the tokens: ``S/sp`` of each sequence in
prefill, the new tokens of ``b/sp`` sequences in decode. Projections keep their TP shards
(weights are replicated across the SP group). Per layer and SP group:

- ``ulysses_a2a`` (``a2a_qkv``): an all-to-all turns "my tokens, the TP rank's heads" into
  "every token, ``1/sp`` of those heads" for Q, K and V;
- attention on every chip over the full sequence for ``heads / (tp*sp)`` query heads;
- ``ulysses_a2a`` (``a2a_out``): the reverse all-to-all of the attention output.

Bytes per rank (the buffer the ``all_to_all`` primitive splits into ``sp`` equal parts, of
which ``(sp-1)/sp`` leave the chip), with ``t`` the chip's tokens, ``a`` the activation
bytes, ``n_h = heads/tp``:

- Q: ``t * n_h * d_qk * a``; output: ``t * n_h * d_v * a`` (MLA: ``v_head_dim``, the head
  owner up-projects with ``W_UV`` before sending);
- K and V: each destination gets the KV heads it holds, ``t * 2 * d_head * kv_dest * a``
  per destination (``kv_dest = kv_tp / sp`` when the TP rank's ``kv_tp`` KV heads split,
  1 when they are replicated); the MLA latent goes whole to every destination.
  MHA (``kv = heads``) gives the textbook ``4 N h / P`` per layer.

Constraints (ConfigError naming the fix): heads divisible by ``tp*sp``; GQA KV heads per TP
rank either divisible by ``sp`` or replicated (``plugins.ulysses.replicate_kv: true``, KV
memory multiplied by the replication, shown in the ledger); MLA's single latent cannot be
head-sharded (refused, or replicated with ``replicate_kv``); ``sp > 1`` with ``cp > 1`` is
refused (2D sequence parallelism is not modelled); prefill needs ``S`` divisible by ``sp``,
decode ``b`` divisible by ``sp``.

The LM head: in prefill it runs on the last SP rank (which holds every sequence's last
token); in decode every chip keeps the core's default (logits of all ``b`` tokens), an
overcount of the logits GEMM by ``sp`` that costs little because a decode LM head is bound
by its weight read, which is the same either way. The all-to-all before attention is on
the critical path (no double buffering of sequence chunks is modelled).

Memory: the KV cache is stored head-sharded (divided by the KV-head split above, the
``kv_cache_heads`` axis); activations outside attention divide by ``sp`` (``tokens``);
``ulysses_a2a_buffers`` is the receive workspace of one layer's two all-to-alls.
"""
from __future__ import annotations

import attrs

from g5core import (
    ConfigError, Dimension, Fragment, MemoryTerm, PluginOption, Work, activation_tensor_bytes, attention_dims,
    attention_kernel, attention_work, hookimpl, step_attention_work, weight_bytes_per_chip, window_attention_work,
)

NAME = "ulysses"
DIM = "sp"
HEAD_AXIS = "attn_q_heads"
REASON = "ulysses_a2a"
HEAD_KINDS = ("final_norm", "lm_head", "logits_gather")
ATTENTION_WEIGHT_KINDS = ("attn_norm", "qkv_proj", "o_proj")


# ------------------------------------------------------------------------------- formulas


def kv_heads_per_tp_rank(model, tp: int) -> int:
    """GQA KV heads one TP rank holds (TP splits them, or keeps one when it has fewer)."""
    a = model.attention
    return a.n_kv_heads // min(tp, a.n_kv_heads)


def kv_split(model, tp: int, sp: int) -> tuple[int, int]:
    """``(divisor, replicas)``: how ``sp`` divides the KV cache a TP rank holds, and how many
    copies of each stored KV head (or of the MLA latent) the SP group keeps.

    GQA with ``kv_tp`` KV heads per TP rank: ``(sp, 1)`` when ``sp`` divides them, else
    ``(kv_tp, sp / kv_tp)`` (each chip holds one head, replicated). MLA: ``(1, sp)``."""
    if model.attention.kind == "mla":
        return 1, sp
    kv_tp = kv_heads_per_tp_rank(model, tp)
    if kv_tp % sp == 0:
        return sp, 1
    return kv_tp, sp // kv_tp


def a2a_widths(model, phase: str, tp: int, sp: int) -> tuple[float, float, float]:
    """Elements per local token the all-to-alls carry: (Q, K+V, output)."""
    a = model.attention
    d_qk, _ = attention_dims(model, phase)
    heads_tp = a.n_heads / tp
    if a.kind == "mla":
        kv = float((a.kv_lora_rank + a.qk_rope_head_dim) * sp)     # the whole latent to every destination
        d_out = a.v_head_dim
    else:
        divisor, _ = kv_split(model, tp, sp)
        kv_dest = kv_heads_per_tp_rank(model, tp) // divisor       # KV heads each destination holds
        kv = float(2 * a.head_dim * kv_dest * sp)
        d_out = a.head_dim
    return heads_tp * d_qk, kv, heads_tp * d_out


def a2a_bytes_per_rank(model, phase: str, tp: int, sp: int, tokens: float, act_bytes: int) -> tuple[float, float]:
    """(Q+K+V all-to-all, output all-to-all) buffer bytes per rank per layer."""
    q, kv, out = a2a_widths(model, phase, tp, sp)
    return activation_tensor_bytes(tokens, q + kv, act_bytes), activation_tensor_bytes(tokens, out, act_bytes)


# ----------------------------------------------------------------------------- the hooks


@hookimpl
def g5_register_dimensions(register):
    register(Dimension(name=DIM, factor=True, rank_order=25, default=1,
                       doc="Ulysses sequence parallelism: tokens split outside attention, heads inside"))


@hookimpl
def g5_register_options(register):
    register(PluginOption(name="replicate_kv", default=False,
                          doc="accept replicated KV heads (GQA with fewer KV heads than tp x sp) or a replicated MLA "
                          "latent; the KV memory is multiplied accordingly"))


@hookimpl
def g5_register_shard_axes(register):
    register(HEAD_AXIS, "query heads a chip computes inside attention, a further divisor of q_heads "
                        "(Ulysses head shards; projections keep q_heads)")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@hookimpl
def g5_validate_deployment(deployment, model, system):
    sp = deployment.size(DIM)
    if sp == 1:
        return
    tp, cp = deployment.size("tp"), deployment.size("cp")
    a = model.attention
    if cp > 1:
        raise ConfigError("parallel.sp", f"sp={sp} with cp={cp}: Ulysses inside context-parallel rings (2D sequence "
                                         "parallelism, USP/LoongTrain) is not modelled; use sp or cp, not both")
    if a.n_heads % (tp * sp):
        raise ConfigError("parallel.sp", f"{model.name} has {a.n_heads} attention heads, not divisible by "
                                         f"tp x sp = {tp * sp}; use fewer sp (sp among {_divisors(a.n_heads // tp)} "
                                         f"at tp={tp}), more tp, or cp instead")
    replicate = deployment.option(NAME, "replicate_kv")
    if a.kind == "mla" and not replicate:
        raise ConfigError("parallel.sp", f"{model.name} uses MLA: its single KV latent cannot be head-sharded by "
                                         f"sp={sp}; set plugins.ulysses.replicate_kv: true to keep the whole latent "
                                         f"on every chip (KV memory not divided by sp), or use cp instead")
    if a.kind == "gqa":
        kv_tp = kv_heads_per_tp_rank(model, tp)
        if kv_tp % sp and sp % kv_tp:
            raise ConfigError("parallel.sp", f"sp={sp} can neither split nor evenly replicate the {kv_tp} KV heads "
                                             f"of a TP rank (tp={tp}); use sp among {_divisors(kv_tp)}, more tp, "
                                             f"or cp instead")
        if kv_tp % sp and not replicate:
            raise ConfigError("parallel.sp", f"{model.name} has {a.n_kv_heads} KV heads, {kv_tp} per TP rank at "
                                             f"tp={tp}, fewer than sp={sp}: each would be replicated "
                                             f"{sp // kv_tp} times (KV memory x{sp // kv_tp}); use fewer sp "
                                             f"(sp <= {kv_tp}), more tp, or cp instead, or set "
                                             f"plugins.ulysses.replicate_kv: true to accept the replication")
    if not deployment.uniform:
        # a step of several groups: every token of the step is split over the SP group
        if deployment.step.new_tokens % sp:
            raise ConfigError("step", f"the step's {deployment.step.new_tokens} new tokens are not divisible by "
                                      f"sp={sp} (each chip holds 1/sp of them outside attention); use counts and "
                                      f"new_tokens whose total is a multiple of {sp}")
        return
    if deployment.phase == "prefill" and deployment.seq_len % sp:
        raise ConfigError("seq_len", f"seq_len={deployment.seq_len} is not divisible by sp={sp} (each chip holds "
                                     f"S/sp tokens outside attention); use a multiple of {sp}")
    if deployment.phase == "decode" and deployment.batch % sp:
        raise ConfigError("batch", f"decode with sp={sp} splits the batch's new tokens over the SP group, and "
                                   f"batch={deployment.batch} is not divisible by {sp}; use a multiple of {sp} "
                                   f"or fewer sp")


@hookimpl
def g5_shard_factors(deployment, model):
    sp = deployment.size(DIM)
    if sp == 1:
        return None
    divisor, _ = kv_split(model, deployment.size("tp"), sp)
    return {"tokens": sp, HEAD_AXIS: sp, "kv_cache_heads": divisor}


def _attention_shape(ctx):
    """The local shape as attention sees it: full sequence, ``1/sp`` of the TP rank's query
    heads, the KV heads the chip stores."""
    s = ctx.shape
    divisor = s.factor("kv_cache_heads")
    return attrs.evolve(s, q_heads=s.q_heads / s.factor(HEAD_AXIS), kv_heads=s.kv_heads / divisor,
                        kv_shard=s.kv_shard * divisor)


def attention_op_work(ctx, layer: int | None = None) -> Work:
    """One chip's attention for its heads over the whole sequence; a windowed layer (sliding
    or chunked, ``layer``'s) attends over its window, as the core's attention does."""
    dep, s = ctx.deployment, ctx.shape
    if not s.uniform:
        # each chip runs whole sequences on 1/sp of the heads: every group's queries whole
        groups = tuple(attrs.evolve(g, q_tokens=1.0 if g.decode else float(g.new_tokens)) for g in s.groups)
        return step_attention_work(ctx.model, dep, _attention_shape(ctx), groups)
    q_tokens = 1 if dep.phase == "decode" else s.seq_len
    shape = _attention_shape(ctx)
    windowed = window_attention_work(ctx.model, dep, shape, layer, q_tokens=q_tokens)
    if windowed is not None:
        return windowed
    flops, hbm = attention_work(ctx.model, dep, shape, q_tokens, s.kv_len)
    block = "decode" if dep.phase == "decode" else "causal"
    return Work(op_class="attention", flops=flops, hbm_bytes=hbm, weight_class="", weight_elements=0.0,
                kernels=(attention_kernel(ctx.model, dep, shape, q_tokens, s.kv_len, block),))


def _bytes(ctx) -> tuple[float, float]:
    dep = ctx.deployment
    return a2a_bytes_per_rank(ctx.model, dep.phase, dep.size("tp"), dep.size(DIM), ctx.shape.tokens,
                              dep.dtypes.activation_element_bytes)


@hookimpl
def g5_expand_op(ctx, lop):
    if lop.kind != "attention" or ctx.size(DIM) == 1:
        return None
    qkv_bytes, out_bytes = _bytes(ctx)
    work = attention_op_work(ctx, lop.layer)
    placed = set(ctx.place(lop))
    return Fragment.combine(
        Fragment.exchange_around(
            ctx.comm_op(lop, "all_to_all", group, qkv_bytes, REASON, owner=NAME, part="a2a_qkv"),
            [ctx.compute_op(lop, chip, work, owner=NAME, part="heads") for chip in group],
            ctx.comm_op(lop, "all_to_all", group, out_bytes, REASON, owner=NAME, part="a2a_out"))
        for group in ctx.rankmap.groups(DIM) if placed.issuperset(group))


@hookimpl
def g5_place_op(ctx, lop):
    # prefill: each sequence's last token (whose logits are needed) is on the last SP rank
    if ctx.size(DIM) == 1 or ctx.phase != "prefill" or lop.kind not in HEAD_KINDS:
        return None
    last = ctx.size(DIM) - 1
    return [c for c in ctx.all_chips if ctx.rankmap.coords(c)[DIM] == last]


@hookimpl
def g5_memory_terms(ctx):
    if ctx.size(DIM) == 1:
        return None
    qkv_bytes, out_bytes = _bytes(ctx)
    # the attention block's weights (projections and their norms): every SP rank holds the
    # same ones, so they are replicated sp times (split only as tp splits them). Part of
    # "weights", shown on its own: the cost of Ulysses that EP (sharding the experts over
    # the sp ranks too) does not remove.
    attention = weight_bytes_per_chip(ctx, ATTENTION_WEIGHT_KINDS)  # the ledger's, of those kinds only
    # the all-to-all cannot run in place: one layer's received Q/K/V and output, reused per layer
    return [MemoryTerm(name="ulysses_a2a_buffers", category="workspace",
                       bytes_per_chip={c: qkv_bytes + out_bytes for c in ctx.all_chips}),
            MemoryTerm.from_vector("sp_replicated_attention_weights", "weights", attention, part_of="weights")]
