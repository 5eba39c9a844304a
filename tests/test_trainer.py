"""The training loop on the CPU: both schedules train, runs are deterministic, user errors fail early.

The speedloader tests need ``fsdp_speedloader.engine.speedloader.apply_speedloader``: without it they FAIL
(an import error), they never skip.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch

import fsdp_speedloader.app.trainer as trainer_mod
from dist_utils import tiny_config
from fsdp_speedloader.app.config import OptimConfig
from fsdp_speedloader.app.logger import MetricLogger, build_logger
from fsdp_speedloader.app.metrics import StepMetrics, host_rss_gib
from fsdp_speedloader.app.optim import build_lr_scheduler, build_optimizer, lr_factor
from fsdp_speedloader.app.runtime import gpu_memory_fraction
from fsdp_speedloader.app.trainer import IGNORE_INDEX, Trainer, num_label_tokens

SCHEDULES = ["canonical", "speedloader"]


def _losses(history: list[dict]) -> list[float]:
    return [m["loss"] for m in history]


def _no_model_build(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the model was built although the config is invalid")

    monkeypatch.setattr(trainer_mod, "build_model", fail)


# --- training runs -----------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_loss_falls(tmp_path, schedule):
    cfg = tiny_config(tmp_path, schedule={"name": schedule}, steps=8, log_every=4)
    history = Trainer(cfg).train()
    losses = _losses(history)
    assert [m["step"] for m in history] == list(range(1, 9))
    assert all(math.isfinite(x) for x in losses)
    assert losses[0] > 5.0  # about ln(320) at initialisation
    assert sum(losses[-2:]) / 2 < losses[0] - 1.0, losses

    last = history[-1]
    tokens_per_step = 4 * 32
    assert last["tokens"] == 8 * tokens_per_step
    assert last["tokens_per_s"] == pytest.approx(tokens_per_step / last["step_time_s"])
    assert last["mfu"] == pytest.approx(last["tokens_per_s"] * last["flops_per_token"] / 989e12)
    # Both schedules recompute the blocks here (canonical: activation_checkpointing defaults to on).
    assert last["hfu"] > last["mfu"] > 0
    assert "peak_gpu_mem_allocated_gib" not in last and last["host_rss_gib"] > 0  # no GPU, no GPU figures
    assert 0 < last["lr"] <= cfg.optim.lr and last["grad_norm"] > 0

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [4, 8]  # log_every=4
    assert records[-1]["loss"] == pytest.approx(losses[-1])


def test_speedloader_matches_canonical(tmp_path):
    """Same seed, same data: layer-major and gradient accumulation give the same losses."""
    a = _losses(Trainer(tiny_config(tmp_path / "a", schedule={"name": "canonical"})).train())
    b = _losses(Trainer(tiny_config(tmp_path / "b", schedule={"name": "speedloader"})).train())
    assert b == pytest.approx(a, rel=1e-4)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_units_kept_on_the_device_train_like_all_offloaded(tmp_path, schedule):
    """offload.device_units: a training run (overlapped optimizer for layer-major, clipping on) gives the losses of
    the run with every unit offloaded, bit for bit (on the CPU both keep the states in the same memory: what differs
    is each unit's FSDP offload policy and which thread steps it)."""
    overlap = {"overlap_with_backward": schedule == "speedloader", "grad_clip": 1.0}
    runs = []
    for k in (0, 2):
        trainer = Trainer(tiny_config(tmp_path / str(k), steps=3, schedule={"name": schedule},
                                      offload={"params": True, "device_units": k}, optim=overlap))
        blocks = trainer.model.model.layers
        policies = [type(b._get_fsdp_state()._fsdp_param_group.offload_policy).__name__ for b in blocks]
        assert policies == ["OffloadPolicy"] * k + ["CPUOffloadPolicy"] * (len(blocks) - k), policies
        runs.append(_losses(trainer.train()))
    assert runs[0] == runs[1]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_compiled_blocks_give_the_eager_losses(tmp_path, schedule):
    """schedule.compile_blocks: one compiled block forward (inductor on the CPU) trains like eager, with no
    graph break and graphs shared by every block (forward, and forward with grad for the recompute)."""
    from torch._dynamo.utils import counters

    eager = _losses(Trainer(tiny_config(tmp_path / "a", steps=3, schedule={"name": schedule})).train())
    torch._dynamo.reset()
    counters.clear()
    compiled = _losses(Trainer(tiny_config(tmp_path / "b", steps=3, schedule={"name": schedule,
                                                                             "compile_blocks": True})).train())
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert 1 <= counters["stats"]["unique_graphs"] <= 3, dict(counters["stats"])  # not one per block


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_deterministic(tmp_path, schedule):
    a = _losses(Trainer(tiny_config(tmp_path / "a", schedule={"name": schedule})).train())
    b = _losses(Trainer(tiny_config(tmp_path / "b", schedule={"name": schedule})).train())
    assert a == b
    c = _losses(Trainer(tiny_config(tmp_path / "c", schedule={"name": schedule}, seed=1)).train())
    assert c != a  # the seed does reach the weights


def test_canonical_loss_is_effective_batch_mean_with_ignored_labels(tmp_path):
    """Micro-batches with different label counts: summed losses equal the whole batch's mean loss."""
    trainer = Trainer(tiny_config(tmp_path, schedule={"name": "canonical", "num_sub_batches": 2,
                                                      "sub_batch_size": 2, "activation_checkpointing": False}))
    batch = trainer.loader.next_batch()
    ids, labels = batch["input_ids"], batch["labels"].clone()
    labels[:2, :20] = -100  # first micro-batch keeps far fewer label tokens than the second
    labels[3, 25:] = -100
    with torch.no_grad():
        reference = trainer.model(input_ids=ids, labels=labels, use_cache=False).loss
    loss = trainer._forward_backward(ids, labels, num_label_tokens(labels))
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    # An unweighted mean of the two micro-batch means would differ noticeably.
    with torch.no_grad():
        halves = [trainer.model(input_ids=ids[i : i + 2], labels=labels[i : i + 2], use_cache=False).loss
                  for i in (0, 2)]
    assert abs(sum(halves).item() / 2 - reference.item()) > 1e-3


@pytest.mark.parametrize("checkpointing", [False, True])
def test_canonical_activation_checkpointing_recomputes(tmp_path, checkpointing):
    trainer = Trainer(tiny_config(tmp_path, steps=1, schedule={"name": "canonical",
                                                               "activation_checkpointing": checkpointing}))
    calls = []
    trainer.adapter.blocks[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    trainer.train()
    assert len(calls) == 2 * (2 if checkpointing else 1)  # 2 micro-batches, forward (+ recompute)


def test_canonical_recomputes_every_kth_block_only_and_trains_the_same(tmp_path):
    """schedule.activation_checkpointing_every=2: blocks 2, 4, ... recompute, the others keep their activations; the
    losses are those of no recompute at all (fp32 on the CPU: recompute is exact)."""
    def run(path, **schedule):
        trainer = Trainer(tiny_config(path, steps=3, schedule={"name": "canonical", **schedule}))
        calls = [[] for _ in trainer.adapter.blocks]
        for i, block in enumerate(trainer.adapter.blocks):
            block.mlp.register_forward_pre_hook(lambda *_, i=i: calls[i].append(1))
        return _losses(trainer.train()), [len(c) for c in calls], trainer

    every2, calls, trainer = run(tmp_path / "a", activation_checkpointing_every=2)
    assert len(calls) >= 2
    assert calls == [3 * 2 * (2 if i % 2 == 0 else 1) for i in range(1, len(calls) + 1)]  # 3 steps x 2 micro-batches
    none, _, plain = run(tmp_path / "b", activation_checkpointing=False)
    assert every2 == pytest.approx(none, rel=1e-6)
    full_hfu = Trainer(tiny_config(tmp_path / "c", steps=1, schedule={"name": "canonical"}))
    recompute = full_hfu.metrics.hardware_flops_per_token - plain.metrics.hardware_flops_per_token
    assert trainer.metrics.hardware_flops_per_token - plain.metrics.hardware_flops_per_token == pytest.approx(
        recompute * (len(calls) // 2) / len(calls))  # HFU counts the recomputed blocks only


def test_grad_clip_off_reports_no_norm(tmp_path):
    history = Trainer(tiny_config(tmp_path, schedule={"name": "canonical"}, steps=1,
                                  optim={"grad_clip": 0.0})).train()
    assert math.isnan(history[0]["grad_norm"])


# --- errors before anything is built -----------------------------------------------------------


def test_missing_data_path_fails_before_model_build(tmp_path, monkeypatch):
    _no_model_build(monkeypatch)
    cfg = tiny_config(tmp_path, data={"source": "text", "path": str(tmp_path / "missing.txt")})
    with pytest.raises(ValueError, match="data.path"):
        Trainer(cfg)


def test_missing_resume_path_fails_before_model_build(tmp_path, monkeypatch):
    _no_model_build(monkeypatch)
    cfg = tiny_config(tmp_path, checkpoint={"resume": str(tmp_path / "nowhere" / "step_00000003")})
    with pytest.raises(ValueError, match="checkpoint.resume"):
        Trainer(cfg)


def test_a_fused_host_kernel_that_cannot_build_fails_before_model_build(tmp_path, monkeypatch):
    """optim.host_kernel=fused where the kernel cannot be built ($CXX names no compiler, an empty extension cache):
    refused at setup, naming the key, before the model is built."""
    from fsdp_speedloader.memory import adamw_chunk

    _no_model_build(monkeypatch)
    monkeypatch.setattr(adamw_chunk, "_built", None)
    monkeypatch.setenv("CXX", str(tmp_path / "no-compiler"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    cfg = tiny_config(tmp_path, optim={"state_dtype": "int8", "host_kernel": "fused"})
    with pytest.raises(ValueError, match="optim.host_kernel=fused: the fused C.. AdamW kernel could not be built"):
        Trainer(cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_gpu_fails(tmp_path, monkeypatch):
    _no_model_build(monkeypatch)
    with pytest.raises(ValueError, match="device"):
        Trainer(tiny_config(tmp_path, device="cuda"))


# --- GPU memory cap ----------------------------------------------------------------------------


def test_gpu_memory_fraction():
    assert gpu_memory_fraction(20.0, 80 * 2**30) == pytest.approx(0.25)
    assert gpu_memory_fraction(80.0, 80 * 2**30) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="max_gpu_memory_gib.*more than this GPU"):
        gpu_memory_fraction(81.0, 80 * 2**30)


def test_gpu_memory_cap_on_cpu_fails_before_model_build(tmp_path, monkeypatch):
    _no_model_build(monkeypatch)
    with pytest.raises(ValueError, match="max_gpu_memory_gib"):
        Trainer(tiny_config(tmp_path, max_gpu_memory_gib=1.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_memory_cap_applies(tmp_path):
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    with pytest.raises(ValueError, match="max_gpu_memory_gib"):
        trainer_mod.maybe_cap_gpu_memory(total + 1.0, torch.device("cuda", 0))
    trainer_mod.maybe_cap_gpu_memory(1.0, torch.device("cuda", 0))
    try:
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)


def test_running_out_of_gpu_memory_with_kept_pairs_says_what_to_change(tmp_path, monkeypatch):
    """A hand-set schedule.keep_activations that the GPU cannot hold: the allocator's error comes back as a user
    error (one line, exit code 2) naming the setting, how many pairs were held when it ran out, and what to set;
    it keeps 'out of memory' (sweeps classify the point by it). Here unit 2's second sub-batch runs out, after
    3 of the 4 pairs were kept. Without kept pairs the allocator's error is left as it is."""
    from fsdp_speedloader.app.launch import UserError
    from fsdp_speedloader.engine.chain import Unit

    original, runs = Unit.forward, []

    def forward(self, *args, **kwargs):
        runs.append(self.index)
        if len(runs) == 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Unit, "forward", forward)
    trainer = Trainer(tiny_config(tmp_path / "kept", schedule={"name": "speedloader", "keep_activations": 4}))
    with pytest.raises(UserError) as raised:
        trainer.train()
    message = str(raised.value)
    assert "schedule.keep_activations=4: 3 kept (unit, sub-batch) pairs" in message
    assert "set schedule.keep_activations below 3" in message and "schedule=auto" in message
    assert "out of memory. Tried to allocate 2.00 GiB." in message and "\n" not in message
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)

    runs.clear()
    plain = Trainer(tiny_config(tmp_path / "plain", schedule={"name": "speedloader"}))
    with pytest.raises(torch.OutOfMemoryError):
        plain.train()


# --- optimizer, LR schedule, metrics, logger ---------------------------------------------------


def test_lr_schedule():
    kw = dict(warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert [lr_factor(s, schedule="cosine", **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, schedule="cosine", **kw) == pytest.approx(1.0)
    assert lr_factor(9, schedule="cosine", **kw) == pytest.approx(0.55)
    assert lr_factor(14, schedule="cosine", **kw) == pytest.approx(0.1)
    assert lr_factor(9, schedule="linear", **kw) == pytest.approx(0.55)
    assert lr_factor(13, schedule="linear", **kw) == pytest.approx(1 - 0.9 * 0.9)
    assert lr_factor(13, schedule="constant", **kw) == 1.0
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(model, OptimConfig(lr=1.0, warmup_steps=4))
    scheduler = build_lr_scheduler(optimizer, OptimConfig(lr=1.0, warmup_steps=4), 14)
    seen = []
    for _ in range(5):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])


def test_weight_decay_only_on_matrices():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = build_optimizer(model, OptimConfig(weight_decay=0.1))
    decay = {g["weight_decay"]: [tuple(p.shape) for p in g["params"]] for g in optimizer.param_groups}
    assert decay == {0.1: [(4, 4)], 0.0: [(4,), (4,), (4,)]}


def test_num_label_tokens_shifts_like_hugging_face():
    labels = torch.tensor([[-100, 1, 2, -100], [5, 6, 7, 8]])
    assert num_label_tokens(labels) == 2 + 3  # position 0 is never a target


def test_step_metrics_formulas():
    m = StepMetrics(device=torch.device("cpu"), world_size=4, tokens_per_step_per_device=1000,
                    flops_per_token=6e9, recompute_flops_per_token=2e9, peak_tflops=1.0,
                    attention_flops_per_token=1.5e9)
    m.start_step()
    m.mark_data_ready()
    out = m.end_step(loss=2.0, lr=1e-3, grad_norm=None)
    per_device = 1000 / out["step_time_s"]
    assert out["tokens_per_s_per_device"] == pytest.approx(per_device)
    assert out["tokens_per_s"] == pytest.approx(4 * per_device)
    assert out["mfu"] == pytest.approx(per_device * 6e9 / 1e12)
    assert out["hfu"] == pytest.approx(per_device * 8e9 / 1e12)
    assert out["mfu_no_attention"] == pytest.approx(per_device * 4.5e9 / 1e12)
    assert 0 <= out["data_wait_s"] <= out["step_time_s"]
    assert math.isnan(out["grad_norm"])
    assert 0 < host_rss_gib() < 1024


def test_attention_flops_of_llama2_7b_by_hand():
    """12 L h s at seq 4096 for LLaMA-2-7B (32 layers, 32 heads x 128): 12 x 32 x 4096 x 4096 = 6.44e9, and
    flops_per_token = 6 x (non-embedding parameters) + that."""
    from fsdp_speedloader.models import ModelConfig, build_model, get_adapter

    adapter = get_adapter(build_model(ModelConfig(name="llama2_7b", hidden_size=4096, num_layers=32, num_heads=32,
                                                  intermediate_size=11008, vocab_size=32000,
                                                  max_position_embeddings=4096), device="meta"))
    assert adapter.attention_flops_per_token(4096) == 12 * 32 * 4096 * 4096 == 6_442_450_944
    assert adapter.flops_per_token(4096) == 6 * adapter.num_non_embedding_params() + 6_442_450_944


def test_logger_rank0_writes_jsonl_other_ranks_nothing(tmp_path):
    cfg = tiny_config(tmp_path).logger
    quiet = build_logger(cfg, {}, tmp_path / "r1", rank=1)
    assert type(quiet) is MetricLogger
    quiet.log({"loss": 1.0}, step=1)
    assert not (tmp_path / "r1").exists()
    logger = build_logger(cfg, {}, tmp_path / "r0", rank=0)
    logger.log({"loss": 1.5, "grad_norm": float("nan")}, step=3)
    logger.finish()
    record = json.loads((tmp_path / "r0" / "metrics.jsonl").read_text())
    assert record == {"step": 3, "loss": 1.5, "grad_norm": None}


def test_speedloader_logs_exchange_and_arena_figures(tmp_path):
    """With the host activation store, each step's metrics carry the exchange's copy bytes and the
    arena's page-locked bytes: 2 units x N sub-batches x (n, s, h) activations go out and come back."""
    from dist_utils import tiny_config
    from fsdp_speedloader.app.trainer import Trainer

    cfg = tiny_config(tmp_path, steps=2, schedule={"name": "speedloader", "activation_store": "host"})
    history = Trainer(cfg).train()
    last = history[-1]
    act_bytes = cfg.schedule.batch_size * cfg.data.seq_len * cfg.model.hidden_size * 4  # fp32 on the CPU
    assert last["exchange_d2h_bytes"] >= cfg.model.num_layers * act_bytes  # every unit's outputs stored
    assert last["exchange_h2d_bytes"] >= cfg.model.num_layers * act_bytes
    assert last["arena_requested_bytes"] == last["arena_bytes"] > 0  # exact size (page-locked only with CUDA)


# --- what a person sees: the console line, the status lines, the progress bar ------------------------------


def test_cpu_run_prints_no_gpu_fields(tmp_path, caplog):
    """The console line of a CPU run has no MFU (peak_tflops is an accelerator's) and no GPU memory (there is none);
    metrics.jsonl keeps MFU for the tools. The first status line comes before the model is built."""
    from fsdp_speedloader.app.logger import format_metrics

    caplog.set_level("INFO")
    Trainer(tiny_config(tmp_path, steps=2, logger={"backend": "none"})).train()
    messages = [r.getMessage() for r in caplog.records]
    steps = [m for m in messages if m.startswith("step ")]
    assert len(steps) == 2 and all("loss" in m and "tok/s" in m for m in steps), messages
    assert not any("mfu" in m or "gpu" in m for m in steps), steps
    status = [k for k, m in enumerate(messages) if m.startswith("setting up:")]
    build = [k for k, m in enumerate(messages) if m.startswith("building the model")]
    assert status and build and status[0] < build[0] < messages.index(steps[0])
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["mfu"] > 0 and "peak_gpu_mem_allocated_gib" not in record
    gpu_record = {"loss": 2.0, "mfu": 0.41, "peak_gpu_mem_allocated_gib": 3.0, "peak_gpu_mem_reserved_gib": 4.0,
                  "gpu_alloc_retries": 0}
    assert "mfu 41.0%" in format_metrics(gpu_record, 1) and "gpu 3.00/4.00 GiB" in format_metrics(gpu_record, 1)
    assert "retries" not in format_metrics(gpu_record, 1)
    assert "gpu 3.00/4.00 GiB | 3 allocator retries" in format_metrics({**gpu_record, "gpu_alloc_retries": 3}, 1)


def test_a_sequence_longer_than_model_paths_positions_is_refused_at_setup(tmp_path):
    # model.path's positions are in its config.json, read at setup: the engine's error came at step 1, a traceback
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 vocab_size=320, max_position_embeddings=16)).save_pretrained(tmp_path / "hf")
    cfg = tiny_config(tmp_path / "run", steps=1, logger={"backend": "none"}, model={"path": str(tmp_path / "hf")})
    with pytest.raises(ValueError, match=r"^data\.seq_len: 32 exceeds the 16 positions of model\.path="):
        Trainer(cfg)


def test_a_model_path_run_logs_its_checkpoint_s_config_not_the_group_s_shapes(tmp_path, monkeypatch):
    # W&B's config said hidden_size 256, 4 layers (llama_tiny's) for a 2-layer, 64-wide model.path checkpoint
    from transformers import LlamaConfig, LlamaForCausalLM

    for name, value in (("WANDB_DIR", tmp_path / "wandb_dir"), ("WANDB_CACHE_DIR", tmp_path / "wandb_cache"),
                        ("WANDB_CONFIG_DIR", tmp_path / "wandb_config"), ("WANDB_SILENT", "true")):
        monkeypatch.setenv(name, str(value))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 vocab_size=320, max_position_embeddings=64)).save_pretrained(tmp_path / "hf")
    cfg = tiny_config(tmp_path / "run", steps=1, logger={"backend": "wandb", "mode": "offline"},
                      model={"path": str(tmp_path / "hf")})
    Trainer(cfg).train()
    # offline, the config is in the run's transaction log (protobuf records holding each key's value as JSON)
    (log,) = (tmp_path / "run").glob("wandb/offline-run-*/run-*.wandb")
    logged = log.read_bytes()
    assert b'"config_json":{' in logged and b'"num_hidden_layers":2' in logged and b'"hidden_size":64' in logged
    assert b'"hidden_size":256' not in logged and b'"num_layers":4' not in logged  # llama_tiny's, the group's


def test_a_fresh_run_in_a_used_directory_moves_the_earlier_metrics_aside(tmp_path):
    # appended, a second run's steps 1, 2 followed the first's 1, 2, 3 (a sweep's summary then took the wrong loss)
    Trainer(tiny_config(tmp_path, steps=3, logger={"backend": "none"})).train()
    Trainer(tiny_config(tmp_path, steps=2, logger={"backend": "none"})).train()
    steps = lambda name: [json.loads(line)["step"] for line in (tmp_path / name).read_text().splitlines()]  # noqa: E731
    assert steps("metrics.jsonl") == [1, 2] and steps("metrics.1.jsonl") == [1, 2, 3]


def test_keep_activations_above_the_pairs_says_every_pair_is_kept(tmp_path, caplog):
    caplog.set_level("WARNING")
    cfg = tiny_config(tmp_path, steps=1, logger={"backend": "none"},
                      schedule={"sub_batch_size": 1, "num_sub_batches": 2, "keep_activations": 9})
    Trainer(cfg).train()
    warned = [r.getMessage() for r in caplog.records if "keep_activations" in r.getMessage()]
    assert warned == ["schedule.keep_activations=9 is more than the 4 (unit, sub-batch) pairs of this run (2 units x 2 "
                      "sub-batches): every pair keeps its activations, none is recomputed"]
    caplog.clear()
    Trainer(dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, keep_activations=4),
                                output_dir=str(tmp_path / "4"))).train()
    assert not [r for r in caplog.records if "keep_activations" in r.getMessage()]


def test_a_record_without_console_figures_prints_no_bare_step_line(tmp_path, caplog):
    """The tuner logs its plan as one record (metrics.jsonl, W&B); its console line would be a bare 'step 0'."""
    from fsdp_speedloader.app.logger import Rank0Logger

    caplog.set_level("INFO", logger="fsdp_speedloader.app.logger")
    logger = Rank0Logger(tmp_path)
    logger.log({"tune/sub_batch_size": 2, "tune/num_sub_batches": 4}, step=0)
    logger.log({"loss": 2.5}, step=1)
    logger.finish()
    assert [r.getMessage() for r in caplog.records] == ["step 1 | loss 2.5000"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"step": 0, "tune/sub_batch_size": 2, "tune/num_sub_batches": 4}, {"step": 1, "loss": 2.5}]


def test_an_overlapped_cpu_step_that_shows_in_3_steps_in_a_row_warns_once_with_the_next_device_unit(tmp_path, caplog):
    """After the first steps, optimizer_wait_s above 5% of the step in 3 steps in a row: one warning naming
    offload.device_units one higher (and schedule=auto); a step where it hid starts the count again."""
    trainer = Trainer(tiny_config(tmp_path, offload={"params": True, "device_units": 1}))
    caplog.set_level("WARNING")
    waits = ((1, 0.5), (2, 0.5), (3, 0.10), (4, 0.04), (5, 0.10), (6, 0.06), (7, 0.20), (8, 0.30))
    for step, wait in waits:  # steps of 1 s; 1-2 are the first steps, 4 hid it (4%), 5-7 showed it
        trainer.step = step
        trainer._check_host_step_shows({"optimizer_wait_s": wait, "optimizer_busy_s": 0.6, "step_time_s": 1.0})
    warned = [r.getMessage() for r in caplog.records if "CPU optimizer step showed" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("step 7: the overlapped CPU optimizer step showed after the "
                                                     "backward in 3 steps in a row (this step: 0.200 s of 1.000 s")
    assert "offload.device_units=2 keeps one more unit" in warned[0] and "schedule=auto" in warned[0]
    quiet = Trainer(tiny_config(tmp_path / "quiet"))
    for step in range(1, 9):  # no overlapped optimizer: no key, nothing to say
        quiet.step = step
        quiet._check_host_step_shows({"step_time_s": 1.0})
    assert len([r for r in caplog.records if "CPU optimizer step showed" in r.getMessage()]) == 1


@pytest.mark.parametrize("schedule,fix", [({"name": "speedloader"}, "schedule.keep_activations"),
                                          ({"name": "canonical"}, "schedule.activation_checkpointing")])
def test_allocator_retries_after_the_first_steps_warn_once_with_what_to_lower(tmp_path, caplog, schedule, fix):
    trainer = Trainer(tiny_config(tmp_path, schedule=schedule))
    caplog.set_level("WARNING")
    for step, retries in ((1, 4), (2, 4), (3, 0), (4, 2), (5, 7)):
        trainer.step = step
        trainer._check_alloc_retries({"gpu_alloc_retries": retries})
    warned = [r.getMessage() for r in caplog.records if "allocator retried" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("step 4: the CUDA caching allocator retried 2 allocation(s)")
    assert fix in warned[0]
    trainer.step = 9
    trainer._check_alloc_retries({})  # no GPU: no key, nothing to say
    assert len([r for r in caplog.records if "allocator retried" in r.getMessage()]) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif("expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                    reason="expandable segments grow in place instead of retrying")
def test_step_metrics_count_the_allocators_retries_per_step():
    """A freed 600 MiB block cannot hold 700 MiB, and the cap leaves no room for both: the allocator frees its cache
    and retries. The step's metrics count that retry; the next step's count starts again from 0."""
    device, mib = torch.device("cuda", 0), 2**20
    torch.cuda.empty_cache()
    cap = torch.cuda.memory_reserved(device) + 1024 * mib  # what earlier tests still hold, and 1 GiB
    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory, device)
    metrics = StepMetrics(device=device, world_size=1, tokens_per_step_per_device=1, flops_per_token=1.0,
                          peak_tflops=1.0)
    try:
        metrics.start_step()
        first = torch.empty(600 * mib, dtype=torch.uint8, device=device)
        del first  # cached, not returned
        second = torch.empty(700 * mib, dtype=torch.uint8, device=device)
        assert metrics.end_step(loss=0.0, lr=0.0, grad_norm=None)["gpu_alloc_retries"] >= 1
        metrics.start_step()
        second.add_(1)
        assert metrics.end_step(loss=0.0, lr=0.0, grad_norm=None)["gpu_alloc_retries"] == 0
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def test_progress_bar_rank0_on_a_terminal_or_forced(tmp_path, monkeypatch, capfd):
    from fsdp_speedloader.app.logger import PROGRESS_ENV, progress_bar_enabled

    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    assert not progress_bar_enabled(0)  # pytest's stderr is not a terminal: CI logs stay clean
    monkeypatch.setenv(PROGRESS_ENV, "1")
    assert progress_bar_enabled(0) and not progress_bar_enabled(1)  # forced, and never on other ranks
    monkeypatch.setenv(PROGRESS_ENV, "maybe")
    with pytest.raises(ValueError, match=PROGRESS_ENV):
        progress_bar_enabled(0)

    monkeypatch.setenv(PROGRESS_ENV, "1")
    capfd.readouterr()
    Trainer(tiny_config(tmp_path / "bar", steps=3)).train()
    err = capfd.readouterr().err
    assert "train: 100%" in err and "3/3" in err and "loss=" in err, err[-2000:]
    monkeypatch.delenv(PROGRESS_ENV)
    Trainer(tiny_config(tmp_path / "plain", steps=3)).train()
    assert "train:" not in capfd.readouterr().err


# --- the loss where no label counts --------------------------------------------------------------------------


def test_all_labels_ignored_gives_nan_loss_and_zero_grads_like_hugging_face(tmp_path):
    """Every label -100: the unmodified model's loss is nan (0 / 0) and its gradients are zero; layer-major too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    trainer = Trainer(tiny_config(tmp_path, schedule={"name": "speedloader"}))
    ids = trainer.loader.next_batch()["input_ids"]
    ignored = torch.full_like(ids, IGNORE_INDEX)
    loss = trainer.model(input_ids=ids, labels=ignored).loss
    assert math.isnan(loss.item())
    loss.backward()
    grads = [p.grad.to_local() for p in trainer.model.parameters() if p.grad is not None]
    assert grads and all(torch.count_nonzero(g) == 0 for g in grads)

    c = trainer.model.config
    reference = LlamaForCausalLM(LlamaConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                                             num_hidden_layers=c.num_hidden_layers, vocab_size=c.vocab_size,
                                             num_attention_heads=c.num_attention_heads))
    ref_loss = reference(input_ids=ids, labels=ignored).loss
    ref_loss.backward()
    assert math.isnan(ref_loss.item())
    assert all(torch.count_nonzero(p.grad) == 0 for p in reference.parameters() if p.grad is not None)
    # One counted label: a finite loss, the same mean as before the change.
    one = ignored.clone()
    one[0, 5] = ids[0, 5]
    assert math.isfinite(trainer.model(input_ids=ids, labels=one).loss.item())


# --- the tuner's plan with N = 1 ----------------------------------------------------------------------------


def test_tuned_plan_with_one_sub_batch_warns_only_where_memory_or_a_cap_made_it(tmp_path, caplog):
    """schedule=auto whose whole target batch fits one sub-batch (target_batch_size = the sub-batch size) plans
    N = 1 on purpose (where it fits, the faster plan): a note, no warning. A target the largest n does not divide
    runs with the largest n that does (the whole target, no warning)."""
    caplog.set_level("INFO")
    cfg = tiny_config(tmp_path / "a", offload={"params": True}, steps=1,
                      schedule={"name": "auto", "activation_store": "host", "target_batch_size": 2})
    trainer = Trainer(cfg)
    assert trainer.cfg.schedule.num_sub_batches == 1 and trainer.tune_plan.whole_batch_fits()
    assert trainer.tune_plan.single_sub_batch_warning() is None
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "N=1" in r.getMessage()]
    assert any("the whole target batch fits one sub-batch: N=1 (n=2)" in r.getMessage() for r in caplog.records)
    caplog.clear()
    cfg = tiny_config(tmp_path / "b", offload={"params": True}, steps=1,
                      schedule={"name": "auto", "activation_store": "host", "target_batch_size": 3})
    trainer = Trainer(cfg)
    assert (trainer.cfg.schedule.sub_batch_size, trainer.cfg.schedule.num_sub_batches) == (1, 3)  # not 2 x 1
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "multiple" in r.getMessage()]
