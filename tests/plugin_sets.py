"""The built-in plugins versus third-party ones installed in the same environment.

Tests of the core's built-in behaviour (which dimensions exist, the rank order) run with the
third-party plugins disabled, so installing one (contrib/g5-ulysses) changes none of them.
"""
from __future__ import annotations

import importlib.metadata

from g5core.api.plugins import ENTRY_POINT_GROUP, available_plugin_names, make_plugin_manager

BUILTIN = tuple(sorted({ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
                        if ep.value.startswith("g5plugins.")}))
THIRD_PARTY = tuple(n for n in available_plugin_names() if n not in BUILTIN)


def builtin_plugin_manager(disabled=(), **kwargs):
    return make_plugin_manager(disabled=tuple(disabled) + THIRD_PARTY, **kwargs)
