"""The context-parallel dimension ``cp`` (spec v1.1.1): groups, sharding, guards.

- ``cp`` is a factor of the chip count (dp x tp x pp x cp = chips) and must be stated in
  every configuration. A CP group is the cp chips sharing one (dp, pp, tp) coordinate.
- Prefill: every chip runs non-attention ops on ``S/cp`` of each sequence's tokens and
  holds ``S/cp`` of its KV (balanced chunk split: ``S`` must divide by ``2 cp``).
- The LM head computes the logits of each sequence's last token, on the CP root, which
  holds the last chunk in the balanced split.
- Decode: each chip holds ``S/cp`` of each sequence's KV. The new tokens live on the CP
  group's root (cp rank 0), which runs every non-attention op for the whole batch; the
  other ranks only hold KV shards and compute partial attention (pass-Q). Decode compute
  on the root does not shrink with cp beyond the KV read: cp buys capacity, not speed.
- ``cp > 1`` with TP sequence parallelism is refused by the TP plugin, which owns that
  switch (``plugins.tp.sp``; both cut the sequence), and attention at
  ``cp > 1`` must be claimed by a pass-KV (prefill) or pass-Q (decode) plugin: the core's
  single-chip attention would silently be wrong.
"""
from __future__ import annotations

from g5core import ConfigError, Dimension, hookimpl

PHASE_PLUGIN = {"prefill": "cp_passkv", "decode": "cp_passq"}


@hookimpl
def g5_register_dimensions(register):
    register(Dimension(name="cp", factor=True, rank_order=20, default=None,
                       doc="context parallelism: the sequence split over cp chips (required)"))


@hookimpl
def g5_validate_deployment(deployment, model, system):
    cp = deployment.size("cp")
    if cp == 1:
        return
    if deployment.seq_len % (2 * cp):
        raise ConfigError("seq_len", f"seq_len={deployment.seq_len} is not divisible by 2 x cp = {2 * cp} "
                                     f"(balanced chunk split); use a multiple of {2 * cp}")


@hookimpl
def g5_shard_factors(deployment, model):
    cp = deployment.size("cp")
    if cp == 1:
        return None
    if deployment.phase == "prefill":
        return {"tokens": cp, "kv_len": cp}
    return {"kv_len": cp}


def cp_roots(ctx):
    return [g[0] for g in ctx.rankmap.groups("cp")]


HEAD_KINDS = ("final_norm", "lm_head")


@hookimpl
def g5_place_op(ctx, lop):
    if ctx.size("cp") == 1 or lop.kind == "attention":
        return None
    if ctx.phase == "decode" or lop.kind in HEAD_KINDS:
        # decode: the root holds the new tokens; prefill: the root holds each sequence's
        # last chunk (balanced split gives rank 0 chunks 0 and 2cp-1), whose logits are needed
        return cp_roots(ctx)
    return None


@hookimpl
def g5_require_owner(ctx, lop):
    cp = ctx.size("cp")
    if cp == 1 or lop.kind != "attention":
        return None
    plugin = PHASE_PLUGIN[ctx.phase]
    return (f"attention at cp={cp} in {ctx.phase} needs the {plugin} plugin, which is disabled; "
            f"enable it (drop --disable {plugin}) or set parallel.cp: 1")


@hookimpl
def g5_register_sweep_presets(register):
    from .scan import PRESET

    register(PRESET)
