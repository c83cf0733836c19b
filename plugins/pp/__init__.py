"""Pipeline parallelism: layers split into stages, activations passed stage to stage.

Split rule: ``L`` layers on ``pp`` stages give the first ``L mod pp`` stages
``ceil(L / pp)`` layers and the rest ``floor(L / pp)`` (61 layers on 4 stages: 16, 15, 15,
15). The embedding lives on the first stage, the final norm and LM head on the last. One
batch goes through every stage in turn (no micro-batching), so TTFT and TPOT include every
stage; at a stage boundary each chip sends its activations (local tokens x hidden) to the
chip with the same coordinates in the next stage (``pp_p2p``).
"""
from __future__ import annotations

from g5core import ConfigError, Dimension, Fragment, hookimpl


def stage_sizes(n_layers: int, pp: int) -> tuple[int, ...]:
    base, extra = divmod(n_layers, pp)
    return tuple(base + (1 if s < extra else 0) for s in range(pp))


def stage_of(layer: int, n_layers: int, pp: int) -> int:
    """Stage holding ``layer``; -1 (embedding) is stage 0 and ``n_layers`` (head) the last."""
    if layer < 0:
        return 0
    if layer >= n_layers:
        return pp - 1
    first = 0
    for s, size in enumerate(stage_sizes(n_layers, pp)):
        if layer < first + size:
            return s
        first += size
    raise AssertionError("unreachable")


@hookimpl
def g5_register_dimensions(register):
    register(Dimension(name="pp", factor=True, rank_order=10, doc="pipeline stages (layers split across them)"))


@hookimpl
def g5_validate_deployment(deployment, model, system):
    pp = deployment.size("pp")
    if pp > model.n_layers:
        raise ConfigError("parallel.pp", f"pp={pp} is larger than the {model.n_layers} layers of {model.name}; "
                                         f"use pp <= {model.n_layers}")


@hookimpl
def g5_layer_chips(ctx, layer):
    pp = ctx.size("pp")
    if pp == 1:
        return None
    stage = stage_of(layer, ctx.model.n_layers, pp)
    return [c for c in ctx.all_chips if ctx.rankmap.coords(c)["pp"] == stage]


@hookimpl
def g5_expand_op(ctx, lop):
    pp = ctx.size("pp")
    if lop.kind != "boundary" or pp == 1:
        return None
    n = ctx.model.n_layers
    stage = stage_of(lop.layer, n, pp)
    if stage == stage_of(lop.layer - 1, n, pp):
        return None
    nbytes = ctx.hidden_states_bytes(ctx.shape.norm_tokens)
    ops, heads, tails = [], {}, {}
    for dst in ctx.place(lop):
        coords = ctx.rankmap.coords(dst)
        coords["pp"] = stage - 1
        src = ctx.rankmap.chip_of(**coords)
        op = ctx.comm_op(lop, "p2p", (src, dst), nbytes, "pp_p2p", owner="pp", part="send")
        ops.append(op)
        heads[src] = (op.key,)
        tails[dst] = (op.key,)
    return Fragment(ops=ops, heads=heads, tails=tails)
