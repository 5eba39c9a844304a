"""LocalShardAdamW: torch.optim.AdamW's bits on DTensor parameters, its kernel called on the local shards."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.overrides import TorchFunctionMode

from engine_cases import cpu_mesh
from fsdp_speedloader.memory.local_adamw import LocalShardAdamW

SHAPES = [(300, 200), (70_000,), (64,)]


def _params(mesh, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(distribute_tensor(torch.randn(shape, generator=gen), mesh, [Shard(0)]))
            for shape in SHAPES]


def _groups(params):
    return [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}]


def _steps(opt, params, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = distribute_tensor(torch.randn(p.shape, generator=gen), p.device_mesh, p.placements)
        opt.step()


class _KernelArguments(TorchFunctionMode):
    """Records the tensor types each AdamW kernel call (fused or foreach) is given."""

    def __init__(self):
        super().__init__()
        self.types: set[type] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("_fused_adamw_", "_foreach_add_", "_foreach_lerp_"):
            self.types.update(type(t) for t in args[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_the_same_bits_as_torch_adamw_with_the_state_kept_as_dtensors(impl):
    mesh = cpu_mesh()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, **{impl: True})
    ref_params, params = _params(mesh), _params(mesh)
    ref, opt = torch.optim.AdamW(_groups(ref_params), **kw), LocalShardAdamW(_groups(params), **kw)
    _steps(ref, ref_params, 3)
    with _KernelArguments() as seen:
        _steps(opt, params, 3)
    assert seen.types == {torch.Tensor}, seen.types  # the kernels saw the local shards, never a DTensor
    for a, b in zip(ref_params, params):
        assert torch.equal(a.full_tensor(), b.full_tensor())
        for key in ("exp_avg", "exp_avg_sq", "step"):
            want, got = ref.state[a][key], opt.state[b][key]
            assert type(want) is type(got)
            if isinstance(want, DTensor):
                assert got.placements == want.placements and torch.equal(got.full_tensor(), want.full_tensor())
            else:
                assert torch.equal(want, got)


def test_state_dict_round_trip_continues_bit_for_bit():
    mesh = cpu_mesh()
    params_a, params_b = _params(mesh), _params(mesh)
    a, b = LocalShardAdamW(_groups(params_a), lr=1e-2, fused=True), LocalShardAdamW(_groups(params_b), lr=1e-2,
                                                                                      fused=True)
    _steps(a, params_a, 2)
    _steps(b, params_b, 2)
    resumed = LocalShardAdamW(_groups(params_b), lr=1e-2, fused=True)
    resumed.load_state_dict(b.state_dict())
    _steps(a, params_a, 2, seed=7)
    _steps(resumed, params_b, 2, seed=7)
    for x, y in zip(params_a, params_b):
        assert torch.equal(x.full_tensor(), y.full_tensor())


@pytest.mark.parametrize("host_chunk,amsgrad", [(64, False), (1024, False), (1024, True), (1 << 21, False)])
def test_host_chunks_on_the_pool_give_torch_adamws_bits(host_chunk, amsgrad):
    """optim.fp32_host_step=pool: the host step as chunks of the fused kernel on the host pool (2 threads, chunks
    starting at multiples of 64 elements, tensors whose sizes are not): the bits of torch.optim.AdamW's fused step,
    the moments and the step counts too."""
    mesh = cpu_mesh()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True, amsgrad=amsgrad)
    ref_params, params = _params(mesh), _params(mesh)
    ref = torch.optim.AdamW(_groups(ref_params), **kw)
    opt = LocalShardAdamW(_groups(params), host_chunk=host_chunk, **kw)
    chunks = []
    with _KernelArguments() as seen:
        original = torch._fused_adamw_
        torch._fused_adamw_ = lambda p, *a, **k: (chunks.append(p[0].numel()), original(p, *a, **k))[1]
        try:
            _steps(opt, params, 3)
        finally:
            torch._fused_adamw_ = original
    _steps(ref, ref_params, 3)
    assert seen.types == {torch.Tensor}  # local shards, never a DTensor
    if host_chunk < 70_000:
        assert max(chunks) == host_chunk and len(chunks) > 3 * len(SHAPES)  # stepped in chunks
    for a, b in zip(ref_params, params):
        assert torch.equal(a.full_tensor(), b.full_tensor())
        for key in ("exp_avg", "exp_avg_sq", "step") + (("max_exp_avg_sq",) if amsgrad else ()):
            want, got = ref.state[a][key], opt.state[b][key]
            assert torch.equal(*(t.full_tensor() if isinstance(t, DTensor) else t for t in (want, got))), key


def test_host_chunks_step_a_non_contiguous_tensor_whole_and_refuse_bad_settings():
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(64, 300, generator=gen), torch.randn(1000, generator=gen)]
    ref_params = [torch.nn.Parameter(base[0].t()), torch.nn.Parameter(base[1].clone())]  # the first: a transpose
    params = [torch.nn.Parameter(base[0].clone().t()), torch.nn.Parameter(base[1].clone())]
    ref = torch.optim.AdamW(ref_params, lr=1e-2, fused=True)
    opt = LocalShardAdamW(params, lr=1e-2, fused=True, host_chunk=128)
    for _ in range(2):
        for a, b in zip(ref_params, params):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
    assert not params[0].is_contiguous()
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params))
    for bad in (-64, 100):
        with pytest.raises(ValueError, match="multiple of 64"):
            LocalShardAdamW(params, lr=1e-2, fused=True, host_chunk=bad)
    with pytest.raises(ValueError, match="fused=True"):
        LocalShardAdamW(params, lr=1e-2, foreach=True, host_chunk=64)


def test_build_adamw_pools_the_fp32_step_of_host_parameters_only():
    from fsdp_speedloader.app.config import OptimConfig
    from fsdp_speedloader.app.optim import build_adamw
    from fsdp_speedloader.memory.compressed_adamw import CHUNK_PER_THREAD

    params = [torch.nn.Parameter(torch.randn(8, 8))]
    assert build_adamw(params, OptimConfig()).host_chunk == CHUNK_PER_THREAD  # pool: the default
    assert build_adamw(params, OptimConfig(fp32_host_step="openmp")).host_chunk == 0
    assert build_adamw(params, OptimConfig(fp32_host_step="pool", state_dtype="int8")).__class__.__name__ == \
        "CompressedAdamW"  # compressed moments have their own pooled chunks
    with pytest.raises(ValueError, match="optim.fp32_host_step"):
        OptimConfig(fp32_host_step="dynamic")
