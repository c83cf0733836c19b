"""TP x SP (Ulysses) on 8 chips of 80 GB: the setting of the Ulysses field notes.

    python3 -m pip install -e . -e contrib/g5-ulysses
    python3 examples/ulysses_tp_sp.py                 # llama-3.1-70b (64 query / 8 KV heads), bf16
    python3 examples/ulysses_tp_sp.py --weights fp8   # the same with fp8 weights
    python3 examples/ulysses_tp_sp.py --model qwen3-235b-a22b --weights fp8 --replicate-kv   # MoE, 4 KV heads

For every split of 8 chips into tp x sp that the head counts allow (8x1, 4x2, 2x4, 1x8) and
every context length, it prints the per-chip memory of one sequence, its TTFT, the largest
batch whose memory fits, and the TTFT and prefill throughput at that batch. It writes no
file. The notes' layout names ("TP4, SP4, DP2" on 8 chips) do not multiply to 8; here `sp`
is a factor of the chip count, as in DeepSpeed-Ulysses.
"""
from __future__ import annotations

import argparse
import sys

from g5core import G5Error
from g5core.sim.memory import GIB, memory_report
from g5core.session.run import make_plan, run

LAYOUTS = ((8, 1), (4, 2), (2, 4), (1, 8))
MAX_BATCH = 4096


def config(model: str, system: str, tp: int, sp: int, seq_len: int, batch: int, weights: str,
           replicate_kv: bool = False) -> dict:
    raw = {"model": model, "system": system, "chips": tp * sp,
           "parallel": {"dp": 1, "pp": 1, "cp": 1, "tp": tp, "sp": sp}, "phase": "prefill", "batch": batch,
           "seq_len": seq_len, "dtypes": {"weights": weights}}
    if replicate_kv:
        raw["plugins"] = {"ulysses": {"replicate_kv": True}}
    return raw


def fits(raw: dict) -> bool:
    return memory_report(make_plan(raw).ctx).fits


def largest_batch(raw: dict) -> int:
    """The largest batch whose per-chip memory fits (0 when one sequence does not)."""
    if not fits(dict(raw, batch=1)):
        return 0
    lo, hi = 1, 2
    while hi <= MAX_BATCH and fits(dict(raw, batch=hi)):
        lo, hi = hi, hi * 2
    hi = min(hi, MAX_BATCH + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(dict(raw, batch=mid)) else (lo, mid)
    return lo


def row(model, system, tp, sp, seq_len, weights, replicate_kv=False) -> list[str]:
    raw = config(model, system, tp, sp, seq_len, 1, weights, replicate_kv and sp > 1)
    one = run(raw)
    mem = one.memory.max_total_bytes / GIB
    best = largest_batch(raw)
    cells = [f"{tp}x{sp}", f"{seq_len // 1024}K", f"{mem:.1f}", f"{one.latency_s:.2f}",
             f"{100 * _a2a_share(one):.1f}%", str(best)]
    if best:
        full = run(dict(raw, batch=best))
        cells += [f"{full.latency_s:.2f}", f"{best * seq_len / full.latency_s:,.0f}",
                  f"{full.memory.max_total_bytes / GIB:.1f}"]
    else:
        cells += ["-", "-", "-"]
    return cells


def _a2a_share(out) -> float:
    """Exposed all-to-all time as a share of the TTFT."""
    ov = out.sim.overlap["by_reason"].get("ulysses_a2a")
    return ov["exposed_comm_s"] / out.latency_s if ov else 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-70b")
    ap.add_argument("--system", default="h100-sxm")
    ap.add_argument("--weights", default="bf16", help="weight dtype (bf16, fp8, ...)")
    ap.add_argument("--seq-lens", default="32768,65536,131072")
    ap.add_argument("--replicate-kv", action="store_true",
                    help="accept replicated KV heads where a TP rank has fewer KV heads than sp")
    args = ap.parse_args(argv)
    header = ["tp x sp", "context", "GiB/chip (b=1)", "TTFT b=1 (s)", "a2a exposed", "max batch",
              "TTFT max b (s)", "prefill tok/s at max b", "GiB/chip at max b"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    try:
        for seq_len in (int(s) for s in args.seq_lens.split(",")):
            for tp, sp in LAYOUTS:
                print("| " + " | ".join(row(args.model, args.system, tp, sp, seq_len, args.weights, args.replicate_kv)) + " |", flush=True)
    except G5Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
