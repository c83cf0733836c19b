"""Fit the cross-node latencies NCCL's model leaves out to public multi-node nccl-tests rows,
and check them on the rows the fit did not see.

    python tools/fit_net_floors.py        # -v: every row

What is fitted (g5plugins/collectives, "measured floors"): NCCL's tuner picks the algorithm
with its own latencies (tuning.cc hwLatencies[NET], with the network's ``latencyInter`` that
the IB plugin leaves at 0), and G5 then times the chosen algorithm with

- ``network_latency_s``: the start latency of one cross-node send/receive (the network round
  trip of a small message and NCCL's proxy progress), fitted to 2-rank sendrecv_perf rows;
- ``network_hop_latency_s[ring | tree | nvls_tree]``: the latency of one node-crossing step of
  that algorithm, in NCCL's own latency formula in place of its ``interLat`` (ring: nInterSteps
  of them; tree and NVLS tree: 2 log2(nodes)), each fitted to all-reduce rows of that
  algorithm.

Each is one number, fitted by least squares on log time to every other row of its table (the
first, third, ...) and checked on the others. The proxy's per-op overhead is not separated
from the per-step latency: every table is of 2 or 3 nodes, where the step counts do not
vary enough to tell them apart, so each fitted step latency includes it.

Which public rows exist (tests/data/nccl/*.csv give each source): sendrecv 256 B .. 8 KiB on
two A40 nodes (nccl-tests #214), all-reduce 8 .. 64 B on two A100 nodes with one GPU each
(ring; nccl-tests #150), 256 B and 4 KiB on three 8 x H100 nodes (tree LL; nccl #1453), 4 ..
512 B NVLS tree on two 8 x H20 nodes with NDR (nccl #1244). No public all-gather or
all-to-all table across H100 nodes was found; the EFA (AWS P5) and TCPXO (GCP A3 Mega) rows of
the same folder are other network tiers, printed for comparison, not fitted.
"""
from __future__ import annotations

import csv
import math
import pathlib
import sys

import attrs

from g5core.inputs.systems import get_system
from g5core.sim.collbench import collective_rows

DATA = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "nccl"


def rows(name: str, collective: str) -> list[tuple[int, int, float]]:
    """(gpus, size_bytes, time_us) of one table's rows of ``collective``."""
    with open(DATA / name, encoding="utf-8") as fh:
        return [(int(r["gpus"]), int(r["size_bytes"]), float(r["time_us"]))
                for r in csv.DictReader(line for line in fh if not line.startswith("#"))
                if r["collective"] == collective and r["size_bytes"] and r["time_us"]]


def one_chip_per_node(system):
    """The system with one chip (and one NIC) per node: a run of one GPU per node."""
    return attrs.evolve(system, chips_per_node=1, nics_per_node=None, nic_of_chip=())


#: parameter -> (table, collective in the table, primitive G5 runs, system, how to set the parameter)
FITS = {
    "network_latency_s": ("nccl-tests-issue-214.csv", "sendrecv", "sendrecv",
                          lambda: one_chip_per_node(get_system("h100-sxm")),
                          lambda s, v: attrs.evolve(s, network_latency_s=v)),
    "network_hop_latency_s.ring": ("nccl-tests-issue-150.csv", "all_reduce", "all_reduce",
                                   lambda: one_chip_per_node(get_system("a100-80gb")),
                                   lambda s, v: _with_hop(s, "ring", v)),
    "network_hop_latency_s.tree": ("nccl-issue-1453.csv", "all_reduce", "all_reduce",
                                   lambda: get_system("h100-sxm"), lambda s, v: _with_hop(s, "tree", v)),
    "network_hop_latency_s.nvls_tree": ("nccl-issue-1244.csv", "all_reduce_nvls_tree", "all_reduce",
                                        lambda: attrs.evolve(get_system("h100-sxm"),
                                                             nccl={"all_reduce": {"algorithm": "nvls_tree"}}),
                                        lambda s, v: _with_hop(s, "nvls_tree", v)),
}


def _with_hop(system, algorithm: str, value: float):
    hops = dict(system.network_hop_latency_s)
    hops[algorithm] = value
    return attrs.evolve(system, network_hop_latency_s=hops)


def model_us(system, primitive: str, gpus: int, size: int) -> tuple[float, str]:
    row = collective_rows(primitive, system, gpus, [size])[0]
    return row["time_s"] * 1e6, f"{row['algorithm']}/{row['protocol']}"


def fit_one(name: str):
    from scipy.optimize import minimize_scalar     # the measured extra

    table, coll, primitive, base, setter = FITS[name]
    data = rows(table, coll)
    seen, held = data[0::2], data[1::2]

    def loss(v: float) -> float:
        s = setter(base(), v)
        return sum((math.log(model_us(s, primitive, n, size)[0]) - math.log(t)) ** 2 for n, size, t in seen)

    best = minimize_scalar(loss, bounds=(0.0, 200e-6), method="bounded", options={"xatol": 1e-9})
    return best.x, math.sqrt(best.fun / len(seen)), seen, held


def main(argv) -> None:
    shipped = get_system("h100-sxm")
    for name in FITS:
        value, rms, seen, held = fit_one(name)
        table, coll, primitive, base, setter = FITS[name]
        now = (shipped.network_latency_s if name == "network_latency_s"
               else shipped.network_hop_latency_s.get(name.split(".")[1]))
        print(f"{name} = {value * 1e6:.2f} us (fitted on {len(seen)} rows of {table}, rms log error {rms:.3f}); "
              f"h100-sxm.yaml has {'none' if now is None else f'{now * 1e6:.2f} us'}")
        system = setter(base(), value)
        errs = []
        for n, size, t in held:
            m, how = model_us(system, primitive, n, size)
            errs.append(t / m - 1.0)
            if "-v" in argv:
                print(f"    held back: {n} GPUs {size:>6} B  measured {t:7.2f} us  G5 {m:7.2f} us ({how})  "
                      f"{(t / m - 1) * 100:+.1f}%")
        print(f"    held-back rows: measured / G5 - 1 from {min(errs) * 100:+.1f}% to {max(errs) * 100:+.1f}%")
    print("other tiers (not fitted): AWS P5 EFA, 2 nodes: sendrecv 40-53 us, all_reduce 55.5 us, alltoall 60 us "
          "(hf-smol-playbook-aws-p5.csv); GCP A3 Mega TCPXO all_reduce 2 nodes 123 us at 16 B "
          "(gcp-a3mega-2node-allreduce.csv)")
    for primitive, chips in (("sendrecv", 16), ("all_reduce", 16), ("all_to_all", 16)):
        t, how = model_us(shipped, primitive, chips, 8)
        print(f"h100-sxm now: {primitive} 8 B on {chips} chips (2 nodes): {t:.1f} us ({how})")


if __name__ == "__main__":
    main(sys.argv[1:])
