"""Issue 35 item 5: the serving plots: titled (model, system, chips, workload, SLO), runs
labelled by rate or trace, legends outside the axes, a rate sweep joined along its rate and
unrelated trace runs as markers alone on axes from zero, occupancy step-drawn, Pareto labels
that never overlap (checked on the matplotlib objects)."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from g5core.present.serve_plots import _pareto_figure, serve_figure  # noqa: E402
from g5core.serve.api import simulate_serving  # noqa: E402
from g5core.study.serve_db import load_serving_rows, open_serving_db  # noqa: E402
from g5core.serve.metrics import series  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BASE = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 1, "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1},
        "serving": {"instances": 1, "slo": {"ttft_p99": "2s"}}}


def runner(groups):
    return 5e-3 + sum(k * (5e-5 if n == 1 else 2e-5 * n) for n, c, k in groups)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    db_path = tmp_path_factory.mktemp("plots") / "s.db"
    db = open_serving_db(db_path)
    workloads = [{"trace": str(REPO / "examples" / "traces" / t), "requests": 12}
                 for t in ("sample-azure.csv", "sample-mooncake.jsonl")]
    workloads += [{"requests": 40, "arrival": {"kind": "poisson", "rate_per_s": r}, "input_tokens": 500,
                   "output_tokens": 20} for r in (5, 50)]
    for w in workloads:
        res = simulate_serving(BASE, w, runner=runner, check_predictor=0)
        db.add(BASE, (), w, res.to_json_dict(), series(res.loop))
    db.close()
    return load_serving_rows(db_path)


def _legend_outside(ax_or_fig) -> bool:
    leg = ax_or_fig.get_legend()
    return leg is not None and leg.get_bbox_to_anchor().x0 >= ax_or_fig.get_window_extent().x1 - 1


@pytest.mark.parametrize("kind", ["serve-cdf", "serve-occupancy", "serve-throughput"])
def test_every_plot_is_titled_and_its_legend_sits_outside(rows, kind):
    fig = serve_figure(kind, rows)
    fig.canvas.draw()
    title = fig._suptitle.get_text() if fig._suptitle else fig.axes[0].get_title()
    for word in ("llama-3.1-8b", "h100-sxm", "1 x", "SLO ttft_p99 <= 2 s"):
        assert word in title, title
    labels = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert any("sample-azure.csv" in x for x in labels) and any("sample-mooncake.jsonl" in x for x in labels)
    assert not any(len(x) == 8 and x.isalnum() and not x.isalpha() for x in labels)   # no hash prefixes
    assert any(_legend_outside(ax) for ax in fig.axes)


def test_throughput_joins_only_the_rate_sweep_and_starts_at_zero(rows):
    ax = serve_figure("serve-throughput", rows).axes[0]
    lines = ax.get_lines()
    joined = [ln for ln in lines if ln.get_linestyle() != "None"]
    assert len(joined) == 1 and len(joined[0].get_xdata()) == 2          # the 5 and 50 req/s sweep
    assert joined[0].get_label().startswith("rate sweep")
    alone = [ln for ln in lines if ln.get_linestyle() == "None"]
    assert sorted(ln.get_label() for ln in alone) == ["sample-azure.csv (first 12)", "sample-mooncake.jsonl (first 12)"]
    assert ax.get_ylim()[0] == 0 and ax.get_xlim()[0] == 0


def test_occupancy_is_step_drawn_with_integer_ticks(rows):
    fig = serve_figure("serve-occupancy", rows)
    fig.canvas.draw()
    for ax in fig.axes:
        assert all(ln.get_drawstyle() == "steps-post" for ln in ax.get_lines())
    ticks = fig.axes[1].get_yticks()
    assert all(float(t).is_integer() for t in ticks)


def test_pareto_labels_never_overlap():
    import matplotlib.pyplot as plt

    # a front of 10 points crowded into a narrow band, every one labelled
    rows = [{"label": f"{k} x [tp={k}], max_num_seqs=64, chunk=8192", "disaggregated": k % 2 == 0,
             "per_user": 10.0 + k, "per_chip": 1000.0 - 2.0 * k} for k in range(10)]
    fig = _pareto_figure(plt, rows, (11.0, 6.5))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    texts = [t for t in ax.texts if t.get_text()]
    assert len(texts) == 10
    from matplotlib.text import Text

    boxes = [Text.get_window_extent(t, renderer) for t in texts]   # the text itself, not its leader line
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            assert not boxes[i].overlaps(boxes[j]), (texts[i].get_text(), texts[j].get_text())
    assert "serving search" in ax.get_title()


def test_a_serving_run_of_another_build_is_drawn_once(tmp_path, monkeypatch):
    """The same run stored by two builds (a model change between them): `g5 plot --kind
    serve-cdf` draws the newest and says it left the other out."""
    from click.testing import CliRunner

    from g5core.present.cli import main
    from g5core.study import resultsdb
    from g5core.study.serve_db import serving_free_key

    db_path = tmp_path / "s.db"
    w = {"requests": 20, "arrival": {"kind": "poisson", "rate_per_s": 5}, "input_tokens": 500, "output_tokens": 20}
    for build in (None, "e" * 64):
        if build:
            monkeypatch.setitem(resultsdb._BUILD, "id", build)
        db = open_serving_db(db_path)
        res = simulate_serving(BASE, w, runner=runner, check_predictor=0)
        assert db.add(BASE, (), w, res.to_json_dict(), series(res.loop))     # a new row: the key holds the build
        db.close()
    stored = load_serving_rows(db_path)
    assert len(stored) == 2 and len({serving_free_key(r) for r in stored}) == 1
    out = CliRunner().invoke(main, ["plot", str(db_path), "--kind", "serve-cdf", "-o", str(tmp_path / "c.svg")])
    assert out.exit_code == 0, out.output
    assert "1 row of the same configurations computed by other G5 builds left out" in out.stderr
