"""The field notes' comparison on DeepSeek-V3, one 8-GPU H200 node: TP8 against Ulysses with the
experts sharded over all 8 GPUs (sp=8, ep=8; and tp=2 x sp=4, ep=8), at 32K, 64K and 128K tokens.

    python benchmarks/ulysses_deepseek_v3.py     # about a minute

For each layout and length: the largest batch whose memory ledger fits (prefill: prompts of S
tokens; decode: sequences at a context of S), the throughput at that batch (prefill: prompt
tokens per second, b x S / TTFT; decode: generated tokens per second, b / TPOT) and the peak
memory per GPU there. Weights bf16 with fp8 experts, bf16 KV cache. The MLA latent has no
heads to shard, so Ulysses replicates it on every SP rank (``replicate_kv``), as TP does.
Prints a Markdown table (the table of contrib/g5-ulysses/README.md; needs g5-ulysses installed).
"""
from __future__ import annotations

import sys

from g5core.sim.memory import GIB, memory_report
from g5core.session.run import make_plan, run

BASE = {"model": "deepseek-v3", "system": "h200", "chips": 8, "batch": 1,
        "dtypes": {"weights": {"default": "bf16", "experts": "fp8"}, "activations": "bf16", "kv_cache": "bf16"}}
LAYOUTS = {
    "TP8": {"parallel": {"dp": 1, "tp": 8, "pp": 1, "cp": 1, "sp": 1, "ep": 1}},
    "Ulysses sp=8 + EP8": {"parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "sp": 8, "ep": 8},
                           "plugins": {"ulysses": {"replicate_kv": True}}},
    # the notes' TP4 x SP4 needs 16 GPUs; on 8, TP2 x SP4 (tp halves the replicated attention weights)
    "Ulysses tp=2 sp=4 + EP8": {"parallel": {"dp": 1, "tp": 2, "pp": 1, "cp": 1, "sp": 4, "ep": 8},
                                "plugins": {"ulysses": {"replicate_kv": True}}},
}
LENGTHS = (32768, 65536, 131072)


def config(layout: str, phase: str, seq_len: int, batch: int) -> dict:
    return {**BASE, **LAYOUTS[layout], "phase": phase, "seq_len": seq_len, "batch": batch}


def fits(cfg: dict) -> bool:
    return memory_report(make_plan(cfg).ctx).fits


def largest_batch(layout: str, phase: str, seq_len: int) -> int:
    """The largest batch that fits (a multiple of sp in Ulysses decode, which splits the batch)."""
    step = LAYOUTS[layout]["parallel"]["sp"] if phase == "decode" else 1
    if not fits(config(layout, phase, seq_len, step)):
        return 0
    lo, hi = step, 2 * step
    while fits(config(layout, phase, seq_len, hi)):
        lo, hi = hi, 2 * hi
    while hi - lo > step:  # lo fits, hi does not
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(config(layout, phase, seq_len, mid)) else (lo, mid)
    return lo


def measure(layout: str, phase: str, seq_len: int) -> dict:
    b = largest_batch(layout, phase, seq_len)
    if b == 0:
        return {"batch": 0, "smallest": LAYOUTS[layout]["parallel"]["sp"] if phase == "decode" else 1}
    out = run(config(layout, phase, seq_len, b))
    tokens_per_s = b * seq_len / out.latency_s if phase == "prefill" else b / out.latency_s
    return {"batch": b, "latency_s": out.latency_s, "tokens_per_s": tokens_per_s,
            "peak_gib": out.memory.max_total_bytes / GIB}


def main() -> int:
    print("| S | phase | layout | largest batch | latency | throughput (tokens/s) | peak memory per GPU |")
    print("|---|---|---|---|---|---|---|")
    for seq_len in LENGTHS:
        for phase in ("prefill", "decode"):
            for layout in LAYOUTS:
                r = measure(layout, phase, seq_len)
                if not r["batch"]:
                    print(f"| {seq_len // 1024}K | {phase} | {layout} | none: batch {r['smallest']} (the smallest "
                          f"it runs) does not fit | | | |")
                    continue
                what = "TTFT" if phase == "prefill" else "TPOT"
                print(f"| {seq_len // 1024}K | {phase} | {layout} | {r['batch']} | {what} {r['latency_s'] * 1e3:.1f} ms | "
                      f"{r['tokens_per_s']:.0f} | {r['peak_gib']:.1f} GiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
