"""NCCL's cost model: its latency and bandwidth tables, its time formula and its tuner.

Every table and formula here is NCCL 2.29.2's (NVIDIA/nccl commit ebd1e929285881cb4df02c3459588a2e12b2d8c0):
``src/graph/tuning.cc`` (``ncclTunerConstantsDefaults``, ``ncclTopoTuneModel``,
``ncclTopoGetAlgoTime``), ``src/enqueue.cc`` (``topoGetAlgoInfo``: channels for one op),
``src/graph/search.cc`` (speed arrays, ``ncclTopoDupChannels``) and ``src/graph/topo.h``.
Units as in NCCL: latencies in microseconds, bandwidths in GB/s (1e9 bytes/s).

What G5 substitutes: NCCL's graph search measures the bandwidth a ring or tree gets per
channel on the real machine; G5 takes it from its topology instead (the chip's scale-up
link bandwidth inside a node, the group's NICs on a node across nodes). Everything the
tuner then does with it -- protocol factors, per-channel caps, latencies, the choice -- is
NCCL's.
"""
from __future__ import annotations

import math

import attrs

from g5core import NVLINK_COPY_EFFICIENCY

ALGORITHMS = ("tree", "ring", "nvls", "nvls_tree")
PROTOCOLS = ("ll", "ll128", "simple")

# tuning.cc ncclTunerConstantsDefaults.baseLatencies [algorithm][protocol], us
BASE_LAT_US = {
    "tree": {"ll": 6.8, "ll128": 14.0, "simple": 8.4},
    "ring": {"ll": 6.6, "ll128": 14.0, "simple": 8.4},
    "nvls": {"ll": 0.0, "ll128": 0.0, "simple": 0.0},
    "nvls_tree": {"ll": 0.0, "ll128": 0.0, "simple": 0.0},
}
# tuning.cc ncclTunerConstantsDefaults.hwLatencies [NVLINK | NET][algorithm][protocol], us
HW_LAT_US = {
    "nvlink": {
        "tree": {"ll": 0.6, "ll128": 1.25, "simple": 4.0},
        "ring": {"ll": 0.6, "ll128": 1.9, "simple": 3.4},
        "nvls": {"ll": 0.0, "ll128": 0.0, "simple": 25.0},
        "nvls_tree": {"ll": 0.0, "ll128": 0.0, "simple": 25.0},
    },
    "net": {
        "tree": {"ll": 5.0, "ll128": 8.5, "simple": 14.0},
        "ring": {"ll": 2.7, "ll128": 4.0, "simple": 14.0},
        "nvls": {"ll": 0.0, "ll128": 0.0, "simple": 18.0},
        "nvls_tree": {"ll": 0.0, "ll128": 0.0, "simple": 20.9},
    },
}
# tuning.cc: compCapIndex = cc >= 10 Blackwell(3), >= 9 Hopper(2), >= 8 Ampere(1), else Volta(0);
# nodes index = 0 (1 node), 1 (2 nodes), 2 (more)
LL_MAX_BW_GBYTES_PER_S = ((39.0, 39.0, 20.4), (87.7, 22.5, 19.0), (141.0, 45.0, 35.0), (282.0, 90.0, 70.0))
PER_CH_MAX_RING_LL128_GBYTES_PER_S = ((20, 20, 20), (20, 20, 20), (36.7, 36.7, 36.7), (34.5, 34.6, 34.5))
PER_CH_MAX_TREE_LL128_GBYTES_PER_S = ((20, 20, 20), (20, 20, 20), (36.7, 36.7, 29.0), (55.6, 31.67, 20.0))
PER_CH_MAX_TREE_GBYTES_PER_S = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (38.7, 41.4, 36.0), (70.0, 42.8, 24.0))
PER_CH_MAX_NVLS_TREE_GBYTES_PER_S = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (0.0, 57.7, 45.5), (0.0, 96.0, 43.8))
NVLS_EFFICIENCY = (0.0, 0.0, 0.85, 0.74)

#: NCCL releases whose tuner G5 can run (``nccl: {tuner: {release: R}}`` in a system file): the one above,
#: the default, and NCCL 2.26.2 (NVIDIA/nccl tag v2.26.2-1, the release of nccl-tests #309's runs; the same tables
#: through v2.27.7-1). Their
#: tuning.cc tables differ, for what G5 models, in the NVLS and NVLS-tree terms and in Blackwell's per-channel
#: caps; the graph search (search.cc), the chunking (enqueue.cc) and the kernels G5 times are 2.29.2's.
TUNER_RELEASES = ("2.29.2", "2.26.2")
DEFAULT_TUNER, TUNER_2_26 = TUNER_RELEASES
#: v2.26.2-1 src/graph/tuning.cc: hwLat[NET][NVLS_TREE][SIMPLE] = 14 us (20.9 since 2.28.9, commit dbc86fd0);
#: no perChMaxNVLSTreeBws; Blackwell's per-channel caps twice Hopper's
HW_LAT_NET_NVLS_TREE_US_2_26 = 14.0
PER_CH_MAX_2_26 = {
    "ring_ll128": ((20, 20, 20), (20, 20, 20), (36.7, 36.7, 36.7), (73.4, 73.4, 73.4)),
    "tree_ll128": ((20, 20, 20), (20, 20, 20), (36.7, 36.7, 29.0), (73.4, 73.4, 58.0)),
    "tree": ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (38.7, 41.4, 36.0), (77.4, 82.8, 72.0)),
}
#: v2.26.2-1 ncclTopoTuneModel converts NVLS and NVLS-tree bus bandwidth to algorithm bandwidth by 5/6
#: (2.28.3 on: nRanks / nsteps, as the ring)
NVLS_ALGBW_RATIO_2_26 = 5.0 / 6.0
# tuning.cc treeCorrectionFactor[protocol][log2(nBytes / 64)], applied to tree all-reduce bandwidth
TREE_CORRECTION = {
    "ll": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    "ll128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    "simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
}
# tuning.cc getNetOverhead(): 1 us on Intel hosts (DGX/HGX H100 and B200 nodes); tripled for Simple
NET_OVERHEAD_US = 1.0
# ring Simple all-reduce across nodes, "plateau effect of ring" (ncclTopoGetAlgoTime), cc >= 8.0
RING_PLATEAU_LAT_FACTOR = 1.4
# enqueue.cc topoGetAlgoInfo: thread thresholds (tuning.cc/comm.h) and threads per protocol (device.h)
THREAD_THRESHOLD = {"ll": 8, "ll128": 8, "simple": 64}
MAX_THREADS = {"ll": 512, "ll128": 640, "simple": 512}
MAX_CHANNELS = 32     # NCCL's MAXCHANNELS
NVLS_CHANNELS = 16    # NCCL's default nvlsChannels on Hopper (an 8xH100 log prints "16 nvls channels")
# search.cc per-channel speed candidates (GB/s) for one node, by compute capability
SPEED_ARRAY_INTRA = {
    10: (90.0, 80.0, 70.0, 60.0, 50.0, 45.0, 40.0, 30.0, 24.0, 20.0, 19.0, 18.0),
    9: (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0),
    0: (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0),
}
# enqueue.cc calcCollChunking, NVLS: chunks of at most 128 KiB, cut to 64, 32 and 16 KiB when
# the message is below 64, 8 and 2 x (channels x NVLS heads x chunk) bytes
NVLS_MAX_CHUNK_BYTES = 131072
NVLS_CHUNK_STEPS = ((64, 65536), (8, 32768), (2, 16384))
# The measured cost of NVLS chunks and of the NVLS pipeline's fill: each chip's traffic to and from the
# switch runs at NCCL's own nvlsEfficiency (tuning.cc, NVLS_EFFICIENCY below) x chunk / (chunk +
# NVLS_CHUNK_COST_BYTES) of its link, and an op holds NVLS_FILL_LOOPS loops of its chunk pipeline
# (nvls_loop_bytes: every NVLS channel hands each head one chunk) at that rate before its first chunk is
# done, time that holds the op but not its links. Both fitted by `python tools/fit_nvls_chunk.py` to the
# two public NVLS all-reduce tables of one 8 x H100 node from 2 MiB (tests/data/nccl/azure-nd-h100-v5.csv,
# NVLS forced, to 8 GiB; aiconfigurator-h100-sxm-nccl2.29.2.csv, to 512 MiB; rms log error 0.059), and
# within -6% .. +10% of the Azure benchmark on 8 x H200 (azure-nd-h200-v5.csv), which the fit did not see.
# The measured time at one chunk size is a straight line of the size (`python tools/nvls_mid_sizes.py`)
# with an intercept one to two loops beyond NCCL's 25 us NVLS latency (the fill) and a slope near 0.85 of
# the link at 128 KiB chunks; one cost per chunk without the fill (27.7 KB) bent the slope to make up for
# the intercept and put 256 and 512 MiB 7-9% slow and 8 MiB 16% fast.
NVLS_CHUNK_COST_BYTES = 7316.0
NVLS_FILL_LOOPS = 0.878


def nvls_chunk_bytes(n_bytes: float, n_heads: int) -> int:
    """The chunk NCCL cuts an NVLS all-reduce of ``n_bytes`` into (calcCollChunking)."""
    concurrent = NVLS_CHANNELS * n_heads
    chunk = NVLS_MAX_CHUNK_BYTES
    for times, smaller in NVLS_CHUNK_STEPS:
        if n_bytes < times * concurrent * chunk and chunk > smaller:
            chunk = smaller
    return chunk


# enqueue.cc calcCollChunking, NVLS_TREE: chunks of nvlsChunkSize (128 KiB, init.cc NCCL_NVLS_CHUNKSIZE),
# at most 64 KiB from 4 nodes on (NCCL_NVLS_TREE_MAX_CHUNKSIZE default), cut to 64 and 32 KiB when the
# message is below 4 and 1 x (channels x NVLS heads x chunk) bytes (the 256 KiB and 128 KiB steps of the
# same code never apply to a 128 KiB chunk)
NVLS_TREE_CHUNK_STEPS = ((4, 65536), (1, 32768))
NVLS_TREE_MAX_CHUNK_BYTES_4_NODES = 65536


def nvls_tree_chunk_bytes(n_bytes: float, n_heads: int, n_nodes: int) -> int:
    """The chunk NCCL cuts an NVLS-tree all-reduce of ``n_bytes`` into (calcCollChunking)."""
    concurrent = NVLS_CHANNELS * n_heads
    chunk = NVLS_MAX_CHUNK_BYTES if n_nodes < 4 else NVLS_TREE_MAX_CHUNK_BYTES_4_NODES
    for times, smaller in NVLS_TREE_CHUNK_STEPS:
        if n_bytes < times * concurrent * chunk and chunk > smaller:
            chunk = smaller
    return chunk


def nvls_loop_bytes(chunk_bytes: int, n_heads: int) -> int:
    """Bytes one loop of an NVLS or NVLS-tree all-reduce covers: every NVLS channel hands each
    head one chunk (enqueue.cc calcCollChunking, ncclPatternNvls/NvlsTree: loopSize = nChannels
    x nHeads x chunkSize)."""
    return NVLS_CHANNELS * n_heads * chunk_bytes


def nvls_tree_fill_loops(n_nodes: int) -> int:
    """Loops an NVLS-tree all-reduce holds in flight beyond a one-node NVLS all-reduce before
    its first chunk is back: src/device/all_reduce.h (RunWorkColl<AllReduce, NVLS_TREE, SIMPLE>)
    passes each chunk from the head's reduce warps up the tree (``treeUp``), through the root's
    reduce warps back down (``treeDown``) and into the child's broadcast warps, so every tree
    level is crossed twice, each crossing one more stage of the chunk pipeline whose stages
    move one loop per loop time (the one-node stages -- scatter, reduce-multicast, gather --
    fill the measured NVLS_FILL_LOOPS, at the switch's rate; the crossings fill at the NICs')."""
    return 2 * log2i(n_nodes)


def nvls_tree_bus_factor(n_ranks: int, ppn: int) -> float:
    """How much more each chip's NVLS traffic an NVLS-tree all-reduce over ``n_ranks`` costs
    than an NVLS all-reduce of its ``ppn`` chips in one node. NCCL's model (tuning.cc
    ncclTopoTuneModel) gives NVLS and NVLS-tree the same per-channel bus rate (the NVLink
    rate x nvlsEfficiency) and converts bus to algorithm bandwidth by nRanks / nsteps for
    both, so at equal bus rate an op over n ranks takes 2(n-1)/n over 2(ppn-1)/ppn times the
    one-node op: ``(n - 1) / n * ppn / (ppn - 1)``."""
    if ppn < 2:
        return 1.0
    return (n_ranks - 1) / n_ranks * ppn / (ppn - 1)


def nvls_efficiency_of_chunk(chunk_bytes: float, compute_capability: float, cost_bytes: float = None) -> float:
    """Fraction of the link's rate NVLS traffic in chunks of ``chunk_bytes`` reaches: NCCL's
    nvlsEfficiency of the GPU generation, less the measured cost of each chunk."""
    cost = NVLS_CHUNK_COST_BYTES if cost_bytes is None else cost_bytes
    return NVLS_EFFICIENCY[comp_cap_index(compute_capability)] * chunk_bytes / (chunk_bytes + cost)


# the wire overhead of the protocols themselves: LL sends a 4-byte flag with every 4 data bytes,
# LL128 8 flag bytes per 128-byte line (device.h); a lowering never runs faster than its wires
PROTOCOL_WIRE_FACTOR = {"ll": 2.0, "ll128": 128.0 / 120.0, "simple": 1.0}


def comp_cap_index(compute_capability: float) -> int:
    if compute_capability >= 10:
        return 3
    if compute_capability >= 9:
        return 2
    if compute_capability >= 8:
        return 1
    return 0


def log2i(n: int) -> int:
    return max(int(n).bit_length() - 1, 0)


def graph_channels(link_bw_gbytes_per_s: float, compute_capability: float) -> int:
    """Runtime ring/tree channels of one node, as NCCL's search finds them: the first speed
    of the speed array that fits the link gives floor(link / speed) channels; channels of
    >= 25 GB/s are duplicated (ncclTopoDupChannels, not for cc > 8 below 50 GB/s with more
    than 4 channels); ncclTopoPostset doubles them again. An 8xH100 node: 370.8 GB/s ->
    6 at 60 -> 12 at 30 -> 24 channels (the log of an 8xH100 node prints 24)."""
    speeds = SPEED_ARRAY_INTRA[10 if compute_capability >= 10 else 9 if compute_capability >= 9 else 0]
    speed = next((s for s in speeds if s <= link_bw_gbytes_per_s), speeds[-1])
    n = max(1, int(link_bw_gbytes_per_s // speed))
    if speed >= 25.0 and not (compute_capability > 8.0 and speed < 50.0 and n > 4):
        n *= 2
    return min(MAX_CHANNELS, 2 * n)


def op_channels(n_bytes: float, channels: int, protocol: str, algorithm: str, n_ranks: int) -> int:
    """Channels one op of ``n_bytes`` runs on (enqueue.cc topoGetAlgoInfo): fewer for small
    messages, until each channel's threads have enough bytes."""
    if algorithm in ("nvls", "nvls_tree"):
        return NVLS_CHANNELS
    threshold = THREAD_THRESHOLD[protocol] * (n_ranks if (algorithm == "ring" and protocol == "ll") else 1)
    nt = MAX_THREADS[protocol]
    nc = channels
    while n_bytes < nc * nt * threshold and nc >= 2:
        nc -= 1
    return nc


@attrs.frozen(kw_only=True)
class Group:
    """What NCCL's tuner knows of one communicator."""

    coll: str
    n_ranks: int
    n_nodes: int
    ppn: int                       # ranks per node (the largest)
    link_bw_gbytes_per_s: float            # one chip's scale-up bandwidth, per direction
    net_bw_gbytes_per_s: float             # the group's NIC bandwidth on one node, per direction
    compute_capability: float
    nvls: bool
    tuner: str = DEFAULT_TUNER      # the NCCL release whose tuner tables are used (TUNER_RELEASES)

    @property
    def nsteps(self) -> int:
        n = self.n_ranks
        return 2 * (n - 1) if self.coll == "all_reduce" else n - 1

    @property
    def graph_busbw_gbytes_per_s(self) -> float:
        """nChannels x bw of NCCL's ring/tree graph: the link inside a node; across nodes the
        slower of the link and the group's NICs on a node (``bwIntra`` up to two nodes,
        ``bwInter`` beyond, as ncclTopoTuneModel reads them)."""
        return self.link_bw_gbytes_per_s if self.n_nodes <= 2 else min(self.link_bw_gbytes_per_s, self.net_bw_gbytes_per_s)

    @property
    def channels(self) -> int:
        return graph_channels(self.link_bw_gbytes_per_s, self.compute_capability) // 2   # graph (search) channels


#: src/transport/nvls.cc ncclNvlsInit: NVLS stays off with this many GPUs (per node) or fewer
NVLS_MIN_GPUS_EXCLUSIVE = 2


def enabled(group: Group, algorithm: str, protocol: str) -> bool:
    """Whether NCCL would consider (algorithm, protocol) for this communicator."""
    if algorithm == "tree":
        return group.coll == "all_reduce" and group.n_ranks > 1
    nvls = (group.nvls and protocol == "simple" and group.coll == "all_reduce"
            and group.ppn > NVLS_MIN_GPUS_EXCLUSIVE)
    if algorithm == "nvls":
        return nvls and group.n_nodes == 1
    if algorithm == "nvls_tree":
        return nvls and group.n_nodes > 1
    return True


def latency_us(group: Group, algorithm: str, protocol: str, hop_us=None) -> float:
    """ncclTopoTuneModel's latency of one op (before the ring plateau factor).

    ``hop_us`` (algorithm -> us), when given, replaces the network latency NCCL puts on each
    node-crossing step (``interLat``: its ``hwLatencies[NET]`` plus the network's own
    ``latencyInter``, which the IB plugin leaves at 0 -- src/transport/net_ib/init.cc
    ``props->latency = 0; // Not set`` -- counted twice for Simple, the flush) by a measured
    one; NCCL's own tuner never sees it (:func:`choose`)."""
    lat = BASE_LAT_US[algorithm][protocol]
    intra = HW_LAT_US["nvlink"][algorithm][protocol]
    inter = HW_LAT_US["net"]["tree" if group.ppn == 1 else algorithm][protocol]
    if group.tuner == TUNER_2_26 and algorithm == "nvls_tree" and group.ppn > 1:
        inter = HW_LAT_NET_NVLS_TREE_US_2_26
    if hop_us is not None and algorithm in hop_us:
        inter = hop_us[algorithm]
    nodes = group.n_nodes
    if algorithm == "ring":
        if nodes > 1:
            intra = max(intra, NET_OVERHEAD_US * (3 if protocol == "simple" else 1))
        n_inter = 0 if nodes == 1 else (2 * (nodes - 1) if group.coll == "all_reduce" else nodes - 1)
        return lat + (group.nsteps - n_inter) * intra + n_inter * inter
    if algorithm == "tree":
        return lat + 2 * ((group.n_ranks // nodes - 1) * intra + log2i(nodes) * inter)
    if algorithm == "nvls":
        return intra + (inter if nodes > 1 else 0.0)
    return lat + intra + 2 * log2i(nodes) * inter    # nvls_tree


def algbw_gbytes_per_s(group: Group, algorithm: str, protocol: str) -> float:
    """ncclTopoTuneModel's algorithm bandwidth (``comm->bandwidths``), GB/s, of the group's
    tuner release."""
    cc = comp_cap_index(group.compute_capability)
    nodes_index = min(group.n_nodes, 3) - 1
    n_ch = group.channels
    ll_max = LL_MAX_BW_GBYTES_PER_S[cc if group.n_nodes == 1 else 0][nodes_index]
    bus = group.graph_busbw_gbytes_per_s
    old = group.tuner == TUNER_2_26
    ring_ll128, tree_ll128, tree = ((PER_CH_MAX_2_26[k] for k in ("ring_ll128", "tree_ll128", "tree")) if old else
                                    (PER_CH_MAX_RING_LL128_GBYTES_PER_S, PER_CH_MAX_TREE_LL128_GBYTES_PER_S,
                                     PER_CH_MAX_TREE_GBYTES_PER_S))
    if algorithm in ("nvls", "nvls_tree"):
        n_ch = NVLS_CHANNELS
        if old:     # v2.26.2-1: nChannels x min(bwIntra, bwInter (halved beyond two nodes for the tree))
            inter = group.net_bw_gbytes_per_s / n_ch / (2 if group.n_nodes > 2 and algorithm == "nvls_tree" else 1)
            bus = n_ch * min(group.link_bw_gbytes_per_s / n_ch, inter if group.n_nodes > 1 else math.inf)
            return bus * NVLS_ALGBW_RATIO_2_26
        intra = group.link_bw_gbytes_per_s / n_ch * NVLS_EFFICIENCY[cc] * (n_ch - 1) / n_ch * 2.0
        inter = group.net_bw_gbytes_per_s / n_ch * (2 if group.n_nodes <= 2 and algorithm == "nvls_tree" else 1)
        per_ch = min(intra, inter if group.n_nodes > 1 else math.inf,
                     PER_CH_MAX_NVLS_TREE_GBYTES_PER_S[cc][nodes_index] if algorithm == "nvls_tree" else math.inf)
        bus = n_ch * per_ch
    if algorithm == "ring" and protocol == "ll":
        bus = min(ll_max, bus * 0.5)
    if algorithm == "ring" and protocol == "ll128":
        bus = min(bus * 0.92, n_ch * ring_ll128[cc][nodes_index])
    if algorithm == "tree":
        bus = min(bus * 0.92, n_ch * tree[cc][nodes_index])
        if protocol == "ll":
            bus = min(bus / 3.8, ll_max)
        elif protocol == "ll128":
            bus = min(bus * (7.0 / 9.0 if group.n_nodes == 1 else 120.0 / 128.0), n_ch * tree_ll128[cc][nodes_index])
    ratio = 0.5 if algorithm == "tree" else group.n_ranks / group.nsteps
    return bus * ratio


def cost_us(group: Group, algorithm: str, protocol: str, n_bytes: float, hop_us=None) -> tuple[float, float]:
    """ncclTopoGetAlgoTime for one op, as (latency, transfer): the time is
    ``lat + nBytes / (1000 * bw)``, with the tree correction factor on ``bw`` and the ring
    plateau factor on ``lat``; ``hop_us`` as in :func:`latency_us`."""
    bw = algbw_gbytes_per_s(group, algorithm, protocol)
    lat = latency_us(group, algorithm, protocol, hop_us)
    log_size = log2i(int(n_bytes) >> 6) if n_bytes >= 64 else -1
    if algorithm == "tree" and 0 <= log_size < 23:
        bw *= TREE_CORRECTION[protocol][log_size]
    if (algorithm == "ring" and protocol == "simple" and group.n_nodes > 1 and group.coll == "all_reduce"
            and n_bytes / (2 * group.channels * group.n_ranks) >= 64):
        lat *= RING_PLATEAU_LAT_FACTOR
    return lat, n_bytes / (1000.0 * bw)


def choose(group: Group, n_bytes: float, forced=None) -> tuple[str, str, float, float] | None:
    """The (algorithm, protocol) NCCL's tuner picks, with its latency and transfer time in
    us: the fastest enabled pair (ties: NCCL's index order, tree before ring, LL before
    Simple). ``forced`` narrows the pairs to a system file's choice; None if none is left."""
    forced = forced or {}
    best = None
    for a in ALGORITHMS:
        if forced.get("algorithm", a) != a:
            continue
        for p in PROTOCOLS:
            if forced.get("protocol", p) != p or not enabled(group, a, p):
                continue
            lat, transfer = cost_us(group, a, p, n_bytes)
            if best is None or lat + transfer < best[2] + best[3]:
                best = (a, p, lat, transfer)
    return best


# ------------------------------------------------------------------------------ point to point
# NCCL's send/receive (and so all-to-all, its grouped send/receive) inside one node, from
# enqueue.cc (NCCL 2.29.2) addP2pToPlan / scheduleP2pTasksToPlan / calcP2pChannelCount and
# init.cc / paths.cc. NCCL's tuner has no time model for them; what follows is the mechanism
# those files describe, with two constants measured on nccl-tests (below).
P2P_NVL_CHUNK_BYTES = 524288      # init.cc NCCL_P2P_NVL_CHUNKSIZE default: a Simple step over NVLink
P2P_LL_THRESHOLD_BYTES = 16384    # enqueue.cc NCCL_P2P_LL_THRESHOLD: LL up to this many bytes per channel
P2P_LL_WIRE_FACTOR = 2.0          # LL: a 4-byte flag with every 4 data bytes (device.h)
# The copy rate of one p2p channel (one CTA moving a send and a receive) over NVLink, and the
# fraction of the link's bandwidth NVLink copies reach, in GB/s and as a fraction: fitted by
# `python tools/fit_p2p.py` to nccl-tests alltoall on 2, 4 and 8 x H100 (aiconfigurator-core
# nccl_perf, NCCL 2.29.2: tests/data/nccl/aiconfigurator-h100-sxm-nccl2.29.2.csv; rms log
# error 0.113); the same constants are checked, unchanged, on H200, B200 and A100 tables
# (the script prints the errors; README "Network model" quotes them).
P2P_CHANNEL_COPY_RATE_GBYTES_PER_S = 16.53
P2P_NVLINK_EFFICIENCY = NVLINK_COPY_EFFICIENCY  # kept in g5core: the EP plugin's NVLink legs use it too


def pow2_up(n: int) -> int:
    p = 1
    while p < n:
        p <<= 1
    return p


def p2p_node_channels(link_bw_gbytes_per_s: float, compute_capability: float) -> int:
    """p2pnChannels (= p2pnChannelsPerPeer on an all-NVLink node): the runtime channels rounded
    up to a power of two (paths.cc ncclTopoComputeP2pChannels); 32 on 8 x H100, A100 or B200
    (an 8 x H100 log prints "32 p2p channels, 32 p2p channels per peer")."""
    return min(MAX_CHANNELS, pow2_up(graph_channels(link_bw_gbytes_per_s, compute_capability)))


def p2p_peer_channels(peer_bytes: float, n_ranks: int, node_channels: int) -> int:
    """Channels one send (or receive) of ``peer_bytes`` is split over inside a node:
    scheduleP2pTasksToPlan's nChannelsMin (all channels, halved until one op per channel
    covers the ranks), then addP2pToPlan's part bounds (parts of at least chunk/8, doubled
    channels while a part exceeds 32 chunks)."""
    return split_channels(peer_bytes, n_ranks, node_channels, node_channels,
                          P2P_NVL_CHUNK_BYTES // 8, P2P_NVL_CHUNK_BYTES * 32)


def split_channels(peer_bytes: float, n_ranks: int, peer_channels: int, p2p_channels: int,
                   min_part: int, max_part: int) -> int:
    """scheduleP2pTasksToPlan's nChannelsMin (the peer's channels, halved until one op per
    channel covers the ranks), then addP2pToPlan's parts of ``min_part .. max_part`` bytes
    (channels doubled while a part exceeds ``max_part`` and the peer has more)."""
    if peer_bytes <= 0:
        return 1
    c_min = peer_channels
    while c_min * n_ranks > p2p_channels and c_min > 1:
        c_min //= 2
    nc = min(c_min, math.ceil(peer_bytes / min_part))
    part = max(min_part, math.ceil(peer_bytes / nc))
    while part > max_part and nc <= peer_channels // 2:
        nc *= 2
        part = math.ceil(peer_bytes / nc)
    return nc


def p2p_protocol(peer_bytes: float, channels: int) -> str:
    """addP2pToPlan: LL when the bytes are at most NCCL_P2P_LL_THRESHOLD per channel."""
    return "ll" if peer_bytes <= channels * P2P_LL_THRESHOLD_BYTES else "simple"


def p2p_copy_time_us(peer_bytes: float, n_ranks: int, node_channels: int, rate_gbytes_per_s: float = None) -> float:
    """Time the channels' CTAs need to copy one rank's sends of ``peer_bytes`` to each of its
    ``n_ranks - 1`` peers, whatever the links allow: each channel carries a part of each op
    in Simple steps of at most one chunk through the peer's FIFO, the sender's copy of one
    step overlapping the receiver's copy of the step before (NCCL_STEPS slots), so a part
    takes ``part + step`` bytes of copy time (LL: twice the part, its flags, and no step:
    the receiver copies each line as it lands); ops sharing a channel (more ops than
    channels) share its CTA."""
    rate = P2P_CHANNEL_COPY_RATE_GBYTES_PER_S if rate_gbytes_per_s is None else rate_gbytes_per_s
    if peer_bytes <= 0 or n_ranks < 2:
        return 0.0
    nc = p2p_peer_channels(peer_bytes, n_ranks, node_channels)
    part = math.ceil(peer_bytes / nc)
    if p2p_protocol(peer_bytes, nc) == "ll":     # a flag per line: the receiver copies as lines land
        step, wire = 0, P2P_LL_WIRE_FACTOR
    else:
        step, wire = min(part, P2P_NVL_CHUNK_BYTES), 1.0
    ops_per_channel = math.ceil((n_ranks - 1) * nc / node_channels)
    return ops_per_channel * (part + step) * wire / (1000.0 * rate)


# ------------------------------------------------------------------------------ point to point across nodes
# NCCL 2.29.2 gives one remote peer few channels: paths.cc ncclTopoGetNchannels ("Remote rank, use
# network"): nNetChannels = max(netCount, divUp(netBw, NCCL_P2P_PER_CHANNEL_NET_BW = 14 GB/s)), netCount
# and netBw from topo.cc getLocalNetCountByBw (the GPU's local NICs, until their bandwidth covers the
# GPU's own PCIe path); ncclTopoComputeP2pChannels rounds it up to a power of two and, with more than one
# node, halves it while nChannelsPerPeer x divUp(nRanks, NCCL_MAX_DEV_WORK_P2P_PER_BATCH = 8) exceeds
# p2pnChannels. enqueue.cc addP2pToPlan then splits one op over at most that many channels, in parts of
# chunk/2 .. chunk with the network chunk NCCL_P2P_NET_CHUNKSIZE = 128 KiB (init.cc computeBuffSizes).
# NCCL_NCHANNELS_PER_NET_PEER (config nChannelsPerNetPeer) replaces the computed figure.
P2P_PER_CHANNEL_NET_BW_GBYTES_PER_S = 14.0
P2P_NET_CHUNK_BYTES = 131072
MAX_DEV_WORK_P2P_PER_BATCH = 8


def net_peer_channels(gpu_net_bw_gbytes_per_s: float, local_nics: int, n_ranks: int, p2p_channels: int,
                      per_net_peer: int | None = None) -> int:
    """p2pnChannelsPerPeer of a communicator that spans nodes: the channels NCCL lets one
    peer use. ``gpu_net_bw_gbytes_per_s`` is the bandwidth of the NICs local to one GPU that
    getLocalNetCountByBw counts (``local_nics`` of them); ``per_net_peer`` is
    NCCL_NCHANNELS_PER_NET_PEER where set (then NCCL keeps it, capped by p2pnChannels)."""
    if per_net_peer is not None:
        return min(p2p_channels, pow2_up(per_net_peer))
    nc = pow2_up(max(local_nics, math.ceil(gpu_net_bw_gbytes_per_s / P2P_PER_CHANNEL_NET_BW_GBYTES_PER_S)))
    batches = math.ceil(n_ranks / MAX_DEV_WORK_P2P_PER_BATCH)
    while nc * batches > p2p_channels and nc > 1:
        nc //= 2
    return nc


def net_op_channels(peer_bytes: float, n_ranks: int, peer_channels: int, p2p_channels: int) -> int:
    """Channels one cross-node send of ``peer_bytes`` runs on (scheduleP2pTasksToPlan's
    nChannelsMin, then addP2pToPlan's parts of at least chunk/2, doubled while a part
    exceeds one chunk and channels remain)."""
    return split_channels(peer_bytes, n_ranks, peer_channels, p2p_channels, P2P_NET_CHUNK_BYTES // 2,
                          P2P_NET_CHUNK_BYTES)


def net_copy_time_us(peer_bytes: float, channels: int, rate_gbytes_per_s: float = None) -> float:
    """Time the ``channels`` CTAs of one cross-node send need to move ``peer_bytes`` through
    the network FIFOs at the fitted per-channel rate (as :func:`p2p_copy_time_us`: each part
    plus one step of pipeline fill, steps of at most one network chunk)."""
    rate = P2P_CHANNEL_COPY_RATE_GBYTES_PER_S if rate_gbytes_per_s is None else rate_gbytes_per_s
    if peer_bytes <= 0:
        return 0.0
    part = math.ceil(peer_bytes / channels)
    if p2p_protocol(peer_bytes, channels) == "ll":
        step, wire = 0, P2P_LL_WIRE_FACTOR
    else:
        step, wire = min(part, P2P_NET_CHUNK_BYTES), 1.0
    return (part + step) * wire / (1000.0 * rate)
