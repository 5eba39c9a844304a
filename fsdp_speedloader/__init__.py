"""fsdp_speedloader: layer-major (SpeedLoader) training and inference on PyTorch FSDP2."""

from .speedloader import apply_speedloader

__all__ = ["apply_speedloader"]
__version__ = "0.1.0"
