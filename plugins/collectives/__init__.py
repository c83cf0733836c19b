"""Communication primitives lowered into flows.

Every collective lowers into one set of concurrent flows plus a start latency, the
bandwidth-optimal form of its algorithm: the flows carry exactly the bytes each rank sends
under that algorithm, and the latency counts its message steps. ``bytes_per_rank`` is the
buffer each rank contributes (N). With ``n`` ranks and step latency ``a`` (the network's
when the group spans nodes):

| primitive      | flows                                   | bytes per flow      | latency      |
|----------------|-----------------------------------------|---------------------|--------------|
| p2p            | src -> dst                              | N                   | a            |
| all_reduce     | ring: rank i -> rank i+1                | 2 (n-1)/n N         | 2 (n-1) a    |
| all_gather     | ring: rank i -> rank i+1                | (n-1)/n N           | (n-1) a      |
| reduce_scatter | ring: rank i -> rank i+1                | (n-1)/n N           | (n-1) a      |
| all_to_all     | every rank to every other rank          | N / n               | a            |
| broadcast      | root -> every other rank (small message)| N                   | a            |
| gather         | every other rank -> root (small message)| N                   | a            |

On an idle ring of link bandwidth B this gives the textbook all-reduce time
``2 (n-1) a + 2 (n-1)/n N / B``; under contention the flows slow down with everything else
on their ports.
"""
from __future__ import annotations

from g5core import Lowering, Topology, hookimpl


def ring_flows(group, bytes_each):
    n = len(group)
    return tuple((group[i], group[(i + 1) % n], bytes_each) for i in range(n))


def p2p(group, nbytes, topo: Topology) -> Lowering:
    src, dst = group
    return Lowering(flows=((src, dst, nbytes),), latency_s=topo.message_latency_s(group))


def all_reduce(group, nbytes, topo: Topology) -> Lowering:
    n = len(group)
    return Lowering(ring_flows(group, 2.0 * (n - 1) / n * nbytes), 2 * (n - 1) * topo.message_latency_s(group))


def all_gather(group, nbytes, topo: Topology) -> Lowering:
    n = len(group)
    return Lowering(ring_flows(group, (n - 1) / n * nbytes), (n - 1) * topo.message_latency_s(group))


reduce_scatter = all_gather  # same ring traffic, opposite data movement


def all_to_all(group, nbytes, topo: Topology) -> Lowering:
    n = len(group)
    flows = tuple((s, t, nbytes / n) for s in group for t in group if s != t)
    return Lowering(flows, topo.message_latency_s(group))


def broadcast(group, nbytes, topo: Topology) -> Lowering:
    root = group[0]
    return Lowering(tuple((root, t, nbytes) for t in group[1:]), topo.message_latency_s(group))


def gather(group, nbytes, topo: Topology) -> Lowering:
    root = group[0]
    return Lowering(tuple((s, root, nbytes) for s in group[1:]), topo.message_latency_s(group))


PRIMITIVES = {
    "p2p": p2p,
    "all_reduce": all_reduce,
    "all_gather": all_gather,
    "reduce_scatter": reduce_scatter,
    "all_to_all": all_to_all,
    "broadcast": broadcast,
    "gather": gather,
}


@hookimpl
def g5_register_primitives(register):
    for name, lower in PRIMITIVES.items():
        register(name, lower)
