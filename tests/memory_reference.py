"""The per-chip memory ledger: weights, KV cache, activations, workspace.

The core computes the terms that follow from the sharded shapes (one formula each, below);
plugins add named terms only they know through ``g5_memory_terms``. Nothing here needs the
op DAG, so the Math path reports the same ledger.
"""
from __future__ import annotations

import math

import attrs

from g5core.api.errors import PluginError
from g5core.api.records import CATEGORIES, MemoryTerm

GIB = float(2 ** 30)


def kv_cache_bytes(batch: int, seq_len: int, kv_bytes_per_token_per_layer: int, layers: int,
                   seq_shards: int, head_shards: int) -> float:
    """Per-chip KV cache: ``b * S * c_kv * L_local / (seq_shards * head_shards)``.

    ``seq_shards`` is cp (the spec's formula ``b * S * c_kv * L_local / cp``); ``head_shards``
    divides GQA KV heads across TP, times any further head split of the stored cache
    (``kv_cache_heads``, e.g. Ulysses); 1 for MLA's latent unless a plugin splits it.
    """
    return batch * seq_len * kv_bytes_per_token_per_layer * layers / (seq_shards * head_shards)


def kv_bytes_on(m, dep, s, c_kv: int, layers: list[int]) -> float:
    """KV cache of the layers one chip holds: a windowed layer keeps at most its window of
    tokens per sequence (:meth:`ModelSpec.kv_tokens`), a full layer the whole context."""
    groups: dict[int, int] = {}
    for layer in layers:
        tokens = m.kv_tokens(layer, dep.seq_len)
        groups[tokens] = groups.get(tokens, 0) + 1
    if not groups:
        groups = {dep.seq_len: 0}
    return math.fsum(kv_cache_bytes(dep.batch, tokens, c_kv, n, s.factor("kv_len"), s.kv_shard * s.kv_cache_shard)
                     for tokens, n in groups.items())


def activation_peak_bytes(ctx, layers: list[int]) -> float:
    """Peak live activation bytes of one forward step on one chip.

    ``act_bytes * (tokens * (2 * hidden + W))``: the residual stream and the current op's
    input (``2 * hidden`` per token) plus the widest intermediate ``W`` per token among the
    chip's layers: the Q/K/V projection outputs, the attention output, the gated-FFN
    ``2 * ffn_cols`` (gate and up), the shared expert's, and the routed experts'
    ``top_k * 2 * expert_cols`` scaled by the share of tokens the chip routes. Attention is
    fused (flash): no score matrix is stored. ``tokens`` is the chip's local token count,
    so sequence-direction activations divide by cp in prefill.
    """
    if not layers:
        return 0.0
    from g5core.lower.layers import attention_dims, local_projections

    m, s = ctx.model, ctx.shape
    d = m.hidden_size
    widths = [sum(o for name, _, o in local_projections(m, s) if name != "o_proj" and not name.endswith("_a_proj"))]
    widths.append(s.q_heads * attention_dims(m, ctx.deployment.phase)[1])
    if any(not m.is_moe_layer(layer) for layer in layers):
        widths.append(2.0 * s.ffn_cols)
    if m.moe is not None and any(m.is_moe_layer(layer) for layer in layers):
        widths.append(2.0 * m.moe.n_shared_experts * m.moe.shared_expert_ffn_dim / s.factor("ffn_cols"))
        share = s.moe_tokens / s.tokens if s.tokens else 0.0
        widths.append(share * m.moe.n_active_experts * (d + 2.0 * s.expert_cols))
    return ctx.deployment.dtypes.activation_element_bytes * s.tokens * (2.0 * d + max(widths))


@attrs.frozen(kw_only=True)
class ChipMemory:
    chip: int
    weights_bytes: float
    kv_cache_bytes: float
    activation_bytes: float
    workspace_bytes: float
    total_bytes: float
    capacity_bytes: int
    fits: bool


@attrs.frozen
class MemoryReport:
    per_chip: tuple[ChipMemory, ...]
    terms: tuple[MemoryTerm, ...]

    @property
    def max_total_bytes(self) -> float:
        return max(c.total_bytes for c in self.per_chip)

    @property
    def fits(self) -> bool:
        return all(c.fits for c in self.per_chip)

    def shortfall_summary(self) -> str:
        """'' when every chip fits, else 'does not fit by X GiB on chips ...'."""
        over = [c for c in self.per_chip if not c.fits]
        if not over:
            return ""
        worst = max(c.total_bytes - c.capacity_bytes for c in over)
        chips = _ranges([c.chip for c in over])
        where = f"chips {chips}" if len(over) > 1 else f"chip {chips}"
        return f"does not fit by {worst / GIB:.2f} GiB on {where} (of {over[0].capacity_bytes / GIB:.1f} GiB each)"

    def to_json_dict(self) -> dict:
        return {
            "per_chip": [attrs.asdict(c) for c in self.per_chip],
            "max_total_bytes": self.max_total_bytes,
            "fits": self.fits,
            "terms": {t.name: {"category": t.category, "max_bytes": max((b for _, b in t.bytes_per_chip), default=0.0),
                               **({"part_of": t.part_of} if t.part_of else {})}
                      for t in self.terms},
        }


def _ranges(chips: list[int]) -> str:
    chips = sorted(chips)
    parts, start, prev = [], chips[0], chips[0]
    for c in chips[1:] + [None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(parts)


def weight_bytes_by_chip(ctx, kinds=None) -> tuple[dict[int, float], dict[int, list[int]]]:
    """Weight bytes each chip holds, of the logical ops of ``kinds`` (None: every op), and
    the decoder layers each chip holds (the one formula: weight elements x their bytes)."""
    from g5core.lower.layers import WEIGHT_CLASS, build_program, weight_elements

    m, dep, s = ctx.model, ctx.deployment, ctx.shape
    weights: dict[int, float] = {c: 0.0 for c in ctx.all_chips}
    layers_on: dict[int, list[int]] = {c: [] for c in ctx.all_chips}
    per_layer: dict[int, float] = {}
    for lop in build_program(m):
        if kinds is not None and lop.kind not in kinds:
            per_layer.setdefault(lop.layer, 0.0)
            continue
        wclass = WEIGHT_CLASS.get(lop.kind, "default")
        per_layer[lop.layer] = per_layer.get(lop.layer, 0.0) + (
            weight_elements(lop.kind, m, s) * dep.dtypes.weight_element_bytes(wclass))
    for layer, nbytes in per_layer.items():
        for c in ctx.layer_chips(layer):
            weights[c] += nbytes
            if 0 <= layer < m.n_layers:
                layers_on[c].append(layer)
    return weights, layers_on


def core_terms(ctx) -> list[MemoryTerm]:
    """Weights, KV cache and activations from the sharded shapes and the layers each chip holds."""
    m, dep, s = ctx.model, ctx.deployment, ctx.shape
    weights, layers_on = weight_bytes_by_chip(ctx)
    c_kv = m.kv_bytes_per_token_per_layer(dep.dtypes.kv_cache_element_bytes)
    kv = {c: ctx.resident_batches * kv_bytes_on(m, dep, s, c_kv, layers_on[c]) for c in ctx.all_chips}
    acts = {c: activation_peak_bytes(ctx, layers_on[c]) for c in ctx.all_chips}
    return [
        MemoryTerm(name="weights", category="weights", bytes_per_chip=weights),
        MemoryTerm(name="kv_cache", category="kv_cache", bytes_per_chip=kv),
        MemoryTerm(name="activations", category="activations", bytes_per_chip=acts),
    ]


def memory_report(ctx) -> MemoryReport:
    terms = core_terms(ctx)
    for plugin, answer in ctx.hooks.call_each("g5_memory_terms", ctx=ctx):
        for term in answer:
            if not isinstance(term, MemoryTerm):
                raise PluginError(plugin, f"g5_memory_terms must yield MemoryTerm values, got {term!r}")
            if any(b < 0 for _, b in term.bytes_per_chip):
                raise PluginError(plugin, f"memory term {term.name!r} has negative bytes")
            if term.name in {t.name for t in terms}:
                raise PluginError(plugin, f"memory term {term.name!r} is already contributed")
            if term.part_of:
                whole = next((t for t in terms if t.name == term.part_of), None)
                if whole is None or whole.part_of or whole.category != term.category:
                    raise PluginError(plugin, f"memory term {term.name!r} is part of {term.part_of!r}, which is not "
                                              f"a {term.category} term of the ledger")
                if any(b > whole.on(c) * (1 + 1e-12) for c, b in term.bytes_per_chip):
                    raise PluginError(plugin, f"memory term {term.name!r} exceeds the {term.part_of!r} it is part of")
            terms.append(term)
    cap = ctx.system.hbm_capacity_bytes
    per_chip = []
    for c in ctx.all_chips:
        by_cat = {k: 0.0 for k in CATEGORIES}
        for t in terms:
            if not t.part_of:
                by_cat[t.category] += t.on(c)
        total = sum(by_cat.values())
        per_chip.append(ChipMemory(
            chip=c, weights_bytes=by_cat["weights"], kv_cache_bytes=by_cat["kv_cache"],
            activation_bytes=by_cat["activations"], workspace_bytes=by_cat["workspace"],
            total_bytes=total, capacity_bytes=cap, fits=total <= cap,
        ))
    return MemoryReport(per_chip=tuple(per_chip), terms=tuple(terms))
