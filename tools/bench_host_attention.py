"""How fast the CPU computes one decoding step's attention over a host KV cache, alone and while the link copies.

The question behind ``cpu_attention_sub_batches``: can the CPU read a sub-batch's cache faster than the link
can copy it, and what is left of that while the weights stream to the GPU? One OPT-30B sub-batch's layer
(12 sequences, 56 heads of 128, 544 positions, fp16: 187 MB of keys and values) is laid out as the host
cache lays it out (``kv[t, c, j, k, d]``, so a head's keys are strided), and attended with one query
token per sequence in several ways. Then the same while another thread keeps a 4 GiB page-locked
host-to-device copy running (the weights' traffic). GB/s = cache bytes read / time.

    python tools/bench_host_attention.py --out bench/results/host_attention_cpu_h200.json

The record (bench/results/host_attention_cpu_h200.json, one H200 machine, 16 Intel Xeon cores with
AVX512-FP16/AMX): Hugging Face's SDPA path in fp16 on the strided cache reads 48.5 GB/s alone and 23.4 GB/s
while the link copies at 55.5 GB/s; converting to fp32 first (FlexGen's way) 6.7 and 3.5 GB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import threading
import time

import torch

N, H, T, D = 12, 56, 544, 128  # one OPT-30B sub-batch of 12 sequences, one layer, 512 + 32 positions
SUB_BATCHES = 4


def variants(arena: torch.Tensor, i: int) -> dict:
    block = arena[i]  # (T, 2, n, H, d), the host cache's layout of one (sub-batch, layer)
    k, v = block[:, 0].permute(1, 2, 0, 3), block[:, 1].permute(1, 2, 0, 3)  # (n, H, T, d) strided views
    q = torch.randn(N, H, 1, D).half()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return {
        "sdpa_fp16_strided": lambda: sdpa(q, k, v, scale=1.0),
        "sdpa_fp16_contig_copy": lambda: sdpa(q, k.contiguous(), v.contiguous(), scale=1.0),
        "sdpa_fp32_convert": lambda: sdpa(q.float(), k.float(), v.float(), scale=1.0),
        "bmm_fp32_flexgen": lambda: torch.matmul(torch.matmul(q.float(), k.float().transpose(-1, -2)).softmax(-1),
                                                 v.float()),
        "sdpa_bf16_strided": lambda: sdpa(q.bfloat16(), k.bfloat16(), v.bfloat16(), scale=1.0),
    }


def bench(arena: torch.Tensor, tag: str, results: dict) -> None:
    gb = 2 * N * H * T * D * 2 / 1e9
    for name in variants(arena, 0):
        calls = [variants(arena, i)[name] for i in range(SUB_BATCHES)]
        calls[0]()
        start, repeats = time.perf_counter(), 2
        for _ in range(repeats):
            for call in calls:
                call()
        seconds = (time.perf_counter() - start) / (repeats * SUB_BATCHES)
        results[f"{tag}:{name}"] = gb / seconds
        print(f"{tag:8s} {name:24s} {seconds * 1e3:7.1f} ms/sub-batch {gb / seconds:6.1f} GB/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/host_attention_cpu.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    results: dict = {}
    arena = torch.randn(SUB_BATCHES, T, 2, N, H, D).half().pin_memory()
    bench(arena, "idle", results)
    stop = False
    buf = torch.empty(4 * 2**30, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(buf, device="cuda")

    def pump() -> None:  # the weights' traffic: page-locked host-to-device copies, back to back
        stream, copies, start = torch.cuda.Stream(), 0, time.perf_counter()
        with torch.cuda.stream(stream):
            while not stop:
                dev.copy_(buf, non_blocking=True)
                stream.synchronize()
                copies += 1
        results["h2d_GBps_during"] = copies * buf.numel() / 1e9 / (time.perf_counter() - start)

    thread = threading.Thread(target=pump)
    thread.start()
    time.sleep(0.5)
    bench(arena, "h2d_busy", results)
    stop = True
    thread.join()
    commit = os.environ.get("FSL_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                             text=True).stdout.strip()
    record = {"benchmark": "host_attention", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cpu_threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "commit": commit or "unknown", "shape": {"n": N, "heads": H, "positions": T, "head_dim": D},
              "GBps": results}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
