"""Runtimes of the commands a user types from the README's "Using it" section, on the
shipped examples: wall seconds, CPU seconds (user + sys of the command and every process it
waited for: its workers) and peak memory (the largest resident set of any one of its
processes), one command at a time, each in its own process as a user starts it.

Not a test: it reports figures. Usage:

    python benchmarks/bench_commands.py                 # every command, then the table
    python benchmarks/bench_commands.py --only serve    # those whose command line contains "serve"
    python benchmarks/bench_commands.py --list          # the commands, nothing run

Every command runs in a new temporary directory (``examples/`` and ``validation/`` are
symbolic links to this checkout's, read only by the commands; every output, database,
plot and launch file is written there and removed at the end), with ``g5`` as
``python -m g5core`` of this checkout (the console script ``g5 = g5core.present.cli:main``
of pyproject.toml; ``g5core/__main__.py`` calls the same ``main``). A command still running
after ``--timeout`` seconds (default 600) is stopped (its process group) and recorded as
``> N min`` with the last lines it printed. Prints the table as Markdown, then one JSON
object with every figure, the date, the commit, the machine's cores and its load average
before and after each command. On a shared machine the CPU seconds are the figure to
compare; the wall seconds include the waits for a core.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: the 2-chip and 1-chip llama-3.1-8b H100 configurations the README's serving-search
#: examples call cluster.yaml ("a `chips: 2` llama-3.1-8b H100 configuration")
CLUSTER_2 = "model: llama-3.1-8b\nsystem: h100-sxm\nchips: 2\n"
CLUSTER_1 = "model: llama-3.1-8b\nsystem: h100-sxm\nchips: 1\n"

RATE_SWEEP_WORKLOAD = ("--set serving.workload.requests=300 --set serving.workload.input_tokens=8000 "
                       "--set serving.workload.output_tokens=128 --set serving.workload.arrival.kind=poisson")

#: the README's default serving search (llama-3.1-70b on 16 H100): benchmarks/bench_serve_search.py
#: measures it (README, "Serving search benchmark"); its row points there
DEFAULT_SEARCH = ("g5 best cluster.yaml --serve --isl 8192 --osl 1024 --slo ttft_p90=2s,tpot_p90=50ms --disagg auto "
                  "--workers 2 --db search.db")

#: (command as the user types it, what it does, files written before it runs)
COMMANDS: list[tuple[str, str, dict[str, str]]] = [
    ("g5 run examples/deepseek-v3-1m-prefill-cp8.yaml",
     "the CP spec's case: deepseek-v3 on 64 H200, 1M-token prefill, tp2 cp8 dp4", {}),
    ("g5 explain examples/deepseek-v3-1m-prefill-cp8.yaml", "the same layout's groups, no simulation", {}),
    ("g5 run examples/llama-3.1-405b-1m-prefill-cp16.yaml",
     "llama-3.1-405b on 256 H100, 1M-token prefill, tp8 cp16 dp2", {}),
    ("g5 run examples/llama-3.1-405b-1m-prefill-cp16.yaml --set seq_len=131072 --set chips=128 --set parallel.dp=1",
     "the same at 128K tokens on one replica", {}),
    ("g5 run examples/llama-3.1-70b-prefill.yaml --trace trace.json --trace-layers 0-3 --timeline ops.csv",
     "llama-3.1-70b tp8 32K prefill, every chip, with a Perfetto trace of 4 layers and the op CSV", {}),
    ("g5 collective all_reduce --system h100-sxm --chips 8 --framework vllm",
     "vLLM's custom all-reduce, symmetric memory and NCCL over 8 H100, nccl-tests columns", {}),
    ("g5 sweep examples/llama-3.1-70b-prefill.yaml --set parallel.dp=auto --grid parallel.tp=1,2,4,8 "
     "--grid seq_len=32768,131072 --db sweep.db --workers 2", "8-cell sweep, 2 workers", {}),
    ("g5 plot sweep.db -o latency.png", "TTFT against the swept axis (PNG)", {}),
    ("g5 plot sweep.db --kind memory -o memory.png", "per-chip memory of the sweep's layouts", {}),
    ("g5 report sweep.db --format markdown", "the sweep's rows as a Markdown table", {}),
    ("g5 scan examples/llama-3.1-70b-prefill.yaml --set parallel.tp=2 --set batch=1 --cp 1,2,4 "
     "--seq-len 32768,131072,1048576 --db scan.db",
     "CP scan: cp 1/2/4 x 32K/128K/1M on 8 H100 (the README plots' scan)", {}),
    ("g5 plot scan.db --kind timeline --where seq_len=131072,parallel.cp=4 -o timeline.png",
     "one layer across a cp group, re-simulated from a row", {}),
    ("g5 best examples/llama-3.1-70b-prefill.yaml --db best.db",
     "which layout: every split of 8 H100 for the 70B 32K prefill", {}),
    ("g5 plot best.db --kind pareto -o pareto.png", "latency against memory, the search's front", {}),
    ("python docs/make_plots.py", "the README's five plots from fresh runs (a scan and a g5 best on 16 H100)", {}),
    ("g5 run examples/llama-3.1-70b-decode.yaml --set speculative.method=eagle --set speculative.tokens=5",
     "EAGLE decode, 5 drafts, 70B tp8 pp2", {}),
    ("g5 run examples/speculative/deepseek-v3-decode-mtp.yaml", "DeepSeek-V3 MTP decode on 8 H200", {}),
    ("g5 serve examples/serving/llama-3.1-70b-serve.yaml --rate 40 --requests 2000 --isl 2048 --osl 256 "
     "--slo ttft=2s,tpot=50ms", "2,000 requests on 8 x tp8 70B instances (64 H100)", {}),
    ("g5 run examples/serving/llama-3.1-8b-disagg.yaml", "one representative step of each pool", {}),
    ("g5 explain examples/serving/llama-3.1-8b-disagg.yaml", "both pools' layouts and steps", {}),
    ("g5 serve examples/serving/llama-3.1-8b-disagg-h200.yaml --rate 4 --requests 20 --isl 1000 --osl 32",
     "disaggregated H100 prefill + H200 decode, 20 requests", {}),
    ("g5 serve examples/serving/llama-3.1-8b-agg.yaml --rate 6 --requests 300 --isl 8000 --osl 128",
     "aggregated 2 x 1 H100, 300 requests", {}),
    ("g5 serve examples/serving/llama-3.1-8b-disagg.yaml --rate 6 --requests 300 --isl 8000 --osl 128",
     "disaggregated 1 + 1 H100, 300 requests", {}),
    ("g5 serve examples/serving/qwen3-235b-a22b-attention-dp.yaml --rate 8 --requests 300 --isl 2000 --osl 200",
     "Qwen3-235B-A22B, 16 attention-DP ranks with EP16 on 16 H200, 300 requests", {}),
    ("g5 sweep examples/serving/llama-3.1-8b-agg.yaml " + RATE_SWEEP_WORKLOAD
     + " --grid serving.workload.arrival.rate_per_s=2,4,6,8 --db rates.db",
     "a rate sweep: g5 serve at 4 rates, 300 requests each", {}),
    ("g5 plot rates.db --kind serve-cdf -o cdf.png", "the sweep's TTFT/TPOT CDFs", {}),
    ("g5 plot rates.db --kind serve-throughput -o throughput.png",
     "tokens/s per chip against per-user speed along the rate", {}),
    ("g5 serve examples/serving/llama-3.1-8b-multiturn-128k.yaml --json",
     "8 conversations of 3 turns over a 128K document, HBM prefix cache only", {}),
    ("g5 serve examples/serving/llama-3.1-8b-multiturn-128k.yaml --set 'serving.kv_tiers=[{kind: host}]' --db kv.db",
     "the same with a 256 GiB host tier", {}),
    ("g5 serve examples/serving/llama-3.1-8b-multiturn-128k.yaml --set chips=2 --set parallel.cp=2",
     "the same on 2 H100 with cp=2", {}),
    ("g5 plot kv.db --kind serve-cache -o cache.png", "cached blocks per tier over time", {}),
    ("g5 serve examples/serving/llama-3.1-8b-disagg.yaml --rate 6 --requests 300 --isl 8000 --osl 128 "
     "--emit dynamo launch/ --db s.db", "the disaggregated run, a Dynamo deployment and a results database", {}),
    ("g5 serve examples/serving/llama-3.1-8b-agg.yaml --rate 6 --requests 300 --isl 8000 --osl 128 "
     "--emit vllm launch-vllm/", "the aggregated run and its vllm serve launch files", {}),
    ("g5 report s.db --serving", "the serving run's row as a table", {}),
    ("g5 plot s.db --kind serve-occupancy -o occupancy.png", "KV use and waiting requests over time", {}),
    (DEFAULT_SEARCH, "the default search: llama-3.1-70b on 16 H100 (skipped here)", {}),
    ("g5 best cluster.yaml --serve --isl 1000 --osl 256 --requests 60 --slo ttft_p90=2s,tpot_p90=8ms "
     "--chunks 2048 --seqs 32 --vary tp --settle 4 --confirm 0",
     "serving search, llama-3.1-8b on 2 H100 (cluster.yaml), aggregated and disaggregated", {"cluster.yaml": CLUSTER_2}),
    ("g5 best cluster.yaml --serve --isl 1000 --osl 256 --requests 60 --slo ttft_p90=2s,tpot_p90=8ms "
     "--chunks 2048 --seqs 32 --vary tp --settle 4 --confirm 0 --decode-system h200 --db search.db",
     "the same with H200 decode pools", {"cluster.yaml": CLUSTER_2}),
    ("g5 plot search.db --kind serve-pareto -o serve-pareto.png", "the search's Pareto front", {}),
    ("g5 report search.db", "the search's candidates as a table", {}),
    ("g5 best cluster.yaml --serve --speculative off,eagle:1,eagle:3 --isl 512 --osl 32 --requests 20 "
     "--slo ttft_p90=0.5s,tpot_p90=7ms --chunks 1024 --seqs 8 --disagg off --confirm 0 --tolerance 0.2 --settle 2",
     "serving search over speculative decoding, llama-3.1-8b on 1 H100 (cluster.yaml with chips: 1)",
     {"cluster.yaml": CLUSTER_1}),
    ("g5 validate validation/measured.csv", "6 measured rows, the aiconfigurator tables", {}),
    ("g5 validate validation/measured.csv --set system=h100-sxm", "the same rows on the roofline", {}),
    ("g5 validate validation/measured-meta.csv", "Meta's 16 rows on its GTT hosts", {}),
    ("g5 validate validation/measured-meta.csv --set system=h100-sxm", "the same rows on the shipped H100", {}),
    ("g5 validate validation/measured-frameworks.csv", "44 rows under their frameworks' profiles, 16 of them g5 serve runs",
     {}),
    ("g5 validate validation/measured-collectives.csv", "207 all-reduce rows of three frameworks' kernels on H100",
     {}),
    ("g5 calibrate validation/measured.csv --fit compute_model.hbm_fraction,network_bw_bytes_per_s -o fit.yaml "
     "--workers 2", "fit two system parameters to the 6 rows, leave-one-out included", {}),
    ("g5 models", "the model catalog", {}),
    ("g5 systems", "the system catalog", {}),
    ("g5 systems show h100-sxm", "one system file", {}),
    ("g5 plugins", "the plugins and their hooks", {}),
]

#: commands measured elsewhere: their table row points there
ELSEWHERE = {DEFAULT_SEARCH: "see Serving search benchmark"}


def argv_of(command: str, tmp: pathlib.Path) -> list[str]:
    words = shlex.split(command)
    if words[0] == "g5":
        return [sys.executable, "-m", "g5core", *words[1:]]
    if words[:2] == ["python", "docs/make_plots.py"]:
        # the script writes beside itself (docs/plots): run a copy in the temporary folder
        (tmp / "docs").mkdir(exist_ok=True)
        shutil.copy(ROOT / "docs" / "make_plots.py", tmp / "docs" / "make_plots.py")
        return [sys.executable, "docs/make_plots.py", *words[2:]]
    raise ValueError(f"not a g5 or known python command: {command}")


def run_one(command: str, files: dict[str, str], tmp: pathlib.Path, timeout_s: float, env: dict) -> dict:
    for name, text in files.items():
        (tmp / name).write_text(text)
    argv = argv_of(command, tmp)
    log = tmp / "output.log"
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        stopped = threading.Event()

        def stop() -> None:
            stopped.set()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        timer = threading.Timer(timeout_s, stop)
        timer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    text = log.read_text(errors="replace")
    return {"command": command, "rc": proc.returncode, "stopped_at_timeout": stopped.is_set(),
            "wall_s": round(wall, 2), "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
            "peak_mib": round(usage.ru_maxrss / 1024, 1), "load_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],
            "output_lines": text.count("\n"), "output_tail": text.splitlines()[-6:]}


def fmt(result: dict, timeout_s: float) -> tuple[str, str, str]:
    if result.get("elsewhere"):
        return (result["elsewhere"],) * 3
    if result["stopped_at_timeout"]:
        return f"> {timeout_s / 60:g} min", f"{result['cpu_s']:.1f} (stopped)", f"{result['peak_mib']:.0f}"
    return f"{result['wall_s']:.1f}", f"{result['cpu_s']:.1f}", f"{result['peak_mib']:.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="run only the commands whose line contains this text")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before a command is stopped")
    ap.add_argument("--list", action="store_true", help="print the commands and run nothing")
    args = ap.parse_args()
    chosen = [c for c in COMMANDS if args.only is None or args.only in c[0]]
    if args.list:
        print("\n".join(c[0] for c in chosen))
        return 0
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True).stdout.strip())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "contrib" / "g5-ulysses"),
                                                      os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    started = datetime.datetime.now(datetime.timezone.utc)
    results = []
    with tempfile.TemporaryDirectory(prefix="g5-bench-commands-") as tmpname:
        tmp = pathlib.Path(tmpname)
        for name in ("examples", "validation"):
            (tmp / name).symlink_to(ROOT / name, target_is_directory=True)
        for command, what, files in chosen:
            if command in ELSEWHERE:
                results.append({"command": command, "what": what, "elsewhere": ELSEWHERE[command]})
                continue
            print(f"running: {command}", file=sys.stderr, flush=True)
            res = dict(run_one(command, files, tmp, args.timeout, env), what=what)
            print(f"  rc {res['rc']}, {res['wall_s']} s wall, {res['cpu_s']} s CPU, {res['peak_mib']} MiB"
                  + (" (stopped at the timeout)" if res["stopped_at_timeout"] else ""), file=sys.stderr, flush=True)
            results.append(res)
    header = {"date_utc": started.strftime("%Y-%m-%d %H:%M"), "commit": commit + ("+dirty" if dirty else ""),
              "cores": os.cpu_count(), "python": platform.python_version(), "timeout_s": args.timeout}
    print(f"Measured {header['date_utc']} UTC at {header['commit']}, {header['cores']} cores, "
          f"Python {header['python']}.\n")
    print("| command | what it does | wall s | CPU s | peak MiB |")
    print("|---|---|---|---|---|")
    for res in results:
        wall, cpu, peak = fmt(res, args.timeout)
        failed = "" if res.get("elsewhere") or res["rc"] == 0 or res["stopped_at_timeout"] else f" (exit {res['rc']})"
        print(f"| `{res['command']}` | {res['what']}{failed} | {wall} | {cpu} | {peak} |")
    print()
    print(json.dumps({**header, "results": results}, indent=1))
    return 0 if all(r.get("elsewhere") or r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
