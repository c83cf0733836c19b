"""A seeded fuzzer of G5's input boundary: configurations, Hugging Face config.json files
and system files, sane and absurd, each run as ``g5 run`` runs it (``g5core.session.run.run``).

Every case must end in one of two outcomes:

- a result: finite latency, the six conservation KPIs at 0, standard JSON;
- a G5 error: one line (the command line prints it and exits 2).

Anything else is a failure: another exception, a non-finite number, a multi-line error,
or a case slower than ``--slow-s`` (a small input that runs for long is a defect too).
Cases are made from ``random.Random(seed)``: the same seed gives the same cases.

    python tests/fuzz/fuzzer.py --cases 5000 --seed 1       # the long run; failures as JSON lines
    python tests/fuzz/fuzzer.py --cases 20 --seed 7 --show  # print the cases too

``tests/test_fuzz_sample.py`` runs a small fixed sample in the suite.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
HF_FILES = ["llama-3.1-8b.json", "deepseek-v3.json", "mixtral-8x7b.json", "qwen2.5-72b.json", "qwen3-235b-a22b.json"]
MODELS = ["llama-3.1-8b", "llama-3.1-70b", "mixtral-8x7b", "deepseek-v3", "qwen3-235b-a22b"]
#: ops and flows each case may build (a larger one is a ResourceError, an allowed outcome)
MAX_OPS = 20_000

JUNK = [None, True, False, "", "x", "8", -1, 0, 1, 2, 0.5, -0.0, 1e-300, 1e300, 1e308, float("nan"), float("inf"),
        10 ** 400, 2 ** 63, [], [1, 2], {}, {"a": 1}, "1e9"]
MAGNITUDES = [0.0, 1e-300, 1e-9, 4e-6, 1.0, 50e9, 1e15, 1e300, 1e308, 10 ** 401, -1.0]


def _catalog_systems() -> list[str]:
    from g5core.inputs.systems import CATALOG_NAMES
    return list(CATALOG_NAMES)


def _base_system() -> dict:
    from g5core.inputs.systems import get_system
    return get_system("h100-sxm").to_dict()


def _mutate(rng: random.Random, data: dict, depth: int = 0) -> None:
    """Put a junk value or an absurd magnitude somewhere in ``data`` (nested mappings too)."""
    key = rng.choice(sorted(data, key=str))
    if isinstance(data[key], dict) and data[key] and depth < 2 and rng.random() < 0.5:
        _mutate(rng, data[key], depth + 1)
    else:
        data[key] = rng.choice(JUNK + MAGNITUDES)


def make_case(rng: random.Random, folder: Path, n: int) -> dict:
    """One case: the configuration mapping (with its model and system files written to
    ``folder``), described so that it can be replayed."""
    tp, cp = rng.choice([1, 2, 4, 8]), rng.choice([1, 1, 2, 4, 16])
    pp, dp = rng.choice([1, 1, 2]), rng.choice([1, 1, 2, 4])
    raw = {"model": rng.choice(MODELS + ["HF"] * 3), "system": rng.choice(_catalog_systems() + ["FILE"] * 3),
           "chips": dp * tp * pp * cp,
           "parallel": {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": 1},
           "phase": rng.choice(["prefill", "decode"]),
           "batch": rng.choice([1, 2, 4, 8, 3, 64, 2 ** 20]),
           "seq_len": rng.choice([64, 1024, 4096, 16384, 131072] * 4 + [1000, 2 ** 30, 2 ** 41]),
           "dtypes": rng.choice([{}, {}, {"weights": "fp8"}, {"kv_cache": "fp8"},
                                 {"weights": {"default": "bf16", "ffn": "fp8"}}] * 4 + [{"weights": "int3"}]),
           "path": rng.choice(["g5", "g5", "g5", "math"] if cp == 1 else ["g5"])}
    if raw["model"] in ("mixtral-8x7b", "deepseek-v3", "qwen3-235b-a22b", "HF") and rng.random() < 0.5:
        raw["parallel"]["ep"] = rng.choice([e for e in (1, 2, 4, 8) if (dp * tp) % e == 0])
    if cp == 1 and rng.random() < 0.2:
        raw["parallel"]["sp"] = rng.choice([2, 4])
        raw["chips"] *= raw["parallel"]["sp"]
    if rng.random() < 0.15:
        raw["tp_sp"] = True
    if rng.random() < 0.2:
        _mutate(rng, raw)
    if raw.get("model") == "HF":
        hf = json.loads((ROOT / "tests" / "data" / "hf" / rng.choice(HF_FILES)).read_text())
        hf["num_hidden_layers"] = rng.choice([1, 2, 3, 4])
        if "first_k_dense_replace" in hf:
            hf["first_k_dense_replace"] = rng.randint(0, hf["num_hidden_layers"] - 1)
        if rng.random() < 0.3:
            hf["hidden_size"] = rng.choice([64, 128, 4096, 10 ** 300])
        if rng.random() < 0.25:
            _mutate(rng, hf)
        if rng.random() < 0.03:
            hf = {"model_type": json.loads("[" * 200 + "]" * 200)}
        p = folder / f"hf-{n}.json"
        p.write_text(json.dumps(hf, default=str))
        raw["model"] = str(p)
    if raw.get("system") == "FILE":
        sysd = _base_system()
        if rng.random() < 0.4:
            _mutate(rng, sysd)
        if rng.random() < 0.1:
            sysd.update(nvls=True, compute_capability=rng.choice([7.0, 8.0, 9.0, 10.0]))
        p = folder / f"system-{n}.yaml"
        if rng.random() < 0.05:   # a base: chain, sometimes looping
            other = folder / f"base-{n}.yaml"
            other.write_text(yaml.safe_dump({"base": p.name if rng.random() < 0.5 else "h100-sxm"}))
            sysd = {"base": other.name, "name": f"s{n}"}
        p.write_text(yaml.safe_dump(sysd, default_flow_style=None))
        raw["system"] = str(p)
    return raw


def check_case(raw: dict, slow_s: float) -> tuple[str, str]:
    """('ok' | 'error' | 'FAIL', detail) of one case."""
    from g5core.api.errors import G5Error
    from g5core.session.run import run

    t0 = time.perf_counter()
    try:
        out = run(copy.deepcopy(raw), max_ops=MAX_OPS)
    except G5Error as exc:
        wall = time.perf_counter() - t0
        text = str(exc)
        if "\n" in text:
            return "FAIL", f"a G5 error of several lines: {text!r}"
        if wall > slow_s:
            return "FAIL", f"refused after {wall:.1f} s: {text}"
        return "error", text
    except Exception as exc:  # noqa: BLE001 - what the fuzzer looks for
        return "FAIL", f"{type(exc).__name__}: {exc}; {traceback.format_exc(limit=-3)}"
    wall = time.perf_counter() - t0
    if not (math.isfinite(out.latency_s) and out.latency_s > 0):
        return "FAIL", f"latency {out.latency_s!r}"
    if out.sim is not None and any(v != 0 for v in out.sim.kpis.values()):
        return "FAIL", f"conservation KPIs {out.sim.kpis}"
    try:
        json.dumps(out.to_json_dict(), allow_nan=False)
    except (ValueError, TypeError) as exc:
        return "FAIL", f"the JSON output: {exc}"
    if wall > slow_s:
        return "FAIL", f"ran {wall:.1f} s"
    return "ok", f"{out.latency_s:.6g} s"


def fuzz(cases: int, seed: int, slow_s: float = 10.0, show: bool = False, out=sys.stdout, progress: int = 0) -> dict:
    """Run ``cases`` cases from ``seed``; returns the counts and the failures."""
    rng = random.Random(seed)
    counts = {"ok": 0, "error": 0, "FAIL": 0}
    failures = []
    with tempfile.TemporaryDirectory() as d:
        for n in range(cases):
            raw = make_case(rng, Path(d), n)
            files = {k: Path(raw[k]).read_text() for k in ("model", "system")
                     if isinstance(raw.get(k), str) and raw[k].startswith(d)}
            outcome, detail = check_case(raw, slow_s)
            counts[outcome] += 1
            if show or outcome == "FAIL":
                print(json.dumps({"case": n, "outcome": outcome, "detail": detail[:400], "config": raw,
                                  "files": files}, default=str), file=out, flush=True)
            if outcome == "FAIL":
                failures.append((n, detail))
            if progress and (n + 1) % progress == 0:
                print(json.dumps({"done": n + 1, **counts}), file=sys.stderr, flush=True)
    return {"seed": seed, "cases": cases, **counts, "failures": failures}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--slow-s", type=float, default=10.0, help="a case slower than this fails")
    ap.add_argument("--show", action="store_true", help="print every case, not only failures")
    ap.add_argument("--progress", type=int, default=0, metavar="N", help="a progress line on stderr every N cases")
    args = ap.parse_args()
    summary = fuzz(args.cases, args.seed, args.slow_s, args.show, progress=args.progress)
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}))
    return 1 if summary["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
