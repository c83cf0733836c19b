"""Model shapes: attention, FFN/MoE, parameter counts and c_kv (KV bytes per token per layer).

The catalog is written out in Python, plus the Hugging Face style config.json files the project
writes in g5core/data/models/ (each names its source); any other model comes from a Hugging Face
config.json of an accepted family (:data:`ACCEPTED_MODEL_TYPES`). Every size formula lives here, once.

Attention may vary by layer: a sliding-window layer attends to (and caches) the last
``window`` tokens; a chunked layer (Llama 4) attends within its ``window``-token chunk; a full
layer attends to the whole context (:meth:`ModelSpec.kv_window`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Mapping

import attrs
from attrs.validators import ge, gt, in_, instance_of

from g5core.api.errors import ConfigError, suggest
from g5core.inputs.reading import MAX_MODEL_DIM, check_size, short_repr, load_json, read_text

_POS = [instance_of(int), gt(0)]
_NONNEG = [instance_of(int), ge(0)]
WINDOW_KINDS = ("sliding", "chunked")


@attrs.frozen(kw_only=True)
class AttentionSpec:
    kind: str = attrs.field(validator=in_(("gqa", "mla")))
    n_heads: int = attrs.field(validator=_POS)
    n_kv_heads: int = attrs.field(validator=_POS)  # MLA: equals n_heads (informational)
    head_dim: int = attrs.field(validator=_POS)  # MLA: qk_nope_head_dim + qk_rope_head_dim
    qkv_bias: bool = attrs.field(default=False, validator=instance_of(bool))
    qk_norm: bool = attrs.field(default=False, validator=instance_of(bool))  # Qwen3 q_norm/k_norm
    # MLA only (0 for GQA); q_lora_rank 0 = plain q_proj
    q_lora_rank: int = attrs.field(default=0, validator=_NONNEG)
    kv_lora_rank: int = attrs.field(default=0, validator=_NONNEG)
    qk_nope_head_dim: int = attrs.field(default=0, validator=_NONNEG)
    qk_rope_head_dim: int = attrs.field(default=0, validator=_NONNEG)
    v_head_dim: int = attrs.field(default=0, validator=_NONNEG)
    #: one learned sink logit per query head (GPT-OSS): parameters, no KV
    attention_sinks: bool = attrs.field(default=False, validator=instance_of(bool))

    def __attrs_post_init__(self) -> None:
        if self.kind == "gqa" and self.n_heads % self.n_kv_heads:
            raise ConfigError(
                "num_key_value_heads",
                f"{self.n_kv_heads} does not divide num_attention_heads {self.n_heads}",
            )
        if self.kind == "mla":
            for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, f) <= 0:
                    raise ConfigError(f, "must be > 0 for MLA attention")
            if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
                raise ConfigError("head_dim", "MLA head_dim must be qk_nope_head_dim + qk_rope_head_dim")


@attrs.frozen(kw_only=True)
class MoESpec:
    n_routed_experts: int = attrs.field(validator=_POS)
    n_active_experts: int = attrs.field(validator=_POS)  # top-k
    expert_ffn_dim: int = attrs.field(validator=_POS)
    n_shared_experts: int = attrs.field(default=0, validator=_NONNEG)
    shared_expert_ffn_dim: int = attrs.field(default=0, validator=_NONNEG)  # per shared expert
    first_dense_layers: int = attrs.field(default=0, validator=_NONNEG)
    #: every ``layer_step``-th layer is MoE (Llama 4 Maverick: 2); layer i is MoE when
    #: i % layer_step == layer_step - 1 (Hugging Face Llama 4's rule) and i >= first_dense_layers
    layer_step: int = attrs.field(default=1, validator=_POS)
    # group-limited routing (DeepSeek-V3 config.json ``n_group`` / ``topk_group``): the routed
    # experts form ``n_groups`` equal contiguous groups and each token picks its experts from
    # ``topk_groups`` of them; 1 / 1 is plain top-k routing
    n_groups: int = attrs.field(default=1, validator=_POS)
    topk_groups: int = attrs.field(default=1, validator=_POS)

    def __attrs_post_init__(self) -> None:
        if self.n_routed_experts % self.n_groups:
            raise ConfigError("n_group", f"{self.n_routed_experts} routed experts do not split into "
                                         f"{self.n_groups} equal groups")
        if self.topk_groups > self.n_groups or (self.n_groups > 1 and self.topk_groups
                                                * (self.n_routed_experts // self.n_groups) < self.n_active_experts):
            raise ConfigError("topk_group", f"topk_group {self.topk_groups} of n_group {self.n_groups} cannot hold "
                                            f"{self.n_active_experts} routed experts per token")
        if self.n_active_experts > self.n_routed_experts:
            raise ConfigError(
                "num_experts_per_tok",
                f"{self.n_active_experts} active experts exceed {self.n_routed_experts} routed experts",
            )
        if (self.n_shared_experts > 0) != (self.shared_expert_ffn_dim > 0):
            raise ConfigError("n_shared_experts", "shared experts need a shared expert FFN size and vice versa")


@attrs.frozen(kw_only=True)
class LayerParams:
    """Parameter count of one decoder layer, by part."""

    attention: int
    attention_norms: int
    dense_ffn: int = 0
    router: int = 0
    routed_experts: int = 0  # all routed experts
    routed_experts_active: int = 0  # the top-k a token runs through
    shared_experts: int = 0

    @property
    def total(self) -> int:
        return (self.attention + self.attention_norms + self.dense_ffn + self.router
                + self.routed_experts + self.shared_experts)

    @property
    def active(self) -> int:
        return (self.attention + self.attention_norms + self.dense_ffn + self.router
                + self.routed_experts_active + self.shared_experts)


@attrs.frozen
class ParamCounts:
    total: int
    active: int          # every weight a token runs through: embedding and lm_head included
    embedding: int = 0   # the input embedding table (a lookup, no FLOPs)

    @property
    def active_less_embedding(self) -> int:
        """Active parameters without the input embedding, as OpenAI counts gpt-oss's (5.1B of
        gpt-oss-120b: the model card's "active parameters"); Qwen and DeepSeek publish
        :attr:`active` (qwen3-30b-a3b 3.3B, DeepSeek-V3 37B)."""
        return self.active - self.embedding


@attrs.frozen(kw_only=True)
class ModelSpec:
    name: str = attrs.field(validator=instance_of(str))
    hidden_size: int = attrs.field(validator=_POS)
    n_layers: int = attrs.field(validator=_POS)
    vocab_size: int = attrs.field(validator=_POS)
    ffn_dim: int = attrs.field(validator=_POS)  # dense FFN intermediate size
    attention: AttentionSpec = attrs.field(validator=instance_of(AttentionSpec))
    moe: MoESpec | None = attrs.field(default=None, validator=attrs.validators.optional(instance_of(MoESpec)))
    tie_word_embeddings: bool = attrs.field(default=False, validator=instance_of(bool))
    #: the longest context the model was trained for (config.json max_position_embeddings);
    #: longer sequences still run, with a warning
    max_context_tokens: int | None = attrs.field(
        default=None, validator=attrs.validators.optional([instance_of(int), gt(0)]))
    #: attention window of each layer in tokens, 0 = full attention; () = every layer full
    layer_windows: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    #: how a windowed layer attends: "sliding" (the last window tokens) or "chunked" (its chunk)
    window_kind: str = attrs.field(default="sliding", validator=in_(WINDOW_KINDS))
    #: RMSNorms per decoder layer (Gemma 2/3: 4, before and after attention and FFN)
    norms_per_layer: int = attrs.field(default=2, validator=_POS)
    #: every decoder layer is a multi-token-prediction module (DeepSeek-V3's MTP, a speculative
    #: proposer: g5core.session.speculative): before it, the next token's embedding and the
    #: previous hidden state are RMS-normed (``enorm``, ``hnorm``), concatenated and projected
    #: ``2 d -> d`` by ``eh_proj`` (logical op ``eh_proj``)
    mtp_module: bool = attrs.field(default=False, validator=instance_of(bool))
    #: the model is an EAGLE head (Li et al., EAGLE, arXiv 2401.15077; a speculative proposer:
    #: g5core.session.speculative): before its first decoder layer, the token's embedding and
    #: the target's top feature are concatenated and projected ``2 d -> d`` by ``fc`` (logical
    #: op ``eagle_fc``), once per pass
    eagle_fc: bool = attrs.field(default=False, validator=instance_of(bool))
    #: the weights' dtypes the hub config's ``quantization_config`` publishes, as sorted
    #: ``(weight class, dtype)`` pairs with a ``default`` (() when it has none G5 reads); a
    #: configuration without ``dtypes.weights`` runs them (:func:`read_quantization`)
    published_weights: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=tuple)
    #: a one-line warning about a ``quantization_config`` G5 does not read ("" when none)
    quantization_warning: str = attrs.field(default="", validator=instance_of(str))

    def __attrs_post_init__(self) -> None:
        if self.moe is not None and self.moe.first_dense_layers >= self.n_layers:
            raise ConfigError("first_k_dense_replace", f"must be < num_hidden_layers ({self.n_layers})")
        if self.layer_windows and len(self.layer_windows) != self.n_layers:
            raise ConfigError("layer_types", f"lists {len(self.layer_windows)} layers; the model has "
                                             f"num_hidden_layers {self.n_layers}")
        if any(not isinstance(w, int) or w < 0 for w in self.layer_windows):
            raise ConfigError("sliding_window", "a layer's attention window must be a whole number of tokens >= 0")

    # -- structure ---------------------------------------------------------------------------
    def _check_layer(self, layer: int) -> None:
        if not (isinstance(layer, int) and 0 <= layer < self.n_layers):
            raise ValueError(f"layer {layer!r} out of range 0..{self.n_layers - 1} for {self.name}")

    def is_moe_layer(self, layer: int) -> bool:
        self._check_layer(layer)
        m = self.moe
        return m is not None and layer >= m.first_dense_layers and layer % m.layer_step == m.layer_step - 1

    def first_layers(self, n_layers: int) -> "ModelSpec":
        """The model cut to its first ``n_layers`` layers (their windows with them)."""
        return attrs.evolve(self, n_layers=n_layers, layer_windows=self.layer_windows[:n_layers])

    def alike_from(self) -> int | None:
        """The first layer from which every layer is alike (the same FFN kind, the same
        attention window): an MoE model's dense prefix (``first_dense_layers``), 0 for a
        dense model; None where layers past it differ (MoE every ``layer_step``-th layer,
        sliding or chunked windows on some layers only)."""
        first = 0
        if self.moe is not None:
            if self.moe.layer_step != 1:
                return None
            first = self.moe.first_dense_layers
        return first if len(set(self.layer_windows[first:])) <= 1 else None

    def kv_window(self, layer: int) -> int:
        """Tokens layer ``layer`` attends to at most (and caches): 0 means the whole context."""
        self._check_layer(layer)
        return self.layer_windows[layer] if self.layer_windows else 0

    def kv_tokens(self, layer: int, seq_len: int) -> int:
        """Context tokens of one sequence of ``seq_len`` whose KV layer ``layer`` keeps."""
        w = self.kv_window(layer)
        return min(seq_len, w) if w else seq_len

    @property
    def has_windows(self) -> bool:
        return any(self.layer_windows)

    def attention_pattern(self) -> str:
        """'full', or e.g. 'sliding window 128 on 18 of 36 layers, full on 18'."""
        if not self.has_windows:
            return "full"
        windows = sorted({w for w in self.layer_windows if w})
        parts = [f"{self.window_kind} window {w} on {self.layer_windows.count(w)} of {self.n_layers} layers"
                 for w in windows]
        full = self.layer_windows.count(0)
        return ", ".join(parts) + (f", full on {full}" if full else "")

    def kv_bytes_per_token_per_layer(self, kv_dtype_bytes: int) -> int:
        """c_kv: bytes of K and V cache one token adds to one layer (the one place for this)."""
        if not (isinstance(kv_dtype_bytes, int) and kv_dtype_bytes > 0):
            raise ValueError(f"kv_dtype_bytes must be a positive int, got {kv_dtype_bytes!r}")
        a = self.attention
        if a.kind == "mla":  # one compressed latent plus the shared rope key, not doubled
            return (a.kv_lora_rank + a.qk_rope_head_dim) * kv_dtype_bytes
        return 2 * a.n_kv_heads * a.head_dim * kv_dtype_bytes

    def projection_shapes(self) -> tuple[tuple[str, int, int], ...]:
        """Attention-block weight matrices of one layer as (name, in_dim, out_dim)."""
        d, a = self.hidden_size, self.attention
        if a.kind == "gqa":
            return (
                ("q_proj", d, a.n_heads * a.head_dim),
                ("k_proj", d, a.n_kv_heads * a.head_dim),
                ("v_proj", d, a.n_kv_heads * a.head_dim),
                ("o_proj", a.n_heads * a.head_dim, d),
            )
        q_out = a.n_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim)
        q = ((("q_a_proj", d, a.q_lora_rank), ("q_b_proj", a.q_lora_rank, q_out))
             if a.q_lora_rank else (("q_proj", d, q_out),))
        return q + (
            ("kv_a_proj", d, a.kv_lora_rank + a.qk_rope_head_dim),
            ("kv_b_proj", a.kv_lora_rank, a.n_heads * (a.qk_nope_head_dim + a.v_head_dim)),
            ("o_proj", a.n_heads * a.v_head_dim, d),
        )

    # -- parameter counts ----------------------------------------------------------------------
    def ffn_params(self, ffn_dim: int) -> int:
        """Gated (SwiGLU) FFN: gate, up and down projections."""
        return 3 * self.hidden_size * ffn_dim

    def layer_params(self, layer: int) -> LayerParams:
        self._check_layer(layer)
        d, a = self.hidden_size, self.attention
        attention = sum(i * o for _, i, o in self.projection_shapes())
        if a.qkv_bias:
            attention += (a.n_heads + 2 * a.n_kv_heads) * a.head_dim
        norms = self.norms_per_layer * d  # input and post-attention RMSNorm (Gemma: four)
        if a.attention_sinks:
            attention += a.n_heads
        if a.qk_norm:
            norms += 2 * a.head_dim
        if a.kind == "mla":
            norms += a.q_lora_rank + a.kv_lora_rank  # q_a_layernorm, kv_a_layernorm
        if not self.is_moe_layer(layer):
            return LayerParams(attention=attention, attention_norms=norms, dense_ffn=self.ffn_params(self.ffn_dim))
        m = self.moe
        expert = self.ffn_params(m.expert_ffn_dim)
        return LayerParams(
            attention=attention,
            attention_norms=norms,
            router=d * m.n_routed_experts,
            routed_experts=m.n_routed_experts * expert,
            routed_experts_active=m.n_active_experts * expert,
            shared_experts=m.n_shared_experts * self.ffn_params(m.shared_expert_ffn_dim),
        )

    def param_counts(self) -> ParamCounts:
        """Embedding + all decoder layers + final norm + lm_head (unless tied)."""
        outer = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        outer += self.hidden_size  # final norm
        layers = [self.layer_params(i) for i in range(self.n_layers)]
        return ParamCounts(
            total=outer + sum(p.total for p in layers),
            active=outer + sum(p.active for p in layers),
            embedding=self.vocab_size * self.hidden_size,
        )

    # -- Hugging Face config.json --------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, data: Mapping, name: str) -> ModelSpec:
        if not isinstance(data, Mapping):
            raise ConfigError("model", f"{name}: a Hugging Face config must be a JSON object")
        published, warning = read_quantization(data.get("quantization_config"), name)
        model_type = data.get("model_type")
        if isinstance(model_type, str) and model_type in _TEXT_CONFIG_OF and isinstance(data.get("text_config"), Mapping):
            data = {"model_type": _TEXT_CONFIG_OF[model_type], **data["text_config"]}
            model_type = data["model_type"]
        if not isinstance(model_type, str) or model_type not in _HF_PARSERS:
            got = "missing" if model_type is None else f"unsupported model_type {model_type!r}"
            raise ConfigError(
                "model_type",
                f"{name}: {got}{suggest(str(model_type), ACCEPTED_MODEL_TYPES)}; accepted: "
                f"{', '.join(ACCEPTED_MODEL_TYPES)}; G5 reads only model_type and {', '.join(FIELDS_READ)}",
            )
        spec = _HF_PARSERS[model_type](_Fields(data, name), name)
        return attrs.evolve(spec, published_weights=published, quantization_warning=warning) if (
            published or warning) else spec

    @classmethod
    def from_hf_file(cls, path: str | os.PathLike, name: str | None = None) -> ModelSpec:
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        text = read_text(p, "model", "Hugging Face config")
        try:
            data = load_json(text)
        except ValueError as e:
            raise ConfigError("model", f"{str(p)!r} is not valid JSON: {e}") from None
        if name is None:
            name = p.parent.name if p.name == "config.json" and p.parent.name else p.stem
        return cls.from_hf_config(data, name)


# -- quantization_config -------------------------------------------------------------------------
#: the ``quantization_config`` methods G5 reads, and the dtype each gives the quantized weights:
#: ``mxfp4`` (openai/gpt-oss-20b and -120b config.json: ``{"quant_method": "mxfp4",
#: "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
#: "model.embed_tokens", "lm_head"]}``: the experts in MXFP4, the rest bf16); ``fp8``
#: (deepseek-ai/DeepSeek-V3 and moonshotai/Kimi-K2-Instruct config.json: ``{"quant_method":
#: "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}``: every
#: linear layer's weights in FP8 with 128x128 block scales; the embedding, the lm_head and the
#: router bf16); ``modelopt`` with ``quant_algo`` ``NVFP4`` (the NVIDIA ModelOpt checkpoints,
#: nvidia/*-FP4, vLLM docs/features/quantization/modelopt.md: ``hf_quant_config.json`` or
#: config.json, ``exclude_modules`` kept bf16) and ``compressed-tensors`` with a config group of
#: ``format`` ``nvfp4-pack-quantized`` (vLLM model_executor/layers/quantization/compressed_tensors).
QUANT_METHODS = ("mxfp4", "fp8", "modelopt (NVFP4, FP8)", "compressed-tensors (nvfp4-pack-quantized)")
#: the weight classes a quantization method converts (the router runs at ``default``)
_LINEAR_CLASSES = ("attention", "ffn", "experts")
#: module-name fragments of ``modules_to_not_convert`` / ``exclude_modules`` / ``ignore`` and the
#: weight class they keep unconverted
_MODULE_CLASSES = (("self_attn", "attention"), ("attn", "attention"), ("shared_expert", "ffn"),
                   ("experts", "experts"), ("mlp", "ffn"))


def _unconverted(modules: Any, name: str) -> tuple[set, list]:
    """The weight classes ``modules`` keeps unconverted, and the entries naming one layer only
    (G5 gives a weight class one dtype in every layer: those layers run converted)."""
    kept, partial = set(), []
    for m in modules or ():
        text = str(m)
        cls = next((c for frag, c in _MODULE_CLASSES if frag in text), None)
        if cls is None or "router" in text or text.endswith(".gate") or "lm_head" in text or "embed" in text:
            continue   # the router and the embedding run at bf16 anyway
        if any(part.isdigit() for part in text.replace("*", ".*.").split(".")):
            partial.append(text)
            continue
        kept.add(cls)
        if cls == "ffn" and "mlp" in text and "shared" not in text:
            kept.add("experts")
    return kept, partial


def read_quantization(qc: Any, name: str) -> tuple[tuple[tuple[str, str], ...], str]:
    """``(published weights, warning)`` from a hub config's ``quantization_config``."""
    if qc is None:
        return (), ""
    if not isinstance(qc, Mapping):
        return (), f"{name}: quantization_config is not a mapping; its weights run at the configuration's dtypes"
    method = str(qc.get("quant_method", "")).lower()
    modules = qc.get("modules_to_not_convert") or qc.get("exclude_modules") or qc.get("ignore")
    dtype = None
    if method == "mxfp4":
        dtype = "mxfp4"
    elif method == "fp8":
        dtype = "fp8"
    elif method == "modelopt":
        inner = qc.get("quantization") if isinstance(qc.get("quantization"), Mapping) else qc
        algo = str(inner.get("quant_algo", "")).upper()
        dtype = {"NVFP4": "nvfp4", "FP8": "fp8"}.get(algo)
        modules = modules or inner.get("exclude_modules")
        if dtype is None:
            return (), (f"{name}: quantization_config quant_algo {algo or '(none)'!r} is not read (G5 reads "
                        f"{', '.join(QUANT_METHODS)}); its weights run at the configuration's dtypes")
    elif method == "compressed-tensors":
        groups = qc.get("config_groups") if isinstance(qc.get("config_groups"), Mapping) else {}
        formats = {str(g.get("format", qc.get("format", ""))) for g in groups.values() if isinstance(g, Mapping)}
        formats = formats or {str(qc.get("format", ""))}
        if formats == {"nvfp4-pack-quantized"}:
            dtype = "nvfp4"
        else:
            return (), (f"{name}: quantization_config compressed-tensors format {', '.join(sorted(formats))} is not "
                        f"read (G5 reads {', '.join(QUANT_METHODS)}); its weights run at the configuration's dtypes")
    if dtype is None:
        return (), (f"{name}: quantization_config quant_method {method or '(none)'!r} is not read (G5 reads "
                    f"{', '.join(QUANT_METHODS)}); its weights run at the configuration's dtypes")
    kept, partial = _unconverted(modules, name)
    if method == "mxfp4":
        # transformers' Mxfp4HfQuantizer converts the MoE experts only (gpt-oss)
        kept |= {"attention", "ffn"}
    table = {"default": "bf16", **{c: dtype for c in _LINEAR_CLASSES if c not in kept}}
    warning = ""
    if partial:
        warning = (f"{name}: quantization_config keeps {', '.join(partial[:3])}{' ...' if len(partial) > 3 else ''} "
                   f"unconverted, layer by layer; G5 gives a weight class one dtype, so those run at {dtype}")
    return tuple(sorted(table.items())), warning


# -- config.json parsing -------------------------------------------------------------------------
_LAYER_TYPES = ("full_attention", "sliding_attention")


class _Fields:
    """Typed reads from a config dict; every error names the field."""

    def __init__(self, data: Mapping, name: str):
        self.data, self.name = data, name

    def _bad(self, key: str, msg: str) -> ConfigError:
        return ConfigError(key, f"{msg} in the Hugging Face config of {self.name!r}")

    def integer(self, key: str, default: Any = None, minimum: int = 1) -> int:
        v = self.data.get(key)
        if v is None:
            if default is None:
                raise self._bad(key, "required field missing")
            return default
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise self._bad(key, f"must be an integer >= {minimum}, got {short_repr(v)}")
        check_size(key, v, MAX_MODEL_DIM, f" for a model size (in the Hugging Face config of {self.name!r})")
        return v

    def flag(self, key: str, default: bool) -> bool:
        v = self.data.get(key, default)
        if not isinstance(v, bool):
            raise self._bad(key, f"must be true or false, got {v!r}")
        return v

    def common(self) -> dict:
        return dict(
            hidden_size=self.integer("hidden_size"),
            n_layers=self.integer("num_hidden_layers"),
            vocab_size=self.integer("vocab_size"),
            ffn_dim=self.integer("intermediate_size"),
            tie_word_embeddings=self.flag("tie_word_embeddings", False),
            max_context_tokens=self.integer("max_position_embeddings", 0, minimum=0) or None,
        )

    def gqa(self, qkv_bias: bool, qk_norm: bool = False) -> AttentionSpec:
        heads, hidden = self.integer("num_attention_heads"), self.integer("hidden_size")
        if "head_dim" not in self.data and hidden % heads:
            raise self._bad("num_attention_heads", f"{heads} does not divide hidden_size {hidden}")
        return AttentionSpec(
            kind="gqa", n_heads=heads, n_kv_heads=self.integer("num_key_value_heads", heads),
            head_dim=self.integer("head_dim", hidden // heads), qkv_bias=qkv_bias, qk_norm=qk_norm,
        )

    def shared_moe(self) -> MoESpec:
        """DeepSeek-style MoE fields: routed and shared experts of moe_intermediate_size."""
        expert = self.integer("moe_intermediate_size")
        shared = self.integer("n_shared_experts", 0, minimum=0)
        return MoESpec(n_routed_experts=self.integer("n_routed_experts"),
                       n_active_experts=self.integer("num_experts_per_tok"), expert_ffn_dim=expert,
                       n_shared_experts=shared, shared_expert_ffn_dim=expert if shared else 0,
                       first_dense_layers=self.integer("first_k_dense_replace", 0, minimum=0),
                       n_groups=self.integer("n_group", 1), topk_groups=self.integer("topk_group", 1))

    def _layer_types(self) -> list | None:
        types = self.data.get("layer_types")
        if types is None:
            return None
        n = self.integer("num_hidden_layers")
        if not isinstance(types, list) or len(types) != n or any(t not in _LAYER_TYPES for t in types):
            raise self._bad("layer_types", f"must list one of {', '.join(_LAYER_TYPES)} for each of the "
                                           f"{n} layers")
        return types

    def windows(self, default_pattern: int = 0) -> dict:
        """Sliding-window layers: from ``layer_types`` where given; else Gemma's and GPT-OSS's
        rule (every ``sliding_window_pattern``-th layer full, the rest sliding; Gemma 2 and
        GPT-OSS: every other), Qwen's ``use_sliding_window`` from ``max_window_layers`` on, or
        Mistral's ``sliding_window`` on every layer."""
        n = self.integer("num_hidden_layers")
        model_type = self.data.get("model_type")
        window = self.data.get("sliding_window")
        types = self._layer_types()
        if types is None:
            pattern = {"gemma2": 2, "gemma3_text": 6}.get(model_type, default_pattern)
            if model_type == "gemma3_text":
                pattern = self.integer("sliding_window_pattern", 6)
            if pattern:
                types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
            elif model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
                if not self.flag("use_sliding_window", False):
                    return {}
                first = self.integer("max_window_layers", 0, minimum=0)
                types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
            elif window is not None:  # Mistral, Mixtral: one window on every layer (null = none)
                types = ["sliding_attention"] * n
            else:
                return {}
        if "sliding_attention" not in types:
            return {}
        w = self.integer("sliding_window")
        return dict(layer_windows=tuple(w if t == "sliding_attention" else 0 for t in types), window_kind="sliding")

    def llama4_windows(self) -> dict:
        """Llama 4: layers with RoPE attend within chunks of attention_chunk_size tokens; the
        NoPE layers (every no_rope_layer_interval-th, default 4) attend to the whole context."""
        n = self.integer("num_hidden_layers")
        chunk = self.data.get("attention_chunk_size")
        if chunk is None:
            return {}
        chunk = self.integer("attention_chunk_size")
        rope = self.data.get("no_rope_layers")
        if not rope:
            interval = self.integer("no_rope_layer_interval", 4)
            rope = [int((i + 1) % interval != 0) for i in range(n)]
        if not isinstance(rope, list) or len(rope) != n or any(r not in (0, 1) for r in rope):
            raise self._bad("no_rope_layers", f"must list 0 or 1 for each of the {n} layers")
        return dict(layer_windows=tuple(chunk if r else 0 for r in rope), window_kind="chunked")


def _parse_dense(qwen2: bool = False, qwen3: bool = False, gemma: bool = False) -> Callable[[_Fields, str], ModelSpec]:
    def parse(f: _Fields, name: str) -> ModelSpec:
        bias = True if qwen2 else f.flag("attention_bias", False)  # Qwen2 always has q/k/v bias
        extra = dict(norms_per_layer=4) if gemma else {}
        return ModelSpec(name=name, attention=f.gqa(bias, qk_norm=qwen3 or f.data.get("model_type") == "gemma3_text"),
                         **extra, **f.windows(), **f.common())
    return parse


def _parse_qwen3_moe(f: _Fields, name: str) -> ModelSpec:
    if f.integer("decoder_sparse_step", 1) != 1:
        raise f._bad("decoder_sparse_step", "only 1 (every layer MoE) is supported")
    dense = f.data.get("mlp_only_layers") or []
    if not isinstance(dense, list) or dense != list(range(len(dense))):
        raise f._bad("mlp_only_layers", "only a leading run of dense layers [0, 1, ..] is supported")
    qwen2 = f.data.get("model_type") == "qwen2_moe"
    shared = f.integer("shared_expert_intermediate_size", 0, minimum=0) if qwen2 else 0
    moe = MoESpec(n_routed_experts=f.integer("num_experts"), n_active_experts=f.integer("num_experts_per_tok"),
                  expert_ffn_dim=f.integer("moe_intermediate_size"), n_shared_experts=1 if shared else 0,
                  shared_expert_ffn_dim=shared, first_dense_layers=len(dense))
    attention = f.gqa(True if qwen2 else f.flag("attention_bias", False), qk_norm=not qwen2)
    return ModelSpec(name=name, attention=attention, moe=moe, **f.windows(), **f.common())


def _parse_mixtral(f: _Fields, name: str) -> ModelSpec:
    moe = MoESpec(n_routed_experts=f.integer("num_local_experts"), n_active_experts=f.integer("num_experts_per_tok"),
                  expert_ffn_dim=f.integer("intermediate_size"))  # every expert is a full-size FFN
    return ModelSpec(name=name, attention=f.gqa(False), moe=moe, **f.windows(), **f.common())


def _parse_gpt_oss(f: _Fields, name: str) -> ModelSpec:
    # Experts are full gated FFNs of intermediate_size; attention has q/k/v biases and one
    # sink logit per head. The experts' and router's bias vectors (a few million parameters
    # in all) are not counted.
    moe = MoESpec(n_routed_experts=f.integer("num_local_experts"), n_active_experts=f.integer("num_experts_per_tok"),
                  expert_ffn_dim=f.integer("intermediate_size"))
    attention = attrs.evolve(f.gqa(f.flag("attention_bias", True)), attention_sinks=True)
    return ModelSpec(name=name, attention=attention, moe=moe, **f.windows(default_pattern=2), **f.common())


def _parse_llama4(f: _Fields, name: str) -> ModelSpec:
    # Dense layers run intermediate_size_mlp; each MoE layer has num_local_experts routed
    # experts and one shared expert of intermediate_size. Llama 4's QK norm has no weights.
    expert = f.integer("intermediate_size")
    moe = MoESpec(n_routed_experts=f.integer("num_local_experts"), n_active_experts=f.integer("num_experts_per_tok"),
                  expert_ffn_dim=expert,
                  n_shared_experts=1, shared_expert_ffn_dim=expert,
                  layer_step=f.integer("interleave_moe_layer_step", 1))
    common = f.common()
    common["ffn_dim"] = f.integer("intermediate_size_mlp")
    return ModelSpec(name=name, attention=f.gqa(f.flag("attention_bias", False)), moe=moe,
                     **f.llama4_windows(), **common)


def _parse_deepseek_v3(f: _Fields, name: str) -> ModelSpec:
    if f.integer("moe_layer_freq", 1) != 1:
        raise f._bad("moe_layer_freq", "only 1 (every layer after the dense ones is MoE) is supported")
    heads = f.integer("num_attention_heads")
    nope, rope = f.integer("qk_nope_head_dim"), f.integer("qk_rope_head_dim")
    attention = AttentionSpec(
        kind="mla", n_heads=heads, n_kv_heads=heads, head_dim=nope + rope,
        q_lora_rank=f.integer("q_lora_rank", 0, minimum=0), kv_lora_rank=f.integer("kv_lora_rank"),
        qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=f.integer("v_head_dim"),
    )
    # num_nextn_predict_layers (the MTP module) is not part of the served model: ignored.
    return ModelSpec(name=name, attention=attention, moe=f.shared_moe(), **f.common())


def _parse_glm4_moe(f: _Fields, name: str) -> ModelSpec:
    # GQA with q/k/v bias and (GLM-4.5, not -Air) QK norm; DeepSeek-style MoE fields. The MTP
    # layer (num_nextn_predict_layers) is not part of the served model: ignored.
    attention = f.gqa(f.flag("attention_bias", True), qk_norm=f.flag("use_qk_norm", False))
    return ModelSpec(name=name, attention=attention, moe=f.shared_moe(), **f.common())


_HF_PARSERS: dict[str, Callable[[_Fields, str], ModelSpec]] = {
    "llama": _parse_dense(),
    "mistral": _parse_dense(),
    "qwen2": _parse_dense(qwen2=True),
    "qwen3": _parse_dense(qwen3=True),
    "qwen2_moe": _parse_qwen3_moe,
    "qwen3_moe": _parse_qwen3_moe,
    "mixtral": _parse_mixtral,
    "gemma2": _parse_dense(gemma=True),
    "gemma3_text": _parse_dense(gemma=True),
    "gpt_oss": _parse_gpt_oss,
    "llama4_text": _parse_llama4,
    "deepseek_v3": _parse_deepseek_v3,
    "kimi_k2": _parse_deepseek_v3,
    "glm4_moe": _parse_glm4_moe,
}
#: multimodal configs whose language model is the ``text_config`` of this model_type
_TEXT_CONFIG_OF = {"gemma3": "gemma3_text", "llama4": "llama4_text"}
ACCEPTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted((*_HF_PARSERS, *_TEXT_CONFIG_OF)))
#: the config.json fields G5 reads (besides model_type); every other field is ignored
FIELDS_READ = (
    "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "attention_bias", "tie_word_embeddings", "max_position_embeddings",
    "layer_types", "sliding_window", "use_sliding_window", "max_window_layers", "sliding_window_pattern",
    "attention_chunk_size", "no_rope_layers", "no_rope_layer_interval", "num_experts", "num_local_experts",
    "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "n_shared_experts", "first_k_dense_replace", "mlp_only_layers", "decoder_sparse_step",
    "interleave_moe_layer_step", "intermediate_size_mlp", "use_qk_norm", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_layer_freq", "text_config",
)


# -- catalog -------------------------------------------------------------------------------------
def _gqa(heads: int, kv: int, head_dim: int = 128, **kw: Any) -> AttentionSpec:
    return AttentionSpec(kind="gqa", n_heads=heads, n_kv_heads=kv, head_dim=head_dim, **kw)


# max_context_tokens: max_position_embeddings of each model's published config.json
_MODELS = (  # name, hidden_size, n_layers, vocab_size, ffn_dim, attention
    ModelSpec(name="llama-3.1-8b", hidden_size=4096, n_layers=32, vocab_size=128256, ffn_dim=14336, attention=_gqa(32, 8), max_context_tokens=131072),
    ModelSpec(name="llama-3.1-70b", hidden_size=8192, n_layers=80, vocab_size=128256, ffn_dim=28672, attention=_gqa(64, 8), max_context_tokens=131072),
    ModelSpec(name="llama-3.1-405b", hidden_size=16384, n_layers=126, vocab_size=128256, ffn_dim=53248, attention=_gqa(128, 8), max_context_tokens=131072),
    ModelSpec(name="qwen2.5-72b", hidden_size=8192, n_layers=80, vocab_size=152064, ffn_dim=29568, attention=_gqa(64, 8, qkv_bias=True), max_context_tokens=32768),
    ModelSpec(name="qwen3-235b-a22b", hidden_size=4096, n_layers=94, vocab_size=151936, ffn_dim=12288, attention=_gqa(64, 4, qk_norm=True),
              moe=MoESpec(n_routed_experts=128, n_active_experts=8, expert_ffn_dim=1536), max_context_tokens=40960),
    ModelSpec(name="mixtral-8x7b", hidden_size=4096, n_layers=32, vocab_size=32000, ffn_dim=14336, attention=_gqa(32, 8),
              moe=MoESpec(n_routed_experts=8, n_active_experts=2, expert_ffn_dim=14336), max_context_tokens=32768),
    ModelSpec(
        name="deepseek-v3", hidden_size=7168, n_layers=61, vocab_size=129280, ffn_dim=18432,
        attention=AttentionSpec(kind="mla", n_heads=128, n_kv_heads=128, head_dim=192, q_lora_rank=1536, kv_lora_rank=512,
                      qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        moe=MoESpec(n_routed_experts=256, n_active_experts=8, expert_ffn_dim=2048,
                    n_shared_experts=1, shared_expert_ffn_dim=2048, first_dense_layers=3,
                    n_groups=8, topk_groups=4),
        max_context_tokens=163840,
    ),
)
#: config.json files of the accepted families the project writes (each names its source)
MODELS_DIR = Path(__file__).resolve().parent.parent / "data" / "models"


def _data_models() -> tuple[ModelSpec, ...]:
    return tuple(ModelSpec.from_hf_file(p, p.stem) for p in sorted(MODELS_DIR.glob("*.json")))


CATALOG: Mapping[str, ModelSpec] = {m.name: m for m in (*_MODELS, *_data_models())}


def catalog_names() -> tuple[str, ...]:
    return tuple(CATALOG)


def get_model(name_or_path: str) -> ModelSpec:
    """A catalog model by name, or a model read from a Hugging Face config.json path."""
    if name_or_path in CATALOG:
        return CATALOG[name_or_path]
    s = str(name_or_path)
    if s.endswith(".json") or os.path.exists(s):
        return ModelSpec.from_hf_file(s)
    raise ConfigError(
        "model",
        f"unknown model {s!r}{suggest(s, CATALOG)}; known: {', '.join(CATALOG)}; "
        "or give a path to a Hugging Face config.json",
    )
