"""Errors G5 raises on purpose. Each carries a one-line message meant for a person."""
from __future__ import annotations

import difflib
import re
from typing import Iterable


class G5Error(Exception):
    """Base of every error G5 reports to the user (exit status 2, no traceback)."""


class ConfigError(G5Error):
    """A deployment, model or system file is wrong; the message names the field and the fix."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


class PluginError(G5Error):
    """A plugin failed to load, registered something invalid, or raised inside a hook."""

    def __init__(self, plugin: str, message: str):
        self.plugin = plugin
        super().__init__(f"plugin '{plugin}': {message}")


class DagError(G5Error):
    """The op DAG a plugin built is invalid (cycle, unplaced op, unlowered comm op)."""


class ResourceError(G5Error):
    """A run would need more ops, memory or time than the limit allows (``--max-ops``)."""


class ConservationError(G5Error):
    """An engine invariant did not hold after a run; carries the KPIs."""

    def __init__(self, kpis: dict, message: str):
        self.kpis = dict(kpis)
        super().__init__(message)


def _tokens(text: str) -> list[str]:
    return [t for t in re.split(r"[^0-9a-z]+", text.lower()) if t]


def _squash(text: str) -> str:
    return "".join(_tokens(text))


def closest(name: str, choices: Iterable[str]) -> list[str]:
    """The choices a person most likely meant by ``name`` (empty when none is close).

    In order: the same name ignoring case and punctuation (``llama3.1-8b``); the choices
    that start with it (``h100`` -> ``h100-sxm``); the choices holding all of its parts
    (``llama-70b`` -> ``llama-3.1-70b``); then the closest spelling (``tpp`` -> ``tp``)."""
    name = str(name)
    options = sorted(set(map(str, choices)))
    key = _squash(name)
    if not key:
        return []
    same = [c for c in options if _squash(c) == key]
    if same:
        return same[:1]
    prefixed = [c for c in options if _squash(c).startswith(key)]
    if prefixed:
        return prefixed
    parts = _tokens(name)
    family = [c for c in options if all(any(t.startswith(p) for t in _tokens(c)) for p in parts)]
    if family:
        return family
    return difflib.get_close_matches(name, options, n=1, cutoff=0.5)


def suggest(name: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' for the likely choices (see :func:`closest`), or ''."""
    best = closest(name, choices)
    if not best or len(best) > 4:
        return ""
    if len(best) == 1:
        return f" (did you mean '{best[0]}'?)"
    return f" (did you mean one of {', '.join(repr(b) for b in best)}?)"
