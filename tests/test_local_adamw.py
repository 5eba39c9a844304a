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
