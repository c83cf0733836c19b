"""Fit the per-chunk cost of NVLS all-reduce to nccl-tests measurements (a microbenchmark of
that very operation), and check it on another machine's measurements.

    python tools/fit_nvls_chunk.py

Model (g5plugins/collectives/nccl.py, ``nvls_efficiency_of_chunk``): NCCL splits an NVLS
all-reduce into chunks whose size falls with the message (enqueue.cc calcCollChunking: 128
KiB, then 64, 32 and 16 KiB below 64, 8 and 2 x (channels x heads x chunk) bytes). Each
chunk pays a fixed cost worth ``c0`` bytes of transfer, so each chip's traffic to and from
the switch runs at ``chunk / (chunk + c0)`` of its link. ``c0`` is the one parameter, fitted
by least squares on log time to the Azure ND H100 v5 NVLS-forced all-reduce (8 GPUs, 2 MiB
.. 8 GiB), then checked, unchanged, on the ND H200 v5 run of the same benchmark. (With
NCCL's own nvlsEfficiency of 0.85 as a further factor the fit is worse: rms log error 0.096
against 0.065, large messages 10% too slow.)
"""
from __future__ import annotations

import csv
import math
import pathlib

from scipy.optimize import minimize_scalar

from g5plugins.collectives import nccl

DATA = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "nccl"
LINK_GBYTES_PER_S = 370.8           # H100/H200: 18 NVLinks x 20.6 GB/s (NCCL topo.h), the shipped figure
N = 8


def rows(name):
    with open(DATA / name, encoding="utf-8") as fh:
        for r in csv.DictReader(line for line in fh if not line.startswith("#")):
            if r["collective"] == "all_reduce" and int(r["size_bytes"]) >= 2 ** 21:
                yield int(r["size_bytes"]), float(r["time_us"])


def model_us(size, c0):
    eff = nccl.nvls_efficiency_of_chunk(nccl.nvls_chunk_bytes(size, N), c0)
    algbw = LINK_GBYTES_PER_S * eff / (1.0 + 1.0 / N)
    return nccl.HW_LAT_US["nvlink"]["nvls"]["simple"] + size / (1000.0 * algbw)


def loss(c0, data):
    return sum((math.log(model_us(s, c0)) - math.log(t)) ** 2 for s, t in data)


def main():
    h100 = list(rows("azure-nd-h100-v5.csv"))
    fit = minimize_scalar(lambda c: loss(c, h100), bounds=(0.0, 2 ** 17), method="bounded")
    c0 = fit.x
    print(f"c0 = {c0:.0f} bytes (fitted on {len(h100)} H100 rows; rms log error "
          f"{math.sqrt(fit.fun / len(h100)):.3f})")
    for name in ("azure-nd-h100-v5.csv", "azure-nd-h200-v5.csv"):
        data = list(rows(name))
        errs = [model_us(s, c0) / t - 1 for s, t in data]
        print(f"{name}: time error min {min(errs) * 100:+.1f}% max {max(errs) * 100:+.1f}% "
              f"(rms log {math.sqrt(loss(c0, data) / len(data)):.3f})")
        for (s, t), e in zip(data, errs):
            print(f"  {s:>11} measured {t:9.1f} us  model {model_us(s, c0):9.1f} us  {e * 100:+6.1f}%")


if __name__ == "__main__":
    main()
