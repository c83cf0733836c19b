"""Concrete ops, the fragments plugins contribute, and the op DAG they form."""
from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Iterable, Mapping, Union

import attrs
import networkx as nx

from .errors import DagError

@attrs.frozen(kw_only=True)
class ComputeOp:
    """Work on one chip's compute stream: its totals and the kernels (with their shapes) it
    runs (:mod:`g5core.compute`)."""

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


@attrs.frozen
class Fragment:
    """What one plugin contributes for one logical op.

    ``heads[chip]``: ops that consume the logical op's input on ``chip`` (the core adds an
    edge from the input's producers on that chip). ``tails[chip]``: ops whose completion
    makes the logical op's output available on ``chip``. ``edges`` are internal
    dependencies, as ``(before_key, after_key)``. A fragment made by :meth:`replicated`
    holds a template instead of its ops; ``ops``, ``heads`` and ``tails`` are then made
    when read.
    """

    _ops: tuple[Op, ...] = attrs.field(converter=tuple, alias="ops")
    edges: tuple[tuple[str, str], ...] = attrs.field(converter=lambda es: tuple(tuple(e) for e in es), default=())
    _heads: tuple[tuple[int, tuple[str, ...]], ...] = attrs.field(converter=_key_map, default=(), alias="heads")
    _tails: tuple[tuple[int, tuple[str, ...]], ...] = attrs.field(converter=_key_map, default=(), alias="tails")
    #: a template op repeated over chips (:meth:`replicated`), or None
    repeated: Replicated | None = attrs.field(default=None)

    @property
    def ops(self) -> tuple[Op, ...]:
        return self._ops if self.repeated is None else self.repeated.ops()

    @property
    def heads(self) -> tuple[tuple[int, tuple[str, ...]], ...]:
        return self._heads if self.repeated is None else self._repeated_map()

    @property
    def tails(self) -> tuple[tuple[int, tuple[str, ...]], ...]:
        return self._tails if self.repeated is None else self._repeated_map()

    def _repeated_map(self) -> tuple[tuple[int, tuple[str, ...]], ...]:
        r = self.repeated
        return _key_map((c, (r.key(c),)) for c in r.chips)

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


class OpView(Sequence):
    """``OpDag.ops``: op ``i`` as a :class:`ComputeOp` or :class:`CommOp`, made from the
    DAG's columns when asked for (the DAG keeps no object per op)."""

    __slots__ = ("_dag",)

    def __init__(self, dag: "OpDag"):
        self._dag = dag

    def __len__(self) -> int:
        return len(self._dag.keys)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._dag.op(j) for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("op index out of range")
        return self._dag.op(i)

    def __iter__(self):
        op = self._dag.op
        return (op(i) for i in range(len(self)))


@attrs.define(eq=False)
class OpDag:
    """The op DAG of one run, stored as columns (struct of arrays), one row per op.

    ``ops[i]`` is op ``i``, made on demand; ``graph`` is the networkx view (node = op key,
    attribute ``op``). Per op: ``keys[i]``, ``chip[i]`` (a compute op's chip, -1 for a comm
    op), ``layer[i]`` and ``spec[i]``: an id into ``specs``, the interned rest of the op,
    shared by every op alike but for chip, key and layer (compute: ``(op_class, name,
    dtype, owner, kernels, flops, hbm_bytes)``; comm: ``(primitive, group, reason, name,
    owner, bytes_per_rank)``); ``spec_is_comm[s]`` says which. Numbers are interned by
    value (the first op with a value gives the object every later one shares)."""

    keys: list = attrs.field(factory=list, repr=False)
    index: dict = attrs.field(factory=dict, repr=False)
    chip: array = attrs.field(factory=lambda: array("q"), repr=False)
    layer: array = attrs.field(factory=lambda: array("q"), repr=False)
    spec: array = attrs.field(factory=lambda: array("q"), repr=False)
    specs: list = attrs.field(factory=list, repr=False)
    spec_is_comm: list = attrs.field(factory=list, repr=False)
    _spec_ids: dict = attrs.field(factory=dict, repr=False)
    # edges as a flat array of (pred_index, succ_index) pairs: 16 bytes an edge
    edge_pairs: array = attrs.field(factory=lambda: array("q"), repr=False)
    _graph: nx.DiGraph | None = attrs.field(default=None, repr=False)
    _graph_size: tuple = attrs.field(default=(-1, -1), repr=False)  # (ops, edges) it was built from

    @property
    def ops(self) -> OpView:
        return OpView(self)

    def __len__(self) -> int:
        return len(self.keys)

    def is_comm(self, i: int) -> bool:
        return self.spec_is_comm[self.spec[i]]

    def op(self, i: int) -> Op:
        """Op ``i`` as an object (made from the columns)."""
        s = self.spec[i]
        p = self.specs[s]
        if not self.spec_is_comm[s]:
            return ComputeOp(key=self.keys[i], chip=self.chip[i], op_class=p[0], flops=p[5], hbm_bytes=p[6],
                             layer=self.layer[i], name=p[1], dtype=p[2], owner=p[3], kernels=p[4])
        return CommOp(key=self.keys[i], primitive=p[0], group=p[1], bytes_per_rank=p[5], reason=p[2],
                      layer=self.layer[i], name=p[3], owner=p[4])

    def owner(self, i: int) -> str:
        s = self.spec[i]
        return self.specs[s][4 if self.spec_is_comm[s] else 3]

    def op_chips(self, i: int) -> tuple[int, ...]:
        s = self.spec[i]
        return self.specs[s][1] if self.spec_is_comm[s] else (self.chip[i],)

    def comm_indices(self) -> list[int]:
        """Ids of the communication ops, in op order."""
        comm = self.spec_is_comm
        return [i for i, s in enumerate(self.spec) if comm[s]]

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

    def append(self, op: Op) -> int:
        """Store ``op`` as a row (no key check: :meth:`add_op` checks)."""
        key = op.key
        i = len(self.keys)
        self.keys.append(key)
        self.index[key] = i
        self.layer.append(op.layer)
        if type(op) is ComputeOp:
            self.spec.append(self._compute_spec(op))
            self.chip.append(op.chip)
        else:
            # a group is a tuple, a compute spec's second item a str: the two never collide
            spec = (op.primitive, op.group, op.reason, op.name, op.owner, op.bytes_per_rank)
            s = self._spec_ids.get(spec)
            self.spec.append(self._new_spec(spec, spec, True) if s is None else s)
            self.chip.append(-1)
        return i

    def extend_replicated(self, rep: Replicated) -> None:
        """Store ``rep``'s ops as rows, in chip order as given, without making them (no key
        check: the build checks)."""
        t, keys, chips = rep.template, rep.keys(), rep.chips
        i, n = len(self.keys), len(keys)
        self.keys.extend(keys)
        self.index.update(zip(keys, range(i, i + n)))
        self.layer.extend([t.layer] * n)
        self.spec.extend([self._compute_spec(t)] * n)
        self.chip.extend(chips)

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
        size = (len(self.keys), self.n_edges)
        if self._graph is None or self._graph_size != size:
            g = nx.DiGraph()
            g.add_nodes_from((op.key, {"op": op}) for op in self.ops)
            keys = self.keys
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
