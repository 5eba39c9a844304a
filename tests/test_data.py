"""Tokenizers, corpora, packing, rank sharding, resume, and the errors a user can hit (CPU, fast)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fsdp_speedloader.app.config import DataConfig
from fsdp_speedloader.app.data import (
    ByteTokenizer,
    SyntheticLoader,
    TokenLoader,
    build_loader,
    build_tokenizer,
    check_held_out,
    check_prepared_with,
    load_tokens,
    read_default_corpus,
    validate_data,
)

REPO = Path(__file__).resolve().parents[1]
EOS = ByteTokenizer.eos_token_id


def _encode(text: str) -> list[int]:
    return ByteTokenizer().encode(text)


def _sequence_ids(batch: dict[str, torch.Tensor], seq_len: int) -> list[int]:
    """Which packed sequence each row is, checking that each row is one contiguous slice of
    a stream whose token i has value i."""
    rows = batch["input_ids"]  # (b, s)
    assert torch.equal(rows - rows[:, :1], torch.arange(seq_len).expand_as(rows))
    assert bool((rows[:, 0] % seq_len == 0).all())
    return (rows[:, 0] // seq_len).tolist()


def _write_tiny_hf_tokenizer(directory: Path) -> dict[str, int]:
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "<eos>", "hello", "world", "the", "cat", "sat"])}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="[UNK]").save_pretrained(directory)
    return vocab


# ----- tokenizers and corpora


def test_byte_tokenizer_round_trip():
    tokenizer = build_tokenizer("bytes")
    assert isinstance(tokenizer, ByteTokenizer)
    assert (tokenizer.vocab_size, tokenizer.eos_token_id, len(tokenizer)) == (257, 256, 257)
    text = "Hello, wörld: naïve café, 日本語, emoji 🙂\n\ttabs"
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(torch.tensor(ids + [EOS])) == text  # EOS decodes to nothing
    assert tokenizer.decode(ids[:-len("🙂\n\ttabs".encode()) + 1]).endswith("\ufffd")  # a cut character


def test_default_corpus_is_real_text():
    text = read_default_corpus()
    assert len(text.encode("utf-8")) > 100_000
    words = set(text.lower().split())
    assert {"the", "and", "of", "is", "function", "statement", "value"} <= words
    tokens = load_tokens(DataConfig())  # one document, byte tokenizer: exactly the UTF-8 bytes
    np.testing.assert_array_equal(tokens, np.frombuffer(text.encode("utf-8"), dtype=np.uint8))

    loader = build_loader(DataConfig(seq_len=128), vocab_size=320, batch_size=4)
    batch = loader.next_batch()
    assert batch["input_ids"].shape == (4, 128) and batch["input_ids"].dtype == torch.int64
    assert loader.num_sequences == len(tokens) // 128


def test_local_hugging_face_tokenizer(tmp_path):
    vocab = _write_tiny_hf_tokenizer(tmp_path / "tok")
    tokenizer = build_tokenizer(str(tmp_path / "tok"))
    assert len(tokenizer) == len(vocab) and tokenizer.eos_token_id == vocab["<eos>"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"^data\.tokenizer: '.*empty' holds no tokenizer \(tokenizer\.json, "):
        build_tokenizer(str(tmp_path / "empty"))  # one line, not transformers' page on sentencepiece and tiktoken
    tokenizer.save_pretrained(tmp_path / "copy")  # as a checkpoint and an export save it: how it was read stays out
    saved = json.loads((tmp_path / "copy" / "tokenizer_config.json").read_text())
    assert "local_files_only" not in saved and "is_local" not in saved
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(json.dumps({"text": "hello world"}) + "\n" + json.dumps({"text": "the cat sat"}) + "\n")
    cfg = DataConfig(source="text", path=str(corpus), tokenizer=str(tmp_path / "tok"), seq_len=2)
    expected = [vocab["hello"], vocab["world"], vocab["<eos>"], vocab["the"], vocab["cat"], vocab["sat"]]
    assert load_tokens(cfg).tolist() == expected  # no BOS/EOS added inside documents
    validate_data(cfg, vocab_size=len(vocab))
    with pytest.raises(ValueError, match="model.vocab_size"):
        validate_data(cfg, vocab_size=len(vocab) - 1)


def test_token_data_is_read_with_the_tokenizer_that_prepared_it(tmp_path):
    """data=tokens: data.tokenizer=null is the tokenizer that prepared the data (a checkpoint carries it, and
    generation and export read the model's ids with it); another tokenizer, for the data, a mixture's dataset or
    the held-out set, is refused by name (it trained without a word, and exports carried 'bytes')."""
    from fsdp_speedloader.app.config import TrainConfig
    from fsdp_speedloader.app.prepare import run as prepare

    vocab = _write_tiny_hf_tokenizer(tmp_path / "tok")
    (tmp_path / "docs.txt").write_text("hello world the cat sat " * 40)
    prepare([str(tmp_path / "docs.txt")], tmp_path / "hf", tokenizer_name=str(tmp_path / "tok"), progress_bar=False)
    prepare([str(tmp_path / "docs.txt")], tmp_path / "by", tokenizer_name="bytes", progress_bar=False)
    data = {"source": "tokens", "path": str(tmp_path / "hf"), "tokenizer": None, "seq_len": 4}
    cfg = TrainConfig.from_dict({"model": {"name": "llama_tiny"}, "data": data})
    assert cfg.data.tokenizer == str(tmp_path / "tok")  # not 'bytes'
    check_prepared_with(cfg.data)
    refused = r"^data\.tokenizer: '.*{}' was prepared with '.*{}' \({} tokens, EOS {}\), but this run's tokenizer '{}' "
    with pytest.raises(ValueError, match=refused.format("hf", "tok", len(vocab), vocab["<eos>"], "bytes")):
        check_prepared_with(DataConfig(**{**data, "tokenizer": "bytes"}))
    mixture = [{"path": str(tmp_path / "hf"), "weight": 1}, {"path": str(tmp_path / "by"), "weight": 1}]
    cfg = TrainConfig.from_dict({"model": {"name": "llama_tiny"}, "data": {**data, "path": None, "mixture": mixture}})
    with pytest.raises(ValueError, match=refused.format("by", "bytes", 257, 256, ".*tok")):  # not one tokenizer
        check_prepared_with(cfg.data)
    cfg = DataConfig(**{**data, "tokenizer": str(tmp_path / "tok"), "val_path": str(tmp_path / "by")})
    with pytest.raises(ValueError, match=refused.format("by", "bytes", 257, 256, ".*tok")):
        check_prepared_with(cfg)
    with pytest.raises(ValueError, match=r"^data\.val_path: token file '.*nothing' does not exist"):  # not data.path
        check_held_out(DataConfig(**{**data, "val_path": str(tmp_path / "nothing")}), vocab_size=320,
                       global_batch_size=1)


def test_text_txt_jsonl_and_directory(tmp_path):
    txt = "First paragraph, ünïcode.\n\nSecond paragraph after a blank line.\n"
    (tmp_path / "b.txt").write_text(txt, encoding="utf-8")
    docs = [{"text": "doc one", "id": 1}, {"text": "doc two ✓"}]
    (tmp_path / "a.jsonl").write_text(json.dumps(docs[0]) + "\n\n" + json.dumps(docs[1]) + "\n")
    (tmp_path / "notes.md").write_text("not part of the corpus")

    def tokens(path, **kw) -> list[int]:
        return load_tokens(DataConfig(source="text", path=str(path), seq_len=4, **kw)).tolist()

    assert tokens(tmp_path / "b.txt") == _encode(txt)  # one document: paragraphs need no EOS
    jsonl = _encode("doc one") + [EOS] + _encode("doc two ✓")
    assert tokens(tmp_path / "a.jsonl") == jsonl
    assert tokens(tmp_path) == jsonl + [EOS] + _encode(txt)  # file-name order, .md ignored

    (tmp_path / "c.jsonl").write_text(json.dumps({"content": "other field"}) + "\n")
    assert tokens(tmp_path / "c.jsonl", text_field="content") == _encode("other field")


def test_text_reads_gzipped_jsonl_and_refuses_a_directory_with_files_it_would_leave_out(tmp_path):
    """data=text reads .jsonl.gz as the prepare tool does; a directory that also holds a .parquet corpus (which
    only the prepare tool reads) is refused, naming the files, instead of training on the rest without a word."""
    (tmp_path / "a.txt").write_text("plain text")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"text": "zipped one"}) + "\n" + json.dumps({"text": "zipped two"}) + "\n")

    def tokens(path) -> list[int]:
        return load_tokens(DataConfig(source="text", path=str(path), seq_len=4)).tolist()

    assert tokens(tmp_path / "b.jsonl.gz") == _encode("zipped one") + [EOS] + _encode("zipped two")
    assert tokens(tmp_path) == _encode("plain text") + [EOS] + _encode("zipped one") + [EOS] + _encode("zipped two")
    (tmp_path / "c.parquet").write_bytes(b"PAR1")
    with pytest.raises(ValueError, match=r"data\.path: directory .* holds c\.parquet, which data=text does not read "
                                         r".*fsdp-speedloader-prepare .*data=tokens"):
        validate_data(DataConfig(source="text", path=str(tmp_path)), vocab_size=320)
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(b'{"text": "x"}\n' * 100)[:30])
    with pytest.raises(ValueError, match=r"data\.path: .*cut\.jsonl\.gz' is not a complete gzip file"):
        load_tokens(DataConfig(source="text", path=str(tmp_path / "cut.jsonl.gz"), seq_len=4))


# ----- packing, sharding, resume


def test_packing_shapes_and_one_epoch_visits_every_sequence_once():
    seq_len, num_sequences = 8, 12
    tokens = np.arange(num_sequences * seq_len + 5, dtype=np.uint16)  # a 5-token tail is dropped
    loader = TokenLoader(tokens, seq_len=seq_len, batch_size=3)
    seen = []
    for _ in range(num_sequences // 3):
        batch = loader.next_batch()
        assert batch["input_ids"].shape == (3, seq_len) and batch["input_ids"].dtype == torch.int64
        assert torch.equal(batch["labels"], batch["input_ids"])
        assert batch["labels"].data_ptr() != batch["input_ids"].data_ptr()  # masking labels must not touch inputs
        seen += _sequence_ids(batch, seq_len)
    assert sorted(seen) == list(range(num_sequences))
    assert seen != list(range(num_sequences))  # shuffled
    assert loader.state_dict() == {"epoch": 1, "position": 0, "num_sequences": num_sequences,
                                   "order": "permutation", "seed": 0}


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_sharding_is_disjoint_and_covering(world_size):
    seq_len, batch_size, steps_per_epoch = 4, 2, 3
    num_sequences = world_size * batch_size * steps_per_epoch
    tokens = np.arange(num_sequences * seq_len, dtype=np.uint16)
    loaders = [TokenLoader(tokens, seq_len=seq_len, batch_size=batch_size, rank=r, world_size=world_size, seed=1)
               for r in range(world_size)]
    # One rank taking the whole global batch sees the same rows, in rank order.
    single = TokenLoader(tokens, seq_len=seq_len, batch_size=world_size * batch_size, seed=1)
    epoch = []
    for _ in range(steps_per_epoch):
        batches = [loader.next_batch() for loader in loaders]
        assert torch.equal(torch.cat([b["input_ids"] for b in batches]), single.next_batch()["input_ids"])
        step = [i for b in batches for i in _sequence_ids(b, seq_len)]
        assert len(set(step)) == len(step) == world_size * batch_size  # disjoint within the step
        epoch += step
    assert sorted(epoch) == list(range(num_sequences))  # the ranks cover the epoch
    assert all(loader.state_dict() == loaders[0].state_dict() for loader in loaders)


@pytest.mark.parametrize("k", [0, 1, 4, 7])
def test_resume_gives_the_uninterrupted_batches(k):
    tokens = np.random.default_rng(0).integers(0, 257, size=10 * 16 + 7).astype(np.uint16)
    kwargs = dict(seq_len=16, batch_size=3, rank=1, world_size=2, seed=7)  # global batch 6 of 10 sequences
    uninterrupted = TokenLoader(tokens, **kwargs)
    for _ in range(k):
        uninterrupted.next_batch()
    state = json.loads(json.dumps(uninterrupted.state_dict()))  # plain ints survive JSON
    assert all(type(v) is int for k, v in state.items() if k != "order") and state["order"] == "permutation"
    resumed = TokenLoader(tokens, **kwargs)
    resumed.load_state_dict(state)
    for _ in range(5):  # crosses epoch boundaries
        expected, got = uninterrupted.next_batch(), resumed.next_batch()
        assert torch.equal(expected["input_ids"], got["input_ids"])
        assert torch.equal(expected["labels"], got["labels"])

    other_corpus = TokenLoader(tokens, **{**kwargs, "seq_len": 8})
    with pytest.raises(ValueError, match="data.seq_len"):
        other_corpus.load_state_dict(state)
    with pytest.raises(ValueError, match=r"^data\.seed: the checkpoint's loader drew its order with data\.seed=7, "
                                         r"this run has 8; resume with data\.seed=7"):  # the epoch's order differs
        TokenLoader(tokens, **{**kwargs, "seed": 8}).load_state_dict(state)
    TokenLoader(tokens, **{**kwargs, "seed": 8}).load_state_dict({k: v for k, v in state.items() if k != "seed"})


def test_a_corpus_smaller_than_one_global_batch_warns(caplog):
    tokens = np.arange(3 * 16, dtype=np.uint16)  # 3 sequences for a global batch of 4
    caplog.set_level("WARNING")
    TokenLoader(tokens, seq_len=16, batch_size=2, rank=0, world_size=2)
    assert [r.getMessage() for r in caplog.records] == [
        "data: the corpus gives 3 sequences of data.seq_len=16, fewer than one global batch of 4: every step repeats "
        "sequences (an epoch is shorter than a step); use a larger corpus or a smaller batch"]
    caplog.clear()
    TokenLoader(tokens, seq_len=16, batch_size=3)
    assert not caplog.records


def test_epoch_wrap_reshuffles():
    seq_len, num_sequences = 4, 10
    loader = TokenLoader(np.arange(num_sequences * seq_len), seq_len=seq_len, batch_size=4, seed=3)
    ids = [i for _ in range(5) for i in _sequence_ids(loader.next_batch(), seq_len)]  # 20 = two epochs
    first, second = ids[:num_sequences], ids[num_sequences:]
    assert sorted(first) == sorted(second) == list(range(num_sequences))
    assert first != second  # a new order per epoch
    assert loader.state_dict()["epoch"] == 2 and loader.state_dict()["position"] == 0


def test_fewer_sequences_than_one_global_batch():
    seq_len = 4
    tokens = np.arange(3 * seq_len + 1)
    loaders = [TokenLoader(tokens, seq_len=seq_len, batch_size=2, rank=r, world_size=2) for r in range(2)]
    ids = [i for _ in range(3) for loader in loaders for i in _sequence_ids(loader.next_batch(), seq_len)]
    assert len(ids) == 12 and sorted(ids[:3]) == [0, 1, 2] and sorted(ids[3:6]) == [0, 1, 2]  # wraps epochs
    assert loaders[0].state_dict()["epoch"] == 4

    one = TokenLoader(np.arange(5), seq_len=seq_len, batch_size=3)  # a single sequence
    assert torch.equal(one.next_batch()["input_ids"], torch.arange(seq_len).expand(3, seq_len))


def test_synthetic_is_deterministic_and_resumable():
    kwargs = dict(vocab_size=50, seq_len=8, batch_size=2, world_size=2, seed=3)
    first = [SyntheticLoader(rank=0, **kwargs).next_batch()["input_ids"]]
    loader = SyntheticLoader(rank=0, **kwargs)
    batches = [loader.next_batch()["input_ids"] for _ in range(4)]
    assert torch.equal(batches[0], first[0])
    assert all(b.shape == (2, 8) and b.dtype == torch.int64 and 0 <= b.min() and b.max() < 50 for b in batches)
    assert not torch.equal(batches[0], batches[1])  # steps differ
    assert not torch.equal(batches[0], SyntheticLoader(rank=1, **kwargs).next_batch()["input_ids"])  # ranks differ
    assert not torch.equal(batches[0], SyntheticLoader(rank=0, **{**kwargs, "seed": 4}).next_batch()["input_ids"])

    resumed = SyntheticLoader(rank=0, **kwargs)
    resumed.load_state_dict(json.loads(json.dumps({"step": 2})))
    assert all(torch.equal(resumed.next_batch()["input_ids"], b) for b in batches[2:])

    cfg = DataConfig(source="synthetic", seq_len=8, seed=3)
    built = build_loader(cfg, vocab_size=50, batch_size=2, rank=0, world_size=2)
    assert isinstance(built, SyntheticLoader) and torch.equal(built.next_batch()["input_ids"], batches[0])


def test_legacy_checkpoint_state_resumes_on_its_permutation_order():
    """A loader state of token files saved before the keyed order (no "order" key) resumes mid-epoch on the order
    array that run drew: the same sequences that the earlier code would have given."""
    tokens = np.arange(20 * 4)
    resumed = TokenLoader(tokens, seq_len=4, batch_size=3, seed=7, order="keyed")
    resumed.load_state_dict({"epoch": 2, "position": 5, "num_sequences": 20})
    legacy_order = np.random.default_rng((7, 2)).permutation(20)
    assert _sequence_ids(resumed.next_batch(), 4) == legacy_order[5:8].tolist()
    assert resumed.state_dict()["order"] == "permutation"


# ----- errors that name what to change


def _token_file(path: Path, num_tokens: int, vocab_size: int, *, sidecar: bool = True) -> str:
    np.zeros(num_tokens, dtype="<u2").tofile(path)
    if sidecar:
        meta = {"dtype": "uint16", "vocab_size": vocab_size, "num_tokens": num_tokens, "tokenizer": "test"}
        Path(f"{path}.json").write_text(json.dumps(meta))
    return str(path)


@pytest.mark.parametrize("source, trains_on", [("default", "the corpus bundled"), ("synthetic", "random tokens")])
def test_a_path_the_source_would_ignore_is_refused(source, trains_on):
    """``data.path=my.txt`` without ``data=text`` would train on other tokens than the user's: refused, naming the
    groups that read a path (a held-out ``val_path`` beside the default corpus stays allowed: it is read as text)."""
    with pytest.raises(ValueError, match=rf"data\.path: data\.source='{source}' reads no data\.path \(it trains on "
                                         rf"{trains_on}.*add data=text .* or data=tokens"):
        DataConfig(source=source, path="my_corpus.txt")
    assert DataConfig(val_path="held_out.txt").val_path == "held_out.txt"


def test_errors_name_the_field_to_change(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("only a few bytes")
    (tmp_path / "missing_field.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    (tmp_path / "no_text").mkdir()
    cases = [
        (DataConfig(source="text", path=str(tmp_path / "nope.txt")), r"data\.path: .*does not exist"),
        (DataConfig(source="text", path=str(tmp_path / "empty.txt")), r"data\.path: .*is empty"),
        (DataConfig(source="text", path=str(tmp_path / "no_text")),
         r"data\.path: .*no \.txt, \.jsonl or \.jsonl\.gz"),
        (DataConfig(source="text", path=str(tmp_path / "missing_field.jsonl")), r"data\.text_field: .*line 2: no field 'text'"),
        (DataConfig(source="text", path=str(tmp_path / "bad.jsonl")), r"data\.path: .*line 1: not valid JSON"),
        (DataConfig(source="text", path=str(tmp_path / "short.txt"), seq_len=64), r"data\.seq_len: .*16 tokens"),
        (DataConfig(seq_len=10**7), r"data\.seq_len: the default corpus"),
        (DataConfig(tokenizer=str(tmp_path / "no_tokenizer")), r"data\.tokenizer: .*existing directory"),
        (DataConfig(source="tokens", path=str(tmp_path / "nope.bin")), r"data\.path: .*does not exist"),
        (DataConfig(source="tokens", path=_token_file(tmp_path / "bare.bin", 100, 257, sidecar=False)),
         r"data\.path: .*no sidecar .*fsdp-speedloader-prepare"),
        (DataConfig(source="tokens", path=_token_file(tmp_path / "big_vocab.bin", 100, 1000)),
         r"model\.vocab_size: .*vocab_size=1000"),
        (DataConfig(source="tokens", path=_token_file(tmp_path / "short.bin", 10, 257), seq_len=64),
         r"data\.seq_len: .*10 tokens"),
    ]
    for cfg, message in cases:
        with pytest.raises(ValueError, match=message):
            validate_data(cfg, vocab_size=320)

    with pytest.raises(ValueError, match=r"model\.vocab_size: data\.tokenizer='bytes' has 257 tokens"):
        validate_data(DataConfig(), vocab_size=100)
    Path(f"{tmp_path / 'big_vocab.bin'}.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 257,
                                                                       "num_tokens": 99, "tokenizer": "test"}))
    with pytest.raises(ValueError, match=r"data\.path: .*200 bytes but its sidecar promises 99"):
        validate_data(DataConfig(source="tokens", path=str(tmp_path / "big_vocab.bin")), vocab_size=320)
    with pytest.raises(ValueError, match=r"data\.seed"):
        TokenLoader(np.arange(10), seq_len=4, batch_size=1, seed=-1)
