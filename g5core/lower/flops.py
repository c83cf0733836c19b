"""Work formulas: FLOPs and HBM bytes of every compute op class. The one place they live.

Each function returns ``(flops, hbm_bytes)`` for the work one chip does. Conventions:

- a GEMM of ``tokens x in_dim`` by ``in_dim x out_dim`` costs ``2 * tokens * in * out``
  FLOPs and reads its weights once plus its input and output activations;
- causal prefill attention counts half the score matrix: per sequence and head,
  ``QK^T`` and ``PV`` cost ``2 * S^2 * d / 2`` each, so a layer costs
  ``b * S^2 * n_heads * (d_qk + d_v)`` FLOPs;
- causal attention of ``T`` new queries after a cached prefix of ``P`` keys adds the
  unmasked ``T x P`` rectangle to the diagonal block: ``b * h * (d_qk + d_v) * (T^2 + 2 T P)``
  (``P = 0`` is the prefill above);
- decode attention is one query against ``kv_len`` keys: ``2 * kv_len * n_heads *
  (d_qk + d_v)`` FLOPs per sequence; it reads the whole local KV cache;
- an elementwise op (norm, residual, activation) costs ``ELEMENTWISE_FLOPS_PER_ELEMENT``
  FLOPs per element and reads and writes each element once.
"""
from __future__ import annotations

ELEMENTWISE_FLOPS_PER_ELEMENT = 5.0


def activation_tensor_bytes(tokens: float, width: float, element_bytes: float) -> float:
    """Bytes of a ``tokens x width`` activation tensor: what a layer hands on per token row."""
    return tokens * width * element_bytes


def gemm(tokens: float, in_dim: float, out_dim: float, weight_bytes: float, act_bytes: float) -> tuple[float, float]:
    flops = 2.0 * tokens * in_dim * out_dim
    hbm = in_dim * out_dim * weight_bytes + tokens * (in_dim + out_dim) * act_bytes
    return flops, hbm


def grouped_gemm(
    tokens: float, in_dim: float, out_dim: float, n_weight_sets: float, weight_bytes: float, act_bytes: float
) -> tuple[float, float]:
    """``tokens`` routed through ``n_weight_sets`` distinct weight matrices (MoE experts)."""
    flops = 2.0 * tokens * in_dim * out_dim
    hbm = n_weight_sets * in_dim * out_dim * weight_bytes + tokens * (in_dim + out_dim) * act_bytes
    return flops, hbm


def elementwise(tokens: float, width: float, act_bytes: float) -> tuple[float, float]:
    elements = tokens * width
    return ELEMENTWISE_FLOPS_PER_ELEMENT * elements, 2.0 * elements * act_bytes


def residual_add(tokens: float, width: float, act_bytes: float) -> tuple[float, float]:
    """``x + residual``: one FLOP per element; reads two tensors, writes one."""
    elements = tokens * width
    return elements, 3.0 * elements * act_bytes


def causal_attention_flops(batch: float, seq: float, n_heads: float, d_qk: float, d_v: float) -> float:
    """F_attn: FLOPs of one layer's causal self-attention over ``seq`` tokens."""
    return batch * seq * seq * n_heads * (d_qk + d_v)


def attention_block_bytes(
    batch: float, q_tokens: float, kv_tokens: float, n_heads: float, d_qk: float, d_v: float,
    kv_bytes_per_token: float, act_bytes: float,
) -> float:
    """HBM bytes of a fused (flash) attention over one block: read Q and KV, write O."""
    q_and_o = batch * q_tokens * n_heads * (d_qk + d_v) * act_bytes
    return q_and_o + batch * kv_tokens * kv_bytes_per_token


def prefill_attention(
    batch: float, seq: float, n_heads: float, d_qk: float, d_v: float, kv_bytes_per_token: float, act_bytes: float
) -> tuple[float, float]:
    flops = causal_attention_flops(batch, seq, n_heads, d_qk, d_v)
    return flops, attention_block_bytes(batch, seq, seq, n_heads, d_qk, d_v, kv_bytes_per_token, act_bytes)


def prefix_attention_flops(batch: float, new: float, cached: float, n_heads: float, d_qk: float,
                           d_v: float) -> float:
    """Causal attention of ``new`` queries over ``cached + new`` keys: the causal diagonal
    block of the new tokens plus the unmasked ``new x cached`` block of the prefix."""
    return (causal_attention_flops(batch, new, n_heads, d_qk, d_v)
            + block_attention_flops(batch, new, cached, n_heads, d_qk, d_v))


def prefix_attention(
    batch: float, new: float, cached: float, n_heads: float, d_qk: float, d_v: float, kv_bytes_per_token: float,
    act_bytes: float,
) -> tuple[float, float]:
    """(FLOPs, HBM bytes) of prefill attention after a cached prefix: reads Q of the new
    tokens, the KV of all ``cached + new`` tokens, writes O of the new tokens."""
    flops = prefix_attention_flops(batch, new, cached, n_heads, d_qk, d_v)
    return flops, attention_block_bytes(batch, new, cached + new, n_heads, d_qk, d_v, kv_bytes_per_token, act_bytes)


def block_attention_flops(batch: float, q_len: float, kv_len: float, n_heads: float, d_qk: float, d_v: float) -> float:
    """FLOPs of an unmasked ``q_len x kv_len`` attention block (``QK^T`` and ``PV``)."""
    return 2.0 * batch * q_len * kv_len * n_heads * (d_qk + d_v)


def decode_attention(
    batch: float, kv_len: float, n_heads: float, d_qk: float, d_v: float, kv_bytes_per_token: float, act_bytes: float
) -> tuple[float, float]:
    flops = block_attention_flops(batch, 1, kv_len, n_heads, d_qk, d_v)
    return flops, attention_block_bytes(batch, 1, kv_len, n_heads, d_qk, d_v, kv_bytes_per_token, act_bytes)


def expected_active_experts(local_experts: float, total_experts: float, routed_token_slots: float) -> float:
    """Expected number of a chip's experts that receive at least one token, uniform routing.

    ``routed_token_slots`` is tokens x top-k routed over the whole expert set.
    """
    if routed_token_slots <= 0:
        return 0.0
    miss = (1.0 - 1.0 / total_experts) ** routed_token_slots
    return local_experts * (1.0 - miss)


# ---------------------------------------------------------------------------------------
# The memory-bound kernels around the GEMMs and attention (issue 22). Each returns
# ``(flops, hbm_bytes)``; ``LSE_BYTES`` is one fp32 log-sum-exp (or max / sum) per row.
# ---------------------------------------------------------------------------------------
LSE_BYTES = 4.0
#: bytes of one expert index and one routing weight per (token, expert) slot (int32, fp32)
ROUTE_SLOT_BYTES = 8.0
#: bytes of one logit as the sampler reads it: vLLM's ``Sampler.forward`` casts the logits to
#: float32 first (vllm/v1/sample/sampler.py, "Use float32 for the logits")
SAMPLER_LOGIT_BYTES = 4.0
#: bytes of one sampled token id as argmax writes it (int64, torch.argmax)
TOKEN_ID_BYTES = 8.0


def logits_cast(tokens: float, vocab: float, act_bytes: float) -> tuple[float, float]:
    """The sampler's cast of ``tokens x vocab`` logits to fp32: reads the model's dtype, writes
    fp32; one FLOP (the conversion) per element."""
    elements = tokens * vocab
    return elements, elements * (act_bytes + SAMPLER_LOGIT_BYTES)


def greedy_argmax(tokens: float, vocab: float) -> tuple[float, float]:
    """Greedy sampling: the argmax of each row of fp32 logits; reads them, writes one id a row;
    one comparison per element."""
    elements = tokens * vocab
    return elements, elements * SAMPLER_LOGIT_BYTES + tokens * TOKEN_ID_BYTES


def swiglu(tokens: float, cols: float, act_bytes: float) -> tuple[float, float]:
    """``silu(gate) * up`` over ``tokens x cols``: reads gate and up, writes the product;
    ``ELEMENTWISE_FLOPS_PER_ELEMENT`` per output element."""
    elements = tokens * cols
    return ELEMENTWISE_FLOPS_PER_ELEMENT * elements, 3.0 * elements * act_bytes


def fp8_quantize(tokens: float, width: float, act_bytes: float) -> tuple[float, float]:
    """Per-tensor FP8 quantisation of a ``tokens x width`` activation before an FP8 GEMM: one
    pass for the absolute maximum (the scale), one that scales and converts: reads the input
    twice, writes one byte per element; 3 FLOPs per element (abs-max, scale, convert)."""
    elements = tokens * width
    return 3.0 * elements, elements * (2.0 * act_bytes + 1.0)


def kv_cache_append(tokens: float, kv_elements_per_token: float, kv_bytes: float) -> tuple[float, float]:
    """Writing ``tokens`` new tokens' K and V into the KV cache: reads them, writes them (in the
    cache's dtype); no FLOPs."""
    return 0.0, 2.0 * tokens * kv_elements_per_token * kv_bytes


def partials_merge(rows: float, d_v: float, parts: float, act_bytes: float) -> tuple[float, float]:
    """Merging ``parts`` partial attention outputs of ``rows`` (query, head) rows by their
    online-softmax statistics (flash-decoding's split-KV combine, pass-KV / pass-Q merge):
    reads each part's ``d_v`` outputs and its LSE, writes one output and LSE; per part and
    element a rescale and an add (2 FLOPs), per part and row 4 for the statistics."""
    return rows * parts * (2.0 * d_v + 4.0), rows * (parts + 1.0) * (d_v * act_bytes + LSE_BYTES)


def moe_topk(tokens: float, n_experts: float, top_k: float) -> tuple[float, float]:
    """Routing: the softmax (or sigmoid) of the fp32 router logits and their top-k: reads the
    logits, writes ``top_k`` indices and weights per token."""
    return ELEMENTWISE_FLOPS_PER_ELEMENT * tokens * n_experts, tokens * (n_experts * LSE_BYTES
                                                                           + top_k * ROUTE_SLOT_BYTES)


def moe_permute(slots: float, hidden: float, act_bytes: float) -> tuple[float, float]:
    """Gathering the hidden states into expert order: ``slots`` (token, expert) rows read and
    written, plus their indices; no FLOPs."""
    return 0.0, slots * (2.0 * hidden * act_bytes + ROUTE_SLOT_BYTES)


def moe_unpermute(slots: float, hidden: float, top_k: float, act_bytes: float) -> tuple[float, float]:
    """The weighted sum of each token's ``top_k`` expert outputs back in token order: reads the
    ``slots`` rows and their weights, writes ``slots / top_k`` rows; 2 FLOPs per element read."""
    return 2.0 * slots * hidden, slots * (hidden * act_bytes + ROUTE_SLOT_BYTES) + slots / top_k * hidden * act_bytes

def passq_reduce_elements(n_heads: float, d_v_sent: float) -> float:
    """Numbers one rank's pass-Q partial carries per query token: ``n_h * d_v + 2 n_h``
    (numerator per head plus the per-head max and denominator). ``d_v_sent`` is the value
    width the rank sends: the head dim for GQA; for MLA ``v_head_dim``, because the
    per-head up-projection ``W_UV`` is linear and may be applied before the merge (checked
    by :func:`g5core.testing.reference.up_project`)."""
    return n_heads * d_v_sent + 2.0 * n_heads
