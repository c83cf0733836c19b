"""``g5 best CONFIG --serve``'s flags to a serving search (the CLI adapter; the CLI prints the
result)."""
from __future__ import annotations

import math
import os
import pathlib
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


def best_serve_command(raw: Mapping, config_path, disabled, objective, db_path, workers: Optional[int],
                       executor: str, *, disagg: str, workload=None, requests=None, isl=None, osl=None, slo=None,
                       seed=None, rate=None, chunks=None, seqs=None, tolerance=None, max_rate=None, beam=None,
                       vary=None, settle=None, confirm=None, top=DEFAULT_TOP, max_steps=None, decode_system=None,
                       speculative=None) -> ServeSearchResult:
    """``g5 best CONFIG --serve``'s flags to a search (the CLI prints its result); ``workers``
    None: :func:`default_workers`."""
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
    return serve_search(raw, spec, settings, db_path=db_path, disabled=disabled,
                        workers=default_workers() if workers is None else workers, executor=executor,
                        progress=default_progress(), inputs=[config_path], max_work=max_steps)


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


#: the serving search's worker processes by default, at most: each worker keeps caches of its
#: own (the Qwen3-235B search peaks at 784 MB in one process), so a many-core machine is not
#: filled with them unasked (``--workers N`` sets any number)
DEFAULT_WORKERS_MAX = 4

#: where a container's CPU quota is read (cgroup v2, then v1), as joblib's loky reads it
CGROUP_ROOT = "/sys/fs/cgroup"


def default_workers() -> int:
    """``g5 best --serve``'s worker processes when ``--workers`` is not given: the CPUs this
    process may use (:func:`usable_cpus`), at most :data:`DEFAULT_WORKERS_MAX`. The search's
    answer does not depend on it (the waves are fixed: driver.WAVE), its time does."""
    return max(1, min(usable_cpus(), DEFAULT_WORKERS_MAX))


def usable_cpus(cgroup_root: str = CGROUP_ROOT) -> int:
    """The CPUs this process may run on: its affinity where the platform tells it, at most its
    container's CPU quota rounded up (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us``; no quota: the affinity)."""
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    quota = cpu_quota(cgroup_root)
    return max(1, min(cpus, math.ceil(quota))) if quota is not None else cpus


def cpu_quota(cgroup_root: str = CGROUP_ROOT) -> Optional[float]:
    """The CPUs a container's quota allows (quota over period), None where there is none or
    the files cannot be read."""
    root = pathlib.Path(cgroup_root)
    try:
        text = (root / "cpu.max").read_text().split()
        quota, period = text[0], text[1]
    except (OSError, IndexError):
        try:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    try:
        q, p = float(quota), float(period)
    except ValueError:      # "max": no quota
        return None
    return q / p if q > 0 and p > 0 else None

