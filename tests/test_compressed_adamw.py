"""Compressed AdamW moments (``optim.state_dtype``): bf16 is, bit for bit, fused AdamW whose moments are rounded to
bf16 after each step; int8 stays close to fp32 AdamW; both train through the trainer, plain and overlapped, save
their moments in their stored dtype and resume exactly. fp32 (the default) stays torch's AdamW."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed, tiny_config
from fsdp_speedloader.app.config import OptimConfig
from fsdp_speedloader.app.optim import build_adamw
from fsdp_speedloader.app.trainer import Trainer
from fsdp_speedloader.memory import compressed_adamw
from fsdp_speedloader.memory import threads as host_threads
from fsdp_speedloader.memory.compressed_adamw import CompressedAdamW, num_state_bytes
from fsdp_speedloader.memory.local_adamw import LocalShardAdamW
from fsdp_speedloader.memory.threads import adopted_num_threads, host_pool

SHAPES = [(300, 50), (3000,), (7, 1), (5000,)]  # 5000: no multiple of BLOCK, spans chunks when they are small


def _params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _grads(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen) * (10.0 ** -(k % 3)) for k, s in enumerate(SHAPES)]


@pytest.mark.parametrize("chunk_per_thread", [2048, 1 << 18])
def test_bf16_moments_are_fused_adamw_with_moments_rounded_to_bf16(monkeypatch, chunk_per_thread):
    monkeypatch.setattr(compressed_adamw, "CHUNK_PER_THREAD", chunk_per_thread)
    ps, ref = _params(), _params()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    opt = CompressedAdamW(ps, state_dtype="bf16", **kw)
    ref_opt = torch.optim.AdamW(ref, fused=True, **kw)
    for step in range(5):
        for p, r, g in zip(ps, ref, _grads(step)):
            p.grad, r.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        for r in ref:  # the reference's moments, rounded to nearest bf16 as the compressed ones are stored
            for key in ("exp_avg", "exp_avg_sq"):
                ref_opt.state[r][key].copy_(ref_opt.state[r][key].bfloat16())
    for p, r in zip(ps, ref):
        assert torch.equal(p, r)
        assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(opt.state[p]["exp_avg_sq"].float(), ref_opt.state[r]["exp_avg_sq"])
        assert torch.equal(opt.state[p]["step"], ref_opt.state[r]["step"])


@pytest.mark.parametrize("chunk_per_thread", [2048, 1 << 18])
def test_int8_moments_stay_close_to_fp32_adamw(monkeypatch, chunk_per_thread):
    monkeypatch.setattr(compressed_adamw, "CHUNK_PER_THREAD", chunk_per_thread)
    ps, ref = _params(), _params()
    kw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, eps=1e-8)
    opt = CompressedAdamW(ps, state_dtype="int8", **kw)
    ref_opt = torch.optim.AdamW(ref, fused=True, **kw)
    start = [p.detach().clone() for p in ps]
    for step in range(20):
        for p, r, g in zip(ps, ref, _grads(step)):
            p.grad, r.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    for p, r, p0 in zip(ps, ref, start):
        moved = (r - p0).norm()
        assert torch.isfinite(p).all()
        assert (p - r).norm() < 0.05 * moved  # the updates differ by less than 5%
        assert opt.state[p]["exp_avg"].dtype == torch.int8 and opt.state[p]["exp_avg_sq"].dtype == torch.uint8


@pytest.mark.parametrize("state_dtype, dtype, rounding", [("int8", torch.float32, "nearest"),
                                                          ("int8", torch.bfloat16, "stochastic"),
                                                          ("bf16", torch.bfloat16, "nearest")])
def test_host_chunks_on_several_threads_give_the_serial_result(monkeypatch, state_dtype, dtype, rounding):
    """On the host the chunks are stepped on the caller's thread count of threads: bit for bit the serial step."""
    monkeypatch.setattr(compressed_adamw, "CHUNK_PER_THREAD", 2048)  # many chunks per parameter
    main_threads = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            ps = _params(dtype)
            opt = CompressedAdamW(ps, state_dtype=state_dtype, lr=1e-2, rounding=rounding, seed=5)
            for step in range(3):
                for p, g in zip(ps, _grads(step)):
                    p.grad = g.to(dtype)
                opt.step()
            results.append(([p.detach().clone() for p in ps], [dict(opt.state[p]) for p in ps]))
    finally:
        torch.set_num_threads(main_threads)
    (serial, serial_states), (pooled, pooled_states) = results
    assert all(torch.equal(a, b) for a, b in zip(serial, pooled))
    for a, b in zip(serial_states, pooled_states):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_host_pool_leaves_the_thread_count_new_threads_adopt():
    """torch.set_num_threads in the pool's workers would set the count every later thread adopts; it is put back."""
    with host_threads._lock:  # read while no worker is setting its count
        before = adopted_num_threads()
    pool = host_pool(5)  # a size no other test asks for: started here
    started = threading.Barrier(5)  # every worker started (the pool starts them lazily) before the count is read

    def count() -> int:
        started.wait(timeout=60)
        return torch.get_num_threads()

    counts = [f.result() for f in [pool.submit(count) for _ in range(5)]]
    assert set(counts) == {1}  # the workers compute with one intra-op thread
    with host_threads._lock:
        assert adopted_num_threads() == before


def test_int8_codes_keep_small_second_moments_from_blowing_up_the_update():
    """A block whose exp_avg_sq spans many orders of magnitude: no element's update exceeds a few lr (a linear
    8-bit code would zero the small ones and divide their exp_avg by eps)."""
    p = torch.nn.Parameter(torch.zeros(2048))
    opt = CompressedAdamW([p], state_dtype="int8", lr=1.0, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.logspace(-8, 0, 2048)  # eight orders of magnitude in one block
    for _ in range(3):
        p.grad = g.clone()
        opt.step()
    assert p.abs().max() < 3 * 4.0  # Adam moves each element by about lr per step


def test_state_bytes_per_parameter():
    assert num_state_bytes(1 << 20, "fp32") == 8 << 20
    assert num_state_bytes(1 << 20, "bf16") == 4 << 20
    assert num_state_bytes(1 << 20, "int8") == (2 << 20) + 2 * 4 * (1 << 20) // 2048
    p = _params()[0]
    opt = CompressedAdamW([p], state_dtype="int8", lr=1e-3)
    p.grad = torch.ones_like(p)
    opt.step()
    state = opt.state[p]
    stored = sum(t.numel() * t.element_size() for k, t in state.items() if k != "step")
    assert stored == num_state_bytes(p.numel(), "int8")


def test_the_default_is_torch_adamw_and_the_choice_is_validated():
    params = _params()
    default = build_adamw(params, OptimConfig())  # torch's AdamW, fused, stepping DTensors through their shards
    assert type(default) is LocalShardAdamW and isinstance(default, torch.optim.AdamW)
    assert all(group["fused"] for group in default.param_groups)
    assert isinstance(build_adamw(params, OptimConfig(state_dtype="bf16")), CompressedAdamW)
    assert build_adamw(params, OptimConfig(state_dtype="int8")).kernel == "auto"
    assert build_adamw(params, OptimConfig(state_dtype="int8", host_kernel="torch")).kernel == "torch"
    with pytest.raises(ValueError, match="optim.host_kernel"):
        OptimConfig(state_dtype="int8", host_kernel="cuda")
    with pytest.raises(ValueError, match="optim.state_dtype"):
        OptimConfig(state_dtype="fp8")
    with pytest.raises(ValueError, match="optim.grad_slots_in_flight"):
        OptimConfig(grad_slots_in_flight=-1)
    with pytest.raises(ValueError, match="amsgrad"):
        opt = CompressedAdamW(params, state_dtype="bf16")
        opt.param_groups[0]["amsgrad"] = True
        params[0].grad = torch.zeros_like(params[0])
        opt.step()


# --- through the trainer: train, save, resume --------------------------------------------------------------


def _config(out: Path, ckpt: Path, state_dtype: str, overlap: bool, resume=None):
    optim = {"state_dtype": state_dtype, "overlap_with_backward": overlap, "grad_clip": 0.0 if overlap else 1.0}
    return tiny_config(out, schedule={"name": "speedloader"}, offload={"params": True}, optim=optim, steps=4,
                       checkpoint={"every": 2, "dir": str(ckpt), "save_final": False, "resume": resume})


def _resume(root: Path, state_dtype: str, overlap: bool) -> tuple[list, list, dict]:
    whole = Trainer(_config(root / "a", root / "a_ckpt", state_dtype, overlap))
    uninterrupted = whole.train()
    Trainer(_config(root / "b", root / "b_ckpt", state_dtype, overlap)).train(max_steps=2)
    resumed_trainer = Trainer(_config(root / "c", root / "b_ckpt", state_dtype, overlap, resume="auto"))
    assert resumed_trainer.step == 2
    resumed = resumed_trainer.train()
    dtypes = {key: str(value.dtype) for opt in resumed_trainer.optimizer for state in opt.state.values()
              for key, value in state.items()}
    params = [p.full_tensor() for p in whole.model.parameters()], [p.full_tensor() for p in
                                                                    resumed_trainer.model.parameters()]
    return uninterrupted, resumed, {"dtypes": dtypes, "same_params": all(torch.equal(a, b) for a, b in zip(*params))}


@pytest.mark.parametrize("state_dtype,overlap", [("bf16", True), ("int8", False)])
def test_compressed_states_train_and_resume_exactly(tmp_path, state_dtype, overlap):
    uninterrupted, resumed, out = _resume(tmp_path, state_dtype, overlap)
    assert all(math.isfinite(m["loss"]) for m in uninterrupted)
    assert uninterrupted[-1]["loss"] < uninterrupted[0]["loss"]
    assert [m["loss"] for m in resumed] == [m["loss"] for m in uninterrupted[2:]]
    assert out["same_params"]
    stored = {"bf16": {"torch.bfloat16"}, "int8": {"torch.int8", "torch.uint8"}}[state_dtype]
    assert stored <= set(out["dtypes"].values())


def _resume_2_ranks(rank: int, world_size: int, root: str) -> tuple:
    return _resume(Path(root), "int8", True)


def test_int8_states_resume_exactly_at_world_size_2(tmp_path):
    for uninterrupted, resumed, out in run_distributed(_resume_2_ranks, 2, str(tmp_path)):
        assert [m["loss"] for m in resumed] == [m["loss"] for m in uninterrupted[2:]]
        assert out["same_params"]


# --- on the GPU: offloaded shards on a CUDA mesh ------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("root_on_device", [False, True])
def test_compressed_states_stay_with_offloaded_shards_on_a_cuda_mesh(tmp_path, state_dtype, root_on_device):
    """FSDP2 keeps an offloaded shard as a DTensor of a CUDA mesh whose local tensor is on the CPU; every moment
    and int8 scale must live beside it (``DTensor.from_local`` would move a scale to the mesh's device: the int8
    step then failed mixing devices, found training a 56-layer model with the root on the GPU)."""
    from fsdp_speedloader.parallel import maybe_init_process_group

    maybe_init_process_group("cuda")
    cfg = tiny_config(tmp_path, device="cuda", steps=3, schedule={"name": "speedloader"},
                      offload={"params": True, "root": not root_on_device},
                      optim={"state_dtype": state_dtype, "overlap_with_backward": True, "grad_clip": 0.0})
    trainer = Trainer(cfg)
    losses = [m["loss"] for m in trainer.train()]
    assert all(math.isfinite(x) for x in losses)
    checked = 0
    for opt in trainer.optimizer:
        for p, state in opt.state.items():
            where = p.to_local().device if hasattr(p, "to_local") else p.device
            for key, value in state.items():
                if key != "step":
                    local = value.to_local() if hasattr(value, "to_local") else value
                    assert local.device == where, (key, local.device, where)
                    checked += 1
    assert checked > 0
