"""Shared pieces of the tests that launch the real entry points in subprocesses (torchrun, sweeps).

The runs are CPU-only (``CUDA_VISIBLE_DEVICES=""``, also on a GPU machine), offline (W&B offline,
no Hugging Face hub), single-threaded per process, and start in a temporary directory.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"

# A 2-layer, width-64 LLaMA on the embedded corpus, 32-token sequences: a step takes milliseconds.
TINY_OVERRIDES = ["device=cpu", "log_every=1", "model=llama_tiny", "model.hidden_size=64", "model.num_layers=2",
                  "model.num_heads=4", "model.intermediate_size=128", "data=default", "data.seq_len=32",
                  "schedule.sub_batch_size=2", "schedule.num_sub_batches=2", "logger=none"]

_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "FSDP_SPEEDLOADER_RUN_STAMP",
             "FSDP_SPEEDLOADER_INJECT_FAULT", "WANDB_API_KEY", "WANDB_RUN_ID", "SUBMITIT_EXECUTOR")


def clean_env(tmp_path: Path, **extra: str) -> dict:
    """This process's environment minus anything distributed (an in-process test group sets some)."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               WANDB_SILENT="true", WANDB_MODE="offline", WANDB_DIR=str(tmp_path / "wandb_dir"),
               WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"), WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"),
               HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.update(extra)
    return env


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def tail(text: str, n: int = 4000) -> str:
    return text[-n:]
