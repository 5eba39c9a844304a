"""Training entry point (Hydra). The configs are the package ``fsdp_speedloader.conf`` (``conf/``).

One process (CPU, or one GPU)::

    python -m fsdp_speedloader.train experiment=tiny_cpu
    python -m fsdp_speedloader.train model=llama2_7b schedule=speedloader schedule.num_sub_batches=8 offload=params

One node, 8 GPUs::

    torchrun --standalone --nproc-per-node 8 -m fsdp_speedloader.train experiment=llama2_7b_offload

Two nodes of 8 GPUs (run on each node; HSDP: shard within a node, replicate across nodes;
``checkpoint.dir`` must be on a file system both nodes see)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500 \\
        --rdzv-id $JOB_ID -m fsdp_speedloader.train dp_replicate=2 checkpoint.dir=/shared/ckpt checkpoint.resume=auto

``fsdp-speedloader-train`` (the console script) is :func:`main`. Under torchrun every rank agrees
on ONE run directory: before Hydra composes the config, the process group is initialised and
rank 0's timestamp is broadcast into ``$FSDP_SPEEDLOADER_RUN_STAMP``, which ``hydra.run.dir`` /
``hydra.sweep.dir`` in ``conf/config.yaml`` read (falling back to Hydra's ``${now:...}`` when it is
unset). Only rank 0 writes Hydra's ``.hydra/`` files and logs; every other rank runs with
``hydra.output_subdir=null`` and Hydra's logging set up off (warnings still reach stderr).
Setting ``FSDP_SPEEDLOADER_RUN_STAMP`` yourself names the run directory.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from datetime import datetime
from pathlib import Path
from typing import Callable, NoReturn

import hydra
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from fsdp_speedloader import parallel
from fsdp_speedloader.config import TrainConfig

RUN_STAMP_ENV = "FSDP_SPEEDLOADER_RUN_STAMP"
"""Read by ``hydra.run.dir`` / ``hydra.sweep.dir`` in conf/config.yaml; set by :func:`main`."""

# Overrides for every rank but 0: no .hydra/ files, no log file (Hydra's job and own logging off).
_NON_ZERO_RANK_OVERRIDES = {"hydra.output_subdir": "null", "hydra/job_logging": "none",
                            "hydra/hydra_logging": "none"}


def _config_path() -> str:
    # Installed: the package fsdp_speedloader.conf. From a source checkout that is not installed,
    # the conf/ directory next to the package.
    if importlib.util.find_spec("fsdp_speedloader.conf") is not None:
        return "pkg://fsdp_speedloader.conf"
    return str(Path(__file__).resolve().parent.parent / "conf")


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def agree_on_run_stamp() -> str:
    """Sets ``$FSDP_SPEEDLOADER_RUN_STAMP`` to rank 0's time on every rank (unless already set)."""
    stamp = os.environ.get(RUN_STAMP_ENV)
    if stamp:
        return stamp
    stamp = datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
    if _world_size() > 1:
        # The group the trainer uses later (maybe_init_process_group is a no-op once initialised).
        parallel.maybe_init_process_group()
        box = [stamp]
        dist.broadcast_object_list(box, src=0)
        stamp = box[0]
    os.environ[RUN_STAMP_ENV] = stamp
    return stamp


def _rank_overrides(argv: list[str]) -> list[str]:
    """Hydra overrides this rank adds: none on rank 0, no files and no logging setup elsewhere."""
    if _rank() == 0:
        return []
    given = {a.split("=", 1)[0].lstrip("+~") for a in argv if "=" in a}
    return [f"{k}={v}" for k, v in _NON_ZERO_RANK_OVERRIDES.items() if k not in given]


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """The Hydra config, resolved once into the typed config (``output_dir`` is Hydra's run directory)."""
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    container["output_dir"] = HydraConfig.get().runtime.output_dir
    return TrainConfig.from_dict(container)


def maybe_export_submitit_env() -> bool:
    """Inside a SLURM job of hydra-submitit-launcher (one task per GPU, no torchrun), sets torch's
    ``env://`` variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) from SLURM's, through
    submitit's own helper. A no-op under torchrun and for plain ``python``. True when it exported.
    """
    if "RANK" in os.environ or not os.environ.get("SUBMITIT_EXECUTOR"):
        return False
    from submitit.helpers import TorchDistributedEnvironment  # installed with hydra-submitit-launcher

    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    return True


@hydra.main(config_path=_config_path(), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    from fsdp_speedloader.trainer import Trainer  # after Hydra parsed the command line (--help stays fast)

    under_submitit = maybe_export_submitit_env()  # before anything reads RANK
    if _rank() != 0:
        logging.getLogger().setLevel(logging.WARNING)
    try:
        trainer = Trainer(to_train_config(cfg))
    except ValueError as e:  # a user error found during setup: one line, no traceback
        fail(e)
    trainer.train()
    if under_submitit:  # main() (which tears the group down) runs on the submitting host, not here
        parallel.destroy_process_group()


def fail(error: ValueError) -> NoReturn:
    """A user error: one line on stderr, no traceback, exit code 2."""
    print(f"error: {error}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()  # no barrier: other ranks may have failed differently
    sys.exit(2)


def launch(hydra_main: Callable[[], None]) -> None:
    """Runs a Hydra entry point (train, tune, generate) under torchrun or plain python.

    Ranks first agree on rank 0's run stamp (one run directory); non-zero ranks get the overrides
    that keep them from writing Hydra's files and logs.
    """
    # Expandable segments unless the user chose: layer-major steps allocate sub-batch-sized blocks
    # whose sizes change between the forward, the head and the backward, and the default allocator's
    # fragmentation ran full LLaMA-2-7B out of memory with 9 GiB reserved but unallocated (H200).
    # torchtitan's launcher sets the same. Before anything touches CUDA.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    try:
        agree_on_run_stamp()
    except ValueError as e:
        fail(e)
    sys.argv.extend(_rank_overrides(sys.argv[1:]))
    hydra_main()
    parallel.destroy_process_group()  # barrier first: no rank leaves while another still checkpoints


def main() -> None:
    """Console script: ``fsdp-speedloader-train [overrides]``; also ``python -m fsdp_speedloader.train``."""
    launch(_hydra_main)


if __name__ == "__main__":
    main()
