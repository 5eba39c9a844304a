"""A reproducible load on the host's CPUs for a benchmark's duration (issue 40: a step as steady on a busy host).

``busy`` processes each keep one core busy with a CPU-bound loop (integer arithmetic in the interpreter: no memory
traffic); ``copy`` processes each copy a 256 MiB buffer back and forth (memory bandwidth, as a data loader or
another job's host optimizer would). The load runs in separate processes in their own session, started before the
timed contender and stopped after it (:class:`HostLoad`), and each reports how much work it did, so a record
shows that the load ran.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

# Each child loops until SIGTERM, then writes its count of finished iterations to the file named in argv[1].
_BUSY = """
import signal, sys
done = [0]
def stop(*_):
    open(sys.argv[1], "w").write(str(done[0])); sys.exit(0)
signal.signal(signal.SIGTERM, stop)
x = 1
while True:
    for i in range(100_000):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
    done[0] += 1
"""
_COPY = """
import signal, sys
done = [0]
def stop(*_):
    open(sys.argv[1], "w").write(str(done[0] * 2 * 2**28)); sys.exit(0)
signal.signal(signal.SIGTERM, stop)
import numpy as np
a = np.ones(2**26, dtype=np.float32)  # 256 MiB
b = np.empty_like(a)
while True:
    np.copyto(b, a); np.copyto(a, b)
    done[0] += 1
"""
KINDS = {"busy": _BUSY, "copy": _COPY}


class HostLoad:
    """``with HostLoad(busy=K, copy=M):`` K busy-loop and M memory-copy processes for the block's duration.
    ``summary()`` after the block: how many of each ran, for how long, and their work (busy: loop iterations of
    100k steps; copy: bytes copied)."""

    def __init__(self, busy: int = 0, copy: int = 0) -> None:
        if busy < 0 or copy < 0:
            raise ValueError(f"host load: busy={busy}, copy={copy}: counts of processes, at least 0")
        self.counts = {"busy": busy, "copy": copy}
        self._children: list[tuple[str, subprocess.Popen, Path]] = []
        self._dir: Optional[tempfile.TemporaryDirectory] = None
        self._started = self._stopped = 0.0
        self._work: dict[str, int] = {}

    def __enter__(self) -> "HostLoad":
        self._dir = tempfile.TemporaryDirectory(prefix="fsl_host_load_")
        for kind, count in self.counts.items():
            for i in range(count):
                out = Path(self._dir.name, f"{kind}{i}")
                proc = subprocess.Popen([sys.executable, "-c", KINDS[kind], str(out)], start_new_session=True,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                self._children.append((kind, proc, out))
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self._stopped = time.perf_counter()
        for _, proc, _ in self._children:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        work: dict[str, int] = {}
        for kind, proc, out in self._children:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            work[kind] = work.get(kind, 0) + (int(out.read_text() or 0) if out.exists() else 0)
        self._work = work
        if self._dir is not None:
            self._dir.cleanup()

    def summary(self) -> dict:
        return {"busy_processes": self.counts["busy"], "copy_processes": self.counts["copy"],
                "seconds": round(self._stopped - self._started, 3),
                "busy_iterations": self._work.get("busy", 0), "copy_bytes": self._work.get("copy", 0)}

