"""Serving search (``g5 best CONFIG --serve``): on these chips, for this traffic, within these
SLO limits, which deployment serves the most?

1. **Layouts.** Every layout of every per-instance chip count ``c`` dividing ``chips``
   (:func:`g5core.study.search.enumerate_layouts` over the registered dimensions, cp and sp
   included; ``dp`` stays 1 inside an instance: the instances are the data-parallel copies),
   each with every chunk size (``max_num_batched_tokens``) of ``chunks``.
   With ``speculative`` (``--speculative off,eagle:1,eagle:3``) every layout, and every
   candidate after it, is tried once per ``speculative:`` block (:class:`Candidate`'s
   ``speculative``; plain decode is ``()``), its acceptance the configuration's block's or
   the method's published default (:func:`g5core.inputs.speculative.draft_block`).
2. **Screening** (one cell per layout and chunk size, before any rate is tried): the
   plugins' refusals, the KV pool (the ledger's pool must hold the longest request), and
   one request alone on an idle instance: its TTFT is the lone prefill (every chunk), its
   TPOT the lone decode at the growing context. A layout whose lone prefill misses a TTFT
   limit, whose lone decode misses a TPOT limit, or whose lone request misses an e2e limit
   can meet it at no rate (a loaded instance only adds work to a step; a speculative
   layout's TPOT there is its floor, every draft kept), so it is pruned,
   with its reason, grouped by family; a disaggregated pair whose lone prefill plus lone
   decode misses an e2e limit is not a candidate.
3. **Candidates.** Aggregated: ``chips / c`` instances of a kept layout, with
   ``max_num_seqs`` over the powers of two from ``min_seqs`` up to the first that the KV pool
   cannot hold with every sequence at its longest (the pool caps the batch beyond it).
   Disaggregated (``--disagg on|auto``): a prefill pool and a decode pool of kept layouts
   (a prefill layout must meet the TTFT screen, a decode layout the TPOT one) with
   ``n_p c_p + n_d c_d = chips``, every pair of layouts (``--beam N`` keeps only the ``N``
   best of each role by their lone step: a heuristic cut, reported as such). The screen is
   the aggregated one: a layout whose pool cannot hold a whole request is out of both
   roles, even though a prefill pool only needs the prompt.
   With ``--decode-system NAME`` (heterogeneous disaggregation, aiconfigurator's
   ``--decode-system``) every layout is screened a second time on that system and the
   decode role's layouts are those (their KV pool and lone TPOT on it), while the prefill
   role's and the aggregated candidates' stay on the configuration's system; a
   disaggregated candidate's decode pool names the system (its ``system:``). The chips stay
   one budget, ``n_p c_p + n_d c_d = chips`` whatever each chip is, and the per-chip
   objectives count every chip alike: aiconfigurator's convention (one ``--total-gpus``;
   ``num_total_gpus = prefill GPUs + decode GPUs`` and tokens/s/gpu over that sum, in its
   ``sdk/picking.py``), so no separate decode chip count.
4. **Bounds.** Each candidate gets a saturated throughput ``mu`` (requests/s) from its
   roles as DistServe sizes them, per layout from the screen (:func:`role_rates`: the
   prefill pool's prompts per lone prefill, the decode pool's best tokens per second over
   the batches within the TPOT limit; an aggregated instance is both roles), and, for an
   aggregated candidate that reaches a wave (a speculative candidate has neither this nor
   the estimate below: both count one token per decode step), the lower of that and a run of its own
   deployment with ``SATURATED_ROUNDS`` full batches of requests arriving at once
   (:func:`saturated_run`, in its cell). A run at a rate above ``mu`` builds a queue, so
   the TTFT percentile bounds the capacity (:func:`capacity_bound`).
   **Estimate.** Each candidate also gets an estimated capacity from its layouts' step
   tables (:mod:`g5core.study.serving.estimate`: the scheduler's steady state per instance,
   the prompts' queue of the run's own length and arrivals; the lower of the prefill and
   decode pools' for a disaggregated one); its bound is at most the estimate times ``1 +
   ESTIMATE_MARGIN``, it needs no saturated run, and its bisection starts at the estimate
   times the median simulated/estimated capacity of its side (aggregated or disaggregated)
   among the candidates simulated so far (:func:`~.capacity.start_share`;
   ``START_ESTIMATE_SHARE`` before any): only the start, which no bound uses. The estimate
   is not a proof either: the tests check it against simulated capacities.
5. **Capacity** of each candidate: the highest Poisson arrival rate at which the SLO holds
   (every named percentile under its limit, every request completed) on the workload's
   seed and on ``confirm`` further seeds (the capacity holds when every seed's run does
   there), by seeded runs of ``requests`` requests. The search over the rate runs on the
   workload's seed; the further seeds run at the capacity it finds, and while one fails there
   the rate steps down by ``1 + tolerance`` (:func:`~.bisect.confirm`). From ``START_ESTIMATE_SHARE x estimate`` the rate gallops by ``1 +
   tolerance`` (the factor squared each step) up while the SLO holds or down while it does
   not, to a bracket; without an estimate (``min_chips``, ``bound=False``) from ``START_SHARE
   x mu`` (without a bound: ``instances / lone end-to-end``) it bisects toward the bound,
   then doubles past it if the SLO still holds there (the bound only guesses the bracket:
   a failing run is required above the capacity), or halves until it holds; then it bisects
   until ``hi / lo <= 1 + tolerance``: the capacity is ``lo``. Each run has ``max(requests,
   settle x rate x (TTFT limit + mean output x TPOT limit))`` requests (``settle`` times the
   requests in the system when the SLO holds, by Little's law). ``min_chips`` also lets a
   deployment use fewer chips and first asks whether it serves ``--rate``.
6. **Branch and bound** (not for ``min_chips``; ``bound=False`` turns it off): candidates run
   best bound first, ``WAVE`` at a time; before each wave, a candidate whose bound of
   the objective (its capacity bound over its chips, the goodput share at most 1) is not
   above the ``top``-th best simulated value times ``1 + tolerance``, or the first's where
   that is lower (the bar's value, :func:`~.bound.bar_value`), cannot pass the ``top``-th
   beyond the search's resolution and is bounded out (reported with its bound, not
   simulated), and so is every one after it. In the wave, a candidate's first run is at
   the rate where its value would pass the bar's value (when its start is below it), and a
   failing run at or below that rate ends its search: its capacity is below it (bounded out
   by simulation). A capacity is the lower end of a bracket ``hi / lo <= 1 + tolerance``, so
   such a candidate is tied with the ``top``-th within the search's own resolution: the
   winner is exact, places 2 to ``top`` up to the tolerance.
   Likewise, before its confirming seeds run, a candidate whose value with them cannot pass
   that value (the value at the capacity its workload's seed found, or the most a capacity
   ``1 + tolerance`` lower allows: :func:`~.bound.confirmed_upper`) is bounded out there:
   candidates tied at the top (decode-bound disaggregated pairs beside one decode pool with
   other prefill partners, most often) do not each run their confirming seeds. The first
   wave has no such value yet: its cells find their capacities on the workload's seed only
   (``defer``, ``status: unconfirmed``); the driver then confirms the ``top`` best by that
   unconfirmed value and each side's best in cells of their own
   (:func:`~.capacity.confirm_cell`, the same result as the one cell's, run for run), and
   bounds out each other one whose value once confirmed (``tie_upper``, the same bound)
   cannot pass the value those set, as a cell with that bar would
   (:func:`~.capacity.tie_result`); the rest run their seeds against it. An
   aggregated candidate without an
   estimate whose saturated run lowers its bound below that value stops there (bounded out
   too). The waves are fixed, so the candidates simulated do not depend on the workers.
   **max_num_seqs variants** (one deployment, the same pools and chunk size) run in
   different waves: every run records the most sequences any scheduler held at once
   (``peak_running``, after admissions, per attention-DP rank). Below a limit, that limit
   never stopped an admission, so a run below both variants' limits is the same run on
   either, bit for bit. A later variant makes again only the simulated one's runs that
   reached the lower limit (:func:`~.capacity.variant_cell`); when each holds or fails as
   before, the simulated capacity search (the same rates, the same decisions) is its own
   (``same_runs``, counted apart from the simulated); otherwise it is simulated. Within a
   capacity search, a rate tried again on a seed is not run again.
   **A decode pool's TPOT miss** (:class:`~.decode.DecodeSides`): a disaggregated
   candidate's run that misses a TPOT or ITL limit at rate ``r`` bounds every candidate
   with the same decode pool (its prefill pool reaches the decode pool only through when
   each prompt's KV arrives): its capacity at most ``r / (1 + tolerance)``, and where the
   first one's bracket ``[c, r]`` held at ``c``, its value at most ``c`` times the share of
   requests within the TPOT limits there. A heuristic: the tests simulate what it bounded
   out anyway. A wave holds one candidate per decode pool and scheduler limits.
   The Pareto front is the simulated candidates' front.
7. **Ranking** by the objective: ``goodput_per_chip`` (requests/s per chip meeting the SLO
   at capacity), ``throughput_per_chip`` (output tokens/s per chip at capacity), or
   ``min_chips`` (fewest chips serving ``--rate``, then the most goodput per chip).

What is approximate: the bounds and the estimates. ``mu`` is a measured steady state (no proof that a lighter
load does better per second), the queue argument takes the queue's growth at its mean, the
decode role counts only batches within ``1 + TPOT_SLACK`` of the TPOT limit, and each
allows ``BOUND_MARGIN`` more; ``tests/test_serve_search.py`` simulates the bounded-out
candidates anyway and checks that none beats the ``top``-th and that no capacity exceeds
its bound.

Every cell runs through the sweep machinery's executors (``--workers``, ``--executor
dask``) and is stored as its own row of the ``serve_search`` table of the results
database the moment it finishes, so a search killed (``kill -9`` included) resumes where it
stopped. The serving runs are :class:`g5core.serve.session.ServingSession` runs (those of
``g5 serve``), the engine's step latencies shared between the candidates of a layout.

The modules, one per concern: :mod:`.space` (settings, candidates, configurations, run
lengths), :mod:`.screen` (a layout's screen cell), :mod:`.estimate` (capacities from step
tables), :mod:`.bound` (the branch and bound's bounds), :mod:`.capacity` (a candidate's
capacity cell), :mod:`.runs` (a capacity search's runs and the figures one cell ships another),
:mod:`.bisect` (its search over the rate), :mod:`.decode` (a decode pool's
runs bounding its other prefill partners), :mod:`.result` (ranking and reporting), :mod:`.storage` (cells in the results
database, progress), :mod:`.candidates` (the candidates from the screens),
:mod:`.inputs` (the search's inputs checked), :mod:`.driver` (the search), :mod:`.command`
(``g5 best --serve``'s flags to a search).
"""
from g5core.study.serving.bound import capacity_bound, role_rates
from g5core.study.serving.bisect import capacity_search
from g5core.study.serving.capacity import candidate_cell, saturated_run
from g5core.study.serving.command import best_serve_command
from g5core.study.serving.driver import serve_search
from g5core.study.serving.estimate import ESTIMATE_MARGIN, Estimator
from g5core.study.serving.result import Bounded, Scored, ServeSearchResult, limiter
from g5core.study.serving.screen import screen_cell
from g5core.study.serving.space import (DEFAULT_BEAM, DEFAULT_CHUNKS, DEFAULT_CONFIRM, DEFAULT_MAX_RATE,
                                        DEFAULT_MIN_SEQS, DEFAULT_REQUESTS, DEFAULT_TOLERANCE, DEFAULT_TOP,
                                        DISAGG_MODES, MAX_RUN_REQUESTS, SERVE_OBJECTIVES, SETTLE, Candidate,
                                        PoolChoice, Pruned, SearchSettings, candidate_config, check_workload,
                                        run_requests, short_label)

__all__ = ["Bounded", "Candidate", "DEFAULT_BEAM", "DEFAULT_CHUNKS", "DEFAULT_CONFIRM", "DEFAULT_MAX_RATE",
           "DEFAULT_MIN_SEQS", "DEFAULT_REQUESTS", "DEFAULT_TOLERANCE", "DEFAULT_TOP", "DISAGG_MODES",
           "ESTIMATE_MARGIN", "Estimator", "MAX_RUN_REQUESTS", "PoolChoice", "Pruned", "SERVE_OBJECTIVES", "SETTLE",
           "Scored", "SearchSettings", "ServeSearchResult", "best_serve_command", "candidate_cell",
           "candidate_config", "capacity_bound", "capacity_search", "check_workload", "limiter", "role_rates",
           "run_requests", "saturated_run", "screen_cell", "serve_search", "short_label"]
