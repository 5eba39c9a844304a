"""tools/bench_infer.py's trace summary (the benchmark itself needs a GPU: it runs on the GPU machine)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import bench_infer  # noqa: E402


def _event(name, ts, dur, **extra):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, **extra}


def test_summarize_decode_trace_splits_copies_by_cpu_attention_windows(tmp_path):
    attend, wait = "speedloader::host_attention", "speedloader::host_attention_wait"
    copy = "Memcpy HtoD (Pinned -> Device)"
    events = [
        _event(copy, 0, 100, cat="gpu_memcpy", args={"bytes": 10**9}),  # before the first window: not counted
        _event(wait, 950, 50),
        _event(attend, 1000, 1000),  # windows [1000, 2000] and [3000, 4000] (us)
        _event(attend, 3000, 1000),
        _event(copy, 1500, 1000, cat="gpu_memcpy", args={"bytes": 4 * 10**9}),  # half inside the first window
        _event(copy, 2500, 500, cat="gpu_memcpy", args={"bytes": 2 * 10**9}),  # outside
        _event("Memcpy DtoH (Device -> Pinned)", 3100, 100, cat="gpu_memcpy", args={"bytes": 10**9}),  # not H2D
        _event(wait, 2950, 50),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    got = bench_infer.summarize_decode_trace(str(path))
    assert got["span_s"] == pytest.approx(3e-3) and got["cpu_attention_s"] == pytest.approx(2e-3)
    assert got["cpu_attention_wait_s"] == pytest.approx(50e-6)  # the wait before the first window is outside
    assert got["h2d_gb"] == pytest.approx(6.0) and got["h2d_gb_during_cpu_attention"] == pytest.approx(2.0)
    assert got["h2d_GBps_during_cpu_attention"] == pytest.approx(2.0 / 2e-3)
    assert got["h2d_GBps_otherwise"] == pytest.approx(4.0 / 1e-3)


def test_summarize_decode_trace_without_host_attention(tmp_path):
    """The cache on the device: from the first decoding step's host marker to the GPU's last work, the link's
    bytes and rate and the host's time issuing the steps (the markers' GPU-timeline copies not counted)."""
    step, copy = "speedloader::decode_step", "Memcpy HtoD (Pinned -> Device)"
    events = [
        _event("speedloader::prefill", 0, 500, cat="user_annotation"),
        _event(copy, 400, 100, cat="gpu_memcpy", args={"bytes": 10**9}),  # the prefill's: before the window
        _event(step, 1000, 200, cat="user_annotation"),
        _event(step, 1300, 200, cat="user_annotation"),
        _event(step, 1100, 900, cat="gpu_user_annotation"),  # the same steps on the GPU's timeline
        _event(copy, 1100, 400, cat="gpu_memcpy", args={"bytes": 2 * 10**9}),
        _event("gemm", 1500, 1500, cat="kernel"),  # the GPU's last work ends at 3000
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    got = bench_infer.summarize_decode_trace(str(path))
    assert got["decode_steps"] == 2 and got["host_issue_s"] == pytest.approx(400e-6)
    assert got["span_s"] == pytest.approx(2e-3) and got["h2d_gb"] == pytest.approx(2.0)
    assert got["h2d_GBps"] == pytest.approx(2.0 / 2e-3) and got["gpu_busy_fraction"] == pytest.approx(1900 / 2000)
    path.write_text(json.dumps({"traceEvents": [_event("aten::mm", 0, 10, cat="cpu_op")]}))
    assert "no decoding step" in bench_infer.summarize_decode_trace(str(path))["error"]


def test_where_time_goes_merges_the_gpu_intervals_and_ranks_kernels_and_host_ops():
    events = [
        _event("gemm", 0, 400, cat="kernel"),
        _event("Memcpy HtoD (Pinned -> Device)", 200, 400, cat="gpu_memcpy"),  # overlaps the gemm: busy 0..600
        _event("gemm", 800, 100, cat="kernel"),
        _event("norm", 950, 10, cat="kernel"),
        _event("aten::mm", 0, 30, cat="cpu_op"),
        _event("aten::mm", 100, 30, cat="cpu_op"),
        _event("cudaLaunchKernel", 5, 1, cat="cuda_runtime"),
        _event("gemm", 5000, 100, cat="kernel"),  # outside the window: not counted
    ]
    got = bench_infer.where_time_goes(events, 0, 1000)
    assert got["gpu_busy_fraction"] == pytest.approx((600 + 100 + 10) / 1000)
    assert got["top_kernels"][0] == {"name": "gemm", "s": pytest.approx(500e-6)}
    assert got["top_host_ops"] == [{"name": "aten::mm", "s": pytest.approx(60e-6)}]
    assert got["kernel_launches_per_s"] == pytest.approx(1 / 1e-3)


def test_count_decode_ops_counts_every_group_of_a_split_cache():
    """tools/count_decode_ops.py: with the cache on the device a decoding step runs the whole batch through a
    layer at once; with a split cache each sub-batch is a group of its own, so its ops per layer grow with N."""
    import count_decode_ops

    from fsdp_speedloader.parallel import maybe_init_process_group

    maybe_init_process_group("cpu")
    device, split16, split32 = (count_decode_ops.count(name, n) for name, n in
                                (("device", 16), ("split", 16), ("split", 32)))
    assert device["ops_per_layer"] > 0
    assert split32["ops_per_layer"] > 1.5 * split16["ops_per_layer"] > 1.5 * device["ops_per_layer"]


def test_dummy_init_fills_every_parameter_in_threaded_chunks(monkeypatch):
    """bench_infer's dummy weights: every host value filled in [-0.02, 0.02] by chunks on the host threads (CPU
    uniform_ alone is one thread), chunks that do not divide a tensor included, distinct chunks distinct, and
    parameters that require grad (and DTensors' locals) filled in place without an autograd error."""
    import torch

    monkeypatch.setattr(bench_infer, "_DUMMY_CHUNK", 1000)
    params = [torch.nn.Parameter(torch.full((3, 1234), 7.0, dtype=torch.bfloat16)),
              torch.nn.Parameter(torch.full((999,), 7.0)), torch.nn.Parameter(torch.zeros(4, 4).t()),  # strided
              torch.nn.Parameter(torch.zeros(5, dtype=torch.int64), requires_grad=False)]
    bench_infer._dummy_init(params)
    for p in params[:3]:
        assert p.abs().max() <= 0.02 and (p != 0).float().mean() > 0.99 and not (p == 7.0).any()
    first = params[0].detach().view(-1)
    assert not torch.equal(first[:1000].float(), first[1000:2000].float())  # a generator per chunk
    assert torch.equal(params[3], torch.zeros(5, dtype=torch.int64))  # not floating point: untouched


def test_an_appended_record_divides_no_rows_of_different_invocations(tmp_path):
    """bench_infer --append merges rows of separate commands into one record, but its speedup divides only the rows
    of one invocation (docs/benchmarking.md: rows of different invocations are never divided into a ratio)."""
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    base = [sys.executable, str(REPO / "tools" / "bench_infer.py"), "--device", "cpu", "--model", "opt_tiny", "--layers",
            "2", "--prompt-len", "8", "--gen-len", "2", "--name", "r", "--out-dir", str(tmp_path)]
    for contender, append in (("speedloader:4x2", []), ("accelerate:4", ["--append"])):
        proc = subprocess.run([*base, "--contender", contender, *append], env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "r.json").read_text())
    assert [r["status"] for r in record["results"]] == ["ok", "ok"]
    assert "speedup" not in record  # the speedloader row came from the first command
