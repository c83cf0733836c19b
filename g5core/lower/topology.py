"""The cluster's network as the engine sees it: named resources with a capacity each.

A *node* is one scale-up domain: the chips that share one NVLink/NVSwitch fabric (8 in a
DGX H100, 72 in a GB200 NVL72 rack). Resources, all per direction:

- every chip's scale-up link, send side and receive side (``chipC.link_tx`` / ``link_rx``);
- every NIC, send side and receive side (``nodeN.nicK.tx`` / ``rx``). A node has
  ``nics_per_node`` NICs; chip ``i`` of a node uses NIC ``nic_of_chip[i]`` when the system
  file maps them, else NIC ``i * nics_per_node // chips_per_node`` (rail-optimised: with one NIC per chip, chip i uses NIC i, and NIC k of every node sits
  on the same rail, i.e. the same leaf switch plane);
- with an oversubscribed fabric, every leaf's uplink and downlink (``leafL.up`` / ``down``):
  ``nodes_per_leaf`` nodes share a leaf, and traffic between leaves crosses the sending
  leaf's uplink and the receiving leaf's downlink, each of capacity
  ``nodes_per_leaf x nics_per_node x nic bandwidth / oversubscription``. A full-bisection
  fabric (no ``fabric`` block, or oversubscription 1) has no such tier: it never limits.

Every send side (``link_tx``, ``tx``, ``up``) has an even id and its receive side the next,
odd, id. A *route* is the tuple of resources a byte crosses. The switch inside a node and the
fabric's spine are otherwise non-blocking. Flows on a resource share it max-min fairly
(the engine). Collective lowerings choose routes (which NIC a channel uses); point-to-point
traffic takes :meth:`Topology.route` (one NIC on each side).
"""
from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:  # pragma: no cover
    from g5core.inputs.systems import SystemSpec

#: resource kinds, in the order of the resource ids
LINK_TX, LINK_RX, NIC_TX, NIC_RX, LEAF_UP, LEAF_DOWN = range(6)
KIND_NAMES = ("link_tx", "link_rx", "nic_tx", "nic_rx", "leaf_up", "leaf_down")


@attrs.frozen(kw_only=True)
class Topology:
    """Resources of one cluster of ``chips`` chips and how bytes are routed over them."""

    chips: int
    chips_per_node: int
    nics_per_node: int
    link_bw_bytes_per_s: float          # per chip, per direction (scale-up)
    nic_bw_bytes_per_s: float           # per NIC, per direction (scale-out)
    link_latency_s: float               # start latency of one point-to-point message in a node
    network_latency_s: float            # ... between nodes
    nvls: bool = False                  # the scale-up switch can reduce in place (NVLink SHARP)
    nic_of_chip: tuple = ()             # NIC index of each chip of a node; () rail-optimised
    nodes_per_leaf: int = 0             # 0: full bisection, no leaf tier
    oversubscription: float = 1.0
    system: "SystemSpec | None" = attrs.field(default=None, eq=False, repr=False)

    @classmethod
    def from_system(cls, system: "SystemSpec", chips: int) -> "Topology":
        fabric = system.fabric
        tiered = bool(fabric) and fabric["oversubscription"] > 1.0
        return cls(
            chips=chips,
            chips_per_node=system.chips_per_node,
            nics_per_node=system.nics,
            link_bw_bytes_per_s=system.intra_node_bw_bytes_per_s,
            nic_bw_bytes_per_s=system.network_bw_bytes_per_s,
            link_latency_s=system.intra_node_latency_s,
            network_latency_s=system.network_latency_s,
            nvls=system.nvls,
            nic_of_chip=tuple(system.nic_of_chip),
            nodes_per_leaf=int(fabric["nodes_per_leaf"]) if tiered else 0,
            oversubscription=float(fabric["oversubscription"]) if tiered else 1.0,
            system=system,
        )

    # ---------------------------------------------------------------- shape
    @property
    def nodes(self) -> int:
        return -(-self.chips // self.chips_per_node)

    @property
    def leaves(self) -> int:
        return -(-self.nodes // self.nodes_per_leaf) if self.nodes_per_leaf else 0

    @property
    def n_resources(self) -> int:
        return 2 * self.chips + 2 * self.nodes * self.nics_per_node + 2 * self.leaves

    def node_of(self, chip: int) -> int:
        return chip // self.chips_per_node

    def same_node(self, a: int, b: int) -> bool:
        return a // self.chips_per_node == b // self.chips_per_node

    def nodes_of(self, group) -> tuple[int, ...]:
        """The distinct nodes of ``group``, in order of first appearance."""
        return tuple(dict.fromkeys(c // self.chips_per_node for c in group))

    def rail_of(self, chip: int) -> int:
        """Index, within its node, of the NIC ``chip`` uses (the system's map, else rail-optimised)."""
        if self.nic_of_chip:
            return self.nic_of_chip[chip % self.chips_per_node]
        return (chip % self.chips_per_node) * self.nics_per_node // self.chips_per_node

    def leaf_of(self, node: int) -> int:
        return node // self.nodes_per_leaf if self.nodes_per_leaf else 0

    # ---------------------------------------------------------------- resource ids
    def link_tx(self, chip: int) -> int:
        return 2 * chip

    def link_rx(self, chip: int) -> int:
        return 2 * chip + 1

    def nic_tx(self, node: int, rail: int) -> int:
        return 2 * self.chips + 2 * (node * self.nics_per_node + rail)

    def nic_rx(self, node: int, rail: int) -> int:
        return self.nic_tx(node, rail) + 1

    def _leaf_base(self) -> int:
        return 2 * self.chips + 2 * self.nodes * self.nics_per_node

    def resource_kind(self, r: int) -> int:
        if r < 2 * self.chips:
            return LINK_TX + r % 2
        if r < self._leaf_base():
            return NIC_TX + r % 2
        return LEAF_UP + r % 2

    def resource_name(self, r: int) -> str:
        kind = self.resource_kind(r)
        if kind <= LINK_RX:
            return f"chip{r // 2}.{KIND_NAMES[kind]}"
        if kind <= NIC_RX:
            node, rail = divmod((r - 2 * self.chips) // 2, self.nics_per_node)
            return f"node{node}.nic{rail}.{'tx' if kind == NIC_TX else 'rx'}"
        leaf = self.leaf_of_resource(r)
        return f"leaf{leaf}.{'up' if kind == LEAF_UP else 'down'}"

    def resource_owner_chip(self, r: int) -> int:
        """The chip a resource is drawn with in traces: the link's chip, the first chip on the
        NIC's rail, or -1 for fabric tiers."""
        kind = self.resource_kind(r)
        if kind <= LINK_RX:
            return r // 2
        if kind <= NIC_RX:
            node, rail = divmod((r - 2 * self.chips) // 2, self.nics_per_node)
            local = next(i for i in range(self.chips_per_node) if self.rail_of(i) == rail)
            return min(node * self.chips_per_node + local, self.chips - 1)
        return -1

    def leaf_of_resource(self, r: int) -> int:
        return (r - self._leaf_base()) // 2

    def capacities(self) -> tuple[float, ...]:
        """Bytes per second of every resource, by id."""
        return _capacities(self)

    def _capacities(self) -> tuple[float, ...]:
        link = (self.link_bw_bytes_per_s,) * (2 * self.chips)
        nic = (self.nic_bw_bytes_per_s,) * (2 * self.nodes * self.nics_per_node)
        leaf_bw = self.nodes_per_leaf * self.nics_per_node * self.nic_bw_bytes_per_s / self.oversubscription
        return link + nic + (leaf_bw,) * (2 * self.leaves)

    # ---------------------------------------------------------------- routes
    def network_route(self, src_node: int, src_rail: int, dst_node: int, dst_rail: int) -> tuple[int, ...]:
        """NIC ``src_rail`` of ``src_node`` through the fabric to NIC ``dst_rail`` of ``dst_node``."""
        tx, rx = self.nic_tx(src_node, src_rail), self.nic_rx(dst_node, dst_rail)
        if self.nodes_per_leaf:
            ls, ld = self.leaf_of(src_node), self.leaf_of(dst_node)
            if ls != ld:
                base = self._leaf_base()
                return (tx, base + 2 * ls, base + 2 * ld + 1, rx)
        return (tx, rx)

    def egress_route(self, chip: int) -> tuple[int, ...]:
        """This side of a message from ``chip`` to a chip of another cluster (another system,
        whose own topology routes the other side): ``chip``'s NIC's send side and, with an
        oversubscribed fabric, its leaf's uplink."""
        node = self.node_of(chip)
        tx = self.nic_tx(node, self.rail_of(chip))
        return (tx, self._leaf_base() + 2 * self.leaf_of(node)) if self.nodes_per_leaf else (tx,)

    def ingress_route(self, chip: int) -> tuple[int, ...]:
        """This side of a message from a chip of another cluster to ``chip``: with an
        oversubscribed fabric the leaf's downlink, then ``chip``'s NIC's receive side."""
        node = self.node_of(chip)
        rx = self.nic_rx(node, self.rail_of(chip))
        return (self._leaf_base() + 2 * self.leaf_of(node) + 1, rx) if self.nodes_per_leaf else (rx,)

    def route(self, src: int, dst: int) -> tuple[int, ...]:
        """Resources one point-to-point message crosses: the scale-up links inside a node;
        between nodes the sender's NIC, the fabric, and the receiver's NIC."""
        if self.same_node(src, dst):
            return (self.link_tx(src), self.link_rx(dst))
        return self.network_route(self.node_of(src), self.rail_of(src), self.node_of(dst), self.rail_of(dst))

    def message_latency_s(self, group) -> float:
        """Start latency of one point-to-point message among ``group``: the network's if it
        spans nodes."""
        return self.network_latency_s if len(self.nodes_of(group)) > 1 else self.link_latency_s


@lru_cache(maxsize=16)
def _capacities(topo: Topology) -> tuple[float, ...]:
    return topo._capacities()
