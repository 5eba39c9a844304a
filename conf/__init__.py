# Makes conf/ importable as the package fsdp_speedloader.conf (see pyproject.toml), so that
# Hydra finds these configs as pkg://fsdp_speedloader.conf after `pip install .` or `pip install -e .`.
