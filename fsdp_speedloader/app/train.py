"""Training entry point (Hydra). The configs are the package ``fsdp_speedloader.conf`` (``conf/``).

One process (CPU, or one GPU)::

    python -m fsdp_speedloader.app.train experiment=tiny_cpu
    python -m fsdp_speedloader.app.train model=llama2_7b schedule=speedloader schedule.num_sub_batches=8 offload=params

One node, 8 GPUs::

    torchrun --standalone --nproc-per-node 8 -m fsdp_speedloader.app.train experiment=llama2_7b_offload

Two nodes of 8 GPUs (run on each node; HSDP: shard within a node, replicate across nodes;
``checkpoint.dir`` must be on a file system both nodes see)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500 \\
        --rdzv-id $JOB_ID -m fsdp_speedloader.app.train dp_replicate=2 checkpoint.dir=/nfs/ckpt checkpoint.resume=auto

``fsdp-speedloader-train`` (the console script) is :func:`main`; ``app/launch.py`` says how ranks agree on
one run directory.
"""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig

from fsdp_speedloader import parallel
from fsdp_speedloader.app.config import TrainConfig
from fsdp_speedloader.app.launch import UserError, config_path, fail, launch, maybe_export_submitit_env, rank, \
    resolved_config

def to_train_config(cfg: DictConfig) -> TrainConfig:
    """The Hydra config, resolved once into the typed config (``output_dir`` is Hydra's run directory)."""
    return TrainConfig.from_dict(resolved_config(cfg))


@hydra.main(config_path=config_path(), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    from fsdp_speedloader.app.trainer import Trainer  # after Hydra parsed the command line (--help stays fast)

    under_submitit = maybe_export_submitit_env()  # before anything reads RANK
    if rank() != 0:
        logging.getLogger().setLevel(logging.WARNING)
    try:
        trainer = Trainer(to_train_config(cfg))
    except ValueError as e:  # a user error found during setup: one line, no traceback
        fail(e)
    try:
        trainer.train()
    except UserError as e:  # a memory budget that the first step showed to be wrong: one line as well
        fail(e)
    if under_submitit:  # main() (which tears the group down) runs on the submitting host, not here
        parallel.destroy_process_group()


def main() -> None:
    """Console script: ``fsdp-speedloader-train [overrides]``; also ``python -m fsdp_speedloader.app.train``."""
    launch(_hydra_main, config_name="config")


if __name__ == "__main__":
    main()
