"""Opt-in float8 training: torchao's ``Float8Linear`` in place of the blocks' linear layers, before sharding.

The matmuls of the blocks' linears (q, k, v, o, gate, up, down) run in float8 on the tensor cores (sm89+: H100,
H200) with dynamic scales; everything else, the LM head and the weights FSDP2 stores, transfers and the optimizer
steps stay as they were (fp32 shards, bf16 unsharded compute copies). ``Float8Linear`` subclasses ``nn.Linear``
and keeps its ``weight`` and ``bias``, so state dicts, checkpoints and the export are unchanged.

FSDP2's float8 all-gather (``enable_fsdp_float8_all_gather``) stays off, read against torch 2.11-2.13's
``FSDPParam.all_gather_inputs``: (1) a parameter with ``fsdp_pre_all_gather`` takes FSDP2's extension branch,
which, with ``CPUOffloadPolicy``, copies the full-precision local shard to the GPU first and casts there, so the
host-to-device bytes do not shrink; (2) that branch bypasses ``_sharded_param_data``, which is what our staged
loads and bf16 transfer copies (``fsdp2/param_transfer.py``, ``fsdp2/prefetch.py``) replace; (3) its tensorwise
scale needs every weight's amax after each optimizer step (``precompute_float8_dynamic_scale_for_fsdp``): on the
CPU when the shards are offloaded; (4) at world size 1 the all-gather is a device copy with nothing to save.
The float8 casts are elementwise kernels that want fusing: use it with ``compile_blocks``.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's Float8LinearRecipeName values


def check_float8_training(recipe: str, *, device_type: str) -> None:
    """ValueError unless torchao is installed and the GPU has float8 tensor cores (compute capability 8.9+)."""
    name = f"float8_training={recipe!r}"
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        raise ValueError(f"{name} needs torchao (pip install 'fsdp-speedloader[kernels]', or the wheel in .wheels: "
                         f"tools/device_wheels.sh): {e}; or set float8_training=null") from None
    if device_type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"{name} runs float8 matmuls on CUDA tensor cores and this run is on {device_type}; "
                         "set float8_training=null")
    capability = torch.cuda.get_device_capability()
    if capability < (8, 9):
        raise ValueError(f"{name} needs float8 tensor cores (compute capability 8.9+: L4, H100, H200); this GPU "
                         f"is {'.'.join(map(str, capability))}: set float8_training=null")


def _float8_shape(module: nn.Module) -> bool:
    """torch._scaled_mm takes matrices whose dimensions are multiples of 16."""
    return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_float8_training(blocks: Iterable[nn.Module], recipe: str = "tensorwise", *, emulate: bool = False) -> int:
    """Swaps every linear of ``blocks`` whose shape float8 matmuls take for torchao's ``Float8Linear`` (in place,
    on any device, meta included); returns how many. ``emulate``: float8 arithmetic emulated in fp32 (tests on the
    CPU; no speed)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        import dataclasses

        config = dataclasses.replace(config, emulate=True)
    count = 0
    for block in blocks:
        before = sum(type(m).__name__ == "Float8Linear" for m in block.modules())
        convert_to_float8_training(block, config=config, module_filter_fn=lambda m, _: _float8_shape(m))
        count += sum(type(m).__name__ == "Float8Linear" for m in block.modules()) - before
    return count
