"""G5 benchmark: the cost of ``--trace`` and ``--timeline`` against the run alone.

Not a test: it reports figures. The case is issue 25's: llama-3.1-405b prefill of 128K
tokens on 128 H100s (tp8 x cp16, every chip simulated). Usage:

    python benchmarks/bench_outputs.py                      # the issue's case
    python benchmarks/bench_outputs.py --set seq_len=16384  # a smaller one

It times the run (with the port-rate log a trace needs), then writes the trace, the trace of
layers 0-3 (``--trace-layers 0-3``) and the timeline into a temporary folder through the
same atomic writer as ``g5 run``, and prints each one's seconds, its ratio to the run and
its file size, and the process's peak resident memory, as one JSON line; the ratios of CPU
seconds (``_cpu_over_run_cpu``) are the ones to read on a shared machine.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "llama-3.1-405b-1m-prefill-cp16.yaml"
OVERRIDES = ["chips=128", "parallel.dp=1", "seq_len=131072"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", action="append", default=[], help="more overrides (dotted.key=value)")
    args = ap.parse_args()
    from g5core.inputs.outputs import write_atomically
    from g5core.present.trace import dump_timeline, dump_trace, parse_layers
    from g5core.session.run import load_raw, run

    raw = load_raw(str(CONFIG), OVERRIDES + args.set)
    t0, c0 = time.perf_counter(), time.process_time()
    out = run(raw, symmetry=False, record_port_rates=True)
    run_s, run_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    topo = out.plan.ctx.topology
    fig = {"case": " ".join(OVERRIDES + args.set), "ops": out.sim.compiled.n_ops,
           "flows": len(out.sim.compiled.flow_bytes), "run_s": round(run_s, 2), "run_cpu_s": round(run_cpu_s, 2)}
    with tempfile.TemporaryDirectory() as folder:
        for name, dump in (("trace", lambda fh: dump_trace(out.sim, topo, fh)),
                           ("trace_layers_0_3", lambda fh: dump_trace(out.sim, topo, fh, parse_layers("0-3"))),
                           ("timeline", lambda fh: dump_timeline(out.sim, fh))):
            path = os.path.join(folder, name)
            t0, c0 = time.perf_counter(), time.process_time()
            write_atomically(path, dump)
            s, cpu = time.perf_counter() - t0, time.process_time() - c0
            fig[f"{name}_s"] = round(s, 2)
            fig[f"{name}_over_run"] = round(s / run_s, 2)
            fig[f"{name}_cpu_over_run_cpu"] = round(cpu / run_cpu_s, 2)
            fig[f"{name}_mib"] = round(os.path.getsize(path) / 2 ** 20, 1)
            os.unlink(path)
    fig["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(json.dumps(fig))


if __name__ == "__main__":
    sys.exit(main())
