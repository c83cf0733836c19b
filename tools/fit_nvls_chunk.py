"""Fit the per-chunk cost and the pipeline fill of NVLS all-reduce to nccl-tests measurements (a
microbenchmark of that very operation), and check them on another machine's measurements.

    python tools/fit_nvls_chunk.py

Model (g5plugins/collectives/nccl.py, ``nvls_efficiency_of_chunk`` and ``NVLS_FILL_LOOPS``):
NCCL splits an NVLS all-reduce into chunks whose size falls with the message (enqueue.cc
calcCollChunking: 128 KiB, then 64, 32 and 16 KiB below 64, 8 and 2 x (channels x heads x chunk)
bytes). Each chip's traffic to and from the switch, ``N (1 + 1/n)`` each way, runs at NCCL's own
nvlsEfficiency (tuning.cc: 0.85 on Hopper) x ``chunk / (chunk + c0)`` of its link: each chunk pays
a fixed cost worth ``c0`` bytes. Before its first chunk is done the op holds ``F`` loops of its
chunk pipeline (a loop: every NVLS channel hands each head one chunk; a message smaller than a
loop fills it with itself) at that rate, beyond NCCL's NVLS latency of 25 us:

    time = 25 us + (N + F x min(loop, N)) / rate(chunk)

``c0`` and ``F`` are fitted by least squares on log time to the two public NVLS all-reduce tables
of one 8 x H100 node from 2 MiB: the Azure ND H100 v5 run with NVLS forced (NCCL 2.18.5, 2 MiB ..
8 GiB) and aiconfigurator's NCCL 2.29.2 table (2 .. 512 MiB, where NCCL's tuner runs NVLS), then
checked, unchanged, on the ND H200 v5 run of the Azure benchmark. Why two terms: the time at one
chunk size is a straight line of the size (``python tools/nvls_mid_sizes.py``) whose intercept
lies one to two loops beyond NCCL's 25 us and whose slope approaches 0.85 of the link at 128 KiB
chunks; one cost per chunk and no fill (the previous model, c0 = 27.7 KB) bent the slope to make
up for the intercept and put 256 and 512 MiB 7-9% slow and 8 MiB 16% fast.
"""
from __future__ import annotations

import csv
import math
import pathlib

from scipy.optimize import minimize

from g5plugins.collectives import nccl

DATA = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "nccl"
LINK_GBYTES_PER_S = 370.8           # H100/H200: 18 NVLinks x 20.6 GB/s (NCCL topo.h), the shipped figure
N = 8
HOPPER = 9.0
FITTED = ("azure-nd-h100-v5.csv", "aiconfigurator-h100-sxm-nccl2.29.2.csv")
CHECKED = ("azure-nd-h200-v5.csv",)


def rows(name):
    """(size, time) of the table's 8-GPU all-reduce rows from 2 MiB."""
    with open(DATA / name, encoding="utf-8") as fh:
        for r in csv.DictReader(line for line in fh if not line.startswith("#")):
            if r["collective"] == "all_reduce" and int(r["gpus"]) == N and int(r["size_bytes"]) >= 2 ** 21:
                yield int(r["size_bytes"]), float(r["time_us"])


def model_us(size, c0, fill_loops):
    chunk = nccl.nvls_chunk_bytes(size, N)
    algbw = LINK_GBYTES_PER_S * nccl.nvls_efficiency_of_chunk(chunk, HOPPER, c0) / (1.0 + 1.0 / N)
    held = size + fill_loops * min(nccl.nvls_loop_bytes(chunk, N), size)
    return nccl.HW_LAT_US["nvlink"]["nvls"]["simple"] + held / (1000.0 * algbw)


def loss(params, data):
    return sum((math.log(model_us(s, *params)) - math.log(t)) ** 2 for s, t in data)


def fit():
    data = [r for name in FITTED for r in rows(name)]
    best = minimize(lambda p: loss(p, data), [20000.0, 1.0], method="Nelder-Mead",
                    options={"xatol": 1e-3, "fatol": 1e-12, "maxiter": 4000})
    return best.x, math.sqrt(best.fun / len(data)), len(data)


def main():
    (c0, fill), rms, n = fit()
    print(f"c0 = {c0:.0f} bytes, fill = {fill:.3f} loops (fitted on {n} H100 rows of {', '.join(FITTED)}; "
          f"rms log error {rms:.3f}); nccl.py has {nccl.NVLS_CHUNK_COST_BYTES:.0f} bytes, {nccl.NVLS_FILL_LOOPS} loops")
    for name in FITTED + CHECKED:
        data = list(rows(name))
        errs = [model_us(s, c0, fill) / t - 1 for s, t in data]
        print(f"{name}{' (not fitted)' if name in CHECKED else ''}: time error min {min(errs) * 100:+.1f}% "
              f"max {max(errs) * 100:+.1f}% (rms log {math.sqrt(loss((c0, fill), data) / len(data)):.3f})")
        for (s, t), e in zip(data, errs):
            print(f"  {s:>11} measured {t:9.1f} us  model {model_us(s, c0, fill):9.1f} us  {e * 100:+6.1f}%")


if __name__ == "__main__":
    main()
