"""Data parallelism: independent replicas, each serving ``batch`` sequences.

DP adds nothing to the op DAG but its chips: every replica runs the same ops on its own
chips (the rank map places them), so replicas only meet where another dimension regroups
them (EP carves its groups from dp x tp) or where they share ports. It declares its slices independent replicas
(``replicas=True``): where the core proves no other dimension or resource joins them, it
simulates one replica and replicates the results (:mod:`g5core.lower.symmetry`).
"""
from __future__ import annotations

from g5core import Dimension, hookimpl


@hookimpl
def g5_register_dimensions(register):
    register(Dimension(name="dp", factor=True, rank_order=0, doc="data-parallel replicas, each serving `batch` sequences",
                       replicas=True))
