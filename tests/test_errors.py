"""User errors end a run with ONE line, early, and exit code 2: the real entry point, one case each.

Each case is a subprocess of ``python -m fsdp_speedloader.app.train`` (a tiny model on the CPU). The processes
are independent and mostly wait on imports, so the module starts them all at once and each test checks its own:
exactly one ``error:`` line saying what to change, exit code 2, no traceback, and (where the error is about the
setup) no model built. ``FSDP_SPEEDLOADER_TRACEBACK=1`` shows the traceback of a user error too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dist_utils import tiny_config
from launch_utils import TINY_OVERRIDES, clean_env, tail

ARENA = ["schedule=speedloader", "offload=params"]  # the layer-major schedule with the pinned host arena
CHECKPOINT = "step_00000001"


def _cases(root: Path) -> dict[str, tuple[list[str], dict]]:
    """name -> (overrides, environment) of each failing run."""
    ckpt = root / "ckpt"
    return {
        "truncated_checkpoint": ([f"checkpoint.resume={root / 'truncated' / CHECKPOINT}"], {}),
        "wrong_shape_checkpoint": (["model.hidden_size=128", f"checkpoint.resume={ckpt / CHECKPOINT}"], {}),
        "other_family_checkpoint": (["model=opt_tiny", "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4",
                                     "model.intermediate_size=128", "checkpoint.resume=auto",
                                     f"checkpoint.dir={ckpt}"], {}),
        "host_memory_too_low": (ARENA, {"FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB": "0.001"}),
        "host_memory_not_a_number": (ARENA, {"FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB": "abc"}),
        "cpu_host_memory_too_low": ([], {"FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB": "0.001"}),
        "unwritable_run_dir": ([f"hydra.run.dir={root / 'a_file' / 'run'}"], {}),
        "unwritable_checkpoint_dir": ([f"checkpoint.dir={root / 'a_file' / 'ckpt'}"], {}),
        "wandb_online_without_key": (["logger=wandb", "logger.mode=online"],
                                     {"HOME": str(root / "home"), "NETRC": str(root / "home" / ".netrc")}),
        "traceback_flag": ([f"checkpoint.dir={root / 'a_file' / 'ckpt'}"], {"FSDP_SPEEDLOADER_TRACEBACK": "1"}),
        "device_units_without_offload": (["offload.device_units=1"], {}),
        "blocks_per_unit_over_the_layers": (["schedule.blocks_per_unit=3"], {}),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    from fsdp_speedloader.app.trainer import Trainer

    root = tmp_path_factory.mktemp("errors")
    (root / "a_file").write_text("a file where a directory is needed")
    (root / "home").mkdir()
    # A real checkpoint of the tiny model (width 64), and a copy with its shard file cut short.
    Trainer(tiny_config(root / "saver", steps=1, checkpoint={"save_final": True, "dir": str(root / "ckpt")})).train()
    truncated = shutil.copytree(root / "ckpt" / CHECKPOINT, root / "truncated" / CHECKPOINT)
    shard = next(truncated.glob("*.distcp"))
    os.truncate(shard, shard.stat().st_size // 3)

    procs = {}
    for name, (overrides, env) in _cases(root).items():
        cwd = root / name
        cwd.mkdir()
        cmd = [sys.executable, "-m", "fsdp_speedloader.app.train", *TINY_OVERRIDES, "steps=2", *overrides]
        procs[name] = subprocess.Popen(cmd, cwd=cwd, env=clean_env(cwd, **env), stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    done = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    done["root"] = root
    return done


def _one_error_line(run: subprocess.CompletedProcess) -> str:
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 2, tail(run.stdout + run.stderr)
    assert len(errors) == 1, tail(run.stderr)
    assert "Traceback" not in run.stderr + run.stdout, tail(run.stderr)
    return errors[0]


def _model_not_built(run: subprocess.CompletedProcess) -> None:
    assert "building the model" not in run.stdout, tail(run.stdout)


def test_truncated_checkpoint(runs):
    line = _one_error_line(runs["truncated_checkpoint"])
    path = runs["root"] / "truncated" / CHECKPOINT
    assert line.startswith(f"error: checkpoint.resume: '{path}' is not a complete checkpoint: __0_0.distcp is "
                           "truncated ("), line
    _model_not_built(runs["truncated_checkpoint"])


def test_wrong_shape_checkpoint(runs):
    line = _one_error_line(runs["wrong_shape_checkpoint"])
    path = runs["root"] / "ckpt" / CHECKPOINT
    assert line.startswith(f"error: checkpoint '{path}' does not fit this model: model.embed_tokens.weight is "
                           "(320, 64) in the checkpoint but (320, 128) in the model"), line
    # the fix names the settings that wrote the checkpoint (its model_config.json) where this run's differ
    assert "resume with the model settings that wrote it (model.hidden_size=64), or start fresh" in line, line
    _model_not_built(runs["wrong_shape_checkpoint"])


def test_the_error_line_is_in_the_run_log_too(runs):
    """A run that fails at setup leaves its run directory: its train.log says why, as stderr did."""
    run_dir, = (runs["root"] / "wrong_shape_checkpoint").glob("outputs/*/*")
    log = (run_dir / "train.log").read_text()
    assert _one_error_line(runs["wrong_shape_checkpoint"]) in log and "[ERROR]" in log, log


def test_checkpoint_of_another_family(runs):
    line = _one_error_line(runs["other_family_checkpoint"])
    path = runs["root"] / "ckpt" / CHECKPOINT
    assert line.startswith(f"error: checkpoint '{path}' does not fit this model: the model's "
                           "model.decoder.embed_tokens.weight is not in the checkpoint"), line


def test_host_memory_limit_too_low(runs):
    """Checked from the sharded meta model's plan, before the shards take host memory (not at step 1)."""
    run = runs["host_memory_too_low"]
    line = _one_error_line(run)
    assert line.startswith("error: the pinned host arena needs ") and "lower schedule.num_sub_batches" in line, line
    assert "FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB" in line and "step 1" not in run.stdout


def test_model_states_over_the_host_memory_on_the_cpu(runs):
    """On the CPU every model state is in host memory: checked before the shards are materialised."""
    run = runs["cpu_host_memory_too_low"]
    line = _one_error_line(run)
    assert line.startswith("error: training on the CPU keeps every model state in host memory: "), line
    assert "optim.state_dtype=int8 frees" in line and "FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB" in line, line
    assert "step 1" not in run.stdout


def test_host_memory_limit_not_a_number(runs):
    line = _one_error_line(runs["host_memory_not_a_number"])
    assert line == ("error: FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB='abc' is not a number of GiB > 0; set it to the "
                    "host memory this machine may use (e.g. FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB=64) or unset it "
                    "(the limit is then detected)")
    _model_not_built(runs["host_memory_not_a_number"])


def test_unwritable_run_dir(runs):
    run = runs["unwritable_run_dir"]
    line = _one_error_line(run)
    a_file = runs["root"] / "a_file"
    assert line == (f"error: hydra.run.dir: cannot write to '{a_file / 'run'}': '{a_file}' is a file, not a "
                    "directory; set hydra.run.dir to a directory you can write to")
    assert "setting up" not in run.stdout  # found before Hydra (which would create the directory) ran


def test_unwritable_checkpoint_dir(runs):
    line = _one_error_line(runs["unwritable_checkpoint_dir"])
    a_file = runs["root"] / "a_file"
    assert line == (f"error: checkpoint.dir: cannot write to '{a_file / 'ckpt'}': '{a_file}' is a file, not a "
                    "directory; set checkpoint.dir to a directory you can write to")
    _model_not_built(runs["unwritable_checkpoint_dir"])


def test_wandb_online_without_api_key(runs):
    line = _one_error_line(runs["wandb_online_without_key"])
    assert line == ("error: logger.mode=online: no W&B API key (WANDB_API_KEY is not set and no netrc login for "
                    "api.wandb.ai); set WANDB_API_KEY (or run `wandb login`), or use logger.mode=offline or "
                    "logger.mode=auto")
    _model_not_built(runs["wandb_online_without_key"])


def test_traceback_flag_shows_the_traceback_of_a_user_error(runs):
    run = runs["traceback_flag"]
    assert run.returncode == 2 and "Traceback (most recent call last)" in run.stderr, tail(run.stderr)
    assert [line for line in run.stderr.splitlines() if line.startswith("error:")] == \
        [_one_error_line(runs["unwritable_checkpoint_dir"])]


# --- in-process: the pieces behind the lines ------------------------------------------------------------------


def test_host_arena_error_at_the_first_step_is_a_user_error(tmp_path, monkeypatch):
    """Where the early plan check passes but the arena's own (exact) check fails at step 1, the error is a
    ``UserError``: the entry point prints it in one line as well."""
    import fsdp_speedloader.app.trainer as trainer_mod
    from fsdp_speedloader.app.launch import UserError

    monkeypatch.setattr(trainer_mod, "check_host_memory_plan", lambda *a, **k: None)
    trainer = trainer_mod.Trainer(tiny_config(tmp_path, schedule={"name": "speedloader"}, offload={"params": True}))
    monkeypatch.setenv("FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB", "0.001")
    with pytest.raises(UserError, match="the pinned host arena needs"):
        trainer.train()


def test_device_units_without_offloaded_parameters(runs):
    line = _one_error_line(runs["device_units_without_offload"])
    assert "offload.device_units" in line and "offload=params" in line, line
    _model_not_built(runs["device_units_without_offload"])


def test_more_blocks_per_unit_than_the_model_has(runs):
    line = _one_error_line(runs["blocks_per_unit_over_the_layers"])
    assert line == ("error: schedule.blocks_per_unit=3: the model has 2 blocks (layers); set at most 2 (one unit of "
                    "every block)"), line


def test_run_dir_named_on_the_command_line():
    from fsdp_speedloader.app.launch import _run_dir_override

    assert _run_dir_override(["steps=3"]) == ("hydra.run.dir", "outputs")
    assert _run_dir_override(["hydra.run.dir=/x/y", "steps=3"]) == ("hydra.run.dir", "/x/y")
    assert _run_dir_override(["-m", "hydra.sweep.dir=/s", "hydra.run.dir=/x"]) == ("hydra.sweep.dir", "/s")
    assert _run_dir_override(["--multirun"]) == ("hydra.sweep.dir", "multirun")
