"""What the NVLS and NVLS-tree all-reduce rows of mid sizes show (a diagnostic; fits nothing,
changes nothing).

    python tools/nvls_mid_sizes.py

1. nccl-tests #309's two-node run (NCCL 2.26.2) against G5 at 128 KiB .. 64 MiB: G5's own
   choice (NCCL 2.29.2's tuner) and its time, and G5's time with the NVLS tree forced. From
   512 KiB the measured time is flat at 70-76 us up to 2 MiB, an NVLS tree's floor (NCCL 2.29.2's
   own NVLS-tree latency on two nodes is 25 + 2 x 20.9 = 66.8 us); NCCL 2.26.2's tuner rated the
   NVLS tree's network step at 14 us (src/graph/tuning.cc hwLat[NET][NVLS_TREE], v2.26.2-1;
   20.9 us since NCCL 2.28.9, commit dbc86fd0) and its bandwidth as nHeads x min(bwIntra,
   bwInter) x 5/6, so its NVLS tree (53 us + the transfer) overtakes tree LL128 at 512 KiB ..
   1 MiB (with 8 heads of 48 GB/s assumed: the run printed no algorithm), where 2.29.2's (66.8
   us) waits until 4 MiB. The forced column is G5's time of the algorithm the run ran. With the
   run's tuner (``nccl: {tuner: {release: '2.26.2'}}``, G5's substitutions for NCCL's graph
   bandwidths) the NVLS tree wins from 1 MiB; at 512 KiB tree LL128 stays ahead by 0.7 us (54.0
   against 54.7 us), a tie the run's TUNING log would settle.
2. The one-node NVLS-forced tables (Azure ND H100 v5 and H200 v5): at each NVLS chunk size
   (enqueue.cc calcCollChunking) the time is a straight line of the size; the script prints
   its slope (as busbw) and its intercept, and the intercept beyond NCCL's NVLS latency
   (25 us, tuning.cc hwLat[NVLINK][NVLS][SIMPLE]) in loops of nvlsChannels x nHeads chunks at
   that slope.
"""
from __future__ import annotations

import pathlib
import sys

import attrs

from g5core.inputs.systems import get_system
from g5core.session.collbench import collective_rows

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from fit_net_floors import rows  # noqa: E402

from g5plugins.collectives import nccl  # noqa: E402

NVLS_LATENCY_US = nccl.HW_LAT_US["nvlink"]["nvls"]["simple"]


def two_nodes() -> None:
    system = get_system("h100-sxm")
    forced = attrs.evolve(system, nccl={"all_reduce": {"algorithm": "nvls_tree"}})
    measured = {s: t for g, s, t in rows("nccl-tests-issue-309.csv", "all_reduce", "qoofyk-bm") if g == 16}
    sizes = [s for s in sorted(measured) if 2 ** 17 <= s <= 2 ** 26]
    own = collective_rows("all_reduce", "h100-sxm", 16, sizes)
    nvls_tree = collective_rows("all_reduce", forced, 16, sizes)
    old = collective_rows("all_reduce", attrs.evolve(system, nccl={"tuner": {"release": "2.26.2"}}), 16, sizes)
    print("nccl-tests #309 qoofyk-bm, 2 x 8 H100 (time us; error = G5 / measured - 1); G5's choice with its "
          "default (2.29.2) tuner and with the run's 2.26.2 tuner")
    print(f"{'size':>10} {'measured':>9} {'G5 choice':>16} {'G5':>7} {'err':>6} {'2.26.2 choice':>16} {'G5':>7} "
          f"{'err':>6} {'G5 nvls_tree':>12} {'err':>6}")
    for size, a, c, b in zip(sizes, own, old, nvls_tree):
        m, ta, tc, tb = measured[size], a["time_s"] * 1e6, c["time_s"] * 1e6, b["time_s"] * 1e6
        choice, choice_c = f"{a['algorithm']}/{a['protocol']}", f"{c['algorithm']}/{c['protocol']}"
        print(f"{size:>10} {m:>9.1f} {choice:>16} {ta:>7.1f} {ta / m - 1:>+6.0%} {choice_c:>16} {tc:>7.1f} "
              f"{tc / m - 1:>+6.0%} {tb:>12.1f} {tb / m - 1:>+6.0%}")


def line(points):
    n = len(points)
    sx, sy = sum(s for s, _ in points), sum(t for _, t in points)
    sxx, sxy = sum(s * s for s, _ in points), sum(s * t for s, t in points)
    slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return slope, (sy - slope * sx) / n


def one_node(name: str) -> None:
    measured = {s: t for g, s, t in rows(name, "all_reduce") if g == 8}
    print(f"{name}, one node of 8, NVLS forced: time = intercept + size / rate at each chunk size")
    for chunk in (32768, 65536, 131072):
        points = [(s, t) for s, t in sorted(measured.items()) if nccl.nvls_chunk_bytes(s, 8) == chunk]
        slope, intercept = line(points)
        loop_us = nccl.nvls_loop_bytes(chunk, 8) * slope
        print(f"  chunk {chunk // 1024:>3} KiB ({points[0][0] >> 20} .. {points[-1][0] >> 20} MiB): "
              f"busbw {2 * 7 / 8 / slope / 1e3:6.1f} GB/s, intercept {intercept:6.1f} us, "
              f"(intercept - {NVLS_LATENCY_US:g}) / loop = {(intercept - NVLS_LATENCY_US) / loop_us:.2f} loops")


if __name__ == "__main__":
    two_nodes()
    for table in ("azure-nd-h100-v5.csv", "azure-nd-h200-v5.csv"):
        one_node(table)
