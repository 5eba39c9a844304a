"""The layer-major engine: ``apply_speedloader`` (speedloader.py), the autograd Functions that chain the
sub-batches (chain.py) and the store of block-boundary activations (activation_store.py)."""
