"""One chip's share of the work: the model's sizes divided by the plugins' shard factors."""
from __future__ import annotations

import re
from typing import Iterable, Mapping

import attrs

from g5core.inputs.config import Deployment
from g5core.api.errors import PluginError
from g5core.inputs.models import ModelSpec

# Shard axes a plugin may divide (g5_shard_factors). The core knows the model's structure,
# not the strategies: "q_heads" is divided by whoever shards heads.
SHARD_AXES = (
    "tokens",       # tokens each chip runs non-attention ops on (prefill: b*S; decode: b; a step: its new tokens)
    "kv_len",       # context tokens of each sequence whose KV a chip holds
    "q_heads",      # query heads (and the attention output width)
    "kv_heads",     # KV heads (GQA); plugins keep the quotient whole (replicate when fewer)
    "kv_cache_heads",  # further split of the *stored* KV heads, beyond kv_heads, by a strategy that
                       # shards heads only inside attention (Ulysses); divides the KV cache, not K/V projections
    "ffn_cols",     # dense-FFN and shared-expert intermediate columns
    "experts",      # routed experts held per chip
    "expert_cols",  # routed-expert intermediate columns
    "moe_tokens",   # tokens a chip routes into the MoE (of its `tokens`)
    "vocab",        # embedding / LM-head rows
    "norm_tokens",  # tokens a chip runs norms on (of its `tokens`)
)


_AXIS_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def collect_shard_axes(hooks) -> tuple[str, ...]:
    """The core's axes followed by those plugins register (in registration order)."""
    found: dict[str, str] = {}

    def record(plugin: str, name: str, doc: str) -> None:
        if not isinstance(name, str) or not _AXIS_NAME.match(name) or not isinstance(doc, str) or not doc:
            raise PluginError(plugin, f"g5_register_shard_axes: register(name, doc) needs a lower-case name "
                                      f"and a doc line, got {name!r}, {doc!r}")
        if name in SHARD_AXES:
            raise PluginError(plugin, f"shard axis '{name}' is one of the core's axes")
        if name in found:
            raise PluginError(plugin, f"shard axis '{name}' is already registered by plugin '{found[name]}'")
        found[name] = plugin

    hooks.call_registration("g5_register_shard_axes", record)
    return SHARD_AXES + tuple(found)


def merge_factors(answers: Iterable[tuple[str, Mapping[str, int]]], axes: tuple[str, ...] = SHARD_AXES) -> dict[str, int]:
    """Multiply the plugins' shard factors per axis; bad axes or values name the plugin."""
    out = {axis: 1 for axis in axes}
    for plugin, factors in answers:
        for axis, value in dict(factors).items():
            if axis not in out:
                raise PluginError(plugin, f"g5_shard_factors: unknown shard axis {axis!r}; valid: {', '.join(axes)}")
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise PluginError(plugin, f"g5_shard_factors: factor for {axis!r} must be a positive int, got {value!r}")
            out[axis] *= value
    return out


@attrs.frozen(kw_only=True)
class LocalGroup:
    """One group of the step (:class:`g5core.inputs.step.StepGroup`) as one chip sees it."""

    count: int              # sequences (per data-parallel replica)
    new_tokens: int         # new tokens of each sequence (whole step)
    cached_tokens: int      # tokens of each sequence already in the KV cache
    q_tokens: float         # query tokens per sequence on a chip (new / the tokens split; 1 for decode)
    kv_len: float           # keys per sequence whose KV this chip holds: (cached + new) / the kv_len split
    decode: bool            # one new token per sequence, or a verification group (the decode kernel)
    verify: bool = False    # a speculative verification group: q_tokens = k + 1 queries per sequence


@attrs.frozen(kw_only=True)
class LocalShape:
    """Sizes one chip works on. Floats where a quotient need not be whole (tokens in decode).

    ``groups`` are the step's groups as this chip sees them. Where the deployment is
    ``uniform`` (one group, as the shorthand phase/batch/seq_len says), ``batch``,
    ``seq_len``, ``q_tokens`` and ``kv_len`` describe it exactly; otherwise ``batch`` is the
    step's sequences, ``seq_len`` its longest context, and ``q_tokens``/``kv_len`` the means
    per sequence: read ``groups`` for per-sequence shapes."""

    batch: int              # sequences per data-parallel replica
    seq_len: int            # S: prompt length (prefill) or context length (decode); longest context (a step)
    tokens: float           # tokens per chip for non-attention ops (the step's new tokens, split)
    q_tokens: float         # query tokens per sequence per chip in attention (S/cp prefill, 1 decode)
    kv_len: float           # context tokens per sequence whose KV this chip holds
    q_heads: float
    kv_heads: float
    kv_shard: int           # divisor applied to c_kv (GQA kv heads split; 1 for MLA)
    kv_cache_shard: int     # divisor of the stored KV cache beyond kv_shard (kv_cache_heads)
    ffn_cols: float
    experts: float
    expert_cols: float
    moe_tokens: float
    vocab: float
    norm_tokens: float
    factors: tuple[tuple[str, int], ...]
    groups: tuple[LocalGroup, ...] = ()
    uniform: bool = True    # the shorthand fields say the whole step

    @classmethod
    def from_factors(cls, deployment: Deployment, model: ModelSpec, factors: Mapping[str, int]) -> "LocalShape":
        b, s = deployment.batch, deployment.seq_len
        a = model.attention
        step = deployment.step
        uniform = deployment.uniform
        if uniform:
            prefill = deployment.phase == "prefill"
            total_tokens = b * s if prefill else b
            q_tokens = (s / factors["tokens"]) if prefill else 1.0
            kv_len = s / factors["kv_len"]
        else:
            total_tokens = step.new_tokens
            q_tokens = step.new_tokens / step.sequences / factors["tokens"]
            kv_len = step.context_tokens / step.sequences / factors["kv_len"]
        groups = tuple(LocalGroup(count=g.count, new_tokens=g.new_tokens, cached_tokens=g.cached_tokens,
                                  q_tokens=1.0 if g.new_tokens == 1 else g.new_tokens / factors["tokens"],
                                  kv_len=g.context_tokens / factors["kv_len"], decode=g.is_decode,
                                  verify=g.verify)
                       for g in step)
        tokens = total_tokens / factors["tokens"]
        kv_shard = 1 if a.kind == "mla" else factors["kv_heads"]
        return cls(
            batch=b,
            seq_len=s,
            tokens=tokens,
            q_tokens=q_tokens,
            kv_len=kv_len,
            q_heads=a.n_heads / factors["q_heads"],
            kv_heads=a.n_kv_heads / kv_shard,
            kv_shard=kv_shard,
            kv_cache_shard=factors["kv_cache_heads"],
            ffn_cols=model.ffn_dim / factors["ffn_cols"],
            experts=(model.moe.n_routed_experts / factors["experts"]) if model.moe else 0.0,
            expert_cols=(model.moe.expert_ffn_dim / factors["expert_cols"]) if model.moe else 0.0,
            moe_tokens=tokens / factors["moe_tokens"],
            vocab=model.vocab_size / factors["vocab"],
            norm_tokens=tokens / factors["norm_tokens"],
            factors=tuple(sorted(factors.items())),
            groups=groups,
            uniform=uniform,
        )

    def factor(self, axis: str) -> int:
        return dict(self.factors)[axis]
