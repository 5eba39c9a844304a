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

``host_chunk`` (the host pool, ``optim.fp32_host_step=pool``): torch's fused CPU kernel splits every tensor evenly
over its OpenMP threads, so the step lasts as long as its slowest thread, and on a host where other processes keep
some cores busy that is a thread sharing its core. With ``host_chunk`` the step of host tensors runs as chunks of
that many elements on the host pool (``memory/threads.py``), one thread each, every thread taking the next chunk:
a thread slowed by another process takes fewer. Each chunk is the same kernel on a slice; torch's kernel splits at
cache-line multiples and chunks start at multiples of ``CHUNK_ALIGN`` elements, so every element takes the same
vector or scalar path as unchunked: the same bits (tested).
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import DTensor

from fsdp_speedloader.memory.threads import run_on_host_threads

CHUNK_ALIGN = 64  # elements: a multiple of every CPU vector width and cache line torch's kernel splits at


class LocalShardAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (same arguments) that updates DTensors through their local tensors; with
    ``host_chunk`` > 0 (and ``fused=True``), host tensors step in chunks of that many elements on the host pool (an
    optimizer with any parameter off the host steps as torch's does)."""

    def __init__(self, params, *args, host_chunk: int = 0, **kwargs):
        if host_chunk < 0 or host_chunk % CHUNK_ALIGN:
            raise ValueError(f"host_chunk={host_chunk}: use 0 (off) or a positive multiple of {CHUNK_ALIGN}")
        super().__init__(params, *args, **kwargs)
        if host_chunk and not all(g["fused"] for g in self.param_groups):
            raise ValueError("host_chunk steps chunks with the fused kernel: pass fused=True")
        self.host_chunk = host_chunk

    def _init_group(self, group, *tensor_lists):
        has_complex = super()._init_group(group, *tensor_lists)
        for tensors in tensor_lists:  # params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps
            tensors[:] = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        return has_complex

    @torch.no_grad()
    def step(self, closure=None):
        on_host = all(p.device.type == "cpu" for g in self.param_groups for p in g["params"])
        if not self.host_chunk or not on_host or getattr(self, "grad_scale", None) is not None:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        tasks = []
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = lists = ([], [], [], [], [], [])
            if self._init_group(group, *lists):
                raise ValueError("host_chunk: complex parameters are not supported; use host_chunk=0")
            if not params:
                continue
            torch._foreach_add_(steps, 1)  # as torch's fused path does, before its kernel
            beta1, beta2 = group["betas"]
            kw = dict(amsgrad=group["amsgrad"], lr=group["lr"], beta1=beta1, beta2=beta2,
                      weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
            for i, p in enumerate(params):
                tensors = [p, grads[i], exp_avgs[i], exp_avg_sqs[i]]
                tensors += [max_exp_avg_sqs[i]] if group["amsgrad"] else []
                if not all(t.is_contiguous() for t in tensors):  # no flat view: the whole tensor is one task
                    tasks.append(functools.partial(_fused_step, tensors, steps[i], kw))
                    continue
                flat = [t.view(-1) for t in tensors]
                for start in range(0, p.numel(), self.host_chunk):
                    tasks.append(functools.partial(_fused_step, [t[start:start + self.host_chunk] for t in flat],
                                                   steps[i], kw))
        run_on_host_threads(tasks)
        return loss


def _fused_step(tensors: list, step: torch.Tensor, kw: dict) -> None:
    """torch's fused AdamW kernel on one slice: param, grad, exp_avg, exp_avg_sq (, max_exp_avg_sq)."""
    param, grad, exp_avg, exp_avg_sq, *max_sq = tensors
    torch._fused_adamw_([param], [grad], [exp_avg], [exp_avg_sq], max_sq, [step], **kw)
