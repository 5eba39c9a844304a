"""Host memory: the exact-size page-locked arena (arena.py), the streams that move tensors between it and the
GPU (exchange.py), and the optimizer that steps each unit on the CPU during the backward (optimizer_overlap.py)."""
