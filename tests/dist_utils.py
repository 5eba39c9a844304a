"""Running a test function on several gloo ranks (spawned processes) on the CPU.

    from dist_utils import run_distributed

    def _check(rank, world_size, value):   # module level: it is pickled into the children
        ...
        return something_picklable

    results = run_distributed(_check, 2, 42)   # [rank 0's return, rank 1's return]

Each child initialises a gloo process group on a free local port (the torchrun environment
variables RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT are set too, so library code that calls
``maybe_init_process_group`` finds the group), runs ``fn(rank, world_size, *args)``, then meets
the others at a barrier and destroys the group. An exception in any rank fails the call with that
rank's traceback (the other ranks are terminated); a hang ends at the collective timeout.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn: Callable, world_size: int, port: int, timeout_s: float, result_dir: str,
            args: tuple, backend: str = "gloo") -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    faulthandler.enable(all_threads=True)  # a native abort in a rank prints every thread's Python stack
    torch.set_num_threads(1)  # world_size processes share the CI machine's cores
    if "nccl" in backend:
        torch.cuda.set_device(rank)  # one GPU per rank
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    result = fn(rank, world_size, *args)  # an exception skips the barrier: spawn reports it and kills the rest
    torch.save(result, Path(result_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: in CI both ranks of a finished run have aborted there
    # ("terminate called without an active exception", a native thread still joinable at exit, no Python frame
    # left), after the result was saved and the group destroyed. Nothing of the test runs after this point.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
                    backend: str = "gloo") -> list:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` ranks (gloo; or e.g. ``cpu:gloo,cuda:nccl``, one GPU
    per rank); returns each rank's return value."""
    with tempfile.TemporaryDirectory() as result_dir:
        mp.spawn(_worker, args=(fn, world_size, free_port(), timeout_s, result_dir, args, backend),
                 nprocs=world_size, join=True)
        return [torch.load(Path(result_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


# ---------------------------------------------------------------------------------------------
# A tiny training configuration (shared by the trainer, checkpoint and engine tests)
# ---------------------------------------------------------------------------------------------

TINY = {
    "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128},
    "data": {"seq_len": 32},
    "schedule": {"sub_batch_size": 2, "num_sub_batches": 2},
    "optim": {"lr": 1e-2, "warmup_steps": 2},
    "logger": {"backend": "none"},
    "checkpoint": {"save_final": False},
    "device": "cpu",
    "steps": 4,
}


def _merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for k, v in override.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def tiny_config(output_dir: str | os.PathLike, **overrides: Any):
    """A ``TrainConfig`` of a 2-layer, width-64 LLaMA on the default corpus, seq_len 32, console-less.

    Keyword overrides are merged section by section: ``tiny_config(d, schedule={"name": "canonical"})``.
    """
    from fsdp_speedloader.app.config import TrainConfig

    return TrainConfig.from_dict(_merge(TINY, {"output_dir": str(output_dir), **overrides}))
