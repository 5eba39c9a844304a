"""How long a checkpoint save holds the training loop: synchronous vs asynchronous (``checkpoint.async_save``).

Runs the real training entry point twice on the same overrides, once with ``checkpoint.async_save=false`` and once
with ``true`` (each in its own process and checkpoint directory, saving every ``--every`` steps), and reads the
trainer's own ``checkpoint_stall_s`` from each run's ``metrics.jsonl``: the seconds the save held the loop (the
whole write when synchronous; the wait for the previous save plus the staging copy when asynchronous). Also
recorded: each run's median step time over the steps without a save (what a save costs the steps around it), its
wall time, the checkpoint's size on disk and the host peak resident set of the asynchronous run's staging.

``async_over_sync_stall`` compares the median stalls after each run's first save (the first pays one-time costs:
DCP's planning, the staging buffers), so give it three saves or more.

Usage (the lead's GPU run, full LLaMA-2-7B with every state on the host, saves at steps 2 and 4; bf16 master
weights and int8 AdamW states, so that the staging copy fits a 128 GiB host beside the arena and two checkpoints of
about 27 GB fit a 64 GB disk: the plan refuses fp32 states, 75.3 GiB of staging on top of 108.7 GiB; both modes run
the same config). Save less often than a checkpoint takes to write, or the next
asynchronous save waits for the previous one and the stall measures the disk::

    python tools/bench_checkpoint.py --name checkpoint_stall_llama2_7b --every 2 -- \\
        experiment=llama2_7b_offload optim.state_dtype=int8 optim.master_dtype=bf16 \\
        optim.overlap_with_backward=true steps=4 checkpoint.dir=/local_nvme/ckpt_bench
    python tools/bench_checkpoint.py --name checkpoint_stall_cpu --every 2 -- \\
        experiment=tiny_cpu steps=6 logger=none                  # CPU: the code path

``checkpoint.dir`` (given or not) gets one sub-directory per mode, deleted after its run unless ``--keep`` (so a disk
holds one mode's checkpoints at a time). Writes --out-dir (default bench/results)/<name>.json (tools/harness.py's header) and prints one line per mode and the ratio.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package: its modules import by name
import harness  # noqa: E402

REPO = harness.REPO
MODES = {"sync": "false", "async": "true"}


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_mode(mode: str, overrides: list[str], *, every: int, root: Path, timeout: float, keep: bool = False) -> dict:
    ckpt_root = next((Path(o.split("=", 1)[1]) for o in overrides if o.startswith("checkpoint.dir=")), root)
    ckpt = ckpt_root / f"bench_{mode}"
    run_dir = root / f"run_{mode}"
    shutil.rmtree(ckpt, ignore_errors=True)
    args = [o for o in overrides if not o.startswith("checkpoint.dir=")]
    cmd = [sys.executable, "-m", "fsdp_speedloader.app.train", *args, f"checkpoint.async_save={MODES[mode]}",
           f"checkpoint.every={every}", "checkpoint.every_minutes=0", "checkpoint.keep_last=1",
           "checkpoint.save_final=false", f"checkpoint.dir={ckpt}", f"hydra.run.dir={run_dir}", "log_every=1"]
    try:
        done = harness.run_process(cmd, cwd=REPO, timeout=timeout, echo=lambda line: print(f"[{mode}] {line}", end=""))
        row = _row(mode, cmd, done, run_dir, ckpt)
    finally:  # before the next mode writes its own: a disk holds one run's checkpoints at a time
        if not keep:
            shutil.rmtree(ckpt, ignore_errors=True)
    return row


def _row(mode: str, cmd: list[str], done, run_dir: Path, ckpt: Path) -> dict:
    if done.returncode != 0:
        status, error = done.failure()
        return {"mode": mode, "status": status, "error": error, "command": cmd}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    saves = [r for r in records if "checkpoint_stall_s" in r]
    plain = [r["step_time_s"] for r in records if "checkpoint_stall_s" not in r and "step_time_s" in r]
    steps = sorted(ckpt.glob("step_*"))
    row = {"mode": mode, "status": "ok", "save_steps": [r["step"] for r in saves],
           "checkpoint_stall_s": [r["checkpoint_stall_s"] for r in saves],
           "median_stall_s": statistics.median(r["checkpoint_stall_s"] for r in saves) if saves else None,
           # The first save also pays one-time costs (DCP's planning, the staging buffers' allocation).
           "median_stall_after_first_s": (statistics.median(r["checkpoint_stall_s"] for r in saves[1:])
                                          if len(saves) > 1 else None),
           "median_step_time_s_without_save": statistics.median(plain) if plain else None,
           "wall_s": done.wall_s, "checkpoint_bytes": _dir_bytes(steps[-1]) if steps else None,
           "host_rss_gib_last": records[-1].get("host_rss_gib"),
           # The staging copy lives in host memory: an asynchronous run's GPU peak equals the synchronous one's.
           "peak_gpu_mem_allocated_gib": max((r["peak_gpu_mem_allocated_gib"] for r in records
                                              if "peak_gpu_mem_allocated_gib" in r), default=None)}
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default="checkpoint_stall", help="record name: bench/results/<name>.json")
    p.add_argument("--every", type=int, default=2, help="checkpoint.every (saves at these steps)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints written")
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results"), help="where the record is written")
    p.add_argument("overrides", nargs="*", help="training overrides (after --)")
    args = p.parse_args(argv)
    record = harness.record_header("checkpoint_stall", __file__, argv)
    record["overrides"] = args.overrides
    record["every"] = args.every
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as tmp:
        rows = [run_mode(mode, args.overrides, every=args.every, root=Path(tmp), timeout=args.timeout, keep=args.keep)
                for mode in MODES]
    record["runs"] = rows
    by_mode = {r["mode"]: r for r in rows}
    sync, asynchronous = (by_mode[m].get("median_stall_after_first_s") or by_mode[m].get("median_stall_s")
                          for m in ("sync", "async"))
    record["async_over_sync_stall"] = asynchronous / sync if sync and asynchronous is not None else None
    path = harness.write_record(Path(args.out_dir) / f"{args.name}.json", record)
    for r in rows:
        print(f"{r['mode']}: {r['status']}, stall per save {r.get('checkpoint_stall_s')} s"
              + (f" ({r['error']})" if r["status"] != "ok" else ""))
    print(f"async / sync stall: {record['async_over_sync_stall']}; record {path}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
