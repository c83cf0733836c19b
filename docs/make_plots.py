"""Draw the README's example plots, one of each kind, from fresh runs:

    python docs/make_plots.py            # writes docs/plots/{latency,memory,pareto,timeline,best-latency}.png

A CP scan of llama-3.1-70b on 8 H100s (tp=2, dp auto, cp 1/2/4 at 32K, 128K and 1M tokens:
the longer ones do not all fit) gives the latency, memory, Pareto and timeline plots; a
`g5 best` search of the same model on 16 H100s at 32K gives the latency plot of a best
database (one line per layout family). About 17 s of CPU (2026-12-03, README "Runtimes of the
user commands"); needs g5[plot].
"""
from __future__ import annotations

import pathlib
import sys
import tempfile

from g5core.inputs.outputs import write_atomically
from g5core.present.plots import figure_bytes, make_figure, parse_where
from g5core.present.report import auto_dims, load_rows
from g5core.study.search import best_layouts
from g5core.study.sweep import parse_grid, run_sweep

OUT = pathlib.Path(__file__).resolve().parent / "plots"
SCAN = {"model": "llama-3.1-70b", "system": "h100-sxm", "chips": 8,
        "parallel": {"dp": "auto", "tp": 2, "pp": 1, "cp": 1}, "phase": "prefill", "batch": 1, "seq_len": 32768}
GRID = ["seq_len=32768,131072,1048576", "parallel.cp=1,2,4"]
BEST = dict(SCAN, chips=16, parallel={"cp": 1})


def main() -> int:
    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="g5-docs-") as tmp:
        scan, best = pathlib.Path(tmp, "scan.db"), pathlib.Path(tmp, "best.db")
        run_sweep(SCAN, parse_grid(GRID), scan)
        best_layouts(BEST, db_path=best)
        figures = {
            "latency": make_figure("latency", load_rows(scan), auto_dims=auto_dims(scan)),
            "memory": make_figure("memory", load_rows(scan)),
            "pareto": make_figure("pareto", load_rows(scan)),
            "timeline": make_figure("timeline", load_rows(scan), where=parse_where("seq_len=131072,parallel.cp=4")),
            "best-latency": make_figure("latency", load_rows(best), auto_dims=auto_dims(best)),
        }
        for name, fig in figures.items():
            path = OUT / f"{name}.png"
            write_atomically(path, lambda fh, fig=fig: fh.write(figure_bytes(fig, "png")), "docs/plots", binary=True)
            print(f"wrote {path.relative_to(OUT.parent.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
