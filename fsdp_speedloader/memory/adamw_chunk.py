"""The host AdamW step of one compressed chunk as one C++ kernel (``csrc/adamw_chunk.cpp``), built at first use.

``CompressedAdamW`` steps host parameters chunk by chunk on a thread pool (``memory/threads.py``). With torch ops a
chunk's step is about twenty elementwise passes over fp32 scratch (decode the moments, ``torch._fused_adamw_``,
round bf16 parameters, encode the moments), each dispatched under the interpreter lock: on a many-core host the
threads contend for the lock and for memory bandwidth. The kernel ``torch.ops.fsdp_speedloader.adamw_chunk_``
decodes, steps and encodes one block of ``BLOCK`` elements at a time in the core's cache, so the chunk's memory is
read and written once, and a call through ``torch.ops`` releases the interpreter lock while it runs. It does the
torch ops' IEEE operations in their order, including the multiply-adds torch's fused AdamW kernel fuses on this CPU
(``torch_arithmetic``), with correctly rounded square roots: bit for bit the torch-ops step with IEEE roots
(``tests/test_adamw_chunk.py``). torch.sqrt on x86 builds with MKL is MKL's, a unit in the last place off for a few
inputs in a thousand: there the torch-ops path's codes differ from the kernel's where such a root crosses a rounding
boundary (one code in tens of thousands), and a block's scale where its largest root is one of them.

Built by ``torch.utils.cpp_extension.load`` (a C++ compiler, and ninja: the ``ninja`` package, a dependency) into
torch's extension cache (``$TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``) under a name carrying
the torch version: once per machine and torch; later processes load it, and a file lock orders ranks that build at
once. The build targets the architecture's baseline, with an AVX2 + FMA copy chosen at run time on x86 (no
``-march=native``: a cache directory in a shared home serves machines with other CPUs).

Stochastic rounding of bf16 parameters takes its random bits from a counter-based generator (SplitMix64 of a key
and the element's position, ``memory/bf16_master.py``): the kernel is given the key (``bf16_master.noise_key``) and
the chunk's position in its parameter and computes each block's bits in its loop, the bits
``bf16_master.random_bits`` gives the torch-ops path.

``CompressedAdamW(kernel=...)``: ``"auto"`` (the default) the kernel where it builds, else the torch ops, after one
warning; ``"fused"`` the kernel or an error; ``"torch"`` the torch ops. ``$FSDP_SPEEDLOADER_FUSED_ADAMW`` = ``1`` /
``0`` makes ``"auto"`` mean ``"fused"`` / ``"torch"`` (for the trainer, which builds the optimizer itself). The kernel
steps fp32 and bf16 parameters on the CPU; fp16 ones and accelerator chunks always take the torch ops.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger(__name__)

KERNELS = ("auto", "fused", "torch")
KERNEL_ENV = "FSDP_SPEEDLOADER_FUSED_ADAMW"
SOURCE = Path(__file__).resolve().parent / "csrc" / "adamw_chunk.cpp"
# -ffp-contract=off: no multiply and add contracted into one behind the source's back (the kernel writes torch's
# fused ones out); -fno-math-errno / -fno-trapping-math (as torch builds): sqrt and rounding inline and vectorized,
# the values unchanged.
CFLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]

_lock = threading.Lock()
_built: Optional[bool] = None  # None: not tried yet in this process
_build_error = ""


def extension_name() -> str:
    """The extension's name in torch's cache: one build per torch version (its ABI)."""
    return "fsdp_speedloader_adamw_chunk_" + re.sub(r"[^0-9A-Za-z]", "_", torch.__version__)


def _ensure_ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from ``$PATH``; the ``ninja`` package's copy lies in the environment's bin
    directory, which is on ``$PATH`` only when the environment is activated."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join([os.environ.get("PATH", ""), str(ninja.BIN_DIR)])


def load() -> bool:
    """Builds (first time on this machine) or loads the kernel, once per process; False, after one warning, where
    it cannot be built."""
    global _built, _build_error
    with _lock:
        if _built is None:
            try:
                from torch.utils import cpp_extension

                _ensure_ninja_on_path()
                # The first use on a machine compiles it (the step waits): say so, or the wait looks like a hang.
                log.info("CompressedAdamW: loading the fused host AdamW kernel %s (compiled into torch's extension "
                         "cache at its first use on this machine and torch)", extension_name())
                cpp_extension.load(name=extension_name(), sources=[str(SOURCE)], extra_cflags=CFLAGS,
                                   is_python_module=False, verbose=False)
                _built = True
            except Exception as e:  # no compiler, no ninja, a failed compilation: the torch ops remain
                lines = [line for line in str(e).strip().splitlines() if line.strip()]
                _build_error = f"{type(e).__name__}: {lines[-1] if lines else ''}"
                log.debug("building %s failed: %s", SOURCE, e)
                log.warning("CompressedAdamW: the fused C++ AdamW kernel could not be built (%s); stepping with "
                            "torch ops (slower; %s=0 skips the attempt)", _build_error, KERNEL_ENV)
                _built = False
        return _built


def use_kernel(kernel: str) -> bool:
    """Whether ``CompressedAdamW(kernel=kernel)`` steps its host chunks with the kernel (building it if needed)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: one of {', '.join(KERNELS)}")
    if kernel == "auto":
        env = os.environ.get(KERNEL_ENV, "")
        if env not in ("", "0", "1"):
            raise ValueError(f"{KERNEL_ENV}={env!r}: 1 (the fused C++ kernel), 0 (torch ops) or unset (the kernel "
                             "where it builds)")
        kernel = {"": "auto", "1": "fused", "0": "torch"}[env]
    if kernel == "torch":
        return False
    if load():
        return True
    if kernel == "fused":
        raise RuntimeError(f"the fused C++ AdamW kernel could not be built ({_build_error}); it needs a C++ compiler "
                           f"and ninja; kernel='torch' (or {KERNEL_ENV}=0) steps with torch ops")
    return False


@functools.lru_cache(maxsize=None)
def torch_arithmetic() -> tuple[int, bool]:
    """How ``torch._fused_adamw_`` rounds on this CPU, as (scalar tail, fused multiply-adds). With fused
    multiply-adds (torch's AVX2 and AVX512 builds) exp_avg's lerp is one, and exp_avg_sq's update is contracted one
    way for a chunk's elements up to the last multiple of the scalar tail and the other way for the rest: torch's
    vector loop (8 elements wide with AVX2, 16 with AVX512, where the compiler vectorized the scalar loop 8 at a time)
    and its scalar loop (``csrc/adamw_chunk.cpp``, ``update``). Read from torch's x86 builds (``ATEN_CPU_CAPABILITY``
    AVX512, AVX2, DEFAULT); on other instruction sets the last ``n % 8`` elements of a chunk may differ from torch's
    in the last bit."""
    return 8, torch.backends.cpu.get_cpu_capability() != "DEFAULT"


def step_chunk(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               exp_avg_scale: Optional[torch.Tensor], exp_avg_sq_scale: Optional[torch.Tensor],
               noise_key: Optional[int] = None, position: int = 0, *, lr: float, beta1: float, beta2: float,
               weight_decay: float, eps: float, step: float) -> None:
    """One AdamW step of a chunk (1-D, contiguous, starting at a multiple of ``BLOCK``) in place: ``param`` fp32 or
    bf16, rounded stochastically where ``noise_key`` (``bf16_master.noise_key``) is given, else to nearest; moments
    int8 / uint8 codes with their blocks' scales, or bf16. The kernel computes the random bits itself, those
    ``bf16_master.random_bits`` gives for the chunk's elements at their ``position + i`` in the whole parameter.
    ``load()`` first."""
    torch.ops.fsdp_speedloader.adamw_chunk_(param, grad, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale,
                                            noise_key, position, lr, beta1, beta2, weight_decay, eps, step,
                                            *torch_arithmetic())

