"""Pipelined throughput and chunked-prefill TTFT against the micro-batch count (README,
"Pipeline throughput and micro-batches"): llama-3.1-8b on 4 H100s.

    python benchmarks/pp_microbatches.py
"""
from __future__ import annotations

from g5core.session.run import run


def config(phase: str, m: int, pp: int = 4, dp: int = 1, batch: int = 8, seq_len: int = 2048) -> dict:
    return {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": pp * dp,
            "parallel": {"dp": dp, "tp": 1, "pp": pp, "cp": 1}, "phase": phase, "batch": batch, "seq_len": seq_len,
            "plugins": {"pp": {"microbatches": m}}}


def main() -> None:
    print("decode, batch 8 per micro-batch, context 2048")
    for m in (1, 2, 3, 4, 8):
        d = run(config("decode", m)).to_json_dict()
        p = d.get("pipeline", {})
        print(f"  pp=4 m={m}: TPOT {d['tpot_s'] * 1e3:.3f} ms, step interval "
              f"{p.get('step_interval_s', d['tpot_s']) * 1e3:.3f} ms, {d['tokens_per_s_per_chip']:.1f} tokens/s/chip")
    d = run(config("decode", 1, pp=1, dp=4)).to_json_dict()
    print(f"  dp=4 m=1: TPOT {d['tpot_s'] * 1e3:.3f} ms, {d['tokens_per_s_per_chip']:.1f} tokens/s/chip")
    print("prefill, one 32768-token prompt")
    for m in (1, 2, 4, 8):
        d = run(config("prefill", m, batch=1, seq_len=32768)).to_json_dict()
        print(f"  pp=4 m={m}: TTFT {d['ttft_s']:.3f} s, {d['tokens_per_s_per_chip']:.0f} tokens/s/chip")


if __name__ == "__main__":
    main()
