"""tools/bench_cpu_optim.py: a row per candidate, thread count and (for the compressed candidates) chunk size, the
chunk applied in the worker and recorded; a chunk that is no whole number of int8 blocks refused before any run; with
--dtensor, DTensor rows with the main thread's progress beside the step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_cpu_optim.py"


def _run(tmp_path, *args):
    return subprocess.run([sys.executable, str(TOOL), "--out-dir", str(tmp_path), "--name", "t", *args],
                          capture_output=True, text=True, timeout=600)


def test_each_chunk_size_is_a_row(tmp_path):
    done = _run(tmp_path, "--candidates", "fsl-int8", "--threads", "1", "--chunks", "65536,262144", "--blocks", "1",
                "--steps", "1", "--warmup", "0")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "t.json").read_text())["results"]
    assert [(r["candidate"], r["chunk_elements"], r["status"]) for r in rows] == [
        ("fsl-int8", 65536, "ok"), ("fsl-int8", 262144, "ok")]
    assert all(r["s_per_billion_params"] > 0 for r in rows)


def test_a_chunk_of_no_whole_blocks_is_refused(tmp_path):
    done = _run(tmp_path, "--candidates", "fsl-int8", "--chunks", "3000")
    assert done.returncode == 2 and "multiples of 2048" in done.stderr
    assert not (tmp_path / "t.json").exists()


def test_dtensor_rows_record_the_main_threads_progress(tmp_path):
    """--dtensor: the parameters and gradients are DTensors; every row says how much of its Python progress the main
    thread kept beside the step (a share: positive, and no thread keeps much more than all of it)."""
    done = _run(tmp_path, "--dtensor", "--candidates", "local-fused,clip-norms-fsl", "--threads", "1", "--blocks",
                "1", "--steps", "1", "--warmup", "0")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "t.json").read_text())["results"]
    assert [(r["candidate"], r["status"], r["dtensor"]) for r in rows] == [
        ("local-fused", "ok", True), ("clip-norms-fsl", "ok", True)]
    assert all(0 < r["main_thread_progress"] < 1.5 and r["s_per_billion_params"] > 0 for r in rows)


def test_processes_run_as_the_ranks_of_a_node(tmp_path):
    """--processes 2: two workers at once, LOCAL_RANK 0 and 1 of 2, their timed steps started together; the row
    sums their rates into the node's (each worker's parameters over its own median step)."""
    done = _run(tmp_path, "--candidates", "torch-fused", "--threads", "1", "--blocks", "1", "--steps", "2",
                "--warmup", "1", "--processes", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads((tmp_path / "t.json").read_text())["results"][0]
    assert row["status"] == "ok" and row["num_processes"] == 2
    assert sorted(p["local_rank"] for p in row["processes"]) == [0, 1]
    expected = sum(p["num_params"] / p["median_step_s"] / 1e9 for p in row["processes"])
    assert abs(row["node_billion_params_per_s"] - expected) < 1e-9 and "node of 2" in done.stdout


def test_affinity_pins_each_ranks_step_to_its_own_cpus(tmp_path):
    """--affinity: as optim.worker_affinity, each worker's step runs on its rank's CPUs less one (one CPU: that
    one), one thread per CPU, whatever --threads says; two ranks get disjoint CPUs where there are two or more."""
    import os

    done = _run(tmp_path, "--candidates", "torch-fused", "--threads", "7", "--blocks", "1", "--steps", "1",
                "--warmup", "0", "--processes", "2", "--affinity")
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads((tmp_path / "t.json").read_text())["results"][0]
    cpus = [p["cpus"] for p in sorted(row["processes"], key=lambda p: p["local_rank"])]
    assert all(cpus) and all(p["threads"] == len(p["cpus"]) for p in row["processes"])
    if len(os.sched_getaffinity(0)) >= 2:
        assert not set(cpus[0]) & set(cpus[1]), cpus


def test_the_pooled_step_is_a_row_per_chunk_beside_a_host_load(tmp_path):
    """local-pool (optim.fp32_host_step=pool): a row per --chunks size, the chunk recorded; --host-busy 1 runs one
    busy-loop process beside every row's worker, and each row records it."""
    done = _run(tmp_path, "--candidates", "local-pool", "--threads", "2", "--chunks", "1048576",
                "--blocks", "1", "--steps", "1", "--warmup", "0", "--host-busy", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "t.json").read_text())["results"]
    assert [(r["candidate"], r["chunk_elements"], r["status"]) for r in rows] == [("local-pool", 1048576, "ok")]
    assert rows[0]["host_load"]["busy_processes"] == 1 and rows[0]["host_load"]["busy_iterations"] > 0
