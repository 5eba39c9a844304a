"""fsdp_speedloader: layer-major (SpeedLoader) training and inference on PyTorch FSDP2."""

from .generate import generate
from .speedloader import apply_speedloader
from .tuner import TunePlan, tune

__all__ = ["TunePlan", "apply_speedloader", "generate", "tune"]
__version__ = "0.1.0"
