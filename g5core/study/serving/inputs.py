"""The serving search's inputs, checked before any cell runs: the settings, the workload, the
SLO, the chips, the plugins and dimensions, the speculative: blocks."""
from __future__ import annotations

from typing import Mapping

from g5core.api.dimensions import collect_dimensions
from g5core.api.errors import ConfigError
from g5core.api.plugins import Hooks, make_plugin_manager
from g5core.inputs.config import disabled_from_config
from g5core.inputs.serving import parse_slo
from g5core.inputs.speculative import parse_speculative
from g5core.study.serving.space import SearchSettings, check_workload, freeze_block
from g5core.study.sweep import LocalExecutor, make_executor


def checked_inputs(raw: Mapping, workload: Mapping, settings: SearchSettings, disabled, executor: str, workers: int,
                   runner_for) -> tuple:
    """``(workload, SLO limits, chips, disabled plugin names, dimensions, speculative blocks)``
    of a search, each checked (a bad one raises ConfigError naming its field)."""
    settings.check()
    workload = check_workload(workload)
    limits = parse_slo(settings.slo)
    if not limits:
        raise ConfigError("--slo", "the serving search needs SLO limits, e.g. --slo ttft_p90=2s,tpot_p90=50ms")
    chips = raw.get("chips")
    if isinstance(chips, bool) or not isinstance(chips, int) or chips <= 0:
        raise ConfigError("chips", f"must be a positive whole number, got {chips!r}")
    exe = make_executor(executor, workers)
    if runner_for is not None and not (isinstance(exe, LocalExecutor) and workers == 1):
        raise ConfigError("runner", "a custom runner needs the in-process executor (local, one worker)")
    names = tuple(dict.fromkeys(tuple(disabled) + tuple(disabled_from_config(raw))))
    dims = collect_dimensions(Hooks(make_plugin_manager(disabled=names)))
    if settings.vary is not None:
        unknown = [d for d in settings.vary if d not in dims.names]
        if unknown:
            raise ConfigError("--vary", f"unknown dimension {unknown[0]!r}; known: {', '.join(dims.names)}")
    # the speculative: blocks tried (each a candidate of its own), off the base configuration
    if settings.speculative is None:
        parse_speculative(raw)      # the configuration's block, checked before any cell
    variants = (settings.speculative if settings.speculative is not None
                else (freeze_block(raw.get("speculative")),))
    return workload, limits, chips, names, dims, variants
