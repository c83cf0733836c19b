"""Issue 35 item 9: launch files for a serving deployment (``--emit``): they parse, use only
the frameworks' documented flags, and read back to the winner's layout, batch limits and
chunk size; cp and sp are expressed where the framework has them and refused in one line
where not; the folder is checked before any work and the files written atomically."""
from __future__ import annotations

import json
import shlex

import pytest
import yaml
from click.testing import CliRunner

from g5core.api.errors import ConfigError
from g5core.present.cli import main
from g5core.present.emit import FRAMEWORKS, emit_files, read_back

WORKLOAD = {"requests": 400, "arrival": {"kind": "poisson", "rate_per_s": 12.5}, "input_tokens": 2000,
            "output_tokens": 200, "seed": 0}
#: a tp4 aggregated winner, as g5 best --serve writes it: 2 instances of 4 chips
AGG = {"model": "llama-3.1-70b", "system": "h100-sxm", "chips": 4,
       "parallel": {"dp": 1, "tp": 4, "pp": 1, "cp": 1, "sp": 1, "ep": 1},
       "serving": {"instances": 2, "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 4096,
                                                 "chunked_prefill": True},
                   "slo": "ttft_p99=2s,tpot_p99=50ms", "workload": WORKLOAD}}
#: a disaggregated winner: 2 prefill instances of tp2 and 1 decode instance of tp4 x pp2
DISAGG = {**AGG, "serving": {**AGG["serving"], "scheduler": {"max_num_seqs": 128, "max_num_batched_tokens": 8192},
                             "disaggregation": {"prefill": {"instances": 2, "chips": 2, "parallel": {"tp": 2}},
                                                "decode": {"instances": 1, "chips": 8,
                                                           "parallel": {"tp": 4, "pp": 2}}}}}
del DISAGG["serving"]["instances"]

#: the flags each framework documents (vllm/engine/arg_utils.py and vllm/config/parallel.py;
#: sglang python/sglang/srt/server_args.py; tensorrt_llm/llmapi/llm_args.py; the benchmarks')
DOCUMENTED = {
    "vllm": {"--port", "--tensor-parallel-size", "--pipeline-parallel-size", "--prefill-context-parallel-size",
             "--decode-context-parallel-size", "--enable-expert-parallel", "--max-num-seqs", "--max-num-batched-tokens",
             "--enable-chunked-prefill", "--no-enable-chunked-prefill", "--block-size", "--kv-cache-dtype",
             "--kv-transfer-config", "--long-prefill-token-threshold", "--model", "--disaggregation-mode"},
    "sglang": {"--model-path", "--port", "--tp-size", "--pp-size", "--ep-size", "--max-running-requests",
               "--chunked-prefill-size", "--page-size", "--kv-cache-dtype", "--disaggregation-mode",
               "--disaggregation-transfer-backend", "--pd-disaggregation", "--prefill", "--decode", "--host",
               "--enable-mixed-chunk"},
    "trtllm": {"--port", "--extra_llm_api_options", "-c"},
    "bench": {"--model", "--base-url", "--dataset-name", "--random-input-len", "--random-output-len", "--num-prompts",
              "--request-rate", "--max-concurrency", "--percentile-metrics", "--metric-percentiles", "--backend",
              "--host", "--port"},
}
TRTLLM_KEYS = {"tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size", "cp_config",
               "moe_expert_parallel_size", "max_batch_size", "max_num_tokens", "enable_chunked_prefill",
               "kv_cache_config", "cache_transceiver_config"}


def _flags(text: str) -> set[str]:
    out = set()
    for line in text.splitlines():
        if line.startswith("#") or not line.strip() or line == "wait":
            continue
        out |= {w for w in shlex.split(line.rstrip(" &")) if w.startswith("-") and w != "-m"}   # python3 -m
    return out


def _expected(config):
    block = config["serving"]
    if "disaggregation" in block:
        sched = block["scheduler"]
        return [{"role": role, "instances": p["instances"], "tp": p["parallel"].get("tp", 1),
                 "pp": p["parallel"].get("pp", 1), "cp": 1, "ep": 1, "max_num_seqs": sched["max_num_seqs"],
                 "max_num_batched_tokens": sched["max_num_batched_tokens"], "block_size": 16}
                for role, p in block["disaggregation"].items()]
    return [{"role": "serve", "instances": 2, "tp": 4, "pp": 1, "cp": 1, "ep": 1, "max_num_seqs": 64,
             "max_num_batched_tokens": 4096, "block_size": 16}]


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("config", [AGG, DISAGG], ids=["tp4-agg", "disagg"])
def test_files_parse_use_documented_flags_and_round_trip(framework, config):
    files = emit_files(config, framework)
    for name, text in files.items():
        if name.endswith(".yaml"):
            assert isinstance(yaml.safe_load(text), dict)
        if name == "launch.sh":
            allowed = DOCUMENTED["vllm" if framework in ("vllm", "dynamo") else framework]
            assert _flags(text) <= allowed, _flags(text) - allowed
            for line in text.splitlines():
                if "--kv-transfer-config" in line:
                    words = shlex.split(line.rstrip(" &"))
                    assert json.loads(words[words.index("--kv-transfer-config") + 1])["kv_connector"]
        if name.endswith("extra-llm-api-config.yaml"):
            assert set(yaml.safe_load(text)) <= TRTLLM_KEYS
    assert _flags(files["bench.sh"]) <= DOCUMENTED["bench"]
    assert "--request-rate 12.5" in files["bench.sh"] and "--random-input-len 2000" in files["bench.sh"]
    if framework == "dynamo":
        doc = yaml.safe_load(files["deployment.yaml"])
        assert doc["kind"] == "DynamoGraphDeployment"
        args = [a for s in doc["spec"]["services"].values() if s["componentType"] == "worker"
                for a in s["extraPodSpec"]["mainContainer"]["args"]]
        assert {a for a in args if a.startswith("-")} <= DOCUMENTED["vllm"]
    back = sorted(read_back(framework, files), key=lambda p: p["role"])
    # the configuration's steps mix (no framework key): SGLang's launch says so
    extra = {"mixed_prefill": True} if framework == "sglang" else {}
    assert back == sorted(({**p, **extra} for p in _expected(config)), key=lambda p: p["role"])


def test_the_launch_files_keep_the_scheduling_g5_serve_ran():
    """Under the sglang profile (or mixed_prefill: false) prefills run apart: SGLang's launch has
    no --enable-mixed-chunk, and vLLM's and TensorRT-LLM's, which always mix, are refused in one
    line naming the field; mixed_prefill: true wins over the profile."""
    apart = {**AGG, "framework": "sglang"}
    assert read_back("sglang", emit_files(apart, "sglang"))[0]["mixed_prefill"] is False
    for framework in ("vllm", "trtllm", "dynamo"):
        with pytest.raises(ConfigError, match=r"^serving.scheduler.mixed_prefill: false .*always runs prefill"):
            emit_files(apart, framework)
    mixed = {**apart, "serving": {**AGG["serving"], "scheduler": {**AGG["serving"]["scheduler"], "mixed_prefill": True}}}
    assert read_back("sglang", emit_files(mixed, "sglang"))[0]["mixed_prefill"] is True
    assert emit_files(mixed, "vllm")["launch.sh"]


def test_best_serve_refuses_launch_files_that_cannot_keep_its_scheduling_before_the_search(tmp_path):
    cfg = tmp_path / "s.yaml"
    cfg.write_text("model: llama-3.1-8b\nsystem: h100-sxm\nchips: 1\nparallel: {dp: 1, tp: 1, pp: 1, cp: 1}\n")
    r = CliRunner().invoke(main, ["best", str(cfg), "--serve", "--framework", "sglang", "--isl", "500", "--osl",
                                  "20", "--emit", "vllm", str(tmp_path / "out")])
    assert r.exit_code == 2 and "serving.scheduler.mixed_prefill" in r.output
    assert not (tmp_path / "out").exists() and "capacity" not in r.output.lower()


def test_cp_and_sp_expressed_or_refused_in_one_line():
    cp = {**AGG, "parallel": {**AGG["parallel"], "tp": 2, "cp": 2}}
    v = emit_files(cp, "vllm")["launch.sh"]
    assert "--prefill-context-parallel-size 2 --decode-context-parallel-size 2" in v
    assert read_back("vllm", emit_files(cp, "vllm"))[0]["cp"] == 2
    t = yaml.safe_load(emit_files(cp, "trtllm")["extra-llm-api-config.yaml"])
    assert t["context_parallel_size"] == 2 and t["cp_config"] == {"cp_type": "RING"}
    with pytest.raises(ConfigError, match=r"parallel.cp: cp=2: SGLang's attention context parallelism") as e:
        emit_files(cp, "sglang")
    assert "\n" not in str(e.value)
    sp = {**AGG, "parallel": {**AGG["parallel"], "tp": 2, "sp": 2}}
    with pytest.raises(ConfigError, match=r"parallel.sp: sp=2: vllm has no Ulysses"):
        emit_files(sp, "vllm")
    assert yaml.safe_load(emit_files(sp, "trtllm")["extra-llm-api-config.yaml"])["cp_config"] == {"cp_type": "ULYSSES"}


def test_g5_serve_emit_checks_the_folder_first_and_writes_the_files(tmp_path):
    cfg = tmp_path / "s.yaml"
    cfg.write_text("model: llama-3.1-8b\nsystem: h100-sxm\nchips: 1\nparallel: {dp: 1, tp: 1, pp: 1, cp: 1}\n"
                   "serving: {instances: 2, scheduler: {max_num_batched_tokens: 2048}}\n")
    flags = ["--rate", "5", "--requests", "20", "--isl", "500", "--osl", "20"]
    bad = CliRunner().invoke(main, ["serve", str(cfg), *flags, "--emit", "vllm", str(tmp_path / "no" / "such")])
    assert bad.exit_code == 2 and "--emit" in bad.output and "does not exist" in bad.output
    assert "TTFT" not in bad.output                                   # nothing ran
    out = tmp_path / "launch"
    r = CliRunner().invoke(main, ["serve", str(cfg), *flags, "--emit", "sglang", str(out)])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["bench.sh", "launch.sh"]
    back = read_back("sglang", {p.name: p.read_text() for p in out.iterdir()})
    assert back == [{"role": "serve", "instances": 2, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "max_num_seqs": 256,
                     "max_num_batched_tokens": 2048, "block_size": 16, "mixed_prefill": True}]
    assert "--request-rate 5.0" in (out / "bench.sh").read_text()
