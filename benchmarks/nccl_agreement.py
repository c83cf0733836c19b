"""G5's collective times against published NCCL measurements (tests/data/nccl/*.csv).

    python benchmarks/nccl_agreement.py [--markdown | --summary]

For every measured row of the default algorithm (collectives named exactly all_reduce,
all_gather, reduce_scatter, alltoall) on H100 systems, and the alltoall rows of H200, B200
and A100 (the tables the p2p constants were not fitted to), G5's time for the same op alone
(``g5 collective``'s engine path) beside the measurement, and the error of G5's bus
bandwidth. The README's agreement table is this script's --summary output (every row:
--markdown).
"""
from __future__ import annotations

import csv
import pathlib
import re
import sys

import attrs

from g5core.session.collbench import collective_rows
from g5core.inputs.systems import get_system

DATA = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "nccl"
FILES = {  # data file -> (G5 system, NCCL choice the measurement forced)
    "aiconfigurator-h100-sxm-nccl2.29.2.csv": ("h100-sxm", {}),
    "azure-nd-h100-v5.csv": ("h100-sxm", {"all_reduce": {"algorithm": "nvls"}}),   # run with NCCL_ALGO=NVLS
    "nccl-issue-1221.csv": ("h100-sxm", {}),
    # alltoall only: the fitted table above and three it did not see (tools/fit_p2p.py)
    "aiconfigurator-h200-sxm-nccl2.29.2.csv": ("h200", {}),
    "aiconfigurator-b200-sxm-nccl2.29.2.csv": ("b200", {}),
    "aiconfigurator-a100-sxm-nccl2.27.3.csv": ("a100-80gb", {}),
}
ONLY = {"aiconfigurator-h200-sxm-nccl2.29.2.csv": "alltoall", "aiconfigurator-b200-sxm-nccl2.29.2.csv": "alltoall",
        "aiconfigurator-a100-sxm-nccl2.27.3.csv": "alltoall"}
OPS = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
       "alltoall": "all_to_all"}


def _system(name: str, forced: dict):
    spec = get_system(name)
    return attrs.evolve(spec, nccl=forced) if forced else spec


def measured_rows():
    for name, (system, forced) in FILES.items():
        system = _system(system, forced)
        with open(DATA / name, encoding="utf-8") as fh:
            for row in csv.DictReader(line for line in fh if not line.startswith("#")):
                if row["collective"] in OPS and ONLY.get(name, row["collective"]) == row["collective"]:
                    yield name, system, row


def agreement(ops=None):
    """One row per measured row (of the ops named in ``ops``, G5's names, or of every op); G5's
    times of one (system, op, GPUs) come from one collective_rows call over all its sizes."""
    wanted = [(name, system, row) for name, system, row in measured_rows()
              if ops is None or OPS[row["collective"]] in ops]
    sizes: dict = {}
    for _name, system, row in wanted:
        key = (system.name, bool(system.nccl), OPS[row["collective"]], int(row["gpus"]))
        sizes.setdefault(key, (system, {}))[1].setdefault(int(row["size_bytes"]), None)
    cache: dict = {}
    for (sys_name, forced, op, gpus), (system, by_size) in sizes.items():
        for g5 in collective_rows(op, system, gpus, list(by_size)):
            cache[(sys_name, forced, op, gpus, g5["size_bytes"])] = g5
    out = []
    for name, system, row in wanted:
        op, gpus, size = OPS[row["collective"]], int(row["gpus"]), int(row["size_bytes"])
        g5 = cache[(system.name, bool(system.nccl), op, gpus, size)]
        measured_us = float(row["time_us"])
        out.append({"source": name, "op": op, "gpus": gpus, "nodes": int(row["nodes"]), "size_bytes": size,
                    "measured_us": measured_us, "g5_us": g5["time_s"] * 1e6,
                    "measured_busbw_gbytes_per_s": float(row["busbw_gbytes_per_s"]), "g5_busbw_gbytes_per_s": g5["busbw_bytes_per_s"] / 1e9,
                    "error": measured_us / (g5["time_s"] * 1e6) - 1.0,   # busbw error = time ratio - 1
                    "algorithm": g5["algorithm"], "protocol": g5["protocol"]})
    return out


def summary_rows(rows):
    """The rows the README's table shows: 8 GPUs or more, sizes a decade or so apart."""
    keep = {2 ** 10, 2 ** 16, 2 ** 20, 2 ** 24, 2 ** 26, 2 ** 28, 2 ** 30, 2 ** 33}
    keep_a2a = {2 ** 10, 2 ** 20, 2 ** 24, 2 ** 29}     # alltoall tables end at 512 MiB
    return [r for r in rows if r["gpus"] >= 8
            and (r["size_bytes"] in (keep_a2a if r["op"] == "all_to_all" else keep)
                 or r["source"].startswith("nccl-issue"))]


def source_label(name: str) -> str:
    """``aiconfigurator-h200-sxm-nccl2.29.2.csv`` -> ``aiconfigurator nccl_perf, H200, NCCL 2.29.2``
    (with whether the p2p constants were fitted to it)."""
    m = re.match(r"aiconfigurator-(\w+?)-(?:sxm-)?nccl([\d.]+?)\.csv$", name)
    if not m:
        return name.removesuffix(".csv")
    gpu, version = m.group(1).upper(), m.group(2)
    fitted = "p2p fit" if name == "aiconfigurator-h100-sxm-nccl2.29.2.csv" else "not fitted"
    return f"aiconfigurator nccl_perf, {gpu}, NCCL {version} ({fitted})"


def main(argv):
    rows = agreement()
    if "--summary" in argv:
        rows = summary_rows(rows)
        argv = ["--markdown"]
    if "--markdown" in argv:
        print("| source | op | GPUs | size | measured busbw GB/s | G5 busbw GB/s | error | G5 algorithm |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['source'].split('.csv')[0]} | {r['op']} | {r['gpus']} | {r['size_bytes']} | "
                  f"{r['measured_busbw_gbytes_per_s']:.1f} | {r['g5_busbw_gbytes_per_s']:.1f} | {r['error'] * 100:+.0f}% | "
                  f"{r['algorithm']}/{r['protocol']} |")
        return
    for r in rows:
        print(f"{r['source'][:28]:28} {r['op']:>14} {r['gpus']:>3} {r['size_bytes']:>11} meas {r['measured_us']:>10.1f}us "
              f"g5 {r['g5_us']:>10.1f}us busbw {r['measured_busbw_gbytes_per_s']:7.1f} vs {r['g5_busbw_gbytes_per_s']:7.1f} "
              f"{r['error'] * 100:+6.1f}% {r['algorithm']}/{r['protocol']}")


if __name__ == "__main__":
    main(sys.argv[1:])
