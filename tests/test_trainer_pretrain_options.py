"""The trainer options a wall-clock pretraining comparison needs (tools/bench_pretrain.py), on the CPU.

- ``time_budget_s``: the loop stops after the first step that ends past the budget, logs that step,
  and saves a final checkpoint only when ``checkpoint.save_final`` asks for one; all ranks stop together.
- ``schedule.gradient_sync=last`` (canonical, FSDP2 accumulation without reduce-scatter until the last
  micro-batch) gives the losses of ``every``.
- ``optim.overlap_with_backward`` (layer-major, per-unit CPU AdamW steps during backward) gives the
  losses and learning rates of one AdamW after backward, and resumes exactly from its checkpoints.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

import fsdp_speedloader.app.trainer as trainer_mod
from dist_utils import run_distributed, tiny_config
from fsdp_speedloader.app.checkpoint import list_checkpoints
from fsdp_speedloader.app.trainer import Trainer


def _losses(history: list[dict]) -> list[float]:
    return [m["loss"] for m in history]


# --- time_budget_s -----------------------------------------------------------------------------


class _Clock:
    """Stands in for the trainer's ``time``: each reading is one second after the previous one."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


@pytest.mark.parametrize("save_final", [False, True])
def test_time_budget_stops_after_the_step_that_crosses_it(tmp_path, monkeypatch, save_final):
    # The loop reads the clock once when it starts and once after each step: step k ends k s in.
    monkeypatch.setattr(trainer_mod, "time", _Clock())
    cfg = tiny_config(tmp_path, steps=100, time_budget_s=3.5, log_every=1000, checkpoint={"save_final": save_final})
    history = Trainer(cfg).train()
    assert [m["step"] for m in history] == [1, 2, 3, 4]  # 3 s < 3.5 s <= 4 s: stops after step 4
    assert [m["elapsed_s"] for m in history] == [1.0, 2.0, 3.0, 4.0]
    assert history[-1]["tokens"] == 4 * 4 * 32

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["elapsed_s"]) for r in records] == [(4, 4.0)]  # logged although log_every=1000

    saved = [step for step, _ in list_checkpoints(tmp_path / "checkpoints")]
    assert saved == ([4] if save_final else [])


def test_time_budget_on_the_real_clock(tmp_path):
    history = Trainer(tiny_config(tmp_path, steps=100_000, time_budget_s=0.5)).train()
    elapsed = [m["elapsed_s"] for m in history]
    assert len(history) < 100_000 and elapsed == sorted(elapsed)
    assert elapsed[-1] >= 0.5 and all(s < 0.5 for s in elapsed[:-1])


def test_no_time_budget_runs_every_step(tmp_path):
    history = Trainer(tiny_config(tmp_path, steps=3)).train()
    assert [m["step"] for m in history] == [1, 2, 3]
    assert all(m["elapsed_s"] > 0 for m in history)


@pytest.mark.parametrize("budget", [0, -1.0])
def test_bad_time_budget_is_named(tmp_path, budget):
    with pytest.raises(ValueError, match="time_budget_s"):
        tiny_config(tmp_path, time_budget_s=budget)


def _any_rank(rank: int, world_size: int) -> list[bool]:
    this = SimpleNamespace(world_size=world_size, device=torch.device("cpu"))
    return [Trainer._any_rank(this, rank == 1, False), Trainer._any_rank(this, False, rank == 0)]


@pytest.mark.slow
def test_ranks_stop_together():
    """One rank past the budget (or signalled) stops every rank (their clocks and signals differ)."""
    assert run_distributed(_any_rank, 2) == [[(1, 0), (0, 1)], [(1, 0), (0, 1)]]  # each flag's max, on every rank


# --- schedule.gradient_sync --------------------------------------------------------------------


@pytest.mark.parametrize("offload", [False, True])
def test_gradient_sync_last_gives_the_same_losses(tmp_path, offload):
    def run(name: str, sync: str) -> list[float]:
        cfg = tiny_config(tmp_path / name, steps=4, offload={"params": offload},
                          schedule={"name": "canonical", "gradient_sync": sync, "num_sub_batches": 3})
        return _losses(Trainer(cfg).train())

    assert run("last", "last") == pytest.approx(run("every", "every"), rel=1e-5)


def test_gradient_sync_is_for_the_canonical_schedule(tmp_path):
    with pytest.raises(ValueError, match=re.escape("schedule.gradient_sync")):
        tiny_config(tmp_path, schedule={"name": "speedloader", "gradient_sync": "last"})


@pytest.mark.parametrize("schedule,message", [
    ({"name": "speedloader"}, "set schedule.keep_activations instead"),
    ({"name": "canonical", "activation_checkpointing": False}, "activation_checkpointing=False"),
    ({"name": "canonical", "activation_checkpointing_every": 0}, "schedule.activation_checkpointing_every"),
])
def test_recompute_every_kth_block_is_for_the_canonical_schedule_with_checkpointing(tmp_path, schedule, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny_config(tmp_path, schedule={"activation_checkpointing_every": 2, **schedule})


# --- optim.overlap_with_backward ---------------------------------------------------------------

OVERLAP = {"schedule": {"name": "speedloader"}, "offload": {"params": True}, "optim": {"grad_clip": 0.0}}


def _overlap_config(out, overlap: bool, **overrides):
    base = {**OVERLAP, "optim": {**OVERLAP["optim"], "overlap_with_backward": overlap}}
    return tiny_config(out, **{"steps": 5, **base, **overrides})


def test_overlapped_optimizer_gives_the_same_losses(tmp_path):
    plain = Trainer(_overlap_config(tmp_path / "plain", False)).train()
    trainer = Trainer(_overlap_config(tmp_path / "overlap", True))
    assert len(trainer.optimizer.optimizers) == 2 + 1  # one AdamW per unit (2 blocks) and the root
    overlapped = trainer.train()
    assert _losses(overlapped) == pytest.approx(_losses(plain), rel=1e-6)
    assert [m["lr"] for m in overlapped] == pytest.approx([m["lr"] for m in plain])


def test_overlapped_optimizer_resumes_exactly(tmp_path):
    checkpoint = {"every": 2, "dir": str(tmp_path / "ckpt"), "save_final": False}
    uninterrupted = Trainer(_overlap_config(tmp_path / "a", True, steps=4)).train()
    Trainer(_overlap_config(tmp_path / "b", True, steps=4, checkpoint=checkpoint)).train(max_steps=2)
    resumed = Trainer(_overlap_config(tmp_path / "c", True, steps=4, checkpoint={**checkpoint, "resume": "auto"}))
    assert resumed.step == 2
    history = resumed.train()
    assert [m["step"] for m in history] == [3, 4]
    for key in ("loss", "lr"):
        assert [m[key] for m in history] == pytest.approx([m[key] for m in uninterrupted[2:]], rel=1e-6), key


@pytest.mark.parametrize("overrides,field_name", [
    ({"schedule": {"name": "canonical"}}, "optim.overlap_with_backward"),
    ({"offload": {"params": False}}, "optim.overlap_with_backward"),
])
def test_overlap_needs_layer_major_and_offload(tmp_path, overrides, field_name):
    with pytest.raises(ValueError, match=re.escape(field_name)):
        _overlap_config(tmp_path, True, **overrides)


def test_overlap_takes_clipping(tmp_path):
    """Global-norm clipping with the overlapped optimizer (exact; tests/test_overlap_clip.py trains with it)."""
    cfg = _overlap_config(tmp_path, True, optim={"grad_clip": 1.0, "overlap_with_backward": True})
    assert (cfg.optim.grad_clip, cfg.optim.overlap_with_backward, cfg.optim.skip_nonfinite) == (1.0, True, True)
