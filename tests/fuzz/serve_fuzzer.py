"""A seeded fuzzer of the serving surface: ``g5 serve`` run as the command line runs it, on
small valid serving configurations and on ones with one to three mutations of the
``serving:`` block (instances, scheduler limits, router, block size, disaggregation pools),
the workload (rates, length distributions and their parameters, histograms, prefixes,
conversations, closed loop), the flags (``--requests``, ``--rate``, ``--isl``/``--osl``,
``--slo``, ``--seed``), trace files of each format with bad lines (missing columns, NaN,
negative or decreasing times, huge counts, empty, header only, binary, non-UTF-8), and
output paths (some of them an input).

Every case must end in one of two outcomes:

- exit 0 with a JSON result whose invariants hold: every request completed once
  (``completed == requests``), p50 <= p90 <= p99 of every metric, TTFT > 0, goodput <=
  throughput, the loop's own checks (``conservation``: token counts, order, FCFS, blocks
  back to zero) all 0;
- exit 2 with a one-line ``g5: error:`` message;

and no input file may change. Anything else (a traceback, another exit code, a message of
several lines, a broken invariant, a case slower than ``--slow-s``) is a failure. Case ``i``
of seed ``s`` is made from ``random.Random(f"{s}:{i}")`` alone, so any case replays by itself
(``--only I``).

    python tests/fuzz/serve_fuzzer.py --cases 3000 --seed 1   # the long run; failures as JSON lines
    python tests/fuzz/serve_fuzzer.py --cases 20 --seed 7 --show

``tests/test_serve_fuzz.py`` runs a small fixed sample in the suite.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import yaml

JUNK = [None, True, "", "x", -1, 0, 1, 0.5, 1e-300, 1e300, float("nan"), float("inf"), 10 ** 400, 2 ** 63, [],
        [1, 2], {}, {"a": 1}, "8"]
LENGTHS = ["1", "64", "300", "uniform:10:500", "normal:200:50", "lognormal:200:0.5", "hist:100=0.5,400=0.5",
           "200@1:300", "hist:100=nan", "uniform:500:10", "normal:1e999:1", "lognormal:100:1e9", "0", "-5",
           "2000000", "1e6", "x", "hist:", "uniform:1", str(2 ** 70), "1000000"]
SLOS = ["ttft=2s", "ttft=2s,tpot=50ms", "ttft_p90=1s", "e2e=10s,queue=1ms", "ttft=0s", "ttft=nan s", "bogus=1s",
        "ttft=2", "ttft_p100=1s", "ttft=1e999s", "ttft=2s,ttft=3s", ""]
ARRIVALS = [{"kind": "poisson", "rate_per_s": 20}, {"kind": "gamma", "rate_per_s": 10, "cv": 2},
            {"kind": "closed", "concurrency": 4}, {"kind": "gamma", "rate_per_s": 10, "cv": 100},
            {"kind": "gamma", "rate_per_s": 1, "cv": 1e-200}, {"kind": "poisson", "rate_per_s": 1e-300},
            {"kind": "poisson", "rate_per_s": 1e300}, {"kind": "closed", "concurrency": 0}, {"kind": "x"}]
#: what a trace line may be replaced with (the format's own columns come first)
BAD_CELLS = ["", "nan", "-1", "inf", "1e400", "x", str(2 ** 64), "1.5", "0", "99999999999999999999"]


def _mutate(rng: random.Random, data: dict, depth: int = 0) -> None:
    key = rng.choice(sorted(data, key=str))
    if isinstance(data[key], dict) and data[key] and depth < 2 and rng.random() < 0.5:
        _mutate(rng, data[key], depth + 1)
    else:
        data[key] = rng.choice(JUNK)


def _trace(rng: random.Random, folder: Path, n: int) -> Path:
    """A trace file of one of the built-in formats, sometimes with a bad line or worse."""
    kind = rng.choice(["g5csv", "g5jsonl", "azure", "mooncake"])
    rows = []
    t = 0.0
    for _ in range(rng.randint(1, 12)):
        t += rng.choice([0.0, 0.01, 0.2, 1.0])
        rows.append([t, rng.choice([50, 200, 700]), rng.choice([1, 4, 16])])
    if kind == "g5csv":
        cols = ["arrival_s", "input_tokens", "output_tokens"]
        cells = [[repr(r[0]), str(r[1]), str(r[2])] for r in rows]
    elif kind == "azure":
        cols = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
        cells = [[f"2023-11-16 18:{int(r[0] // 60) % 60:02d}:{r[0] % 60:09.6f}", str(r[1]), str(r[2])] for r in rows]
    else:
        cols = (["arrival_s", "input_tokens", "output_tokens"] if kind == "g5jsonl"
                else ["timestamp", "input_length", "output_length"])
        cells = [[r[0] * (1000 if kind == "mooncake" else 1), r[1], r[2]] for r in rows]
    bad = rng.random()
    if bad < 0.4:
        line, col = rng.randrange(len(cells)), rng.randrange(3)
        choice = rng.random()
        if choice < 0.2:
            cells[line] = cells[line][:2]                          # a missing column
        elif choice < 0.3 and line:
            cells[line][0] = cells[0][0] if kind == "azure" else -1   # negative (or equal) time
        else:
            cells[line][col] = rng.choice(BAD_CELLS)
    suffix = ".csv" if kind in ("g5csv", "azure") else ".jsonl"
    p = folder / f"trace-{n}{suffix}"
    if suffix == ".csv":
        text = ",".join(cols) + "\n" + "".join(",".join(map(str, c)) + "\n" for c in cells)
    else:
        lines = []
        for c in cells:
            rec = dict(zip(cols, c))
            if kind == "mooncake" and rng.random() < 0.3:
                rec["hash_ids"] = rng.choice([[1, 2], [], "x", [[1]], list(range(3))])
            lines.append(json.dumps(rec, allow_nan=True))
        text = "\n".join(lines) + "\n"
    if 0.4 <= bad < 0.5:
        text = rng.choice(["", ",".join(cols) + "\n" if suffix == ".csv" else "\n", "\x00\x01\x02binary",
                           "not,a,trace\n1,2,3\n", "{\"a\": [" * 50])
    p.write_bytes(b"\xff\xfe\x80" + text.encode() if 0.5 <= bad < 0.53 else text.encode())
    return p


def make_case(seed: int, index: int, folder: Path) -> dict:
    """Case ``index`` of ``seed``: ``{"config": mapping, "args": [...], "inputs": [paths]}``
    (the configuration file and any trace are written to ``folder``)."""
    rng = random.Random(f"{seed}:{index}")
    serving: dict = {"instances": rng.choice([1, 1, 2, 3]),
                     "scheduler": {"max_num_seqs": rng.choice([4, 64, 256]),
                                   "max_num_batched_tokens": rng.choice([512, 2048, 8192]),
                                   "block_size": rng.choice([16, 16, 32, 1])}}
    if rng.random() < 0.3:
        serving["router"] = rng.choice(["round_robin", "least_outstanding_tokens", "least_kv"])
    if rng.random() < 0.15:
        serving.pop("instances")
        serving["disaggregation"] = {"prefill": {"instances": 1, "chips": 1},
                                     "decode": {"instances": rng.choice([1, 2]), "chips": 1}}
    args: list = []
    inputs: list = []
    mode = rng.random()
    if mode < 0.45:        # flags
        args += ["--requests", str(rng.choice([1, 3, 8, 20] * 3 + [0, -1, 10 ** 9, 10 ** 30])),
                 "--isl", rng.choice(LENGTHS[:8] * 3 + LENGTHS), "--osl", rng.choice(LENGTHS[:3] * 6 + LENGTHS)]
        if rng.random() < 0.8:
            args += ["--rate", str(rng.choice([5.0, 50.0] * 4 + [1e-300, 0.0, -1.0, 1e300, float("nan"), 1e9]))]
        else:
            args += ["--concurrency", str(rng.choice([1, 4, 1, 4, 0, 10 ** 12]))]
        if rng.random() < 0.2:
            args += ["--workload", rng.choice(["poisson", "gamma:cv=2", "gamma:cv=100", "gamma:cv=0", "closed",
                                               "gamma:cv=nan", "weird", "poisson:rate=x"])]
        if rng.random() < 0.3:
            args += ["--seed", str(rng.choice([0, 1, -1, 2 ** 70]))]
    elif mode < 0.75:      # the configuration's serving.workload
        wl: dict = {"requests": rng.choice([1, 4, 12, 10 ** 8]), "arrival": dict(rng.choice(ARRIVALS)),
                    "input_tokens": rng.choice([64, 300, "uniform:50:600", {"kind": "normal", "mean": 200, "std": 40},
                                                {"kind": "hist", "bins": {100: 1, 400: 1}}]),
                    "output_tokens": rng.choice([1, 4, 16, "lognormal:8:0.5"]), "seed": rng.randint(0, 5)}
        if rng.random() < 0.15:
            wl["prefix"] = {"groups": rng.choice([1, 3]), "tokens": rng.choice([32, 128])}
        elif rng.random() < 0.15 and wl["arrival"]["kind"] != "closed":
            wl["conversation"] = {"turns": rng.choice([1, 2, 3]), "think_s": rng.choice([0.0, 0.5])}
        serving["workload"] = wl
    else:                  # a trace, given by flag or by the configuration
        trace = _trace(rng, folder, index)
        inputs.append(trace)
        if rng.random() < 0.5:
            args += ["--workload", str(trace)]
        else:
            serving["workload"] = {"trace": str(trace)}
        if rng.random() < 0.3:
            args += ["--requests", str(rng.choice([1, 2, 0]))]
    if rng.random() < 0.25:
        args += ["--slo", rng.choice(SLOS)]
    for _ in range(rng.choice([0] * 7 + [1, 1, 2, 3])):
        _mutate(rng, serving)
    config = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 1, "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1},
              "serving": serving}
    cfg = folder / f"case-{index}.yaml"
    cfg.write_text(yaml.safe_dump(config, default_flow_style=None))
    inputs.append(cfg)
    if rng.random() < 0.2:   # an output path: fresh, or one of the inputs, or a folder
        option = rng.choice(["--requests-csv", "--trace"])
        target = rng.choice([folder / f"out-{index}.csv"] * 3 + [folder, *inputs])
        args += [option, str(target)]
    return {"config": config, "args": [str(cfg), *args], "inputs": [str(p) for p in inputs]}


def _digest(paths) -> dict:
    return {p: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths if Path(p).is_file()}


def check_result(out: dict) -> str:
    """'' when the result's invariants hold, else what broke."""
    if out["completed"] != out["requests"]:
        return f"completed {out['completed']} of {out['requests']} requests"
    bad = {k: v for k, v in out["conservation"].items() if v}
    if bad:
        return f"loop invariants {bad}"
    for metric in ("queue_s", "ttft_s", "tpot_s", "itl_s", "e2e_s"):
        s = out[metric]
        if s["p50"] is not None and not s["p50"] <= s["p90"] <= s["p99"]:
            return f"{metric} percentiles out of order {s}"
    if not out["ttft_s"]["p50"] is None and not min(out["ttft_s"]["p50"], out["ttft_s"]["mean"]) > 0:
        return f"TTFT not above 0: {out['ttft_s']}"
    good = out.get("goodput") or {}
    tput = out["throughput"]
    for key, value in good.items():
        if key in tput and isinstance(value, (int, float)) and value > tput[key] * (1 + 1e-12):
            return f"goodput {key} {value} above throughput {tput[key]}"
    return ""


def run_case(case: dict, slow_s: float) -> tuple[str, str]:
    """('ok' | 'error' | 'FAIL', detail) of one case, run through the command line."""
    from click.testing import CliRunner

    from g5core.present.cli import main

    before = _digest(case["inputs"])
    t0 = time.perf_counter()
    res = CliRunner().invoke(main, ["serve", *case["args"], "--json"])
    wall = time.perf_counter() - t0
    if _digest(case["inputs"]) != before:
        return "FAIL", "an input file changed"
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        tb = "".join(traceback.format_exception(res.exception)[-4:])
        return "FAIL", f"{type(res.exception).__name__}: {res.exception}; {tb}"
    if wall > slow_s:
        return "FAIL", f"ran {wall:.1f} s (exit {res.exit_code})"
    if res.exit_code == 2:
        lines = [line for line in res.output.splitlines() if line.strip()]
        if len(lines) != 1 or not lines[0].startswith(("g5: error:", "Error:", "Usage:")):
            if not (len(lines) >= 2 and lines[-1].startswith("Error:")):    # click's own usage errors
                return "FAIL", f"exit 2 without a one-line error: {res.output[-400:]!r}"
        if "serving invariants violated" in res.output:
            return "FAIL", lines[-1]
        return "error", lines[-1]
    if res.exit_code != 0:
        return "FAIL", f"exit {res.exit_code}: {res.output[-400:]!r}"
    try:
        out = json.loads(res.output)
    except ValueError:
        return "FAIL", f"not JSON: {res.output[-400:]!r}"
    broken = check_result(out)
    if broken:
        return "FAIL", broken
    return "ok", f"{out['requests']} requests, ttft p50 {out['ttft_s']['p50']}"


def fuzz(cases: int, seed: int, slow_s: float = 30.0, show: bool = False, out=sys.stdout, progress: int = 0,
         only=None) -> dict:
    counts = {"ok": 0, "error": 0, "FAIL": 0}
    failures = []
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as d:
        os.chdir(d)   # relative output paths land in the scratch folder
        try:
            for n in (only if only is not None else range(cases)):
                case = make_case(seed, n, Path(d))
                outcome, detail = run_case(case, slow_s)
                counts[outcome] += 1
                if show or outcome == "FAIL":
                    print(json.dumps({"case": n, "outcome": outcome, "detail": detail[:600], "args": case["args"],
                                      "config": case["config"]}, default=str), file=out, flush=True)
                if outcome == "FAIL":
                    failures.append((n, detail))
                if progress and (n + 1) % progress == 0:
                    print(json.dumps({"done": n + 1, **counts}), file=sys.stderr, flush=True)
        finally:
            os.chdir(cwd)
    return {"seed": seed, "cases": cases, **counts, "failures": failures}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--slow-s", type=float, default=30.0, help="a case slower than this fails")
    ap.add_argument("--show", action="store_true", help="print every case, not only failures")
    ap.add_argument("--only", type=int, action="append", metavar="I", help="run case I only (repeatable)")
    ap.add_argument("--progress", type=int, default=0, metavar="N", help="a progress line on stderr every N cases")
    args = ap.parse_args()
    summary = fuzz(args.cases, args.seed, args.slow_s, args.show, progress=args.progress, only=args.only)
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}))
    return 1 if summary["FAIL"] else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
