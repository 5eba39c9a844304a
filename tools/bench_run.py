"""One run of the real trainer, recorded: every step's metrics, the node's host memory and each GPU's memory.

For runs that are the figure themselves (a 70B model on one node, a long job) rather than contenders of a
table: ``torchrun --standalone --nproc-per-node N -m fsdp_speedloader.app.train OVERRIDES`` with its run
directory under --out-dir, a sampler beside it (the node's used host memory from /proc/meminfo and each GPU's
used memory from nvidia-smi, every --sample-s seconds, in ``<name>.monitor.log``), then the record
``<name>.json``: the header (device, torch, commit, command), the overrides, every step's metrics from the
run's metrics.jsonl, and a summary over the steady steps (after --warmup-steps): tokens/s and MFU as
median, min and max, the loss's first and last values and whether it fell, the largest rank RSS, GPU peak and
the node's host peak.

    python tools/bench_run.py --nproc-per-node 4 --name train_llama2_70b_4gpu --out-dir bench/results -- \\
        experiment=llama2_70b_4gpu logger=none
    # a run already made (its run directory, and the sampler's log if there was one)
    python tools/bench_run.py --from-run-dir outputs/run70b --monitor-log run70b.monitor.log \\
        --device "4 x NVIDIA H200" --name train_llama2_70b_4gpu --out-dir bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))  # tools/ is not a package: its modules import by name
import harness  # noqa: E402
import protocol  # noqa: E402

GIB = 2**30
STEP_KEYS = ("step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "mfu", "mfu_no_attention", "hfu",
             "host_rss_gib", "peak_gpu_mem_allocated_gib", "peak_gpu_mem_reserved_gib", "tokens", "epoch",
             "optimizer_busy_s", "optimizer_wait_s", "grad_ring_wait_s", "data_wait_s")
MONITOR_LINE = re.compile(r"^\[mon (\d+) s\] host used (\d+(?:\.\d+)?) GiB(.*)$")


def host_used_gib() -> float:
    """The node's used host memory: MemTotal - MemAvailable (what a run and everything else on the node hold)."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    return (info["MemTotal"] - info.get("MemAvailable", info["MemTotal"])) / GIB


def gpu_used_mib() -> list[int]:
    """Each GPU's used memory as nvidia-smi reports it ([] without nvidia-smi): asked from outside, so that this
    process holds no CUDA context beside the run's."""
    if shutil.which("nvidia-smi") is None:
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30)
    return [int(v) for v in out.stdout.split()] if out.returncode == 0 else []


def monitor_line(elapsed_s: float, host_gib: float, gpus_mib: Sequence[int]) -> str:
    return f"[mon {elapsed_s:.0f} s] host used {host_gib:.1f} GiB" + "".join(f" {m} MiB" for m in gpus_mib)


def parse_monitor(text: str) -> dict:
    """The sampler's log -> the node's host peak (GiB) and each GPU's peak used memory (MiB), over its samples."""
    host, gpus, samples = 0.0, [], 0
    for line in text.splitlines():
        m = MONITOR_LINE.match(line.strip())
        if not m:
            continue
        samples += 1
        host = max(host, float(m.group(2)))
        values = [int(v) for v in re.findall(r"(\d+) MiB", m.group(3))]
        gpus = [max(a, b) for a, b in zip(gpus, values)] if gpus else values
    return {"samples": samples, "node_host_used_peak_gib": host if samples else None,
            "gpu_used_peak_mib": gpus}


def read_steps(run_dir: Path) -> list[dict]:
    """Every step line of the run's metrics.jsonl (evaluation lines left out), the keys of :data:`STEP_KEYS`."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl in the run directory (did the run reach step 1?)")
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if "step" in row and "loss" in row and "tokens_per_s" in row:
            rows.append({k: row[k] for k in STEP_KEYS if k in row})
    return rows


def summarize(steps: Sequence[dict], *, warmup_steps: int) -> dict:
    """The steady steps' figures (those after the first ``warmup_steps``: compilation and first-touch costs sit
    in the first), the loss's course over every step, and the memory peaks."""
    if not steps:
        return {"steps": 0}
    steady = list(steps[warmup_steps:]) or list(steps)
    losses = [s["loss"] for s in steps]
    out = {"steps": len(steps), "warmup_steps": min(warmup_steps, len(steps) - 1 if len(steps) > 1 else 0),
           "tokens_per_s": protocol.spread(s["tokens_per_s"] for s in steady),
           "step_time_s": protocol.spread(s["step_time_s"] for s in steady),
           "loss_first": losses[0], "loss_last": losses[-1], "loss_fell": losses[-1] < losses[0],
           "loss_max": max(losses),
           "host_rss_gib_max": max((s.get("host_rss_gib") or 0.0) for s in steps),
           "peak_gpu_mem_allocated_gib": max((s.get("peak_gpu_mem_allocated_gib") or 0.0) for s in steps)}
    if all(s.get("mfu") is not None for s in steady):
        out["mfu"] = protocol.spread(s["mfu"] for s in steady)
    return out


class Sampler:
    """Writes :func:`monitor_line` every ``every_s`` seconds to ``path`` until stopped."""

    def __init__(self, path: Path, every_s: float) -> None:
        self.path, self.every_s = path, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        start = time.monotonic()
        with open(self.path, "w") as sink:
            while True:
                sink.write(monitor_line(time.monotonic() - start, host_used_gib(), gpu_used_mib()) + "\n")
                sink.flush()
                if self._stop.wait(self.every_s):
                    return


def train_command(nproc: int, run_dir: Path, overrides: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "fsdp_speedloader.app.train", *overrides, f"hydra.run.dir={run_dir}"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--name", required=True, help="the record's file name (without .json)")
    parser.add_argument("--out-dir", default=str(harness.REPO / "bench" / "results"))
    parser.add_argument("--warmup-steps", type=int, default=1, help="first steps left out of the steady figures")
    parser.add_argument("--sample-s", type=float, default=10.0, help="seconds between memory samples")
    parser.add_argument("--timeout", type=float, default=None, help="stop the run after this many seconds")
    parser.add_argument("--from-run-dir", default=None, help="record a run already made instead of starting one")
    parser.add_argument("--monitor-log", default=None, help="with --from-run-dir: its sampler's log, if any")
    parser.add_argument("--run-command", default=None, help="with --from-run-dir: the command that made the run")
    parser.add_argument("--device", default=None, help="the device's description (default: asked from torch)")
    parser.add_argument("overrides", nargs="*", help="the trainer's Hydra overrides (after --)")
    args = parser.parse_args(argv)
    if args.nproc_per_node < 1 or args.warmup_steps < 0 or args.sample_s <= 0:
        parser.error("--nproc-per-node >= 1, --warmup-steps >= 0 and --sample-s > 0")
    if bool(args.from_run_dir) == bool(args.overrides):
        parser.error("give the trainer's overrides after --, or --from-run-dir DIR (not both)")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = harness.record_header("run", __file__, argv, device=args.device)
    if args.from_run_dir:
        run_dir = Path(args.from_run_dir)
        monitor = Path(args.monitor_log).read_text() if args.monitor_log else ""
        overrides_file = run_dir / ".hydra" / "overrides.yaml"
        overrides = [line[2:].strip() for line in overrides_file.read_text().splitlines()
                     if line.startswith("- ")] if overrides_file.is_file() else []
        record.update(recorded_from=str(run_dir), run_command=args.run_command, overrides=overrides, returncode=None,
                      wall_s=None)
    else:
        run_dir = out_dir / f"{args.name}.run"
        monitor_path = out_dir / f"{args.name}.monitor.log"
        cmd = train_command(args.nproc_per_node, run_dir, args.overrides)
        env = dict(os.environ)
        print(f"bench_run: {' '.join(cmd)}", flush=True)
        with Sampler(monitor_path, args.sample_s):
            done = harness.run_process(cmd, env=env, timeout=args.timeout, echo=lambda line: print(line, end=""))
        monitor = monitor_path.read_text()
        record.update(overrides=list(args.overrides), nproc_per_node=args.nproc_per_node,
                      returncode=done.returncode, wall_s=done.wall_s, train_command=" ".join(cmd))
        if done.returncode != 0:
            status, error = done.failure("")
            record.update(status=status, error=error)
    steps = read_steps(run_dir) if (run_dir / "metrics.jsonl").is_file() or args.from_run_dir else []
    record.setdefault("status", "ok" if steps else "failed")
    record["memory"] = parse_monitor(monitor)
    record["summary"] = summarize(steps, warmup_steps=args.warmup_steps)
    record["steps"] = steps
    path = harness.write_record(out_dir / f"{args.name}.json", record)
    summary = record["summary"]
    if summary.get("steps"):
        tps, mfu = summary["tokens_per_s"], summary.get("mfu")
        print(f"bench_run: {summary['steps']} steps, steady tokens/s median {tps['median']:,.0f} "
              f"(min {tps['min']:,.0f}, max {tps['max']:,.0f})"
              + (f", MFU median {mfu['median']:.1%}" if mfu else "")
              + f", loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f}; node host peak "
              f"{record['memory']['node_host_used_peak_gib']} GiB")
    print(f"bench_run: wrote {path}")
    return 0 if record["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
