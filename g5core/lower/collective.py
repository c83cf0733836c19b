"""The contract between communication ops and the engine: a lowering into flows.

A plugin registers, per primitive name, a function ``lower(group, bytes_per_rank, topology)``
that returns a :class:`Lowering`: a start latency, then flows that start together, each
over a route of resources of the :class:`~g5core.lower.topology.Topology`. The engine shares
every resource max-min fairly among the flows on it, so contention between collectives
comes from the engine, never from the lowering.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping

from g5core.lower.dag import require_lowering
from g5core.api.errors import G5Error, PluginError
from g5core.api.plugins import Hooks
from g5core.api.records import Lowering
from g5core.lower.topology import Topology


#: The fraction of a chip's NVLink bandwidth that SM-driven copies between GPUs reach:
#: fitted by ``python tools/fit_p2p.py`` to nccl-tests alltoall on 2, 4 and 8 x H100
#: (tests/data/nccl/aiconfigurator-h100-sxm-nccl2.29.2.csv) together with NCCL's per-channel
#: copy rate (plugins/collectives/nccl.py, "point to point"); NCCL's p2p lowering and the EP
#: plugin's DeepEP NVLink legs both use it.
NVLINK_COPY_EFFICIENCY = 0.772


LowerFn = Callable[[tuple, float, Topology], Lowering]


def collect_primitives(hooks: Hooks) -> Mapping[str, tuple[str, LowerFn]]:
    """Primitive name -> (plugin, lowering function); a name registered twice is an error."""
    found: dict[str, tuple[str, LowerFn]] = {}

    def record(plugin: str, name: str, lower: LowerFn) -> None:
        if not isinstance(name, str) or not callable(lower):
            raise PluginError(plugin, f"g5_register_primitives: register(name, callable) got {name!r}, {lower!r}")
        if name in found:
            raise PluginError(plugin, f"primitive '{name}' is already registered by plugin '{found[name][0]}'")
        found[name] = (plugin, lower)

    hooks.call_registration("g5_register_primitives", record)
    return dict(sorted(found.items()))


def lower_op(op, primitives: Mapping, topo: Topology) -> tuple[Lowering, tuple]:
    """``(lowering, flows)`` of one comm op, checked; every error names the plugin.

    Flows are ``(src, dst, bytes, route)``; flows of one op with the same source,
    destination and route (e.g. the channels of a ring that share a NIC) are merged into one.
    """
    require_lowering(op, primitives)
    plugin, lower = primitives[op.primitive]
    try:
        low = lower(op.group, op.bytes_per_rank, topo)
    except G5Error:
        raise
    except Exception as exc:
        raise PluginError(plugin, f"lowering {op.primitive} for {op.key} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(low, Lowering):
        raise PluginError(plugin, f"lowering {op.primitive} must return a Lowering, got {low!r}")
    members = set(op.group)
    n_res = topo.n_resources
    merged: dict = {}
    for flow in low.flows:
        s, t, b = flow[0], flow[1], flow[2]
        route = tuple(flow[3]) if len(flow) > 3 else None
        bad = s not in members or t not in members or not (b >= 0 and math.isfinite(b))
        if route is None:
            bad = bad or s == t
            route = topo.route(s, t) if not bad else ()
        elif not route or any(not (type(r) is int and 0 <= r < n_res) for r in route) or len(set(route)) != len(route):
            bad = True
        if bad:
            raise PluginError(plugin, f"lowering {op.primitive} of {op.key} made a bad flow {tuple(flow)}")
        k = (s, t, route)
        merged[k] = merged.get(k, 0.0) + float(b)
    flows = tuple((s, t, b, route) for (s, t, route), b in merged.items())
    return low, flows


def idle_transfer_s(flows, topo: Topology) -> float:
    """How long ``flows`` take alone on idle resources: at max-min fair rates they end when
    the busiest resource has carried its bytes. A flow is ``(src, dst, bytes)`` (routed by
    :meth:`Topology.route`) or ``(src, dst, bytes, route)``."""
    caps = topo.capacities()
    load: dict[int, float] = {}
    for f in flows:
        for r in (f[3] if len(f) > 3 else topo.route(f[0], f[1])):
            load[r] = load.get(r, 0.0) + f[2]
    return max((b / caps[r] for r, b in load.items()), default=0.0)
