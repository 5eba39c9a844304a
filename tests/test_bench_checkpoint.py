"""tools/bench_checkpoint.py on the CPU: both modes run the real trainer, their stalls are read from metrics.jsonl, and
each mode's checkpoints are gone before the next mode writes (a disk holds one mode's at a time)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bench_checkpoint  # noqa: E402  (tools/ is not a package)


@pytest.mark.slow
def test_both_modes_on_the_cpu(tmp_path, monkeypatch):
    seen = []
    real = bench_checkpoint._row

    def row_and_dirs(mode, cmd, done, run_dir, ckpt):
        seen.append(sorted(p.name for p in (tmp_path / "ckpt").iterdir()))  # after this mode's run, before cleanup
        return real(mode, cmd, done, run_dir, ckpt)

    monkeypatch.setattr(bench_checkpoint, "_row", row_and_dirs)
    assert bench_checkpoint.main(["--name", "stall", "--every", "2", "--out-dir", str(tmp_path), "--",
                                  "experiment=tiny_cpu", "steps=6", "logger=none",
                                  f"checkpoint.dir={tmp_path / 'ckpt'}"]) == 0
    record = json.loads((tmp_path / "stall.json").read_text())
    runs = {r["mode"]: r for r in record["runs"]}
    assert runs["sync"]["save_steps"] == runs["async"]["save_steps"] == [2, 4, 6]
    assert all(s >= 0 for r in runs.values() for s in r["checkpoint_stall_s"])
    assert record["async_over_sync_stall"] is not None
    assert seen == [["bench_sync"], ["bench_async"]]  # the sync run's checkpoints went before the async run wrote
    assert list((tmp_path / "ckpt").iterdir()) == []
