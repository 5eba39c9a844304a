"""Typed configuration: one dataclass per component, validated on construction.

The Hydra entry points convert their ``DictConfig`` once with :func:`TrainConfig.from_dict`;
library code only ever sees these dataclasses. Every check raises ``ValueError`` naming the
field and what to change, so a bad value fails before any model or memory is allocated.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from fsdp_speedloader.app.token_shards import prepared_tokenizer
from fsdp_speedloader.kernels import FLOAT8_RECIPES, SDPA_BACKENDS
from fsdp_speedloader.models.config import ModelConfig
from fsdp_speedloader.validation import check, check_choice, check_positive, dataclass_from_dict, dtype_choice

_DTYPES = ("auto", "float32", "bfloat16", "float16")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")  # a Hugging Face tokenizer's


def default_tokenizer(model_path: Optional[str]) -> str:
    """The tokenizer of ``data.tokenizer=null``: ``model_path`` where that checkpoint directory holds a Hugging Face
    tokenizer (a pretrained model's text is its own tokenizer's ids), else 'bytes'."""
    if model_path and any(os.path.isfile(os.path.join(model_path, name)) for name in TOKENIZER_FILES):
        return model_path
    return "bytes"


@dataclass
class DataConfig:
    """Where training tokens come from. Sequences are packed to ``seq_len``."""

    source: str = "default"
    """'default' (embedded corpus), 'synthetic' (random tokens), 'text' (.txt/.jsonl), 'tokens' (a token directory
    from fsdp-speedloader-prepare, or a .bin file)."""
    path: Optional[str] = None
    """File or directory for 'text'; a token directory or .bin file for 'tokens' (or data.mixture instead)."""
    tokenizer: Optional[str] = "bytes"
    """'bytes' (built in, vocab 257), a local Hugging Face tokenizer directory, or null (the data groups' default):
    token data's own (the tokenizer that prepared it, where it loads here), else ``model.path``'s own tokenizer
    where that checkpoint directory holds one, else 'bytes'. Token data prepared with another is refused."""
    text_field: str = "text"
    """Field holding the document text in .jsonl files."""
    seq_len: int = 256
    """Tokens per sequence s."""
    seed: int = 0
    """Seed of the sequence order and of synthetic tokens."""
    mixture: Optional[list] = None
    """For 'tokens', instead of data.path: a list of {path, weight} (token directories or .bin files, one
    tokenizer); each global sample comes from the dataset furthest behind its weight's share (docs/data.md)."""
    document_mask: bool = False
    """Packed documents (joined with the tokenizer's EOS) do not attend to each other and their positions restart
    after each EOS; a document's first token is no target of the one before it. LLaMA, Mistral, Qwen2/3."""
    val_path: Optional[str] = None
    """The held-out set, read as ``source`` reads ``path`` (a .txt/.jsonl file or directory, or a .bin file)."""
    val_fraction: float = 0.0
    """Or: hold out this fraction of the training tokens (the end of the stream, whole sequences); 0: none."""

    def __post_init__(self) -> None:
        check_choice(self.source, "data.source", ("default", "synthetic", "text", "tokens"))
        check_positive(self.seq_len, "data.seq_len")
        if self.mixture is not None:
            self._check_mixture()
        elif self.source in ("text", "tokens"):
            check(bool(self.path), "data.path", f"data.source={self.source!r} needs data.path=<file or directory>"
                  + (" or data.mixture=[{path: ..., weight: ...}, ...]" if self.source == "tokens" else ""))
        else:  # a path given to a source that reads none would be ignored: the run would train on other tokens
            what = "the corpus bundled with the package" if self.source == "default" else "random tokens"
            check(not self.path, "data.path",
                  f"data.source={self.source!r} reads no data.path (it trains on {what}); to train on {self.path!r} "
                  "add data=text (a .txt/.jsonl file or a directory of them) or data=tokens (a token directory from "
                  "fsdp-speedloader-prepare, or a .bin file); or drop data.path")
        check(0.0 <= self.val_fraction < 1.0, "data.val_fraction", f"got {self.val_fraction}; use [0, 1) (0: none)")
        check(not (self.mixture and self.val_fraction), "data.val_fraction",
              "a mixture holds out no fraction of its datasets; give its held-out set as data.val_path=<a token "
              "directory>, or set data.val_fraction=0")
        check(not (self.val_path and self.val_fraction), "data.val_fraction",
              f"data.val_path={self.val_path!r} is the held-out set already; set data.val_fraction=0 or "
              "data.val_path=null")
        if self.source == "synthetic":
            check(not self.document_mask, "data.document_mask",
                  "synthetic tokens hold no documents; set data.document_mask=false or use another data.source")
            key = "data.val_fraction" if self.val_fraction else "data.val_path"
            check(not (self.val_path or self.val_fraction), key, "synthetic tokens have no held-out set; set "
                  "data.val_path=null and data.val_fraction=0, or use another data.source")

    def prepared_tokenizer(self) -> Optional[str]:
        """Token data: the tokenizer that prepared it (its first dataset's), where it loads here; else None."""
        if self.source != "tokens":
            return None
        first = self.mixture[0].get("path") if self.mixture and isinstance(self.mixture[0], dict) else self.path
        return prepared_tokenizer(first) if first else None

    @property
    def has_validation(self) -> bool:
        """Whether a held-out set is configured."""
        return bool(self.val_path) or self.val_fraction > 0

    def _check_mixture(self) -> None:
        example = "data.mixture='[{path: /data/web, weight: 0.7}, {path: /data/code, weight: 0.3}]'"
        check(self.source == "tokens", "data.mixture", f"needs data.source=tokens (data=tokens), got {self.source!r}")
        check(not self.path, "data.path", "set data.path=null with data.mixture (each dataset names its own path)")
        check(isinstance(self.mixture, list) and len(self.mixture) > 0, "data.mixture",
              f"expected a non-empty list of {{path, weight}}, e.g. {example}")
        for i, entry in enumerate(self.mixture):
            ok = (isinstance(entry, dict) and set(entry) == {"path", "weight"} and isinstance(entry["path"], str)
                  and bool(entry["path"]) and isinstance(entry["weight"], (int, float))
                  and not isinstance(entry["weight"], bool) and 0 < entry["weight"] < float("inf"))
            check(ok, f"data.mixture[{i}]", f"got {entry!r}; each entry is {{path: <token directory or .bin>, "
                  f"weight: <a positive number>}}, e.g. {example}")


@dataclass
class OptimConfig:
    """AdamW with warmup and decay."""

    lr: float = 3e-4
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr (cosine / linear)."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    lr_schedule: str = "cosine"
    """'cosine', 'linear' or 'constant' after warmup."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (torch.nn.utils.clip_grad_norm_'s result, also with
    overlap_with_backward); 0 turns clipping off."""
    skip_nonfinite: bool = True
    """With grad_clip > 0: a step whose global gradient norm is inf or nan updates nothing (no parameter, no
    optimizer state, no LR schedule step), is logged and counted (num_skipped_steps), and training goes on.
    With grad_clip = 0 no norm is computed and nothing is checked."""
    overlap_with_backward: bool = False
    """Layer-major, parameters offloaded: step each unit on the CPU beside the GPU's work
    (``OverlappedOptimizer``; exact): as soon as its gradients reach the host, during the backward
    (grad_clip=0); or, with grad_clip > 0, once the global norm is known at the end of backward, in forward
    order, during the next forward (docs/design.md §9)."""
    grad_slots_in_flight: int = 4
    """With overlap_with_backward and grad_clip=0 (each unit stepped as its gradients land): the host arena holds
    the gradients of this many units, reused in turn, instead of a slot per parameter (4 B/param -> about
    grad_slots_in_flight units' worth; exact, docs/design.md §13); 0: a slot per parameter. Clipping needs every
    gradient after the backward: then there is a slot per parameter whatever this says."""
    worker_threads: int = 0
    """With overlap_with_backward: the CPU threads of the worker that steps the units (that thread's only:
    memory/threads.py); 0: torch's default (every core). Meant to leave the thread that launches the GPU's work a
    core while the step runs beside the backward; measured on the MoE step it gave no gain (docs/results.md).
    Exact either way."""
    worker_nice: int = 0
    """With overlap_with_backward: raise the worker's niceness (and its CPU threads') by this much (0..19, Linux),
    so that on a busy host the scheduler prefers the thread that launches the GPU's work (docs/results.md, issue
    40's busy-host curve). Exact either way."""
    worker_affinity: bool = False
    """With overlap_with_backward: the worker (its CPU threads, and the pool threads its steps use) runs on this
    rank's share of the CPUs (those the process may use / the node's ranks, LOCAL_RANK's block) less one, which is
    left to the thread that launches the GPU's work; with worker_threads=0 it computes on one thread per CPU of
    that share. Linux. Exact either way."""
    state_dtype: str = "fp32"
    """AdamW's moments: 'fp32' (torch.optim.AdamW, 8 B/param, exact: the default); 'bf16' (4 B/param, rounded to
    nearest after each step) or 'int8' (8-bit blockwise, 2 B/param): fsdp_speedloader's CompressedAdamW, torch's
    fused AdamW arithmetic on decoded chunks (docs/design.md §13; their loss is checked against fp32 by
    tools/convergence_check.py). The parameters stay fp32; parameters on the GPU keep fp32 moments."""

    host_kernel: str = "auto"
    """How the compressed AdamW (state_dtype bf16/int8) steps host chunks: 'fused' (one C++ kernel per chunk,
    memory/csrc/adamw_chunk.cpp, built at first use: needs a C++ compiler), 'torch' (torch ops) or 'auto' (the
    kernel where it builds, else torch ops after one warning; $FSDP_SPEEDLOADER_FUSED_ADAMW=1/0 turns 'auto' into
    'fused'/'torch'). The kernel does the torch ops' arithmetic (docs/design.md §13)."""

    fp32_host_step: str = "pool"
    """How the fp32 AdamW step of host parameters (state_dtype fp32) spreads over its CPU threads: 'openmp' (torch's
    fused kernel, each tensor split evenly over the threads: the step waits for the slowest, and on a host where
    other processes keep cores busy that is a thread sharing its core) or 'pool' (the same kernel on chunks of 2^21
    elements, each host-pool thread taking the next: a slowed thread takes fewer; memory/local_adamw.py). Exact
    either way (the same bits). 'pool' is the default: on the GPU machine's 16-core host it stepped faster quiet and
    much faster beside busy cores (docs/results.md, issue 40)."""

    master_dtype: str = "fp32"
    """The host copy of the parameters (offload=params): 'fp32' (exact, the default) or 'bf16' (2 B/param instead of
    4, and the gradients with them; each update stochastically rounded, memory/bf16_master.py; not exact: checked
    by tools/convergence_check.py). bf16 needs compressed moments (state_dtype bf16 or int8). The root's parameters
    stay fp32 when they live on the GPU (offload.root=false)."""

    def __post_init__(self) -> None:
        check(self.lr > 0, "optim.lr", f"got {self.lr}; must be > 0")
        check(0.0 <= self.min_lr_ratio <= 1.0, "optim.min_lr_ratio", f"got {self.min_lr_ratio}; use [0, 1]")
        check_positive(self.warmup_steps, "optim.warmup_steps", allow_zero=True)
        check_choice(self.lr_schedule, "optim.lr_schedule", ("cosine", "linear", "constant"))
        check(self.weight_decay >= 0, "optim.weight_decay", f"got {self.weight_decay}; must be >= 0")
        check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "optim.beta1/beta2", "use values in [0, 1)")
        check(self.grad_clip >= 0, "optim.grad_clip", f"got {self.grad_clip}; use 0 to turn clipping off")
        check_positive(self.grad_slots_in_flight, "optim.grad_slots_in_flight", allow_zero=True)
        check_positive(self.worker_threads, "optim.worker_threads", allow_zero=True)
        check(isinstance(self.worker_nice, int) and 0 <= self.worker_nice <= 19, "optim.worker_nice",
              f"got {self.worker_nice}; use an integer in 0..19 (0: the process's priority)")
        check(not self.worker_affinity or self.overlap_with_backward, "optim.worker_affinity",
              "pins the overlapped optimizer's worker: set optim.overlap_with_backward=true too (or leave "
              "optim.worker_affinity=false)")
        check(not self.worker_affinity or hasattr(os, "sched_setaffinity"), "optim.worker_affinity",
              "needs Linux's per-thread CPU affinity (os.sched_setaffinity), which this system lacks")
        self.state_dtype = dtype_choice(self.state_dtype, "optim.state_dtype", ("fp32", "bf16", "int8"))
        self.master_dtype = dtype_choice(self.master_dtype, "optim.master_dtype", ("fp32", "bf16"))
        check_choice(self.host_kernel, "optim.host_kernel", ("auto", "fused", "torch"))
        check_choice(self.fp32_host_step, "optim.fp32_host_step", ("openmp", "pool"))
        check(self.master_dtype == "fp32" or self.state_dtype != "fp32", "optim.master_dtype",
              "bf16 master weights are stepped by the compressed AdamW: set optim.state_dtype=bf16 or int8 too "
              "(or optim.master_dtype=fp32)")


@dataclass
class ScheduleConfig:
    """How one effective batch of num_sub_batches x sub_batch_size sequences is processed."""

    name: str = "speedloader"
    """'speedloader' (layer-major), 'canonical' (FSDP2 gradient accumulation) or 'auto' (layer-major, tuned; or the
    canonical schedule where it measured faster: canonical_candidate)."""
    sub_batch_size: int = 4
    """Sequences per sub-batch n (the micro-batch size of the canonical schedule)."""
    num_sub_batches: int = 2
    """Sub-batches per effective batch N (accumulation steps of the canonical schedule)."""
    blocks_per_unit: int = 1
    """Consecutive transformer blocks per FSDP unit (the paper's on-device layers)."""
    activation_store: str = "auto"
    """Block-boundary activations: 'device', 'host' (pinned arena, overlapped copies), 'host_sync', or 'auto'
    (host when parameters are offloaded)."""
    activation_checkpointing: bool = True
    """Canonical schedule: recompute each block in backward (speedloader always recomputes)."""
    activation_checkpointing_every: int = 1
    """Canonical schedule with activation_checkpointing: recompute only every k-th block (blocks k, 2k, ..., counted
    from 1; torchtitan's selective per-layer option): the others keep their activations. 1: every block."""
    gradient_sync: str = "every"
    """Canonical schedule: reduce-scatter gradients after 'every' micro-batch (they accumulate sharded, on the
    host when offloaded) or only the 'last' (unsharded gradients accumulate on the device: faster, more memory)."""
    reshard_after_forward: bool = True
    """Canonical schedule: free each unit's all-gathered parameters after its forward (ZeRO-3: gathered again for
    backward), or keep them unsharded from the step's first forward to its last backward (false: one all-gather per
    unit per step, not two per micro-batch; the whole model's unsharded parameters stay on the device, ZeRO-2's
    memory)."""
    forward_prefetch: int = 1
    """FSDP units whose all-gather is issued ahead in forward (0 = FSDP's default only)."""
    loss_chunk_tokens: int = 4096
    """Tokens per chunk of the chunked cross-entropy (bounds the logits kept in memory). The canonical schedule
    chunks its head the same way (``models.chunked_loss``), or with 0 leaves it to the model's own loss (every
    logit of a micro-batch at once)."""
    compile_blocks: bool = False
    """torch.compile the transformer blocks' forward (one compiled function shared by every block; training only)."""
    alternate_sub_batches: bool = True
    """speedloader: each loop over the sub-batches in the reverse order of the one before, so each unit starts with
    the input still on the GPU (false: always 0 .. N-1: gradient sums bit for bit those of FSDP2's accumulation)."""
    keep_activations: int = 0
    """speedloader: (unit, sub-batch) pairs, from the last unit back, whose activations stay on the GPU from
    forward to backward so their backward skips the recompute (exact; GPU memory per pair); auto plans it."""
    gpu_memory_budget_gib: Optional[float] = None
    """auto: GPU memory the plan may fill (peak, less 10%); null: max_gpu_memory_gib, else the device's."""
    host_memory_budget_gib: Optional[float] = None
    """auto: host memory for model states and activation slots; null: detected (as the host arena's budget)."""
    target_batch_size: Optional[int] = None
    """auto: at most this many sequences per rank per step (caps n x N); null: as many as memory holds."""
    max_sub_batch_size: Optional[int] = None
    """auto: at most this many sequences per sub-batch (caps n); with target_batch_size, the GPU memory a smaller n
    leaves over goes to kept pairs (keep_activations) instead of longer sub-batches; null: as large as fits."""
    tune_blocks_per_unit: list = field(default_factory=list)
    """auto: more blocks_per_unit values to choose from (two trial steps each); empty: blocks_per_unit only."""
    canonical_candidate: Optional[bool] = None
    """auto: also measure the canonical schedule with the model gathered once and no recompute, and run it where it
    steps the planned batch faster (app/schedule_choice.py); null: on CUDA only; false: layer-major's plan always."""

    def __post_init__(self) -> None:
        check_choice(self.name, "schedule.name", ("speedloader", "canonical", "auto"))
        check_positive(self.sub_batch_size, "schedule.sub_batch_size")
        check_positive(self.num_sub_batches, "schedule.num_sub_batches")
        check_positive(self.blocks_per_unit, "schedule.blocks_per_unit")
        check_choice(self.activation_store, "schedule.activation_store", ("auto", "device", "host", "host_sync"))
        check_choice(self.gradient_sync, "schedule.gradient_sync", ("every", "last"))
        check(self.gradient_sync == "every" or self.name == "canonical", "schedule.gradient_sync",
              f"{self.gradient_sync!r} applies to schedule.name='canonical' only (layer-major reduce-scatters "
              f"once per step anyway); got schedule.name={self.name!r}: set schedule.gradient_sync=every")
        check(self.reshard_after_forward or self.name == "canonical", "schedule.reshard_after_forward",
              f"false applies to schedule.name='canonical' only (layer-major unshards each unit once per forward "
              f"and once per backward anyway); got schedule.name={self.name!r}: set "
              "schedule.reshard_after_forward=true")
        check_positive(self.activation_checkpointing_every, "schedule.activation_checkpointing_every")
        check(self.activation_checkpointing_every == 1 or (self.name == "canonical" and self.activation_checkpointing),
              "schedule.activation_checkpointing_every",
              f"{self.activation_checkpointing_every} applies to schedule.name='canonical' with "
              f"schedule.activation_checkpointing=true only (layer-major recomputes every (unit, sub-batch) pair it "
              f"does not keep: set schedule.keep_activations instead); got schedule.name={self.name!r}, "
              f"activation_checkpointing={self.activation_checkpointing}")
        check_positive(self.forward_prefetch, "schedule.forward_prefetch", allow_zero=True)
        check_positive(self.loss_chunk_tokens, "schedule.loss_chunk_tokens", allow_zero=self.name == "canonical")
        check_positive(self.keep_activations, "schedule.keep_activations", allow_zero=True)
        for name in ("gpu_memory_budget_gib", "host_memory_budget_gib"):
            value = getattr(self, name)
            check(value is None or value > 0, f"schedule.{name}", f"got {value}; must be > 0 (or null)")
        for name in ("target_batch_size", "max_sub_batch_size"):
            if getattr(self, name) is not None:
                check_positive(getattr(self, name), f"schedule.{name}")
        for value in self.tune_blocks_per_unit:
            check_positive(value, "schedule.tune_blocks_per_unit")
        # The tuner's budgets and caps: under a hand-set schedule they would be ignored without a word.
        tuner_only = [name for name in AUTO_ONLY if getattr(self, name) not in (None, [])]
        if tuner_only and self.name != "auto":
            given = ", ".join(f"{name}={getattr(self, name)}" for name in tuner_only)
            check(False, f"schedule.{tuner_only[0]}",
                  f"{given} applies to schedule=auto only (the tuner's budgets and caps); schedule.name={self.name!r} "
                  f"runs sub_batch_size x num_sub_batches as given ({self.sub_batch_size} x {self.num_sub_batches}): "
                  f"add schedule=auto to plan them, or drop {'it' if len(tuner_only) == 1 else 'them'}")

    @property
    def batch_size(self) -> int:
        """Sequences per rank per optimizer step."""
        return self.sub_batch_size * self.num_sub_batches


# ScheduleConfig's fields that only the tuner reads (schedule=auto, app.tune).
AUTO_ONLY = ("gpu_memory_budget_gib", "host_memory_budget_gib", "target_batch_size", "max_sub_batch_size",
             "tune_blocks_per_unit", "canonical_candidate")


def auto_unset() -> dict:
    """Those fields unset (a fresh list each call): a planned schedule (spent on the plan, which keeps them) carries
    none, as a hand-set one must."""
    return {name: [] if name == "tune_blocks_per_unit" else None for name in AUTO_ONLY}


@dataclass
class KernelsConfig:
    """Opt-in kernel levers of the training step (both schedules; docs/configuration.md, docs/design.md)."""

    sdpa_backend: str = "auto"
    """The one scaled_dot_product_attention backend of the blocks, forward and recompute: 'cudnn', 'flash',
    'efficient', 'math', or 'auto' (PyTorch picks per call)."""
    liger_kernels: bool = False
    """Liger's Triton RMSNorm, SwiGLU and RoPE, bound per module (LLaMA-layout families, CUDA, the kernels extra)."""
    float8_training: Optional[str] = None
    """null, or a torchao float8 recipe for the blocks' linears: 'tensorwise', 'rowwise' or 'rowwise_with_gw_hp'
    (sm89+ GPU, the kernels extra; best with schedule.compile_blocks=true)."""

    def __post_init__(self) -> None:
        check_choice(self.sdpa_backend, "kernels.sdpa_backend", SDPA_BACKENDS)
        if self.float8_training is not None:
            check_choice(self.float8_training, "kernels.float8_training", FLOAT8_RECIPES)


@dataclass
class OffloadConfig:
    """What lives in host memory."""

    params: bool = False
    """Parameters, gradients and optimizer state on the host (FSDP2 CPUOffloadPolicy)."""
    pin_memory: bool = True
    """Page-lock offloaded shards so copies are asynchronous (ignored without CUDA)."""
    param_transfer_dtype: Optional[str] = None
    """None, or 'bf16' ('bfloat16'): keep a copy of each offloaded shard in the arena in this dtype (the
    param_dtype) and transfer it instead of the fp32 shard: half the host-to-device bytes, the same bits.
    Layer-major with params=true, pin_memory=true and the host activation store."""
    root: bool = True
    """With params: also the root's states (embeddings, final norm, LM head); false keeps them on the GPU
    (16 bytes per root parameter with fp32 AdamW: 4.2 GB for LLaMA-2-7B) and takes their load, gradient copy
    and CPU optimizer step out of every step."""
    device_units: int = 0
    """With params: units 1 .. K keep their states on the GPU, as root=false keeps the root's (16 bytes per
    parameter with fp32 AdamW): unit 1's CPU optimizer step, which starts only when the backward ends, no longer
    delays the next step. Both schedules."""

    def __post_init__(self) -> None:
        check_positive(self.device_units, "offload.device_units", allow_zero=True)
        check(self.device_units == 0 or self.params, "offload.device_units",
              "keeps units' states on the GPU when the others are offloaded: set offload=params, or "
              "offload.device_units=0")
        if self.param_transfer_dtype is not None:
            self.param_transfer_dtype = dtype_choice(self.param_transfer_dtype, "offload.param_transfer_dtype",
                                                     ("bfloat16", "float16"))
            check(self.params and self.pin_memory, "offload.param_transfer_dtype",
                  "its copies live in the pinned arena next to the offloaded shards: set offload=params with "
                  "offload.pin_memory=true, or offload.param_transfer_dtype=null")


@dataclass
class LoggerConfig:
    """Weights & Biases logging (rank 0 only)."""

    backend: str = "wandb"
    """'wandb' or 'none'."""
    project: str = "fsdp_speedloader"
    """W&B project."""
    entity: Optional[str] = None
    """W&B entity (team or user); None uses the default."""
    mode: str = "auto"
    """'auto' (online with an API key, else offline), 'online', 'offline' or 'disabled'."""
    group: Optional[str] = None
    """W&B group (sweeps put all points in one group)."""
    name: Optional[str] = None
    """Run name; None derives one from the model and schedule."""
    tags: list = field(default_factory=list)
    """W&B tags."""

    def __post_init__(self) -> None:
        check_choice(self.backend, "logger.backend", ("wandb", "none"))
        check_choice(self.mode, "logger.mode", ("auto", "online", "offline", "disabled"))


@dataclass
class CheckpointConfig:
    """torch.distributed.checkpoint saves and resume."""

    every: int = 0
    """Save every k steps (0: no step-based saves)."""
    every_minutes: Optional[float] = 30.0
    """Also save when this many minutes have passed since the last save (or the start of the loop), all ranks
    together; 0 or null: no time-based saves. A run also saves when it gets SIGTERM or SIGINT, then exits."""
    dir: Optional[str] = None
    """Checkpoint directory; None means <output_dir>/checkpoints."""
    resume: Optional[str] = None
    """None (fresh), 'auto' (latest in dir, if any) or a path to one step_* checkpoint."""
    keep_last: int = 2
    """How many step checkpoints to keep (older ones are deleted after a successful save)."""
    save_final: bool = True
    """Save after the last step."""
    async_save: bool = False
    """Save asynchronously (DCP's ``async_save``): training stalls only while this rank's model and optimizer state
    is copied into host memory (a whole checkpoint of it, counted in the host-memory plan); the files are written in
    the background and the step directory becomes complete once they are. The key is ``async_save``, not ``async``
    (a Python keyword: the config keys are the dataclass's fields)."""
    overwrite: bool = False
    """Let a run start where its saves would mix with another run's steps in ``dir`` (a fresh start into a directory
    holding step directories, or a resume from an older step than the directory's newest): delete those step
    directories (and unfinished ``*.tmp`` saves) first, each named in a warning. False: such a run is refused."""

    def __post_init__(self) -> None:
        check_positive(self.every, "checkpoint.every", allow_zero=True)
        check(self.every_minutes is None or self.every_minutes >= 0, "checkpoint.every_minutes",
              f"got {self.every_minutes}; must be >= 0 (0 or null: no time-based saves)")
        check_positive(self.keep_last, "checkpoint.keep_last")


@dataclass
class EvalConfig:
    """The validation loss on the held-out set (``data.val_path`` or ``data.val_fraction``)."""

    every: int = 100
    """Evaluate every k optimizer steps, and after the last step; 0: after the last step only."""
    batches: int = 4
    """Batches per evaluation, each the training step's shape (num_sub_batches x sub_batch_size sequences per rank);
    the same held-out sequences every time (fewer when the held-out set is smaller)."""

    def __post_init__(self) -> None:
        check_positive(self.every, "eval.every", allow_zero=True)
        check_positive(self.batches, "eval.batches")


@dataclass
class TrainConfig:
    """A whole training run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    steps: int = 200
    """Optimizer steps."""
    seed: int = 0
    """Seed of weights, data order and dropout."""
    device: str = "auto"
    """'auto' (cuda when available), 'cuda' or 'cpu'."""
    param_dtype: str = "auto"
    """Compute dtype of the unsharded parameters: 'auto' (bfloat16 on cuda, float32 on cpu) or a dtype."""
    reduce_dtype: str = "float32"
    """Dtype of the gradient reduce-scatter."""
    dp_replicate: int = 1
    """HSDP replicas (usually the number of nodes); 1 means plain FSDP over all ranks."""
    log_every: int = 1
    """Log metrics every k steps."""
    peak_tflops: float = 989.0
    """Peak dense TFLOP/s of one accelerator, the denominator of MFU (989: H100/H200 bf16)."""
    max_gpu_memory_gib: Optional[float] = None
    """Cap this process's GPU memory (emulates a smaller card); None: no cap."""
    time_budget_s: Optional[float] = None
    """Stop after the first step that ends this many seconds into the step loop (model build excluded); None: off."""
    output_dir: str = "outputs"
    """Run directory (the Hydra entry point sets it; all ranks agree on it)."""

    def __post_init__(self) -> None:
        if self.data.tokenizer is None:  # token data: the tokenizer that prepared it; text: the checkpoint's own
            self.data.tokenizer = self.data.prepared_tokenizer() or default_tokenizer(self.model.path)
        check_positive(self.steps, "steps")
        check_choice(self.device, "device", ("auto", "cuda", "cpu"))
        self.param_dtype = dtype_choice(self.param_dtype, "param_dtype", _DTYPES)
        self.reduce_dtype = dtype_choice(self.reduce_dtype, "reduce_dtype", _DTYPES[1:])
        check_positive(self.dp_replicate, "dp_replicate")
        check_positive(self.log_every, "log_every")
        check(self.peak_tflops > 0, "peak_tflops", f"got {self.peak_tflops}; must be > 0")
        if self.max_gpu_memory_gib is not None:
            check(self.max_gpu_memory_gib > 0, "max_gpu_memory_gib", "must be > 0 (or null for no cap)")
        if self.time_budget_s is not None:
            check(self.time_budget_s > 0, "time_budget_s", f"got {self.time_budget_s}; must be > 0 (or null: off)")
        if self.optim.overlap_with_backward:
            why = "optim.overlap_with_backward steps each unit's parameters on the CPU during the layer-major backward"
            check(self.schedule.name in ("speedloader", "auto"), "optim.overlap_with_backward",
                  f"{why}; it needs schedule=speedloader (or auto), got schedule.name={self.schedule.name!r}: "
                  "set optim.overlap_with_backward=false")
            check(self.offload.params, "optim.overlap_with_backward",
                  f"{why}; it needs the parameters there: set offload=params (or optim.overlap_with_backward=false)")
        if self.optim.master_dtype != "fp32":
            check(self.offload.params, "optim.master_dtype",
                  f"optim.master_dtype={self.optim.master_dtype} shrinks the host copy of offloaded parameters; "
                  "set offload=params (or optim.master_dtype=fp32)")
            check(self.offload.param_transfer_dtype is None, "optim.master_dtype",
                  "bf16 master weights already cross to the GPU in bf16: set offload.param_transfer_dtype=null")
        if self.offload.param_transfer_dtype is not None:
            what = f"offload.param_transfer_dtype={self.offload.param_transfer_dtype}"
            check(self.schedule.name in ("speedloader", "auto") and self.schedule.activation_store in ("auto", "host"),
                  "offload.param_transfer_dtype", f"{what} needs the layer-major schedule's host arena: "
                  "schedule=speedloader (or auto) with schedule.activation_store=host (or auto), or "
                  "offload.param_transfer_dtype=null")
            check(self.param_dtype in ("auto", self.offload.param_transfer_dtype), "offload.param_transfer_dtype",
                  f"{what} differs from param_dtype={self.param_dtype}: FSDP2 casts to param_dtype on the device "
                  "anyway; set both to the same dtype, or offload.param_transfer_dtype=null")
        check(not (self.data.document_mask and self.kernels.sdpa_backend == "flash"), "kernels.sdpa_backend",
              "the flash SDPA kernel takes no attention mask, and data.document_mask needs one (block-causal per "
              "document): set kernels.sdpa_backend=auto, efficient or cudnn, or data.document_mask=false")
        check(self.data.seq_len <= self.model.max_position_embeddings or self.model.path is not None,
              "data.seq_len", f"{self.data.seq_len} exceeds model.max_position_embeddings="
              f"{self.model.max_position_embeddings}; lower data.seq_len")

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """Builds a validated config from a plain nested dict (e.g. ``OmegaConf.to_container``)."""
        resume = (d.get("checkpoint") or {}).get("resume")
        if isinstance(resume, bool):  # Hugging Face's resume_from_checkpoint=True: which checkpoint is meant?
            check(not resume, "checkpoint.resume", "got true; say which: checkpoint.resume=auto (the newest complete "
                  "step in checkpoint.dir; a fresh start when there is none) or checkpoint.resume=PATH (one "
                  "step_NNNNNNNN directory)")
            d = {**d, "checkpoint": {**d["checkpoint"], "resume": None}}
        return dataclass_from_dict(cls, d)


