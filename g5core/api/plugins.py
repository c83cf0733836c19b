"""Plugin manager factory and the typed facade through which the core calls hooks.

There is no global plugin manager: :func:`make_plugin_manager` builds a fresh one per run
(and per test). Built-in plugins are loaded from the ``g5.plugins`` entry-point group, the
same way third-party plugins are. Disabled names are blocked *before* entry points load.
"""
from __future__ import annotations

import functools
import importlib.metadata
import sys
from typing import Any, Callable, Iterable, Sequence

import attrs
import pluggy

from g5core.api import hookspecs
from g5core.api.errors import G5Error, PluginError, suggest

ENTRY_POINT_GROUP = "g5.plugins"
PROJECT_NAME = "g5"

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@attrs.frozen(kw_only=True)
class PluginInfo:
    name: str
    enabled: bool
    hooks: tuple[str, ...]


#: the installed entry points of the group, per process: scanning every installed
#: distribution costs about 11 ms, and every plugin manager asks. Keyed by what decides the
#: answer within a process (the import path, and the function that reads them, which tests
#: replace), so a changed path or a stand-in is scanned afresh
_SCANNED: dict = {}


def _scan() -> tuple:
    key = (importlib.metadata.entry_points, tuple(sys.path))   # the function itself: an id could be reused
    hit = _SCANNED.get(key)
    if hit is None:
        if len(_SCANNED) > 8:
            _SCANNED.clear()
        hit = _SCANNED[key] = tuple(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    return hit


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    eps = _scan()
    by_name: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in sorted(eps, key=lambda e: (e.name, e.value)):
        if ep.name in by_name and by_name[ep.name].value != ep.value:
            raise PluginError(
                ep.name,
                f"two installed distributions register this plugin name "
                f"({by_name[ep.name].value} and {ep.value}); uninstall one",
            )
        by_name[ep.name] = ep
    return [by_name[name] for name in sorted(by_name)]


def plugin_modules() -> tuple[tuple[str, str], ...]:
    """``(name, module)`` of every installed plugin (its entry point's value), by name."""
    return tuple((ep.name, ep.value) for ep in _entry_points())


def available_plugin_names() -> tuple[str, ...]:
    """Names of every installed plugin (entry points), whether or not enabled."""
    return tuple(ep.name for ep in _entry_points())


def make_plugin_manager(
    disabled: Iterable[str] = (),
    extra_plugins: Sequence[tuple[str, Any]] = (),
    load_entry_points: bool = True,
) -> pluggy.PluginManager:
    """Build a fresh plugin manager.

    ``disabled`` names are blocked before any entry point is loaded; a name that is not an
    installed or extra plugin is an error (a typo must not silently keep a plugin on).
    ``extra_plugins`` are ``(name, module_or_object)`` pairs registered after the entry
    points (tests and embedding applications use them).
    """
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    eps = _entry_points() if load_entry_points else []
    known = {ep.name for ep in eps} | {name for name, _ in extra_plugins}
    disabled = tuple(disabled)
    for name in disabled:
        if name not in known:
            raise PluginError(
                name,
                f"cannot disable an unknown plugin{suggest(name, known)}; "
                f"installed plugins: {', '.join(sorted(known))}",
            )
        pm.set_blocked(name)
    for ep in eps:
        if pm.is_blocked(ep.name):
            continue
        try:
            plugin = ep.load()
        except Exception as exc:  # any import failure is reported by plugin name
            raise PluginError(ep.name, f"failed to load ({ep.value}): {type(exc).__name__}: {exc}") from exc
        _register(pm, ep.name, plugin)
    for name, plugin in extra_plugins:
        if pm.is_blocked(name):
            continue
        _register(pm, name, plugin)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        name = pm.get_name(exc.plugin) if getattr(exc, "plugin", None) is not None else None
        raise PluginError(name or "?", " ".join(str(exc).split())) from exc
    return pm


def _register(pm: pluggy.PluginManager, name: str, plugin: Any) -> None:
    if pm.get_plugin(name) is not None:
        raise PluginError(name, "a plugin with this name is already registered")
    try:
        pm.register(plugin, name=name)
    except ValueError as exc:
        raise PluginError(name, f"cannot register: {exc}") from exc
    except pluggy.PluginValidationError as exc:
        raise PluginError(name, f"invalid hook implementation: {' '.join(str(exc).split())}") from exc
    # The core calls each implementation on its own (to name the plugin that failed and to
    # validate each answer), so a wrapper would never wrap anything: refuse it here rather
    # than hand the core a generator where it expects an answer.
    wrappers = sorted(caller.name for caller in pm.get_hookcallers(plugin) or ()
                      for impl in caller.get_hookimpls()
                      if impl.plugin is plugin and (impl.hookwrapper or getattr(impl, "wrapper", False)))
    if wrappers:
        pm.unregister(plugin)
        raise PluginError(name, f"implements {', '.join(wrappers)} as a wrapper (wrapper=True or hookwrapper=True); "
                                "G5 calls every implementation on its own, so wrappers are not supported: "
                                "implement the hook plainly")


def describe_plugins(pm: pluggy.PluginManager) -> tuple[PluginInfo, ...]:
    """Every installed or registered plugin, enabled or disabled, with the hooks it implements."""
    infos = []
    registered = dict(pm.list_name_plugin())
    names = set(registered) | set(available_plugin_names())
    for name in sorted(names):
        plugin = registered.get(name)
        if plugin is None:
            infos.append(PluginInfo(name=name, enabled=False, hooks=()))
            continue
        hooks = tuple(sorted(h.name for h in pm.get_hookcallers(plugin) or ()))
        infos.append(PluginInfo(name=name, enabled=True, hooks=hooks))
    return tuple(infos)


class Hooks:
    """Typed facade over the plugin manager.

    Calls each implementation separately so that an exception raised inside a plugin is
    reported with that plugin's name, and so that contribution hooks return
    ``(plugin_name, answer)`` pairs the core can validate. Called once per build step,
    never inside the engine's event loop.
    """

    def __init__(self, pm: pluggy.PluginManager):
        self.pm = pm

    def implementations(self, hook_name: str) -> list:
        """Every implementation of ``hook_name`` (pluggy ``HookImpl``; ``.plugin_name`` names
        its plugin), in the order the core calls them: pluggy's (last registered first,
        ``tryfirst``/``trylast`` honoured)."""
        caller = getattr(self.pm.hook, hook_name)
        return list(reversed(caller.get_hookimpls()))

    def plugin_implementations(self, hook_name: str, plugin: str) -> list:
        """The implementations of ``hook_name`` that ``plugin`` provides (none when disabled)."""
        return [impl for impl in self.implementations(hook_name) if impl.plugin_name == plugin]

    def call_each(self, hook_name: str, **kwargs) -> list[tuple[str, Any]]:
        """Call every implementation; return ``(plugin_name, result)`` for non-None results."""
        out = []
        for impl in self.implementations(hook_name):
            result = self.call_impl(impl, hook_name, kwargs)
            if result is not None:
                out.append((impl.plugin_name, result))
        return out

    def call_first(self, hook_name: str, **kwargs) -> tuple[str, Any] | None:
        for impl in self.implementations(hook_name):
            result = self.call_impl(impl, hook_name, kwargs)
            if result is not None:
                return impl.plugin_name, result
        return None

    def call_registration(self, hook_name: str, record: Callable[..., None]) -> None:
        """Call a registration hook: each implementation gets a ``register`` that passes what
        it registers to ``record(plugin_name, *args)``, so it is recorded under its own
        plugin's name (the core's one registration collector: ``record`` validates)."""
        for impl in self.implementations(hook_name):
            self.call_impl(impl, hook_name, {"register": functools.partial(record, impl.plugin_name)})

    def collect_named(self, hook_name: str, cls: type, what: str) -> dict[str, Any]:
        """Every ``cls`` value (an attrs record with ``name`` and ``owner``) the plugins
        register through ``hook_name``, by name, its ``owner`` set to the registering plugin;
        a value of another type, or a name registered twice, is an error naming the plugin."""
        found: dict[str, Any] = {}

        def record(plugin: str, value) -> None:
            if not isinstance(value, cls):
                raise PluginError(plugin, f"{hook_name}: expected a {cls.__name__}, got {value!r}")
            if value.name in found:
                raise PluginError(plugin, f"{what} '{value.name}' is already registered by plugin "
                                          f"'{found[value.name].owner}'")
            found[value.name] = attrs.evolve(value, owner=plugin)

        self.call_registration(hook_name, record)
        return found

    @staticmethod
    def call_impl(impl, hook_name: str, kwargs: dict) -> Any:
        """Call one implementation with the arguments it asks for; an exception other than a
        :class:`~g5core.api.errors.G5Error` becomes a :class:`PluginError` naming its plugin."""
        args = {name: kwargs[name] for name in impl.argnames}
        try:
            return impl.function(**args)
        except G5Error:
            raise
        except Exception as exc:
            raise PluginError(
                impl.plugin_name, f"raised {type(exc).__name__} in {hook_name}: {exc}"
            ) from exc
