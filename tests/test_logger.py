"""The metric logger's W&B side, with the real wandb library: run names for every kind of run, and
``logger.mode=auto`` logging offline within seconds when the server does not answer."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fsdp_speedloader.app.config import LoggerConfig, TrainConfig
from fsdp_speedloader.app.logger import WANDB_PROBE_TIMEOUT_S, build_logger, check_wandb_credentials, \
    default_run_name, resolve_wandb_mode


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    for name in ("WANDB_MODE", "WANDB_RUN_ID", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    return monkeypatch


def test_run_names_say_what_ran():
    import dataclasses

    train = dataclasses.asdict(TrainConfig())
    assert default_run_name(train) == "llama_tiny-speedloader-n4xN2"
    train["schedule"]["name"] = "auto"
    assert default_run_name(train) == "llama_tiny-auto"  # n and N are the tuner's, chosen later
    assert default_run_name({"model": {"name": "opt_tiny"}, "max_new_tokens": 8, "num_sub_batches": 4}) == \
        "opt_tiny-generate-N4"
    assert "?" not in default_run_name({"model": {"name": "m"}})
    # a model.path run is named after its checkpoint, not the model group's default name it does not use
    assert default_run_name({"model": {"name": "llama_tiny", "path": "/models/Llama-2-7b-hf/"},
                             "schedule": {"name": "speedloader", "sub_batch_size": 2, "num_sub_batches": 4}}) == \
        "Llama-2-7b-hf-speedloader-n2xN4"


def test_auto_mode_without_a_key_is_offline_and_says_why(wandb_env, tmp_path):
    wandb_env.setenv("NETRC", str(tmp_path / "no_netrc"))
    assert resolve_wandb_mode("auto") == ("offline", "no WANDB_API_KEY")
    assert resolve_wandb_mode("disabled") == ("disabled", "logger.mode=disabled")
    # W&B's own switch is honoured by auto; online without a key cannot be, and says so
    wandb_env.setenv("WANDB_MODE", "disabled")
    assert resolve_wandb_mode("auto") == ("disabled", "WANDB_MODE=disabled")
    wandb_env.setenv("WANDB_MODE", "online")
    assert resolve_wandb_mode("auto") == ("offline", "WANDB_MODE=online without an API key")
    assert resolve_wandb_mode("offline") == ("offline", "logger.mode=offline")  # an explicit mode wins
    # a WANDB_MODE W&B does not take: one line before anything is built (pydantic's error came after the model)
    wandb_env.setenv("WANDB_MODE", "bogus")
    with pytest.raises(ValueError, match=r"^WANDB_MODE=bogus: W&B takes online, offline, disabled, "):
        check_wandb_credentials(LoggerConfig(backend="wandb", mode="auto"))
    check_wandb_credentials(LoggerConfig(backend="none"))  # not read without W&B


def test_auto_mode_with_an_unreachable_server_logs_offline_within_seconds(wandb_env, tmp_path):
    wandb_env.setenv("WANDB_API_KEY", "a" * 40)
    wandb_env.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # the discard port: nothing listens on loopback
    start = time.perf_counter()
    logger = build_logger(LoggerConfig(mode="auto"), {"model": {"name": "m"}}, tmp_path / "run", rank=0)
    try:
        assert logger.wandb_run is not None and logger.wandb_run.settings.mode == "offline"
        logger.log({"loss": 1.0}, step=1)
    finally:
        logger.finish()
    # the probe's timeout plus an offline wandb.init (a local service process), not W&B's 90 s init timeout
    assert time.perf_counter() - start < WANDB_PROBE_TIMEOUT_S + 30


def _wandb_runs(run_dir: Path) -> dict[str, bytes]:
    """The offline W&B run directories under ``run_dir``: {directory name: its transaction log's bytes}."""
    return {d.name: next(d.glob("run-*.wandb")).read_bytes() for d in (run_dir / "wandb").glob("offline-run-*")}


@pytest.mark.slow
def test_a_resumed_job_logs_on_into_its_wandb_run_quietly(tmp_path):
    """The real entry point with the real wandb library (offline): the W&B run id is saved in the checkpoint and a
    resumed run logs on into that run; W&B's run summary is not printed, and a CPU run logs no MFU to W&B."""
    from launch_utils import TINY_OVERRIDES, clean_env, tail

    env = clean_env(tmp_path)
    del env["WANDB_SILENT"]  # what a user sees
    ckpt = tmp_path / "ckpt"

    def train(name: str, *extra: str) -> str:
        cmd = [sys.executable, "-m", "fsdp_speedloader.app.train", *TINY_OVERRIDES, "logger=wandb",
               "logger.mode=offline", "schedule=canonical", f"checkpoint.dir={ckpt}", "checkpoint.every=1",
               f"hydra.run.dir={tmp_path / name}", *extra]
        done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, tail(done.stdout + done.stderr)
        return done.stdout + done.stderr

    first_out = train("first", "steps=2")
    (first_name, first_log), = _wandb_runs(tmp_path / "first").items()
    run_id = first_name.rsplit("-", 1)[1]
    assert torch.load(ckpt / "step_00000002" / "extra_rank0.pt", weights_only=True)["wandb_run_id"] == run_id
    second_out = train("second", "steps=4", "checkpoint.resume=auto")
    (second_name, second_log), = _wandb_runs(tmp_path / "second").items()
    assert second_name.endswith(f"-{run_id}") and second_name != first_name  # W&B's directory per process, one id
    sync = f"`wandb sync {tmp_path / 'second' / 'wandb' / second_name}` uploads it"
    assert f"(id {run_id}, resumed, mode offline: logger.mode=offline; {sync})" in second_out, tail(second_out)
    assert torch.load(ckpt / "step_00000004" / "extra_rank0.pt", weights_only=True)["wandb_run_id"] == run_id
    for out in (first_out, second_out):
        assert "Run summary" not in out and "Run history" not in out, tail(out)
        assert sum(line.startswith("wandb:") for line in out.splitlines()) <= 4, tail(out)
    # History keys in W&B's protobuf log are length-prefixed strings: b"\x04loss" is the key "loss".
    for log_bytes in (first_log, second_log):
        assert b"\x04loss" in log_bytes and b"\x03mfu" not in log_bytes and b"\x03hfu" not in log_bytes
