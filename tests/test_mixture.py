"""data.mixture and the keyed epoch order: proportions, determinism, resume, resume at another world size (CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fsdp_speedloader.app.config import DataConfig
from fsdp_speedloader.app.data import build_loader, validate_data
from fsdp_speedloader.app.mixture import MixtureLoader
from fsdp_speedloader.app.permutation import KeyedPermutation
from fsdp_speedloader.app.token_shards import write_index

SEQ_LEN = 8


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 17, 100, 1000, 4099])
def test_keyed_permutation_is_a_bijection_picked_by_its_key(n):
    perm = KeyedPermutation(n, (5, 0))
    order = perm[np.arange(n)]
    assert sorted(order.tolist()) == list(range(n))
    np.testing.assert_array_equal(perm[3 : n // 2], order[3 : n // 2])  # slices and index arrays agree
    np.testing.assert_array_equal(KeyedPermutation(n, (5, 0))[np.arange(n)], order)  # a function of the key
    if n >= 16:
        assert not np.array_equal(KeyedPermutation(n, (5, 1))[np.arange(n)], order)
        assert not np.array_equal(order, np.arange(n))
    with pytest.raises(IndexError):
        perm[np.array([n])]


def _dataset(tag: int, num_sequences: int) -> tuple[str, np.ndarray]:
    """Sequences whose every token says (dataset, sequence): tag * 1000 + index."""
    ids = tag * 1000 + np.arange(num_sequences)
    return f"d{tag}", np.repeat(ids, SEQ_LEN).reshape(num_sequences, SEQ_LEN)


def _mixture(sizes=(50, 13, 7), weights=(0.6, 0.3, 0.1), **kwargs) -> MixtureLoader:
    return MixtureLoader([_dataset(i, n) for i, n in enumerate(sizes)], list(weights), **kwargs)


def _ids(batch: dict[str, torch.Tensor]) -> list[int]:
    rows = batch["input_ids"]  # (b, s)
    assert bool((rows == rows[:, :1]).all()) and torch.equal(batch["labels"], rows)
    return rows[:, 0].tolist()


def test_every_prefix_holds_each_dataset_within_one_sample_of_its_weight():
    weights = (5.0, 3.0, 1.5, 0.5)  # normalised by the loader
    loader = _mixture(sizes=(40, 30, 20, 10), weights=weights, batch_size=7)
    seen = [i for _ in range(60) for i in _ids(loader.next_batch())]
    counts = np.zeros(4)
    share = np.array(weights) / sum(weights)
    for k, sample in enumerate(seen, start=1):
        counts[sample // 1000] += 1
        assert np.all(np.abs(counts - share * k) <= 1.0), (k, counts)
    assert loader.consumed == counts.astype(int).tolist()
    # Each dataset's sequences: every one once per epoch, in a fresh order each epoch.
    d3 = [s % 1000 for s in seen if s // 1000 == 3]  # 21 samples of 10 sequences: epochs 0, 1 and one of 2
    assert sorted(d3[:10]) == sorted(d3[10:20]) == list(range(10)) and d3[:10] != d3[10:20]
    assert loader.epochs == [c // n for c, n in zip(loader.consumed, (40, 30, 20, 10))]


def test_deterministic_and_disjoint_across_ranks():
    sizes = (500, 130, 70)  # no dataset starts a new epoch within these steps
    world = [_mixture(sizes, batch_size=3, rank=r, world_size=4, seed=11) for r in range(4)]
    again = [_mixture(sizes, batch_size=3, rank=r, world_size=4, seed=11) for r in range(4)]
    other_seed = _mixture(sizes, batch_size=3, rank=0, world_size=4, seed=12)
    steps = [[_ids(loader.next_batch()) for loader in world] for _ in range(5)]
    assert steps == [[_ids(loader.next_batch()) for loader in again] for _ in range(5)]
    assert [_ids(other_seed.next_batch()) for _ in range(5)] != [step[0] for step in steps]
    for step in steps:  # 12 samples a step: no sequence twice within a step
        flat = [i for rank in step for i in rank]
        assert len(set(flat)) == len(flat)
    assert all(loader.state_dict() == world[0].state_dict() for loader in world)


@pytest.mark.parametrize("k", [0, 3, 11])
def test_resume_gives_the_uninterrupted_batches(k):
    uninterrupted = _mixture(batch_size=5, rank=1, world_size=2, seed=3)
    for _ in range(k):
        uninterrupted.next_batch()
    state = json.loads(json.dumps(uninterrupted.state_dict()))
    resumed = _mixture(batch_size=5, rank=1, world_size=2, seed=3)
    resumed.load_state_dict(state)
    for _ in range(12):  # past several epochs of the small datasets
        assert _ids(resumed.next_batch()) == _ids(uninterrupted.next_batch())


def test_resume_at_another_world_size():
    """World 2 x batch 2 saved after 5 steps, resumed as world 1 x batch 4 (same global batch): the same
    samples in the same steps as the world-2 run that went on."""
    ranks = [_mixture(batch_size=2, rank=r, world_size=2, seed=9) for r in range(2)]
    for _ in range(5):
        for loader in ranks:
            loader.next_batch()
    state = json.loads(json.dumps(ranks[0].state_dict()))  # every rank holds the same state
    single = _mixture(batch_size=4, rank=0, world_size=1, seed=9)
    single.load_state_dict(state)
    for _ in range(10):
        assert _ids(single.next_batch()) == _ids(ranks[0].next_batch()) + _ids(ranks[1].next_batch())
    # And back up: world 1 -> world 4 at batch 1.
    four = [_mixture(batch_size=1, rank=r, world_size=4, seed=9) for r in range(4)]
    for loader in four:
        loader.load_state_dict(json.loads(json.dumps(single.state_dict())))
    for _ in range(10):
        assert _ids(single.next_batch()) == [i for loader in four for i in _ids(loader.next_batch())]


def test_resume_refuses_another_mixture():
    state = _mixture(batch_size=2).state_dict()
    with pytest.raises(ValueError, match=r"data\.mixture\[1\]: .*13 sequences, 'd1' gives 14"):
        _mixture(sizes=(50, 14, 7), batch_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"data\.mixture\[0\]: .*weight share is 0\.6, this run's 0\.5"):
        _mixture(weights=(0.5, 0.4, 0.1), batch_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"mixes 3 datasets, this run 2"):
        _mixture(sizes=(50, 13), weights=(1, 1), batch_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"^data\.seed: .*data\.seed=0, this run has 3"):
        _mixture(batch_size=2, seed=3).load_state_dict(state)


# ----- data.mixture from a config: token directories and .bin files


def _token_dir(path: Path, tokens: np.ndarray, *, vocab_size: int = 257, shards: int = 2) -> str:
    path.mkdir(parents=True)
    entries = []
    for i, part in enumerate(np.array_split(tokens.astype("<u2"), shards)):
        part.tofile(path / f"{i:06d}-00000.bin")
        np.save(path / f"{i:06d}-00000.docs.npy", np.array([0], dtype=np.int64))
        entries.append({"file": f"{i:06d}-00000.bin", "num_tokens": len(part), "num_documents": 1,
                        "document_starts": f"{i:06d}-00000.docs.npy", "source": "test"})
    write_index(path, tokenizer="bytes", vocab_size=vocab_size, eos_token_id=vocab_size - 1, dtype="uint16", shards=entries)
    return str(path)


def _bin(path: Path, tokens: np.ndarray) -> str:
    tokens.astype("<u2").tofile(path)
    Path(f"{path}.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 257, "num_tokens": len(tokens),
                                                "tokenizer": "bytes"}))
    return str(path)


def test_config_mixture_of_a_directory_and_a_bin_file(tmp_path):
    web = _token_dir(tmp_path / "web", np.repeat(np.arange(30) % 200, SEQ_LEN), shards=3)
    code = _bin(tmp_path / "code.bin", np.repeat(200 + np.arange(10) % 50, SEQ_LEN))
    cfg = DataConfig(source="tokens", seq_len=SEQ_LEN, seed=1,
                     mixture=[{"path": web, "weight": 3}, {"path": code, "weight": 1}])
    loader = build_loader(cfg, vocab_size=257, batch_size=8)
    assert isinstance(loader, MixtureLoader)
    rows = torch.cat([loader.next_batch()["input_ids"] for _ in range(5)])  # (40, s)
    assert bool((rows == rows[:, :1]).all())
    assert int((rows[:, 0] >= 200).sum()) == 10  # a quarter from code
    assert [e["path"] for e in loader.state_dict()["mixture"]] == [web, code]

    big_vocab = _token_dir(tmp_path / "big", np.zeros(100, dtype=int), vocab_size=300)
    cases = [
        (dict(mixture=[{"path": web, "weight": 1}, {"path": big_vocab, "weight": 1}]),
         r"data\.mixture: .*big' was tokenized with 'bytes' \(vocab_size=300\)"),
        (dict(mixture=[{"path": web, "weight": 1}, {"path": str(tmp_path / "nowhere"), "weight": 1}]),
         r"^data\.mixture\[1\]\.path: .*nowhere.* does not exist"),  # the entry, not data.path
        (dict(mixture=[{"path": str(tmp_path), "weight": 1}, {"path": web, "weight": 1}]),
         r"^data\.mixture\[0\]\.path: .* has no index\.json; it is not a token directory"),
        (dict(mixture=[{"path": web, "weight": 1}, {"path": _bin(tmp_path / "tiny.bin", np.arange(5)), "weight": 1}]),
         r"data\.seq_len: .*tiny\.bin' has 5 tokens"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            validate_data(DataConfig(source="tokens", seq_len=SEQ_LEN, **kwargs), vocab_size=400)


@pytest.mark.parametrize("kwargs, message", [
    (dict(source="text", path="x", mixture=[{"path": "a", "weight": 1}]), r"data\.mixture: needs data\.source=tokens"),
    (dict(source="tokens", path="x", mixture=[{"path": "a", "weight": 1}]), r"data\.path: set data\.path=null"),
    (dict(source="tokens", mixture=[]), r"data\.mixture: expected a non-empty list"),
    (dict(source="tokens", mixture=[{"path": "a", "weight": 0}]), r"data\.mixture\[0\]: got .*a positive number"),
    (dict(source="tokens", mixture=[{"path": "a", "weight": 1}, {"path": "b"}]), r"data\.mixture\[1\]"),
    (dict(source="tokens", mixture=[{"path": "a", "weight": 1, "extra": 2}]), r"data\.mixture\[0\]"),
    (dict(source="tokens"), r"data\.path: .*or data\.mixture="),
])
def test_mixture_config_errors_name_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**kwargs)


@pytest.mark.slow
def test_training_resume_restores_every_dataset_position(tmp_path):
    """A real run (tiny LLaMA, CPU) on a mixture: checkpoint at step 3, resume, same losses as the run that went
    on, and the positions of both datasets came back from the checkpoint."""
    from dist_utils import tiny_config

    from fsdp_speedloader.app.trainer import Trainer

    rng = np.random.default_rng(0)
    web = _token_dir(tmp_path / "web", rng.integers(0, 200, 40 * 32), shards=3)
    code = _bin(tmp_path / "code.bin", rng.integers(0, 200, 15 * 32))
    data = {"source": "tokens", "path": None, "mixture": [{"path": web, "weight": 0.7}, {"path": code, "weight": 0.3}]}

    def config(name: str, resume=None):
        return tiny_config(tmp_path / name, data=data, schedule={"name": "canonical"}, steps=6,
                           checkpoint={"every": 3, "dir": str(tmp_path / f"{name}_ckpt"), "save_final": False,
                                       "resume": resume})

    uninterrupted = Trainer(config("a")).train()
    Trainer(config("b")).train(max_steps=3)
    resumed_trainer = Trainer(config("b", resume="auto"))
    assert resumed_trainer.step == 3
    consumed = [e["consumed"] for e in resumed_trainer.loader.state_dict()["mixture"]]
    assert sum(consumed) == 3 * tiny_config(tmp_path / "x", data=data).schedule.batch_size and min(consumed) > 0
    resumed = resumed_trainer.train()
    assert [m["loss"] for m in resumed] == pytest.approx([m["loss"] for m in uninterrupted[3:]], rel=1e-6)


def test_a_mixture_checkpoint_and_a_single_dataset_one_do_not_cross():
    from fsdp_speedloader.app.data import TokenLoader

    single = TokenLoader(np.arange(50 * SEQ_LEN), seq_len=SEQ_LEN, batch_size=2)
    with pytest.raises(ValueError, match=r"data\.mixture: the checkpoint was saved by a run with data\.mixture"):
        single.load_state_dict(_mixture(batch_size=2).state_dict())
    with pytest.raises(ValueError, match=r"data\.mixture: the checkpoint was saved by a run without data\.mixture"):
        _mixture(batch_size=2).load_state_dict(single.state_dict())


def test_a_synthetic_checkpoint_and_a_corpus_one_do_not_cross():
    # Resuming a corpus run with data=synthetic (or the reverse) was a KeyError traceback; now one line each way.
    from fsdp_speedloader.app.data import SyntheticLoader, TokenLoader

    single = TokenLoader(np.arange(50 * SEQ_LEN), seq_len=SEQ_LEN, batch_size=2)
    synthetic = SyntheticLoader(vocab_size=257, seq_len=SEQ_LEN, batch_size=2)
    for corpus in (single, _mixture(batch_size=2)):
        with pytest.raises(ValueError, match=r"^data: the checkpoint was saved by a run that read a corpus .* this "
                                             r"one has data=synthetic"):
            synthetic.load_state_dict(corpus.state_dict())
    with pytest.raises(ValueError, match=r"^data: the checkpoint was saved by a run with data=synthetic"):
        single.load_state_dict(synthetic.state_dict())
    with pytest.raises(ValueError, match=r"data\.mixture: the checkpoint was saved by a run without data\.mixture"):
        _mixture(batch_size=2).load_state_dict(synthetic.state_dict())


def test_token_directories_give_a_held_out_set_and_progress(tmp_path):
    """data.val_fraction on a token directory: the training stream ends where the held-out set begins, both read
    from the shards; data.val_path holds a token directory too (read whole); a mixture reports its progress and
    takes its held-out set from data.val_path only; the EOS of packed documents is the directory's own."""
    from fsdp_speedloader.app.data import eos_token_id, load_val_tokens, split_held_out, load_tokens

    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 200, 40 * SEQ_LEN)
    web = _token_dir(tmp_path / "web", tokens, shards=3)
    cfg = DataConfig(source="tokens", path=web, seq_len=SEQ_LEN, val_fraction=0.1)
    train, held_out = split_held_out(load_tokens(cfg), cfg.val_fraction, SEQ_LEN)
    assert len(train) == 36 * SEQ_LEN and np.array_equal(held_out, tokens[36 * SEQ_LEN:])
    loader = build_loader(cfg, vocab_size=257, batch_size=4)
    assert loader.num_sequences == 36 and loader.progress() == {"epoch": 0.0, "dataset_tokens": 36 * SEQ_LEN}
    seen = torch.cat([loader.next_batch()["input_ids"] for _ in range(9)])  # the whole epoch: 36 rows
    assert not any(bool((seen == torch.from_numpy(row.astype(np.int64))).all(1).any())
                   for row in held_out.reshape(4, SEQ_LEN))
    assert np.array_equal(load_val_tokens(DataConfig(source="tokens", path=web, seq_len=SEQ_LEN, val_path=web)),
                          tokens)
    assert eos_token_id(cfg) == 256  # the index's, which validate_data checks is the run tokenizer's

    mix = DataConfig(source="tokens", seq_len=SEQ_LEN, val_path=web,
                     mixture=[{"path": web, "weight": 1}, {"path": _bin(tmp_path / "c.bin", tokens), "weight": 1}])
    mixed = build_loader(mix, vocab_size=257, batch_size=4)
    mixed.next_batch()
    # 4 samples, 2 from each: 2 of web's 40 sequences and 2 of c.bin's 40, each a dataset's own figure
    assert mixed.progress() == {"epoch": pytest.approx(4 / 80), "dataset_tokens": 80 * SEQ_LEN,
                                "mixture/0/epoch": pytest.approx(2 / 40), "mixture/0/tokens": 2 * SEQ_LEN,
                                "mixture/1/epoch": pytest.approx(2 / 40), "mixture/1/tokens": 2 * SEQ_LEN}
    assert len(load_val_tokens(mix)) == len(tokens)
    with pytest.raises(ValueError, match=r"data\.val_fraction: a mixture holds out no fraction"):
        DataConfig(source="tokens", seq_len=SEQ_LEN, val_fraction=0.1, mixture=[{"path": web, "weight": 1}])


@pytest.mark.slow
def test_training_on_a_token_directory_with_validation_and_document_mask(tmp_path):
    """A real run (tiny LLaMA, CPU, layer-major) on a token directory with a held-out fraction and packed documents
    kept apart: the validation loss is logged, the loader's progress is in every record."""
    from dist_utils import tiny_config

    from fsdp_speedloader.app.trainer import Trainer

    rng = np.random.default_rng(1)
    stream = rng.integers(1, 200, 48 * 32)
    stream[::7] = 0  # the directory's EOS (0): many short documents per sequence
    web = _token_dir(tmp_path / "web", stream, shards=2)
    cfg = tiny_config(tmp_path / "run", data={"source": "tokens", "path": web, "val_fraction": 0.25,
                                              "document_mask": True}, steps=3, eval={"every": 2, "batches": 1})
    records = Trainer(cfg).train()
    assert [r["step"] for r in records if "val_loss" in r] == [2, 3]
    assert all(np.isfinite(r["val_loss"]) and r["dataset_tokens"] == 36 * 32 for r in records if "val_loss" in r)
