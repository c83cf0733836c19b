"""The concrete ops plugins make (compute and communication) and the fragments they contribute."""
from __future__ import annotations

import operator
from typing import Iterable, Mapping, Union

import attrs

from g5core.api.errors import DagError


@attrs.frozen(kw_only=True)
class ComputeOp:
    """Work on one chip's compute stream: its totals and the kernels (with their shapes) it
    runs (:mod:`g5core.lower.kernels`)."""

    key: str
    chip: int
    op_class: str
    flops: float = attrs.field(validator=attrs.validators.ge(0))
    hbm_bytes: float = attrs.field(validator=attrs.validators.ge(0))
    layer: int
    name: str                 # logical op kind (qkv_proj, attention, ...)
    dtype: str                # dtype that sets the peak FLOP/s
    owner: str = "core"       # plugin that made it
    kernels: tuple = attrs.field(converter=tuple)  # Gemm / Attention / Elementwise shapes

    @property
    def chips(self) -> tuple[int, ...]:
        return (self.chip,)


@attrs.frozen(kw_only=True)
class CommOp:
    """A communication op over a group of chips.

    ``bytes_per_rank`` is the payload each rank contributes (the buffer size), as the
    primitive defines it; the lowering turns it into flows. For ``p2p`` the group is
    ``(src, dst)``; for ``broadcast`` and ``gather`` the root comes first.
    """

    key: str
    primitive: str
    group: tuple[int, ...] = attrs.field(converter=tuple)
    bytes_per_rank: float = attrs.field(validator=attrs.validators.ge(0))
    reason: str
    layer: int
    name: str
    owner: str = "core"

    @property
    def chips(self) -> tuple[int, ...]:
        return self.group


Op = Union[ComputeOp, CommOp]


def _key_map(value) -> tuple[tuple[int, tuple[str, ...]], ...]:
    if isinstance(value, Mapping):
        value = value.items()
    return tuple(sorted((int(c), tuple(keys)) for c, keys in value))


# ----------------------------------------------------------------------------------------
# Op keys as (stem, number) columns
# ----------------------------------------------------------------------------------------

#: ``key_arg`` codes of an op key that is not ``f"{stem}@c{n}"`` (``n >= 0``): a comm op's
#: ``f"{stem}@c{a}->c{b}"`` or ``f"{stem}@g{a}-{b}-..."`` over its group (the forms
#: :meth:`g5core.api.context.BuildContext.comm_op` makes); at most ``KEY_VERBATIM``: a key kept
#: as a string, ``odd_keys[KEY_VERBATIM - arg]``.
KEY_PAIR, KEY_GROUP, KEY_VERBATIM = -1, -2, -3
_MAX_KEY_CHIP = 2 ** 31 - 1   # key numbers are stored as 32-bit ints


def split_key(key: str, group: tuple | None = None) -> tuple[str, int]:
    """``(stem, arg)`` of an op key: ``"L003.attention.step02@c12"`` -> ``("L003.attention.step02", 12)``;
    with a comm op's ``group``, its group forms give :data:`KEY_PAIR` or :data:`KEY_GROUP`;
    any other key gives ``(key, KEY_VERBATIM)``. :func:`join_key` makes the key back."""
    stem, at, suffix = key.rpartition("@")
    if at:
        if suffix[:1] == "c":
            n = suffix[1:]
            if n.isdigit() and n.isascii() and (n[0] != "0" or n == "0") and len(n) < 10:
                return stem, int(n)
        if group is not None:
            if len(group) == 2 and suffix == f"c{group[0]}->c{group[1]}":
                return stem, KEY_PAIR
            if suffix == "g" + "-".join(map(str, group)):
                return stem, KEY_GROUP
    return key, KEY_VERBATIM


def join_key(stem: str, arg: int, group: tuple = ()) -> str:
    """The key :func:`split_key` split (``arg >= KEY_GROUP``)."""
    if arg >= 0:
        return f"{stem}@c{arg}"
    if arg == KEY_PAIR:
        return f"{stem}@c{group[0]}->c{group[1]}"
    return f"{stem}@g{'-'.join(map(str, group))}"


def _slot_op(op: Op, tile: tuple[int, ...]) -> Op:
    """A template op (on slot chips) moved onto ``tile``: slot ``s`` -> chip ``tile[s]``,
    in its placement and in its key."""
    if type(op) is ComputeOp:
        stem, arg = split_key(op.key)
        if arg < 0:
            raise DagError(f"op {op.key!r} of a tiled template is not keyed on a slot (...@c<slot>)")
        return attrs.evolve(op, key=join_key(stem, tile[arg]), chip=tile[op.chip])
    group = tuple(tile[s] for s in op.group)
    stem, arg = split_key(op.key, op.group)
    if arg == KEY_VERBATIM:
        raise DagError(f"op {op.key!r} of a tiled template is not keyed on its slots (...@g<slots>)")
    return attrs.evolve(op, key=join_key(stem, tile[arg] if arg >= 0 else arg, group), group=group)


def _chip_number(c) -> int:
    if isinstance(c, bool):
        raise TypeError("a bool is not a chip number")
    return operator.index(c)


@attrs.frozen
class Replicated:
    """One compute op made alike on each of ``chips``: on chip ``c`` it is ``template`` with
    ``chip=c`` and key ``f"{stem}@c{c}"``, and it is its fragment's head and tail on ``c``.
    The ops and keys are made only when asked for; the build stores them as columns."""

    template: ComputeOp
    stem: str
    chips: tuple[int, ...] = attrs.field(converter=tuple)

    def key(self, chip: int) -> str:
        return f"{self.stem}@c{chip}"

    def keys(self) -> list[str]:
        stem = self.stem
        return [f"{stem}@c{c}" for c in self.chips]

    def ops(self) -> tuple[ComputeOp, ...]:
        t = self.template
        return tuple(attrs.evolve(t, key=k, chip=c) for k, c in zip(self.keys(), self.chips))

    def edges(self) -> tuple:
        return ()

    def heads(self) -> tuple[tuple[int, tuple[str, ...]], ...]:
        return tuple((c, (self.key(c),)) for c in self.chips)

    tails = heads

    def as_tiled(self) -> "Tiled":
        """The same ops as a one-slot :class:`Tiled` (how the build stores them)."""
        key = self.key(0)
        op = attrs.evolve(self.template, key=key, chip=0)
        return Tiled(Fragment(ops=(op,), heads=((0, (key,)),), tails=((0, (key,)),)), tuple((c,) for c in self.chips))


@attrs.frozen
class Tiled:
    """A template fragment instantiated on each of ``tiles`` (:meth:`Fragment.tiled`)."""

    template: "Fragment"
    tiles: tuple[tuple[int, ...], ...] = attrs.field(converter=lambda ts: tuple(tuple(t) for t in ts))

    def ops(self) -> tuple[Op, ...]:
        ops = self.template.ops
        return tuple(_slot_op(op, tile) for tile in self.tiles for op in ops)

    def _key_maps(self) -> list[dict[str, str]]:
        ops = self.template.ops
        return [{op.key: _slot_op(op, tile).key for op in ops} for tile in self.tiles]

    def edges(self) -> tuple[tuple[str, str], ...]:
        edges = self.template.edges
        return tuple((m[a], m[b]) for m in self._key_maps() for a, b in edges)

    def _by_slot(self, entries) -> tuple[tuple[int, tuple[str, ...]], ...]:
        return tuple((tile[s], tuple(m[k] for k in keys))
                     for tile, m in zip(self.tiles, self._key_maps()) for s, keys in entries)

    def heads(self) -> tuple[tuple[int, tuple[str, ...]], ...]:
        return self._by_slot(self.template.heads)

    def tails(self) -> tuple[tuple[int, tuple[str, ...]], ...]:
        return self._by_slot(self.template.tails)


@attrs.frozen(kw_only=True)
class Fragment:
    """What one plugin contributes for one logical op.

    ``heads[chip]``: ops that consume the logical op's input on ``chip`` (the core adds an
    edge from the input's producers on that chip). ``tails[chip]``: ops whose completion
    makes the logical op's output available on ``chip``. ``edges`` are internal
    dependencies, as ``(before_key, after_key)``.

    Repeated structure is contributed without an object per op (the build stores it as
    columns, with numpy, in the order the per-op API would make it):

    * :meth:`replicated`: one compute op on many chips, keyed ``f"{stem}@c{chip}"``.
    * :meth:`tiled`: a template fragment whose ops sit on *slot* chips ``0 .. m-1`` (a comm
      op's group is slots too), instantiated once per *tile*, a tuple of ``m`` chips: slot
      ``s`` becomes chip ``tile[s]`` in every op's placement, key, the heads and the tails.
      Template keys are those :meth:`g5core.api.context.BuildContext.compute_op` and ``comm_op``
      make on the slots (``...@c<slot>``, ``...@c<a>->c<b>``, ``...@g<a>-<b>-...``), so each
      tile's keys are the ones those helpers make on its chips. Ops come out tile by tile,
      in template order within a tile; edges likewise. A ring plugin makes one ring on
      slots and tiles it over every ring; a collective plugin one group.

    Such a fragment holds the template instead of its ops (``repeated``); ``ops``,
    ``edges``, ``heads`` and ``tails`` are made when read, as the per-op fragment they stand
    for (the repeated ops first, then any ``ops`` given alongside).
    """

    _ops: tuple[Op, ...] = attrs.field(converter=tuple, alias="ops")
    _edges: tuple[tuple[str, str], ...] = attrs.field(converter=lambda es: tuple(tuple(e) for e in es), default=(),
                                                     alias="edges")
    _heads: tuple[tuple[int, tuple[str, ...]], ...] = attrs.field(converter=_key_map, default=(), alias="heads")
    _tails: tuple[tuple[int, tuple[str, ...]], ...] = attrs.field(converter=_key_map, default=(), alias="tails")
    #: a template repeated over chips (:meth:`replicated`) or tiles (:meth:`tiled`), or None
    repeated: Replicated | Tiled | None = attrs.field(default=None)

    @property
    def ops(self) -> tuple[Op, ...]:
        return self._ops if self.repeated is None else self.repeated.ops() + self._ops

    @property
    def edges(self) -> tuple[tuple[str, str], ...]:
        return self._edges if self.repeated is None else self.repeated.edges() + self._edges

    @property
    def heads(self) -> tuple[tuple[int, tuple[str, ...]], ...]:
        return self._heads if self.repeated is None else _key_map(self.repeated.heads() + self._heads)

    @property
    def tails(self) -> tuple[tuple[int, tuple[str, ...]], ...]:
        return self._tails if self.repeated is None else _key_map(self.repeated.tails() + self._tails)

    @property
    def plain(self) -> bool:
        """Whether the fragment is only its ``repeated`` template (nothing given alongside)."""
        return not (self._ops or self._edges or self._heads or self._tails)

    @classmethod
    def replicated(cls, template: ComputeOp, stem: str, chips: Iterable[int]) -> "Fragment":
        """``template`` on each of ``chips`` (distinct), keyed ``f"{stem}@c{chip}"``, each op
        head and tail on its chip: what :meth:`single_chip_ops` makes of such ops, without
        making them (the template's own key and chip are not used)."""
        chips = tuple(chips)
        if len(set(chips)) != len(chips):
            raise DagError(f"Fragment.replicated: chips of {stem!r} repeat: {chips}")
        return cls(ops=(), repeated=Replicated(template=template, stem=stem, chips=chips))

    @classmethod
    def tiled(cls, template: "Fragment", tiles: Iterable[Iterable[int]]) -> "Fragment":
        """``template`` (ops on slot chips ``0 .. m-1``, keys made on the slots) once on each
        of ``tiles`` (tuples of ``m`` chips, no chip in two tiles); see the class docstring.
        E.g. one ring of ``cp`` ranks on slots ``0 .. cp-1``, tiled over every cp ring."""
        try:   # numpy integers become ints; a bool or a fraction is refused
            tiles = tuple(tuple(c if type(c) is int else _chip_number(c) for c in t) for t in tiles)
        except TypeError:
            raise DagError(f"Fragment.tiled: tiles must be tuples of chip numbers, got {tiles!r}") from None
        if not isinstance(template, Fragment) or template.repeated is not None:
            raise DagError(f"Fragment.tiled needs a template Fragment of plain ops, got {template!r}")
        if len({len(t) for t in tiles}) > 1:
            raise DagError(f"Fragment.tiled: tiles differ in length: {tiles[:4]}")
        chips = [c for t in tiles for c in t]
        if len(set(chips)) != len(chips):
            raise DagError(f"Fragment.tiled: a chip is in two tiles or twice in one: {tiles[:4]}")
        return cls(ops=(), repeated=Tiled(template=template, tiles=tiles))

    @classmethod
    def single_chip_ops(cls, ops: Iterable[ComputeOp]) -> "Fragment":
        """One independent op per chip, each both head and tail on its chip."""
        ops = tuple(ops)
        return cls(ops=ops, heads={o.chip: (o.key,) for o in ops}, tails={o.chip: (o.key,) for o in ops})

    @classmethod
    def exchange_around(cls, before: CommOp, computes: Iterable[ComputeOp], after: CommOp) -> "Fragment":
        """A collective, one compute op per member that waits for it, and a collective back
        that waits for every compute op (EP dispatch/experts/combine, Ulysses a2a/heads/a2a).
        ``before`` is each member's head, ``after`` its tail."""
        computes = tuple(computes)
        edges = [e for op in computes for e in ((before.key, op.key), (op.key, after.key))]
        return cls(ops=(before, after) + computes, edges=edges, heads={c: (before.key,) for c in before.group},
                   tails={c: (after.key,) for c in after.group})

    @staticmethod
    def ring_edges(sends, steps) -> list[tuple[str, str]]:
        """The edges of a ring of ``cp`` ranks that passes a block along: ``sends[r][i]`` (``cp
        - 1`` per rank, rank ``r`` to ``r + 1``) and ``steps[r][i]`` (``cp`` per rank). Step
        ``i`` on rank ``r`` and its forward wait for send ``i - 1`` of rank ``r - 1``; a send
        never waits for its rank's step (that would serialise the ring)."""
        cp = len(steps)
        edges = []
        for r in range(cp):
            prev = (r - 1) % cp
            for i in range(1, cp):
                edges.append((sends[prev][i - 1].key, steps[r][i].key))
                if i < cp - 1:
                    edges.append((sends[prev][i - 1].key, sends[r][i].key))
        return edges

    @classmethod
    def combine(cls, fragments: Iterable["Fragment"]) -> "Fragment":
        """Fragments on disjoint chips as one (ops and edges in order)."""
        fragments = tuple(fragments)
        return cls(ops=[op for f in fragments for op in f.ops], edges=[e for f in fragments for e in f.edges],
                   heads=[h for f in fragments for h in f.heads], tails=[t for f in fragments for t in f.tails])

    @classmethod
    def collective(cls, op: CommOp) -> "Fragment":
        """A communication op that every member consumes and produces on."""
        return cls(ops=(op,), heads={c: (op.key,) for c in op.group}, tails={c: (op.key,) for c in op.group})
