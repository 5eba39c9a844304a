"""A full training run's throughput and its host memory: the trainer itself, any config, host PEAK resident set.

Runs ``fsdp_speedloader.app.trainer.Trainer`` on the config that the Hydra overrides compose (as ``python -m
fsdp_speedloader.app.train OVERRIDES`` would) in one worker process, for ``steps`` steps, and records:

  tokens/s and MFU      medians over the steps after ``--warmup-steps`` (the trainer's own step metrics: data,
                        forward, backward and the optimizer step, as a run sees them)
  trainer_build_s       seconds from the config to a trainer ready for step 1 (build, initialisation, optimizer)
  host_peak_rss_gib     the worker's peak resident set (VmHWM: every allocation of the run, model build included)
  host_plan             the plan by tier the trainer checked before step 1 (app/host_memory.py), bytes per parameter
  arena                 the pinned arena's bytes by slot kind after the last step
  peak_gpu_*            the CUDA allocator's peaks (the last step's; the trainer resets them every step)

Usage (one GPU; each run is one worker; ``--timeout`` bounds it):
  python tools/bench_host_memory.py --name train_llama2_13b_full_bf16_states -- experiment=llama2_13b_offload \\
      schedule.sub_batch_size=3 schedule.num_sub_batches=8 schedule.activation_store=device \\
      schedule.compile_blocks=true optim.overlap_with_backward=true optim.grad_clip=0 optim.state_dtype=bf16 steps=3
  python tools/bench_host_memory.py --device-check -- model=llama_tiny device=cpu offload=params steps=2   # CPU: the code path

Writes bench/results/<name>.json (tools/harness.py's header: device, torch, commit, command) and prints one line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package: its modules import by name
import harness  # noqa: E402

REPO = harness.REPO


def compose_train_config(overrides: list[str], output_dir: str):
    """The validated ``TrainConfig`` of ``python -m fsdp_speedloader.app.train OVERRIDES``."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from fsdp_speedloader.app.config import TrainConfig

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, f"output_dir={output_dir}"])
    return TrainConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))


def run_worker(args: argparse.Namespace) -> dict:
    import dataclasses
    import logging

    import torch

    from fsdp_speedloader.app.host_memory import host_memory_plan
    from fsdp_speedloader.app.trainer import Trainer
    from fsdp_speedloader.engine.speedloader import speedloader_engine
    from fsdp_speedloader.fsdp2 import fast_path_stats
    from fsdp_speedloader.parallel import shard_size

    # Timestamped set-up and per-step lines: a run cut by --timeout still shows (in the record's output_tail)
    # where its time went (the model build, compilation or the steps).
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out_dir = tempfile.mkdtemp(prefix="fsl_host_memory_")
    cfg = compose_train_config([*args.overrides, "logger=none", "log_every=1", "checkpoint.save_final=false",
                                "checkpoint.every_minutes=0"], out_dir)
    build_start = time.perf_counter()
    trainer = Trainer(cfg)
    build_s = time.perf_counter() - build_start  # model build, initialisation, optimizer: before step 1
    shards = shard_size(trainer.mesh)
    plan = None
    if cfg.offload.params and speedloader_engine(trainer.model, missing_ok=True) is not None:
        plan, _ = host_memory_plan(trainer.model, cfg, shards=shards,
                                   activation_itemsize=2 if trainer.device.type == "cuda" else 4)
    history = trainer.train()
    timed = history[args.warmup_steps:] or history
    engine = speedloader_engine(trainer.model, missing_ok=True)
    result = {
        "config": dataclasses.asdict(cfg), "num_params": trainer.num_params, "steps": len(history),
        "trainer_build_s": build_s,
        "tokens_per_step": history[-1]["tokens"] // len(history),
        "tokens_per_s": statistics.median(m["tokens_per_s"] for m in timed),
        "mfu": statistics.median(m["mfu"] for m in timed),
        "step_time_s": statistics.median(m["step_time_s"] for m in timed),
        "step_times_s": [m["step_time_s"] for m in history], "losses": [m["loss"] for m in history],
        "host_peak_rss_gib": harness.host_peak_rss_gib(),
        "host_rss_gib_per_step": [m["host_rss_gib"] for m in history],
        "peak_gpu_mem_allocated_gib": max((m.get("peak_gpu_mem_allocated_gib", 0.0) for m in history), default=0.0),
        "peak_gpu_mem_reserved_gib": max((m.get("peak_gpu_mem_reserved_gib", 0.0) for m in history), default=0.0),
        "arena": engine.store.step_stats() if engine is not None else {},
        "fast_paths": fast_path_stats(),
        "gpu_name": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    if plan is not None:
        result["host_plan"] = {"bytes": plan.by_tier(), "total_gib": plan.total / 2**30,
                               "bytes_per_param": plan.bytes_per_param(), "num_params_on_host": plan.num_params}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the training run (after --)")
    parser.add_argument("--warmup-steps", type=int, default=1, help="steps left out of the medians")
    parser.add_argument("--name", default="host_memory_run")
    parser.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    parser.add_argument("--timeout", type=float, default=570)
    parser.add_argument("--device-check", action="store_true", help="CPU: record under device 'cpu' (a code check)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        harness.print_result(run_worker(args))
        return
    record = {**harness.record_header("host_memory", __file__, device=harness.cpu_name() if args.device_check
                                      else None), "overrides": args.overrides}
    outcome = harness.launch_worker(harness.worker_command(__file__, "run", sys.argv[1:]), timeout=args.timeout)
    record["result"] = outcome.row()
    path = harness.write_record(Path(args.out_dir, f"{args.name}.json"), record)
    r = record["result"]
    if r["status"] == "ok":
        print(f"{r['num_params'] / 1e9:.2f}B parameters: {r['tokens_per_s']:.0f} tokens/s, MFU {100 * r['mfu']:.1f}%, "
              f"host peak RSS {r['host_peak_rss_gib']:.1f} GiB, GPU peak {r['peak_gpu_mem_allocated_gib']:.1f} GiB "
              f"allocated / {r['peak_gpu_mem_reserved_gib']:.1f} reserved; plan "
              f"{r.get('host_plan', {}).get('total_gib', 0):.1f} GiB; wrote {path}")
    else:
        print(f"{r['status']}: {r.get('error')}; wrote {path}")
        sys.exit(1)


if __name__ == "__main__":
    main()
