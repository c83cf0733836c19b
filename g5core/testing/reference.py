"""Numerical reference for the attention splits G5 models (numpy, float64, small sizes).

G5 never runs attention; it counts FLOPs and bytes. This module checks that what the plugins
count is what the splits really need, by computing one layer's causal attention four ways
and comparing them:

(a) :func:`causal_attention`: monolithic;
(b) :func:`passkv_ring`: context parallel prefill, pass-KV: ``cp`` ranks each hold a balanced
    pair of sequence chunks and pass K/V around a ring, merging partial results by online
    softmax (running max, numerator, denominator);
(c) :func:`passq_decode`: context parallel decode, pass-Q: each rank attends the new query to
    its KV shard and sends a :class:`Partial` (numerator plus per-head max and denominator) to
    the root, which merges them (the three-quantity reduction);
(d) :func:`ulysses_attention`: Ulysses sequence parallelism: sequence-sharded Q/K/V go
    through an all-to-all into head shards over the full sequence, and back.

Shapes: ``q`` is ``[tokens, q_heads, d_qk]``, ``k`` ``[tokens, kv_heads, d_qk]``, ``v``
``[tokens, kv_heads, d_v]``; GQA query head ``h`` reads KV head ``h // (q_heads // kv_heads)``.
MLA (absorbed, as decoded) is GQA with one KV "head" (the latent) shared by every query
head: :func:`mla_absorbed_qkv` builds those tensors from the latent and the weights.
"""
from __future__ import annotations

from typing import Sequence

import attrs
import numpy as np

from g5core.lower.flops import passq_reduce_elements  # noqa: F401  (the formula the oracle checks)


def _expand_kv(x: np.ndarray, q_heads: int) -> np.ndarray:
    """KV heads repeated to one per query head (GQA grouping)."""
    group = q_heads // x.shape[1]
    if group * x.shape[1] != q_heads:
        raise ValueError(f"{q_heads} query heads do not group onto {x.shape[1]} KV heads")
    return np.repeat(x, group, axis=1)


@attrs.frozen(eq=False)
class Partial:
    """Attention of some queries over a subset of the keys, not yet normalised.

    ``m`` ``[q, H]``: running max of the scores; ``l`` ``[q, H]``: sum of ``exp(score - m)``;
    ``o`` ``[q, H, d_v]``: sum of ``exp(score - m) * v``. A query that saw no key has
    ``m = -inf``, ``l = 0``, ``o = 0``. These three are what a pass-Q partial must carry.
    """

    m: np.ndarray
    l: np.ndarray
    o: np.ndarray

    def result(self) -> np.ndarray:
        """The attention output ``o / l`` (every query must have seen at least one key)."""
        return self.o / self.l[..., None]

    def elements_per_query(self) -> int:
        """Numbers one query token's partial carries: ``H * d_v + 2 H``."""
        return int(self.o[0].size + self.m[0].size + self.l[0].size)


def partial_attention(q, k, v, q_pos, k_pos, scale: float | None = None) -> Partial:
    """Causal attention of queries at positions ``q_pos`` over keys at ``k_pos`` (unnormalised)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    heads = q.shape[1]
    scale = 1.0 / np.sqrt(q.shape[2]) if scale is None else scale
    kk, vv = _expand_kv(k, heads), _expand_kv(v, heads)
    scores = np.einsum("qhd,khd->qhk", q, kk) * scale
    visible = np.asarray(q_pos)[:, None] >= np.asarray(k_pos)[None, :]
    scores = np.where(visible[:, None, :], scores, -np.inf)
    m = scores.max(axis=2) if scores.shape[2] else np.full(scores.shape[:2], -np.inf)
    safe_m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(scores - safe_m[..., None])
    return Partial(m=m, l=p.sum(axis=2), o=np.einsum("qhk,khd->qhd", p, vv))


def merge(a: Partial, b: Partial) -> Partial:
    """Online-softmax merge of two partials of the same queries over disjoint keys."""
    m = np.maximum(a.m, b.m)
    safe = np.where(np.isfinite(m), m, 0.0)
    wa = np.where(np.isfinite(a.m), np.exp(a.m - safe), 0.0)
    wb = np.where(np.isfinite(b.m), np.exp(b.m - safe), 0.0)
    return Partial(m=m, l=a.l * wa + b.l * wb, o=a.o * wa[..., None] + b.o * wb[..., None])


def merge_all(parts: Sequence[Partial]) -> Partial:
    out = parts[0]
    for p in parts[1:]:
        out = merge(out, p)
    return out


def causal_attention(q, k, v, scale: float | None = None) -> np.ndarray:
    """(a) Monolithic causal attention, ``[tokens, q_heads, d_v]``."""
    pos = np.arange(len(q))
    return partial_attention(q, k, v, pos, pos, scale).result()


# ------------------------------------------------------------------------------ (b) pass-KV


def balanced_chunks(seq_len: int, cp: int) -> list[np.ndarray]:
    """Token positions each CP rank holds: chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``."""
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len={seq_len} is not divisible by 2 x cp = {2 * cp}")
    c = seq_len // (2 * cp)
    return [np.concatenate([np.arange(r * c, (r + 1) * c), np.arange((2 * cp - 1 - r) * c, (2 * cp - r) * c)])
            for r in range(cp)]


def ring_step_pairs(seq_len: int, cp: int) -> np.ndarray:
    """``[cp, cp]``: causal (query, key) pairs rank ``r`` computes in ring step ``i`` (the work)."""
    chunks = balanced_chunks(seq_len, cp)
    out = np.zeros((cp, cp), dtype=np.int64)
    for r in range(cp):
        for i in range(cp):
            src = (r - i) % cp
            out[r, i] = int((chunks[r][:, None] >= chunks[src][None, :]).sum())
    return out


def passkv_ring(q, k, v, cp: int, scale: float | None = None) -> np.ndarray:
    """(b) Pass-KV ring: in step ``i`` rank ``r`` holds the KV block of rank ``r - i`` and
    merges its partial into a running (max, numerator, denominator)."""
    chunks = balanced_chunks(len(q), cp)
    out = np.empty((q.shape[0], q.shape[1], v.shape[2]))
    for r in range(cp):
        mine = chunks[r]
        acc = None
        for i in range(cp):
            src = chunks[(r - i) % cp]
            part = partial_attention(q[mine], k[src], v[src], mine, src, scale)
            acc = part if acc is None else merge(acc, part)
        out[mine] = acc.result()
    return out


# ------------------------------------------------------------------------------- (c) pass-Q


def passq_partials(q_last, k, v, cp: int, scale: float | None = None) -> list[Partial]:
    """The partials each of ``cp`` ranks sends the root for the newest token ``q_last``
    (``[1, q_heads, d_qk]``, at position ``len(k) - 1``); rank ``r`` holds KV chunk ``r``."""
    pos = np.array([len(k) - 1])
    shards = np.array_split(np.arange(len(k)), cp)
    return [partial_attention(q_last, k[s], v[s], pos, s, scale) for s in shards]


def passq_decode(q_last, k, v, cp: int, scale: float | None = None) -> np.ndarray:
    """(c) Pass-Q decode: the root merges every rank's partial (three-quantity reduction)."""
    return merge_all(passq_partials(q_last, k, v, cp, scale)).result()




def up_project(p: Partial, w_uv: np.ndarray) -> Partial:
    """Apply a per-head linear map ``w_uv`` ``[H, d_in, d_out]`` to a partial's numerator."""
    return Partial(m=p.m, l=p.l, o=np.einsum("qhr,hrd->qhd", p.o, w_uv))


def mla_absorbed_qkv(h_q, latent, k_rope, w_uk, q_rope):
    """MLA in the absorbed form: every query head attends to the shared latent.

    ``latent`` ``[S, r]`` (the cached ``c_kv``), ``k_rope`` ``[S, dr]`` (the shared rope key),
    ``h_q`` ``[Sq, H, d_nope]`` (no-rope query), ``w_uk`` ``[H, d_nope, r]``, ``q_rope``
    ``[Sq, H, dr]``. Returns ``(q, k, v)`` with one KV head: ``q = [h_q W_UK, q_rope]``,
    ``k = [latent, k_rope]``, ``v = latent``.
    """
    q = np.concatenate([np.einsum("qhn,hnr->qhr", h_q, w_uk), q_rope], axis=2)
    k = np.concatenate([latent, k_rope], axis=1)[:, None, :]
    return q, k, latent[:, None, :]


# ------------------------------------------------------------------------------ (d) Ulysses


def all_to_all(blocks: Sequence[Sequence[np.ndarray]]) -> list[list[np.ndarray]]:
    """``blocks[src][dst]`` -> ``out[dst][src]``: what every rank receives from every rank."""
    n = len(blocks)
    return [[blocks[src][dst] for src in range(n)] for dst in range(n)]


def kv_heads_per_rank(kv_heads: int, sp: int) -> list[list[int]]:
    """KV heads each of ``sp`` ranks holds: a disjoint ``kv_heads / sp`` when ``sp`` divides
    them, else each rank holds the single KV head its query heads read (replicated
    ``sp / kv_heads`` times)."""
    if kv_heads >= sp:
        if kv_heads % sp:
            raise ValueError(f"{kv_heads} KV heads do not split over sp={sp}")
        per = kv_heads // sp
        return [list(range(r * per, (r + 1) * per)) for r in range(sp)]
    if sp % kv_heads:
        raise ValueError(f"sp={sp} cannot replicate {kv_heads} KV heads evenly")
    return [[r * kv_heads // sp] for r in range(sp)]


def ulysses_attention(q, k, v, sp: int, scale: float | None = None) -> tuple[np.ndarray, dict]:
    """(d) Ulysses: rank ``r`` starts with tokens ``r*S/sp .. (r+1)*S/sp`` of Q, K, V (all
    heads); an all-to-all gives it the full sequence for query heads ``r*H/sp ..`` and the KV
    heads they read; attention; the reverse all-to-all returns its tokens, all heads.

    Returns the output and the elements each rank sends to *other* ranks per tensor
    (``q``, ``k``, ``v``, ``out``), for the byte formulas.
    """
    seq, heads = q.shape[0], q.shape[1]
    if seq % sp or heads % sp:
        raise ValueError(f"tokens {seq} and query heads {heads} must divide by sp={sp}")
    toks = np.array_split(np.arange(seq), sp)
    hq = heads // sp
    qh = [list(range(r * hq, (r + 1) * hq)) for r in range(sp)]
    kvh = kv_heads_per_rank(k.shape[1], sp)
    sent = {}

    def exchange(x, head_sets, name):
        blocks = [[x[toks[src]][:, head_sets[dst]] for dst in range(sp)] for src in range(sp)]
        sent[name] = sum(blocks[0][dst].size for dst in range(1, sp))
        return [np.concatenate(row, axis=0) for row in all_to_all(blocks)]  # [S, heads of dst, d]

    qs, ks, vs = exchange(q, qh, "q"), exchange(k, kvh, "k"), exchange(v, kvh, "v")
    outs = []
    for r in range(sp):
        # local KV head index for each local query head
        group = heads // k.shape[1]
        local = [kvh[r].index(h // group) for h in qh[r]]
        pos = np.arange(seq)
        outs.append(partial_attention(qs[r], ks[r][:, local], vs[r][:, local], pos, pos, scale).result())
    # reverse: rank r sends tokens of rank dst for its heads
    back = [[outs[src][toks[dst]] for dst in range(sp)] for src in range(sp)]
    sent["out"] = sum(back[0][dst].size for dst in range(1, sp))
    out = np.concatenate([np.concatenate(row, axis=1) for row in all_to_all(back)], axis=0)
    return out, sent
