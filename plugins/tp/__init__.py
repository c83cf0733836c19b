"""Tensor parallelism: column/row sharding of projections and FFNs inside a TP group.

- Query heads, the attention output, dense-FFN and shared-expert columns, and the
  vocabulary are divided by ``tp``. GQA KV heads are divided when ``n_kv >= tp`` and
  replicated otherwise (each chip keeps one); the MLA latent is replicated.
- Routed experts are column-sharded by ``tp`` when ``ep = 1``. With ``ep > 1`` experts are
  whole on their EP rank and each TP rank routes a disjoint ``1/tp`` of its tokens (the
  tokens are replicated across the TP group after attention); the TP reduction after the
  MoE block re-replicates them.
- After each row-parallel op (output projection, FFN/MoE) the partial sums are combined
  with an all-reduce (``tp_allreduce``) of ``tokens x hidden`` per rank. With the option
  ``plugins: {tp: {sp: true}}`` (TP sequence parallelism; the former top-level key
  ``tp_sp: true`` still sets it) the reduction is a reduce-scatter (``tp_reduce_scatter``), norms run on
  ``1/tp`` of the tokens, and an all-gather (``tp_allgather``) restores the full sequence
  before the next column-parallel op. TP sequence parallelism with ``cp > 1`` is refused
  (both cut the sequence dimension; spec v1).
- The LM head's logits, a ``1/tp`` slice of the vocabulary on each rank, are all-gathered
  before sampling (``tp_logits_allgather``: ``rows x vocab`` in the activation dtype), as
  vLLM's ``LogitsProcessor._gather_logits`` (``tensor_model_parallel_all_gather`` wherever
  the platform can all-gather), SGLang's ``LogitsProcessor`` (unless ``enable_dp_lm_head``)
  and TensorRT-LLM's LM head (``gather_output``) do. vLLM and SGLang run it with NCCL, not
  their custom all-reduce.
"""
from __future__ import annotations

from g5core import ConfigError, Dimension, Fragment, PluginOption, hookimpl

REDUCE_KINDS = ("attn_out_reduce", "ffn_out_reduce")
GATHER_KINDS = ("attn_in_gather", "ffn_in_gather")


@hookimpl
def g5_register_dimensions(register):
    register(Dimension(name="tp", factor=True, rank_order=30, doc="tensor parallelism (innermost: stays in a node)"))


@hookimpl
def g5_register_options(register):
    register(PluginOption(name="sp", default=False, doc="TP sequence parallelism: reduce-scatter + all-gather instead of all-reduce, "
                                       "norms on 1/tp of the tokens", legacy_key="tp_sp"))


def tp_sp(deployment) -> bool:
    """Whether TP sequence parallelism is on (``plugins.tp.sp``; False when TP is disabled)."""
    return deployment.option("tp", "sp", False)


@hookimpl
def g5_validate_deployment(deployment, model, system):
    tp = deployment.size("tp")
    a = model.attention
    if a.n_heads % tp:
        raise ConfigError("parallel.tp", f"{model.name} has {a.n_heads} attention heads, not divisible by tp={tp}; "
                                         f"choose tp among {_divisors(a.n_heads)}")
    if a.kind == "gqa" and tp > 1:
        if a.n_kv_heads >= tp and a.n_kv_heads % tp:
            raise ConfigError("parallel.tp", f"{model.name} has {a.n_kv_heads} KV heads, not divisible by tp={tp}")
        if a.n_kv_heads < tp and tp % a.n_kv_heads:
            raise ConfigError("parallel.tp", f"tp={tp} cannot replicate {a.n_kv_heads} KV heads evenly; "
                                             f"use a multiple of {a.n_kv_heads}")
    if tp_sp(deployment) and tp == 1:
        raise ConfigError("plugins.tp.sp", "TP sequence parallelism needs tp > 1; set plugins.tp.sp: false "
                                           "(or the former tp_sp: false) or raise parallel.tp")
    cp = deployment.size("cp")
    if tp_sp(deployment) and cp > 1:
        raise ConfigError("plugins.tp.sp", f"cp={cp} cannot be combined with TP sequence parallelism (both cut the "
                                           "sequence dimension; not supported in v1); set plugins.tp.sp: false "
                                           "(or the former tp_sp: false) or cp: 1")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@hookimpl
def g5_shard_factors(deployment, model):
    tp = deployment.size("tp")
    if tp == 1:
        return None
    ep = deployment.size("ep")
    kv = min(tp, model.attention.n_kv_heads) if model.attention.kind == "gqa" else 1
    return {
        "q_heads": tp,
        "kv_heads": kv,
        "ffn_cols": tp,
        "expert_cols": tp if ep == 1 else 1,
        "moe_tokens": tp if ep > 1 else 1,
        "vocab": tp,
        "norm_tokens": tp if tp_sp(deployment) else 1,
    }


def _tp_groups(ctx, chips):
    groups = {}
    for c in chips:
        g = ctx.rankmap.group_of("tp", c)
        groups[g] = True
    return list(groups)


def collective_of(ctx, lop) -> tuple[str, str] | None:
    """(primitive, reason) of the TP collective that ``lop`` is, or None."""
    if ctx.size("tp") == 1:
        return None
    sp = tp_sp(ctx.deployment)
    if lop.kind in REDUCE_KINDS:
        return ("reduce_scatter", "tp_reduce_scatter") if sp else ("all_reduce", "tp_allreduce")
    if lop.kind in GATHER_KINDS and sp:
        return "all_gather", "tp_allgather"
    if lop.kind == "logits_gather":
        return "all_gather", "tp_logits_allgather"
    return None


def group_fragment(ctx, lop, group, collective: tuple[str, str]) -> Fragment:
    """The collective on ``group`` (``range(tp)`` for the slots of a tiled template)."""
    primitive, reason = collective
    nbytes = ctx.logits_bytes() if lop.kind == "logits_gather" else ctx.hidden_states_bytes(ctx.shape.tokens)
    return Fragment.collective(ctx.comm_op(lop, primitive, group, nbytes, reason, owner="tp", part=primitive))


@hookimpl
def g5_expand_op(ctx, lop):
    collective = collective_of(ctx, lop)
    if collective is None:
        return None
    # one collective on slot chips 0 .. tp-1, tiled over the TP groups of the placed chips
    return Fragment.tiled(group_fragment(ctx, lop, range(ctx.size("tp")), collective),
                          _tp_groups(ctx, ctx.place(lop)))
