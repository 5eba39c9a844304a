"""Adapters over unmodified Hugging Face causal LMs, and building them."""

from torch import nn

from fsdp_speedloader.models.adapter import BlockInputs, ModelAdapter
from fsdp_speedloader.models.config import ModelConfig
from fsdp_speedloader.models.build import build_hf_config, build_model, load_safetensors, materialize_model
from fsdp_speedloader.models.init import init_weights
from fsdp_speedloader.models.gemma3 import Gemma3Adapter
from fsdp_speedloader.models.llama import LlamaAdapter, MistralAdapter, QwenAdapter
from fsdp_speedloader.models.moe import MoeAdapter
from fsdp_speedloader.models.opt import OPTAdapter

ADAPTERS: tuple[type[ModelAdapter], ...] = (LlamaAdapter, MistralAdapter, QwenAdapter, Gemma3Adapter, MoeAdapter,
                                            OPTAdapter)


def get_adapter(model: nn.Module) -> ModelAdapter:
    """The adapter for ``model``; ValueError naming the supported classes otherwise."""
    for adapter_cls in ADAPTERS:
        if isinstance(model, adapter_cls.model_classes):
            return adapter_cls(model)
    supported = sorted(c.__name__ for a in ADAPTERS for c in a.model_classes)
    raise ValueError(f"unsupported model class {type(model).__name__}; fsdp_speedloader supports {supported}. "
                     "Another family needs an adapter that reproduces its forward's masks, positions and "
                     "head (fsdp_speedloader/models/adapter.py).")


def position_ids_model_classes() -> list[str]:
    """The model classes whose layer-major forward takes ``position_ids`` (packed documents)."""
    return sorted(c.__name__ for a in ADAPTERS if a.takes_position_ids for c in a.model_classes)


__all__ = ["ADAPTERS", "BlockInputs", "Gemma3Adapter", "LlamaAdapter", "MistralAdapter", "ModelAdapter", "ModelConfig",
           "MoeAdapter", "OPTAdapter", "QwenAdapter", "build_hf_config", "build_model", "get_adapter", "init_weights",
           "load_safetensors", "materialize_model", "position_ids_model_classes"]
