"""Wall-time overhead of validation: one training run through the CLI, evaluating at the default ``eval.every`` and
``eval.batches`` (or those given), the held-out set split off with ``data.val_fraction``.

The overhead is measured inside the run, so both sides share the machine's load at the same time:

  eval_s       the summed ``val_time_s`` of every evaluation (at ``eval.every`` and after the last step)
  loop_s       the training loop's wall time: the last step's ``elapsed_s`` plus the final evaluation
  overhead     eval_s / (loop_s - eval_s): what validation adds to the run's wall time
  per_interval the mean evaluation's seconds over ``eval.every`` mean steps: the steady-state figure, what a run
               much longer than ``eval.every`` pays

Writes bench/results/<name>.json (device, torch, commit, command, the run's overrides, every figure above, each
step's and each evaluation's seconds).

Usage (CPU, the tiny run of ``experiment=tiny_cpu`` for 200 steps: minutes):
  python tools/bench_validation.py
  python tools/bench_validation.py --steps 400 --override eval.every=50 --override eval.batches=8
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package: its modules import by name
import harness  # noqa: E402

REPO = harness.REPO


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experiment", default="tiny_cpu")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--val-fraction", type=float, default=0.01)
    p.add_argument("--override", action="append", default=[], help="one more Hydra override of the run")
    p.add_argument("--name", default="validation_overhead_tiny_cpu")
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    return p.parse_args(argv)


def summarize(records: list[dict], every: int) -> dict:
    """The figures of one run's metrics.jsonl records (every step logged)."""
    steps = [r["step_time_s"] for r in records]
    evals = [r["val_time_s"] for r in records if "val_time_s" in r]
    eval_s = sum(evals)
    loop_s = records[-1]["elapsed_s"] + records[-1].get("val_time_s", 0.0)
    return {"num_steps": len(records), "num_evaluations": len(evals), "eval_s": eval_s, "loop_s": loop_s,
            "overhead": eval_s / (loop_s - eval_s),
            "per_interval": statistics.mean(evals) / (every * statistics.mean(steps)) if every else None,
            "mean_step_s": statistics.mean(steps), "median_step_s": statistics.median(steps),
            "mean_eval_s": statistics.mean(evals), "val_tokens": records[-1].get("val_tokens"),
            "step_time_s": steps, "val_time_s": evals,
            "val_loss": [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]}


def main(argv=None) -> int:
    args = parse_args(argv)
    from fsdp_speedloader.app.config import EvalConfig

    every = EvalConfig().every
    for o in args.override:
        if o.startswith("eval.every="):
            every = int(o.split("=", 1)[1])
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [f"experiment={args.experiment}", f"steps={args.steps}", "log_every=1", "logger=none",
                     f"data.val_fraction={args.val_fraction}", f"hydra.run.dir={run_dir}", *args.override]
        cmd = [sys.executable, "-m", "fsdp_speedloader.app.train", *overrides]
        print("running:", shlex.join(cmd), flush=True)
        done = harness.run_process(cmd, cwd=REPO)
        if done.returncode != 0:
            print(harness.error_summary(done.stdout + done.stderr))
            return 1
        records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    figures = summarize(records, every)
    figures["load_average"] = os.getloadavg()  # 1, 5, 15 minutes at the end: how shared the machine was
    record = {**harness.record_header("validation_overhead", __file__, argv, device=harness.device_name("cpu")),
              "config": {"overrides": [o for o in overrides if not o.startswith("hydra.run.dir=")],
                         "eval_every": every}, **figures}
    path = harness.write_record(Path(args.out_dir) / f"{args.name}.json", record)
    print(f"{figures['num_evaluations']} evaluations: {figures['eval_s']:.1f} s of a {figures['loop_s']:.1f} s loop: "
          f"overhead {figures['overhead']:.2%}, per interval {figures['per_interval']:.2%} -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
