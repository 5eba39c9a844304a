"""``QuantizedLinear``: a block's ``nn.Linear`` whose weight is kept group-wise quantized, and
``quantize_linears_``, which puts one in place of every linear of every transformer block.

The quantized weight is not a parameter or a buffer: FSDP2 neither shards nor moves it, ``to_empty`` and
``state_dict`` do not see it. It lives in its block's buffer of packed bytes (``weights.py``: host memory when
offloaded, else the GPU), and reaches the compute device one unit at a time through generation's weight stream
(``generation/weight_stream.py``), which dequantizes each weight once per unit call and hands it to the module
(``weight_on_device``), or hands it the packed bytes already on the device to dequantize each time it runs
(``packed_on_device``: a one-group call, or a prefill short of GPU memory). Called any other way (a plain
forward, a perplexity evaluation), the module dequantizes its weight on the fly, onto the input's device:
correct, not fast. The bias stays a parameter (FSDP2's).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_speedloader.engine.speedloader import speedloader_engine
from fsdp_speedloader.models import MoeAdapter, get_adapter
from fsdp_speedloader.quant.formats import PackedWeight, WeightFormat


class QuantizedLinear(nn.Module):
    """``y = x W'^T + b`` with ``W'`` the dequantized group-wise weight (``formats.py``)."""

    def __init__(self, linear: nn.Linear, fmt: WeightFormat) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.format = fmt
        self.dtype = linear.weight.dtype  # the compute dtype: of the scales, and of the dequantized weight
        self.bias = linear.bias  # the same Parameter object: FSDP2 manages it as before
        # A weight with values (quantized in place at materialization, then dropped); None on the meta device.
        self.source: Optional[torch.Tensor] = None if linear.weight.is_meta else linear.weight.detach()
        self.packed: Optional[PackedWeight] = None  # its bytes where they live (weights.py)
        self.weight_on_device: Optional[torch.Tensor] = None  # (out, in), set by the weight stream for one unit call
        self.packed_on_device: Optional[PackedWeight] = None  # or its packed bytes on the device, for one unit call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight_on_device
        if weight is None and self.packed_on_device is not None:
            weight = self.packed_on_device.dequantize(self.dtype)
        elif weight is None:
            if self.packed is None:
                raise RuntimeError("QuantizedLinear has no weight yet: call fsdp_speedloader.quant."
                                   "materialize_quantized_weights(model, ...) after apply_speedloader")
            weight = self.packed.to(x.device).dequantize(x.dtype)
        return F.linear(x, weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format={self.format.name}, group_size={self.format.group_size}")


def quantized_linears(module: nn.Module) -> list[tuple[str, QuantizedLinear]]:
    """(name, module) of every ``QuantizedLinear`` under ``module``, in registration order."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, QuantizedLinear)]


def quantize_linears_(model: nn.Module, fmt: WeightFormat) -> nn.Module:
    """Replaces every ``nn.Linear`` inside the transformer blocks of ``model`` by a ``QuantizedLinear`` of
    format ``fmt``, in place, BEFORE ``apply_speedloader``. Embeddings, the final norm and the LM head keep
    the compute dtype. On the meta device nothing is computed (``materialize_quantized_weights`` fills the
    weights while loading); a model with values keeps each weight until it is quantized there.

    Raises ``ValueError`` for a prepared model, a mixture of experts (its experts are stacked parameters, not
    linears), a model already quantized, or a group size that does not divide a linear's input width.
    """
    if speedloader_engine(model, missing_ok=True) is not None:
        raise ValueError("quantize_linears_ replaces modules that FSDP2 would already have sharded: call it before "
                         "apply_speedloader (on the meta-device model)")
    adapter = get_adapter(model)
    if isinstance(adapter, MoeAdapter):
        raise ValueError(f"weight quantization covers dense models: the experts of {type(model).__name__} are stacked "
                         "(E, out, in) parameters, not linears; generate it in the compute dtype (weight_quant=null)")
    if quantized_linears(model):
        raise ValueError("the model's linears are already quantized")
    for index, block in enumerate(adapter.blocks):
        for name, child in list(block.named_modules()):
            if not isinstance(child, nn.Linear):
                continue
            fmt.check_shape(child.out_features, child.in_features, f"block {index} {name}")
            parent_name, _, attr = name.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            setattr(parent, attr, QuantizedLinear(child, fmt))
    return model
