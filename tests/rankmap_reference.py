"""Rank map: coordinates over the factor dimensions <-> chip id, and the groups of each dimension.

Chip ids are mixed-radix numbers over the factor dimensions in rank order, outermost first
(with the built-in plugins: dp, pp, cp, tp), so the innermost dimension (tp) varies
fastest and a TP group is a run of consecutive chips: it stays inside one node whenever
``tp <= chips_per_node`` and ``chips_per_node % tp == 0``.

A non-factor dimension (ep) regroups the chips that vary over the dimensions it names
(dp x sp x tp) at each fixed coordinate of the others (pp, cp): those chips, in chip-id order,
are cut into consecutive groups of its size.
"""
from __future__ import annotations

from typing import Mapping

import attrs

from g5core.api.dimensions import DimensionRegistry


@attrs.frozen(kw_only=True)
class RankMap:
    chips: int
    chips_per_node: int
    factor_names: tuple[str, ...]  # outermost first
    factor_sizes: tuple[int, ...]
    _groups: Mapping[str, tuple[tuple[int, ...], ...]] = attrs.field(repr=False)
    _group_index: Mapping[str, tuple[int, ...]] = attrs.field(repr=False)  # chip -> index into _groups

    @classmethod
    def build(cls, sizes: Mapping[str, int], dims: DimensionRegistry, chips_per_node: int) -> "RankMap":
        factors = dims.factors
        names = tuple(d.name for d in factors)
        fsizes = tuple(int(sizes.get(n, 1)) for n in names)
        chips = 1
        for s in fsizes:
            chips *= s
        all_coords = [cls._coords_of(c, fsizes) for c in range(chips)]
        groups: dict[str, tuple[tuple[int, ...], ...]] = {}
        for axis, name in enumerate(names):
            buckets: dict[tuple, list[int]] = {}
            for chip, co in enumerate(all_coords):
                key = co[:axis] + co[axis + 1:]
                buckets.setdefault(key, []).append(chip)
            groups[name] = tuple(tuple(b) for _, b in sorted(buckets.items()))
        for d in dims.dims:
            if d.factor:
                continue
            size = int(sizes.get(d.name, 1))
            over = {names.index(n) for n in d.regroups if n in names}
            buckets = {}
            for chip, co in enumerate(all_coords):
                key = tuple(v for i, v in enumerate(co) if i not in over)
                buckets.setdefault(key, []).append(chip)
            out = []
            for _, members in sorted(buckets.items()):
                if len(members) % size:
                    raise ValueError(f"{d.name}={size} does not divide {len(members)}")
                out.extend(tuple(members[i:i + size]) for i in range(0, len(members), size))
            groups[d.name] = tuple(out)
        index: dict[str, tuple[int, ...]] = {}
        for name, gs in groups.items():
            idx = [0] * chips
            for gi, g in enumerate(gs):
                for chip in g:
                    idx[chip] = gi
            index[name] = tuple(idx)
        return cls(chips=chips, chips_per_node=chips_per_node, factor_names=names, factor_sizes=fsizes, groups=groups,
                   group_index=index)

    @staticmethod
    def _coords_of(chip: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
        out = []
        for s in reversed(sizes):
            out.append(chip % s)
            chip //= s
        return tuple(reversed(out))

    # -- coordinates --------------------------------------------------------------------
    def coords(self, chip: int) -> dict[str, int]:
        if not 0 <= chip < self.chips:
            raise IndexError(f"chip {chip} out of range 0..{self.chips - 1}")
        return dict(zip(self.factor_names, self._coords_of(chip, self.factor_sizes)))

    def chip_of(self, **coords: int) -> int:
        chip = 0
        for name, size in zip(self.factor_names, self.factor_sizes):
            v = coords.get(name, 0)
            if not 0 <= v < size:
                raise IndexError(f"{name}={v} out of range 0..{size - 1}")
            chip = chip * size + v
        return chip

    def size(self, dim: str) -> int:
        if dim in self.factor_names:
            return self.factor_sizes[self.factor_names.index(dim)]
        gs = self._groups.get(dim)
        return len(gs[0]) if gs else 1

    # -- groups -------------------------------------------------------------------------
    def groups(self, dim: str) -> tuple[tuple[int, ...], ...]:
        """All groups of a dimension; a dimension no plugin registered has singleton groups."""
        if dim not in self._groups:
            return tuple((c,) for c in range(self.chips))
        return self._groups[dim]

    def group_of(self, dim: str, chip: int) -> tuple[int, ...]:
        if dim not in self._groups:
            return (chip,)
        return self._groups[dim][self._group_index[dim][chip]]

    def rank_in(self, dim: str, chip: int) -> int:
        return self.group_of(dim, chip).index(chip)

    @property
    def dims(self) -> tuple[str, ...]:
        return tuple(sorted(self._groups))

    # -- topology -----------------------------------------------------------------------
    def node_of(self, chip: int) -> int:
        return chip // self.chips_per_node

    def crosses_nodes(self, group) -> bool:
        return len({self.node_of(c) for c in group}) > 1

    @property
    def nodes(self) -> int:
        return -(-self.chips // self.chips_per_node)
