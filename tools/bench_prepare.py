"""Throughput of fsdp-speedloader-prepare per worker process, on THIS CPU (issue 41's targets: at least 1 M tokens/s
per worker with the byte tokenizer, at least 0.2 M tokens/s per worker with a fast Hugging Face tokenizer).

The text is the embedded corpus (fsdp_speedloader/assets, Python's documentation, about 466 KB) cut into documents
at blank lines and repeated to ``--megabytes`` MB per input file. The Hugging Face tokenizer is a byte-level BPE
trained here on that corpus with the `tokenizers` library (``--vocab-size`` tokens), saved as a
PreTrainedTokenizerFast: what `prepare --tokenizer DIR` loads for any local model's tokenizer.

Each row is one whole prepare (`app.prepare.run`: find the inputs, read and parse them, tokenize, write the shards,
the progress records and the index), timed end to end, with ``--workers`` processes; tokens/s per worker is tokens /
seconds / workers. On a shared machine a worker does not get a whole core: tokens per CPU-second (this process's
and its workers' user + system time) is what one worker does with one core to itself. Rows: the byte tokenizer on
each input kind (.jsonl, .jsonl.gz, .parquet, .txt), and the BPE on .jsonl; each with one worker, and with
``--workers`` (default 2) over as many files. The machine's 1-minute load average is recorded with each row: on a
shared machine, compare rows taken together.

Usage:
  python tools/bench_prepare.py                          # writes bench/results/prepare_throughput.json
  python tools/bench_prepare.py --megabytes 64 --workers 4 --out bench/results/prepare_throughput_4w.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

from fsdp_speedloader.app.data import read_default_corpus  # noqa: E402
from fsdp_speedloader.app.prepare import run  # noqa: E402

TARGETS = {"bytes": 1.0e6, "bpe": 0.2e6}  # tokens/s per worker, issue 41


def documents() -> list[str]:
    return [d for d in re.split(r"\n\s*\n", read_default_corpus()) if d.strip()]


def write_inputs(directory: Path, kind: str, num_files: int, megabytes: float) -> list[str]:
    """``num_files`` files of ``kind``, each about ``megabytes`` MB of text."""
    docs = documents()
    per_pass = sum(len(d.encode()) for d in docs)
    passes = max(1, round(megabytes * 1e6 / per_pass))
    directory.mkdir(parents=True)
    paths = []
    for i in range(num_files):
        path = directory / f"part{i}{kind}"
        if kind == ".txt":
            path.write_text("\n\n".join(docs * passes))
        elif kind == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"text": docs * passes}), path)
        else:
            lines = "".join(json.dumps({"text": d}) + "\n" for d in docs) * passes
            if kind == ".jsonl.gz":
                with gzip.open(path, "wt", encoding="utf-8", compresslevel=6) as f:
                    f.write(lines)
            else:
                path.write_text(lines)
        paths.append(str(path))
    return paths


def train_bpe(directory: Path, vocab_size: int) -> str:
    """A byte-level BPE trained on the embedded corpus, saved as a Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documents(), trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(directory)
    return str(directory)


def _cpu_seconds() -> float:
    """CPU time of this process and of its reaped children (the pool's workers, joined when run() returns)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure(root: Path, name: str, tokenizer: str, kind: str, workers: int, megabytes: float) -> dict:
    inputs = write_inputs(root / f"{name}_in", kind, workers, megabytes)
    output = root / f"{name}_out"
    load = os.getloadavg()[0]
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    index = run(inputs, output, tokenizer_name=tokenizer, workers=workers, progress_bar=False)
    seconds, cpu_seconds = time.perf_counter() - start, _cpu_seconds() - cpu_start
    input_bytes = sum(Path(p).stat().st_size for p in inputs)
    shutil.rmtree(output)
    shutil.rmtree(root / f"{name}_in")
    row = {"name": name, "tokenizer": "bytes" if tokenizer == "bytes" else "bpe", "input_kind": kind,
           "workers": workers, "input_bytes": input_bytes, "num_tokens": index["num_tokens"],
           "num_documents": index["num_documents"], "seconds": round(seconds, 3),
           "tokens_per_s": round(index["num_tokens"] / seconds),
           "tokens_per_s_per_worker": round(index["num_tokens"] / seconds / workers),
           "cpu_seconds": round(cpu_seconds, 3), "tokens_per_cpu_second": round(index["num_tokens"] / cpu_seconds),
           "load_average_1min_before": round(load, 2)}
    target = TARGETS[row["tokenizer"]]
    row["target_tokens_per_s_per_worker"], row["meets_target"] = target, row["tokens_per_s_per_worker"] >= target
    print(f"{name:28s} {kind:9s} workers={workers} {index['num_tokens']:>12,} tokens in {seconds:7.2f} s: "
          f"{row['tokens_per_s_per_worker'] / 1e6:6.2f} M tokens/s per worker (target {target / 1e6:.1f} M), "
          f"{row['tokens_per_cpu_second'] / 1e6:6.2f} M tokens per CPU-second",
          flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=float, default=32.0, help="text per input file, MB (byte tokenizer)")
    parser.add_argument("--bpe-megabytes", type=float, default=8.0, help="text per input file, MB (BPE)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="the BPE's vocabulary")
    parser.add_argument("--workers", type=int, default=2, help="workers of the multi-worker rows")
    parser.add_argument("--out", default=str(harness.REPO / "bench/results/prepare_throughput.json"))
    args = parser.parse_args()

    # Each worker is one core: the Rust tokenizer's own threads would make "per worker" mean "per machine".
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_prepare_") as tmp:
        root = Path(tmp)
        bpe = train_bpe(root / "bpe", args.vocab_size)
        for workers in sorted({1, args.workers}):
            for kind in (".jsonl", ".jsonl.gz", ".parquet", ".txt"):
                rows.append(measure(root, f"bytes{kind}_w{workers}", "bytes", kind, workers, args.megabytes))
            rows.append(measure(root, f"bpe.jsonl_w{workers}", bpe, ".jsonl", workers, args.bpe_megabytes))

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), None) if Path("/proc/cpuinfo").is_file() else None
    device = f"{harness.cpu_name()}{f', {model}' if model else ''}, shared with other sessions"
    record = {**harness.record_header("prepare_throughput", __file__, device=device),
              "configuration": {"megabytes_per_file": args.megabytes, "bpe_megabytes_per_file": args.bpe_megabytes,
                                "bpe_vocab_size": args.vocab_size, "workers": args.workers,
                                "corpus": "fsdp_speedloader/assets/default_corpus.txt.gz, cut at blank lines, repeated",
                                "tokenizers_parallelism": False},
              "targets_tokens_per_s_per_worker": TARGETS, "rows": rows}
    print(f"wrote {harness.write_record(args.out, record)}")


if __name__ == "__main__":
    main()
