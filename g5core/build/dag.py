"""Concrete ops, the fragments plugins contribute, and the op DAG they form."""
from __future__ import annotations

import operator
from array import array
from collections.abc import Sequence
from types import MappingProxyType
from typing import Iterable, Mapping, Union

import attrs
import networkx as nx
import numpy as np

from g5core.api.errors import DagError

#: Op ids, chips, layers and spec ids are stored as int32 (4 bytes each): a run holds far
#: fewer than 2**31 ops (the size guard, g5core.build.builder.check_size, refuses more).
ID_CODE = "i"
ID_DTYPE = np.int32
ID_LIMIT = 2 ** 31 - 1


def _view(column: array) -> np.ndarray:
    return np.frombuffer(column, dtype=ID_DTYPE) if len(column) else np.zeros(0, dtype=ID_DTYPE)

@attrs.frozen(kw_only=True)
class ComputeOp:
    """Work on one chip's compute stream: its totals and the kernels (with their shapes) it
    runs (:mod:`g5core.sim.compute`)."""

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


@attrs.frozen
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
#: :meth:`g5core.build.builder.BuildContext.comm_op` makes); at most ``KEY_VERBATIM``: a key kept
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


@attrs.frozen
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
      Template keys are those :meth:`g5core.build.builder.BuildContext.compute_op` and ``comm_op``
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


class _RowView(Sequence):
    """A read-only sequence of one value per op of an :class:`OpDag`, made from its columns
    when asked for (the DAG keeps no object per op); ``_item(dag, i)`` makes row ``i``'s."""

    __slots__ = ("_dag",)

    def __init__(self, dag: "OpDag"):
        self._dag = dag

    def __len__(self) -> int:
        return len(self._dag)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._item(self._dag, j) for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("op index out of range")
        return self._item(self._dag, i)

    def __iter__(self):
        dag, item = self._dag, self._item
        return (item(dag, i) for i in range(len(self)))


class OpView(_RowView):
    """``OpDag.ops``: op ``i`` as a :class:`ComputeOp` or :class:`CommOp`."""

    __slots__ = ()
    _item = staticmethod(lambda dag, i: dag.op(i))


class KeyView(_RowView):
    """``OpDag.keys``: op ``i``'s key, made from the key columns."""

    __slots__ = ()
    _item = staticmethod(lambda dag, i: dag.key(i))

    def __contains__(self, key) -> bool:
        return key in self._dag.index

    def index(self, key, *args) -> int:
        if args:
            return super().index(key, *args)
        try:
            return self._dag.index[key]
        except KeyError:
            raise ValueError(f"{key!r} is not an op key") from None


@attrs.define(eq=False)
class OpDag:
    """The op DAG of one run, stored as columns (struct of arrays), one row per op.

    ``ops[i]`` is op ``i``, made on demand; ``graph`` is the networkx view (node = op key,
    attribute ``op``). Per op: ``chip[i]`` (a compute op's chip, -1 for a comm op),
    ``layer[i]`` and ``spec[i]``: an id into ``specs``, the interned rest of the op,
    shared by every op alike but for chip, key and layer (compute: ``(op_class, name,
    dtype, owner, kernels, flops, hbm_bytes)``; comm: ``(primitive, group, reason, name,
    owner, bytes_per_rank)``); ``spec_is_comm[s]`` says which. Numbers are interned by
    value (the first op with a value gives the object every later one shares).

    Keys are columns too (:func:`split_key`): ``key_stem[i]``, an id into the interned
    ``stems``, and ``key_arg[i]``, the chip number of a ``...@c<n>`` key or a code for a
    comm op's group forms or a key kept verbatim (``odd_keys``). ``keys`` (a read-only
    sequence) and ``index`` (key -> op id, a mapping made on first use) give the strings.
    """

    chip: array = attrs.field(factory=lambda: array(ID_CODE), repr=False)
    layer: array = attrs.field(factory=lambda: array(ID_CODE), repr=False)
    spec: array = attrs.field(factory=lambda: array(ID_CODE), repr=False)
    specs: list = attrs.field(factory=list, repr=False)
    spec_is_comm: list = attrs.field(factory=list, repr=False)
    _spec_ids: dict = attrs.field(factory=dict, repr=False)
    key_stem: array = attrs.field(factory=lambda: array("i"), repr=False)
    key_arg: array = attrs.field(factory=lambda: array("i"), repr=False)
    stems: list = attrs.field(factory=list, repr=False)
    _stem_ids: dict = attrs.field(factory=dict, repr=False)
    odd_keys: list = attrs.field(factory=list, repr=False)
    _index: dict = attrs.field(factory=dict, repr=False)   # key -> op id of the first len(_index) ops
    _indexed: int = attrs.field(default=0, repr=False)
    # edges as a flat array of (pred_index, succ_index) pairs: 8 bytes an edge
    edge_pairs: array = attrs.field(factory=lambda: array(ID_CODE), repr=False)
    _graph: nx.DiGraph | None = attrs.field(default=None, repr=False)
    _graph_size: tuple = attrs.field(default=(-1, -1), repr=False)  # (ops, edges) it was built from

    @property
    def ops(self) -> OpView:
        return OpView(self)

    @property
    def keys(self) -> KeyView:
        return KeyView(self)

    @property
    def index(self) -> Mapping[str, int]:
        """Key -> op id (the first op with that key), made on first use and extended since."""
        n, first = len(self.spec), self._indexed
        if first < n:
            keys = self.keys[first:n]
            if not first:   # reversed, so that a repeated key keeps its first op
                self._index = dict(zip(reversed(keys), range(n - 1, -1, -1)))
            else:
                setdefault = self._index.setdefault
                for i, k in enumerate(keys, first):
                    setdefault(k, i)
            self._indexed = n
        return MappingProxyType(self._index)

    def __len__(self) -> int:
        return len(self.spec)

    def key(self, i: int) -> str:
        """Op ``i``'s key (made from the key columns)."""
        a = self.key_arg[i]
        if a <= KEY_VERBATIM:
            return self.odd_keys[KEY_VERBATIM - a]
        stem = self.stems[self.key_stem[i]]
        if a >= 0:
            return f"{stem}@c{a}"
        return join_key(stem, a, self.specs[self.spec[i]][1])

    def is_comm(self, i: int) -> bool:
        return self.spec_is_comm[self.spec[i]]

    def op(self, i: int) -> Op:
        """Op ``i`` as an object (made from the columns)."""
        s = self.spec[i]
        p = self.specs[s]
        if not self.spec_is_comm[s]:
            return ComputeOp(key=self.key(i), chip=self.chip[i], op_class=p[0], flops=p[5], hbm_bytes=p[6],
                             layer=self.layer[i], name=p[1], dtype=p[2], owner=p[3], kernels=p[4])
        return CommOp(key=self.key(i), primitive=p[0], group=p[1], bytes_per_rank=p[5], reason=p[2],
                      layer=self.layer[i], name=p[3], owner=p[4])

    def owner(self, i: int) -> str:
        s = self.spec[i]
        return self.specs[s][4 if self.spec_is_comm[s] else 3]

    def op_chips(self, i: int) -> tuple[int, ...]:
        s = self.spec[i]
        return self.specs[s][1] if self.spec_is_comm[s] else (self.chip[i],)

    # the columns as numpy arrays (views, no copy)
    def spec_array(self) -> np.ndarray:
        return _view(self.spec)

    def chip_array(self) -> np.ndarray:
        return _view(self.chip)

    def edge_array(self) -> np.ndarray:
        """Every edge made, as rows (pred_index, succ_index), in order (duplicates kept)."""
        return _view(self.edge_pairs).reshape(-1, 2)

    def comm_mask(self) -> np.ndarray:
        """Per op: whether it is a comm op (a bool array)."""
        if not len(self.spec):
            return np.zeros(0, dtype=bool)
        return np.asarray(self.spec_is_comm, dtype=bool)[self.spec_array()]

    def comm_indices(self) -> list[int]:
        """Ids of the communication ops, in op order."""
        return np.flatnonzero(self.comm_mask()).tolist()

    def _new_spec(self, spec: tuple, fast: tuple, is_comm: bool) -> int:
        s = self._spec_ids[fast] = len(self.specs)
        self.specs.append(spec)
        self.spec_is_comm.append(is_comm)
        return s

    def _compute_spec(self, op: ComputeOp) -> int:
        kernels = op.kernels
        # interned by the kernels tuple's identity (ops made from one Work share it);
        # ``specs`` keeps the tuple alive, so the id is not reused
        fast = (op.op_class, op.name, op.dtype, op.owner, id(kernels), op.flops, op.hbm_bytes)
        s = self._spec_ids.get(fast)
        if s is None:
            s = self._new_spec((op.op_class, op.name, op.dtype, op.owner, kernels, op.flops, op.hbm_bytes), fast, False)
        return s

    def _comm_spec(self, spec: tuple) -> int:
        # a group is a tuple, a compute spec's second item a str: the two never collide
        s = self._spec_ids.get(spec)
        return self._new_spec(spec, spec, True) if s is None else s

    def stem_id(self, stem: str) -> int:
        s = self._stem_ids.get(stem)
        if s is None:
            s = self._stem_ids[stem] = len(self.stems)
            self.stems.append(stem)
        return s

    def _key_code(self, key: str, group: tuple | None) -> tuple[int, int]:
        """(key_stem, key_arg) of ``key``."""
        stem, arg = split_key(key, group)
        if arg > _MAX_KEY_CHIP or arg == KEY_VERBATIM:
            self.odd_keys.append(key)
            return -1, KEY_VERBATIM - (len(self.odd_keys) - 1)
        return self.stem_id(stem), arg

    def append(self, op: Op) -> int:
        """Store ``op`` as a row (no key check: :meth:`add_op` checks)."""
        i = len(self.spec)
        self.layer.append(op.layer)
        if type(op) is ComputeOp:
            stem, arg = self._key_code(op.key, None)
            self.spec.append(self._compute_spec(op))
            self.chip.append(op.chip)
        else:
            stem, arg = self._key_code(op.key, op.group)
            self.spec.append(self._comm_spec((op.primitive, op.group, op.reason, op.name, op.owner,
                                              op.bytes_per_rank)))
            self.chip.append(-1)
        self.key_stem.append(stem)
        self.key_arg.append(arg)
        return i

    def extend_columns(self, chip: np.ndarray, layer: np.ndarray, spec: np.ndarray, key_stem: np.ndarray,
                       key_arg: np.ndarray) -> None:
        """Store rows given as numpy columns (no check: the build checks)."""
        self.chip.frombytes(np.ascontiguousarray(chip, dtype=ID_DTYPE).tobytes())
        self.layer.frombytes(np.ascontiguousarray(layer, dtype=ID_DTYPE).tobytes())
        self.spec.frombytes(np.ascontiguousarray(spec, dtype=ID_DTYPE).tobytes())
        self.key_stem.frombytes(np.ascontiguousarray(key_stem, dtype=np.int32).tobytes())
        self.key_arg.frombytes(np.ascontiguousarray(key_arg, dtype=np.int32).tobytes())

    def add_op(self, op: Op) -> int:
        if op.key in self.index:
            other = self.owner(self.index[op.key])
            raise DagError(f"op key {op.key!r} made twice (by {other} and {op.owner})")
        return self.append(op)

    def add_edge(self, before: str, after: str, owner: str = "core") -> None:
        try:
            self.edge_pairs.extend((self.index[before], self.index[after]))
        except KeyError as exc:
            raise DagError(f"plugin '{owner}' made an edge to unknown op {exc.args[0]!r}") from None

    @property
    def edges(self) -> list[tuple[int, int]]:
        """Every edge made, as (pred_index, succ_index), in order (duplicates kept)."""
        pairs = self.edge_pairs
        return list(zip(pairs[0::2], pairs[1::2]))

    @property
    def n_edges(self) -> int:
        return len(self.edge_pairs) // 2

    @property
    def graph(self) -> nx.DiGraph:
        """The networkx view, rebuilt when ops or edges were added since it was made."""
        size = (len(self), self.n_edges)
        if self._graph is None or self._graph_size != size:
            g = nx.DiGraph()
            g.add_nodes_from((op.key, {"op": op}) for op in self.ops)
            keys = list(self.keys)
            g.add_edges_from((keys[u], keys[v]) for u, v in self.edges)
            self._graph, self._graph_size = g, size
        return self._graph

    def predecessors(self, key: str) -> list[str]:
        return sorted(self.graph.predecessors(key))

    def successors(self, key: str) -> list[str]:
        return sorted(self.graph.successors(key))

    def comm_ops(self, reason: str | None = None) -> list[CommOp]:
        return [self.op(i) for i in self.comm_indices()
                if reason is None or self.specs[self.spec[i]][2] == reason]


def require_lowering(op: CommOp, primitives: Mapping) -> None:
    """DagError unless an enabled plugin lowers ``op``'s primitive (build, engine and the
    Math path all check it with this one message)."""
    if op.primitive not in primitives:
        raise DagError(f"op {op.key!r} made by plugin '{op.owner}' uses primitive '{op.primitive}', which no enabled "
                       f"plugin lowers (registered: {', '.join(primitives) or 'none'}); enable the collectives plugin")
