"""Write the small trace samples in examples/traces/, one per built-in format, from a seeded
generator (G5 never downloads a trace; these only show each format's columns).

    python benchmarks/make_trace_samples.py        # rewrites examples/traces/*
"""
from __future__ import annotations

import datetime
import json
import pathlib

import numpy as np

OUT = pathlib.Path(__file__).resolve().parent.parent / "examples" / "traces"
N = 40


def main() -> None:
    rng = np.random.default_rng(20)
    gaps = rng.exponential(0.25, N)
    gaps[0] = 0.0
    t = np.cumsum(gaps)
    isl = np.clip(np.rint(1024 * np.exp(0.7 * rng.standard_normal(N))), 16, 8192).astype(int)
    osl = np.clip(np.rint(200 * np.exp(0.6 * rng.standard_normal(N))), 1, 1024).astype(int)
    prefix = rng.integers(0, 3, N)
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "sample-g5.csv", "w") as fh:
        fh.write("arrival_s,input_tokens,output_tokens,prefix_id,cached_tokens\n")
        for k in range(N):
            fh.write(f"{t[k]:.6f},{isl[k] + 512},{osl[k]},sys{prefix[k]},512\n")
    with open(OUT / "sample-g5.jsonl", "w") as fh:
        for k in range(N):
            fh.write(json.dumps({"arrival_s": round(float(t[k]), 6), "input_tokens": int(isl[k]),
                                 "output_tokens": int(osl[k])}) + "\n")
    start = datetime.datetime(2023, 11, 16, 18, 15, 46)
    with open(OUT / "sample-azure.csv", "w") as fh:
        fh.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for k in range(N):
            stamp = start + datetime.timedelta(microseconds=int(round(t[k] * 1e6)))
            fh.write(f"{stamp:%Y-%m-%d %H:%M:%S}.{stamp.microsecond:06d}0,{isl[k]},{osl[k]}\n")
    with open(OUT / "sample-mooncake.jsonl", "w") as fh:
        next_id = 3
        for k in range(N):
            blocks = -(-int(isl[k]) // 512)
            ids = [int(prefix[k])] + list(range(next_id, next_id + blocks - 1))
            next_id += blocks - 1
            fh.write(json.dumps({"timestamp": int(round(t[k] * 1000)), "input_length": int(isl[k]),
                                 "output_length": int(osl[k]), "hash_ids": ids}) + "\n")


if __name__ == "__main__":
    main()
