"""The training loop: one ``TrainConfig`` in, a trained (and checkpointed) model out.

Setup order (torchtitan's): check the data and the resume path (user errors fail before any
memory is allocated) -> process group -> seeds -> GPU memory cap -> model on ``meta`` -> schedule
(``apply_fsdp`` for the canonical schedule, ``apply_speedloader`` for the layer-major one) ->
``materialize_model`` -> optimizer, LR schedule, data loader -> resume.

One optimizer step processes ``num_sub_batches x sub_batch_size`` sequences per rank:

- ``canonical``: gradient accumulation over ``num_sub_batches`` micro-batches of ``sub_batch_size``;
  each micro-batch loss is a token sum divided by the label-token count T of the WHOLE effective
  batch (``num_items_in_batch``), so the summed losses are the effective-batch mean loss.
- ``speedloader``: one layer-major forward/backward over the whole effective batch.
- ``auto``: ``planning.tune_train_config`` first plans n and N from two trial steps, then ``speedloader`` runs (or
  ``canonical``, gathered once, where ``schedule_choice`` measured it faster on the planned batch).

``time_budget_s`` stops the loop after the first step that ends that many seconds after the loop
began (the clock starts after the model, optimizer, data and logger are built); every step's
metrics carry ``elapsed_s`` on that clock.

Work is never lost to a stop: checkpoints are written every ``checkpoint.every`` steps and every
``checkpoint.every_minutes`` (asynchronously with ``checkpoint.async_save``), and a SIGTERM or SIGINT seen by any
rank makes every rank save after the step in flight and stop (``launch.TrainingInterrupted``: exit status 128 + the
signal). Rank 0 holds ``checkpoint.dir``'s lock from setup to the end of ``train()`` (``app/checkpoint_lock.py``: one
run per directory). Rank 0 shows a progress bar on a terminal (``logger.StepProgress``).

Library code: no Hydra, no W&B (``logger.build_logger`` imports W&B only when asked to).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdp_speedloader import openmp_wait, parallel
from fsdp_speedloader.app.checkpoint import TOKENIZER_DIR, Checkpointer, check_checkpoint_fits, \
    check_not_a_step_dir, claim_checkpoint_dir, resolve_resume_path
from fsdp_speedloader.app.checkpoint_extra import EXTRA_FILE, read_extra
from fsdp_speedloader.app.checkpoint_lock import CheckpointDirLock
from fsdp_speedloader.app.canonical import apply_schedule, canonical_forward_backward, micro_batches
from fsdp_speedloader.app.config import TrainConfig
from fsdp_speedloader.app.data import apply_document_mask, build_loader, check_held_out, check_prepared_with, \
    eos_token_id, load_val_tokens, other_than_models_own, val_batches, validate_data
from fsdp_speedloader.app.faults import fault_from_env
from fsdp_speedloader.app.host_memory import check_async_staging, check_cpu_memory, check_host_memory
from fsdp_speedloader.app.launch import TrainingInterrupted, UserError, check_writable_dir
from fsdp_speedloader.app.launch import rank as launch_rank
from fsdp_speedloader.app.logger import MetricLogger, StepProgress, build_logger, check_wandb_credentials, \
    logged_model, progress_bar_enabled
from fsdp_speedloader.app.metrics import StepMetrics, num_block_params, recompute_flops_per_token
from fsdp_speedloader.models import build_hf_config, build_model, get_adapter, materialize_model, \
    position_ids_model_classes
from fsdp_speedloader.models.chunked_loss import causal_lm_loss
from fsdp_speedloader.app.optim import build_lr_scheduler, build_optimizer
from fsdp_speedloader.app.planning import planned_config, tune_train_config
from fsdp_speedloader.app.runtime import DTYPES, maybe_cap_gpu_memory, resolve_device_type, resolve_param_dtype, \
    seed_everything
from fsdp_speedloader.engine.speedloader import speedloader_engine
from fsdp_speedloader.memory import adamw_chunk
from fsdp_speedloader.memory.arena import ArenaPlan, HostMemoryBudget, check_plan, host_memory_limit_from_env
from fsdp_speedloader.memory.bf16_master import cast_host_masters_
from fsdp_speedloader.memory.threads import threads_instead_of_torchrun_default

log = logging.getLogger(__name__)

IGNORE_INDEX = -100


# ---------------------------------------------------------------------------------------------
# Small pieces, each usable on its own
# ---------------------------------------------------------------------------------------------


def check_host_kernel() -> None:
    """``optim.host_kernel=fused``: the compressed AdamW's C++ kernel builds here, or the run is refused now (not at
    its first optimizer step, after the model has taken its memory)."""
    try:
        adamw_chunk.use_kernel("fused")
    except RuntimeError as e:
        raise ValueError(f"optim.host_kernel=fused: {e}; or set optim.host_kernel=auto (torch ops where the kernel "
                         "cannot be built)") from e


def check_host_memory_plan(model: torch.nn.Module, cfg: TrainConfig, mesh: DeviceMesh, *,
                           param_dtype: torch.dtype, device: torch.device) -> None:
    """The host budget check for a model that is sharded but not yet materialised: on the CPU every model state
    (``check_cpu_memory``); with offloaded parameters every tier of ``app.host_memory`` (parameter shards,
    gradients, optimizer states, activations, transfer copies; ValueError in one line naming what each setting
    frees), else the activation slots of one layer-major step (U + 1 slots of N x n x s x h) in the pinned arena.
    The arena checks its own slots again at the first step, to the byte. ``checkpoint.async_save``'s staging copy
    is a tier of the CPU and offloaded plans, else checked alone."""
    engine = speedloader_engine(model, missing_ok=True)
    if device.type == "cpu" and not cfg.offload.params:
        check_cpu_memory(model, cfg, shards=parallel.shard_size(mesh))
        return
    if cfg.checkpoint.async_save and not (engine is not None and engine.options.offload_params):
        check_async_staging(model, cfg, shards=parallel.shard_size(mesh))  # offloaded: a tier of the plan below
    if engine is not None and engine.options.offload_params:
        # Every tier (parameter shards, gradients, optimizer states, activations, transfer copies): memory/host_plan.py
        check_host_memory(model, cfg, shards=parallel.shard_size(mesh), activation_dtype=param_dtype,
                          on_cpu=device.type == "cpu")
        return
    if engine is None or not engine.options.uses_arena_store:
        return
    sched, s = cfg.schedule, cfg.data.seq_len
    plan = ArenaPlan().add("activations", "activations", (len(engine.units) + 1, sched.num_sub_batches,
                                                          sched.sub_batch_size, s, model.config.hidden_size),
                           param_dtype)
    hint = (f"lower schedule.num_sub_batches (N={sched.num_sub_batches}), schedule.sub_batch_size "
            f"(n={sched.sub_batch_size}) or data.seq_len (s={s}), or raise schedule.blocks_per_unit")
    check_plan(plan, HostMemoryBudget.detect(), hint=hint)


def num_label_tokens(labels: torch.Tensor) -> int:
    """Label tokens that count in the loss, shifted as Hugging Face does (position 0 predicts nothing)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def perplexity(loss: float) -> float:
    """exp(mean token loss); inf where that overflows a float, nan for a nan loss."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


# ---------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------


def _resume_without_model_path(cfg: TrainConfig) -> str:
    """For an error about model.path on a resume: how to resume without it (a resume reads no weights from model.path,
    only its config.json, which every step directory holds too); '' where this is no resume."""
    if cfg.checkpoint.resume is None or cfg.model.path is None or (Path(cfg.model.path) / "config.json").is_file():
        return ""
    try:
        step = resolve_resume_path(cfg.checkpoint, cfg.checkpoint.dir or Path(cfg.output_dir) / "checkpoints")
    except ValueError:
        return ""
    if step is None:
        return ""
    tokenizer = (f" data.tokenizer={step / TOKENIZER_DIR}" if (step / TOKENIZER_DIR).is_dir() else "")
    return (f". A resume reads only the config.json of model.path, and the step it resumes holds the same one: "
            f"model.path={step}{tokenizer} resumes without the original directory")


class Trainer:
    """Builds everything from ``cfg`` in the constructor; ``train()`` runs the steps.

    Args:
        cfg: the validated run configuration.
        logger: where metrics go; None builds one from ``cfg.logger`` (rank 0 only logs).
        run_config: the resolved config as a plain dict for the logger (W&B); None: ``cfg`` as a dict.

    Attributes (after construction): ``model``, ``adapter``, ``optimizer`` (an ``OptimizersContainer``: plain or
    overlapped with backward, used alike), ``scheduler``, ``loader``, ``mesh``, ``device``, ``rank``,
    ``world_size``, ``step`` (optimizer steps done; > 0 after a resume).
    """

    def __init__(self, cfg: TrainConfig, *, logger: Optional[MetricLogger] = None,
                 run_config: Optional[dict] = None) -> None:
        self._checkpoint_lock: Optional[CheckpointDirLock] = None  # rank 0's, from setup to the end of train()
        try:
            self._setup(cfg, logger=logger, run_config=run_config)
        except BaseException:
            self.release_checkpoint_dir()
            raise

    def _setup(self, cfg: TrainConfig, *, logger: Optional[MetricLogger], run_config: Optional[dict]) -> None:
        self.cfg = cfg
        sched = cfg.schedule

        # 1. User errors first: nothing is allocated yet.
        if launch_rank() == 0:  # the first line of a run, within seconds (the model build can take minutes)
            log.info("setting up: model %s, tokenizer %s, schedule %s, %d steps, run directory %s",
                     cfg.model.path or cfg.model.name, cfg.data.tokenizer, sched.name, cfg.steps, cfg.output_dir)
        device_type = resolve_device_type(cfg.device)
        try:
            hf_config = build_hf_config(cfg.model)
        except ValueError as e:
            raise ValueError(f"{e}{_resume_without_model_path(cfg)}") from None
        vocab_size = hf_config.vocab_size
        positions = getattr(hf_config, "max_position_embeddings", None)  # model.path's: its config.json holds them
        if cfg.model.path and positions is not None and cfg.data.seq_len > positions:
            raise ValueError(f"data.seq_len: {cfg.data.seq_len} exceeds the {positions} positions of model.path="
                             f"{cfg.model.path!r} (max_position_embeddings in its config.json); lower data.seq_len")
        validate_data(cfg.data, vocab_size=vocab_size)
        host_memory_limit_from_env()  # a malformed FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB fails here, not at step 1
        checkpoint_dir = Path(cfg.checkpoint.dir or Path(cfg.output_dir) / "checkpoints")
        check_not_a_step_dir(checkpoint_dir)
        check_writable_dir(cfg.output_dir, "output_dir")  # before the model, not at the first save
        check_writable_dir(checkpoint_dir, "checkpoint.dir")
        if launch_rank() == 0:  # only rank 0 logs
            check_wandb_credentials(cfg.logger)
        skipped: list[tuple[Path, str]] = []
        resume_path = resolve_resume_path(cfg.checkpoint, checkpoint_dir, skipped=skipped)

        # 2. Processes, seeds, memory cap.
        parallel.maybe_init_process_group(device_type)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = parallel.compute_device(device_type)
        resume_path = self._agree(resume_path)  # rank 0's view of the checkpoint directory wins
        for path, why in skipped:
            self._warning("checkpoint.resume=%s: skipped %s: %s", cfg.checkpoint.resume, path, why)
        if resume_path is not None:  # another model's checkpoint fails here, from its metadata, before any allocation
            check_checkpoint_fits(resume_path, build_model(cfg.model, device="meta"), cfg.model, cfg.data.tokenizer)
        resume_step, saved_wandb_run_id = 0, None
        if resume_path is not None:  # weights_only: a tampered extra file is refused here, before anything is built
            saved = read_extra(resume_path / EXTRA_FILE.format(rank=0))
            resume_step, saved_wandb_run_id = int(saved["step"]), saved.get("wandb_run_id")
            if cfg.steps <= resume_step:
                raise ValueError(f"steps={cfg.steps}: the checkpoint {str(resume_path)!r} is at step {resume_step} "
                                 f"already, so there is nothing left to train; set steps above {resume_step} (e.g. "
                                 f"steps={2 * resume_step}) to train on from it")
        self._claim_checkpoint_dir(checkpoint_dir, resume_path, resume_step)
        self._fault = fault_from_env(rank=self.rank, batch_size=sched.batch_size)  # tests of fault tolerance
        # Same seed on every rank; ranks differ through their data, and weights come from named seeds.
        seed_everything(cfg.seed)
        if cfg.offload.params and (threads := threads_instead_of_torchrun_default()) is not None:
            torch.set_num_threads(threads)  # the host AdamW and the shards' initialisation run on these
            self._info("host threads: %d per rank (this node's CPUs / %s local ranks) instead of torchrun's default "
                       "OMP_NUM_THREADS=1; set OMP_NUM_THREADS (or optim.worker_threads) to choose", threads,
                       os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if openmp_wait.chosen is not None:
            self._info("OpenMP: idle threads sleep at once (OMP_WAIT_POLICY=%s set at import), as %s ranks share this "
                       "host's cores; set OMP_WAIT_POLICY or GOMP_SPINCOUNT to choose", openmp_wait.chosen,
                       os.environ.get("LOCAL_WORLD_SIZE"))
        elif cfg.offload.params and openmp_wait.missed():
            self._warning("OpenMP's idle threads spin: %s ranks share this host's cores, and torch was imported before "
                          "fsdp_speedloader, too late to choose; set OMP_WAIT_POLICY=PASSIVE in the launch environment "
                          "(docs/scaling.md)", os.environ.get("LOCAL_WORLD_SIZE"))
        maybe_cap_gpu_memory(cfg.max_gpu_memory_gib, self.device)
        self.mesh = parallel.build_mesh(device_type, cfg.dp_replicate)
        param_dtype = resolve_param_dtype(cfg.param_dtype, device_type)
        reduce_dtype = DTYPES[cfg.reduce_dtype]
        self.tune_plan = None
        self._warned_alloc_retries = False
        self._warned_host_step, self._host_step_shown = False, 0
        if sched.name == "auto":  # trial steps on a throw-away model, then the plan (layer-major, or canonical)
            self._info("schedule=auto: tuning n and N from trial steps")
            self.tune_plan = tune_train_config(cfg, mesh=self.mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
            self._info("schedule=auto:\n%s", self.tune_plan.summary())
            cfg = self.cfg = planned_config(self.tune_plan, cfg)
            sched = cfg.schedule
        # The held-out set must hold one evaluation batch; packed documents need the tokenizer's EOS.
        check_held_out(cfg.data, vocab_size=vocab_size, global_batch_size=self.world_size * sched.batch_size)
        check_prepared_with(cfg.data)  # the tokenizer its checkpoints will carry is the one that made the data
        if self.rank == 0 and (why := other_than_models_own(cfg.data, cfg.model.path)) is not None:
            self._warning("%s", why)
        self.eos_token_id = eos_token_id(cfg.data) if cfg.data.document_mask else None

        if cfg.optim.state_dtype != "fp32" and cfg.optim.host_kernel == "fused":
            check_host_kernel()  # built or refused now, before the model takes memory
        # 3. The model: meta -> schedule (sharding) -> materialise this rank's shards.
        self._info("building the model: %s schedule, %d rank(s) on %s", sched.name, self.world_size, self.device)
        model = build_model(cfg.model, device="meta")
        model.train()
        self.adapter = get_adapter(model)
        num_blocks = len(self.adapter.blocks)
        if sched.blocks_per_unit > num_blocks:
            raise ValueError(f"schedule.blocks_per_unit={sched.blocks_per_unit}: the model has {num_blocks} blocks "
                             f"(layers); set at most {num_blocks} (one unit of every block)")
        num_units = -(-num_blocks // sched.blocks_per_unit)
        if sched.name == "speedloader" and sched.keep_activations > num_units * sched.num_sub_batches:
            self._warning("schedule.keep_activations=%d is more than the %d (unit, sub-batch) pairs of this run (%d "
                          "units x %d sub-batches): every pair keeps its activations, none is recomputed",
                          sched.keep_activations, num_units * sched.num_sub_batches, num_units, sched.num_sub_batches)
        if cfg.data.document_mask and not self.adapter.takes_position_ids:
            raise ValueError(f"data.document_mask: per-document positions and attention are supported for "
                             f"{', '.join(position_ids_model_classes())} (RoPE, causal), not {type(model).__name__}; "
                             "set data.document_mask=false")
        flops_per_token = self.adapter.flops_per_token(cfg.data.seq_len)
        recompute = sched.name == "speedloader" or sched.activation_checkpointing
        recompute_flops = recompute_flops_per_token(
            num_block_params=num_block_params(self.adapter.blocks), num_layers=len(self.adapter.blocks),
            hidden_size=model.config.hidden_size, seq_len=cfg.data.seq_len) if recompute else 0.0
        if sched.name == "canonical":  # only every k-th block recomputes
            recompute_flops *= (num_blocks // sched.activation_checkpointing_every) / num_blocks
        self.num_params = sum(p.numel() for p in model.parameters())
        if cfg.optim.master_dtype == "bf16":  # before sharding: FSDP2 keeps each parameter's dtype in its shard
            on_device = list(self.adapter.blocks)[:cfg.offload.device_units * sched.blocks_per_unit]  # units 1 .. K
            cast_host_masters_(model, self.adapter.blocks, include_root=cfg.offload.root, keep=on_device)
        self.kernel_scope = apply_schedule(model, cfg, self.mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        # before the shards take host memory
        check_host_memory_plan(model, cfg, self.mesh, param_dtype=param_dtype, device=self.device)
        param_device = torch.device("cpu") if cfg.offload.params else self.device
        # a resume takes every weight from its checkpoint: model.path's are not read (only its config.json)
        materialize_model(model, cfg.model, device=self.device, seed=cfg.seed, param_device=param_device,
                          fill=resume_path is None)
        self.model = model

        # 4. Optimizer, LR schedule, data, metrics, logging, checkpoints.
        self.optimizer = build_optimizer(model, cfg.optim, seed=cfg.seed)
        if cfg.optim.worker_affinity:
            cpus = self.optimizer.worker_cpus
            self._info("optim.worker_affinity: the optimizer worker runs on %d CPUs (%d to %d) with %d threads "
                       "(rank 0's)", len(cpus), cpus[0], cpus[-1], self.optimizer.worker_threads)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.optim, cfg.steps)
        self.loader = build_loader(cfg.data, vocab_size=vocab_size, batch_size=sched.batch_size,
                                   rank=self.rank, world_size=self.world_size)
        self.val_batches = val_batches(load_val_tokens(cfg.data), seq_len=cfg.data.seq_len,
                                       batch_size=sched.batch_size, num_batches=cfg.eval.batches, rank=self.rank,
                                       world_size=self.world_size) if cfg.data.has_validation else []
        self.metrics = StepMetrics(device=self.device, world_size=self.world_size,
                                   tokens_per_step_per_device=sched.batch_size * cfg.data.seq_len,
                                   flops_per_token=flops_per_token, recompute_flops_per_token=recompute_flops,
                                   peak_tflops=cfg.peak_tflops,
                                   attention_flops_per_token=self.adapter.attention_flops_per_token(cfg.data.seq_len))
        self.checkpointer = Checkpointer(cfg.checkpoint, checkpoint_dir, rank=self.rank, device=self.device,
                                         model_config=cfg.model, tokenizer=cfg.data.tokenizer,
                                         lock=self._checkpoint_lock,
                                         pin_staging=self.device.type == "cuda" and not cfg.offload.params)
        self.step = 0
        self.tokens_per_step = self.world_size * sched.batch_size * cfg.data.seq_len
        self.tokens = 0  # trained on so far: a resume with another batch size goes on from the checkpoint's count
        if resume_path is not None:
            self.step = self.checkpointer.load(resume_path, model=model, optimizer=self.optimizer,
                                               scheduler=self.scheduler, loader=self.loader)
            saved = self.checkpointer.loaded_tokens  # None: a checkpoint from before the count was saved
            self.tokens = saved if saved is not None else self.step * self.tokens_per_step
            self._info("resumed from %s at step %d", resume_path, self.step)
            if (engine := speedloader_engine(model, missing_ok=True)) is not None:
                engine.refresh_param_transfer(force=True)  # loaded in place: recast whatever the checks missed
        elif cfg.checkpoint.resume == "auto" and cfg.checkpoint.dir is None:
            # the default directory is under this run's own (a new dated one, unless hydra.run.dir is fixed)
            self._warning("checkpoint.resume=auto: no complete checkpoint in %s, starting fresh. checkpoint.dir is "
                          "unset, so auto looks only in this run's directory: to continue an earlier run set "
                          "checkpoint.dir to its checkpoint directory (one directory for every run of a job), or "
                          "checkpoint.resume=PATH", checkpoint_dir)
        elif cfg.checkpoint.resume == "auto":
            self._info("checkpoint.resume=auto: no complete checkpoint in %s, starting fresh", checkpoint_dir)
        logged = run_config if run_config is not None else dataclasses.asdict(cfg)
        self.logger = logger if logger is not None else build_logger(
            cfg.logger, {**logged, "model": logged_model(cfg.model, hf_config)}, cfg.output_dir, self.rank,
            show_mfu=self.device.type != "cpu",  # peak_tflops is an accelerator's: no MFU on a CPU
            wandb_run_id=saved_wandb_run_id, fresh=resume_path is None)  # a resumed job logs on into its W&B run
        self.checkpointer.wandb_run_id = getattr(self.logger, "wandb_run_id", None)
        if self.tune_plan is not None:
            self.logger.log(self.tune_plan.as_metrics(), step=self.step)
        self._info("%s schedule: %s params, %d rank(s) on %s, mesh %s, param_dtype %s, batch %d x %d x %d tokens, "
                   "%d steps", sched.name, f"{self.num_params:,}", self.world_size, self.device,
                   dict(zip(self.mesh.mesh_dim_names, self.mesh.shape)), param_dtype,
                   sched.num_sub_batches, sched.sub_batch_size, cfg.data.seq_len, cfg.steps)
        if sched.compile_blocks:
            self._info("schedule.compile_blocks: the first step compiles the blocks (minutes for a large model)")

    def _claim_checkpoint_dir(self, checkpoint_dir: Path, resume_path: Optional[Path], resume_step: int) -> None:
        """Rank 0 takes ``checkpoint_dir``'s lock and checks that this run's saves cannot mix with another run's
        steps (``claim_checkpoint_dir``: deletes them with ``checkpoint.overwrite=true``); every rank gets the outcome,
        so a refusal ends all of them at once (ValueError), none waiting on the others."""
        error = None
        if self.rank == 0:
            try:
                self._checkpoint_lock = CheckpointDirLock.acquire(checkpoint_dir, run_dir=self.cfg.output_dir)
                atexit.register(self._checkpoint_lock.release)  # a Trainer that never trains: released at exit
                claim_checkpoint_dir(checkpoint_dir, resume_path=resume_path, resume_step=resume_step,
                                     overwrite=self.cfg.checkpoint.overwrite)
            except ValueError as e:
                error = e
        if (message := self._agree(None if error is None else str(error))) is not None:
            raise error if error is not None else ValueError(message)

    def release_checkpoint_dir(self) -> None:
        """Removes rank 0's lock of the checkpoint directory (``train()`` does, at its end); idempotent."""
        if self._checkpoint_lock is not None:
            self._checkpoint_lock.release()

    def _info(self, msg: str, *args: Any) -> None:
        if self.rank == 0:
            log.info(msg, *args)

    def _warning(self, msg: str, *args: Any) -> None:
        if self.rank == 0:
            log.warning(msg, *args)

    def _agree(self, value: Any) -> Any:
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # --- one step ------------------------------------------------------------------------------
    def _forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor, num_tokens: int,
                          position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Accumulates the gradients of the effective-batch mean loss; returns that loss (detached)."""
        sched = self.cfg.schedule
        if sched.name == "speedloader":
            loss = self.model(input_ids=input_ids, labels=labels, position_ids=position_ids).loss
            loss.backward()
            return loss.detach()
        return canonical_forward_backward(self.model, input_ids, labels, sub_batch_size=sched.sub_batch_size,
                                          num_tokens=num_tokens, gradient_sync=sched.gradient_sync,
                                          reshard_after_forward=sched.reshard_after_forward, scope=self.kernel_scope,
                                          position_ids=position_ids, loss_chunk_tokens=sched.loss_chunk_tokens)

    def _device_batch(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], int]:
        """(input_ids, labels, position_ids or None, label tokens) of a loader's batch, on the device; packed
        documents (``data.document_mask``) get their per-document positions here, from the batch's EOS tokens."""
        if self.eos_token_id is not None:
            batch = apply_document_mask(batch, self.eos_token_id)
        num_tokens = num_label_tokens(batch["labels"])  # on the host: no device sync
        on_device = [batch[k].to(self.device, non_blocking=True) if k in batch else None
                     for k in ("input_ids", "labels", "position_ids")]  # each (N * n, s)
        return (*on_device, num_tokens)

    def train_step(self) -> dict:
        """One optimizer step; returns its metrics (the loss averaged over ranks)."""
        self.metrics.start_step()
        input_ids, labels, position_ids, num_tokens = self._device_batch(self.loader.next_batch())
        self.metrics.mark_data_ready()

        loss = self._forward_backward(input_ids, labels, num_tokens, position_ids)
        engine = speedloader_engine(self.model, missing_ok=True)
        lr = self.optimizer.param_groups[0]["lr"]
        # Clips to optim.grad_clip first (clip_grad_norm_ over model.parameters(), bit for bit also when the steps
        # are overlapped), then steps, and casts the bf16 transfer copies it made stale rather than in the next
        # forward. An overlapped optimizer may return before its unit steps are applied: the next forward waits
        # for each unit's, and the LR scheduler and zero_grad below run after them.
        self.optimizer.step()
        grad_norm = self.optimizer.last_grad_norm
        skipped = self.optimizer.last_step_skipped
        if skipped:  # the same on every rank: the norm is global
            self._warning("step %d: the gradient norm is %s; skipped the optimizer step (no parameter, optimizer "
                          "state or LR schedule changed; optim.skip_nonfinite), %d step(s) skipped so far",
                          self.step + 1, grad_norm.item(), self.optimizer.num_skipped_steps)
        else:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens += self.tokens_per_step

        if self.world_size > 1:  # gloo has no AVG: sum, then divide
            dist.all_reduce(loss, op=dist.ReduceOp.SUM)
            loss = loss / self.world_size
        # .item() waits for the step's kernels: this is the step boundary.
        metrics = self.metrics.end_step(loss=loss.item(), lr=float(lr),
                                        grad_norm=grad_norm.item() if grad_norm is not None else None,
                                        step_skipped=skipped, num_skipped_steps=self.optimizer.num_skipped_steps)
        metrics["tokens"] = self.tokens
        metrics.update(self.loader.progress())  # epoch, dataset_tokens (where the loader knows them)
        if engine is not None:  # copy bytes, compute-stream waits on copies, arena bytes (read at the step end)
            metrics.update(engine.store.step_stats())
        if hasattr(self.optimizer, "step_stats"):  # the overlapped CPU step: its busy seconds and what showed
            metrics.update(self.optimizer.step_stats())
        self._check_alloc_retries(metrics)
        self._check_host_step_shows(metrics)
        return metrics

    # The first steps fill the caching allocator's cache and compile: neither an allocator retry nor a CPU step that
    # shows there says anything of the steady state.
    WARMUP_STEPS = 2

    def _check_alloc_retries(self, metrics: dict) -> None:
        """Warns once when the caching allocator retried after the first steps: the step runs at the GPU memory
        cap, where each retry synchronises the GPU and frees the cache (docs/benchmarking.md, the ladder rule)."""
        retries = metrics.get("gpu_alloc_retries", 0)
        if not retries or self.step <= self.WARMUP_STEPS or self._warned_alloc_retries:
            return
        self._warned_alloc_retries = True
        sched = self.cfg.schedule
        if sched.name == "canonical":
            fix = ("lower schedule.sub_batch_size, or recompute more blocks (schedule.activation_checkpointing=true, "
                   "a smaller schedule.activation_checkpointing_every)")
        else:
            fix = "lower schedule.keep_activations (pairs kept on the GPU) or schedule.sub_batch_size" + (
                ", or schedule.gpu_memory_budget_gib" if self.tune_plan is not None else "")
        self._warning("step %d: the CUDA caching allocator retried %d allocation(s): GPU memory is at its cap, and "
                      "every retry synchronises the GPU and empties the cache. A step with a little less memory is "
                      "often faster: %s (this warning shows once; gpu_alloc_retries is in every step's metrics)",
                      self.step, retries, fix)

    # The overlapped CPU step must show for this share of the step in this many steps in a row to warn: one slow step
    # says little (a checkpoint, a burst of the host's other work).
    HOST_STEP_SHOWS_SHARE = 0.05
    HOST_STEP_SHOWS_STEPS = 3

    def _check_host_step_shows(self, metrics: dict) -> None:
        """Warns once when, after the first steps, the overlapped CPU optimizer step showed after the backward
        (``optimizer_wait_s``: the main thread blocked on it) for more than 5% of the step in 3 steps in a row: the
        backward no longer hides it (a busy host, or more host parameters than the backward's window), and the
        setting that takes work off the CPU (docs/configuration.md)."""
        wait, step_time = metrics.get("optimizer_wait_s"), metrics.get("step_time_s")
        if wait is None or not step_time or self.step <= self.WARMUP_STEPS or self._warned_host_step:
            return
        shown = wait > self.HOST_STEP_SHOWS_SHARE * step_time
        self._host_step_shown = self._host_step_shown + 1 if shown else 0
        if self._host_step_shown < self.HOST_STEP_SHOWS_STEPS:
            return
        self._warned_host_step = True
        units = self.cfg.offload.device_units if self.tune_plan is None else self.tune_plan.device_units
        auto = "" if self.tune_plan is not None else (", or schedule=auto with the same settings, which plans the "
                                                      "units from timed trial steps")
        self._warning("step %d: the overlapped CPU optimizer step showed after the backward in %d steps in a row "
                      "(this step: %.3f s of %.3f s; the CPU step itself %.3f s): the backward no longer hides it, "
                      "as on a host whose cores other processes keep busy. offload.device_units=%d keeps one more "
                      "unit's states on the GPU (16 B per parameter with fp32 AdamW) and takes its share off the CPU "
                      "step%s; or keep other work off this run's cores (this warning shows once; optimizer_wait_s is "
                      "in every step's metrics)", self.step, self._host_step_shown, wait, step_time,
                      metrics.get("optimizer_busy_s", 0.0), units + 1, auto)

    # --- validation ----------------------------------------------------------------------------
    def evaluate(self) -> dict:
        """The held-out set's mean token loss (``val_loss``, over every rank's label tokens), ``val_ppl`` =
        exp(val_loss), ``val_tokens`` and ``val_time_s``: forward only (eval mode, no autograd), through the model's
        own schedule (layer-major: every unit once per batch for all sub-batches, two activation slots; canonical:
        micro-batches). Empty without a held-out set."""
        if not self.val_batches:
            return {}
        start = time.perf_counter()
        self.optimizer.wait()  # an overlapped optimizer's deferred steps: evaluate the stepped parameters
        was_training = self.model.training
        self.model.eval()
        total = tokens = 0.0
        try:
            with torch.no_grad():
                for batch in self.val_batches:
                    input_ids, labels, position_ids, num_tokens = self._device_batch(batch)
                    loss = self._forward_loss(input_ids, labels, num_tokens, position_ids)
                    total, tokens = total + loss.item() * num_tokens, tokens + num_tokens
        finally:
            self.model.train(was_training)
        sums = torch.tensor([total, tokens], dtype=torch.float64, device=self.device)  # (summed token loss, tokens)
        if self.world_size > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        total, tokens = sums.tolist()
        val_loss = total / tokens if tokens else math.nan
        return {"val_loss": val_loss, "val_ppl": perplexity(val_loss), "val_tokens": int(tokens),
                "val_time_s": time.perf_counter() - start}

    def _forward_loss(self, input_ids: torch.Tensor, labels: torch.Tensor, num_tokens: int,
                      position_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """The mean token cross-entropy of one batch, forward only (call under ``torch.no_grad``)."""
        sched = self.cfg.schedule
        # The layer-major forward runs its sub-batches itself; the canonical schedule runs micro-batches.
        pieces = [(input_ids, labels, position_ids)] if sched.name == "speedloader" else \
            micro_batches(input_ids, labels, position_ids, sched.sub_batch_size)
        total = torch.zeros((), device=input_ids.device)
        chunk = 0 if sched.name == "speedloader" else sched.loss_chunk_tokens  # the engine chunks its own
        for ids, lab, pos in pieces:
            with self.kernel_scope():  # MoE: the router's load-balancing term is no token loss
                total += causal_lm_loss(self.model, ids, lab, num_tokens=num_tokens, chunk_tokens=chunk,
                                        position_ids=pos, router_loss=False)
        return total

    def _evaluation_due(self, *, last: bool) -> bool:
        every = self.cfg.eval.every
        return bool(self.val_batches) and (last or (every > 0 and self.step % every == 0))

    # --- the loop ------------------------------------------------------------------------------
    def train(self, max_steps: Optional[int] = None) -> list[dict]:
        """Runs to step ``cfg.steps`` (or stops after step ``max_steps``, as an interrupted run would),
        or, with ``cfg.time_budget_s``, after the first step that ends that many seconds into the loop.

        Returns each step's metrics (the loss averaged over ranks, so the same on every rank), with
        ``elapsed_s``: seconds from the start of the loop to the end of that step (data, forward,
        backward, optimizer, the step-boundary sync, and earlier steps' logging and checkpoints).

        With a held-out set (``data.val_path`` / ``data.val_fraction``), evaluates it every ``eval.every`` steps and
        after the last step (or the one that crossed the time budget): ``val_loss``, ``val_ppl`` in that step's
        record, which is then logged whatever ``log_every`` is.

        Saves checkpoints on ``checkpoint.every``, every ``checkpoint.every_minutes`` and after the last step
        (``checkpoint.save_final``; a run stopped by its time budget saves then too); a step that saves is logged
        whatever ``log_every`` is, with ``checkpoint_stall_s`` (the seconds the save held the loop). An asynchronous
        save in flight (``checkpoint.async_save``) becomes complete at the first step boundary after its write, and
        the loop's end waits for it. Logs the final step
        (``cfg.steps``, or the one that crossed the budget) whatever ``log_every`` is, finishes the logger and
        stops an overlapped optimizer's worker once its last steps are applied: a Trainer trains once.

        With ``optim.grad_clip > 0`` and ``optim.skip_nonfinite`` a step whose gradient norm is inf or nan changes
        nothing (parameters, optimizer state, LR schedule), is logged as a warning and counted (``step_skipped``,
        ``num_skipped_steps`` in the metrics), and the loop goes on; a non-finite loss stops the run only when its
        step was not skipped.

        A SIGTERM or SIGINT (on any rank) ends the loop after the step in flight: every rank saves that step,
        then ``launch.TrainingInterrupted`` (a ``SystemExit`` with code 128 + the signal number) is raised.
        """
        last = self.cfg.steps if max_steps is None else min(max_steps, self.cfg.steps)
        budget = self.cfg.time_budget_s
        history = []
        loop_start = last_save = time.perf_counter()
        stop = StopSignals(announce=self.rank == 0)
        progress = StepProgress(total=self.cfg.steps, initial=self.step, enabled=progress_bar_enabled(self.rank))
        stopped_by = 0
        try:
            with stop, progress:
                while self.step < last:
                    if self._fault is not None and self._fault.step == self.step + 1:
                        self._fault.trigger()
                    try:
                        metrics = self.train_step()
                    except (torch.OutOfMemoryError, ValueError) as e:
                        if (error := self._memory_error(e)) is None:
                            raise
                        raise error from (error.__cause__ or e)
                    if self.tune_plan is not None and self.step == 1:  # the plan next to the first measured peak
                        metrics.update(self.tune_plan.first_step_metrics(metrics))
                    now = time.perf_counter()
                    metrics["elapsed_s"] = elapsed = now - loop_start
                    metrics["step"] = self.step
                    history.append(metrics)
                    # One agreement per step (ranks' clocks and signals differ; all must save and stop together).
                    out_of_time, save_due, stopped_by = self._any_rank(
                        budget is not None and elapsed >= budget, self.checkpointer.time_due(now - last_save),
                        stop.signum)
                    evaluated = self._evaluation_due(last=self.step == self.cfg.steps or bool(out_of_time))
                    if evaluated:  # in this step's record; its time shows in the next step's elapsed_s
                        metrics.update(self.evaluate())
                    diverged = not math.isfinite(metrics["loss"]) and not metrics["step_skipped"]
                    self.checkpointer.poll()  # an asynchronous save that has finished becomes complete
                    if not diverged and (self.checkpointer.should_save(self.step, self.cfg.steps) or save_due
                                         or stopped_by or out_of_time and self.cfg.checkpoint.save_final):
                        self.save_checkpoint()  # before the step's record: it carries the save's stall
                        metrics["checkpoint_stall_s"] = self.last_checkpoint_stall_s
                        last_save = time.perf_counter()
                    if (self.step % self.cfg.log_every == 0 or self.step == self.cfg.steps or out_of_time
                            or stopped_by or evaluated or "checkpoint_stall_s" in metrics):
                        self.logger.log({k: v for k, v in metrics.items() if k != "step"}, step=self.step)
                    progress.update(self.step, metrics)
                    if diverged:
                        raise RuntimeError(f"loss is {metrics['loss']} at step {self.step}; "
                                           "lower optim.lr or check the data")
                    if stopped_by:
                        self._info("%s: saved step %d in %s; stopping (checkpoint.resume=auto with the same "
                                   "checkpoint.dir goes on from there)", signal.Signals(stopped_by).name, self.step,
                                   self.checkpointer.dir)
                        break
                    if out_of_time:
                        self._info("time_budget_s=%g reached: stopping after step %d (%.1f s into the loop, %d "
                                   "tokens)", budget, self.step, elapsed, metrics["tokens"])
                        break
                self.checkpointer.wait()  # an asynchronous save in flight, while repeated signals are still ignored
        finally:
            try:
                self.checkpointer.close()  # an asynchronous save in flight finishes and becomes complete
            finally:
                self.logger.finish()
                self.optimizer.close()  # an overlapped optimizer's worker thread
                self.release_checkpoint_dir()
        if stopped_by:
            raise TrainingInterrupted(stopped_by)
        return history

    def _memory_error(self, error: BaseException) -> Optional[UserError]:
        """A step's error as the user error it is when a memory budget was wrong: a tuned plan's GPU or host budget
        (``TunePlan.memory_error`` names it and by how much), the kept activations of a hand-set
        ``schedule.keep_activations`` (``_kept_pairs_error``), or the host arena's at its first step. A
        :class:`launch.UserError` (one line and exit code 2 at the entry point) whose ``__cause__`` is the plan's
        ``GpuPlanMemoryError`` / ``HostPlanMemoryError`` (caused by ``error``) or ``error``; None for any other error.
        The GPU case keeps the allocator's 'out of memory' in its text (sweeps classify the point as ``oom``)."""
        tuned = self.tune_plan.memory_error(error) if self.tune_plan is not None else None
        if tuned is None and (kept := self._kept_pairs_error(error)) is not None:
            return kept
        if tuned is None and not (isinstance(error, ValueError) and "pinned host arena needs" in str(error)):
            return None
        cause = tuned if tuned is not None else error
        if tuned is not None:
            tuned.__cause__ = error
        user_error = UserError(" ".join(str(cause).split()))  # one line, whatever the allocator's text holds
        user_error.__cause__ = cause
        return user_error

    def _kept_pairs_error(self, error: BaseException) -> Optional[UserError]:
        """A GPU out-of-memory error of a step that keeps (unit, sub-batch) pairs' activations by hand
        (``schedule.keep_activations`` > 0, no tuned plan): the same error, saying how many pairs were held and
        what one held, and what to change. None otherwise."""
        engine = speedloader_engine(self.model, missing_ok=True)
        if (not isinstance(error, torch.OutOfMemoryError) or self.tune_plan is not None or engine is None
                or not engine.options.keep_activations):
            return None
        keep = engine.options.keep_activations
        held, pair_bytes = engine.kept_pairs_report()
        each = f", {pair_bytes / 2**30:.2f} GiB each" if pair_bytes else ""
        fewer = f"below {held}" if 1 < held <= keep else "lower"
        user_error = UserError(
            f"GPU out of memory with schedule.keep_activations={keep}: {held} kept (unit, sub-batch) pairs held "
            f"their activations{each} when it ran out; set schedule.keep_activations {fewer} (0 recomputes every "
            f"pair), or schedule=auto to plan it from the GPU's memory. The allocator said: "
            + " ".join(str(error).split()))
        user_error.__cause__ = error
        return user_error

    def _any_rank(self, *flags: int) -> tuple[int, ...]:
        """Each flag's maximum over ranks, the same on every rank (a flag true on one rank is true on all)."""
        if self.world_size == 1:
            return tuple(int(f) for f in flags)
        box = torch.tensor([int(f) for f in flags], device=self.device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return tuple(int(v) for v in box.tolist())

    def save_checkpoint(self) -> Path:
        """Saves this step (all ranks); ``last_checkpoint_stall_s``: the seconds the save held the training loop (the
        whole write; asynchronously, the wait for the previous save and the staging copy)."""
        self.optimizer.wait()  # an overlapped optimizer's deferred steps: the parameters are read before its state
        start = time.perf_counter()
        path = self.checkpointer.save(self.step, model=self.model, optimizer=self.optimizer,
                                      scheduler=self.scheduler, loader=self.loader, tokens=self.tokens)
        self.last_checkpoint_stall_s = time.perf_counter() - start
        return path


class StopSignals:
    """While entered (in the main thread): SIGTERM and SIGINT only record the signal (``signum``; 0: none), so the
    loop can save and stop at the next step boundary. Repeats are recorded too (torchrun forwards the signal it
    got): the save is never cut short by them; ``kill -9`` still stops the process at once."""

    def __init__(self, *, announce: bool) -> None:
        self.signum = 0
        self._announce = announce
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.signum and self._announce:
            log.warning("%s received: saving a checkpoint after this step, then stopping", signal.Signals(signum).name)
        self.signum = self.signum or signum

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: installed outside Python
        self._previous.clear()


def train(cfg: TrainConfig, **kwargs: Any) -> list[dict]:
    """Builds a :class:`Trainer` and runs it; returns each step's metrics."""
    return Trainer(cfg, **kwargs).train()
