"""Pretraining under a fixed wall-clock budget: speedloader vs fsdp2-offload for the same minutes.

The paper's Table 2 at our scale. Both contenders train the same model from the same seeded
initialisation, on the same real text in the same order (the embedded English corpus with the byte
tokenizer unless --data-path names a .txt/.jsonl file or directory), with the same effective batch
and the same AdamW settings, each for --minutes of training loop, through the real trainer
(``python -m fsdp_speedloader.app.train``), one process per contender so each starts with clean GPU and
host memory:

  speedloader    layer-major (schedule=speedloader), parameters, gradients and optimizer state in host
                 memory (offload=params), each unit's CPU AdamW step overlapped with the backward
                 (optim.overlap_with_backward=true): the project's best configuration
  fsdp2-offload  FSDP2 + CPUOffloadPolicy (schedule=canonical offload=params): gradient accumulation
                 over the micro-batches, every block recomputed, one reduce-scatter after the last
                 micro-batch (schedule.gradient_sync=last, its fastest mode; --fsdp2-gradient-sync every
                 reduce-scatters each micro-batch)

What is timed is the trainer's ``time_budget_s``: the training loop, from just before step 1 to the
end of the first step that crosses the budget. Every step's batch loading and host-to-device copy,
forward, backward, optimizer step, step-boundary synchronisation and metric logging (console,
metrics.jsonl, W&B) count; the first step's one-time costs (CUDA kernels loaded, allocator warm-up)
count too. Not timed: process start, model build, sharding, weight initialisation, optimizer, data
loader and W&B set-up (each contender's ``outside_loop_s`` in the record). Gradient-norm clipping
is off for both by default (--grad-clip 0, the same optimizer settings for both). The learning rate is
constant after warmup.

A contender may carry its own settings: ``NAME:clip=X`` (optim.grad_clip) and, for speedloader,
``:overlap=false`` (the AdamW step after backward, clip-then-step). One invocation then measures what
clipping costs the overlapped optimizer (issue 20: within 3% of the unclipped overlapped step when clipping
does not trigger, never slower than the plain clip-then-step), clip=1e9 never clipping, clip=1e-6 always::

    python tools/bench_pretrain.py --model llama2_7b --layers 8 --seq-len 4096 --minutes 2 \
        --max-gpu-memory-gib 40 --contenders speedloader speedloader:clip=1e9 speedloader:clip=1e-6 \
        speedloader:clip=1e9:overlap=false speedloader:clip=1e-6:overlap=false --name clip_overlap_llama7b_L8

Compare their ``median_step_tokens_per_s`` (steps 3..: steady state, every deferred unit step included in the
step that waits for it).

Usage, one GPU (one invocation takes 2 x --minutes plus each contender's set-up, about a minute for
8 layers of the 7B shape: ~6 minutes for --minutes 2)::

    FSL_COMMIT=$(git rev-parse HEAD) python tools/bench_pretrain.py --model llama2_7b --layers 8 \\
        --seq-len 4096 --sub-batch-size 4 --num-sub-batches 2 --minutes 2 --max-gpu-memory-gib 40

On the CPU, in seconds (tests/test_bench_pretrain.py runs a smaller model still)::

    python tools/bench_pretrain.py --device cpu --model llama_tiny --seq-len 64 --sub-batch-size 2 \\
        --num-sub-batches 2 --minutes 0.05 --out-dir /tmp/bench

Writes ``<out-dir>/<name>.json`` (device, torch version, commit, command, configuration; per contender:
tokens processed, steps, first/final/min loss, loss vs tokens and vs seconds) and ``<out-dir>/<name>.png``
(loss vs wall-clock seconds and loss vs tokens). The run directories (metrics.jsonl, console.log,
wandb/offline-run-*) are ``<out-dir>/<name>_runs/<contender>/``; both W&B runs are in the group <name>
(upload with ``wandb sync <out-dir>/<name>_runs/*/wandb/offline-run-*``; plot loss over ``elapsed_s``
or ``tokens`` to overlay them). FSL_COMMIT names the commit where there is no git (the GPU machine).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package: its modules import by name
import harness  # noqa: E402

REPO = harness.REPO
sys.path.insert(0, str(REPO))  # the checkout's package, also where it is not installed
CONTENDERS = ("speedloader", "fsdp2-offload")
TIMED = ("the trainer's training loop (time_budget_s): from just before step 1 to the end of the first step "
         "that crosses the budget; each step's batch loading, host-to-device copy, forward, backward, optimizer "
         "step, step-boundary sync and metric logging (console, metrics.jsonl, W&B) count. Not timed: process "
         "start, model build, sharding, weight init, optimizer, data loader and W&B set-up (outside_loop_s).")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama2_7b", help="a conf/model option (model=...)")
    p.add_argument("--layers", type=int, default=None, help="model.num_layers (default: the model's)")
    p.add_argument("--seq-len", type=int, default=4096, help="data.seq_len")
    p.add_argument("--sub-batch-size", type=int, default=4, help="n: sequences per sub-batch (micro-batch)")
    p.add_argument("--num-sub-batches", type=int, default=2, help="N: sub-batches per step (effective batch n x N)")
    p.add_argument("--fsdp2-sub-batch-size", type=int, default=None,
                   help="fsdp2-offload's micro-batch size (default --sub-batch-size); must divide n x N")
    p.add_argument("--blocks-per-unit", type=int, default=1, help="schedule.blocks_per_unit (both contenders)")
    p.add_argument("--minutes", type=float, default=2.0, help="training-loop wall clock per contender")
    p.add_argument("--max-gpu-memory-gib", type=float, default=None, help="max_gpu_memory_gib (every contender)")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--data-path", default=None,
                   help="a .txt/.jsonl file or directory (data=text); default: the embedded corpus (data=default)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--lr-schedule", default="constant", choices=("constant", "cosine", "linear"),
                   help="after warmup; cosine and linear decay over --steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=0.0,
                   help="global-norm clipping for every contender without its own :clip=")
    p.add_argument("--no-overlap", action="store_true",
                   help="speedloader steps its optimizer after backward (optim.overlap_with_backward=false)")
    p.add_argument("--fsdp2-gradient-sync", default="last", choices=("last", "every"),
                   help="fsdp2-offload: reduce-scatter after the last micro-batch only, or after every one")
    p.add_argument("--steps", type=int, default=1_000_000, help="upper bound on steps (the budget ends the run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--contenders", nargs="+", default=list(CONTENDERS),
                   help=f"each one of {', '.join(CONTENDERS)}, with :clip=X (optim.grad_clip) and, for speedloader, "
                        ":overlap=true|false")
    p.add_argument("--no-wandb", action="store_true", help="logger=none (metrics.jsonl only)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="one more Hydra override for every contender (repeatable)")
    p.add_argument("--name", default=None, help="record name and W&B group (default from the shape and budget)")
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    p.add_argument("--setup-timeout-s", type=float, default=900.0,
                   help="a contender is killed after --minutes plus this many seconds")
    args = p.parse_args(argv)

    batch = args.sub_batch_size * args.num_sub_batches
    args.fsdp2_sub_batch_size = args.fsdp2_sub_batch_size or args.sub_batch_size
    if min(args.sub_batch_size, args.num_sub_batches, args.fsdp2_sub_batch_size) < 1 or args.minutes <= 0:
        p.error("--sub-batch-size, --num-sub-batches, --fsdp2-sub-batch-size and --minutes must be positive")
    if batch % args.fsdp2_sub_batch_size:
        p.error(f"--fsdp2-sub-batch-size {args.fsdp2_sub_batch_size} does not divide the effective batch {batch}")
    for contender in args.contenders:
        try:
            parse_contender(contender)
        except ValueError as e:
            p.error(str(e))
    if len(set(args.contenders)) != len(args.contenders):
        p.error("--contenders: each contender once")
    if args.max_gpu_memory_gib is not None and args.device == "cpu":
        p.error("--max-gpu-memory-gib caps GPU memory; leave it out with --device cpu")
    if args.data_path is not None:  # the contenders run in the repository root
        args.data_path = str(Path(args.data_path).resolve())
    if args.name is None:
        layers = f"_L{args.layers}" if args.layers else ""
        args.name = f"pretrain_{args.model}{layers}_s{args.seq_len}_b{batch}_{args.minutes:g}min"
    return args


def parse_contender(spec: str) -> tuple[str, Optional[float], Optional[bool]]:
    """'NAME[:clip=X][:overlap=true|false]' -> (NAME, clip or None, overlap or None); None: the command line's."""
    name, *options = spec.split(":")
    clip = overlap = None
    if name not in CONTENDERS:
        raise ValueError(f"contender {spec!r}: the names are {', '.join(CONTENDERS)}")
    for option in options:
        key, _, value = option.partition("=")
        if key == "clip" and _non_negative_float(value):
            clip = float(value)
        elif key == "overlap" and value in ("true", "false") and name == "speedloader":
            overlap = value == "true"
        else:
            raise ValueError(f"contender {spec!r}: the suffixes are ':clip=X' (X >= 0, optim.grad_clip) and, for "
                             "speedloader, ':overlap=true|false' (optim.overlap_with_backward)")
    return name, clip, overlap


def _non_negative_float(text: str) -> bool:
    try:
        return float(text) >= 0
    except ValueError:
        return False


def run_dir_name(contender: str) -> str:
    """A directory name for the contender spec ('speedloader:clip=1' -> 'speedloader_clip-1')."""
    return contender.replace(":", "_").replace("=", "-")


def contender_overrides(args: argparse.Namespace, contender: str, run_dir: Path) -> list[str]:
    """The Hydra overrides of one contender: everything but the schedule (and a contender's own suffixes) is
    shared."""
    contender, clip, overlap = parse_contender(spec := contender)
    grad_clip = args.grad_clip if clip is None else clip
    overlap = (not args.no_overlap) if overlap is None else overlap
    common = [f"model={args.model}", f"data.seq_len={args.seq_len}", f"seed={args.seed}", f"device={args.device}",
              f"steps={args.steps}", f"time_budget_s={args.minutes * 60:g}", "log_every=1", "offload=params",
              f"optim.lr={args.lr:g}", f"optim.warmup_steps={args.warmup_steps}",
              f"optim.lr_schedule={args.lr_schedule}", f"optim.weight_decay={args.weight_decay:g}",
              f"optim.grad_clip={grad_clip:g}", f"schedule.blocks_per_unit={args.blocks_per_unit}",
              "checkpoint.save_final=false", f"hydra.run.dir={run_dir}"]
    common += ["logger=none"] if args.no_wandb else [
        "logger=wandb", "logger.mode=offline", f"logger.group={args.name}", f"logger.name={args.name}-{spec}",
        "logger.tags=[bench_pretrain]"]
    if args.layers:
        common.append(f"model.num_layers={args.layers}")
    common += ["data=default"] if args.data_path is None else ["data=text", f"data.path={args.data_path}"]
    if args.max_gpu_memory_gib is not None:
        common.append(f"max_gpu_memory_gib={args.max_gpu_memory_gib:g}")
    batch = args.sub_batch_size * args.num_sub_batches
    if contender == "speedloader":
        schedule = ["schedule=speedloader", f"schedule.sub_batch_size={args.sub_batch_size}",
                    f"schedule.num_sub_batches={args.num_sub_batches}",
                    f"optim.overlap_with_backward={str(overlap).lower()}"]
    else:
        n = args.fsdp2_sub_batch_size
        schedule = ["schedule=canonical", f"schedule.sub_batch_size={n}", f"schedule.num_sub_batches={batch // n}",
                    "schedule.activation_checkpointing=true", f"schedule.gradient_sync={args.fsdp2_gradient_sync}"]
    return common + schedule + list(args.override)


def run_contender(args: argparse.Namespace, contender: str, run_dir: Path) -> dict:
    """Trains one contender in its own process; returns its record (``status`` ok, or oom, timeout or failed
    as tools/harness.py classifies them)."""
    overrides = contender_overrides(args, contender, run_dir)
    cmd = [sys.executable, "-m", "fsdp_speedloader.app.train", *overrides]
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"[{contender}] {shlex.join(['python', '-m', 'fsdp_speedloader.app.train', *overrides])}", flush=True)
    with open(run_dir / "console.log", "w") as console:

        def echo(line: str) -> None:  # the child's output to console.log and, prefixed, to ours
            console.write(line)
            print(f"[{contender}] {line}", end="", flush=True)

        done = harness.run_process(cmd, cwd=REPO, env=dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true"),
                                   timeout=args.minutes * 60 + args.setup_timeout_s, echo=echo)
    record = {"status": "ok", "returncode": done.returncode, "overrides": overrides, "wall_s": done.wall_s,
              **summarize_run(run_dir)}
    if done.returncode != 0 or not record.get("steps"):
        record["status"], record["error"] = done.failure("" if done.returncode else "without a logged step")
    elif "elapsed_s" in record:
        record["outside_loop_s"] = done.wall_s - record["elapsed_s"]  # process start, build, init, teardown
    return record


def summarize_run(run_dir: Path) -> dict:
    """Figures and curves from the run's metrics.jsonl (every step is logged: log_every=1)."""
    from fsdp_speedloader.app.sweep_report import read_metrics

    rows = [r for r in read_metrics(run_dir) if "loss" in r and r.get("elapsed_s") is not None]
    wandb_runs = sorted(str(p.relative_to(run_dir)) for p in (run_dir / "wandb").glob("offline-run-*"))
    if not rows:
        return {"wandb_runs": wandb_runs}
    losses = [r["loss"] for r in rows]
    last = rows[-1]
    steady = [r["tokens_per_s"] for r in rows[2:]] or [r["tokens_per_s"] for r in rows]
    return {
        "steps": last["step"], "tokens": last["tokens"], "elapsed_s": last["elapsed_s"],
        "tokens_per_s": last["tokens"] / last["elapsed_s"],  # the budget's average, first step included
        "median_step_tokens_per_s": statistics.median(steady),  # steps 3.. (warm)
        "first_step_s": rows[0]["step_time_s"], "median_step_s": statistics.median(r["step_time_s"] for r in rows),
        "first_loss": losses[0], "final_loss": losses[-1], "min_loss": min(losses),
        "last5_mean_loss": statistics.fmean(losses[-5:]), "median_mfu": statistics.median(r["mfu"] for r in rows),
        "peak_gpu_mem_allocated_gib": max(r.get("peak_gpu_mem_allocated_gib", 0.0) for r in rows),
        "peak_host_rss_gib": max(r.get("host_rss_gib", 0.0) for r in rows),
        "num_skipped_steps": last.get("num_skipped_steps", 0),  # optimizer steps skipped (non-finite gradients)
        # The overlapped CPU step, steps 3..: its seconds per step and the seconds of them the training waited.
        **{f"median_{k}": statistics.median(r[k] for r in rows[2:]) for k in ("optimizer_busy_s", "optimizer_wait_s")
           if len(rows) > 2 and all(k in r for r in rows[2:])},
        "wandb_runs": wandb_runs,
        "curve": {"step": [r["step"] for r in rows], "tokens": [r["tokens"] for r in rows],
                  "elapsed_s": [r["elapsed_s"] for r in rows], "loss": losses},
    }


def compare(results: dict) -> Optional[dict]:
    """speedloader against fsdp2-offload: tokens in the same minutes, losses, and that the data was the same."""
    a, b = results.get("speedloader"), results.get("fsdp2-offload")
    if not a or not b or a["status"] != "ok" or b["status"] != "ok":
        return None
    common = min(a["steps"], b["steps"])
    diffs = [abs(x - y) / abs(y) for x, y in zip(a["curve"]["loss"][:common], b["curve"]["loss"][:common])]
    # The loss speedloader had when it had processed as many tokens as fsdp2-offload in its whole budget.
    at_b_tokens = next((loss for t, loss in zip(a["curve"]["tokens"], a["curve"]["loss"]) if t >= b["tokens"]), None)
    at_b_elapsed = next((s for t, s in zip(a["curve"]["tokens"], a["curve"]["elapsed_s"]) if t >= b["tokens"]), None)
    return {
        "tokens_ratio": a["tokens"] / b["tokens"],
        "median_step_tokens_per_s_ratio": a["median_step_tokens_per_s"] / b["median_step_tokens_per_s"],
        "final_loss": {"speedloader": a["final_loss"], "fsdp2-offload": b["final_loss"]},
        "last5_mean_loss": {"speedloader": a["last5_mean_loss"], "fsdp2-offload": b["last5_mean_loss"]},
        # Same init, same first batch: step 1's loss is computed before any update, so it agrees to the
        # numerics of the two schedules (fp32 on the CPU: ~1e-6; bf16 on the GPU: ~1e-3).
        "first_step_loss_rel_diff": diffs[0],
        "common_steps": common, "max_loss_rel_diff_common_steps": max(diffs),
        "speedloader_loss_at_fsdp2_tokens": at_b_tokens, "speedloader_s_to_fsdp2_tokens": at_b_elapsed,
    }


def data_figures(args: argparse.Namespace) -> dict:
    """Size of the corpus the contenders read (the same for both)."""
    from fsdp_speedloader.app.config import DataConfig
    from fsdp_speedloader.app.data import load_tokens

    cfg = (DataConfig(seq_len=args.seq_len) if args.data_path is None
           else DataConfig(source="text", path=args.data_path, seq_len=args.seq_len))
    num_tokens = len(load_tokens(cfg))
    return {"source": cfg.source, "path": cfg.path, "tokenizer": cfg.tokenizer, "num_tokens": num_tokens,
            "num_sequences": num_tokens // args.seq_len}


def plot(record: dict, path: Path) -> Optional[str]:
    """Two panels: loss vs wall-clock seconds (budget marked), loss vs tokens."""
    plt = harness.pyplot("bench_pretrain")
    if plt is None:
        return None
    fig, (by_time, by_tokens) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, r) in enumerate(record["contenders"].items()):
        if r["status"] != "ok":
            continue
        label = f"{name}: {r['tokens']:,} tokens, {r['steps']} steps, final loss {r['final_loss']:.3f}"
        curve = r["curve"]
        # Dashed second curve: at equal tokens the losses agree, and a solid line would hide the other.
        style = {"color": f"C{i}", "linestyle": "--" if i else "-", "marker": "o" if len(curve["loss"]) < 50 else None,
                 "markersize": 3}
        by_time.plot(curve["elapsed_s"], curve["loss"], label=label, **style)
        by_tokens.plot(curve["tokens"], curve["loss"], label=name, **style)
    budget = record["config"]["minutes"] * 60
    by_time.axvline(budget, color="grey", linestyle="--", linewidth=1, label=f"budget {budget:g} s")
    by_time.set(xlabel="training-loop wall clock (s)", ylabel="training loss", title="loss vs time")
    by_tokens.set(xlabel="tokens processed", ylabel="training loss", title="loss vs tokens")
    for ax in (by_time, by_tokens):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    c = record["config"]
    layers = f" ({c['layers']} layers)" if c["layers"] else ""
    fig.suptitle(f"{c['model']}{layers}, seq {c['seq_len']}, {c['effective_batch']} sequences/step, "
                 f"{c['minutes']:g} min each, {record['device']}", fontsize=10)
    return str(harness.save_figure(fig, path))


def print_table(record: dict) -> None:
    print("\n| contender | steps | tokens | tokens/s (budget) | tokens/s (median step) | first loss | final loss "
          "| min loss | peak HBM GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in record["contenders"].items():
        if r["status"] != "ok":
            print(f"| {name} | failed: {r.get('error', '')[:100]} |||||||")
            continue
        print(f"| {name} | {r['steps']} | {r['tokens']:,} | {r['tokens_per_s']:,.0f} | "
              f"{r['median_step_tokens_per_s']:,.0f} | {r['first_loss']:.4f} | {r['final_loss']:.4f} | "
              f"{r['min_loss']:.4f} | {r['peak_gpu_mem_allocated_gib']:.1f} |")
    if record["comparison"]:
        c = record["comparison"]
        print(f"\nspeedloader processed {c['tokens_ratio']:.2f}x the tokens of fsdp2-offload in the same "
              f"{record['config']['minutes']:g} min; step-1 losses differ by {c['first_step_loss_rel_diff']:.1e} "
              "(relative)")


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    import transformers

    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    runs_dir = out_dir / f"{args.name}_runs"
    config = {k: v for k, v in vars(args).items() if k != "out_dir"}
    config.update(effective_batch=args.sub_batch_size * args.num_sub_batches,
                  tokens_per_step=args.sub_batch_size * args.num_sub_batches * args.seq_len, data=data_figures(args))
    results: dict = {}
    header = harness.record_header("pretrain_time_budget", __file__, argv, device=harness.device_name(args.device))
    record = {**header, "name": args.name, "transformers": transformers.__version__, "timed": TIMED,
              "wandb_group": None if args.no_wandb else args.name, "config": config,
              "contenders": results, "comparison": None, "plot": None}
    for contender in args.contenders:
        run_dir = runs_dir / run_dir_name(contender)
        results[contender] = r = run_contender(args, contender, run_dir)
        r["run_dir"] = str(run_dir.relative_to(out_dir))  # wandb_runs are relative to it
        if r["status"] == "ok":
            r["epochs"] = r["tokens"] / (config["data"]["num_sequences"] * args.seq_len)
        print(f"[{contender}] {r['status']}: " + ", ".join(f"{k}={r[k]:.4g}" for k in (
            "steps", "tokens", "elapsed_s", "tokens_per_s", "final_loss") if isinstance(r.get(k), (int, float))),
              flush=True)
        # Written after every contender: a run cut short still leaves what finished.
        record["comparison"] = compare(results)
        png = plot(record, out_dir / f"{args.name}.png")
        record["plot"] = png and Path(png).name  # next to the record
        harness.write_record(out_dir / f"{args.name}.json", record)
    print_table(record)
    print(f"\nwrote {out_dir / f'{args.name}.json'}" + (f" and {out_dir / record['plot']}" if record["plot"] else ""))
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
