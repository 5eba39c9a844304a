"""Inference entry pieces: the generation CLI's typed config, prompt loading and run (``cli.py``).

The layer-major generation itself is ``fsdp_speedloader.generate`` (module ``generate.py``).
"""
