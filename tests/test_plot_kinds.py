"""Every plot kind, checked on the matplotlib objects: a title naming the model, system, chip
count and phase; labelled axes with units; at most 12 legend entries, off the data; layouts
that do not fit drawn hollow and named in the legend; a `g5 best` database drawn by family."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

pytest.importorskip("matplotlib", reason="the plot extra (g5[plot]) is part of the test install")

from g5core.api.errors import ConfigError  # noqa: E402
from g5core.present.cli import main  # noqa: E402
from g5core.present.plots import DOES_NOT_FIT, MAX_LEGEND, make_figure, parse_where, tokens_label  # noqa: E402
from g5core.present.report import auto_dims, load_rows  # noqa: E402
from g5core.study.search import best_layouts  # noqa: E402
from g5core.study.sweep import parse_grid, run_sweep  # noqa: E402

# llama-3.1-70b on 4 H100s at tp=2: 8K fits, 64K does not at cp=1 (the KV cache and activations)
SCAN = {"model": "llama-3.1-70b", "system": "h100-sxm", "chips": 4, "parallel": {"dp": "auto", "tp": 1, "pp": 1, "cp": 1},
        "phase": "prefill", "batch": 1, "seq_len": 32768}


@pytest.fixture(scope="module")
def scan(tmp_path_factory):
    path = tmp_path_factory.mktemp("kinds") / "scan.db"
    run_sweep(SCAN, parse_grid(["seq_len=8192,65536", "parallel.cp=1,2", "parallel.tp=2"]), path)
    return path


@pytest.fixture(scope="module")
def best(tmp_path_factory):
    path = tmp_path_factory.mktemp("kinds") / "best.db"
    # 4 chips: 14 layouts in 9 families and an "other layouts" entry (8 chips: 30 layouts, 3 times the search)
    best_layouts({"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 4, "parallel": {"cp": 1},
                  "phase": "prefill", "batch": 1, "seq_len": 4096}, db_path=path)
    return path


def _check_common(fig, what):
    ax = fig.axes[0]
    title = ax.get_title()
    assert what in title and "on 4 x h100-sxm" in title and "llama-3.1-70b" in title and "prefill" in title
    assert "(" in ax.get_xlabel() or ax.get_xlabel() == "layout"
    assert "(" in ax.get_ylabel()
    legend = ax.get_legend()
    texts = [t.get_text() for t in legend.get_texts()]
    assert 0 < len(texts) <= MAX_LEGEND
    assert legend.get_bbox_to_anchor().x0 >= ax.get_window_extent().x1 - 1  # outside the axes, right
    return ax, texts


def test_tokens_read_as_k_and_m():
    assert [tokens_label(n) for n in (4096, 32768, 131072, 1048576, 1000)] == ["4K", "32K", "128K", "1M", "1000"]


def test_latency_kind(scan):
    ax, texts = _check_common(make_figure("latency", load_rows(scan), auto_dims=auto_dims(scan)), "TTFT")
    assert texts[:2] == ["seq_len=8K", "seq_len=64K"] and DOES_NOT_FIT in texts
    hollow = [l for l in ax.get_lines() if l.get_markerfacecolor() == "white" and len(l.get_xdata())]
    assert hollow  # the 64K points are hollow
    assert "10^" not in " ".join(t.get_text() for t in ax.get_yticklabels())


def test_memory_kind_keeps_cp1_and_marks_what_does_not_fit(scan):
    ax, texts = _check_common(make_figure("memory", load_rows(scan)), "memory")
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels[0].startswith("cp=1") and "seq_len=8K" in labels[0]
    assert DOES_NOT_FIT in texts
    assert any(p.get_hatch() == "//" for c in ax.containers for p in c)


def test_pareto_kind_one_front_per_sequence_length(scan):
    ax, texts = _check_common(make_figure("pareto", load_rows(scan)), "against per-chip memory")
    assert "Pareto front, seq_len=8K" in texts and DOES_NOT_FIT in texts
    rows = [r for r in load_rows(scan) if r["seq_len"] == 65536]
    assert {bool(r["fits"]) for r in rows} == {True, False}  # 64K fits at cp=2 only


def test_pareto_refuses_too_many_workloads(tmp_path):
    rows = []
    for i in range(7):
        rows.append({"status": "ok", "model": "m", "system": "s", "chips": 1, "phase": "prefill", "batch": 1,
                     "seq_len": 1024 * (i + 1), "parallel": {"cp": 1}, "latency_s": 1.0, "fits": 1,
                     "max_total_bytes": 1.0, "tokens_per_s_per_chip": 1.0,
                     "config": {"seq_len": 1024 * (i + 1), "parallel": {"cp": 1}}})
    with pytest.raises(ConfigError) as e:
        make_figure("pareto", rows)
    assert e.value.field == "--where" and "\n" not in str(e.value)


def test_timeline_kind_by_where(scan):
    fig = make_figure("timeline", load_rows(scan), where=parse_where("seq_len=8192,parallel.cp=2"))
    ax, texts = _check_common(fig, "layer")
    assert "cp=2" in ax.get_title() and "seq_len 8K" in ax.get_title()
    assert texts[0] == "compute" and len(texts) >= 2
    with pytest.raises(ConfigError, match="--where"):
        make_figure("timeline", load_rows(scan), where=parse_where("seq_len=1"))
    with pytest.raises(ConfigError, match="did you mean"):
        make_figure("timeline", load_rows(scan), where=parse_where("seq_lem=8192"))


def test_best_database_by_layout_family(best):
    rows = load_rows(best)
    assert auto_dims(best) == ()
    fig = make_figure("latency", rows, auto_dims=auto_dims(best))
    ax = fig.axes[0]
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(texts) <= MAX_LEGEND and texts[-1].startswith("other layouts (")
    # each line joins layouts equal but for cp
    by_label = {}
    for r in rows:
        rest = {k: v for k, v in r["parallel"].items() if k != "cp"}
        by_label.setdefault(tuple(sorted(rest.items())), set()).add(r["parallel"]["cp"])
    for line in ax.get_lines():
        if line.get_label().startswith("_"):
            continue
        fam = dict(kv.split("=") for kv in line.get_label().split(", "))
        key = tuple(sorted((k, int(v)) for k, v in fam.items()))
        matches = [cps for k, cps in by_label.items() if all(dict(k).get(n) == v for n, v in key)]
        assert matches and set(line.get_xdata()) <= set.union(*matches)


def test_cli_png_and_svg_for_every_kind(scan, tmp_path):
    for kind in ("latency", "memory", "pareto", "timeline"):
        for ext in ("png", "svg"):
            out = tmp_path / f"{kind}.{ext}"
            args = ["plot", str(scan), "--kind", kind, "-o", str(out)]
            if kind == "timeline":
                args += ["--where", "seq_len=8192,parallel.cp=2"]
            res = CliRunner().invoke(main, args)
            assert res.exit_code == 0, res.output
            assert out.stat().st_size > 1000
