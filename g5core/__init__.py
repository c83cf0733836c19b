"""G5: event-driven simulation of LLM inference on multi-chip clusters.

Plugins, built-in or third-party, import what they need from here and nowhere else: the
``hookimpl`` marker, the value types they register or return, the errors they raise, and the
helpers that turn a chip's share of the model into work and bytes. Everything in
``__all__`` is public API; the submodules are the core's own business.

Simulating steps (:mod:`g5core.session.prepared`): ``prepare(config)`` validates a deployment
once and returns a :class:`PreparedPlan`; ``plan.simulate(Step([StepGroup(new_tokens=1,
cached_tokens=8191, count=64)]))`` returns a :class:`StepResult` (``latency_s``,
``ttft_s``/``tpot_s`` for a pure prefill/decode step, ``memory``: the per-chip ledger with
``kv_bytes_per_token``), cached per step shape; ``plan.kv_capacity_tokens(step)`` sizes a
KV pool from the ledger.
"""
from .api.context import BuildContext
from .lower.microbatch import PipelineMicrobatches
from .api.dimensions import Dimension
from .api.errors import ConfigError, DagError, G5Error, PluginError, suggest
from .api.ops import CommOp, ComputeOp, Fragment
from .api.options import PluginOption
from .api.plugins import Hooks, PluginInfo, describe_plugins, hookimpl, make_plugin_manager
from .api.records import Lowering, MemoryTerm, StepRules, SweepPreset
from .api.serving import (
    GroupShape, Request, RoutedInstance, Router, Scheduler, Seq, StepWork, TraceFieldError, TraceFormat,
)
from .api.work import LogicalOp, Work
from .lower.flops import activation_tensor_bytes, attention_block_bytes, causal_attention_flops, prefix_attention_flops
from .lower.layers import (
    attention_dims, attention_kernel, attention_kernel_of, attention_side_kernels, attention_work,
    decode_attention_kernel, decode_query_rows, default_work, expert_work, local_kv_bytes_per_token, merge_kernel, step_attention_work, weight_elements, window_attention_work,
)
from .lower.topology import Topology
from .inputs.framework import fused_bytes, kernel_hosts, op_overhead_s
from .inputs.step import Step, StepGroup
from .inputs.reading import check_keys
from .lower.collective import NVLINK_COPY_EFFICIENCY, idle_transfer_s
from .lower.kernels import Attention, Elementwise, Gemm
from .api.records import ComputeTime
from .sim.memory import weight_bytes_per_chip
from .lower.flops import passq_reduce_elements
from .sim.roofline import gemm_padded_flops, kernel_latency_s, op_latency_s, roofline_latency_s
from .session.prepared import PreparedPlan, StepMemory, StepResult, prepare
# the types the hook specifications and BuildContext name (api/ imports none of them)
from .inputs.config import Deployment
from .inputs.models import ModelSpec
from .inputs.systems import SystemSpec
from .lower.rankmap import RankMap
from .lower.shape import LocalShape
# the settings a registered scheduler factory is given
from .serve.scheduler import SchedulerSettings
from .version import __version__

__all__ = [
    "Attention", "BuildContext", "CommOp", "ComputeOp", "ComputeTime", "ConfigError", "DagError", "Deployment",
    "Dimension", "Elementwise", "Fragment", "G5Error", "Gemm", "GroupShape", "Hooks", "LocalShape", "LogicalOp", "Lowering",
    "MemoryTerm", "ModelSpec", "NVLINK_COPY_EFFICIENCY", "PipelineMicrobatches", "PluginError", "PluginInfo",
    "PluginOption", "PreparedPlan", "RankMap", "Request", "RoutedInstance", "Router", "Scheduler",
    "SchedulerSettings", "Seq", "Step", "StepGroup", "StepMemory", "StepResult", "StepRules", "StepWork",
    "SweepPreset", "SystemSpec", "Topology", "TraceFieldError", "TraceFormat", "Work", "activation_tensor_bytes",
    "attention_block_bytes", "attention_dims", "attention_kernel", "attention_kernel_of", "attention_side_kernels",
    "attention_work", "causal_attention_flops", "check_keys", "decode_attention_kernel", "decode_query_rows", "default_work", "describe_plugins", "expert_work",
    "fused_bytes", "gemm_padded_flops", "hookimpl", "idle_transfer_s", "kernel_hosts", "kernel_latency_s",
    "local_kv_bytes_per_token", "make_plugin_manager", "merge_kernel", "op_latency_s", "op_overhead_s",
    "passq_reduce_elements",
    "prefix_attention_flops", "prepare", "roofline_latency_s", "step_attention_work", "suggest",
    "weight_bytes_per_chip", "weight_elements", "window_attention_work",
]
