"""The benchmark tools on today's model families (issue 19): ``--model`` takes any ``conf/model/`` shape through
``ModelConfig``, MFU counts a mixture of experts' active parameters, every contender of a mixture of experts runs
the same Hugging Face experts kernel and builds the model from the ``ModelConfig``, the canonical FSDP2
contenders shard an MoE block as one unit, DeepSpeed gets the MoE blocks as ZeRO-3 leaf modules, and a generation
contender that cannot run a model is recorded as unsupported. The figures need a GPU (tools/bench_fair.py); here
the CPU checks the code paths (``--device cpu``) and tiny random MoE models stand in for the real shapes.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fsdp_speedloader.app.config import OptimConfig

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"
sys.path.insert(0, str(TOOLS))
import bench_deepspeed  # noqa: E402  (tools/ is not a package)
import bench_infer  # noqa: E402
import bench_train  # noqa: E402
import harness  # noqa: E402

from fsdp_speedloader.models import build_hf_config, build_model, get_adapter  # noqa: E402
from fsdp_speedloader.models.config import ModelConfig  # noqa: E402

TINY_MOE = {
    "qwen3_moe": dict(name="tiny_qwen3_moe", family="qwen3_moe", hidden_size=64, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32, vocab_size=256,
                      max_position_embeddings=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "mixtral": dict(name="tiny_mixtral", family="mixtral", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                    intermediate_size=96, vocab_size=256, max_position_embeddings=64, num_experts=4,
                    num_experts_per_tok=2),
}


def _yaml(tmp_path: Path, family: str) -> str:
    path = tmp_path / f"{TINY_MOE[family]['name']}.yaml"
    path.write_text(yaml.safe_dump(TINY_MOE[family]))
    return str(path)


def _args(**kw):
    import argparse

    return argparse.Namespace(**{"model": "llama2_7b", "layers": 8, "seq_len": 4096, **kw})


# --- the model: conf/model shapes through ModelConfig ----------------------------------------------


@pytest.mark.parametrize("name", ["llama3_8b", "qwen3_8b", "mistral_7b", "gemma3_12b", "mixtral_8x7b", "qwen3_30b_a3b",
                                  "llama2_13b", "opt_30b"])
def test_every_conf_shape_is_a_model(name):
    """The conf file's shape, its own layers fewer of them, positions for the sequence, fresh weights."""
    assert name in bench_train.model_names()
    conf = yaml.safe_load((REPO / "conf" / "model" / f"{name}.yaml").read_text())
    cfg = bench_train.model_config(_args(model=name, layers=2, seq_len=4096))
    assert cfg.num_layers == 2 and cfg.path is None and cfg.name == conf["name"] and cfg.family == conf["family"]
    assert cfg.max_position_embeddings >= 4096
    for key in ("hidden_size", "intermediate_size", "num_heads", "vocab_size", "num_experts", "moe_intermediate_size"):
        if key in conf:
            assert getattr(cfg, key) == conf[key], key
    full = get_adapter(build_model(bench_train.model_config(_args(model=name, layers=3))))
    assert len(full.blocks) == 3
    shapes = {n: tuple(p.shape) for n, p in full.blocks[0].named_parameters()}
    assert shapes == {n: tuple(p.shape) for n, p in full.blocks[2].named_parameters()}  # identical layer shapes


@pytest.mark.parametrize("name, legacy", [("llama2_7b", (4096, 11008, 32, 32, 32000)),
                                          ("llama2_13b", (5120, 13824, 40, 40, 32000))])
def test_the_llama2_shapes_from_conf_are_the_old_table(name, legacy):
    """llama2_7b and llama2_13b left bench_train's SHAPES for their conf files: the Hugging Face config each contender
    builds is the one the earlier records ran (their figures stay comparable)."""
    hidden, inter, heads, kv, vocab = legacy
    old = ModelConfig(name=name, hidden_size=hidden, intermediate_size=inter, num_layers=8, num_heads=heads,
                      num_kv_heads=kv, vocab_size=vocab, max_position_embeddings=4096)
    new = bench_train.model_config(_args(model=name))
    assert build_hf_config(new).to_dict() == build_hf_config(old).to_dict()
    assert "llama_1b" in bench_train.model_names()  # the shape without a conf file stays


def test_a_yaml_file_is_a_model(tmp_path):
    cfg = bench_train.model_config(_args(model=_yaml(tmp_path, "mixtral"), layers=2, seq_len=128))
    assert (cfg.family, cfg.num_layers, cfg.max_position_embeddings) == ("mixtral", 2, 128)


def test_an_unknown_model_fails_before_any_launch(capsys, monkeypatch):
    for tool in (bench_train, bench_infer):
        monkeypatch.setattr(sys, "argv", [tool.__file__, "--model", "llama5_900b", "--contender", "speedloader:1x8"])
        with pytest.raises(SystemExit):
            tool.main()
        err = capsys.readouterr().err
        assert "llama5_900b" in err and "qwen3_30b_a3b" in err  # names what there is


def test_mfu_counts_a_mixture_of_experts_active_parameters():
    """The published totals: Qwen3-30B-A3B 30.5B parameters, 3.3B active; Mixtral-8x7B 46.7B, 12.9B."""
    for name, total, active in (("qwen3_30b_a3b", 30.5e9, 3.35e9), ("mixtral_8x7b", 46.7e9, 12.9e9)):
        cfg = harness.model_config(name, min_positions=4096)
        s = harness.model_summary(cfg, 4096)
        assert s["params"] == pytest.approx(total, rel=0.01) and s["active_params"] == pytest.approx(active, rel=0.01)
        assert s["mfu_basis"].startswith("active parameters")
        adapter = get_adapter(build_model(cfg))
        assert s["flops_per_token"] == adapter.flops_per_token(4096)
        inactive = s["expert_params"] * (1 - s["num_experts_per_tok"] / s["num_experts"])
        attention = 12.0 * cfg.num_layers * cfg.num_heads * (cfg.head_dim or cfg.hidden_size // cfg.num_heads) * 4096
        assert s["flops_per_token"] == pytest.approx(6.0 * (adapter.num_non_embedding_params() - inactive) + attention)
    dense = harness.model_summary(harness.model_config("llama3_8b", layers=2), 4096)
    assert dense["active_params"] == dense["params"] and dense["mfu_basis"].startswith("all parameters")


# --- contenders' options ----------------------------------------------------------------------


def test_a_contender_may_have_its_own_gpu_cap():
    c = bench_train.parse_contender("ondevice:2x4:compile:cap=none", None)
    assert c.compiled and bench_train.gpu_cap_gib(c, 40.0) is None
    assert bench_train.gpu_cap_gib(bench_train.parse_contender("deepspeed-offload:2x4:cap=24", None), 40.0) == 24.0
    assert bench_train.gpu_cap_gib(bench_train.parse_contender("fsdp2-offload:2x4", None), 40.0) == 40.0
    for bad in ("ondevice:2x4:cap=big", "ondevice:2x4:cap=0", "ondevice:2x4:cap"):
        with pytest.raises(ValueError, match="cap=GiB"):
            bench_train.parse_contender(bad, None)


def test_the_overlapped_contender_may_compress_its_optimizer_states():
    assert bench_train.parse_contender("speedloader-overlap:2x4:states=int8", None).states == "int8"
    assert bench_train.parse_contender("speedloader-overlap:2x4", None).states == "fp32"
    assert bench_train.parse_contender("speedloader-overlap:2x4:threads=12", None).threads == 12
    assert bench_train.parse_contender("speedloader-overlap:2x4:nice=10", None).nice == 10
    assert bench_train.parse_contender("speedloader-overlap:2x4:affinity", None).affinity
    assert not bench_train.parse_contender("speedloader-overlap:2x4", None).affinity
    default = bench_train.parse_contender("speedloader-overlap:2x4", None)
    assert (default.slots, default.adamw) == (OptimConfig().grad_slots_in_flight, "local")  # the trainer's defaults
    tuned = bench_train.parse_contender("speedloader-overlap:2x4:slots=0:adamw=torch", None)
    assert (tuned.slots, tuned.adamw) == (0, "torch")
    assert bench_train.parse_contender("speedloader-overlap:2x4:adamw=pool", None).adamw == "pool"
    for bad in ("speedloader:2x4:states=bf16", "fsdp2-offload:2x4:states=bf16", "speedloader-overlap:2x4:states=fp8",
                "speedloader-overlap:2x4:threads=0", "speedloader:2x4:threads=4", "speedloader:2x4:slots=2",
                "speedloader-overlap:2x4:slots=-1", "speedloader-overlap:2x4:adamw=dtensor",
                "fsdp2-offload:2x4:adamw=local", "ondevice:1x8:adamw=pool",
                "speedloader-overlap:2x4:nice=20", "ondevice:1x8:nice=5",
                "speedloader:2x4:affinity", "speedloader-overlap:2x4:affinity=on"):
        with pytest.raises(ValueError, match="states"):
            bench_train.parse_contender(bad, None)


def test_the_trace_timeline_splits_the_step_between_compute_copies_and_the_host():
    """Intervals in microseconds: compute 0-40 and 60-80, copies 30-70: both 20 us, compute alone 40, copies
    alone 20, and of a 100 us step 20 us with nothing on the GPU."""
    t = bench_train.timeline(100e-6, [(0, 40), (60, 80)], [(30, 50), (45, 70)])
    expected = {"compute_and_copies_s": 20e-6, "compute_only_s": 40e-6, "copies_only_s": 20e-6, "gpu_idle_s": 20e-6}
    assert t == pytest.approx(expected)


def _event(cat, name, ts, dur, tid=0, **args):
    """One complete ('X') event of a Chrome trace, as the profiler writes it."""
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def test_a_traced_step_is_summarised_with_its_timeline(tmp_path):
    """summarize_trace on a hand-made trace: stream 7 has the most kernel time (the compute stream, 60 us), the
    copies (30-70 us) overlap it 20 us, and the host's CUDA calls are listed."""
    trace = {"traceEvents": [_event("kernel", "gemm", 0, 40, stream=7), _event("kernel", "gemm", 60, 20, stream=7),
                             _event("kernel", "copy", 0, 5, stream=14),
                             _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 30, 20, bytes=2**30),
                             _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 45, 25, bytes=2**30),
                             _event("cuda_runtime", "cudaEventSynchronize", 0, 30)]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    summary = bench_train.summarize_trace(str(path), 100e-6)
    assert summary["compute_stream"] == "7" and summary["copies"]["HtoD"]["gib"] == 2.0
    assert summary["timeline"] == pytest.approx({"compute_and_copies_s": 20e-6, "compute_only_s": 40e-6,
                                                 "copies_only_s": 20e-6, "gpu_idle_s": 20e-6})
    assert summary["top_host_cuda_calls_s"] == pytest.approx({"cudaEventSynchronize": 30e-6})
    # the compute stream's kernels 0-40 and 60-80 us: one gap of 20 us, below the 50 us a launch gap counts from
    assert summary["compute_launch_gaps"] == pytest.approx({"count": 1, "total_s": 20e-6, "long_count": 0,
                                                            "long_total_s": 0.0, "long_us": 50.0})
    # one more compute kernel at 200 us after an all-gather (NCCL's kernel, another stream) ending at 195 us
    trace["traceEvents"] += [_event("kernel", "gemm", 200, 40, stream=7),
                             _event("kernel", "ncclDevKernel_AllGather_RING_LL(x)", 150, 45, stream=21)]
    path.write_text(json.dumps(trace))
    waited = bench_train.summarize_trace(str(path), 250e-6)["compute_gaps_waited_for"]
    assert (waited["collective_count"], waited["copy_count"], waited["host_count"]) == (1, 0, 0)
    assert waited["collective_s"] == pytest.approx(120e-6)
    # a compute kernel at 300 us, 20 us after a 1 GiB host-to-device copy (260-280) ended: the gap 240-300 waited for it
    trace["traceEvents"] += [_event("kernel", "gemm", 300, 10, stream=7),
                             _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 260, 20, bytes=2**30)]
    path.write_text(json.dumps(trace))
    summary = bench_train.summarize_trace(str(path), 350e-6)
    assert summary["compute_gaps_waited_for"]["copy_count"] == 1
    assert summary["copy_gaps_by_copy"] == pytest.approx({"HtoD 1024 MiB": 60e-6})


def test_launch_gaps_count_the_idle_time_between_kernels():
    """Overlapping kernels merge; of the gaps 30 and 100 us only the second is longer than 50 us."""
    gaps = bench_train.launch_gaps([(0, 10), (5, 20), (50, 60), (160, 170)])
    assert gaps == pytest.approx({"count": 2, "total_s": 130e-6, "long_count": 1, "long_total_s": 100e-6,
                                  "long_us": 50.0})
    assert bench_train.launch_gaps([])["count"] == 0


def test_long_gaps_are_charged_to_what_ended_just_before_them():
    """Compute kernels 0-10, 100-110, 300-310, 500-510 us: the gap 10-100 ends 5 us after a collective (80-95),
    110-300 ends 10 us after a copy (200-290), 310-500 ends with nothing just before it (a collective ended at 400,
    100 us before: the host). A 20 us gap is too short to count."""
    compute = [(0, 10), (100, 110), (300, 310), (500, 510), (530, 540)]
    got = bench_train.attribute_gaps(compute, collectives=[(80, 95), (350, 400)], copies=[(200, 290)])
    assert got == pytest.approx({"collective_s": 90e-6, "collective_count": 1, "copy_s": 190e-6, "copy_count": 1,
                                 "host_s": 190e-6, "host_count": 1, "long_us": 50.0, "slack_us": 30.0})
    assert bench_train.attribute_gaps([], [], [])["host_count"] == 0


def test_host_gaps_are_named_by_the_host_waits_under_way():
    """The same kernels; the host gap 310-500 us overlaps a gradient-ring wait 250-400 (90 us of it) and an
    optimizer wait 450-480 (30 us); the other 70 us are unnamed. A wait during a copy's gap (200-290) is not
    counted: that gap waited for the copy. The trace's annotations reach the summary the same way."""
    compute = [(0, 10), (100, 110), (300, 310), (500, 510), (530, 540)]
    gaps = bench_train.long_gaps(compute, collectives=[(80, 95), (350, 400)], copies=[(200, 290)])
    assert [cause for _, _, cause in gaps] == ["collective", "copy", "host"]
    named = {"speedloader::grad_ring_wait": [(250, 400)], "speedloader::optimizer_wait": [(450, 480)]}
    assert bench_train.host_gaps_during(gaps, named) == pytest.approx(
        {"speedloader::grad_ring_wait": 90e-6, "speedloader::optimizer_wait": 30e-6, "unnamed_s": 70e-6})
    assert bench_train.host_gaps_during(gaps, {}) == pytest.approx({"unnamed_s": 190e-6})


def test_a_trace_names_the_host_waits(tmp_path):
    trace = {"traceEvents": [_event("kernel", "gemm", 0, 10, stream=7), _event("kernel", "gemm", 200, 10, stream=7),
                             _event("user_annotation", "speedloader::grad_ring_wait", 50, 100),
                             _event("user_annotation", "speedloader::grad_ring_wait", 120, 60),
                             _event("user_annotation", "aten::mm", 0, 200)]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    summary = bench_train.summarize_trace(str(path), 250e-6)
    assert summary["named_waits_s"] == pytest.approx({"speedloader::grad_ring_wait": 130e-6})
    assert summary["host_gaps_during"] == pytest.approx({"speedloader::grad_ring_wait": 130e-6, "unnamed_s": 60e-6})


def test_a_late_kernel_is_traced_to_what_its_thread_ran_meanwhile(tmp_path):
    """Kernels at 0, 200 and 400 us on the compute stream; the second was queued at 150 us by thread 5, which ran a
    post-backward reduce (20-120, a copy 30-60 inside it) in the gap: a late launch. The third was queued at 5 us,
    before its gap: it waited on the GPU. Thread 9's work does not count: it queued nothing there."""
    trace = {"traceEvents": [
        _event("kernel", "gemm", 0, 10, stream=7, correlation=1),
        _event("kernel", "gemm", 200, 10, stream=7, correlation=2),
        _event("kernel", "gemm", 400, 10, stream=7, correlation=3),
        _event("cuda_runtime", "cudaLaunchKernel", 150, 3, tid=5, correlation=2),
        _event("cuda_driver", "cuLaunchKernel", 5, 3, tid=5, correlation=3),
        _event("cpu_op", "FSDP::post_backward_reduce", 20, 100, tid=5), _event("cpu_op", "aten::copy_", 30, 30, tid=5),
        _event("cpu_op", "aten::mm", 10, 140, tid=9)]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    got = bench_train.summarize_trace(str(path), 500e-6)["host_gaps_launches"]
    ran = got.pop("late_thread_ran_s")
    assert got == pytest.approx({"queued_before_s": 190e-6, "queued_late_s": 190e-6, "unmatched_s": 0.0})
    assert ran == pytest.approx({"FSDP::post_backward_reduce": 100e-6, "aten::copy_": 30e-6})
    assert list(ran) == ["FSDP::post_backward_reduce", "aten::copy_"]  # longest first


def test_the_host_syncs_are_split_by_thread_and_named_by_the_operator_they_ran_in(tmp_path):
    """Thread 5 queued the compute stream's kernels: its stream sync inside aten::item (inside a forward) is the
    launcher's; thread 9's event syncs (an optimizer worker) are the others'; a launch is no sync."""
    trace = {"traceEvents": [
        _event("kernel", "gemm", 0, 10, stream=7, correlation=1),
        _event("kernel", "gemm", 300, 10, stream=7, correlation=2),
        _event("cuda_runtime", "cudaLaunchKernel", 0, 2, tid=5, correlation=1),
        _event("cuda_runtime", "cudaLaunchKernel", 290, 2, tid=5, correlation=2),
        _event("cpu_op", "UnitFunction", 20, 200, tid=5), _event("cpu_op", "aten::item", 50, 100, tid=5),
        _event("cuda_runtime", "cudaStreamSynchronize", 60, 80, tid=5),
        _event("cuda_runtime", "cudaDeviceSynchronize", 250, 20, tid=5),
        _event("cuda_runtime", "cudaEventSynchronize", 30, 200, tid=9),
        _event("cuda_runtime", "cudaEventSynchronize", 240, 40, tid=9)]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    got = bench_train.summarize_trace(str(path), 400e-6)["host_syncs"]
    assert got["launcher"] == pytest.approx({"cudaStreamSynchronize": 80e-6, "cudaDeviceSynchronize": 20e-6})
    assert got["others"] == pytest.approx({"cudaEventSynchronize": 240e-6})
    assert got["launcher_inside"] == pytest.approx({"aten::item": 80e-6, "(none)": 20e-6})


def test_the_host_thread_usage_counts_this_threads_cpu_time():
    import time

    cpu0, switches0 = bench_train.host_thread_usage()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.05:  # 50 ms of this thread's work
        pass
    cpu1, switches1 = bench_train.host_thread_usage()
    assert 0.02 < cpu1 - cpu0 < 1.0 and switches1 >= switches0


def test_the_process_age_counts_from_this_processs_start():
    """A worker's ``before_worker`` phase: the interpreter's start and imports, read from /proc (10 ms ticks)."""
    import time

    age0 = bench_train.process_age_s()
    time.sleep(0.2)
    assert age0 > 0 and 0.15 < bench_train.process_age_s() - age0 < 2.0
    tools = str(Path(bench_train.__file__).parent)
    code = (f"import sys, time; sys.path.insert(0, {tools!r}); time.sleep(0.5); import bench_train; "
            "print(bench_train.process_age_s())")
    child = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0.5 <= child < 60.0  # its sleep and imports, not this process's age


def test_an_fsdp2_contender_may_skip_the_recompute():
    assert bench_train.parse_contender("ondevice:1x8:recompute=off", None).recompute is False
    assert bench_train.parse_contender("fsdp2-offload:1x8", None).recompute is True
    every4 = bench_train.parse_contender("ondevice:1x8:recompute=every4", None)
    assert (every4.ascending, every4.recompute_every) == (False, 4)
    assert bench_train.parse_contender("fsdp2-offload:1x8:recompute=every12", None).recompute_every == 12
    for bad in ("speedloader:1x8:recompute=off", "deepspeed-offload:1x8:recompute=off", "ondevice:1x8:recompute=no",
                "ondevice:1x8:recompute=every1", "ondevice:1x8:recompute=every0", "ondevice:1x8:recompute=every"):
        with pytest.raises(ValueError, match="recompute=on"):
            bench_train.parse_contender(bad, None)


def test_an_fsdp2_contender_may_sync_last_and_keep_its_units_gathered():
    c = bench_train.parse_contender("ondevice:1x8:recompute=off:sync=last:reshard=off", None)
    assert (c.sync, c.reshard) == ("last", False)
    default = bench_train.parse_contender("fsdp2-offload:1x8", None)
    assert (default.sync, default.reshard) == (None, True)  # the contender's own gradient_sync
    for bad in ("speedloader:1x8:sync=last", "ondevice:1x8:reshard=no", "ondevice:1x8:sync=first"):
        with pytest.raises(ValueError, match="reshard=on"):
            bench_train.parse_contender(bad, None)


def test_a_speedloader_contender_may_keep_activations():
    assert bench_train.parse_contender("speedloader-overlap:1x8:root=device:keep=40", None).keep == 40
    assert bench_train.parse_contender("speedloader:1x8", None).keep == 0
    for bad in ("ondevice:1x8:keep=4", "speedloader:1x8:keep=-1", "speedloader:1x8:keep"):
        with pytest.raises(ValueError, match="keep=K"):
            bench_train.parse_contender(bad, None)


def test_every_moe_contender_runs_one_experts_kernel():
    """harness.set_experts_implementation: the named kernel on a mixture of experts, nothing on a dense model."""
    for family in TINY_MOE:
        model = build_model(ModelConfig(**TINY_MOE[family]))
        assert harness.set_experts_implementation(model, None) == "grouped_mm"  # transformers 5's default
        assert harness.set_experts_implementation(model, "eager") == "eager"
        assert model.config._experts_implementation == "eager"
    dense = build_model(ModelConfig())
    assert harness.set_experts_implementation(dense, "grouped_mm") is None


def test_accelerate_keeps_one_experts_kernel_in_decoding():
    """transformers' generate switches grouped_mm to batched_mm for decoding on a GPU (batched_mm copies each routed
    token's expert weights); bench_infer turns that switch off so prefill and decoding run the named kernel."""
    import argparse

    model = build_model(ModelConfig(**TINY_MOE["mixtral"]))
    args = argparse.Namespace(experts_implementation="grouped_mm")
    assert bench_infer._same_experts_throughout(model, args) == "grouped_mm"
    with model._optimize_model_for_decode():
        assert model.config._experts_implementation == "grouped_mm"
    dense = build_model(ModelConfig())
    assert bench_infer._same_experts_throughout(dense, args) is None
    assert "_optimize_model_for_decode" not in vars(dense)


# --- DeepSpeed: MoE blocks as ZeRO-3 leaf modules, importable without DeepSpeed ----------------------------


@pytest.mark.parametrize("family, block", [("qwen3_moe", "Qwen3MoeSparseMoeBlock"), ("mixtral", "MixtralSparseMoeBlock")])
def test_deepspeed_gets_each_moe_block_as_a_leaf_module(family, block):
    model = build_model(ModelConfig(**TINY_MOE[family]))
    calls = []

    def set_z3_leaf_modules(m, classes):  # deepspeed.utils.set_z3_leaf_modules's contract
        calls.append(classes)
        for module in m.modules():
            if type(module) in classes:
                module._z3_leaf = True

    names = bench_deepspeed.mark_moe_leaf_modules(model, set_z3_leaf_modules)
    assert [c.__name__ for c in calls[0]] == [block] and names == [f"{calls[0][0].__module__}.{block}"]
    blocks = bench_deepspeed.moe_blocks(model)
    assert len(blocks) == 4 and all(b._z3_leaf for b in blocks)
    assert all(b.mlp is m for b, m in zip(get_adapter(model).blocks, blocks))  # each layer's router + experts
    calls.clear()
    assert bench_deepspeed.mark_moe_leaf_modules(build_model(ModelConfig()), set_z3_leaf_modules) == [] and not calls


def test_the_peers_chunk_their_head_loss_as_layer_major_unless_told():
    from fsdp_speedloader import SpeedLoaderOptions

    chunk = SpeedLoaderOptions().loss_chunk_tokens
    for spec in ("fsdp2-offload:8x8", "ondevice:1x8", "deepspeed-offload:8x8", "fsdp2-offload-rs:2x4:loss=chunked"):
        assert bench_train.head_loss_chunk(bench_train.parse_contender(spec, None)) == chunk
    for spec in ("fsdp2-offload:8x8:loss=hf", "deepspeed-offload:8x8:loss=hf"):
        assert bench_train.head_loss_chunk(bench_train.parse_contender(spec, None)) == 0
    for bad in ("speedloader:2x4:loss=hf", "fsdp2-offload:8x8:loss=full"):
        with pytest.raises(ValueError, match="loss=chunked"):
            bench_train.parse_contender(bad, None)
    # DeepSpeed's activation estimate (its prefetch and persistence budget) counts one chunk's logits, not all
    full = bench_deepspeed.activation_bytes(8, 4096, 2, 4096, 11008, 32000)
    chunked = bench_deepspeed.activation_bytes(8, 4096, 2, 4096, 11008, 32000, loss_chunk_tokens=chunk)
    assert full - chunked == (8 * 4096 - chunk) * 12 * 32000


def test_deepspeed_activation_estimate_counts_routed_copies():
    dense = bench_deepspeed.activation_bytes(2, 4096, 4, 2048, 768, 151936)
    moe = bench_deepspeed.activation_bytes(2, 4096, 4, 2048, 768, 151936, experts_per_token=8)
    assert moe - dense == 2 * 4096 * 3 * (4 * 8 * 768 + 3 * 8 * 2048 - 4 * 768)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="deepspeed is installed here")
def test_the_deepspeed_contenders_say_deepspeed_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with pytest.raises(SystemExit, match="deepspeed not installed"):
        bench_deepspeed.run_deepspeed(_args(model="qwen3_30b_a3b", layers=1), 1, 1)
    import argparse

    with pytest.raises(SystemExit, match="deepspeed not installed"):
        bench_infer.run_zero_inference(argparse.Namespace(), "1")


# --- generation: a contender that cannot run the model -------------------------------------------


def test_flexgen_policy_from_the_spec():
    """A FlexGen spec sets its batch, compression, weight placement and where attention runs; the rest is its
    published policy; what it does not know is refused naming the options."""
    published = bench_infer.FLEXGEN_POLICIES["opt_30b"]
    pol = bench_infer.flexgen_policy("opt_30b", "")
    assert pol == {**published, "compress_weight": False, "compress_cache": False}
    pol = bench_infer.flexgen_policy("opt_30b", "32x8:c4:w=100:attn=gpu")
    assert (pol["gpu_batch_size"], pol["num_gpu_batches"]) == (32, 8)
    assert pol["percent"] == [100, 0, *published["percent"][2:]] and pol["cpu_cache_compute"] is False
    assert pol["compress_weight"] and pol["compress_cache"]
    pol = bench_infer.flexgen_policy("opt_30b", "64x4:kc4:w=0:attn=gpu")
    assert pol["percent"][:2] == [0, 100] and not pol["compress_weight"] and pol["compress_cache"]
    assert bench_infer.flexgen_policy("opt_30b", "48x3:c4")["cpu_cache_compute"] is True  # published: on the CPU
    for bad, says in (("32x2:c8", "unknown option"), ("32x2:c4:kc4", "two compressions"), ("32x2:w=120", "0-100"),
                      ("32x2:attn=tpu", "unknown option")):
        with pytest.raises(ValueError, match=says):
            bench_infer.flexgen_policy("opt_30b", bad)


def test_flexgen_refuses_what_it_cannot_run(tmp_path, monkeypatch):
    """FlexGen implements OPT only: on Mixtral its row says unsupported and why, and nothing is launched."""
    mixtral = harness.model_config("mixtral_8x7b")
    assert "OPT only" in bench_infer.unsupported_reason("flexgen", mixtral)
    assert bench_infer.unsupported_reason("flexgen", harness.model_config("opt_30b")) is None
    for name in ("speedloader", "accelerate", "zero-inference"):
        assert bench_infer.unsupported_reason(name, mixtral) is None
    launched = []
    monkeypatch.setattr(bench_infer.harness, "launch_worker", lambda *a, **k: launched.append(a))
    monkeypatch.setattr(sys, "argv", ["bench_infer.py", "--model", "mixtral_8x7b", "--layers", "2", "--contender",
                                      "flexgen:32x2", "--out-dir", str(tmp_path), "--name", "r", "--device", "cpu"])
    bench_infer.main()
    record = json.loads((tmp_path / "r.json").read_text())
    (row,) = record["results"]
    assert not launched and row["status"] == "unsupported" and "OPT only" in row["reason"]
    assert "speedup" not in record and record["model"]["num_experts"] == 8
    assert "unsupported: FlexGen" in bench_infer._row(row)


# --- the workers on the CPU (code paths; no figure means anything) ------------------------------------


def _run(tool: str, argv: list, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOLS / tool), *argv], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=harness.child_env())


@pytest.mark.slow
def test_every_training_contender_runs_a_moe_model_on_the_cpu(tmp_path):
    """Each contender builds the model from the ModelConfig (the family's Hugging Face class), runs the same experts
    kernel, shards one MoE block per FSDP unit, and computes the same loss (same seeded weights, same batch);
    DeepSpeed too where it is installed."""
    contenders = ["speedloader-overlap:2x2:root=device",
                  "speedloader-overlap:2x2:root=device:states=bf16:threads=1:slots=0",
                  "fsdp2-offload:2x2", "ondevice:1x4:cap=none", "ondevice:1x4:cap=none:recompute=off",
                  "ondevice:1x4:cap=none:recompute=off:sync=last:reshard=off", "ondevice:1x4:cap=none:recompute=every2"]
    if importlib.util.find_spec("deepspeed") is not None:
        contenders.append("deepspeed-offload:2x2")
    argv = ["--device", "cpu", "--model", _yaml(tmp_path, "qwen3_moe"), "--layers", "2", "--seq-len", "32", "--steps",
            "1", "--warmup", "1", "--out-dir", str(tmp_path), "--name", "moe", "--timeout", "800"]
    for c in contenders:
        argv += ["--contender", c]
    done = _run("bench_train.py", argv)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "moe.json").read_text())
    assert record["model"]["family"] == "qwen3_moe" and record["model"]["mfu_basis"].startswith("active parameters")
    rows = {r["contender_spec"]: r for r in record["results"]}
    assert all(r["status"] == "ok" for r in rows.values()), [r.get("error") for r in rows.values()]
    assert {r["experts_implementation"] for r in rows.values()} == {"grouped_mm"}
    assert {r["flops_per_token"] for r in rows.values()} == {record["model"]["flops_per_token"]}
    for spec, r in rows.items():
        if spec.startswith("deepspeed"):
            assert r["deepspeed"]["num_z3_leaf_modules"] == 2
            assert r["deepspeed"]["z3_leaf_modules"][0].endswith("Qwen3MoeSparseMoeBlock")
        else:
            assert r["num_fsdp_units"] == 2 and r["blocks_per_fsdp_unit"] == [1]  # one MoE block, all experts, a unit
    assert rows["ondevice:1x4:cap=none"]["max_gpu_memory_gib"] is None
    plain, kept = rows["ondevice:1x4:cap=none"], rows["ondevice:1x4:cap=none:recompute=off"]
    assert plain["recompute"] is True and kept["recompute"] is False  # the model's own flag
    gathered = rows["ondevice:1x4:cap=none:recompute=off:sync=last:reshard=off"]
    assert (kept["gradient_sync"], kept["reshard_after_forward"]) == ("every", True)
    assert (gathered["gradient_sync"], gathered["reshard_after_forward"]) == ("last", False)
    assert rows["fsdp2-offload:2x2"]["gradient_sync"] == "last"
    assert plain["hfu_fwd_bwd"] > plain["mfu_fwd_bwd"] and kept["hfu_fwd_bwd"] == pytest.approx(kept["mfu_fwd_bwd"])
    half = rows["ondevice:1x4:cap=none:recompute=every2"]  # block 2 of 2 recomputes: half the blocks' extra work
    assert (plain["blocks_recomputed"], half["blocks_recomputed"], kept["blocks_recomputed"]) == (2, 1, 0)
    assert half["hfu_fwd_bwd"] / half["mfu_fwd_bwd"] - 1 == pytest.approx(
        (plain["hfu_fwd_bwd"] / plain["mfu_fwd_bwd"] - 1) / 2)
    for spec, states in (("speedloader-overlap:2x2:root=device", "fp32"),
                         ("speedloader-overlap:2x2:root=device:states=bf16:threads=1:slots=0", "bf16")):
        assert rows[spec]["optimizer_states"] == states and rows[spec]["optimizer_busy_s"] > 0  # the CPU step ran
        assert rows[spec]["optimizer_wait_s"] >= 0
    default = rows["speedloader-overlap:2x2:root=device"]
    assert default["optimizer_adamw"] == "local"
    assert default["grad_slots_in_flight"] == OptimConfig().grad_slots_in_flight
    assert rows["speedloader-overlap:2x2:root=device:states=bf16:threads=1:slots=0"]["uses_grad_ring"] is False
    assert "optimizer_busy_s" not in rows["fsdp2-offload:2x2"]
    first = [r["losses"][0] for r in rows.values()]
    assert max(first) - min(first) < 1e-3 * abs(first[0])


@pytest.mark.slow
def test_generation_contenders_run_mixtral_on_the_cpu(tmp_path):
    """speedloader and accelerate (ZeRO-Inference too where DeepSpeed is installed) generate with a tiny Mixtral,
    each with the same experts kernel; FlexGen is recorded as unsupported."""
    contenders = ["speedloader:4x2", "accelerate:2", "flexgen"]
    if importlib.util.find_spec("deepspeed") is not None:
        contenders.append("zero-inference:2")
    argv = ["--device", "cpu", "--model", _yaml(tmp_path, "mixtral"), "--layers", "2", "--prompt-len", "16",
            "--gen-len", "3", "--out-dir", str(tmp_path), "--name", "gen", "--timeout", "600"]
    for c in contenders:
        argv += ["--contender", c]
    done = _run("bench_infer.py", argv)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["contender"]: r for r in json.loads((tmp_path / "gen.json").read_text())["results"]}
    assert rows.pop("flexgen")["status"] == "unsupported"
    for name, row in rows.items():
        assert row["status"] == "ok", row.get("error")
        assert row["experts_implementation"] == "grouped_mm"
    if "zero-inference:2" in rows:
        assert rows["zero-inference:2"]["deepspeed"]["z3_leaf_modules"][0].endswith("MixtralSparseMoeBlock")


def test_a_contender_may_start_its_worker_with_environment_variables():
    """``:env=NAME=VALUE`` (every contender, repeatable): parsed, and set by the launchers in the worker process's
    environment (read when the libraries load, so the worker cannot set it itself)."""
    spec = "speedloader-overlap:2x4:env=OMP_WAIT_POLICY=PASSIVE:affinity:env=FSL_X=a b"
    assert bench_train.parse_contender(spec, None).env == (("OMP_WAIT_POLICY", "PASSIVE"), ("FSL_X", "a b"))
    env = bench_train.contender_env(spec, base={"PATH": "/bin", "OMP_WAIT_POLICY": "ACTIVE"})
    assert env == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE", "FSL_X": "a b"}
    assert bench_train.contender_env("ondevice:1x8", base={"A": "1"}) == {"A": "1"}
    for bad in ("ondevice:1x8:env=1X=2", "ondevice:1x8:env=NOVALUE", "ondevice:1x8:env="):
        with pytest.raises(ValueError, match="env=NAME=VALUE"):
            bench_train.parse_contender(bad, None)


def test_a_speedloader_contender_may_run_its_sub_batches_in_ascending_order():
    assert bench_train.parse_contender("speedloader-overlap:4x2:order=ascending", None).ascending
    assert not bench_train.parse_contender("speedloader:4x2:order=alternate", None).ascending
    assert not bench_train.parse_contender("speedloader:4x2", None).ascending
    for bad in ("fsdp2-offload:1x8:order=ascending", "speedloader:4x2:order=descending"):
        with pytest.raises(ValueError, match="order=alternate"):
            bench_train.parse_contender(bad, None)


def test_a_contender_may_prefetch_deeper():
    assert bench_train.parse_contender("speedloader-overlap:4x2:prefetch=2", None).prefetch == 2
    assert bench_train.parse_contender("ondevice:1x8:prefetch=0", None).prefetch == 0
    assert bench_train.parse_contender("fsdp2-offload:1x8", None).prefetch is None  # --prefetch's
    for bad in ("deepspeed-offload:1x8:prefetch=2", "speedloader:4x2:prefetch=-1", "speedloader:4x2:prefetch"):
        with pytest.raises(ValueError, match="prefetch=K"):
            bench_train.parse_contender(bad, None)


@pytest.mark.slow
def test_the_worker_refuses_to_run_without_its_environment(tmp_path):
    """bench_train's driver starts the worker with the contender's variables (its row says so); a worker started
    without them stops with the reason rather than measure something else."""
    base = ["--device", "cpu", "--model", "llama_tiny", "--layers", "2", "--seq-len", "32", "--steps", "1",
            "--warmup", "1"]
    spec = "ondevice:1x2:env=FSL_BENCH_PROBE=42:prefetch=2"
    done = _run("bench_train.py", [*base, "--contender", spec, "--out-dir", str(tmp_path), "--name", "e"])
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads((tmp_path / "e.json").read_text())["results"][0]
    assert row["status"] == "ok" and row["worker_env"] == {"FSL_BENCH_PROBE": "42"}
    assert row["forward_prefetch"] == 2  # the contender's own depth, not --prefetch's 1
    alone = _run("bench_train.py", [*base, "--worker", spec])
    assert alone.returncode != 0 and "started without {'FSL_BENCH_PROBE': '42'}" in alone.stderr
