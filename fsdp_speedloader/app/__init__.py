"""The Hydra applications over the library: entry points (train, generate, tune, sweep), the trainer, typed
configs, data, W&B logging, checkpoints and metrics. Nothing in the library imports this package."""
