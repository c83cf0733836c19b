"""Expert parallelism: routed experts sharded over EP groups carved from the dp x sp x tp chips.

The rank space includes the Ulysses ``sp`` ranks (when that plugin is installed): outside
attention each SP rank holds its own ``1/sp`` of the tokens, as a DP rank does, so an EP
group may span them and the experts are sharded over it instead of replicated over sp. The
``cp`` ranks are not included: in decode every CP rank of a group runs the same tokens
outside attention (CP splits only the context's KV), so an EP group across them would route
each token's slots once per CP rank; one rank space serves both phases.

Routing is assumed uniform: every (token, expert) slot is equally likely to land on any
expert, so each EP rank receives as many slots as it sends, ``tokens x top_k`` spread
evenly over the group, and reads the weights of the local experts expected to receive at
least one token. Dispatch and combine are all-to-alls (``ep_dispatch``, ``ep_combine``)
with a buffer of ``moe_tokens x top_k x hidden x dtype`` per rank, of which the
``(ep-1)/ep`` bound for other ranks crosses the links. Shared experts and dense layers are
not affected.
"""
from __future__ import annotations

from g5core import ConfigError, Dimension, Fragment, MemoryTerm, expert_work, hookimpl


#: the dimensions whose chips an EP group is carved from (one absent is size 1)
RANK_SPACE = ("dp", "sp", "tp")


@hookimpl
def g5_register_dimensions(register):
    register(Dimension(name="ep", factor=False, regroups=RANK_SPACE, default=1, moe_only=True,
                       doc="expert parallelism: EP groups carved from the dp x sp x tp chips (default 1)"))


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
    if model.moe.n_routed_experts % ep:
        raise ConfigError("parallel.ep", f"{model.name} has {model.moe.n_routed_experts} routed experts, "
                                         f"not divisible by ep={ep}")


@hookimpl
def g5_shard_factors(deployment, model):
    ep = deployment.size("ep")
    return {"experts": ep} if ep > 1 else None


def a2a_bytes_per_rank(ctx) -> float:
    """Per-rank all-to-all buffer: ``moe_tokens x top_k`` hidden-state rows."""
    return ctx.hidden_states_bytes(ctx.shape.moe_tokens * ctx.model.moe.n_active_experts)


@hookimpl
def g5_expand_op(ctx, lop):
    ep = ctx.size("ep")
    if lop.kind != "moe_experts" or ep == 1:
        return None
    m = ctx.model
    nbytes = a2a_bytes_per_rank(ctx)
    slots = ctx.shape.moe_tokens * m.moe.n_active_experts
    work = expert_work(m, ctx.deployment, ctx.shape, slots, slots * ep)
    placed = set(ctx.place(lop))
    groups = dict.fromkeys(ctx.rankmap.group_of("ep", c) for c in sorted(placed))
    return Fragment.combine(
        Fragment.exchange_around(
            ctx.comm_op(lop, "all_to_all", group, nbytes, "ep_dispatch", owner="ep", part="dispatch"),
            [ctx.compute_op(lop, chip, work, owner="ep", part="experts") for chip in group],
            ctx.comm_op(lop, "all_to_all", group, nbytes, "ep_combine", owner="ep", part="combine"))
        for group in groups)


@hookimpl
def g5_memory_terms(ctx):
    if ctx.size("ep") == 1 or ctx.model.moe is None:
        return None
    # send and receive buffers of one all-to-all, reused layer after layer
    per_chip = 2.0 * a2a_bytes_per_rank(ctx)
    return [MemoryTerm(name="ep_a2a_buffers", category="workspace",
                       bytes_per_chip={c: per_chip for c in ctx.all_chips})]
