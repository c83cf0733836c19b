"""Default compute latency: the roofline of the system file, flat or size-aware.

It answers last (``trylast``) so a profile-table plugin (``measured``) can answer first.
The formulas live in :mod:`g5core.sim.roofline`.
"""
from __future__ import annotations

from g5core import gemm_padded_flops, hookimpl, kernel_latency_s, op_latency_s, roofline_latency_s

__all__ = ["gemm_padded_flops", "kernel_latency_s", "op_latency_s", "roofline_latency_s"]


@hookimpl(trylast=True)
def g5_compute_latency(op, system, deployment):
    return op_latency_s(op, system, getattr(deployment, "phase", ""))
