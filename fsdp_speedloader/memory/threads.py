"""One thread's intra-op thread count, without changing anyone else's.

``torch.set_num_threads`` sets the calling thread's OpenMP thread count and also the count that every thread which
has not computed yet adopts at its first operation (torch's ``lazy_init_num_threads``). The host optimizer's worker
and its chunk pool want their own count; ``set_thread_num_threads`` gives it to the calling thread only.
"""

from __future__ import annotations

import threading

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
