"""Start-up time and peak host memory of the data loader do not grow with the corpus: a 2 GB token directory
against a 10 MB one, each loaded in a fresh process (its own peak RSS, VmHWM, reset after the imports)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fsdp_speedloader.app.token_shards import write_index

# In the child: the imports come first, so the measured peak is the loader's on top of the same interpreter.
CHILD = textwrap.dedent("""
    import gc, json, sys, time
    from pathlib import Path
    from fsdp_speedloader.app.config import DataConfig
    from fsdp_speedloader.app.data import build_loader

    def peak_rss_mib():
        status = Path("/proc/self/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) / 1024

    # seq_len 256: 4 M sequences in 2 GB, so that anything kept per sequence (an order array) would show.
    cfg = DataConfig(source="tokens", path=sys.argv[1], seq_len=256, seed=0)
    gc.collect()
    # The imports peak above where they settle: reset the high-water mark so that it measures the loader.
    Path("/proc/self/clear_refs").write_text("5")
    before = peak_rss_mib()
    start = time.perf_counter()
    loader = build_loader(cfg, vocab_size=50304, batch_size=8, rank=1, world_size=4)
    loader.next_batch()
    startup = time.perf_counter() - start
    for _ in range(50):  # batches from all over the corpus
        loader.next_batch()
    print(json.dumps({"startup_s": startup, "num_sequences": loader.num_sequences, "rss_before_mib": before,
                      "peak_rss_mib": peak_rss_mib()}))
""")


def _random_token_dir(path: Path, num_tokens: int, shard_tokens: int) -> None:
    """Random uint16 ids in shards, written a block at a time (one random block, varied per block)."""
    path.mkdir()
    rng = np.random.default_rng(0)
    block = rng.integers(0, 50000, size=min(num_tokens, 1 << 24), dtype=np.uint16)
    shards = []
    for i, start in enumerate(range(0, num_tokens, shard_tokens)):
        n = min(shard_tokens, num_tokens - start)
        name = f"{i:06d}-00000"
        with open(path / f"{name}.bin", "wb") as f:
            for j, offset in enumerate(range(0, n, len(block))):
                (block[: n - offset] ^ np.uint16(i * 131 + j)).tofile(f)
        np.save(path / f"{name}.docs.npy", np.arange(0, n, 4096, dtype=np.int64))
        shards.append({"file": f"{name}.bin", "num_tokens": n, "num_documents": len(range(0, n, 4096)),
                       "document_starts": f"{name}.docs.npy", "source": "random"})
    write_index(path, tokenizer="random", vocab_size=50304, eos_token_id=0, dtype="uint16", shards=shards)


def _load_in_child(path: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_startup_and_peak_memory_do_not_grow_with_the_corpus(tmp_path):
    _random_token_dir(tmp_path / "small", 5 * 2**20, shard_tokens=2**22)  # 10 MB, 2 shards
    _random_token_dir(tmp_path / "large", 2**30, shard_tokens=2**27)  # 2 GB, 8 shards
    assert sum(f.stat().st_size for f in (tmp_path / "large").glob("*.bin")) == 2**31

    small, large = _load_in_child(tmp_path / "small"), _load_in_child(tmp_path / "large")
    assert large["num_sequences"] == 2**30 // 256 > 200 * small["num_sequences"]
    # Memory within 10%; time within 10% or 50 ms (start-up takes milliseconds, where 10% is below a shared
    # machine's jitter; a pass over the corpus or an order of its 4 M sequences takes longer).
    assert large["peak_rss_mib"] <= 1.1 * small["peak_rss_mib"], (small, large)
    # Tighter: what loading added above the imports, within 16 MiB (an int64 per sequence would be 32 MiB).
    grew = {name: r["peak_rss_mib"] - r["rss_before_mib"] for name, r in (("small", small), ("large", large))}
    assert grew["large"] <= grew["small"] + 16, grew
    assert large["startup_s"] <= max(1.1 * small["startup_s"], small["startup_s"] + 0.05), (small, large)
