"""AdamW that steps the local shards of DTensor parameters: torch's kernel, torch's bits, the interpreter lock free.

FSDP2's parameters, their gradients and AdamW's moments are DTensors. ``torch.optim.AdamW`` on them goes through
DTensor's dispatch, which runs the local kernel (``_fused_adamw_``, or the foreach ops) while holding the Python
interpreter lock: a host step on the overlapped optimizer's worker thread then stalls the main thread, which
launches the GPU's work, for the whole step (the stepping thread took most of the lock in
``tools/bench_cpu_optim.py --dtensor``; docs/design.md §9). Called on plain tensors the same kernel releases the
lock. ``LocalShardAdamW`` is ``torch.optim.AdamW`` whose per-group tensor lists, once built (``_init_group``: the
state is created there, as DTensors like the parameters), are swapped for the local shards: the same kernel on the
same memory, so the same bits, and the state, ``state_dict`` and checkpoints stay DTensors.

Every DTensor placement is elementwise for AdamW (each shard steps on its own), so no collective is skipped.
``_init_group`` is torch's (private) hook between building the lists and the update in ``Adam.step`` (torch
2.11-2.13); tests/test_local_adamw.py fails if that changes.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


class LocalShardAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (same arguments) that updates DTensors through their local tensors."""

    def _init_group(self, group, *tensor_lists):
        has_complex = super()._init_group(group, *tensor_lists)
        for tensors in tensor_lists:  # params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps
            tensors[:] = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        return has_complex
