"""The ``framework:`` block of a system file: how the serving framework launches kernels.

- ``cuda_graphs``: which steps run as captured CUDA graphs (``decode``: the decode step only,
  as SGLang -- its CUDA graphs cover decode batches up to ``--cuda-graph-max-bs``, prefill
  runs eagerly -- and TensorRT-LLM's PyTorch backend, whose ``cuda_graph_config`` captures
  generation steps, do by default; ``all``; ``none``: eager everywhere).
- ``kernel_launch_s``: what launching one kernel costs when the step is not captured (the
  host's cudaLaunchKernel path). Default 5 us: a measured 4-6 us per launch in a kernel-launch
  microbenchmark (pegainfer, "From Launch Overhead to CUDA Graph", github.com/xiaguan/
  cuda-kernel-launch-lab, RTX 5070 Ti, CUDA 13.0), ~5 us per cudaLaunchKernel on an A100.
- ``eager_passkv_ring``: the pass-KV ring's steps run eagerly (a host loop of send/receive and
  attention per step, as ring attention implementations drive it) even where the rest of the
  step is captured. Default true.
- ``stack``: the serving stack whose kernel fusions G5 applies (:data:`STACKS`): ``trtllm``,
  ``vllm``, ``sglang``, or ``generic`` (the default: only the fusion all three make, the residual
  add inside the RMSNorm kernel). ``fusions``: overrides of single fusions (:data:`FUSIONS`), e.g.
  ``{stack: vllm, fusions: {attn_quant: true}}``. ``fused_fp8_quant: true`` is shorthand for
  ``norm_quant``, ``act_quant`` and ``attn_quant`` (every FP8 input quantisation inside the kernel
  that produces the input). A fused kernel takes no time of its own and is not launched; its
  bytes join the kernel it runs in (:func:`kernel_hosts`).
- ``attention``: the attention kernel family of the size-aware roofline: ``default`` (the
  system file's ``compute_model`` attention fit) or a curve the file's
  ``compute_model.attention_curves`` names (e.g. ``fa3``).

Where the block is left out nothing is added (captured everywhere, the file's own curve) and
the ``generic`` stack's fusions apply.
An op that is not captured takes its kernels' count times ``kernel_launch_s`` longer
(:func:`launch_s`): the GPU waits for each launch, as it does when the kernels are shorter
than their launches (decode, short prompts); for long kernels, where a real host runs
ahead of the GPU, this overcounts, and the run says how much it added. ``g5 run`` reports
the time added per step on the busiest chip.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import attrs

from g5core.api.errors import ConfigError, suggest
from g5core.inputs.reading import check_keys

CUDA_GRAPH_MODES = ("decode", "all", "none")
FRAMEWORK_KEYS = ("cuda_graphs", "kernel_launch_s", "eager_passkv_ring", "stack", "fusions", "fused_fp8_quant",
                  "attention")
DEFAULT_KERNEL_LAUNCH_S = 5.0e-6

#: The fusions G5 models. Each names side kernels that run inside another kernel:
#: ``add_norm``: the residual add inside the RMSNorm kernel; ``norm_quant``: the FP8 quantisation
#: of a GEMM's input inside the norm that produced it; ``act_quant``: the down GEMM's input
#: quantisation inside the SwiGLU kernel; ``attn_quant``: the o_proj input's quantisation inside
#: attention; ``rope_kv_append``: the KV-cache append inside the rotary kernel; ``rope_kv_in_attention``:
#: in decode, rotary and the KV append inside the decode attention kernel; ``splitkv_in_attention``:
#: the split-KV combine inside the decode attention kernel; ``swiglu_in_gemm``: SwiGLU in the
#: gate/up GEMM's epilogue.
FUSIONS = ("add_norm", "norm_quant", "act_quant", "attn_quant", "rope_kv_append", "rope_kv_in_attention",
           "splitkv_in_attention", "swiglu_in_gemm")
_QUANT_FUSIONS = ("norm_quant", "act_quant", "attn_quant")

#: What each stack fuses for a Llama-class FP8 model on Hopper (sources: docs/measured-compute.md,
#: "Fusions by stack"):
#:
#: - all three: residual add + RMSNorm in one kernel (TensorRT-LLM ``RMSNorm.forward(hidden,
#:   residual)`` in tensorrt_llm/_torch/models/modeling_llama.py; vLLM ``fused_add_rms_norm``,
#:   "Fused Add RMSNorm: always (CUDA/ROCm)", docs/design/fusions.md; SGLang ``fused_add_rmsnorm``);
#: - trtllm: norm + FP8 quant and act + quant (``AllReduceFusionOp.RESIDUAL_RMS_NORM_QUANT_FP8``;
#:   PR #12674), attention output in FP8 (XQA ``LOW_PREC_OUTPUT``, PR #11910), RoPE + KV append in
#:   one preprocessing kernel (``applyBiasRopeUpdateKVCacheV2``,
#:   cpp/tensorrt_llm/kernels/unfusedAttentionKernels/unfusedAttentionKernels_2_template.h) and, in
#:   decode on SM90 with an FP8 KV cache, inside XQA (``appliesRoPEInXqaKernel``, decoderXQAImplJIT/
#:   kernelUtils.cpp, ``USE_INPUT_KV``), the split-KV partials merged by the last CTA inside XQA
#:   (cpp/kernels/xqa/README.md, ``mergePartialOutputs`` with a semaphore); GEMM + SwiGLU only with
#:   ``--gemm_swiglu_plugin fp8`` (off by default);
#: - vllm: ``fuse_norm_quant`` and ``fuse_act_quant`` on at O1+ ("conditional"), ``fuse_attn_quant``
#:   off ("disabled"), RoPE + KV-cache update fused only on ROCm/AITER (docs/design/fusions.md);
#:   FA3's split-KV combine is its own kernel (hopper/flash_api.cpp, ``run_mha_fwd_combine`` after
#:   ``run_mha_fwd`` when ``num_splits > 1``);
#: - sglang: the FP8 input quantisation is its own kernel before every FP8 GEMM
#:   (python/sglang/srt/layers/quantization/fp8_utils.py ``apply_fp8_linear``: ``scaled_fp8_quant`` /
#:   ``static_quant_fp8``), SiLU-and-mul, rotary and the KV write are their own kernels, FA3's
#:   combine as in vLLM.
STACKS = {
    "generic": ("add_norm",),
    "trtllm": ("add_norm", "norm_quant", "act_quant", "attn_quant", "rope_kv_append", "rope_kv_in_attention",
               "splitkv_in_attention"),
    "vllm": ("add_norm", "norm_quant", "act_quant"),
    "sglang": ("add_norm",),
}
DEFAULT_STACK = "generic"


def _bool(data: Mapping, key: str, default: bool, field: str) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{field}.{key}", f"expected true or false, got {value!r}")
    return value


@attrs.frozen(kw_only=True)
class Framework:
    cuda_graphs: str = "decode"
    kernel_launch_s: float = DEFAULT_KERNEL_LAUNCH_S
    eager_passkv_ring: bool = True
    stack: str = DEFAULT_STACK
    #: the fusions in force (the stack's, with the block's overrides), in FUSIONS order
    fusions: tuple = STACKS[DEFAULT_STACK]
    attention: str = "default"

    @classmethod
    def from_mapping(cls, data: Any, field: str = "system.framework") -> "Framework":
        if not isinstance(data, Mapping):
            raise ConfigError(field, f"expected a mapping such as {{cuda_graphs: decode, kernel_launch_s: 5e-6}}, "
                                     f"got {data!r}")
        check_keys(data, field, FRAMEWORK_KEYS)
        mode = data.get("cuda_graphs", "decode")
        if mode not in CUDA_GRAPH_MODES:
            raise ConfigError(f"{field}.cuda_graphs", f"unknown mode {mode!r}{suggest(str(mode), CUDA_GRAPH_MODES)}; "
                                                      f"choose one of {', '.join(CUDA_GRAPH_MODES)}")
        launch = data.get("kernel_launch_s", DEFAULT_KERNEL_LAUNCH_S)
        if isinstance(launch, bool) or not isinstance(launch, (int, float)) or not math.isfinite(launch) \
                or not 0 <= launch <= 1:
            raise ConfigError(f"{field}.kernel_launch_s", f"expected seconds in 0 .. 1, got {launch!r}")
        eager = _bool(data, "eager_passkv_ring", True, field)
        stack = data.get("stack", DEFAULT_STACK)
        if stack not in STACKS:
            raise ConfigError(f"{field}.stack", f"unknown stack {stack!r}{suggest(str(stack), tuple(STACKS))}; "
                                                f"choose one of {', '.join(STACKS)}")
        on = set(STACKS[stack])
        if _bool(data, "fused_fp8_quant", False, field):
            on.update(_QUANT_FUSIONS)
        overrides = data.get("fusions", {})
        if not isinstance(overrides, Mapping):
            raise ConfigError(f"{field}.fusions", f"expected a mapping such as {{attn_quant: true}}, got {overrides!r}")
        check_keys(overrides, f"{field}.fusions", FUSIONS)
        for name in overrides:
            (on.add if _bool(overrides, name, False, f"{field}.fusions") else on.discard)(name)
        attention = data.get("attention", "default")
        if not isinstance(attention, str) or not attention:
            raise ConfigError(f"{field}.attention", f"expected a curve name (default, fa3, ...), got {attention!r}")
        return cls(cuda_graphs=mode, kernel_launch_s=float(launch), eager_passkv_ring=eager, stack=stack,
                   fusions=tuple(f for f in FUSIONS if f in on), attention=attention)

    def to_dict(self) -> dict:
        out = attrs.asdict(self)
        out["fusions"] = {f: f in self.fusions for f in FUSIONS}
        return out

    def captured(self, phase: str, owner: str) -> bool:
        """Whether an op of ``owner`` in a ``phase`` step runs inside a captured CUDA graph."""
        if owner == "cp_passkv" and self.eager_passkv_ring:
            return False
        return self.cuda_graphs == "all" or (self.cuda_graphs == "decode" and phase == "decode")


#: the fusions of a system without a framework block
DEFAULT_FRAMEWORK = Framework()


def framework_of(system) -> Framework:
    fw = getattr(system, "framework", None)
    return DEFAULT_FRAMEWORK if fw is None else fw


def _first(kernels, test) -> int | None:
    return next((i for i, k in enumerate(kernels) if test(k)), None)


def kernel_hosts(op, system, phase: str) -> tuple:
    """For each of ``op``'s kernels, the index (in ``op.kernels``) of the kernel that takes its
    bytes under the system's framework, or None where it runs as a kernel of its own.

    A quantisation (or rotary and KV append) fused into a kernel of the op before -- the norm,
    attention, XQA -- is hosted by the op's first GEMM, the kernel that reads its output: it takes
    no time of its own and its bytes join that GEMM's. The split-KV combine is hosted by the decode
    attention kernel, the residual add by the RMSNorm, the append by rotary, the FP8 quantisation of
    the down GEMM's input by SwiGLU (the one that matches SwiGLU's shape), SwiGLU by the gate/up GEMM."""
    return tuple(host for host, _ in kernel_fusions(op, system, phase))


def kernel_fusions(op, system, phase: str) -> tuple:
    """For each of ``op``'s kernels, ``(host index, fusion name)`` (:data:`FUSIONS`), or
    ``(None, None)`` where it runs as a kernel of its own (:func:`kernel_hosts`)."""
    kernels = op.kernels
    fused = framework_of(system).fusions
    kinds = [getattr(k, "kind", k.op_class) for k in kernels]
    gemm = _first(kernels, lambda k: k.op_class == "gemm")
    norm = _first(kinds, lambda kind: kind == "rmsnorm")
    swiglu = _first(kinds, lambda kind: kind == "swiglu")
    rotary = _first(kinds, lambda kind: kind == "rotary")
    attention = _first(kernels, lambda k: k.op_class == "attention" and getattr(k, "block", "") == "decode")
    in_xqa = phase == "decode" and "rope_kv_in_attention" in fused and gemm is not None
    out = []
    for k, kind in zip(kernels, kinds):
        host, name = None, None
        if kind == "residual_add":
            host, name = norm, "add_norm"
        elif kind == "fp8_quant":
            if swiglu is not None and k.tokens == kernels[swiglu].tokens and k.width == kernels[swiglu].width:
                host, name = swiglu, "act_quant"
            else:
                host, name = gemm, "attn_quant" if op.name == "o_proj" else "norm_quant"
        elif kind in ("rotary", "kv_append") and in_xqa:
            host, name = gemm, "rope_kv_in_attention"
        elif kind == "kv_append":
            host, name = rotary, "rope_kv_append"
        elif kind == "splitkv_combine":
            host, name = attention, "splitkv_in_attention"
        elif kind == "swiglu":
            host, name = gemm, "swiglu_in_gemm"
        out.append((host, name) if host is not None and name in fused else (None, None))
    return tuple(out)


def fused_bytes(op, hosts) -> list:
    """Per kernel of ``op``, the HBM bytes of the kernels fused into it (0 for most)."""
    extra = [0.0] * len(op.kernels)
    for k, host in zip(op.kernels, hosts):
        if host is not None:
            extra[host] += k.hbm_bytes
    return extra


def launch_s(op, system, phase: str) -> float:
    """The launch time G5 adds to compute ``op``: its launched (unfused) kernels times
    ``kernel_launch_s`` when it is not captured (0 without a ``framework`` block)."""
    fw = getattr(system, "framework", None)
    if fw is None or fw.captured(phase, op.owner):
        return 0.0
    return max(1, launched_kernels(op, system, phase)) * fw.kernel_launch_s


def launched_kernels(op, system, phase: str) -> int:
    """How many of ``op``'s kernels are launched (not fused into another)."""
    return sum(1 for h in kernel_hosts(op, system, phase) if h is None)
