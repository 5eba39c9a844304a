"""Layer-major at world size 2 on two GPUs over NCCL (issue 43, item 4): every schedule option's gradients equal the
unmodified model's (fp32 on the CPU), averaged over both ranks' batches, as tests/test_engine_distributed.py checks
with gloo on the CPU. One rank per GPU, spawned like the CPU tests; TF32 off, so only the order of the sums differs.

Run on a machine with 2 GPUs: ``python -m pytest -m gpu tests/test_multi_gpu.py`` (tools/gpu_suite.sh runs it).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dist_utils import run_distributed
from engine_cases import assert_grads_close, batch, reference_grads, tiny_model
from fsdp_speedloader import apply_speedloader, speedloader_engine
from fsdp_speedloader.parallel import build_mesh

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

# family, sub-batches, blocks per unit, activation store, parameters offloaded
CASES = list(itertools.product(("llama", "opt"), (1, 3), (1, 2), ("device", "host"), (False, True)))
RTOL = 1e-4  # fp32 on the GPU against fp32 on the CPU: the reductions' order differs


def _parity(rank: int, world_size: int, family: str, n_sub: int, **speedloader_kwargs) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = tiny_model(family)
    _, ref_grads = reference_grads(model, [batch(n_sub, seed=r) for r in range(world_size)])
    apply_speedloader(model, mesh=build_mesh("cuda"), num_sub_batches=n_sub, **speedloader_kwargs)
    ids, labels = batch(n_sub, seed=rank)
    model(input_ids=ids, labels=labels).loss.backward()
    assert_grads_close(model, ref_grads, rtol=RTOL, atol=1e-6)
    return model


def _every_case(rank: int, world_size: int) -> int:
    for family, n_sub, per_unit, store, offload in CASES:
        _parity(rank, world_size, family, n_sub, blocks_per_unit=per_unit, activation_store=store,
                offload_params=offload)
    # the fastest one-GPU setting: compiled blocks, the root's and unit 1's states on the GPU, kept pairs
    model = _parity(rank, world_size, "llama", 2, offload_params=True, activation_store="host", compile_blocks=True,
                    offload_root=False, device_units=1, keep_activations=2)
    assert speedloader_engine(model).adapter.compiled_block_forward is not None
    return len(CASES) + 1


def test_every_schedule_option_on_two_gpus_over_nccl():
    assert run_distributed(_every_case, 2, timeout_s=600, backend="cpu:gloo,cuda:nccl") == [len(CASES) + 1] * 2
