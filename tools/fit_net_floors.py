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

Each is one number, fitted by least squares on log time to every other row of its table in
the fit's size window (the first, third, ...) and checked on the others and on the rows of
other runs and node counts named in its ``checks`` (never fitted). Where a table gives both
of nccl-tests' columns the lower of the out-of-place and in-place times is read: they time
the same operation, and a first call or a one-off spike shows in one column only. The size
window keeps the fit to the sizes where the latency term is most of the time (the tree hop:
8 B .. 64 KiB); ``checks`` reach further. The proxy's per-op overhead is not separated from
the per-step latency: each fitted step latency includes it.

Which public rows exist (tests/data/nccl/*.csv give each source): sendrecv 256 B .. 8 KiB on
two A40 nodes (nccl-tests #214); all-reduce 8 .. 64 B on two A100 nodes with one GPU each (ring;
nccl-tests #150); all-reduce 8 B .. 16 GiB on two and four 8 x H100 nodes with 8 x 400 Gb/s IB
(NCCL 2.26.2, nccl-tests #309, which NCCL's maintainer called good), and 1 MiB .. 8 GiB on 2, 4
and 8 nodes of a second H100 IB cluster (same thread); 4 .. 512 B NVLS tree on two 8 x H20 nodes
with NDR (nccl #1244). Not fitted, printed for comparison: 256 B and 4 KiB on three H100 nodes
from a thread about poor performance (nccl #1453: 62 and 75 us, 2.5x the healthy cluster of
#309); alltoall on two nodes of 8 PCIe GPUs over Spectrum-X RoCE; the EFA (AWS P5) and TCPXO
(GCP A3 Mega) rows, other network tiers. No public all-gather table across H100 nodes and no
alltoall table across NVLink nodes was found.
"""
from __future__ import annotations

import csv
import math
import pathlib
import sys

import attrs

from g5core.inputs.systems import get_system
from g5core.session.collbench import collective_rows

DATA = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "nccl"


def rows(name: str, collective: str, run: str | None = None,
         max_size_bytes: int | None = None) -> list[tuple[int, int, float]]:
    """(gpus, size_bytes, time_us) of one table's rows of ``collective`` (and of ``run`` where
    the table has runs), up to ``max_size_bytes``; the time is the lower of the out-of-place
    and in-place columns where the table has both."""
    out = []
    with open(DATA / name, encoding="utf-8") as fh:
        for r in csv.DictReader(line for line in fh if not line.startswith("#")):
            if r["collective"] != collective or not r["size_bytes"] or not r["time_us"]:
                continue
            if run is not None and r.get("run") != run:
                continue
            size = int(r["size_bytes"])
            if max_size_bytes is not None and size > max_size_bytes:
                continue
            times = [float(r["time_us"])] + ([float(r["time_inplace_us"])] if r.get("time_inplace_us") else [])
            out.append((int(r["gpus"]), size, min(times)))
    return out


def one_chip_per_node(system):
    """The system with one chip (and one NIC) per node: a run of one GPU per node."""
    return attrs.evolve(system, chips_per_node=1, nics_per_node=None, nic_of_chip=())


@attrs.frozen
class Table:
    """Rows of one public table: file, collective, run (where the file has runs), sizes up to."""
    file: str
    collective: str
    run: str | None = None
    max_size_bytes: int | None = None

    def rows(self) -> list[tuple[int, int, float]]:
        return rows(self.file, self.collective, self.run, self.max_size_bytes)


@attrs.frozen
class Fit:
    """One fitted figure: its table, the primitive G5 runs for it, the system the rows ran on,
    how the figure is set, and the other tables it is checked on (never fitted)."""
    table: Table
    primitive: str
    base: object          # () -> SystemSpec
    setter: object        # (SystemSpec, value) -> SystemSpec
    checks: tuple = ()

    def shipped(self, name: str, system) -> float:
        return system.network_latency_s if name == "network_latency_s" else \
            system.network_hop_latency_s[name.split(".")[1]]

    def held_back(self) -> list[tuple[int, int, float]]:
        return self.table.rows()[1::2] + [r for t in self.checks for r in t.rows()]


def _with_hop(system, algorithm: str, value: float):
    hops = dict(system.network_hop_latency_s)
    hops[algorithm] = value
    return attrs.evolve(system, network_hop_latency_s=hops)


#: the fitted figures
FITS = {
    "network_latency_s": Fit(Table("nccl-tests-issue-214.csv", "sendrecv"), "sendrecv",
                             lambda: one_chip_per_node(get_system("h100-sxm")),
                             lambda s, v: attrs.evolve(s, network_latency_s=v)),
    "network_hop_latency_s.ring": Fit(Table("nccl-tests-issue-150.csv", "all_reduce"), "all_reduce",
                                      lambda: one_chip_per_node(get_system("a100-80gb")),
                                      lambda s, v: _with_hop(s, "ring", v)),
    "network_hop_latency_s.tree": Fit(Table("nccl-tests-issue-309.csv", "all_reduce", "qoofyk-bm", 2 ** 16),
                                      "all_reduce", lambda: get_system("h100-sxm"),
                                      lambda s, v: _with_hop(s, "tree", v),
                                      checks=(Table("nccl-tests-issue-309.csv", "all_reduce", "qoofyk-vm",
                                                    2 ** 16),)),
    "network_hop_latency_s.nvls_tree": Fit(Table("nccl-issue-1244.csv", "all_reduce_nvls_tree"), "all_reduce",
                                           lambda: attrs.evolve(get_system("h100-sxm"),
                                                                nccl={"all_reduce": {"algorithm": "nvls_tree"}}),
                                           lambda s, v: _with_hop(s, "nvls_tree", v)),
}

#: rows printed beside G5's shipped h100-sxm figure, never fitted: (label, table, primitive, system)
COMPARED = (
    ("2-node all_reduce 8 B .. 4 MiB, 8 x H100 + 8 x 400G IB, NCCL 2.26.2 (nccl-tests #309)",
     Table("nccl-tests-issue-309.csv", "all_reduce", "qoofyk-bm", 2 ** 22), "all_reduce", None),
    ("the same, with the run's NCCL 2.26.2 tuner (nccl: {tuner: {release: '2.26.2'}})",
     Table("nccl-tests-issue-309.csv", "all_reduce", "qoofyk-bm", 2 ** 22), "all_reduce", "nccl_2_26"),
    ("4-node all_reduce 8 B .. 4 MiB, 8 x H100 VMs + 8 x 400G IB (nccl-tests #309)",
     Table("nccl-tests-issue-309.csv", "all_reduce", "qoofyk-vm", 2 ** 22), "all_reduce", None),
    ("4-node all_reduce from 256 MiB with the run's NCCL 2.26.2 tuner (nccl-tests #309)",
     Table("nccl-tests-issue-309.csv", "all_reduce", "qoofyk-vm"), "all_reduce", "nccl_2_26"),
    ("3-node all_reduce, H100, thread 'Poor NCCL allreduce performance' (nccl #1453)",
     Table("nccl-issue-1453.csv", "all_reduce"), "all_reduce", None),
    ("2-node alltoall, 8 PCIe GPUs per node, Spectrum-X RoCE, NCCL 2.30.3 (other node type)",
     Table("pcie-rtx-spectrumx-2node-alltoall.csv", "alltoall", max_size_bytes=2 ** 20), "all_to_all", None),
    ("2-GPU sendrecv across 2 nodes, H100 + CX-7 400G RoCE, NCCL 2.31.2 (nccl #2409, resolved state)",
     Table("nccl-issue-2409.csv", "sendrecv"), "sendrecv", "one_per_node"),
)


def model_us(system, primitive: str, gpus: int, size: int) -> tuple[float, str]:
    row = collective_rows(primitive, system, gpus, [size])[0]
    return row["time_s"] * 1e6, f"{row['algorithm']}/{row['protocol']}"


def rows_us(system, primitive: str, rows) -> list[float]:
    """model_us's times of ``(gpus, size, measured_us)`` rows, in their order: one collective_rows
    call per GPU count over all its sizes (the fit's loss asks for every seen row each time)."""
    by_gpus: dict[int, list[int]] = {}
    for n, size, _ in rows:
        by_gpus.setdefault(n, []).append(size)
    times = {(n, row["size_bytes"]): row["time_s"] * 1e6 for n, sizes in by_gpus.items()
             for row in collective_rows(primitive, system, n, sorted(set(sizes)))}
    return [times[(n, int(size))] for n, size, _ in rows]


def fit_one(name: str):
    from scipy.optimize import minimize_scalar     # the measured extra

    fit = FITS[name]
    data = fit.table.rows()
    seen = data[0::2]

    def loss(v: float) -> float:
        s = fit.setter(fit.base(), v)
        return sum((math.log(g5) - math.log(t)) ** 2 for g5, (_, _, t) in zip(rows_us(s, fit.primitive, seen), seen))

    best = minimize_scalar(loss, bounds=(0.0, 200e-6), method="bounded", options={"xatol": 1e-9})
    return best.x, math.sqrt(best.fun / len(seen)), seen, fit.held_back()


def _print_rows(system, primitive, data, verbose, label):
    errs = []
    for n, size, t in data:
        m, how = model_us(system, primitive, n, size)
        errs.append(t / m - 1.0)
        if verbose:
            print(f"    {label}: {n} GPUs {size:>8} B  measured {t:8.2f} us  G5 {m:8.2f} us ({how})  "
                  f"{(t / m - 1) * 100:+.1f}%")
    return errs


def main(argv) -> None:
    verbose = "-v" in argv
    shipped = get_system("h100-sxm")
    for name, fit in FITS.items():
        value, rms, seen, held = fit_one(name)
        now = fit.shipped(name, shipped)
        print(f"{name} = {value * 1e6:.2f} us (fitted on {len(seen)} rows of {fit.table.file}"
              f"{' run ' + fit.table.run if fit.table.run else ''}, rms log error {rms:.3f}); "
              f"h100-sxm.yaml has {now * 1e6:.2f} us")
        errs = _print_rows(fit.setter(fit.base(), value), fit.primitive, held, verbose, "held back")
        print(f"    {len(held)} held-back rows: measured / G5 - 1 from {min(errs) * 100:+.1f}% "
              f"to {max(errs) * 100:+.1f}%")
    print("compared, not fitted (G5: the shipped h100-sxm):")
    for label, table, primitive, how in COMPARED:
        system = one_chip_per_node(shipped) if how == "one_per_node" else \
            attrs.evolve(shipped, nccl={"tuner": {"release": "2.26.2"}}) if how == "nccl_2_26" else shipped
        data = [r for r in table.rows() if how != "nccl_2_26" or table.run != "qoofyk-vm" or r[1] >= 2 ** 28]
        errs = _print_rows(system, primitive, data, verbose, "row")
        print(f"  {label}: measured / G5 - 1 from {min(errs) * 100:+.1f}% to {max(errs) * 100:+.1f}%")
    print("other tiers (not fitted): AWS P5 EFA, 2 nodes: sendrecv 40-53 us, all_reduce 55.5 us, alltoall 60 us "
          "(hf-smol-playbook-aws-p5.csv); GCP A3 Mega TCPXO all_reduce 2 nodes 123 us at 16 B "
          "(gcp-a3mega-2node-allreduce.csv)")
    for primitive in ("sendrecv", "all_reduce", "all_gather", "all_to_all"):
        t, how = model_us(shipped, primitive, 16, 8)
        print(f"h100-sxm now: {primitive} 8 B on 16 chips (2 nodes): {t:.1f} us ({how})")


if __name__ == "__main__":
    main(sys.argv[1:])
