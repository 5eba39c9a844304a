"""Saving and resuming training with ``torch.distributed.checkpoint`` (DCP).

One checkpoint is one directory ``<checkpoint.dir>/step_NNNNNNNN/``:

- DCP files (``.metadata``, ``*.distcp``): the model and optimizer state as each rank's shards
  (``get_model_state_dict`` and the optimizers' ``state_dict()``, DCP's layout keyed by parameter name), so a
  checkpoint loads on another world size too;
- ``extra_rank{r}.pt`` (``app/checkpoint_extra.py``: tensors and plain values only, read back with
  ``torch.load(weights_only=True)``), per rank: step, LR scheduler, data loader state, the RNG states (torch CPU,
  CUDA when present, numpy, python ``random``; numpy's and python's as tensors and plain values) and, on rank 0,
  the run's W&B id (``wandb_run_id``, None without W&B);
- what rebuilds the model without the run's config (``app/export.py``: generation from a checkpoint,
  export to Hugging Face): ``config.json`` (the model's Hugging Face config), ``model_config.json``
  (the run's ``ModelConfig`` as a dict and its tokenizer) and ``tokenizer/`` (the run's Hugging Face
  tokenizer files, when it used one).

Every rank writes into ``step_NNNNNNNN.tmp/``; after a barrier rank 0 renames it to
``step_NNNNNNNN/``. A crash therefore never leaves a directory that looks complete: resume only
ever considers names ``step_`` + 8 digits, never ``*.tmp``, and only once :func:`verify_checkpoint` found every file
its ``.metadata`` names at its full length (a checkpoint cut short by a full disk or a copy is skipped, named, for
the newest complete one). Older step directories beyond ``keep_last`` are deleted only after the new one is
complete. A run holds the directory's lock (``app/checkpoint_lock.py``) from setup to exit, so no two runs ever
write one ``step_NNNNNNNN.tmp``; and it starts only where its saves cannot mix with another run's steps
(:func:`steps_of_other_runs`): ``checkpoint.overwrite=true`` deletes those first, nothing else is ever deleted.
All ranks must see the same ``checkpoint.dir`` (a shared file system across nodes).

Trust: ``extra_rank*.pt`` is read with ``weights_only=True`` (a tampered one is refused, naming what it holds), but
DCP reads ``.metadata`` with ``pickle`` and the shards' non-tensor values with ``torch.load(weights_only=False)``:
resume, generate from or export only checkpoints you wrote or trust.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from fsdp_speedloader.app.checkpoint_async import AsyncSaver
from fsdp_speedloader.app.checkpoint_extra import EXTRA_FILE, read_extra, rng_state, save_extra, set_rng_state
from fsdp_speedloader.app.checkpoint_lock import CheckpointDirLock
from fsdp_speedloader.app.config import CheckpointConfig
from fsdp_speedloader.app.data import build_tokenizer
from fsdp_speedloader.app.launch import UserError
from fsdp_speedloader.models import ModelConfig

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{8})$")
_STEP_TMP = re.compile(r"^step_\d{8}(\.replaced)?\.tmp$")
_DCP_METADATA = ".metadata"
HF_CONFIG_FILE = "config.json"
"""In every step directory: the model's Hugging Face config (``PretrainedConfig.to_json_file``)."""
GENERATION_CONFIG_FILE = "generation_config.json"
"""In every step directory of a run whose model.path has one: that file, as it was."""
MODEL_CONFIG_FILE = "model_config.json"
"""In every step directory: ``{"model": the run's ModelConfig as a dict, "tokenizer": "bytes" or TOKENIZER_DIR,
"tokenizer_source": the run's data.tokenizer}``."""
TOKENIZER_DIR = "tokenizer"
"""In every step directory of a run with a Hugging Face tokenizer: its files (``save_pretrained``)."""


def check_not_a_step_dir(checkpoint_dir: Path) -> None:
    """``checkpoint.dir`` names where a run's step directories go: one step directory there would start the run
    fresh and write its steps inside that checkpoint."""
    if _STEP_DIR.match(checkpoint_dir.name) and (checkpoint_dir / _DCP_METADATA).is_file():
        raise ValueError(f"checkpoint.dir: {str(checkpoint_dir)!r} is one step's checkpoint, not a directory of them; "
                         f"to resume from it: checkpoint.resume={checkpoint_dir} "
                         f"checkpoint.dir={checkpoint_dir.parent}")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete step checkpoints in ``directory`` as (step, path), oldest first. ``*.tmp`` never counts."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / _DCP_METADATA).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def verify_checkpoint(path: str | os.PathLike) -> Optional[str]:
    """None when the step directory ``path`` is complete, else why not (a phrase naming the file).

    Complete: its DCP ``.metadata`` reads, every file the metadata points into is there and at least as long as
    the last byte it points at, and ``extra_rank0.pt`` (step, scheduler, data position) is an intact archive.
    Reads the metadata and the small extra file, never the shards.
    """
    path = Path(path)
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except FileNotFoundError:
        return "it has no .metadata"
    except Exception as e:  # truncated or not a pickle at all
        return f"its .metadata cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'empty'})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, nbytes in sorted(needed.items()):
        try:
            size = (path / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if size < nbytes:
            return f"{name} is truncated ({size} of at least {nbytes} bytes)"
    extra = path / "extra_rank0.pt"
    try:
        with zipfile.ZipFile(extra) as archive:
            if archive.testzip() is not None:
                return f"{extra.name} is corrupt"
    except FileNotFoundError:
        return f"{extra.name} is missing"
    except (zipfile.BadZipFile, OSError) as e:
        return f"{extra.name} cannot be read ({e})"
    return None


def latest_complete_checkpoint(directory: str | os.PathLike) -> tuple[Optional[Path], list[tuple[Path, str]]]:
    """The newest step checkpoint in ``directory`` that :func:`verify_checkpoint` accepts (None if there is none),
    and the newer ones it skipped, as (path, why), newest first."""
    skipped = []
    for _, path in reversed(list_checkpoints(directory)):
        why = verify_checkpoint(path)
        if why is None:
            return path, skipped
        skipped.append((path, why))
    return None, skipped


def unfinished_saves(directory: str | os.PathLike, *, after: Optional[Path]) -> list[tuple[Path, str]]:
    """(path, why) of the ``step_NNNNNNNN.tmp`` directories newer than the step ``after`` (a save cut short: a kill
    during the write, a full disk): resume passes them over, and says so."""
    directory, newer_than = Path(directory), int(after.name.split("_")[-1]) if after is not None else -1
    if not directory.is_dir():
        return []
    found = [(int(p.name[5:13]), p) for p in directory.iterdir() if _STEP_TMP.match(p.name) and p.is_dir()]
    return [(p, "an unfinished save (*.tmp), never resumed") for step, p in sorted(found, reverse=True)
            if step > newer_than]


def find_latest_checkpoint(directory: str | os.PathLike) -> Optional[Path]:
    """The newest complete (verified) step checkpoint in ``directory``, or None."""
    return latest_complete_checkpoint(directory)[0]


def _complete_step(path: Path, skipped: list) -> tuple[Optional[Path], str]:
    """``path`` if it is a complete step directory, else the newest complete one inside it; or (None, why not).
    ``skipped`` receives (path, why) of each newer step directory passed over as incomplete."""
    if path.name.endswith(".tmp"):
        return None, "is an unfinished save (*.tmp)"
    if (path / _DCP_METADATA).is_file():
        why = verify_checkpoint(path)
        return (path, "") if why is None else (None, f"is not a complete checkpoint: {why}")
    latest, passed_over = latest_complete_checkpoint(path)
    skipped.extend(passed_over)
    if latest is not None:
        return latest, ""
    if passed_over:
        return None, f"holds no complete checkpoint ({passed_over[0][0].name}: {passed_over[0][1]})"
    return None, "does not exist" if not path.exists() else "is not a complete checkpoint (no .metadata)"


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A complete (verified) step directory: ``path`` itself, or the newest complete one inside it (as ``resume``
    finds them; newer incomplete ones are logged as skipped); ValueError naming ``path`` otherwise."""
    skipped: list[tuple[Path, str]] = []
    found, what = _complete_step(Path(path), skipped)
    for step_dir, why in skipped:
        log.warning("skipped checkpoint %s: %s", step_dir, why)
    if found is not None:
        return found
    raise ValueError(f"checkpoint: {str(Path(path))!r} {what}; give a step_NNNNNNNN directory written by training, "
                     "or the checkpoint directory holding them (its newest complete one is taken)")


def resolve_resume_path(cfg: CheckpointConfig, checkpoint_dir: str | os.PathLike, *,
                        skipped: Optional[list] = None) -> Optional[Path]:
    """Where to resume from: None (fresh start) or a complete (verified) step directory.

    ``resume=auto`` takes the latest complete checkpoint in ``checkpoint_dir`` (None if there is
    none); an explicit path must be a complete step directory, or a directory holding step directories
    (the latest complete one is taken). Raises ValueError before anything is built if it is not.
    ``skipped``: a list that receives (path, why) of each newer step directory passed over as incomplete.
    """
    if cfg.resume is None:
        return None
    skipped = [] if skipped is None else skipped
    if cfg.resume == "auto":
        latest, passed_over = latest_complete_checkpoint(checkpoint_dir)
        skipped.extend(passed_over)
        skipped.extend(unfinished_saves(checkpoint_dir, after=latest))
        return latest
    path = Path(cfg.resume)
    found, what = _complete_step(path, skipped)
    if found is not None:
        return found
    raise ValueError(f"checkpoint.resume: {str(path)!r} {what}; give a complete step_NNNNNNNN directory written by a "
                     "previous run, 'auto' (latest complete one in checkpoint.dir, fresh start if none) or null")


def steps_of_other_runs(directory: str | os.PathLike, resume_path: Optional[Path], resume_step: int) -> list[Path]:
    """Step directories in ``directory`` that the saves of a run starting at ``resume_step`` from ``resume_path``
    (None: a fresh start) would mix with, oldest first.

    A fresh start, or a resume from a step directory elsewhere: every ``step_NNNNNNNN`` directory, complete or not.
    A resume from a step of ``directory``: the complete ones numbered above it (another branch of the run: resume=auto
    would take them after a crash); incomplete newer ones are passed over by resume (it names them) and replaced when
    the run reaches their step. Unfinished saves (``*.tmp``) never count: they are never resumed.
    """
    d = Path(directory)
    if not d.is_dir():
        return []
    steps = sorted((int(m.group(1)), p) for p in d.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir())
    if resume_path is None or Path(resume_path).resolve().parent != d.resolve():
        return [p for _, p in steps]
    return [p for step, p in steps if step > resume_step and verify_checkpoint(p) is None]


def claim_checkpoint_dir(directory: str | os.PathLike, *, resume_path: Optional[Path], resume_step: int,
                         overwrite: bool) -> None:
    """Refuses (ValueError, one line) a run whose saves would mix with another run's steps in ``directory``
    (:func:`steps_of_other_runs`), unless ``overwrite``: then deletes those step directories (and, for a fresh start
    or a resume from elsewhere, the unfinished ``*.tmp`` saves), each one named in a warning. Nothing else in
    ``directory`` is touched. Rank 0 calls this while it holds the directory's lock."""
    d = Path(directory)
    others = steps_of_other_runs(d, resume_path, resume_step)
    inside = resume_path is not None and Path(resume_path).resolve().parent == d.resolve()
    if others and not overwrite:
        names = ", ".join(p.name for p in others[-3:])
        names = f"{len(others)} step directories, the newest {names}" if len(others) > 3 else names
        fix = "or set checkpoint.overwrite=true to delete them first"
        if resume_path is None:
            raise ValueError(f"checkpoint.dir: {str(d)!r} already holds another run's checkpoints ({names}) and this "
                             f"run starts fresh; resume them (checkpoint.resume=auto), give this run another "
                             f"checkpoint.dir, {fix}")
        if inside:
            raise ValueError(f"checkpoint.dir: {str(d)!r} holds checkpoints newer than {Path(resume_path).name}, "
                             f"which this run resumes from ({names}), and its saves would mix with them; resume the "
                             f"newest (checkpoint.resume=auto), give this run another checkpoint.dir, {fix}")
        raise ValueError(f"checkpoint.dir: {str(d)!r} already holds another run's checkpoints ({names}) and this run "
                         f"resumes from {str(resume_path)!r}; give this run another checkpoint.dir, {fix}")
    if not overwrite:
        return
    if not inside and d.is_dir():
        others += sorted(p for p in d.iterdir() if _STEP_TMP.match(p.name) and p.is_dir())
    for path in others:
        shutil.rmtree(path)
        log.warning("checkpoint.overwrite=true: deleted %s (another run's)", path)


def _shape(size) -> str:
    return "(" + ", ".join(str(d) for d in size) + ")"


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # model.layers.N. (LLaMA, Qwen, Gemma), model.decoder.layers.N. (OPT)


def _depth_and_layout(names) -> tuple[int, frozenset]:
    """(decoder layers among parameter names, their parameters' names with the layer's number taken out): two
    models of one family differ in depth only where the second agrees."""
    matches = [(m, name) for name in names if (m := _LAYER.search(name))]
    return (len({m.group(1) for m, _ in matches}),
            frozenset(name[:m.start(1)] + "N" + name[m.end(1):] for m, name in matches))


def check_checkpoint_fits(path: str | os.PathLike, model: nn.Module, model_config: Optional[ModelConfig] = None,
                          tokenizer: Optional[str] = None) -> None:
    """ValueError naming ``path`` and the first parameter whose name or shape differs between the checkpoint
    (its DCP ``.metadata``, and its model_config.json for the fix) and ``model``. Call it with the model on the meta
    device, before any large allocation: a checkpoint of another model shape or family is refused before it costs
    memory. ``model_config`` / ``tokenizer``: this run's, so that the error names the settings that wrote the
    checkpoint where they differ (``model.vocab_size=1024 data.tokenizer=/tok``)."""
    path = Path(path)
    saved = {k[len("model."):]: v for k, v in dcp.FileSystemReader(str(path)).read_metadata()
             .state_dict_metadata.items() if k.startswith("model.")}
    fix = (f"resume with the model settings that wrote it{_settings_that_wrote(path, model_config, tokenizer)}, or "
           "start fresh: checkpoint.resume=null or another checkpoint.dir")
    state = model.state_dict()
    (depth_saved, layout_saved), (depth_model, layout_model) = _depth_and_layout(saved), _depth_and_layout(state)
    if depth_saved and depth_model and depth_saved != depth_model and layout_saved == layout_model:
        raise ValueError(f"checkpoint {str(path)!r} does not fit this model: it holds {depth_saved} layers, the model "
                         f"has {depth_model}; resume with model.num_layers={depth_saved}, or start fresh: "
                         "checkpoint.resume=null or another checkpoint.dir")
    aliases: dict[int, list[str]] = {}  # tied weights: one tensor, several names (the checkpoint may keep one)
    for name, tensor in state.items():
        aliases.setdefault(id(tensor), []).append(name)
    for name, tensor in state.items():
        entry = saved.get(name)
        if entry is None:
            if any(alias in saved for alias in aliases[id(tensor)]):
                continue
            first = next(iter(saved), None)
            held = f" (its first parameter is {first})" if first else " (it holds no model state)"
            raise ValueError(f"checkpoint {str(path)!r} does not fit this model: the model's {name} is not in the "
                             f"checkpoint{held}: a checkpoint of another model family or layout; {fix}")
        size = tuple(getattr(entry, "size", ()))
        if size != tuple(tensor.shape):
            raise ValueError(f"checkpoint {str(path)!r} does not fit this model: {name} is {_shape(size)} in the "
                             f"checkpoint but {_shape(tensor.shape)} in the model (another model shape); {fix}")
    if extra := [k for k in saved if k not in state]:
        raise ValueError(f"checkpoint {str(path)!r} does not fit this model: its {extra[0]} is not a parameter of the "
                         f"model ({len(extra)} such); {fix}")


def _settings_that_wrote(step_dir: Path, model_config: Optional[ModelConfig], tokenizer: Optional[str]) -> str:
    """" (model.vocab_size=1024 data.tokenizer=/tok)": the step's own model settings (model_config.json) where they
    differ from this run's; "" where the step has no record or nothing differs."""
    try:
        record = json.loads((step_dir / MODEL_CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return ""
    wrote, ours = record.get("model") or {}, dataclasses.asdict(model_config) if model_config is not None else {}
    differ = [f"model.{k}={v}" for k, v in wrote.items() if k != "name" and k in ours and ours[k] != v]
    source = record.get("tokenizer_source")
    if tokenizer is not None and source and source != tokenizer:
        differ.append(f"data.tokenizer={source}")
    return f" ({' '.join(differ)})" if differ else ""


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (a sync point, like a barrier)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_failed(step: int, error: BaseException, tmp: Path, *, how: str = "") -> UserError:
    """One line for a save that failed: the first rank's error, the space left on the disk (torch's writer reports
    a full disk as an 'unexpected pos' error, not ENOSPC), and that the step stays unfinished."""
    try:
        free = f"; {shutil.disk_usage(tmp.parent).free / 2**30:.2f} GiB free on the disk of {str(tmp.parent)!r}"
    except OSError:
        free = ""
    return UserError(f"checkpoint: the {how}save of step {step} failed ({_root_cause(error)}){free}; {str(tmp)!r} "
                     "is left unfinished and is never resumed")


def _root_cause(error: BaseException) -> str:
    """``Type: message`` of what made a DCP save fail (a ``CheckpointException`` wraps each rank's error)."""
    failures = getattr(error, "failures", None)
    if failures:
        rank, failure = sorted(failures.items())[0]
        cause = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {type(cause).__name__}: {cause}"
    return f"{type(error).__name__}: {error}"


class Checkpointer:
    """Saves and loads training state under ``checkpoint_dir`` (see the module docstring for the layout).

    Args:
        cfg: the checkpoint section of the config.
        checkpoint_dir: ``cfg.dir`` or ``<output_dir>/checkpoints``.
        rank: this process's global rank (rank 0 renames and prunes).
        device: the compute device (its CUDA RNG is saved).
        lock: rank 0's lock of ``checkpoint_dir``: every save first checks that it still holds it.
        pin_staging: an asynchronous save stages into page-locked memory (states on the GPU: a fast device-to-host
            copy; states already in host memory gain nothing from it).

    ``wandb_run_id`` (set by the trainer once its logger has a W&B run) is saved with every step, on rank 0.

    With ``cfg.async_save``, :meth:`save` returns once this rank's state is staged in host memory; DCP writes it in
    the background into ``step_NNNNNNNN.tmp/``, which rank 0 renames to ``step_NNNNNNNN/`` only once the write has
    finished (:meth:`poll` at every step boundary, :meth:`wait`), so a save cut short never looks complete. The next
    save, and :meth:`close` at the end of the run, wait for the one in flight.
    """

    def __init__(self, cfg: CheckpointConfig, checkpoint_dir: str | os.PathLike, *, rank: int,
                 device: torch.device, model_config: Optional[ModelConfig] = None, tokenizer: str = "bytes",
                 lock: Optional[CheckpointDirLock] = None, pin_staging: bool = False) -> None:
        self.cfg = cfg
        self.lock = lock
        self.wandb_run_id: Optional[str] = None
        self._async = AsyncSaver(pin_memory=pin_staging) if cfg.async_save else None
        self._pending: Optional[tuple[int, Path, Path]] = None  # (step, tmp, final) of the save in flight
        self.dir = Path(checkpoint_dir)
        self.rank = rank
        self.device = torch.device(device)
        self.model_config = model_config  # written into every step with the model's own config.json
        self.tokenizer = tokenizer  # 'bytes' or the run's Hugging Face tokenizer directory (copied into every step)
        self.loaded_tokens: Optional[int] = None  # the tokens a loaded checkpoint had trained on (None: not saved)
        # Read now, at setup: a tokenizer directory that goes away during the run cannot fail a save.
        self._hf_tokenizer = build_tokenizer(tokenizer) if rank == 0 and tokenizer != "bytes" else None
        # model.path's generation_config.json (its EOS ids, sampling defaults): kept with every step for the export
        source = Path(model_config.path) / GENERATION_CONFIG_FILE if model_config and model_config.path else None
        self._generation_config = source.read_text() if rank == 0 and source and source.is_file() else None

    def should_save(self, step: int, total_steps: int) -> bool:
        if self.cfg.every > 0 and step % self.cfg.every == 0:
            return True
        return self.cfg.save_final and step == total_steps

    def time_due(self, seconds_since_save: float) -> bool:
        """Whether ``checkpoint.every_minutes`` have passed (the caller agrees across ranks: clocks differ)."""
        return bool(self.cfg.every_minutes) and seconds_since_save >= 60.0 * self.cfg.every_minutes

    def save(self, step: int, *, model: nn.Module, optimizer: Stateful, scheduler: Stateful, loader: Stateful,
             tokens: Optional[int] = None) -> Path:
        """Writes ``step_NNNNNNNN/`` (all ranks call this); returns its path. Asynchronously (``cfg.async_save``) the
        directory is complete only later (:meth:`poll`, :meth:`wait`); until then it is ``step_NNNNNNNN.tmp/``.
        ``tokens``: trained on so far (:attr:`loaded_tokens` after a load)."""
        self.wait()  # the save in flight first: one at a time, each complete before the next starts
        final = self.dir / step_dir_name(step)
        tmp = final.with_name(final.name + ".tmp")
        lost = None
        if self.rank == 0:
            lost = self.lock.check() if self.lock is not None else None
            if lost is None:
                self.dir.mkdir(parents=True, exist_ok=True)
                if tmp.exists():  # left by a save that crashed (this run holds the lock): never complete, safe to clear
                    shutil.rmtree(tmp)
                tmp.mkdir()
        if (lost := _from_rank0(lost)) is not None:  # every rank stops here, none waits on the others
            raise UserError(f"checkpoint.dir: not saving step {step} into {str(self.dir)!r}: this run no longer holds "
                            f"the directory ({lost}); another run may be writing there: give each run its own "
                            "checkpoint.dir")
        # The small files first: once DCP's files are written (an asynchronous save's coordinator knows it), so are
        # every rank's.
        extra = {"step": step, "tokens": tokens, "scheduler": scheduler.state_dict(), "loader": loader.state_dict(),
                 "rng": rng_state(self.device), "wandb_run_id": self.wandb_run_id if self.rank == 0 else None}
        save_extra(extra, tmp / EXTRA_FILE.format(rank=self.rank))
        if self.rank == 0:
            self._write_model_files(tmp, model)
        state = {"model": get_model_state_dict(model), "optim": optimizer.state_dict()}
        if self._async is not None:
            self._async.start(state, str(tmp))  # returns once the state is staged in host memory
            self._pending = (step, tmp, final)
            return final
        try:
            dcp.save(state, checkpoint_id=str(tmp))
        except (Exception, CheckpointException) as e:  # a full disk, a vanished mount: the step stays *.tmp
            raise save_failed(step, e, tmp) from e
        _barrier()  # every rank's files are in tmp
        if self.rank == 0:
            self._complete(step, tmp, final)
        _barrier()  # nobody reads the directory before the rename
        return final

    def poll(self) -> None:
        """At a step boundary: an asynchronous save that has finished becomes complete now (rank 0 renames it);
        its error, if it failed, is raised. No collective: each rank looks at its own save only."""
        if self._async is not None and self._async.done():
            self._finish_pending()

    def wait(self) -> None:
        """Waits for the asynchronous save in flight, if any, and makes it complete (its error is raised)."""
        if self._async is not None and self._async.in_flight:
            if self.rank == 0 and not self._async.done():
                log.info("waiting for the asynchronous save of step %d to finish", self._pending[0])
            self._finish_pending()

    def close(self) -> None:
        """The end of the run: waits for the save in flight (complete afterwards), frees the staging copy."""
        if self._async is not None:
            try:
                self.wait()
            finally:
                self._async.close()
                self._async = None

    def _finish_pending(self) -> None:
        step, tmp, final = self._pending
        self._pending = None
        try:
            self._async.result()
        except (Exception, CheckpointException) as e:  # (a BaseException) the save stays *.tmp: never resumed
            raise save_failed(step, e, tmp, how="asynchronous ") from e
        if self.rank == 0:  # the coordinator's save has finished: every rank's files are written
            self._complete(step, tmp, final)

    def _complete(self, step: int, tmp: Path, final: Path) -> None:
        """Rank 0: ``tmp`` (every rank's files written) becomes ``final``; older steps beyond keep_last go."""
        if final.exists():  # same step saved before (an earlier run in this dir): replace it
            stale = final.with_name(final.name + ".replaced.tmp")
            if stale.exists():
                shutil.rmtree(stale)
            os.rename(final, stale)
            os.rename(tmp, final)
            shutil.rmtree(stale)
        else:
            os.rename(tmp, final)
        self._prune(step)
        log.info("saved checkpoint %s", final)


    def _write_model_files(self, step_dir: Path, model: nn.Module) -> None:
        """What rebuilds the model from this step alone: config.json, model_config.json, tokenizer/ (and model.path's
        generation_config.json)."""
        model.config.to_json_file(step_dir / HF_CONFIG_FILE)
        tokenizer = "bytes"
        if self._hf_tokenizer is not None:
            self._hf_tokenizer.save_pretrained(step_dir / TOKENIZER_DIR)
            tokenizer = TOKENIZER_DIR
        if self._generation_config is not None:
            (step_dir / GENERATION_CONFIG_FILE).write_text(self._generation_config)
        record = {"model": dataclasses.asdict(self.model_config) if self.model_config is not None else None,
                  "tokenizer": tokenizer, "tokenizer_source": self.tokenizer}
        (step_dir / MODEL_CONFIG_FILE).write_text(json.dumps(record, indent=2) + "\n")

    def _prune(self, step: int) -> None:
        # Only steps up to the one just saved: newer-numbered directories (another run's, or an incomplete one
        # that resume skipped) never push the new checkpoint out.
        checkpoints = [c for c in list_checkpoints(self.dir) if c[0] <= step]
        for _, path in checkpoints[: max(0, len(checkpoints) - self.cfg.keep_last)]:
            shutil.rmtree(path)
            log.info("deleted old checkpoint %s (checkpoint.keep_last=%d)", path, self.cfg.keep_last)

    def load(self, path: str | os.PathLike, *, model: nn.Module, optimizer: Stateful, scheduler: Stateful,
             loader: Stateful) -> int:
        """Restores everything saved by :meth:`save` (all ranks call this); returns the step."""
        path = Path(path)
        extra_file = path / EXTRA_FILE.format(rank=self.rank)
        same_world = extra_file.is_file()
        if not same_world:  # saved on fewer ranks: step, scheduler and loader are the same on every rank
            extra_file = path / EXTRA_FILE.format(rank=0)
        extra = read_extra(extra_file)
        # The loader first: a run with other data settings is refused in one line before the model's bytes are read.
        loader.load_state_dict(extra["loader"])
        state = {"model": get_model_state_dict(model), "optim": optimizer.state_dict()}
        try:
            dcp.load(state, checkpoint_id=str(path))  # in place, into this run's shards
        except Exception as e:  # damaged past what verify_checkpoint sees (bytes changed, not cut short)
            first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise ValueError(f"checkpoint {str(path)!r} cannot be loaded ({type(e).__name__}: {first}); resume from "
                             "another step directory, or start fresh: checkpoint.resume=null") from e
        set_model_state_dict(model, state["model"])
        configured = scheduler.configured() if hasattr(scheduler, "configured") else None
        optimizer.load_state_dict(state["optim"])
        scheduler.load_state_dict(extra["scheduler"])
        if configured is not None and (changed := scheduler.reapply(configured)) and self.rank == 0:
            log.warning("resumed with other optimizer settings than the checkpoint's: %s (this run's apply; the "
                        "schedule goes on from the checkpoint's step)", ", ".join(changed))
        if same_world:
            set_rng_state(extra["rng"], self.device)
        elif self.rank == 0:
            log.warning("checkpoint %s was saved on another world size: RNG states are not restored", path)
        self.loaded_tokens = extra.get("tokens")
        return int(extra["step"])
