"""fsdp_speedloader: layer-major (SpeedLoader) training and inference on PyTorch FSDP2."""

from .generate import generate
from .speedloader import apply_speedloader

__all__ = ["apply_speedloader", "generate"]
__version__ = "0.1.0"
