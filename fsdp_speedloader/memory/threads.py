"""Host threads: one thread's intra-op thread count, and a pool that runs independent tasks on the host's cores.

``torch.set_num_threads`` sets the calling thread's OpenMP thread count and also the count that every thread which
has not computed yet adopts at its first operation (torch's ``lazy_init_num_threads``). The host optimizer's worker
and the pool want their own count; ``set_thread_num_threads`` gives it to the calling thread only.

``run_on_host_threads`` runs independent tasks (the chunks of a compressed AdamW step, the stretches of the seeded
initialisation) on a pool whose threads compute with one intra-op thread each: the parallelism is across tasks, and
no operation opens a parallel region whose barrier would wait for every core.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

import torch

_lock = threading.Lock()  # one change of the adopted count at a time


def adopted_num_threads() -> int:
    """The intra-op thread count a thread that has not computed yet adopts."""
    seen: list[int] = []
    probe = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    probe.start()
    probe.join()
    return seen[0]


def set_thread_num_threads(n: int) -> None:
    """The calling thread computes on ``n`` intra-op threads; other threads, present and future, keep theirs."""
    with _lock:
        adopted = adopted_num_threads()
        torch.get_num_threads()  # this thread's once-only adoption first, so that it cannot undo ``n`` later
        torch.set_num_threads(n)
        restore = threading.Thread(target=torch.set_num_threads, args=(adopted,))
        restore.start()
        restore.join()


def rank_cpus() -> list[int]:
    """This rank's CPUs: the CPUs this process may run on, split into ``LOCAL_WORLD_SIZE`` equal blocks in order,
    block ``LOCAL_RANK`` (ranks on one node get disjoint blocks). A process already bound to fewer CPUs than the
    machine has (SLURM's ``--cpu-bind``, ``torchrun --numa-binding``) keeps its whole set: its launcher chose it."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cpus) < (os.cpu_count() or len(cpus)):
        return cpus
    local_world = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    local_rank = int(os.environ.get("LOCAL_RANK") or 0)
    share = max(1, len(cpus) // local_world)
    block = cpus[local_rank * share : (local_rank + 1) * share]
    return block or cpus[-share:]  # more ranks than CPUs: the blocks overlap rather than vanish


def threads_instead_of_torchrun_default() -> Optional[int]:
    """The rank's CPU share where torchrun's default of one thread is in force (it sets ``OMP_NUM_THREADS=1`` in
    every worker unless the variable is set: right for training on the GPU alone, but a rank whose optimizer steps
    on the host, and whose shards are initialised there, would get one core of the node); else None (the variable
    is another value, or not under torchrun, or the share is one CPU)."""
    if os.environ.get("OMP_NUM_THREADS") != "1" or "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    share = len(rank_cpus())
    return share if share > 1 else None


def optimizer_cpus() -> list[int]:
    """The CPUs of this rank's host optimizer: its block (:func:`rank_cpus`) less the first, which is left to the
    thread that launches the GPU's work; the whole block when it is one CPU."""
    block = rank_cpus()
    return block[1:] if len(block) > 1 else block


def pin_calling_thread(cpus: Sequence[int]) -> None:
    """The calling thread runs on ``cpus`` only (Linux); threads it starts afterwards inherit that, OpenMP's
    included."""
    os.sched_setaffinity(0, set(cpus))


def _pool_thread_init(cpus: Optional[frozenset]) -> None:
    if cpus is not None:
        pin_calling_thread(cpus)
    set_thread_num_threads(1)


@functools.lru_cache(maxsize=None)
def host_pool(threads: int, cpus: Optional[frozenset] = None) -> ThreadPoolExecutor:
    """``threads`` threads that compute with one intra-op thread each, on ``cpus`` when given (started once, kept)."""
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fsl-host",
                              initializer=_pool_thread_init, initargs=(cpus,))


def run_on_host_threads(tasks: list[Callable[[], None]], threads: Optional[int] = None) -> None:
    """Runs independent tasks on ``threads`` pool threads (default: the caller's intra-op thread count), in the
    caller when that is 1 or there is one task; raises the first task's error. The pool's threads run where the
    caller may run (a pinned optimizer worker's tasks stay on its CPUs)."""
    threads = threads or max(1, torch.get_num_threads())
    if threads <= 1 or len(tasks) <= 1:
        for task in tasks:
            task()
        return
    cpus = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    for future in [host_pool(threads, cpus).submit(task) for task in tasks]:
        future.result()
