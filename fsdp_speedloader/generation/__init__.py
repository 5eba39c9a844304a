"""Layer-major generation on a model prepared with ``apply_speedloader``: the loop over steps (generate.py), one
step's schedule (step.py), token selection (sampling.py), the KV cache on the GPU, the host or split
(kv_cache.py), and decoding attention on the CPU (host_attention.py)."""
