"""tools/bench_run.py: one real trainer run under torchrun, recorded (its steps, a summary, memory samples)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from launch_utils import TINY_OVERRIDES, TOOLS, clean_env, tail

sys.path.insert(0, str(TOOLS))
import bench_run  # noqa: E402  (tools/ is not a package)


def _step(i: int, loss: float, tps: float, mfu: float = 0.4) -> dict:
    return {"step": i, "loss": loss, "tokens_per_s": tps, "step_time_s": 1000 / tps, "mfu": mfu,
            "host_rss_gib": 10.0 + i, "peak_gpu_mem_allocated_gib": 5.0}


def test_summary_leaves_out_warmup_steps_and_follows_the_loss():
    steps = [_step(1, 12.0, 100.0, 0.01), _step(2, 11.0, 400.0), _step(3, 9.0, 500.0), _step(4, 10.0, 300.0)]
    got = bench_run.summarize(steps, warmup_steps=1)
    assert got["tokens_per_s"]["median"] == 400.0 and got["tokens_per_s"]["min"] == 300.0
    assert got["tokens_per_s"]["n"] == 3 and got["mfu"]["median"] == 0.4  # step 1's 1% left out
    assert (got["loss_first"], got["loss_last"], got["loss_fell"], got["loss_max"]) == (12.0, 10.0, True, 12.0)
    assert got["host_rss_gib_max"] == 14.0
    assert bench_run.summarize(steps, warmup_steps=0)["tokens_per_s"]["min"] == 100.0
    rising = [_step(1, 5.0, 100.0), _step(2, 7.0, 100.0)]
    assert bench_run.summarize(rising, warmup_steps=1)["loss_fell"] is False
    assert bench_run.summarize([], warmup_steps=1) == {"steps": 0}


def test_monitor_log_peaks():
    text = "\n".join([bench_run.monitor_line(0, 4.0, [0, 0]), bench_run.monitor_line(20, 412.0, [44076, 42091]),
                      "unrelated", bench_run.monitor_line(40, 220.5, [4, 50000])])
    got = bench_run.parse_monitor(text)
    assert got == {"samples": 3, "node_host_used_peak_gib": 412.0, "gpu_used_peak_mib": [44076, 50000]}
    assert bench_run.parse_monitor("")["node_host_used_peak_gib"] is None


@pytest.mark.slow
def test_records_a_real_torchrun_training_run(tmp_path):
    out = tmp_path / "results"
    cmd = [sys.executable, str(TOOLS / "bench_run.py"), "--name", "tiny", "--out-dir", str(out), "--sample-s", "0.5",
           "--", *TINY_OVERRIDES, "steps=4"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=clean_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, tail(proc.stdout + proc.stderr)
    record = json.loads((out / "tiny.json").read_text())
    assert record["benchmark"] == "run" and record["status"] == "ok" and record["returncode"] == 0
    assert [s["step"] for s in record["steps"]] == [1, 2, 3, 4]
    summary = record["summary"]
    assert summary["steps"] == 4 and summary["tokens_per_s"]["n"] == 3 and summary["loss_fell"]
    assert record["memory"]["samples"] >= 1 and record["memory"]["node_host_used_peak_gib"] > 0
    assert "steps=4" in record["overrides"] and "--nproc-per-node 1" in record["train_command"]
    # the same run recorded again from its run directory and sampler log
    again = [sys.executable, str(TOOLS / "bench_run.py"), "--from-run-dir", str(out / "tiny.run"), "--monitor-log",
             str(out / "tiny.monitor.log"), "--device", "cpu", "--name", "again", "--out-dir", str(out)]
    proc = subprocess.run(again, cwd=tmp_path, env=clean_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, tail(proc.stdout + proc.stderr)
    copy = json.loads((out / "again.json").read_text())
    assert copy["steps"] == record["steps"] and copy["summary"] == summary and "steps=4" in copy["overrides"]


def test_refuses_both_or_neither_source(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_run.main(["--name", "x", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit):
        bench_run.main(["--name", "x", "--out-dir", str(tmp_path), "--from-run-dir", str(tmp_path), "--", "steps=1"])
    assert "not both" in capsys.readouterr().err
