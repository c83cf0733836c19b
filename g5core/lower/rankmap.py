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
import numpy as np

from g5core.api.dimensions import DimensionRegistry


class _Groups(Mapping):
    """Each dimension's groups, kept as a (groups x size) array and made into tuples of
    chip ids when first read (a run of many replicas reads few dimensions' groups)."""

    def __init__(self, arrays: Mapping[str, np.ndarray]):
        self._arrays, self._tuples = dict(arrays), {}

    def __getitem__(self, name: str) -> tuple[tuple[int, ...], ...]:
        out = self._tuples.get(name)
        if out is None:
            out = self._tuples[name] = tuple(map(tuple, self._arrays[name].tolist()))
        return out

    def __iter__(self):
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def __contains__(self, name) -> bool:
        return name in self._arrays

    def array(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def width(self, name: str) -> int:
        """The size of the dimension's groups (1 when it has none)."""
        a = self._arrays.get(name)
        return int(a.shape[1]) if a is not None and len(a) else 1


@attrs.frozen(kw_only=True)
class RankMap:
    chips: int
    chips_per_node: int
    factor_names: tuple[str, ...]  # outermost first
    factor_sizes: tuple[int, ...]
    _groups: Mapping[str, tuple[tuple[int, ...], ...]] = attrs.field(repr=False)
    _group_index: Mapping[str, np.ndarray] = attrs.field(repr=False, eq=False)  # chip -> index into _groups
    _at: dict = attrs.field(factory=dict, repr=False, eq=False)  # chips_at's answers

    @classmethod
    def build(cls, sizes: Mapping[str, int], dims: DimensionRegistry, chips_per_node: int) -> "RankMap":
        """The groups of every dimension, made with numpy from the mixed-radix structure
        (no Python step per chip but the conversion of the groups to tuples)."""
        factors = dims.factors
        names = tuple(d.name for d in factors)
        fsizes = tuple(int(sizes.get(n, 1)) for n in names)
        chips = 1
        for s in fsizes:
            chips *= s
        ids = np.arange(chips, dtype=np.int64)
        strides = [1] * len(fsizes)
        for axis in range(len(fsizes) - 2, -1, -1):
            strides[axis] = strides[axis + 1] * fsizes[axis + 1]
        coord = [(ids // strides[a]) % fsizes[a] for a in range(len(fsizes))]
        arrays: dict[str, np.ndarray] = {}
        for axis, name in enumerate(names):
            # a group: the chips that differ only in this coordinate, in chip order; groups in
            # the order of their other coordinates (outermost first) = of their first chip
            bases = np.flatnonzero(coord[axis] == 0)
            arrays[name] = bases[:, None] + strides[axis] * np.arange(fsizes[axis], dtype=np.int64)[None, :]
        for d in dims.dims:
            if d.factor:
                continue
            size = int(sizes.get(d.name, 1))
            over = {names.index(n) for n in d.regroups if n in names}
            # buckets: the chips alike in every coordinate not regrouped, in chip order; buckets
            # in the order of those coordinates (outermost first)
            key = np.zeros(chips, dtype=np.int64)
            members = 1
            for a in range(len(fsizes)):
                if a in over:
                    members *= fsizes[a]
                else:
                    key = key * fsizes[a] + coord[a]
            if members % size:
                raise ValueError(f"{d.name}={size} does not divide {members}")
            order = np.argsort(key, kind="stable")
            arrays[d.name] = order.reshape(-1, size)
        index: dict[str, np.ndarray] = {}
        for name, arr in arrays.items():
            idx = np.empty(chips, dtype=np.int64)
            idx[arr.ravel()] = np.repeat(np.arange(len(arr), dtype=np.int64), arr.shape[1])
            index[name] = idx
        return cls(chips=chips, chips_per_node=chips_per_node, factor_names=names, factor_sizes=fsizes,
                   groups=_Groups(arrays), group_index=index)

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

    def chips_at(self, dim: str, value: int) -> tuple[int, ...]:
        """The chips whose coordinate along factor dimension ``dim`` is ``value``, in chip
        order (made once per (dim, value), with numpy)."""
        key = (dim, value)
        chips = self._at.get(key)
        if chips is None:
            axis = self.factor_names.index(dim)
            stride = 1
            for s in self.factor_sizes[axis + 1:]:
                stride *= s
            ids = np.arange(self.chips, dtype=np.int64)
            chips = self._at[key] = tuple(np.flatnonzero((ids // stride) % self.factor_sizes[axis] == value).tolist())
        return chips

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
        return self._groups.width(dim)

    # -- groups -------------------------------------------------------------------------
    def groups(self, dim: str) -> tuple[tuple[int, ...], ...]:
        """All groups of a dimension; a dimension no plugin registered has singleton groups."""
        if dim not in self._groups:
            return tuple((c,) for c in range(self.chips))
        return self._groups[dim]

    def group_of(self, dim: str, chip: int) -> tuple[int, ...]:
        if dim not in self._groups:
            return (chip,)
        return self._groups[dim][int(self._group_index[dim][chip])]

    def group_array(self, dim: str) -> np.ndarray:
        """The groups of a dimension as one (groups x size) array of chip ids."""
        if dim not in self._groups:
            return np.arange(self.chips, dtype=np.int64)[:, None]
        return self._groups.array(dim)

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
