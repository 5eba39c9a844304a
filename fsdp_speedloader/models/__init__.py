"""Adapters over unmodified Hugging Face causal LMs, and building them."""

from torch import nn

from fsdp_speedloader.models.adapter import BlockInputs, ModelAdapter
from fsdp_speedloader.models.config import ModelConfig
from fsdp_speedloader.models.build import build_hf_config, build_model, init_weights, load_safetensors, materialize_model
from fsdp_speedloader.models.llama import LlamaAdapter
from fsdp_speedloader.models.opt import OPTAdapter

ADAPTERS: tuple[type[ModelAdapter], ...] = (LlamaAdapter, OPTAdapter)


def get_adapter(model: nn.Module) -> ModelAdapter:
    """The adapter for ``model``; ValueError naming the supported classes otherwise."""
    for adapter_cls in ADAPTERS:
        if isinstance(model, adapter_cls.model_classes):
            return adapter_cls(model)
    supported = sorted(c.__name__ for a in ADAPTERS for c in a.model_classes)
    raise ValueError(f"unsupported model class {type(model).__name__}; fsdp_speedloader supports {supported}. "
                     "A model of the LLaMA layout needs only its class added to LlamaAdapter.model_classes.")


__all__ = ["ADAPTERS", "BlockInputs", "LlamaAdapter", "ModelAdapter", "ModelConfig", "OPTAdapter", "build_hf_config",
           "build_model", "get_adapter", "init_weights", "load_safetensors", "materialize_model"]
