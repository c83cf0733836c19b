"""Communication primitives lowered into flows the way NCCL runs them.

``bytes_per_rank`` (N) is the buffer size nccl-tests reports: each rank's buffer for
all_reduce, the gathered output for all_gather, the full input for reduce_scatter, each
rank's send buffer for all_to_all, the message for p2p / broadcast / gather.

**all_reduce, all_gather, reduce_scatter.** NCCL's tuner (:mod:`.nccl`) predicts every
enabled (algorithm, protocol) pair with NCCL's time formula and picks the fastest, unless
the system file forces a choice (``nccl: {all_reduce: {algorithm: ring, protocol: simple}}``).
The chosen algorithm becomes flows on the topology's resources:

- ring: ranks ordered by node, each rank sends ``2 (n-1)/n N`` (all_reduce) or
  ``(n-1)/n N`` to the next; a hop inside a node crosses the two chips' scale-up links;
  a hop between nodes is split over the op's channels, channel ``c`` crossing NIC
  ``c mod k`` of the ``k`` NICs the group's chips use on that node (rail-aligned, as
  NCCL's search binds each channel to a NIC), so two nodes exchange data over all their
  NICs at once;
- tree (all_reduce): a chain inside each node (``N`` each way per hop: reduce up,
  broadcast down) and NCCL's double binary tree across nodes (each tree carries ``N/2``
  up and down its edges), the node-crossing edges spread over the NICs like ring hops;
- nvls (all_reduce in one node, where the switch reduces in place): each chip sends
  ``N (1 + 1/n)`` to the switch and receives as much (reduce-scatter by in-switch loads,
  all-gather by multicast stores);
- nvls_tree (all_reduce across nodes): nvls inside each node, a double binary tree between
  nodes, each chip carrying its ``N/ppn`` slice over its own NIC.

Its flows carry the payload times the protocol's own wire overhead (LL 2: a flag per data
word; LL128 128/120; NVLS: NCCL cuts the message into chunks of 16 to 128 KiB by its size,
and the switch traffic runs at NCCL's nvlsEfficiency less a measured cost per chunk (7.3 KB of
transfer, fitted on nccl-tests); NVLS tree: the switch part at NCCL's NVLS-tree chunks and bus
scaling, the NICs at NCCL's 1/nvlsEfficiency). Its start latency is NCCL's latency of the pair
plus whatever NCCL's bandwidth model adds beyond those wires (LL's polling, a tree's pipeline)
and, for NVLS, the fill of its chunk pipeline: the measured :data:`nccl.NVLS_FILL_LOOPS` loops
at the switch's rate and, for the NVLS tree, :func:`nccl.nvls_tree_fill_loops` loops of its node
crossings at the NICs' rate: time that holds the op but not its links. The system file's
``nccl: {tuner: {release: R}}`` picks the NCCL release whose tuner tables choose
(:data:`nccl.TUNER_RELEASES`). So an op alone takes NCCL's predicted time, or longer where
its wires are the limit, and a busy one slows down with everything else on its links.

**The serving framework's own all-reduce** (a framework profile's ``all_reduce``: vLLM's and
SGLang's custom all-reduce, TensorRT-LLM's one-shot / two-shot) replaces NCCL's for a group of
one node where the framework's code chooses it (:func:`custom_all_reduce`); NCCL above.

**all_to_all** is NCCL's grouped send/receive: ``N/n`` to every other rank at once. Inside
one node it follows NCCL's p2p schedule (:func:`nvlink_p2p`: channels per peer, LL or
Simple steps, a measured copy rate per channel and NVLink efficiency); across nodes a
message leaves through the sender's NIC and enters through the
receiver's, so the pairs of a node spread over all its NICs (one per chip when rails are
one to one). **p2p** is one flow
over one NIC on each side; **broadcast** and **gather** are direct flows from or to the
root. Their start latency is the system's point-to-point latency (NCCL's tuner has no
send/receive model), to which an all_to_all in a node adds its channels' copy time beyond
its links' time.
"""
from __future__ import annotations

from typing import Mapping

from g5core import (
    NVLINK_COPY_EFFICIENCY, ConfigError, Lowering, Topology, check_keys, hookimpl, idle_transfer_s, suggest,
)

from . import nccl

# ------------------------------------------------------------------------------ the system file's nccl block
#: what a system file may force, per collective (``nccl: {COLLECTIVE: {algorithm: A, protocol: P}}``)
NCCL_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
NCCL_ALGORITHMS = ("ring", "tree", "nvls", "nvls_tree")
NCCL_PROTOCOLS = ("ll", "ll128", "simple")
#: ``nccl: {p2p: {net_peer_channels: N}}``: NCCL_NCHANNELS_PER_NET_PEER (1 .. MAXCHANNELS)
NCCL_P2P_KEYS = ("net_peer_channels",)
#: ``nccl: {tuner: {release: R}}``: the NCCL release whose tuner picks (nccl.TUNER_RELEASES)
NCCL_TUNER_KEYS = ("release",)


def forced_choices(system) -> Mapping[str, Mapping[str, str]]:
    """The system file's forced NCCL choices, checked (one-line ConfigErrors naming the field):
    collectives, keys and values NCCL knows; tree for all_reduce only; nvls on a system whose
    switch reduces in place. Whether a choice applies to a group is checked where it meets one."""
    field = "system.nccl"
    for coll, choice in system.nccl.items():
        if coll == "p2p":
            _check_p2p(f"{field}.p2p", choice)
            continue
        if coll == "tuner":
            check_keys(choice, f"{field}.tuner", NCCL_TUNER_KEYS)
            release = choice.get("release", nccl.DEFAULT_TUNER)
            if release not in nccl.TUNER_RELEASES:
                raise ConfigError(f"{field}.tuner.release",
                                  f"G5 has no tuner tables of NCCL {release!r}; "
                                  f"choose one of {', '.join(nccl.TUNER_RELEASES)} (quote it: '2.26.2')")
            continue
        if coll not in NCCL_COLLECTIVES:
            raise ConfigError(f"{field}.{coll}", f"unknown collective{suggest(str(coll), NCCL_COLLECTIVES)}; "
                                                 f"NCCL's choice can be forced for {', '.join(NCCL_COLLECTIVES)}")
        check_keys(choice, f"{field}.{coll}", ("algorithm", "protocol"))
        for key, v in choice.items():
            allowed = {"algorithm": NCCL_ALGORITHMS, "protocol": NCCL_PROTOCOLS}[key]
            if v not in allowed:
                raise ConfigError(f"{field}.{coll}.{key}", f"unknown {key} {v!r}{suggest(str(v), allowed)}; "
                                                           f"choose one of {', '.join(allowed)}")
        if choice.get("algorithm") in ("tree", "nvls_tree") and coll != "all_reduce":
            raise ConfigError(f"{field}.{coll}.algorithm", f"NCCL runs {choice['algorithm']} only for all_reduce, "
                                                           f"not {coll}; choose ring (or nvls)")
        if choice.get("algorithm") in ("nvls", "nvls_tree") and not system.nvls:
            raise ConfigError(f"{field}.{coll}.algorithm",
                              "nvls needs a switch that reduces in place; set nvls: true or choose ring/tree")
    return system.nccl


def _check_p2p(field: str, choice) -> None:
    check_keys(choice, field, NCCL_P2P_KEYS)
    for key, v in choice.items():
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= nccl.MAX_CHANNELS:
            raise ConfigError(f"{field}.{key}", f"expected a whole number of channels in 1 .. {nccl.MAX_CHANNELS} "
                                                f"(NCCL_NCHANNELS_PER_NET_PEER), got {v!r}")


# ------------------------------------------------------------------------------ helpers
def _by_node(group, topo: Topology) -> dict[int, list[int]]:
    nodes: dict[int, list[int]] = {}
    for c in sorted(group, key=lambda c: (topo.node_of(c), c)):
        nodes.setdefault(topo.node_of(c), []).append(c)
    return nodes


def _rails(members, topo: Topology) -> list[int]:
    return sorted({topo.rail_of(c) for c in members})


def _nccl_group(coll: str, group, topo: Topology) -> nccl.Group:
    system = topo.system
    cc = getattr(system, "compute_capability", None)
    if cc is None:
        raise ConfigError("system.compute_capability",
                          f"system '{getattr(system, 'name', '?')}' does not give the GPU's compute capability, which "
                          "NCCL's tables depend on; add e.g. 'compute_capability: 9.0' (Hopper) to the system file")
    nodes = _by_node(group, topo)
    ppn = max(len(m) for m in nodes.values())
    rails = min(len(_rails(m, topo)) for m in nodes.values())
    tuner = system.nccl.get("tuner", {}).get("release", nccl.DEFAULT_TUNER)
    return nccl.Group(coll=coll, n_ranks=len(group), n_nodes=len(nodes), ppn=ppn,
                      link_bw_gbytes_per_s=topo.link_bw_bytes_per_s / 1e9,
                      net_bw_gbytes_per_s=rails * topo.nic_bw_bytes_per_s / 1e9,
                      compute_capability=float(cc), nvls=topo.nvls, tuner=tuner)


def _cross(flows: list, a: int, b: int, nbytes: float, channels: int, topo: Topology, rails_a, rails_b) -> None:
    """A node-crossing hop a -> b split over ``channels``, channel c on the c-th NIC (mod)."""
    na, nb = topo.node_of(a), topo.node_of(b)
    per = nbytes / channels
    for c in range(channels):
        ra, rb = rails_a[c % len(rails_a)], rails_b[c % len(rails_b)]
        flows.append((a, b, per, topo.network_route(na, ra, nb, rb)))


def ring_flows(group, nbytes: float, channels: int, topo: Topology) -> list:
    nodes = _by_node(group, topo)
    order = [c for members in nodes.values() for c in members]
    rails = {n: _rails(m, topo) for n, m in nodes.items()}
    flows: list = []
    n = len(order)
    for i in range(n):
        a, b = order[i], order[(i + 1) % n]
        if topo.same_node(a, b):
            flows.append((a, b, nbytes))
        else:
            _cross(flows, a, b, nbytes, channels, topo, rails[topo.node_of(a)], rails[topo.node_of(b)])
    return flows


def btree(nranks: int, rank: int) -> tuple[int, int, int]:
    """(parent, child0, child1) of ``rank`` in NCCL's binary tree (src/graph/trees.cc
    ncclGetBtree); -1 for none."""
    bit = 1
    while bit < nranks:
        if bit & rank:
            break
        bit <<= 1
    if rank == 0:
        return -1, -1, (bit >> 1) if nranks > 1 else -1
    up = (rank ^ bit) | (bit << 1)
    if up >= nranks:
        up = rank ^ bit
    lowbit = bit >> 1
    down0 = -1 if lowbit == 0 else rank - lowbit
    down1 = -1 if lowbit == 0 else rank + lowbit
    while down1 >= nranks:
        lowbit >>= 1
        down1 = -1 if lowbit == 0 else rank + lowbit
    return up, down0, down1


def dtree_edges(nranks: int) -> list[list[tuple[int, int]]]:
    """(child, parent) edges of NCCL's two complementary trees (trees.cc ncclGetDtree): the
    second tree mirrors the first for an even count and shifts it by one for an odd count."""
    trees: list[list[tuple[int, int]]] = [[], []]
    for r in range(nranks):
        up, _, _ = btree(nranks, r)
        if up >= 0:
            trees[0].append((r, up))
        if nranks % 2 == 1:
            up1, _, _ = btree(nranks, (r - 1) % nranks)
            parent = (up1 + 1) % nranks if up1 >= 0 else -1
        else:
            up1, _, _ = btree(nranks, nranks - 1 - r)
            parent = nranks - 1 - up1 if up1 >= 0 else -1
        if parent >= 0:
            trees[1].append((r, parent))
    return trees


def tree_flows(group, nbytes: float, channels: int, topo: Topology) -> list:
    nodes = _by_node(group, topo)
    heads = [m[0] for m in nodes.values()]
    rails = {n: _rails(m, topo) for n, m in nodes.items()}
    flows: list = []
    for members in nodes.values():               # chain: reduce up, broadcast down
        for a, b in zip(members, members[1:]):
            flows.append((b, a, nbytes))
            flows.append((a, b, nbytes))
    node_ids = list(nodes)
    for edges in dtree_edges(len(heads)):
        for child, parent in edges:
            c, p = heads[child], heads[parent]
            rc, rp = rails[node_ids[child]], rails[node_ids[parent]]
            _cross(flows, c, p, nbytes / 2, channels, topo, rc, rp)   # reduce
            _cross(flows, p, c, nbytes / 2, channels, topo, rp, rc)   # broadcast
    return flows


def nvls_flows(group, nbytes: float, topo: Topology) -> list:
    """Each chip's traffic to and from the reducing switch (``src == dst``: the switch)."""
    flows: list = []
    for members in _by_node(group, topo).values():
        k = len(members)
        for c in members:
            each = nbytes * (1.0 + 1.0 / k)
            flows.append((c, c, each, (topo.link_tx(c),)))
            flows.append((c, c, each, (topo.link_rx(c),)))
    return flows


def nvls_tree_flows(group, nbytes: float, topo: Topology) -> list:
    nodes = _by_node(group, topo)
    flows = nvls_flows(group, nbytes, topo)
    members = list(nodes.values())
    for edges in dtree_edges(len(members)):
        for child, parent in edges:
            mc, mp = members[child], members[parent]
            k = min(len(mc), len(mp))
            for j in range(k):                     # slice j crosses on chip j's rail
                a, b = mc[j], mp[j]
                na, nb = topo.node_of(a), topo.node_of(b)
                ra, rb = topo.rail_of(a), topo.rail_of(b)
                flows.append((a, b, nbytes / (2 * k), topo.network_route(na, ra, nb, rb)))
                flows.append((b, a, nbytes / (2 * k), topo.network_route(nb, rb, na, ra)))
    return flows


def lower_collective(coll: str, group, nbytes: float, topo: Topology) -> Lowering:
    g = _nccl_group(coll, group, topo)
    forced = dict(forced_choices(topo.system).get(coll, {})) if topo.system is not None else {}
    choice = nccl.choose(g, nbytes, forced)
    if choice is None:
        raise ConfigError(f"system.nccl.{coll}",
                          f"the forced choice {forced} does not apply to {coll} over {g.n_ranks} chips on "
                          f"{g.n_nodes} node(s) (nvls runs in one node, nvls_tree across nodes, both only with "
                          "protocol simple and nvls: true); change or remove it")
    algorithm, protocol, latency_us, transfer_us = choice
    hop_us = _measured_hops_us(topo)
    if hop_us and g.n_nodes > 1:    # NCCL picked with its model; the op runs at the measured floors
        latency_us, transfer_us = nccl.cost_us(g, algorithm, protocol, nbytes, hop_us)
    n = len(group)
    nc = nccl.op_channels(nbytes, 2 * g.channels, protocol, algorithm, n)
    if algorithm == "ring":
        per_rank = (2.0 * (n - 1) / n if coll == "all_reduce" else (n - 1) / n) * nbytes
        flows = ring_flows(group, per_rank, nc, topo)
    elif algorithm == "tree":
        flows = tree_flows(group, nbytes, nc, topo)
    elif algorithm == "nvls":
        flows = nvls_flows(group, nbytes, topo)
    else:
        flows = nvls_tree_flows(group, nbytes, topo)
    own = net_own = nccl.PROTOCOL_WIRE_FACTOR[protocol]
    chunk = None
    if algorithm == "nvls":      # the switch's rate with NCCL's chunks (measured per-chunk cost)
        chunk = nccl.nvls_chunk_bytes(nbytes, g.ppn)
        own = 1.0 / nccl.nvls_efficiency_of_chunk(chunk, g.compute_capability)
    elif algorithm == "nvls_tree":
        # the switch part: NCCL's NVLS-tree chunks at the measured cost per chunk, and NCCL's bus-rate
        # scaling from one node to n ranks; the NIC part: NCCL's 1 / nvlsEfficiency
        chunk = nccl.nvls_tree_chunk_bytes(nbytes, g.ppn, g.n_nodes)
        own = (1.0 / nccl.nvls_efficiency_of_chunk(chunk, g.compute_capability)
               * nccl.nvls_tree_bus_factor(g.n_ranks, g.ppn))
        net_own = 1.0 / nccl.NVLS_EFFICIENCY[nccl.comp_cap_index(g.compute_capability)]
    flows = [(f[0], f[1], f[2] * (own if f[0] == f[1] else net_own)) + tuple(f[3:]) for f in flows]
    # what NCCL's model adds beyond the wires (a protocol's polling, a tree's pipeline) holds
    # the op but not its links: it joins the start latency
    wires_s = idle_transfer_s(flows, topo)
    extra_s = max(0.0, transfer_us * 1e-6 - wires_s)
    if chunk is not None:     # NVLS: the chunk pipeline's fill, at the switch's and (tree crossings) the NICs' rate
        share = min(nccl.nvls_loop_bytes(chunk, g.ppn), nbytes) / nbytes
        switch_s = idle_transfer_s([f for f in flows if f[0] == f[1]], topo)
        net_s = idle_transfer_s([f for f in flows if f[0] != f[1]], topo)
        extra_s += (nccl.NVLS_FILL_LOOPS * switch_s + nccl.nvls_tree_fill_loops(g.n_nodes) * net_s) * share
    return Lowering(flows=flows, latency_s=latency_us * 1e-6 + extra_s, algorithm=algorithm, protocol=protocol,
                    channels=nc, wire_bytes_per_payload_byte=own)


# ------------------------------------------------------------------------------ primitives
def all_reduce(group, nbytes, topo: Topology) -> Lowering:
    custom = custom_all_reduce(group, nbytes, topo)
    return custom if custom is not None else lower_collective("all_reduce", group, nbytes, topo)


def custom_all_reduce(group, nbytes, topo: Topology):
    """The serving framework's own all-reduce kernel (``system.framework.all_reduce``,
    g5core.inputs.framework.CustomAllReduce), or None where the framework runs NCCL: a group of
    one node of a world size it supports, a buffer under its limit. One-shot: every rank reads
    each peer's whole buffer over NVLink and reduces it (``N`` from each peer); two-shot: a
    reduce-scatter then an all-gather through peer memory (``2 N / n`` from each peer). The
    flows move at NVLINK_COPY_EFFICIENCY (SM-driven loads, as NCCL's p2p copies) after the
    kernel's measured fixed cost. Symmetric memory (``symm_mem_multimem``, vLLM's torch
    multimem all-reduce above its custom kernel's limit): a fixed cost plus the measured
    seconds per byte, its flows on the links that time."""
    fw = getattr(topo.system, "framework", None) if topo.system is not None else None
    spec = getattr(fw, "all_reduce", None)
    n = len(group)
    if spec is None or len({topo.node_of(c) for c in group}) != 1:
        return None
    regime = spec.choose(n, nbytes)
    if regime is None:
        return None
    if regime == "symm_mem_multimem":
        # each rank reduces its 1 / n of the buffer through the switch (multimem.ld_reduce
        # from every peer) and stores it to all (multimem.st): N / n each way between each
        # pair, at the measured rate (symm_mem_s_per_byte) when the links are otherwise idle
        flows = tuple((a, b, nbytes / n) for a in group for b in group if a != b)
        wire = nbytes * spec.s_per_byte(n) / idle_transfer_s(flows, topo)
    else:
        per_peer = nbytes if regime == "one_shot" else 2.0 * nbytes / n
        flows = tuple((a, b, per_peer) for a in group for b in group if a != b)
        wire = 1.0 / NVLINK_COPY_EFFICIENCY
    flows = tuple((a, b, size * wire) for a, b, size in flows)
    name = regime if regime == "symm_mem_multimem" else f"{spec.kernel}_{regime}"   # not the custom kernel's
    return Lowering(flows=flows, latency_s=spec.latency_s(n, regime), algorithm=name,
                    protocol="", channels=1, wire_bytes_per_payload_byte=wire)


def all_gather(group, nbytes, topo: Topology) -> Lowering:
    return lower_collective("all_gather", group, nbytes, topo)


def reduce_scatter(group, nbytes, topo: Topology) -> Lowering:
    return lower_collective("reduce_scatter", group, nbytes, topo)


def _measured_hops_us(topo: Topology):
    """The system's measured latency per node-crossing step, by algorithm, in us (None: NCCL's own)."""
    hops = getattr(topo.system, "network_hop_latency_s", None) if topo.system is not None else None
    return {a: v * 1e6 for a, v in hops.items()} if hops else None


def _net_pair(src: int, dst: int, nbytes: float, n_ranks: int, topo: Topology) -> tuple[list, float, int, str]:
    """One cross-node send of ``nbytes`` in a communicator of ``n_ranks``: (flows, start
    latency, channels, protocol). NCCL gives the peer :func:`nccl.net_peer_channels`
    channels and the op :func:`nccl.net_op_channels` of them; the flow crosses the sender's
    and the receiver's NIC; what the channels' copies need beyond the wires joins the start
    latency (the system's measured cross-node floor, ``network_latency_s``)."""
    system = topo.system
    p2p_channels = nccl.p2p_node_channels(topo.link_bw_bytes_per_s / 1e9, float(system.compute_capability)) \
        if system is not None and system.compute_capability is not None else nccl.MAX_CHANNELS
    per_peer = nccl.net_peer_channels(topo.nic_bw_bytes_per_s / 1e9, 1, n_ranks, p2p_channels,
                                      _forced_net_peer_channels(topo))
    nc = nccl.net_op_channels(nbytes, n_ranks, per_peer, p2p_channels)
    flows = [(src, dst, nbytes)]
    copy_s = nccl.net_copy_time_us(nbytes, nc) * 1e-6
    extra_s = max(0.0, copy_s - idle_transfer_s(flows, topo))
    return flows, topo.network_latency_s + extra_s, nc, nccl.p2p_protocol(nbytes, nc)


def _forced_net_peer_channels(topo: Topology):
    """NCCL_NCHANNELS_PER_NET_PEER as the system file sets it (``nccl: {p2p: {net_peer_channels: N}}``)."""
    forced = topo.system.nccl.get("p2p", {}) if topo.system is not None else {}
    return forced.get("net_peer_channels")


def p2p(group, nbytes, topo: Topology) -> Lowering:
    src, dst = group
    if topo.same_node(src, dst):
        return Lowering(flows=((src, dst, nbytes),), latency_s=topo.message_latency_s(group), algorithm="p2p",
                        protocol="simple")
    flows, latency_s, nc, protocol = _net_pair(src, dst, nbytes, 2, topo)
    return Lowering(flows=flows, latency_s=latency_s, algorithm="p2p", protocol=protocol, channels=nc)


def sendrecv(group, nbytes, topo: Topology) -> Lowering:
    """nccl-tests' sendrecv_perf: every rank sends ``nbytes`` to the next and receives as
    much from the previous, all at once (one grouped send/receive); a pair inside a node
    is one flow at the link's rate, a pair across nodes runs as :func:`p2p` across nodes in
    a communicator of all the ranks; the op starts when its slowest pair can."""
    n = len(group)
    flows, latency_s, channels, protocol = [], 0.0, 1, "simple"
    for i, src in enumerate(group):
        dst = group[(i + 1) % n]
        if topo.same_node(src, dst):
            flows.append((src, dst, nbytes))
            latency_s = max(latency_s, topo.link_latency_s)
        else:
            pair, lat, channels, protocol = _net_pair(src, dst, nbytes, n, topo)
            flows.extend(pair)
            latency_s = max(latency_s, lat)
    return Lowering(flows=flows, latency_s=latency_s, algorithm="p2p", protocol=protocol, channels=channels)


def nvlink_p2p(group, peer_bytes: float, pairs, topo: Topology) -> Lowering:
    """NCCL's grouped send/receive of ``peer_bytes`` per pair inside one node (nccl.py,
    "point to point"): the flows carry the payload over the NVLink efficiency (and LL's flags),
    which occupies the links; the channels' copy time beyond what the links need joins the
    start latency, like NCCL's own extra time in :func:`lower_collective`."""
    g = _nccl_group("all_to_all", group, topo)
    node_channels = nccl.p2p_node_channels(g.link_bw_gbytes_per_s, g.compute_capability)
    nc = nccl.p2p_peer_channels(peer_bytes, len(group), node_channels)
    protocol = nccl.p2p_protocol(peer_bytes, nc)
    own = (nccl.P2P_LL_WIRE_FACTOR if protocol == "ll" else 1.0) / nccl.P2P_NVLINK_EFFICIENCY
    flows = [(s, t, peer_bytes * own) for s, t in pairs]
    copy_s = nccl.p2p_copy_time_us(peer_bytes, len(group), node_channels) * 1e-6
    extra_s = max(0.0, copy_s - idle_transfer_s(flows, topo))
    return Lowering(flows=flows, latency_s=topo.message_latency_s(group) + extra_s, algorithm="p2p", protocol=protocol,
                    channels=nc, wire_bytes_per_payload_byte=own)


def all_to_all(group, nbytes, topo: Topology) -> Lowering:
    n = len(group)
    pairs = [(s, t) for s in group for t in group if s != t]
    if len(topo.nodes_of(group)) == 1:
        return nvlink_p2p(group, nbytes / n, pairs, topo)
    flows = tuple((s, t, nbytes / n) for s, t in pairs)
    return Lowering(flows=flows, latency_s=topo.message_latency_s(group), algorithm="p2p", protocol="simple")


def broadcast(group, nbytes, topo: Topology) -> Lowering:
    root = group[0]
    return Lowering(flows=tuple((root, t, nbytes) for t in group[1:]), latency_s=topo.message_latency_s(group), algorithm="direct",
                    protocol="simple")


def gather(group, nbytes, topo: Topology) -> Lowering:
    root = group[0]
    return Lowering(flows=tuple((s, root, nbytes) for s in group[1:]), latency_s=topo.message_latency_s(group), algorithm="direct",
                    protocol="simple")


PRIMITIVES = {
    "p2p": p2p,
    "sendrecv": sendrecv,
    "all_reduce": all_reduce,
    "all_gather": all_gather,
    "reduce_scatter": reduce_scatter,
    "all_to_all": all_to_all,
    "broadcast": broadcast,
    "gather": gather,
}


@hookimpl
def g5_validate_deployment(deployment, model, system):
    forced_choices(system)


@hookimpl
def g5_register_primitives(register):
    for name, lower in PRIMITIVES.items():
        register(name, lower)
