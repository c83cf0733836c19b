"""Warnings about a deployment: one line each on stderr, never a change to the results.

They point at layouts that run but that a deployment engineer would likely not want, or
at results that rest on an assumption worth knowing:

- the tensor-parallel group spans nodes (its all-reduces leave the NVLink domain);
- heads are split more ways than the model has KV heads (KV heads are replicated);
- the sequence (a step's cached + new tokens) is longer than the context the model was trained for;
- a model with windowed (sliding or chunked) layers runs context parallelism, whose ring
  attention G5 models over the whole context (an overestimate for those layers), or a step
  of several groups or with a cached prefix, whose attention G5 models the same way;
- the model's hub config has a quantization_config G5 does not read;
- the layout does not fit in memory (the summary says so too; a --json run only here).
"""
from __future__ import annotations

from typing import Optional

from g5core.sim.memory import MemoryReport


def plural(n: int, word: str, many: Optional[str] = None) -> str:
    """``1 chip``, ``2 chips``; ``many`` for irregular plurals."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def deployment_warnings(ctx, memory: Optional[MemoryReport] = None) -> list[str]:
    """The warnings for a prepared run (``BuildContext``), in a fixed order."""
    dep, model, rm = ctx.deployment, ctx.model, ctx.rankmap
    out: list[str] = []
    if "tp" in rm.dims and dep.size("tp") > 1:
        crossing = [g for g in rm.groups("tp") if rm.crosses_nodes(g)]
        if crossing:
            out.append(f"tp={dep.size('tp')} spans nodes ({plural(ctx.system.chips_per_node, 'chip')} per node): "
                       f"{len(crossing)} of {plural(len(rm.groups('tp')), 'TP group')} cross node boundaries, so "
                       "their all-reduces also cross the network (over every NIC of the group); "
                       "`g5 best` compares layouts")
    a = model.attention
    head_ways = ctx.shape.factor("q_heads")
    if a.kind == "gqa" and head_ways > a.n_kv_heads:
        out.append(f"heads are split {head_ways} ways but {model.name} has {plural(a.n_kv_heads, 'KV head')}: "
                   f"each KV head is replicated on {head_ways // a.n_kv_heads} chips (KV cache and its reads "
                   "do not shrink beyond that)")
    if model.quantization_warning:
        out.append(model.quantization_warning)
    limit = model.max_context_tokens
    if limit is not None and dep.seq_len > limit:
        what = "the step's longest context (cached + new tokens)" if dep.step_form else "seq_len"
        out.append(f"{what} {dep.seq_len:,} is beyond the {limit:,}-token context {model.name} was trained for "
                   "(max_position_embeddings); the timing is still computed, the model's quality there is not known")
    if model.has_windows and dep.size("cp") > 1:
        out.append(f"{model.name} has windowed attention ({model.attention_pattern()}); with cp={dep.size('cp')} "
                   "the CP plugin's attention runs over the whole context of every layer, so those layers' "
                   "attention time is overestimated (their KV cache keeps only the window)")
    elif model.has_windows and not dep.uniform:
        out.append(f"{model.name} has windowed attention ({model.attention_pattern()}); a step of several groups or "
                   "with a cached prefix runs its attention over the whole context of every layer, so those layers' "
                   "attention time is overestimated (their KV cache keeps only the window)")
    if memory is not None:
        short = memory.shortfall_summary()
        if short:
            out.append(f"the layout {short}; the timing assumes it ran anyway")
    return out
