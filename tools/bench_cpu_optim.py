"""The host optimizer step, per billion parameters: fp32 AdamW against compressed-state candidates, on THIS CPU.

With parameters offloaded the AdamW step runs on the host (docs/design.md §9); a compressed optimizer state is
only worth having if its CPU step still hides behind the GPU's work. Each candidate runs in its own process with
``--threads`` intra-op threads on LLaMA-2-7B block shapes (``--blocks`` blocks: 202M parameters each), fp32
gradients, and reports the median step time of ``--steps`` steps after ``--warmup`` (the first steps allocate
the state and, for the torch.compile'd ones, compile):

  torch-fused        torch.optim.AdamW(fused=True), fp32 moments (the default path, exact)
  torch-foreach      torch.optim.AdamW(foreach=True), fp32 moments
  local-fused        fsdp_speedloader LocalShardAdamW(fused=True): torch's fused AdamW called on the local shards of
                     DTensor parameters (what the trainer builds; the same as torch-fused on plain tensors)
  local-pool         local-fused in chunks of --chunks elements (default compressed_adamw.CHUNK_PER_THREAD) on the
                     host pool, each thread taking the next chunk (optim.fp32_host_step=pool; the same bits)
  fsl-bf16           fsdp_speedloader CompressedAdamW, bf16 moments (torch's fused kernel on decoded chunks:
                     kernel='torch')
  fsl-int8           fsdp_speedloader CompressedAdamW, 8-bit blockwise moments (same)
  torch-fused-bf16p  torch.optim.AdamW(fused=True) on bf16 parameters (bf16 master, moments, round to nearest)
  fsl-int8-bf16-sr   fsdp_speedloader CompressedAdamW, int8 moments, bf16 parameters and gradients, stochastic
                     rounding (optim.master_dtype=bf16 optim.state_dtype=int8: the smallest mode)
  fsl-bf16-fused     fsl-bf16 with the fused C++ kernel per chunk (kernel='fused', memory/adamw_chunk.py: one pass
                     over the chunk, the interpreter lock released; the same results; the library's default where
                     the kernel builds)
  fsl-int8-fused     fsl-int8 with the fused C++ kernel
  fsl-int8-bf16-sr-fused  fsl-int8-bf16-sr with the fused C++ kernel (which computes the random bits itself)
  torchao-8bit       torchao.optim.AdamW8bit (fp32 parameters, 8-bit blockwise moments; torch.compile)
  torchao-4bit       torchao.optim.AdamW4bit
  torchao-fp8        torchao.optim.AdamWFp8
  torchao-bf16-sr    torchao.optim._AdamW(bf16_stochastic_round=True) on bf16 parameters (bf16 master + moments)
  bnb-8bit           bitsandbytes.optim.AdamW8bit (its CPU backend)
  clip-norms-torch   not a step: the per-tensor gradient 2-norms of a clipped step, one after another as
                     torch.nn.utils.clip_grad_norm_ takes them (DTensor gradients whatever --dtensor says)
  clip-norms-fsl     the same norms as the overlapped optimizer takes them (grad_clip.tensor_norms: on the local
                     shards, one tensor per host thread; the same bits)

``--dtensor``: the parameters and gradients are DTensors sharded on a one-rank gloo mesh, as FSDP2's are (default:
plain tensors). Each row also reports ``main_thread_progress``: the share of its pure-Python progress that the main
thread keeps while another thread runs the step back to back (1.0: the step leaves the interpreter lock free; near
0: it holds it throughout, and with it the thread that launches the GPU's work in training).

Candidates whose library is missing are recorded as ``status: missing`` (``pip install torchao bitsandbytes``;
neither is a dependency of the package: measured, not chosen). The machine's 1-minute load average is recorded with
each figure: on a shared machine a parallel region waits for descheduled threads, so compare figures taken together.

Usage:
  python tools/bench_cpu_optim.py                          # every candidate, 1 and 2 threads, 2 blocks (405M)
  python tools/bench_cpu_optim.py --candidates torch-fused,fsl-bf16 --threads 2 --blocks 1
  python tools/bench_cpu_optim.py --candidates fsl-int8-bf16-sr --threads 16 --chunks 65536,262144,1048576

``--processes P`` runs P workers of each row at once, as the P ranks of one node (``LOCAL_RANK``/``LOCAL_WORLD_SIZE``),
their timed steps started together: the row's ``node_billion_params_per_s`` is what the node's host steps per second
(P x T threads on the node's cores: oversubscribed or not). ``--affinity`` pins each worker's step as
``optim.worker_affinity`` does (its rank's CPUs less one, one thread per CPU) and measures the main thread's progress
on the CPU left out:

  python tools/bench_cpu_optim.py --candidates local-fused --threads 16,15,12 --processes 4 --blocks 2
  python tools/bench_cpu_optim.py --candidates local-fused --processes 4 --blocks 2 --affinity

``--chunks``: the fsl candidates' elements per host chunk (``compressed_adamw.CHUNK_PER_THREAD``), one row each:
a chunk is ~30 tensor operations, each dispatched under the interpreter lock, over fp32 scratch of that many
elements (fewer, larger chunks: fewer dispatches; smaller ones: scratch closer to the cores).

Writes bench/results/<name>.json (device: this CPU) and prints a table: seconds per step per 1e9 parameters,
and thread-seconds per 1e9 parameters (seconds x threads: what a core-bound step costs; a machine with more cores
divides it by its threads only while memory bandwidth keeps up).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package: its modules import by name
import harness  # noqa: E402
from host_load import HostLoad  # noqa: E402

REPO = harness.REPO
BLOCK_SHAPES = [(4096, 4096)] * 4 + [(11008, 4096)] * 3 + [(4096,)] * 2  # one LLaMA-2-7B block
CANDIDATES = ("torch-fused", "torch-foreach", "local-fused", "local-pool", "fsl-bf16", "fsl-int8", "fsl-int8-bf16-sr",
              "fsl-bf16-fused", "fsl-int8-fused", "fsl-int8-bf16-sr-fused", "torch-fused-bf16p", "torchao-8bit", "torchao-4bit", "torchao-fp8", "torchao-bf16-sr", "bnb-8bit",
              "clip-norms-torch", "clip-norms-fsl")
STATE_BYTES = {"clip-norms-torch": 0, "clip-norms-fsl": 0, "local-fused": 8, "local-pool": 8, "torch-fused": 8,
               "torch-foreach": 8,
               "fsl-bf16": 4, "fsl-int8": 2, "fsl-int8-bf16-sr": 2, "fsl-bf16-fused": 4, "fsl-int8-fused": 2,
               "fsl-int8-bf16-sr-fused": 2, "torch-fused-bf16p": 4,
               "torchao-8bit": 2, "torchao-4bit": 1, "torchao-fp8": 2, "torchao-bf16-sr": 4, "bnb-8bit": 2}
# The others keep fp32 parameters (4).
MASTER_BYTES = {"torch-fused-bf16p": 2, "torchao-bf16-sr": 2, "fsl-int8-bf16-sr": 2, "fsl-int8-bf16-sr-fused": 2}


def build(name: str, params: list):
    import torch

    kw = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    if name == "torch-fused" or name == "torch-fused-bf16p":
        return torch.optim.AdamW(params, fused=True, **kw)
    if name == "torch-foreach":
        return torch.optim.AdamW(params, foreach=True, **kw)
    if name in ("local-fused", "local-pool"):
        from fsdp_speedloader.memory import compressed_adamw
        from fsdp_speedloader.memory.local_adamw import LocalShardAdamW

        chunk = compressed_adamw.CHUNK_PER_THREAD if name == "local-pool" else 0
        return LocalShardAdamW(params, fused=True, host_chunk=chunk, **kw)
    if name.startswith("fsl-"):
        from fsdp_speedloader.memory.compressed_adamw import CompressedAdamW

        base, fused = name.removesuffix("-fused"), name.endswith("-fused")
        kw = dict(kw, kernel="fused" if fused else "torch")
        if base == "fsl-int8-bf16-sr":
            return CompressedAdamW(params, state_dtype="int8", rounding="stochastic", **kw)
        return CompressedAdamW(params, state_dtype=base[4:], **kw)
    if name.startswith("torchao-"):
        import torchao.optim as ao

        if name == "torchao-bf16-sr":
            return ao._AdamW(params, bf16_stochastic_round=True, **kw)
        return {"torchao-8bit": ao.AdamW8bit, "torchao-4bit": ao.AdamW4bit, "torchao-fp8": ao.AdamWFp8}[name](
            params, **kw)
    if name == "bnb-8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, **kw)
    if name.startswith("clip-norms-"):
        return _ClipNorms(params, threaded=name == "clip-norms-fsl")
    raise ValueError(name)


class _ClipNorms:
    """``step()`` takes the 2-norm of every gradient (DTensors)."""

    def __init__(self, params: list, threaded: bool) -> None:
        self.grads = [p.grad if hasattr(p.grad, "device_mesh") else _as_dtensor(p.grad) for p in params]
        self.threaded = threaded

    def step(self) -> None:
        import torch

        from fsdp_speedloader.memory.grad_clip import tensor_norms

        if self.threaded:
            tensor_norms(self.grads, {})
        else:
            [torch.linalg.vector_norm(g, 2.0) for g in self.grads]


def _as_dtensor(t):
    """``t`` sharded on dim 0 over a one-rank gloo mesh (FSDP2's layout at world size 1)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from fsdp_speedloader.parallel import build_mesh, maybe_init_process_group

    maybe_init_process_group("cpu")
    return distribute_tensor(t, build_mesh("cpu"), [Shard(0)])


def _spin(seconds: float) -> float:
    """Pure-Python loop iterations per second on this thread."""
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        n += 1
    return n / seconds


def pinned_progress(step, cpus: list, seconds: float = 2.0) -> float:
    """:func:`main_thread_progress` with the roles as ``optim.worker_affinity`` sets them: a thread pinned to
    ``cpus`` (the launching thread's CPU) spins while this thread, pinned to the optimizer's CPUs with its own
    OpenMP threads, runs ``step`` back to back."""
    out: dict = {}
    started = threading.Event()

    def spinner() -> None:
        os.sched_setaffinity(0, set(cpus))
        out["alone"] = _spin(seconds / 2)
        started.set()
        out["beside"] = _spin(seconds)

    thread = threading.Thread(target=spinner)
    thread.start()
    started.wait()
    while thread.is_alive():
        step()
    thread.join()
    return out["beside"] / out["alone"]


def wait_for_peers(barrier: str) -> None:
    """Several workers started together (``--processes``): each says it is ready (its setup done) and waits until all
    are, so that their timed steps overlap."""
    directory, count = barrier.rsplit(",", 1)
    Path(directory, f"ready_{os.getpid()}").touch()
    deadline = time.monotonic() + 600
    while len(list(Path(directory).glob("ready_*"))) < int(count):
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(list(Path(directory).glob('ready_*')))} of {count} workers got ready")
        time.sleep(0.01)


def main_thread_progress(step, seconds: float = 2.0) -> float:
    """The share of its pure-Python progress this thread keeps while another runs ``step`` back to back."""
    alone = _spin(seconds / 2)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            step()

    other = threading.Thread(target=loop)
    other.start()
    try:
        beside = _spin(seconds)
    finally:
        stop.set()
        other.join()
    return beside / alone


def run_worker(args: argparse.Namespace) -> dict:
    import torch

    name, threads, chunk = args.worker.split("@")
    cpus = None
    if args.affinity:  # as optim.worker_affinity: this rank's CPUs less one for the step, before any thread exists
        from fsdp_speedloader.memory.threads import optimizer_cpus, rank_cpus

        launcher, cpus = rank_cpus()[:1], optimizer_cpus()
        os.sched_setaffinity(0, set(cpus))
        threads = str(len(cpus))
    torch.set_num_threads(int(threads))
    if chunk:
        from fsdp_speedloader.memory import compressed_adamw

        compressed_adamw.CHUNK_PER_THREAD = int(chunk)
    dtype = torch.bfloat16 if name in MASTER_BYTES else torch.float32
    gen = torch.Generator().manual_seed(0)
    params = []
    for _ in range(args.blocks):
        for shape in BLOCK_SHAPES:
            p = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
            grad = (torch.randn(shape, generator=gen) * 1e-3).to(dtype)
            p = torch.nn.Parameter(_as_dtensor(p) if args.dtensor else p)
            p.grad = _as_dtensor(grad) if args.dtensor else grad
            params.append(p)
    num_params = sum(p.numel() for p in params)
    try:
        opt = build(name, params)
    except ImportError as e:
        return {"status_detail": f"missing: {e}", "missing": True}
    if os.environ.get("FSL_CPU_OPTIM_BARRIER"):
        wait_for_peers(os.environ["FSL_CPU_OPTIM_BARRIER"])
    times = []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    timed = times[args.warmup:]
    median = statistics.median(timed)
    progress = pinned_progress(opt.step, launcher) if cpus else main_thread_progress(opt.step)
    return {"num_params": num_params, "threads": int(threads), "chunk_elements": int(chunk) if chunk else None,
            "cpus": cpus, "local_rank": int(os.environ.get("LOCAL_RANK") or 0),
            "step_times_s": times, "median_step_s": median,
            "s_per_billion_params": median / num_params * 1e9,
            "thread_s_per_billion_params": median / num_params * 1e9 * int(threads),
            "state_bytes_per_param": STATE_BYTES[name], "master_bytes_per_param": MASTER_BYTES.get(name, 4),
            "main_thread_progress": progress, "dtensor": args.dtensor,
            "host_peak_rss_gib": harness.host_peak_rss_gib(), "load_average_1min": os.getloadavg()[0],
            "library_versions": _versions(name)}


def _versions(name: str) -> dict:
    import torch

    out = {"torch": torch.__version__}
    for module in ("torchao", "bitsandbytes"):
        if name.startswith(module[:3]) and module in sys.modules:
            out[module] = getattr(sys.modules[module], "__version__", "unknown")
    return out


def run_row(cmd: list, name: str, threads: str, args: argparse.Namespace) -> dict:
    """One row: one worker, or ``--processes`` workers at once (each a rank of the node) summed into the node's
    rate; their own rows kept under ``processes``."""
    env = {**os.environ, "OMP_NUM_THREADS": threads}
    if args.processes == 1:
        row = harness.launch_worker(cmd, env, timeout=args.timeout).row(candidate=name)
        if row.get("missing"):
            row["status"] = "missing"
        return row
    with tempfile.TemporaryDirectory() as barrier, ThreadPoolExecutor(args.processes) as pool:
        envs = [{**env, "LOCAL_RANK": str(i), "LOCAL_WORLD_SIZE": str(args.processes),
                 "FSL_CPU_OPTIM_BARRIER": f"{barrier},{args.processes}"} for i in range(args.processes)]
        outcomes = list(pool.map(lambda e: harness.launch_worker(cmd, e, timeout=args.timeout), envs))
    each = [o.row(candidate=name) for o in outcomes]
    ok = [r for r in each if r["status"] == "ok"]
    if len(ok) < len(each):
        bad = next(r for r in each if r["status"] != "ok")
        return {**bad, "candidate": name, "processes": each}
    return {"candidate": name, "status": "ok", "processes": each, "num_processes": len(each),
            "threads": ok[0]["threads"], "chunk_elements": ok[0]["chunk_elements"],
            "state_bytes_per_param": ok[0]["state_bytes_per_param"],
            # the node's rate: every worker's parameters over its own median step, summed
            "node_billion_params_per_s": sum(r["num_params"] / r["median_step_s"] / 1e9 for r in ok),
            "s_per_billion_params": statistics.median(r["s_per_billion_params"] for r in ok),
            "thread_s_per_billion_params": statistics.median(r["thread_s_per_billion_params"] for r in ok),
            "main_thread_progress": min(r["main_thread_progress"] for r in ok)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--candidates", default=",".join(CANDIDATES), help=f"comma-separated, of {CANDIDATES}")
    parser.add_argument("--threads", default="1,2", help="comma-separated intra-op thread counts")
    parser.add_argument("--blocks", type=int, default=2, help="LLaMA-2-7B blocks of parameters (202M each)")
    parser.add_argument("--chunks", default="", help="comma-separated elements per host chunk of the fsl candidates "
                        "and local-pool "
                        "(default: the library's CHUNK_PER_THREAD)")
    parser.add_argument("--dtensor", action="store_true", help="parameters and gradients as DTensors (FSDP2's)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--name", default="cpu_optim_step")
    parser.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    parser.add_argument("--processes", type=int, default=1,
                        help="workers of each row at once, as the ranks of one node (LOCAL_RANK, LOCAL_WORLD_SIZE), "
                             "their timed steps started together: the node's parameters per second")
    parser.add_argument("--affinity", action="store_true",
                        help="as optim.worker_affinity: each worker's step on its rank's CPUs less one, one thread "
                             "per CPU (--threads is then ignored), the main-thread progress measured on the CPU left")
    parser.add_argument("--host-busy", type=int, default=0,
                        help="K processes spinning a Python loop beside every row's workers (tools/host_load.py)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        harness.print_result(run_worker(args))
        return
    candidates = [c for c in args.candidates.split(",") if c]
    unknown = sorted(set(candidates) - set(CANDIDATES))
    if unknown:
        parser.error(f"unknown candidate(s) {unknown}; choose from {CANDIDATES}")
    rows: list = []
    record = {**harness.record_header("cpu_optim", __file__, device=harness.cpu_name()),
              "config": {k: v for k, v in vars(args).items() if k != "worker"},
              "note": ("per-thread figures of this CPU; the GPU machine's host has 16 cores and another memory "
                       "system: divide thread_s_per_billion_params by its threads for an optimistic estimate "
                       "(a memory-bound step scales less)"),
              "results": rows}
    path = Path(args.out_dir, f"{args.name}.json")
    chunks = [c for c in args.chunks.split(",") if c]
    if not all(c.isdigit() and int(c) % 2048 == 0 and int(c) > 0 for c in chunks):
        parser.error(f"--chunks {args.chunks}: multiples of 2048 elements (the int8 block)")
    print("| candidate | threads | chunk | state B/param | s per step per 1e9 params | thread-s per 1e9 params | "
          "main thread's progress |")
    print("|---|---|---|---|---|---|---|", flush=True)
    if args.processes < 1:
        parser.error("--processes: at least 1")
    for name, threads, chunk in [(n, t, c) for n in candidates for t in args.threads.split(",")
                                 for c in ((chunks or [""]) if n.startswith("fsl-") or n == "local-pool" else [""])]:
        cmd = harness.worker_command(__file__, f"{name}@{threads}@{chunk}", sys.argv[1:], drop=("--candidates",))
        with HostLoad(busy=args.host_busy) as load:
            row = run_row(cmd, name, threads, args)
        row["host_load"] = load.summary()
        rows.append(row)
        harness.write_record(path, record)
        if row["status"] == "ok":
            node = (f" (node of {row['num_processes']}: {row['node_billion_params_per_s']:.2f} G params/s)"
                    if "num_processes" in row else "")
            print(f"| {name} | {row['threads']} | {chunk or 'default'} | {row['state_bytes_per_param']} | "
                  f"{row['s_per_billion_params']:.2f}{node} | {row['thread_s_per_billion_params']:.2f} | "
                  f"{row['main_thread_progress']:.2f} |", flush=True)
        else:
            print(f"| {name} | {threads} | {chunk or 'default'} | - | {row['status']}: "
                  f"{row.get('error') or row.get('status_detail')} | - | - |", flush=True)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
