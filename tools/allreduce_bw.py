"""All-reduce bandwidth between two emulated nodes, over a link of known rate (tools/slow_link.py) or loopback.

The driver builds the link (``--link-gbit``), starts the two torchrun agents (tools/launch_two_nodes.py) with
this file's ``--worker`` as their target, and writes one record (tools/harness.py). Each worker all-reduces
float32 tensors of every ``--sizes-mb`` size (NCCL on CUDA, gloo on the CPU), each size repeated until
``--min-time-s`` has passed (the count decided once, the same on every rank), and reports per size:

  algbw   size / time of one all-reduce (the slowest rank's)
  busbw   algbw x 2 (W - 1) / W, nccl-tests' bus bandwidth: the bytes each rank sends per second in a ring
          all-reduce. With the nodes contiguous in the ring, each direction of the link carries the same
          2 (W - 1) / W x size per all-reduce, so busbw is what the link delivered each way.
  link    in netns mode, the bytes each node put into its end of the link during the timed all-reduces (its
          tc qdisc's counter, read by the node's first rank) and their rate: the traffic did cross the link
          (about busbw plus TCP/IP headers), and what the link delivered.

    python tools/allreduce_bw.py --device cuda --nproc-per-node 1 --link-gbit 10 --name allreduce_bw_10g
    python tools/allreduce_bw.py --device cpu --link-gbit 0.5 --sizes-mb 1,4,16 --min-time-s 0.5   # gloo, CPU

Without ``--link-gbit`` the nodes meet over loopback (``--emulate-ethernet``: NCCL over TCP sockets), the
unshaped figure for comparison. Exit 0 when the worker reported; 2 when the link cannot be built (one line per
mode tried, see tools/slow_link.py; ``--link-modes netns,lo,sockets`` allows the fallbacks).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package: its modules import by name
import harness  # noqa: E402
import launch_two_nodes  # noqa: E402
import slow_link  # noqa: E402

COUNT_LINK_ENV = "FSL_ALLREDUCE_COUNT_LINK"
"""Set (to 1) in the workers' environment in netns mode: each node's first rank reads its link counter."""
MAX_ITERS = 200


def bus_factor(world: int) -> float:
    """busbw / algbw of a ring all-reduce over ``world`` ranks."""
    return 2 * (world - 1) / world


def parse_sizes(text: str) -> list[float]:
    sizes = [float(v) for v in text.split(",") if v.strip()]
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError(f"--sizes-mb {text!r}: give positive sizes in MiB, e.g. 1,4,16,64,256")
    return sizes


# --- worker (one rank) -----------------------------------------------------------------------------------


def _link_bytes() -> Optional[int]:
    dev = os.environ.get("NCCL_SOCKET_IFNAME", "")
    return slow_link.root_qdisc_bytes(dev) if dev else None


def run_worker(args: argparse.Namespace) -> Optional[dict]:
    """Every size's figures (on rank 0; None elsewhere)."""
    import torch
    import torch.distributed as dist

    cuda = args.device == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    world, rank = dist.get_world_size(), dist.get_rank()
    counts_link = os.environ.get(COUNT_LINK_ENV) == "1" and local_rank == 0
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def timed(tensor, iters: int) -> float:
        dist.barrier()
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(tensor)
        sync()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the collective ends with its slowest rank
        return elapsed.item()

    rows = []
    for size_mb in args.sizes:
        numel = int(size_mb * 2**20) // 4
        tensor = torch.ones(numel, dtype=torch.float32, device=device)
        timed(tensor, 1)  # connections, buffers
        once = timed(tensor, 1)
        iters = max(1, min(MAX_ITERS, math.ceil(args.min_time_s / max(once, 1e-6))))  # the same on every rank
        before = _link_bytes() if counts_link else None
        seconds = timed(tensor, iters)
        after = _link_bytes() if counts_link else None
        sent = None if before is None or after is None else after - before
        nodes = [None] * world  # one (node, bytes its end sent) per node: its first rank's
        dist.all_gather_object(nodes, (int(os.environ.get("GROUP_RANK", 0)), sent) if counts_link else None)
        per_node = dict(n for n in nodes if n is not None)
        size = numel * 4
        per_iter = seconds / iters
        algbw = size / per_iter
        row = {"size_bytes": size, "size_mib": size / 2**20, "iters": iters, "time_s": per_iter,
               "algbw_gbyte_s": algbw / 1e9, "busbw_gbyte_s": algbw * bus_factor(world) / 1e9,
               "busbw_gbit_s": algbw * bus_factor(world) * 8 / 1e9,
               "expected_bytes_per_direction": size * bus_factor(world)}
        if per_node and all(v is not None for v in per_node.values()):
            row["link_bytes_per_node"] = [per_node[n] / iters for n in sorted(per_node)]
            row["link_gbit_s_per_node"] = [per_node[n] * 8 / seconds / 1e9 for n in sorted(per_node)]
        rows.append(row)
        del tensor
    info = {"world_size": world, "backend": dist.get_backend(), "rows": rows,
            "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None}
    dist.barrier()
    dist.destroy_process_group()
    return info if rank == 0 else None


# --- driver -------------------------------------------------------------------------------------------


def summary(rows: Sequence[dict], link: Optional[dict]) -> dict:
    """The record's headline: the largest size's bus bandwidth, and against the link's rate where it has one."""
    best = max(rows, key=lambda r: r["busbw_gbit_s"])
    out = {"largest_size_busbw_gbit_s": rows[-1]["busbw_gbit_s"], "peak_busbw_gbit_s": best["busbw_gbit_s"],
           "peak_at_mib": best["size_mib"]}
    if link and link.get("gbit"):
        out["peak_busbw_over_link_rate"] = best["busbw_gbit_s"] / link["gbit"]
    sent = [r for r in rows if r.get("link_bytes_per_node")]
    if sent:  # bytes on the wire over the ring's payload: ~1 plus TCP/IP headers when everything crossed the link
        out["link_bytes_over_expected"] = min(min(r["link_bytes_per_node"]) / r["expected_bytes_per_direction"]
                                              for r in sent)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks per emulated node")
    parser.add_argument("--sizes-mb", default="1,4,16,64,256", help="all-reduce sizes, MiB (float32 tensors)")
    parser.add_argument("--min-time-s", type=float, default=1.0, help="timed seconds per size (at least one call)")
    parser.add_argument("--link-gbit", type=float, default=None, help="the link's rate, Gbit/s each way")
    parser.add_argument("--link-delay-ms", type=float, default=0.0)
    parser.add_argument("--link-modes", default="netns", help=f"slow_link modes to try, in order ({slow_link.MODES})")
    parser.add_argument("--emulate-ethernet", action="store_true",
                        help="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 (also within a node)")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--name", default=None)
    parser.add_argument("--out-dir", default=str(harness.REPO / "bench" / "results"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        args.sizes = parse_sizes(args.sizes_mb)
    except ValueError as err:
        parser.error(str(err))
    if args.worker:
        info = run_worker(args)
        if info is not None:
            harness.print_result(info)
        return 0
    modes = [m for m in args.link_modes.split(",") if m]
    if args.link_gbit is not None and (args.link_gbit <= 0 or args.link_delay_ms < 0
                                       or not modes or set(modes) - set(slow_link.MODES)):
        parser.error(f"--link-gbit {args.link_gbit} --link-delay-ms {args.link_delay_ms} --link-modes "
                     f"{args.link_modes}: give a positive rate, a delay >= 0 and modes of {','.join(slow_link.MODES)}")
    if args.min_time_s <= 0 or args.nproc_per_node < 1:
        parser.error("--min-time-s and --nproc-per-node must be positive")
    target = [str(Path(__file__).resolve()), "--worker", "--device", args.device, "--sizes-mb", args.sizes_mb,
              "--min-time-s", str(args.min_time_s)]
    rate = f"{args.link_gbit:g}g" if args.link_gbit else "loopback"
    name = args.name or f"allreduce_bw_{args.device}_2x{args.nproc_per_node}_{rate}"
    device = harness.device_name(args.device)
    record = {**harness.record_header("allreduce_bw", __file__, argv,
                                      device=f"2 nodes x {args.nproc_per_node} x {device}"),
              "config": {k: v for k, v in vars(args).items() if k != "worker"}}

    def measure(link: Optional[slow_link.Link]) -> int:
        env = dict(os.environ, **({COUNT_LINK_ENV: "1"} if link and link.mode == "netns" else {}))
        commands, envs = launch_two_nodes.two_node_launch(target, device=args.device,
                                                          nproc_per_node=args.nproc_per_node, base_env=env,
                                                          emulate_ethernet=args.emulate_ethernet, link=link)
        record["commands"] = [" ".join(c) for c in commands]
        record["env_per_node"] = [{k: v for k, v in e.items() if k.startswith(("NCCL_", "GLOO_"))} for e in envs]
        lines: list[str] = []

        class Sink:
            def write(self, text: str) -> None:
                lines.append(text)
                if not text.split("] ", 1)[-1].startswith(harness.RESULT_PREFIX):
                    sys.stdout.write(text)

            def flush(self) -> None:
                sys.stdout.flush()

        start = time.monotonic()
        codes = launch_two_nodes.run_agents(commands, envs, timeout_s=args.timeout, grace_s=30.0, sink=Sink())
        record["wall_s"] = time.monotonic() - start
        text = "".join(line.split("] ", 1)[-1] for line in lines)  # the [nodeN] prefixes off
        try:
            info = harness.parse_result(text)
        except ValueError as err:
            info, unreadable = None, str(err)
        else:
            unreadable = ""
        if info is None:
            code = launch_two_nodes.exit_status(codes)
            done = harness.Finished(None if None in codes else code, text, "", record["wall_s"], timeout=args.timeout)
            record["status"], record["error"] = done.failure(unreadable or "without a RESULT line")
            print(f"allreduce_bw: {record['status']}: {record['error']}", file=sys.stderr)
        else:
            record.update(status="ok", **info, summary=summary(info["rows"], record.get("link")))
        path = harness.write_record(Path(args.out_dir) / f"{name}.json", record)
        if info is not None:
            print(table(info["rows"]))
            print(f"allreduce_bw: {record['summary']}")
        print(f"allreduce_bw: wrote {path}")
        return 0 if info is not None else 1

    if args.link_gbit is None:
        record["link"] = None
        return measure(None)

    def measure_over(link) -> int:
        record["link"] = link.describe()
        return measure(link)

    return slow_link.run_over_link("allreduce_bw", args.link_gbit, args.link_delay_ms, modes, measure_over)


def table(rows: Sequence[dict]) -> str:
    lines = ["| MiB | iters | ms | algbw GB/s | busbw GB/s | busbw Gbit/s | link Gbit/s per node |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        link = ", ".join(f"{v:.2f}" for v in r.get("link_gbit_s_per_node", []))
        lines.append(f"| {r['size_mib']:g} | {r['iters']} | {r['time_s'] * 1e3:.1f} | {r['algbw_gbyte_s']:.3f} | "
                     f"{r['busbw_gbyte_s']:.3f} | {r['busbw_gbit_s']:.2f} | {link} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
