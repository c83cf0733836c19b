"""Errors G5 raises on purpose. Each carries a one-line message meant for a person."""
from __future__ import annotations

import difflib
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


class ConservationError(G5Error):
    """An engine invariant did not hold after a run; carries the KPIs."""

    def __init__(self, kpis: dict, message: str):
        self.kpis = dict(kpis)
        super().__init__(message)


def suggest(name: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' for the closest choice, or '' when none is close."""
    close = difflib.get_close_matches(str(name), sorted(choices), n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""
