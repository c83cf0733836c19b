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

from g5core import ConfigError, Dimension, PluginOption, Step, StepRules, hookimpl, idle_transfer_s

PHASE_PLUGIN = {"prefill": "cp_passkv", "decode": "cp_passq"}
#: the ``plugins.cp.prefill`` choices: the ring algorithm of context-parallel prefill
PREFILL_MODES = ("pass_kv", "pass_q", "auto")
MODE_PLUGIN = {"pass_kv": "cp_passkv", "pass_q": "cp_passq"}


@hookimpl
def g5_register_dimensions(register):
    register(Dimension(name="cp", factor=True, rank_order=20, default=None,
                       doc="context parallelism: the sequence split over cp chips (required)",
                       missing_hint="context parallelism is now an explicit dimension; add `cp: 1` to keep the "
                                    "previous behaviour (no context parallelism), and keep dp x tp x pp x cp = chips"))


@hookimpl
def g5_register_options(register):
    register(PluginOption(name="prefill", default="pass_kv",
                          doc="ring algorithm of CP prefill: pass_kv rotates the KV of the cached and new tokens, "
                              "pass_q the new queries (then returns partial outputs); auto picks per step by the "
                              "rule of arXiv:2411.01783 (Algorithm 5)",
                          kind="choice", choices=PREFILL_MODES))


@hookimpl
def g5_validate_deployment(deployment, model, system):
    cp = deployment.size("cp")
    if cp == 1:
        return
    if deployment.uniform:
        if deployment.seq_len % (2 * cp):
            raise ConfigError("seq_len", f"seq_len={deployment.seq_len} is not divisible by 2 x cp = {2 * cp} "
                                         f"(balanced chunk split); use a multiple of {2 * cp}")
        return
    step = deployment.step
    if step.phase == "mixed":
        raise ConfigError("step", f"a step mixing prefill and decode groups is not supported at cp={cp} (CP prefill "
                                  "rotates a ring over the sequence, CP decode runs on the CP root); simulate the "
                                  "prefill and the decode groups as separate steps, or set parallel.cp: 1")
    for g in step:
        # the cached KV is sharded like the new tokens: balanced chunks of both; a verification
        # group's drafts (and their KV) are transient: its context is that of its decode
        context = g.cached_tokens + 1 if g.verify else g.context_tokens
        sizes = (("context", context),) if g.is_decode else (("new", g.new_tokens),
                                                                      ("cached", g.cached_tokens))
        for what, n in sizes:
            if n % (2 * cp):
                raise ConfigError("step", f"group {g.to_dict()}: {what} tokens {n} are not divisible by 2 x cp = "
                                          f"{2 * cp} (balanced chunk split); use a multiple of {2 * cp}")


def split_phases(step: Step) -> tuple[Step, Step]:
    """A step mixing prefill and decode groups at ``cp > 1``, run as its prefill groups and
    then its decode groups: CP prefill rotates a ring over the sequence, CP decode runs on
    the CP root, so one step cannot hold both (``g5_validate_deployment`` refuses it)."""
    return Step(g for g in step if not g.is_decode), Step(g for g in step if g.is_decode)


@hookimpl
def g5_step_rules(deployment):
    """Every sequence in ``2 cp`` balanced chunks (token counts padded to a multiple of
    ``2 cp``, as CP implementations pad a sequence), and no mixed step (``split_phases``)."""
    cp = deployment.size("cp")
    if cp == 1:
        return None
    return StepRules(token_multiple=2 * cp, mixed=False, split=split_phases)


def ring_bandwidth_bytes_per_s(ctx, ring) -> float:
    """The slowest hop of a CP ring alone on idle links (bytes/s): ``BW`` of the rule."""
    topo = ctx.topology
    return min(1.0 / idle_transfer_s([(a, b, 1.0)], topo) for a, b in zip(ring, ring[1:] + ring[:1]))


def auto_prefill_mode(new_tokens: float, cached_tokens: float, cp: int, peak_flops: float, bandwidth: float,
                      kv_to_q_bytes: float, element_bytes: float) -> tuple[str, str]:
    """The pass-KV / pass-Q selection of arXiv:2411.01783 (Algorithm 5, from its Eqs. 2 and 5),
    with ``T`` new and ``P`` cached tokens, ``N = cp``, ``C`` the peak FLOP/s, ``BW`` the ring's
    bytes/s and ``e`` the element bytes: pass-KV when
    ``T >= N * C * N_KV * e / (2 * N_H * BW)`` (the KV messages hide behind attention) or
    ``T / (T + P) >= 2 * N_KV / N_H - 4 * T * BW / (N * C * e)`` (the KV messages are not
    much larger than the query messages), else pass-Q. ``2 N_KV / N_H`` is the ratio of a
    token's KV bytes to its query bytes (``kv_to_q_bytes``; for MLA its latent over the
    queries). Returns the mode and the rule's figures as a line."""
    ratio = kv_to_q_bytes
    hide_tokens = cp * peak_flops * (ratio / 2.0) * element_bytes / (2.0 * bandwidth)
    miss = new_tokens / (new_tokens + cached_tokens)
    bound = ratio - 4.0 * new_tokens * bandwidth / (cp * peak_flops * element_bytes)
    mode = "pass_kv" if new_tokens >= hide_tokens or miss >= bound else "pass_q"
    why = (f"T={new_tokens:g} {'>=' if new_tokens >= hide_tokens else '<'} {hide_tokens:.6g} "
           f"and T/(T+P)={miss:.6g} {'>=' if miss >= bound else '<'} {bound:.6g}")
    return mode, why


def prefill_mode(ctx) -> tuple[str, str]:
    """(``pass_kv`` | ``pass_q``, why) of this step's CP prefill: the ``plugins.cp.prefill``
    option, or with ``auto`` the paper's rule on the step's largest prefill group."""
    mode = ctx.deployment.option("cp", "prefill", "pass_kv")
    if mode != "auto":
        return mode, "plugins.cp.prefill"
    s, dep = ctx.shape, ctx.deployment
    group = max(s.groups, key=lambda g: (g.count * g.new_tokens, g.cached_tokens))
    ring = ctx.rankmap.groups("cp")[0]
    from g5core import attention_dims

    d_qk = attention_dims(ctx.model, "prefill")[0]
    act = dep.dtypes.activation_element_bytes
    kv_to_q = ctx.kv_bytes_per_token_local / (s.q_heads * d_qk * act)
    return auto_prefill_mode(group.new_tokens, group.cached_tokens, ctx.size("cp"),
                             ctx.system.peak_flops(dep.dtypes.activations), ring_bandwidth_bytes_per_s(ctx, list(ring)),
                             kv_to_q, act)


@hookimpl
def g5_step_choices(ctx):
    if ctx.size("cp") == 1 or ctx.phase != "prefill" or ctx.deployment.option("cp", "prefill") != "auto":
        return None
    mode, why = prefill_mode(ctx)
    return {"prefill": mode, "rule": why}


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


HEAD_KINDS = ("final_norm", "lm_head", "logits_gather")


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
    plugin = MODE_PLUGIN[prefill_mode(ctx)[0]] if ctx.phase == "prefill" else PHASE_PLUGIN[ctx.phase]
    return (f"attention at cp={cp} in {ctx.phase} needs the {plugin} plugin, which is disabled; "
            f"enable it (drop --disable {plugin}) or set parallel.cp: 1")


@hookimpl
def g5_register_sweep_presets(register):
    from .scan import PRESET

    register(PRESET)
