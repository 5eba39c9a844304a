"""The kernel levers on one GPU, bf16: gradients within bf16 noise of the same layer-major step without the lever,
and float8's loss curve within bf16 noise of bf16's on the embedded corpus.

Run on the GPU machine (liger-kernel and torchao from .wheels: tools/device_wheels.sh):
``python -m pytest -m gpu tests/test_gpu_kernels.py``. A lever whose package is missing is skipped, named.
The noise: the gradient error against the fp32 unmodified model of the layer-major bf16 step without the lever
(float8: of the unmodified model with the same float8 linears, same micro-batches); a lever passes within 1.5x of it.
"""

from __future__ import annotations

import copy
import statistics

import pytest
import torch

from fsdp_speedloader import apply_speedloader
from fsdp_speedloader.parallel import maybe_init_process_group
from test_gpu_engine import BF16, _batch, _grads, _model, _rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
FLOAT8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
# (lever's options, the package it needs)
LEVERS = {"sdpa=cudnn": ({"sdpa_backend": "cudnn"}, None), "sdpa=flash": ({"sdpa_backend": "flash"}, None),
          "sdpa=efficient": ({"sdpa_backend": "efficient"}, None), "liger": ({"liger_kernels": True}, "liger_kernel"),
          "fp8": ({"float8_training": "tensorwise"}, "torchao.float8"),
          "fp8=rowwise": ({"float8_training": "rowwise"}, "torchao.float8")}


def _step(base, ids, labels, *, compiled: bool, **lever) -> dict:
    """One layer-major step, offloaded, host store, 4 sub-batches: full fp32 gradients on the CPU."""
    model = apply_speedloader(copy.deepcopy(base), num_sub_batches=4, param_dtype=BF16, offload_params=True,
                              activation_store="host", compile_blocks=compiled, **lever)
    model(input_ids=ids, labels=labels).loss.backward()
    torch.cuda.synchronize()
    return _grads(model)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("lever", list(LEVERS))
def test_lever_gradients_within_bf16_noise(lever, compiled):
    options, package = LEVERS[lever]
    if package:
        pytest.importorskip(package)
    if lever.startswith("fp8") and not FLOAT8:
        pytest.skip("float8 needs compute capability 8.9+")
    maybe_init_process_group("cuda")
    torch._dynamo.reset()
    base = _model()
    ids, labels = _batch(8, 256)
    truth = copy.deepcopy(base).cuda()
    truth(input_ids=ids.cuda(), labels=labels.cuda()).loss.backward()
    truth_grads = {n: p.grad.float().cpu() for n, p in truth.named_parameters()}
    del truth
    err = _rel_err(_step(base, ids, labels, compiled=compiled, **options), truth_grads)
    if lever.startswith("fp8"):
        # float8 rounds every block matmul's operands to 3 (e4m3) or 2 (e5m2, gradients) mantissa bits: its
        # noise is its own, ~10x bf16's. The reference is the unmodified model with the same float8 linears,
        # accumulating the same micro-batches (dynamic scales are per call in both).
        noise = _rel_err(_canonical_float8_grads(base, ids, labels, options["float8_training"]), truth_grads)
    else:
        noise = _rel_err(_step(base, ids, labels, compiled=compiled), truth_grads)
    assert err <= max(1.5 * noise, 5e-3), (lever, err, noise)


def _canonical_float8_grads(base, ids, labels, recipe: str, micro_batches: int = 4) -> dict:
    """The unmodified model in bf16 with torchao's float8 linears in its blocks, gradients accumulated over the
    same micro-batches as ``_step``'s sub-batches (each loss over the whole batch's target count)."""
    from fsdp_speedloader.kernels import apply_float8_training
    from fsdp_speedloader.models import get_adapter

    model = copy.deepcopy(base).cuda().to(BF16)
    apply_float8_training(get_adapter(model).blocks, recipe)
    num_targets = int((labels[:, 1:] != -100).sum())
    for i, lab in zip(ids.cuda().chunk(micro_batches), labels.cuda().chunk(micro_batches)):
        model(input_ids=i, labels=lab, num_items_in_batch=num_targets).loss.backward()
    torch.cuda.synchronize()
    return _grads(model)


@pytest.mark.skipif(not FLOAT8, reason="float8 needs compute capability 8.9+")
def test_float8_loss_curve_within_bf16_noise(tmp_path):
    """The same 60 steps on the embedded corpus (same seeded weights, same batches), layer-major, offloaded,
    compiled: float8's final loss (mean of the last 10 steps) within 2% of bf16's, and no step's loss apart by more
    than 5% after warmup."""
    pytest.importorskip("torchao.float8")
    from dist_utils import tiny_config
    from fsdp_speedloader.app.trainer import Trainer

    def losses(float8):
        cfg = tiny_config(tmp_path / str(float8), device="cuda", steps=60, log_every=1,
                          model={"hidden_size": 256, "intermediate_size": 704, "num_heads": 4, "num_layers": 4},
                          data={"seq_len": 256}, schedule={"name": "speedloader", "sub_batch_size": 4,
                                                           "num_sub_batches": 2, "compile_blocks": True},
                          offload={"params": True}, optim={"lr": 1e-3, "warmup_steps": 10},
                          kernels={"float8_training": float8})
        torch._dynamo.reset()
        return [m["loss"] for m in Trainer(cfg).train()]

    bf16, fp8 = losses(None), losses("tensorwise")
    final = statistics.mean(bf16[-10:]), statistics.mean(fp8[-10:])
    assert bf16[-1] < bf16[0] - 1.0  # it trained
    assert abs(final[1] - final[0]) <= 0.02 * final[0], final
    assert max(abs(a - b) / a for a, b in zip(bf16[10:], fp8[10:])) <= 0.05
