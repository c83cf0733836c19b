"""Issue 35 item 6: a hub config's quantization_config sets the weights' dtypes (mxfp4, fp8,
nvfp4), others warn in one line; `g5 models` says what its active counts count."""
from __future__ import annotations

import json

from click.testing import CliRunner

from g5core.inputs.config import Deployment
from g5core.session.run import make_plan
from g5core.inputs.models import MODELS_DIR, get_model, read_quantization
from g5core.present.cli import main

GPT_OSS_QC = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
DEEPSEEK_QC = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def hub_copy(tmp_path, catalog: str, qc) -> str:
    data = json.loads((MODELS_DIR / f"{catalog}.json").read_text())
    data["quantization_config"] = qc
    p = tmp_path / catalog / "config.json"
    p.parent.mkdir()
    p.write_text(json.dumps(data))
    return str(p)


def deployment(model: str, **extra) -> Deployment:
    return make_plan({"model": model, "system": "b200", "chips": 1, "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1},
                      "phase": "decode", "batch": 1, "seq_len": 1024, **extra}).ctx.deployment


def test_gpt_oss_mxfp4_runs_its_experts_in_mxfp4(tmp_path):
    path = hub_copy(tmp_path, "gpt-oss-120b", GPT_OSS_QC)
    assert dict(get_model(path).published_weights) == {"default": "bf16", "experts": "mxfp4"}
    dep = deployment(path)
    assert dep.dtypes.weight_dtype("experts") == "mxfp4" and dep.dtypes.weight_dtype("attention") == "bf16"
    # the configuration's own dtypes.weights wins
    assert deployment(path, dtypes={"weights": "bf16"}).dtypes.weight_dtype("experts") == "bf16"
    # the catalog model is unchanged
    assert deployment("gpt-oss-120b").dtypes.weight_dtype("experts") == "bf16"


def test_gpt_oss_hub_copy_fits_a_b200(tmp_path):
    from g5core.session.run import run

    path = hub_copy(tmp_path, "gpt-oss-120b", GPT_OSS_QC)
    raw = {"model": path, "system": "b200", "chips": 1, "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1}, "phase": "decode", "batch": 1,
           "seq_len": 1024, "path": "math"}
    assert run(raw).memory.fits


def test_fp8_nvfp4_and_an_unknown_method():
    assert dict(read_quantization(DEEPSEEK_QC, "m")[0]) == {"default": "bf16", "attention": "fp8", "ffn": "fp8",
                                                            "experts": "fp8"}
    nv = {"quant_method": "modelopt", "quant_algo": "NVFP4", "exclude_modules": ["lm_head", "model.layers.*.self_attn*"]}
    assert dict(read_quantization(nv, "m")[0]) == {"default": "bf16", "ffn": "nvfp4", "experts": "nvfp4"}
    ct = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"format": "nvfp4-pack-quantized"}}}
    assert dict(read_quantization(ct, "m")[0])["ffn"] == "nvfp4"
    weights, warning = read_quantization({"quant_method": "gptq", "bits": 4}, "m")
    assert weights == () and "'gptq' is not read" in warning and "\n" not in warning


def test_an_unknown_method_is_a_one_line_warning_of_g5_explain(tmp_path):
    path = hub_copy(tmp_path, "gpt-oss-20b", {"quant_method": "awq"})
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {path}\nsystem: b200\nchips: 1\nparallel: {{dp: 1, tp: 1, pp: 1, cp: 1}}\nphase: decode\nbatch: 1\n"
                   "seq_len: 1024\n")
    r = CliRunner().invoke(main, ["explain", str(cfg)])
    assert r.exit_code == 0, r.output
    assert "g5: warning: gpt-oss-20b: quantization_config quant_method 'awq' is not read" in r.output


def test_g5_models_says_what_its_active_counts_count():
    out = CliRunner().invoke(main, ["models"]).output
    row = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("gpt-oss-120b", "qwen3-30b"))}
    assert row["gpt-oss-120b"][5:7] == ["5.71B", "5.13B"]        # OpenAI publishes 5.1B: less the embedding
    assert row["qwen3-30b-a3b"][5] == "3.35B"                     # Qwen publishes 3.3B: everything
    assert "less embedding: without the input embedding table" in out
