"""Validation: the held-out set, its loss through the layer-major forward only, and what every log record carries.

The validation loss equals the unmodified Hugging Face model's mean token loss on the same held-out batches (fp32,
CPU, rtol 1e-6), with and without packed documents, for both schedules; evaluating leaves training untouched (the
same losses, bit for bit); the no-grad layer-major forward holds two activation slots, and a training step after it
is exact. Also: the split is deterministic and disjoint from the training sequences, and bad settings are refused in
one line before the model is built.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import fsdp_speedloader.app.trainer as trainer_mod
from dist_utils import run_distributed, tiny_config
from engine_cases import assert_grads_close, batch, cpu_mesh, reference_grads, tiny_model
from fsdp_speedloader import apply_speedloader, speedloader_engine
from fsdp_speedloader.app.config import DataConfig, TrainConfig
from fsdp_speedloader.app.data import ByteTokenizer, apply_document_mask, build_loader, check_held_out, \
    load_tokens, load_val_tokens, split_held_out, val_batches
from fsdp_speedloader.app.trainer import Trainer
from fsdp_speedloader.models import build_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _corpus(tmp_path, num_documents: int = 60, seed: int = 0) -> str:
    """A .jsonl of short documents of different lengths (joined with EOS by the loader)."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "layer", "major", "unit", "shard", "token", "batch"]
    path = tmp_path / "corpus.jsonl"
    with open(path, "w") as f:
        for _ in range(num_documents):
            f.write(json.dumps({"text": " ".join(rng.choice(words, size=rng.integers(2, 12)))}) + "\n")
    return str(path)


def _unmodified_copy(trainer: Trainer) -> torch.nn.Module:
    """The trainer's current weights in a fresh, unsharded Hugging Face model of the same config."""
    ref = build_model(trainer.cfg.model, device="cpu", seed=0)
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in trainer.model.state_dict().items()}
    ref.load_state_dict(state)
    return ref.eval()


def _reference_val_loss(trainer: Trainer) -> float:
    total, tokens = _reference_val_sums(trainer)
    return total / tokens


def _reference_val_sums(trainer: Trainer) -> tuple[float, float]:
    """(summed token loss, label tokens) of the unmodified model on this rank's held-out batches."""
    ref = _unmodified_copy(trainer)
    total = tokens = 0.0
    with torch.no_grad():
        for b in trainer.val_batches:
            if trainer.eos_token_id is not None:
                b = apply_document_mask(b, trainer.eos_token_id)
            n = int((b["labels"][:, 1:] != -100).sum())
            out = ref(input_ids=b["input_ids"], labels=b["labels"], position_ids=b.get("position_ids"),
                      use_cache=False)
            total, tokens = total + out.loss.item() * n, tokens + n
    return total, tokens


# ---------------------------------------------------------------------------------------------
# The engine's forward only
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("store", ["device", "host", "host_sync"])
def test_no_grad_forward_holds_two_slots_and_training_after_it_is_exact(store):
    model = tiny_model("llama")
    ids, labels = batch(3)
    with torch.no_grad():
        want = model(input_ids=ids, labels=labels).loss
    ref_loss, ref_grads = reference_grads(model, [(ids, labels)])
    apply_speedloader(model, mesh=cpu_mesh(), num_sub_batches=3, activation_store=store)
    engine = speedloader_engine(model)

    def forward_only() -> None:
        with torch.no_grad():
            got = model(input_ids=ids, labels=labels).loss
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        assert engine.store.num_slots == 2

    forward_only()
    loss = model(input_ids=ids, labels=labels).loss  # the store's geometry goes 2 -> U + 1 -> 2 slots
    assert engine.store.num_slots == len(engine.units) + 1
    held = _host_activation_memory(engine.store)
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss[0], rtol=1e-6, atol=0)
    assert_grads_close(model, ref_grads)
    forward_only()
    assert _host_activation_memory(engine.store) == held  # the host stores keep the step's memory: no reallocation


def _host_activation_memory(store) -> tuple:
    """What a host store holds for activations: the arena and its capacity (exchange store), or its buffer."""
    if getattr(store, "arena", None) is not None:
        return id(store.arena), store.arena.capacity("activations")
    return None, store.host_bytes


# ---------------------------------------------------------------------------------------------
# The held-out set
# ---------------------------------------------------------------------------------------------


def test_held_out_sequences_are_the_end_of_the_stream_and_never_trained_on():
    tokens = np.arange(1000, dtype=np.uint16)
    train, held_out = split_held_out(tokens, 0.1, seq_len=10)
    assert (len(train), len(held_out)) == (900, 100) and held_out[0] == 900
    assert split_held_out(tokens, 0.001, seq_len=10)[1].tolist() == list(range(990, 1000))  # at least one sequence
    assert len(split_held_out(tokens, 0.0, seq_len=10)[1]) == 0
    # Each rank its own sequences, in order; a partial batch is dropped; at most num_batches.
    per_rank = [val_batches(held_out, seq_len=10, batch_size=2, num_batches=9, rank=r, world_size=2) for r in (0, 1)]
    assert [len(b) for b in per_rank] == [2, 2]  # 10 sequences: 2 full global batches of 4
    firsts = sorted(int(b["input_ids"][k, 0]) for batches in per_rank for b in batches for k in range(2))
    assert firsts == list(range(900, 980, 10))
    assert len(val_batches(held_out, seq_len=10, batch_size=2, num_batches=1, world_size=2)) == 1


def test_the_training_loader_never_reads_the_held_out_set(tmp_path):
    cfg = DataConfig(source="text", path=_corpus(tmp_path), seq_len=16, val_fraction=0.25)
    held_out = load_val_tokens(cfg).reshape(-1, 16)
    loader = build_loader(cfg, vocab_size=320, batch_size=4)
    num_batches = 2 * loader.num_sequences // 4  # more than one epoch: every training sequence
    seen = {tuple(row) for _ in range(num_batches) for row in loader.next_batch()["input_ids"].tolist()}
    assert seen == {tuple(r) for r in loader.sequences.tolist()}
    assert not seen & {tuple(r) for r in held_out.tolist()}
    assert loader.num_sequences + len(held_out) == len(load_tokens(cfg)) // 16
    assert loader.progress() == {"epoch": pytest.approx(num_batches * 4 / loader.num_sequences),
                                 "dataset_tokens": loader.num_sequences * 16}


# ---------------------------------------------------------------------------------------------
# The trainer's validation loss
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule,document_mask,held_out", [
    ("speedloader", False, "fraction"), ("speedloader", True, "fraction"), ("canonical", True, "fraction"),
    ("speedloader", True, "path")])
def test_validation_loss_equals_the_unmodified_models(tmp_path, schedule, document_mask, held_out):
    corpus = _corpus(tmp_path)
    if held_out == "path":  # another file of documents
        (tmp_path / "val").mkdir()
        split = {"val_path": _corpus(tmp_path / "val", num_documents=40, seed=1)}
    else:
        split = {"val_fraction": 0.3}
    cfg = tiny_config(tmp_path, data={"source": "text", "path": corpus, "document_mask": document_mask, **split},
                      schedule={"name": schedule}, eval={"batches": 3})
    trainer = Trainer(cfg)
    assert len(trainer.val_batches) == 3
    assert trainer.eos_token_id == (ByteTokenizer.eos_token_id if document_mask else None)
    trainer.train_step()  # weights that are no longer the initial ones
    result = trainer.evaluate()
    want = _reference_val_loss(trainer)
    assert result["val_loss"] == pytest.approx(want, rel=1e-6)
    assert result["val_ppl"] == pytest.approx(math.exp(want), rel=1e-6)
    assert trainer.model.training
    if document_mask:  # the mask changes the loss: the test would notice it missing
        trainer.eos_token_id = None
        assert abs(trainer.evaluate()["val_loss"] - want) > 1e-3


def _val_loss_2_ranks(rank: int, world_size: int, root: str) -> tuple[float, tuple[float, float], list[tuple]]:
    corpus = _corpus(Path(root)) if rank == 0 else str(Path(root) / "corpus.jsonl")
    if rank == 0:
        Path(root, "ready").touch()
    while not Path(root, "ready").exists():
        time.sleep(0.05)
    cfg = tiny_config(root, data={"source": "text", "path": corpus, "val_fraction": 0.3, "document_mask": True},
                      eval={"batches": 2})
    trainer = Trainer(cfg)
    trainer.train_step()
    rows = [tuple(row) for b in trainer.val_batches for row in b["input_ids"].tolist()]
    return trainer.evaluate()["val_loss"], _reference_val_sums(trainer), rows


@pytest.mark.slow
def test_validation_loss_over_2_ranks_is_the_mean_over_their_tokens(tmp_path):
    """Each rank evaluates its own share of every held-out batch; the loss is the mean over all their tokens."""
    per_rank = run_distributed(_val_loss_2_ranks, 2, str(tmp_path))
    sums = [r[1] for r in per_rank]
    want = sum(s[0] for s in sums) / sum(s[1] for s in sums)
    assert [r[0] for r in per_rank] == pytest.approx([want, want], rel=1e-6)
    assert len(per_rank[0][2]) == 2 * 4 and not set(per_rank[0][2]) & set(per_rank[1][2])  # each its own sequences


def test_evaluation_is_logged_and_leaves_training_untouched(tmp_path):
    corpus = _corpus(tmp_path)
    data = {"source": "text", "path": corpus, "val_fraction": 0.3, "document_mask": True}
    with_eval = Trainer(tiny_config(tmp_path / "a", data=data, steps=5, log_every=10,
                                    eval={"every": 2, "batches": 2})).train()
    # The same run evaluating after its last step only.
    without = Trainer(tiny_config(tmp_path / "b", data=data, steps=5, log_every=10, eval={"every": 0})).train()
    assert [m["loss"] for m in with_eval] == [m["loss"] for m in without]  # bit for bit
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    # Logged at every evaluation (steps 2, 4 and the last) whatever log_every says.
    assert [r["step"] for r in records] == [2, 4, 5]
    assert all("val_loss" in r and r["val_ppl"] == pytest.approx(math.exp(r["val_loss"])) for r in records)
    for r in records:  # tokens seen, epoch and dataset size in every record
        assert r["tokens"] == r["step"] * 4 * 32 and r["dataset_tokens"] > 0
        assert r["epoch"] == pytest.approx(r["tokens"] / r["dataset_tokens"])
    assert records[-1]["val_loss"] < records[0]["val_loss"]


# ---------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("data,match", [
    ({"val_fraction": 1.0}, "data.val_fraction: got 1.0"),
    ({"val_fraction": 0.1, "val_path": "x.txt"}, "data.val_fraction: data.val_path='x.txt' is the held-out set"),
    ({"source": "synthetic", "document_mask": True}, "data.document_mask: synthetic tokens hold no documents"),
    ({"source": "synthetic", "val_fraction": 0.1}, "data.val_fraction: synthetic tokens have no held-out set"),
    ({"source": "synthetic", "val_path": "x.txt"}, "data.val_path: synthetic tokens have no held-out set"),
])
def test_bad_data_settings_name_the_key(tmp_path, data, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(tmp_path, data=data)


def test_document_mask_refuses_the_flash_kernel(tmp_path):
    with pytest.raises(ValueError, match="kernels.sdpa_backend: the flash SDPA kernel takes no attention mask"):
        tiny_config(tmp_path, data={"document_mask": True}, kernels={"sdpa_backend": "flash"})


def test_too_small_held_out_sets_are_refused_before_the_model_is_built(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the model was built although the config is invalid")

    monkeypatch.setattr(trainer_mod, "build_model", fail)
    corpus = _corpus(tmp_path)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("x" * 40)  # one sequence of 32
    cases = [({"val_fraction": 0.001}, r"data.val_fraction: the held-out set holds 1 sequences .* fewer than one "
                                       r"evaluation batch of 4"),
             ({"val_path": str(tiny)}, "data.val_path: the held-out set holds 1 sequences"),
             ({"val_path": str(tmp_path / "missing.txt")},  # the setting that named it, not data.path
              r"^data\.val_path: .*missing.txt' does not exist; point data\.val_path at a \.txt")]
    for data, match in cases:
        with pytest.raises(ValueError, match=match):
            Trainer(tiny_config(tmp_path, data={"source": "text", "path": corpus, **data}))
    with pytest.raises(ValueError, match="leaves none to train on"):
        check_held_out(DataConfig(source="text", path=str(tiny), seq_len=32, val_fraction=0.5), vocab_size=320,
                       global_batch_size=1)


def test_document_mask_is_refused_for_families_without_per_document_positions(tmp_path):
    cfg = tiny_config(tmp_path, model={"family": "opt", "name": "opt_tiny"}, data={"document_mask": True})
    with pytest.raises(ValueError, match="data.document_mask: .*LlamaForCausalLM.*not OPTForCausalLM"):
        Trainer(cfg)
