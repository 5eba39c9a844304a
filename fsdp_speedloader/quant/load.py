"""Filling the quantized weights while loading: ``materialize_quantized_weights``.

The order is the library's (torchtitan's): ``build_model`` on meta -> ``quantize_linears_`` ->
``apply_speedloader`` -> ``materialize_model`` (the other parameters) -> ``materialize_quantized_weights``.
Each weight is quantized straight into its place in its block's buffer, one tensor at a time, from:

- ``path``: a local Hugging Face safetensors checkpoint, read tensor by tensor (memory-mapped): at most one
  weight of the checkpoint's dtype (and one fp32 row block) exists besides the packed bytes, never the model;
- the weights a model with values had when ``quantize_linears_`` replaced its linears (tests, small models);
- ``dummy=True``: a byte pattern and constant scales, nothing computed (benchmarks: 70B in seconds);
- else the library's seeded initialisation (``models.init.initial_value``, seeded by (seed, name, stretch)), so the
  quantized model stands for the same weights as the unquantized one built with that seed.

With weights on the GPU (``offload=False``) a weight is moved there and quantized there.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp_speedloader.models import get_adapter
from fsdp_speedloader.models.init import initial_value
from fsdp_speedloader.quant.formats import fill_dummy, quantize_into
from fsdp_speedloader.quant.linear import quantized_linears
from fsdp_speedloader.quant.weights import QuantizedWeights, allocate, plan_block, set_quantized_weights

log = logging.getLogger(__name__)


def materialize_quantized_weights(model: nn.Module, *, device: torch.device, offload: bool,
                                  path: Optional[str] = None, dummy: bool = False, seed: int = 0,
                                  std: float = 0.02, host_memory_limit_bytes: Optional[int] = None) -> QuantizedWeights:
    """Allocates every block's packed buffer (host arena when ``offload``, else ``device``) and fills it (see
    the module docstring for the sources, in that order of precedence). Returns the model's
    ``QuantizedWeights`` (also ``quant.quantized_weights(model)``).

    One process only: the packed weights are not sharded over ranks (``ValueError`` otherwise).
    """
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(f"quantized weights run on one process (the packed weights are not sharded over ranks); "
                         f"this run has {dist.get_world_size()}: start one process, or weight_quant=null")
    linears = quantized_linears(model)
    if not linears:
        raise ValueError("the model has no quantized linears: call quant.quantize_linears_(model, fmt) first")
    fmt = linears[0][1].format
    device = torch.device(device)
    names = {id(m): n for n, m in model.named_modules()}
    blocks = list(get_adapter(model).blocks)
    plans = [plan_block(b, names[id(b)]) for b in blocks]
    start = time.perf_counter()
    arena = allocate(plans, offload=offload, device=device, host_memory_limit_bytes=host_memory_limit_bytes)
    weights = QuantizedWeights(fmt, plans, {id(b): k for k, b in enumerate(blocks)}, offload, arena)
    if path is not None:
        source = "checkpoint"
        _load_checkpoint(weights, Path(path), model)
    elif all(m.source is not None for _, m in linears):
        source = "weights in memory"
        for plan in plans:
            for module, packed in plan.views():
                quantize_into(module.source.to(packed.codes.device), packed)
    elif dummy:
        source = "dummy"
        for plan in plans:
            for _, packed in plan.views():
                fill_dummy(packed, std=std)
    else:
        source = f"seeded initialisation (seed {seed})"
        for plan in plans:
            for entry in plan.entries:
                m = entry.module
                full = initial_value(m, f"{entry.name}.weight",
                                     (m.out_features, m.in_features), seed=seed, std=std, dtype=m.dtype)
                quantize_into(full.to(device if not offload else "cpu"), entry.view(plan.buffer))
    for plan in plans:
        for module, packed in plan.views():
            module.packed, module.source = packed, None
    if arena is not None:
        arena.pin()  # after the fill: every page was committed by it
    weights.stats = {"weights_format": fmt.name, "weights_group_size": fmt.group_size,
                     "weights_packed_bytes": weights.nbytes, "weights_offloaded": offload,
                     "weights_source": source, "weights_fill_s": time.perf_counter() - start}
    log.info("quantized weights: %s g%d, %.2f GiB packed (%s), from %s in %.1f s", fmt.name, fmt.group_size,
             weights.nbytes / 2**30, "host" if offload else str(device), source, weights.stats["weights_fill_s"])
    set_quantized_weights(model, weights)
    return weights


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model.path: no *.safetensors files in {path}")
    return files


@torch.no_grad()
def _load_checkpoint(weights: QuantizedWeights, path: Path, model: nn.Module) -> None:
    """Quantizes each linear's checkpoint tensor into its place, reading one tensor at a time."""
    from safetensors import safe_open

    prefix = getattr(model, "base_model_prefix", "model") + "."
    wanted = {}  # checkpoint key (with or without the base model's prefix) -> (entry, its block's buffer)
    for plan in weights.blocks:
        for entry in plan.entries:
            key = f"{entry.name}.weight"
            wanted[key] = wanted[key.removeprefix(prefix)] = (entry, plan.buffer)
    done: set[int] = set()
    for file in _checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key in wanted and id(wanted[key][0]) not in done:
                    entry, buffer = wanted[key]
                    packed = entry.view(buffer)
                    quantize_into(f.get_tensor(key).to(packed.codes.device), packed)
                    done.add(id(entry))
    missing = [e.name for plan in weights.blocks for e in plan.entries if id(e) not in done]
    if missing:
        raise ValueError(f"model.path: checkpoint {path} lacks {len(missing)} linear weight(s), e.g. "
                         f"{[m + '.weight' for m in missing[:3]]}")
