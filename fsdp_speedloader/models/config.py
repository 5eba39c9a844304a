"""What model to build: the shapes of a fresh Hugging Face causal LM, or a local checkpoint to load."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fsdp_speedloader.validation import check, check_choice, check_positive


@dataclass
class ModelConfig:
    """A Hugging Face causal LM: shapes for a fresh model, or ``path`` to a local checkpoint."""

    name: str = "llama_tiny"
    """Label used in logs and run names."""
    family: str = "llama"
    """Architecture: 'llama' (LLaMA layout: LLaMA, Mistral, Qwen2, ...) or 'opt'."""
    path: Optional[str] = None
    """Local Hugging Face checkpoint directory (config.json + safetensors); overrides the shapes."""
    hidden_size: int = 256
    """Model width h."""
    num_layers: int = 4
    """Number of transformer blocks L."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: Optional[int] = None
    """Key/value heads for grouped-query attention (LLaMA); None means num_heads."""
    intermediate_size: int = 688
    """MLP width (LLaMA intermediate_size, OPT ffn_dim)."""
    vocab_size: int = 320
    """Vocabulary size (the default byte tokenizer needs >= 257)."""
    max_position_embeddings: int = 2048
    """Longest sequence the model accepts."""
    rope_theta: float = 10000.0
    """Rotary base (LLaMA)."""
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
        check_choice(self.family, "model.family", ("llama", "opt"))
        check_choice(self.attn_implementation, "model.attn_implementation", ("sdpa", "eager"))
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "vocab_size",
                     "max_position_embeddings"):
            check_positive(getattr(self, name), f"model.{name}")
        check(self.hidden_size % self.num_heads == 0, "model.hidden_size",
              f"{self.hidden_size} is not divisible by model.num_heads={self.num_heads}")
        if self.num_kv_heads is not None:
            check_positive(self.num_kv_heads, "model.num_kv_heads")
            check(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads",
                  f"model.num_heads={self.num_heads} must be a multiple of it")
        check(0.0 <= self.dropout < 1.0, "model.dropout", f"got {self.dropout}; use a value in [0, 1)")
        check(self.init_std > 0, "model.init_std", f"got {self.init_std}; must be > 0")
