"""Convergence of every non-exact host-memory mode against exact fp32 AdamW states: same model, data, seed, steps.

Each mode trains through ``python -m fsdp_speedloader.app.train`` in its own process, layer-major with the states
offloaded and the optimizer overlapped with the backward (``optim.grad_clip=0``: the in-flight gradient slots,
exact), on the embedded corpus (``data=default``; ``--data-path`` for a .txt/.jsonl file) from the same seeded
weights in the same batch order:

  fp32   optim.state_dtype=fp32 (the reference: exact)
  bf16   optim.state_dtype=bf16 (bf16 moments, rounded to nearest after each step)
  int8   optim.state_dtype=int8 (8-bit blockwise moments)
  bf16-master  optim.master_dtype=bf16 optim.state_dtype=int8 (bf16 master weights with stochastic rounding and
               int8 moments: the smallest mode, ~4.2 B/param)

A mode passes when its loss after the last step -- the mean of the last ``--window`` steps' losses, the same batches
for every mode -- is within ``--tolerance`` (default 1%) of fp32's. Writes bench/results/<name>.json (device,
torch, commit, command, config, per mode: the loss curve, the final loss, its relative difference, pass/fail) and
<name>.png (the curves together, and each mode's relative difference per step; needs matplotlib: ``pip install -e
'.[plots]'``); the runs log to W&B offline in the group <name> (``wandb sync
<out-dir>/<name>_runs/*/wandb/offline-run-*``), unless ``--no-wandb``.

Usage (CPU, a few minutes):
  python tools/convergence_check.py                                   # llama_tiny, 300 steps, every mode
  python tools/convergence_check.py --steps 20 --modes fp32,bf16 --override model.num_layers=2   # quick
Exits 1 when a mode misses the tolerance.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package: its modules import by name
import harness  # noqa: E402

REPO = harness.REPO
MODES = {"fp32": ["optim.state_dtype=fp32"], "bf16": ["optim.state_dtype=bf16"], "int8": ["optim.state_dtype=int8"],
         "bf16-master": ["optim.master_dtype=bf16", "optim.state_dtype=int8"]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="fp32,bf16,int8,bf16-master",
                   help=f"comma-separated, of {list(MODES)}; fp32 first")
    p.add_argument("--model", default="llama_tiny")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--sub-batch-size", type=int, default=4)
    p.add_argument("--num-sub-batches", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=10, help="the final loss: the mean of the last this many steps")
    p.add_argument("--tolerance", type=float, default=0.01, help="relative difference allowed to fp32's final loss")
    p.add_argument("--data-path", default=None, help="a .txt/.jsonl file or directory (default: the embedded corpus)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--override", action="append", default=[], help="one more Hydra override for every mode")
    p.add_argument("--no-wandb", action="store_true", help="logger=none (metrics.jsonl only)")
    p.add_argument("--name", default="convergence_llama_tiny")
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    p.add_argument("--timeout-s", type=float, default=3600)
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or modes[0] != "fp32" or set(modes) - set(MODES):
        p.error(f"--modes: fp32 first (the reference), then any of {list(MODES)[1:]}")
    return args


def mode_overrides(args: argparse.Namespace, mode: str, run_dir: Path) -> list[str]:
    """The Hydra overrides of one mode: the same run but for ``optim.state_dtype`` (and ``optim.master_dtype``)."""
    common = [f"model={args.model}", f"data.seq_len={args.seq_len}", f"seed={args.seed}", f"device={args.device}",
              f"steps={args.steps}", "log_every=1", "offload=params", "schedule=speedloader",
              f"schedule.sub_batch_size={args.sub_batch_size}", f"schedule.num_sub_batches={args.num_sub_batches}",
              "optim.overlap_with_backward=true", "optim.grad_clip=0", f"optim.lr={args.lr:g}",
              f"optim.warmup_steps={args.warmup_steps}", "checkpoint.save_final=false", f"hydra.run.dir={run_dir}"]
    common += ["logger=none"] if args.no_wandb else [
        "logger=wandb", "logger.mode=offline", f"logger.group={args.name}", f"logger.name={args.name}-{mode}",
        "logger.tags=[convergence_check]"]
    common += ["data=default"] if args.data_path is None else ["data=text", f"data.path={args.data_path}"]
    return common + MODES[mode] + list(args.override)


def run_mode(args: argparse.Namespace, mode: str, run_dir: Path) -> dict:
    from fsdp_speedloader.app.sweep_report import read_metrics

    overrides = mode_overrides(args, mode, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"[{mode}] {shlex.join(['python', '-m', 'fsdp_speedloader.app.train', *overrides])}", flush=True)
    with open(run_dir / "console.log", "w") as console:
        done = harness.run_process([sys.executable, "-m", "fsdp_speedloader.app.train", *overrides], cwd=REPO,
                                   env=dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true"),
                                   timeout=args.timeout_s, echo=console.write)
    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    record = {"status": "ok", "overrides": overrides, "wall_s": done.wall_s,
              "wandb_runs": sorted(str(p.relative_to(run_dir)) for p in (run_dir / "wandb").glob("offline-run-*")),
              "curve": {"step": [r["step"] for r in rows], "loss": [r["loss"] for r in rows]}}
    if done.returncode != 0 or len(rows) < args.steps:
        record["status"], record["error"] = done.failure("" if done.returncode else "with fewer logged steps")
        return record
    losses = record["curve"]["loss"]
    record["final_loss"] = statistics.fmean(losses[-args.window:])
    record["first_loss"] = losses[0]
    return record


def plot(path: Path, results: dict, args: argparse.Namespace) -> Path | None:
    plt = harness.pyplot("convergence_check")
    if plt is None:
        return None
    fig, (ax, rel) = plt.subplots(1, 2, figsize=(11, 4))
    ref = results["fp32"]["curve"]["loss"]
    for mode, r in results.items():
        if r["status"] != "ok":
            continue
        ax.plot(r["curve"]["step"], r["curve"]["loss"], label=f"{mode} (final {r['final_loss']:.4f})", lw=1)
        if mode != "fp32":
            rel.plot(r["curve"]["step"], [100 * (a - b) / b for a, b in zip(r["curve"]["loss"], ref)], label=mode,
                     lw=1)
    ax.set(xlabel="step", ylabel="loss", title=f"{args.model}: AdamW states")
    ax.legend()
    rel.axhline(100 * args.tolerance, color="grey", ls="--", lw=0.8)
    rel.axhline(-100 * args.tolerance, color="grey", ls="--", lw=0.8)
    rel.set(xlabel="step", ylabel="loss vs fp32 (%)", title="relative difference per step")
    rel.legend()
    return harness.save_figure(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    runs = out_dir / f"{args.name}_runs"
    results = {}
    for mode in args.modes.split(","):
        results[mode] = run_mode(args, mode, runs / mode)
    ref = results["fp32"]
    ok = ref["status"] == "ok"
    for mode, r in results.items():
        if r["status"] == "ok" and ok:
            r["relative_to_fp32"] = (r["final_loss"] - ref["final_loss"]) / ref["final_loss"]
            r["within_tolerance"] = abs(r["relative_to_fp32"]) <= args.tolerance
        ok = ok and r.get("within_tolerance", False)
        r["run_dir"] = str((runs / mode).relative_to(out_dir))
    record = {**harness.record_header("convergence_check", __file__, device=harness.device_name(args.device)),
              "config": vars(args), "wandb_group": None if args.no_wandb else args.name, "passed": ok,
              "results": results}
    path = harness.write_record(out_dir / f"{args.name}.json", record)
    png = plot(out_dir / f"{args.name}.png", results, args) if ref["status"] == "ok" else None
    print("| mode | final loss (mean of the last %d steps) | vs fp32 | within %.1f%% |" % (args.window,
                                                                                   100 * args.tolerance))
    print("|---|---|---|---|")
    for mode, r in results.items():
        if r["status"] != "ok":
            print(f"| {mode} | {r['status']}: {r.get('error')} | - | no |")
            continue
        print(f"| {mode} | {r['final_loss']:.4f} | {100 * r.get('relative_to_fp32', 0.0):+.3f}% | "
              f"{'yes' if r.get('within_tolerance') else 'no'} |")
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
