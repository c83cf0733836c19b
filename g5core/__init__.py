"""G5: event-driven simulation of LLM inference on multi-chip clusters.

Plugins, built-in or third-party, import what they need from here and nowhere else: the
``hookimpl`` marker, the value types they register or return, the errors they raise, and the
helpers that turn a chip's share of the model into work and bytes. Everything in
``__all__`` is public API; the submodules are the core's own business.
"""
from .sim.collective import NVLINK_COPY_EFFICIENCY, Lowering, idle_transfer_s
from .build.topology import Topology
from .build.dag import CommOp, ComputeOp, Fragment
from .api.dimensions import Dimension
from .api.errors import ConfigError, DagError, G5Error, PluginError
from .build.flops import activation_tensor_bytes, causal_attention_flops
from .build.layers import (Work, attention_dims, attention_kernel, attention_work, default_work, expert_work,
                           local_kv_bytes_per_token, weight_elements)
from .sim.memory import MemoryTerm
from .api.options import PluginOption
from .api.plugins import Hooks, PluginInfo, describe_plugins, hookimpl, make_plugin_manager

__all__ = [
    "CommOp", "ComputeOp", "ConfigError", "DagError", "Dimension", "Fragment", "G5Error", "Hooks", "Lowering",
    "MemoryTerm", "NVLINK_COPY_EFFICIENCY", "PluginError", "PluginInfo", "PluginOption", "Topology", "Work", "activation_tensor_bytes",
    "attention_dims", "attention_kernel", "attention_work", "causal_attention_flops", "default_work", "describe_plugins",
    "expert_work", "hookimpl", "idle_transfer_s", "local_kv_bytes_per_token", "make_plugin_manager", "weight_elements",
]
__version__ = "0.1.0"
