"""G5: event-driven simulation of LLM inference on multi-chip clusters.

Plugins, built-in or third-party, import what they need from here and nowhere else: the
``hookimpl`` marker, the value types they register or return, the errors they raise, and the
helpers that turn a chip's share of the model into work and bytes. Everything in
``__all__`` is public API; the submodules are the core's own business.
"""
from .collective import Lowering, idle_transfer_s
from .topology import Topology
from .dag import CommOp, ComputeOp, Fragment
from .dimensions import Dimension
from .errors import ConfigError, DagError, G5Error, PluginError
from .flops import activation_tensor_bytes, causal_attention_flops
from .layers import Work, attention_dims, attention_kernel, attention_work, default_work, local_kv_bytes_per_token
from .memory import MemoryTerm
from .options import PluginOption
from .plugins import Hooks, PluginInfo, describe_plugins, hookimpl, make_plugin_manager

__all__ = [
    "CommOp", "ComputeOp", "ConfigError", "DagError", "Dimension", "Fragment", "G5Error", "Hooks", "Lowering",
    "MemoryTerm", "PluginError", "PluginInfo", "PluginOption", "Topology", "Work", "activation_tensor_bytes",
    "attention_dims", "attention_kernel", "attention_work", "causal_attention_flops", "default_work", "describe_plugins",
    "hookimpl", "idle_transfer_s", "local_kv_bytes_per_token", "make_plugin_manager",
]
__version__ = "0.1.0"
