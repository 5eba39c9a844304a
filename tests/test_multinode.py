"""Multi-node launches: two torchrun "nodes" on one host, the SLURM launcher config, submitit's environment.

- CPU (CI): ``tools/launch_two_nodes.py`` starts two torchrun agents (``--nnodes 2 --nproc-per-node 1``,
  c10d rendezvous on 127.0.0.1) running ``python -m fsdp_speedloader.app.train ... dp_replicate=2``: an
  HSDP mesh of 2 replicas ("nodes") x 1 shard. Both exit 0, into ONE run directory.
- GPU (marked ``gpu``; needs 4 GPUs): 2 nodes x 2 GPUs with NCCL restricted to its network transport
  (``--emulate-ethernet``); NCCL's own log shows every connection going through NET/Socket.
- hydra-submitit-launcher is an optional extra: the tests that need it skip without it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from launch_utils import REPO, TINY_OVERRIDES, TOOLS, clean_env, read_metrics, tail

sys.path.insert(0, str(TOOLS))
import launch_two_nodes  # noqa: E402  (tools/ is not a package)



def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


HAS_SUBMITIT = _installed("hydra_plugins.hydra_submitit_launcher")
SLURM_YAML = REPO / "conf" / "hydra" / "launcher" / "slurm.yaml"


def _one_run_dir(root: Path) -> Path:
    run_dirs = [p for p in (root / "outputs").glob("*/*") if p.is_dir()]
    assert len(run_dirs) == 1, run_dirs  # every rank of both nodes agreed on rank 0's timestamp
    return run_dirs[0]


@pytest.mark.slow
def test_two_nodes_on_one_host_cpu(tmp_path):
    cmd = [sys.executable, str(TOOLS / "launch_two_nodes.py"), "--device", "cpu", "--nproc-per-node", "1",
           "--timeout", "240", "--", "-m", "fsdp_speedloader.app.train", *TINY_OVERRIDES, "steps=3", "dp_replicate=2",
           "checkpoint.save_final=true"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=clean_env(tmp_path), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, tail(out)
    for node in (0, 1):
        assert re.search(rf"^\[node{node}\] .*--nnodes 2 --nproc-per-node 1 --node-rank {node} --rdzv-backend c10d "
                         r"--rdzv-endpoint 127\.0\.0\.1:\d+ --rdzv-id two-nodes-", out, re.M), tail(out)

    run = _one_run_dir(tmp_path)
    log = (run / "train.log").read_text()
    assert "2 rank(s) on cpu, mesh {'dp_replicate': 2, 'dp_shard': 1}" in log  # HSDP across the two "nodes"
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    step_dir = run / "checkpoints" / "step_00000003"
    assert (step_dir / "extra_rank0.pt").is_file() and (step_dir / "extra_rank1.pt").is_file()


def test_two_node_commands_and_environments():
    base = {"PATH": "/bin", "NCCL_NVLS_ENABLE": "0", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    envs = launch_two_nodes.agent_envs(base, device="cuda", nproc_per_node=2, emulate_ethernet=True)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["4,5", "6,7"]  # each "node" its own GPUs
    for env in envs:
        assert {k: env[k] for k in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE")} == {
            "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
        assert env["NCCL_NVLS_ENABLE"] == "0" and env["PATH"] == "/bin"  # the rest passes through
    assert "NCCL_P2P_DISABLE" not in launch_two_nodes.agent_envs(base, device="cuda", nproc_per_node=2)[0]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in launch_two_nodes.agent_envs({}, device="cpu", nproc_per_node=1)] == ["", ""]
    with pytest.raises(ValueError, match="needs 6 GPUs, 4 visible"):
        launch_two_nodes.agent_envs(base, device="cuda", nproc_per_node=3)

    cmd = launch_two_nodes.agent_command(["-m", "fsdp_speedloader.app.train", "dp_replicate=2"], node_rank=1,
                                         nproc_per_node=2, port=29400, rdzv_id="job", max_restarts=1, python="py")
    assert cmd == ["py", "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", "1",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400", "--rdzv-id", "job",
                   "--max-restarts", "1", "-m", "fsdp_speedloader.app.train", "dp_replicate=2"]
    assert launch_two_nodes.exit_status([0, 0]) == 0
    assert launch_two_nodes.exit_status([0, None]) == 1 and launch_two_nodes.exit_status([0, 3]) == 3


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs (2 nodes x 2)")
def test_two_nodes_of_two_gpus_over_emulated_ethernet(tmp_path):
    env = clean_env(tmp_path, NCCL_DEBUG="INFO")
    env.pop("CUDA_VISIBLE_DEVICES")  # clean_env hides GPUs: this test wants them
    cmd = [sys.executable, str(TOOLS / "launch_two_nodes.py"), "--device", "cuda", "--nproc-per-node", "2",
           "--emulate-ethernet", "--timeout", "420", "--", "-m", "fsdp_speedloader.app.train", *TINY_OVERRIDES,
           "device=cuda", "steps=3", "dp_replicate=2", "schedule.num_sub_batches=4", "checkpoint.save_final=true"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=480)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, tail(out, 8000)
    run = _one_run_dir(tmp_path)
    assert "4 rank(s) on cuda:0, mesh {'dp_replicate': 2, 'dp_shard': 2}" in (run / "train.log").read_text()
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    # NCCL's connection lines ("Channel 00/0 : 0[0] -> 1[1] via NET/Socket/0"): network transport only.
    channels = [line for line in out.splitlines() if re.search(r"Channel \d+.* via ", line)]
    assert channels, "NCCL_DEBUG=INFO printed no channel setup"
    assert all("via NET/Socket" in line for line in channels), [l for l in channels if "NET/Socket" not in l][:5]


# --- SLURM through hydra-submitit-launcher ---------------------------------------------------------


def test_slurm_launcher_config():
    text = SLURM_YAML.read_text()
    assert text.splitlines()[0] == "# @package hydra.launcher"
    cfg = yaml.safe_load(text)
    assert cfg["defaults"] == ["submitit_slurm"]
    assert cfg["tasks_per_node"] == cfg["gpus_per_node"]  # one rank per GPU, no torchrun inside the job
    if not HAS_SUBMITIT:
        pytest.skip("hydra-submitit-launcher is not installed (optional): checked the YAML only")
    from hydra import compose, initialize_config_dir
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf

    assert set(cfg) - {"defaults"} <= set(SlurmQueueConf.__dataclass_fields__)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        composed = compose("config", overrides=["hydra/launcher=slurm", "hydra.launcher.nodes=4", "output_dir=/x"],
                           return_hydra_config=True)
    launcher = composed.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher") and launcher.nodes == 4 and launcher.tasks_per_node == 8


def test_submitit_environment_becomes_torch_environment(monkeypatch):
    from fsdp_speedloader.app.launch import maybe_export_submitit_env

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "SUBMITIT_EXECUTOR"):
        monkeypatch.delenv(key, raising=False)
    assert maybe_export_submitit_env() is False  # plain python: nothing to do
    if not _installed("submitit"):
        pytest.skip("submitit is not installed (optional)")
    slurm = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "123", "SLURM_NTASKS": "16", "SLURM_JOB_NUM_NODES": "2",
             "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_PROCID": "11", "SLURM_LOCALID": "3"}
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    assert maybe_export_submitit_env() is True
    import os

    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"], os.environ["MASTER_ADDR"]) == (
        "11", "16", "3", "gpu07")
    monkeypatch.setenv("RANK", "11")
    assert maybe_export_submitit_env() is False  # torchrun (or an earlier export) already set it


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SUBMITIT, reason="hydra-submitit-launcher is not installed (optional)")
def test_submitit_local_launcher_two_tasks(tmp_path):
    """The SLURM path without SLURM: submitit's local executor starts 2 tasks, as srun would."""
    cmd = [sys.executable, "-m", "fsdp_speedloader.app.train", "-m", "hydra/launcher=submitit_local",
           "hydra.launcher.tasks_per_node=2", "hydra.launcher.timeout_min=5", f"hydra.sweep.dir={tmp_path / 'multirun'}",
           *TINY_OVERRIDES, "steps=3", "dp_replicate=2"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=clean_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, tail(proc.stdout + proc.stderr)
    run = tmp_path / "multirun" / "0"
    assert "2 rank(s) on cpu, mesh {'dp_replicate': 2, 'dp_shard': 1}" in (run / "train.log").read_text()
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]


# --- tools/bench_scale.py: its launches (the GPU runs are the lead's) -----------------------------

import bench_scale  # noqa: E402

FAKE_WORKER = '''
import json, os, sys
contender = sys.argv[sys.argv.index("--worker") + 1].split(":")[0]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if contender == "fsdp2-offload" and world == 1:
    sys.exit("RuntimeError: stand-in failure")
step = (1.0 if contender == "speedloader" else 4.0) + 0.5 * rank
print("RESULT " + json.dumps({"contender": contender, "tokens_per_step": 1000, "step_s": step, "fwd_bwd_s": step - 0.5,
      "optimizer_s": 0.5, "mfu": 0.1, "peak_hbm_gib": 1.0 + rank, "host_peak_rss_gib": 2.0,
      "env": {k: os.environ.get(k) for k in ("NCCL_P2P_DISABLE", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")}}))
'''


def test_bench_scale_dry_run_launches(capsys, monkeypatch):
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    assert bench_scale.main(["--dry-run", "--gpu-ids", "0,1,2,3", "--threads-per-rank", "16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    launches = [re.match(r"\[(\S+) (\S+) node(\d)\] (.*)", line).groups() for line in lines]
    # 3 contenders x (1gpu, 4gpu, 2x2-ethernet with 2 agents, 2gpu), in priority order.
    assert [(c, case) for c, case, node, _ in launches if node == "0"] == [
        (c, case) for c in bench_scale.CONTENDERS for case in ("1gpu", "4gpu", "2x2-ethernet", "2gpu")]
    by_key = {(c, case, node): cmd for c, case, node, cmd in launches}
    one = by_key[("speedloader", "1gpu", "0")]
    assert "CUDA_VISIBLE_DEVICES=0 " in one and "OMP_NUM_THREADS=16" in one and "NCCL_P2P_DISABLE" not in one
    assert "--standalone --nproc-per-node 1" in one and "bench_train.py --worker speedloader:1x8" in one
    assert "--standalone --nproc-per-node 4" in by_key[("fsdp2-offload", "4gpu", "0")]
    for node, gpus in (("0", "0,1"), ("1", "2,3")):
        cmd = by_key[("speedloader", "2x2-ethernet", node)]
        assert f"CUDA_VISIBLE_DEVICES={gpus} " in cmd and "NCCL_P2P_DISABLE=1" in cmd and "NCCL_SHM_DISABLE=1" in cmd
        assert f"--nnodes 2 --nproc-per-node 2 --node-rank {node} --rdzv-backend c10d" in cmd
    assert "bench_train.py --worker deepspeed-offload:1x8" in by_key[("deepspeed-offload", "1gpu", "0")]


def test_bench_scale_contender_options(capsys):
    """bench_train's options ride after a contender's name; bad ones fail before any launch; the Ethernet
    ratios compare each contender's fastest variant and name it."""
    base = ["--dry-run", "--gpu-ids", "0,1,2,3", "--gpus", "", "--shape", "2x32", "--threads-per-rank", "16"]
    assert bench_scale.main([*base, "--contenders", "speedloader:compile:root=device,fsdp2-offload:compile"]) == 0
    out = capsys.readouterr().out
    assert "--worker speedloader:2x32:compile:root=device " in out and "--worker fsdp2-offload:2x32:compile " in out
    assert "speedloader_compile_root_device_2x2-ethernet" in out  # no ':' or '=' in the log directories
    with pytest.raises(SystemExit):
        bench_scale.main([*base, "--contenders", "deepspeed-offload:compile"])
    assert "deepspeed-offload:2x32:compile" in capsys.readouterr().err
    results = [{"contender": c, "case": "2x2-ethernet", "status": "ok", "tokens_per_s": t}
               for c, t in (("speedloader", 100.0), ("speedloader:compile:root=device", 150.0),
                            ("fsdp2-offload", 30.0), ("fsdp2-offload:compile", 25.0))]
    got = bench_scale.targets(results)
    assert got["ethernet_variants"] == {"speedloader": "speedloader:compile:root=device", "fsdp2-offload": "fsdp2-offload"}
    assert got["ethernet_speedloader_over"] == {"fsdp2-offload": 5.0}
    assert got["ethernet_speedloader_over_each"] == {"fsdp2-offload": 5.0, "fsdp2-offload:compile": 6.0}


def test_bench_scale_contender_micro_batch(capsys):
    """A contender may split the same effective batch its own way (its micro-batch) under the cap every contender
    shares; another total is refused before any launch, naming the total to keep."""
    base = ["--dry-run", "--gpu-ids", "0,1,2,3", "--gpus", "", "--shape", "2x32", "--threads-per-rank", "16"]
    assert bench_scale.main([*base, "--contenders", "speedloader,fsdp2-offload:8x8:compile,deepspeed-offload:16x4",
                             "--max-gpu-memory-gib", "12"]) == 0
    out = capsys.readouterr().out
    assert out.count("--max-gpu-memory-gib 12.0") == 6  # the same cap for every rank's agent, 3 runs x 2 nodes
    assert "--worker speedloader:2x32 " in out and "--worker fsdp2-offload:8x8:compile " in out
    assert "--worker deepspeed-offload:16x4 " in out and "fsdp2-offload_8x8_compile_2x2-ethernet" in out
    assert "--profile" not in out
    assert bench_scale.main([*base, "--contenders", "speedloader:env=OMP_WAIT_POLICY=PASSIVE"]) == 0
    launches = capsys.readouterr().out.splitlines()
    assert len(launches) == 2 and all(" OMP_WAIT_POLICY=PASSIVE /" in line for line in launches)  # each agent's env
    assert bench_scale.main([*base, "--contenders", "speedloader", "--profile"]) == 0
    assert capsys.readouterr().out.count(" --profile") == 2  # every rank's agent traces one more step
    with pytest.raises(SystemExit):
        bench_scale.main([*base, "--contenders", "fsdp2-offload:8x4"])
    err = capsys.readouterr().err
    assert "8x4 is 32 sequences per GPU per step, --shape 2x32 is 64" in err and "n x N = 64" in err


@pytest.mark.slow
def test_bench_scale_runs_cases_and_records_them_on_cpu(tmp_path):
    """The whole harness with a stand-in worker (the real ones need GPUs): launches, per-rank results,
    aggregates, a failed run recorded while the others go on, targets, JSON and plot."""
    fake = tmp_path / "fake_worker.py"
    fake.write_text(FAKE_WORKER)
    cmd = [sys.executable, str(TOOLS / "bench_scale.py"), "--device", "cpu", "--worker-script", str(fake),
           "--gpus", "1", "--ethernet", "2x1", "--contenders", "speedloader,fsdp2-offload", "--threads-per-rank", "1",
           "--out-dir", str(tmp_path / "results"), "--name", "smoke", "--budget-s", "240"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=clean_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, tail(proc.stdout + proc.stderr)
    import json

    record = json.loads((tmp_path / "results" / "smoke.json").read_text())
    assert record["benchmark"] == "scale" and record["torch"] == torch.__version__ and record["command"]
    runs = {(r["contender"], r["case"]): r for r in record["results"]}
    assert [r["status"] for r in record["results"]] == ["ok", "ok", "failed", "ok"]
    assert "stand-in failure" in runs[("fsdp2-offload", "1gpu")]["error"]
    eth = runs[("speedloader", "2x1-ethernet")]
    assert len(eth["ranks"]) == 2 and eth["step_s"] == 1.5  # the slower rank sets the pace
    assert eth["tokens_per_s"] == pytest.approx(2000 / 1.5) and eth["tokens_per_s_per_gpu"] == pytest.approx(1000 / 1.5)
    assert {r["env"]["NCCL_P2P_DISABLE"] for r in eth["ranks"]} == {"1"}  # the emulated network reached the ranks
    assert runs[("speedloader", "1gpu")]["ranks"][0]["env"]["NCCL_P2P_DISABLE"] is None
    assert record["targets"]["ethernet_speedloader_over"]["fsdp2-offload"] == pytest.approx((2000 / 1.5) / (2000 / 4.5))
    try:
        import matplotlib  # noqa: F401
        has_matplotlib = True
    except ImportError:
        has_matplotlib = False
    assert (tmp_path / "results" / "smoke.png").is_file() == has_matplotlib
    assert has_matplotlib or "pip install matplotlib" in proc.stderr


def test_bench_scale_medians_over_invocations():
    """Each (contender, case)'s rates are its median invocation's; the spread is kept; failed runs do not count."""
    def run(contender, tps, status="ok"):
        return {"contender": contender, "case": "2x1-ethernet", "status": status, "tokens_per_s": tps,
                "tokens_per_s_per_gpu": tps / 2 if tps else None}

    results = [run("speedloader", 300.0), run("speedloader", 360.0), run("speedloader", 330.0),
               run("fsdp2-offload:16x4", 100.0), run("fsdp2-offload:16x4", 120.0), run("fsdp2-offload:16x4", None, "oom")]
    med = bench_scale.medians(results)
    assert med[("speedloader", "2x1-ethernet")]["tokens_per_s"] == 330.0
    assert med[("speedloader", "2x1-ethernet")]["tokens_per_s_per_gpu"] == 165.0
    assert med[("speedloader", "2x1-ethernet")]["spread"]["n"] == 3
    assert med[("fsdp2-offload:16x4", "2x1-ethernet")]["tokens_per_s"] == 110.0
    t = bench_scale.targets(results)
    assert t["ethernet_speedloader_over"]["fsdp2-offload"] == pytest.approx(3.0)
    assert t["repeats"]["speedloader 2x1-ethernet"]["min"] == 300.0


def test_bench_scale_link_per_step_and_the_bound():
    """Over a shaped link each run says the busier direction's bytes per step and their seconds at the link's rate;
    the targets bound each ratio by the peer's median step over layer-major's median forward+backward."""
    got = bench_scale.link_per_step([72_586_246_077, 72_587_901_036], 7, 10.0)
    assert got["link_bytes_per_step"] == pytest.approx(72_587_901_036 / 7)
    assert got["link_s_per_step"] == pytest.approx(72_587_901_036 / 7 * 8 / 10e9)  # 8.30 s
    assert bench_scale.link_per_step([17_623_420_719, None], 7, None) == {
        "link_bytes_per_step": pytest.approx(17_623_420_719 / 7), "link_s_per_step": None}  # no rate: no seconds
    assert bench_scale.link_per_step([None, None], 7, 10.0) == {}  # sockets mode counts nothing

    def run(contender, tps, step_s, fwd_bwd_s, link_s):
        return {"contender": contender, "case": "2x1-ethernet", "status": "ok", "tokens_per_s": tps,
                "tokens_per_s_per_gpu": tps / 2, "step_s": step_s, "fwd_bwd_s": fwd_bwd_s, "link_s_per_step": link_s}

    results = [run("speedloader:compile", 149_530.0, 3.51, 3.41, 2.0),
               run("speedloader:compile", 147_921.0, 3.54, 3.47, 2.1),
               run("fsdp2-offload:8x8", 55_575.0, 9.43, 9.32, 8.3), run("fsdp2-offload:8x8", 55_436.0, 9.46, 9.35, 8.3),
               run("fsdp2-offload:4x16", 30_797.0, 17.02, 16.87, 15.5)]
    t = bench_scale.targets(results)
    assert t["ethernet_variants"]["fsdp2-offload"] == "fsdp2-offload:8x8"  # the bound is against its best point
    bound = t["ethernet_bound"]["fsdp2-offload"]
    assert bound["peer_step_s"] == pytest.approx(9.445) and bound["speedloader_fwd_bwd_s"] == pytest.approx(3.44)
    assert bound["at_most"] == pytest.approx(9.445 / 3.44)
    assert t["ethernet_speedloader_over"]["fsdp2-offload"] <= bound["at_most"]  # measured within its bound
    assert bound["peer_link_share"] == pytest.approx(8.3 / 9.445)  # the peer bound by the link
    assert bound["speedloader_link_share"] == pytest.approx(2.05 / 3.525)
    assert "deepspeed-offload" not in t["ethernet_bound"]  # not run: no bound
    assert "ethernet_eager_speedloader_over_deepspeed" not in t


def test_bench_scale_eager_layer_major_beside_deepspeed():
    """DeepSpeed runs eager: the targets give layer-major's fastest eager variant over DeepSpeed's fastest beside the
    compiled ratio (the protocol's like-for-like pair)."""
    def run(contender, tps):
        return {"contender": contender, "case": "2x1-ethernet", "status": "ok", "tokens_per_s": tps,
                "tokens_per_s_per_gpu": tps / 2}

    results = [run("speedloader:compile:root=device", 150.0), run("speedloader:root=device", 120.0),
               run("speedloader", 110.0), run("deepspeed-offload:16x4", 80.0), run("deepspeed-offload:8x8", 40.0)]
    t = bench_scale.targets(results)
    assert t["ethernet_speedloader_over"]["deepspeed-offload"] == pytest.approx(150 / 80)
    assert t["ethernet_eager_speedloader_over_deepspeed"] == {
        "speedloader": "speedloader:root=device", "deepspeed-offload": "deepspeed-offload:16x4",
        "ratio": pytest.approx(120 / 80), "invocations": None, "separate_invocations": False}


def test_bench_scale_ratios_divide_runs_of_the_same_invocations():
    """Eager layer-major run again beside DeepSpeed by a later command (invocations 3-5 of another start): its ratio
    over DeepSpeed takes both medians over 3-5 only; a pair that never shared the protocol's three invocations is
    flagged, not divided as if it had."""
    def run(contender, tps, invocation):
        return {"contender": contender, "case": "2x1-ethernet", "status": "ok", "tokens_per_s": tps,
                "tokens_per_s_per_gpu": tps / 2, "invocation": invocation}

    results = [run(c, t, i) for i in range(3) for c, t in (("speedloader:compile:root=device", 150.0),
                                                            ("deepspeed-offload:16x4", 80.0))]
    results += [run("speedloader:root=device", 120.0, i) for i in range(6, 9)]  # alone: another start
    results += [run(c, t, i) for i in range(3, 6) for c, t in (("speedloader:root=device", 140.0),
                                                               ("deepspeed-offload:16x4", 90.0))]
    t = bench_scale.targets(results)
    eager = t["ethernet_eager_speedloader_over_deepspeed"]
    assert eager["ratio"] == pytest.approx(140 / 90) and eager["invocations"] == [3, 4, 5]
    assert not eager["separate_invocations"]
    assert t["ethernet_speedloader_over"]["deepspeed-offload"] == pytest.approx(150 / 80)  # invocations 0-2
    assert t["ethernet_pairs"]["deepspeed-offload"]["invocations"] == [0, 1, 2]
    alone = [r for r in results if r["invocation"] not in (3, 4, 5)]
    flagged = bench_scale.targets(alone)["ethernet_eager_speedloader_over_deepspeed"]
    assert flagged["separate_invocations"] and flagged["invocations"] == []


def test_bench_scale_invocations_alternate_and_append(tmp_path):
    """--invocations 2 runs every (contender, case) twice, the order reversed the second time; a later command with
    the same work appends a third invocation to the same record, and one of some contenders only; other settings are
    refused, not merged."""
    fake = tmp_path / "fake_worker.py"
    fake.write_text(FAKE_WORKER)
    base = [sys.executable, str(TOOLS / "bench_scale.py"), "--device", "cpu", "--worker-script", str(fake),
            "--gpus", "", "--ethernet", "2x1", "--contenders", "speedloader,fsdp2-offload", "--threads-per-rank", "1",
            "--out-dir", str(tmp_path / "results"), "--name", "rep", "--budget-s", "240"]

    def bench(*extra):
        return subprocess.run([*base, *extra], cwd=tmp_path, env=clean_env(tmp_path), capture_output=True, text=True,
                              timeout=300)

    proc = bench("--invocations", "2")
    assert proc.returncode == 0, tail(proc.stdout + proc.stderr)
    proc = bench("--invocations", "1", "--budget-s", "200")
    assert proc.returncode == 0, tail(proc.stdout + proc.stderr)
    import json

    record = json.loads((tmp_path / "results" / "rep.json").read_text())
    order = [(r["invocation"], r["contender"]) for r in record["results"]]
    assert order == [(0, "speedloader"), (0, "fsdp2-offload"), (1, "fsdp2-offload"), (1, "speedloader"),
                     (2, "speedloader"), (2, "fsdp2-offload")]
    assert len(record["commands"]) == 2
    assert all(r["status"] == "ok" for r in record["results"]), [(r["status"], r.get("error")) for r in record["results"]]
    assert record["targets"]["repeats"]["speedloader 2x1-ethernet"]["n"] == 3
    proc = bench("--invocations", "1", "--shape", "2x4")
    assert proc.returncode != 0 and "holds another measurement" in proc.stderr and "shape" in proc.stderr
    # one contender in a command of its own (a slow peer that fills a command): appended, the record's list kept
    proc = bench("--invocations", "1", "--contenders", "fsdp2-offload")
    assert proc.returncode == 0, tail(proc.stdout + proc.stderr)
    record = json.loads((tmp_path / "results" / "rep.json").read_text())
    assert record["config"]["contenders"] == "speedloader,fsdp2-offload" and len(record["commands"]) == 3
    assert [(r["invocation"], r["contender"]) for r in record["results"]][6:] == [(3, "fsdp2-offload")]
    assert record["targets"]["repeats"]["fsdp2-offload 2x1-ethernet"]["n"] == 4


@pytest.mark.slow
def test_bench_scale_real_workers_on_cpu(tmp_path):
    """bench_train's real workers under real torchrun on the CPU (gloo), 1 and 2 ranks: ``--device`` reaches the
    workers, and the overlapped optimizer's contender runs at world size 2 as the weak-scaling run asks, its worker
    pinned to each rank's own CPUs (``:affinity``)."""
    cmd = [sys.executable, str(TOOLS / "bench_scale.py"), "--device", "cpu", "--model", "llama_tiny", "--layers", "2",
           "--seq-len", "64", "--shape", "1x2", "--gpus", "1,2", "--ethernet", "", "--contenders",
           "speedloader-overlap:affinity", "--steps", "2", "--warmup", "1", "--threads-per-rank", "1",
           "--out-dir", str(tmp_path / "results"), "--name", "real", "--budget-s", "400"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=clean_env(tmp_path), capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, tail(proc.stdout + proc.stderr)
    import json

    record = json.loads((tmp_path / "results" / "real.json").read_text())
    runs = {r["case"]: r for r in record["results"]}
    assert [runs[c]["status"] for c in ("1gpu", "2gpu")] == ["ok", "ok"], tail(proc.stdout)
    assert [runs[c]["world_size"] for c in ("1gpu", "2gpu")] == [1, 2] and len(runs["2gpu"]["ranks"]) == 2
    assert all(r["contender"] == "speedloader-overlap" for r in runs["2gpu"]["ranks"])
    # ':affinity': each rank's optimizer worker on its own block of the CPUs (less the launching thread's CPU)
    blocks = [r["optimizer_worker_cpus"] for r in runs["2gpu"]["ranks"]]
    assert all(blocks) and (len(os.sched_getaffinity(0)) < 2 or not set(blocks[0]) & set(blocks[1])), blocks
