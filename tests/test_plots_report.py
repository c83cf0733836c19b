"""`g5 plot` and `g5 report` on a real sweep: valid images with the expected series; the report
round-trips the database values."""
from __future__ import annotations

import csv
import io
import json
import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner

pytest.importorskip("matplotlib", reason="the plot extra (g5[plot]) is part of the test install")

from g5core.present.cli import main  # noqa: E402
from g5core.present.plots import make_figure  # noqa: E402
from g5core.present.report import load_rows  # noqa: E402
from g5core.study.resultsdb import JSON_COLUMNS, RESULT_COLUMNS  # noqa: E402
from g5core.study.sweep import parse_grid, run_sweep  # noqa: E402

BASE = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 4, "parallel": {"dp": "auto", "tp": 1, "pp": 1, "cp": 1},
        "phase": "prefill", "batch": 1, "seq_len": 4096}


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    path = tmp_path_factory.mktemp("plots") / "sweep.db"
    # 3 S x 3 cp = 9 points, plus one invalid (cp=8 on 4 chips) per S
    run_sweep(BASE, parse_grid(["seq_len=4096,8192,16384", "parallel.cp=1,2,4,8"]), path)
    return path


def _labelled(ax):
    return [line for line in ax.get_lines() if not line.get_label().startswith("_")]


def test_latency_plot_has_one_line_per_seq_len(db):
    fig = make_figure("latency", load_rows(db))
    ax = fig.axes[0]
    lines = _labelled(ax)
    assert [line.get_label() for line in lines] == ["seq_len=4K", "seq_len=8K", "seq_len=16K"]  # numeric order
    assert all(list(line.get_xdata()) == [1, 2, 4] for line in lines)
    assert ax.get_ylabel() in ("TTFT (s)", "TTFT (ms)") and "cp" in ax.get_xlabel()


def test_memory_plot_stacks_four_parts_against_capacity(db):
    ax = make_figure("memory", load_rows(db)).axes[0]
    assert len(ax.containers) == 4 and all(len(c) == 9 for c in ax.containers)
    assert [c.get_label() for c in ax.containers] == ["weights", "KV cache", "activations", "workspace"]
    assert [line.get_label() for line in ax.get_lines()] == ["capacity"]
    assert "GiB" in ax.get_ylabel()
    rows = [r for r in load_rows(db) if r["status"] == "ok"]
    tops = [sum(c[i].get_height() for c in ax.containers) for i in range(9)]
    assert tops == pytest.approx([r["max_total_bytes"] / 2 ** 30 for r in rows])


def test_pareto_and_timeline_plots(db):
    ax = make_figure("pareto", load_rows(db)).axes[0]
    # one front per sequence length, not one cloud
    assert [l.get_label() for l in _labelled(ax)] == [f"Pareto front, seq_len={s}" for s in ("4K", "8K", "16K")]
    assert "GiB" in ax.get_xlabel() and "(s)" in ax.get_ylabel() or "(ms)" in ax.get_ylabel()
    ax = make_figure("timeline", load_rows(db)).axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[0] == "compute" and "cp_passkv" in legend  # ring traffic in its own colour
    colours = {tuple(c.get_facecolor()[0]) for c in ax.collections}
    assert len(colours) == len(legend)
    assert any(t.get_text() == "attention" for t in ax.texts)  # ops are named
    assert "(ms)" in ax.get_xlabel()


def test_cli_writes_valid_png_and_svg(db, tmp_path):
    png = tmp_path / "latency.png"
    res = CliRunner().invoke(main, ["plot", str(db), "-o", str(png), "--kind", "latency"])
    assert res.exit_code == 0, res.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(str(png)).shape[0] > 600
    svg = tmp_path / "memory.svg"
    res = CliRunner().invoke(main, ["plot", str(db), "-o", str(svg), "--kind", "memory"])
    assert res.exit_code == 0, res.stderr
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    bars = [e for e in root.iter() if e.get("id", "").startswith("patch_")]
    assert len(bars) >= 4 * 9  # the stacked bars are there
    assert not list(tmp_path.glob(".*"))  # no temporary file left behind


def test_plot_output_is_checked_before_work(db, tmp_path):
    res = CliRunner().invoke(main, ["plot", str(db), "-o", str(tmp_path / "x.gif")])
    assert res.exit_code == 2 and ".png or .svg" in res.stderr
    res = CliRunner().invoke(main, ["plot", str(db), "-o", str(tmp_path / "no" / "x.png")])
    assert res.exit_code == 2 and "does not exist" in res.stderr
    res = CliRunner().invoke(main, ["plot", str(db), "-o", str(db.with_suffix(".png")), "--kind", "timeline",
                                    "--layer", "99"])
    assert res.exit_code == 2 and "--layer" in res.stderr and not db.with_suffix(".png").exists()
    res = CliRunner().invoke(main, ["report", str(tmp_path / "missing.db")])
    assert res.exit_code == 2 and "no results database" in res.stderr


def test_report_round_trips_the_database_values(db, tmp_path):
    rows = load_rows(db)
    assert len(rows) == 12 and sum(r["status"] == "error" for r in rows) == 3
    res = CliRunner().invoke(main, ["report", str(db), "--format", "json"])
    assert res.exit_code == 0
    assert json.loads(res.stdout) == rows

    out = tmp_path / "r.csv"
    res = CliRunner().invoke(main, ["report", str(db), "--format", "csv", "-o", str(out)])
    assert res.exit_code == 0
    parsed = list(csv.DictReader(io.StringIO(out.read_text())))
    assert list(parsed[0]) == list(RESULT_COLUMNS)

    def back(column, text, like):
        if text == "":
            return None
        if column in JSON_COLUMNS:
            return json.loads(text)
        return type(like)(text) if like is not None else text

    for row, got in zip(rows, parsed):
        assert {c: back(c, got[c], row[c]) for c in RESULT_COLUMNS} == row

    res = CliRunner().invoke(main, ["report", str(db), "--format", "markdown"])
    lines = res.stdout.splitlines()
    assert len(lines) == 2 + 12 and "TTFT (s)" in lines[0]
    assert sum("auto: chips=4 is not divisible" in l for l in lines) == 3


def test_a_plot_draws_each_configurations_newest_build_once(tmp_path, monkeypatch):
    """A sweep run again by another build (a model change) keeps the older rows beside the new:
    `g5 plot` draws each configuration once, the newest, and says what it left out; `--sweep N`
    draws that sweep's."""
    from g5core.study import resultsdb

    path = tmp_path / "s.db"
    grid = parse_grid(["seq_len=4096", "parallel.cp=1,2"])
    run_sweep(BASE, grid, path)
    monkeypatch.setitem(resultsdb._BUILD, "id", "f" * 64)
    run_sweep(BASE, grid, path)
    rows = load_rows(path)
    assert len(rows) == 4
    kept, older = resultsdb.newest_of_each(rows, resultsdb.result_free_key)
    assert older == 2 and {r["g5_version"] for r in kept} == {"0.1.0+" + "f" * 12}
    res = CliRunner().invoke(main, ["plot", str(path), "--kind", "memory", "-o", str(tmp_path / "m.svg")])
    assert res.exit_code == 0, res.output
    assert "2 rows of the same configurations computed by other G5 builds left out" in res.stderr
    assert len(make_figure("memory", kept).axes[0].containers[0]) == 2     # one bar a configuration
    res = CliRunner().invoke(main, ["plot", str(path), "--kind", "memory", "--sweep", "1",
                                                    "-o", str(tmp_path / "m1.svg")])
    assert res.exit_code == 0 and "left out" not in res.stderr
