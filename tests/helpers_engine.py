"""Shared helpers for engine tests: synthetic systems and models, hand-built DAGs.

A hand-built DAG runs on a real :class:`g5core.lower.builder.Plan` (made from a small config on a
synthetic system file, so bandwidths and latencies are known), but its ops are written by
the test, not by the plugins:

    plan = synthetic_plan(tmp_path, chips=4, chips_per_node=4, intra_node_bw_bytes_per_s=100e9)
    b = DagBuilder()
    b.p2p("send", 0, 1, 1e6)
    run = b.run(plan)            # compile_dag + Engine(...).run() + conservation_kpis
    run.end_s("send")
"""
from __future__ import annotations

import copy
import itertools
import json
import pathlib
from typing import Any, Iterable

import attrs
import yaml
import numpy as np

from g5core.api.ops import CommOp, ComputeOp
from g5core.lower.dag import OpDag
from g5core.sim.engine import Engine
from g5core.sim.compile import compile_dag
from g5core.sim.results import conservation_kpis
from g5core.session.run import make_plan

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
HF_DIR = REPO_ROOT / "tests" / "data" / "hf"
EXAMPLES_DIR = REPO_ROOT / "examples"

#: A synthetic system: efficiencies 1 and round figures, so roofline times are simple.
SYSTEM_FIELDS: dict[str, Any] = {
    "name": "synthetic",
    "chips_per_node": 4,
    "hbm_capacity_bytes": 80 * 2 ** 30,
    "hbm_bw_bytes_per_s": 2.0e12,
    "peak_flops_per_s": {"bf16": 1.0e15, "fp16": 1.0e15, "fp8": 2.0e15, "fp32": 1.0e14},
    "intra_node_bw_bytes_per_s": 100.0e9,
    "intra_node_latency_s": 1.0e-6,
    "network_bw_bytes_per_s": 10.0e9,
    "network_latency_s": 5.0e-6,
    "launch_overhead_s": 0.0,
    "efficiency": {"gemm": 1.0, "attention": 1.0, "elementwise": 1.0, "hbm": 1.0},
    "compute_capability": 9.0,
}


_SYSTEM_FILES = itertools.count()


def write_system(directory, filename: str = "system.yaml", **changes) -> str:
    """Write a synthetic system YAML (``SYSTEM_FIELDS`` updated with ``changes``); return its path."""
    data = copy.deepcopy(SYSTEM_FIELDS)
    data.update(changes)
    path = pathlib.Path(directory) / filename
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return str(path)


def write_tiny_model(directory, base: str = "llama-3.1-8b", layers: int = 2, **changes) -> str:
    """A copy of ``tests/data/hf/<base>.json`` with ``layers`` layers; return its path."""
    data = json.loads((HF_DIR / f"{base}.json").read_text(encoding="utf-8"))
    data["num_hidden_layers"] = layers
    data.update(changes)
    path = pathlib.Path(directory) / f"tiny-{base}-{layers}l.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return str(path)


def raw_config(model: str, system: str, chips: int, phase: str = "prefill", batch: int = 1,
               seq_len: int = 4096, **parallel) -> dict:
    """A raw config dict; ``parallel`` sizes default to 1 (dp takes the chips left over)."""
    par = {"dp": 1, "tp": 1, "pp": 1, "cp": 1}
    par.update(parallel)
    if "dp" not in parallel:
        rest = chips
        for k, v in par.items():
            if k not in ("dp", "ep"):
                rest //= v
        par["dp"] = rest
    return {"model": model, "system": system, "chips": chips, "parallel": par, "phase": phase,
            "batch": batch, "seq_len": seq_len}


def synthetic_plan(directory, chips: int, model: str = "llama-3.1-8b", **system_changes):
    """A plan for ``chips`` chips (dp = chips) on a synthetic system written to ``directory``.

    Only its topology and system matter to a hand-built DAG.
    """
    system = write_system(directory, filename=f"system-{next(_SYSTEM_FILES)}.yaml", **system_changes)
    return make_plan(raw_config(model, system, chips, batch=chips, seq_len=128, dp=chips))


@attrs.define(kw_only=True)
class DagRun:
    """What one hand-built DAG produced."""

    dag: OpDag
    compiled: Any
    engine: Engine
    kpis: dict

    def start_s(self, key: str) -> float:
        return self.engine.start_s[self.dag.index[key]]

    def end_s(self, key: str) -> float:
        return self.engine.end_s[self.dag.index[key]]

    def flows_of(self, key: str) -> range:
        i = self.dag.index[key]
        return range(self.compiled.flow_ptr[i], self.compiled.flow_ptr[i + 1])

    @property
    def makespan_s(self) -> float:
        return self.engine.makespan_s


def run_dag(dag: OpDag, plan, engine_cls: type = Engine) -> DagRun:
    """compile_dag, run the engine, compute the KPIs."""
    compiled = compile_dag(dag, plan)
    engine = engine_cls(dag=compiled).run()
    return DagRun(dag=dag, compiled=compiled, engine=engine, kpis=conservation_kpis(engine))


class DagBuilder:
    """Build an OpDag by hand with short calls."""

    def __init__(self) -> None:
        self.dag = OpDag()

    def compute(self, key: str, chip: int, flops: float, hbm_bytes: float = 0.0, op_class: str = "gemm",
                dtype: str = "bf16") -> str:
        self.dag.add_op(ComputeOp(key=key, chip=chip, op_class=op_class, flops=flops, hbm_bytes=hbm_bytes,
                                  layer=0, name="test", dtype=dtype, owner="test", kernels=()))
        return key

    def comm(self, key: str, primitive: str, group: Iterable[int], bytes_per_rank: float,
             reason: str = "test") -> str:
        self.dag.add_op(CommOp(key=key, primitive=primitive, group=tuple(group), bytes_per_rank=bytes_per_rank,
                               reason=reason, layer=0, name="test", owner="test"))
        return key

    def p2p(self, key: str, src: int, dst: int, nbytes: float, reason: str = "test") -> str:
        return self.comm(key, "p2p", (src, dst), nbytes, reason)

    def edge(self, before: str, after: str) -> None:
        self.dag.add_edge(before, after, owner="test")

    def run(self, plan, engine_cls: type = Engine) -> DagRun:
        return run_dag(self.dag, plan, engine_cls)


def all_zero(kpis: dict) -> bool:
    return all(v == 0 for v in kpis.values())


# ----------------------------------------------------------------------------------------
# Broken engines: each breaks one invariant through one seam of g5core.sim.engine.Engine
# ----------------------------------------------------------------------------------------


class SkipsOneOp(Engine):
    """``_may_start`` refuses the first compute op it is asked about: that op never runs."""

    def _may_start(self, op: int) -> bool:
        if getattr(self, "_victim", None) is None:
            self._victim = op
        return op != self._victim


class ReleasesEarly(Engine):
    """``_successors`` also names the successors' successors, so an op is released as soon
    as a predecessor of its predecessor finishes (e.g. the consumer of an all-reduce
    starts when the all-reduce starts)."""

    def _successors(self, op: int):
        succ = self.dag.succ
        return tuple(succ[op]) + tuple(w for v in succ[op] for w in succ[v])


class DropsAFlow(Engine):
    """``_release_flows`` leaves out the last flow of the first comm op that has flows."""

    def _release_flows(self, op: int) -> range:
        flows = super()._release_flows(op)
        if len(flows) and not getattr(self, "_dropped", False):
            self._dropped = True
            return flows[:-1]
        return flows


class HalfFlops(Engine):
    """``_flops_of`` credits half of each compute op's FLOPs."""

    def _flops_of(self, op: int) -> float:
        return 0.5 * float(self.dag.spec_flops[self.dag.spec[op]])


class GreedyPorts(Engine):
    """``_allocate`` gives every flow the full capacity of its ports, ignoring sharing."""

    def _allocate(self, flows, ports) -> dict:
        cap = self.dag.port_capacity
        return {f: min(cap[p] for p in self.dag.flow_ports[f]) for f in flows}


class ParallelStreams(Engine):
    """A chip that starts every ready compute op at once: each compute op runs on a private
    stream. (Engine has no seam for "is this chip's stream free"; this double swaps in a
    DAG with one stream per op for the run, and restores the real chip of every op before
    the KPIs read it.)"""

    def run(self) -> "Engine":
        real = self.dag
        n = real.n_ops
        private = np.where(real.chip >= 0, real.n_chips + np.arange(n), real.chip)
        self.dag = attrs.evolve(real, n_chips=real.n_chips + n, chip=private)
        try:
            super().run()
        finally:
            self.dag = real
        return self


#: KPI name -> the broken engine that must make it non-zero.
BROKEN_ENGINES = {
    "ops_not_executed_once": SkipsOneOp,
    "ops_started_before_predecessor_finished": ReleasesEarly,
    "bytes_injected_minus_delivered": DropsAFlow,
    "dag_flops_minus_executed_flops": HalfFlops,
    "port_bytes_beyond_capacity": GreedyPorts,
    "overlapping_compute_intervals": ParallelStreams,
}
