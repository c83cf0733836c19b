"""Symmetric replicas: simulate one slice of identical, independent replicas and replicate.

A dimension may declare (``Dimension(..., replicas=True)``) that the slices of the chips
it splits, one per coordinate along it, are independent replicas running the same work:
the dp plugin does. When every condition below holds, the engine runs the ops of slice 0
only, and the results are replicated (design notes, "Symmetric replicas", for the proof
sketch of exactness):

1. the dimension is a factor dimension of size ``k > 1`` whose slices are contiguous
   runs of ``R = chips / k`` chips (it is the outermost factor);
2. every group of every other dimension lies inside one slice;
3. the system has no oversubscribed fabric tier (leaf uplinks would be shared);
4. the slices sit alike on the nodes: ``R`` is a multiple or a divisor of
   ``chips_per_node``;
5. after the build: every op of the reduced DAG lies inside slice 0 (plugins place
   through ``ctx.place``);
6. after the compile: every resource slice 0's flows cross is private to slice 0 (no NIC
   or fabric tier shared with another slice), and every communication op, moved to any
   other slice, lowers to the same flows moved there (same bytes, routes moved alike).

Conditions 1-4 are checked before the build (``g5 explain`` shows the outcome); 5 and 6
on the reduced DAG, and a failure there falls back to simulating every chip, with the
reason in the JSON's ``symmetry`` block.
"""
from __future__ import annotations

from typing import Optional

import attrs
import numpy as np

from g5core.lower.topology import LINK_RX, NIC_RX, Topology
from g5core.lower.collective import lower_op


@attrs.frozen(kw_only=True)
class Symmetry:
    """What a run simulates: ``replicas`` slices of ``slice_chips`` chips each, simulated
    once (``replicas == 1``: every chip, with ``reason`` saying why not fewer)."""

    replicas: int = 1
    dimension: Optional[str] = None
    slice_chips: int = 0
    reason: Optional[str] = None

    @property
    def applied(self) -> bool:
        return self.replicas > 1

    def chips(self) -> tuple[int, ...]:
        return tuple(range(self.slice_chips))

    def refused(self, reason: str) -> "Symmetry":
        return Symmetry(replicas=1, dimension=self.dimension, slice_chips=0, reason=reason)

    def to_json_dict(self) -> dict:
        return {"replicas": self.replicas, "dimension": self.dimension,
                "simulated_chips": self.slice_chips if self.applied else None, "refused": self.reason}

    def describe(self) -> str:
        if self.applied:
            return (f"symmetry: {self.replicas} identical {self.dimension} replicas of {self.slice_chips} chips; "
                    f"one is simulated and its results replicated (--no-symmetry simulates every chip)")
        return f"symmetry: every chip simulated ({self.reason})"


#: a run that simulates every chip
WHOLE_RUN = Symmetry()


def off_reason(symmetry: "bool | str") -> Optional[str]:
    """``symmetry`` as the API takes it (True: allowed; False, or a string giving the reason:
    every chip simulated) -> the reason it is off, or None."""
    if symmetry is True:
        return None
    return symmetry if isinstance(symmetry, str) and symmetry else "symmetry=False"


def plan_symmetry(ctx, off_reason: Optional[str] = None) -> Symmetry:
    """Conditions 1-4 on a prepared run's context (:class:`g5core.api.context.BuildContext`)."""
    if off_reason:
        return Symmetry(reason=off_reason)
    dims = [d for d in ctx.dims.dims if d.replicas]
    rm, topo = ctx.rankmap, ctx.topology
    sized = [d for d in dims if rm.size(d.name) > 1]
    if not sized:
        names = ", ".join(f"{d.name}=1" for d in dims)
        return Symmetry(reason=f"no replicas to share ({names})" if names
                        else "no enabled plugin declares a dimension of independent replicas")
    if len(sized) > 1:
        return Symmetry(reason=f"several replica dimensions ({', '.join(d.name for d in sized)})")
    dim = sized[0].name
    k = rm.size(dim)
    size = rm.chips // k
    sym = Symmetry(replicas=k, dimension=dim, slice_chips=size)
    refused = _slices_refused(ctx, dim, size)
    if refused:
        return sym.refused(refused)
    # 3. no shared fabric tier
    if topo.nodes_per_leaf:
        return sym.refused(f"the system's fabric is {topo.oversubscription:g}:1 oversubscribed: replicas share "
                           f"leaf uplinks")
    # 4. alike on the nodes
    cpn = topo.chips_per_node
    if size % cpn and cpn % size:
        return sym.refused(f"a replica of {size} chips is neither a multiple nor a divisor of the "
                           f"{cpn} chips of a node")
    return sym


def _slices_refused(ctx, dim: str, size: int) -> Optional[str]:
    """Conditions 1 and 2, from the rank map's structure (chip ids are mixed-radix numbers
    over the factor dimensions, outermost first: :mod:`g5core.lower.rankmap`): a factor
    dimension's slices are contiguous runs of chips exactly when every factor outside it
    has size 1; a factor dimension's group varies in its own coordinate only, so it lies
    in one slice; only a regrouping dimension that regroups over ``dim`` can span slices,
    and its groups are checked (numpy, no Python step per chip)."""
    rm = ctx.rankmap
    by_name = {d.name: d for d in ctx.dims.dims}
    # 1. the slices are contiguous runs of chips: chip c is in slice c // size
    if dim in rm.factor_names:
        outer = rm.factor_names[:rm.factor_names.index(dim)]
        contiguous = all(rm.size(o) == 1 for o in outer)
    else:  # not a mixed-radix coordinate: look at every chip
        contiguous = all(rm.group_of(dim, chip) == g and rm.rank_in(dim, chip) == chip // size
                         for g in rm.groups(dim) for chip in g)
    if not contiguous:
        return f"the {dim} replicas are not contiguous runs of chips ({dim} is not the outermost dimension)"
    # 2. no other dimension's group spans two slices
    for other in rm.dims:
        if other == dim:
            continue
        d = by_name.get(other)
        if d is not None and d.factor and dim in rm.factor_names:
            continue  # varies in its own coordinate only
        if d is not None and not d.factor and dim not in d.regroups and dim in rm.factor_names:
            continue  # its buckets fix the coordinate of dim
        groups = rm.group_array(other) // size
        spans = np.flatnonzero((groups != groups[:, :1]).any(axis=1))
        if len(spans):
            return f"{other} group {list(rm.groups(other)[int(spans[0])])[:8]} spans several {dim} replicas"
    return None


def check_reduced_dag(sym: Symmetry, dag) -> Optional[str]:
    """Condition 5: the reason the reduced DAG is not one slice, or None."""
    size = sym.slice_chips
    if not len(dag):
        return None
    outside = np.array([bool(comm and spec.group and max(spec.group) >= size)
                        for spec, comm in zip(dag.specs, dag.spec_is_comm)], dtype=bool)
    bad = np.flatnonzero((dag.chip_array() >= size) | outside[dag.spec_array()])
    if len(bad):
        i = int(bad[0])
        return f"plugin '{dag.owner(i)}' placed op {dag.keys[i]!r} outside the simulated replica"
    return None


def _resource_chips(topo: Topology, r: int) -> tuple[int, int]:
    """The range ``[lo, hi)`` of chips whose traffic may cross resource ``r`` (its sharers)."""
    kind = topo.resource_kind(r)
    if kind <= LINK_RX:
        return r // 2, r // 2 + 1
    if kind <= NIC_RX:
        node = (r - 2 * topo.chips) // 2 // topo.nics_per_node
        lo = node * topo.chips_per_node
        return lo, min(lo + topo.chips_per_node, topo.chips)
    return 0, topo.chips  # a fabric tier: assume any chip


def _shift_resource(topo: Topology, r: int, chips: int) -> int:
    """Resource ``r`` of a slice, moved ``chips`` chips on (a multiple of a node's chips when
    it is a NIC)."""
    kind = topo.resource_kind(r)
    if kind <= LINK_RX:
        return r + 2 * chips
    return r + 2 * (chips // topo.chips_per_node) * topo.nics_per_node


def representative_replicas(sym: Symmetry, topo: Topology) -> list[int]:
    """The replicas whose lowerings condition 6 compares with replica 0's: one per offset
    of a replica inside a node, one a whole node further, and the last. Without a fabric
    tier (condition 3) the topology repeats node by node (the same chips, links and NICs
    on every node: :class:`Topology`), so a replica moved by whole nodes meets the same
    resources moved alike; the replicas between repeat these."""
    k = sym.replicas
    per_node = max(1, topo.chips_per_node // sym.slice_chips) if sym.slice_chips < topo.chips_per_node else 1
    picked = set(range(1, min(k, 2 * per_node + 1))) | {k - 1}
    return sorted(r for r in picked if 0 < r < k)


def check_resources(sym: Symmetry, dag, compiled, plan) -> Optional[str]:
    """Condition 6: the reason slice 0's traffic is not private and alike in every slice, or None."""
    topo: Topology = plan.ctx.topology
    size = sym.slice_chips
    used = set()
    for r in set(compiled.flow_route.tolist()):
        used.update(compiled.routes[r])
    for r in sorted(used):
        lo, hi = _resource_chips(topo, r)
        if hi > size:
            return f"resource {topo.resource_name(r)} is shared with another replica"
    seen = {}
    for i in dag.comm_indices():
        spec = dag.specs[dag.spec[i]]
        key = (spec.primitive, spec.group, spec.bytes_per_rank)
        if key in seen:
            continue
        seen[key] = i
        op = dag.op(i)
        first, last = compiled.flow_ptr[i], compiled.flow_ptr[i + 1]
        mine = [(compiled.flow_src[f], compiled.flow_dst[f], compiled.flow_bytes[f], compiled.flow_ports[f])
                for f in range(first, last)]
        for k in representative_replicas(sym, topo):
            shift = k * size
            moved = attrs.evolve(op, group=tuple(c + shift for c in op.group))
            low, flows = lower_op(moved, plan.primitives, topo)
            want = [(s + shift, t + shift, b, tuple(_shift_resource(topo, r, shift) for r in route))
                    for s, t, b, route in mine]
            got = [(s, t, b, tuple(route)) for s, t, b, route in flows]
            s = compiled.spec[i]
            same_algo = ((low.algorithm, low.protocol, low.channels) == tuple(compiled.algos[compiled.spec_algo[s]])
                         and float(low.wire_bytes_per_payload_byte) == compiled.spec_wire[s])
            if got != want or float(low.latency_s) != compiled.spec_duration_s[s] or not same_algo:
                return f"op {op.key!r} lowers differently in {sym.dimension} replica {k}"
    return None
