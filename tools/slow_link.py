"""A network link of known bandwidth between two emulated nodes on one host (issue 43: two nodes over a slow link).

Between two machines every byte of a collective crosses their network; on one host the "nodes" of
tools/launch_two_nodes.py talk over loopback, which is far faster than Ethernet. :func:`open_link` builds a
link of a given rate, in the first of these modes the machine allows (``modes``, in order):

  netns     two network namespaces joined by a veth pair (a private /30, 10.213.7.1 and .2, that exists only
            inside those namespaces: nothing is routed anywhere else), each end's egress shaped by ``tc`` (a
            token bucket, ``tbf``, at ``gbit``; with ``delay_ms`` a ``netem`` delay above it). A full-duplex
            link: ``gbit`` each way, as Ethernet. Each node's torchrun agent runs in its own namespace
            (``ip netns exec``), so every byte between the nodes crosses the shaped link and nothing else does
            (NVLink between the GPUs of one node stays NVLink). Needs CAP_NET_ADMIN, ``ip`` (iproute2), veth,
            and ``sch_tbf`` (``sch_netem`` for a delay).
  lo        the fallback where namespaces cannot be made but ``tc`` works on loopback: a token bucket on
            ``lo`` of this namespace. lo has one queue for both directions, so ``gbit`` is shared by the two
            directions (a half-duplex link: an all-reduce, which sends both ways at once, measures about half
            of it), and every other loopback user of the machine (the rendezvous, other programs) is shaped
            too. The machine's lo is left as it was found (a root qdisc other than noqueue is refused).
  sockets   the closest with no ``tc`` at all: NCCL over loopback with one socket and one thread per
            connection (NCCL_SOCKET_NTHREADS=1, NCCL_NSOCKS_PERTHREAD=1). The rate is not set, only narrowed;
            the bandwidth test (tools/allreduce_bw.py) measures what it is (``gbit`` is recorded as None).

In every mode each node gets its own ``NCCL_HOSTID`` (both namespaces share the hostname and boot id, from
which NCCL would otherwise conclude that all ranks share a host and use shared memory or peer copies between
the "nodes"), NCCL's socket transport (``NCCL_IB_DISABLE=1``, ``NCCL_NET=Socket``), and ``NCCL_SOCKET_IFNAME``
/ ``GLOO_SOCKET_IFNAME`` naming the link's interface. A mode that fails says why in one line; when none is
left, :class:`LinkUnavailable` carries every reason.

Teardown: on leaving the ``with`` block, on an exception, and on SIGTERM (turned into an exit while the link
is open) the namespaces (and with them the veth pair and its qdiscs) are deleted, or lo's qdisc removed. A
process killed with SIGKILL cannot clean up: ``python tools/slow_link.py cleanup`` removes what dead processes
left (their names carry their pid).

    python tools/slow_link.py probe --gbit 10            # which mode this machine allows (builds and removes it)
    python tools/slow_link.py cleanup                    # leftovers of killed runs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

MODES = ("netns", "lo", "sockets")
NODE_ADDRESSES = ("10.213.7.1", "10.213.7.2")
PREFIX_LEN = 30
LOOPBACK = "127.0.0.1"
CAP_NET_ADMIN = 12
_NAME = re.compile(r"^fsl(\d+)n([01])$")
LO_MARKER_DIR = Path("/run/fsl_slow_link")
"""lo mode writes a file here naming its pid: cleanup removes lo's qdisc only when its owner is gone."""


CARRIED_IPROUTE2 = Path(__file__).resolve().parents[1] / ".iproute2" / "root"
"""iproute2 unpacked by tools/fetch_iproute2.sh and carried to a machine that has none (the lent 2-GPU machines had
neither `ip` nor `tc` on 2026-11-27)."""


def use_carried_iproute2(root: Path = CARRIED_IPROUTE2) -> bool:
    """Where this machine has no `ip` or `tc` and ``root`` holds carried ones: puts them, and the libraries they load,
    on this process's PATH and LD_LIBRARY_PATH (its children inherit both). Returns whether it did."""
    dirs = [root / d for d in ("sbin", "bin")]
    if shutil.which("ip") and shutil.which("tc"):
        return False
    # is_file follows links: a link out of the tree (Debian's sbin/ip -> /bin/ip) does not count where it dangles
    if not any((d / "ip").is_file() for d in dirs):
        return False
    os.environ["PATH"] = os.pathsep.join([*(str(d) for d in dirs if d.is_dir()), os.environ.get("PATH", "")])
    libs = [str(root / d) for d in ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu") if (root / d).is_dir()]
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([*libs, *filter(None, [os.environ.get("LD_LIBRARY_PATH")])])
    return True


class LinkUnavailable(RuntimeError):
    """No requested mode can be built here; the message has one line per mode tried."""


@dataclass
class Link:
    """An open link: how each node reaches the other and what its processes need."""

    mode: str
    gbit: Optional[float]
    delay_ms: float
    interfaces: list[str]
    addresses: list[str]
    namespaces: list[str] = field(default_factory=list)
    tried: list[str] = field(default_factory=list)
    """Why each mode before this one could not be built."""
    tag: str = ""

    @property
    def rendezvous_host(self) -> str:
        return self.addresses[0]

    def command(self, node: int, cmd: Sequence[str]) -> list[str]:
        """``cmd`` as node ``node`` runs it: inside its namespace in netns mode."""
        if self.mode == "netns":
            return ["ip", "netns", "exec", self.namespaces[node], *cmd]
        return list(cmd)

    def agent_args(self, node: int) -> list[str]:
        """torchrun options of node ``node``'s agent. In netns mode the agents reach each other only by the link's
        addresses: node 0 hosts the rendezvous store (its host cannot be told from the hostname, which both
        namespaces share) and each agent names its own address, which the workers use as MASTER_ADDR."""
        if self.mode != "netns":
            return []
        return ["--local-addr", self.addresses[node], "--rdzv-conf", f"is_host={int(node == 0)}"]

    def env(self, node: int) -> dict:
        """The variables node ``node``'s processes need (added to, and overriding, the caller's)."""
        env = {"NCCL_HOSTID": f"fsl-node{node}-{self.tag}", "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket",
               "NCCL_SOCKET_IFNAME": self.interfaces[node], "GLOO_SOCKET_IFNAME": self.interfaces[node]}
        if self.mode == "sockets":
            env.update(NCCL_SOCKET_NTHREADS="1", NCCL_NSOCKS_PERTHREAD="1")
        return env

    def bytes_sent(self) -> list[Optional[int]]:
        """Bytes each node has sent into the link so far (its egress qdisc's counter); lo mode: one counter for
        both directions and every other loopback user, given as node 0's; sockets mode: none."""
        if self.mode == "netns":
            return [root_qdisc_bytes(self.interfaces[i], self.namespaces[i]) for i in range(2)]
        if self.mode == "lo":
            return [root_qdisc_bytes("lo", None), None]
        return [None, None]

    def describe(self) -> dict:
        """What a record says about the link."""
        return {"mode": self.mode, "gbit": self.gbit, "delay_ms": self.delay_ms, "interfaces": self.interfaces,
                "addresses": self.addresses, "duplex": {"netns": "full", "lo": "half (one queue, both directions)",
                                                         "sockets": None}[self.mode],
                "not_possible": self.tried, "meaning": MODE_MEANING[self.mode]}


MODE_MEANING = {
    "netns": "veth pair between two network namespaces, tc tbf on each end's egress: gbit each way",
    "lo": "tc tbf on this namespace's loopback: gbit shared by both directions and every loopback user",
    "sockets": "loopback, NCCL limited to one socket and one thread per connection: rate not set, measure it",
}


# --- shell --------------------------------------------------------------------------------------------


def _run(cmd: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise _CommandFailed(f"`{' '.join(cmd)}` failed: {(proc.stderr or proc.stdout).strip() or proc.returncode}")
    return proc


class _CommandFailed(RuntimeError):
    pass


def root_qdisc_bytes(dev: str, namespace: Optional[str] = None) -> Optional[int]:
    """Bytes that ``dev``'s root qdisc has sent (in ``namespace``, else this process's); None without a counter."""
    ns = ["-n", namespace] if namespace else []
    proc = _run(["tc", *ns, "-s", "-j", "qdisc", "show", "dev", dev], check=False)
    try:
        roots = [q for q in json.loads(proc.stdout or "[]") if q.get("root")]
    except json.JSONDecodeError:
        return None
    return int(roots[0]["bytes"]) if roots and "bytes" in roots[0] else None


def has_net_admin() -> bool:
    """Whether this process holds CAP_NET_ADMIN (its effective capability set)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_NET_ADMIN & 1)
    except OSError:
        pass
    return os.geteuid() == 0


def shaping_commands(dev: str, gbit: float, delay_ms: float) -> list[list[str]]:
    """tc arguments (after ``tc [-n NS]``) that shape ``dev``'s egress to ``gbit``, ``delay_ms`` later.

    The token bucket holds at least 4 ms at the rate (a timer tick at HZ=250) and 1 MiB (more than one
    segmentation-offload packet of 64 KiB, which tbf would otherwise split); its queue holds 50 ms."""
    rate_bytes = gbit * 1e9 / 8
    burst = max(2**20, int(rate_bytes * 0.004))
    tbf = ["tbf", "rate", f"{gbit * 1000:g}mbit", "burst", str(burst), "latency", "50ms"]
    if not delay_ms:
        return [["qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf]]
    netem = ["netem", "delay", f"{delay_ms:g}ms", "limit", "100000"]  # room for a delay's worth of packets
    return [["qdisc", "add", "dev", dev, "root", "handle", "1:", *netem],
            ["qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf]]


# --- the modes ---------------------------------------------------------------------------------------


def _names(tag: str) -> tuple[list[str], list[str]]:
    # Interface names have at most 15 characters; the pid in both names tells cleanup whose they are.
    return [f"fsl{tag}n{i}" for i in range(2)], [f"fsl{tag}v{i}" for i in range(2)]


def plan_link(mode: str, gbit: Optional[float], delay_ms: float = 0.0, tag: Optional[str] = None) -> Link:
    """The link ``mode`` would give, not built (a dry run's commands; :func:`build_link` builds it)."""
    tag = tag or str(os.getpid())
    if mode == "netns":
        namespaces, veths = _names(tag)
        return Link("netns", gbit, delay_ms, veths, list(NODE_ADDRESSES), namespaces, tag=tag)
    return Link(mode, gbit if mode == "lo" else None, delay_ms if mode == "lo" else 0.0, ["lo", "lo"],
                [LOOPBACK, LOOPBACK], tag=tag)


def _build_netns(tag: str, gbit: float, delay_ms: float) -> Link:
    if not shutil.which("ip") or not shutil.which("tc"):
        raise _CommandFailed("`ip` or `tc` not found (install iproute2, or carry it: tools/fetch_iproute2.sh)")
    link = plan_link("netns", gbit, delay_ms, tag)
    namespaces, veths = link.namespaces, link.interfaces
    try:
        for ns in namespaces:
            _run(["ip", "netns", "add", ns])
        _run(["ip", "link", "add", veths[0], "type", "veth", "peer", "name", veths[1]])
        for ns, veth, addr in zip(namespaces, veths, NODE_ADDRESSES):
            _run(["ip", "link", "set", veth, "netns", ns])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/{PREFIX_LEN}", "dev", veth])
            _run(["ip", "-n", ns, "link", "set", veth, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])  # each agent's own loopback (its workers' store)
            for args in shaping_commands(veth, gbit, delay_ms):
                _run(["tc", "-n", ns, *args])
            # The agents start through `ip netns exec`, which needs a mount namespace of its own (it remounts
            # /sys): a container may allow the namespaces but not that.
            _run(["ip", "netns", "exec", ns, sys.executable, "-c", ""])
    except _CommandFailed:
        _teardown_netns(namespaces, veths[0])
        raise
    return link


def _netns_pids(ns: str) -> list[int]:
    proc = _run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def _teardown_netns(namespaces: Sequence[str], veth: Optional[str] = None) -> None:
    existing = set(_run(["ip", "netns", "list"], check=False).stdout.split())
    for ns in namespaces:
        if ns not in existing:
            continue
        # A namespace lives on while a process is in it: our agents are stopped before this, a straggler that
        # survived its SIGTERM (a worker stuck in a collective) goes now.
        for pid in _netns_pids(ns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _run(["ip", "netns", "del", ns], check=False)
    if veth:  # still here only when the build failed before moving it into its namespace
        _run(["ip", "link", "del", veth], check=False)


def _lo_root_kind() -> Optional[str]:
    proc = _run(["tc", "-j", "qdisc", "show", "dev", "lo"], check=False)
    try:
        roots = [q for q in json.loads(proc.stdout or "[]") if q.get("root")]
    except json.JSONDecodeError:
        return None
    return roots[0].get("kind") if roots else None


def _build_lo(tag: str, gbit: float, delay_ms: float) -> Link:
    if not shutil.which("tc"):
        raise _CommandFailed("`tc` not found (install iproute2, or carry it: tools/fetch_iproute2.sh)")
    kind = _lo_root_kind()
    if kind not in (None, "noqueue"):
        raise _CommandFailed(f"lo already has a root qdisc ({kind}): not touching it")
    for args in shaping_commands("lo", gbit, delay_ms):
        try:
            _run(["tc", *args])
        except _CommandFailed:
            _run(["tc", "qdisc", "del", "dev", "lo", "root"], check=False)
            raise
    with contextlib.suppress(OSError):
        LO_MARKER_DIR.mkdir(parents=True, exist_ok=True)
        (LO_MARKER_DIR / f"lo.{tag}").write_text(str(os.getpid()))
    return plan_link("lo", gbit, delay_ms, tag)


def _teardown_lo(tag: str) -> None:
    _run(["tc", "qdisc", "del", "dev", "lo", "root"], check=False)
    with contextlib.suppress(OSError):
        (LO_MARKER_DIR / f"lo.{tag}").unlink()
        LO_MARKER_DIR.rmdir()  # when no other link's marker is in it


def close_link(link: Link) -> None:
    """Removes what :func:`build_link` made (idempotent)."""
    if link.mode == "netns":
        _teardown_netns(link.namespaces)
    elif link.mode == "lo":
        _teardown_lo(link.tag)


def build_link(gbit: Optional[float], delay_ms: float = 0.0, modes: Sequence[str] = ("netns",),
               tag: Optional[str] = None) -> Link:
    """The first of ``modes`` this machine allows, built; :class:`LinkUnavailable` with every reason otherwise.
    Call :func:`close_link` after (or use :func:`open_link`)."""
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"link modes {list(modes)}: choose from {', '.join(MODES)}")
    if gbit is not None and gbit <= 0:
        raise ValueError(f"link rate {gbit} Gbit/s: give a positive rate")
    if delay_ms < 0:
        raise ValueError(f"link delay {delay_ms} ms: give 0 or more")
    use_carried_iproute2()
    tag = tag or str(os.getpid())
    tried = []
    for mode in modes:
        if mode == "sockets":
            if delay_ms:
                tried.append("sockets: cannot add a delay without tc")
                continue
            link = plan_link("sockets", gbit, tag=tag)
            link.tried = tried
            return link
        if not has_net_admin():
            tried.append(f"{mode}: this process lacks CAP_NET_ADMIN (run as root, or in a container with NET_ADMIN)")
            continue
        try:
            link = (_build_netns if mode == "netns" else _build_lo)(tag, gbit, delay_ms)
        except _CommandFailed as err:
            reason = str(err)
            if "qdisc kind is unknown" in reason:
                reason += (" (the kernel has no sch_netem: leave the delay out)" if "netem" in reason
                           else " (the kernel has no sch_tbf)")
            tried.append(f"{mode}: {reason}")
            continue
        link.tried = tried
        return link
    raise LinkUnavailable("no link of the requested kind can be made on this machine:\n  " + "\n  ".join(tried))


@contextlib.contextmanager
def open_link(gbit: Optional[float], delay_ms: float = 0.0, modes: Sequence[str] = ("netns",)) -> Iterator[Link]:
    """:func:`build_link` for the ``with`` block; torn down after it, also on an exception or SIGTERM."""
    link = build_link(gbit, delay_ms, modes)
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield link
    finally:
        close_link(link)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def run_over_link(tool: str, gbit: float, delay_ms: float, modes, run) -> int:
    """``run(link)`` inside a link opened by :func:`open_link` (its description printed first), or 2 with one line
    saying why none of ``modes`` could be made: what every tool that takes ``--link-gbit`` does."""
    try:
        with open_link(gbit, delay_ms, modes) as link:
            print(f"{tool}: link {json.dumps(link.describe())}", flush=True)
            return run(link)
    except LinkUnavailable as err:
        print(f"{tool}: {err}\n  (--link-modes netns,lo,sockets allows the fallbacks; tools/slow_link.py says what "
              "each means)", file=sys.stderr)
        return 2


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and not yet reaped by its parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def cleanup_leftovers() -> list[str]:
    """Removes the namespaces and lo qdisc of links whose process is gone; returns what it removed."""
    use_carried_iproute2()
    removed = []
    if shutil.which("ip"):
        for name in _run(["ip", "netns", "list"], check=False).stdout.split():
            match = _NAME.match(name)
            if match and not _alive(int(match.group(1))):
                _teardown_netns([name])
                removed.append(f"netns {name}")
    for marker in LO_MARKER_DIR.glob("lo.*") if LO_MARKER_DIR.is_dir() else []:
        with contextlib.suppress(ValueError, OSError):
            if not _alive(int(marker.read_text().strip())):
                _teardown_lo(marker.name.split(".", 1)[1])
                removed.append("lo root qdisc")
    return removed


def leftovers() -> list[str]:
    """Namespaces of this tool that still exist, and lo's root qdisc if it is not the default one."""
    use_carried_iproute2()
    names = _run(["ip", "netns", "list"], check=False).stdout.split() if shutil.which("ip") else []
    found = [f"netns {n}" for n in names if _NAME.match(n)]
    if shutil.which("tc") and _lo_root_kind() not in (None, "noqueue"):
        found.append(f"lo root qdisc {_lo_root_kind()}")
    return found


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)
    probe = sub.add_parser("probe", help="build the first possible mode, print it, remove it")
    probe.add_argument("--gbit", type=float, default=10.0)
    probe.add_argument("--delay-ms", type=float, default=0.0)
    probe.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, in order of preference ({MODES})")
    sub.add_parser("cleanup", help="remove the namespaces and lo qdisc left by killed runs")
    args = parser.parse_args(argv)
    if args.action == "cleanup":
        removed = cleanup_leftovers()
        print("slow_link: removed " + (", ".join(removed) if removed else "nothing"))
        return 0
    try:
        with open_link(args.gbit, args.delay_ms, [m for m in args.modes.split(",") if m]) as link:
            print(json.dumps(link.describe(), indent=2))
    except (ValueError, LinkUnavailable) as err:
        print(f"slow_link: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
