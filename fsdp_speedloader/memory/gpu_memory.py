"""GPU memory this process may still use: what the card has free and what a per-process cap leaves.

Generation sizes two things from it at run time: the sub-batches whose KV cache stays on the GPU
(``generation/kv_cache.py``) and whether a unit's quantized weights are dequantized whole, ahead of its groups
(``generation/weight_stream.py``). Both take half of it, leaving the other half to what a step allocates.
"""

from __future__ import annotations

import torch


def gpu_bytes_available(device: torch.device) -> int:
    """Bytes this process can still allocate on ``device``: the card's free memory plus the caching allocator's
    reserved-but-unused blocks, within ``torch.cuda.set_per_process_memory_fraction``'s cap (which bounds
    reserved memory; blocks reserved by an earlier call and now unused count as available)."""
    if device.index is None:  # 'cuda': the current device (the cap's getter wants an index)
        device = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    fraction = get_fraction(device) if get_fraction is not None else 1.0
    reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
    return max(0, int(min(free + reserved - allocated, fraction * total - allocated)))
