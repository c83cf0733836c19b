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
- ``fused_fp8_quant``: the FP8 quantisation of a GEMM's input runs inside the kernel that
  produces it (TensorRT-LLM fuses residual add + RMSNorm + FP8 quantisation, NVIDIA/
  TensorRT-LLM PR #12674, and the attention output's quantisation into attention, PR #11910;
  vLLM does so only with its fusion pass on, vllm-project/vllm PR #27883): no separate
  ``fp8_quant`` kernel time. Default false.
- ``attention``: the attention kernel family of the size-aware roofline: ``default`` (the
  system file's ``compute_model`` attention fit) or a curve the file's
  ``compute_model.attention_curves`` names (e.g. ``fa3``).

Where the block is left out nothing is added (captured everywhere, the file's own curve).
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
FRAMEWORK_KEYS = ("cuda_graphs", "kernel_launch_s", "eager_passkv_ring", "fused_fp8_quant", "attention")
DEFAULT_KERNEL_LAUNCH_S = 5.0e-6


@attrs.frozen(kw_only=True)
class Framework:
    cuda_graphs: str = "decode"
    kernel_launch_s: float = DEFAULT_KERNEL_LAUNCH_S
    eager_passkv_ring: bool = True
    fused_fp8_quant: bool = False
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
        eager = data.get("eager_passkv_ring", True)
        if not isinstance(eager, bool):
            raise ConfigError(f"{field}.eager_passkv_ring", f"expected true or false, got {eager!r}")
        fused = data.get("fused_fp8_quant", False)
        if not isinstance(fused, bool):
            raise ConfigError(f"{field}.fused_fp8_quant", f"expected true or false, got {fused!r}")
        attention = data.get("attention", "default")
        if not isinstance(attention, str) or not attention:
            raise ConfigError(f"{field}.attention", f"expected a curve name (default, fa3, ...), got {attention!r}")
        return cls(cuda_graphs=mode, kernel_launch_s=float(launch), eager_passkv_ring=eager, fused_fp8_quant=fused,
                   attention=attention)

    def to_dict(self) -> dict:
        return attrs.asdict(self)

    def captured(self, phase: str, owner: str) -> bool:
        """Whether an op of ``owner`` in a ``phase`` step runs inside a captured CUDA graph."""
        if owner == "cp_passkv" and self.eager_passkv_ring:
            return False
        return self.cuda_graphs == "all" or (self.cuda_graphs == "decode" and phase == "decode")


def launch_s(op, system, phase: str) -> float:
    """The launch time G5 adds to compute ``op``: its kernels times ``kernel_launch_s`` when it
    is not captured (0 without a ``framework`` block)."""
    fw = getattr(system, "framework", None)
    if fw is None or fw.captured(phase, op.owner):
        return 0.0
    return max(1, len(op.kernels)) * fw.kernel_launch_s


def fused_away(kernel, system) -> bool:
    """Whether ``kernel`` runs inside its producer under the system's framework (no time)."""
    fw = getattr(system, "framework", None)
    return fw is not None and fw.fused_fp8_quant and getattr(kernel, "kind", "") == "fp8_quant"
