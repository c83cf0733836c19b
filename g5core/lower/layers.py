"""The model as a program of logical ops, and the work each logical op does on one chip.

The core knows a transformer's structure (norms, projections, attention, FFN or MoE, and
the points where partial results must be combined or sequence shards gathered) but not
how any strategy shards it. Synchronisation points (``*_gather``, ``*_reduce``,
``boundary``) do nothing by default; the plugin that shards something claims them.
"""
from __future__ import annotations

import functools
import math
from typing import Iterator

import attrs

from g5core.lower import flops as F
from g5core.lower.kernels import Attention, Elementwise, Gemm
from g5core.inputs.config import Deployment
from g5core.api.errors import DagError
from g5core.api.work import LogicalOp, Work
from g5core.inputs.models import ModelSpec
from g5core.lower.shape import LocalShape

EMBED_LAYER = -1

# Kinds whose default expansion creates no op: they exist so a plugin can claim them.
# ``token_return``: a decode micro-batch's sampled tokens handed from the LM head back to
# the embedding of its next step (g5core.lower.microbatch); nothing moves when they share chips.
# ``logits_gather``: the LM head's logits, computed over a shard of the vocabulary, gathered
# before sampling (claimed by the plugin that shards the vocabulary).
SYNC_KINDS = frozenset({"boundary", "attn_in_gather", "attn_out_reduce", "ffn_in_gather", "ffn_out_reduce",
                        "token_return", "logits_gather"})


@functools.lru_cache(maxsize=64)
def build_program(model: ModelSpec, micro: int = -1, head: bool = True) -> tuple[LogicalOp, ...]:
    """The logical ops of one forward step, in order, with their data dependencies (made
    once per model and arguments: the tuple and its ops are immutable).

    ``micro``: the program copy every op belongs to (g5core.lower.microbatch); ``head=False``
    leaves out the final norm and LM head (a prompt chunk before the last makes no token)."""
    ops: list[LogicalOp] = []

    def add(kind: str, layer: int, *inputs: LogicalOp) -> LogicalOp:
        op = LogicalOp(kind, layer, tuple(i.id for i in inputs), micro=micro)
        ops.append(op)
        return op

    out = add("embedding", EMBED_LAYER)
    for layer in range(model.n_layers):
        x = add("boundary", layer, out)
        if model.mtp_module:
            x = add("eh_proj", layer, x)
        if model.eagle_fc and layer == 0:
            x = add("eagle_fc", layer, x)
        x = add("attn_norm", layer, x)
        x = add("attn_in_gather", layer, x)
        x = add("qkv_proj", layer, x)
        x = add("attention", layer, x)
        x = add("o_proj", layer, x)
        x = add("attn_out_reduce", layer, x)
        x = add("ffn_norm", layer, x)
        h = add("ffn_in_gather", layer, x)
        if model.is_moe_layer(layer):
            # router, shared expert, routed experts: the order a single stream runs them in
            router = add("router", layer, h)
            shared = (add("shared_expert", layer, h),) if model.moe.n_shared_experts else ()
            routed = add("moe_experts", layer, router)
            out = add("ffn_out_reduce", layer, routed, *shared)
        else:
            out = add("ffn_out_reduce", layer, add("ffn", layer, h))
    if not head:
        return tuple(ops)
    head = model.n_layers
    x = add("boundary", head, out)
    x = add("final_norm", head, x)
    x = add("lm_head", head, x)
    add("logits_gather", head, x)
    return tuple(ops)


# ----------------------------------------------------------------------------------------
# Local matrices and work
# ----------------------------------------------------------------------------------------


def local_projections(model: ModelSpec, shape: LocalShape) -> tuple[tuple[str, float, float], ...]:
    """Attention-block matrices on one chip: latent down-projections (``*_a_proj``) are
    replicated, K/V split like the KV heads, the rest split like the query heads."""
    out = []
    for name, in_dim, out_dim in model.projection_shapes():
        if name.endswith("_a_proj"):
            out.append((name, in_dim, out_dim))
        elif name in ("k_proj", "v_proj"):
            out.append((name, in_dim, out_dim / shape.kv_shard))
        elif name == "o_proj":
            out.append((name, in_dim / shape.factor("q_heads"), out_dim))
        else:
            out.append((name, in_dim, out_dim / shape.factor("q_heads")))
    return tuple(out)


def attention_dims(model: ModelSpec, phase: str) -> tuple[int, int]:
    """(d_qk, d_v) per head. MLA decode runs absorbed over the latent (DeepSeek's inference
    path); MLA prefill runs on decompressed heads."""
    a = model.attention
    if a.kind == "gqa":
        return a.head_dim, a.head_dim
    if phase == "decode":
        return a.kv_lora_rank + a.qk_rope_head_dim, a.kv_lora_rank
    return a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim


def local_kv_bytes_per_token(model: ModelSpec, deployment: Deployment, shape: LocalShape) -> float:
    """c_kv on one chip: the model's c_kv divided by the KV-head split (1 for MLA)."""
    return model.kv_bytes_per_token_per_layer(deployment.dtypes.kv_cache_element_bytes) / shape.kv_shard


def weight_elements(kind: str, model: ModelSpec, shape: LocalShape) -> float:
    """Weight elements one chip holds for one logical op (the one formula for weights)."""
    d = model.hidden_size
    if kind == "embedding" or kind == "lm_head":
        if kind == "lm_head" and model.tie_word_embeddings:
            return 0.0
        return shape.vocab * d
    if kind in ("attn_norm", "ffn_norm", "final_norm"):
        return float(d)
    if kind == "eh_proj":   # the 2d x d projection and its two input norms (enorm, hnorm), on every chip
        return 2.0 * d * d + 2.0 * d
    if kind == "eagle_fc":  # the 2d x d projection and its bias (EAGLE_FC_BIAS), on every chip
        return 2.0 * d * d + (d if EAGLE_FC_BIAS else 0.0)
    projections = local_projections(model, shape)
    if kind == "qkv_proj":
        return sum(i * o for name, i, o in projections if name != "o_proj")
    if kind == "o_proj":
        return sum(i * o for name, i, o in projections if name == "o_proj")
    if kind == "ffn":
        return 3.0 * d * shape.ffn_cols
    if kind == "router":
        return float(d * model.moe.n_routed_experts)
    if kind == "moe_experts":
        return shape.experts * 3.0 * d * shape.expert_cols
    if kind == "shared_expert":
        m = model.moe
        return 3.0 * d * m.n_shared_experts * m.shared_expert_ffn_dim / shape.factor("ffn_cols")
    return 0.0


WEIGHT_CLASS = {
    "embedding": "embedding", "lm_head": "embedding", "qkv_proj": "attention", "o_proj": "attention",
    "ffn": "ffn", "shared_expert": "ffn", "moe_experts": "experts", "router": "default", "eh_proj": "default",
    "eagle_fc": "default",
}

#: whether an EAGLE head's ``fc`` carries a bias (``d`` weights, its add fused in the GEMM's
#: epilogue, no FLOPs counted): the EAGLE reference (SafeAILab/EAGLE ``eagle/model/cnets1.py``,
#: ``Model.__init__(..., bias=True)``: ``self.fc = nn.Linear(2 * hidden, hidden, bias=bias)``)
#: and SGLang (``python/sglang/srt/models/llama_eagle.py``: ``torch.nn.Linear(hidden * 2,
#: hidden)``, PyTorch's default ``bias=True``) hold one; vLLM's V1 ``llama_eagle.py`` builds
#: ``fc`` with ``bias=False`` (its V0 ``eagle.py``: ``bias=config.eagle_fc_bias``, default False).
#: ``d`` elements beside ``2 d^2`` (1 / 8,192 of the matrix at d = 4,096).
EAGLE_FC_BIAS = True


def projection_kernels(model: ModelSpec, shape: LocalShape, kind: str, tokens: float,
                       weight_bytes: float, act_bytes: float) -> tuple[Gemm, ...]:
    """GEMMs of ``qkv_proj`` or ``o_proj``: the matrices that read the hidden state run as
    one fused GEMM (QKV fusion; MLA's q_a and kv_a), each other matrix on its own."""
    mats = [m for m in local_projections(model, shape) if (m[0] == "o_proj") == (kind == "o_proj")]
    fused = [o for name, i, o in mats if i == model.hidden_size and name != "o_proj"]
    out = [Gemm(m=tokens, n=sum(fused), k=model.hidden_size, weight_bytes=weight_bytes, act_bytes=act_bytes)] if fused else []
    out += [Gemm(m=tokens, n=o, k=i, weight_bytes=weight_bytes, act_bytes=act_bytes)
            for name, i, o in mats if not (i == model.hidden_size and name != "o_proj")]
    return tuple(out)


def rotary_kernel(model: ModelSpec, shape: LocalShape, act_bytes: float) -> Elementwise:
    """Rotary embedding of the local queries and keys (MLA: the rope part of each query head
    and the one shared rope key), a memory-bound kernel after the QKV projection."""
    a = model.attention
    if a.kind == "mla":
        width = (shape.q_heads + 1) * a.qk_rope_head_dim
    else:
        width = (shape.q_heads + shape.kv_heads) * a.head_dim
    return Elementwise(tokens=shape.tokens, width=width, kind="rotary", act_bytes=act_bytes)


def ffn_kernels(tokens: float, hidden: float, cols: float, weight_bytes: float, act_bytes: float,
                groups: float = 1.0) -> tuple[Gemm, ...]:
    """A gated FFN (or ``groups`` experts of one): the fused gate/up GEMM, then the down GEMM."""
    return (Gemm(m=tokens, n=2.0 * cols, k=hidden, groups=groups, weight_bytes=weight_bytes, act_bytes=act_bytes),
            Gemm(m=tokens, n=hidden, k=cols, groups=groups, weight_bytes=weight_bytes, act_bytes=act_bytes))


def default_work(kind: str, model: ModelSpec, deployment: Deployment, shape: LocalShape,
                 layer: int | None = None) -> Work | None:
    """Work of one logical op on one chip when nothing but the shard factors changes it:
    :func:`base_work` with the memory-bound kernels around its GEMMs and attention
    (:func:`with_side_kernels`); ``layer`` sets the attention window of a model whose
    attention varies by layer. Returns ``None`` for synchronisation kinds (no compute)."""
    work = base_work(kind, model, deployment, shape, layer)
    return None if work is None else with_side_kernels(kind, work, model, deployment, shape)


def base_work(kind: str, model: ModelSpec, deployment: Deployment, shape: LocalShape,
              layer: int | None = None) -> Work | None:
    """The GEMMs, attention and norms of one logical op on one chip (no side kernels);
    ``layer`` sets the attention window of a model whose attention varies by layer.

    Returns ``None`` for synchronisation kinds (no compute).
    """
    if kind in SYNC_KINDS:
        return None
    d = model.hidden_size
    act = deployment.dtypes.activation_element_bytes
    wclass = WEIGHT_CLASS.get(kind, "")
    wbytes = deployment.dtypes.weight_element_bytes(wclass) if wclass else 0
    welems = weight_elements(kind, model, shape)
    if kind == "embedding":
        fl, hb = F.elementwise(shape.tokens, d, act)
        return Work(op_class="elementwise", flops=0.0, hbm_bytes=hb, weight_class="", weight_elements=welems,
                    kernels=(Elementwise(tokens=shape.tokens, width=d, kind="embedding", act_bytes=act),))
    if kind in ("attn_norm", "ffn_norm", "final_norm"):
        tokens = _head_tokens(shape) if kind == "final_norm" else shape.norm_tokens
        fl, hb = F.elementwise(tokens, d, act)
        # the residual add of the block before the norm runs as its own kernel (layer 0's
        # attn_norm has none in the model; it is counted there too, one small kernel)
        return Work(op_class="elementwise", flops=fl, hbm_bytes=hb, weight_class="", weight_elements=welems,
                    kernels=(Elementwise(tokens=tokens, width=d, kind="residual_add", act_bytes=act),
                             Elementwise(tokens=tokens, width=d, kind="rmsnorm", act_bytes=act)))
    if kind == "lm_head":
        tokens = _head_tokens(shape)
        fl, hb = F.gemm(tokens, d, shape.vocab, wbytes, act)
        return Work(op_class="gemm", flops=fl, hbm_bytes=hb, weight_class=wclass, weight_elements=welems,
                    kernels=(Gemm(m=tokens, n=shape.vocab, k=d, weight_bytes=wbytes, act_bytes=act),))
    if kind in ("eh_proj", "eagle_fc"):
        return input_proj_work(kind, d, shape.tokens, wbytes, act, welems)
    if kind in ("qkv_proj", "o_proj"):
        mats = [m for m in local_projections(model, shape) if (m[0] == "o_proj") == (kind == "o_proj")]
        fl = hb = 0.0
        for _, i, o in mats:
            f1, h1 = F.gemm(shape.tokens, i, o, wbytes, act)
            fl, hb = fl + f1, hb + h1
        return Work(op_class="gemm", flops=fl, hbm_bytes=hb, weight_class=wclass, weight_elements=welems,
                    kernels=projection_kernels(model, shape, kind, shape.tokens, wbytes, act)
                    + ((rotary_kernel(model, shape, act),) if kind == "qkv_proj" else ()))
    if kind == "attention":
        if deployment.phase != "decode" and (shape.factor("tokens") > 1 or shape.factor("kv_len") > 1):
            raise DagError(f"prefill attention over a sharded sequence ({shape.factor('tokens')}-way queries, "
                           f"{shape.factor('kv_len')}-way keys) needs a plugin that owns it; enable the plugin for "
                           "the dimension that shards the sequence")
        if not shape.uniform:
            return step_attention_work(model, deployment, shape)
        windowed = window_attention_work(model, deployment, shape, layer)
        if windowed is not None:
            return windowed
        block = "decode" if deployment.phase == "decode" else "causal"
        fl, hb = attention_work(model, deployment, shape, shape.q_tokens, shape.kv_len)
        return Work(op_class="attention", flops=fl, hbm_bytes=hb, weight_class="", weight_elements=0.0,
                    kernels=(attention_kernel(model, deployment, shape, shape.q_tokens, shape.kv_len, block),))
    if kind in ("ffn", "shared_expert"):
        if kind == "ffn":
            cols = shape.ffn_cols
            fl, hb = F.gemm(shape.tokens, d, 3.0 * cols, wbytes, act)
        else:
            shared = model.moe.n_shared_experts * model.moe.shared_expert_ffn_dim
            cols = shared / shape.factor("ffn_cols")
            fl, hb = F.gemm(shape.tokens, d, 3.0 * shared / shape.factor("ffn_cols"), wbytes, act)
        return Work(op_class="gemm", flops=fl, hbm_bytes=hb, weight_class=wclass, weight_elements=welems,
                    kernels=ffn_kernels(shape.tokens, d, cols, wbytes, act))
    if kind == "router":
        fl, hb = F.gemm(shape.tokens, d, model.moe.n_routed_experts, wbytes, act)
        return Work(op_class="gemm", flops=fl, hbm_bytes=hb, weight_class=wclass, weight_elements=welems,
                    kernels=(Gemm(m=shape.tokens, n=model.moe.n_routed_experts, k=d, weight_bytes=wbytes,
                                  act_bytes=act),))
    if kind == "moe_experts":
        return expert_work(model, deployment, shape, shape.moe_tokens * model.moe.n_active_experts,
                           shape.moe_tokens * model.moe.n_active_experts * shape.factor("experts"))
    raise ValueError(f"no default work for logical op kind {kind!r}")


def input_proj_work(kind: str, d: int, tokens: float, wbytes: float, act: float, welems: float) -> Work:
    """A speculative proposer's input projection on one chip, a ``2 d -> d`` GEMM on every
    token of the replica, whole on every rank (an ``nn.Linear`` in vLLM and SGLang):

    - ``eh_proj``, an MTP module's, over ``[enorm(embedding); hnorm(previous hidden state)]``
      (vLLM ``deepseek_mtp.py``, SGLang ``deepseek_nextn.py``); its two input RMSNorms are
      side kernels (:func:`with_side_kernels`);
    - ``eagle_fc``, an EAGLE head's ``fc``, over ``[embedding; the target's top feature]``
      (EAGLE, arXiv 2401.15077; vLLM and SGLang ``llama_eagle.py``), no norm before it; its
      bias (:data:`EAGLE_FC_BIAS`) is in its weights, its add in the GEMM's epilogue.

    The concatenation is not counted (its producers can write their halves in place)."""
    fl, hb = F.gemm(tokens, 2.0 * d, d, wbytes, act)
    return Work(op_class="gemm", flops=fl, hbm_bytes=hb, weight_class=WEIGHT_CLASS[kind], weight_elements=welems,
                kernels=(Gemm(m=tokens, n=d, k=2.0 * d, weight_bytes=wbytes, act_bytes=act),))


def expert_work(model: ModelSpec, deployment: Deployment, shape: LocalShape,
                token_slots: float, group_token_slots: float, permute: bool = True) -> Work:
    """Routed experts on one chip: ``token_slots`` (token, expert) pairs land here; the
    experts read are those expected to receive a token under uniform routing. With
    ``permute`` (no all-to-all kernel that lays the tokens out by expert), the permute and
    unpermute kernels around the grouped GEMMs (:func:`expert_side_kernels`)."""
    work = _expert_gemm_work(model, deployment, shape, token_slots, group_token_slots)
    return _with_kernels(work, expert_side_kernels(model, deployment, token_slots, work.kernels, permute))


def _expert_gemm_work(model: ModelSpec, deployment: Deployment, shape: LocalShape,
                      token_slots: float, group_token_slots: float) -> Work:
    d = model.hidden_size
    act = deployment.dtypes.activation_element_bytes
    wbytes = deployment.dtypes.weight_element_bytes("experts")
    active = F.expected_active_experts(shape.experts, model.moe.n_routed_experts, group_token_slots)
    fl, hb = F.grouped_gemm(token_slots, d, 3.0 * shape.expert_cols, active, wbytes, act)
    return Work(op_class="gemm", flops=fl, hbm_bytes=hb, weight_class="experts",
                weight_elements=weight_elements("moe_experts", model, shape),
                kernels=ffn_kernels(token_slots, d, shape.expert_cols, wbytes, act, groups=active))


def attention_kernel(model: ModelSpec, deployment: Deployment, shape: LocalShape,
                     q_len: float, kv_len: float, block: str) -> Attention:
    """The attention kernel of one chip over a ``q_len x kv_len`` block per sequence."""
    return attention_kernel_of(model, deployment, shape, shape.batch, q_len, kv_len, block, deployment.phase)


def attention_kernel_of(model: ModelSpec, deployment: Deployment, shape: LocalShape, batch: float,
                        q_len: float, kv_len: float, block: str, phase: str) -> Attention:
    """The attention kernel of ``batch`` sequences, ``q_len x kv_len`` each, with the head
    dims of ``phase`` (MLA: decompressed for prefill, absorbed for decode)."""
    d_qk, d_v = attention_dims(model, phase)
    return Attention(batch=batch, q_len=q_len, kv_len=kv_len, heads=shape.q_heads, kv_heads=shape.kv_heads,
                     d_qk=d_qk, d_v=d_v, block=block, mla=model.attention.kind == "mla",
                     kv_bytes_per_token=local_kv_bytes_per_token(model, deployment, shape),
                     act_bytes=deployment.dtypes.activation_element_bytes)


def window_attention_kernels(model: ModelSpec, deployment: Deployment, shape: LocalShape,
                             layer: int | None, q_tokens: float | None = None) -> tuple[Attention, ...]:
    """Attention kernels of a windowed layer whose window is shorter than the context, or ()
    (a full layer, a window the context fits in, or a context a plugin shards).

    Sliding window ``w`` over ``S`` prefill tokens: the first ``w`` queries as a causal block,
    the other ``S - w`` against ``w`` keys each; decode reads the last ``w`` tokens. Chunked
    (Llama 4): each whole chunk of ``w`` is a causal block, the remainder one more; decode
    reads the tokens of its own chunk. ``q_tokens``: the query tokens per sequence the chip
    attends for (default the shape's; a strategy that gathers the whole sequence, such as
    Ulysses, gives ``S``)."""
    if layer is None or not 0 <= layer < model.n_layers or shape.factor("kv_len") != 1:
        return ()
    w, S = model.kv_window(layer), shape.seq_len
    if not w or w >= S:
        return ()
    chunked = model.window_kind == "chunked"
    if deployment.phase == "decode":
        kv = (S - 1) % w + 1 if chunked else w
        return (attention_kernel(model, deployment, shape, 1, kv, "decode"),)
    if (shape.q_tokens if q_tokens is None else q_tokens) != S:
        return ()
    if chunked:
        whole, rest = divmod(S, w)
        blocks = [attrs.evolve(attention_kernel(model, deployment, shape, w, w, "causal"), batch=shape.batch * whole)]
        if rest:
            blocks.append(attention_kernel(model, deployment, shape, rest, rest, "causal"))
        return tuple(blocks)
    return (attention_kernel(model, deployment, shape, w, w, "causal"),
            attention_kernel(model, deployment, shape, S - w, w, "full"))


def window_attention_work(model: ModelSpec, deployment: Deployment, shape: LocalShape,
                          layer: int | None, q_tokens: float | None = None) -> Work | None:
    """The attention Work of a windowed layer (:func:`window_attention_kernels`), or None."""
    kernels = window_attention_kernels(model, deployment, shape, layer, q_tokens)
    if not kernels:
        return None
    return Work(op_class="attention", flops=math.fsum(k.flops for k in kernels),
                hbm_bytes=math.fsum(k.hbm_bytes for k in kernels), weight_class="", weight_elements=0.0,
                kernels=kernels)


def attention_work(model: ModelSpec, deployment: Deployment, shape: LocalShape,
                   q_tokens: float, kv_len: float) -> tuple[float, float]:
    """Attention of one chip's query tokens against ``kv_len`` keys per sequence."""
    d_qk, d_v = attention_dims(model, deployment.phase)
    c_kv = local_kv_bytes_per_token(model, deployment, shape)
    act = deployment.dtypes.activation_element_bytes
    if deployment.phase == "decode":
        return F.decode_attention(shape.batch, kv_len, shape.q_heads, d_qk, d_v, c_kv, act)
    if q_tokens == kv_len:
        return F.prefill_attention(shape.batch, q_tokens, shape.q_heads, d_qk, d_v, c_kv, act)
    # the queries are the last q_tokens of kv_len keys (a cached prefix before them)
    return F.prefix_attention(shape.batch, q_tokens, kv_len - q_tokens, shape.q_heads, d_qk, d_v, c_kv, act)


def group_kind(group) -> str:
    """The phase whose attention runs a step group: ``decode`` or ``prefill``."""
    return "decode" if group.decode else "prefill"


def step_attention_kernels(model: ModelSpec, deployment: Deployment, shape: LocalShape,
                           groups=None) -> tuple[Attention, ...]:
    """The attention kernels of a step on one chip, as a varlen engine runs them: one causal
    kernel per prefill group (its new queries over its cached and new keys: ``q_tokens``
    of ``kv_len`` per sequence), and one decode kernel for every decode sequence together
    (flash-decoding / paged attention over per-sequence KV lengths: FLOPs and bytes are
    linear in each sequence's length, so the kernel runs ``sum(count)`` sequences at the
    mean length ``sum(count * kv_len) / sum(count)``). MLA prefill groups run on
    decompressed heads, MLA decode groups absorbed (:func:`attention_dims`)."""
    groups = shape.groups if groups is None else groups
    out = []
    for g in groups:
        if not g.decode:
            out.append(attention_kernel_of(model, deployment, shape, g.count, g.q_tokens, g.kv_len, "causal",
                                         "prefill"))
    for g in groups:
        if g.verify:
            out.append(verify_attention_kernel(model, deployment, shape, g.count, g.q_tokens, g.kv_len))
    decode = [g for g in groups if g.decode and not g.verify]
    if decode:
        count = sum(g.count for g in decode)
        kv_len = decode[0].kv_len if len(decode) == 1 else sum(g.count * g.kv_len for g in decode) / count
        out.append(attention_kernel_of(model, deployment, shape, count, 1.0, kv_len, "decode", "decode"))
    return tuple(out)


def verify_attention_kernel(model: ModelSpec, deployment: Deployment, shape: LocalShape, batch: float,
                            q_len: float, kv_len: float) -> Attention:
    """The attention of a speculative verification: ``q_len = k + 1`` queries per sequence (the
    last sampled token and the drafts) over ``kv_len`` keys, the drafts causal among themselves
    after the cached prefix (the ``causal`` block's ``q_len x (kv_len - q_len)`` rectangle plus
    its diagonal block), on the decode path's head dims (MLA absorbed, as FlashMLA runs
    ``seq_len_q > 1``). A KV shard shorter than the queries (context parallelism) is an
    unmasked block."""
    block = "causal" if kv_len >= q_len else "full"
    return attention_kernel_of(model, deployment, shape, batch, q_len, kv_len, block, "decode")


def decode_query_rows(shape: LocalShape) -> float:
    """Query tokens of a decode step per replica: one per sequence, ``k + 1`` per sequence of a
    verification group (what the LM head and a decode attention's outputs run on)."""
    return float(shape.batch + sum(g.count * (g.new_tokens - 1) for g in shape.groups if g.verify))


def decode_attention_kernel(model: ModelSpec, deployment: Deployment, shape: LocalShape, batch: float,
                            kv_len: float) -> Attention:
    """A decode step's attention kernel over ``kv_len`` keys per sequence (a strategy's KV
    shard): the single-query decode kernel, or for a verification step (one verification
    group) :func:`verify_attention_kernel` with its ``k + 1`` queries."""
    verify = [g for g in shape.groups if g.verify]
    if verify:
        return verify_attention_kernel(model, deployment, shape, batch, verify[0].q_tokens, kv_len)
    return attention_kernel_of(model, deployment, shape, batch, 1, kv_len, "decode", deployment.phase)


def step_attention_work(model: ModelSpec, deployment: Deployment, shape: LocalShape, groups=None) -> Work:
    """The attention work of a step on one chip: :func:`step_attention_kernels`, their FLOPs
    and bytes summed (each kernel's from :mod:`g5core.lower.flops`)."""
    kernels = step_attention_kernels(model, deployment, shape, groups)
    return Work(op_class="attention", flops=sum(k.flops for k in kernels), hbm_bytes=sum(k.hbm_bytes for k in kernels),
                weight_class="", weight_elements=0.0, kernels=kernels)


def _head_tokens(shape: LocalShape) -> float:
    """The LM head computes logits for the last token of each sequence (prefill) or the new
    token (decode): ``batch`` tokens, wherever the sequence is sharded; a verification group
    needs the logits of all its ``k + 1`` tokens (:func:`decode_query_rows`)."""
    return decode_query_rows(shape)


def iter_layers(model: ModelSpec) -> Iterator[int]:
    yield EMBED_LAYER
    yield from range(model.n_layers)
    yield model.n_layers


# ----------------------------------------------------------------------------------------
# Side kernels: the memory-bound kernels around the GEMMs and attention (issue 22). Each
# kernel's FLOPs and bytes are g5core.lower.flops formulas.
# ----------------------------------------------------------------------------------------

#: vLLM's paged attention v2 cuts the KV into partitions of 512 tokens and combines them with
#: a reduce kernel (vllm/attention/ops/paged_attn.py ``_PARTITION_SIZE = 512``, "Should be the
#: same as PARTITION_SIZE in paged_attention_v2_launcher"); it runs v1 (no split) when
#: ``max_seq_len <= 8192 and (max_num_partitions == 1 or num_seqs * num_heads > 512)``
SPLIT_KV_PARTITION_TOKENS = 512
SPLIT_KV_MAX_V1_SEQ_TOKENS = 8192
SPLIT_KV_V1_MIN_ROWS = 512


def split_kv_partitions(batch: float, heads: float, kv_len: float) -> int:
    """Partitions flash-decoding splits one sequence's KV into (1: no split, no combine)."""
    parts = max(1, math.ceil(kv_len / SPLIT_KV_PARTITION_TOKENS))
    if kv_len <= SPLIT_KV_MAX_V1_SEQ_TOKENS and (parts == 1 or batch * heads > SPLIT_KV_V1_MIN_ROWS):
        return 1
    return parts


def _with_kernels(work: Work, extra: tuple) -> Work:
    """``work`` with ``extra`` kernels appended. The op's totals (its FLOPs for MFU, its bytes)
    stay those of its GEMMs, attention and norms: each side kernel carries its own FLOPs and
    bytes (the timeline lists them) and its time comes from the size-aware roofline or a
    table."""
    if not extra:
        return work
    return attrs.evolve(work, kernels=work.kernels + tuple(extra))


def sampler_kernels(model: ModelSpec, shape: LocalShape, act_bytes: float) -> tuple[Elementwise, ...]:
    """Greedy sampling after the LM head, as vLLM's V1 ``Sampler.forward`` runs it with default
    sampling parameters (vllm/v1/sample/sampler.py at 3e34265): the logits cast to fp32, then
    their argmax (``greedy_sample``); the logits processors and penalties are no-ops by default.
    Over the whole vocabulary on every chip: a TP group gathers the vocabulary-parallel logits
    first (``logits_gather``, the TP plugin's all-gather), so each rank samples them all; these
    kernels are the LM head's, ahead of the gather in the program, which changes no step's
    time (the three run one after the other at its end). A verification group samples each of
    its rows (:func:`_head_tokens`)."""
    tokens = _head_tokens(shape)
    vocab = model.vocab_size
    return (Elementwise(tokens=tokens, width=vocab, kind="logits_cast", act_bytes=act_bytes),
            Elementwise(tokens=tokens, width=vocab, kind="argmax", act_bytes=act_bytes))


def fp8_input_kernels(gemms, deployment: Deployment, weight_class: str) -> tuple[Elementwise, ...]:
    """Per-tensor FP8 quantisation of each FP8 GEMM's input (``m x k``), once per distinct
    input: the fused gate/up GEMM and a QKV projection read one tensor."""
    if not weight_class or deployment.dtypes.weight_dtype(weight_class) != "fp8":
        return ()
    act = deployment.dtypes.activation_element_bytes
    seen, out = set(), []
    for g in gemms:
        if isinstance(g, Gemm) and (g.m, g.k) not in seen:
            seen.add((g.m, g.k))
            out.append(Elementwise(tokens=g.m, width=g.k, kind="fp8_quant", act_bytes=act))
    return tuple(out)


def swiglu_kernels(gemms, act_bytes: float) -> tuple[Elementwise, ...]:
    """The gated activation between a gated FFN's gate/up GEMM (``n = 2 cols``) and its down GEMM."""
    gate_up = gemms[0]
    return (Elementwise(tokens=gate_up.m, width=gate_up.n / 2.0, kind="swiglu", act_bytes=act_bytes),)


def kv_append_kernel(model: ModelSpec, deployment: Deployment, shape: LocalShape) -> Elementwise:
    """The KV-cache append of this chip's new tokens, after the QKV projection and rotary
    (TensorRT-LLM fuses it with rotary, vLLM runs reshape_and_cache; G5 counts it once)."""
    kv_bytes = deployment.dtypes.kv_cache_element_bytes
    kv_elements = local_kv_bytes_per_token(model, deployment, shape) / kv_bytes
    return Elementwise(tokens=shape.tokens, width=kv_elements, kind="kv_append", act_bytes=kv_bytes)


def attention_side_kernels(model: ModelSpec, deployment: Deployment, shape: LocalShape) -> tuple[Elementwise, ...]:
    """In decode, flash-decoding's split-KV combine (:func:`split_kv_partitions`)."""
    out = []
    if deployment.phase == "decode":
        parts = split_kv_partitions(shape.batch, shape.q_heads, shape.kv_len)
        if parts > 1:
            _, d_v = attention_dims(model, deployment.phase)
            out.append(merge_kernel(decode_query_rows(shape) * shape.q_heads, d_v, parts, deployment,
                                    "splitkv_combine"))
    return tuple(out)


def merge_kernel(rows: float, d_v: float, parts: float, deployment: Deployment, kind: str = "attn_merge") -> Elementwise:
    """Merging ``parts`` partial attention outputs of ``rows`` (query, head) rows by their
    online-softmax statistics: flash-decoding's combine, the pass-KV and pass-Q merges."""
    return Elementwise(tokens=rows, width=d_v, kind=kind, act_bytes=deployment.dtypes.activation_element_bytes,
                       parts=parts)


def router_side_kernels(model: ModelSpec, shape: LocalShape) -> tuple[Elementwise, ...]:
    """The router's softmax / sigmoid and top-k over its fp32 logits."""
    m = model.moe
    return (Elementwise(tokens=shape.tokens, width=m.n_routed_experts, kind="moe_topk", act_bytes=4.0,
                        parts=m.n_active_experts),)


def expert_side_kernels(model: ModelSpec, deployment: Deployment, token_slots: float, gemms,
                        permute: bool) -> tuple[Elementwise, ...]:
    """SwiGLU between the experts' grouped GEMMs, FP8 input quantisation where the experts
    run in FP8, and (``permute``) the permute and unpermute around them."""
    act = deployment.dtypes.activation_element_bytes
    out = swiglu_kernels(gemms, act) + fp8_input_kernels(gemms, deployment, "experts")
    if permute:
        d, k = model.hidden_size, model.moe.n_active_experts
        out += (Elementwise(tokens=token_slots, width=d, kind="moe_permute", act_bytes=act),
                Elementwise(tokens=token_slots, width=d, kind="moe_unpermute", act_bytes=act, parts=k))
    return out


def with_side_kernels(kind: str, work: Work, model: ModelSpec, deployment: Deployment, shape: LocalShape) -> Work:
    """``work`` of a logical op of ``kind`` with the side kernels it runs."""
    act = deployment.dtypes.activation_element_bytes
    if kind in ("ffn", "shared_expert"):
        extra = swiglu_kernels(work.kernels, act) + fp8_input_kernels(work.kernels, deployment, WEIGHT_CLASS[kind])
    elif kind == "qkv_proj":
        extra = fp8_input_kernels(work.kernels, deployment, WEIGHT_CLASS[kind]) + (
            kv_append_kernel(model, deployment, shape),)
    elif kind == "lm_head":
        extra = fp8_input_kernels(work.kernels, deployment, WEIGHT_CLASS[kind]) + sampler_kernels(model, shape, act)
    elif kind in ("o_proj", "eagle_fc"):
        extra = fp8_input_kernels(work.kernels, deployment, WEIGHT_CLASS[kind])
    elif kind == "eh_proj":   # enorm and hnorm before the projection, then its input quantisation
        norm = Elementwise(tokens=shape.tokens, width=model.hidden_size, kind="rmsnorm", act_bytes=act)
        extra = (norm, norm) + fp8_input_kernels(work.kernels, deployment, WEIGHT_CLASS[kind])
    elif kind == "attention":
        extra = attention_side_kernels(model, deployment, shape)
    elif kind == "router":
        extra = router_side_kernels(model, shape)
    else:
        extra = ()
    return _with_kernels(work, extra)
