"""Metric logging on rank 0: a console line, ``metrics.jsonl`` and (optionally) Weights & Biases.

``build_logger`` gives every rank but 0 a no-op logger, so callers log unconditionally. The
trainer decides when to log (every ``log_every`` steps); the logger writes every record it is given.
W&B is imported only when ``logger.backend=wandb``: this module and the entry point are the only
places that import it.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import socket
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

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
    """Training: ``<model>-<schedule>-n<sub_batch_size>xN<num_sub_batches>``; generation:
    ``<model>-generate-N<num_sub_batches>``; anything else: the model's name."""
    model = run_config.get("model", {}).get("name", "model")
    schedule = run_config.get("schedule")
    if isinstance(schedule, dict) and "name" in schedule:
        if schedule["name"] == "auto":  # n and N are chosen by the tuner at run time
            return f"{model}-auto"
        return f"{model}-{schedule['name']}-n{schedule.get('sub_batch_size')}xN{schedule.get('num_sub_batches')}"
    if "max_new_tokens" in run_config:
        return f"{model}-generate-N{run_config.get('num_sub_batches')}"
    return model


WANDB_INIT_TIMEOUT_S = 30.0
"""How long ``wandb.init`` may take online before ``mode=auto`` falls back to offline (``online`` fails)."""
WANDB_PROBE_TIMEOUT_S = 3.0
"""``mode=auto`` with an API key: how long the W&B server may take to accept a connection before the run
logs offline instead."""


def wandb_server_reachable(timeout_s: float = WANDB_PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to W&B's server (``WANDB_BASE_URL`` or wandb's default) opens in time."""
    import wandb

    url = urlparse(os.environ.get("WANDB_BASE_URL") or wandb.Settings().base_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def resolve_wandb_mode(mode: str) -> str:
    """``auto``: online when ``WANDB_API_KEY`` is set and the server answers within a few seconds, else offline
    (sync later with ``wandb sync``): a run never waits on an unreachable server."""
    if mode != "auto":
        return mode
    if not os.environ.get("WANDB_API_KEY"):
        return "offline"
    if not wandb_server_reachable():
        log.warning("W&B: the server does not answer within %.0f s; logging offline (sync later with `wandb sync`)",
                    WANDB_PROBE_TIMEOUT_S)
        return "offline"
    return "online"


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
        init = functools.partial(wandb.init, project=cfg.project, entity=cfg.entity, group=cfg.group,
                                 name=cfg.name or default_run_name(run_config), tags=list(cfg.tags) or None,
                                 dir=str(output_dir), config=run_config)
        try:
            wandb_run = init(mode=mode, settings=wandb.Settings(init_timeout=WANDB_INIT_TIMEOUT_S))
        except wandb.errors.CommError as e:
            if cfg.mode != "auto":
                raise ValueError(f"logger.mode={cfg.mode}: W&B could not start a run ({str(e).splitlines()[0]}); "
                                 "check WANDB_API_KEY / WANDB_BASE_URL, or set logger.mode=offline") from None
            log.warning("W&B: online init failed (%s); logging offline", str(e).splitlines()[0])
            mode = "offline"
            wandb_run = init(mode=mode)
        log.info("W&B run %s (mode %s) in %s", wandb_run.name, mode, output_dir)
    return Rank0Logger(output_dir, wandb_run)
