"""Serving framework profiles (g5core/data/frameworks/*.yaml): selection and overrides, CUDA
graphs with captured batch sizes, host time per step, the framework's own all-reduce."""
from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from g5core.api.errors import ConfigError
from g5core.inputs.framework import FRAMEWORK_NAMES, Framework, HostTime, launched_kernels, load_profile
from g5core.inputs.step import Step, StepGroup
from g5core.inputs.systems import get_system
from g5core.present.cli import main
from g5core.session.collbench import collective_rows
from g5core.session.prepared import prepare
from g5core.session.run import run

SMALL = {"model": "llama-3.1-8b", "system": "h100-sxm", "chips": 1,
         "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1}, "phase": "decode", "batch": 1, "seq_len": 1}


def _system(tmp_path, body: str) -> str:
    path = tmp_path / f"fw-{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(f"base: h100-sxm\nname: h100-fw\nframework: {body}\n")
    return str(path)


def test_every_shipped_profile_loads_with_a_version_and_sources():
    for name in FRAMEWORK_NAMES:
        data = load_profile(name)
        fw = Framework.from_mapping({"name": name})
        assert fw.name == name and fw.version == str(data["version"])
        if name != "generic":
            # every value the profile sets names where it comes from
            assert {"cuda_graph_batch_sizes", "all_reduce.max_bytes", "host", "mixed_prefill"} <= set(data["sources"])
            assert fw.all_reduce is not None and fw.cuda_graph_batch_sizes is not None


def test_the_block_overrides_the_profile_and_bad_selections_are_one_clear_error():
    fw = Framework.from_mapping({"name": "vllm", "cuda_graph_batch_sizes": [1, 2], "fusions": {"act_quant": False}})
    assert fw.cuda_graph_batch_sizes == (1, 2) and fw.stack == "vllm"
    assert "act_quant" not in fw.fusions and "norm_quant" in fw.fusions
    assert fw.all_reduce.kernel == "vllm_custom"        # the profile's own value, not overridden
    with pytest.raises(ConfigError, match="system.framework.name.*did you mean 'vllm'"):
        Framework.from_mapping({"name": "vlm"})
    with pytest.raises(ConfigError, match="system.framework.version.*ships the vllm profile of release"):
        Framework.from_mapping({"name": "vllm", "version": "0.1"})
    with pytest.raises(ConfigError, match="system.framework.version.*add name"):
        Framework.from_mapping({"version": "0.1"})
    result = CliRunner().invoke(main, ["run", "examples/llama-3.1-8b-prefill.yaml", "--framework", "vlm"])
    assert result.exit_code == 2 and "--framework" in result.output


def test_generic_is_bit_for_bit_the_run_without_a_profile(tmp_path):
    plain = run(SMALL)
    for step in ({"batch": 3, "seq_len": 2048}, {"phase": "prefill", "batch": 1, "seq_len": 512}):
        a, b = run({**SMALL, **step}), run({**SMALL, **step, "framework": "generic"})
        assert a.latency_s == b.latency_s
        ja, jb = a.to_json_dict(), b.to_json_dict()
        jb["deployment"].pop("framework")
        ja.pop("sim_wall_s"), jb.pop("sim_wall_s")
        assert ja == jb
    # a file's framework: {name: generic} block prices steps as a system without a block does
    system = _system(tmp_path, "{name: generic}")
    for step in ({"batch": 3, "seq_len": 2048}, {"phase": "prefill", "batch": 1, "seq_len": 512}):
        assert run({**SMALL, **step, "system": system}).latency_s == run({**SMALL, **step}).latency_s
    assert plain.latency_s > 0


def test_a_decode_batch_of_5_with_graphs_of_1_2_4_8_costs_what_8_cost_and_above_8_runs_eagerly(tmp_path):
    system = _system(tmp_path, "{cuda_graph_batch_sizes: [1, 2, 4, 8], graph_kernel_s: 0.5e-6}")
    at = lambda b, s=1: run({**SMALL, "system": system, "batch": b, "seq_len": s})  # noqa: E731
    # at context 1 the three padding slots are decodes like the others: the step is the batch of 8
    assert at(5).latency_s == at(8).latency_s
    assert at(4).latency_s < at(5).latency_s
    # at a longer context the padding slots attend nothing: 5 real decodes and 3 empty ones
    plan = prepare({**SMALL, "system": system})
    padded = Step([StepGroup(new_tokens=1, cached_tokens=4095, count=5), StepGroup(new_tokens=1, count=3)])
    assert plan.simulate(Step.decode(5, 4096)).latency_s == plan.simulate(padded).latency_s
    # above the largest captured size every kernel pays its launch, inside a graph only 0.5 us
    eager, graph = at(9), at(8)
    ops = [op for op in eager.sim.dag.ops if hasattr(op, "kernels") and op.chip == 0]
    kernels = sum(max(1, launched_kernels(op, eager.plan.ctx.system, "decode")) for op in ops)
    assert eager.sim.compute["launch"]["added_s"] == pytest.approx(kernels * 5e-6, rel=1e-9)
    assert graph.sim.compute["launch"]["added_s"] == pytest.approx(kernels * 0.5e-6, rel=1e-9)
    # without padding a batch between captured sizes runs eagerly (TensorRT-LLM's default)
    exact = _system(tmp_path, "{cuda_graph_batch_sizes: [1, 2, 4, 8], graph_kernel_s: 0.5e-6, "
                              "cuda_graph_padding: false}")
    assert run({**SMALL, "system": exact, "batch": 5}).sim.compute["launch"]["added_s"] == pytest.approx(
        kernels * 5e-6, rel=1e-9)


def test_a_context_parallel_decode_between_captured_sizes_pads_with_slots_its_split_takes(tmp_path):
    """cp splits every context into 2 x cp balanced chunks: a padding slot gets the least
    context the split takes (one new token after 2 x cp - 1 cached), where a slot of one token
    had made every padded cp decode refuse ('context tokens 1 are not divisible by 2 x cp'):
    `g5 run` and the serving search's padded steps alike."""
    system = _system(tmp_path, "{cuda_graph_batch_sizes: [1, 2, 4, 8], graph_kernel_s: 0.5e-6}")
    cp = {**SMALL, "system": system, "chips": 2, "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 2}, "seq_len": 4096}
    five, eight = run({**cp, "batch": 5}), run({**cp, "batch": 8})
    assert eight.latency_s >= five.latency_s > run({**cp, "batch": 4}).latency_s
    padded = Step([StepGroup(new_tokens=1, cached_tokens=4095, count=5), StepGroup(new_tokens=1, cached_tokens=3,
                                                                                    count=3)])
    assert prepare(cp).simulate(Step.decode(5, 4096)).latency_s == prepare(cp).simulate(padded).latency_s
    # without cp the slots stay one token (the step above, bit for bit)
    from g5core.inputs.framework import graph_step
    fw = get_system(system)
    assert StepGroup(new_tokens=1, cached_tokens=0, count=3) in tuple(graph_step(Step.decode(5, 4096), fw))
    assert StepGroup(new_tokens=1, cached_tokens=3, count=3) in tuple(graph_step(Step.decode(5, 4096), fw, 4))


def test_a_profile_prices_a_launch_once_not_the_per_op_overhead_on_top(tmp_path):
    """launch_overhead_s (the host's fixed cost of one launch, per op) is not added where the
    framework prices every kernel's launch: inside a CUDA graph there is no host launch."""
    old = run({**SMALL, "system": _system(tmp_path, "{cuda_graphs: decode}"), "batch": 8})
    new = run({**SMALL, "system": _system(tmp_path, "{cuda_graphs: decode, graph_kernel_s: 0.0}"), "batch": 8})
    ops = [op for op in old.sim.dag.ops if hasattr(op, "kernels") and op.chip == 0]
    # a single-chip decode runs its ops one after another: the difference is one overhead per op
    assert old.latency_s - new.latency_s == pytest.approx(len(ops) * get_system("h100-sxm").launch_overhead_s,
                                                          rel=1e-6)


def test_overlapped_host_time_shows_only_where_it_exceeds_the_gpu_time(tmp_path):
    gpu = prepare(SMALL).simulate(Step.decode(4, 1024)).latency_s
    for fixed, overlap, want in ((0.5 * gpu, True, gpu), (2 * gpu, True, 2 * gpu), (0.5 * gpu, False, 1.5 * gpu)):
        system = _system(tmp_path, f"{{host: {{fixed_s: {fixed!r}, overlap: {str(overlap).lower()}}}}}")
        got = prepare({**SMALL, "system": system}).simulate(Step.decode(4, 1024)).latency_s
        assert got == pytest.approx(want, rel=1e-12)
    host = HostTime(fixed_s=1e-3, per_sequence_s=1e-5, per_token_s=1e-6, overlap=True)
    assert host.seconds(10, 100) == pytest.approx(1e-3 + 1e-4 + 1e-4)
    assert host.step_s(5e-3, 10, 100) == 5e-3 and host.step_s(1e-4, 10, 100) == pytest.approx(1.2e-3)


def test_vllm_custom_all_reduce_below_its_threshold_and_nccl_above_as_its_code_chooses():
    def algos(chips, sizes):
        return [r["algorithm"] for r in collective_rows("all_reduce", "h100-sxm", chips, sizes, framework="vllm")]
    # TP8: custom (one-shot) below CUSTOM_ALL_REDUCE_MAX_SIZES["9.0"][8] = 256 KiB, symmetric
    # memory (multimem) from there below SYMM_MEM_ALL_REDUCE_MAX_SIZES["9.0"][8] = 64 MiB, NCCL from there
    got = algos(8, [16384, 262144 - 16, 262144, (64 << 20) - 16, 64 << 20])
    assert got[:4] == ["vllm_custom_one_shot"] * 2 + ["symm_mem_multimem"] * 2
    assert got[4] in ("ring", "tree", "nvls", "nvls_tree")
    # TP4: one-shot below 512 KiB, two-shot to max_size 8 MiB, multimem to 32 MiB, NCCL at 32 MiB
    got = algos(4, [262144, 524288, 8388608, 32 << 20])
    assert got[:3] == ["vllm_custom_one_shot", "vllm_custom_two_shot", "symm_mem_multimem"]
    assert got[3] in ("ring", "tree", "nvls", "nvls_tree")
    # TP2: vLLM's symmetric memory runs two-shot there, which G5 does not model: NCCL above 8 MiB
    assert algos(2, [16 << 20])[0] in ("ring", "tree", "nvls", "nvls_tree")
    # across nodes the custom kernel is off (in_the_same_node_as)
    assert not algos(16, [16384])[0].startswith("vllm_custom")
    # the custom kernel is faster than NCCL for a decode-sized message
    custom = collective_rows("all_reduce", "h100-sxm", 8, [16384], framework="vllm")[0]["time_s"]
    nccl = collective_rows("all_reduce", "h100-sxm", 8, [16384])[0]["time_s"]
    assert custom < nccl


def test_trtllm_one_shot_all_reduce_is_tensorrt_llm_s_own_measured_kernel():
    """g5[measured]: aiconfigurator-core's TRT-LLM 1.3.0rc20 all-reduce table on H100 (message
    sizes in elements, latency in ms) is what trtllm.yaml's one-shot fixed costs come from; over
    the one-shot sizes up to 1 MiB, where the fixed cost is most of the time, G5's time stays
    within 0.35 us or 6% of the table (above 1 MiB NVLink's bandwidth term decides: -15% to +6% at
    TP2). The sgl-kernel figures the profile held before were 0.9 to 2.9 us above it."""
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    from plugins.measured import tables
    try:
        root = tables.data_root()
    except tables.MissingExtra:
        pytest.skip("the g5[measured] extra is not installed")
    table = pd.read_parquet(root / "h100_sxm" / "comm" / "trtllm" / "1.3.0rc20" / "custom_allreduce_perf.parquet")
    checked = 0
    for chips in (2, 4, 8):
        rows = table[(table.num_gpus == chips) & (table.allreduce_dtype == "bfloat16")]
        sizes_bytes = [int(n) * 2 for n in rows.message_size]
        got = collective_rows("all_reduce", "h100-sxm", chips, sizes_bytes, framework="trtllm")
        for r, measured_ms in zip(got, rows.latency):
            if r["algorithm"] != "trtllm_custom_one_shot" or r["size_bytes"] > 1 << 20:
                continue
            measured_s = measured_ms * 1e-3
            assert abs(r["time_s"] - measured_s) < max(0.35e-6, 0.06 * measured_s), (chips, r["size_bytes"], r["time_s"])
            checked += 1
    assert checked >= 30  # 256 B .. 1 MiB at TP2, .. 256 KiB at TP4 and TP8


def test_g5_collective_prints_both_regimes_under_a_framework():
    result = CliRunner().invoke(main, ["collective", "all_reduce", "--system", "h100-sxm", "--chips", "8",
                                       "--sizes", "64K:128M", "--factor", "4", "--framework", "vllm", "--json"])
    assert result.exit_code == 0, result.output
    algorithms = [r["algorithm"] for r in json.loads(result.output)]
    assert "vllm_custom_one_shot" in algorithms and "symm_mem_multimem" in algorithms
    assert algorithms[-1] in ("ring", "tree", "nvls", "nvls_tree")      # NCCL above both


def test_the_symmetric_memory_regime_costs_its_measured_line_alone_and_more_under_load():
    """vllm's symm_mem_multimem: alone, the fixed cost plus the measured seconds per byte
    (vllm.yaml all_reduce.symm_mem); its flows hold the NVLink links, so two at once on the
    same chips take longer than one."""
    from g5core.api.ops import CommOp
    from g5core.api.plugins import Hooks, make_plugin_manager
    from g5core.inputs.framework import with_framework
    from g5core.lower.builder import make_topology
    from g5core.lower.collective import collect_primitives
    from g5core.lower.dag import OpDag
    from g5core.session.collbench import collective_compiler
    from g5core.sim.compile import compile_ops
    from g5core.sim.engine import Engine

    spec = load_profile("vllm")["framework"]["all_reduce"]
    size = 4 << 20
    (row,) = collective_rows("all_reduce", "h100-sxm", 8, [size], framework="vllm")
    assert row["algorithm"] == "symm_mem_multimem"
    assert row["time_s"] == pytest.approx(spec["symm_mem_latency_s"][8] + size * spec["symm_mem_s_per_byte"][8],
                                          rel=1e-9)
    one = collective_compiler("all_reduce", "h100-sxm", 8, framework="vllm")(size)
    assert Engine(dag=one).run().makespan_s == pytest.approx(row["time_s"], rel=1e-12)
    hooks = Hooks(make_plugin_manager())
    system = with_framework(get_system("h100-sxm"), "vllm")
    dag = OpDag()
    for k in range(2):      # two independent all-reduces on the same 8 chips, at once
        dag.add_op(CommOp(key=f"ar{k}", primitive="all_reduce", group=tuple(range(8)), bytes_per_rank=float(size),
                          reason="collective", layer=0, name=f"ar{k}", owner="g5"))
    both = compile_ops(dag, topology=make_topology(hooks, system, 8), primitives=collect_primitives(hooks),
                       hooks=hooks, system=system, deployment=None)
    assert Engine(dag=both).run().makespan_s > 1.5 * row["time_s"]


@pytest.mark.parametrize("extra, field", [
    ({"symm_mem_max_bytes": {8: 1 << 26}}, "symm_mem_latency_s"),
    ({"symm_mem_max_bytes": {8: 1 << 26}, "symm_mem_latency_s": {8: 1e-5}, "symm_mem_s_per_byte": {6: 1e-12}},
     "symm_mem_latency_s"),
])
def test_a_partial_symmetric_memory_regime_is_refused(extra, field):
    from g5core.inputs.framework import CustomAllReduce

    block = dict(load_profile("vllm")["framework"]["all_reduce"])
    for k in ("symm_mem_max_bytes", "symm_mem_latency_s", "symm_mem_s_per_byte"):
        block.pop(k)
    with pytest.raises(ConfigError) as err:
        CustomAllReduce.from_mapping({**block, **extra}, "framework.all_reduce")
    assert field in str(err.value)
    assert CustomAllReduce.from_mapping(block, "framework.all_reduce").choose(8, 1 << 20) is None   # NCCL without it


def test_validate_reports_each_framework_and_refuses_an_unknown_one(tmp_path):
    from g5core.study.validate import validate

    config = tmp_path / "c.yaml"
    config.write_text("model: llama-3.1-8b\nsystem: h100-sxm\nchips: 1\nparallel: {dp: 1, tp: 1, pp: 1, cp: 1}\n"
                      "phase: decode\nbatch: 1\nseq_len: 1024\n")
    csv = tmp_path / "m.csv"
    csv.write_text("config,set,metric,measured_ms,framework,source\n"
                   "c.yaml,,tpot,5,vllm,x\nc.yaml,,tpot,5,trtllm,x\nc.yaml,,tpot,5,,x\n")
    report = validate(csv)
    groups = {(g["framework"], g["metric"]): g["rows"] for g in report["by_framework"]}
    assert groups == {("-", "tpot"): 1, ("trtllm", "tpot"): 1, ("vllm", "tpot"): 1}
    plain = run({**SMALL, "seq_len": 1024}).latency_s * 1e3
    vllm = run({**SMALL, "seq_len": 1024, "framework": "vllm"}).latency_s * 1e3
    by_row = {r["row"]: r["predicted_ms"] for r in report["rows"]}
    assert by_row[1] == vllm and by_row[3] == plain and vllm != plain
    csv.write_text("config,set,metric,measured_ms,framework,source\nc.yaml,,tpot,5,vlm,x\n")
    with pytest.raises(ConfigError, match="row 1.*unknown framework 'vlm'"):
        validate(csv)


def test_best_serve_framework_auto_ranks_every_framework_s_candidates_together():
    from types import SimpleNamespace

    from g5core.present.cli import _best_serve_by_framework

    capacity = {"vllm": 3.0, "sglang": 5.0, "trtllm": 4.0}

    def scored(name):
        return SimpleNamespace(capacity=capacity[name], value=lambda objective: (-capacity[name],),
                               rates=lambda: (capacity[name] / 8, 100 * capacity[name]),
                               candidate=SimpleNamespace(label=lambda: "tp8"),
                               to_json_dict=lambda: {"capacity_requests_per_s": capacity[name]})
    asked = []

    def search(raw):
        asked.append(raw["framework"])
        return SimpleNamespace(objective="goodput_per_chip", ranked=(scored(raw["framework"]),))
    out = json.loads(_best_serve_by_framework({"model": "m"}, search, 10, as_json=True))
    assert asked == ["vllm", "sglang", "trtllm"]
    assert [r["framework"] for r in out] == ["sglang", "trtllm", "vllm"]
    result = CliRunner().invoke(main, ["best", "examples/llama-3.1-8b-prefill.yaml", "--framework", "auto"])
    assert result.exit_code == 2 and "add --serve" in result.output


def test_shipped_host_times_are_the_cited_ones_overlapped_and_generic_has_none():
    """vLLM: V1 Scheduler.schedule() per call (PR #19057's microbenchmark) as a fixed cost and
    Scheduler.update_from_output per running sequence (PR #46112's baseline: 0.142 ms at 128, 0.287
    ms at 256), behind async scheduling (on by default); SGLang and TensorRT-LLM ship no figure;
    generic no host block."""
    host = {name: load_profile(name)["framework"].get("host") for name in FRAMEWORK_NAMES}
    assert host["vllm"] == {"fixed_s": 1.06e-4, "per_sequence_s": 1.12e-6, "per_token_s": 0.0, "overlap": True}
    source = load_profile("vllm")["sources"]["host"]
    assert "PR #19057" in source and "PR #46112" in source
    # the per-sequence figure is the least-squares line through the origin of the two rows
    rows = ((128, 0.142e-3), (256, 0.287e-3))
    fit = sum(n * t for n, t in rows) / sum(n * n for n, _ in rows)
    assert round(fit, 8) == host["vllm"]["per_sequence_s"]
    for name in ("sglang", "trtllm"):
        assert host[name]["overlap"] is True and not any(host[name][k] for k in ("fixed_s", "per_sequence_s",
                                                                                 "per_token_s"))
    assert host.get("generic") is None


def test_validate_adds_the_profile_s_host_time_as_a_serving_step_pays_it(tmp_path):
    from g5core.study.validate import validate

    gpu = run({**SMALL, "seq_len": 1024}).latency_s
    rows = []
    for i, (fixed, overlap) in enumerate(((1e-3, False), (0.5 * gpu, True), (2 * gpu, True))):
        system = _system(tmp_path, f"{{host: {{fixed_s: {fixed!r}, overlap: {str(overlap).lower()}}}}}")
        (tmp_path / f"c{i}.yaml").write_text(
            f"model: llama-3.1-8b\nsystem: {system}\nchips: 1\nparallel: {{dp: 1, tp: 1, pp: 1, cp: 1}}\n"
            "phase: decode\nbatch: 1\nseq_len: 1024\n")
        rows.append(f"c{i}.yaml,,tpot,5,,x\n")
    csv = tmp_path / "m.csv"
    csv.write_text("config,set,metric,measured_ms,framework,source\n" + "".join(rows))
    got = [r["predicted_ms"] for r in validate(csv)["rows"]]
    assert got == pytest.approx([(gpu + 1e-3) * 1e3, gpu * 1e3, 2 * gpu * 1e3], rel=1e-9)


def test_a_collectives_file_is_priced_by_g5_collective_per_framework(tmp_path):
    """g5 validate on a file with an op column prices each row as g5 collective does (under the
    row's framework; generic: NCCL alone) and reports the error per framework."""
    from g5core.study.validate import validate

    csv = tmp_path / "c.csv"
    csv.write_text("# a comment line\nname,op,system,chips,size_bytes,framework,kernel,measured_us,source\n"
                   "a,all_reduce,h100-sxm,8,16384,vllm,custom,6.0,x\n"
                   "b,all_reduce,h100-sxm,4,1048576,,nccl,25.0,y\n"
                   "c,all_reduce,h100-sxm,8,16384,generic,nccl,15.0,z\n")
    report = validate(csv)
    rows = {r["row"]: r for r in report["rows"]}
    vllm = collective_rows("all_reduce", "h100-sxm", 8, [16384], framework="vllm")[0]
    nccl4 = collective_rows("all_reduce", "h100-sxm", 4, [1 << 20])[0]
    nccl8 = collective_rows("all_reduce", "h100-sxm", 8, [16384])[0]
    assert rows[1]["predicted_us"] == vllm["time_s"] * 1e6 and rows[1]["algorithm"].startswith("vllm_custom")
    assert rows[2]["predicted_us"] == nccl4["time_s"] * 1e6 and rows[3]["predicted_us"] == nccl8["time_s"] * 1e6
    assert rows[1]["predicted_us"] < rows[3]["predicted_us"]      # the custom kernel under its threshold
    assert rows[2]["error_pct"] == pytest.approx(100 * (nccl4["time_s"] * 1e6 - 25.0) / 25.0)
    groups = {g["framework"]: g["rows"] for g in report["by_framework"]}
    assert groups == {"generic": 2, "vllm": 1}
    with pytest.raises(ConfigError, match="--set"):     # its rows name their system and group
        validate(csv, ["system=h200"])


@pytest.mark.parametrize("text, field", [
    ("name,op,system,chips,size_bytes,framework,kernel,source\na,all_reduce,h100-sxm,8,16,,k,x\n", "measured_us"),
    ("name,op,system,chips,size_bytes,framework,kernel,measured_us,source\na,all_reduce,h100-sxm,1,16,,k,5,x\n",
     "chips must be >= 2"),
    ("name,op,system,chips,size_bytes,framework,kernel,measured_us,source\na,all_reduce,h100-sxm,8,16,vlm,k,5,x\n",
     "unknown framework"),
    ("name,op,system,chips,size_bytes,framework,kernel,measured_us,source\na,all_reduce,h100-sxm,8,16,,k,5,\n",
     "source is empty"),
    ("name,op,system,chips,size_bytes,framework,kernel,measured_us,source\na,allreduc,h100-sxm,8,16,,k,5,x\n",
     "unknown collective"),
])
def test_a_bad_collectives_row_is_refused_naming_it(tmp_path, text, field):
    from g5core.study.validate import validate

    csv = tmp_path / "c.csv"
    csv.write_text(text)
    with pytest.raises(ConfigError) as err:
        validate(csv)
    assert field in str(err.value)


def test_calibrate_refuses_a_collectives_file_and_writes_nothing(tmp_path):
    import pathlib

    from g5core.study.validate import calibrate

    shipped = pathlib.Path(__file__).parent.parent / "validation" / "measured-collectives.csv"
    out = tmp_path / "fit.yaml"
    with pytest.raises(ConfigError, match="collectives file"):
        calibrate(shipped, ["launch_overhead_s"], out)
    assert not out.exists()


def test_the_shipped_collectives_file_prices_every_row():
    """validation/measured-collectives.csv: every row of aiconfigurator-core's three H100 tables."""
    import pathlib

    from g5core.study.validate import validate

    report = validate(pathlib.Path(__file__).parent.parent / "validation" / "measured-collectives.csv")
    assert len(report["rows"]) == 207
    assert {g["framework"] for g in report["by_framework"]} == {"vllm", "sglang", "trtllm"}
    assert all(r["predicted_us"] > 0 and math.isfinite(r["error_pct"]) for r in report["rows"])


def test_the_july_2025_vllm_system_repeats_the_profile_s_custom_kernel_without_symmetric_memory():
    """validation/systems/b200-vllm-2025-07.yaml replaces the profile's all_reduce block (a
    framework key replaces it whole) to drop the symmetric-memory regime: the custom kernel's
    values must stay the profile's."""
    import pathlib

    import yaml

    path = pathlib.Path(__file__).parent.parent / "validation" / "systems" / "b200-vllm-2025-07.yaml"
    own = yaml.safe_load(path.read_text())["framework"]["all_reduce"]
    profile = dict(load_profile("vllm")["framework"]["all_reduce"])
    assert "symm_mem_max_bytes" in profile and not any(k.startswith("symm_mem") for k in own)
    assert own == {k: v for k, v in profile.items() if not k.startswith("symm_mem")}


def test_sglang_serves_prefills_apart_from_decodes_unless_the_configuration_says_otherwise():
    """The profile's scheduling is the serving scheduler's where the configuration is silent:
    SGLang runs prefill batches apart (enable_mixed_chunk False), vLLM and TensorRT-LLM mix;
    serving.scheduler.mixed_prefill, given, wins; generic leaves the scheduler's default."""
    from g5core.serve.api import simulate_serving

    assert {n: Framework.from_mapping({"name": n}).mixed_prefill for n in FRAMEWORK_NAMES} == {
        "generic": None, "vllm": True, "sglang": False, "trtllm": True}
    wl = {"requests": 30, "arrival": {"kind": "poisson", "rate_per_s": 20}, "input_tokens": "uniform:200:2000",
          "output_tokens": "uniform:8:64", "seed": 3}

    def served(framework, scheduler=None):
        raw = {**SMALL, "serving": {"workload": wl, "scheduler": {"max_num_batched_tokens": 1024, **(scheduler or {})}}}
        if framework is not None:
            raw["framework"] = framework
        res = simulate_serving(raw, check_predictor=0)
        rows = [res.loop.instances[0].steps[i:i + 7] for i in range(0, len(res.loop.instances[0].steps), 7)]
        return res.pools[0]["mixed_prefill"], any(r[2] > 0 and r[3] > 0 for r in rows)

    assert served("sglang") == (False, False)
    assert served("sglang", {"mixed_prefill": True}) == (True, True)
    assert served("vllm") == (True, True) and served(None) == (True, True)
    assert served("vllm", {"mixed_prefill": False}) == (False, False)
    from g5core.serve.present import render_summary
    text = render_summary(simulate_serving({**SMALL, "framework": "sglang", "serving": {"workload": wl}},
                                           check_predictor=0).to_json_dict())
    assert "tokens per instance, prefill steps apart from decode" in text
    with pytest.raises(ConfigError, match=r"^system.framework.mixed_prefill: must be true or false"):
        Framework.from_mapping({"mixed_prefill": "no"})
