"""fsdp-speedloader-prepare: every input kind, both tokenizer kinds, workers, resume, and bad input (CPU, fast)."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fsdp_speedloader.app.config import DataConfig
from fsdp_speedloader.app.data import ByteTokenizer, TokenLoader, build_loader, build_tokenizer, load_tokens
from fsdp_speedloader.app.prepare import main, run
from fsdp_speedloader.app.token_shards import TokenDirectory, read_index

REPO = Path(__file__).resolve().parents[1]
EOS = ByteTokenizer.eos_token_id
TXT = "A text file, with ünïcode.\n\nAnd a second paragraph.\n" * 40


def _documents(n: int, tag: str) -> list[str]:
    return [f"{tag} document {i} ✓ " + "word " * (i % 7) for i in range(n)]


def _corpus(root: Path) -> dict[str, list[str]]:
    """One file of every kind; returns each file's documents (a .txt file is one document)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    docs = {"a.txt": [TXT], "b.jsonl": _documents(30, "b"), "c.jsonl.gz": _documents(25, "c"),
            "d.parquet": _documents(40, "d")}
    (root / "a.txt").write_text(TXT)
    # A blank line and an empty text are skipped: neither is a document.
    lines = [json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(docs["b.jsonl"])]
    (root / "b.jsonl").write_text("".join(lines) + "\n" + json.dumps({"text": ""}) + "\n")
    with gzip.open(root / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in docs["c.jsonl.gz"])
    pq.write_table(pa.table({"text": docs["d.parquet"], "n": list(range(40))}), root / "d.parquet", row_group_size=16)
    return docs


def _expected_stream(docs: dict[str, list[str]], encode) -> tuple[np.ndarray, list[int]]:
    """Every document's ids followed by EOS, in file-name order; and where each document starts."""
    ids, starts = [], []
    for name in sorted(docs):
        for text in docs[name]:
            starts.append(len(ids))
            ids.extend(encode(text) + [EOS])
    return np.array(ids), starts


def _shard_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.suffix in (".bin", ".npy")}


def test_every_input_kind_with_the_byte_tokenizer(tmp_path):
    docs = _corpus(tmp_path / "corpus")
    # Small shards: documents and packed sequences run across shard boundaries.
    index = run([str(tmp_path / "corpus")], tmp_path / "out", tokenizer_name="bytes", shard_tokens=300,
                workers=1, progress_bar=False)
    expected, starts = _expected_stream(docs, ByteTokenizer().encode)
    stream = TokenDirectory(tmp_path / "out")
    assert (index["num_tokens"], index["num_documents"], index["dtype"]) == (len(expected), len(starts), "uint16")
    assert (index["vocab_size"], index["eos_token_id"], index["tokenizer"]) == (257, EOS, "bytes")
    assert len(index["shards"]) > 4 and read_index(tmp_path / "out") == index
    np.testing.assert_array_equal(stream.read(0, len(stream)), expected)
    np.testing.assert_array_equal(stream.document_starts(0, len(stream)), starts)
    np.testing.assert_array_equal(stream.document_starts(1000, 1500), [s for s in starts if 1000 <= s < 1500])

    # The .txt and .jsonl files alone: the same stream as data=text gives, plus the last document's EOS.
    flat = tmp_path / "flat"
    flat.mkdir()
    for name in ("a.txt", "b.jsonl"):
        (flat / name).write_bytes((tmp_path / "corpus" / name).read_bytes())
    run([str(flat)], tmp_path / "flat_out", tokenizer_name="bytes", shard_tokens=500, workers=1, progress_bar=False)
    from_text = load_tokens(DataConfig(source="text", path=str(flat)))
    np.testing.assert_array_equal(load_tokens(DataConfig(source="tokens", path=str(tmp_path / "flat_out")))
                                  .read(0, len(from_text) + 1), np.append(from_text, EOS))

    # The loader reads a directory exactly as it reads the same ids in memory.
    cfg = DataConfig(source="tokens", path=str(tmp_path / "out"), seq_len=64, seed=3)
    from_dir = build_loader(cfg, vocab_size=300, batch_size=4, rank=1, world_size=2)
    in_memory = TokenLoader(expected, seq_len=64, batch_size=4, rank=1, world_size=2, seed=3, order="keyed")
    for _ in range(12):  # past one epoch
        assert torch.equal(from_dir.next_batch()["input_ids"], in_memory.next_batch()["input_ids"])


def test_workers_write_what_one_worker_writes(tmp_path):
    _corpus(tmp_path / "corpus")
    one = run([str(tmp_path / "corpus")], tmp_path / "one", tokenizer_name="bytes", shard_tokens=300, workers=1,
              progress_bar=False)
    two = run([str(tmp_path / "corpus" / "*.*")], tmp_path / "two", tokenizer_name="bytes", shard_tokens=300,
              workers=2, progress_bar=False)
    assert one["shards"] == two["shards"]
    assert _shard_bytes(tmp_path / "one") == _shard_bytes(tmp_path / "two")


def test_local_hugging_face_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "<eos>", "b", "c", "d", "document", "word", "✓"])}
    vocab.update({str(i): len(vocab) + i for i in range(40)})
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="[UNK]").save_pretrained(
        tmp_path / "tok")
    docs = _corpus(tmp_path / "corpus")
    index = run([str(tmp_path / "corpus")], tmp_path / "out", tokenizer_name=str(tmp_path / "tok"), shard_tokens=100,
                workers=2, progress_bar=False)
    tokenizer = build_tokenizer(str(tmp_path / "tok"))
    ids, _ = _expected_stream(docs, lambda t: tokenizer.encode(t, add_special_tokens=False))
    ids[ids == EOS] = vocab["<eos>"]  # _expected_stream writes the byte tokenizer's EOS
    assert (index["eos_token_id"], index["vocab_size"]) == (vocab["<eos>"], len(tokenizer))
    stream = TokenDirectory(tmp_path / "out")
    np.testing.assert_array_equal(stream.read(0, len(stream)), ids)


def test_resume_skips_recorded_shards_and_redoes_a_partial_one(tmp_path):
    """An interruption leaves complete shards recorded and the shard in progress as .bin.tmp; the same command
    skips the recorded ones (not rewritten) and writes the rest exactly as an uninterrupted run."""
    _corpus(tmp_path / "corpus")
    kwargs = dict(tokenizer_name="bytes", shard_tokens=200, workers=1, progress_bar=False)
    whole = run([str(tmp_path / "corpus")], tmp_path / "whole", **kwargs)

    out = tmp_path / "out"
    run([str(tmp_path / "corpus")], out, **kwargs)
    # What an interruption in file 1 (b.jsonl) after its second shard leaves on disk:
    record_path = out / "progress" / "000001.json"
    record = json.loads(record_path.read_text())
    assert len(record["shards"]) > 3
    for shard in record["shards"][2:]:
        (out / shard["file"]).unlink()
    (out / f"{record['shards'][2]['file']}.tmp").write_bytes(b"\x01\x02partial")
    record_path.write_text(json.dumps({**record, "shards": record["shards"][:2], "done": False}))
    for later in ("000002.json", "000003.json"):
        (out / "progress" / later).unlink()
    (out / "index.json").unlink()
    kept = {p: p.stat().st_ino for p in [out / record["shards"][0]["file"], out / "000000-00000.bin"]}
    with pytest.raises(ValueError, match="did not finish: run the same prepare command again"):
        TokenDirectory(out)

    resumed = run([str(tmp_path / "corpus")], out, **kwargs)
    assert resumed["shards"] == whole["shards"]
    assert _shard_bytes(out) == _shard_bytes(tmp_path / "whole")
    assert {p: p.stat().st_ino for p in kept} == kept  # skipped, not rewritten
    assert not list(out.glob("*.tmp"))


def test_a_failed_run_resumes_after_the_input_is_fixed(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in _documents(50, "a")))
    (corpus / "b.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    kwargs = dict(tokenizer_name="bytes", shard_tokens=100, workers=1, progress_bar=False)
    with pytest.raises(ValueError, match=r"b\.jsonl: line 2: no field 'text'"):
        run([str(corpus)], tmp_path / "out", **kwargs)
    first = tmp_path / "out" / "000000-00000.bin"
    inode = first.stat().st_ino
    (corpus / "b.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": "now fixed"}) + "\n")
    index = run([str(corpus)], tmp_path / "out", **kwargs)
    assert first.stat().st_ino == inode  # a.jsonl was done: not tokenized again
    assert index == run([str(corpus)], tmp_path / "fresh", **kwargs)


def test_a_rerun_after_an_input_shrank_removes_the_shards_it_no_longer_lists(tmp_path):
    """The same command after an input lost documents writes fewer parts: the old higher parts (and a leftover
    .tmp) are deleted, so the directory holds what a fresh prepare writes; files of other names stay."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in _documents(60, "a")))
    (corpus / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in _documents(20, "b")))
    kwargs = dict(tokenizer_name="bytes", shard_tokens=200, workers=1, progress_bar=False)
    out = tmp_path / "out"
    before = run([str(corpus)], out, **kwargs)
    (out / "notes.txt").write_text("keep me")
    (out / "000000-00099.bin.bak").write_text("not a shard name: kept")
    (out / "000001-00042.bin.tmp").write_bytes(b"left over")
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in _documents(4, "a")))

    index = run([str(corpus)], out, **kwargs)
    assert len(index["shards"]) < len(before["shards"])
    assert index == run([str(corpus)], tmp_path / "fresh", **kwargs)
    assert _shard_bytes(out) == _shard_bytes(tmp_path / "fresh")
    listed = {name for s in index["shards"] for name in (s["file"], s["document_starts"])}
    assert {p.name for p in out.iterdir()} == listed | {"index.json", "progress", "notes.txt", "000000-00099.bin.bak"}
    assert len(TokenDirectory(out)) == index["num_tokens"]


def _fail(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--no-progress"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_bad_input_is_one_line_naming_file_and_line(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "missing.jsonl").write_text(json.dumps({"text": "a"}) + "\n\n" + json.dumps({"body": "b"}) + "\n")
    (tmp_path / "latin1.jsonl").write_bytes(json.dumps({"text": "ok"}).encode() + b"\n" + b'{"text": "caf\xe9"}\n')
    (tmp_path / "latin1.txt").write_bytes(b"line one\nline two\ncaf\xe9\n")
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "a"}) + "\n{not json\n")
    (tmp_path / "number.jsonl").write_text(json.dumps({"text": 3}) + "\n")
    (tmp_path / "blank.jsonl").write_text("\n" + json.dumps({"text": ""}) + "\n")
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip at all")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocol.parquet")
    pq.write_table(pa.table({"text": ["x", None]}), tmp_path / "null.parquet")
    (tmp_path / "notes.md").write_text("# not an input kind")
    out = str(tmp_path / "out")
    cases = [
        ("missing.jsonl", r"missing\.jsonl: line 3: no field 'text' \(found \['body'\]\); pass --text-field"),
        ("latin1.jsonl", r"latin1\.jsonl: line 2: not UTF-8"),
        ("latin1.txt", r"latin1\.txt: line 3: not UTF-8"),
        ("empty.txt", r"empty\.txt is empty \(0 bytes\); nothing to prepare"),
        ("bad.jsonl", r"bad\.jsonl: line 2: not valid JSON"),
        ("number.jsonl", r"number\.jsonl: line 1: field 'text' holds a number, not a string"),
        ("blank.jsonl", r"blank\.jsonl: line 2: no line holds any text"),
        ("bad.jsonl.gz", r"bad\.jsonl\.gz: line 1: not a readable gzip file"),
        ("nocol.parquet", r"nocol\.parquet: row 1: no column 'text' \(found \['body'\]\)"),
        ("null.parquet", r"null\.parquet: row 2: column 'text' is null"),
        ("notes.md", r"notes\.md: not a .* file"),
        ("nowhere/*.jsonl", r"matches no"),
    ]
    for name, message in cases:
        err = _fail(capsys, [str(tmp_path / name), "--output", f"{out}_{name.replace('/', '_')}"])
        assert re.search(message, err), (name, err)
    err = _fail(capsys, [str(tmp_path / "missing.jsonl"), "-o", out, "--text-field", "body"])
    assert "line 1: no field 'body'" in err

    # An output started with other settings, or holding other files, is refused and left alone.
    (tmp_path / "good.jsonl").write_text(json.dumps({"text": "fine"}) + "\n")
    run([str(tmp_path / "good.jsonl")], tmp_path / "done", tokenizer_name="bytes", workers=1, progress_bar=False)
    err = _fail(capsys, [str(tmp_path / "good.jsonl"), "-o", str(tmp_path / "done"), "--shard-tokens", "7"])
    assert "other shard_tokens; use a new --output" in err
    assert (tmp_path / "done" / "index.json").is_file()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert "not empty and holds no prepare progress" in _fail(capsys, [str(tmp_path / "good.jsonl"), "-o",
                                                                      str(tmp_path / "mine")])
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert _fail(capsys, [str(tmp_path / "good.jsonl"), "-o", out, "--tokenizer", str(tmp_path / "no_tokenizer")]
                 ).startswith("error: --tokenizer: ")  # the flag this command takes, not training's data.tokenizer


def test_an_empty_input_file_is_skipped_with_a_warning(tmp_path, capsys):
    """A 0-byte file among the inputs holds no documents: a warning names it and the rest is prepared as if it
    were not there; only a prepare whose every input is empty is refused (one line)."""
    _corpus(tmp_path / "corpus")
    kwargs = dict(tokenizer_name="bytes", shard_tokens=200, workers=1, progress_bar=False)
    without = run([str(tmp_path / "corpus")], tmp_path / "without", **kwargs)
    for name in ("0-empty.txt", "b2-empty.jsonl", "e-empty.jsonl.gz"):
        (tmp_path / "corpus" / name).write_bytes(b"")
    capsys.readouterr()
    index = run([str(tmp_path / "corpus")], tmp_path / "with", **kwargs)
    assert index == without and _shard_bytes(tmp_path / "with") == _shard_bytes(tmp_path / "without")
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 3 and all("is empty (0 bytes); skipped" in w for w in warnings), warnings
    assert "b2-empty.jsonl" in warnings[1]

    (tmp_path / "none").mkdir()
    for name in ("a.txt", "b.jsonl"):
        (tmp_path / "none" / name).write_bytes(b"")
    err = _fail(capsys, [str(tmp_path / "none"), "-o", str(tmp_path / "out")])
    assert re.search(r"error: all 2 input files \(.*a\.txt, \.\.\.\) are empty \(0 bytes\); nothing to prepare", err)


def test_a_prepare_that_failed_before_its_first_shard_starts_over_with_the_corrected_settings(tmp_path, capsys):
    # The first try names no --text-field and fails on line 1: nothing was written to resume, so the corrected
    # command runs (it was refused as "started with other text_field"). One with a complete shard is still refused.
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"content": t}) + "\n" for t in _documents(5, "c")))
    out = tmp_path / "out"
    assert "no field 'text' (found ['content'])" in _fail(capsys, [str(tmp_path / "c.jsonl"), "-o", str(out)])
    index = run([str(tmp_path / "c.jsonl")], out, tokenizer_name="bytes", text_field="content", workers=1,
                progress_bar=False)
    assert index["num_documents"] == 5 and (out / "index.json").is_file()
    assert "other text_field; use a new --output" in _fail(capsys, [str(tmp_path / "c.jsonl"), "-o", str(out)])
    assert (out / "index.json").is_file()


@pytest.mark.slow
def test_module_entry_point(tmp_path):
    """``python -m fsdp_speedloader.app.prepare`` as a user runs it: a summary, exit 0; the progress bar where
    stderr is a terminal or FSDP_SPEEDLOADER_PROGRESS=1 asks for it, not in a redirected log."""
    _corpus(tmp_path / "corpus")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("FSDP_SPEEDLOADER_PROGRESS", None)

    def prepare(out: str, **extra_env) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "fsdp_speedloader.app.prepare", str(tmp_path / "corpus"),
                               "--output", str(tmp_path / out), "--workers", "2"], env={**env, **extra_env},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done

    done = prepare("out", FSDP_SPEEDLOADER_PROGRESS="1")
    assert "prepare (2 worker(s))" in done.stderr and "100%" in done.stderr
    assert f"data.path={tmp_path / 'out'}" in done.stdout and f"{1 + 30 + 25 + 40} documents" in done.stdout
    assert read_index(tmp_path / "out")["num_documents"] == 1 + 30 + 25 + 40
    quiet = prepare("out2")  # stderr is a pipe here
    assert "\r" not in quiet.stderr and "100%" not in quiet.stderr, quiet.stderr


def test_a_bin_file_of_the_earlier_format_still_loads(tmp_path):
    tokens = np.random.default_rng(1).integers(0, 257, 1000).astype("<u2")
    tokens.tofile(tmp_path / "train.bin")
    (tmp_path / "train.bin.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 257, "num_tokens": 1000,
                                                         "tokenizer": "bytes"}))
    loader = build_loader(DataConfig(source="tokens", path=str(tmp_path / "train.bin"), seq_len=16, seed=2),
                          vocab_size=257, batch_size=4, rank=1, world_size=2)
    in_memory = TokenLoader(tokens, seq_len=16, batch_size=4, rank=1, world_size=2, seed=2, order="keyed")
    for _ in range(10):
        assert torch.equal(loader.next_batch()["input_ids"], in_memory.next_batch()["input_ids"])


def test_an_id_past_the_vocabulary_is_one_error_naming_the_file_when_it_is_read(tmp_path):
    """A shard holding an id >= the index's vocab_size (written by hand, or with another tokenizer) fails when a
    batch reads it, naming the file, the id and the vocab_size (a UserError: one line at the entry point), not as
    an IndexError inside the model's embedding."""
    from fsdp_speedloader.app.launch import UserError

    _corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    index = run([str(tmp_path / "corpus")], out, tokenizer_name="bytes", shard_tokens=200, workers=1,
                progress_bar=False)
    bad = out / index["shards"][3]["file"]
    tokens = np.fromfile(bad, dtype="<u2")
    tokens[5] = 5000
    tokens.tofile(bad)
    message = rf"data.path: token file '{re.escape(str(bad))}' holds id 5000 .* >= vocab_size=257 of its index"
    with pytest.raises(UserError, match=message):
        TokenDirectory(out).read(0, index["num_tokens"])
    loader = build_loader(DataConfig(source="tokens", path=str(out), seq_len=16), vocab_size=320, batch_size=8)
    with pytest.raises(UserError, match=message):
        for _ in range(loader.num_sequences // 8 + 1):  # an epoch: every sequence is read once
            loader.next_batch()

    tokens.tofile(tmp_path / "train.bin")  # the earlier format: the sidecar's vocab_size
    (tmp_path / "train.bin.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 257,
                                                         "num_tokens": len(tokens), "tokenizer": "bytes"}))
    with pytest.raises(UserError, match=r"train\.bin' holds id 5000 .* >= vocab_size=257 of its sidecar"):
        load_tokens(DataConfig(source="tokens", path=str(tmp_path / "train.bin"))).read(0, len(tokens))


def test_errors_found_while_reading_name_the_setting_that_gave_the_files(tmp_path):
    """A mixture's dataset and the held-out set are read as data.path is; what goes wrong mid-run (a shard cut
    short after its index was written, an id past the vocabulary) names their own setting, as a UserError (one line
    at the entry point, not a traceback)."""
    from fsdp_speedloader.app.data import load_val_tokens
    from fsdp_speedloader.app.launch import UserError

    _corpus(tmp_path / "corpus")
    for name in ("a", "b"):
        run([str(tmp_path / "corpus")], tmp_path / name, tokenizer_name="bytes", shard_tokens=200, workers=1,
            progress_bar=False)
    index = json.loads((tmp_path / "b" / "index.json").read_text())
    cut = tmp_path / "b" / index["shards"][-1]["file"]
    mixture = [{"path": str(tmp_path / "a"), "weight": 0.5}, {"path": str(tmp_path / "b"), "weight": 0.5}]
    loader = build_loader(DataConfig(source="tokens", path=None, mixture=mixture, seq_len=16), vocab_size=320,
                          batch_size=8)
    cut.write_bytes(cut.read_bytes()[:10])  # changed after its index was written (and checked, at setup)
    with pytest.raises(UserError, match=rf"^data\.mixture\[1\]\.path: '{re.escape(str(cut))}' ended early"):
        for _ in range(4 * index["num_tokens"] // (16 * 8)):  # both datasets' epochs, and then some
            loader.next_batch()
    bad = tmp_path / "a" / index["shards"][0]["file"]
    tokens = np.fromfile(bad, dtype="<u2")
    tokens[3] = 5000
    tokens.tofile(bad)
    with pytest.raises(UserError, match=rf"^data\.val_path: token file '{re.escape(str(bad))}' holds id 5000"):
        load_val_tokens(DataConfig(source="tokens", path=str(tmp_path / "b"), val_path=str(tmp_path / "a"),
                                   seq_len=16))


def _forked_children(pid: int) -> list[int]:
    """Children of ``pid`` running its command line (fork()ed workers, not a helper process it started)."""
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and (stat.parent / "cmdline").read_bytes() == cmdline:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):  # a process that ended while we looked
            continue
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the workers through /proc")
def test_a_killed_worker_stops_the_run_and_the_same_command_finishes_it(tmp_path):
    """A real interruption: a worker SIGKILLed mid-run (what the out-of-memory killer does) ends the run with one
    line, exit 1, no index; the same command then resumes and writes what an uninterrupted run writes."""
    import signal
    import time

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    block = "".join(json.dumps({"text": t * 20}) + "\n" for t in _documents(500, "x"))
    for name in ("a.jsonl", "b.jsonl"):
        (corpus / name).write_text(block * 40)  # about 20 MB each
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "fsdp_speedloader.app.prepare", str(corpus), "--output", str(out), "--workers",
               "2", "--shard-tokens", str(2**20), "--no-progress"]
    # Its own session: if the test fails midway, the run and its workers are stopped together.
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not any(json.loads(p.read_text())["shards"] for p in (out / "progress").glob("0*.json")):
            assert proc.poll() is None, "the run ended before it could be interrupted"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(_forked_children(proc.pid)[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 1, err
    assert err.strip().splitlines()[-1].startswith("error: a worker process died")
    assert not (out / "index.json").exists()

    resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    whole = run([str(corpus)], tmp_path / "whole", tokenizer_name="bytes", shard_tokens=2**20, workers=1,
                progress_bar=False)
    assert read_index(out)["shards"] == whole["shards"]
    assert _shard_bytes(out) == _shard_bytes(tmp_path / "whole")
