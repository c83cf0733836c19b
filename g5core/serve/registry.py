"""Schedulers, routers and trace formats by name: the core's built-in ones, then what the
enabled plugins register through the serving hooks (``g5_register_schedulers``,
``g5_register_routers``, ``g5_register_workload_formats``). A name registered twice is an
error naming both owners."""
from __future__ import annotations

from typing import Callable

import attrs

from g5core.api.errors import PluginError
from g5core.api.plugins import Hooks
from g5core.serve.router import BUILTIN_ROUTERS
from g5core.serve.scheduler import VllmScheduler
from g5core.api.serving import TraceFormat
from g5core.serve.traces import BUILTIN_FORMATS

CORE = "g5core"


@attrs.frozen
class ServingRegistry:
    schedulers: dict      # name -> (owner, factory)
    routers: dict         # name -> (owner, factory)
    formats: tuple        # TraceFormat, built-in first

    def scheduler(self, name: str) -> Callable:
        return self.schedulers[name][1]

    def router(self, name: str) -> Callable:
        return self.routers[name][1]


def _named(table: dict, what: str) -> Callable[..., None]:
    """``record(plugin, name, factory)`` for :meth:`Hooks.call_registration`."""
    def record(plugin: str, name, factory) -> None:
        if not isinstance(name, str) or not name or not callable(factory):
            raise PluginError(plugin, f"register({name!r}, ...) needs a {what} name and a callable factory")
        if name in table:
            raise PluginError(plugin, f"{what} {name!r} is already registered by {table[name][0]}")
        table[name] = (plugin, factory)
    return record


def serving_registry(hooks: Hooks) -> ServingRegistry:
    schedulers = {"vllm": (CORE, VllmScheduler)}
    routers = {name: (CORE, cls) for name, cls in BUILTIN_ROUTERS.items()}
    formats = list(BUILTIN_FORMATS)
    hooks.call_registration("g5_register_schedulers", _named(schedulers, "scheduler"))
    hooks.call_registration("g5_register_routers", _named(routers, "router"))

    def record_format(plugin: str, fmt) -> None:
        if not isinstance(fmt, TraceFormat):
            raise PluginError(plugin, f"g5_register_workload_formats must register TraceFormat values, got {fmt!r}")
        if any(f.name == fmt.name and f.container == fmt.container for f in formats):
            raise PluginError(plugin, f"trace format {fmt.name!r} ({fmt.container}) is already registered")
        formats.append(fmt)
    hooks.call_registration("g5_register_workload_formats", record_format)
    return ServingRegistry(schedulers, routers, tuple(formats))
