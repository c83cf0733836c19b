"""``g5 best CONFIG --serve``'s flags to a serving search (the CLI adapter; the CLI prints the
result)."""
from __future__ import annotations

import os
import sys
from typing import Mapping, Optional

from g5core.api.errors import ConfigError
from g5core.inputs.serving import TRACE_SUFFIXES, split_config, workload_spec
from g5core.inputs.speculative import search_blocks
from g5core.study.serving.driver import serve_search
from g5core.study.serving.result import ServeSearchResult
from g5core.study.serving.space import (DEFAULT_BEAM, DEFAULT_CHUNKS, DEFAULT_CONFIRM, DEFAULT_MAX_RATE,
                                        DEFAULT_REQUESTS, DEFAULT_TOLERANCE, DEFAULT_TOP, SERVE_OBJECTIVES, SETTLE,
                                        SearchSettings, freeze_block)
from g5core.study.sweep import default_progress


def best_serve_command(raw: Mapping, config_path, disabled, objective, db_path, workers: int, executor: str, *,
                       disagg: str, workload=None, requests=None, isl=None, osl=None, slo=None, seed=None, rate=None,
                       chunks=None, seqs=None, tolerance=None, max_rate=None, beam=None, vary=None, settle=None,
                       confirm=None, top=DEFAULT_TOP, max_steps=None, decode_system=None,
                       speculative=None) -> ServeSearchResult:
    """``g5 best CONFIG --serve``'s flags to a search (the CLI prints its result)."""
    if objective is not None and objective not in SERVE_OBJECTIVES:
        raise ConfigError("--objective", f"{objective} ranks single-batch layouts; with --serve use "
                                         f"{', '.join(SERVE_OBJECTIVES)}")
    _, block = split_config(raw)
    base_wl = dict(block.get("workload") or {})
    if rate is not None and objective != "min_chips":
        raise ConfigError("--rate", "the search finds the rate (the capacity); --rate is the min_chips objective's")
    # the flags over the configuration's workload; the search sets each run's rate itself
    if requests is None and "requests" not in base_wl and not (workload or "").lower().endswith(TRACE_SUFFIXES):
        requests = DEFAULT_REQUESTS     # the documented default (--help, the README)
    spec = workload_spec(base_wl, workload, requests, _placeholder_rate(base_wl, workload), None, isl, osl, seed)
    slo = slo if slo is not None else block.get("slo")
    if isinstance(slo, Mapping):
        slo = ",".join(f"{k}={v}" for k, v in slo.items())
    if not slo:
        raise ConfigError("--slo", "the serving search needs SLO limits, e.g. --slo ttft_p90=2s,tpot_p90=50ms")
    settings = SearchSettings(
        slo=slo, objective=objective or "goodput_per_chip", disagg=disagg,
        chunks=tuple(chunks) if chunks else DEFAULT_CHUNKS, seqs=tuple(seqs) if seqs else None,
        tolerance=DEFAULT_TOLERANCE if tolerance is None else tolerance,
        max_rate=DEFAULT_MAX_RATE if max_rate is None else max_rate, beam=DEFAULT_BEAM if beam is None else beam,
        rate=rate, vary=tuple(v.strip() for v in vary.split(",") if v.strip()) if vary else None,
        settle=SETTLE if settle is None else settle, confirm=DEFAULT_CONFIRM if confirm is None else confirm,
        top=top, decode_system=decode_system,
        speculative=None if speculative is None else tuple(
            freeze_block(b) for b in search_blocks(speculative, raw.get("speculative"))))
    progress = default_progress()
    cpus = usable_cpus()
    if executor == "local" and workers == 1 and cpus > 1:
        # the search's answer does not depend on its workers (driver.WAVE), its time does
        progress = _NoticeFirst(progress, f"serving search on 1 worker process; this machine lets G5 use {cpus} "
                                          f"CPUs: --workers {cpus} runs the search's cells in parallel (the same "
                                          "answer)")
    return serve_search(raw, spec, settings, db_path=db_path, disabled=disabled, workers=workers,
                        executor=executor, progress=progress, inputs=[config_path], max_work=max_steps)


def _placeholder_rate(base_wl: Mapping, workload) -> Optional[float]:
    """1.0 where an open-loop arrival names no rate (the search sets every run's own; ``g5
    best --serve --workload gamma:cv=2`` was refused for the missing rate), else None (a
    trace, a closed loop, a rate given)."""
    if workload:
        if workload.lower().endswith(TRACE_SUFFIXES):
            return None
        kind, _, rest = workload.partition(":")
        given = any(part.partition("=")[0] == "rate" for part in rest.split(","))
    else:
        arrival = base_wl.get("arrival") or {}
        if not isinstance(arrival, Mapping):
            return None     # the configuration's own error, from workload_spec
        kind, given = arrival.get("kind", "poisson"), "rate_per_s" in arrival
    return 1.0 if kind in ("poisson", "gamma") and not given else None


class _NoticeFirst:
    """A progress that prints ``notice`` on stderr when the search starts its work (its
    inputs checked: a bad input stays a one-line error), then is ``inner``."""

    def __init__(self, inner, notice: str):
        self._inner, self._notice = inner, notice

    def start(self, total) -> None:
        if self._notice:
            print(self._notice, file=sys.stderr, flush=True)
            self._notice = ""
        self._inner.start(total)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the platform tells it)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)

