"""Tokenizes local text into a token directory for ``data=tokens`` (format: ``app/token_shards.py``).

    fsdp-speedloader-prepare --output data/web corpus/ --tokenizer bytes
    fsdp-speedloader-prepare --output data/web 'dump/**/*.jsonl.gz' more.parquet --tokenizer /models/llama/ --workers 8
    fsdp-speedloader-train data=tokens data.path=data/web

(``python -m fsdp_speedloader.app.prepare`` is the same command.) INPUTS are files, directories (searched
recursively) or glob patterns of .txt (one document per file), .jsonl / .jsonl.gz (one document per line, its
text in --text-field) and .parquet (one document per row, column --text-field) files; the token stream keeps
their order (each argument's files sorted by path). Every document is followed by the tokenizer's EOS.

Each input file goes to one worker process, which streams it (a line, a row or a piece of about 1 MB of a
.txt file at a time) and writes its own shards of about --shard-tokens tokens, so memory stays bounded
whatever the file sizes. Resume: a shard is recorded in <output>/progress/ only once it is complete, with
how far into its input file it reaches; after an interruption, the same command skips what is recorded and
redoes the rest (a partly written shard included). index.json is written last: training refuses a directory
without it. Bad input (a missing field, a line that is not UTF-8 or not JSON) stops the run with one line naming
the file and line, exit status 2; an empty (0-byte) file is skipped with a warning, unless every input is empty.
"""

from __future__ import annotations

import argparse
import array
import itertools
import json
import multiprocessing
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from fsdp_speedloader.app.data import ByteTokenizer, build_tokenizer
from fsdp_speedloader.app.logger import progress_bar_enabled
from fsdp_speedloader.app.prepare_inputs import InputError, Reader, Unit, find_inputs
from fsdp_speedloader.app.token_shards import INDEX_FILE, TOKEN_DTYPES, token_dtype, write_index, write_json_atomic

PROGRESS_DIR = "progress"
SETTINGS_FILE = "settings.json"
DEFAULT_SHARD_TOKENS = 1 << 26
SHARD_NAME = re.compile(r"\d{6,}-\d{5,}\.(bin|docs\.npy)(\.tmp)?")  # <input file number>-<part>, as _ShardWriter names
_BATCH_CHARS = 1 << 20  # text per tokenizer call: large enough to amortise the call, small enough to bound memory
_BATCH_UNITS = 4096


class WorkerDied(RuntimeError):
    """A worker process ended before its file was done: not the input's fault; a rerun resumes."""


# ---------------------------------------------------------------------------------------------
# Tokenizing a batch of units into one array
# ---------------------------------------------------------------------------------------------


def encode_units(tokenizer: Any, units: list[Unit], dtype: np.dtype, eos: int) -> tuple[np.ndarray, np.ndarray]:
    """The ids of ``units`` in order, EOS after each document's last unit: (num_tokens,); and the offset in it
    where each unit ends: (len(units),)."""
    texts = [u.text for u in units]
    if isinstance(tokenizer, ByteTokenizer):
        encoded = [t.encode("utf-8") for t in texts]
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        flat = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    else:
        ids = _hf_encode_batch(tokenizer, texts)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()))
    ends = np.array([u.ends_document for u in units])
    tokens = np.insert(flat.astype(dtype, copy=False), np.cumsum(lengths)[ends], eos)
    return tokens, np.cumsum(lengths + ends)  # a unit's length counts the EOS it ends with


def _hf_encode_batch(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    # The Rust tokenizer of a fast Hugging Face tokenizer, as transformers configured it, without the Python
    # per-call layer; no special tokens (EOS goes between documents).
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


# ---------------------------------------------------------------------------------------------
# A worker: one input file -> its shards, recorded one by one
# ---------------------------------------------------------------------------------------------


@dataclass
class Settings:
    tokenizer: str
    text_field: str
    shard_tokens: int
    vocab_size: int
    eos_token_id: int
    dtype: str


@dataclass
class FileTask:
    number: int
    path: Path
    output: Path
    settings: Settings


_worker: dict = {}  # per process: the tokenizer and the progress callback


def init_worker(tokenizer: Any, report: Callable[[int, int], None]) -> None:
    """Sets this process's tokenizer and ``report(bytes, tokens)`` (progress) for :func:`prepare_file`."""
    _worker.update(tokenizer=tokenizer, report=report)


def _report_to_counters(counters: tuple) -> Callable[[int, int], None]:
    def report(num_bytes: int, num_tokens: int) -> None:
        for counter, n in zip(counters, (num_bytes, num_tokens)):
            with counter.get_lock():  # every worker adds to the same two counters
                counter.value += n
    return report


def _init_pool_worker(tokenizer: Any, counters: tuple) -> None:
    init_worker(tokenizer, _report_to_counters(counters))


def _prepare_numbered(task: FileTask) -> tuple[int, dict]:
    return task.number, prepare_file(task)


class _ShardWriter:
    """One shard being written: ``<name>.bin.tmp`` until complete, then renamed with its ``.docs.npy``."""

    def __init__(self, output: Path, name: str, source: str) -> None:
        self.output, self.name, self.source = output, name, source
        self.tmp = output / f"{name}.bin.tmp"
        self.file = open(self.tmp, "wb")
        self.num_tokens = 0
        self.document_starts = array.array("q")

    def write(self, tokens: np.ndarray, starts: list[int]) -> None:
        self.document_starts.extend(self.num_tokens + s for s in starts)
        self.file.write(tokens.tobytes())
        self.num_tokens += len(tokens)

    def close(self, units_done: int) -> dict:
        self.file.close()
        docs = f"{self.name}.docs.npy"
        with open(self.output / f"{docs}.tmp", "wb") as f:
            np.save(f, np.frombuffer(self.document_starts, dtype=np.int64))
        os.replace(self.output / f"{docs}.tmp", self.output / docs)
        os.replace(self.tmp, self.output / f"{self.name}.bin")
        return {"file": f"{self.name}.bin", "num_tokens": self.num_tokens,
                "num_documents": len(self.document_starts), "document_starts": docs, "source": self.source,
                "units_done": units_done}


def prepare_file(task: FileTask) -> dict:
    """Writes the shards of one input file, skipping those its progress record lists; returns the record."""
    tokenizer, report = _worker["tokenizer"], _worker["report"]
    s = task.settings
    dtype = TOKEN_DTYPES[s.dtype]
    stat = task.path.stat()
    record_path = task.output / PROGRESS_DIR / f"{task.number:06d}.json"
    identity = {"source": str(task.path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    record = json.loads(record_path.read_text()) if record_path.is_file() else None
    if record is not None and {k: record.get(k) for k in identity} != identity:
        record = None  # the input changed since: redo it (its shards are overwritten by name)
    if record is not None and record["done"]:
        report(stat.st_size, sum(sh["num_tokens"] for sh in record["shards"]))
        return record
    record = record or {**identity, "shards": [], "done": False}
    reader = Reader(task.path, s.text_field)
    skip = record["shards"][-1]["units_done"] if record["shards"] else 0
    report(0, sum(sh["num_tokens"] for sh in record["shards"]))

    writer: Optional[_ShardWriter] = None
    batch: list[Unit] = []
    reported_bytes, last_unit = 0, skip

    def flush() -> None:
        nonlocal writer, reported_bytes, last_unit
        tokens, unit_ends = encode_units(tokenizer, batch, dtype, s.eos_token_id)
        unit_starts = np.concatenate([[0], unit_ends[:-1]])
        report(reader.bytes_read - reported_bytes, len(tokens))
        reported_bytes = reader.bytes_read
        first = 0  # the first unit of the batch not yet written
        while first < len(batch):
            if writer is None:
                writer = _ShardWriter(task.output, f"{task.number:06d}-{len(record['shards']):05d}", str(task.path))
            # Units up to the first whose end fills the shard: a shard ends between units, where a resume can start.
            room = s.shard_tokens - writer.num_tokens
            last = min(int(np.searchsorted(unit_ends, unit_starts[first] + room)), len(batch) - 1)
            begin, end = int(unit_starts[first]), int(unit_ends[last])
            writer.write(tokens[begin:end], [int(unit_starts[j]) - begin for j in range(first, last + 1)
                                             if batch[j].starts_document])
            last_unit, first = batch[last].number, last + 1
            if writer.num_tokens >= s.shard_tokens:
                record["shards"].append(writer.close(units_done=last_unit))
                write_json_atomic(record_path, record)
                writer = None
        batch.clear()

    chars = 0
    for unit in reader.units(skip):
        batch.append(unit)
        chars += len(unit.text)
        if chars >= _BATCH_CHARS or len(batch) >= _BATCH_UNITS:
            flush()
            chars = 0
    if batch:
        flush()
    if writer is not None:
        record["shards"].append(writer.close(units_done=last_unit))
    report(reader.bytes_read - reported_bytes, 0)
    record["done"] = True
    write_json_atomic(record_path, record)
    return record


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def check_output(output: Path, settings: dict) -> None:
    """A new or empty directory, or one this prepare (same settings, same inputs) started, or one a prepare with
    other settings started but completed no shard of; else InputError."""
    progress = output / PROGRESS_DIR / SETTINGS_FILE
    if output.exists() and not output.is_dir():
        raise InputError(f"--output {output}: is a file; name a new or empty directory")
    if progress.is_file():
        started = json.loads(progress.read_text())
        differ = sorted(k for k in set(started) | set(settings) if started.get(k) != settings.get(k))
        # A prepare that stopped before its first shard was complete (a wrong --text-field, say, fails on line 1)
        # recorded nothing to resume: the corrected command starts it over.
        recorded = [f for f in (output / PROGRESS_DIR).glob("*.json") if f.name != SETTINGS_FILE]
        if differ and recorded:
            raise InputError(f"--output {output}: holds a prepare started with other {', '.join(differ)}; use a new "
                             "--output directory (or delete this one to start it over)")
    elif output.exists() and any(output.iterdir()):
        raise InputError(f"--output {output}: is not empty and holds no prepare progress; use a new or empty "
                         "directory (nothing in it is touched)")


def remove_unlisted_shards(output: Path, shards: list[dict]) -> list[Path]:
    """Deletes the shard files (``.bin``, ``.docs.npy``) in ``output`` that ``shards`` does not list, and any shard
    ``.tmp`` left over; returns them. A rerun after an input shrank writes fewer parts: its old higher parts would
    stay behind.

    Safe here: check_output let this run into ``output`` only as a new or empty directory or as one a prepare
    started, so a file with a shard's name is a prepare's own; every worker has finished, so no .tmp is being
    written; and index.json is written after this, so a run stopped mid-way is resumed as any other. Only names of
    the shard pattern are touched: anything else a user put there stays."""
    listed = {name for shard in shards for name in (shard["file"], shard["document_starts"])}
    stale = sorted(f for f in output.iterdir()
                   if SHARD_NAME.fullmatch(f.name) and f.name not in listed and f.is_file())
    for f in stale:
        f.unlink()
    return stale


def run(inputs: list[str], output: Path, *, tokenizer_name: str, text_field: str = "text",
        shard_tokens: int = DEFAULT_SHARD_TOKENS, workers: int = 0, progress_bar: bool = True) -> dict:
    """Prepares ``inputs`` into ``output``; returns the index. Raises InputError / ValueError on bad input."""
    # One core per worker: the worker processes are the parallelism, not the Rust tokenizer's threads.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    files = find_inputs(inputs)
    tokenizer = build_tokenizer(tokenizer_name)
    vocab_size, eos = len(tokenizer), int(tokenizer.eos_token_id)
    settings = Settings(tokenizer_name, text_field, shard_tokens, vocab_size, eos, token_dtype(vocab_size).name)
    recorded = {**vars(settings), "inputs": [str(f) for f in files]}
    check_output(output, recorded)
    (output / PROGRESS_DIR).mkdir(parents=True, exist_ok=True)
    write_json_atomic(output / PROGRESS_DIR / SETTINGS_FILE, recorded)
    (output / INDEX_FILE).unlink(missing_ok=True)  # rewritten last: until then training refuses the directory

    tasks = [FileTask(i, f, output, settings) for i, f in enumerate(files)]
    workers = min(workers or os.cpu_count() or 1, len(tasks))
    total_bytes = sum(f.stat().st_size for f in files)
    from tqdm import tqdm

    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"prepare ({workers} worker(s))",
               disable=not progress_bar, dynamic_ncols=True)
    records: dict[int, dict] = {}
    if workers == 1:
        num_tokens = [0]

        def report(num_bytes: int, tokens: int) -> None:
            num_tokens[0] += tokens
            bar.update(num_bytes)
            bar.set_postfix(tokens=f"{num_tokens[0]:,}", refresh=False)

        init_worker(tokenizer, report)
        for task in tasks:
            records[task.number] = prepare_file(task)
    else:
        records = _run_pool(tasks, workers, tokenizer, bar)
    bar.close()
    shards = [{k: v for k, v in shard.items() if k != "units_done"}
              for i in range(len(tasks)) for shard in records[i]["shards"]]
    remove_unlisted_shards(output, shards)
    return write_index(output, tokenizer=tokenizer_name, vocab_size=vocab_size, eos_token_id=eos,
                       dtype=settings.dtype, shards=shards, text_field=text_field)


def _run_pool(tasks: list[FileTask], workers: int, tokenizer: Any, bar: Any) -> dict[int, dict]:
    # fork where there is one: workers inherit the imported modules and the loaded tokenizer (not used for
    # encoding before the fork, so no tokenizer thread pool is copied half-way).
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    counters = (ctx.Value("q", 0), ctx.Value("q", 0))
    records: dict[int, dict] = {}
    # Largest files first, so that one big file does not start last and run alone.
    order = sorted(tasks, key=lambda t: -t.path.stat().st_size)
    before = {p.pid for p in multiprocessing.active_children()}
    with ctx.Pool(workers, initializer=_init_pool_worker, initargs=(tokenizer, counters)) as pool:
        # A Pool replaces a worker that dies (killed, out of memory) but loses its task: without this check the
        # run would wait for it forever. Its workers only end when the pool does.
        worker_pids = {p.pid for p in multiprocessing.active_children()} - before
        try:
            results = pool.imap_unordered(_prepare_numbered, order)
            while len(records) < len(tasks):
                if not worker_pids <= {p.pid for p in multiprocessing.active_children()}:
                    raise WorkerDied("a worker process died (killed, or out of memory?); run the same command again "
                                     "to resume")
                try:
                    number, record = results.next(timeout=0.5)
                    records[number] = record
                except multiprocessing.TimeoutError:
                    pass
                bar.update(counters[0].value - bar.n)
                bar.set_postfix(tokens=f"{counters[1].value:,}", refresh=False)
        except BaseException:
            pool.terminate()  # a bad input or Ctrl-C: the other workers stop now, their partial shards are redone
            raise
    return records


def main(argv: Optional[list[str]] = None) -> None:
    """Console script ``fsdp-speedloader-prepare``; also ``python -m fsdp_speedloader.app.prepare``."""
    parser = argparse.ArgumentParser(prog="fsdp-speedloader-prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+",
                        help="files, directories or glob patterns of .txt/.jsonl/.jsonl.gz/.parquet")
    parser.add_argument("--output", "-o", required=True, type=Path, help="the token directory to write (data.path)")
    parser.add_argument("--tokenizer", default="bytes",
                        help="'bytes' or a local Hugging Face tokenizer directory (data.tokenizer); default: bytes")
    parser.add_argument("--text-field", default="text", help="the .jsonl field / .parquet column holding the text")
    parser.add_argument("--workers", type=int, default=0, help="worker processes (default: one per core, at most "
                                                               "one per input file)")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                        help=f"tokens per shard, about (default {DEFAULT_SHARD_TOKENS:,})")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (shown on a terminal only, as training's: FSDP_SPEEDLOADER_PROGRESS=1 "
                             "shows it anyway)")
    args = parser.parse_args(argv)
    if args.workers < 0 or args.shard_tokens < 1:
        parser.exit(2, "error: --workers must be >= 0 and --shard-tokens >= 1\n")

    start = time.perf_counter()
    try:
        # a redirected log gets no bar (its carriage returns would fill it), as a training run's does not
        progress_bar = not args.no_progress and progress_bar_enabled(rank=0)
        index = run(args.inputs, args.output, tokenizer_name=args.tokenizer, text_field=args.text_field,
                    shard_tokens=args.shard_tokens, workers=args.workers, progress_bar=progress_bar)
    except ValueError as e:  # InputError, data.tokenizer errors, a bad FSDP_SPEEDLOADER_PROGRESS: one line, exit 2
        message = str(e)  # the tokenizer's errors name training's key; here the flag is --tokenizer
        if message.startswith("data.tokenizer:"):
            message = "--tokenizer:" + message[len("data.tokenizer:"):]
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)
    except WorkerDied as e:
        print(f"error: {e} ({args.output}/{PROGRESS_DIR} lists what is done)", file=sys.stderr, flush=True)
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"interrupted: run the same command again to resume ({args.output}/{PROGRESS_DIR} lists what is done)",
              file=sys.stderr, flush=True)
        sys.exit(130)
    documents = index["num_documents"]
    print(f"wrote {args.output}: {index['num_tokens']:,} {index['dtype']} tokens, {documents:,} "
          f"document{'' if documents == 1 else 's'}, {len(index['shards'])} shard(s), vocab_size={index['vocab_size']}, in "
          f"{time.perf_counter() - start:.1f} s; train with data=tokens data.path={args.output}")


if __name__ == "__main__":
    main()
