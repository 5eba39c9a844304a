"""Can the CPU's attention over a host KV cache and the link's copies share host memory at full speed?

The question behind ``cpu_attention_sub_batches``: a decoding step reads the weights (over the link) and
the host KV cache (over the link, or by the CPU's attention) from host memory. If the two run side by side
at their own speeds, moving the cache's reads to the CPU shortens the step. (On the H200 machine they do:
55 + 44 GB/s together. Steps that lasted the link's time plus the CPU's came from the attention output's
copy back, queued behind the next unit's weights: ``return_copy_ms``.)

Two activities, each timed alone and then together, both from page-locked memory registered with CUDA
as the KV cache and the weights are (``PinnedArena``):

  link       host-to-device copies of 256 MiB chunks, queued on a side stream, timed with CUDA events;
  attention  Hugging Face's SDPA path in fp16 over one OPT-30B sub-batch's layer (12 sequences, 56 heads of
             128, 544 positions: 187 MB of keys and values) in the host cache's strided layout
             (``kv[t, c, j, k, d]``), one query token per sequence, on the main thread.

And the attention output's way back (``return_copy_ms``): host milliseconds from queuing one output's
host-to-device copy (172 KB, on the current stream) until it has landed, while one unit's weights (1.25 GiB)
are being copied on another stream, from pageable or page-locked memory, the weights in 256 or 16 MiB
copies; ``idle`` without the weights' copy. The next CPU sub-batch's query waits for that copy.
``read_in_place``: host attention's way back, an elementwise kernel reading the page-locked output.

Together: the copies are queued first, then the attention runs until the copies' end event has completed
(no helper thread: a Python thread spinning on a stream would take a core from the attention). Each
thread count in ``--threads`` is measured on its own. GB/s = bytes read from host memory / seconds.

    python tools/bench_host_attention.py --out bench/results/host_attention_overlap_h200.json

(``bench/results/host_attention_cpu_h200.json``, commit 10bb1c2, came from the previous version of this
tool, whose copies ran in a Python thread that spun on ``stream.synchronize()``.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package: its modules import by name
import harness  # noqa: E402

sys.path.insert(0, str(harness.REPO))
from fsdp_speedloader.memory.arena import ArenaPlan, HostMemoryBudget, PinnedArena  # noqa: E402
from fsdp_speedloader.generation.host_attention import device_view  # noqa: E402

N, H, T, D = 12, 56, 544, 128  # one OPT-30B sub-batch of 12 sequences, one layer, 512 + 32 positions
SUB_BATCHES = 4
CHUNK = 256 * 2**20
KV_BYTES = 2 * N * H * T * D * 2


def attention_calls(kv: torch.Tensor) -> list:
    """One SDPA call per sub-batch, over the strided (n, H, t, d) views of the host cache's layout."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = []
    for i in range(kv.shape[0]):
        k, v = kv[i, :, 0].permute(1, 2, 0, 3), kv[i, :, 1].permute(1, 2, 0, 3)
        q = torch.randn(N, H, 1, D).half()
        calls.append(lambda q=q, k=k, v=v: sdpa(q, k, v, scale=1.0))
    return calls


def queue_copies(chunks: list, dst: torch.Tensor, stream: torch.cuda.Stream) -> tuple:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        for chunk in chunks:
            dst.copy_(chunk, non_blocking=True)
        end.record(stream)
    return start, end


def link_rate(chunks: list, start, end) -> float:
    end.synchronize()
    return len(chunks) * CHUNK / 1e9 / (start.elapsed_time(end) / 1e3)


def cpu_until(calls: list, done) -> float:
    """Runs the CPU's calls round-robin until ``done()``; GB/s over that time."""
    count, begin = 0, time.perf_counter()
    while not done():
        calls[count % len(calls)]()
        count += 1
    return count * KV_BYTES / 1e9 / (time.perf_counter() - begin)


def measure(threads: int, chunks: list, dst: torch.Tensor, activities: dict, stream) -> dict:
    torch.set_num_threads(threads)
    out = {"link_alone_GBps": link_rate(chunks, *queue_copies(chunks, dst, stream))}
    for name, calls in activities.items():
        for call in calls:  # warm the kernels and this thread count's pool
            call()
        stop = time.perf_counter() + 0.5
        out[f"{name}_alone_GBps"] = cpu_until(calls, lambda: time.perf_counter() > stop)
        start, end = queue_copies(chunks, dst, stream)
        out[f"{name}_during_link_GBps"] = cpu_until(calls, end.query)
        out[f"link_during_{name}_GBps"] = link_rate(chunks, start, end)
        out[f"{name}_together_GBps"] = out[f"{name}_during_link_GBps"] + out[f"link_during_{name}_GBps"]
    return out


def return_copy_ms(weights: list, piece_mib: int, land, dst: torch.Tensor, stream: torch.cuda.Stream,
                   repeats: int = 5) -> float:
    """Median host ms until ``land()`` (queued on the current stream) is done while ``weights`` stream in
    ``piece_mib`` copies on ``stream`` (0: the link idle)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        if piece_mib:
            with torch.cuda.stream(stream):
                for chunk in weights:
                    for piece in chunk.split(piece_mib * 2**20):
                        dst[: piece.numel()].copy_(piece, non_blocking=True)
            time.sleep(0.002)  # the weights' copy is under way, as when an attention output returns
        begin = time.perf_counter()
        land()
        torch.cuda.current_stream().synchronize()
        times.append((time.perf_counter() - begin) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def return_copies(chunks: list, dst: torch.Tensor, stream: torch.cuda.Stream) -> dict:
    weights = chunks[:5]  # 1.25 GiB: about one OPT-30B decoder layer
    output = torch.randn(N, 1, H, D).half()
    pinned = output.pin_memory()
    landed = torch.empty(output.shape, dtype=output.dtype, device="cuda")
    ways = {"pageable": lambda: landed.copy_(output, non_blocking=True),
            "pinned": lambda: landed.copy_(pinned, non_blocking=True),
            # host attention's way: an elementwise kernel reads the page-locked bytes in place
            "read_in_place": lambda: torch.mul(device_view(pinned, landed.device), 1, out=landed)}
    out = {}
    for piece_mib, label in ((0, "idle"), (256, "during_256MiB_copies"), (16, "during_16MiB_copies")):
        out.update({f"{name}_{label}": return_copy_ms(weights, piece_mib, land, dst, stream)
                    for name, land in ways.items()})
    assert torch.equal(landed.cpu(), output)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/host_attention_overlap.json")
    parser.add_argument("--threads", default=f"{torch.get_num_threads()},12,8",
                        help="comma-separated intra-op thread counts of the attention")
    parser.add_argument("--link-gib", type=float, default=16.0, help="bytes queued per link measurement")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_host_attention needs a CUDA device (the link is the host-to-device copy)")
    torch.manual_seed(0)
    num_chunks = max(1, int(args.link_gib * 2**30 // CHUNK))
    plan = (ArenaPlan().add("weights", "link", (num_chunks, CHUNK), torch.uint8)
            .add("kv_cache", "kv_cache", (SUB_BATCHES, T, 2, N, H, D), torch.float16))
    arena = PinnedArena(plan, budget=HostMemoryBudget.detect(), hint="lower --link-gib", pin=True)
    kv = arena.slot("kv_cache")
    kv.copy_(torch.randn(kv.shape, dtype=torch.float16))
    chunks = list(arena.slot("weights"))
    dst = torch.empty(CHUNK, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    activities = {"attention": attention_calls(kv)}
    results = {"return_copy_ms": return_copies(chunks, dst, stream)}
    print("return copy ms: " + ", ".join(f"{k} {v:.2f}" for k, v in results["return_copy_ms"].items()), flush=True)
    for threads in (int(t) for t in args.threads.split(",")):
        results[f"threads_{threads}"] = row = measure(threads, chunks, dst, activities, stream)
        print(f"{threads:3d} threads: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    record = {**harness.record_header("host_attention_overlap", __file__), "cpu_count": os.cpu_count(),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "shape": {"n": N, "heads": H, "positions": T, "head_dim": D, "kv_bytes_per_call": KV_BYTES},
              "link_bytes_per_measurement": num_chunks * CHUNK, "results": results}
    harness.write_record(args.out, record)


if __name__ == "__main__":
    main()
