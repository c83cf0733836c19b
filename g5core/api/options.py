"""Plugin options: switches a plugin declares and a configuration sets under ``plugins: {NAME: {...}}``.

A plugin declares each option through ``g5_register_options`` with a default, a doc line and
its allowed values; the core validates a configuration's ``plugins.NAME.OPTION`` entries with
the same one-line :class:`~g5core.api.errors.ConfigError` as every other field, and stores every
declared option (set or default) on the :class:`~g5core.inputs.config.Deployment`.

An option may also claim a *legacy top-level key* (``tp_sp`` for the TP plugin's ``sp``):
the old spelling keeps working and means exactly the same; giving both spellings with
different values is an error.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Optional

import attrs

from g5core.api.errors import ConfigError, PluginError, suggest
from g5core.api.plugins import available_plugin_names

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
KINDS = ("bool", "int", "choice", "value")
# Keys of the ``plugins`` mapping the core owns; a plugin may not be called by these names.
RESERVED = ("disable",)


@attrs.frozen(kw_only=True)
class PluginOption:
    """One option of one plugin.

    ``kind``: ``bool`` (true/false), ``int`` (a positive whole number), ``choice`` (one of
    ``choices``) or ``value``: whatever ``parse(value, field)`` accepts; it returns the
    stored value (hashable, and written back by the echo of the configuration as JSON) or
    raises :class:`~g5core.api.errors.ConfigError` naming ``field``. ``legacy_key``: a former top-level configuration key that still sets this
    option (``""`` for none).
    """

    name: str = attrs.field(validator=attrs.validators.matches_re(_NAME))
    default: Any
    doc: str
    kind: str = attrs.field(default="bool", validator=attrs.validators.in_(KINDS))
    choices: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    legacy_key: str = ""
    owner: str = ""
    parse: Any = attrs.field(default=None, eq=False, repr=False)

    def __attrs_post_init__(self):
        if self.kind == "choice" and not self.choices:
            raise ValueError(f"option {self.name}: a choice option needs its choices")
        if (self.kind == "value") != callable(self.parse):
            raise ValueError(f"option {self.name}: a value option, and only one, needs parse(value, field)")
        self.check(self.default, f"default of option {self.name}", error=ValueError)

    def check(self, value: Any, field: str, error: type = ConfigError) -> Any:
        """``value`` if it is allowed, else ``error`` naming ``field`` and what is allowed."""
        if self.kind == "value":
            try:
                return self.parse(value, field)
            except ConfigError as exc:
                if error is ConfigError:
                    raise
                raise error(str(exc)) from None
        if self.kind == "bool":
            ok, want = isinstance(value, bool), "true or false"
        elif self.kind == "int":
            ok, want = isinstance(value, int) and not isinstance(value, bool) and value > 0, "a positive whole number"
        else:
            ok, want = isinstance(value, str) and value in self.choices, "one of " + ", ".join(self.choices)
        if ok:
            return value
        hint = suggest(str(value), self.choices) if self.kind == "choice" else ""
        if error is ConfigError:
            raise ConfigError(field, f"must be {want}, got {value!r}{hint}")
        raise error(f"{field}: must be {want}, got {value!r}")


@attrs.frozen
class OptionRegistry:
    """Every declared option, by plugin (sorted)."""

    options: tuple[PluginOption, ...] = ()

    def of(self, plugin: str) -> tuple[PluginOption, ...]:
        return tuple(o for o in self.options if o.owner == plugin)

    @property
    def plugins(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(o.owner for o in self.options))

    @property
    def legacy_keys(self) -> dict[str, PluginOption]:
        return {o.legacy_key: o for o in self.options if o.legacy_key}

    def resolve(self, data: Mapping, disabled: tuple[str, ...] = ()) -> tuple[tuple, tuple[str, ...]]:
        """Validated values of every declared option from a raw configuration mapping.

        ``data`` is the whole configuration (the ``plugins`` mapping and legacy top-level
        keys are read from it). Returns ``((plugin, ((option, value), ...)), ...)`` sorted, and
        the ``plugin.option`` names that took their default.
        """
        section = data.get("plugins") or {}
        given: dict[str, dict[str, Any]] = {}
        for plugin, values in section.items():
            if plugin in RESERVED:
                continue
            field = f"plugins.{plugin}"
            if plugin not in self.plugins:
                if plugin in disabled or plugin in available_plugin_names():
                    raise ConfigError(field, f"plugin '{plugin}' is disabled or declares no options; remove {field} "
                                             f"or enable the plugin")
                known = self.plugins
                raise ConfigError(field, f"no enabled plugin named '{plugin}' declares options"
                                         f"{suggest(str(plugin), known)}; plugins with options: "
                                         f"{', '.join(known) or 'none'}")
            if not isinstance(values, Mapping):
                raise ConfigError(field, f"must be a mapping of option names to values, got {values!r}")
            names = tuple(o.name for o in self.of(plugin))
            for key in values:
                if key not in names:
                    raise ConfigError(f"{field}.{key}", f"unknown option{suggest(str(key), names)}; "
                                                       f"options of plugin '{plugin}': {', '.join(names)}")
            given[plugin] = dict(values)
        for key, opt in self.legacy_keys.items():
            if key not in data:
                continue
            new_field = f"plugins.{opt.owner}.{opt.name}"
            value = opt.check(data[key], key)
            if opt.name in given.get(opt.owner, {}) and given[opt.owner][opt.name] != value:
                raise ConfigError(key, f"{key}: {value!r} disagrees with {new_field}: "
                                       f"{given[opt.owner][opt.name]!r}; keep only {new_field}")
            given.setdefault(opt.owner, {})[opt.name] = value
        out, implicit = [], []
        for plugin in sorted(self.plugins):
            values = given.get(plugin, {})
            implicit += [f"{plugin}.{o.name}" for o in self.of(plugin) if o.name not in values]
            out.append((plugin, tuple(sorted(
                (o.name, o.check(values[o.name], f"plugins.{plugin}.{o.name}") if o.name in values else o.default)
                for o in self.of(plugin)))))
        return tuple(out), tuple(sorted(implicit))


def collect_options(hooks) -> OptionRegistry:
    """Ask every plugin to declare its options; duplicates and bad declarations name the plugin."""
    found: dict[tuple[str, str], PluginOption] = {}
    legacy: dict[str, str] = {}

    def record(plugin: str, option: PluginOption) -> None:
        if not isinstance(option, PluginOption):
            raise PluginError(plugin, f"g5_register_options: expected a PluginOption, got {option!r}")
        if plugin in RESERVED:
            raise PluginError(plugin, f"a plugin named {plugin!r} cannot declare options (plugins.{plugin} is the core's)")
        if (plugin, option.name) in found:
            raise PluginError(plugin, f"option '{option.name}' is declared twice")
        if option.legacy_key:
            if option.legacy_key in legacy:
                raise PluginError(plugin, f"legacy key '{option.legacy_key}' is already claimed by plugin "
                                          f"'{legacy[option.legacy_key]}'")
            legacy[option.legacy_key] = plugin
        found[(plugin, option.name)] = attrs.evolve(option, owner=plugin)

    hooks.call_registration("g5_register_options", record)
    return OptionRegistry(tuple(found[k] for k in sorted(found)))


def option_value(options: tuple, plugin: str, name: str, default: Optional[Any] = None) -> Any:
    """The value of ``plugins.<plugin>.<name>`` in resolved options; ``default`` when the
    plugin is not enabled (it declared nothing)."""
    for owner, values in options:
        if owner == plugin:
            return dict(values)[name]
    return default
