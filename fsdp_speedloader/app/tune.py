"""``python -m fsdp_speedloader.app.tune``: plan sub_batch_size x num_sub_batches for a training run.

Takes the training run's own overrides (``conf/tune.yaml`` is ``config.yaml`` with ``schedule.name``
forced to ``auto``), runs the tuner's two trial steps (``fsdp_speedloader/tuning/tuner.py``) and prints the
plan, the fitted memory models and the overrides that run it; nothing is trained. The plan goes to
``<run dir>/tune_plan.json`` and to W&B (``logger=none`` turns W&B off)::

    python -m fsdp_speedloader.app.tune experiment=tiny_cpu logger=none
    python -m fsdp_speedloader.app.tune experiment=llama2_7b_offload schedule.gpu_memory_budget_gib=40
    python -m fsdp_speedloader.app.tune experiment=llama2_7b_offload schedule.tune_blocks_per_unit=[1,2]
    torchrun --standalone --nproc-per-node 8 -m fsdp_speedloader.app.tune experiment=llama2_13b_offload

``schedule=auto`` in ``python -m fsdp_speedloader.app.train`` does the same and then trains with the plan.
The library function is ``fsdp_speedloader.tune`` (``tuning/tuner.py``); this module is the CLI.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from fsdp_speedloader import parallel
from fsdp_speedloader.app.config import TrainConfig
from fsdp_speedloader.app.launch import config_path, fail, launch
from fsdp_speedloader.app.launch import rank as launch_rank
from fsdp_speedloader.app.logger import build_logger, check_wandb_credentials
from fsdp_speedloader.app.planning import tune_train_config
from fsdp_speedloader.app.runtime import DTYPES, maybe_cap_gpu_memory, resolve_device_type, resolve_param_dtype, \
    seed_everything
from fsdp_speedloader.tuning.plan import TunePlan

log = logging.getLogger("fsdp_speedloader.app.tune")

PLAN_FILE = "tune_plan.json"


def _commit() -> str:
    repo = Path(__file__).resolve().parents[1]
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=repo).stdout.strip()


def run(cfg: TrainConfig, *, run_config: Optional[dict] = None) -> TunePlan:
    """Tunes ``cfg`` (its schedule is planned whatever its name) on this process group; rank 0 reports."""
    if launch_rank() == 0:  # the first line, within seconds; a missing W&B key fails before any trial model
        log.info("setting up: tuning n and N for model %s from two trial steps, run directory %s", cfg.model.name,
                 cfg.output_dir)
        check_wandb_credentials(cfg.logger)
    device_type = resolve_device_type(cfg.device)
    parallel.maybe_init_process_group(device_type)
    rank = dist.get_rank()
    device = parallel.compute_device(device_type)
    seed_everything(cfg.seed)
    maybe_cap_gpu_memory(cfg.max_gpu_memory_gib, device)
    mesh = parallel.build_mesh(device_type, cfg.dp_replicate)
    plan = tune_train_config(cfg, mesh=mesh, param_dtype=resolve_param_dtype(cfg.param_dtype, device_type),
                             reduce_dtype=DTYPES[cfg.reduce_dtype])
    record = {"plan": plan.as_dict(), "overrides": plan.overrides(), "world_size": dist.get_world_size(),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "commit": _commit(), "command": " ".join(sys.argv),
              "config": run_config if run_config is not None else dataclasses.asdict(cfg)}
    if rank == 0:
        log.info("tuned in %.1f s\n%s", plan.trial_s, plan.summary())
        out = Path(cfg.output_dir) / PLAN_FILE
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2))
        log.info("plan written to %s", out)
    logger_cfg = cfg.logger if cfg.logger.name else dataclasses.replace(cfg.logger, name=f"{cfg.model.name}-tune")
    logger = build_logger(logger_cfg, {**record["config"], "tune_plan": record["plan"]}, cfg.output_dir, rank)
    logger.log(plan.as_metrics(), step=0)
    logger.finish()
    return plan


def main() -> None:
    """Hydra entry: ``python -m fsdp_speedloader.app.tune [overrides]`` (conf/tune.yaml)."""
    import hydra
    from omegaconf import DictConfig

    from fsdp_speedloader.app.train import to_train_config

    @hydra.main(config_path=config_path(), config_name="tune", version_base="1.3")
    def _hydra_main(dcfg: DictConfig) -> None:
        if int(os.environ.get("RANK", "0")) != 0:
            logging.getLogger().setLevel(logging.WARNING)
        try:
            cfg = to_train_config(dcfg)
            run(cfg, run_config=dataclasses.asdict(cfg))
        except ValueError as e:  # a user error (a budget too small, a bad value): one line, no traceback
            fail(e)

    launch(_hydra_main, config_name="tune")


if __name__ == "__main__":
    main()
