"""The per-chip memory ledger: weights, KV cache, activations, workspace.

The core computes the terms that follow from the sharded shapes (one formula each, below);
plugins add named terms only they know through ``g5_memory_terms``. Nothing here needs the
op DAG, so the Math path reports the same ledger.
"""
from __future__ import annotations

import math

import attrs
import numpy as np

from g5core.api.errors import PluginError
from g5core.api.records import CATEGORIES, MemoryTerm
from g5core.lower.layers import (
    WEIGHT_CLASS, attention_dims, build_program, group_kind, local_projections, weight_elements,
)

GIB = float(2 ** 30)


def kv_cache_bytes(context_tokens: int, kv_bytes_per_token_per_layer: int, layers: int,
                   seq_shards: int, head_shards: int) -> float:
    """Per-chip KV cache: ``tokens * c_kv * L_local / (seq_shards * head_shards)``.

    ``context_tokens`` are the KV tokens of every sequence of the replica after the step,
    ``sum(count * (cached + new))`` (``b * S`` for the shorthand: the spec's formula
    ``b * S * c_kv * L_local / cp``). ``seq_shards`` is cp; ``head_shards``
    divides GQA KV heads across TP, times any further head split of the stored cache
    (``kv_cache_heads``, e.g. Ulysses); 1 for MLA's latent unless a plugin splits it.
    """
    return context_tokens * kv_bytes_per_token_per_layer * layers / (seq_shards * head_shards)


def kv_bytes_on(m, dep, s, c_kv: int, layers: list[int]) -> float:
    """KV cache of the layers one chip holds, for every sequence of the step (its cached and
    new tokens): a windowed layer keeps at most its window of tokens per sequence
    (:meth:`ModelSpec.kv_tokens`), a full layer the whole context."""
    groups: dict[int, int] = {}  # KV tokens of the replica in one layer -> layers holding that many
    for layer in layers:
        tokens = sum(g.count * m.kv_tokens(layer, g.context_tokens) for g in dep.step)
        groups[tokens] = groups.get(tokens, 0) + 1
    if not groups:
        groups = {dep.step.context_tokens: 0}
    return math.fsum(kv_cache_bytes(tokens, c_kv, n, s.factor("kv_len"), s.kv_shard * s.kv_cache_shard)
                     for tokens, n in groups.items())


def activation_peak_bytes(ctx, layers: list[int]) -> float:
    """Peak live activation bytes of one forward step on one chip.

    ``act_bytes * (tokens * (2 * hidden + W))``: the residual stream and the current op's
    input (``2 * hidden`` per token) plus the widest intermediate ``W`` per token among the
    chip's layers: the Q/K/V projection outputs, the attention output, the gated-FFN
    ``2 * ffn_cols`` (gate and up), the shared expert's, and the routed experts'
    ``top_k * 2 * expert_cols`` scaled by the share of tokens the chip routes. Attention is
    fused (flash): no score matrix is stored. ``tokens`` is the chip's local token count,
    so sequence-direction activations divide by cp in prefill; in a step it is the step's new
    tokens only (a chunk of a long prompt needs the activations of the chunk, not the prompt),
    and in a chunked prefill through a pipeline those of its largest chunk.
    """
    if not layers:
        return 0.0

    m, s = ctx.model, ctx.activation_shape or ctx.shape
    d = m.hidden_size
    widths = [sum(o for name, _, o in local_projections(m, s) if name != "o_proj" and not name.endswith("_a_proj"))]
    phases = (ctx.deployment.phase,) if s.uniform else tuple({group_kind(g): 1 for g in s.groups})
    widths.extend(s.q_heads * attention_dims(m, phase)[1] for phase in phases)
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


@attrs.frozen(eq=False)
class MemoryReport:
    """Every chip's ledger, stored as one array per column (``weights_bytes``, ...,
    ``total_bytes``, by chip id); ``per_chip`` makes the :class:`ChipMemory` rows on first use."""

    columns: Mapping[str, np.ndarray] = attrs.field(repr=False)
    terms: tuple[MemoryTerm, ...]
    capacity_bytes: int = 0
    _rows: list = attrs.field(factory=list, repr=False)  # per_chip, once made

    COLUMNS = ("weights_bytes", "kv_cache_bytes", "activation_bytes", "workspace_bytes", "total_bytes")

    def __eq__(self, other) -> bool:
        if not isinstance(other, MemoryReport):
            return NotImplemented
        return (self.terms == other.terms and self.capacity_bytes == other.capacity_bytes
                and all(np.array_equal(self.columns[k], other.columns[k]) for k in self.COLUMNS))

    __hash__ = None

    @property
    def per_chip(self) -> tuple[ChipMemory, ...]:
        if not self._rows:
            cap = self.capacity_bytes
            cols = [self.columns[k].tolist() for k in self.COLUMNS]
            self._rows.append(tuple(
                ChipMemory(chip=c, weights_bytes=w, kv_cache_bytes=kv, activation_bytes=a, workspace_bytes=ws,
                           total_bytes=tot, capacity_bytes=cap, fits=tot <= cap)
                for c, (w, kv, a, ws, tot) in enumerate(zip(*cols))))
        return self._rows[0]

    @property
    def chips(self) -> int:
        return len(self.columns["total_bytes"])

    @property
    def max_total_bytes(self) -> float:
        return float(self.columns["total_bytes"].max())

    @property
    def fits(self) -> bool:
        return bool((self.columns["total_bytes"] <= self.capacity_bytes).all())

    def worst(self) -> ChipMemory:
        """The chip with the largest total (the lowest id among equals)."""
        return self.row(int(np.argmax(self.columns["total_bytes"])))

    def row(self, chip: int) -> ChipMemory:
        """One chip's ledger (without making every row)."""
        w, kv, a, ws, tot = (float(self.columns[k][chip]) for k in self.COLUMNS)
        return ChipMemory(chip=chip, weights_bytes=w, kv_cache_bytes=kv, activation_bytes=a, workspace_bytes=ws,
                          total_bytes=tot, capacity_bytes=self.capacity_bytes, fits=tot <= self.capacity_bytes)

    def shortfall_summary(self) -> str:
        """'' when every chip fits, else 'does not fit by X GiB on chips ...'."""
        total = self.columns["total_bytes"]
        over = np.flatnonzero(total > self.capacity_bytes)
        if not len(over):
            return ""
        worst = float((total[over] - self.capacity_bytes).max())
        chips = _ranges(over.tolist())
        where = f"chips {chips}" if len(over) > 1 else f"chip {chips}"
        return f"does not fit by {worst / GIB:.2f} GiB on {where} (of {self.capacity_bytes / GIB:.1f} GiB each)"

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


def _layer_weight_bytes(ctx, kinds=None) -> dict[int, float]:
    """One chip's weight bytes in each layer it holds, of the logical ops of ``kinds``
    (None: every op); the one formula: weight elements x their bytes."""
    m, dep, s = ctx.model, ctx.deployment, ctx.shape
    per_layer: dict[int, float] = {}
    per_kind: dict[str, float] = {}  # one chip's weight bytes of a kind: the same in every layer
    for lop in build_program(m):
        if kinds is not None and lop.kind not in kinds:
            per_layer.setdefault(lop.layer, 0.0)
            continue
        if lop.kind not in per_kind:
            wclass = WEIGHT_CLASS.get(lop.kind, "default")
            per_kind[lop.kind] = weight_elements(lop.kind, m, s) * dep.dtypes.weight_element_bytes(wclass)
        per_layer[lop.layer] = per_layer.get(lop.layer, 0.0) + per_kind[lop.kind]
    return per_layer


def _chip_groups(ctx, layers) -> tuple[np.ndarray, np.ndarray, dict[int, int]]:
    """The chips grouped by the layers they hold: ``(groups, inverse, set_of_layer)``, where
    ``groups[g, set_of_layer[layer]]`` says whether the chips of group ``g`` hold ``layer``
    and ``inverse[c]`` is chip ``c``'s group."""
    n = ctx.rankmap.chips
    sets: dict[tuple, int] = {}
    set_of_layer: dict[int, int] = {}
    for layer in layers:
        set_of_layer[layer] = sets.setdefault(ctx.layer_chips(layer), len(sets))
    member = np.zeros((len(sets), n), dtype=bool)
    for chips, j in sets.items():
        member[j, np.asarray(chips, dtype=np.int64)] = True
    groups, inverse = np.unique(member.T, axis=0, return_inverse=True) if n else \
        (np.zeros((0, len(sets)), dtype=bool), np.zeros(0, dtype=np.int64))
    return groups, np.asarray(inverse).reshape(-1), set_of_layer


def weight_bytes_per_chip(ctx, kinds=None) -> np.ndarray:
    """The ledger's weight bytes on every chip ``0 .. n - 1``, of the logical ops of ``kinds``
    (None: every op, the ``weights`` term itself): the same sums, in the same order, as the
    ledger's (:func:`core_terms`), e.g. the attention weights a plugin replicates."""
    per_layer = _layer_weight_bytes(ctx, kinds)
    groups, inverse, set_of_layer = _chip_groups(ctx, per_layer)
    return np.asarray([_held(per_layer, row, set_of_layer)[0] for row in groups], dtype=float)[inverse]


def _held(per_layer: dict[int, float], row, set_of_layer: dict[int, int]) -> tuple[float, list[int]]:
    """A chip group's weight bytes (summed in layer order) and the layers it holds."""
    weights, layers_on = 0.0, []
    for layer, nbytes in per_layer.items():
        if row[set_of_layer[layer]]:
            weights += nbytes
            layers_on.append(layer)
    return weights, layers_on


def core_terms(ctx) -> list[MemoryTerm]:
    """Weights, KV cache and activations from the sharded shapes and the layers each chip holds.

    Chips that hold the same layers hold the same bytes: the chips are grouped by the
    layers they hold (numpy, from the distinct chip sets of the layers) and each term is
    worked out once per group, in the same order of additions as chip by chip."""
    m, dep, s = ctx.model, ctx.deployment, ctx.shape
    per_layer = _layer_weight_bytes(ctx)
    groups, inverse, set_of_layer = _chip_groups(ctx, per_layer)
    c_kv = m.kv_bytes_per_token_per_layer(dep.dtypes.kv_cache_element_bytes)
    w_g, kv_g, act_g = [], [], []
    for row in groups:
        weights, held = _held(per_layer, row, set_of_layer)
        layers_on = [layer for layer in held if 0 <= layer < m.n_layers]
        w_g.append(weights)
        # decode micro-batches cycling through the pipeline each keep their sequences' KV
        kv_g.append(ctx.resident_batches * kv_bytes_on(m, dep, s, c_kv, layers_on))
        act_g.append(activation_peak_bytes(ctx, layers_on))
    return [MemoryTerm.from_vector(name, name, np.asarray(values, dtype=float)[inverse])
            for name, values in (("weights", w_g), ("kv_cache", kv_g), ("activations", act_g))]


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
    n = ctx.rankmap.chips
    # per category, the terms added in their order (as chip by chip: the same sums)
    by_cat = {k: np.zeros(n) for k in CATEGORIES}
    for t in terms:
        if not t.part_of:
            by_cat[t.category] += t.vector(n)
    total = by_cat["weights"] + by_cat["kv_cache"] + by_cat["activations"] + by_cat["workspace"]
    columns = {"weights_bytes": by_cat["weights"], "kv_cache_bytes": by_cat["kv_cache"],
               "activation_bytes": by_cat["activations"], "workspace_bytes": by_cat["workspace"], "total_bytes": total}
    return MemoryReport(columns=columns, terms=tuple(terms), capacity_bytes=cap)
