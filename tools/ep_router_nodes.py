"""Distinct nodes a token reaches: the uniform group-limited formula (plugins/ep/routing.py)
against routers that choose their groups by score, for DeepSeek-V3's 256 experts, top-8, 4 of
8 groups, one group a node (EP64 over 8 nodes).

    python tools/ep_router_nodes.py

Scores are |N(0, 1)| + 1 per (token, expert), seeded, as in DeepEP's tests
(tests/legacy/test_internode.py); a group's score is its best expert (DeepEP's tests) or the
sum of its best two (DeepSeek-V3's router, noaux_tc).
"""
from __future__ import annotations

import numpy as np

from g5plugins.ep.routing import expected_units_hit

TOKENS, EXPERTS, GROUPS, TOPK_GROUPS, TOPK = 20_000, 256, 8, 4, 8


def distinct_nodes(group_score) -> float:
    rng = np.random.default_rng(0)
    scores = np.abs(rng.standard_normal((TOKENS, EXPERTS))) + 1
    per_group = np.sort(scores.reshape(TOKENS, GROUPS, -1), axis=-1)
    chosen = np.argpartition(-group_score(per_group), TOPK_GROUPS - 1, axis=1)[:, :TOPK_GROUPS]
    allowed = np.zeros((TOKENS, GROUPS), dtype=bool)
    np.put_along_axis(allowed, chosen, True, axis=1)
    masked = np.where(np.repeat(allowed, EXPERTS // GROUPS, axis=1), scores, -1.0)
    nodes = np.sort(np.argpartition(-masked, TOPK - 1, axis=1)[:, :TOPK] // (EXPERTS // GROUPS), axis=1)
    return float(((nodes[:, 1:] != nodes[:, :-1]).sum(axis=1) + 1).mean())


if __name__ == "__main__":
    print(f"uniform formula:              {expected_units_hit((EXPERTS // GROUPS,) * GROUPS, EXPERTS, TOPK, GROUPS, TOPK_GROUPS):.3f}")
    print(f"groups by their best expert:  {distinct_nodes(lambda g: g[:, :, -1]):.3f}")
    print(f"groups by their best two:     {distinct_nodes(lambda g: g[:, :, -2:].sum(axis=-1)):.3f}")
