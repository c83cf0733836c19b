"""The kernel records: the shapes a compute op is made of (GEMM, attention, elementwise),
each with its FLOPs and HBM bytes from :mod:`g5core.lower.flops`."""
from __future__ import annotations

import math
from typing import Union

import attrs

from g5core.lower import flops as F

ATTENTION_BLOCKS = ("causal", "full", "decode")
ELEMENTWISE_KINDS = ("rmsnorm", "residual_add", "rotary", "embedding", "swiglu", "fp8_quant", "kv_append",
                     "splitkv_combine", "attn_merge", "moe_topk", "moe_permute", "moe_unpermute", "logits_cast",
                     "argmax")


def _nonneg(instance, attribute, value) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 and math.isfinite(value)):
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be a finite number >= 0, got {value!r}")


def _num():
    return attrs.field(converter=float, validator=_nonneg)


@attrs.frozen(kw_only=True, cache_hash=True)
class Gemm:
    """``m x k`` activations times ``groups`` weight matrices of ``k x n`` (``m`` rows in all)."""

    m: float = _num()
    n: float = _num()
    k: float = _num()
    groups: float = attrs.field(converter=float, default=1.0, validator=_nonneg)
    weight_bytes: float = _num()   # bytes per weight element
    act_bytes: float = _num()      # bytes per activation element

    op_class = "gemm"

    @property
    def flops(self) -> float:
        return F.grouped_gemm(self.m, self.k, self.n, self.groups, self.weight_bytes, self.act_bytes)[0]

    def describe(self) -> str:
        groups = f",groups={self.groups:g}" if self.groups != 1 else ""
        return f"gemm(m={self.m:g},n={self.n:g},k={self.k:g}{groups})"

    @property
    def hbm_bytes(self) -> float:
        return F.grouped_gemm(self.m, self.k, self.n, self.groups, self.weight_bytes, self.act_bytes)[1]


@attrs.frozen(kw_only=True, cache_hash=True)
class Attention:
    """A fused (flash) attention over one block of ``q_len x kv_len`` per sequence and head."""

    batch: float = _num()
    q_len: float = _num()
    kv_len: float = _num()
    heads: float = _num()
    kv_heads: float = _num()
    d_qk: float = _num()
    d_v: float = _num()
    block: str = attrs.field(validator=attrs.validators.in_(ATTENTION_BLOCKS))
    mla: bool = attrs.field(default=False)
    kv_bytes_per_token: float = _num()   # K and V of one token on this chip (all its KV heads)
    act_bytes: float = _num()

    op_class = "attention"

    @property
    def flops(self) -> float:
        if self.block == "causal":
            # the queries are the last q_len of kv_len keys: a cached prefix when kv_len > q_len
            return F.prefix_attention_flops(self.batch, self.q_len, self.kv_len - self.q_len, self.heads, self.d_qk,
                                            self.d_v)
        return F.block_attention_flops(self.batch, self.q_len, self.kv_len, self.heads, self.d_qk, self.d_v)

    @property
    def hbm_bytes(self) -> float:
        return F.attention_block_bytes(self.batch, self.q_len, self.kv_len, self.heads, self.d_qk, self.d_v,
                                       self.kv_bytes_per_token, self.act_bytes)

    def describe(self) -> str:
        return (f"attention_{self.block}(batch={self.batch:g},q={self.q_len:g},kv={self.kv_len:g},"
                f"heads={self.heads:g},kv_heads={self.kv_heads:g},d_qk={self.d_qk:g},d_v={self.d_v:g})")

    @property
    def length_tokens(self) -> float:
        """The block length that sets a flash kernel's efficiency: its KV length."""
        return self.kv_len


@attrs.frozen(kw_only=True, cache_hash=True)
class Elementwise:
    """A memory-bound kernel over ``tokens x width`` elements. ``parts``: the partials a
    merge reads (``splitkv_combine``, ``attn_merge``: ``tokens`` are (query, head) rows and
    ``width`` is ``d_v``) or the experts per token (``moe_topk``: ``width`` is the expert
    count; ``moe_unpermute``: ``tokens`` are the (token, expert) slots); ``kv_append``:
    ``width`` KV elements per token of ``act_bytes`` each (the cache's dtype)."""

    tokens: float = _num()
    width: float = _num()
    kind: str = attrs.field(validator=attrs.validators.in_(ELEMENTWISE_KINDS))
    act_bytes: float = _num()
    parts: float = attrs.field(converter=float, default=1.0, validator=_nonneg)

    op_class = "elementwise"

    def _work(self) -> tuple[float, float]:
        t, w, b = self.tokens, self.width, self.act_bytes
        if self.kind == "residual_add":
            return F.residual_add(t, w, b)
        if self.kind == "swiglu":
            return F.swiglu(t, w, b)
        if self.kind == "fp8_quant":
            return F.fp8_quantize(t, w, b)
        if self.kind == "kv_append":
            return F.kv_cache_append(t, w, b)
        if self.kind in ("splitkv_combine", "attn_merge"):
            return F.partials_merge(t, w, self.parts, b)
        if self.kind == "moe_topk":
            return F.moe_topk(t, w, self.parts)
        if self.kind == "moe_permute":
            return F.moe_permute(t, w, b)
        if self.kind == "moe_unpermute":
            return F.moe_unpermute(t, w, self.parts, b)
        if self.kind == "logits_cast":
            return F.logits_cast(t, w, b)
        if self.kind == "argmax":
            return F.greedy_argmax(t, w)
        return F.elementwise(t, w, b)

    def describe(self) -> str:
        extra = f",parts={self.parts:g}" if self.parts != 1 else ""
        return f"{self.kind}(tokens={self.tokens:g},width={self.width:g}{extra})"

    @property
    def flops(self) -> float:
        return 0.0 if self.kind == "embedding" else self._work()[0]

    @property
    def hbm_bytes(self) -> float:
        return self._work()[1]


Kernel = Union[Gemm, Attention, Elementwise]


def describe_kernels(kernels, fusions=None) -> str:
    """The kernels of a compute op as the timeline shows them: each kernel's name and shape,
    its FLOPs and HBM bytes (:mod:`g5core.lower.flops`), separated by ``;``; with ``fusions``
    (g5core.inputs.framework.kernel_fusions), a fused kernel ends in ``fused=<fusion>``."""
    def one(i, k):
        text = f"{k.describe()} flops={k.flops!r} bytes={k.hbm_bytes!r}"
        if fusions is not None and fusions[i][1] is not None:
            text += f" fused={fusions[i][1]}"
        return text

    return "; ".join(one(i, k) for i, k in enumerate(kernels))


def scaled_kernel(kernel: Kernel, factor: float) -> Kernel:
    """The same kernel over ``factor`` times the rows (GEMM ``m``, attention ``batch``,
    elementwise ``tokens``): ``factor`` times the work, same weights per row."""
    if isinstance(kernel, Gemm):
        return attrs.evolve(kernel, m=kernel.m * factor)
    if isinstance(kernel, Attention):
        return attrs.evolve(kernel, batch=kernel.batch * factor)
    return attrs.evolve(kernel, tokens=kernel.tokens * factor)
