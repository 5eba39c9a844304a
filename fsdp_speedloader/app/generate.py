"""``python -m fsdp_speedloader.app.generate``: prompts in, generations (jsonl) and throughput out.

One process (CPU, or one GPU)::

    python -m fsdp_speedloader.app.generate model=opt_tiny logger=none
    python -m fsdp_speedloader.app.generate model=llama_tiny prompts.path=prompts.txt   # a file: prompts.source=file
    python -m fsdp_speedloader.app.generate model=llama_tiny prompts.text='[Once upon a time,Hello]'  # given here
    python -m fsdp_speedloader.app.generate model=opt_30b offload=params prompts.num_prompts=64 \\
        prompts.prompt_len=512 max_new_tokens=32 num_sub_batches=4 max_gpu_memory_gib=24

Several GPUs (weights sharded; every rank generates its share of the prompts)::

    torchrun --standalone --nproc-per-node 8 -m fsdp_speedloader.app.generate model=opt_175b offload=params

From what a training run saved (a step directory, or the checkpoint directory: its newest complete step); the
model and the tokenizer come from the checkpoint, the ``model`` group is ignored (``app/export.py``)::

    python -m fsdp_speedloader.app.generate checkpoint=outputs/DATE/TIME/checkpoints prompts.path=prompts.txt

Config: ``conf/generate.yaml`` (the ``model``, ``offload`` and ``logger`` groups are the training
ones). Converted once into ``GenerateConfig``; the library sees typed objects only. Hydra and W&B
are imported by this entry only (W&B through ``logger.build_logger``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp_speedloader import parallel
from fsdp_speedloader.app.config import LoggerConfig, OffloadConfig, default_tokenizer
from fsdp_speedloader.app.data import build_tokenizer, tokenizer_difference
from fsdp_speedloader.app.export import checkpoint_path_overrides, open_checkpoint, special_generation_config, \
    special_token_ids
from fsdp_speedloader.app.jsonl import JsonLineError, json_line_text
from fsdp_speedloader.app.launch import config_path, fail, launch, rank, resolved_config
from fsdp_speedloader.app.launch import rank as launch_rank
from fsdp_speedloader.app.logger import StepProgress, build_logger, check_wandb_credentials, logged_model, \
    progress_bar_enabled
from fsdp_speedloader.app.runtime import DTYPES, maybe_cap_gpu_memory, resolve_device_type, resolve_param_dtype
from fsdp_speedloader.engine.speedloader import apply_speedloader
from fsdp_speedloader.generation.generate import generate
from fsdp_speedloader.generation.kv_cache import KV_CACHE_MODES
from fsdp_speedloader.generation.weight_stream import DEQUANTIZE_MODES
from fsdp_speedloader.memory.arena import GIB, LIMIT_ENV, HostMemoryBudget
from fsdp_speedloader.models import ModelConfig, build_hf_config, build_model, materialize_model
from fsdp_speedloader.models.config import MOE_FAMILIES
from fsdp_speedloader.options import SpeedLoaderOptions
from fsdp_speedloader.quant import KV_CACHE_DTYPES, WEIGHT_FORMATS, materialize_quantized_weights, quantize_linears_, \
    weight_format
from fsdp_speedloader.validation import check, check_choice, check_positive, dataclass_from_dict, dtype_choice

log = logging.getLogger("fsdp_speedloader.app.generate")

@dataclass
class PromptsConfig:
    """Where prompts come from."""

    source: Optional[str] = None
    """'synthetic' (random token ids), 'file' (.txt: one prompt per line; .jsonl: one object per line) or 'text'
    (``text``); null: 'file' when ``path`` is given, 'text' when ``text`` is, else 'synthetic'."""
    path: Optional[str] = None
    """The prompt file (source 'file')."""
    text: Optional[list] = None
    """The prompts themselves (source 'text'): ``prompts.text='[Once upon a time,The capital of France is]'``, or
    one: ``prompts.text=Hello``."""
    text_field: str = "text"
    """Field of each .jsonl object that holds the prompt."""
    num_prompts: int = 8
    """Synthetic: number of prompts (all ranks together)."""
    prompt_len: int = 32
    """Synthetic: tokens per prompt (the longest, with min_prompt_len)."""
    min_prompt_len: Optional[int] = None
    """Synthetic: when set, prompt lengths are drawn from [min_prompt_len, prompt_len] and left-padded."""

    def __post_init__(self) -> None:
        check(not (self.path and self.text), "prompts.text",
              f"give the prompts as prompts.text or in a file (prompts.path={self.path}), not both")
        if self.source is None:  # prompts.path=FILE alone means the file, not random prompts beside it
            self.source = "file" if self.path else "text" if self.text else "synthetic"
        check_choice(self.source, "prompts.source", ("synthetic", "file", "text"))
        check(self.source == "file" or not self.path, "prompts.path",
              f"prompts.source={self.source} reads no file; drop prompts.path={self.path} or "
              f"prompts.source={self.source}")
        check(self.source == "text" or not self.text, "prompts.text",
              f"prompts.source={self.source} reads no prompts.text; drop prompts.text or prompts.source={self.source}")
        if self.source == "text":
            check(bool(self.text) and all(isinstance(t, str) and t for t in self.text), "prompts.text",
                  f"got {self.text!r}; give a list of non-empty prompts: prompts.text='[Once upon a time,Hello]' "
                  "(quote a prompt holding a comma: prompts.text='[\"Hello, world\"]')")
        check_positive(self.num_prompts, "prompts.num_prompts")
        check_positive(self.prompt_len, "prompts.prompt_len")
        if self.min_prompt_len is not None:
            check(isinstance(self.min_prompt_len, int) and 1 <= self.min_prompt_len <= self.prompt_len,
                  "prompts.min_prompt_len", f"got {self.min_prompt_len!r}; use 1..prompts.prompt_len or null")
        if self.source == "file":
            check(bool(self.path), "prompts.path", "prompts.source=file needs prompts.path=<.txt or .jsonl file>")


@dataclass
class SamplingConfig:
    """Greedy by default."""

    do_sample: bool = False
    """Sample instead of taking the most likely token."""
    temperature: float = 1.0
    """Softmax temperature (sampling)."""
    top_k: Optional[int] = None
    """Keep the k most likely tokens (sampling); null: all."""
    top_p: Optional[float] = None
    """Nucleus sampling mass (sampling); null: 1."""

    def __post_init__(self) -> None:
        # temperature=0 is a common way to say greedy: taken as such without sampling
        check(self.temperature > 0 or (self.temperature == 0 and not self.do_sample), "sampling.temperature",
              f"got {self.temperature}; must be > 0 with sampling.do_sample=true (0 or do_sample=false: greedy)")
        if self.top_k is not None:
            check_positive(self.top_k, "sampling.top_k")
        if self.top_p is not None:
            check(0 < self.top_p <= 1, "sampling.top_p", f"got {self.top_p}; use (0, 1] or null")
        unused = [f"sampling.{name}={value}" for name, value, default in
                  (("temperature", self.temperature, (0, 1.0)), ("top_k", self.top_k, (None,)),
                   ("top_p", self.top_p, (None,))) if value not in default]
        if unused and not self.do_sample:  # Hugging Face's generate warns alike
            log.warning("%s appl%s only with sampling.do_sample=true: this run decodes greedily", ", ".join(unused),
                        "ies" if len(unused) == 1 else "y")


@dataclass
class GenerateConfig:
    """One generation run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    checkpoint_path: Optional[str] = None
    """A training checkpoint (a step_NNNNNNNN directory, or the checkpoint directory: its newest complete step;
    ``checkpoint=PATH`` on the command line): the model and its trained weights come from it, and the model group
    is ignored; null: the model group."""
    tokenizer: Optional[str] = None
    """'bytes' or a local Hugging Face tokenizer directory (prompts from files; decoding the output); null: the
    training checkpoint's tokenizer, else ``model.path``'s own where that directory holds one, else 'bytes'."""
    max_new_tokens: int = 32
    """New tokens per prompt."""
    num_sub_batches: int = 2
    """N: each unit is loaded once per step for N sub-batches (prompts per rank must divide by it)."""
    blocks_per_unit: int = 1
    """Consecutive blocks per FSDP unit."""
    kv_cache: str = "auto"
    """'auto', 'device', 'split', 'host' or 'off' (recompute the prefix every step)."""
    kv_device_sub_batches: Optional[int] = None
    """With kv_cache 'split': sub-batches whose cache stays on the GPU (null: as many as fit)."""
    cpu_attention_sub_batches: int = 0
    """With kv_cache 'host' or 'split': host sub-batches whose decoding attention runs on the CPU."""
    kv_cache_dtype: Optional[str] = None
    """null (the compute dtype), 'int8' or 'fp8': the host part of a 'host' or 'split' KV cache in 8 bits."""
    weight_quant: Optional[str] = None
    """null (the compute dtype), 'int8' or 'int4': the blocks' linear weights kept group-wise quantized (host
    memory with offload=params, else the GPU), quantized while loading, dequantized on the GPU unit by unit."""
    weight_quant_group_size: Optional[int] = None
    """Elements per scale of weight_quant; null: 128 for int8, 64 for int4."""
    weight_dequantize: str = "auto"
    """With weight_quant, how a unit dequantizes for the prefill's sub-batches: 'unit' (once for all), 'linear'
    (each linear when it runs: less GPU memory, N times the work) or 'auto' (unit when it fits)."""
    activation_store: str = "auto"
    """Block-boundary activations between units: 'auto', 'device' or 'host'."""
    forward_prefetch: int = 1
    """Units whose unshard is issued ahead."""
    show_generations: Optional[int] = 3
    """Prompts (the first ones) whose text and completion rank 0 prints on the console; null (``all`` on the command
    line): every one; 0: none. generations.jsonl holds them all either way."""
    stop_at_eos: bool = True
    """Stop a sequence at the tokenizer's EOS and at the other end ids of the model's generation_config.json
    (synthetic prompts never stop early)."""
    warmup: bool = True
    """Run a 2-token generation first, so the timed run excludes lazy init and page-locking."""
    seed: int = 0
    """Seed of the weights (when initialised), synthetic prompts and sampling."""
    device: str = "auto"
    """'auto' (cuda when available), 'cuda' or 'cpu'."""
    param_dtype: str = "auto"
    """Dtype the weights are stored and computed in: 'auto' (bfloat16 on cuda, float32 on cpu) or a dtype."""
    dp_replicate: int = 1
    """HSDP replicas (nodes); 1: plain FSDP over all ranks."""
    max_gpu_memory_gib: Optional[float] = None
    """Cap this process's GPU memory (emulates a smaller card)."""
    host_memory_limit_gib: Optional[float] = None
    """Host budget of the KV arena; null: detected."""
    output_file: str = "generations.jsonl"
    """Written in output_dir by rank 0: one line per prompt."""
    output_dir: str = "outputs"
    """Run directory (the Hydra entry sets it)."""

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "num_sub_batches", "blocks_per_unit", "dp_replicate"):
            check_positive(getattr(self, name), name)
        check_positive(self.forward_prefetch, "forward_prefetch", allow_zero=True)
        if self.show_generations is not None:
            check_positive(self.show_generations, "show_generations", allow_zero=True)
        check_choice(self.kv_cache, "kv_cache", KV_CACHE_MODES)
        if self.kv_device_sub_batches is not None:
            check(self.kv_cache == "split", "kv_device_sub_batches", "applies to kv_cache=split only")
            check(1 <= self.kv_device_sub_batches < self.num_sub_batches, "kv_device_sub_batches",
                  f"must be 1 .. num_sub_batches - 1 = {self.num_sub_batches - 1}")
        check_positive(self.cpu_attention_sub_batches, "cpu_attention_sub_batches", allow_zero=True)
        if self.cpu_attention_sub_batches:
            check(self.kv_cache in ("host", "split"), "cpu_attention_sub_batches", "needs kv_cache=host or split")
            host = self.num_sub_batches - (self.kv_device_sub_batches or 0)
            check(self.cpu_attention_sub_batches <= host, "cpu_attention_sub_batches",
                  f"must be at most the {host} sub-batches whose cache is on the host")
        if self.kv_cache_dtype is not None:
            check_choice(self.kv_cache_dtype, "kv_cache_dtype", KV_CACHE_DTYPES)
            check(self.kv_cache != "off", "kv_cache_dtype",
                  "stores the KV cache in 8 bits; kv_cache=off stores none: choose auto, device, split or host")
        if self.weight_quant is not None:
            check_choice(self.weight_quant, "weight_quant", WEIGHT_FORMATS)
            weight_format(self.weight_quant, self.weight_quant_group_size)  # a bad group size fails here
            check(self.checkpoint_path is None, "weight_quant",
                  "quantizes while loading from model.path (a Hugging Face directory) or a seeded initialisation; a "
                  "training checkpoint holds its linears unquantized in its own format: export it first "
                  "(python -m fsdp_speedloader.app.export checkpoint=... out=DIR) and pass model.path=DIR")
            check(self.model.family not in MOE_FAMILIES, "weight_quant",
                  f"covers dense models; {self.model.family}'s experts are stacked parameters, not linears")
        else:
            check(self.weight_quant_group_size is None, "weight_quant_group_size", "applies to weight_quant only")
            check(self.weight_dequantize == "auto", "weight_dequantize", "applies to weight_quant only")
        check_choice(self.weight_dequantize, "weight_dequantize", DEQUANTIZE_MODES)
        check_choice(self.activation_store, "activation_store", ("auto", "device", "host"))
        check_choice(self.device, "device", ("auto", "cuda", "cpu"))
        self.param_dtype = dtype_choice(self.param_dtype, "param_dtype", ("auto", *DTYPES))
        if self.max_gpu_memory_gib is not None:
            check(self.max_gpu_memory_gib > 0, "max_gpu_memory_gib", "must be > 0 (or null for no cap)")
        if self.host_memory_limit_gib is not None:
            check(self.host_memory_limit_gib > 0, "host_memory_limit_gib", "must be > 0 (or null: detected)")
        if self.prompts.source == "synthetic" and self.checkpoint_path is None:  # a checkpoint's model: checked in run()
            check(self.prompts.prompt_len + self.max_new_tokens <= self.model.max_position_embeddings
                  or self.model.path is not None, "max_new_tokens",
                  f"prompts.prompt_len {self.prompts.prompt_len} + max_new_tokens {self.max_new_tokens} exceeds "
                  f"model.max_position_embeddings={self.model.max_position_embeddings}")

    @classmethod
    def from_dict(cls, d: dict) -> "GenerateConfig":
        """Builds a validated config from a plain nested dict (e.g. ``OmegaConf.to_container``)."""
        if d.get("show_generations") == "all":  # show_generations=all on the command line: every prompt
            d = {**d, "show_generations": None}
        prompts = d.get("prompts")
        if isinstance(prompts, dict) and isinstance(prompts.get("text"), str):  # prompts.text=Hello: one prompt
            d = {**d, "prompts": {**prompts, "text": [prompts["text"]]}}
        return dataclass_from_dict(cls, d)

    def speedloader_options(self) -> SpeedLoaderOptions:
        """The engine's options of this run (generation keeps no fp32 master weights: no mixed precision)."""
        return SpeedLoaderOptions(num_sub_batches=self.num_sub_batches, blocks_per_unit=self.blocks_per_unit,
                                  activation_store=self.activation_store, offload_params=self.offload.params,
                                  pin_memory=self.offload.pin_memory, forward_prefetch=self.forward_prefetch)


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------


def read_prompt_file(path: str, text_field: str = "text") -> list[str]:
    """Prompts of a .txt (one per line) or .jsonl (``text_field`` of each object) file. Output k answers input
    line k, so an empty line is refused (naming it) rather than skipped."""
    p = Path(path)
    if not p.exists():
        where = "" if p.is_absolute() else f" (looked in {Path.cwd()})"
        raise ValueError(f"prompts.path: prompt file {path!r} does not exist{where}")
    if not p.is_file() or p.suffix not in (".txt", ".jsonl"):
        raise ValueError(f"prompts.path: {path!r} is not a .txt or .jsonl file")
    prompts = []
    for number, line in enumerate(p.read_bytes().splitlines(), start=1):
        if not line.strip():
            raise ValueError(f"prompts.path: line {number} of {path} is empty; every line is one prompt and "
                             "output k answers line k: remove the empty line")
        try:
            if p.suffix == ".jsonl":
                prompts.append(json_line_text(line, text_field, field_hint="set prompts.text_field to the field "
                                                                          "that holds the prompt"))
                continue
            prompts.append(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"prompts.path: line {number} of {path}: not UTF-8 ({e.reason} at byte {e.start + 1} "
                             "of the line); re-encode the file as UTF-8") from None
        except JsonLineError as e:
            key = "prompts.text_field" if e.about_field else "prompts.path"
            raise ValueError(f"{key}: line {number} of {path}: {e}") from None
    if not prompts:
        raise ValueError(f"prompts.path: {path} holds no prompts")
    return prompts


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), both (len(sequences), longest), padded on the left."""
    longest = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, longest - len(seq):] = torch.tensor(seq)
            mask[row, longest - len(seq):] = 1
    return ids, mask


def build_prompts(cfg: GenerateConfig, tokenizer: Any, vocab_size: int) -> tuple[list[Optional[str]], list[list[int]]]:
    """All prompts (texts or None for synthetic ones) and their token ids, in order."""
    if cfg.prompts.source in ("file", "text"):
        texts = (read_prompt_file(cfg.prompts.path, cfg.prompts.text_field) if cfg.prompts.source == "file"
                 else list(cfg.prompts.text))
        tokens = [list(tokenizer.encode(t)) for t in texts]
        empty = [k for k, t in enumerate(tokens) if not t]
        if empty:
            key = "path" if cfg.prompts.source == "file" else "text"
            raise ValueError(f"prompts.{key}: prompt(s) {empty[:8]} tokenize to nothing")
        return texts, tokens
    p = cfg.prompts
    gen = torch.Generator().manual_seed(cfg.seed)
    low = p.min_prompt_len or p.prompt_len
    lengths = torch.randint(low, p.prompt_len + 1, (p.num_prompts,), generator=gen).tolist()
    return [None] * p.num_prompts, [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


_SHOWN_PROMPT_CHARS = 80


def generation_lines(records: list[dict], limit: Optional[int]) -> list[str]:
    """Console lines of the first ``limit`` records (None: all), ``[index] prompt -> completion``, each text a Python
    string literal (a newline or a control byte stays on its line); a long prompt shows its end, which the completion
    continues."""
    shown = records if limit is None else records[:limit]
    lines = []
    for r in shown:
        if r["prompt"] is None:
            prompt = f"<{len(r['prompt_tokens'])} random tokens>"
        elif len(r["prompt"]) > _SHOWN_PROMPT_CHARS:
            prompt = "..." + repr(r["prompt"][-_SHOWN_PROMPT_CHARS:])
        else:
            prompt = repr(r["prompt"])
        lines.append(f"[{r['index']}] {prompt} -> {r['completion']!r}")
    if len(shown) < len(records):
        lines.append(f"({len(records) - len(shown)} more in the jsonl; show_generations=all prints every one)")
    return lines


@contextlib.contextmanager
def _without_info(logger: logging.Logger) -> Iterator[None]:
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


RATES = ("prefill_tokens_per_s", "decode_tokens_per_s", "generated_tokens_per_s")


def stop_token_ids(tokenizer: Any, model_dir: Optional[str]) -> list[int]:
    """The ids that end a sequence: the tokenizer's EOS and the EOS ids of ``model_dir``'s generation_config.json
    (model.path's, or a checkpoint's copy of it), where Hugging Face's generate stops too: an instruct model's
    several end tokens (Llama-3's <|eot_id|> beside <|end_of_text|>). A config that does not list the tokenizer's EOS
    names another tokenizer's ids; those are left out, as the export leaves them out."""
    special = special_token_ids(tokenizer)
    config = special_generation_config(special, Path(model_dir) if model_dir else None)
    listed = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    return list(dict.fromkeys(int(i) for i in (special["eos_token_id"], *listed) if i is not None))


def check_host_weights(model: torch.nn.Module, cfg: GenerateConfig, dtype: torch.dtype, on: str) -> None:
    """Unquantized weights kept in host memory (``on``: the CPU, or offload=params) must fit the host budget:
    ``ValueError`` in one line before they are materialised (a 7B model in fp32 would otherwise fill the machine's
    memory until the kernel killed the process). Quantized weights are loaded under their own host limit."""
    if cfg.weight_quant is not None:
        return
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    need = local * dtype.itemsize
    limit = None if cfg.host_memory_limit_gib is None else int(cfg.host_memory_limit_gib * GIB)
    budget = HostMemoryBudget.detect(limit)
    if need <= budget.available_bytes:
        return
    smaller = "; param_dtype=bfloat16 halves them" if dtype.itemsize > 2 else ""
    over = need - budget.available_bytes
    raise ValueError(f"generation keeps the weights in host memory ({on}): {need / GIB:.2f} GiB for {local:,} "
                     f"parameters in {str(dtype).removeprefix('torch.')} on this rank, {over / GIB:.2f} GiB over: "
                     f"{budget.describe()}. Quantize them while loading (weight_quant=int8 or int4){smaller}; or "
                     "generate on more ranks, or a smaller model. If this machine has more host memory than it "
                     f"reports, set host_memory_limit_gib (or {LIMIT_ENV})")


def other_than_trained_with(name: str, models_own: Optional[str]) -> Optional[str]:
    """Why ``tokenizer=name`` is not the one the model's ids mean (the checkpoint's, or model.path's own), if it is
    not: prompts encoded and completions decoded with another vocabulary read as noise, though every id may fit the
    model. None where they agree, or where the model's own cannot be read here (a checkpoint's moved tokenizer)."""
    if not models_own:
        return None
    try:
        diff = tokenizer_difference(name, models_own)
    except ValueError:  # the model's own tokenizer directory is not here: nothing to compare against
        return None
    if diff is None:
        return None
    (tokens, eos), (own_tokens, own_eos) = diff
    return (f"tokenizer {name!r} ({tokens} tokens, EOS {eos}) is not the model's own ({models_own!r}: {own_tokens} "
            f"tokens, EOS {own_eos}): the prompts are encoded and the completions decoded with another vocabulary "
            "than the model was trained on; tokenizer=null uses the model's own")


def run(cfg: GenerateConfig, run_config: Optional[dict] = None) -> dict:
    """Builds the model, generates every prompt (each rank its share), writes the jsonl; returns the figures.

    Rank 0 says what it does within seconds (setting up, building the model, loading the checkpoint) and, on a
    terminal (or with ``FSDP_SPEEDLOADER_PROGRESS=1``), shows a progress bar over the decoding steps."""
    first = launch_rank() == 0
    if first:  # the first line, before the checkpoint is read and the model built
        log.info("setting up: %s, %d new tokens per prompt, run directory %s",
                 f"checkpoint {cfg.checkpoint_path}" if cfg.checkpoint_path is not None else
                 f"model {cfg.model.path or cfg.model.name}",
                 cfg.max_new_tokens, cfg.output_dir)
        check_wandb_credentials(cfg.logger)  # logger.mode=online without a key: one line, before the model
    show_bar = progress_bar_enabled(launch_rank())  # a malformed FSDP_SPEEDLOADER_PROGRESS fails here, not later
    device_type = resolve_device_type(cfg.device)
    checkpoint = open_checkpoint(cfg.checkpoint_path) if cfg.checkpoint_path is not None else None
    model_cfg = checkpoint.model if checkpoint is not None else cfg.model
    hf_config = build_hf_config(model_cfg)
    models_own = checkpoint.tokenizer if checkpoint is not None else default_tokenizer(cfg.model.path)
    tokenizer = build_tokenizer(cfg.tokenizer or models_own)
    trained = checkpoint is not None or models_own == cfg.model.path  # random weights have no tokenizer of their own
    if first and cfg.tokenizer and trained and (why := other_than_trained_with(cfg.tokenizer, models_own)):
        log.warning("%s", why)
    texts, tokens = build_prompts(cfg, tokenizer, hf_config.vocab_size)
    top = max((max(t) for t in tokens if t), default=-1)
    if top >= hf_config.vocab_size:  # before the model is built (it failed at the first forward)
        raise ValueError(f"tokenizer: the prompts' token ids reach {top}, outside the model's vocabulary of "
                         f"{hf_config.vocab_size} ids; use the model's own tokenizer (tokenizer=null: the checkpoint's "
                         "or model.path's)")
    longest = max(len(t) for t in tokens)
    if longest + cfg.max_new_tokens > hf_config.max_position_embeddings:
        raise ValueError(f"the longest prompt ({longest} tokens) + max_new_tokens {cfg.max_new_tokens} exceeds the "
                         f"model's {hf_config.max_position_embeddings} positions")

    parallel.maybe_init_process_group(device_type)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = parallel.compute_device(device_type)
    torch.manual_seed(cfg.seed)
    maybe_cap_gpu_memory(cfg.max_gpu_memory_gib, device)
    mesh = parallel.build_mesh(device_type, cfg.dp_replicate)
    dtype = resolve_param_dtype(cfg.param_dtype, device_type)

    # Inference keeps no fp32 master weights: parameters are stored (and offloaded) in the compute dtype.
    model = build_model(model_cfg, device="meta").to(dtype)
    # the architecture, not model_cfg.name: a model.path run keeps the model group's default name
    architecture = type(model).__name__
    if rank == 0:
        log.info("building the model: %s, %d rank(s) on %s, %s", architecture, world, device, dtype)
    if cfg.weight_quant is not None:  # the block linears, before sharding; their bytes come with the weights below
        quantize_linears_(model, weight_format(cfg.weight_quant, cfg.weight_quant_group_size))
    apply_speedloader(model, cfg.speedloader_options(), mesh=mesh)
    param_device = torch.device("cpu") if cfg.offload.params else device
    if param_device.type == "cpu":
        check_host_weights(model, cfg, dtype, "offload=params" if device.type != "cpu" else "on the CPU")
    if checkpoint is not None:  # the trained weights (the model's entries only, never the optimizer state)
        if rank == 0:
            log.info("loading the checkpoint %s", checkpoint.step_dir)
        checkpoint.materialize(model, device=device, param_device=param_device)
        if rank == 0:
            log.info("loaded %s from %s", architecture, checkpoint.step_dir)
    else:
        if rank == 0 and cfg.model.path is None:  # a throughput run's model; text from it means nothing
            log.info("random weights (model=%s, no checkpoint= or model.path=): the completions are noise",
                     cfg.model.name)
        materialize_model(model, cfg.model, device=device, seed=cfg.seed, param_device=param_device)
    host_limit = None if cfg.host_memory_limit_gib is None else int(cfg.host_memory_limit_gib * 2**30)
    if cfg.weight_quant is not None:  # each linear read (or drawn) and quantized one at a time
        if rank == 0:
            log.info("quantizing the linears to %s while loading (%s)", cfg.weight_quant,
                     "host memory" if cfg.offload.params else device)
        materialize_quantized_weights(model, device=device, offload=cfg.offload.params, path=model_cfg.path,
                                      seed=cfg.seed, std=model_cfg.init_std, host_memory_limit_bytes=host_limit)

    # Each rank takes every world-th prompt; the share is filled up to a multiple of N with copies.
    mine = list(range(rank, len(tokens), world))
    per_rank = -(-len(range(0, len(tokens), world)) // cfg.num_sub_batches) * cfg.num_sub_batches
    rows = mine + [mine[-1] if mine else 0] * (per_rank - len(mine))
    pad_id = getattr(tokenizer, "pad_token_id", None)
    eos_id = getattr(tokenizer, "eos_token_id", None)
    pad_id = pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)
    ids, mask = left_pad([tokens[k] for k in rows], pad_id)
    eos = stop_token_ids(tokenizer, model_cfg.path) if cfg.stop_at_eos and cfg.prompts.source != "synthetic" else None
    kwargs = dict(max_new_tokens=cfg.max_new_tokens, num_sub_batches=cfg.num_sub_batches, kv_cache=cfg.kv_cache,
                  kv_device_sub_batches=cfg.kv_device_sub_batches,
                  cpu_attention_sub_batches=cfg.cpu_attention_sub_batches, kv_cache_dtype=cfg.kv_cache_dtype,
                  weight_dequantize=cfg.weight_dequantize, do_sample=cfg.sampling.do_sample,
                  temperature=cfg.sampling.temperature, top_k=cfg.sampling.top_k,
                  top_p=cfg.sampling.top_p, eos_token_id=eos, pad_token_id=pad_id, seed=cfg.seed + rank,
                  host_memory_limit_bytes=host_limit)
    if rank == 0:
        log.info("generating: %d prompt(s), %d on this rank in %d sub-batch(es), %d new tokens%s", len(tokens),
                 len(mine), cfg.num_sub_batches, cfg.max_new_tokens, " (after a 2-token warm-up)" if cfg.warmup else "")
        if len(rows) > len(mine):
            log.warning("%d filler row(s), copies of a prompt, fill this rank's %d sub-batch(es) to equal sizes (%d "
                        "prompts here); they are generated but not counted in the throughput: num_sub_batches dividing "
                        "the prompts per rank wastes none", len(rows) - len(mine), cfg.num_sub_batches, len(mine))
    if cfg.warmup:
        generate(model, ids, mask, **{**kwargs, "max_new_tokens": min(2, cfg.max_new_tokens)})
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with StepProgress(total=cfg.max_new_tokens, enabled=show_bar and rank == 0, desc="generate",
                      unit="token") as progress:  # a step is one new token per prompt
        out, stats = generate(model, ids, mask, return_stats=True, on_step=progress.update, **kwargs)

    prompt_len = ids.shape[1]
    records = [{"index": k, "prompt": texts[k], "prompt_tokens": tokens[k],
                "completion_tokens": out[row, prompt_len:].tolist()} for row, k in enumerate(mine)]
    for r in records:
        r["completion"] = tokenizer.decode(r["completion_tokens"])
    figures = {**stats.as_dict(), "num_ranks": world, "model": model_cfg.name,
               "num_sub_batches": cfg.num_sub_batches, "sub_batch_size": ids.shape[0] // cfg.num_sub_batches,
               "prompts": len(mine), "filler_rows": len(rows) - len(mine)}
    for key in RATES:  # the prompts' tokens per second: the copies that fill the sub-batches are not output
        figures[key] *= len(mine) / len(rows)
    if device.type == "cuda":
        figures["peak_gpu_mem_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    gathered = [None] * world
    dist.all_gather_object(gathered, (records, figures))
    if rank == 0:
        all_records = sorted((r for recs, _ in gathered for r in recs), key=lambda r: r["index"])
        out_path = Path(cfg.output_dir) / cfg.output_file
        out_path.parent.mkdir(parents=True, exist_ok=True)
        with open(out_path, "w") as f:
            for r in all_records:
                f.write(json.dumps(r) + "\n")
        if cfg.show_generations != 0:
            for line in generation_lines(all_records, cfg.show_generations):
                log.info("%s", line)
        # Throughput of all ranks together: they run concurrently, so rates add up.
        for key in (*RATES, "prompts", "filler_rows"):
            figures[key] = sum(fig[key] for _, fig in gathered)
        log.info("%d prompt(s) -> %s | prefill %.1f tok/s (%.2f s) | decode %.1f tok/s (%.2f s) | kv_cache %s",
                 len(all_records), out_path, figures["prefill_tokens_per_s"], figures["prefill_s"],
                 figures["decode_tokens_per_s"], figures["decode_s"], figures["kv_cache"])
    logged = run_config if run_config is not None else dataclasses.asdict(cfg)  # the model that ran, not the group's
    logger = build_logger(cfg.logger, {**logged, "model": logged_model(model_cfg, hf_config)}, cfg.output_dir, rank)
    # The metric logger's console line shows training's figures: for generation it would read a bare "step 0". The
    # summary line above is generation's; metrics.jsonl and W&B still get every figure.
    with _without_info(logging.getLogger(build_logger.__module__)):
        logger.log({k: v for k, v in figures.items() if isinstance(v, (int, float, str))}, step=0)
    logger.finish()
    return figures


def main() -> None:
    """Hydra entry: ``python -m fsdp_speedloader.app.generate [overrides]``."""
    import hydra
    from omegaconf import DictConfig

    @hydra.main(config_path=config_path(), config_name="generate", version_base="1.3")
    def _hydra_main(dcfg: DictConfig) -> None:
        if rank() != 0:
            logging.getLogger().setLevel(logging.WARNING)
        try:
            container = resolved_config(dcfg)
            cfg = GenerateConfig.from_dict(container)
            run(cfg, run_config=container)
        except ValueError as e:  # a user error: one line, no traceback
            fail(e)

    sys.argv[1:] = checkpoint_path_overrides(sys.argv[1:])  # checkpoint=PATH: the checkpoint, not the training group
    launch(_hydra_main, config_name="generate")


if __name__ == "__main__":
    main()
