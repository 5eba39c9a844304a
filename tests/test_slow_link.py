"""Two nodes over a link of known bandwidth (tools/slow_link.py, issue 43), on the CPU.

- The link's plan: tc commands, each node's namespace, addresses, torchrun options and NCCL/gloo variables, and
  the launchers that use it (tools/launch_two_nodes.py, tools/bench_scale.py), without building anything.
- Refusals: a mode the machine cannot give says why in one line (a process without CAP_NET_ADMIN, made with
  setpriv), and bad rates or modes stop before anything is built.
- Where this machine lets root make network namespaces (``slow``, skipped otherwise with the reason): gloo's
  all-reduce over a 0.5 Gbit/s veth link measures just under the rate, with every byte counted on the link; the
  tiny HSDP training runs over it; cleanup removes what a killed run left; nothing is left behind.
- GPU (marked ``gpu``; 2 GPUs as 2 nodes x 1): NCCL's all-reduce over a 10 Gbit/s link, through its socket
  transport only (its own log), at no more than the rate, every byte counted on the link.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch_utils import TINY_OVERRIDES, TOOLS, clean_env, read_metrics, tail

sys.path.insert(0, str(TOOLS))
import bench_scale  # noqa: E402  (tools/ is not a package)
import launch_two_nodes  # noqa: E402
import slow_link  # noqa: E402


def test_shaping_commands():
    # 10 Gbit/s: the bucket holds 4 ms at the rate (5 MB), more than the 1 MiB floor.
    assert slow_link.shaping_commands("v0", 10, 0) == [
        ["qdisc", "add", "dev", "v0", "root", "handle", "1:", "tbf", "rate", "10000mbit", "burst", "5000000",
         "latency", "50ms"]]
    delayed = slow_link.shaping_commands("v0", 0.5, 2.5)
    assert delayed[0][:7] == ["qdisc", "add", "dev", "v0", "root", "handle", "1:"] and delayed[0][7:10] == [
        "netem", "delay", "2.5ms"]
    assert delayed[1][:7] == ["qdisc", "add", "dev", "v0", "parent", "1:1", "handle"]
    assert delayed[1][8:12] == ["tbf", "rate", "500mbit", "burst"] and delayed[1][12] == str(2**20)


def test_planned_link_and_two_node_launch():
    link = slow_link.plan_link("netns", 10.0, tag="4242")
    assert link.namespaces == ["fsl4242n0", "fsl4242n1"] and link.interfaces == ["fsl4242v0", "fsl4242v1"]
    assert all(len(name) <= 15 for name in link.interfaces)  # the kernel's limit for an interface name
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3", "NCCL_NVLS_ENABLE": "0"}
    commands, envs = launch_two_nodes.two_node_launch(["-m", "x"], device="cuda", nproc_per_node=2, base_env=base,
                                                      link=link, port=29400, rdzv_id="job", python="py")
    for node in (0, 1):
        assert commands[node] == [
            "ip", "netns", "exec", f"fsl4242n{node}", "py", "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "2", "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint",
            "10.213.7.1:29400", "--rdzv-id", "job", "--max-restarts", "0", "--local-addr", f"10.213.7.{node + 1}",
            "--rdzv-conf", f"is_host={1 - node}", "-m", "x"]
        env = envs[node]
        assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == f"fsl4242v{node}"
        assert env["NCCL_HOSTID"] == f"fsl-node{node}-4242"  # two hosts to NCCL: NVLink only within a node
        assert env["NCCL_IB_DISABLE"] == "1" and env["NCCL_NET"] == "Socket" and env["NCCL_NVLS_ENABLE"] == "0"
        assert "NCCL_P2P_DISABLE" not in env
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1", "2,3"]
    # Loopback fallbacks: no namespace, the rendezvous on 127.0.0.1; "sockets" narrows NCCL's connections.
    lo = slow_link.plan_link("sockets", 10.0, tag="7")
    commands, envs = launch_two_nodes.two_node_launch(["-m", "x"], device="cpu", nproc_per_node=1, base_env={},
                                                      link=lo, port=1, rdzv_id="j", python="py")
    assert commands[0][:3] == ["py", "-m", "torch.distributed.run"] and "127.0.0.1:1" in commands[0]
    assert "--local-addr" not in commands[0] and lo.gbit is None and lo.describe()["duplex"] is None
    assert envs[1]["NCCL_SOCKET_NTHREADS"] == envs[1]["NCCL_NSOCKS_PERTHREAD"] == "1"
    assert envs[1]["NCCL_SOCKET_IFNAME"] == "lo" and envs[1]["NCCL_HOSTID"] == "fsl-node1-7"


def test_bench_scale_over_a_link_dry_run(capsys):
    base = ["--dry-run", "--gpu-ids", "0,1", "--gpus", "1", "--ethernet", "2x1", "--threads-per-rank", "4",
            "--contenders", "speedloader,fsdp2-offload:2x4", "--shape", "1x8"]
    assert bench_scale.main([*base, "--dp-replicate", "2", "--link-gbit", "10"]) == 0
    lines = capsys.readouterr().out.splitlines()
    by_key = {m.group(1, 2, 3): m.group(4) for m in (re.match(r"\[(\S+) (\S+) node(\d)\] (.*)", x) for x in lines)}
    one = by_key[("speedloader", "1gpu", "0")]
    assert "ip netns exec" not in one and "--dp-replicate" not in one  # one node: no link, a 1-D mesh
    for node in ("0", "1"):
        cmd = by_key[("fsdp2-offload:2x4", "2x1-ethernet", node)]
        assert f"ip netns exec fsl{os.getpid()}n{node} " in cmd
        assert cmd.endswith("--worker fsdp2-offload:2x4 --model llama2_7b --layers 4 --seq-len 4096 --steps 2 "
                            "--warmup 1 --peak-tflops 989.0 --prefetch 1 --activation-store host --device cuda "
                            "--dp-replicate 2")
        assert "NCCL_P2P_DISABLE" not in cmd  # the namespaces separate the nodes; NVLink stays within one
    with pytest.raises(SystemExit):
        bench_scale.main([*base, "--ethernet", "", "--dp-replicate", "2"])
    assert "--dp-replicate 2: 1 (FSDP over all ranks) or 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_scale.main([*base, "--link-gbit", "0"])
    assert "give a positive rate" in capsys.readouterr().err


def test_bench_slow_link_nodes_of_two_gpus_dry_run(tmp_path):
    """FSL_SLOW_LINK_GPUS_PER_NODE=2: the HSDP part runs 2 nodes x 2 GPUs on GPUs 0-3, and its record says so in
    its name (a 2 x 1 record of the same point must not be appended to)."""
    env = dict(os.environ, FSL_BENCH_DRY_RUN="1", FSL_SLOW_LINK_GPUS_PER_NODE="2", FSL_SLOW_LINK_CAP_GIB="24",
               FSL_SLOW_LINK_LAYERS="2")
    out = subprocess.run(["bash", str(TOOLS / "bench_slow_link.sh"), str(tmp_path), "hsdp"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    launch = next(line for line in out.stdout.splitlines() if "bench_scale.py" in line)
    assert "--ethernet 2x2 --gpu-ids 0,1,2,3 --dp-replicate 2" in launch
    assert "--name slow_link_hsdp_10g_llama2_7b_L2_s4096_2x32_cap24_nodes2x2 " in launch
    env.pop("FSL_SLOW_LINK_GPUS_PER_NODE")
    out = subprocess.run(["bash", str(TOOLS / "bench_slow_link.sh"), str(tmp_path), "hsdp"], env=env,
                         capture_output=True, text=True, timeout=120)
    launch = next(line for line in out.stdout.splitlines() if "bench_scale.py" in line)
    assert "--ethernet 2x1 --gpu-ids 0,1 " in launch
    assert "--name slow_link_hsdp_10g_llama2_7b_L2_s4096_2x32_cap24 " in launch


def test_refusals(capsys):
    with pytest.raises(slow_link.LinkUnavailable, match="sockets: cannot add a delay without tc"):
        slow_link.build_link(10, 5.0, modes=("sockets",))
    with pytest.raises(ValueError, match="choose from netns, lo, sockets"):
        slow_link.build_link(10, modes=("veth",))
    with pytest.raises(ValueError, match="give a positive rate"):
        slow_link.build_link(-1)
    with pytest.raises(SystemExit) as exit:
        launch_two_nodes.main(["--link-gbit", "10", "--link-modes", "tbf", "--", "-m", "x"])
    assert exit.value.code == 2 and "modes of netns,lo,sockets" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launch_two_nodes.main(["--link-delay-ms", "3", "--", "-m", "x"])
    assert "--link-delay-ms needs --link-gbit" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux) to drop CAP_NET_ADMIN")
def test_without_net_admin_says_so_and_falls_back():
    drop = ["setpriv", "--inh-caps=-net_admin", "--bounding-set=-net_admin"]
    probe = [sys.executable, str(TOOLS / "slow_link.py"), "probe", "--gbit", "10"]
    proc = subprocess.run([*drop, *probe, "--modes", "netns,lo"], capture_output=True, text=True, timeout=60)
    if proc.returncode == 0 and "netns" in proc.stdout:
        pytest.skip("setpriv could not drop CAP_NET_ADMIN here")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "netns: this process lacks CAP_NET_ADMIN" in proc.stderr and "lo: this process lacks" in proc.stderr
    proc = subprocess.run([*drop, *probe, "--modes", "netns,sockets"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    described = json.loads(proc.stdout)
    assert described["mode"] == "sockets" and described["gbit"] is None
    assert described["not_possible"] == [
        "netns: this process lacks CAP_NET_ADMIN (run as root, or in a container with NET_ADMIN)"]


# --- a real link (root, network namespaces, sch_tbf) ----------------------------------------------------


@pytest.fixture
def netns_link():
    """Skips where this machine cannot make the link; yields what was left over before the test, so that the test
    can tell that it left nothing (other sessions on a shared machine may hold links of their own)."""
    try:
        slow_link.close_link(slow_link.build_link(1.0))
    except slow_link.LinkUnavailable as err:
        pytest.skip(f"this machine cannot make the link: {err}")
    yield set(slow_link.leftovers())


@pytest.mark.slow
def test_gloo_all_reduce_over_a_shaped_link(tmp_path, netns_link):
    gbit = 0.5
    cmd = [sys.executable, str(TOOLS / "allreduce_bw.py"), "--device", "cpu", "--link-gbit", str(gbit),
           "--sizes-mb", "1,8", "--min-time-s", "0.5", "--out-dir", str(tmp_path), "--name", "bw", "--timeout", "200"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=clean_env(tmp_path), capture_output=True, text=True, timeout=260)
    assert proc.returncode == 0, tail(proc.stdout + proc.stderr)
    record = json.loads((tmp_path / "bw.json").read_text())
    assert record["benchmark"] == "allreduce_bw" and record["status"] == "ok" and record["backend"] == "gloo"
    assert record["link"]["mode"] == "netns" and record["link"]["gbit"] == gbit and record["world_size"] == 2
    largest = record["rows"][-1]
    assert largest["size_mib"] == 8
    # Just under the rate: the token bucket caps it (its 1 MiB burst at most once per all-reduce), TCP gets most.
    assert 0.6 * gbit < largest["busbw_gbit_s"] <= 1.05 * gbit, largest
    # Every byte of the ring crossed the link, each way: the payload plus TCP/IP headers.
    for sent in largest["link_bytes_per_node"]:
        assert 0.99 <= sent / largest["expected_bytes_per_direction"] < 1.25, largest
    assert all(v <= 1.1 * gbit for v in largest["link_gbit_s_per_node"])
    assert set(slow_link.leftovers()) <= netns_link  # namespaces and qdiscs removed


@pytest.mark.slow
def test_tiny_hsdp_training_over_the_link(tmp_path, netns_link):
    cmd = [sys.executable, str(TOOLS / "launch_two_nodes.py"), "--device", "cpu", "--nproc-per-node", "1",
           "--link-gbit", "1", "--timeout", "240", "--", "-m", "fsdp_speedloader.app.train", *TINY_OVERRIDES,
           "steps=3", "dp_replicate=2"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=clean_env(tmp_path), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, tail(out)
    assert re.search(r'^launch_two_nodes: link \{"mode": "netns", "gbit": 1\.0', out, re.M), tail(out)
    for node in (0, 1):
        assert re.search(rf"^\[node{node}\] .*GLOO_SOCKET_IFNAME=fsl\d+v{node} .*ip netns exec fsl\d+n{node} .*"
                         rf"--rdzv-endpoint 10\.213\.7\.1:\d+ ", out, re.M), tail(out)
    run = next(p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir())
    assert "2 rank(s) on cpu, mesh {'dp_replicate': 2, 'dp_shard': 1}" in (run / "train.log").read_text()
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    assert set(slow_link.leftovers()) <= netns_link  # namespaces and qdiscs removed


def test_cleanup_removes_what_a_killed_run_left(netns_link):
    """A run killed with SIGKILL leaves its link, named by its pid; cleanup removes it once that process is gone:
    reaped, or a zombie that its parent has not reaped yet (what a killed launcher is to the shell that started
    it)."""
    import time

    reaped = subprocess.Popen([sys.executable, "-c", "pass"])
    reaped.wait()
    zombie = subprocess.Popen(["true"])
    while Path(f"/proc/{zombie.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
        time.sleep(0.01)  # exited, not reaped: no wait() until cleanup has run
    links = []
    try:
        links = [slow_link.build_link(1.0, tag=str(p.pid)) for p in (reaped, zombie)]
        names = {f"netns fsl{p.pid}n{i}" for p in (reaped, zombie) for i in (0, 1)}
        assert names <= set(slow_link.leftovers())
        assert names <= set(slow_link.cleanup_leftovers())
        assert not names & set(slow_link.leftovers())
    finally:
        for link in links:
            slow_link.close_link(link)  # idempotent: nothing left to remove when cleanup did its work
        zombie.wait()


def test_loopback_fallback_leaves_lo_as_found():
    """lo mode shapes this namespace's loopback (here far above what the machine's processes send, so that others
    on it are not slowed), refuses a lo that already has a root qdisc, and restores lo's default on close."""
    try:
        link = slow_link.build_link(100.0, modes=("lo",))
    except slow_link.LinkUnavailable as err:
        pytest.skip(f"this machine cannot shape lo: {err}")
    try:
        assert link.mode == "lo" and link.rendezvous_host == "127.0.0.1" and link.command(1, ["x"]) == ["x"]
        assert slow_link._lo_root_kind() == "tbf" and isinstance(link.bytes_sent()[0], int)
        with pytest.raises(slow_link.LinkUnavailable, match=r"lo: lo already has a root qdisc \(tbf\): not touching"):
            slow_link.build_link(100.0, modes=("lo",), tag="second")
    finally:
        slow_link.close_link(link)
    assert slow_link._lo_root_kind() in (None, "noqueue") and not slow_link.LO_MARKER_DIR.exists()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (2 nodes x 1)")
def test_nccl_all_reduce_over_a_10_gbit_link(tmp_path, netns_link):
    """On the GPU machine: NCCL between the two nodes goes through its socket transport over the shaped veth (its
    own log says so), at no more than the link's rate, with every byte counted on the link."""
    env = clean_env(tmp_path, NCCL_DEBUG="INFO")
    env.pop("CUDA_VISIBLE_DEVICES")  # clean_env hides GPUs: this test wants them
    cmd = [sys.executable, str(TOOLS / "allreduce_bw.py"), "--device", "cuda", "--link-gbit", "10", "--sizes-mb",
           "16,64", "--min-time-s", "1", "--out-dir", str(tmp_path), "--name", "bw", "--timeout", "200"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=260)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, tail(out, 8000)
    channels = [line for line in out.splitlines() if re.search(r"Channel \d+.* via ", line)]
    assert channels and all("via NET/Socket" in line for line in channels), channels[:5]
    record = json.loads((tmp_path / "bw.json").read_text())
    assert record["backend"] == "nccl" and record["link"]["mode"] == "netns"
    largest = record["rows"][-1]
    assert largest["busbw_gbit_s"] <= 10.5, largest
    assert all(0.99 <= sent / largest["expected_bytes_per_direction"] < 1.25 for sent in largest["link_bytes_per_node"])
    assert set(slow_link.leftovers()) <= netns_link


def test_carried_iproute2_goes_on_path_only_where_the_machine_has_none(tmp_path, monkeypatch):
    """tools/fetch_iproute2.sh's unpacked root: its sbin and libraries join PATH and LD_LIBRARY_PATH when `ip` or `tc`
    is missing; a machine with both keeps its own; an empty root changes nothing."""
    root = tmp_path / "root"
    (root / "sbin").mkdir(parents=True)
    (root / "lib" / "x86_64-linux-gnu").mkdir(parents=True)
    (root / "sbin" / "ip").write_text("")
    monkeypatch.setenv("PATH", "/usr/bin")
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    monkeypatch.setattr(slow_link.shutil, "which", lambda name: "/usr/sbin/ip" if name == "ip" else None)
    assert slow_link.use_carried_iproute2(root) is True
    assert os.environ["PATH"] == f"{root / 'sbin'}{os.pathsep}/usr/bin"
    assert os.environ["LD_LIBRARY_PATH"] == str(root / "lib" / "x86_64-linux-gnu")
    monkeypatch.setenv("PATH", "/usr/bin")
    monkeypatch.setattr(slow_link.shutil, "which", lambda name: f"/usr/sbin/{name}")
    assert slow_link.use_carried_iproute2(root) is False and os.environ["PATH"] == "/usr/bin"
    monkeypatch.setattr(slow_link.shutil, "which", lambda name: None)
    assert slow_link.use_carried_iproute2(tmp_path / "nothing") is False


def test_carried_iproute2_is_found_where_its_sbin_link_points_outside_the_tree(tmp_path, monkeypatch):
    """Debian's sbin/ip is a link to /bin/ip, which a machine without iproute2 lacks: the tree's own bin/ip is used
    (a dangling link alone is no `ip`)."""
    root = tmp_path / "root"
    for d in ("sbin", "bin"):
        (root / d).mkdir(parents=True)
    (root / "sbin" / "ip").symlink_to(tmp_path / "missing" / "ip")
    (root / "sbin" / "tc").write_text("")
    monkeypatch.setenv("PATH", "/usr/bin")
    monkeypatch.setattr(slow_link.shutil, "which", lambda name: None)
    assert slow_link.use_carried_iproute2(root) is False  # no ip in the tree yet: PATH unchanged
    assert os.environ["PATH"] == "/usr/bin"
    (root / "bin" / "ip").write_text("")
    assert slow_link.use_carried_iproute2(root) is True
    assert os.environ["PATH"] == os.pathsep.join([str(root / "sbin"), str(root / "bin"), "/usr/bin"])
