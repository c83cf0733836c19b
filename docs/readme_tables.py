"""The README's tables that quote G5's own output, generated from fresh runs.

    python docs/readme_tables.py            # print each table
    python docs/readme_tables.py --write    # rewrite them in README.md, between their markers
    python docs/readme_tables.py --check    # exit 1 when README.md differs from a fresh run

Tables (each between ``<!-- g5-table: NAME -->`` and ``<!-- /g5-table: NAME -->``):

- ``validation``: `g5 validate validation/measured.csv`, once with each row's own system
  (the aiconfigurator tables) and once with ``--set system=h100-sxm`` (the size-aware
  roofline), about 12 s of CPU each (2026-12-03);
- ``validation-meta``: the same for `validation/measured-meta.csv` (Meta's rows, each on its GTT
  hosts' system file, validation/systems/h100-gtt.yaml), about 15 s each;
- ``validation-frameworks``: `g5 validate validation/measured-frameworks.csv` (each row under its
  framework's profile), every row against the +-10% band, about 15 s (the serving rows run g5 serve);
- ``validation-tp-trend``: the same report's TP series (rows equal but for their TP degree), the
  error at each degree and its trend;
- ``framework-changes``: how much each element of each framework profile (g5core/data/frameworks)
  moves a TP8 decode step (batch 1, 4K context) and a 4K prefill of Llama-3.1-70B bf16 on
  h100-sxm (the size-aware roofline), one element at a time on G5's model without a profile,
  ranked by the decode change, about 20 s;
- ``nccl``: `python benchmarks/nccl_agreement.py --summary`, G5's bus bandwidth beside the
  published NCCL measurements, about 20 s;
- ``deepep``: `g5 collective ep_dispatch|ep_combine --system h800 --chips N` beside DeepEP's
  published tables (tests/data/deepep), the normal kernels at 4096 tokens and the pure-RDMA
  low-latency kernels at 128, a few seconds.

The README's benchmark table (wall time and peak memory of the simulator) is measured, not
computed, and is not regenerated here; `benchmarks/bench.py` gives it.
tests/test_readme_tables.py fails when the README's figures differ from a fresh run by
more than their rounding.
"""
from __future__ import annotations

import importlib.util
import pathlib
import re
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
README = REPO / "README.md"
MEASURED = REPO / "validation" / "measured.csv"
MEASURED_META = REPO / "validation" / "measured-meta.csv"
MEASURED_FRAMEWORKS = REPO / "validation" / "measured-frameworks.csv"
#: the band a validation row of a framework is held to (issue 32)
BAND_PCT = 10.0

# validation/measured.csv rows: the README's label of each, and the heading above its group
VALIDATION_LABELS = {
    1: "TTFT, 5000-token prompt", 2: "TTFT, 500-token prompt",
    3: "ITL at ~5250 tokens of context", 4: "ITL at ~1500 tokens of context",
    5: "TTFT, 128K-token prompt", 6: "TTFT, 1M-token prompt",
}
VALIDATION_GROUPS = {
    1: "Llama 3.3 70B, fp8, TP2 on 2 x H100, concurrency 1 (NVIDIA NIM 1.8.0 benchmarks)",
    5: "Llama 3 405B, fp8 FFN weights, TP8 x CP16 on 128 H100 (arXiv:2411.01783)",
}
# validation/measured-meta.csv rows (Meta's GTT hosts, arXiv:2411.01783)
META_LABELS = {
    1: "TTFT, 128K prompt, CP16 x TP8 (16 hosts)", 2: "TTFT, 1M prompt, CP16 x TP8 (16 hosts)",
    3: "TTFT, 8K prompt, TP8 (1 host)", 4: "TTFT, 8K prompt, CP2 x TP8 (2 hosts)",
    5: "TTFT, 128K prompt, TP8 (1 host)", 6: "TTFT, 128K prompt, CP2 x TP8 (2 hosts)",
    7: "TTFT, 128K prompt, TP16 (2 hosts)", 8: "TTFT, 128K prompt, CP4 x TP8 (4 hosts)",
    9: "TTFT, 128K prompt, TP32 (4 hosts)",
    10: "TTIT at 8K, TP8 (1 host)", 11: "TTIT at 128K, TP8 (1 host)",
    12: "TTIT at 8K, CP2 x TP8, ring pass-Q (2 hosts)", 13: "TTIT at 128K, CP2 x TP8, ring pass-Q (2 hosts)",
    14: "TTIT at 128K, TP16 (2 hosts)", 15: "TTIT at 128K, CP4 x TP8, ring pass-Q (4 hosts)",
    16: "TTIT at 128K, TP32 (4 hosts)",
}
META_GROUPS = {
    1: "Llama 3 405B, fp8 FFN weights, batch 1, on Meta's GTT hosts (arXiv:2411.01783: abstract, Tables 6 and 7)",
}
# tests/data/nccl files: the README's name of each source
NCCL_SOURCES = {
    "aiconfigurator-h100-sxm-nccl2.29.2.csv": "aiconfigurator nccl_perf, NCCL 2.29.2",
    "azure-nd-h100-v5.csv": "Azure ND H100 v5 (NVLS forced)",
    "nccl-issue-1221.csv": "NVIDIA/nccl issue #1221 (RoCE)",
}


def _ms(value: float) -> str:
    return f"{value:.2f}"


def _num(value: float) -> str:
    """A measured figure as the CSV gives it: 406.77, 3800."""
    return f"{value:g}" if value == int(value) else f"{value:.2f}"


def _validation(csv, labels, groups, own) -> str:
    from g5core.study.validate import validate

    tables = validate(csv), validate(csv, ["system=h100-sxm"])
    rows = [tables[0]["rows"], tables[1]["rows"]]
    if [r["row"] for r in rows[0]] != sorted(labels):
        raise SystemExit(f"{csv} has rows {[r['row'] for r in rows[0]]}; give each a label in docs/readme_tables.py")
    lines = [f"| row | measured ms | G5, {own} | G5, size-aware roofline of h100-sxm |", "|---|---|---|---|"]
    for a, b in zip(*rows):
        if a["row"] in groups:
            lines.append(f"| **{groups[a['row']]}** | | | |")
        lines.append(f"| {labels[a['row']]} | {_num(a['measured_ms'])} | "
                     f"{_ms(a['predicted_ms'])} ({a['error_pct']:+.1f}%) | {_ms(b['predicted_ms'])} ({b['error_pct']:+.1f}%) |")
    lines.append(f"| MAPE ({len(rows[0])} rows) | | {tables[0]['mape_pct']:.1f}% | {tables[1]['mape_pct']:.1f}% |")
    return "\n".join(lines)


def validation_table() -> str:
    return _validation(MEASURED, VALIDATION_LABELS, VALIDATION_GROUPS, "aiconfigurator tables")


def validation_meta_table() -> str:
    return _validation(MEASURED_META, META_LABELS, META_GROUPS, "GTT hosts (h100-gtt)")


def validation_frameworks_table() -> str:
    from g5core.study.validate import read_rows, validate

    report = validate(MEASURED_FRAMEWORKS)
    names = {r.number: r.label.split()[0].rsplit("/", 1)[-1] for r in read_rows(MEASURED_FRAMEWORKS)}
    lines = ["| row | framework | metric | config | measured ms | G5 ms | error | within +-10% |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        ok = "yes" if abs(r["error_pct"]) <= BAND_PCT else "**no**"
        lines.append(f"| {r['row']} | {r['framework']} | {r['metric']} | {names[r['row']]} | {_num(r['measured_ms'])} | "
                     f"{_ms(r['predicted_ms'])} | {r['error_pct']:+.1f}% | {ok} |")
    for g in report["by_framework"]:
        lines.append(f"| MAPE | {g['framework']} | {g['metric']} | {g['rows']} row{'s' if g['rows'] != 1 else ''} | | | "
                     f"{g['mape_pct']:.1f}% | |")
    return "\n".join(lines)


def validation_tp_trend_table() -> str:
    """`g5 validate`'s TP series of the frameworks file: each series' error at each TP degree
    and its trend (the highest degree's error less the lowest's), and G5's step beside the
    measured one."""
    from g5core.study.validate import validate

    report = validate(MEASURED_FRAMEWORKS)
    by_row = {r["row"]: r for r in report["rows"]}
    lines = ["| framework | metric | series (rows) | error by TP degree | measured - G5 by TP degree, ms | trend |",
             "|---|---|---|---|---|---|"]
    for t in report["tp_trends"]:
        rows = sorted((by_row[n] for n in t["rows"]), key=lambda r: r["tp"])
        gaps = ", ".join(f"TP{r['tp']} {r['measured_ms'] - r['predicted_ms']:.2f}" for r in rows)
        errors = ", ".join(f"TP{tp} {e:+.1f}%" for tp, e in t["errors_by_tp"])
        numbers = ", ".join(map(str, t["rows"]))
        lines.append(f"| {t['framework']} | {t['metric']} | {t['config']} ({numbers}) | {errors} | {gaps} | "
                     f"{t['trend_pts']:+.1f} points |")
    return "\n".join(lines)


#: the elements of a framework profile, each the framework-block keys it sets (the rest of the
#: block: every step captured, as G5's model without a profile runs)
PROFILE_ELEMENTS = {
    "CUDA graphs (captured sizes, launches)": ("cuda_graphs", "cuda_graph_batch_sizes", "cuda_graph_padding",
                                               "graph_kernel_s", "kernel_launch_s"),
    "TP all-reduce kernels": ("all_reduce",),
    "kernel fusions": ("stack",),
    "host time per step": ("host",),
}


def framework_changes_table() -> str:
    import tempfile

    import yaml

    from g5core.inputs.framework import host_step_s, load_profile
    from g5core.session.run import run

    base = {"model": "llama-3.1-70b", "chips": 8, "parallel": {"dp": 1, "tp": 8, "pp": 1, "cp": 1}, "batch": 1}
    steps = {"decode": {"phase": "decode", "seq_len": 4096}, "prefill": {"phase": "prefill", "seq_len": 4096}}
    rows = []
    seen: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        def latency(block, step) -> float:
            key = (yaml.safe_dump(block, sort_keys=True), step)
            if key not in seen:
                seen[key] = _latency(block, step)
            return seen[key]

        def _latency(block, step) -> float:
            system = "h100-sxm"
            if block is not None:
                path = pathlib.Path(tmp) / f"s{abs(hash(yaml.safe_dump(block, sort_keys=True)))}.yaml"
                path.write_text(yaml.safe_dump({"base": "h100-sxm", "name": "h100-fw", "framework": block}))
                system = str(path)
            out = run({**base, **steps[step], "system": system})
            # with the profile's host time per step, as a serving step (and g5 validate) pays it
            return host_step_s(out.latency_s, out.deployment.step, out.plan.ctx.system)

        plain = {step: latency(None, step) for step in steps}
        for name in ("vllm", "sglang", "trtllm"):
            values = dict(load_profile(name)["framework"])
            for element, keys in PROFILE_ELEMENTS.items():
                block = {"cuda_graphs": "all", **{k: values[k] for k in keys if k in values}}
                moved = {step: latency(block, step) / plain[step] - 1.0 for step in steps}
                rows.append((name, element, moved))
            whole = {step: latency({"name": name}, step) / plain[step] - 1.0 for step in steps}
            rows.append((name, "the whole profile", whole))
    # the elements by how much they move the decode step, the whole profiles last
    rows.sort(key=lambda r: (r[1] == "the whole profile", -abs(r[2]["decode"]), r[0], r[1]))
    lines = [f"| framework | profile element | TP8 decode step (G5 without a profile: {plain['decode'] * 1e3:.2f} ms) | "
             f"4K prefill ({plain['prefill'] * 1e3:.1f} ms) |", "|---|---|---|---|"]
    for name, element, moved in rows:
        lines.append(f"| {name} | {element} | {100 * moved['decode']:+.1f}% | {100 * moved['prefill']:+.1f}% |")
    return "\n".join(lines)


def _agreement_module():
    spec = importlib.util.spec_from_file_location("nccl_agreement", REPO / "benchmarks" / "nccl_agreement.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nccl_table() -> str:
    module = _agreement_module()
    rows = module.summary_rows(module.agreement())
    lines = ["| source | op | GPUs | size (B) | measured busbw GB/s | G5 busbw GB/s | error | G5 algorithm |",
             "|---|---|---|---|---|---|---|---|"]
    last = None
    for r in rows:
        source = (module.source_label(r["source"]) if r["op"] == "all_to_all"
                  else NCCL_SOURCES.get(r["source"]) or module.source_label(r["source"]))
        gpus = f"{r['gpus']}" + (f" ({r['nodes']} nodes)" if r["nodes"] > 1 else "")
        first = f"| {source} |" if source != last else "| |"
        lines.append(f"{first} {r['op']} | {gpus} | {r['size_bytes']} | "
                     f"{r['measured_busbw_gbytes_per_s']:.1f} | {r['g5_busbw_gbytes_per_s']:.1f} | {r['error'] * 100:+.0f}% | "
                     f"{r['algorithm']}/{r['protocol']} |")
        last = source
    return "\n".join(lines)


def deepep_table() -> str:
    import csv

    from g5core.session.collbench import bench_rows

    rows = list(csv.DictReader((REPO / "tests" / "data" / "deepep" / "deepep-performance.csv").open()))

    def published(table, direction, ep, figure):
        return next(float(r["value"]) for r in rows if (r["table"], r["direction"], r["ep"], r["figure"])
                    == (table, direction, str(ep), figure))

    normal_eps, ll_eps = (8, 16, 32, 64), (8, 16, 32, 64, 128, 256)
    lines = ["| normal, 4096 tokens | " + " | ".join(f"EP{ep}" + (" (NVLink)" if ep == 8 else " (RDMA)" if ep == 64
                                                                  else "") for ep in normal_eps) + " |",
             "|--|" + "--|" * len(normal_eps)]
    for direction in ("dispatch", "combine"):
        cells = []
        for ep in normal_eps:
            (got,) = bench_rows(f"ep_{direction}", "h800", ep, [4096], {"kernel": "normal"})
            link = next(r["link"] for r in rows if (r["table"], r["direction"], r["ep"]) == ("normal", direction, str(ep)))
            column = "nvl_bytes_per_s" if link == "NVLink" else "rdma_bytes_per_s"
            cells.append(f"{published('normal', direction, ep, 'bandwidth_gbps'):g} / {got[column] / 1e9:.1f}")
        lines.append(f"| {direction} GB/s, DeepEP / G5 | " + " | ".join(cells) + " |")
    lines += ["", "| low latency, 128 tokens, us | " + " | ".join(f"EP{ep}" for ep in ll_eps) + " |",
              "|--|" + "--|" * len(ll_eps)]
    for direction in ("dispatch", "combine"):
        cells = []
        for ep in ll_eps:
            (got,) = bench_rows(f"ep_{direction}", "h800", ep, [128],
                                {"kernel": "low_latency", "experts": 288 if 288 % ep == 0 else 256})
            cells.append(f"{published('low_latency_pure_rdma', direction, ep, 'latency_us'):g} / {got['time_s'] * 1e6:.1f}")
        lines.append(f"| {direction}, DeepEP / G5 | " + " | ".join(cells) + " |")
    return "\n".join(lines)


TABLES = {"validation": validation_table, "validation-meta": validation_meta_table,
          "validation-tp-trend": validation_tp_trend_table,
          "validation-frameworks": validation_frameworks_table, "framework-changes": framework_changes_table,
          "nccl": nccl_table, "deepep": deepep_table}


def _block(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- g5-table: {name} -->\n)(.*?)(\n<!-- /g5-table: {name} -->)", re.S)


def readme_table(name: str, text: str | None = None) -> str:
    """The table ``name`` as README.md holds it."""
    m = _block(name).search(README.read_text(encoding="utf-8") if text is None else text)
    if not m:
        raise SystemExit(f"README.md has no <!-- g5-table: {name} --> block")
    return m.group(2)


def main(argv: list[str]) -> int:
    fresh = {name: make() for name, make in TABLES.items()}
    if "--write" in argv:
        text = README.read_text(encoding="utf-8")
        for name, table in fresh.items():
            readme_table(name, text)
            text = _block(name).sub(lambda m: m.group(1) + table + m.group(3), text)
        tmp = README.with_name(".README.md.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(README)
        print("README.md: tables rewritten: " + ", ".join(fresh))
        return 0
    if "--check" in argv:
        stale = [name for name, table in fresh.items() if readme_table(name) != table]
        print("README.md tables " + (f"differ from a fresh run: {', '.join(stale)}" if stale else "match a fresh run"))
        return 1 if stale else 0
    for name, table in fresh.items():
        print(f"<!-- g5-table: {name} -->\n{table}\n<!-- /g5-table: {name} -->\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
