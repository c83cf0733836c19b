"""The per-chip memory ledger against hand-computed values, the does-not-fit report, and JSON.

Expected values are computed here from the models' published shapes (Llama 3.1 config.json:
hidden 4096 / 8192, 32 / 80 layers, 32 / 64 query heads, 8 KV heads of 128, FFN 14336 /
28672, vocabulary 128256, untied embeddings), independently of ``g5core.lower.layers``. The
activation term follows the ledger's documented rule (``g5core.sim.memory.activation_peak_bytes``):
``act_bytes * tokens * (2 * hidden + W)`` with ``W`` the widest per-token intermediate:
for Llama the gated FFN's ``2 * ffn / tp``.
"""
from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from g5core.present.cli import main
from g5core.sim.memory import memory_report
from g5core.session.run import make_plan, run

BF16_BYTES = 2
GIB = 2.0 ** 30
H100_HBM_BYTES = 80 * 2 ** 30  # h100-sxm.yaml: 85899345920

LLAMA_8B = dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256)
LLAMA_70B = dict(hidden=8192, layers=80, heads=64, kv_heads=8, head_dim=128, ffn=28672, vocab=128256)


def hand_ledger(shapes, phase, batch, seq_len, tp=1):
    """(weights, kv_cache, activations) bytes on one chip, by hand, for a Llama-style model."""
    d, L, H, K, hd, F, V = (shapes[k] for k in ("hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "vocab"))
    q = d * H * hd
    k = v = d * K * hd
    o = H * hd * d
    ffn = 3 * d * F
    layer = (q + k + v + o + ffn) / tp + 2 * d  # KV heads (8) >= tp: all matrices split
    weights = (V * d / tp + L * layer + d + V * d / tp) * BF16_BYTES
    c_kv = 2 * K * hd * BF16_BYTES
    kv = batch * seq_len * c_kv * L / tp
    tokens = batch * seq_len if phase == "prefill" else batch
    widest = max((H + 2 * K) * hd / tp, H * hd / tp, 2 * F / tp)  # QKV outputs, attention output, gate+up
    activations = BF16_BYTES * tokens * (2 * d + widest)
    return weights, kv, activations


def _raw(model="llama-3.1-8b", tp=1, dp=1, pp=1, phase="prefill", batch=2, seq_len=1024):
    return {"model": model, "system": "h100-sxm", "chips": dp * tp * pp,
            "parallel": {"dp": dp, "tp": tp, "pp": pp, "cp": 1}, "phase": phase, "batch": batch, "seq_len": seq_len}


@pytest.mark.parametrize("tp, phase", [(1, "prefill"), (2, "prefill"), (1, "decode"), (4, "decode")])
def test_ledger_matches_hand_computed_values(tp, phase):
    batch, seq_len = 2, 1024
    weights, kv, acts = hand_ledger(LLAMA_8B, phase, batch, seq_len, tp)
    report = memory_report(make_plan(_raw(tp=tp, phase=phase, batch=batch, seq_len=seq_len)).ctx)
    assert len(report.per_chip) == tp
    for c in report.per_chip:
        assert c.weights_bytes == pytest.approx(weights, rel=1e-12)
        assert c.kv_cache_bytes == pytest.approx(kv, rel=1e-12)
        assert c.activation_bytes == pytest.approx(acts, rel=1e-12)
        assert c.workspace_bytes == 0.0
        assert c.total_bytes == pytest.approx(weights + kv + acts, rel=1e-12)
        assert c.capacity_bytes == H100_HBM_BYTES
        assert c.fits
    assert report.fits and report.shortfall_summary() == ""


def test_hand_numbers_for_one_chip_are_what_we_think():
    # a sanity anchor for the closed form itself: 8.03 B parameters in bf16, 128 KiB of KV
    # per token (32 layers x 4 KiB), and 2048 tokens x (8192 + 28672) activations
    weights, kv, acts = hand_ledger(LLAMA_8B, "prefill", 2, 1024)
    assert weights / BF16_BYTES == 8_030_261_248
    assert kv == 2 * 1024 * 32 * 4096
    assert acts == 2 * 2048 * (8192 + 28672)


def test_a_config_that_cannot_fit_says_so_naming_chips_and_gib():
    # llama-3.1-70b whole on each of two data-parallel chips: ~131 GiB of weights per 80 GiB chip
    batch, seq_len = 1, 4096
    report = memory_report(make_plan(_raw(model="llama-3.1-70b", dp=2, batch=batch, seq_len=seq_len)).ctx)
    weights, kv, acts = hand_ledger(LLAMA_70B, "prefill", batch, seq_len)
    shortfall_gib = (weights + kv + acts - H100_HBM_BYTES) / GIB
    assert shortfall_gib > 40
    assert not report.fits
    assert [c.fits for c in report.per_chip] == [False, False]
    assert report.shortfall_summary() == f"does not fit by {shortfall_gib:.2f} GiB on chips 0-1 (of 80.0 GiB each)"


def test_only_the_chips_that_overflow_are_named():
    # deepseek-v3 (61 layers: 3 dense, then MoE) on 16 pipeline stages: stage 0 holds the
    # embedding and 3 dense + 1 MoE layer, stages 1-12 hold 4 MoE layers (~86 GiB), stages
    # 13-15 hold 3 (~64-66 GiB): exactly chips 1-12 overflow
    report = memory_report(make_plan({
        "model": "deepseek-v3", "system": "h100-sxm", "chips": 16,
        "parallel": {"dp": 1, "tp": 1, "pp": 16, "cp": 1}, "phase": "decode", "batch": 1, "seq_len": 1024}).ctx)
    over = [c.chip for c in report.per_chip if not c.fits]
    assert over == list(range(1, 13))
    worst_gib = max(c.total_bytes - c.capacity_bytes for c in report.per_chip) / GIB
    assert report.shortfall_summary() == f"does not fit by {worst_gib:.2f} GiB on chips 1-12 (of 80.0 GiB each)"
    # pp=2 of llama-3.1-70b with a 1k context fits (40 layers, ~66 GiB per stage)
    ok = memory_report(make_plan(_raw(model="llama-3.1-70b", pp=2, batch=1, seq_len=1024)).ctx)
    assert ok.fits and ok.shortfall_summary() == ""


def test_json_memory_fields():
    batch, seq_len = 2, 1024
    weights, kv, acts = hand_ledger(LLAMA_8B, "prefill", batch, seq_len)
    out = run(_raw(batch=batch, seq_len=seq_len)).to_json_dict()
    mem = json.loads(json.dumps(out["memory"]))  # JSON-serialisable as is
    assert set(mem) == {"per_chip", "max_total_bytes", "fits", "terms"}
    (chip,) = mem["per_chip"]
    assert set(chip) == {"chip", "weights_bytes", "kv_cache_bytes", "activation_bytes", "workspace_bytes",
                         "total_bytes", "capacity_bytes", "fits"}
    assert chip["chip"] == 0 and chip["fits"] is True and chip["capacity_bytes"] == H100_HBM_BYTES
    assert chip["weights_bytes"] == pytest.approx(weights, rel=1e-12)
    assert chip["kv_cache_bytes"] == pytest.approx(kv, rel=1e-12)
    assert chip["activation_bytes"] == pytest.approx(acts, rel=1e-12)
    assert mem["max_total_bytes"] == pytest.approx(weights + kv + acts, rel=1e-12)
    assert mem["fits"] is True
    assert mem["terms"]["weights"] == {"category": "weights", "max_bytes": pytest.approx(weights, rel=1e-12)}
    assert mem["terms"]["kv_cache"]["category"] == "kv_cache"
    assert mem["terms"]["activations"]["category"] == "activations"


def test_cli_json_and_summary_report_the_same_ledger(tmp_path):
    raw = _raw(model="llama-3.1-70b", dp=2, batch=1, seq_len=256)
    cfg = tmp_path / "big.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    runner = CliRunner()
    res = runner.invoke(main, ["run", str(cfg), "--json"])
    assert res.exit_code == 0, res.output
    mem = json.loads(res.stdout)["memory"]
    weights, kv, acts = hand_ledger(LLAMA_70B, "prefill", 1, 256)
    assert mem["fits"] is False
    assert [c["fits"] for c in mem["per_chip"]] == [False, False]
    assert mem["max_total_bytes"] == pytest.approx(weights + kv + acts, rel=1e-12)
    text = runner.invoke(main, ["run", str(cfg)])
    assert text.exit_code == 0, text.output
    shortfall_gib = (weights + kv + acts - H100_HBM_BYTES) / GIB
    assert f"DOES NOT FIT: does not fit by {shortfall_gib:.2f} GiB on chips 0-1" in text.output
