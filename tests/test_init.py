"""The seeded initialisation (models/init.py): each element's value depends on (seed, name, position) only, not on
which part of the tensor a rank draws, the thread count, the dtype it is stored in, the world size or offloading."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from torch import nn

from fsdp_speedloader.models import build_model, init_weights
from fsdp_speedloader.models import init as init_module
from fsdp_speedloader.models.config import ModelConfig
from fsdp_speedloader.memory.threads import run_on_host_threads
from fsdp_speedloader.models.init import initial_fill_tasks, initial_value
from fsdp_speedloader.models.shards import local_stretch

SHAPE = (37, 1003)  # a stretch boundary falls inside a row, and the last stretch is short


@pytest.fixture
def small_stretches(monkeypatch):
    monkeypatch.setattr(init_module, "INIT_CHUNK", 4096)  # many stretches in a small tensor


def _part(start: int, stop: int, *, dtype=torch.float32, threads=1, module=None, name="w.weight") -> torch.Tensor:
    out = torch.full((stop - start,), float("nan"), dtype=dtype)
    tasks = initial_fill_tasks(out, module or nn.Linear(1, 1), name, SHAPE, start=start, seed=3, std=0.02)
    run_on_host_threads(tasks, threads)
    return out


def test_any_part_equals_that_part_of_the_full_tensor(small_stretches):
    full = initial_value(nn.Linear(1, 1), "w.weight", SHAPE, seed=3, std=0.02, threads=1).view(-1)
    assert not full.isnan().any()
    for start, stop in [(0, full.numel()), (0, 1), (4095, 4097), (5000, 13000), (full.numel() - 7, full.numel())]:
        assert torch.equal(_part(start, stop), full[start:stop]), (start, stop)
    assert torch.equal(_part(0, full.numel(), threads=4), full)  # the thread count changes nothing


def test_values_follow_the_seed_name_and_distribution(small_stretches):
    a = initial_value(nn.Linear(1, 1), "a.weight", SHAPE, seed=3, std=0.02)
    assert torch.equal(a, initial_value(nn.Linear(1, 1), "a.weight", SHAPE, seed=3, std=0.02))
    assert not torch.equal(a, initial_value(nn.Linear(1, 1), "b.weight", SHAPE, seed=3, std=0.02))
    assert not torch.equal(a, initial_value(nn.Linear(1, 1), "a.weight", SHAPE, seed=4, std=0.02))
    assert abs(a.mean().item()) < 1e-3 and abs(a.std().item() - 0.02) < 5e-4
    stretches = a.view(-1)[: 2 * 4096].view(2, 4096)
    assert not torch.equal(stretches[0], stretches[1])  # every stretch has its own generator


def test_other_dtypes_hold_the_fp32_draw_rounded(small_stretches):
    fp32 = _part(100, 9000)
    assert torch.equal(_part(100, 9000, dtype=torch.bfloat16), fp32.to(torch.bfloat16))


def test_constants_and_the_embedding_padding_row(small_stretches):
    assert torch.equal(initial_value(nn.LayerNorm(8), "norm.weight", (8,), seed=0, std=0.02), torch.ones(8))
    assert torch.equal(initial_value(nn.Linear(8, 8), "proj.bias", (8,), seed=0, std=0.02), torch.zeros(8))
    emb = nn.Embedding(37, 1003, padding_idx=5, device="meta")
    full = initial_value(emb, "embed.weight", SHAPE, seed=3, std=0.02)
    assert torch.equal(full[5], torch.zeros(1003)) and full[4].abs().sum() > 0 and full[6].abs().sum() > 0
    part = _part(4 * 1003 + 11, 7 * 1003, module=emb, name="embed.weight")  # the padding row inside a part
    assert torch.equal(part, full.view(-1)[4 * 1003 + 11 : 7 * 1003])


def _tiny() -> ModelConfig:
    return ModelConfig(name="tiny", family="llama", vocab_size=97, hidden_size=32, intermediate_size=64,
                       num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=64)


def test_init_weights_fills_the_model_as_initial_value_does():
    model = build_model(_tiny(), device="cpu", seed=7)
    owners = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
    for name, param in model.named_parameters():
        expected = initial_value(owners[id(param)], name, tuple(param.shape), seed=7, std=_tiny().init_std)
        assert torch.equal(param.detach(), expected), name


def _shards(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    from fsdp_speedloader import parallel

    model = build_model(_tiny(), device="meta")
    mesh = parallel.build_mesh("cpu", 1)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    init_weights(model, seed=7, std=_tiny().init_std, threads=2)
    shards = {}
    for name, param in model.named_parameters():
        assert local_stretch(param) is not None, name  # FSDP2's dim-0 shards are drawn in place
        shards[name] = param.to_local().clone()
    return shards


def test_sharded_init_at_world_size_2_equals_the_unsharded_model():
    reference = dict(build_model(_tiny(), device="cpu", seed=7).named_parameters())
    ranks = run_distributed(_shards, 2)
    for name, param in reference.items():
        assert torch.equal(torch.cat([ranks[0][name], ranks[1][name]]), param.detach()), name
