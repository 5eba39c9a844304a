"""tools/bench_pretrain.py end to end on the CPU: both contenders train through the Hydra entry point
for the same few seconds, and the record, the plot and the two offline W&B runs (one group) exist.

Same data for both is checked through the losses: both start from the same seeded weights and read
the same batches, and the losses of every step both ran agree (fp32 on the CPU; step 1's loss is
computed before any update, so it depends on nothing but the initial weights and the first batch).
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "bench_pretrain.py"
TINY = ["--device", "cpu", "--model", "llama_tiny", "--layers", "2", "--seq-len", "32", "--sub-batch-size", "2",
        "--num-sub-batches", "2", "--override", "model.hidden_size=64", "--override", "model.intermediate_size=128"]


def _load_tool():
    spec = importlib.util.spec_from_file_location("bench_pretrain", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load_tool()


# --- the contenders' configurations (no training) ----------------------------------------------


def _without(overrides: list[str], *keys: str) -> set[str]:
    return {o for o in overrides if o.split("=", 1)[0] not in keys}


def test_contenders_differ_only_in_schedule(tmp_path):
    args = bench.parse_args([*TINY, "--minutes", "1"])
    a = bench.contender_overrides(args, "speedloader", tmp_path / "a")
    b = bench.contender_overrides(args, "fsdp2-offload", tmp_path / "b")
    schedule_keys = ("schedule", "schedule.sub_batch_size", "schedule.num_sub_batches",
                     "schedule.activation_checkpointing", "schedule.gradient_sync", "optim.overlap_with_backward",
                     "logger.name", "hydra.run.dir")
    assert _without(a, *schedule_keys) == _without(b, *schedule_keys)
    assert {"schedule=speedloader", "optim.overlap_with_backward=true", "offload=params", "time_budget_s=60",
            "data=default", "optim.grad_clip=0", f"logger.group={args.name}"} <= set(a)
    assert {"schedule=canonical", "schedule.gradient_sync=last", "schedule.sub_batch_size=2",
            "schedule.num_sub_batches=2", "offload=params"} <= set(b)


def test_fsdp2_micro_batch_keeps_the_effective_batch(tmp_path):
    args = bench.parse_args([*TINY, "--fsdp2-sub-batch-size", "1"])
    b = bench.contender_overrides(args, "fsdp2-offload", tmp_path)
    assert {"schedule.sub_batch_size=1", "schedule.num_sub_batches=4"} <= set(b)


def test_a_contender_may_clip_and_step_after_backward(tmp_path):
    """One invocation compares the overlapped optimizer unclipped, clipped, and the plain clip-then-step."""
    specs = ["speedloader", "speedloader:clip=1e9", "speedloader:clip=1e-6:overlap=false", "fsdp2-offload:clip=1"]
    args = bench.parse_args([*TINY, "--contenders", *specs])
    overrides = [set(bench.contender_overrides(args, spec, tmp_path / bench.run_dir_name(spec))) for spec in specs]
    assert {"optim.grad_clip=0", "optim.overlap_with_backward=true"} <= overrides[0]
    assert {"optim.grad_clip=1e+09", "optim.overlap_with_backward=true"} <= overrides[1]
    assert {"optim.grad_clip=1e-06", "optim.overlap_with_backward=false"} <= overrides[2]
    assert {"optim.grad_clip=1", "schedule=canonical"} <= overrides[3]
    assert bench.run_dir_name(specs[2]) == "speedloader_clip-1e-6_overlap-false"


@pytest.mark.parametrize("extra,message", [
    (["--fsdp2-sub-batch-size", "3"], "does not divide"),
    (["--contenders", "speedloader:clip=-1"], "':clip=X'"),
    (["--contenders", "fsdp2-offload:overlap=false"], "':overlap=true|false'"),
    (["--contenders", "deepspeed"], "the names are"),
    (["--max-gpu-memory-gib", "40"], "--max-gpu-memory-gib"),
])
def test_bad_arguments_are_refused(capsys, extra, message):
    with pytest.raises(SystemExit):
        bench.parse_args([*TINY, *extra])
    assert message in capsys.readouterr().err


# --- end to end --------------------------------------------------------------------------------


def _wandb_records(path: Path):
    """The records of an offline W&B run file (a LevelDB-style log of protobuf ``Record`` messages)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} does not look like a W&B run file; its format changed?"
    block, pos, pending = 32 * 1024, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block trailer too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:  # zero padding
            continue
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL/FIRST start a record, MIDDLE/LAST extend it
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _wandb_run(run_dir: Path) -> tuple:
    """(group, display name, logged losses by step) of the one offline W&B run in ``run_dir``."""
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    group = name = None
    losses = {}
    for record in _wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            group, name = record.run.run_group, record.run.display_name
        elif kind == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            losses[items["_step"]] = items["loss"]
    return group, name, losses


@pytest.mark.slow
def test_bench_pretrain_end_to_end(tmp_path):
    budget_s = 3.0
    env = dict(os.environ, FSL_COMMIT="test-commit")
    proc = subprocess.run([sys.executable, str(TOOL), *TINY, "--minutes", str(budget_s / 60), "--name", "tiny",
                           "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    record = json.loads((tmp_path / "tiny.json").read_text())
    assert record["commit"] == "test-commit" and record["device"].startswith("cpu")
    assert record["torch"] and "bench_pretrain.py" in record["command"] and record["timed"]
    assert record["config"]["effective_batch"] == 4 and record["config"]["data"]["source"] == "default"
    assert list(record["contenders"]) == ["speedloader", "fsdp2-offload"]
    for name, r in record["contenders"].items():
        assert r["status"] == "ok", r
        curve = r["curve"]
        assert curve["step"] == list(range(1, r["steps"] + 1))
        assert curve["tokens"] == [step * 4 * 32 for step in curve["step"]] and r["tokens"] == curve["tokens"][-1]
        # Stopped by the budget, after the first step past it.
        assert curve["elapsed_s"][-1] >= budget_s and all(s < budget_s for s in curve["elapsed_s"][:-1])
        assert r["final_loss"] == curve["loss"][-1] and r["min_loss"] == min(curve["loss"])

        run_dir = tmp_path / r["run_dir"]
        group, run_name, wandb_losses = _wandb_run(run_dir)
        assert (group, run_name) == ("tiny", f"tiny-{name}")
        assert wandb_losses == pytest.approx(dict(zip(curve["step"], curve["loss"])))

    # The same model, data, seed, effective batch and optimizer; only the schedule differs.
    configs = {name: yaml.safe_load((tmp_path / r["run_dir"] / ".hydra" / "config.yaml").read_text())
               for name, r in record["contenders"].items()}
    a, b = configs["speedloader"], configs["fsdp2-offload"]
    for key in ("model", "data", "seed", "offload", "time_budget_s"):
        assert a[key] == b[key], key
    assert {**a["optim"], "overlap_with_backward": None} == {**b["optim"], "overlap_with_backward": None}
    assert (a["schedule"]["name"], a["optim"]["overlap_with_backward"]) == ("speedloader", True)
    assert (b["schedule"]["name"], b["schedule"]["gradient_sync"]) == ("canonical", "last")
    assert a["offload"]["params"]

    comparison = record["comparison"]
    assert comparison["first_step_loss_rel_diff"] < 1e-5
    assert comparison["max_loss_rel_diff_common_steps"] < 1e-4
    assert comparison["tokens_ratio"] == pytest.approx(record["contenders"]["speedloader"]["tokens"]
                                                       / record["contenders"]["fsdp2-offload"]["tokens"])

    png = tmp_path / record["plot"]
    assert png.name == "tiny.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
