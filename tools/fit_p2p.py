"""Fit NCCL's point-to-point copy rate per channel and NVLink efficiency to nccl-tests alltoall
on 2, 4 and 8 x H100, and check them, unchanged, on H200, B200 and A100.

    python tools/fit_p2p.py

Model (g5plugins/collectives/nccl.py, "point to point"; NCCL 2.29.2 enqueue.cc): an
all-to-all of ``N`` bytes per rank over ``n`` GPUs of one node sends ``m = N/n`` to each
peer. NCCL splits each send over ``c`` of its p2p channels (scheduleP2pTasksToPlan,
addP2pToPlan), uses LL when ``m <= c x 16 KiB``, else Simple steps of at most one 512 KiB
chunk. Its time alone is

    latency + max(copy, link)
    copy = (part + step) x wire / r            (per channel; part = m / c)
    link = (n - 1) x m x wire / (eta x B)      (each chip's NVLink, B per direction)

with ``latency`` the system's measured point-to-point start latency, ``wire`` 2 for LL and
the two constants ``r`` (the copy rate of one channel's CTA, GB/s) and ``eta`` (the fraction
of the link NVLink copies reach). Least squares on log time over the H100 table; rows
slower than a larger message of the same table are measurement glitches and left out (the
8-GPU H100 table has 16-17 us at 2, 16 and 32 KiB between 7.5 and 8.7 us rows).
"""
from __future__ import annotations

import csv
import math
import pathlib
import sys

from g5core.inputs.systems import get_system
from g5plugins.collectives import nccl

DATA = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "nccl"
FIT = ("aiconfigurator-h100-sxm-nccl2.29.2.csv", "h100-sxm")
CHECKS = (("aiconfigurator-h200-sxm-nccl2.29.2.csv", "h200"), ("aiconfigurator-b200-sxm-nccl2.29.2.csv", "b200"),
          ("aiconfigurator-a100-sxm-nccl2.27.3.csv", "a100-80gb"))


def rows(name: str) -> list[tuple[int, int, float]]:
    """(gpus, size_bytes, time_us) of the alltoall rows, glitches left out."""
    with open(DATA / name, encoding="utf-8") as fh:
        data = [(int(r["gpus"]), int(r["size_bytes"]), float(r["time_us"]))
                for r in csv.DictReader(line for line in fh if not line.startswith("#"))
                if r["collective"] == "alltoall"]
    return [(n, s, t) for n, s, t in data
            if not any(n2 == n and s2 > s and t2 < t for n2, s2, t2 in data)]


def model_us(system, n: int, size: int, rate_gbytes_per_s: float, efficiency: float) -> float:
    link_gbytes_per_s = system.intra_node_bw_bytes_per_s / 1e9
    channels = nccl.p2p_node_channels(link_gbytes_per_s, system.compute_capability)
    m = size / n
    nc = nccl.p2p_peer_channels(m, n, channels)
    wire = nccl.P2P_LL_WIRE_FACTOR if nccl.p2p_protocol(m, nc) == "ll" else 1.0
    copy = nccl.p2p_copy_time_us(m, n, channels, rate_gbytes_per_s)
    link = (n - 1) * m * wire / (efficiency * link_gbytes_per_s * 1000.0)
    return system.intra_node_latency_s * 1e6 + max(copy, link)


def loss(params, system, data) -> float:
    rate, eff = params
    if rate <= 0 or not 0 < eff <= 1:
        return math.inf
    return sum((math.log(model_us(system, n, s, rate, eff)) - math.log(t)) ** 2 for n, s, t in data)


def errors(system, data, rate, eff):
    """G5's busbw error per row: measured time / model time - 1 (+: G5 faster)."""
    return [(n, s, t / model_us(system, n, s, rate, eff) - 1.0) for n, s, t in data]


def main(argv) -> None:
    from scipy.optimize import minimize     # the measured extra

    name, sysname = FIT
    h100, system = rows(name), get_system(sysname)
    fit = minimize(loss, [20.0, 0.85], args=(system, h100), method="Nelder-Mead",
                   options={"xatol": 1e-4, "fatol": 1e-10})
    rate, eff = fit.x
    print(f"r = {rate:.2f} GB/s per channel, eta = {eff:.3f} (fitted on {len(h100)} H100 rows; rms log error "
          f"{math.sqrt(fit.fun / len(h100)):.3f}); nccl.py has r = {nccl.P2P_CHANNEL_COPY_RATE_GBYTES_PER_S}, "
          f"eta = {nccl.P2P_NVLINK_EFFICIENCY}")
    for data_name, sysname in (FIT,) + CHECKS:
        system, data = get_system(sysname), rows(data_name)
        errs = errors(system, data, nccl.P2P_CHANNEL_COPY_RATE_GBYTES_PER_S, nccl.P2P_NVLINK_EFFICIENCY)
        for n in (2, 4, 8):
            all_e = [e for g, _, e in errs if g == n]
            big = [e for g, s, e in errs if g == n and s >= 2 ** 26]
            print(f"{data_name}: {n} GPUs: busbw error {min(all_e) * 100:+.0f}% .. {max(all_e) * 100:+.0f}%, "
                  f"from 64 MiB {min(big) * 100:+.0f}% .. {max(big) * 100:+.0f}%")
        if "-v" in argv:
            for n, s, e in errs:
                print(f"    {n} GPUs {s:>10} B  {e * 100:+6.1f}%")


if __name__ == "__main__":
    main(sys.argv[1:])
