"""The serving search's candidates from its layouts' screens (the driver's step 2, see the
package doc): each role's layouts (a layout whose lone request misses a limit is pruned,
with its reason), the aggregated candidates (instances x ``max_num_seqs``) and the
disaggregated pairs (a prefill and a decode pool filling the chips), each with its roles'
bound (:func:`~g5core.study.serving.bound.role_rates`) and its pools' screens."""
from __future__ import annotations

from typing import Mapping, Sequence

import attrs

from g5core.study.search import layout_label
from g5core.study.serving.bound import role_rates
from g5core.study.serving.screen import _lone
from g5core.study.serving.space import (Candidate, PoolChoice, Pruned, SearchSettings, _longest, _pow2_seqs,
                                        _shortest_output)


@attrs.frozen
class Enumerated:
    """What :func:`candidates_from_screens` gives the driver."""
    pruned: list          # Pruned layouts (the screen's refusals and the lone request's misses)
    cands: list           # (Candidate, a start rate) each
    roles_bound: dict     # candidate index -> its roles' bound (role_rates; None with a speculative block)
    screens: dict         # candidate index -> (its pools' screens, their layout keys)
    skipped: int          # disaggregated pairs beyond --beam
    all_roles: dict       # role -> the kept (chips, parallel, chunk, screen) of every variant


def candidates_from_screens(per_layout: Sequence, by_layout: Sequence, layouts: Sequence, variants: Sequence,
                            settings: SearchSettings, workload: Mapping, limits, chips: int, dsys,
                            reuse: bool) -> Enumerated:
    """The candidates of a search from its screens: ``per_layout`` the screen cells' results
    (per speculative block, the configuration's system's layouts then --decode-system's),
    ``by_layout`` their ``(chips, layout label)`` keys,
    ``layouts`` the ``(chips, parallel, chunk)`` cells, ``dsys`` --decode-system's name (or
    None), ``reuse`` whether the workload reuses prefixes (then only the TPOT screen prunes)."""
    ttft_limits = [l for l in limits if l.metric in ("ttft", "e2e")]
    tpot_limits = [l for l in limits if l.metric in ("tpot", "itl")]
    e2e_limits = [l for l in limits if l.metric == "e2e"]
    longest = _longest(workload)
    fewest = _shortest_output(workload)
    pruned: list[Pruned] = []
    cands: list[tuple[Candidate, float]] = []
    fewer = settings.objective == "min_chips"
    roles_bound: dict = {}   # candidate index -> its roles' bound (role_rates)
    screens: dict = {}       # candidate index -> (its pools' screens, their layout keys)
    shortest = _lone(workload).requests[0]
    skipped = 0
    all_roles: dict[str, list] = {"serve": [], "prefill": [], "decode": []}
    per_variant = len(by_layout) * (1 + (dsys is not None))
    for v, spec in enumerate(variants):
        cells_v = per_layout[v * per_variant:(v + 1) * per_variant]
        found = {key: cell["chunks"] for key, cell in zip(by_layout, cells_v)}
        screened = [found[(c, layout_label(par))][settings.chunks.index(chunk)] for c, par, chunk in layouts]
        dfound = {key: cell["chunks"] for key, cell in zip(by_layout, cells_v[len(by_layout):])}
        roles: dict[str, list] = {"serve": [], "prefill": [], "decode": []}
        for (c, par, chunk), res in zip(layouts, screened):
            if res["status"] != "ok":
                pruned.append(Pruned(par, c, chunk, res["family"], res["reason"], spec))
                continue
            ttft_miss = [] if reuse else [l for l in ttft_limits if res["lone_ttft_s"] > l.limit_s]
            tpot_miss = [l for l in tpot_limits
                         if res["lone_tpot_s"] is not None and res["lone_tpot_s"] > l.limit_s]
            e2e_miss = [] if reuse else [l for l in e2e_limits if _lone_e2e_s(res, res, fewest) > l.limit_s]
            if not ttft_miss:
                roles["prefill"].append((c, par, chunk, res))
            if not tpot_miss and dsys is None:
                roles["decode"].append((c, par, chunk, res))
            if not ttft_miss and not tpot_miss and not e2e_miss:
                roles["serve"].append((c, par, chunk, res))
            elif ttft_miss:
                pruned.append(Pruned(par, c, chunk, "lone prefill misses TTFT",
                                     f"one request alone takes {res['lone_ttft_s']:.4g} s to its first token "
                                     f"(limit {ttft_miss[0].key} {ttft_miss[0].limit_s:.4g} s)", spec))
            elif tpot_miss:
                pruned.append(_tpot_pruned(par, c, chunk, res, tpot_miss[0], None, spec))
            else:
                pruned.append(Pruned(par, c, chunk, "lone request misses E2E",
                                     f"one request alone takes {_lone_e2e_s(res, res, fewest):.4g} s to its "
                                     f"last token (limit {e2e_miss[0].key} {e2e_miss[0].limit_s:.4g} s)", spec))
        for c, par, chunk in (layouts if dsys is not None else ()):   # the decode role on --decode-system
            res = dfound[(c, layout_label(par))][settings.chunks.index(chunk)]
            tpot_miss = [l for l in tpot_limits
                         if res.get("lone_tpot_s") is not None and res["lone_tpot_s"] > l.limit_s]
            if res["status"] == "ok" and not tpot_miss:
                roles["decode"].append((c, par, chunk, res))
            elif res["status"] != "ok":
                pruned.append(Pruned(par, c, chunk, f"{res['family']} (decode on {dsys})", res["reason"], spec))
            else:
                pruned.append(_tpot_pruned(par, c, chunk, res, tpot_miss[0], dsys, spec))
        for role, kept_role in roles.items():
            all_roles[role] += kept_role

        # 2. candidates. A speculative one has no roles' bound (they count one token per
        # decode step, a verification keeps 1 .. k + 1): it is simulated unless a failing
        # run at the bar bounds it out
        if settings.disagg in ("off", "auto"):
            for c, par, chunk, res in roles["serve"]:
                for inst in (range(1, chips // c + 1) if fewer else (chips // c,)):
                    pool = PoolChoice(c, tuple(sorted(par.items())), inst)
                    for m in _pow2_seqs(res["kv_capacity_tokens"] // par.get("dp", 1), longest, settings):
                        roles_bound[len(cands)] = None if spec else role_rates(
                            res, res, inst, inst, m * par.get("dp", 1), chunk, shortest, tpot_limits)
                        screens[len(cands)] = ((res,), ((c, layout_label(par), chunk),))
                        cands.append((Candidate((pool,), m, chunk, spec), inst / res["lone_e2e_s"]))
        if settings.disagg in ("on", "auto"):
            prefill = sorted(roles["prefill"], key=lambda x: (x[3]["lone_ttft_s"] * x[0], layout_label(x[1])))
            decode = sorted(roles["decode"], key=lambda x: (
                -(x[3]["kv_capacity_tokens"] / longest) / (x[3]["lone_tpot_s"] * x[0]), layout_label(x[1])))
            beam = settings.beam
            for chunk in settings.chunks:
                p_ok = [x for x in prefill if x[2] == chunk]
                d_ok = [x for x in decode if x[2] == chunk]
                if beam is not None:
                    skipped += len(p_ok) * len(d_ok) - len(p_ok[:beam]) * len(d_ok[:beam])
                    p_ok, d_ok = p_ok[:beam], d_ok[:beam]
                for p in p_ok:
                    for d in d_ok:
                        if not reuse and any(_lone_e2e_s(p[3], d[3], fewest) > l.limit_s for l in e2e_limits):
                            continue    # no rate serves this pair within the e2e limit (its lone request misses it)
                        for n_p in range(1, chips // p[0] + 1):
                            rest = chips - n_p * p[0]
                            for n_d in (range(1, rest // d[0] + 1) if fewer else
                                        ((rest // d[0],) if rest > 0 and rest % d[0] == 0 else ())):
                                if n_d < 1:
                                    continue
                                pools = (PoolChoice(p[0], tuple(sorted(p[1].items())), n_p),
                                         PoolChoice(d[0], tuple(sorted(d[1].items())), n_d, dsys))
                                for m in _pow2_seqs(d[3]["kv_capacity_tokens"] // d[1].get("dp", 1), longest,
                                                    settings):
                                    start = min(n_p / p[3]["lone_ttft_s"], n_d / d[3]["lone_e2e_s"])
                                    seqs = m * d[1].get("dp", 1)    # max_num_seqs is per attention-DP rank
                                    roles_bound[len(cands)] = None if spec else role_rates(
                                        p[3], d[3], n_p, n_d, seqs, chunk, shortest, tpot_limits)
                                    screens[len(cands)] = ((p[3], d[3]), ((p[0], layout_label(p[1]), chunk),
                                                                          (d[0], layout_label(d[1]), chunk)))
                                    cands.append((Candidate(pools, m, chunk, spec), start))
    return Enumerated(pruned, cands, roles_bound, screens, skipped, all_roles)


def _tpot_pruned(par, chips: int, chunk: int, res: Mapping, limit, system=None, spec: tuple = ()) -> Pruned:
    """A layout whose lone decode misses a TPOT limit (on ``system``, --decode-system's, when
    given; with the speculative: block ``spec``, even with every draft kept: see screen_cell)."""
    on = f" on {system}" if system else ""
    best = f" even with all {res['speculative_tokens']} drafts kept" if res.get("speculative_tokens") else ""
    return Pruned(par, chips, chunk, "lone decode misses TPOT" + (f" (decode on {system})" if system else ""),
                  f"one request alone decodes at {res['lone_tpot_s'] * 1e3:.4g} ms per token{on}{best} "
                  f"(limit {limit.key} {limit.limit_s * 1e3:.4g} ms)", spec)


def _lone_e2e_s(prefill: Mapping, decode: Mapping, fewest: int) -> float:
    """A lower bound of every request's e2e with its prompt on the layout ``prefill``
    screened and its decodes on ``decode`` (the same screen when aggregated): the lone
    request's first token on ``prefill`` plus its decode steps on ``decode`` (the
    shortest prompt and output on an idle instance: a loaded instance only adds work to a
    step, a disaggregated deployment the KV transfer too). With a request of one output
    token (the lone request decodes two, see ``_lone``) the first token alone."""
    if fewest < 2:
        return prefill["lone_ttft_s"]
    return prefill["lone_ttft_s"] + decode["lone_e2e_s"] - decode["lone_ttft_s"]
