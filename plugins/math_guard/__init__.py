"""Refuses context parallelism on the Math path (spec v1.1.1).

The closed-form path has no validated CP formula; a silent wrong number is worse than an
error, so ``cp > 1`` with ``path: math`` is a configuration error.
"""
from __future__ import annotations

from g5core import ConfigError, hookimpl


@hookimpl
def g5_validate_deployment(deployment, model, system):
    cp = deployment.size("cp")
    if deployment.path == "math" and cp > 1:
        raise ConfigError("path", f"cp={cp} is not supported on the Math path (it has no validated CP formula); "
                                  "use path: g5 for context parallelism, or set parallel.cp: 1")
