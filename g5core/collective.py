"""Topology and the contract between communication ops and the engine: flows over ports.

Each chip has four ports: its intra-node link port (send side, receive side) and its
network interface (send side, receive side). A flow inside a node crosses the sender's
link send port and the receiver's link receive port; a flow between nodes crosses the
sender's NIC send port and the receiver's NIC receive port. The switch fabric between
ports is assumed non-blocking.
"""
from __future__ import annotations

from typing import Callable, Mapping

import attrs

from .errors import PluginError
from .plugins import Hooks
from .rankmap import RankMap
from .systems import SystemSpec

LINK_TX, LINK_RX, NIC_TX, NIC_RX = range(4)
PORTS_PER_CHIP = 4
PORT_NAMES = ("link_tx", "link_rx", "nic_tx", "nic_rx")


@attrs.frozen
class Topology:
    chips: int
    chips_per_node: int
    intra_node_bw_bytes_per_s: float
    intra_node_latency_s: float
    network_bw_bytes_per_s: float
    network_latency_s: float

    @classmethod
    def from_system(cls, system: SystemSpec, rankmap: RankMap) -> "Topology":
        return cls(
            chips=rankmap.chips,
            chips_per_node=system.chips_per_node,
            intra_node_bw_bytes_per_s=system.intra_node_bw_bytes_per_s,
            intra_node_latency_s=system.intra_node_latency_s,
            network_bw_bytes_per_s=system.network_bw_bytes_per_s,
            network_latency_s=system.network_latency_s,
        )

    def node_of(self, chip: int) -> int:
        return chip // self.chips_per_node

    def same_node(self, a: int, b: int) -> bool:
        return a // self.chips_per_node == b // self.chips_per_node

    def ports(self, src: int, dst: int) -> tuple[int, int]:
        """(send port, receive port) a flow from ``src`` to ``dst`` crosses."""
        if self.same_node(src, dst):
            return src * PORTS_PER_CHIP + LINK_TX, dst * PORTS_PER_CHIP + LINK_RX
        return src * PORTS_PER_CHIP + NIC_TX, dst * PORTS_PER_CHIP + NIC_RX

    def port_capacity(self, port: int) -> float:
        kind = port % PORTS_PER_CHIP
        return self.intra_node_bw_bytes_per_s if kind in (LINK_TX, LINK_RX) else self.network_bw_bytes_per_s

    def message_latency_s(self, group) -> float:
        """Start latency of one message step among ``group``: the network's if it spans nodes."""
        nodes = {c // self.chips_per_node for c in group}
        return self.network_latency_s if len(nodes) > 1 else self.intra_node_latency_s

    @staticmethod
    def port_name(port: int) -> str:
        return f"chip{port // PORTS_PER_CHIP}.{PORT_NAMES[port % PORTS_PER_CHIP]}"


@attrs.frozen
class Lowering:
    """A communication op as the engine runs it: after ``latency_s`` all ``flows`` start
    together and share the ports they cross; the op ends when the last flow ends.
    ``flows`` are ``(src_chip, dst_chip, bytes)``."""

    flows: tuple[tuple[int, int, float], ...] = attrs.field(converter=lambda fs: tuple(tuple(f) for f in fs))
    latency_s: float = attrs.field(validator=attrs.validators.ge(0))

    @property
    def total_bytes(self) -> float:
        return sum(f[2] for f in self.flows)


LowerFn = Callable[[tuple, float, Topology], Lowering]


def collect_primitives(hooks: Hooks) -> Mapping[str, tuple[str, LowerFn]]:
    """Primitive name -> (plugin, lowering function); a name registered twice is an error."""
    found: dict[str, tuple[str, LowerFn]] = {}
    for impl in hooks._impls("g5_register_primitives"):
        plugin = impl.plugin_name

        def register(name: str, lower: LowerFn, _plugin: str = plugin) -> None:
            if not isinstance(name, str) or not callable(lower):
                raise PluginError(_plugin, f"g5_register_primitives: register(name, callable) got {name!r}, {lower!r}")
            if name in found:
                raise PluginError(_plugin, f"primitive '{name}' is already registered by plugin '{found[name][0]}'")
            found[name] = (_plugin, lower)

        hooks._call(impl, "g5_register_primitives", {"register": register})
    return dict(sorted(found.items()))
