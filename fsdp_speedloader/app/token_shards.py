"""A token directory: the shards that ``fsdp-speedloader-prepare`` writes and ``data=tokens`` memory-maps.

Layout of ``<dir>/``::

    index.json               written last: training refuses a directory without it
    000000-00000.bin         raw little-endian token ids (``dtype``), every document followed by EOS
    000000-00000.docs.npy    int64 offsets, within that shard, where a document starts (a document may run
                             on into the next shard: a long .txt file is cut into pieces at line ends)
    000001-00000.bin ...     shard names: <input file number>-<part>, in the order of the token stream
    progress/                prepare's resume records (ignored by training)

``index.json``: ``format`` ("fsdp_speedloader.tokens"), ``version`` (1), ``tokenizer`` (its name as given to
prepare), ``vocab_size``, ``eos_token_id``, ``dtype`` ("uint16" or "uint32"), ``num_tokens``, ``num_documents``,
``text_field`` and ``shards``: a list of ``{file, num_tokens, num_documents, document_starts, source}``.

The shards read as one token stream, their concatenation in index order; :class:`TokenDirectory` opens a shard
only when a batch reads from it, keeps a bounded number open and reads only the rows a batch picks, so start-up
time and host memory do not grow with the corpus (only the index, one small entry per shard).
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path
from typing import NoReturn, Optional, Union

import numpy as np

INDEX_FILE = "index.json"
FORMAT = "fsdp_speedloader.tokens"
VERSION = 1
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
"""On-disk dtypes of token files (always little-endian)."""
PREPARE_HINT = ("write it with `fsdp-speedloader-prepare --output DIR INPUTS...` "
                "(python -m fsdp_speedloader.app.prepare)")
_MAX_OPEN_SHARDS = 64

PathLike = Union[str, os.PathLike]


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest on-disk dtype that holds every id of a vocabulary."""
    return TOKEN_DTYPES["uint16"] if vocab_size <= 2**16 else TOKEN_DTYPES["uint32"]


def prepared_tokenizer(path: PathLike) -> Optional[str]:
    """The tokenizer a token directory (its index) or a .bin file (its sidecar) was prepared with, where it loads
    here: 'bytes', or its directory as prepare was given it; else None (a bad index is refused later, by name)."""
    p = Path(path)
    try:
        name = json.loads((p / INDEX_FILE if p.is_dir() else Path(f"{p}.json")).read_text()).get("tokenizer")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) and (name == "bytes" or Path(name).is_dir()) else None


def write_json_atomic(path: Path, obj: dict) -> None:
    """``obj`` as JSON at ``path``, replacing it in one rename: a reader sees the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def write_index(directory: PathLike, *, tokenizer: str, vocab_size: int, eos_token_id: int, dtype: str,
                shards: list[dict], text_field: str = "text") -> dict:
    """Writes ``index.json`` for shards already in ``directory`` (each ``{file, num_tokens, num_documents,
    document_starts, source}``); returns it."""
    index = {"format": FORMAT, "version": VERSION, "tokenizer": tokenizer, "vocab_size": vocab_size,
             "eos_token_id": eos_token_id, "dtype": dtype,
             "num_tokens": sum(s["num_tokens"] for s in shards),
             "num_documents": sum(s["num_documents"] for s in shards), "text_field": text_field, "shards": shards}
    write_json_atomic(Path(directory) / INDEX_FILE, index)
    return index


def read_index(directory: PathLike, *, check_files: bool = True) -> dict:
    """The checked ``index.json`` of a token directory; ``check_files``: every shard is there at its length.
    ValueError (``data.path: ...``) says what is wrong and what to do."""
    d = Path(directory)
    path = d / INDEX_FILE
    if not path.is_file():
        unfinished = (d / "progress").is_dir()
        raise ValueError(f"data.path: {str(d)!r} has no {INDEX_FILE}" + (
            "; its prepare did not finish: run the same prepare command again to resume it" if unfinished
            else f"; it is not a token directory: {PREPARE_HINT}"))
    try:
        index = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"data.path: {str(path)!r} is not valid JSON ({e}); {PREPARE_HINT}") from None
    keys = ("version", "vocab_size", "eos_token_id", "num_tokens", "num_documents")
    ok = (isinstance(index, dict) and index.get("format") == FORMAT and index.get("dtype") in TOKEN_DTYPES
          and all(isinstance(index.get(k), int) and index[k] >= 0 for k in keys)
          and isinstance(index.get("shards"), list))
    if not ok:
        raise ValueError(f"data.path: {str(path)!r} is not a {FORMAT} index (needs format, version, dtype, "
                         f"vocab_size, eos_token_id, num_tokens, num_documents, shards); {PREPARE_HINT}")
    if index["version"] > VERSION:
        raise ValueError(f"data.path: {str(path)!r} has format version {index['version']}, newer than this "
                         f"fsdp_speedloader reads ({VERSION}); upgrade fsdp_speedloader or prepare it again")
    if index["vocab_size"] > 2**16 and index["dtype"] == "uint16":
        raise ValueError(f"data.path: {str(path)!r} claims vocab_size={index['vocab_size']} in uint16; {PREPARE_HINT}")
    if sum(s["num_tokens"] for s in index["shards"]) != index["num_tokens"]:
        raise ValueError(f"data.path: {str(path)!r}: the shards' token counts do not add up to num_tokens; "
                         f"{PREPARE_HINT}")
    if check_files:
        itemsize = TOKEN_DTYPES[index["dtype"]].itemsize
        for shard in index["shards"]:
            f = d / shard["file"]
            size = f.stat().st_size if f.is_file() else None
            if size != shard["num_tokens"] * itemsize:
                found = "is missing" if size is None else f"holds {size} bytes"
                raise ValueError(f"data.path: shard {str(f)!r} {found} but the index promises {shard['num_tokens']} "
                                 f"{index['dtype']} tokens; prepare the directory again (a new --output)")
    return index


class TokenStream:
    """Token files read as one stream, their concatenation; ``len()`` is its token count.

    Rows are read with positioned reads (``os.pread``), not through a memory map: a mapped page counts in the
    process's resident memory once touched (a whole large folio of the page cache at a time, on recent kernels),
    so a map's RSS grows towards the corpus size as batches pick rows all over it, and schedulers that police
    RSS (Slurm) count it. A read leaves the pages in the kernel's page cache, outside the process."""

    ndim = 1

    def __init__(self, files: list[tuple[Path, int]], dtype: np.dtype, vocab_size: Optional[int] = None,
                 vocab_source: str = "its index") -> None:
        files = [(Path(f), n) for f, n in files if n > 0]
        self.dtype = np.dtype(dtype)
        # Every id read is checked against it: an id past the vocabulary (a hand-written shard, another
        # tokenizer's) would fail deep in the model's embedding, or on a GPU as an asynchronous device assert.
        self.vocab_size, self.vocab_source = vocab_size, vocab_source
        self.key = "data.path"  # the setting that named these files, in errors found mid-run (a mixture's entry)
        self._files = [f for f, _ in files]
        self._starts = np.concatenate([[0], np.cumsum([n for _, n in files], dtype=np.int64)])  # (num_files + 1,)
        self._open: collections.OrderedDict[int, int] = collections.OrderedDict()  # file number -> descriptor

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _fd(self, i: int) -> int:
        # A bounded set of open files: a corpus of thousands of shards must not hold thousands of descriptors.
        if i in self._open:
            self._open.move_to_end(i)
            return self._open[i]
        if len(self._open) >= _MAX_OPEN_SHARDS:
            os.close(self._open.popitem(last=False)[1])
        self._open[i] = os.open(self._files[i], os.O_RDONLY)
        return self._open[i]

    def close(self) -> None:
        opened = getattr(self, "_open", {})  # absent when __init__ failed (a bad index)
        while opened:
            os.close(opened.popitem()[1])

    def __del__(self) -> None:
        self.close()

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the stream, across file boundaries: (stop - start,)."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"TokenStream.read: [{start}, {stop}) is outside [0, {len(self)})")
        out = np.empty(stop - start, dtype=self.dtype)
        i, done = int(np.searchsorted(self._starts, start, side="right")) - 1, 0
        while start < stop:
            end = min(stop, int(self._starts[i + 1]))
            offset = (start - int(self._starts[i])) * self.dtype.itemsize
            data = os.pread(self._fd(i), (end - start) * self.dtype.itemsize, offset)
            if len(data) != (end - start) * self.dtype.itemsize:
                self._error(f"{str(self._files[i])!r} ended early (read {len(data)} bytes at {offset}); it changed "
                            "after its index was written: prepare it again")
            piece = np.frombuffer(data, dtype=self.dtype)
            if self.vocab_size is not None and len(piece) and (largest := int(piece.max())) >= self.vocab_size:
                self._id_error(i, largest)
            out[done : done + end - start] = piece
            start, i, done = end, i + 1, done + end - start
        return out

    def _id_error(self, i: int, largest: int) -> NoReturn:
        self._error(f"token file {str(self._files[i])!r} holds id {largest} (the largest read) >= "
                    f"vocab_size={self.vocab_size} of {self.vocab_source}; it was written with another tokenizer or "
                    "by hand: prepare it again")

    def _error(self, message: str) -> NoReturn:
        from fsdp_speedloader.app.launch import UserError  # a ValueError the training loop prints as one line

        raise UserError(f"{self.key}: {message}")

    def sequences(self, seq_len: int) -> "PackedSequences":
        return PackedSequences(self, seq_len)

    def head(self, num_tokens: int) -> "TokenStream":
        """The stream's first ``num_tokens`` tokens, as a stream over the same files (nothing is read)."""
        if not 0 <= num_tokens <= len(self):
            raise IndexError(f"TokenStream.head: {num_tokens} is outside [0, {len(self)}]")
        files = [(f, int(min(end, num_tokens) - start)) for f, start, end in
                 zip(self._files, self._starts[:-1], self._starts[1:]) if start < num_tokens]
        head = TokenStream(files, self.dtype, self.vocab_size, self.vocab_source)
        head.key = self.key
        return head


class TokenDirectory(TokenStream):
    """The token stream of a token directory (its shards in index order), and its document boundaries."""

    def __init__(self, directory: PathLike) -> None:
        self.directory = Path(directory)
        self.index = read_index(self.directory)
        shards = [s for s in self.index["shards"] if s["num_tokens"] > 0]
        super().__init__([(self.directory / s["file"], s["num_tokens"]) for s in shards],
                         TOKEN_DTYPES[self.index["dtype"]], self.index["vocab_size"], "its index")
        self._doc_files = [self.directory / s["document_starts"] for s in shards]

    def document_starts(self, start: int, stop: int) -> np.ndarray:
        """Stream offsets in ``[start, stop)`` where a document starts (int64, sorted), from the shards'
        ``.docs.npy`` files."""
        found = []
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        last = int(np.searchsorted(self._starts, max(start, stop - 1), side="right")) - 1
        for i in range(max(first, 0), min(last, len(self._doc_files) - 1) + 1):
            offset = int(self._starts[i])
            starts = np.load(self._doc_files[i], mmap_mode="r")  # (num_documents,), dropped after the lookup
            lo, hi = np.searchsorted(starts, [start - offset, stop - offset])
            found.append(np.asarray(starts[lo:hi], dtype=np.int64) + offset)
        return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)


class PackedSequences:
    """The stream cut into ``len(stream) // seq_len`` sequences (tail dropped); ``seqs[ids]`` -> (len(ids), s),
    like a (num_sequences, seq_len) view of an in-memory array."""

    def __init__(self, stream: TokenStream, seq_len: int) -> None:
        self.stream, self.seq_len = stream, seq_len
        self.shape = (len(stream) // seq_len, seq_len)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, ids) -> np.ndarray:
        ids = np.atleast_1d(np.asarray(ids, dtype=np.int64))
        out = np.empty((len(ids), self.seq_len), dtype=self.stream.dtype)  # (b, s)
        for row, i in enumerate(ids.tolist()):
            out[row] = self.stream.read(i * self.seq_len, (i + 1) * self.seq_len)
        return out
