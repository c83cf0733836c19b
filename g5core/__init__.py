"""G5: event-driven simulation of LLM inference on multi-chip clusters.

Plugins import what they need from here: ``hookimpl`` (the marker), the value types they
return, and the errors they raise.
"""
from .collective import Lowering
from .topology import Topology
from .dag import CommOp, ComputeOp, Fragment
from .dimensions import Dimension
from .errors import ConfigError, DagError, G5Error, PluginError
from .memory import MemoryTerm
from .plugins import hookimpl, make_plugin_manager

__all__ = [
    "CommOp", "ComputeOp", "ConfigError", "DagError", "Dimension", "Fragment", "G5Error", "Lowering", "MemoryTerm",
    "PluginError", "Topology", "hookimpl", "make_plugin_manager",
]
__version__ = "0.1.0"
