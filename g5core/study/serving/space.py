"""The serving search's space: its settings, the candidates (pools of layouts, scheduler
limits) and their configurations, the workload it varies the rate of, and the run lengths."""
from __future__ import annotations

import math
from typing import Mapping, Optional

import attrs
import numpy as np

from g5core.api.errors import ConfigError
from g5core.inputs.kv_tiers import tier_defaults
from g5core.inputs.models import get_model
from g5core.inputs.serving import WorkloadSpec, check_pool_system
from g5core.inputs.systems import get_system
from g5core.study.search import divisors, enumerate_layouts
from g5core.serve.workload import requests_of, synthetic


SERVE_OBJECTIVES = ("goodput_per_chip", "throughput_per_chip", "min_chips")
DISAGG_MODES = ("off", "on", "auto")
DEFAULT_CHUNKS = (2048, 8192)
DEFAULT_MIN_SEQS = 8
DEFAULT_TOLERANCE = 0.05
DEFAULT_MAX_RATE = 1000.0
DEFAULT_BEAM = None        # every prefill and decode layout pair (the branch and bound bounds them)


#: a run at a rate uses at least this many requests (``--requests``; p90 from 300 samples is
#: the 270th) and at least ``SETTLE`` times the requests in the system at that rate when the
#: SLO holds (``rate x (TTFT limit + mean output tokens x TPOT limit)``), so the queue
#: reaches its steady state for most of the run; at most ``MAX_RUN_REQUESTS``
DEFAULT_REQUESTS = 300


SETTLE = 16
MAX_RUN_REQUESTS = 20000
#: seeds besides the workload's on which the capacity found must hold too (else it steps
#: down by the tolerance): a finite run's percentile near the knee varies with the seed
DEFAULT_CONFIRM = 2


DEFAULT_TOP = 5
#: whether the search tries instances of attention data-parallel ranks with the experts over
#: ep (:func:`attention_dp_layout`) for MoE models (the serving loop's attention-DP pools:
#: g5core.serve.cost.DpCost, g5core.serve.scheduler.DpScheduler)
ATTENTION_DP = True


@attrs.frozen
class SearchSettings:
    slo: str
    objective: str = "goodput_per_chip"
    disagg: str = "off"
    chunks: tuple[int, ...] = DEFAULT_CHUNKS
    min_seqs: int = DEFAULT_MIN_SEQS
    seqs: Optional[tuple[int, ...]] = None     # max_num_seqs values instead of the powers of two
    tolerance: float = DEFAULT_TOLERANCE
    max_rate: float = DEFAULT_MAX_RATE
    beam: Optional[int] = DEFAULT_BEAM         # only the best this many layouts of each role pair up
    rate: Optional[float] = None               # min_chips: the rate to serve
    vary: Optional[tuple[str, ...]] = None     # only these dimensions vary (the others stay 1)
    settle: float = SETTLE                     # runs hold this many times the requests in the system
    confirm: int = DEFAULT_CONFIRM             # further seeds the capacity must hold on
    top: int = DEFAULT_TOP                     # the ranking is exact down to this place, up to the tolerance (bound.bar_value)
    bound: bool = True                         # False: simulate every candidate (no branch and bound)
    decode_system: Optional[str] = None        # the disaggregated candidates' decode pools' system
    #: the speculative: blocks to try (:func:`freeze_block` each, ``()`` plain decode), every
    #: one a candidate of its own; None: the configuration's (its block, or plain decode)
    speculative: Optional[tuple] = None

    def check(self) -> None:
        if self.objective not in SERVE_OBJECTIVES:
            raise ConfigError("--objective", f"unknown serving objective {self.objective!r}; use "
                                             f"{', '.join(SERVE_OBJECTIVES)}")
        if self.disagg not in DISAGG_MODES:
            raise ConfigError("--disagg", f"must be one of {', '.join(DISAGG_MODES)}, got {self.disagg!r}")
        if self.objective == "min_chips" and self.rate is None:
            raise ConfigError("--rate", "the min_chips objective needs the rate to serve (--rate R)")
        if self.rate is not None and not 0 < self.rate < math.inf:
            raise ConfigError("--rate", f"must be a positive number of requests per second, got {self.rate!r}")
        if not 0 < self.tolerance < 1:
            raise ConfigError("--tolerance", f"must lie between 0 and 1, got {self.tolerance!r}")
        if not 0 < self.max_rate < math.inf:
            raise ConfigError("--max-rate", f"must be a positive number, got {self.max_rate!r}")
        if self.rate is not None and self.rate > self.max_rate:
            raise ConfigError("--rate", f"{self.rate:g} is above the rate ceiling --max-rate {self.max_rate:g}")
        for name, values in (("--chunks", self.chunks), ("--seqs", self.seqs or (1,))):
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise ConfigError(name, f"must be positive whole numbers, got {values!r}")
        if not self.settle > 0:
            raise ConfigError("--settle", f"must be a positive number, got {self.settle!r}")
        if isinstance(self.confirm, bool) or not isinstance(self.confirm, int) or self.confirm < 0:
            raise ConfigError("--confirm", f"must be 0 or more further seeds (a whole number), got {self.confirm!r}")
        if self.beam is not None and self.beam < 1:
            raise ConfigError("--beam", f"must be a positive whole number, got {self.beam!r}")
        if isinstance(self.top, bool) or not isinstance(self.top, int) or self.top < 1:
            raise ConfigError("--top", f"must be a positive whole number, got {self.top!r}")
        if self.decode_system is not None:
            if self.disagg == "off":
                raise ConfigError("--decode-system", "places the disaggregated candidates' decode pools, and --disagg "
                                                     "off has none: give --disagg on or auto")
            check_pool_system(self.decode_system, "--decode-system")
        if self.speculative is not None and not self.speculative:
            raise ConfigError("--speculative", "is empty: give off, METHOD:K or K (e.g. off,eagle:1,eagle:3)")


@attrs.frozen
class PoolChoice:
    """One pool of a candidate: ``instances`` copies of ``parallel`` on ``chips`` chips each,
    on ``system`` (None: the configuration's; ``--decode-system``: a decode pool's own)."""
    chips: int
    parallel: tuple          # sorted (dimension, size) pairs
    instances: int
    system: Optional[str] = None

    @property
    def layout(self) -> dict:
        return dict(self.parallel)

    def label(self) -> str:
        return f"{self.instances} x [{short_label(self.layout)}]" + (f" on {self.system}" if self.system else "")


def freeze_block(block: Optional[Mapping]) -> tuple:
    """A ``speculative:`` block as a candidate holds it: its ``(key, value)`` pairs sorted,
    lists as tuples (hashable, one spelling per block); ``()`` for none (plain decode)."""
    if not block:
        return ()
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in block.items()))


def thaw_block(frozen: tuple) -> Optional[dict]:
    """The configuration's ``speculative:`` block of :func:`freeze_block`'s pairs (None: plain decode)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in frozen} if frozen else None


def speculative_label(frozen: tuple) -> str:
    """``eagle:3`` (method and draft tokens), ``off`` for plain decode."""
    if not frozen:
        return "off"
    block = dict(frozen)
    return f"{block['method']}:{block['tokens']}"


@attrs.frozen
class Candidate:
    pools: tuple[PoolChoice, ...]   # one (aggregated) or prefill then decode
    max_num_seqs: int
    chunk: int
    speculative: tuple = ()         # its speculative: block (freeze_block), () plain decode
    #: the host KV tier it runs with (:func:`host_tier_variants`): None, not varied (the
    #: configuration's serving block as it is); 0.0, the block cache in HBM alone; else
    #: ``serving.kv_tiers: [{kind: host, bytes_per_chip: this}]``
    host_tier_bytes_per_chip: Optional[float] = None
    #: ``plugins.cp.prefill`` it runs with (:func:`cp_prefill_choice`); None: the configuration's
    cp_prefill: Optional[str] = None

    @property
    def disaggregated(self) -> bool:
        return len(self.pools) == 2

    @property
    def chips(self) -> int:
        return sum(p.chips * p.instances for p in self.pools)

    def label(self, speculative: bool = True) -> str:
        """The deployment in words; with ``speculative`` (and a block) its method and drafts too."""
        pools = " + ".join(("prefill " if i == 0 else "decode ") * self.disaggregated + p.label()
                           for i, p in enumerate(self.pools))
        spec = f", speculative {speculative_label(self.speculative)}" if speculative and self.speculative else ""
        tier = "" if self.host_tier_bytes_per_chip is None else f", host tier {host_tier_label(self.host_tier_bytes_per_chip)}"
        cp = f", cp prefill {self.cp_prefill}" if self.cp_prefill else ""
        return f"{pools}, max_num_seqs={self.max_num_seqs}, chunk={self.chunk}{spec}{tier}{cp}"


@attrs.frozen
class Pruned:
    parallel: dict
    chips: int
    chunk: int
    family: str
    reason: str
    speculative: tuple = ()         # the speculative: block it was screened with (freeze_block)


def short_label(parallel: Mapping) -> str:
    """``tp=4 cp=2``: the dimensions above 1 (``tp=1`` when none is)."""
    return " ".join(f"{k}={v}" for k, v in sorted(parallel.items()) if v != 1) or "tp=1"


def _layout_config(base: Mapping, chips: int, parallel: Mapping) -> dict:
    out = {k: v for k, v in base.items() if k != "serving"}
    out["chips"] = chips
    out["parallel"] = dict(parallel)
    return out


def candidate_config(base: Mapping, cand: Candidate, workload: Mapping, slo: str, rate: Optional[float]) -> dict:
    """The complete configuration of a candidate, as ``g5 serve`` takes it (``rate``: the
    workload's arrival rate, e.g. the capacity)."""
    block = dict(base.get("serving") or {})
    for key in ("instances", "disaggregation"):
        block.pop(key, None)
    sched = {**dict(block.get("scheduler") or {}), "max_num_seqs": cand.max_num_seqs,
             "max_num_batched_tokens": cand.chunk, "chunked_prefill": True}
    block["scheduler"] = sched
    block["slo"] = slo
    block["workload"] = _at_rate(workload, rate) if rate is not None else dict(workload)
    first = cand.pools[0]
    out = _layout_config(base, first.chips, first.layout)
    out.pop("speculative", None)
    if cand.speculative:
        out["speculative"] = thaw_block(cand.speculative)
    if cand.disaggregated:
        block["disaggregation"] = {role: {"instances": p.instances, "chips": p.chips, "parallel": p.layout,
                                          **({"system": p.system} if p.system else {})}
                                   for role, p in zip(("prefill", "decode"), cand.pools)}
    else:
        block["instances"] = first.instances
    if cand.host_tier_bytes_per_chip is not None:
        block["prefix_cache"] = dict(block.get("prefix_cache") or {})
        block.pop("kv_tiers", None)
        if cand.host_tier_bytes_per_chip > 0:
            block["kv_tiers"] = [{"kind": "host", "bytes_per_chip": cand.host_tier_bytes_per_chip}]
    if cand.cp_prefill is not None:
        plugins = dict(out.get("plugins") or {})
        plugins["cp"] = {**dict(plugins.get("cp") or {}), "prefill": cand.cp_prefill}
        out["plugins"] = plugins
    out["serving"] = block
    return out


def _at_rate(workload: Mapping, rate: float) -> dict:
    arrival = dict(workload.get("arrival") or {})
    arrival["kind"] = arrival.get("kind", "poisson")
    arrival["rate_per_s"] = float(rate)
    return {**dict(workload), "arrival": arrival}


def check_workload(workload: Optional[Mapping]) -> dict:
    if not workload:
        raise ConfigError("--isl", "the serving search needs a synthetic workload: give --isl and --osl (or "
                                   "serving.workload in the configuration)")
    if "trace" in workload:
        raise ConfigError("--workload", "the serving search varies the arrival rate of a synthetic workload; a "
                                        "trace has its own arrival times: give --isl and --osl instead")
    kind = (workload.get("arrival") or {}).get("kind", "poisson")
    if kind not in ("poisson", "gamma"):
        raise ConfigError("--workload", f"the serving search varies an open-loop arrival rate; {kind!r} has none: "
                                        "use poisson or gamma:cv=C")
    out = dict(workload)
    for key, flag in (("input_tokens", "--isl"), ("output_tokens", "--osl")):
        if key not in workload:
            raise ConfigError(flag, f"the serving search needs {flag} (or serving.workload.{key})")
        if isinstance(out[key], str) and out[key].strip().isdigit():
            out[key] = int(out[key])
    out.setdefault("requests", DEFAULT_REQUESTS)
    out.setdefault("seed", 0)
    arrival = dict(out.get("arrival") or {"kind": "poisson"})
    arrival.setdefault("rate_per_s", 1.0)   # a placeholder: every run sets its own rate
    out["arrival"] = arrival
    # its values checked before any cell (a run makes its requests as synthetic does), each
    # error named as the flag that gave the value (g5 best --serve's WorkloadSpec)
    try:
        requests_of(out)
        synthetic({**out, "requests": 1})
    except ConfigError as exc:
        raise (workload.named(exc) if isinstance(workload, WorkloadSpec) else exc) from None
    return out


def run_requests(workload: Mapping, rate: float, settle_s: float, settle: float = SETTLE) -> int:
    """Requests of the run at ``rate`` (see ``SETTLE``)."""
    want = settle * rate * settle_s   # inf (or nan) at an extreme rate: MAX_RUN_REQUESTS, not an OverflowError
    return int(max(workload["requests"], math.ceil(want) if want < MAX_RUN_REQUESTS else MAX_RUN_REQUESTS))


def _pow2_seqs(capacity_tokens: int, longest: int, settings: SearchSettings) -> list[int]:
    if settings.seqs is not None:
        return sorted(set(settings.seqs))
    holds = max(capacity_tokens // max(longest, 1), 1)
    out, m = [], 1
    while True:
        if m >= settings.min_seqs or m >= holds:
            out.append(m)
        if m >= holds:
            return out
        m *= 2


def _mean_lengths(workload: Mapping) -> tuple[float, float]:
    """The workload's mean prompt and output tokens."""
    reqs = synthetic(workload).requests
    return sum(r.input_tokens for r in reqs) / len(reqs), sum(r.output_tokens for r in reqs) / len(reqs)


def _longest(workload: Mapping) -> int:

    return max(r.input_tokens + r.output_tokens for r in synthetic(workload).requests)


def _longest_output(workload: Mapping) -> int:

    return max(r.output_tokens for r in synthetic(workload).requests)


def _shortest_output(workload: Mapping) -> int:
    return min(r.output_tokens for r in synthetic(workload).requests)



def instance_layouts(chips: int, dims, vary: Optional[tuple] = None, moe: bool = False,
                     attention_dp: bool = ATTENTION_DP) -> list[tuple[int, dict]]:
    """Every ``(chips per instance, layout)`` of the search: the layouts of each ``c``
    dividing ``chips`` over the registered dimensions (``vary``: only those vary), ``dp`` 1
    (the instances are the data-parallel copies), and with ``attention_dp`` for a MoE model
    also the attention-DP layouts (:func:`attention_dp_layout`)."""
    out = []
    for c in divisors(chips):
        for par in enumerate_layouts(c, dims):
            if par.get("dp", 1) != 1 and not (attention_dp and moe and attention_dp_layout(par)):
                continue
            if vary is not None and any(v != 1 for k, v in par.items() if k not in vary):
                continue
            out.append((c, par))
    return out


def attention_dp_layout(par: Mapping) -> bool:
    """An instance of ``dp`` attention data-parallel ranks (each its own batch and KV pool)
    of ``tp`` x ``sp`` chips each, the experts over ``ep = dp x sp x tp`` (every EP group
    spans every attention-DP rank, one per pipeline stage): SGLang's
    ``--enable-dp-attention`` with ``--ep-size``, TensorRT-LLM's attention DP. ``dp > 1``
    only; cp stays 1 (the ranks split requests, not a sequence)."""
    dp = par.get("dp", 1)
    return dp > 1 and par.get("cp", 1) == 1 and par.get("ep", 1) == dp * par.get("sp", 1) * par.get("tp", 1)


def is_moe(raw: Mapping) -> bool:
    """Whether the configuration's model has experts (a name or a path; inline models: no)."""
    model = raw.get("model")
    return isinstance(model, str) and get_model(model).moe is not None


# ------------------------------------------------------------------ the KV tier and cp for long prompts
#: the host tier sizes a search tries when the workload reuses prefixes, as shares of the
#: system's default host tier (``g5core/data/kv_tiers.yaml``); 0: no host tier (the block
#: cache in HBM alone). The shares are the design of issue 34's search (a halving ladder
#: from the whole default down to an eighth), not a measured optimum
HOST_TIER_SHARES = (0.0, 0.125, 0.25, 0.5, 1.0)
#: a workload whose p90 prompt is over this many tokens has long prompts: its cp > 1
#: candidates run CP prefill with ``auto`` (the Meta CP paper's rule, arXiv:2411.01783
#: Algorithm 5, picking pass-KV or pass-Q per step from the new and cached tokens); 32K is
#: issue 34's design threshold for "long context", an assumption
LONG_PROMPT_TOKENS = 32768


def host_tier_label(bytes_per_chip: float) -> str:
    """``none`` or the size per chip in GiB (``32 GiB``)."""
    return "none" if not bytes_per_chip else f"{bytes_per_chip / 2 ** 30:.4g} GiB"


def reuses_prefixes(workload: Mapping) -> bool:
    """Whether the workload's requests share prompt blocks (a shared prefix or a
    conversation's history), the ones a prefix cache and its tiers serve."""
    return any(r.prefix or r.history is not None for r in synthetic(workload).requests)


def host_tier_variants(raw: Mapping, workload: Mapping) -> tuple[Optional[float], ...]:
    """The host tier sizes the candidates run with: ``HOST_TIER_SHARES`` of the system's
    default host tier when the workload reuses prefixes, the configuration gives no
    ``serving.kv_tiers`` of its own and its system has a default host tier; else
    ``(None,)``, the configuration's serving block as it is."""
    block = raw.get("serving") or {}
    if "kv_tiers" in block or not reuses_prefixes(workload):
        return (None,)
    host = tier_defaults()["systems"].get(get_system(raw["system"]).name, {}).get("host")
    if not host:
        return (None,)
    return tuple(share * float(host["bytes_per_chip"]) for share in HOST_TIER_SHARES)


def p90_prompt_tokens(workload: Mapping) -> float:
    """The 90th percentile of the workload's prompt tokens (numpy's linear interpolation)."""
    return float(np.percentile([r.input_tokens for r in synthetic(workload).requests], 90))


def cp_prefill_choice(raw: Mapping, workload: Mapping) -> Optional[str]:
    """``auto`` for the cp > 1 candidates when the p90 prompt is over ``LONG_PROMPT_TOKENS``
    and the configuration does not set ``plugins.cp.prefill`` itself; else None."""
    own = ((raw.get("plugins") or {}).get("cp") or {}).get("prefill")
    if own is not None or p90_prompt_tokens(workload) <= LONG_PROMPT_TOKENS:
        return None
    return "auto"


def vary_cache(cands: list, roles_bound: dict, screens: dict, tiers: tuple, cp_prefill: Optional[str]) -> list:
    """Each candidate once per host tier size in ``tiers`` (``roles_bound`` and ``screens``,
    by candidate index, follow it), its cp > 1 ones with ``cp_prefill``. Returns the new
    ``(candidate, start)`` list; the two dicts are rewritten in place."""
    if tiers == (None,) and cp_prefill is None:
        return cands
    out, bound, scr = [], {}, {}
    for i, (cand, start) in enumerate(cands):
        cp = cp_prefill if any(p.layout.get("cp", 1) > 1 for p in cand.pools) else None
        for tier in tiers:
            bound[len(out)], scr[len(out)] = roles_bound[i], screens[i]
            out.append((attrs.evolve(cand, host_tier_bytes_per_chip=tier, cp_prefill=cp), start))
    roles_bound.clear()
    roles_bound.update(bound)
    screens.clear()
    screens.update(scr)
    return out
