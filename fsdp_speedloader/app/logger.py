"""Metric logging on rank 0: a console line, ``metrics.jsonl`` and (optionally) Weights & Biases.

``build_logger`` gives every rank but 0 a no-op logger, so callers log unconditionally. The
trainer decides when to log (every ``log_every`` steps); the logger writes every record it is given.
W&B is imported only when ``logger.backend=wandb``: this module and the entry point are the only
places that import it.

On a terminal, rank 0 also shows a progress bar (:class:`StepProgress`, tqdm) over the training steps, the points
of a sweep (``app/sweep.py``) or the decoding steps of a generation (``app/generate.py``); the per-step lines go on
to the log and ``metrics.jsonl``, written above the bar.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import math
import netrc
import os
import socket
import sys
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

from fsdp_speedloader.app.config import LoggerConfig

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PEAK_RELATIVE_METRICS = ("mfu", "mfu_no_attention", "hfu")
"""Fractions of ``peak_tflops`` (an accelerator's): left out of the console and W&B on a CPU."""


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


def format_metrics(metrics: dict, step: int, *, show_mfu: bool = True) -> str:
    """One console line with the figures a person watches. ``show_mfu``: False where MFU means nothing (a CPU
    run: ``peak_tflops`` is an accelerator's); GPU memory appears only when the record has it (CUDA)."""
    parts = [f"step {step}"]
    fmt = {"loss": "loss {:.4f}", "lr": "lr {:.2e}", "grad_norm": "grad_norm {:.3f}",
           "tokens_per_s": "{:,.0f} tok/s", "mfu": "mfu {:.1%}", "step_time_s": "{:.3f} s/step",
           "data_wait_s": "data {:.3f} s", "tokens": "{:,} tokens", "epoch": "epoch {:.3f}",
           "val_loss": "val_loss {:.4f}", "val_ppl": "val_ppl {:.2f}", "checkpoint_stall_s": "checkpoint stall {:.3f} s"}
    if not show_mfu:
        del fmt["mfu"]
    for key, spec in fmt.items():
        value = metrics.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            parts.append(spec.format(value))
    if "peak_gpu_mem_allocated_gib" in metrics:
        parts.append(f"gpu {metrics['peak_gpu_mem_allocated_gib']:.2f}/"
                     f"{metrics.get('peak_gpu_mem_reserved_gib', 0.0):.2f} GiB")
        if metrics.get("gpu_alloc_retries"):
            parts.append(f"{metrics['gpu_alloc_retries']} allocator retries")
    if "host_rss_gib" in metrics:
        parts.append(f"rss {metrics['host_rss_gib']:.2f} GiB")
    return " | ".join(parts)


class Rank0Logger(MetricLogger):
    """Console line + ``<output_dir>/metrics.jsonl`` + an optional W&B run. ``show_mfu=False`` (a CPU run) leaves
    MFU (:data:`PEAK_RELATIVE_METRICS`) out of the console line and the W&B run (``metrics.jsonl`` keeps every
    figure)."""

    def __init__(self, output_dir: str | os.PathLike, wandb_run: Any = None, *, show_mfu: bool = True,
                 fresh: bool = False) -> None:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(output_dir) / METRICS_FILE
        if fresh and self.path.is_file() and self.path.stat().st_size:  # an earlier run's records: kept, apart
            earlier = next(p for k in itertools.count(1) if not (p := self.path.with_suffix(f".{k}.jsonl")).exists())
            self.path.rename(earlier)
            log.warning("%s held an earlier run's records (this directory was used before); moved to %s, so that "
                        "this run's steps are not mixed with them", self.path, earlier.name)
        # appended to on resume; line-buffered: readable while the run goes on
        self._file = open(self.path, "a", buffering=1)
        self.wandb_run = wandb_run
        self.show_mfu = show_mfu

    def log(self, metrics: dict, step: int) -> None:
        line = format_metrics(metrics, step, show_mfu=self.show_mfu)
        if line != f"step {step}":  # a record with no console figure (the tuner's plan) is not a bare "step 0" line
            log.info(line)
        record = {"step": step, **{k: _json_value(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(metrics if self.show_mfu else
                               {k: v for k, v in metrics.items() if k not in PEAK_RELATIVE_METRICS}, step=step)

    @property
    def wandb_run_id(self) -> Optional[str]:
        """The W&B run's id (None without one): saved in every checkpoint, so a resumed job logs on into this run."""
        return self.wandb_run.id if self.wandb_run is not None else None

    def finish(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def default_run_name(run_config: dict) -> str:
    """Training: ``<model>-<schedule>-n<sub_batch_size>xN<num_sub_batches>``; generation:
    ``<model>-generate-N<num_sub_batches>``; anything else: the model's name (a model.path run's: its directory's
    name, not the model group's default name, which it does not use)."""
    model_cfg = run_config.get("model", {})
    path = model_cfg.get("path")
    model = Path(str(path).rstrip("/")).name if path else model_cfg.get("name", "model")
    schedule = run_config.get("schedule")
    if isinstance(schedule, dict) and "name" in schedule:
        if schedule["name"] == "auto":  # n and N are chosen by the tuner at run time
            return f"{model}-auto"
        return f"{model}-{schedule['name']}-n{schedule.get('sub_batch_size')}xN{schedule.get('num_sub_batches')}"
    if "max_new_tokens" in run_config:
        return f"{model}-generate-N{run_config.get('num_sub_batches')}"
    return model


def logged_model(model: Any, hf_config: Any) -> dict:
    """The ``model`` section of a run's logged config (W&B): a fresh model's shapes; with ``model.path``, the
    checkpoint's own config.json (``hf_config.to_diff_dict()``) beside its path, name and attention kernel, not the
    model group's shapes, which such a run does not use."""
    section = dataclasses.asdict(model)
    if not model.path:
        return section
    return {**{k: section[k] for k in ("name", "path", "attn_implementation")}, "config_json": hf_config.to_diff_dict()}


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


def _wandb_host() -> str:
    return urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc


def wandb_credentials_found() -> bool:
    """Whether W&B would find an API key without asking: ``WANDB_API_KEY`` (or ``WANDB_IDENTITY_TOKEN_FILE``), or a
    login for the W&B host in the netrc file (``$NETRC``, else ``~/.netrc``) that ``wandb login`` writes."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        entry = netrc.netrc(path).authenticators(_wandb_host())
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


WANDB_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")  # wandb.Settings.mode's values


def check_wandb_credentials(cfg: LoggerConfig) -> None:
    """``logger.mode=online`` needs an API key: ValueError before anything is built when W&B has none (it would
    otherwise prompt for one, or fail, once the model is built); so does a ``WANDB_MODE`` W&B does not take."""
    env = os.environ.get("WANDB_MODE", "").strip()
    if cfg.backend == "wandb" and env and env.lower() not in WANDB_MODES:  # W&B refuses it only inside wandb.init
        raise ValueError(f"WANDB_MODE={env}: W&B takes {', '.join(WANDB_MODES)}; unset WANDB_MODE or set one of "
                         "them (logger.mode=auto follows it)")
    if cfg.backend == "wandb" and cfg.mode == "online" and not wandb_credentials_found():
        raise ValueError(f"logger.mode=online: no W&B API key (WANDB_API_KEY is not set and no netrc login for "
                         f"{_wandb_host()}); set WANDB_API_KEY (or run `wandb login`), or use logger.mode=offline "
                         "or logger.mode=auto")


def resolve_wandb_mode(mode: str) -> tuple[str, str]:
    """(the W&B mode of a run, why). ``auto``: ``WANDB_MODE`` where it is set (W&B's own switch; ``online`` without
    an API key logs offline), else online when ``WANDB_API_KEY`` is set and the server answers within a few
    seconds, else offline (sync later with ``wandb sync``): a run never waits on an unreachable server."""
    if mode != "auto":
        return mode, f"logger.mode={mode}"
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if env in ("offline", "disabled") or env == "online" and wandb_credentials_found():
        return env, f"WANDB_MODE={env}"
    if env == "online":
        log.warning("W&B: WANDB_MODE=online but no W&B API key (WANDB_API_KEY is not set and no netrc login for "
                    "%s); logging offline", _wandb_host())
        return "offline", "WANDB_MODE=online without an API key"
    if not os.environ.get("WANDB_API_KEY"):
        return "offline", "no WANDB_API_KEY"
    if not wandb_server_reachable():
        log.warning("W&B: the server does not answer within %.0f s; logging offline (sync later with `wandb sync`)",
                    WANDB_PROBE_TIMEOUT_S)
        return "offline", "the W&B server did not answer"
    return "online", "WANDB_API_KEY"


def build_logger(cfg: LoggerConfig, run_config: dict, output_dir: str | os.PathLike,
                 rank: int, *, show_mfu: bool = True, wandb_run_id: Optional[str] = None,
                 fresh: bool = False) -> MetricLogger:
    """The metric logger of this rank: rank 0 logs, every other rank gets a no-op logger.

    ``run_config`` (the full resolved config) goes to ``wandb.init(config=...)``. ``show_mfu``: MFU in the
    console line and the W&B run (False on a CPU, whose MFU against an accelerator's peak means nothing;
    ``metrics.jsonl`` keeps it). ``wandb_run_id``: the W&B run to log on into (a resumed job's, from its checkpoint:
    ``wandb.init(id=..., resume="allow")``); None starts a new run. W&B prints its start lines but not its run
    summary (``quiet``): the console's own lines already show the figures. ``fresh``: a run that starts at step 0
    (not resumed) moves an earlier run's ``metrics.jsonl`` in the same directory aside instead of appending to it.
    """
    if rank != 0:
        return MetricLogger()
    wandb_run: Optional[Any] = None
    if cfg.backend == "wandb":
        import wandb  # only runs that log to W&B pay for the import

        mode, why = resolve_wandb_mode(cfg.mode)
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        init = functools.partial(wandb.init, project=cfg.project, entity=cfg.entity, group=cfg.group,
                                 name=cfg.name or default_run_name(run_config), tags=list(cfg.tags) or None,
                                 dir=str(output_dir), config=run_config, id=wandb_run_id,
                                 resume="allow" if wandb_run_id else None)
        try:
            wandb_run = init(mode=mode, settings=wandb.Settings(init_timeout=WANDB_INIT_TIMEOUT_S, quiet=True))
        except wandb.errors.CommError as e:
            if cfg.mode != "auto":
                raise ValueError(f"logger.mode={cfg.mode}: W&B could not start a run ({str(e).splitlines()[0]}); "
                                 "check WANDB_API_KEY / WANDB_BASE_URL, or set logger.mode=offline") from None
            log.warning("W&B: online init failed (%s); logging offline", str(e).splitlines()[0])
            mode, why = "offline", "online init failed"
            wandb_run = init(mode=mode, settings=wandb.Settings(quiet=True))
        # offline: the run's directory (wandb/offline-run-...) is what `wandb sync` uploads later
        sync = f"; `wandb sync {Path(wandb_run.dir).parent}` uploads it" if mode == "offline" else ""
        log.info("W&B run %s (id %s%s, mode %s: %s%s) in %s", wandb_run.name, wandb_run.id,
                 ", resumed" if wandb_run_id else "", mode, why, sync, output_dir)
    return Rank0Logger(output_dir, wandb_run, show_mfu=show_mfu, fresh=fresh)


# ---------------------------------------------------------------------------------------------
# Progress bar
# ---------------------------------------------------------------------------------------------

PROGRESS_ENV = "FSDP_SPEEDLOADER_PROGRESS"
"""``1``: show the progress bar even when stderr is not a terminal; ``0``: never show it."""


def progress_bar_enabled(rank: int) -> bool:
    """Rank 0 only; when stderr is a terminal (CI logs and redirected runs stay clean), unless
    ``FSDP_SPEEDLOADER_PROGRESS`` says otherwise."""
    value = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if value not in ("", "0", "1", "true", "false", "yes", "no", "on", "off"):
        raise ValueError(f"{PROGRESS_ENV}={value!r}; use 1 (always show the progress bar), 0 (never) or unset it "
                         "(on a terminal only)")
    if rank != 0 or value in ("0", "false", "no", "off"):
        return False
    return bool(value) or sys.stderr.isatty()


def _has_console_handler(logger: logging.Logger) -> bool:
    return any(type(h) is logging.StreamHandler and h.stream in (sys.stdout, sys.stderr) for h in logger.handlers)


class StepProgress:
    """A tqdm bar over ``total`` steps (training steps by default; ``desc`` and ``unit`` name others: sweep points,
    decoding steps) on stderr, when ``enabled``; otherwise it does nothing. While it shows, console log lines are
    written above it (``tqdm.contrib.logging.logging_redirect_tqdm``) and :meth:`write` prints above it too; the log
    file and ``metrics.jsonl`` are untouched."""

    def __init__(self, *, total: int, initial: int = 0, enabled: bool, desc: str = "train",
                 unit: str = "step") -> None:
        self._bar = None
        self._stack = contextlib.ExitStack()
        if not enabled:
            return
        from tqdm import tqdm  # a dependency of transformers, declared in pyproject.toml
        from tqdm.contrib.logging import logging_redirect_tqdm

        if _has_console_handler(logging.getLogger()):
            self._stack.enter_context(logging_redirect_tqdm())
        self._bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, file=sys.stderr)

    @property
    def enabled(self) -> bool:
        return self._bar is not None

    def update(self, step: int, metrics: Optional[dict] = None, **postfix: str) -> None:
        """The bar at ``step`` done; beside it the loss and tokens/s of ``metrics`` and any ``postfix`` fields."""
        if self._bar is None:
            return
        fields = {}
        metrics = metrics or {}
        if isinstance(metrics.get("loss"), float) and math.isfinite(metrics["loss"]):
            fields["loss"] = f"{metrics['loss']:.4f}"
        if isinstance(metrics.get("tokens_per_s"), float):
            fields["tok/s"] = f"{metrics['tokens_per_s']:,.0f}"
        fields.update(postfix)
        if fields:
            self._bar.set_postfix(fields, refresh=False)
        if step != self._bar.n:
            self._bar.update(step - self._bar.n)
        elif fields:  # the same step, new fields (a sweep point starting): show them now
            self._bar.refresh()

    def write(self, line: str) -> None:
        """``line`` on stdout, above the bar while it shows (a plain ``print`` otherwise)."""
        if self._bar is None:
            print(line, flush=True)
        else:
            self._bar.write(line, file=sys.stdout)
            sys.stdout.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._stack.close()

    def __enter__(self) -> "StepProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
