"""A speculative decode step: the target's verification step plus the proposer's ``k`` passes.

With ``speculative: {method, tokens: k, ...}`` (:mod:`g5core.inputs.speculative`) one engine
step of a decode is

1. the proposer, ``k`` times in sequence, one token per sequence each pass
   (:func:`proposer_model`: MTP's extra layer(s) of the target, an EAGLE head, a draft
   model; ``ngram`` costs no chip time), on the chips of the target's last pipeline stage
   (where the target's LM head and final hidden states are; the proposer runs there with the
   target's tensor, expert and context split and ``pp = 1``);
2. the verification step of the target (:meth:`g5core.inputs.step.Step.verify`): ``k + 1``
   query tokens per sequence against its context, through every dimension of the layout.

The step keeps ``tokens_per_step`` tokens per sequence on average, so the time per output
token is ``(verify + k * proposer pass) / tokens_per_step``. G5 does not overlap the proposer
with the verification (vLLM, SGLang and TensorRT-LLM run them one after the other in one
iteration) and does not model tree drafts (``eagle_topk > 1``): a chain of ``k`` drafts.
An MTP module starts with ``eh_proj`` (a ``2 d -> d`` GEMM on the proposer's tokens, after
the ``enorm`` and ``hnorm`` RMSNorms): a logical op of its program
(:attr:`g5core.inputs.models.ModelSpec.mtp_module`), in its time and its weights line. An
EAGLE head starts with ``fc`` (a ``2 d -> d`` GEMM over the token's embedding and the target's
top feature, once per pass; logical op ``eagle_fc``, :attr:`~g5core.inputs.models.ModelSpec.eagle_fc`):
in its time, in the head's weights line and on a line of its own within it
(``speculative_eagle_head_fc``, ``part_of`` the head's line).
"""
from __future__ import annotations

from typing import Optional

import attrs
import numpy as np

from g5core.api.errors import ConfigError
from g5core.api.records import MemoryTerm
from g5core.inputs.config import Deployment
from g5core.inputs.models import ModelSpec, get_model
from g5core.inputs.speculative import Speculative
from g5core.inputs.step import Step
from g5core.lower.builder import plan_deployment
from g5core.lower.layers import EMBED_LAYER
from g5core.sim.memory import _layer_weight_bytes, memory_report, weight_bytes_per_chip

#: the ledger line of each method's proposer weights (and its KV cache)
LEDGER_NAMES = {"mtp": "speculative_mtp_layers", "eagle": "speculative_eagle_head", "draft_model": "speculative_draft_model"}


def proposer_model(spec: Speculative, target: ModelSpec) -> Optional[ModelSpec]:
    """The model one proposer pass runs, or None (``ngram``: host-side prompt lookup).

    ``mtp``: ``layers`` decoder layers like the target's last (DeepSeek-V3's MTP module is one
    MoE decoder layer; ``num_nextn_predict_layers``), each after its ``eh_proj``
    (``mtp_module``), the target's embedding and LM head.
    ``eagle``: ``fc`` (``eagle_fc``: ``[embedding; feature]``, ``2 d -> d``), then ``layers``
    dense decoder layers at the target's width, attention and dense FFN width, the target's
    LM head (EAGLE / EAGLE-2 reuse it). ``draft_model``: the named model."""
    if spec.method == "ngram":
        return None
    if spec.method == "draft_model":
        try:
            return get_model(spec.draft_model)
        except ConfigError as exc:
            raise ConfigError("speculative.draft_model", str(exc)) from None
    windows = target.layer_windows[-spec.layers:] if target.layer_windows else ()
    moe = None
    if spec.method == "mtp" and target.moe is not None and target.is_moe_layer(target.n_layers - 1):
        moe = attrs.evolve(target.moe, first_dense_layers=0, layer_step=1)
    return attrs.evolve(target, name=f"{target.name}-{spec.method}", n_layers=spec.layers, layer_windows=windows,
                        moe=moe, mtp_module=spec.method == "mtp",
                        eagle_fc=spec.method == "eagle")


def proposer_deployment(dep: Deployment, model: ModelSpec) -> Deployment:
    """The target's deployment as the proposer runs it: one pipeline stage's chips (``pp = 1``),
    no expert split for a dense proposer, a plain decode step, no speculation."""
    parallel = dict(dep.parallel)
    chips = dep.chips // parallel.get("pp", 1)
    if "pp" in parallel:
        parallel["pp"] = 1
    if model.moe is None and "ep" in parallel:
        parallel["ep"] = 1
    return attrs.evolve(dep, model=model.name, chips=chips, parallel=tuple(sorted(parallel.items())),
                        speculative=None, step=Step.decode(dep.batch, dep.seq_len), step_form=False,
                        phase="decode")


@attrs.frozen(kw_only=True)
class SpeculativeResult:
    """What one speculative decode step costs and makes (per sequence, per replica)."""

    spec: Speculative
    verify_s: float               # the target's verification step (k + 1 queries per sequence)
    proposer_pass_s: float        # one proposer pass (0 for ngram)
    plain_decode_s: float         # the same deployment's plain decode step, for comparison
    batch: int

    @property
    def proposer_s(self) -> float:
        return self.spec.tokens * self.proposer_pass_s

    @property
    def step_s(self) -> float:
        return self.verify_s + self.proposer_s

    @property
    def tokens_per_step(self) -> float:
        return self.spec.tokens_per_step

    @property
    def proposer_share(self) -> float:
        return self.proposer_s / self.step_s

    @property
    def tpot_s(self) -> float:
        """The effective time per output token: the step over the tokens it keeps."""
        return self.step_s / self.tokens_per_step

    @property
    def speedup(self) -> float:
        """Plain decode's TPOT over the effective TPOT (above 1: speculation pays)."""
        return self.plain_decode_s / self.tpot_s

    def to_json_dict(self) -> dict:
        s = self.spec
        return {"method": s.method, "tokens": s.tokens, "acceptance": list(s.acceptance),
                "acceptance_source": s.source, "tokens_per_step": self.tokens_per_step,
                "verify_step_s": self.verify_s, "proposer_pass_s": self.proposer_pass_s, "proposer_s": self.proposer_s,
                "step_s": self.step_s, "proposer_share": self.proposer_share, "tpot_per_output_token_s": self.tpot_s,
                "plain_decode_tpot_s": self.plain_decode_s, "speedup_over_plain_decode": self.speedup}


class Proposer:
    """The proposer of a deployment: its model, its prepared plan (None for ngram)."""

    def __init__(self, plan, spec: Speculative):
        self.spec = spec
        self.target_ctx = plan.ctx
        self.model = proposer_model(spec, plan.ctx.model)
        self.plan = None
        if self.model is not None:
            dep = proposer_deployment(plan.ctx.deployment, self.model)
            try:
                self.plan = plan_deployment(dep, plan.pm, model=self.model)
            except ConfigError as exc:
                raise ConfigError("speculative", f"the {spec.method} proposer does not fit this layout: "
                                                 f"{exc.field}: {exc.message}") from None

    def pass_s(self, simulate) -> float:
        """One proposer pass: ``simulate(plan)`` of the proposer's decode step (0 for ngram)."""
        return 0.0 if self.plan is None else simulate(self.plan).latency_s

    def memory_terms(self) -> list[MemoryTerm]:
        """The proposer's own lines of the target's ledger, on the chips that hold the target's
        LM head: its weights (MTP / EAGLE: its layers, the embedding and LM head shared; a
        draft model: all of it; MTP's include ``eh_proj``, EAGLE's ``fc``, which also has a
        line of its own within the head's, ``part_of`` it) and its KV cache."""
        if self.plan is None:
            return []
        ctx, tgt = self.plan.ctx, self.target_ctx
        per_layer = _layer_weight_bytes(ctx)
        shared = (EMBED_LAYER, ctx.model.n_layers) if self.spec.method != "draft_model" else ()
        weights = sum(b for layer, b in per_layer.items() if layer not in shared)
        kv = float(np.max(memory_report(ctx).columns["kv_cache_bytes"]))
        head = np.flatnonzero(weight_bytes_per_chip(tgt, kinds={"final_norm"}) > 0).tolist()
        name = LEDGER_NAMES[self.spec.method]
        terms = [MemoryTerm(name=name, category="weights", bytes_per_chip={c: weights for c in head})]
        if self.spec.method == "eagle":
            fc = sum(_layer_weight_bytes(ctx, kinds={"eagle_fc"}).values())
            terms.append(MemoryTerm(name=f"{name}_fc", category="weights", bytes_per_chip={c: fc for c in head},
                                    part_of=name))
        return terms + [MemoryTerm(name=f"{name}_kv_cache", category="kv_cache", bytes_per_chip={c: kv for c in head})]


def verify_deployment(dep: Deployment) -> Deployment:
    """The deployment running its speculative verification step."""
    spec = dep.speculative
    return dep.with_step(Step.verify(dep.batch, dep.seq_len, spec.tokens))
