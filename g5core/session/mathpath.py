"""The Math path: a closed-form TTFT/TPOT with no op DAG and no event simulation.

Each logical op is expanded by the same plugins, but nothing is linked or simulated: the
op's time is the slowest chip's compute (the same roofline durations the engine uses)
plus, serially, the alpha-beta time of its communication ops on the chips they touch,
each alone on the links: ``latency + max over ports (own bytes on the port / port
bandwidth)``. Logical ops add up in program order: no overlap, no contention. On one chip
this is exactly the sum the engine's single stream produces.
"""
from __future__ import annotations


from typing import Optional

import attrs

from g5core.lower.builder import Plan, ReplicaSpill, expand
from g5core.inputs.step import phase_metrics
from g5core.lower.collective import idle_transfer_s, lower_op
from g5core.sim.compute import LatencyLookup, coverage_from_columns
from g5core.lower.topology import Topology
from g5core.api.ops import CommOp, ComputeOp
from g5core.lower.layers import build_program
from g5core.lower.symmetry import Symmetry, plan_symmetry


@attrs.frozen(kw_only=True)
class MathResult:
    phase: str
    latency_s: float
    compute_s: float
    comm_s: float
    compute: dict = attrs.field(factory=dict)  # g5core.sim.compute.coverage_report

    def to_json_dict(self) -> dict:
        return {"phase": self.phase, "latency_s": self.latency_s, **phase_metrics(self.phase, self.latency_s),
                "compute_s": self.compute_s, "comm_s": self.comm_s, "compute": self.compute}


def alpha_beta_s(op: CommOp, plan: Plan, cache: dict) -> float:
    """The comm op alone on idle links: start latency, then its bytes on its busiest resource."""
    key = (op.primitive, op.group, op.bytes_per_rank)
    if key not in cache:
        topo: Topology = plan.ctx.topology
        low, flows = lower_op(op, plan.primitives, topo)
        cache[key] = low.latency_s + idle_transfer_s(flows, topo)
    return cache[key]


def math_estimate(plan: Plan) -> MathResult:
    """The closed form of ``plan``. Where identical independent replicas make the run
    symmetric (:func:`g5core.lower.symmetry.plan_symmetry`, conditions 1-4), only the first
    replica's ops are expanded and timed: every other replica's chips run the same ops, so
    the maxima over chips are the same and the coverage counts each op once per replica. A
    plugin that places an op outside that replica makes the estimate expand every chip."""
    sym = plan_symmetry(plan.ctx)
    if sym.applied:
        try:
            return _estimate(plan, sym)
        except ReplicaSpill:
            pass
    return _estimate(plan, None)


def _estimate(plan: Plan, sym: Optional[Symmetry]) -> MathResult:
    ctx = plan.ctx
    ectx = ctx.restricted(sym.chips()) if sym is not None else ctx
    inside = sym.slice_chips if sym is not None else ctx.rankmap.chips
    lookup = LatencyLookup(hooks=plan.hooks, system=ctx.system, deployment=ctx.deployment)
    comm_cache: dict = {}
    total = compute_total = comm_total = 0.0
    timed = []
    for lop in build_program(ctx.model):
        _, frag = expand(ectx, lop)
        compute: dict[int, float] = {}
        comm: dict[int, float] = {}
        for op in frag.ops:
            if isinstance(op, ComputeOp):
                if op.chip >= inside:
                    raise ReplicaSpill(f"{lop.id}: a compute op outside the first replica")
                seconds = lookup.seconds(op)
                timed.append((op, seconds))
                compute[op.chip] = compute.get(op.chip, 0.0) + seconds
            else:
                if max(op.group) >= inside:
                    raise ReplicaSpill(f"{lop.id}: a communication op outside the first replica")
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
    replicas = sym.replicas if sym is not None else 1
    coverage = coverage_from_columns([lookup.answer_id(op) for op, _ in timed], [op.chip for op, _ in timed],
                                     [float(op.flops) for op, _ in timed], ctx.system, total, ctx.rankmap.chips,
                                     lookup, replicas=replicas, replica_chips=inside if replicas > 1 else 0)
    return MathResult(phase=ctx.deployment.phase, latency_s=total, compute_s=compute_total, comm_s=comm_total,
                      compute=coverage)
