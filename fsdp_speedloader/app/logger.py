"""Metric logging on rank 0: a console line, ``metrics.jsonl`` and (optionally) Weights & Biases.

``build_logger`` gives every rank but 0 a no-op logger, so callers log unconditionally. The
trainer decides when to log (every ``log_every`` steps); the logger writes every record it is given.
W&B is imported only when ``logger.backend=wandb``: this module and the entry point are the only
places that import it.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Optional

from fsdp_speedloader.app.config import LoggerConfig

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


class MetricLogger:
    """The interface: ``log(metrics, step)`` and ``finish()``. This base class does nothing."""

    def log(self, metrics: dict, step: int) -> None:
        pass

    def finish(self) -> None:
        pass


def _json_value(value: Any) -> Any:
    # json.dumps writes NaN/Infinity, which strict JSON readers reject.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def format_metrics(metrics: dict, step: int) -> str:
    """One console line with the figures a person watches."""
    parts = [f"step {step}"]
    fmt = {"loss": "loss {:.4f}", "lr": "lr {:.2e}", "grad_norm": "grad_norm {:.3f}",
           "tokens_per_s": "{:,.0f} tok/s", "mfu": "mfu {:.1%}", "step_time_s": "{:.3f} s/step",
           "data_wait_s": "data {:.3f} s"}
    for key, spec in fmt.items():
        value = metrics.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            parts.append(spec.format(value))
    if "peak_gpu_mem_allocated_gib" in metrics:
        parts.append(f"gpu {metrics['peak_gpu_mem_allocated_gib']:.2f}/"
                     f"{metrics.get('peak_gpu_mem_reserved_gib', 0.0):.2f} GiB")
    if "host_rss_gib" in metrics:
        parts.append(f"rss {metrics['host_rss_gib']:.2f} GiB")
    return " | ".join(parts)


class Rank0Logger(MetricLogger):
    """Console line + ``<output_dir>/metrics.jsonl`` + an optional W&B run."""

    def __init__(self, output_dir: str | os.PathLike, wandb_run: Any = None) -> None:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(output_dir) / METRICS_FILE
        self._file = open(self.path, "a", buffering=1)  # line-buffered: readable while the run goes on
        self.wandb_run = wandb_run

    def log(self, metrics: dict, step: int) -> None:
        log.info(format_metrics(metrics, step))
        record = {"step": step, **{k: _json_value(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)

    def finish(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def default_run_name(run_config: dict) -> str:
    """``<model.name>-<schedule.name>-n<sub_batch_size>xN<num_sub_batches>``."""
    model, schedule = run_config.get("model", {}), run_config.get("schedule", {})
    return (f"{model.get('name', 'model')}-{schedule.get('name', 'schedule')}"
            f"-n{schedule.get('sub_batch_size', '?')}xN{schedule.get('num_sub_batches', '?')}")


def resolve_wandb_mode(mode: str) -> str:
    """``auto``: online when ``WANDB_API_KEY`` is set, else offline (sync later with ``wandb sync``)."""
    if mode == "auto":
        return "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return mode


def build_logger(cfg: LoggerConfig, run_config: dict, output_dir: str | os.PathLike,
                 rank: int) -> MetricLogger:
    """The metric logger of this rank: rank 0 logs, every other rank gets a no-op logger.

    ``run_config`` (the full resolved config) goes to ``wandb.init(config=...)``.
    """
    if rank != 0:
        return MetricLogger()
    wandb_run: Optional[Any] = None
    if cfg.backend == "wandb":
        import wandb  # only runs that log to W&B pay for the import

        mode = resolve_wandb_mode(cfg.mode)
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        wandb_run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name or default_run_name(run_config),
                               group=cfg.group, tags=list(cfg.tags) or None, mode=mode, dir=str(output_dir),
                               config=run_config)
        log.info("W&B run %s (mode %s) in %s", wandb_run.name, mode, output_dir)
    return Rank0Logger(output_dir, wandb_run)
