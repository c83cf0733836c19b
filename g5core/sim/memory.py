"""The per-chip memory ledger: weights, KV cache, activations, workspace.

The core computes the terms that follow from the sharded shapes (one formula each, below);
plugins add named terms only they know through ``g5_memory_terms``. Nothing here needs the
op DAG, so the Math path reports the same ledger.
"""
from __future__ import annotations

from typing import Mapping

import attrs
import numpy as np

from g5core.api.errors import PluginError

CATEGORIES = ("weights", "kv_cache", "activations", "workspace")
GIB = float(2 ** 30)


class _ChipItems(tuple):
    """``(chip, bytes)`` pairs already in MemoryTerm's form (sorted, int and float)."""


def _chip_items(value) -> tuple[tuple[int, float], ...]:
    if type(value) is _ChipItems:
        return value
    if isinstance(value, Mapping):
        value = value.items()
    return tuple(sorted((int(c), float(b)) for c, b in value))


@attrs.frozen
class MemoryTerm:
    """A named per-chip memory term. ``bytes_per_chip`` maps chip -> bytes (absent = 0)."""

    name: str
    category: str = attrs.field(validator=attrs.validators.in_(CATEGORIES))
    bytes_per_chip: tuple[tuple[int, float], ...] = attrs.field(converter=_chip_items)
    _lookup: dict = attrs.field(init=False, repr=False, eq=False, factory=dict)  # "on": chip -> bytes; "vector"

    def on(self, chip: int) -> float:
        table = self._lookup.get("on")
        if table is None:
            table = self._lookup["on"] = dict(self.bytes_per_chip)
        return table.get(chip, 0.0)

    def vector(self, chips: int) -> np.ndarray:
        """Bytes on every chip ``0 .. chips - 1`` (0 where absent) as one array."""
        if "vector" in self._lookup and len(self._lookup["vector"]) == chips:
            return self._lookup["vector"]
        out = np.zeros(chips)
        if self.bytes_per_chip:
            ids, values = zip(*self.bytes_per_chip)
            out[np.asarray(ids, dtype=np.int64)] = values
        return out

    @classmethod
    def from_vector(cls, name: str, category: str, values: np.ndarray) -> "MemoryTerm":
        """A term holding ``values[c]`` bytes on every chip ``c`` (made without a Python
        step per chip but the pairs themselves)."""
        term = cls(name, category, _ChipItems(zip(range(len(values)), np.asarray(values, dtype=float).tolist())))
        term._lookup["vector"] = np.asarray(values, dtype=float)
        return term


def kv_cache_bytes(batch: int, seq_len: int, kv_bytes_per_token_per_layer: int, layers: int,
                   seq_shards: int, head_shards: int) -> float:
    """Per-chip KV cache: ``b * S * c_kv * L_local / (seq_shards * head_shards)``.

    ``seq_shards`` is cp (the spec's formula ``b * S * c_kv * L_local / cp``); ``head_shards``
    divides GQA KV heads across TP, times any further head split of the stored cache
    (``kv_cache_heads``, e.g. Ulysses); 1 for MLA's latent unless a plugin splits it.
    """
    return batch * seq_len * kv_bytes_per_token_per_layer * layers / (seq_shards * head_shards)


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
    from g5core.build.layers import attention_dims, local_projections

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


@attrs.frozen
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
            "terms": {t.name: {"category": t.category, "max_bytes": max((b for _, b in t.bytes_per_chip), default=0.0)}
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


def core_terms(ctx) -> list[MemoryTerm]:
    """Weights, KV cache and activations from the sharded shapes and the layers each chip holds.

    Chips that hold the same layers hold the same bytes: the chips are grouped by the
    layers they hold (numpy, from the distinct chip sets of the layers) and each term is
    worked out once per group, in the same order of additions as chip by chip."""
    from g5core.build.layers import WEIGHT_CLASS, build_program, weight_elements

    m, dep, s = ctx.model, ctx.deployment, ctx.shape
    n = ctx.rankmap.chips
    per_layer: dict[int, float] = {}
    for lop in build_program(m):
        wclass = WEIGHT_CLASS.get(lop.kind, "default")
        per_layer[lop.layer] = per_layer.get(lop.layer, 0.0) + (
            weight_elements(lop.kind, m, s) * dep.dtypes.weight_element_bytes(wclass))
    # the distinct chip sets of the layers, and each chip's group: the sets it is in
    sets: dict[tuple, int] = {}
    set_of_layer: dict[int, int] = {}
    for layer in per_layer:
        set_of_layer[layer] = sets.setdefault(ctx.layer_chips(layer), len(sets))
    member = np.zeros((len(sets), n), dtype=bool)
    for chips, j in sets.items():
        member[j, np.asarray(chips, dtype=np.int64)] = True
    groups, inverse = np.unique(member.T, axis=0, return_inverse=True) if n else \
        (np.zeros((0, len(sets)), dtype=bool), np.zeros(0, dtype=np.int64))
    inverse = np.asarray(inverse).reshape(-1)
    c_kv = m.kv_bytes_per_token_per_layer(dep.dtypes.kv_cache_element_bytes)
    w_g, kv_g, act_g = [], [], []
    for row in groups:
        weights, layers_on = 0.0, []
        for layer, nbytes in per_layer.items():
            if row[set_of_layer[layer]]:
                weights += nbytes
                if 0 <= layer < m.n_layers:
                    layers_on.append(layer)
        w_g.append(weights)
        kv_g.append(kv_cache_bytes(dep.batch, dep.seq_len, c_kv, len(layers_on), s.factor("kv_len"),
                                   s.kv_shard * s.kv_cache_shard))
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
            terms.append(term)
    cap = ctx.system.hbm_capacity_bytes
    n = ctx.rankmap.chips
    # per category, the terms added in their order (as chip by chip: the same sums)
    by_cat = {k: np.zeros(n) for k in CATEGORIES}
    for t in terms:
        by_cat[t.category] += t.vector(n)
    total = by_cat["weights"] + by_cat["kv_cache"] + by_cat["activations"] + by_cat["workspace"]
    columns = {"weights_bytes": by_cat["weights"], "kv_cache_bytes": by_cat["kv_cache"],
               "activation_bytes": by_cat["activations"], "workspace_bytes": by_cat["workspace"], "total_bytes": total}
    return MemoryReport(columns=columns, terms=tuple(terms), capacity_bytes=cap)
