"""The fused C++ host step of a compressed chunk (``memory/adamw_chunk.py``): bit for bit the torch-ops step with
IEEE square roots (codes, scales, bf16 and fp32 parameters, step after step; chunk tails, zeros, huge and tiny
values, weight decay on and off, both branches of torch's lerp), and CompressedAdamW's torch-ops path up to torch's
MKL square root; the interpreter lock free while it runs; the switch; and the fallback to torch ops, after one
warning, where it cannot be built."""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
import time

import numpy as np
import pytest
import torch

from fsdp_speedloader.memory import adamw_chunk, compressed_adamw
from fsdp_speedloader.memory.bf16_master import noise_key, random_bits, stochastic_round_
from fsdp_speedloader.memory.compressed_adamw import CompressedAdamW

pytestmark = pytest.mark.usefixtures("one_thread")

# Lengths: no multiple of the block or of torch's vector sizes (16, 8), one shorter than a vector; with chunks of
# 4096 elements the long ones end in short chunks (13 elements, 904 = 56 x 16 + 8).
SIZES = [1, 7, 149, 2048, 4096 + 13, 5000]


@pytest.fixture(scope="module")
def kernel_built():
    """The kernel built (first time on this machine: seconds) or loaded from torch's extension cache."""
    assert adamw_chunk.load(), f"the fused AdamW kernel did not build: {adamw_chunk._build_error}"


def _values(kind: str, n: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, generator=gen)
    if kind == "zeros":
        return torch.zeros(n)
    if kind == "huge":
        return x * 1e18
    if kind == "tiny":  # fp32 subnormals among them; their squares underflow to zero
        return x * 1e-39
    if kind == "mixed":  # many orders of magnitude in one block, a zero block after the first
        x = x * torch.logspace(-30, 15, n)
        x[2048:4096] = 0
        return x
    return x


KINDS = ["normal", "zeros", "huge", "tiny", "mixed", "normal"]


def test_a_chunks_last_elements_round_as_torchs_scalar_loop(kernel_built):
    """torch's kernel contracts exp_avg_sq's update one way in its vector loop and another in the scalar loop over a
    chunk's last elements (``torch_arithmetic``). Zero parameters make each step's update the parameter itself, so
    a different rounding of exp_avg_sq shows in it (bf16 moments: more bits of them carry to the next step)."""
    n = 2 * 2048 + 29  # the last 29 elements: 16 + 8 + 5 (AVX512), 3 x 8 + 5 (AVX2): 5 in torch's scalar loop
    gen = torch.Generator().manual_seed(3)
    state = _state("bf16", n)
    for step in range(1, 41):
        p, g = torch.zeros(n), torch.randn(n, generator=gen)
        kw = dict(lr=1e-2, beta1=0.9, beta2=0.95, weight_decay=0.0, eps=1e-8, step=float(step))
        ref_p, ref_state = _reference_step(p, g, state, None, "nearest", dict(kw))
        adamw_chunk.step_chunk(p, g, *state, None, **kw)
        assert torch.equal(p, ref_p) and all(a is b is None or torch.equal(a, b) for a, b in zip(state, ref_state))


def _runs(state_dtype: str, dtype: torch.dtype, rounding: str, betas, weight_decay: float, steps: int = 4):
    """The kernel's optimizer and the torch-ops one on the same parameters and gradients, stepped side by side:
    yields (fused parameters, fused optimizer, torch-ops parameters, torch-ops optimizer) after every step."""
    runs = []
    for kernel in ("fused", "torch"):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(_values(kind if kind != "huge" else "normal", n, gen).to(dtype))
                  for kind, n in zip(KINDS, SIZES)]
        opt = CompressedAdamW(params, state_dtype=state_dtype, rounding=rounding, lr=1e-2, betas=betas,
                              weight_decay=weight_decay, seed=7, kernel=kernel)
        runs.append((params, opt))
    for step in range(steps):
        for params, opt in runs:
            gen = torch.Generator().manual_seed(100 + step)
            for k, p in enumerate(params):
                kind = KINDS[(k + step) % len(KINDS)]  # each parameter sees several kinds of gradient
                p.grad = _values(kind, p.numel(), gen).to(dtype)
            opt.step()
        yield (*runs[0], *runs[1])
    assert runs[0][1]._fused and not runs[1][1]._fused


CASES = [("int8", torch.float32, "nearest"), ("int8", torch.bfloat16, "nearest"),
         ("int8", torch.bfloat16, "stochastic"), ("bf16", torch.float32, "nearest"),
         ("bf16", torch.bfloat16, "stochastic")]
HYPER = [((0.9, 0.95), 0.1), ((0.3, 0.999), 0.0)]  # beta1 = 0.3: the other branch of torch's lerp (1 - beta1 >= 0.5)


def _state(state_dtype: str, n: int) -> list:
    if state_dtype == "bf16":
        return [torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16), None, None]
    blocks = -(-n // compressed_adamw.BLOCK)
    return [torch.zeros(n, dtype=torch.int8), torch.zeros(n, dtype=torch.uint8), torch.zeros(blocks),
            torch.zeros(blocks)]


def _reference_step(p, g, state, bits, rounding, kw) -> tuple:
    """The torch-ops step of compressed_adamw on one chunk, its roots taken by numpy: torch.sqrt on x86 builds with
    MKL is MKL's, which misses the correctly rounded root by one unit in the last place for about 0.5% of inputs;
    the kernel takes IEEE square roots (and so does torch._fused_adamw_ for its denominator)."""
    m, v, m_scale, v_scale = (t.clone() if t is not None else None for t in state)
    n = p.numel()
    m32, v32 = torch.empty(n), torch.empty(n)
    if m_scale is None:
        m32.copy_(m), v32.copy_(v)
    else:
        compressed_adamw._decode_signed(m, m_scale, m32)
        compressed_adamw._decode_sqrt(v, v_scale, v32)
    p32, g32 = p.to(torch.float32, copy=True), g.to(torch.float32, copy=True)  # (the inputs stay as they are)
    step = kw.pop("step")
    torch._fused_adamw_([p32], [g32], [m32], [v32], [], [torch.tensor(step)], amsgrad=False, maximize=False, **kw)
    kw["step"] = step
    if p.dtype == torch.float32:
        p_new = p32
    elif rounding == "stochastic":
        p_new = torch.empty(n, dtype=torch.bfloat16)
        stochastic_round_(p_new, p32, bits)
    else:
        p_new = p32.bfloat16()
    if m_scale is None:
        return p_new, [m32.bfloat16(), v32.bfloat16(), None, None]
    root_m = torch.from_numpy(np.sqrt(np.abs(m32.numpy())))
    root_v = torch.from_numpy(np.sqrt(np.sqrt(v32.numpy())))
    (rows_m, _), (sign, _), (rows_v, _) = (compressed_adamw._blocks(x) for x in (root_m, m32, root_v))
    compressed_adamw._encode(rows_m, n, m, m_scale, 127.0, sign=sign)
    compressed_adamw._encode(rows_v, n, v, v_scale, 255.0)
    return p_new, [m, v, m_scale, v_scale]


@pytest.mark.parametrize("betas, weight_decay", HYPER)
@pytest.mark.parametrize("state_dtype, dtype, rounding", CASES)
def test_the_kernel_is_the_torch_ops_step_with_ieee_roots_bit_for_bit(kernel_built, state_dtype, dtype, rounding,
                                                                      betas, weight_decay):
    """Each step of a chunk from the same state: parameters, codes, scales (or bf16 moments) equal bit for bit."""
    gen = torch.Generator().manual_seed(0)
    for k, n in enumerate(SIZES):
        p = _values(KINDS[k] if KINDS[k] != "huge" else "normal", n, gen).to(dtype)
        state = _state(state_dtype, n)
        for step in range(1, 5):
            g = _values(KINDS[(k + step) % len(KINDS)], n, gen).to(dtype)
            stochastic = rounding == "stochastic"
            bits = random_bits(n, seed=1, index=k, step=step) if stochastic else None
            kw = dict(lr=1e-2, beta1=betas[0], beta2=betas[1], weight_decay=weight_decay, eps=1e-8, step=float(step))
            ref_p, ref_state = _reference_step(p, g, state, bits, rounding, dict(kw))
            adamw_chunk.step_chunk(p, g, *state, noise_key(1, k, step) if stochastic else None, **kw)
            assert torch.equal(p, ref_p), (n, step)
            for a, b in zip(state, ref_state):
                assert a is b is None or torch.equal(a, b), (n, step)
        assert bool(p.ne(0).any()) or KINDS[k] == "zeros"


@pytest.mark.parametrize("position", [2048, 12_345, (1 << 33) + 4_097])
def test_the_kernels_random_bits_are_random_bits_at_the_chunks_position(kernel_built, position):
    """A chunk that starts at ``position`` of its parameter (no multiple of anything, past 2^32) rounds with
    ``random_bits(offset=position)``: the bf16 parameters equal the torch-ops step's with those bits, bit for bit,
    step after step; the bits of position 0 instead would round differently."""
    n = 2 * 2048 + 777
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(n, generator=gen).bfloat16()
    state = _state("int8", n)
    for step in range(1, 4):
        g = torch.randn(n, generator=gen).bfloat16()
        kw = dict(lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, step=float(step))
        bits = random_bits(n, seed=3, index=2, step=step, offset=position)
        ref_p, _ = _reference_step(p, g, state, bits, "stochastic", dict(kw))
        wrong_p, _ = _reference_step(p, g, state, random_bits(n, seed=3, index=2, step=step), "stochastic", dict(kw))
        adamw_chunk.step_chunk(p, g, *state, noise_key(3, 2, step), position, **kw)
        assert torch.equal(p, ref_p), step
        assert not torch.equal(p, wrong_p)


@pytest.mark.parametrize("betas, weight_decay", HYPER)
@pytest.mark.parametrize("state_dtype, dtype, rounding", CASES)
def test_compressed_adamw_steps_as_with_torch_ops(kernel_built, monkeypatch, state_dtype, dtype, rounding, betas,
                                                  weight_decay):
    """The optimizer with the kernel against its torch-ops path over several chunked steps: bit for bit with bf16
    moments; with int8 codes up to the codes torch's MKL square root rounds across a code boundary (one in tens of
    thousands) or a block's largest root it misses by a unit in the last place (the block's scale off by as much;
    on a tie, as for the elements at the code floor, every element of the block on it flips with it)."""
    monkeypatch.setattr(compressed_adamw, "CHUNK_PER_THREAD", 4096)
    exact = state_dtype == "bf16"
    events: set = set()  # the codes that differed after a step, per block and pair of codes
    # Elements whose codes or block scales differed after some step: their parameters may differ from then on.
    flipped = [torch.zeros(n, dtype=torch.bool) for n in SIZES]
    for fused, fused_opt, ref, ref_opt in _runs(state_dtype, dtype, rounding, betas, weight_decay):
        for k, (p, r) in enumerate(zip(fused, ref)):
            assert p.dtype == r.dtype == dtype
            a, b = fused_opt.state[p], ref_opt.state[r]
            assert a.keys() == b.keys() and all(a[key].dtype == b[key].dtype for key in a)
            if exact:
                assert torch.equal(p, r) and all(torch.equal(a[key], b[key]) for key in a)
                continue
            for key in ("exp_avg_scale", "exp_avg_sq_scale"):
                torch.testing.assert_close(a[key], b[key], rtol=2.5e-7, atol=0)
                for j in a[key].ne(b[key]).nonzero().flatten().tolist():  # the block decodes an ulp apart from here on
                    flipped[k][j * compressed_adamw.BLOCK:(j + 1) * compressed_adamw.BLOCK] = True
            for key in ("exp_avg", "exp_avg_sq"):
                differ = a[key].int() - b[key].int()
                assert differ.abs().max() <= 1, key
                where = differ.ne(0).nonzero().flatten().tolist()
                flipped[k][where] = True
                # A block's elements at exp_avg_sq's code floor (half a step) decay in step with its peak and land
                # together on a tie (exactly half a step): one rounding of the peak's root flips them all. So a
                # difference counts once per block and pair of codes.
                events |= {(k, key, i // compressed_adamw.BLOCK, int(a[key][i]), int(b[key][i])) for i in where}
            torch.testing.assert_close(p.float(), r.float(), rtol=0, atol=1e-2)  # lr: no element's path differs much
    if exact:
        return
    codes_differ = len(events)
    params_differ = sum(int((p.ne(r) & ~f).sum()) for p, r, f in zip(fused, ref, flipped))
    assert codes_differ <= 4 and params_differ <= 4 * len(SIZES)  # of 2 x 11,314 codes and 11,314 parameters


def test_the_kernel_checks_its_operands(kernel_built):
    p, g = torch.zeros(10), torch.zeros(10)
    m, v = torch.zeros(10, dtype=torch.int8), torch.zeros(10, dtype=torch.uint8)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.0, eps=1e-8, step=1.0)
    with pytest.raises(RuntimeError, match="scales"):
        adamw_chunk.step_chunk(p, g, m, v, None, None, None, **kw)
    with pytest.raises(RuntimeError, match="10 elements"):
        adamw_chunk.step_chunk(p, g[:5], m, v, torch.zeros(1), torch.zeros(1), None, **kw)


def _main_thread_share(work, seconds_alone: float = 0.05) -> float:
    """This thread's pure-Python iterations while ``work`` runs on another thread, per second of the work, over its
    rate alone (the same loop, stopped by a timer). A switch interval of 0.1 ms: a call that holds the interpreter
    lock leaves this thread at most that long before it starts."""
    def spin(done: threading.Event) -> int:
        n = 0
        while not done.is_set():
            n += 1
        return n

    done = threading.Event()
    threading.Timer(seconds_alone, done.set).start()
    start = time.perf_counter()
    alone = spin(done) / (time.perf_counter() - start)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        done, span = threading.Event(), []

        def run() -> None:
            span.append(time.perf_counter())
            work()
            span.append(time.perf_counter())
            done.set()

        worker = threading.Thread(target=run)
        worker.start()
        beside = spin(done)
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    return beside / (span[1] - span[0]) / alone


def test_the_kernel_releases_the_interpreter_lock(kernel_built):
    """Another thread keeps running Python while the kernel steps a large chunk; the measure's control, a C call
    that holds the lock (through ctypes.PyDLL) for as long, stops it."""
    n = 1 << 23
    p, g = torch.randn(n), torch.randn(n) * 1e-3
    m, v = torch.zeros(n, dtype=torch.int8), torch.zeros(n, dtype=torch.uint8)
    scales = (torch.zeros(n // 2048), torch.zeros(n // 2048))
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.0, eps=1e-8)

    def step() -> None:
        adamw_chunk.step_chunk(p, g, m, v, *scales, None, step=1.0, **kw)

    start = time.perf_counter()
    step()
    took = time.perf_counter() - start
    share = _main_thread_share(step)
    assert share > 0.3, share
    hold = ctypes.PyDLL(None).usleep  # a C function called with the interpreter lock held
    hold.argtypes = [ctypes.c_uint]
    # At least 0.2 s: the few switch intervals around the call (longer when the machine is loaded and the threads
    # wait for a core) must stay small beside it, or the control measures them instead of the lock.
    held = _main_thread_share(lambda: hold(int(max(took, 0.2) * 1e6)))
    assert held < 0.1, held


def test_the_switch(kernel_built, monkeypatch):
    monkeypatch.setenv(adamw_chunk.KERNEL_ENV, "0")
    assert not adamw_chunk.use_kernel("auto") and adamw_chunk.use_kernel("fused")
    monkeypatch.setenv(adamw_chunk.KERNEL_ENV, "1")
    assert adamw_chunk.use_kernel("auto") and not adamw_chunk.use_kernel("torch")
    monkeypatch.delenv(adamw_chunk.KERNEL_ENV)
    assert adamw_chunk.use_kernel("auto")
    monkeypatch.setenv(adamw_chunk.KERNEL_ENV, "yes")
    with pytest.raises(ValueError, match=f"{adamw_chunk.KERNEL_ENV}='yes'"):
        adamw_chunk.use_kernel("auto")
    with pytest.raises(ValueError, match="kernel='cuda'"):
        CompressedAdamW([torch.nn.Parameter(torch.zeros(2))], kernel="cuda")


def test_without_a_compiler_the_torch_ops_step_after_one_warning(kernel_built, monkeypatch, tmp_path, caplog):
    """A build that fails (no compiler here: $CXX names none, in an empty extension cache) is tried once: one
    warning, then 'auto' steps with torch ops and 'fused' refuses."""
    monkeypatch.setattr(adamw_chunk, "_built", None)
    monkeypatch.setenv("CXX", str(tmp_path / "no-compiler"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.delenv(adamw_chunk.KERNEL_ENV, raising=False)
    p = torch.nn.Parameter(torch.randn(100))
    opt = CompressedAdamW([p], state_dtype="int8")
    with caplog.at_level(logging.WARNING, logger=adamw_chunk.__name__):
        for _ in range(2):
            p.grad = torch.randn(100)
            opt.step()
        assert not adamw_chunk.load()
    assert opt._fused is False and torch.isfinite(p).all()
    warnings = [r for r in caplog.records if r.name == adamw_chunk.__name__]
    assert len(warnings) == 1 and "could not be built" in warnings[0].getMessage()
    with pytest.raises(RuntimeError, match="could not be built"):
        CompressedAdamW([p], state_dtype="int8", kernel="fused").step()
