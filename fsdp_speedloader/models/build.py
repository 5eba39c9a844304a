"""Build a Hugging Face causal LM on the meta device, then materialise it after sharding.

The torchtitan order: ``build_model`` (meta, no memory) -> shard (``apply_fsdp`` or
``apply_speedloader``) -> ``materialize_model`` (each rank allocates only its shards, then fills
them from a seeded initialisation or from a local safetensors checkpoint). The initialisation
(``init.py``) draws each rank's shards from generators seeded by (seed, parameter name, stretch), so the
weights do not depend on the world size, the mesh or offloading.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from transformers import (AutoConfig, AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, MixtralConfig,
                          OPTConfig, PretrainedConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig)

from fsdp_speedloader.models.config import ModelConfig
from fsdp_speedloader.models.init import init_weights
from fsdp_speedloader.models.shards import copy_full_tensor_

# Hugging Face model_type of a checkpoint -> the ModelConfig family that runs it.
SUPPORTED_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                         "gemma3_text": "gemma3", "mixtral": "mixtral", "qwen3_moe": "qwen3_moe", "opt": "opt"}


def build_hf_config(cfg: ModelConfig) -> PretrainedConfig:
    """The Hugging Face config for ``cfg``: read from ``cfg.path`` or built from its shapes."""
    if cfg.path is not None:
        path = Path(cfg.path)
        if not (path / "config.json").is_file():
            raise ValueError(f"model.path: {path} has no config.json; point it at a local Hugging Face "
                             "checkpoint directory (config.json + *.safetensors)")
        hf = AutoConfig.from_pretrained(path, local_files_only=True)
        if hf.model_type == "gemma3":
            raise ValueError(f"model.path: {path} holds the multimodal Gemma-3 (Gemma3ForConditionalGeneration); "
                             "save its text model as Gemma3ForCausalLM (model_type gemma3_text) and point at that")
        if hf.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model.path: model_type {hf.model_type!r} is not supported; "
                             f"supported: {sorted(SUPPORTED_MODEL_TYPES)}")
    elif cfg.family == "opt":
        hf = OPTConfig(hidden_size=cfg.hidden_size, ffn_dim=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                       num_attention_heads=cfg.num_heads, vocab_size=cfg.vocab_size,
                       max_position_embeddings=cfg.max_position_embeddings, word_embed_proj_dim=cfg.hidden_size,
                       dropout=cfg.dropout, attention_dropout=cfg.dropout, layerdrop=0.0,
                       tie_word_embeddings=cfg.tie_word_embeddings, init_std=cfg.init_std)
    else:
        hf = _llama_layout_config(cfg)
    hf._attn_implementation = cfg.attn_implementation
    return hf


def _llama_layout_config(cfg: ModelConfig) -> PretrainedConfig:
    """LLaMA, Mistral, Qwen2, Qwen3, Gemma-3 text, Mixtral and Qwen3-MoE configs from ``cfg``'s shapes (the legacy ``rope_theta`` /
    ``rope_scaling`` / ``rope_local_base_freq`` keys, which every transformers 5.x turns into its rope parameters)."""
    kwargs = dict(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads or cfg.num_heads, vocab_size=cfg.vocab_size,
                  max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
                  rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
                  attention_dropout=cfg.dropout, initializer_range=cfg.init_std)
    if cfg.head_dim is not None:
        kwargs["head_dim"] = cfg.head_dim
    if cfg.rope_scaling is not None:
        kwargs["rope_scaling"] = dict(cfg.rope_scaling)
    if cfg.family == "llama":
        return LlamaConfig(**kwargs)
    if cfg.family == "mistral":  # MistralConfig's default window is 4096: say None explicitly
        return MistralConfig(sliding_window=cfg.sliding_window, **kwargs)
    if cfg.family in ("mixtral", "qwen3_moe"):
        return _moe_config(cfg, kwargs)
    if cfg.family in ("qwen2", "qwen3"):
        config_cls = Qwen2Config if cfg.family == "qwen2" else Qwen3Config
        return config_cls(use_sliding_window=False, sliding_window=None, **kwargs)
    assert cfg.family == "gemma3", cfg.family
    gemma = dict(sliding_window=cfg.sliding_window, final_logit_softcapping=cfg.final_logit_softcapping)
    if cfg.sliding_window_pattern is not None:
        gemma["sliding_window_pattern"] = cfg.sliding_window_pattern
    if cfg.rope_local_theta is not None:
        gemma["rope_local_base_freq"] = cfg.rope_local_theta
    return Gemma3TextConfig(**gemma, **kwargs)


def _moe_config(cfg: ModelConfig, kwargs: dict) -> PretrainedConfig:
    moe = dict(num_experts_per_tok=cfg.num_experts_per_tok, output_router_logits=cfg.output_router_logits)
    if cfg.router_aux_loss_coef is not None:
        moe["router_aux_loss_coef"] = cfg.router_aux_loss_coef
    if cfg.family == "mixtral":  # its experts are intermediate_size wide
        return MixtralConfig(num_local_experts=cfg.num_experts, sliding_window=cfg.sliding_window, **moe, **kwargs)
    if cfg.moe_intermediate_size is not None:
        moe["moe_intermediate_size"] = cfg.moe_intermediate_size
    if cfg.norm_topk_prob is not None:
        moe["norm_topk_prob"] = cfg.norm_topk_prob
    return Qwen3MoeConfig(num_experts=cfg.num_experts, use_sliding_window=False, sliding_window=None, **moe, **kwargs)


def build_model(cfg: ModelConfig, *, device: torch.device | str = "meta", seed: int = 0) -> nn.Module:
    """An unmodified Hugging Face causal LM in fp32; on ``meta`` nothing is allocated.

    On a real device the weights are initialised at once (seeded), for tests and small runs.
    """
    hf = build_hf_config(cfg)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf, attn_implementation=cfg.attn_implementation,
                                                 dtype=torch.float32)
    if str(device) != "meta":
        init_weights(model, seed=seed, std=cfg.init_std)
    return model


def materialize_model(model: nn.Module, cfg: ModelConfig, *, device: torch.device, seed: int,
                      param_device: Optional[torch.device] = None, fill: bool = True) -> None:
    """Allocates the (sharded) parameters and fills them: from ``cfg.path`` if set, else seeded init.

    ``param_device`` is where offloaded parameters live (the host); parameters of FSDP groups that do not
    offload (``offload_root=False``'s root) and buffers such as the rotary frequencies go to the compute
    ``device``. ``fill=False`` allocates only: a resume's checkpoint overwrites every parameter next (its load
    is strict), so reading ``cfg.path``'s weights or initialising them first would be time spent for nothing.
    """
    model.to_empty(device=param_device or device)
    if param_device is not None and param_device != device:  # groups that keep their states on the device
        from fsdp_speedloader.fsdp2 import move_unoffloaded_shards

        move_unoffloaded_shards(model, device)
    _rebuild_buffers(model, device)
    if not fill:
        return
    if cfg.path is not None:
        load_safetensors(model, cfg.path)
    else:
        init_weights(model, seed=seed, std=cfg.init_std)


def _rebuild_buffers(model: nn.Module, device: torch.device) -> None:
    # to_empty leaves computed buffers uninitialised: rebuild the rotary modules (inv_freq, Gemma-3's
    # <layer type>_inv_freq) and refill Gemma's embedding scale.
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if any(name.endswith("inv_freq") for name, _ in child.named_buffers(recurse=False)):
                with torch.device(device):  # the constructor's device argument varies across versions
                    setattr(parent, child_name, type(child)(config=child.config))
    for module in model.modules():
        if hasattr(module, "scalar_embed_scale") and isinstance(getattr(module, "embed_scale", None), torch.Tensor):
            module.embed_scale = torch.tensor(module.scalar_embed_scale, device=device)


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model.path: no *.safetensors files in {path}; save the model with "
                         "save_pretrained(..., safe_serialization=True)")
    return files


# Mixture-of-experts checkpoints as published store each expert's projections apart (Mixtral:
# block_sparse_moe.experts.<e>.w1/w3/w2 and block_sparse_moe.gate; Qwen3-MoE: mlp.experts.<e>.gate_proj/up_proj/
# down_proj); Hugging Face's modules hold them stacked: experts.gate_up_proj (E, 2I, H) = [gate; up] per expert,
# experts.down_proj (E, H, I), and the router as mlp.gate.
_EXPERT_KEY = re.compile(r"^(?P<layer>.*layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(?P<expert>\d+)\."
                         r"(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_ROUTER_KEY = re.compile(r"^(?P<layer>.*layers\.\d+)\.block_sparse_moe\.gate\.weight$")
# projection -> (stacked parameter, which half of the gate_up rows; None: all rows)
_STACKED = {"w1": ("gate_up_proj", 0), "gate_proj": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
            "up_proj": ("gate_up_proj", 1), "w2": ("down_proj", None), "down_proj": ("down_proj", None)}


class _ExpertStacks:
    """Assembles stacked expert parameters from per-expert checkpoint tensors; each is copied into its (sharded)
    parameter as soon as every piece has arrived, so at most a few layers' stacks are held at once."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params
        self.pending: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (full tensor, pieces still missing)

    def name_of(self, key: str, prefix: str) -> Optional[str]:
        """The parameter a checkpoint key belongs to, or None when it is not an expert or router tensor."""
        router = _ROUTER_KEY.match(key)
        if router:
            return self._param_name(f"{router['layer']}.mlp.gate.weight", prefix)
        expert = _EXPERT_KEY.match(key)
        if expert:
            return self._param_name(f"{expert['layer']}.mlp.experts.{_STACKED[expert['proj']][0]}", prefix)
        return None

    def _param_name(self, name: str, prefix: str) -> Optional[str]:
        return name if name in self.params else prefix + name if prefix + name in self.params else None

    def add(self, key: str, name: str, tensor: torch.Tensor) -> bool:
        """Places ``tensor`` into parameter ``name``; True once that parameter is complete and copied."""
        expert = _EXPERT_KEY.match(key)
        if expert is None:  # a renamed router
            copy_full_tensor_(self.params[name], tensor)
            return True
        param = self.params[name]
        full, missing = self.pending.get(name) or (torch.empty(param.shape, dtype=tensor.dtype),
                                                    param.shape[0] * (2 if name.endswith("gate_up_proj") else 1))
        e, half = int(expert["expert"]), _STACKED[expert["proj"]][1]
        rows = full[e] if half is None else full[e].chunk(2, dim=0)[half]
        if rows.shape != tensor.shape:
            raise ValueError(f"shape mismatch: checkpoint tensor {key} {tuple(tensor.shape)} vs its place in "
                             f"{name} {tuple(rows.shape)}")
        rows.copy_(tensor)
        if missing > 1:
            self.pending[name] = (full, missing - 1)
            return False
        self.pending.pop(name, None)
        copy_full_tensor_(param, full)
        return True


@torch.no_grad()
def load_safetensors(model: nn.Module, path: str | os.PathLike) -> None:
    """Fills the (possibly sharded) parameters from a local Hugging Face safetensors checkpoint.

    Tensors are read one at a time (memory-mapped), so a rank never holds the whole model; a mixture of experts'
    per-expert tensors are stacked into Hugging Face's (E, ...) parameters one parameter at a time.
    """
    from safetensors import safe_open

    params = dict(model.named_parameters())
    prefix = getattr(model, "base_model_prefix", "model") + "."
    stacks = _ExpertStacks(params)
    loaded: set[str] = set()
    for file in _checkpoint_files(Path(path)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = key if key in params else prefix + key  # bare base-model checkpoints
                if name in params:
                    copy_full_tensor_(params[name], f.get_tensor(key))
                    loaded.add(name)
                elif (stacked := stacks.name_of(key, prefix)) is not None:  # per-expert MoE layout
                    if stacks.add(key, stacked, f.get_tensor(key)):
                        loaded.add(stacked)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"model.path: checkpoint {path} lacks {len(missing)} parameter(s), e.g. {missing[:3]}")
