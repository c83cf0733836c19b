"""Pipeline parallelism: layers split into stages, activations passed stage to stage.

Split rule: ``L`` layers on ``pp`` stages give the first ``L mod pp`` stages
``ceil(L / pp)`` layers and the rest ``floor(L / pp)`` (61 layers on 4 stages: 16, 15, 15,
15). The embedding lives on the first stage, the final norm and LM head on the last. At a
stage boundary each chip sends its activations (local tokens x hidden) to the chip with the
same coordinates in the next stage (``pp_p2p``).

Micro-batches (``plugins.pp.microbatches``, ``m``; g5core.lower.microbatch): with ``m = 1``
one batch goes through every stage in turn, so TTFT and TPOT include every stage and each
stage idles while the others work. With ``m > 1``:

- decode: ``m`` independent micro-batches of ``batch`` sequences each cycle through the
  stages, one in flight per stage at ``m = pp``: vLLM's virtual engines (vllm/engine/
  llm_engine.py makes one Scheduler, each with its own batch, per pipeline stage, and its
  distributed executors lock each stage "so multiple virtual engines can't execute on the
  same stage at the same time"); the replica holds ``m x batch`` sequences (their KV is on the chips), and
  each micro-batch's sampled token ids go back from the last stage to the first
  (``pp_token``, int32 ids) before its next step;
- prefill: every prompt is split into ``m`` consecutive chunks (sizes differing by at most
  one token, the larger first), which follow one another through the stages (chunked
  pipeline parallelism, as SGLang runs it); chunk ``j`` is the step of its tokens after
  the earlier chunks' (a partial prefill, which CP and Ulysses run over their shards). ``m``
  may not exceed the prompt's tokens, and each chunk must be one the plugins accept.
"""
from __future__ import annotations

from g5core import ConfigError, Dimension, Fragment, PipelineMicrobatches, PluginOption, hookimpl

#: Bytes of one sampled token id sent back to the first stage: vLLM's sampler casts the
#: sampled ids to int32 "to reduce the tensor size" (vllm/v1/sample/sampler.py, Sampler.forward).
TOKEN_ID_BYTES = 4


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


def split(total: int, parts: int) -> tuple[int, ...]:
    """``total`` in ``parts`` whole parts differing by at most one, the larger first."""
    base, extra = divmod(total, parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


@hookimpl
def g5_register_options(register):
    register(PluginOption(name="microbatches", default=1, kind="int",
                          doc="micro-batches in flight through the pipeline stages: decode batches that cycle, or "
                              "prefill chunks of every prompt (1: one batch, no pipelining)"))


def microbatches(deployment) -> int:
    return deployment.option("pp", "microbatches", 1)


@hookimpl
def g5_validate_deployment(deployment, model, system):
    pp = deployment.size("pp")
    if pp > model.n_layers:
        raise ConfigError("parallel.pp", f"pp={pp} is larger than the {model.n_layers} layers of {model.name}; "
                                         f"use pp <= {model.n_layers}")
    m = microbatches(deployment)
    if m == 1:
        return
    field = "plugins.pp.microbatches"
    if not deployment.uniform:
        raise ConfigError(field, f"micro-batches split a batch given by phase/batch/seq_len; this step: list is one "
                                 f"engine iteration of its own; use {field}: 1 or the shorthand")
    decode = deployment.phase == "decode"
    if not decode and m > deployment.seq_len:
        raise ConfigError(field, f"{m} chunks cannot be cut from seq_len={deployment.seq_len} prompt tokens; "
                                 f"use at most {deployment.seq_len}")
    if deployment.path == "math":
        raise ConfigError(field, f"the math path has no pipeline schedule; use path: g5 or {field}: 1")


@hookimpl
def g5_pipeline_microbatches(deployment, model):
    m = microbatches(deployment)
    if m == 1:
        return None
    if deployment.phase == "decode":
        return PipelineMicrobatches("plugins.pp.microbatches", batches=(deployment.batch,) * m)
    return PipelineMicrobatches("plugins.pp.microbatches", chunks=split(deployment.seq_len, m))


@hookimpl
def g5_layer_chips(ctx, layer):
    pp = ctx.size("pp")
    if pp == 1:
        return None
    stage = stage_of(layer, ctx.model.n_layers, pp)
    return ctx.rankmap.chips_at("pp", stage)


@hookimpl
def g5_expand_op(ctx, lop):
    pp = ctx.size("pp")
    if lop.kind not in ("boundary", "token_return") or pp == 1:
        return None
    n = ctx.model.n_layers
    if lop.kind == "token_return":   # the last stage's sampled tokens, to the first stage
        return _p2p_from(ctx, lop, pp - 1, ctx.shape.batch * TOKEN_ID_BYTES, "pp_token")
    stage = stage_of(lop.layer, n, pp)
    if stage == stage_of(lop.layer - 1, n, pp):
        return None
    return _p2p_from(ctx, lop, stage - 1, ctx.hidden_states_bytes(ctx.shape.norm_tokens), "pp_p2p")


def _p2p_from(ctx, lop, src_stage: int, nbytes: float, reason: str) -> Fragment:
    """A send to each chip of ``lop`` from the chip with its coordinates in ``src_stage``."""
    ops, heads, tails = [], {}, {}
    for dst in ctx.place(lop):
        coords = ctx.rankmap.coords(dst)
        coords["pp"] = src_stage
        src = ctx.rankmap.chip_of(**coords)
        op = ctx.comm_op(lop, "p2p", (src, dst), nbytes, reason, owner="pp", part="send")
        ops.append(op)
        heads[src] = (op.key,)
        tails[dst] = (op.key,)
    return Fragment(ops=ops, heads=heads, tails=tails)
