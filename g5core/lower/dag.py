"""Concrete ops, the fragments plugins contribute, and the op DAG they form."""
from __future__ import annotations

from array import array
from collections.abc import Sequence
from types import MappingProxyType
from typing import Mapping

import attrs
import networkx as nx
import numpy as np

from g5core.api.errors import DagError
from g5core.api.ops import _MAX_KEY_CHIP, KEY_VERBATIM, CommOp, ComputeOp, Op, join_key, split_key

#: Op ids, chips, layers and spec ids are stored as int32 (4 bytes each): a run holds far
#: fewer than 2**31 ops (the size guard, g5core.lower.builder.check_size, refuses more).
ID_CODE = "i"
ID_DTYPE = np.int32
ID_LIMIT = 2 ** 31 - 1


def _view(column: array) -> np.ndarray:
    return np.frombuffer(column, dtype=ID_DTYPE) if len(column) else np.zeros(0, dtype=ID_DTYPE)

@attrs.frozen(kw_only=True)
class ComputeSpec:
    """What compute ops alike share, all but chip, key and layer (a row of :attr:`OpDag.specs`)."""

    op_class: str
    name: str
    dtype: str
    owner: str
    kernels: tuple
    flops: float
    hbm_bytes: float


@attrs.frozen(kw_only=True)
class CommSpec:
    """What communication ops alike share, all but key and layer (a row of :attr:`OpDag.specs`)."""

    primitive: str
    group: tuple[int, ...]
    reason: str
    name: str
    owner: str
    bytes_per_rank: float


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


@attrs.define(eq=False, kw_only=True)
class OpDag:
    """The op DAG of one run, stored as columns (struct of arrays), one row per op.

    ``ops[i]`` is op ``i``, made on demand; ``graph`` is the networkx view (node = op key,
    attribute ``op``). Per op: ``chip[i]`` (a compute op's chip, -1 for a comm op),
    ``layer[i]`` and ``spec[i]``: an id into ``specs``, the interned rest of the op,
    shared by every op alike but for chip, key and layer (a :class:`ComputeSpec` or a
    :class:`CommSpec`); ``spec_is_comm[s]`` says which. Numbers are interned by
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
    _alive: list = attrs.field(factory=list, repr=False)  # kernels tuples whose ids key _spec_ids
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
        return join_key(stem, a, self.specs[self.spec[i]].group)

    def is_comm(self, i: int) -> bool:
        return self.spec_is_comm[self.spec[i]]

    def op(self, i: int) -> Op:
        """Op ``i`` as an object (made from the columns)."""
        s = self.spec[i]
        p = self.specs[s]
        if not self.spec_is_comm[s]:
            return ComputeOp(key=self.key(i), chip=self.chip[i], op_class=p.op_class, flops=p.flops,
                             hbm_bytes=p.hbm_bytes, layer=self.layer[i], name=p.name, dtype=p.dtype, owner=p.owner,
                             kernels=p.kernels)
        return CommOp(key=self.key(i), primitive=p.primitive, group=p.group, bytes_per_rank=p.bytes_per_rank,
                      reason=p.reason, layer=self.layer[i], name=p.name, owner=p.owner)

    def owner(self, i: int) -> str:
        return self.specs[self.spec[i]].owner

    def op_chips(self, i: int) -> tuple[int, ...]:
        s = self.spec[i]
        return self.specs[s].group if self.spec_is_comm[s] else (self.chip[i],)

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

    def _new_spec(self, spec: ComputeSpec | CommSpec, fast: tuple, is_comm: bool) -> int:
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
            # then by value: ops alike made from distinct Work objects (a plugin that makes
            # its work per logical op) share one spec, so alike layers add no spec
            spec = ComputeSpec(op_class=op.op_class, name=op.name, dtype=op.dtype, owner=op.owner, kernels=kernels,
                               flops=op.flops, hbm_bytes=op.hbm_bytes)
            s = self._spec_ids.get(spec)
            if s is None:
                s = self._new_spec(spec, fast, False)
                self._spec_ids[spec] = s
            else:
                self._spec_ids[fast] = s
                self._alive.append(kernels)  # its id stays in the fast key: keep it from reuse
        return s

    def _comm_spec(self, *, primitive: str, group: tuple, reason: str, name: str, owner: str,
                   bytes_per_rank: float) -> int:
        # a group is a tuple, a compute spec's second item a str: the two keys never collide
        fast = (primitive, group, reason, name, owner, bytes_per_rank)
        s = self._spec_ids.get(fast)
        if s is None:
            s = self._new_spec(CommSpec(primitive=primitive, group=group, reason=reason, name=name, owner=owner,
                                        bytes_per_rank=bytes_per_rank), fast, True)
        return s

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
            self.spec.append(self._comm_spec(primitive=op.primitive, group=op.group, reason=op.reason, name=op.name,
                                             owner=op.owner, bytes_per_rank=op.bytes_per_rank))
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
                if reason is None or self.specs[self.spec[i]].reason == reason]


def require_lowering(op: CommOp, primitives: Mapping) -> None:
    """DagError unless an enabled plugin lowers ``op``'s primitive (build, engine and the
    Math path all check it with this one message)."""
    if op.primitive not in primitives:
        raise DagError(f"op {op.key!r} made by plugin '{op.owner}' uses primitive '{op.primitive}', which no enabled "
                       f"plugin lowers (registered: {', '.join(primitives) or 'none'}); enable the collectives plugin")
