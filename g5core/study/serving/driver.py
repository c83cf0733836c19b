"""The serving search's driver: screen, enumerate (:mod:`.candidates`), estimate and bound,
simulate in waves (branch and bound), rank."""
from __future__ import annotations

import contextlib
import tempfile
from typing import Mapping, Sequence

import attrs

from g5core.api.errors import G5Error
from g5core.serve.api import check_search_work
from g5core.sim.heap import long_lived_heap
from g5core.study.resultsdb import ResultsDB, config_hash
from g5core.study.search import layout_label
from g5core.study.serving.bound import (_estimate_bound, _top_values, _upper_value, bar_value, capacity_bound,
                                        objective_value)
from g5core.study.serving.candidates import candidates_from_screens
from g5core.study.serving.capacity import (candidate_cell, confirm_cell, run_settle_s, start_share, tie_result,
                                           variant_cell, whole_cell)
from g5core.study.serving.decode import DecodeSides, decode_side
from g5core.study.serving.estimate import Estimator, estimate_for
from g5core.study.serving.inputs import checked_inputs
from g5core.study.serving.result import Bounded, Scored, ServeSearchResult, _group, scored_results, shown
from g5core.study.serving.screen import ShippedPoints, layout_screens
from g5core.study.serving.space import (MAX_RUN_REQUESTS, SearchSettings, _longest_output, cp_prefill_choice,
                                        host_tier_variants, instance_layouts, is_moe, reuses_prefixes, run_requests,
                                        vary_cache)
from g5core.study.serving.storage import _drive, _Kept, _Progress, _Table, _Unconfirmed, _Waves
from g5core.study.serving.variants import Variants, variant_key
from g5core.study.sweep import LineProgress, make_executor


#: candidates simulated together between two branch-and-bound decisions (fixed, so the
#: candidates simulated do not depend on the workers or on which finishes first)
WAVE = 8


def serve_search(raw: Mapping, workload: Mapping, settings: SearchSettings, *, db_path=None, disabled=(),
                 workers: int = 1, executor: str = "local", progress=None, inputs: Sequence = (),
                 runner_for=None, max_work=None) -> ServeSearchResult:
    """Enumerate, screen, simulate (capacity per candidate) and rank; see the module doc.
    ``runner_for``: ``(layout configuration, prepared plan) -> (groups -> latency_s)``
    instead of the engine (tests; in-process only). What survives a full garbage collection
    meanwhile is frozen (:func:`g5core.sim.heap.long_lived_heap`: the cells' caches)."""
    with long_lived_heap():
        return _serve_search(raw, workload, settings, db_path=db_path, disabled=disabled, workers=workers,
                             executor=executor, progress=progress, inputs=inputs, runner_for=runner_for,
                             max_work=max_work)


def _serve_search(raw: Mapping, workload: Mapping, settings: SearchSettings, *, db_path, disabled, workers: int,
                  executor: str, progress, inputs: Sequence, runner_for, max_work) -> ServeSearchResult:
    workload, limits, chips, names, dims, variants = checked_inputs(raw, workload, settings, disabled, executor,
                                                                    workers, runner_for)
    if callable(progress) and not hasattr(progress, "cell"):
        progress = LineProgress(progress)
    base = {k: v for k, v in raw.items() if k not in ("parallel", "speculative")}
    ttft_limits = [l for l in limits if l.metric in ("ttft", "e2e")]
    tpot_limits = [l for l in limits if l.metric in ("tpot", "itl")]
    # reused prefixes (a conversation's history, a shared prefix): a cache hit can beat a cold
    # prompt, so neither the lone request's TTFT and e2e nor the bounds (every prompt priced
    # cold) bound what a candidate can do; only its TPOT still prunes
    reuse = reuses_prefixes(workload)
    ident = {"base": base, "workload": workload, "slo": settings.slo,
             "runner": None if runner_for is None else getattr(runner_for, "__name__", "custom")}

    # 1. layouts x chunks, screened (per speculative block: its proposer's memory and steps)
    layouts = [(c, par, chunk) for c, par in instance_layouts(chips, dims, settings.vary, is_moe(raw))
               for chunk in settings.chunks]
    by_layout = list(dict.fromkeys((c, layout_label(par)) for c, par, _ in layouts))
    pars = {(c, layout_label(par)): par for c, par, _ in layouts}
    # --decode-system: the decode role's layouts screened again on that system (heterogeneous
    # disaggregation); prefill and aggregated stay on the configuration's
    dsys = settings.decode_system if settings.disagg != "off" and settings.decode_system != raw.get("system") else None
    screen_cells = layout_screens(base, variants, by_layout, pars, dsys, ident, names, settings, workload,
                                  tuple(disabled), runner_for)
    own_db = db_path is None
    tmp = tempfile.TemporaryDirectory(prefix="g5-best-serve-") if own_db else None
    path = f"{tmp.name}/best-serve.db" if own_db else db_path
    db = ResultsDB.open(path, inputs=inputs)
    stack = contextlib.ExitStack()
    try:
        table = _Table(db)
        outer = stack.enter_context(make_executor(executor, workers))
        kept = _Kept(outer)
        per_layout = _drive(table, kept, screen_cells,
                            _Progress(progress, "screen") if progress is not None else None, workers)
        # the engine's latencies each layout's screen made (per speculative block and system),
        # shipped to the workers that simulate its candidates: they are not simulated again there
        points = ShippedPoints()
        for k, cell in enumerate(per_layout):
            points.screened(by_layout[k % len(by_layout)], cell.get("engine_points"))
        en = candidates_from_screens(per_layout, by_layout, layouts, variants, settings, workload, limits, chips,
                                     dsys, reuse)
        pruned, cands, roles_bound, screens, skipped, all_roles = (en.pruned, en.cands, en.roles_bound, en.screens,
                                                                   en.skipped, en.all_roles)
        # the host KV tier sizes and, for long prompts, cp's prefill choice (space.vary_cache)
        cands = vary_cache(cands, roles_bound, screens, host_tier_variants(raw, workload),
                           cp_prefill_choice(raw, workload))
        if not cands:
            fams = sorted(((len(m), f, m[0].reason) for f, m in _group(pruned)), reverse=True)
            hint = f"; most ({fams[0][0]}) for {fams[0][1]}: {fams[0][2]}" if fams else ""
            raise G5Error(f"no deployment of {chips} chips is left to simulate ({len(layouts)} layouts and chunk "
                          f"sizes screened){hint}")
        settle_s = run_settle_s(workload, ttft_limits, tpot_limits, all_roles)
        # 3. capacities, best roles' bound first, in waves; a candidate whose bound cannot
        # reach the simulated one at place --top is bounded out (by the driver from its roles'
        # bound, or by its cell from its saturated run)
        use_bounds = settings.bound and settings.objective != "min_chips" and not reuse   # see ``reuse``
        keyed = {k: v for k, v in attrs.asdict(settings).items() if k not in ("top", "bound")}
        top_out = _longest_output(workload)
        caps = [capacity_bound(roles_bound[i], limits, workload, settle_s, settings) if use_bounds else None
                for i in range(len(cands))]
        estimator = Estimator(limits, workload,
                              lambda r: run_requests(workload, r, settle_s, settings.settle), settings.max_rate,
                              MAX_RUN_REQUESTS)
        # a speculative candidate has no estimate (the step tables count one token per decode step)
        estimated = [estimate_for(estimator, cand, *screens[i])
                     if settings.objective != "min_chips" and not cand.speculative else None
                     for i, (cand, _) in enumerate(cands)]
        estimates = estimated if use_bounds else [None] * len(cands)
        caps = [_estimate_bound(e, cap) for e, cap in zip(estimates, caps)]
        upper = [_upper_value(settings.objective, cap, cand, top_out) for (cand, _), cap in zip(cands, caps)]
        check_search_work(len(cands), workload, max_work)   # refused before any capacity run (--max-steps)
        order = sorted(range(len(cands)), key=lambda i: (-upper[i], cands[i][0].label()))
        results: list = [None] * len(cands)
        bounded: list[Bounded] = []
        reporter = _Waves(_Progress(progress, "capacity"), len(cands)) if progress is not None else None

        def cell(kind: str, fn, i: int, keyed_on: Mapping, *args) -> tuple:
            """Candidate ``i``'s cell of ``kind`` (``(key, kind, label, fn, args)``), keyed on the
            search, the candidate and ``keyed_on``; ``fn``'s arguments the search's and ``args``."""
            cand = cands[i][0]
            key = config_hash({"kind": kind, **ident, "candidate": attrs.asdict(cand, recurse=True), "settings": keyed,
                               **keyed_on}, names)
            return key, kind, cand.label(), fn, (base, cand, workload, settings.slo, settings, *args)

        def points_of(i) -> dict:
            """The engine latencies of candidate ``i``'s layouts (none for a stand-in runner)."""
            return {} if runner_for is not None else points.of([(c, lab) for c, lab, _ in screens[i][1]])

        bounded_cell: dict = {}   # candidate index -> its cell, when a failing run at the bar bounded it out
        cell_key: dict = {}       # candidate index -> its candidate cell's key in the table
        bounded_at: dict = {}     # candidate index -> its place in ``bounded``
        # max_num_seqs variants of one deployment run in different waves (Variants)
        seq_variants = Variants(cands, results, bounded, bounded_cell, bounded_at, estimates, settings, top_out,
                                reporter)

        def variant_cells(asked) -> list:
            """The variant cells' results of ``asked`` (``(i, runs)`` each: Variants.check)."""
            cells = [cell("variant", variant_cell, i, {"runs": runs}, settle_s, tuple(disabled), runner_for, runs,
                          points_of(i)) for i, runs in asked]
            return _drive(table, kept, cells, None, workers)

        # what each decode pool's runs tell of its other prefill partners (DecodeSides)
        sides = DecodeSides(cands, limits, settings, top_out)

        def shown_wholes() -> list:
            """``(i, [rate, seed])``: the shown candidates' failing runs stopped at their sure miss."""
            return [(i, results[i]["trace"][results[i]["failed_run"]][:2])
                    for i in shown(cands, results, settings.objective, settings.top)
                    if results[i].get("failed") is None and results[i].get("failed_stopped")
                    and results[i].get("failed_run") is not None]

        def whole_cells(wholes) -> list:
            return [cell("whole", whole_cell, i, {"run": run}, settle_s, tuple(disabled), runner_for, run[0], run[1],
                         points_of(i)) for i, run in wholes]

        def simulate(wave, kth, first=None, whole_failed=()):
            # a wave without a bar (the first) finds its capacities unconfirmed (defer): the
            # driver confirms them (confirm_first), or bounds them out as ties once it has a bar
            defer = kth is None and use_bounds and settings.confirm > 0
            cells = []
            for i in wave:
                cand, start = cands[i]
                roles = roles_bound[i] if use_bounds else None
                share = start_share(cands, results, estimates, cand.disaggregated)
                cells.append(cell("candidate", candidate_cell, i,
                                  {"roles": roles, "kth": kth, "first": first, "estimate": estimates[i],
                                   "start_share": share, **({"whole_failed": True} if i in whole_failed else {}),
                                   **({"defer": True} if defer else {})},
                                  start, settle_s, tuple(disabled), runner_for, roles, kth, estimates[i], share,
                                  points_of(i), first, i in whole_failed, defer))
                cell_key[i] = cells[-1][0]
            # a wave with a bar also makes the failing runs of the candidates shown so far whole
            # (cells of their own, stored: the search's last step finds them), so that its
            # workers are not idle while its last cells run; a candidate no longer shown at the
            # end has its run made for nothing
            extra = whole_cells(shown_wholes()) if kth is not None else []
            # the confirming seeds of the first round (confirm_first) start as soon as what
            # they need is in, beside the wave's last cells: each side's best once its
            # capacity is found (it is confirmed whatever the others find), the --top best
            # once every capacity of the wave is
            keys: dict = {}         # candidate index -> the key of the confirm cell more() gave, in order
            round_given = not defer

            def more(out: list):
                nonlocal round_given
                if round_given:
                    return None
                found = {i: {key: v for key, v in out[k].items() if key != "engine_points"}
                         for k, i in enumerate(wave) if out[k] is not None and out[k]["status"] == "unconfirmed"}
                now = [i for i in wave if i in whole_failed and i in found]
                if all(out[k] is not None for k in range(len(wave))):
                    now, round_given = first_round(found, whole_failed)[1], True
                new = [i for i in now if i not in keys]
                if round_given and not new:
                    return None
                confirms = [confirm_of(i, found[i], None, None, i in whole_failed) for i in new]
                keys.update((i, c[0]) for i, c in zip(new, confirms))
                return confirms
            pending = {}
            shown_as = reporter if not defer or reporter is None else _Unconfirmed(reporter)
            got = _drive(table, kept, cells + extra, shown_as, workers, more, reporter)
            for i, res in zip(wave, got):
                res = points.learn(res)
                if res["status"] == "unconfirmed":
                    pending[i] = res
                else:
                    record(i, res, defer)
            cell_key.update(keys)
            if pending:
                confirm_first(pending, whole_failed, dict(zip(keys, got[len(cells) + len(extra):])))

        def record(i, res, report=False) -> None:
            """Candidate ``i``'s cell's result (``report``: to the progress, which its cell's
            drive did not)."""
            if report and reporter is not None:
                reporter.cell(None, cands[i][0].label(), res)
            sides.learn(i, res)
            if res["status"] == "bounded":
                bounded_cell[i], bounded_at[i] = res, len(bounded)
                bounded.append(Bounded(cands[i][0], res["saturated"]["saturated_requests_per_s"],
                                       res["capacity_bound"], res["upper"], res["kth"], res["source"],
                                       estimates[i], res.get("runs", 0), settings.top))
            else:
                results[i] = res

        def first_round(unconfirmed: dict, whole_failed) -> tuple[list, list]:
            """``(ranked, now)``: the candidates of ``unconfirmed`` (index -> a first-wave
            cell's unconfirmed result) by their unconfirmed value, and those confirmed first:
            the ``--top`` best and each side's best of ``whole_failed`` (these first)."""
            value = {i: objective_value(settings.objective,
                                        Scored(cands[i][0], {}, {**res, "held": res["held"]["summary"]}))
                     for i, res in unconfirmed.items()}
            ranked = sorted(unconfirmed, key=lambda i: (-value[i], cands[i][0].label()))
            now = [i for k, i in enumerate(ranked) if k < settings.top or i in whole_failed]
            return ranked, sorted(now, key=lambda i: i not in whole_failed)

        def confirm_first(pending: dict, whole_failed, made: dict) -> None:
            """The capacities a wave without a bar found unconfirmed (``pending``, candidate
            index -> its cell's result), confirmed in two rounds: first the ``--top`` best by
            their unconfirmed value and each side's best of ``whole_failed`` (:func:`first_round`;
            ``made``: the confirm cells' results of those run beside the wave); then, against
            the bar the confirmed ones set, the others whose value once confirmed
            (``tie_upper``, which the confirming seeds only lower) could still pass it: the
            rest are ties, bounded out as a cell with that bar bounds them (tie_result)."""
            ranked, now = first_round(pending, whole_failed)
            chosen = set(now)
            # the side's bests first: they make their failing runs whole too (the longest cells
            # start first, as in the wave); recorded in that order (those made beside the wave
            # were reported as they finished)
            rest = [i for i in now if i not in made]
            confirmed = dict(zip(rest, confirm_cells(rest, pending, None, None, whole_failed)))
            for i in now:
                record(i, confirmed[i] if i in confirmed else points.learn(made[i]))
            kth, first = _top_values(settings, cands, results)
            passing = bar_value(kth, first, settings.tolerance)
            later = []
            for i in [i for i in ranked if i not in chosen]:
                tie = pending[i]["tie_upper"]
                if passing is not None and tie is not None and tie <= passing:
                    record(i, tie_result(pending[i], kth, passing), True)
                else:
                    later.append(i)
            for i, res in zip(later, confirm_cells(later, pending, kth, passing, whole_failed)):
                record(i, res)

        def confirm_of(i, first_res: Mapping, kth, passing, whole: bool) -> tuple:
            """Candidate ``i``'s confirm cell from its unconfirmed result ``first_res``."""
            return cell("confirm", confirm_cell, i, {"first": cell_key[i], "kth": kth, "passing": passing,
                                                     **({"whole_failed": True} if whole else {})},
                        settle_s, tuple(disabled), runner_for, first_res, kth, passing, whole, points_of(i))

        def confirm_cells(wave, pending: dict, kth, passing, whole_failed) -> list:
            """The confirm cells' results of ``wave`` (reported as each finishes), in order."""
            cells = []
            for i in wave:
                cells.append(confirm_of(i, pending[i], kth, passing, i in whole_failed))
                cell_key[i] = cells[-1][0]
            return [points.learn(res) for res in (_drive(table, kept, cells, reporter, workers) if cells else ())]

        # max_num_seqs variants of one deployment (the same pools and chunk size) run in
        # different waves, best bound first (Variants)
        remaining = list(order)
        place = {i: k for k, i in enumerate(order)}
        # both answers: each side's (aggregated, disaggregated) best by the bounds joins the
        # first wave, which has no bar yet, beside its WAVE others, so that a side bounded out
        # whole still has its best simulated once, without the bar; it makes its own failing
        # run whole there (it is shown whenever its side has none better)
        early = {mine[0] for mine in ([i for i in order if cands[i][0].disaggregated == side]
                                      for side in (False, True)) if mine} if use_bounds else set()
        while remaining:
            kth, first = _top_values(settings, cands, results) if use_bounds else (None, None)
            # a bound not above the bar's value (bar_value: the top-th's times 1 + the
            # tolerance, never the first's) at most ties the top-th within the search's
            # resolution, as a run failing at the bar's rate shows in a cell
            passing = bar_value(kth, first, settings.tolerance)
            cut = next((p for p, i in enumerate(remaining) if upper[i] <= passing), None) if kth is not None else None
            if cut is not None:
                for j in remaining[cut:]:
                    bounded.append(Bounded(cands[j][0], roles_bound[j]["saturated_requests_per_s"], caps[j],
                                           upper[j], kth, "estimate" if estimates[j] else "roles",
                                           estimates[j], place=settings.top))
                if reporter is not None:
                    reporter.skip(len(remaining) - cut)
                remaining = remaining[:cut]
            if sides and kth is not None:
                remaining, out = sides.bounded_out(remaining, passing, kth, roles_bound, estimates)
                bounded.extend(out)
                if reporter is not None and out:
                    reporter.skip(len(out))
            # one candidate per deployment (max_num_seqs variants) and per decode pool with its
            # scheduler limits in a wave: the others wait for what it tells (Variants.runs_of,
            # DecodeSides.bounded_out). Holding back a decode pool's other limits too (the coarser
            # decode_side) measured 86.3 / 53.4 / 59.9 s on the three benchmark cases
            # (Qwen3, 70B 8K, 70B 4K) against 93.3 / 49.9 / 46.9 s: it reorders the waves
            wave, checks, later, keys = [], [], [], set()
            for i in remaining:
                key = variant_key(cands[i][0])
                side = ((decode_side(cands[i][0]), cands[i][0].max_num_seqs, cands[i][0].chunk)
                        if cands[i][0].disaggregated else None)
                plan = seq_variants.runs_of(i)
                if plan is not None and not plan[1]:
                    seq_variants.adopt(i, plan[0], {})        # no run of j's reached either limit: j's runs are i's
                elif i in early:
                    wave.append(i)
                    keys.update((key, side) if side is not None else (key,))
                elif sum(j not in early for j in wave) + len(checks) >= WAVE:
                    later.append(i)
                elif plan is not None:
                    checks.append((i, *plan))
                elif key not in keys and side not in keys:
                    wave.append(i)
                    keys.update((key, side) if side is not None else (key,))
                else:
                    later.append(i)
            if wave:
                # each side's best first: simulated without the bar, they make the most runs
                # (the longest cells start first, so the wave's last cell is not one of them)
                wave = sorted(wave, key=lambda i: i not in early)
                simulate(wave, kth, first, early)
                early = set()
                for i in wave:
                    seq_variants.simulated_one(i)
            if checks:
                later += seq_variants.check(checks, variant_cells)
            remaining = sorted(later, key=place.get)
        # the failing runs stopped at their sure miss of the candidates shown (the ranking's
        # top and each side's best), made again to their end for their figures (those made
        # beside a wave are in the table)
        wholes = shown_wholes()
        cells = whole_cells(wholes)
        for (i, _), res in zip(wholes, _drive(table, kept, cells, None, workers) if cells else ()):
            if res["status"] == "ok":
                results[i] = {**results[i], "failed": res["failed"], "runs": results[i]["runs"] + 1,
                              "failed_made_whole": True}
                if i in cell_key:       # stored with its figures: a search resumed from the file has them
                    table.update(cell_key[i], results[i])
        if reporter is not None:
            reporter.finish()
    finally:
        stack.close()
        db.close()
        if tmp is not None:
            tmp.cleanup()
    scored = scored_results(cands, results, pruned, base, workload, settings)
    simulated = [r for r in results if r is not None and "same_runs_as" not in r]
    cells = len(layouts) * (1 + (dsys is not None)) * len(variants)   # a layout x chunk cell per system and block
    return ServeSearchResult(settings.objective, settings, cells, tuple(pruned), tuple(scored), len(simulated),
                             skipped, sum(r.get("runs", 0) for r in results if r is not None and r["status"] == "ok")
                             + sum(b.runs for b in bounded) + seq_variants.wasted,
                             None if own_db else str(db_path), tuple(bounded),
                             {cand.label(): e for (cand, _), e in zip(cands, estimated)}, len(seq_variants.same_runs))

