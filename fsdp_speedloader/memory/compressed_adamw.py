"""AdamW with its moments stored in fewer bytes than fp32: opt-in, for host memory (docs/design.md §13).

``CompressedAdamW(params, state_dtype="bf16", lr=..., ...)`` is ``torch.optim.AdamW(fused=True)`` whose
``exp_avg`` and ``exp_avg_sq`` live in host memory as

- ``bf16``: bfloat16 (2 + 2 bytes per parameter instead of 4 + 4), rounded to nearest after every step;
- ``int8``: 8-bit blockwise (1 + 1 bytes, plus one fp32 scale per block of ``BLOCK`` elements per moment):
  ``exp_avg`` as int8 codes of ``sign(x) sqrt(|x|)``, ``exp_avg_sq`` as uint8 codes of ``x^(1/4)``, each scaled
  by its block's largest and rounded to nearest (the roots compress the range a block spans; see the codes
  below).

The parameters stay as they are (fp32 masters when the model is fp32; bf16 master weights, rounded to nearest or,
with ``rounding="stochastic"``, stochastically with counter-based random bits, the same on both paths below:
``memory/bf16_master.py``), and so does the arithmetic: each step is
torch's own fused AdamW (``torch._fused_adamw_``, the one ``torch.optim.AdamW(fused=True)`` calls) on fp32 moments
decoded chunk by chunk, then encoded back. On the host the chunks are stepped on several threads at once, one chunk
per thread (``CHUNK_PER_THREAD``), each by one C++ kernel (``memory/adamw_chunk.py``, ``csrc/adamw_chunk.cpp``, built
at first use) that decodes, steps and encodes block by block in the core's cache, with torch's arithmetic, and runs
without the interpreter lock. Where the kernel cannot be built (no compiler), or with ``kernel="torch"`` (or
``$FSDP_SPEEDLOADER_FUSED_ADAMW=0``), and on accelerators, a chunk is about twenty torch operations instead: the
moments decoded into fp32 scratch (one buffer per thread and device, reused), ``torch._fused_adamw_`` on it, the
codes encoded back. So ``state_dtype="bf16"`` gives, bit for bit, fused AdamW whose moments are rounded to bf16
after each step (``tests/test_compressed_adamw.py``); the two paths agree bit for bit but for torch's MKL square
root in the int8 codes (``tests/test_adamw_chunk.py``).

Why not a library: on CPU tensors torchao's low-bit and bf16 stochastic-rounding AdamW (torch.compile'd per
parameter) and bitsandbytes' 8-bit AdamW (its CPU fallback) measured 25 to 100 times slower than fused fp32 AdamW
(``bench/results/cpu_optim_step_llama7b_blocks*.json``): a 13B model's host step would take longer than its GPU
step.

Works on plain tensors and on FSDP2's DTensor parameters (each rank steps its local shard; the states are DTensors
like the parameters, so ``torch.distributed.checkpoint`` saves and loads them sharded, in their stored dtype).
``state_dict`` holds the stored form (bf16, or int8 codes and fp32 scales); ``load_state_dict`` keeps it (it does
not cast the moments to the parameters' dtype as ``torch.optim`` does). Not supported: amsgrad, maximize,
capturable, differentiable, a tensor lr on another device, grad_scale/found_inf.
"""

from __future__ import annotations

import functools
import math
import threading
from itertools import chain
from typing import Any, Callable, Iterable, Optional

import torch
from torch.distributed.tensor import DTensor

from fsdp_speedloader.memory import adamw_chunk
from fsdp_speedloader.memory.bf16_master import noise_key, random_bits, stochastic_round_
from fsdp_speedloader.memory.threads import run_on_host_threads

STATE_DTYPES = ("fp32", "bf16", "int8")
"""``fp32``: plain ``torch.optim.AdamW`` (exact, the default); ``bf16`` / ``int8``: :class:`CompressedAdamW`."""

STATE_BYTES_PER_PARAM = {"fp32": 8.0, "bf16": 4.0, "int8": 2.0 + 8.0 / 2048}
"""Host bytes per parameter of the two AdamW moments, by ``state_dtype`` (int8: codes + one fp32 scale per block
per moment)."""

BLOCK = 2048  # int8: elements per quantisation block (one fp32 scale each, per moment)
# On the host, each chunk of CHUNK_PER_THREAD elements (a multiple of BLOCK: 8 MiB of fp32 scratch per buffer) is
# stepped whole by one thread with one intra-op thread, the chunks on as many threads as the caller's intra-op thread
# count. The ~20 elementwise operations of a chunk then run on the thread's own scratch and open no parallel
# region: with intra-op parallelism each operation is a region whose barrier waits for every thread, and where the
# training's own threads share the cores (the overlapped step runs beside the backward) a barrier waits for
# descheduled threads (docs/design.md §13, bench/results/cpu_optim_step_llama7b_blocks*.json). With torch ops each
# chunk's operations take the interpreter lock to dispatch: on a 16-core host fewer, larger chunks won, up to 2^21
# elements (bench/results/cpu_optim_step_h100_host_chunks*.json); the C++ kernel is one call per chunk. On a GPU, one
# chunk of DEVICE_CHUNK.
CHUNK_PER_THREAD = 1 << 21
DEVICE_CHUNK = 1 << 26
_MOMENTS = ("exp_avg", "exp_avg_sq")
_SCALES = {"exp_avg": "exp_avg_scale", "exp_avg_sq": "exp_avg_sq_scale"}
_scratch = threading.local()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _scales_like(p: torch.Tensor, blocks: int) -> torch.Tensor:
    """int8's per-block fp32 scales of ``p``: ``blocks`` of them on this rank, a DTensor sharded like ``p`` when
    ``p`` is one (every rank holds the same count, sized for the largest shard, so the global shape is even)."""
    if isinstance(p, DTensor):
        shards = math.prod(p.device_mesh.size(d) for d, pl in enumerate(p.placements) if pl.is_shard())
        device = p.to_local().device
        scales = DTensor.from_local(torch.zeros(blocks, dtype=torch.float32, device=device), p.device_mesh,
                                    p.placements, run_check=False, shape=torch.Size([blocks * shards]), stride=(1,))
        # from_local moves the local tensor to the mesh's device type: an offloaded shard's scales (a CUDA mesh,
        # the shard on the CPU) go back to where the shard and its codes are, as FSDP2 keeps offloaded shards.
        return scales if scales.to_local().device == device else scales.to(device)
    return torch.zeros(blocks, dtype=torch.float32, device=p.device)


def _num_blocks(p: torch.Tensor) -> int:
    """int8 blocks of ``p``'s local shard; for a DTensor, of the largest shard (``ceil(dim 0 / shards)`` rows)."""
    if isinstance(p, DTensor) and p.dim() > 0:
        shards = math.prod(p.device_mesh.size(d) for d, pl in enumerate(p.placements) if pl.is_shard())
        numel = -(-p.shape[0] // shards) * math.prod(p.shape[1:])
    else:
        numel = _local(p).numel()
    return max(1, -(-numel // BLOCK))


def _fp32_scratch(n: int, device: torch.device, count: int = 2) -> tuple[torch.Tensor, ...]:
    """``count`` fp32 buffers of at least ``n`` elements on ``device``, this thread's (the optimizer worker and the
    main thread each have their own). Reused: a fresh allocation of a chunk's size costs its page faults again."""
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    buf = bufs.get(device)
    if buf is None or buf.shape[1] < n or buf.shape[0] < count:
        rows = max(count, buf.shape[0] if buf is not None else 0)
        buf = bufs[device] = torch.empty(rows, n, dtype=torch.float32, device=device)
    return tuple(buf[i, :n] for i in range(count))


def chunk_elements(device: torch.device) -> int:
    """Elements stepped at a time: ``CHUNK_PER_THREAD`` per host thread, ``DEVICE_CHUNK`` on an accelerator."""
    return CHUNK_PER_THREAD if device.type == "cpu" else DEVICE_CHUNK


def _run_chunks(tasks: list[Callable[[], None]], device: torch.device) -> None:
    """The chunks' steps: on the host on the caller's intra-op thread count of pool threads, one chunk per thread at
    a time; on an accelerator in order (its kernels are asynchronous already)."""
    if device.type == "cpu":
        run_on_host_threads(tasks)
        return
    for task in tasks:
        task()


class CompressedAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW(fused=True)`` with ``exp_avg`` / ``exp_avg_sq`` stored in ``state_dtype`` ('bf16' or
    'int8'); see the module docstring. ``kernel``: how host chunks are stepped, 'auto' (the fused C++ kernel where
    it builds, else torch ops), 'fused' or 'torch' (``memory/adamw_chunk.py``). The other arguments are AdamW's."""

    def __init__(self, params: Iterable, *, state_dtype: str = "bf16", lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 rounding: str = "nearest", seed: int = 0, kernel: str = "auto") -> None:
        if state_dtype not in ("bf16", "int8"):
            raise ValueError(f"state_dtype={state_dtype!r}: CompressedAdamW stores 'bf16' or 'int8' moments "
                             "(fp32 moments: torch.optim.AdamW)")
        if rounding not in ("nearest", "stochastic"):
            raise ValueError(f"rounding={rounding!r}: 'nearest' or 'stochastic' (bf16 parameters)")
        if kernel not in adamw_chunk.KERNELS:
            raise ValueError(f"kernel={kernel!r}: one of {', '.join(adamw_chunk.KERNELS)}")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.state_dtype = state_dtype
        # bf16 parameters (master weights, memory/bf16_master.py): each update rounded to nearest, or stochastically
        # with counter-based random bits, a hash of (seed, the parameter's index here, its step, the element's
        # position): the fused kernel computes them itself, the torch-ops path with bf16_master.random_bits.
        self.rounding, self.seed = rounding, seed
        self.kernel = kernel
        self._fused: Optional[bool] = None  # whether host chunks take the C++ kernel: decided at the first host step
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                    raise ValueError(f"CompressedAdamW steps floating-point parameters; got {p.dtype}")

    # --- state -------------------------------------------------------------------------------------------------
    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if state:
            return state
        state["step"] = torch.zeros((), dtype=torch.float32, device=_local(p).device)  # as fused AdamW keeps it
        if self.state_dtype == "bf16":
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.contiguous_format)
        else:
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.int8, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.uint8, memory_format=torch.contiguous_format)
            for key in _MOMENTS:
                state[_SCALES[key]] = _scales_like(p, _num_blocks(p))
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """``torch.optim``'s, but the moments (and scales) keep their stored dtype: torch would cast them to the
        parameters' (fp32), a transient copy of every moment at once."""
        kept = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")
        stripped = {pid: {k: v for k, v in s.items() if k not in kept} for pid, s in state_dict["state"].items()}
        super().load_state_dict({**state_dict, "state": stripped})
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = dict(zip(saved_ids, chain.from_iterable(g["params"] for g in self.param_groups)))
        for pid, s in state_dict["state"].items():
            p = params[pid]
            for key in kept:
                if key in s:
                    value = s[key]
                    expected = self._stored_dtype(key)
                    if value.dtype != expected:
                        raise ValueError(f"checkpoint: optimizer state {key!r} is {value.dtype}, this run stores "
                                         f"{expected} (optim.state_dtype={self.state_dtype}); resume with the "
                                         "optim.state_dtype the checkpoint was written with")
                    self.state[p][key] = value.to(device=_local(p).device)

    def _stored_dtype(self, key: str) -> torch.dtype:
        if self.state_dtype == "bf16":
            return torch.bfloat16
        return {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}.get(key, torch.float32)

    # --- the step ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Any] = None) -> Optional[Any]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = -1  # each parameter's position in the optimizer (stochastic rounding's seed)
        tasks_by_device: dict[torch.device, list] = {}  # every parameter's chunks, stepped together
        for group in self.param_groups:
            if group.get("amsgrad") or group.get("maximize") or group.get("differentiable"):
                raise ValueError("CompressedAdamW supports neither amsgrad, maximize nor differentiable")
            beta1, beta2 = group["betas"]
            kwargs = dict(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                          weight_decay=float(group["weight_decay"]), eps=float(group["eps"]), amsgrad=False,
                          maximize=False)
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self._init_state(p)
                state["step"] += 1
                local = _local(p)
                tasks = tasks_by_device.setdefault(local.device, [])
                tasks += self._chunk_steps(local, _local(p.grad), state, kwargs, index=index)
        for device, tasks in tasks_by_device.items():
            _run_chunks(tasks, device)
        return loss

    def _chunk_steps(self, p: torch.Tensor, g: torch.Tensor, state: dict, kwargs: dict, *,
                     index: int = 0) -> list[Callable[[], None]]:
        """``p``'s step as independent chunk steps: the fused kernel on each chunk, its moments decoded into fp32
        scratch (the running thread's) and encoded back. Chunks are whole int8 blocks, and the random bits of
        stochastic rounding depend on positions only, so the result does not depend on the chunking."""
        if g.dtype != p.dtype:
            raise ValueError(f"gradient dtype {g.dtype} differs from its parameter's {p.dtype}")
        p_flat, g_flat = p.view(-1), g.reshape(-1)
        m, v = _local(state["exp_avg"]).view(-1), _local(state["exp_avg_sq"]).view(-1)
        m_scale = v_scale = None
        if self.state_dtype == "int8":
            m_scale, v_scale = _local(state["exp_avg_scale"]), _local(state["exp_avg_sq_scale"])
        step, step_number = [state["step"]], int(state["step"])
        n, chunk = p_flat.numel(), chunk_elements(p_flat.device)
        if p_flat.device.type == "cpu" and p_flat.dtype in (torch.float32, torch.bfloat16) and self._use_kernel():
            return self._fused_chunk_steps(p_flat, g_flat, m, v, m_scale, v_scale, kwargs, index=index,
                                           step=float(state["step"]))

        @torch.no_grad()  # on the pool's threads too: grad mode is per thread
        def step_chunk(start: int, end: int) -> None:
            # The moments' fp32 scratch, and for bf16/fp16 parameters their fp32 copy and the gradient's.
            m32, v32, *p32_g32 = _fp32_scratch(end - start, p_flat.device,
                                               count=2 if p_flat.dtype == torch.float32 else 4)
            if self.state_dtype == "bf16":
                m32.copy_(m[start:end])
                v32.copy_(v[start:end])
            else:
                b0, b1 = start // BLOCK, -(-end // BLOCK)
                _decode_signed(m[start:end], m_scale[b0:b1], m32)
                _decode_sqrt(v[start:end], v_scale[b0:b1], v32)
            if p_flat.dtype == torch.float32:
                torch._fused_adamw_([p_flat[start:end]], [g_flat[start:end]], [m32], [v32], [], step, **kwargs)
            else:  # bf16/fp16 parameters: the kernel wants one dtype; compute in fp32, then round
                p32, g32 = p32_g32
                p32.copy_(p_flat[start:end])
                g32.copy_(g_flat[start:end])
                torch._fused_adamw_([p32], [g32], [m32], [v32], [], step, **kwargs)
                if self.rounding == "stochastic" and p_flat.dtype == torch.bfloat16:
                    bits = random_bits(end - start, seed=self.seed, index=index, step=step_number, offset=start,
                                       out=g32.view(torch.int32))  # the gradient's copy is read
                    stochastic_round_(p_flat[start:end], p32, bits)
                else:
                    p_flat[start:end].copy_(p32)
            if self.state_dtype == "bf16":
                m[start:end].copy_(m32)
                v[start:end].copy_(v32)
            else:
                _encode_signed(m32, m[start:end], m_scale[b0:b1])
                _encode_sqrt(v32, v[start:end], v_scale[b0:b1])

        return [functools.partial(step_chunk, start, min(n, start + chunk)) for start in range(0, n, chunk)]

    def _use_kernel(self) -> bool:
        if self._fused is None:
            self._fused = adamw_chunk.use_kernel(self.kernel)
        return self._fused

    def _fused_chunk_steps(self, p_flat: torch.Tensor, g_flat: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                           m_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor], kwargs: dict, *,
                           index: int, step: float) -> list[Callable[[], None]]:
        """``_chunk_steps`` of a host parameter with the C++ kernel: one call per chunk, the interpreter lock free
        while it runs; the same results."""
        n, chunk = p_flat.numel(), chunk_elements(p_flat.device)
        scalars = {k: kwargs[k] for k in ("lr", "beta1", "beta2", "weight_decay", "eps")}
        stochastic = self.rounding == "stochastic" and p_flat.dtype == torch.bfloat16
        key = noise_key(self.seed, index, int(step)) if stochastic else None  # the kernel computes the bits

        @torch.no_grad()  # on the pool's threads too: the kernel writes the parameter in place
        def step_chunk(start: int, end: int) -> None:
            scales = (None, None)
            if m_scale is not None:
                b0, b1 = start // BLOCK, -(-end // BLOCK)
                scales = (m_scale[b0:b1], v_scale[b0:b1])
            adamw_chunk.step_chunk(p_flat[start:end], g_flat[start:end], m[start:end], v[start:end], *scales, key,
                                   start, step=step, **scalars)

        return [functools.partial(step_chunk, start, min(n, start + chunk)) for start in range(0, n, chunk)]


# --- int8 blockwise codes ----------------------------------------------------------------------------------------
#
# A linear 8-bit code of a moment loses its small elements to zero (a block of 2048 spans orders of magnitude), and
# a zero exp_avg_sq under a non-zero exp_avg makes an update of exp_avg / eps. So each moment is coded through a
# root, which compresses its range: exp_avg as sign(x) sqrt(|x|) (int8, 127 levels each side), exp_avg_sq as
# x^(1/4) (uint8, 255 levels: a ratio of 4e9 between the block's largest and smallest non-zero element), each
# scaled by its block's largest and rounded to nearest. An exp_avg_sq code of 0 in a non-zero block decodes as half
# a step, not 0, which bounds the update of an element whose exp_avg_sq fell below the code's range.


def _blocks(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` (1-D) as (blocks, BLOCK) rows, zero-padded into a copy when its length is no multiple of BLOCK; and
    its length."""
    n = x.numel()
    if n % BLOCK == 0:
        return x.view(-1, BLOCK), n
    padded = torch.zeros(-(-n // BLOCK) * BLOCK, dtype=x.dtype, device=x.device)
    padded[:n].copy_(x)
    return padded.view(-1, BLOCK), n


def _encode(rows: torch.Tensor, n: int, q: torch.Tensor, scale: torch.Tensor, levels: float,
            sign: Optional[torch.Tensor] = None) -> None:
    """``q = round(rows / max(rows) * levels)`` per block (with ``sign``'s sign, where given), ``scale = max(rows) /
    levels``; ``rows`` (>= 0) is scratch. Multiplying the magnitudes and then taking the sign gives the codes the
    signed values would (IEEE multiplication and round-half-even are symmetric), one pass over the chunk fewer."""
    peak = rows.amax(dim=1, keepdim=True)
    scale.copy_(peak.view(-1) / levels)
    rows.mul_(levels / peak.clamp_min(torch.finfo(torch.float32).tiny))
    if sign is not None:
        rows.copysign_(sign)
    q.copy_(rows.round_().view(-1)[:n])


def _decode(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """``out = q * scale`` per block."""
    n = q.numel()
    full = n - n % BLOCK
    if full:
        torch.mul(q[:full].view(-1, BLOCK), scale[: full // BLOCK, None], out=out[:full].view(-1, BLOCK))
    if n > full:
        torch.mul(q[full:], scale[-1], out=out[full:])


def _encode_signed(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """exp_avg -> int8 codes of sign(x) sqrt(|x|); ``x`` (fp32 scratch) is overwritten."""
    rows, n = _blocks(x)
    _encode(rows.abs().sqrt_(), n, q, scale, 127.0, sign=rows)


def _decode_signed(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    _decode(q, scale, out)
    out.mul_(out.abs())  # sign(y) y^2


def _encode_sqrt(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """exp_avg_sq (>= 0) -> uint8 codes of x^(1/4); ``x`` (fp32 scratch) is overwritten."""
    rows, n = _blocks(x)
    rows.sqrt_().sqrt_()
    _encode(rows, n, q, scale, 255.0)


def _decode_sqrt(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    _decode(q, scale, out)
    n = q.numel()
    full = n - n % BLOCK
    if full:  # code 0 in a non-zero block: half a step
        rows = out[:full].view(-1, BLOCK)
        torch.maximum(rows, scale[: full // BLOCK, None] * 0.5, out=rows)
    if n > full:
        torch.clamp_min(out[full:], scale[-1] * 0.5, out=out[full:])
    out.square_().square_()


def state_bytes_per_param(state_dtype: str) -> float:
    """Host bytes per parameter of AdamW's two moments stored as ``state_dtype`` (``STATE_DTYPES``)."""
    if state_dtype not in STATE_BYTES_PER_PARAM:
        raise ValueError(f"state_dtype={state_dtype!r}; choose one of {', '.join(STATE_DTYPES)}")
    return STATE_BYTES_PER_PARAM[state_dtype]


def num_state_bytes(num_params: int, state_dtype: str) -> int:
    """Host bytes of AdamW's moments for ``num_params`` parameters (one tensor; int8 scales rounded up per block)."""
    if state_dtype == "int8":
        return 2 * num_params + 2 * 4 * math.ceil(num_params / BLOCK)
    return int(state_bytes_per_param(state_dtype) * num_params)
