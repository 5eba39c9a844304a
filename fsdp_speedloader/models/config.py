"""What model to build: the shapes of a fresh Hugging Face causal LM, or a local checkpoint to load."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fsdp_speedloader.validation import check, check_choice, check_positive

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "mixtral", "qwen3_moe", "opt")
MOE_FAMILIES = ("mixtral", "qwen3_moe")
_DECODERS = ("llama", "mistral", "qwen2", "qwen3", "gemma3", *MOE_FAMILIES)
# Fields that only some families read: setting one for another family is refused, not ignored.
_FAMILY_FIELDS = {
    "head_dim": _DECODERS,
    "rope_scaling": _DECODERS,
    "sliding_window": ("mistral", "gemma3", "mixtral"),
    "sliding_window_pattern": ("gemma3",),
    "rope_local_theta": ("gemma3",),
    "final_logit_softcapping": ("gemma3",),
    "num_experts": MOE_FAMILIES,
    "num_experts_per_tok": MOE_FAMILIES,
    "moe_intermediate_size": ("qwen3_moe",),
    "norm_topk_prob": ("qwen3_moe",),
    "router_aux_loss_coef": MOE_FAMILIES,
}


@dataclass
class ModelConfig:
    """A Hugging Face causal LM: shapes for a fresh model, or ``path`` to a local checkpoint."""

    name: str = "llama_tiny"
    """Label used in logs and run names."""
    family: str = "llama"
    """Architecture (its Hugging Face class): 'llama' (LLaMA 2/3.x), 'mistral', 'qwen2' (Qwen2/2.5), 'qwen3',
    'gemma3' (Gemma-3 text), 'mixtral', 'qwen3_moe' (Qwen3-MoE, e.g. Qwen3-30B-A3B) or 'opt'."""
    path: Optional[str] = None
    """Local Hugging Face checkpoint directory (config.json + safetensors); overrides the shapes."""
    hidden_size: int = 256
    """Model width h."""
    num_layers: int = 4
    """Number of transformer blocks L."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: Optional[int] = None
    """Key/value heads for grouped-query attention (LLaMA layout); None means num_heads."""
    head_dim: Optional[int] = None
    """Width of one attention head; None means hidden_size / num_heads (Qwen3 and Gemma-3 set it)."""
    intermediate_size: int = 688
    """MLP width (LLaMA intermediate_size, OPT ffn_dim)."""
    vocab_size: int = 320
    """Vocabulary size (the default byte tokenizer needs >= 257)."""
    max_position_embeddings: int = 2048
    """Longest sequence the model accepts."""
    rope_theta: float = 10000.0
    """Rotary base (LLaMA layout; Gemma-3: of its global layers)."""
    rope_scaling: Optional[dict] = None
    """Hugging Face ``rope_scaling`` of that rotary embedding, e.g. {rope_type: llama3, factor: 8.0,
    low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192}; None: unscaled."""
    sliding_window: Optional[int] = None
    """Sliding-window attention span: every layer's (Mistral), the local layers' (Gemma-3, required); None: off."""
    sliding_window_pattern: Optional[int] = None
    """Gemma-3: every k-th layer is global, the others sliding-window; None: Hugging Face's default (6)."""
    rope_local_theta: Optional[float] = None
    """Gemma-3: rotary base of the sliding-window layers; None: Hugging Face's default (10000)."""
    final_logit_softcapping: Optional[float] = None
    """Gemma-3: logits = c * tanh(logits / c); None: off (as in the released Gemma-3 models)."""
    num_experts: Optional[int] = None
    """Mixture of experts: experts per layer (Mixtral ``num_local_experts``, Qwen3-MoE ``num_experts``); required for
    'mixtral' and 'qwen3_moe'."""
    num_experts_per_tok: Optional[int] = None
    """Mixture of experts: experts each token is routed to (top-k); required for 'mixtral' and 'qwen3_moe'."""
    moe_intermediate_size: Optional[int] = None
    """Qwen3-MoE: one expert's MLP width (``intermediate_size`` is then the dense MLP's); Mixtral's experts use
    ``intermediate_size``."""
    norm_topk_prob: Optional[bool] = None
    """Qwen3-MoE: renormalise the top-k routing weights to sum to 1 (true in Qwen3-30B-A3B); None: Hugging Face's
    default (false)."""
    output_router_logits: bool = False
    """Mixture of experts: add the router's load-balancing loss (``router_aux_loss_coef`` x Switch Transformer's
    auxiliary loss over the whole effective batch) to the training loss, as Hugging Face's forward does with
    ``config.output_router_logits``."""
    router_aux_loss_coef: Optional[float] = None
    """Weight of the load-balancing loss; None: Hugging Face's default (Mixtral 0.02, Qwen3-MoE 0.001)."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm / LayerNorm."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output projection."""
    dropout: float = 0.0
    """Dropout probability (OPT); layer-major recompute replays the same masks."""
    init_std: float = 0.02
    """Standard deviation of the initial weights."""
    attn_implementation: str = "sdpa"
    """Hugging Face attention kernel: 'sdpa' or 'eager'."""

    def __post_init__(self) -> None:
        check_choice(self.family, "model.family", FAMILIES)
        check_choice(self.attn_implementation, "model.attn_implementation", ("sdpa", "eager"))
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "vocab_size",
                     "max_position_embeddings"):
            check_positive(getattr(self, name), f"model.{name}")
        for name, families in _FAMILY_FIELDS.items():
            check(getattr(self, name) is None or self.family in families, f"model.{name}",
                  f"model.family={self.family!r} does not use it (families that do: {', '.join(families)}); "
                  "set it to null")
        for name in ("head_dim", "sliding_window", "sliding_window_pattern"):
            if getattr(self, name) is not None:
                check_positive(getattr(self, name), f"model.{name}")
        if self.head_dim is None:
            check(self.hidden_size % self.num_heads == 0, "model.hidden_size",
                  f"{self.hidden_size} is not divisible by model.num_heads={self.num_heads}; or set model.head_dim")
        if self.rope_scaling is not None:
            check(isinstance(self.rope_scaling.get("rope_type", self.rope_scaling.get("type")), str),
                  "model.rope_scaling", f"got {self.rope_scaling}; it needs a rope_type (e.g. llama3, linear, yarn)")
        check(self.family != "gemma3" or self.sliding_window is not None, "model.sliding_window",
              "model.family='gemma3' needs the local layers' window (1024 for Gemma-3 4B/12B/27B, 512 for 1B)")
        for name in ("rope_local_theta", "final_logit_softcapping"):
            value = getattr(self, name)
            check(value is None or value > 0, f"model.{name}", f"got {value}; must be > 0 or null")
        if self.num_kv_heads is not None:
            check_positive(self.num_kv_heads, "model.num_kv_heads")
            check(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads",
                  f"model.num_heads={self.num_heads} must be a multiple of it")
        if self.family in MOE_FAMILIES:
            for name in ("num_experts", "num_experts_per_tok"):
                check(getattr(self, name) is not None, f"model.{name}",
                      f"model.family={self.family!r} is a mixture of experts and needs it")
                check_positive(getattr(self, name), f"model.{name}")
            check(self.num_experts_per_tok <= self.num_experts, "model.num_experts_per_tok",
                  f"got {self.num_experts_per_tok}; a token is routed to at most model.num_experts={self.num_experts}")
            if self.moe_intermediate_size is not None:
                check_positive(self.moe_intermediate_size, "model.moe_intermediate_size")
            check(self.router_aux_loss_coef is None or self.router_aux_loss_coef >= 0, "model.router_aux_loss_coef",
                  f"got {self.router_aux_loss_coef}; must be >= 0 or null")
        else:
            check(not self.output_router_logits, "model.output_router_logits",
                  f"model.family={self.family!r} has no router; set it to false")
        check(0.0 <= self.dropout < 1.0, "model.dropout", f"got {self.dropout}; use a value in [0, 1)")
        check(self.init_std > 0, "model.init_std", f"got {self.init_std}; must be > 0")
