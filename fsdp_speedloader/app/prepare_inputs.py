"""The inputs of ``fsdp-speedloader-prepare``: finding them, and streaming each one's documents in numbered units
(a .jsonl line, a .parquet row, a piece of a .txt file) with errors that name the file and the line.

A unit's number is what a resume counts: a shard records the number of the last unit it holds, and a rerun
skips that many units of the file (cheaply: skipped lines are not parsed).
"""

from __future__ import annotations

import glob
import gzip
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from fsdp_speedloader.app.jsonl import JsonLineError, json_line_text

SUFFIXES = (".jsonl.gz", ".jsonl", ".parquet", ".txt")
_TXT_PIECE_BYTES = 1 << 20  # a .txt file is read and tokenized in pieces of about this size, cut at line ends


class InputError(ValueError):
    """Bad input: one line naming the file and the line (or row), and what is wrong."""


def input_kind(path: Path) -> Optional[str]:
    return next((s for s in SUFFIXES if path.name.endswith(s)), None)


def find_inputs(patterns: list[str]) -> list[Path]:
    """The input files of ``patterns`` (files, directories searched recursively, globs), each argument's sorted
    by path, duplicates and empty (0-byte) files dropped, a warning naming each of the latter; InputError when one
    names nothing usable, or when every file is empty."""
    files: list[Path] = []
    for pattern in patterns:
        p = Path(pattern)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and input_kind(f))
            if not found:
                raise InputError(f"{pattern}: directory holds no {', '.join(SUFFIXES)} files")
        elif p.is_file():
            if not input_kind(p):
                raise InputError(f"{pattern}: not a {', '.join(SUFFIXES)} file")
            found = [p]
        else:
            matches = (Path(f) for f in glob.glob(pattern, recursive=True))
            found = sorted(f for f in matches if f.is_file() and input_kind(f))
            if not found:
                raise InputError(f"{pattern}: no such file, and as a pattern it matches no {', '.join(SUFFIXES)} files")
        files.extend(found)
    unique = list(dict.fromkeys(f.resolve() for f in files))
    # An empty file holds no documents: one among many (a crawl's empty part) is skipped, not fatal; only a
    # prepare with nothing at all to tokenize is refused.
    empty = [f for f in unique if f.stat().st_size == 0]
    if len(empty) == len(unique):
        named = f"{empty[0]} is" if len(empty) == 1 else f"all {len(empty)} input files ({empty[0]}, ...) are"
        raise InputError(f"{named} empty (0 bytes); nothing to prepare")
    for f in empty:
        print(f"warning: {f}: the file is empty (0 bytes); skipped", file=sys.stderr, flush=True)
    return [f for f in unique if f not in empty]


@dataclass
class Unit:
    number: int  # 1-based: the line of a .jsonl, the row of a .parquet, the piece of a .txt
    text: str
    starts_document: bool
    ends_document: bool


class Reader:
    """Streams the units of one input file after the first ``skip``; ``bytes_read``: how far into the file."""

    def __init__(self, path: Path, text_field: str) -> None:
        self.path, self.text_field, self.kind = path, text_field, input_kind(path)
        self.bytes_read = 0

    def units(self, skip: int) -> Iterator[Unit]:
        read = {".txt": self._txt, ".jsonl": self._jsonl, ".jsonl.gz": self._jsonl, ".parquet": self._parquet}
        yield from read[self.kind](skip)

    def _error(self, where: str, message: str) -> InputError:
        return InputError(f"{self.path}: {where}: {message}")

    def _txt(self, skip: int) -> Iterator[Unit]:
        # One document per file, read in pieces cut at line ends (a newline byte is never inside a UTF-8
        # character, so each piece decodes alone); a piece is held back until the next shows it is not the last.
        held: Optional[Unit] = None
        with open(self.path, "rb") as f:
            number, line = 0, 0
            while lines := f.readlines(_TXT_PIECE_BYTES):
                number += 1
                first_line, line = line + 1, line + len(lines)
                self.bytes_read += sum(map(len, lines))
                if number <= skip:
                    continue
                data = b"".join(lines)
                try:
                    text = data.decode("utf-8")
                except UnicodeDecodeError as e:
                    bad = first_line + data[: e.start].count(b"\n")
                    raise self._error(f"line {bad}", f"not UTF-8 ({e.reason}); re-encode the file as UTF-8") from None
                if held is not None:
                    yield held
                held = Unit(number, text, number == 1, False)
        if held is not None:
            held.ends_document = True
            yield held

    def _jsonl(self, skip: int) -> Iterator[Unit]:
        gz = self.kind == ".jsonl.gz"
        number, documents = 0, 0
        with (gzip.open(self.path, "rb") if gz else open(self.path, "rb")) as f:
            lines = iter(f)
            while True:
                try:
                    raw = next(lines, None)
                except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
                    raise self._error(f"line {number + 1}", f"not a readable gzip file ({e})") from None
                if raw is None:
                    break
                number += 1
                self.bytes_read = f.fileobj.tell() if gz else self.bytes_read + len(raw)
                if number <= skip or not raw.strip():
                    continue
                text = self._json_text(raw, number)
                if text:
                    documents += 1
                    yield Unit(number, text, True, True)
        if skip == 0 and documents == 0:
            raise self._error(f"line {number}", f"no line holds any text in field {self.text_field!r}; "
                                                "remove the file from the inputs")

    def _json_text(self, raw: bytes, number: int) -> str:
        try:
            return json_line_text(raw, self.text_field, field_hint="pass --text-field with the field that holds the "
                                                                    "text")
        except JsonLineError as e:
            raise self._error(f"line {number}", str(e)) from None

    def _parquet(self, skip: int) -> Iterator[Unit]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(self.path)
        except (pa.ArrowException, OSError) as e:
            raise self._error("row 1", f"not a readable parquet file ({e})") from None
        names = pf.schema_arrow.names
        if self.text_field not in names:
            raise self._error("row 1", f"no column {self.text_field!r} (found {names}); "
                                       "pass --text-field with the column that holds the text")
        column_type = pf.schema_arrow.field(self.text_field).type
        binary = pa.types.is_binary(column_type) or pa.types.is_large_binary(column_type)
        if not (binary or pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
            raise self._error("row 1", f"column {self.text_field!r} holds {column_type}, not strings")
        num_rows, size = pf.metadata.num_rows, self.path.stat().st_size
        if num_rows == 0:
            raise self._error("row 1", "the file holds no rows; remove it from the inputs")
        number = 0
        for batch in pf.iter_batches(batch_size=1024, columns=[self.text_field]):
            values = batch.column(0)
            if number + len(values) <= skip:
                number += len(values)
                continue
            for value in values.to_pylist():
                number += 1
                if number <= skip:
                    continue
                if value is None:
                    raise self._error(f"row {number}", f"column {self.text_field!r} is null")
                if binary:
                    try:
                        value = value.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise self._error(f"row {number}", f"not UTF-8 ({e.reason})") from None
                if value:
                    yield Unit(number, value, True, True)
            self.bytes_read = size * number // num_rows
