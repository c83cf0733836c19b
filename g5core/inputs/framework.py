"""The ``framework:`` block of a system file: how the serving framework launches kernels.

- ``name`` / ``version``: a shipped profile (:data:`FRAMEWORK_NAMES`: ``g5core/data/frameworks/
  NAME.yaml``, every value with its source; the version is the profile's, for a check) whose
  values the block's other keys override. ``generic`` is G5's model without a profile. A
  configuration's ``framework: NAME`` key (``--framework NAME``) applies one to its system
  (:func:`with_framework`).
- ``cuda_graph_batch_sizes``: the decode batch sizes captured as graphs; a batch between them runs
  padded up to the next (:func:`graph_step`) or, with ``cuda_graph_padding: false``, eagerly, and
  above the largest eagerly. Left out: every batch captured.
- ``graph_kernel_s``: what one kernel costs inside a captured graph. Set (as the profiles do), it
  replaces the system file's per-op ``launch_overhead_s`` (:func:`op_overhead_s`): a captured
  kernel costs ``graph_kernel_s``, an eager one ``kernel_launch_s``, each launched kernel once.
- ``host``: the host's work per serving step (:class:`HostTime`), overlapped or added.
- ``all_reduce``: the framework's own TP all-reduce kernel (:class:`CustomAllReduce`), lowered by
  plugins/collectives where the framework's code chooses it; NCCL otherwise.
- ``mixed_prefill``: the framework's scheduling, whether prefill chunks share a step with the
  decodes (vLLM, TensorRT-LLM) or run in steps of their own (SGLang): ``g5 serve``'s scheduler
  takes it where the configuration gives no ``serving.scheduler.mixed_prefill``
  (:func:`g5core.inputs.serving.scheduler_under`). Left out: the scheduler's default.

- ``cuda_graphs``: which steps run as captured CUDA graphs (``decode``: the decode step only,
  as SGLang -- its CUDA graphs cover decode batches up to ``--cuda-graph-max-bs``, prefill
  runs eagerly -- and TensorRT-LLM's PyTorch backend, whose ``cuda_graph_config`` captures
  generation steps, do by default; ``piecewise``: the decode step captured except its attention
  ops, which run eagerly between the captured pieces, as vLLM V1's ``CUDAGraphMode.PIECEWISE`` --
  its default until vllm PR #25444 (2025-09-23) made it ``FULL_AND_PIECEWISE`` -- splits the
  graph at ``CompilationConfig.splitting_ops`` (``vllm.unified_attention``,
  ``vllm.unified_attention_with_output``), prefill eagerly as ``decode`` does; ``all``;
  ``none``: eager everywhere).
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

import bisect
import functools
import math
import pathlib
from importlib.resources import files
from typing import Any, Mapping

import attrs

from g5core.api.errors import ConfigError, suggest
from g5core.inputs.reading import check_keys, load_yaml
from g5core.inputs.step import Step, StepGroup

CUDA_GRAPH_MODES = ("decode", "piecewise", "all", "none")
FRAMEWORK_KEYS = ("name", "version", "cuda_graphs", "kernel_launch_s", "eager_passkv_ring", "stack", "fusions",
                  "fused_fp8_quant", "attention", "cuda_graph_batch_sizes", "cuda_graph_padding", "graph_kernel_s",
                  "host", "all_reduce", "mixed_prefill")
#: the shipped profiles (g5core/data/frameworks/NAME.yaml)
FRAMEWORK_NAMES = ("generic", "vllm", "sglang", "trtllm")
HOST_KEYS = ("fixed_s", "per_sequence_s", "per_token_s", "overlap")
ALL_REDUCE_KEYS = ("kernel", "world_sizes", "max_bytes", "one_shot_max_bytes", "one_shot_latency_s",
                   "two_shot_latency_s")
#: an ``all_reduce`` block's optional symmetric-memory regime (vLLM's torch symmetric-memory
#: multimem all-reduce above its custom kernel's limit): per world size, all three or none
SYMM_MEM_KEYS = ("symm_mem_max_bytes", "symm_mem_latency_s", "symm_mem_s_per_byte")
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


def _seconds(data: Mapping, key: str, default: float, field: str) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 <= value <= 1:
        raise ConfigError(f"{field}.{key}", f"expected seconds in 0 .. 1, got {value!r}")
    return float(value)


def _whole(value: Any, field: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(field, f"expected a whole number >= {low}, got {value!r}")
    return value


def _per_world(data: Mapping, key: str, field: str, kind) -> tuple:
    """``{world size: value}`` of an ``all_reduce`` block, as sorted ``(size, value)`` pairs."""
    value = data.get(key)
    if not isinstance(value, Mapping) or not value:
        raise ConfigError(f"{field}.{key}", f"expected a mapping of world size to a value, e.g. {{8: 262144}}, "
                                            f"got {value!r}")
    out = []
    for ws, v in value.items():
        _whole(ws, f"{field}.{key}", 2)
        out.append((ws, kind(v, f"{field}.{key}.{ws}")))
    return tuple(sorted(out))


def _bytes(v: Any, field: str) -> int:
    return _whole(v, field, 0)


def _checked_seconds(v: Any, field: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= 1:
        raise ConfigError(field, f"expected seconds in 0 .. 1, got {v!r}")
    return float(v)


@attrs.frozen(kw_only=True)
class HostTime:
    """The host's work per step (scheduling, input preparation, sampling, output processing):
    ``fixed_s + per_sequence_s * sequences + per_token_s * new tokens``; ``overlap``: the
    framework runs it while the GPU runs the previous step (vLLM v1's async scheduling, SGLang's
    overlap scheduler), so a step takes ``max(GPU, host)``, else ``GPU + host``."""

    fixed_s: float = 0.0
    per_sequence_s: float = 0.0
    per_token_s: float = 0.0
    overlap: bool = False

    @classmethod
    def from_mapping(cls, data: Any, field: str) -> "HostTime":
        if not isinstance(data, Mapping):
            raise ConfigError(field, f"expected a mapping such as {{fixed_s: 1e-3, overlap: true}}, got {data!r}")
        check_keys(data, field, HOST_KEYS)
        return cls(fixed_s=_seconds(data, "fixed_s", 0.0, field),
                   per_sequence_s=_seconds(data, "per_sequence_s", 0.0, field),
                   per_token_s=_seconds(data, "per_token_s", 0.0, field), overlap=_bool(data, "overlap", False, field))

    def seconds(self, sequences: int, tokens: int) -> float:
        return self.fixed_s + self.per_sequence_s * sequences + self.per_token_s * tokens

    def step_s(self, gpu_s: float, sequences: int, tokens: int) -> float:
        """What a step of ``gpu_s`` on the GPU takes with this host work: overlapped host time
        shows only where it exceeds the GPU's."""
        host = self.seconds(sequences, tokens)
        return max(gpu_s, host) if self.overlap else gpu_s + host


@attrs.frozen(kw_only=True)
class CustomAllReduce:
    """The framework's own all-reduce kernel inside one NVLink node (plugins/collectives uses it):
    chosen for a group of ``world_sizes`` chips of one node and a buffer under ``max_bytes`` (per
    world size), one-shot (each rank reads every peer's buffer and reduces) under
    ``one_shot_max_bytes`` and two-shot (reduce-scatter then all-gather through peer memory) above;
    NCCL otherwise. ``*_latency_s``: each kernel's fixed cost (its wires come from the topology)."""

    kernel: str
    world_sizes: tuple
    max_bytes: tuple
    one_shot_max_bytes: tuple
    one_shot_latency_s: tuple
    two_shot_latency_s: tuple
    # the symmetric-memory multimem regime (SYMM_MEM_KEYS): above ``max_bytes`` and under
    # ``symm_mem_max_bytes`` for its world sizes, a fixed cost plus seconds per byte per rank
    symm_mem_max_bytes: tuple = ()
    symm_mem_latency_s: tuple = ()
    symm_mem_s_per_byte: tuple = ()

    @classmethod
    def from_mapping(cls, data: Any, field: str) -> "CustomAllReduce":
        if not isinstance(data, Mapping):
            raise ConfigError(field, f"expected a mapping (kernel, world_sizes, max_bytes, ...), got {data!r}")
        check_keys(data, field, ALL_REDUCE_KEYS + SYMM_MEM_KEYS)
        kernel = data.get("kernel")
        if not isinstance(kernel, str) or not kernel:
            raise ConfigError(f"{field}.kernel", f"expected the kernel's name, e.g. vllm_custom, got {kernel!r}")
        sizes = data.get("world_sizes")
        if not isinstance(sizes, (list, tuple)) or not sizes:
            raise ConfigError(f"{field}.world_sizes", f"expected a list of world sizes such as [2, 4, 8], got {sizes!r}")
        world = tuple(sorted(_whole(w, f"{field}.world_sizes", 2) for w in sizes))
        out = cls(kernel=kernel, world_sizes=world,
                  max_bytes=_per_world(data, "max_bytes", field, _bytes),
                  one_shot_max_bytes=_per_world(data, "one_shot_max_bytes", field, _bytes),
                  one_shot_latency_s=_per_world(data, "one_shot_latency_s", field, _checked_seconds),
                  two_shot_latency_s=_per_world(data, "two_shot_latency_s", field, _checked_seconds))
        for key in ALL_REDUCE_KEYS[2:]:
            missing = [w for w in world if w not in dict(getattr(out, key))]
            if missing:
                raise ConfigError(f"{field}.{key}", f"no value for world size {missing[0]}; give one for each of "
                                                    f"world_sizes {list(world)}")
        given = [k for k in SYMM_MEM_KEYS if k in data]
        if given:
            if len(given) != len(SYMM_MEM_KEYS):
                missing = next(k for k in SYMM_MEM_KEYS if k not in data)
                raise ConfigError(f"{field}.{missing}", f"the symmetric-memory regime needs all of "
                                                        f"{', '.join(SYMM_MEM_KEYS)} (or none of them)")
            out = attrs.evolve(out, symm_mem_max_bytes=_per_world(data, "symm_mem_max_bytes", field, _bytes),
                               symm_mem_latency_s=_per_world(data, "symm_mem_latency_s", field, _checked_seconds),
                               symm_mem_s_per_byte=_per_world(data, "symm_mem_s_per_byte", field, _checked_seconds))
            sizes = {k: {w for w, _ in getattr(out, k)} for k in SYMM_MEM_KEYS}
            if len({frozenset(v) for v in sizes.values()}) != 1:
                raise ConfigError(f"{field}.symm_mem_latency_s", "give the symmetric-memory regime's three values "
                                                                 "for the same world sizes")
        return out

    def choose(self, world: int, nbytes: float) -> str | None:
        """``one_shot``, ``two_shot``, ``symm_mem_multimem`` or None (NCCL) for ``nbytes`` per rank
        over ``world`` chips of one node (the custom kernel under its limit, then the
        symmetric-memory regime under its own, as vLLM's ``CudaCommunicator.all_reduce``
        tries them in turn)."""
        if world in self.world_sizes and nbytes < dict(self.max_bytes)[world]:
            return "one_shot" if nbytes < dict(self.one_shot_max_bytes)[world] else "two_shot"
        symm = dict(self.symm_mem_max_bytes)
        if world in symm and nbytes < symm[world]:
            return "symm_mem_multimem"
        return None

    def latency_s(self, world: int, regime: str) -> float:
        if regime == "symm_mem_multimem":
            return dict(self.symm_mem_latency_s)[world]
        return dict(self.one_shot_latency_s if regime == "one_shot" else self.two_shot_latency_s)[world]

    def s_per_byte(self, world: int) -> float:
        """The symmetric-memory regime's seconds per byte per rank at ``world`` chips."""
        return dict(self.symm_mem_s_per_byte)[world]

    def to_dict(self) -> dict:
        out = {"kernel": self.kernel, "world_sizes": list(self.world_sizes),
               **{k: dict(getattr(self, k)) for k in ALL_REDUCE_KEYS[2:]}}
        if self.symm_mem_max_bytes:
            out.update({k: dict(getattr(self, k)) for k in SYMM_MEM_KEYS})
        return out


def _profile_dir():
    try:
        root = files("g5core") / "data" / "frameworks"
        if root.is_dir():
            return root
    except Exception:  # a namespace package on an old Python: use the file system
        pass
    return pathlib.Path(__file__).resolve().parent.parent / "data" / "frameworks"


@functools.lru_cache(maxsize=None)
def load_profile(name: str) -> dict:
    """The shipped profile ``name`` (g5core/data/frameworks/NAME.yaml): ``{name, version,
    sources, framework}``; its ``framework`` mapping is a framework block."""
    text = (_profile_dir() / f"{name}.yaml").read_text(encoding="utf-8")
    data = load_yaml(text)
    if not isinstance(data, Mapping) or data.get("name") != name or not isinstance(data.get("framework"), Mapping):
        raise ConfigError(f"framework profile {name}", "the shipped file is malformed (name, version, sources, "
                                                       "framework)")
    return data


def profile_names() -> tuple:
    return FRAMEWORK_NAMES


@attrs.frozen(kw_only=True)
class Framework:
    #: the profile the block selected (``name:``), None for a block without one (today's behaviour)
    name: str | None = None
    version: str | None = None
    cuda_graphs: str = "decode"
    kernel_launch_s: float = DEFAULT_KERNEL_LAUNCH_S
    eager_passkv_ring: bool = True
    stack: str = DEFAULT_STACK
    #: the fusions in force (the stack's, with the block's overrides), in FUSIONS order
    fusions: tuple = STACKS[DEFAULT_STACK]
    attention: str = "default"
    #: the decode batch sizes captured as CUDA graphs; None: every size (no padding)
    cuda_graph_batch_sizes: tuple | None = None
    #: a decode batch between captured sizes runs padded up to the next one (else eagerly)
    cuda_graph_padding: bool = True
    #: what one launched kernel costs inside a captured graph; None: the system file's
    #: ``launch_overhead_s`` per op, everywhere (the model without a profile)
    graph_kernel_s: float | None = None
    host: HostTime | None = None
    all_reduce: CustomAllReduce | None = None
    #: the framework's scheduling: whether prefill chunks share a step with decodes (the
    #: serving scheduler's ``mixed_prefill`` where the configuration does not give it;
    #: None: the scheduler's default)
    mixed_prefill: bool | None = None

    @classmethod
    def from_mapping(cls, data: Any, field: str = "system.framework") -> "Framework":
        if not isinstance(data, Mapping):
            raise ConfigError(field, f"expected a mapping such as {{name: vllm}} or {{cuda_graphs: decode, "
                                     f"kernel_launch_s: 5e-6}}, got {data!r}")
        check_keys(data, field, FRAMEWORK_KEYS)
        name = data.get("name")
        version = None
        if name is not None:
            if name not in FRAMEWORK_NAMES:
                raise ConfigError(f"{field}.name", f"unknown framework {name!r}{suggest(str(name), FRAMEWORK_NAMES)}; "
                                                   f"choose one of {', '.join(FRAMEWORK_NAMES)}")
            profile = load_profile(name)
            version = str(profile["version"])
            asked = data.get("version")
            if asked is not None and str(asked) != version:
                raise ConfigError(f"{field}.version", f"G5 ships the {name} profile of release {version} only, not "
                                                      f"{asked!r}; remove version or set it to '{version}'")
            values = dict(profile["framework"])
            overrides = data.get("fusions")
            if "fusions" in values and isinstance(overrides, Mapping):
                overrides = {**values["fusions"], **overrides}
            data = {**values, **{k: v for k, v in data.items() if k not in ("name", "version")}}
            if overrides is not None:
                data["fusions"] = overrides
        elif "version" in data:
            raise ConfigError(f"{field}.version", "a version selects a release of a named profile; add name: "
                                                  f"{' | '.join(FRAMEWORK_NAMES)}")
        mode = data.get("cuda_graphs", "decode")
        if mode not in CUDA_GRAPH_MODES:
            raise ConfigError(f"{field}.cuda_graphs", f"unknown mode {mode!r}{suggest(str(mode), CUDA_GRAPH_MODES)}; "
                                                      f"choose one of {', '.join(CUDA_GRAPH_MODES)}")
        launch = _seconds(data, "kernel_launch_s", DEFAULT_KERNEL_LAUNCH_S, field)
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
        for fusion in overrides:
            (on.add if _bool(overrides, fusion, False, f"{field}.fusions") else on.discard)(fusion)
        attention = data.get("attention", "default")
        if not isinstance(attention, str) or not attention:
            raise ConfigError(f"{field}.attention", f"expected a curve name (default, fa3, ...), got {attention!r}")
        sizes = data.get("cuda_graph_batch_sizes")
        if sizes is not None:
            if not isinstance(sizes, (list, tuple)) or not sizes:
                raise ConfigError(f"{field}.cuda_graph_batch_sizes",
                                  f"expected a list of batch sizes such as [1, 2, 4, 8], got {sizes!r}")
            sizes = tuple(sorted({_whole(b, f"{field}.cuda_graph_batch_sizes") for b in sizes}))
        graph_kernel = data.get("graph_kernel_s")
        if graph_kernel is not None:
            graph_kernel = _seconds(data, "graph_kernel_s", 0.0, field)
        host = data.get("host")
        host = None if host is None else HostTime.from_mapping(host, f"{field}.host")
        reduce = data.get("all_reduce")
        reduce = None if reduce is None else CustomAllReduce.from_mapping(reduce, f"{field}.all_reduce")
        mixed = data.get("mixed_prefill")
        if mixed is not None and not isinstance(mixed, bool):
            raise ConfigError(f"{field}.mixed_prefill", f"must be true or false, got {mixed!r}")
        return cls(name=name, version=version, cuda_graphs=mode, kernel_launch_s=launch, eager_passkv_ring=eager,
                   stack=stack, fusions=tuple(f for f in FUSIONS if f in on), attention=attention,
                   cuda_graph_batch_sizes=sizes, cuda_graph_padding=_bool(data, "cuda_graph_padding", True, field),
                   graph_kernel_s=graph_kernel, host=host, all_reduce=reduce, mixed_prefill=mixed)

    def to_dict(self) -> dict:
        out = attrs.asdict(self, recurse=False)
        out["fusions"] = {f: f in self.fusions for f in FUSIONS}
        if self.cuda_graph_batch_sizes is not None:
            out["cuda_graph_batch_sizes"] = list(self.cuda_graph_batch_sizes)
        out["host"] = None if self.host is None else attrs.asdict(self.host)
        out["all_reduce"] = None if self.all_reduce is None else self.all_reduce.to_dict()
        return {k: v for k, v in out.items() if v is not None or k in ("name",)}

    def graph_batch(self, sequences: int) -> int | None:
        """The captured batch size a decode step of ``sequences`` runs as, or None where it runs
        eagerly (above the largest captured size, or between sizes without padding)."""
        sizes = self.cuda_graph_batch_sizes
        if sizes is None:
            return sequences
        i = bisect.bisect_left(sizes, sequences)
        if i == len(sizes) or (sizes[i] != sequences and not self.cuda_graph_padding):
            return None
        return sizes[i]

    def captured(self, phase: str, owner: str, sequences: int | None = None, op_class: str | None = None) -> bool:
        """Whether an op of ``owner`` (of ``op_class``) in a ``phase`` step (of ``sequences``
        sequences, for a decode step) runs inside a captured CUDA graph."""
        if owner == "cp_passkv" and self.eager_passkv_ring:
            return False
        if self.cuda_graphs == "all":
            return True
        if self.cuda_graphs not in ("decode", "piecewise") or phase != "decode":
            return False
        if self.cuda_graphs == "piecewise" and op_class == "attention":
            return False   # the graph is split at the attention op, which runs eagerly
        return sequences is None or self.graph_batch(sequences) is not None


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


def step_sequences(deployment) -> int | None:
    """The sequences of a deployment's step (what CUDA-graph capture is keyed on), or None."""
    step = getattr(deployment, "step", None)
    return None if step is None else step.sequences


def launch_s(op, system, phase: str, sequences: int | None = None) -> float:
    """The launch time G5 adds to compute ``op`` (0 without a ``framework`` block): its launched
    (unfused) kernels times ``kernel_launch_s`` where the op is not captured (``sequences``: the
    step's, which decide whether a decode step has a captured graph); under a profile with
    ``graph_kernel_s``, captured kernels pay that each (:func:`op_overhead_s`)."""
    fw = getattr(system, "framework", None)
    if fw is None:
        return 0.0
    if fw.captured(phase, op.owner, sequences, getattr(op, "op_class", None)):
        if fw.graph_kernel_s is None:
            return 0.0
        return max(1, launched_kernels(op, system, phase)) * fw.graph_kernel_s
    return max(1, launched_kernels(op, system, phase)) * fw.kernel_launch_s


def op_overhead_s(system) -> float:
    """The fixed time the latency plugins add to every compute op: the system file's
    ``launch_overhead_s`` ("fixed host cost of one kernel launch"), except under a framework
    with ``graph_kernel_s``, where :func:`launch_s` prices every kernel's launch -- a captured
    kernel at the graph's cost, an eager one at ``kernel_launch_s`` -- and adding the per-op
    host launch on top would count a launch twice (in a CUDA graph there is no host launch at
    all)."""
    fw = getattr(system, "framework", None)
    return system.launch_overhead_s if fw is None or fw.graph_kernel_s is None else 0.0


def launched_kernels(op, system, phase: str) -> int:
    """How many of ``op``'s kernels are launched (not fused into another)."""
    return sum(1 for h in kernel_hosts(op, system, phase) if h is None)


def with_framework(system, name: str, field: str = "--framework"):
    """``system`` under the shipped profile ``name`` (what ``--framework NAME`` does): the system
    file's own framework block keeps its other keys, which override the profile's values."""
    if name not in FRAMEWORK_NAMES:
        raise ConfigError(field, f"unknown framework {name!r}{suggest(str(name), FRAMEWORK_NAMES)}; "
                                 f"choose one of {', '.join(FRAMEWORK_NAMES)}")
    block = getattr(system, "framework", None)
    if name == "generic" and block is None:
        return system   # G5's model without a profile: the same system, bit for bit
    own = own_keys(block.to_dict()) if block is not None and block.name is None else {}
    return attrs.evolve(system, framework=Framework.from_mapping({**own, "name": name}, field))


def own_keys(block: Mapping) -> dict:
    """The keys a system file's framework block without a ``name`` sets (its mapping, as
    ``to_dict`` gives it): those that differ from the defaults, which override a profile's
    (:func:`with_framework`)."""
    defaults = DEFAULT_FRAMEWORK.to_dict()
    return {k: v for k, v in block.items() if k != "name" and v != defaults.get(k)}


def graph_islands(system) -> frozenset:
    """The decode batch sizes the system's framework captures as CUDA graphs while it runs the
    batches between them eagerly (``cuda_graph_padding: false``, TensorRT-LLM's default):
    islands of graph cost among eager batches. Empty without such a framework."""
    fw = getattr(system, "framework", None)
    if fw is None or fw.cuda_graph_batch_sizes is None or fw.cuda_graph_padding or fw.cuda_graphs == "none":
        return frozenset()
    return frozenset(fw.cuda_graph_batch_sizes)


def graph_step(step, system, token_multiple: int = 1):
    """The step the GPU runs for ``step`` under the system's framework: a decode step whose
    batch lies between captured CUDA-graph sizes is padded up to the next one (the padding
    slots attend next to nothing: one new token each, after ``token_multiple - 1`` cached ones,
    the least context the layout's step rules take: a context-parallel split needs a multiple
    of ``2 x cp``), as vLLM's and SGLang's runners pad a batch to the captured graph (bisect);
    every other step as it is."""
    fw = getattr(system, "framework", None)
    if fw is None or fw.cuda_graph_batch_sizes is None or fw.cuda_graphs == "none" or step.phase != "decode":
        return step
    padded = fw.graph_batch(step.sequences)
    if padded is None or padded == step.sequences:
        return step
    slots = StepGroup(new_tokens=1, cached_tokens=token_multiple - 1, count=padded - step.sequences)
    return Step(tuple(step) + (slots,))


def host_step_s(gpu_s: float, step, system) -> float:
    """A serving step's time with the framework's host work per step (:class:`HostTime`); the
    GPU's time where the framework has none."""
    fw = getattr(system, "framework", None)
    if fw is None or fw.host is None:
        return gpu_s
    return fw.host.step_s(gpu_s, step.sequences, step.new_tokens)
