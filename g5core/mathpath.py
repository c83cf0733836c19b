"""The Math path: a closed-form TTFT/TPOT with no op DAG and no event simulation.

Each logical op is expanded by the same plugins, but nothing is linked or simulated: the
op's time is the slowest chip's compute (the same roofline durations the engine uses)
plus, serially, the alpha-beta time of its communication ops on the chips they touch,
each alone on the links: ``latency + max over ports (own bytes on the port / port
bandwidth)``. Logical ops add up in program order: no overlap, no contention. On one chip
this is exactly the sum the engine's single stream produces.
"""
from __future__ import annotations

import attrs

from .build import Plan, expand
from .collective import Topology
from .dag import CommOp, ComputeOp, require_lowering
from .errors import DagError
from .layers import build_program


@attrs.frozen
class MathResult:
    phase: str
    latency_s: float
    compute_s: float
    comm_s: float

    def to_json_dict(self) -> dict:
        key = "ttft_s" if self.phase == "prefill" else "tpot_s"
        return {"phase": self.phase, "latency_s": self.latency_s, key: self.latency_s,
                "compute_s": self.compute_s, "comm_s": self.comm_s}


def alpha_beta_s(op: CommOp, plan: Plan, cache: dict) -> float:
    key = (op.primitive, op.group, op.bytes_per_rank)
    if key not in cache:
        topo: Topology = plan.ctx.topology
        require_lowering(op, plan.primitives)
        _, lower = plan.primitives[op.primitive]
        low = lower(op.group, op.bytes_per_rank, topo)
        on_port: dict[int, float] = {}
        for s, t, b in low.flows:
            for p in topo.ports(s, t):
                on_port[p] = on_port.get(p, 0.0) + b
        cache[key] = low.latency_s + max((b / topo.port_capacity(p) for p, b in on_port.items()), default=0.0)
    return cache[key]


def math_estimate(plan: Plan) -> MathResult:
    ctx = plan.ctx
    latency_cache: dict = {}
    comm_cache: dict = {}
    total = compute_total = comm_total = 0.0
    for lop in build_program(ctx.model):
        _, frag = expand(ctx, lop)
        compute: dict[int, float] = {}
        comm: dict[int, float] = {}
        for op in frag.ops:
            if isinstance(op, ComputeOp):
                key = (op.op_class, op.flops, op.hbm_bytes, op.dtype)
                if key not in latency_cache:
                    answer = plan.hooks.call_first("g5_compute_latency", op=op, system=ctx.system,
                                                   deployment=ctx.deployment)
                    if answer is None:
                        raise DagError(f"no enabled plugin gives the compute latency of {op.key}; enable the roofline plugin")
                    latency_cache[key] = float(answer[1])
                compute[op.chip] = compute.get(op.chip, 0.0) + latency_cache[key]
            else:
                t = alpha_beta_s(op, plan, comm_cache)
                for c in op.group:
                    comm[c] = comm.get(c, 0.0) + t
        c_s = max(compute.values(), default=0.0)
        m_s = max(comm.values(), default=0.0)
        total += c_s
        if m_s:
            total += m_s
        compute_total += c_s
        comm_total += m_s
    return MathResult(phase=ctx.deployment.phase, latency_s=total, compute_s=compute_total, comm_s=comm_total)
