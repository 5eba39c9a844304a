"""The metric logger's W&B side, with the real wandb library: run names for every kind of run, and
``logger.mode=auto`` logging offline within seconds when the server does not answer."""

import time

import pytest

from fsdp_speedloader.app.config import LoggerConfig, TrainConfig
from fsdp_speedloader.app.logger import WANDB_PROBE_TIMEOUT_S, build_logger, default_run_name, resolve_wandb_mode


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


def test_auto_mode_without_a_key_is_offline(wandb_env):
    assert resolve_wandb_mode("auto") == "offline"
    assert resolve_wandb_mode("disabled") == "disabled"


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
