"""fsdp_speedloader: layer-major (SpeedLoader) training and inference on PyTorch FSDP2.

The library: ``apply_speedloader`` (with ``SpeedLoaderOptions``) makes an unmodified Hugging Face causal LM
layer-major, ``speedloader_engine`` is its engine, ``generate`` runs layer-major generation on it, and
``tune`` plans sub-batches from two trial steps. The Hydra applications live in ``fsdp_speedloader.app``.
"""

from fsdp_speedloader import openmp_wait

openmp_wait.chosen = openmp_wait.prefer_passive_wait()  # before torch loads OpenMP (openmp_wait.py says why)

from fsdp_speedloader.engine.speedloader import apply_speedloader, speedloader_engine  # noqa: E402
from fsdp_speedloader.generation.generate import generate  # noqa: E402
from fsdp_speedloader.options import SpeedLoaderOptions  # noqa: E402
from fsdp_speedloader.tuning.plan import TunePlan  # noqa: E402
from fsdp_speedloader.tuning.tuner import tune  # noqa: E402

__all__ = ["SpeedLoaderOptions", "TunePlan", "apply_speedloader", "generate", "speedloader_engine", "tune"]
__version__ = "0.1.0"
