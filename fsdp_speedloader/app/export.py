"""A training checkpoint as a model: load it into a (sharded) model, or export it to a Hugging Face directory.

    python -m fsdp_speedloader.app.export checkpoint=outputs/DATE/TIME/checkpoints out=my_model
    python -m fsdp_speedloader.app.export checkpoint=ckpt/step_00000200 out=my_model max_shard_size=2GB dtype=bfloat16
    fsdp-speedloader-export checkpoint=ckpt out=my_model                  # the console script: the same entry

``checkpoint`` is a ``step_NNNNNNNN`` directory the trainer wrote, or the directory holding them (its newest
complete step, as ``checkpoint.resume`` finds it: ``app/checkpoint.py``). A step carries the model's
``config.json``, the run's ``model_config.json`` and its tokenizer's files, so nothing else is needed.

The export writes ``config.json`` and ``generation_config.json``, whose special tokens are the run's tokenizer's (the
byte tokenizer's end of sequence is 256: Hugging Face's ``generate`` on the export stops there), the weights as
safetensors (``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json``
above ``max_shard_size``) and the run's tokenizer files (none for the built-in byte tokenizer);
``AutoModelForCausalLM.from_pretrained(out)`` loads it. It runs in one process, whatever the number of ranks that
wrote the checkpoint (DCP reads any sharding), and reads the model's weights only, never the optimizer state.

Host memory: one output shard at a time. The tensors of one shard are allocated (in the export dtype), filled
by DCP, which reads one saved chunk at a time (one rank's part of one tensor), streamed into the shard's file,
and freed before the next shard's are allocated: the peak is about ``max_shard_size`` (or the largest tensor, if
larger) plus one saved chunk.

A non-empty ``out`` is refused before anything is read, unless ``overwrite=true``, which replaces the files an
export writes (an earlier export's shards, index and tokenizer files are removed) and deletes nothing else.

Python (the generation CLI, ``app/generate.py``, loads a checkpoint the same way)::

    from fsdp_speedloader.app.export import export_checkpoint, open_checkpoint
    export_checkpoint("ckpt", "my_model", max_shard_size="2GB")
    ckpt = open_checkpoint("ckpt")          # the newest complete step: ckpt.model (a ModelConfig), ckpt.tokenizer
    model = ckpt.build_model()              # the trained model, unsharded, on the CPU
    # sharded: build_model(ckpt.model, device="meta"), shard it (apply_speedloader / apply_fsdp), then
    # ckpt.materialize(model, device=...), on every rank

Config: ``conf/export.yaml``, converted once into ``ExportConfig``. On the command line of this entry and of
generation, ``checkpoint=PATH`` is the key ``checkpoint_path`` (:func:`checkpoint_path_overrides`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import shutil
import struct
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from transformers import AutoModelForCausalLM, GenerationConfig

from fsdp_speedloader.app.checkpoint import GENERATION_CONFIG_FILE, HF_CONFIG_FILE, MODEL_CONFIG_FILE, \
    resolve_checkpoint
from fsdp_speedloader.app.config import TOKENIZER_FILES
from fsdp_speedloader.app.data import build_tokenizer
from fsdp_speedloader.app.launch import check_writable_dir, config_path, fail, launch, resolved_config, world_size
from fsdp_speedloader.app.runtime import DTYPES
from fsdp_speedloader.engine.speedloader import speedloader_engine
from fsdp_speedloader.models import ModelConfig, build_hf_config, build_model, materialize_model
from fsdp_speedloader.validation import check, check_choice, dataclass_from_dict

log = logging.getLogger("fsdp_speedloader.app.export")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_SHARD_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
# The files a Hugging Face tokenizer's save_pretrained writes (the fast and slow formats of the families here): an
# earlier export's, left beside a model with another vocabulary, or none, would load as this model's tokenizer.
TOKENIZER_FILE_NAMES = (*TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                        "vocab.txt", "spiece.model", "chat_template.jinja", "chat_template.json")
# DCP keys of the model's state in a training checkpoint: "model." + the parameter's name (Checkpointer.save).
_MODEL_PREFIX = "model."


# ---------------------------------------------------------------------------------------------
# A checkpoint as a model
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainingCheckpoint:
    """One complete step of a training run (:func:`open_checkpoint`)."""

    step_dir: Path
    """The ``step_NNNNNNNN`` directory."""
    model: ModelConfig
    """The trained model: ``path`` is the step directory (its config.json: the architecture); name, family and
    attention kernel are the run's. Build it with ``build_model(ckpt.model, device="meta")``."""
    tokenizer: str
    """'bytes' or the directory of the run's Hugging Face tokenizer files (inside the step)."""

    @property
    def step(self) -> int:
        return int(self.step_dir.name.split("_")[-1]) if self.step_dir.name.startswith("step_") else -1

    @torch.no_grad()
    def load_weights(self, model: nn.Module) -> None:
        """Loads the trained weights into ``model``: materialised, sharded with FSDP2 or not, in any dtype. Only
        the model's entries are read (not the optimizer state). With a process group, every rank calls it."""
        state = get_model_state_dict(model)  # this rank's shards, loaded in place
        with _quiet_dcp():
            dcp.load({"model": state}, checkpoint_id=str(self.step_dir), no_dist=not dist.is_initialized())
        set_model_state_dict(model, state)
        if (engine := speedloader_engine(model, missing_ok=True)) is not None:
            engine.refresh_param_transfer(force=True)  # the transfer copies of the loaded shards

    def materialize(self, model: nn.Module, *, device: torch.device,
                    param_device: Optional[torch.device] = None) -> None:
        """``materialize_model`` for a (sharded) model built on ``meta`` from ``self.model``, then the trained
        weights (allocated only: the strict load overwrites every parameter)."""
        materialize_model(model, self.model, device=device, seed=0, param_device=param_device, fill=False)
        self.load_weights(model)

    def build_model(self, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
        """The trained model, unsharded, in ``dtype`` on ``device``, in eval mode (one process holds all of it); its
        config and generation config carry the run's tokenizer's special tokens, as the export's do."""
        model = build_model(self.model, device="meta").to(dtype)
        self.materialize(model, device=torch.device(device))
        special = special_token_ids(build_tokenizer(self.tokenizer))
        for name, value in special.items():
            setattr(model.config, name, value)
        model.generation_config = special_generation_config(special, self.step_dir)
        return model.eval()


def open_checkpoint(path: str | Path) -> TrainingCheckpoint:
    """The checkpoint at ``path`` (a step directory, or the newest complete step in a checkpoint directory);
    ValueError naming the path when there is none or it does not carry its model config."""
    step_dir = resolve_checkpoint(path)
    record_file = step_dir / MODEL_CONFIG_FILE
    if not record_file.is_file() or not (step_dir / HF_CONFIG_FILE).is_file():
        raise ValueError(f"checkpoint: {step_dir} has no {MODEL_CONFIG_FILE} / {HF_CONFIG_FILE}: it was written "
                         "before checkpoints carried their model; resume it for one step (checkpoint.resume=PATH, "
                         "the same model group) to write one that does")
    record = json.loads(record_file.read_text())
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    run_model = {k: v for k, v in (record.get("model") or {}).items() if k in known}
    model = ModelConfig(**{**run_model, "path": str(step_dir)})
    tokenizer = record.get("tokenizer", "bytes")
    return TrainingCheckpoint(step_dir=step_dir, model=model,
                              tokenizer="bytes" if tokenizer == "bytes" else str(step_dir / tokenizer))


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    """DCP warns on every single-process load that it assumes a single process: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# ---------------------------------------------------------------------------------------------
# Export to a Hugging Face directory
# ---------------------------------------------------------------------------------------------


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes of ``size``: an integer, or a number with a unit as Hugging Face writes them ('5GB' = 5e9, '2GiB')."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    if match is None or match.group(2).upper() not in _SIZE_UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"max_shard_size: got {size!r}; give a positive size such as 5GB, 500MB, 2GiB or a number "
                         "of bytes")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Writes ``tensors`` (CPU) as one safetensors file, streaming each tensor's bytes from its own storage
    (``safetensors.torch.save_file`` first copies every tensor into a ``bytes``: twice the shard in memory)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        end = offset + t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in tensors.values():
            f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Names in order, cut into shards of at most ``max_bytes`` (a larger tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name, size in sizes:
        if shards[-1] and filled + size > max_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += size
    return shards


def _export_names(model: nn.Module) -> list[str]:
    """The state-dict keys Hugging Face saves: each tied parameter once, under its first name
    (``from_pretrained`` ties the others again)."""
    first: dict[int, str] = {}
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied.add(name)
        else:
            first[id(param)] = name
    return [name for name in model.state_dict() if name not in tied]


def check_out_dir(out: Path, *, overwrite: bool) -> None:
    """Refuses a file, or a non-empty directory without ``overwrite``: nothing of the user's is ever replaced
    unasked."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"out: {out} is a file; give a directory (new or empty)")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"out: {out} is not empty; give a new or empty directory, or overwrite=true to write into "
                         "it (an earlier export's files are replaced, nothing else is deleted)")
    check_writable_dir(out, "out")  # a parent that is a file, or no permission: before anything is read


def special_token_ids(tokenizer) -> dict[str, Optional[int]]:
    """``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` of the run's tokenizer (the byte tokenizer has an EOS
    only): what the export's config.json and generation_config.json must say, not the config class's defaults
    (LlamaConfig's eos 2 is another token of any tokenizer here, and Hugging Face's generate stops at it)."""
    return {name: getattr(tokenizer, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}


def special_generation_config(special: dict[str, Optional[int]], step_dir: Optional[Path] = None) -> GenerationConfig:
    """Hugging Face's generation config of :func:`special_token_ids`: without a pad token, finished sequences are
    padded with the EOS, as app/generate.py pads them. With ``step_dir``'s copy of model.path's own generation
    config, that one (its sampling defaults, and its EOS ids where they include the tokenizer's: an instruct
    model's several end tokens), its missing pad token filled in."""
    pad = special["pad_token_id"] if special["pad_token_id"] is not None else special["eos_token_id"]
    ours = GenerationConfig(**{**special, "pad_token_id": pad})
    if step_dir is None or not (step_dir / GENERATION_CONFIG_FILE).is_file():
        return ours
    source = GenerationConfig.from_pretrained(step_dir)
    eos = source.eos_token_id if isinstance(source.eos_token_id, list) else [source.eos_token_id]
    if special["eos_token_id"] in eos:  # the source's special tokens are this tokenizer's: kept
        if source.pad_token_id is None:
            source.pad_token_id = ours.pad_token_id
    else:  # trained with another tokenizer: the source's ids would name other tokens
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            setattr(source, name, getattr(ours, name))
    return source


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, max_shard_size: int | str = "5GB",
                      dtype: Optional[str] = None, overwrite: bool = False) -> Path:
    """Writes the training checkpoint ``checkpoint`` (a step directory, or the newest complete step in a
    checkpoint directory) to ``out`` as a Hugging Face model directory; returns ``out``.

    Args:
        max_shard_size: bytes (or '5GB', '2GiB', ...) per safetensors file; more makes an index. Host memory
            holds about one such file at a time.
        dtype: 'float32', 'bfloat16' or 'float16'; None keeps the checkpoint's (the fp32 master weights).
        overwrite: write into a non-empty ``out`` (replacing an earlier export's files).
    """
    out = Path(out)
    max_bytes = parse_size(max_shard_size)
    if dtype is not None:
        check_choice(dtype, "dtype", tuple(DTYPES))
    check_out_dir(out, overwrite=overwrite)  # before anything is read
    ckpt = open_checkpoint(checkpoint)
    if out.resolve() == ckpt.step_dir.resolve() or ckpt.step_dir.resolve() in out.resolve().parents:
        raise ValueError(f"out: {out} is inside the checkpoint {ckpt.step_dir}; give a directory outside it")
    special = special_token_ids(build_tokenizer(ckpt.tokenizer))

    hf_config = build_hf_config(ckpt.model)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    names = _export_names(skeleton)
    saved = {key[len(_MODEL_PREFIX):]: md for key, md in FileSystemReader(ckpt.step_dir).read_metadata()
             .state_dict_metadata.items() if key.startswith(_MODEL_PREFIX) and isinstance(md, TensorStorageMetadata)}
    missing = [n for n in names if n not in saved]
    if missing:
        raise ValueError(f"checkpoint: {ckpt.step_dir} lacks {len(missing)} weight(s) of its {hf_config.model_type} "
                         f"model, e.g. {missing[:3]}")
    target = {n: DTYPES[dtype] if dtype is not None else saved[n].properties.dtype for n in names}
    sizes = [(n, saved[n].size.numel() * target[n].itemsize) for n in names]
    shards = plan_shards(sizes, max_bytes)

    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():  # an earlier export's weights and tokenizer (only with overwrite: else out was empty)
        if old.name in (SINGLE_FILE, INDEX_FILE, *TOKENIZER_FILE_NAMES) or _SHARD_FILE.match(old.name):
            old.unlink()
    files = [SINGLE_FILE] if len(shards) == 1 else \
        [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map = {}
    reader_path = str(ckpt.step_dir)
    for file, shard in zip(files, shards):
        # One shard's tensors at a time: allocated, filled by DCP (any sharding, any dtype), written, freed.
        tensors = {n: torch.empty(tuple(saved[n].size), dtype=target[n]) for n in shard}
        with _quiet_dcp():
            dcp.load({"model": tensors}, storage_reader=FileSystemReader(reader_path), no_dist=True)
        write_safetensors(out / file, tensors)
        del tensors
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(size for _, size in sizes)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    if ckpt.tokenizer != "bytes":
        for f in Path(ckpt.tokenizer).iterdir():
            if f.is_file():
                shutil.copy2(f, out / f.name)
    special_generation_config(special, ckpt.step_dir).save_pretrained(out)
    for name, value in special.items():
        setattr(hf_config, name, value)
    hf_config.architectures = [type(skeleton).__name__]
    hf_config.dtype = next(iter(target.values()))
    hf_config.save_pretrained(out)  # last: an interrupted export has no config.json
    # the architecture, not the model group's name: a run from model.path keeps the group's default name
    log.info("exported %s (%s) to %s: %d file(s), %.1f MB%s", ckpt.step_dir, hf_config.architectures[0], out,
             len(shards), total / 1e6,
             ", tokenizer" if ckpt.tokenizer != "bytes" else ", no tokenizer (the run used bytes)")
    return out


# ---------------------------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------------------------


def checkpoint_path_overrides(argv: list[str]) -> list[str]:
    """``checkpoint=PATH`` -> ``checkpoint_path=PATH``: conf/ holds the training config group ``checkpoint``, which
    Hydra would take ``checkpoint=PATH`` for ("No match in the defaults list"); export and generation mean the
    checkpoint to load."""
    return ["checkpoint_path=" + a[len("checkpoint="):] if a.startswith("checkpoint=") else a for a in argv]


@dataclass
class ExportConfig:
    """One export (``conf/export.yaml``)."""

    checkpoint_path: Optional[str] = None
    """A step_NNNNNNNN directory, or the checkpoint directory holding them (its newest complete step);
    ``checkpoint=PATH`` on the command line."""
    out: Optional[str] = None
    """The Hugging Face directory to write: new or empty, unless overwrite."""
    max_shard_size: str = "5GB"
    """Bytes per safetensors file ('5GB' = 5e9, '2GiB', or a number); more makes an index."""
    dtype: Optional[str] = None
    """'float32', 'bfloat16' or 'float16'; null keeps the checkpoint's (fp32 master weights)."""
    overwrite: bool = False
    """Write into a non-empty out (an earlier export's files are replaced, nothing else is deleted)."""
    output_dir: str = "outputs"
    """Run directory (the Hydra entry sets it: its log)."""

    def __post_init__(self) -> None:
        check(bool(self.checkpoint_path), "checkpoint", "give checkpoint=<step_NNNNNNNN dir or the checkpoint dir>")
        check(bool(self.out), "out", "give out=<the Hugging Face directory to write>")
        parse_size(self.max_shard_size)
        if self.dtype is not None:
            check_choice(self.dtype, "dtype", tuple(DTYPES))

    @classmethod
    def from_dict(cls, d: dict) -> "ExportConfig":
        """Builds a validated config from a plain nested dict (e.g. ``OmegaConf.to_container``)."""
        if isinstance(d.get("max_shard_size"), int):  # max_shard_size=1000000 on the command line: bytes
            d = {**d, "max_shard_size": str(d["max_shard_size"])}
        return dataclass_from_dict(cls, d)


def run(cfg: ExportConfig) -> Path:
    if world_size() > 1:
        raise ValueError("export runs in one process (it reads any checkpoint there): run it with python, "
                         "not torchrun")
    return export_checkpoint(cfg.checkpoint_path, cfg.out, max_shard_size=cfg.max_shard_size, dtype=cfg.dtype,
                             overwrite=cfg.overwrite)


def main() -> None:
    """Console script ``fsdp-speedloader-export``; also ``python -m fsdp_speedloader.app.export``."""
    import hydra
    from omegaconf import DictConfig

    @hydra.main(config_path=config_path(), config_name="export", version_base="1.3")
    def _hydra_main(dcfg: DictConfig) -> None:
        try:
            run(ExportConfig.from_dict(resolved_config(dcfg)))
        except ValueError as e:  # a user error: one line, no traceback
            fail(e)

    sys.argv[1:] = checkpoint_path_overrides(sys.argv[1:])
    launch(_hydra_main, config_name="export")


if __name__ == "__main__":
    main()
