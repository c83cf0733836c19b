"""Launch files for a serving configuration (``g5 serve --emit``, ``g5 best --serve --emit``):
the command lines or configuration files a framework reads to run the same deployment, and a
benchmark at the configuration's arrival rate and workload.

``emit_files(config, framework)`` returns ``{file name: text}`` for a configuration as
``g5 serve`` takes it (its ``serving:`` block: the instances, or the prefill and decode pools,
each with its layout and scheduler limits; ``serving.workload`` for the benchmark's rate and
lengths); :func:`read_back` parses the files again (the layout, batch limits and chunk size of
each pool), which the tests use to check the round trip.

The flags are the frameworks' documented ones:

- vLLM (``vllm serve``): ``--tensor-parallel-size``, ``--pipeline-parallel-size``,
  ``--prefill-context-parallel-size`` and ``--decode-context-parallel-size``,
  ``--enable-expert-parallel`` (vllm/config/parallel.py ``ParallelConfig``: PCP adds ranks,
  "expands the process world size", as G5's cp does; DCP "shards the decode KV cache" and
  spans the PCP axis; expert parallelism spans the TP x DP group), ``--max-num-seqs``,
  ``--max-num-batched-tokens``, ``--enable-chunked-prefill``/``--no-enable-chunked-prefill``,
  ``--long-prefill-token-threshold``, ``--block-size``, ``--kv-cache-dtype`` and
  ``--kv-transfer-config`` for a disaggregated pool (vllm/engine/arg_utils.py ``EngineArgs``;
  the NixlConnector of docs/features/nixl_connector_usage.md); the benchmark is ``vllm bench
  serve`` (``--dataset-name random --random-input-len --random-output-len --num-prompts
  --request-rate --percentile-metrics --metric-percentiles``, vllm/benchmarks/serve.py).
- SGLang (``python3 -m sglang.launch_server``): ``--tp-size``, ``--pp-size``, ``--ep-size``,
  ``--max-running-requests``, ``--chunked-prefill-size``, ``--page-size``, ``--kv-cache-dtype``,
  ``--enable-mixed-chunk`` where the pool's steps mix prefill chunks and decodes (SGLang's default
  keeps them apart; vLLM and TensorRT-LLM always mix them, so a pool that keeps them apart is
  refused there),
  ``--disaggregation-mode prefill|decode`` with ``--disaggregation-transfer-backend``
  (python/sglang/srt/server_args.py ``ServerArgs``), the router ``python3 -m
  sglang_router.launch_router --pd-disaggregation``; the benchmark ``python3 -m
  sglang.bench_serving``. Its attention context parallelism (``--attn-cp-size``) divides the
  tensor-parallel group (the FFN sharded over all of it), not extra ranks as G5's cp, so cp is
  refused.
- TensorRT-LLM (``trtllm-serve MODEL --extra_llm_api_options FILE``): the YAML keys of
  tensorrt_llm/llmapi/llm_args.py (``tensor_parallel_size``, ``pipeline_parallel_size``,
  ``context_parallel_size`` with ``cp_config: {cp_type}``: RING for a prefill or aggregated
  pool's cp, HELIX for a decode pool's, ULYSSES for sp, tensorrt_llm/mapping.py ``CpType``;
  ``moe_expert_parallel_size``, ``max_batch_size``, ``max_num_tokens``,
  ``enable_chunked_prefill``, ``kv_cache_config: {tokens_per_block, dtype}``,
  ``cache_transceiver_config`` for disaggregation), ``trtllm-serve disaggregated -c`` with
  ``context_servers``/``generation_servers``; the benchmark ``python3 -m
  tensorrt_llm.serve.scripts.benchmark_serving``.
- Dynamo: a ``DynamoGraphDeployment`` (apiVersion nvidia.com/v1alpha1; a Frontend and
  workers of ``componentType: worker``, ``subComponentType: prefill|decode``, ``replicas``,
  ``resources.limits.gpu``, ``python3 -m dynamo.vllm`` with vLLM's flags and
  ``--disaggregation-mode``: ai-dynamo/dynamo examples/backends/vllm/deploy/disagg.yaml),
  benchmarked through its OpenAI-compatible frontend with ``vllm bench serve``.

Ulysses sequence parallelism (G5's sp) has no serving flag in vLLM or SGLang and is refused
there. Every refusal is one line naming the dimension and the framework.
"""
from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from typing import Mapping, Optional

import yaml

from g5core.api.errors import ConfigError
from g5core.api.plugins import Hooks, make_plugin_manager
from g5core.inputs.framework import with_framework
from g5core.inputs.models import MODELS_DIR
from g5core.inputs.outputs import check_outputs
from g5core.inputs.serving import scheduler_under
from g5core.inputs.systems import get_system
from g5core.serve.api import load_workload
from g5core.serve.registry import serving_registry
from g5core.serve.scheduler import SchedulerSettings

FRAMEWORKS = ("vllm", "sglang", "trtllm", "dynamo")
#: Hugging Face repositories of the catalog models written out in Python (the data files name
#: theirs in their ``_comment``)
HF_REPOS = {"llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-70b": "meta-llama/Llama-3.1-70B-Instruct",
            "llama-3.1-405b": "meta-llama/Llama-3.1-405B-Instruct", "qwen2.5-72b": "Qwen/Qwen2.5-72B-Instruct",
            "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B", "mixtral-8x7b": "mistralai/Mixtral-8x7B-Instruct-v0.1",
            "deepseek-v3": "deepseek-ai/DeepSeek-V3"}
BASE_PORT = 8000
DYNAMO_IMAGE = "nvcr.io/nvidia/ai-dynamo/vllm-runtime"
VLLM_NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


def model_id(name: str) -> str:
    """The checkpoint a framework loads: a catalog name's Hugging Face repository, or the folder
    of a config.json path."""
    if name in HF_REPOS:
        return HF_REPOS[name]
    data = MODELS_DIR / f"{name}.json"
    if data.exists():
        comment = json.loads(data.read_text()).get("_comment", "")
        if "huggingface.co/" in comment:
            return "/".join(comment.split("huggingface.co/", 1)[1].split("/")[:2])
    p = Path(name)
    return str(p.parent if p.name == "config.json" else p)


def _roles(config: Mapping) -> list[tuple[str, Mapping]]:
    """``(role, its block)`` of each pool of the configuration's ``serving:`` block."""
    block = config.get("serving") or {}
    dis = block.get("disaggregation")
    return [(r, dis[r]) for r in ("prefill", "decode")] if dis else [("serve", {"instances": block.get("instances", 1)})]


def _scheduler(config: Mapping, data: Mapping) -> SchedulerSettings:
    """A pool's scheduler settings as g5 serve runs them: the configuration's keys, its
    framework profile's scheduling where they leave it out (:func:`scheduler_under`)."""
    given = {**dict((config.get("serving") or {}).get("scheduler") or {}), **dict(data.get("scheduler") or {})}
    system = get_system(str(data.get("system", config["system"])))
    if config.get("framework"):
        system = with_framework(system, str(config["framework"]), "framework")
    return scheduler_under(SchedulerSettings.from_dict(given, "serving.scheduler"), given, system)


def check_scheduling(config: Mapping, framework: str) -> None:
    """ConfigError where ``framework`` cannot run the configuration's scheduling (before a
    search whose winner keeps it): prefill steps apart from decode are SGLang's only."""
    for role, data in _roles(config):
        _refuse_scheduling(framework, role, _scheduler(config, data).mixed_prefill)


def _refuse_scheduling(framework: str, role: str, mixed: bool) -> None:
    if not mixed and framework != "sglang":
        field = "serving.scheduler" if role == "serve" else f"serving.disaggregation.{role}.scheduler"
        raise ConfigError(f"{field}.mixed_prefill", f"false (prefill steps apart from decode, SGLang's scheduling): "
                                                    f"{framework} always runs prefill chunks beside the decodes; emit "
                                                    "sglang, or set mixed_prefill: true")


def _pools(config: Mapping) -> list[dict]:
    """Each pool: role, instances, chips, layout (every dimension), scheduler limits."""
    base_par = dict(config.get("parallel") or {})
    out = []
    for role, data in _roles(config):
        par = {**base_par, **dict(data.get("parallel") or {})}
        s = _scheduler(config, data)
        layout = {d: int(par.get(d, 1)) for d in ("tp", "pp", "cp", "sp", "ep", "dp")}
        if layout["dp"] != 1:
            raise ConfigError("parallel.dp", f"dp={layout['dp']} inside an instance: launch files give data "
                                             "parallelism as instances (serving.instances); set dp to 1")
        chips = layout["tp"] * layout["pp"] * layout["cp"] * layout["sp"]
        out.append({"role": role, "instances": int(data.get("instances", 1)), "chips": chips, "layout": layout,
                    "max_num_seqs": s.max_num_seqs, "max_num_batched_tokens": s.max_num_batched_tokens,
                    "chunked_prefill": s.chunked_prefill, "block_size": s.block_size,
                    "long_prefill_token_threshold": s.long_prefill_token_threshold,
                    "mixed_prefill": s.mixed_prefill})
    return out


def _refuse(framework: str, pool: Mapping) -> None:
    lay = pool["layout"]
    where = f"serving.disaggregation.{pool['role']}.parallel" if pool["role"] != "serve" else "parallel"
    if lay["sp"] > 1 and framework in ("vllm", "sglang", "dynamo"):
        raise ConfigError(f"{where}.sp", f"sp={lay['sp']}: {framework} has no Ulysses sequence parallelism for serving "
                                         "a decoder model; emit trtllm (cp_type ULYSSES) or a layout with sp=1")
    if lay["cp"] > 1 and framework == "sglang":
        raise ConfigError(f"{where}.cp", f"cp={lay['cp']}: SGLang's attention context parallelism (--attn-cp-size) "
                                         "divides the tensor-parallel group, not extra ranks as G5's cp; emit vllm or "
                                         "trtllm, or a layout with cp=1")
    if lay["cp"] > 1 and lay["sp"] > 1 and framework == "trtllm":
        raise ConfigError(f"{where}.cp", "cp and sp together: TensorRT-LLM takes one cp_config (one cp_type); emit a "
                                         "layout with one of them")
    _refuse_scheduling(framework, pool["role"], pool["mixed_prefill"])
    if lay["ep"] > 1 and framework in ("vllm", "dynamo") and lay["ep"] != lay["tp"]:
        raise ConfigError(f"{where}.ep", f"ep={lay['ep']} with tp={lay['tp']}: vLLM's expert parallelism spans the "
                                         "whole TP x DP group (--enable-expert-parallel); emit a layout with ep = tp "
                                         "or ep = 1")


def _workload(config: Mapping) -> dict:
    """Benchmark settings: rate, requests and the mean input and output lengths."""
    w = dict((config.get("serving") or {}).get("workload") or {})
    if not w:
        raise ConfigError("serving.workload", "the benchmark command needs a workload: give --rate, --isl and --osl "
                                              "(or --workload FILE)")
    reqs = load_workload(w, serving_registry(Hooks(make_plugin_manager())), "serving.workload").requests
    rate = (w.get("arrival") or {}).get("rate_per_s")
    span = reqs[-1].arrival_s - reqs[0].arrival_s if len(reqs) > 1 else 0.0
    return {"requests": len(reqs), "rate_per_s": float(rate) if rate is not None else (
                len(reqs) / span if span > 0 else None),
            "input_tokens": round(sum(r.input_tokens for r in reqs) / len(reqs)),
            "output_tokens": round(sum(r.output_tokens for r in reqs) / len(reqs)),
            "trace": w.get("trace"), "closed": (w.get("arrival") or {}).get("kind") == "closed",
            "concurrency": (w.get("arrival") or {}).get("concurrency")}


def _vllm_args(model: str, pool: Mapping, disagg: bool, kv_dtype: str) -> list[str]:
    lay = pool["layout"]
    args = ["--tensor-parallel-size", str(lay["tp"]), "--pipeline-parallel-size", str(lay["pp"])]
    if lay["cp"] > 1:
        args += ["--prefill-context-parallel-size", str(lay["cp"]), "--decode-context-parallel-size", str(lay["cp"])]
    if lay["ep"] > 1:
        args += ["--enable-expert-parallel"]
    args += ["--max-num-seqs", str(pool["max_num_seqs"]), "--max-num-batched-tokens",
             str(pool["max_num_batched_tokens"]),
             "--enable-chunked-prefill" if pool["chunked_prefill"] else "--no-enable-chunked-prefill",
             "--block-size", str(pool["block_size"])]
    if pool["long_prefill_token_threshold"]:
        args += ["--long-prefill-token-threshold", str(pool["long_prefill_token_threshold"])]
    if kv_dtype == "fp8":
        args += ["--kv-cache-dtype", "fp8"]
    if disagg:
        args += ["--kv-transfer-config", json.dumps(VLLM_NIXL, separators=(",", ":"))]
    return args


def _sglang_args(pool: Mapping, kv_dtype: str) -> list[str]:
    lay = pool["layout"]
    args = ["--tp-size", str(lay["tp"]), "--pp-size", str(lay["pp"])]
    if lay["ep"] > 1:
        args += ["--ep-size", str(lay["ep"])]
    args += ["--max-running-requests", str(pool["max_num_seqs"]), "--chunked-prefill-size",
             str(pool["max_num_batched_tokens"] if pool["chunked_prefill"] else -1), "--page-size",
             str(pool["block_size"])]
    if pool["mixed_prefill"]:
        args += ["--enable-mixed-chunk"]
    if kv_dtype == "fp8":
        args += ["--kv-cache-dtype", "fp8_e4m3"]
    if pool["role"] != "serve":
        args += ["--disaggregation-mode", pool["role"], "--disaggregation-transfer-backend", "nixl"]
    return args


def _trtllm_options(pool: Mapping, kv_dtype: str) -> dict:
    lay = pool["layout"]
    out = {"tensor_parallel_size": lay["tp"], "pipeline_parallel_size": lay["pp"]}
    if lay["cp"] > 1 or lay["sp"] > 1:
        kind = "ULYSSES" if lay["sp"] > 1 else ("HELIX" if pool["role"] == "decode" else "RING")
        out["context_parallel_size"] = lay["cp"] * lay["sp"]
        out["cp_config"] = {"cp_type": kind}
    if lay["ep"] > 1:
        out["moe_expert_parallel_size"] = lay["ep"]
    out.update(max_batch_size=pool["max_num_seqs"], max_num_tokens=pool["max_num_batched_tokens"],
               enable_chunked_prefill=pool["chunked_prefill"],
               kv_cache_config={"tokens_per_block": pool["block_size"], **({"dtype": "fp8"} if kv_dtype == "fp8"
                                                                           else {})})
    if pool["role"] != "serve":
        out["cache_transceiver_config"] = {"backend": "DEFAULT"}
    return out


def _line(words: list[str], env: Optional[str] = None) -> str:
    return (f"{env} " if env else "") + " ".join(shlex.quote(w) for w in words)


def _devices(first: int, n: int) -> str:
    return "CUDA_VISIBLE_DEVICES=" + ",".join(str(first + k) for k in range(n))


def _servers(pools: list[dict]):
    """``(pool, instance, port, first chip)`` of every instance, pools in order, on chips
    numbered from 0 (one instance after another, as G5 places them)."""
    chip, port = 0, BASE_PORT
    for pool in pools:
        for k in range(pool["instances"]):
            yield pool, k, port, chip
            chip += pool["chips"]
            port += 1


def _bench(framework: str, model: str, wl: Mapping, port: int) -> str:
    head = ["#!/bin/sh", "# the benchmark at the configuration's workload: "
            f"{wl['requests']:,} requests of {wl['input_tokens']:,} input and {wl['output_tokens']:,} output tokens "
            "(the workload's means" + (f"; its trace {os.path.basename(str(wl['trace']))} is replayed at its mean rate"
                                       if wl["trace"] else "") + ")"]
    if wl["closed"]:
        rate = ["--max-concurrency", str(wl["concurrency"])]
        head.append(f"# closed loop: {wl['concurrency']} requests in flight")
    else:
        rate = ["--request-rate", repr(wl["rate_per_s"])]
        head.append(f"# at {wl['rate_per_s']:.6g} requests/s (Poisson arrivals)")
    lengths = ["--dataset-name", "random", "--random-input-len", str(wl["input_tokens"]), "--random-output-len",
               str(wl["output_tokens"]), "--num-prompts", str(wl["requests"])]
    if framework == "sglang":
        cmd = ["python3", "-m", "sglang.bench_serving", "--backend", "sglang", "--host", "127.0.0.1", "--port",
               str(port), *lengths, *rate]
    elif framework == "trtllm":
        cmd = ["python3", "-m", "tensorrt_llm.serve.scripts.benchmark_serving", "--model", model, "--host",
               "127.0.0.1", "--port", str(port), *lengths, *rate, "--percentile-metrics", "ttft,tpot,itl,e2el",
               "--metric-percentiles", "50,90,99"]
    else:
        cmd = ["vllm", "bench", "serve", "--model", model, "--base-url", f"http://127.0.0.1:{port}", *lengths, *rate,
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"]
    return "\n".join(head + [_line(cmd)]) + "\n"


def emit_files(config: Mapping, framework: str) -> dict[str, str]:
    """``{file name: text}`` of ``framework``'s launch files for ``config`` (a configuration with
    a ``serving:`` block and a workload); a layout the framework cannot express is a one-line
    ConfigError naming the dimension."""
    if framework not in FRAMEWORKS:
        raise ConfigError("--emit", f"unknown framework {framework!r}; use {', '.join(FRAMEWORKS)}")
    pools = _pools(config)
    for pool in pools:
        _refuse(framework, pool)
    wl = _workload(config)
    model = model_id(str(config["model"]))
    kv_dtype = str((config.get("dtypes") or {}).get("kv_cache", "bf16"))
    disagg = len(pools) == 2
    note = (f"# G5 deployment: {config['model']} on {sum(p['instances'] * p['chips'] for p in pools)} x "
            f"{config['system']}; " + "; ".join(
                f"{p['role']}: {p['instances']} x {p['chips']} chip{'s' if p['chips'] > 1 else ''} "
                f"({' '.join(f'{k}={v}' for k, v in p['layout'].items() if v != 1) or 'one chip'}), max_num_seqs "
                f"{p['max_num_seqs']}, max_num_batched_tokens {p['max_num_batched_tokens']}" for p in pools))
    files: dict[str, str] = {}
    if framework == "dynamo":
        files["deployment.yaml"] = _dynamo(model, pools, kv_dtype, note)
        files["bench.sh"] = _bench("vllm", model, wl, BASE_PORT)
        return files
    lines = ["#!/bin/sh", note, "# one server per instance, each on its own chips (renumber the devices per node)"]
    if framework == "trtllm":
        for pool in pools:
            name = "extra-llm-api-config.yaml" if pool["role"] == "serve" else f"{pool['role']}-extra-llm-api-config.yaml"
            files[name] = note + "\n" + yaml.safe_dump(_trtllm_options(pool, kv_dtype), sort_keys=False)
    urls: dict[str, list[str]] = {"prefill": [], "decode": [], "serve": []}
    for pool, k, port, chip in _servers(pools):
        urls[pool["role"]].append(f"127.0.0.1:{port}")
        lines.append(f"# {pool['role']} instance {k}")
        env = _devices(chip, pool["chips"])
        if framework == "vllm":
            words = ["vllm", "serve", model, "--port", str(port), *_vllm_args(model, pool, disagg, kv_dtype)]
        elif framework == "sglang":
            words = ["python3", "-m", "sglang.launch_server", "--model-path", model, "--port", str(port),
                     *_sglang_args(pool, kv_dtype)]
        else:
            opts = "extra-llm-api-config.yaml" if pool["role"] == "serve" else f"{pool['role']}-extra-llm-api-config.yaml"
            words = ["trtllm-serve", model, "--port", str(port), "--extra_llm_api_options", opts]
        lines.append(_line(words, env) + " &")
    front = BASE_PORT - 1 if disagg else BASE_PORT
    if disagg and framework == "sglang":
        front = BASE_PORT + sum(p["instances"] for p in pools)
        router = ["python3", "-m", "sglang_router.launch_router", "--pd-disaggregation"]
        for u in urls["prefill"]:
            router += ["--prefill", f"http://{u}"]
        for u in urls["decode"]:
            router += ["--decode", f"http://{u}"]
        lines.append(_line(router + ["--host", "127.0.0.1", "--port", str(front)]) + " &")
    elif disagg and framework == "trtllm":
        front = BASE_PORT + sum(p["instances"] for p in pools)
        files["disagg-config.yaml"] = yaml.safe_dump(
            {"hostname": "127.0.0.1", "port": front,
             "context_servers": {"num_instances": len(urls["prefill"]), "urls": urls["prefill"]},
             "generation_servers": {"num_instances": len(urls["decode"]), "urls": urls["decode"]}}, sort_keys=False)
        lines.append(_line(["trtllm-serve", "disaggregated", "-c", "disagg-config.yaml"]) + " &")
    elif disagg:   # vllm: the prefill and decode servers exchange KV through NIXL; a proxy routes
        front = BASE_PORT + sum(p["instances"] for p in pools)
        lines.append(f"# route each request to a prefill then a decode server on port {front} (vLLM's "
                     "examples/online_serving/disaggregated_serving proxy, or Dynamo: --emit dynamo)")
    elif pools[0]["instances"] > 1:
        lines.append(f"# {pools[0]['instances']} instances on ports {BASE_PORT}-{BASE_PORT + pools[0]['instances'] - 1}: "
                     "put a router in front (G5 routed them " + str((config.get("serving") or {}).get(
                         "router", "round_robin")) + ")")
    lines.append("wait")
    files["launch.sh"] = "\n".join(lines) + "\n"
    files["bench.sh"] = _bench(framework, model, wl, front)
    return files


def _dynamo(model: str, pools: list[dict], kv_dtype: str, note: str) -> str:
    services: dict = {"Frontend": {"componentType": "frontend", "replicas": 1,
                                   "extraPodSpec": {"mainContainer": {"image": f"{DYNAMO_IMAGE}:TAG"}}}}
    disagg = len(pools) == 2
    for pool in pools:
        name = {"serve": "VllmWorker", "prefill": "VllmPrefillWorker", "decode": "VllmDecodeWorker"}[pool["role"]]
        args = ["--model", model, *_vllm_args(model, pool, False, kv_dtype)]
        if disagg:
            args += ["--disaggregation-mode", pool["role"]]
        svc = {"envFromSecret": "hf-token-secret", "componentType": "worker"}
        if disagg:
            svc["subComponentType"] = pool["role"]
        svc.update(replicas=pool["instances"], resources={"limits": {"gpu": str(pool["chips"])}},
                   extraPodSpec={"mainContainer": {"image": f"{DYNAMO_IMAGE}:TAG",
                                                   "workingDir": "/workspace/examples/backends/vllm",
                                                   "command": ["python3", "-m", "dynamo.vllm"], "args": args}})
        services[name] = svc
    doc = {"apiVersion": "nvidia.com/v1alpha1", "kind": "DynamoGraphDeployment",
           "metadata": {"name": "g5-" + ("disagg" if disagg else "agg")}, "spec": {"services": services}}
    return note + "\n" + yaml.safe_dump(doc, sort_keys=False)


# -- reading the files back (the round trip the tests check) ---------------------------------------

_VLLM_FLAGS = {"--tensor-parallel-size": "tp", "--pipeline-parallel-size": "pp", "--prefill-context-parallel-size": "cp",
               "--max-num-seqs": "max_num_seqs", "--max-num-batched-tokens": "max_num_batched_tokens",
               "--block-size": "block_size"}
_SGLANG_FLAGS = {"--tp-size": "tp", "--pp-size": "pp", "--ep-size": "ep", "--max-running-requests": "max_num_seqs",
                 "--chunked-prefill-size": "max_num_batched_tokens", "--page-size": "block_size"}


def _parse_flags(words: list[str], table: Mapping[str, str]) -> dict:
    out: dict = {"tp": 1, "pp": 1, "cp": 1, "ep": 1}
    for k, w in enumerate(words):
        if w in table:
            out[table[w]] = int(words[k + 1])
        if w == "--enable-expert-parallel":
            out["ep"] = -1   # the whole TP group (below)
        if w == "--disaggregation-mode":
            out["role"] = words[k + 1]
        if w == "--enable-mixed-chunk":
            out["mixed_prefill"] = True
        if w == "--kv-transfer-config":
            out["kv_transfer"] = json.loads(words[k + 1])
    if out["ep"] == -1:
        out["ep"] = out["tp"]
    return out


def _group(servers: list[dict]) -> list[dict]:
    """Servers of one role and settings folded into pools with an instance count."""
    pools: list[dict] = []
    for s in servers:
        s = {**s, "role": s.get("role", "serve")}
        s.pop("kv_transfer", None)
        for p in pools:
            if {k: v for k, v in p.items() if k != "instances"} == s:
                p["instances"] += 1
                break
        else:
            pools.append({**s, "instances": 1})
    return pools


def read_back(framework: str, files: Mapping[str, str]) -> list[dict]:
    """Each pool's ``role``, ``instances``, ``tp``/``pp``/``cp``/``ep``, ``max_num_seqs``,
    ``max_num_batched_tokens`` and ``block_size``, parsed from emitted files (SGLang's also
    ``mixed_prefill``: ``--enable-mixed-chunk``)."""
    if framework == "dynamo":
        doc = yaml.safe_load(files["deployment.yaml"])
        out = []
        for name, svc in doc["spec"]["services"].items():
            if svc["componentType"] != "worker":
                continue
            args = svc["extraPodSpec"]["mainContainer"]["args"]
            p = _parse_flags(args, _VLLM_FLAGS)
            p.pop("kv_transfer", None)
            out.append({**p, "role": p.get("role", "serve"), "instances": svc["replicas"]})
        return out
    if framework == "trtllm":
        servers = []
        for line in files["launch.sh"].splitlines():
            words = shlex.split(line.rstrip(" &"))
            if words[1:2] == ["trtllm-serve"] and "--extra_llm_api_options" in words:
                name = words[words.index("--extra_llm_api_options") + 1]
                o = yaml.safe_load(files[name])
                role = name.split("-")[0] if name != "extra-llm-api-config.yaml" else "serve"
                cp = o.get("context_parallel_size", 1)
                servers.append({"role": role, "tp": o["tensor_parallel_size"], "pp": o["pipeline_parallel_size"],
                                "cp": cp, "ep": o.get("moe_expert_parallel_size", 1),
                                "max_num_seqs": o["max_batch_size"], "max_num_batched_tokens": o["max_num_tokens"],
                                "block_size": o["kv_cache_config"]["tokens_per_block"]})
        return _group(servers)
    servers, role = [], "serve"
    for line in files["launch.sh"].splitlines():
        marker = re.fullmatch(r"# (serve|prefill|decode) instance \d+", line)
        if marker:
            role = marker.group(1)
        if not line.startswith("CUDA_VISIBLE_DEVICES="):
            continue
        words = shlex.split(line.rstrip(" &"))[1:]
        servers.append({"role": role, **({} if framework == "vllm" else {"mixed_prefill": False}),
                        **_parse_flags(words, _VLLM_FLAGS if framework == "vllm" else _SGLANG_FLAGS)})
    return _group(servers)


def check_emit_dir(directory, framework: str, inputs=()):
    """Check ``--emit``'s folder before any work: it exists, or its parent does (it is then
    created when the files are written); a file there of an emitted name is replaced."""
    if framework not in FRAMEWORKS:
        raise ConfigError("--emit", f"unknown framework {framework!r}; use {', '.join(FRAMEWORKS)}")
    d = Path(os.path.expanduser(str(directory)))
    if d.exists() and not d.is_dir():
        raise ConfigError("--emit", f"'{directory}' is not a folder; give the folder the launch files go to")
    parent = d if d.exists() else d.parent
    if not parent.exists():
        raise ConfigError("--emit", f"cannot write '{directory}': the folder '{parent}' does not exist; create it first")
    probe = check_outputs({"--emit": parent / ".g5-emit-probe"}, inputs)   # writable, not an input
    del probe
    return d


def write_emit(directory: Path, files: Mapping[str, str], inputs=()) -> list[str]:
    """Write every file atomically (all staged, then renamed); returns the paths written."""
    directory.mkdir(exist_ok=True)
    targets = check_outputs({f"--emit {name}": directory / name for name in files}, inputs)
    targets.write({f"--emit {name}": (lambda fh, text=text: fh.write(text)) for name, text in files.items()})
    for name in files:
        if name.endswith(".sh"):
            os.chmod(directory / name, 0o755)
    return [str(directory / name) for name in files]
