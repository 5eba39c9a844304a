"""Two "nodes" on one host: two torchrun agents meeting at a local c10d rendezvous.

Each agent is what one machine of a 2-node job runs (``torchrun --nnodes 2 --node-rank i
--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID``); here both run on this host, with
its GPUs split between them. Everything after ``--`` is the torchrun target.

CPU (gloo; what CI runs, one rank per "node"):

    python tools/launch_two_nodes.py --device cpu --nproc-per-node 1 -- \\
        -m fsdp_speedloader.app.train experiment=tiny_cpu dp_replicate=2

4 GPUs as 2 nodes x 2 GPUs, NCCL restricted to its network transport (no NVLink/PCIe peer
copies, no shared memory, no InfiniBand: TCP sockets, as over Ethernet between machines):

    python tools/launch_two_nodes.py --device cuda --nproc-per-node 2 --emulate-ethernet -- \\
        -m fsdp_speedloader.app.train experiment=llama2_7b_offload dp_replicate=2 steps=20

``--emulate-ethernet`` sets NCCL_P2P_DISABLE=1, NCCL_SHM_DISABLE=1 and NCCL_IB_DISABLE=1 in both
agents; every other variable (NCCL_NVLS_ENABLE=0 included) is passed on unchanged, except
FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB, which is halved: each node has half of this host.

``--link-gbit G [--link-delay-ms D]`` puts the nodes on a link of known bandwidth (tools/slow_link.py: each
agent in its own network namespace, the two joined by a veth pair shaped with tc to G Gbit/s each way; the
rendezvous, gloo and NCCL's sockets all cross it; each node its own NCCL_HOSTID, so NCCL uses its network
transport between the nodes and NVLink only within one). ``--link-modes netns,lo,sockets`` allows
slow_link's fallbacks, in that order, where namespaces cannot be made; without one a machine that cannot
build the link is refused (exit 2, one line per mode saying why). The link is removed when the agents end:

    python tools/launch_two_nodes.py --device cuda --nproc-per-node 1 --link-gbit 10 -- \\
        -m fsdp_speedloader.app.train experiment=llama2_7b_offload dp_replicate=2 steps=20

Each agent's output is printed with a ``[node0]``/``[node1]`` prefix. Exit status: 0 when both
agents exit 0, else the first nonzero one (when one agent fails, the other is given ``--grace`` seconds to
notice through the rendezvous, then terminated).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package: its modules import by name
import harness  # noqa: E402
import slow_link  # noqa: E402

NUM_NODES = 2
ETHERNET_NCCL_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
"""NCCL between the emulated nodes: network transport only, over TCP sockets."""
HOST_MEMORY_ENV = "FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB"
"""The host-memory budget of a run (fsdp_speedloader.memory.arena); split between the emulated nodes."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_command(target: Sequence[str], *, node_rank: int, nproc_per_node: int, port: int, rdzv_id: str,
                  max_restarts: int = 0, num_nodes: int = NUM_NODES, host: str = "127.0.0.1",
                  python: str = sys.executable, extra_args: Sequence[str] = ()) -> list[str]:
    """The torchrun command line of one node of a ``num_nodes``-node job (``extra_args``: more torchrun options)."""
    return [python, "-m", "torch.distributed.run", "--nnodes", str(num_nodes), "--nproc-per-node", str(nproc_per_node),
            "--node-rank", str(node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{port}",
            "--rdzv-id", rdzv_id, "--max-restarts", str(max_restarts), *extra_args, *target]


def visible_gpus(env: dict) -> list[str]:
    """The GPUs this host may use: ``CUDA_VISIBLE_DEVICES`` if set, else every device torch sees."""
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d for d in listed.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def agent_envs(base_env: dict, *, device: str, nproc_per_node: int, emulate_ethernet: bool = False,
               num_nodes: int = NUM_NODES, gpus: Optional[list[str]] = None) -> list[dict]:
    """Each node's environment: its own GPUs (``CUDA_VISIBLE_DEVICES``), or none for a CPU run."""
    envs = []
    if device == "cuda":
        gpus = visible_gpus(base_env) if gpus is None else gpus
        if len(gpus) < num_nodes * nproc_per_node:
            raise ValueError(f"--nproc-per-node {nproc_per_node} x {num_nodes} nodes needs "
                             f"{num_nodes * nproc_per_node} GPUs, {len(gpus)} visible")
    for node in range(num_nodes):
        env = dict(base_env)
        if device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[node * nproc_per_node : (node + 1) * nproc_per_node])
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""  # gloo ranks on the CPU, also on a GPU host
        if emulate_ethernet:
            env.update(ETHERNET_NCCL_ENV)
        if base_env.get(HOST_MEMORY_ENV):  # each emulated node has its share of this host's memory
            env[HOST_MEMORY_ENV] = f"{float(base_env[HOST_MEMORY_ENV]) / num_nodes:g}"
        envs.append(env)
    return envs


def two_node_launch(target: Sequence[str], *, device: str, nproc_per_node: int, base_env: dict,
                    emulate_ethernet: bool = False, link: Optional[slow_link.Link] = None,
                    gpus: Optional[list[str]] = None, port: Optional[int] = None, rdzv_id: Optional[str] = None,
                    max_restarts: int = 0, python: str = sys.executable,
                    extra_args: Sequence[Sequence[str]] = ((), ())) -> tuple[list[list[str]], list[dict]]:
    """(commands, environments) of the two agents; over ``link`` when given (each inside its namespace, the
    rendezvous at node 0's address on the link, the link's NCCL/gloo variables). ``extra_args``: more torchrun
    options per node."""
    port = port or free_port()
    rdzv_id = rdzv_id or f"two-nodes-{uuid.uuid4().hex[:8]}"
    host = link.rendezvous_host if link else "127.0.0.1"
    commands = [agent_command(target, node_rank=node, nproc_per_node=nproc_per_node, port=port, rdzv_id=rdzv_id,
                              max_restarts=max_restarts, host=host, python=python,
                              extra_args=[*(link.agent_args(node) if link else []), *extra_args[node]])
                for node in range(NUM_NODES)]
    envs = agent_envs(base_env, device=device, nproc_per_node=nproc_per_node, emulate_ethernet=emulate_ethernet,
                      gpus=gpus)
    if link:
        commands = [link.command(node, cmd) for node, cmd in enumerate(commands)]
        for node, env in enumerate(envs):
            env.update(link.env(node))
    return commands, envs


def run_agents(commands: Sequence[Sequence[str]], envs: Sequence[dict], *, cwd: Optional[str] = None,
               timeout_s: Optional[float] = None, grace_s: float = 30.0, sink=None,
               done: Optional[Callable[[], bool]] = None) -> list[Optional[int]]:
    """Starts every agent, prefixes their output, waits; returns each exit status (None: it was stopped).

    When one agent fails the others get ``grace_s`` to fail too (their rendezvous notices), then
    they are terminated, as is everything still running after ``timeout_s``, or ``grace_s`` after
    ``done()`` first returns True (the caller has what it needs; a hang at exit costs no more).
    """
    sink = sink or sys.stdout

    def prefixed(node: int) -> Callable[[str], None]:
        def echo(line: str) -> None:
            sink.write(f"[node{node}] {line}")
            sink.flush()
        return echo

    # A session per agent (harness.Process): stopping it reaches its worker processes too.
    procs = [harness.Process(cmd, env=env, cwd=cwd, echo=prefixed(node))
             for node, (cmd, env) in enumerate(zip(commands, envs))]
    start, failed_at = time.monotonic(), None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and (any(p.poll() not in (None, 0) for p in procs) or (done is not None and done())):
                failed_at = now  # from here on, only grace_s more
            if (failed_at is not None and now - failed_at > grace_s) or (timeout_s and now - start > timeout_s):
                break
            time.sleep(0.2)
    finally:  # also when this process is interrupted
        for proc in procs:
            proc.stop(grace_s=30.0)  # SIGTERM to a running agent's session, SIGKILL 30 s later
    for proc in procs:
        proc.output()  # waits for its last lines to be echoed
    return [None if proc.stopped else proc.poll() for proc in procs]


def exit_status(codes: Sequence[Optional[int]]) -> int:
    """0 when every agent exited 0; else the first nonzero status (1 for an agent that was stopped)."""
    for code in codes:
        if code != 0:
            return 1 if code is None else code
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: launch_two_nodes.py [options] -- <torchrun target, e.g. -m fsdp_speedloader.app.train ...>")
    split = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks per emulated node")
    parser.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")
    parser.add_argument("--rdzv-id", default=None, help="rendezvous id (default: a fresh one)")
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("--emulate-ethernet", action="store_true",
                        help="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 in both agents")
    parser.add_argument("--link-gbit", type=float, default=None,
                        help="put the nodes on a link of this rate, Gbit/s each way (tools/slow_link.py)")
    parser.add_argument("--link-delay-ms", type=float, default=0.0, help="the link's one-way delay (tc netem)")
    parser.add_argument("--link-modes", default="netns",
                        help=f"slow_link modes to try, in order (of {','.join(slow_link.MODES)}); default netns only")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before both agents are stopped")
    parser.add_argument("--grace", type=float, default=30.0)
    parser.add_argument("--dry-run", action="store_true", help="print the two commands and environments; run nothing")
    args = parser.parse_args(argv[:split])
    target = argv[split + 1 :]
    if not target:
        parser.error("nothing to run after --")
    modes = [m for m in args.link_modes.split(",") if m]
    if args.link_gbit is None and args.link_delay_ms:
        parser.error("--link-delay-ms needs --link-gbit")
    if args.link_gbit is not None and (args.link_gbit <= 0 or args.link_delay_ms < 0
                                       or not modes or set(modes) - set(slow_link.MODES)):
        parser.error(f"--link-gbit {args.link_gbit} --link-delay-ms {args.link_delay_ms} --link-modes "
                     f"{args.link_modes}: give a positive rate, a delay >= 0 and modes of {','.join(slow_link.MODES)}")

    def launch(link: Optional[slow_link.Link]) -> int:
        commands, envs = two_node_launch(target, device=args.device, nproc_per_node=args.nproc_per_node,
                                         base_env=dict(os.environ), emulate_ethernet=args.emulate_ethernet, link=link,
                                         port=args.port, rdzv_id=args.rdzv_id, max_restarts=args.max_restarts)
        for node, (cmd, env) in enumerate(zip(commands, envs)):
            changed = {k: env[k] for k in sorted(env) if os.environ.get(k) != env[k]}
            print(f"[node{node}] {' '.join(changed_var + '=' + v for changed_var, v in changed.items())} "
                  f"{' '.join(cmd)}", flush=True)
        if args.dry_run:
            return 0
        return exit_status(run_agents(commands, envs, timeout_s=args.timeout, grace_s=args.grace))

    if args.link_gbit is None:
        return launch(None)
    if args.dry_run:
        return launch(slow_link.plan_link(modes[0], args.link_gbit, args.link_delay_ms))
    return slow_link.run_over_link("launch_two_nodes", args.link_gbit, args.link_delay_ms, modes, launch)


if __name__ == "__main__":
    sys.exit(main())
