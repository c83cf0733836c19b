"""Default compute latency: a roofline with per-op-class efficiencies from the system file.

``time = max(flops / (peak[dtype] * eff[op_class]), hbm_bytes / (hbm_bw * eff["hbm"]))
+ launch_overhead``. It answers last (``trylast``) so a profile-table plugin can answer first.
"""
from __future__ import annotations

from g5core import hookimpl


def roofline_latency_s(op_class, flops, hbm_bytes, dtype, system) -> float:
    compute_s = flops / (system.peak_flops(dtype) * system.op_efficiency(op_class)) if flops else 0.0
    memory_s = hbm_bytes / (system.hbm_bw_bytes_per_s * system.op_efficiency("hbm")) if hbm_bytes else 0.0
    return max(compute_s, memory_s) + system.launch_overhead_s


@hookimpl(trylast=True)
def g5_compute_latency(op, system, deployment):
    return roofline_latency_s(op.op_class, op.flops, op.hbm_bytes, op.dtype, system)
