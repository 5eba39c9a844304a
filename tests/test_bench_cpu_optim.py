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
