"""Expert parallelism: routed experts sharded over EP groups carved from the dp x sp x tp chips.

The rank space includes the Ulysses ``sp`` ranks (when that plugin is installed): outside
attention each SP rank holds its own ``1/sp`` of the tokens, as a DP rank does, so an EP
group may span them and the experts are sharded over it instead of replicated over sp. The
``cp`` ranks are not included: in decode every CP rank of a group runs the same tokens
outside attention (CP splits only the context's KV), so an EP group across them would route
each token's slots once per CP rank; one rank space serves both phases.

Each EP rank routes ``moe_tokens`` tokens (``T``) to ``top_k`` experts each and holds
``n_routed_experts / ep`` whole experts. The dispatch before the experts and the combine
after them run one of three kernel families (``plugins: {ep: {kernel: ...}}``):

- ``normal`` (DeepEP's normal kernels; the default for prefill): one RDMA copy per
  (token, destination node) to the GPU of the same local index on that node, then NVLink
  forwarding from there to the GPUs of that node that hold the token's experts; the combine
  is the mirror image. Per rank: ``ep_rdma`` carries ``T x E[nodes] x (N-1)/N`` copies to
  the other ``N - 1`` nodes of the group, spread evenly, each on the sender's and the
  receiver's rail NIC; at the same time an ``all_to_all`` inside each node carries the
  forwarded copies (``ep_nvl``), ``T x E[ranks]`` per rank of which ``(ppn-1)/ppn`` leave
  the GPU, as NVLink copies at their measured efficiency. The
  experts wait for both; the op takes what its busier resource needs, as DeepEP's
  pipelined forwarding does.
- ``low_latency`` (DeepEP's low-latency kernels, pure RDMA; the default for decode): one
  copy per (token, routed expert), written straight into the receiving expert's buffer
  (DeepEP's layout), ``T x top_k x (ep-1)/ep`` copies per rank spread over the other ranks,
  all through the NICs (same node too); each call starts after a fixed latency
  (:data:`LL_DISPATCH_LATENCY_S`, :data:`LL_COMBINE_LATENCY_S`). The send is issued and the
  receive completes without holding a compute stream (DeepEP's receive hook), so the
  engine overlaps the transfer with whatever compute is ready.
- ``flat``: the plain all-to-all of before (one copy per (token, expert) in the activation
  dtype, ``(ep-1)/ep`` of it to other ranks), kept for comparison; with ``imbalance: 1.0``
  it reproduces those results bit for bit (dtype options do not apply to it).

Copies: ``dispatch_dtype`` fp8 (default; DeepEP's FP8 dispatch) is ``hidden`` bytes plus one
fp32 scale per 128 elements (7168 + 224 B for DeepSeek-V3); bf16 is ``2 x hidden``.
``combine_dtype`` bf16 (default; DeepEP combines in BF16) or fp8. A low-latency dispatch copy
also carries DeepEP's 16-byte token header (``tests/legacy/test_low_latency.py`` counts it).

``E[nodes]`` and ``E[ranks]`` come from uniform routing under the group limit
(:func:`plugins.ep.routing.expected_units_hit`). ``node_limit: model`` (default) uses the
model's ``n_group`` / ``topk_group`` (DeepSeek-V3: 4 of 8 groups; 1 / 1 for models without);
an integer ``n`` makes the nodes of the group the routing groups, at most ``n`` per token
(DeepEP's own benchmark routing).

Two-batch overlap (``two_batch_overlap: true``, as SGLang and DeepSeek run it): the step is
split into two micro-batches of half the sequences each (``g5_micro_batches``); the core
expands the whole program once per micro-batch, and the engine runs one micro-batch's
dispatch/combine while the other's attention and experts hold the compute stream (nothing
is assumed to overlap: dependencies and the one compute stream per chip decide). The
summary's ``hidden`` column says how much of the all-to-all ran under compute. With pipeline
micro-batches (``plugins.pp.microbatches``) each micro-batch is split so, by the same rules.

Expert load (``imbalance``): ``from_routing`` (default) draws the step's (token, expert) slots
of one EP group with a fixed seed and takes the busiest rank's share over the mean; a
number >= 1 is a given max/mean factor; ``1.0`` is uniform. Every rank is then modelled as
the busiest (its grouped GEMM and its dispatch/combine bytes times the factor), which is
what the step waits for at the combine. ``eplb: {redundant_experts: N}`` places ``N``
redundant experts the way DeepSeek's EPLB does, which narrows the factor; their weights are
in the memory ledger (``eplb_redundant_experts``). Shared experts and dense layers are not
affected.
"""
from __future__ import annotations

from typing import Mapping

from g5core import (NVLINK_COPY_EFFICIENCY, CommOp, ConfigError, Dimension, Fragment, Lowering, MemoryTerm,
                    PluginOption, Topology, expert_work, hookimpl, weight_elements)

from .routing import expected_units_hit, routing_imbalance

KERNELS = ("auto", "normal", "low_latency", "flat")
#: elements sharing one fp32 scale in DeepEP's FP8 cast (per_token_cast_to_fp8: 128)
FP8_SCALE_BLOCK = 128
FP32_BYTES = 4
#: DeepEP's low-latency dispatch message: the token plus a 16-byte header
LL_HEADER_BYTES = 16

# Per-call latency of the low-latency kernels, from the smallest EP of DeepEP's pure-RDMA
# table (tests/data/deepep/deepep-performance.csv, README at commit ebfe47e, H800 + CX7):
# EP8 dispatch 163 us and combine 318 us, less the time their bytes need on one NIC at the
# h800 system file's 48 GB/s (128 tokens x 8 copies x 7/8 to other ranks, 7408 B a dispatch
# copy, 14336 B a combine copy: 138.3 us and 267.6 us). No lower-level measurement of it is
# published; tests/test_ep_deepep.py re-derives both from the table.
LL_DISPATCH_LATENCY_S = 24.7e-6
LL_COMBINE_LATENCY_S = 50.4e-6


class Frozen(dict):
    """A mapping option value that can be hashed (it is never changed after parsing)."""

    def __hash__(self):
        return hash(tuple(sorted(self.items())))


def _parse_node_limit(value, field):
    if value == "model" or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    raise ConfigError(field, f"must be 'model' (the model's topk_group of n_group) or a positive whole number of "
                             f"nodes, got {value!r}")


def _parse_imbalance(value, field):
    if value == "from_routing":
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 1.0 and value == value \
            and value != float("inf"):
        return float(value)
    raise ConfigError(field, f"must be 'from_routing' or a max/mean expert-load factor >= 1 (1.0: uniform), "
                             f"got {value!r}")


def _parse_eplb(value, field):
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) != {"redundant_experts"}:
        raise ConfigError(field, f"must be a mapping {{redundant_experts: N}}, got {value!r}")
    n = value["redundant_experts"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"{field}.redundant_experts", f"must be a whole number >= 0, got {n!r}")
    return Frozen(redundant_experts=n)


#: the dimensions whose chips an EP group is carved from (one absent is size 1)
RANK_SPACE = ("dp", "sp", "tp")


@hookimpl
def g5_register_dimensions(register):
    register(Dimension(name="ep", factor=False, regroups=RANK_SPACE, default=1, moe_only=True,
                       doc="expert parallelism: EP groups carved from the dp x sp x tp chips (default 1)"))


@hookimpl
def g5_register_options(register):
    register(PluginOption(name="kernel", default="auto", kind="choice", choices=KERNELS,
                          doc="dispatch/combine kernels: normal, low_latency (DeepEP's), flat (a plain all-to-all); "
                              "auto: normal for prefill, low_latency for decode"))
    register(PluginOption(name="dispatch_dtype", default="fp8", kind="choice", choices=("fp8", "bf16"),
                          doc="dispatch copies: fp8 with its scales (DeepEP's) or bf16"))
    register(PluginOption(name="combine_dtype", default="bf16", kind="choice", choices=("bf16", "fp8"),
                          doc="combine copies: bf16 (DeepEP's) or fp8"))
    register(PluginOption(name="node_limit", default="model", kind="value", parse=_parse_node_limit,
                          doc="routing group limit: 'model' (topk_group of n_group) or at most N nodes per token"))
    register(PluginOption(name="imbalance", default="from_routing", kind="value", parse=_parse_imbalance,
                          doc="expert load max/mean: from_routing (seeded draw at the step's tokens) or a factor >= 1"))
    register(PluginOption(name="eplb", default=None, kind="value", parse=_parse_eplb,
                          doc="EPLB redundant experts: {redundant_experts: N}"))
    register(PluginOption(name="two_batch_overlap", default=False,
                          doc="split the step into two micro-batches so one's dispatch/combine runs under the "
                              "other's compute (SGLang/DeepSeek TBO)"))


@hookimpl
def g5_micro_batches(deployment, model):
    if not deployment.option("ep", "two_batch_overlap", False):
        return None
    if deployment.size("ep") == 1:
        raise ConfigError("plugins.ep.two_batch_overlap", "overlaps the EP dispatch/combine, but ep is 1; set ep > 1 "
                                                          "or remove the option")
    if len(deployment.step) != 1:
        raise ConfigError("plugins.ep.two_batch_overlap", "splits the sequences of one group into two micro-batches; "
                                                          "this step has several groups: give one, or remove the option")
    if deployment.batch < 2:
        raise ConfigError("plugins.ep.two_batch_overlap", f"splits the batch into two micro-batches, but the batch "
                                                          f"is {deployment.batch}; use batch >= 2 per replica")
    return (deployment.batch - deployment.batch // 2, deployment.batch // 2)


@hookimpl
def g5_validate_deployment(deployment, model, system):
    ep = deployment.size("ep")
    if ep == 1:
        return
    space = 1
    for dim in RANK_SPACE:
        space *= deployment.size(dim)
    if space % ep:
        raise ConfigError("parallel.ep", f"ep={ep} does not divide dp x sp x tp = {space}; EP groups are carved from "
                                         f"the dp x sp x tp chips, so ep must divide {space}")
    if model.moe is None:
        raise ConfigError("parallel.ep", f"{model.name} has no MoE layers; set ep: 1")
    redundant = redundant_experts(deployment)
    physical = model.moe.n_routed_experts + redundant
    if physical % ep:
        if not redundant:
            raise ConfigError("parallel.ep", f"{model.name} has {model.moe.n_routed_experts} routed experts, "
                                             f"not divisible by ep={ep} (EPLB's redundant experts can make up the "
                                             f"difference: plugins.ep.eplb.redundant_experts)")
        raise ConfigError("plugins.ep.eplb.redundant_experts",
                          f"{model.moe.n_routed_experts} routed + {redundant} redundant experts do not spread evenly "
                          f"over ep={ep} ranks (EPLB gives every GPU the same number of experts)")
    groups = model.moe.n_groups
    if physical % groups:
        raise ConfigError("plugins.ep.eplb.redundant_experts",
                          f"{physical} physical experts do not split into the model's {groups} routing groups")


@hookimpl
def g5_shard_factors(deployment, model):
    ep = deployment.size("ep")
    return {"experts": ep} if ep > 1 else None


# ------------------------------------------------------------------------------ settings
def redundant_experts(deployment) -> int:
    eplb = deployment.option("ep", "eplb")
    return eplb["redundant_experts"] if eplb else 0


def physical_experts(deployment, model) -> int:
    """Routed experts plus EPLB's redundant ones: the experts the EP ranks hold. Routing is
    modelled over them (a replica takes an equal share of its expert's tokens), so with
    redundant experts ``E + N`` need not divide by ep but by the ranks and the groups."""
    return model.moe.n_routed_experts + redundant_experts(deployment)


def kernel_of(deployment) -> str:
    """The kernel family a deployment runs (``auto``: normal for prefill, low_latency for decode)."""
    kernel = deployment.option("ep", "kernel", "flat")
    if kernel == "auto":
        return "low_latency" if deployment.phase == "decode" else "normal"
    return kernel


def kernel_for(ctx) -> str:
    """The kernel family a run's EP groups use: :func:`kernel_of`, except that ``auto`` runs
    the flat all-to-all where an EP group has unequal chips on its nodes (the normal kernels'
    per-node forwarding needs the same count on each; asking for ``normal`` there is an error)."""
    kernel = kernel_of(ctx.deployment)
    if kernel == "normal" and ctx.deployment.option("ep", "kernel") == "auto":
        counts = {len(m) for m in _members_by_node(ctx.rankmap.groups("ep")[0], ctx.topology)}
        if len(counts) > 1:
            return "flat"
    return kernel


def copy_bytes(dtype: str, hidden: int) -> float:
    """Bytes of one token copy: fp8 is a byte an element plus an fp32 scale per 128."""
    if dtype == "fp8":
        return float(hidden + -(-hidden // FP8_SCALE_BLOCK) * FP32_BYTES)
    return 2.0 * hidden


def routing_groups(deployment, model, n_nodes: int) -> tuple[int, int]:
    """(groups, groups per token) of the router: the model's, or the nodes under ``node_limit: n``."""
    limit = deployment.option("ep", "node_limit", "model")
    if limit == "model":
        return model.moe.n_groups, model.moe.topk_groups
    if physical_experts(deployment, model) % n_nodes:
        raise ConfigError("plugins.ep.node_limit", f"{physical_experts(deployment, model)} experts do not split "
                                                   f"over the {n_nodes} nodes of an EP group; use node_limit: model")
    return n_nodes, min(limit, n_nodes)


def fanout(n_experts: int, topk: int, ep: int, n_nodes: int, groups: tuple[int, int]) -> tuple[float, float]:
    """(E[distinct nodes], E[distinct ranks]) one token reaches in an EP group of ``ep`` ranks
    spread evenly over ``n_nodes`` nodes."""
    per_rank = n_experts // ep
    nodes = expected_units_hit((per_rank * (ep // n_nodes),) * n_nodes, n_experts, topk, *groups)
    ranks = expected_units_hit((per_rank,) * ep, n_experts, topk, *groups)
    return nodes, ranks


def imbalance_factor(deployment, model, tokens_per_rank: float) -> float:
    """Busiest rank's expert load over the mean (``imbalance``, with EPLB)."""
    ep = deployment.size("ep")
    value = deployment.option("ep", "imbalance", 1.0)
    if value != "from_routing":
        return float(value)
    slots = int(round(tokens_per_rank * ep * model.moe.n_active_experts))
    return routing_imbalance(slots, model.moe.n_routed_experts, ep, redundant_experts(deployment))


def a2a_bytes_per_rank(ctx) -> float:
    """Per-rank buffer of the flat all-to-all: ``moe_tokens x top_k`` hidden-state rows."""
    return ctx.hidden_states_bytes(ctx.shape.moe_tokens * ctx.model.moe.n_active_experts)


# ------------------------------------------------------------------------------ ops
def _comm(prefix: str, primitive: str, group, nbytes: float, reason: str, layer: int, name: str,
          part: str) -> CommOp:
    group = tuple(group)
    return CommOp(key=f"{prefix}.{part}@g{'-'.join(map(str, group))}", primitive=primitive, group=group,
                  bytes_per_rank=nbytes, reason=reason, layer=layer, name=name, owner="ep")


def _members_by_node(group, topo: Topology) -> list[tuple[int, ...]]:
    nodes: dict[int, list[int]] = {}
    for c in sorted(group):
        nodes.setdefault(topo.node_of(c), []).append(c)
    return [tuple(m) for m in nodes.values()]


def exchange_ops(kernel: str, direction: str, group, topo: Topology, tokens: float, copy: float, topk: int,
                 fan: tuple[float, float], prefix: str, layer: int, name: str) -> list[tuple[CommOp, tuple]]:
    """The comm ops of one dispatch (``direction`` "dispatch") or combine of one EP group,
    each with the chips whose experts wait for it (dispatch) or that wait for it (combine).
    ``tokens`` per rank (times the imbalance factor), ``copy`` bytes a token copy."""
    reason = f"ep_{direction}"
    ep = len(group)
    if kernel == "low_latency":
        nbytes = tokens * topk * copy * (ep - 1) / ep
        op = _comm(prefix, f"ep_ll_{direction}", group, nbytes, reason, layer, name, direction)
        return [(op, tuple(group))]
    nodes = _members_by_node(group, topo)
    if len({len(m) for m in nodes}) > 1:
        raise ConfigError("plugins.ep.kernel", f"the normal kernels need an EP group with as many chips on each "
                                               f"node; this one has {[len(m) for m in nodes]}; use kernel: flat")
    e_nodes, e_ranks = fan
    out = []
    n = len(nodes)
    if n > 1:
        rdma = _comm(prefix, "ep_rdma", group, tokens * e_nodes * (n - 1) / n * copy, reason, layer, name,
                     f"{direction}_rdma")
        out.append((rdma, tuple(group)))
    if len(nodes[0]) > 1:
        for members in nodes:
            out.append((_comm(prefix, "ep_nvl", members, tokens * e_ranks * copy, reason, layer, name,
                              f"{direction}_nvl"), members))
    return out


def exchange_fragment(dispatch, computes, combine) -> Fragment:
    """Dispatch ops, one compute op per chip waiting for the dispatch ops it is in, and
    combine ops waiting for every compute op of their chips' group."""
    computes = tuple(computes)
    on = {c.chip: c.key for c in computes}
    edges = [(op.key, on[c]) for op, chips in dispatch for c in chips if c in on]
    edges += [(on[c], op.key) for op, _ in combine for c in op.group if c in on]
    heads: dict[int, list[str]] = {}
    tails: dict[int, list[str]] = {}
    for op, _ in dispatch:
        for c in op.group:
            heads.setdefault(c, []).append(op.key)
    for op, chips in combine:
        for c in chips:
            tails.setdefault(c, []).append(op.key)
    ops = [op for op, _ in dispatch] + [op for op, _ in combine] + list(computes)
    return Fragment(ops=ops, edges=edges, heads={c: tuple(k) for c, k in heads.items()},
                    tails={c: tuple(k) for c, k in tails.items()})


@hookimpl
def g5_expand_op(ctx, lop):
    ep = ctx.size("ep")
    if lop.kind != "moe_experts" or ep == 1:
        return None
    m, dep = ctx.model, ctx.deployment
    kernel = kernel_for(ctx)
    topk = m.moe.n_active_experts
    tokens = ctx.shape.moe_tokens
    factor = imbalance_factor(dep, m, tokens)
    slots = tokens * topk
    work = expert_work(m, dep, ctx.shape, slots * factor if factor != 1.0 else slots, slots * ep)
    placed = set(ctx.place(lop))
    groups = dict.fromkeys(ctx.rankmap.group_of("ep", c) for c in sorted(placed))
    if kernel == "flat":
        nbytes = a2a_bytes_per_rank(ctx) * factor if factor != 1.0 else a2a_bytes_per_rank(ctx)
        return Fragment.combine(
            Fragment.exchange_around(
                ctx.comm_op(lop, "all_to_all", group, nbytes, "ep_dispatch", owner="ep", part="dispatch"),
                [ctx.compute_op(lop, chip, work, owner="ep", part="experts") for chip in group],
                ctx.comm_op(lop, "all_to_all", group, nbytes, "ep_combine", owner="ep", part="combine"))
            for group in groups)
    topo = ctx.topology
    d_copy, c_copy = exchange_copies(dep, m.hidden_size, kernel)
    frags = []
    for group in groups:
        fan = fanout(physical_experts(dep, m), topk, ep, len(topo.nodes_of(group)),
                     routing_groups(dep, m, len(topo.nodes_of(group))))
        args = (group, topo, tokens * factor, )
        dispatch = exchange_ops(kernel, "dispatch", *args, d_copy, topk, fan, lop.prefix, lop.layer, lop.kind)
        combine = exchange_ops(kernel, "combine", *args, c_copy, topk, fan, lop.prefix, lop.layer, lop.kind)
        computes = [ctx.compute_op(lop, chip, work, owner="ep", part="experts") for chip in group]
        frags.append(exchange_fragment(dispatch, computes, combine))
    return Fragment.combine(frags)


def exchange_copies(deployment, hidden: int, kernel: str) -> tuple[float, float]:
    """(dispatch, combine) bytes of one token copy for the kernel family."""
    d_copy = copy_bytes(deployment.option("ep", "dispatch_dtype", "fp8"), hidden)
    c_copy = copy_bytes(deployment.option("ep", "combine_dtype", "bf16"), hidden)
    if kernel == "low_latency":
        d_copy += LL_HEADER_BYTES
    return d_copy, c_copy


# ------------------------------------------------------------------------------ lowerings
def ep_rdma(group, nbytes, topo: Topology) -> Lowering:
    """DeepEP's normal-kernel RDMA leg: each rank sends ``nbytes`` spread evenly over the
    other nodes of the group, to the rank of the same local index there, NIC to NIC."""
    nodes = _members_by_node(group, topo)
    flows = []
    per = nbytes / max(1, len(nodes) - 1)   # a group inside one node sends nothing this way
    for a in nodes:
        for b in nodes:
            if a is b:
                continue
            for s, t in zip(a, b):
                flows.append((s, t, per, topo.network_route(topo.node_of(s), topo.rail_of(s), topo.node_of(t),
                                                            topo.rail_of(t))))
    return Lowering(flows=flows, latency_s=topo.network_latency_s, algorithm="deepep_normal", protocol="rdma")


def _ll(group, nbytes, topo: Topology, latency_s: float) -> Lowering:
    per = nbytes / (len(group) - 1)
    flows = [(s, t, per, topo.network_route(topo.node_of(s), topo.rail_of(s), topo.node_of(t), topo.rail_of(t)))
             for s in group for t in group if s != t]
    return Lowering(flows=flows, latency_s=latency_s, algorithm="deepep_low_latency", protocol="rdma")


def ep_ll_dispatch(group, nbytes, topo: Topology) -> Lowering:
    """DeepEP's low-latency dispatch: ``nbytes`` per rank spread evenly over the other ranks,
    every copy through the NICs, after :data:`LL_DISPATCH_LATENCY_S`."""
    return _ll(group, nbytes, topo, LL_DISPATCH_LATENCY_S)


def ep_ll_combine(group, nbytes, topo: Topology) -> Lowering:
    """DeepEP's low-latency combine, like the dispatch, after :data:`LL_COMBINE_LATENCY_S`."""
    return _ll(group, nbytes, topo, LL_COMBINE_LATENCY_S)


def ep_nvl(group, nbytes, topo: Topology) -> Lowering:
    """DeepEP's NVLink leg inside one node: each rank sends ``nbytes / n`` to each of the
    ``n - 1`` others (the ``n``-th share stays), as SM copies at NVLink's measured copy
    efficiency (:data:`g5core.NVLINK_COPY_EFFICIENCY`: the flows carry the payload over it)."""
    own = 1.0 / NVLINK_COPY_EFFICIENCY
    flows = [(s, t, nbytes / len(group) * own) for s in group for t in group if s != t]
    return Lowering(flows=flows, latency_s=topo.link_latency_s, algorithm="deepep_normal", protocol="nvlink",
                    wire_bytes_per_payload_byte=own)


@hookimpl
def g5_register_primitives(register):
    register("ep_rdma", ep_rdma)
    register("ep_nvl", ep_nvl)
    register("ep_ll_dispatch", ep_ll_dispatch)
    register("ep_ll_combine", ep_ll_combine)


# ------------------------------------------------------------------------------ memory, notes
def _ep_run(ctx):
    """``(deployment, model, kernel)`` of a run with expert parallelism, else ``None``."""
    if ctx.size("ep") == 1 or ctx.model.moe is None:
        return None
    return ctx.deployment, ctx.model, kernel_for(ctx)


@hookimpl
def g5_memory_terms(ctx):
    if (run := _ep_run(ctx)) is None:
        return None
    dep, m, kernel = run
    tokens = ctx.shape.moe_tokens
    if kernel == "flat":
        # send and receive buffers of one all-to-all, reused layer after layer
        per_chip = 2.0 * a2a_bytes_per_rank(ctx)
    else:
        d_copy, c_copy = exchange_copies(dep, m.hidden_size, kernel)
        ep = ctx.size("ep")
        if kernel == "low_latency":
            # DeepEP's layout: room for every one of the ep ranks' tokens in each of the
            # physical_experts / ep local experts' buffers, two buffers (one call's while the
            # next is issued)
            per_chip = 2.0 * physical_experts(dep, m) * tokens * (d_copy + c_copy)
        else:
            n_nodes = len(ctx.topology.nodes_of(ctx.rankmap.groups("ep")[0]))
            _, e_ranks = fanout(physical_experts(dep, m), m.moe.n_active_experts, ep, n_nodes,
                                routing_groups(dep, m, n_nodes))
            # receive buffers of the dispatch and of the combine
            per_chip = tokens * e_ranks * (d_copy + c_copy)
        per_chip *= imbalance_factor(dep, m, tokens)
    terms = [MemoryTerm(name="ep_a2a_buffers", category="workspace",
                        bytes_per_chip={c: per_chip for c in ctx.all_chips})]
    redundant = redundant_experts(dep)
    if redundant:
        # each GPU holds redundant / ep more experts in every MoE layer it holds
        per_expert = weight_elements("moe_experts", m, ctx.shape) / ctx.shape.experts
        each = redundant / ctx.size("ep") * per_expert * dep.dtypes.weight_element_bytes("experts")
        held = {c: 0.0 for c in ctx.all_chips}
        for layer in range(m.n_layers):
            if m.is_moe_layer(layer):
                for c in ctx.layer_chips(layer):
                    held[c] += each
        terms.append(MemoryTerm(name="eplb_redundant_experts", category="weights", bytes_per_chip=held))
    return terms


@hookimpl
def g5_run_notes(ctx):
    if (run := _ep_run(ctx)) is None:
        return None
    dep, m, kernel = run
    value = dep.option("ep", "imbalance")
    b = dep.batch
    # the routed tokens of each micro-batch (of the whole step without two-batch overlap)
    parts = (b - b // 2, b // 2) if dep.option("ep", "two_batch_overlap") else (b,)
    tokens = [ctx.shape.moe_tokens * part / b for part in parts]
    factors = " and ".join(f"{imbalance_factor(dep, m, t):.3f}" for t in tokens)
    drawn = " and ".join(f"{t * ctx.size('ep'):g}" for t in tokens)
    how = f"from a seeded routing draw of {drawn} tokens" if value == "from_routing" else "as given"
    eplb = f", EPLB with {redundant_experts(dep)} redundant experts" if redundant_experts(dep) else ""
    dtypes = "" if kernel == "flat" else (f", dispatch {dep.option('ep', 'dispatch_dtype')}, "
                                          f"combine {dep.option('ep', 'combine_dtype')}")
    notes = [f"ep: {kernel} kernels{dtypes}; expert load max/mean {factors} {how}{eplb} (the busiest rank's "
             "experts and all-to-all share follow it)"]
    if len(parts) > 1:
        notes.append(f"ep: two-batch overlap, micro-batches of {parts[0]} and {parts[1]} sequences per replica "
                     "(their ep_dispatch/ep_combine 'hidden' share below is what ran under the other's compute)")
    return notes


# ------------------------------------------------------------------------------ g5 collective
#: ``g5 collective ep_dispatch|ep_combine`` settings and their defaults: DeepEP's benchmark
#: (tests/legacy/test_internode.py: 4096 tokens, hidden 7168, 256 experts, top-8, the nodes
#: as routing groups with min(nodes, 4) of them per token)
BENCH_DEFAULTS = {"tokens": 4096, "topk": 8, "hidden": 7168, "experts": 256, "groups": None, "topk_groups": None,
                  "kernel": "normal", "dtype": None}


@hookimpl
def g5_bench_ops(name, topology, params):
    if name not in ("ep_dispatch", "ep_combine"):
        return None
    direction = name[len("ep_"):]
    p = {**BENCH_DEFAULTS, **{k: v for k, v in params.items() if v is not None}}
    unknown = sorted(set(params) - set(BENCH_DEFAULTS))
    if unknown:
        raise ConfigError(f"--{unknown[0]}", f"{name} has no option {unknown[0]!r}")
    group = tuple(range(topology.chips))
    ep, n_nodes = len(group), len(topology.nodes_of(group))
    groups = p["groups"] or n_nodes
    topk_groups = p["topk_groups"] or min(groups, 4)
    tokens, topk, hidden, experts = (int(p[k]) for k in ("tokens", "topk", "hidden", "experts"))
    kernel = p["kernel"]
    if kernel not in ("normal", "low_latency"):
        raise ConfigError("--kernel", f"must be normal or low_latency, got {kernel!r}")
    for what, n in (("--experts", ep), ("--experts", groups)):
        if experts % n:
            raise ConfigError(what, f"{experts} experts do not split over {n}; give a multiple")
    if topk_groups > groups or topk_groups * (experts // groups) < topk or topk > experts:
        raise ConfigError("--topk-groups", f"{topk_groups} of {groups} groups cannot hold top-{topk}")
    copy = copy_bytes(p["dtype"] or ("fp8" if direction == "dispatch" else "bf16"), hidden)
    if kernel == "low_latency" and direction == "dispatch":
        copy += LL_HEADER_BYTES
    fan = fanout(experts, topk, ep, n_nodes, (groups, topk_groups))
    ops = exchange_ops(kernel, direction, group, topology, float(tokens), copy, topk, fan, "E", 0, name)
    fragment = Fragment(ops=[op for op, _ in ops])
    if kernel == "low_latency":
        logical = {"rdma": tokens * topk * copy}
    else:
        logical = {"rdma": tokens * fan[0] * copy} if n_nodes > 1 else {}
        logical["nvl"] = tokens * fan[1] * copy
    return fragment, logical
